// Decode attention over the paged KV cache for the compiled decode step: one query token per sequence, keys and
// values read in place by block table (no gathered copy), softmax and weighted sum in fp32.
//
// Why native: the same computation as plain tensor ops (engine/attention.py, `decode_attention`'s torch path, which
// is this op's reference) compiles into one Inductor kernel with a dozen parallel loops over a dynamic batch and
// width, and at batch 1 its fork/join barriers, not its arithmetic, were most of its time. Here one parallel region
// splits the (sequence, kv head) pairs, and each pair runs its G = heads / kv_heads queries in one pass over its keys
// and one over its values. The decode step it is part of: reports/decode-quantized.md and reports/decode-kv.md.
//
// The cache write stays a torch scatter before this op (the graph's in-place update of the cache input), so this op
// only reads. The packed step input is engine/attention.py's: [B, 4 + W] int64 with the context length in column 3
// (the new token included) and the block table from column 4.
#include "common.h"

namespace glowplug {
namespace {

constexpr int64_t kDecodeCols = 4, kContextCol = 3;  // engine/attention.py: DECODE_COLS, CONTEXT

#if defined(__AVX512F__)  // the Python side enables this op only on AVX512 CPUs (kernels.native.attention_supported)
// e^x for x <= 0 (scores minus their maximum), within ~2 ulp: x = n ln2 + r with |r| <= ln2 / 2, a degree-6 Taylor
// polynomial for e^r, and vscalefps for the 2^n (which flushes to 0 below the fp32 range, as expf does).
inline __m512 exp_nonpos(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// Element i of a cache row (bf16, fp32 or int8 times its scale) as fp32, D values into dst (D % 16 == 0).
inline void row_f32(const void* base, ScalarType st, int64_t offset, float scale, int64_t D, float* dst) {
  if (st == ScalarType::Float) {
    std::memcpy(dst, static_cast<const float*>(base) + offset, static_cast<size_t>(D) * 4);
  } else if (st == ScalarType::BFloat16) {
    const uint16_t* p = static_cast<const uint16_t*>(base) + offset;
    for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(dst + d, load_bf16x16(p + d));
  } else {  // int8 with one fp32 scale per (token, head): kernels/formats.dequantize_kv
    const int8_t* p = static_cast<const int8_t*>(base) + offset;
    const __m512 s = _mm512_set1_ps(scale);
    for (int64_t d = 0; d < D; d += 16) {
      const __m512i w = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + d)));
      _mm512_storeu_ps(dst + d, _mm512_mul_ps(_mm512_cvtepi32_ps(w), s));
    }
  }
}

// Rows t0..t0 + 15 of a cache tensor (k or v, with its scales for int8) as fp32 into tile [16, D]; a row past the
// context's end, or in a block the engine never sends (cell -1), is zeros and is never read from the cache.
inline void load_tile(const void* base, const float* scales, ScalarType st, const int64_t* cells, int64_t t0,
                      int64_t n, int64_t D, float* tile) {
  for (int64_t i = 0; i < 16; ++i) {
    const int64_t cell = i < n ? cells[t0 + i] : -1;
    if (cell < 0)
      std::fill_n(tile + i * D, D, 0.f);
    else
      row_f32(base, st, cell * D, scales ? scales[cell] : 1.f, D, tile + i * D);
  }
}

inline __m512 dot_lanes(const float* a, const float* b, int64_t D) {  // 16 partial sums of a . b
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
  return acc;
}

// Element i of the result = the sum of v[i]'s 16 lanes: 16 horizontal sums in 45 shuffles and adds, where a
// reduce_add per sum is about 10 dependent steps each.
inline __m512 hsum16(__m512 (&v)[16]) {
  __m512 w[8], u[4], z[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: that lane's sums of v[4i..4i+3]
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * i], w[2 * i + 1], 0x44), _mm512_shuffle_ps(w[2 * i], w[2 * i + 1], 0xEE));
  for (int i = 0; i < 2; ++i)  // lanes pairwise: [u0 (L0+L1), u0 (L2+L3), u1 (L0+L1), u1 (L2+L3)]
    z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88), _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], 0x88), _mm512_shuffle_f32x4(z[0], z[1], 0xDD));
}

void check_cache(const Tensor& c, const char* what, int64_t D) {
  STD_TORCH_CHECK(c.dim() == 4 && c.is_contiguous() && c.size(3) == D, "decode_attention: ", what,
                  " must be a contiguous [blocks, block_size, kv_heads, ", D, "] tensor");
}

// Everything one (sequence, kv head) task reads, fixed for the call.
struct Job {
  const int64_t* pk;
  int64_t cols, W, B, H, D, G, HKV, NBLK, BS;
  const void *qp, *kp, *vp;
  const float *ksp, *vsp;
  ScalarType st;
  bool out_bf16;
  float fscale;
  void* yp;
};

// Tasks [t0, t1) of a call. DC = head_dim / 16 when it is 4 or 8 (64 and 128, compile-time so the row loops
// unroll: with a run-time head_dim their loop control led the op's profile), else 0 (any multiple of 16).
template <int DC>
void attend_tasks(const Job& j, int64_t t0, int64_t t1) {
  const int64_t D = DC > 0 ? DC * 16 : j.D;
  const int64_t G = j.G, HKV = j.HKV, H = j.H, W = j.W, BS = j.BS, NBLK = j.NBLK, cols = j.cols;
  const int64_t* pk = j.pk;
  const void *qp = j.qp, *kp = j.kp, *vp = j.vp;
  const float *ksp = j.ksp, *vsp = j.vsp;
  const ScalarType st = j.st;
  const bool out_bf16 = j.out_bf16;
  const float fscale = j.fscale;
  void* yp = j.yp;
  std::vector<float> qf(static_cast<size_t>(G * D)), acc(static_cast<size_t>(G * D));
  std::vector<float> probs, tile(static_cast<size_t>(16 * D));
  std::vector<int64_t> cells;
  std::vector<__m512> top;
#if defined(__AVX512BF16__)
  const bool bf16_pairs = st == ScalarType::BFloat16 && out_bf16 && D % 32 == 0;
#else
  const bool bf16_pairs = false;
#endif
  const std::vector<uint16_t> zeros(bf16_pairs ? static_cast<size_t>(D) : 0, 0);
  for (int64_t task = t0; task < t1; ++task) {
    const int64_t b = task / HKV, h = task % HKV;
    const int64_t* in = pk + b * cols;
    // A row past its table's capacity, or a padding row (length 0), attends to nothing.
    const int64_t len = std::min<int64_t>(std::max<int64_t>(in[kContextCol], 0), W * BS);
    const int64_t q0 = (b * H + h * G) * D;  // the task's G query heads, and their outputs, are contiguous
    if (!bf16_pairs)  // the bf16 path reads the query as it is
      for (int64_t i = 0; i < G * D; i += 16)
        _mm512_storeu_ps(qf.data() + i, out_bf16 ? load_bf16x16(static_cast<const uint16_t*>(qp) + q0 + i)
                                                 : _mm512_loadu_ps(static_cast<const float*>(qp) + q0 + i));
    std::fill(acc.begin(), acc.end(), 0.f);
    probs.resize(static_cast<size_t>(G * len));  // every entry is written below
    // Each position's (token, head) cell in the cache, or -1 for a block the engine never sends (never read
    // outside the cache), walked block by block once so both passes index a flat list.
    cells.resize(static_cast<size_t>(len));
    for (int64_t j = 0, t = 0; t < len; ++j) {
      const int64_t blk = in[kDecodeCols + j];
      const bool ok = blk >= 0 && blk < NBLK;
      for (int64_t o = 0; o < BS && t < len; ++o, ++t) cells[t] = ok ? (blk * BS + o) * HKV + h : -1;
    }
    // Scores, 16 keys at a time: per query head 16 dot products at once, over the keys as fp32 rows (a tile
    // converted once for all G heads) or, for a bf16 cache, over the cache rows themselves.
    const __m512 vscale = _mm512_set1_ps(fscale);
    // Each head's running maximum score, kept in vectors as the scores are made: a scalar pass over the stored
    // scores waited on the masked stores before it (no store forwarding) and led the op's profile at batch 16.
    top.assign(static_cast<size_t>(G), _mm512_set1_ps(-INFINITY));
    for (int64_t t0 = 0; t0 < len; t0 += 16) {
      const int64_t n = std::min<int64_t>(16, len - t0);
      const __mmask16 live = n >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << n) - 1);
      if (bf16_pairs) {
        // bf16 keys and query: vdpbf16ps multiplies the cache rows in place, in pairs (bf16 products are exact in
        // fp32, summed in fp32 as the fp32 path does); a row the context does not reach reads zeros.
        const uint16_t* rows[16];
        for (int i = 0; i < 16; ++i) {
          const int64_t cell = i < n ? cells[t0 + i] : -1;
          rows[i] = cell < 0 ? zeros.data() : static_cast<const uint16_t*>(kp) + cell * D;
        }
        for (int64_t g = 0; g < G; ++g) {
          const uint16_t* qg = static_cast<const uint16_t*>(qp) + q0 + g * D;
          __m512 parts[16];
          for (int i = 0; i < 16; ++i) {
            __m512 a = _mm512_setzero_ps();
            for (int64_t d = 0; d < D; d += 32)
              a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(rows[i] + d), (__m512bh)_mm512_loadu_si512(qg + d));
            parts[i] = a;
          }
          const __m512 sc = _mm512_mul_ps(hsum16(parts), vscale);
          _mm512_mask_storeu_ps(probs.data() + g * len + t0, live, sc);
          top[g] = _mm512_mask_max_ps(top[g], live, top[g], sc);
        }
        continue;
      }
      load_tile(kp, ksp, st, cells.data(), t0, n, D, tile.data());
      for (int64_t g = 0; g < G; ++g) {
        __m512 parts[16];
        for (int i = 0; i < 16; ++i) parts[i] = dot_lanes(qf.data() + g * D, tile.data() + i * D, D);
        // dot then scale, as the torch path does (sum first, then * scale)
        const __m512 sc = _mm512_mul_ps(hsum16(parts), vscale);
        _mm512_mask_storeu_ps(probs.data() + g * len + t0, live, sc);
        top[g] = _mm512_mask_max_ps(top[g], live, top[g], sc);
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      float* p = probs.data() + g * len;
      const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(top[g]));
      __m512 sum = _mm512_setzero_ps();
      int64_t t = 0;
      for (; t + 16 <= len; t += 16) {
        const __m512 e = exp_nonpos(_mm512_sub_ps(_mm512_loadu_ps(p + t), mx));
        _mm512_storeu_ps(p + t, e);
        sum = _mm512_add_ps(sum, e);
      }
      if (t < len) {
        const __mmask16 m = static_cast<__mmask16>((1u << (len - t)) - 1);
        const __m512 e = _mm512_maskz_mov_ps(m, exp_nonpos(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, p + t), mx)));
        _mm512_mask_storeu_ps(p + t, m, e);
        sum = _mm512_add_ps(sum, e);
      }
      const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum));
      for (t = 0; t + 16 <= len; t += 16) _mm512_storeu_ps(p + t, _mm512_mul_ps(_mm512_loadu_ps(p + t), inv));
      if (t < len) {
        const __mmask16 m = static_cast<__mmask16>((1u << (len - t)) - 1);
        _mm512_mask_storeu_ps(p + t, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, p + t), inv));
      }
    }
    // Weighted values, 16 at a time: the tile's rows as fp32, then each accumulator chunk read and written once
    // per tile (updating it in memory per value stalled on store forwarding).
    for (int64_t t0 = 0; t0 < len; t0 += 16) {
      const int64_t n = std::min<int64_t>(16, len - t0);
      load_tile(vp, vsp, st, cells.data(), t0, n, D, tile.data());
      for (int64_t g = 0; g < G; ++g) {
        const float* pg = probs.data() + g * len + t0;
        if constexpr (DC > 0) {  // all of the head's chunks at once: DC independent FMA chains, not one at a time
          __m512 a[DC];
          for (int c = 0; c < DC; ++c) a[c] = _mm512_loadu_ps(acc.data() + g * D + c * 16);
          for (int64_t i = 0; i < n; ++i) {
            const __m512 pi = _mm512_set1_ps(pg[i]);
            for (int c = 0; c < DC; ++c) a[c] = _mm512_fmadd_ps(pi, _mm512_loadu_ps(tile.data() + i * D + c * 16), a[c]);
          }
          for (int c = 0; c < DC; ++c) _mm512_storeu_ps(acc.data() + g * D + c * 16, a[c]);
          continue;
        }
        for (int64_t d = 0; d < D; d += 16) {
          __m512 a = _mm512_loadu_ps(acc.data() + g * D + d);
          for (int64_t i = 0; i < n; ++i)
            a = _mm512_fmadd_ps(_mm512_set1_ps(pg[i]), _mm512_loadu_ps(tile.data() + i * D + d), a);
          _mm512_storeu_ps(acc.data() + g * D + d, a);
        }
      }
    }
    for (int64_t i = 0; i < G * D; i += 16) {  // round to nearest even, as f32_to_bf16 and torch do
      const __m512 v = _mm512_loadu_ps(acc.data() + i);
      if (!out_bf16) {
        _mm512_storeu_ps(static_cast<float*>(yp) + q0 + i, v);
        continue;
      }
      uint16_t* y = static_cast<uint16_t*>(yp) + q0 + i;
#if defined(__AVX512BF16__)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), (__m256i)_mm512_cvtneps_pbh(v));
#else
      for (int e = 0; e < 16; ++e) y[e] = f32_to_bf16(acc[i + e]);
#endif
    }
  }
}

Tensor attend(const Tensor& q, const Tensor& kc, const Tensor& vc, const Tensor* ks, const Tensor* vs,
              const Tensor& packed, double scale) {
  STD_TORCH_CHECK(q.dim() == 3 && q.is_contiguous() &&
                      (q.scalar_type() == ScalarType::BFloat16 || q.scalar_type() == ScalarType::Float),
                  "decode_attention: q must be a contiguous bfloat16 or float32 [B, heads, head_dim] tensor");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  STD_TORCH_CHECK(D % 16 == 0, "decode_attention: head_dim ", D, " is not a multiple of 16");
  check_cache(kc, "k_cache", D);
  check_cache(vc, "v_cache", D);
  const int64_t NBLK = kc.size(0), BS = kc.size(1), HKV = kc.size(2);
  STD_TORCH_CHECK(vc.size(0) == NBLK && vc.size(1) == BS && vc.size(2) == HKV && vc.scalar_type() == kc.scalar_type(),
                  "decode_attention: k_cache and v_cache differ in shape or dtype");
  STD_TORCH_CHECK(H % HKV == 0, "decode_attention: ", H, " query heads do not divide into ", HKV, " kv heads");
  const ScalarType st = kc.scalar_type();
  if (ks != nullptr) {
    STD_TORCH_CHECK(st == ScalarType::Char, "decode_attention_int8: the cache must be int8");
    for (const Tensor* s : {ks, vs})
      STD_TORCH_CHECK(s->dim() == 3 && s->is_contiguous() && s->scalar_type() == ScalarType::Float &&
                          s->size(0) == NBLK && s->size(1) == BS && s->size(2) == HKV,
                      "decode_attention_int8: scales must be contiguous float32 [blocks, block_size, kv_heads]");
  } else {
    STD_TORCH_CHECK(st == ScalarType::BFloat16 || st == ScalarType::Float,
                    "decode_attention: the cache must be bfloat16 or float32 (int8: decode_attention_int8)");
  }
  STD_TORCH_CHECK(packed.dim() == 2 && packed.is_contiguous() && packed.scalar_type() == ScalarType::Long &&
                      packed.size(0) == B && packed.size(1) > kDecodeCols,
                  "decode_attention: packed must be the contiguous int64 [B, 4 + W] decode step input");
  const int64_t cols = packed.size(1), W = cols - kDecodeCols, G = H / HKV;
  const int64_t* pk = static_cast<const int64_t*>(packed.const_data_ptr());
  const float* ksp = ks ? static_cast<const float*>(ks->const_data_ptr()) : nullptr;
  const float* vsp = vs ? static_cast<const float*>(vs->const_data_ptr()) : nullptr;
  Tensor y = torch::stable::new_empty(q, {B, H, D});
  const Job job{pk, cols, W, B, H, D, G, HKV, NBLK, BS, q.const_data_ptr(), kc.const_data_ptr(), vc.const_data_ptr(),
                ksp, vsp, st, q.scalar_type() == ScalarType::BFloat16, static_cast<float>(scale), y.mutable_data_ptr()};
  torch::stable::parallel_for(0, B * HKV, 1, [&](int64_t t0, int64_t t1) {
    if (D == 64)
      attend_tasks<4>(job, t0, t1);
    else if (D == 128)
      attend_tasks<8>(job, t0, t1);
    else
      attend_tasks<0>(job, t0, t1);
  });
  return y;
}

#else

Tensor attend(const Tensor&, const Tensor&, const Tensor&, const Tensor*, const Tensor*, const Tensor&, double) {
  STD_TORCH_CHECK(false, "decode_attention: this CPU has no AVX512; the engine uses the torch path instead");
  return Tensor();
}

#endif

Tensor decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor packed, double scale) {
  return attend(q, k_cache, v_cache, nullptr, nullptr, packed, scale);
}

Tensor decode_attention_int8(Tensor q, Tensor k_cache, Tensor v_cache, Tensor k_scale, Tensor v_scale, Tensor packed,
                             double scale) {
  return attend(q, k_cache, v_cache, &k_scale, &v_scale, packed, scale);
}

}  // namespace
}  // namespace glowplug

STABLE_TORCH_LIBRARY_FRAGMENT(glowplug_native, m) {
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor packed, float scale) -> Tensor");
  m.def("decode_attention_int8(Tensor q, Tensor k_cache, Tensor v_cache, Tensor k_scale, Tensor v_scale, "
        "Tensor packed, float scale) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(glowplug_native, CPU, m) {
  m.impl("decode_attention", TORCH_BOX(&glowplug::decode_attention));
  m.impl("decode_attention_int8", TORCH_BOX(&glowplug::decode_attention_int8));
}
