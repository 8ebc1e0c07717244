// N-blocked decode kernels for bf16 activations (AVX512-BF16): dense bf16, int4/int2 and int8 weights.
//
// Layout (built by kernels/native.py `pack_blocked`, a reference in kernels/reference.py): the weight rows are taken 16
// at a time (an N-block; N padded with zero rows), and each block is one contiguous stream:
//   codes   chunks of 64 bytes = 32 16-bit words; word w = 2j + e belongs to row j of the block and holds several
//           codes of that row, each in its own bit-plane p: plane p of word 2j + e is the row's code at
//           k = k0 + 2p + e. So bit-plane p of all 32 words is 16 lanes of (k, k+1) pairs: exactly the operand
//           vdpbf16ps multiplies with a broadcast activation pair (x[k], x[k+1]). No shuffles, no activation
//           permutation, and 16 outputs per accumulator (no horizontal sums).
//   scales  per group, the 16 rows' scales (fp16 for int4/int2, fp32 for int8), then for int4/int2 the 16 mins.
// Codes become bf16 without a conversion: with the exponent of 128 OR-ed in, the bits (0x4300 | q) are exactly the
// bf16 number 128 + q (q < 128), so the dot product is sum (128 + q) x = 128 * sum(x) + sum(q x), and the 128 * xsum
// term is taken back with the group's activation sum. int8 codes (offset to 0..255) are split into two nibble planes,
// low and high, with the high half scaled by 16.
//
// Batches: a chunk's planes are decoded once and used for every activation row of the block (up to 8 at a time), so
// the step's cost grows with the batch only by the multiply-adds, which is what keeps a batch-16 step near the
// batch-1 one.
#include "common.h"

namespace glowplug {
namespace {

// Software prefetch, this many bytes ahead in the weight stream. The packed formats do several operations per cache
// line, and at that pace the hardware prefetcher fell behind: the int4 kernel stalled on its weight loads (8.6 GB/s
// single-threaded without prefetch, 15.7 at 4 KiB ahead; two threads 15 -> 26 GB/s). Distances measured on the
// 2-core EPYC: 3-6 KiB for the packed formats, 2 KiB for dense bf16. On the 2-core Intel Xeon (a whole decode step's
// GEMVs, distinct weights, batch 1) int4 took 5.85 / 5.10 / 4.76 / 4.93 ms at 2 / 4 / 8 / 16 KiB ahead and dense
// bf16 did not move; 8 KiB suits both machines' packed kernels.
template <int DIST>
inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p) + DIST, _MM_HINT_T0); }
constexpr int kPackedAhead = 8192, kDenseAhead = 2048;

#if defined(__AVX512BF16__)

inline __m512i bcast_pair(const uint16_t* x) {  // (x[k], x[k+1]) in every 32-bit lane
  uint32_t v;
  std::memcpy(&v, x, 4);
  return _mm512_set1_epi32(static_cast<int32_t>(v));
}

inline __m512 dp(__m512 acc, __m512i w, __m512i x) {
  return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x);
}

// Store 16 outputs (rows n0..n0+15 of row m) into y, clipped to N.
inline void store16(const OutWriter& out, int64_t m, int64_t n0, int64_t N, __m512 v) {
  const int64_t left = N - n0;
  const __mmask16 mask = left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
  if (out.bf16) {
    uint16_t* dst = static_cast<uint16_t*>(out.base) + m * out.ld + n0;
    _mm256_mask_storeu_epi16(dst, mask, (__m256i)_mm512_cvtneps_pbh(v));
  } else {
    _mm512_mask_storeu_ps(static_cast<float*>(out.base) + m * out.ld + n0, mask, v);
  }
}

// ------------------------------------------------------------------------------------------------- dense bf16
// A block is [K / 2, 16, 2] bf16: pair p of row j at word 2j, 2j + 1 of chunk p (one bit-plane of 16 bits).
template <int MB>
void dense_block(const uint16_t* wb, int64_t K, const uint16_t* x, int64_t m0, int64_t nb, int64_t N,
                 const OutWriter& out) {
  __m512 a0[MB], a1[MB];
  _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
  const int64_t pairs = K / 2;
  int64_t p = 0;
  for (; p + 2 <= pairs; p += 2) {
    prefetch<kDenseAhead>(wb + p * 32);
    prefetch<kDenseAhead>(wb + p * 32 + 32);
    const __m512i w0 = _mm512_loadu_si512(wb + p * 32), w1 = _mm512_loadu_si512(wb + p * 32 + 32);
    _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) {
      const uint16_t* xr = x + (m0 + m) * K + 2 * p;
      a0[m] = dp(a0[m], w0, bcast_pair(xr));
      a1[m] = dp(a1[m], w1, bcast_pair(xr + 2));
    }
  }
  if (p < pairs) {
    const __m512i w0 = _mm512_loadu_si512(wb + p * 32);
    _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) a0[m] = dp(a0[m], w0, bcast_pair(x + (m0 + m) * K + 2 * p));
  }
  _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) store16(out, m0 + m, nb * 16, N, _mm512_add_ps(a0[m], a1[m]));
}

// ---------------------------------------------------------------------------------------------- int4 / int2
// A block is [K / KC chunks of 64 bytes][G x 16 fp16 scales][G x 16 fp16 mins], KC = 8 (int4) or 16 (int2) codes of
// each row per chunk; w = q * scale + min.
template <int BITS, int MB, int NA>
void intn_block(const uint8_t* blk, int64_t K, int64_t gs, const uint16_t* x, const float* xsum, int64_t m0,
                int64_t nb, int64_t N, const OutWriter& out) {
  constexpr int PLANES = 16 / BITS, KC = 2 * PLANES;
  const int64_t G = K / gs, chunks_per_group = gs / KC;
  const uint16_t* scales = reinterpret_cast<const uint16_t*>(blk + K * BITS * 2);
  const uint16_t* mins = scales + G * 16;
  const __m512i mask = _mm512_set1_epi16((1 << BITS) - 1);
  const __m512i expo = _mm512_set1_epi16(0x4300);
  const __m512 c128 = _mm512_set1_ps(128.f);
  __m512 tot[MB];
  _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) tot[m] = _mm512_setzero_ps();
  const uint8_t* chunk = blk;
  for (int64_t g = 0; g < G; ++g) {
    __m512 acc[MB][NA];
    _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) _Pragma("GCC unroll 4") for (int a = 0; a < NA; ++a)
      acc[m][a] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks_per_group; ++c, chunk += 64) {
      prefetch<kPackedAhead>(chunk);
      const __m512i v = _mm512_loadu_si512(chunk);
      const int64_t k0 = (g * chunks_per_group + c) * KC;
      _Pragma("GCC unroll 16") for (int p = 0; p < PLANES; ++p) {
        const __m512i sh = p == 0 ? v : _mm512_srli_epi16(v, BITS * p);
        // (sh & mask) | expo in one ternary-logic op; the top plane has no higher bits to clear
        const __m512i w = p == PLANES - 1 ? _mm512_or_si512(sh, expo) : _mm512_ternarylogic_epi32(sh, mask, expo, 0xEA);
        _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m)
          acc[m][p % NA] = dp(acc[m][p % NA], w, bcast_pair(x + (m0 + m) * K + k0 + 2 * p));
      }
    }
    const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + g * 16)));
    const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mins + g * 16)));
    const __m512 adj = _mm512_fnmadd_ps(c128, s, mn);  // min - 128 * scale: takes the 128 offset back
    _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) {
      __m512 a = acc[m][0];
      _Pragma("GCC unroll 4") for (int i = 1; i < NA; ++i) a = _mm512_add_ps(a, acc[m][i]);
      tot[m] = _mm512_fmadd_ps(a, s, tot[m]);
      tot[m] = _mm512_fmadd_ps(adj, _mm512_set1_ps(xsum[(m0 + m) * G + g]), tot[m]);
    }
  }
  _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) store16(out, m0 + m, nb * 16, N, tot[m]);
}

// -------------------------------------------------------------------------------------------------------- int8
// A block is [K / 4 chunks of 64 bytes][G x 16 fp32 scales]; word 2j + e of a chunk holds row j's codes (offset by
// 128) at k0 + e (low byte) and k0 + 2 + e (high byte). Each byte is split into its low and high nibble planes:
// sum (q + 128) x = sum lo x + 16 sum hi x, and with the 128-exponent trick on both, sum q x = dp_lo + 16 dp_hi -
// 2304 sum x (2304 = 128 * 17 + 128).
// One 64-byte chunk of an int8 block into accumulator `a` of every activation row (xr: row m0's codes' k0).
template <int MB, int NA>
__attribute__((always_inline)) inline void int8_chunk(const uint8_t* chunk, const uint16_t* xr, int64_t K, __m512i mask, __m512i expo,
                       __m512 (&lo)[MB][NA], __m512 (&hi)[MB][NA], int a) {
  prefetch<kPackedAhead>(chunk);
  const __m512i v = _mm512_loadu_si512(chunk);
  const __m512i p0 = _mm512_ternarylogic_epi32(v, mask, expo, 0xEA);
  const __m512i p1 = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), mask, expo, 0xEA);
  const __m512i p2 = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 8), mask, expo, 0xEA);
  const __m512i p3 = _mm512_or_si512(_mm512_srli_epi16(v, 12), expo);
  _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) {
    const __m512i x01 = bcast_pair(xr + m * K), x23 = bcast_pair(xr + m * K + 2);
    lo[m][a] = dp(dp(lo[m][a], p0, x01), p2, x23);
    hi[m][a] = dp(dp(hi[m][a], p1, x01), p3, x23);
  }
}

template <int MB, int NA>
void int8_block(const uint8_t* blk, int64_t K, int64_t gs, const uint16_t* x, const float* xsum, int64_t m0,
                int64_t nb, int64_t N, const OutWriter& out) {
  const int64_t G = K / gs, chunks_per_group = gs / 4;
  const float* scales = reinterpret_cast<const float*>(blk + K * 16);
  const __m512i mask = _mm512_set1_epi16(15);
  const __m512i expo = _mm512_set1_epi16(0x4300);
  __m512 tot[MB];
  _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) tot[m] = _mm512_setzero_ps();
  const uint8_t* chunk = blk;
  for (int64_t g = 0; g < G; ++g) {
    __m512 lo[MB][NA], hi[MB][NA];
    _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) _Pragma("GCC unroll 4") for (int a = 0; a < NA; ++a)
      lo[m][a] = hi[m][a] = _mm512_setzero_ps();
    // NA chunks per iteration, chunk a into accumulator a: the accumulator index must be a compile-time constant,
    // or the arrays live on the stack and every multiply-add waits on a store and a reload (Zen 5 forwards such
    // stores fast enough to hide it; an Intel Xeon did not). Speed per shape: reports/kernels.md.
    int64_t c = 0;
    for (; c + NA <= chunks_per_group; c += NA, chunk += 64 * NA) {
      _Pragma("GCC unroll 4") for (int a = 0; a < NA; ++a) int8_chunk<MB, NA>(chunk + 64 * a,
          x + m0 * K + (g * chunks_per_group + c + a) * 4, K, mask, expo, lo, hi, a);
    }
    for (; c < chunks_per_group; ++c, chunk += 64)
      int8_chunk<MB, NA>(chunk, x + m0 * K + (g * chunks_per_group + c) * 4, K, mask, expo, lo, hi, 0);
    const __m512 s = _mm512_loadu_ps(scales + g * 16);
    const __m512 adj = _mm512_mul_ps(_mm512_set1_ps(-2304.f), s);
    _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) {
      __m512 l = lo[m][0], h = hi[m][0];
      _Pragma("GCC unroll 4") for (int i = 1; i < NA; ++i) {
        l = _mm512_add_ps(l, lo[m][i]);
        h = _mm512_add_ps(h, hi[m][i]);
      }
      tot[m] = _mm512_fmadd_ps(_mm512_fmadd_ps(h, _mm512_set1_ps(16.f), l), s, tot[m]);
      tot[m] = _mm512_fmadd_ps(adj, _mm512_set1_ps(xsum[(m0 + m) * G + g]), tot[m]);
    }
  }
  _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) store16(out, m0 + m, nb * 16, N, tot[m]);
}

// Activation sums per (row, group), the correction every packed kernel needs.
std::vector<float> group_sums(const uint16_t* x, int64_t M, int64_t K, int64_t gs) {
  const int64_t G = K / gs;
  std::vector<float> out(static_cast<size_t>(M * G));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      __m512 a = _mm512_setzero_ps();
      int64_t k = 0;
      const uint16_t* p = x + m * K + g * gs;
      for (; k + 16 <= gs; k += 16) a = _mm512_add_ps(a, load_bf16x16(p + k));
      float s = _mm512_reduce_add_ps(a);
      for (; k < gs; ++k) s += bf16_to_f32(p[k]);
      out[m * G + g] = s;
    }
  return out;
}

// Run `block(mb, m0, nb)` over every N-block in parallel and over the rows in blocks of up to 8 (4 when NA > 1).
template <class F>
void for_blocks(int64_t M, int64_t NB, const F& block) {
  torch::stable::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb)
      for (int64_t m0 = 0; m0 < M; m0 += 8) block(std::min<int64_t>(8, M - m0), m0, nb);
  });
}

void check_blocked(const Tensor& x, const Tensor& wp, int64_t N, int64_t K, int64_t block_bytes, const char* op) {
  STD_TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) == K && x.scalar_type() == ScalarType::BFloat16, op,
                  ": x must be a contiguous bfloat16 [M, ", K, "] tensor");
  STD_TORCH_CHECK(wp.is_contiguous() && wp.numel() * static_cast<int64_t>(wp.element_size()) == (N + 15) / 16 * block_bytes,
                  op, ": the packed weight does not match N=", N, ", K=", K, "; pack it with kernels.native.pack_blocked");
}

#define GLOWPLUG_MB_SWITCH(mb, CALL)                                                                       \
  switch (mb) {                                                                                            \
    case 1: CALL(1, 4); break;                                                                             \
    case 2: CALL(2, 2); break;                                                                             \
    case 3: CALL(3, 2); break;                                                                             \
    case 4: CALL(4, 1); break;                                                                             \
    case 5: CALL(5, 1); break;                                                                             \
    case 6: CALL(6, 1); break;                                                                             \
    case 7: CALL(7, 1); break;                                                                             \
    default: CALL(8, 1); break;                                                                            \
  }

Tensor dense_blocked(Tensor x, Tensor wp, int64_t N) {
  const int64_t K = x.size(1), M = x.size(0);
  STD_TORCH_CHECK(K % 2 == 0, "dense_blocked: K must be even");
  check_blocked(x, wp, N, K, K * 32, "dense_blocked");
  Tensor y = torch::stable::new_empty(x, {M, N});
  OutWriter out{y.mutable_data_ptr(), true, N};
  const uint16_t* w = static_cast<const uint16_t*>(wp.const_data_ptr());
  const uint16_t* xp = static_cast<const uint16_t*>(x.const_data_ptr());
  for_blocks(M, (N + 15) / 16, [&](int64_t mb, int64_t m0, int64_t nb) {
#define CALL(MB_, NA_) dense_block<MB_>(w + nb * K * 16, K, xp, m0, nb, N, out)
    GLOWPLUG_MB_SWITCH(mb, CALL)
#undef CALL
  });
  return y;
}

Tensor intn_blocked(Tensor x, Tensor wp, int64_t N, int64_t bits, int64_t group_size) {
  const int64_t K = x.size(1), M = x.size(0);
  STD_TORCH_CHECK(bits == 4 || bits == 2, "intn_blocked: bits must be 4 or 2");
  const int64_t kc = 32 / bits;
  STD_TORCH_CHECK(group_size % kc == 0 && K % group_size == 0, "intn_blocked: group_size ", group_size,
                  " must divide K=", K, " and be a multiple of ", kc);
  const int64_t block_bytes = K * bits * 2 + (K / group_size) * 64;
  check_blocked(x, wp, N, K, block_bytes, "intn_blocked");
  Tensor y = torch::stable::new_empty(x, {M, N});
  OutWriter out{y.mutable_data_ptr(), true, N};
  const uint8_t* w = static_cast<const uint8_t*>(wp.const_data_ptr());
  const uint16_t* xp = static_cast<const uint16_t*>(x.const_data_ptr());
  const std::vector<float> xs = group_sums(xp, M, K, group_size);
  const float* xsum = xs.data();
  for_blocks(M, (N + 15) / 16, [&](int64_t mb, int64_t m0, int64_t nb) {
    const uint8_t* blk = w + nb * block_bytes;
    if (bits == 4) {
#define CALL(MB_, NA_) intn_block<4, MB_, NA_>(blk, K, group_size, xp, xsum, m0, nb, N, out)
      GLOWPLUG_MB_SWITCH(mb, CALL)
#undef CALL
    } else {
#define CALL(MB_, NA_) intn_block<2, MB_, NA_>(blk, K, group_size, xp, xsum, m0, nb, N, out)
      GLOWPLUG_MB_SWITCH(mb, CALL)
#undef CALL
    }
  });
  return y;
}

Tensor int8_blocked(Tensor x, Tensor wp, int64_t N, int64_t group_size) {
  const int64_t K = x.size(1), M = x.size(0);
  STD_TORCH_CHECK(group_size % 4 == 0 && K % group_size == 0, "int8_blocked: group_size ", group_size,
                  " must divide K=", K, " and be a multiple of 4");
  const int64_t block_bytes = K * 16 + (K / group_size) * 64;
  check_blocked(x, wp, N, K, block_bytes, "int8_blocked");
  Tensor y = torch::stable::new_empty(x, {M, N});
  OutWriter out{y.mutable_data_ptr(), true, N};
  const uint8_t* w = static_cast<const uint8_t*>(wp.const_data_ptr());
  const uint16_t* xp = static_cast<const uint16_t*>(x.const_data_ptr());
  const std::vector<float> xs = group_sums(xp, M, K, group_size);
  const float* xsum = xs.data();
  for_blocks(M, (N + 15) / 16, [&](int64_t mb, int64_t m0, int64_t nb) {
#define CALL(MB_, NA_) int8_block<MB_, NA_>(w + nb * block_bytes, K, group_size, xp, xsum, m0, nb, N, out)
    GLOWPLUG_MB_SWITCH(mb, CALL)
#undef CALL
  });
  return y;
}

#else  // no AVX512-BF16: the Python side never enables these (kernels.native.blocked_supported)

Tensor unsupported(const char* op) {
  STD_TORCH_CHECK(false, op, ": this CPU has no AVX512-BF16; the engine uses the stock kernels instead");
  return Tensor();
}
Tensor dense_blocked(Tensor, Tensor, int64_t) { return unsupported("dense_blocked"); }
Tensor intn_blocked(Tensor, Tensor, int64_t, int64_t, int64_t) { return unsupported("intn_blocked"); }
Tensor int8_blocked(Tensor, Tensor, int64_t, int64_t) { return unsupported("int8_blocked"); }

#endif

}  // namespace
}  // namespace glowplug

STABLE_TORCH_LIBRARY_IMPL(glowplug_native, CPU, m) {
  m.impl("dense_blocked", TORCH_BOX(&glowplug::dense_blocked));
  m.impl("intn_blocked", TORCH_BOX(&glowplug::intn_blocked));
  m.impl("int8_blocked", TORCH_BOX(&glowplug::int8_blocked));
}

