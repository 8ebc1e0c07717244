// Decode attention over the paged KV cache for the compiled decode step: one query token per sequence, keys and
// values read in place by block table (no gathered copy), softmax and weighted sum in fp32.
//
// Why native: the same computation as plain tensor ops (engine/attention.py, `decode_attention`'s torch path, which
// is this op's reference) compiles into one Inductor kernel with a dozen parallel loops over a dynamic batch and
// width, and at batch 1 its fork/join barriers, not its arithmetic, were most of its time. Here one parallel region
// gives each thread an equal share of the batch's 16-token tiles (Split, below: sequences are cut where the shares
// meet, flash-decoding style, and their pieces' softmax states combined after), and each tile is read once, keys and
// values together, into an online softmax. The decode step it is part of: reports/decode-quantized.md and
// reports/decode-kv.md.
//
// On a CPU with AMX, a bf16 cache with blocks of a multiple of 16 tokens takes `attend_amx` instead (scores as tile
// products, below), for every batch of two or more sequences and for one sequence over a long context; the vector
// path stays for the int8 and fp32 caches, other CPUs, and one short sequence, where AMX's per-call set-up is
// more than it saves. Both fetch the cache rows ahead of the arithmetic (software prefetch): the vector path a few
// tiles ahead in its share, the AMX path the next task's rows while a task computes.
//
// CPUs without AVX512 (and other architectures) take a portable version of the vector path (below), still split per
// (sequence, kv head).
//
// A sliding window (`window` > 0: Gemma 3's local layers) limits row b to positions max(0, L - window) .. L - 1, L its
// context length (engine/attention.py's mask: keys kv > q - window). Why in the op and not as a mask: a mask still
// reads the whole context, so a windowed layer's step would grow with it. Each path skips every tile before the one
// holding the window's first position: the vector paths read none of the tokens before that position, the AMX path
// scores that tile whole (one stretch of the block holding the window's start) and leaves those tokens out of the
// softmax. So a windowed layer's step reads at most `window` + 15 positions a row whatever the context, and nothing of
// the blocks before the window (not even a prefetch).
//
// The cache write stays a torch scatter before this op (the graph's in-place update of the cache input), so this op
// only reads. The packed step input is engine/attention.py's: [B, 4 + W] int64 with the context length in column 3
// (the new token included) and the block table from column 4.
#include "amx.h"

#include <array>

namespace glowplug {
namespace {

constexpr int64_t kDecodeCols = 4, kContextCol = 3;  // engine/attention.py: DECODE_COLS, CONTEXT
// One sequence runs on AMX tiles from this context length. The tiles' set-up per call and task (the tile
// configuration, the query's B tiles) is fixed, and for one short sequence it outweighed what the tiles saved; the
// crossover was measured with the op alone on cold caches (issue 10's closing note has the figures).
constexpr int64_t kAmxMinContext = 256;

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
  int64_t window;  // <= 0: the whole context
  // The first position a row with context length len attends to.
  int64_t lo(int64_t len) const { return window > 0 && len > window ? len - window : 0; }
};

// How the vector path shares a call out. A tile is 16 tokens of one sequence with every kv head (rows that lie
// side by side in the cache, so a tile of a block is one contiguous stretch), and part p takes tiles [begin(p),
// begin(p + 1)) of the sequences laid end to end, one part per thread: every thread reads the same number of rows
// whatever the batch and the lengths. The split it replaces, one task per (sequence, kv head), gave SmolLM2 at batch
// 1 three tasks for two threads, so one thread read two thirds of the cache while the other waited (issue 34). A
// sequence cut by a part boundary leaves each part's softmax state in a slot (its running maximum, sum of weights
// and weighted values), and combine() finishes it after the parallel region.
struct Split {
  // [B + 1]: sequence b's tiles are [first[b], first[b + 1]), none for a padding row; with a window only the tiles
  // from the one holding its first position (tile j of b is tokens (lo / 16 + j) * 16 ..)
  const int64_t* first;
  int64_t parts, total, stride, slot;
  float* work;   // per part: `stride` floats of working state
  float* slots;  // per part two, for its first and its last sequence: `slot` floats each ([H] max, [H] sum, [H, D])
  int64_t begin(int64_t p) const { return total * p / parts; }
  float* slot_at(int64_t p, int64_t last) const { return slots + (2 * p + last) * slot; }
};
// How far ahead of the tile computing its part's prefetch runs, in bytes of cache rows: one int8 tile ahead (6.5 KB),
// none for bf16 (12 KB: its own rows fetched as it starts). Measured with the op alone on one thread over 30 layers
// (issue 34): with no prefetch both ran at 55-70% of their rate with it; one bf16 tile ahead was 20% slower than
// none at 8,192 tokens (rows evicted from L1 before they were read), one int8 tile ahead 10% faster. And the fewest
// tiles worth a part: below that one thread does it all (waking the other costs more than it saves).
constexpr int64_t kAheadBytes = 8192, kMinTiles = 2;

#if defined(__AVX512F__)  // else the portable attend_tasks below
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

// D values of a cache row as fp32 into dst (D % 16 == 0). int8 rows stay unscaled: their per-(token, head) scales
// go onto the scores and the weights instead (kernels/formats.dequantize_kv's product, regrouped), one multiply per
// token rather than one per element.
inline void row_f32(const void* base, ScalarType st, int64_t offset, int64_t D, float* dst) {
  if (st == ScalarType::Float) {
    std::memcpy(dst, static_cast<const float*>(base) + offset, static_cast<size_t>(D) * 4);
  } else if (st == ScalarType::BFloat16) {
    const uint16_t* p = static_cast<const uint16_t*>(base) + offset;
    for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(dst + d, load_bf16x16(p + d));
  } else {
    const int8_t* p = static_cast<const int8_t*>(base) + offset;
    for (int64_t d = 0; d < D; d += 16)
      _mm512_storeu_ps(dst + d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + d)))));
  }
}

// Kv head h's rows of one tile's 16 tokens as fp32 into tile [16, D]. tok[i] is token i's first cell (its kv head 0),
// or -1 past the context's end or in a block the engine never sends: zeros, never read from the cache.
inline void load_rows(const void* base, ScalarType st, const int64_t* tok, int64_t h, int64_t D, float* tile) {
  for (int64_t i = 0; i < 16; ++i) {
    if (tok[i] < 0)
      std::fill_n(tile + i * D, D, 0.f);
    else
      row_f32(base, st, (tok[i] + h) * D, D, tile + i * D);
  }
}

// The int8 scales of kv head h for a tile's 16 tokens (0 where there is no row: its products are 0 either way).
inline __m512 scales16(const float* s, const int64_t* tok, int64_t h) {
  alignas(64) float v[16];
  for (int i = 0; i < 16; ++i) v[i] = tok[i] < 0 ? 0.f : s[tok[i] + h];
  return _mm512_load_ps(v);
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

// The tile's weighted values for NG query heads of kv head h (weights w [NG][16], accumulators acc [NG][D]), for a
// head_dim of DC x 16: each value row is converted once for the NG heads, which accumulate in NG x DC registers
// (against the rows as an fp32 tile, converted, stored and read back per head, and each head's accumulator loaded
// and stored per tile). SK: the cache dtype (0 fp32, 1 bf16, 2 int8, whose scales are in w).
template <int DC, int NG, int SK>
inline void weigh_rows(const void* vp, const int64_t* tok, int64_t h, int64_t n, const float* w, float* acc) {
  constexpr int64_t D = DC * 16;
  __m512 a[NG][DC];
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < DC; ++c) a[g][c] = _mm512_loadu_ps(acc + g * D + c * 16);
  for (int64_t k = 0; k < n; ++k) {
    if (tok[k] < 0) continue;  // a row never sent: zeros add nothing
    const int64_t off = (tok[k] + h) * D;
    __m512 x[DC];
    for (int c = 0; c < DC; ++c) {
      if constexpr (SK == 0)
        x[c] = _mm512_loadu_ps(static_cast<const float*>(vp) + off + c * 16);
      else if constexpr (SK == 1)
        x[c] = load_bf16x16(static_cast<const uint16_t*>(vp) + off + c * 16);
      else
        x[c] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(vp) + off + c * 16))));
    }
    for (int g = 0; g < NG; ++g) {
      const __m512 p = _mm512_set1_ps(w[g * 16 + k]);
      for (int c = 0; c < DC; ++c) a[g][c] = _mm512_fmadd_ps(p, x[c], a[g][c]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < DC; ++c) _mm512_storeu_ps(acc + g * D + c * 16, a[g][c]);
}

template <int DC, int SK>
inline void weigh_heads(const void* vp, const int64_t* tok, int64_t h, int64_t n, int64_t G, const float* w, float* acc) {
  constexpr int GB = DC == 4 ? 4 : 2;  // heads per pass: GB x DC accumulators and DC rows in registers
  for (int64_t g0 = 0; g0 < G; g0 += GB) {
    const float* wg = w + g0 * 16;
    float* ag = acc + g0 * DC * 16;
    switch (std::min<int64_t>(GB, G - g0)) {
      case 1: weigh_rows<DC, 1, SK>(vp, tok, h, n, wg, ag); break;
      case 2: weigh_rows<DC, 2, SK>(vp, tok, h, n, wg, ag); break;
      case 3: weigh_rows<DC, 3, SK>(vp, tok, h, n, wg, ag); break;
      default: weigh_rows<DC, GB, SK>(vp, tok, h, n, wg, ag); break;
    }
  }
}

// Part `part` of a call (Split, below). Each tile is 16 tokens of one sequence: per kv head, the G query heads'
// scores, then an online softmax step (each head's running maximum and sum, its weighted values rescaled when the
// maximum rises), then the tile's values weighed in; keys and values are read once, tile by tile. DC = head_dim /
// 16 when it is 4 or 8 (64 and 128, compile-time so the row loops unroll: with a run-time head_dim their loop
// control led the op's profile), else 0 (any multiple of 16).
template <int DC>
void attend_part(const Job& j, const Split& sp, int64_t part) {
  const int64_t u0 = sp.begin(part), u1 = sp.begin(part + 1);
  if (u0 >= u1) return;
  const int64_t D = DC > 0 ? DC * 16 : j.D;
  const int64_t G = j.G, HKV = j.HKV, H = j.H, BS = j.BS, NBLK = j.NBLK, cols = j.cols, cap = j.W * j.BS;
  const int64_t* pk = j.pk;
  const int64_t* first = sp.first;
  const ScalarType st = j.st;
  const bool int8 = st == ScalarType::Char, out_bf16 = j.out_bf16;
  float* acc = sp.work + part * sp.stride;  // [H, D]: each query head's weighted values, not yet divided
  float* lsum = acc + H * D;                // [H, 16]: each head's sum of weights, in lanes
  float* pr = lsum + H * 16;                // [H, 16]: the tile's weights
  float* mx = pr + H * 16;                  // [H]: each head's running maximum score
  float* tile = mx + (H + 15) / 16 * 16;    // [16, D]: a kv head's rows of the tile as fp32
  float* qf = tile + 16 * D;                // [H, D]: the query as fp32
  uint16_t* zeros = reinterpret_cast<uint16_t*>(qf + H * D);  // [D] bf16: the row a missing token reads
  // bf16 queries take their scores as bf16 pairs (vdpbf16ps): from the bf16 cache's rows in place, or from the int8
  // cache's rows widened to bf16 (exact: every int8 value is a bf16), which costs less than widening them to fp32
  // and multiplying in fp32 (issue 34: the int8 op was as slow per tile as the bf16 one, on half the bytes).
#if defined(__AVX512BF16__)
  const bool bf16_pairs = (st == ScalarType::BFloat16 || int8) && out_bf16 && D % 32 == 0;
#else
  const bool bf16_pairs = false;
#endif
  if (bf16_pairs) std::fill_n(zeros, D, uint16_t{0});
  const int64_t es = st == ScalarType::Float ? 4 : int8 ? 1 : 2;
  const int64_t rowb = HKV * D * es;  // one token's rows, every kv head's, side by side
  const int64_t ahead = kAheadBytes / (16 * 2 * (rowb + (int8 ? HKV * 4 : 0)));
  const __m512 vscale = _mm512_set1_ps(j.fscale);
  auto seq_len = [&](int64_t b) __attribute__((always_inline)) {  // a padding row (length 0) has no tiles
    return std::min<int64_t>(std::max<int64_t>(pk[b * cols + kContextCol], 0), cap);
  };
  auto cell0 = [&](const int64_t* in, int64_t t) __attribute__((always_inline)) -> int64_t {
    const int64_t blk = in[kDecodeCols + t / BS];
    return blk >= 0 && blk < NBLK ? (blk * BS + t % BS) * HKV : -1;
  };
  // Each tile's rows are requested all at once as it starts, and `ahead` tiles further on: blocks sit anywhere in the
  // cache, so the hardware prefetcher does not follow them from block to block, and without this the op waited on
  // every row it read. The stream runs on into the part's next sequence.
  int64_t pu = u0, pb = std::upper_bound(first, first + j.B + 1, u0) - first - 1;
  // With blocks of a multiple of 16 tokens (the engine's are 16) a tile lies in one block, its rows one stretch.
  const bool one_block = BS % 16 == 0;
  auto fetch = [&](const void* base, int64_t c, int64_t bytes) __attribute__((always_inline)) {
    const char* r = static_cast<const char*>(base) + c;
    for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(r + o, _MM_HINT_T0);
    _mm_prefetch(r + bytes - 1, _MM_HINT_T0);  // the last line, where the stretch does not start on one
  };
  auto prefetch_to = [&](int64_t until) __attribute__((always_inline)) {
    for (; pu < until; ++pu) {
      while (first[pb + 1] <= pu) ++pb;
      const int64_t* in = pk + pb * cols;
      const int64_t len = seq_len(pb), lo = j.lo(len), t0 = (pu - first[pb] + lo / 16) * 16;
      const int64_t n = std::min<int64_t>(16, len - t0), skip = std::max<int64_t>(0, lo - t0);
      for (int64_t i = skip; i < n; i += one_block ? n : 1) {
        const int64_t c = cell0(in, t0 + i), m = one_block ? n - skip : 1;
        if (c < 0) continue;
        fetch(j.kp, c * D * es, m * rowb);
        fetch(j.vp, c * D * es, m * rowb);
        if (int8) {
          fetch(j.ksp, c * 4, m * HKV * 4);
          fetch(j.vsp, c * 4, m * HKV * 4);
        }
      }
    }
  };
  int64_t b = pb;
  for (int64_t u = u0; u < u1;) {
    while (first[b + 1] <= u) ++b;
    const int64_t* in = pk + b * cols;
    const int64_t len = seq_len(b), lo = j.lo(len), a = u - first[b], e = std::min(u1, first[b + 1]) - first[b];
    const int64_t q0 = b * H * D;  // kv head h's G query heads, and their outputs, are rows h * G.. of the sequence
    if (!bf16_pairs)               // the bf16 path reads the query as it is
      for (int64_t i = 0; i < H * D; i += 16)
        _mm512_storeu_ps(qf + i, out_bf16 ? load_bf16x16(static_cast<const uint16_t*>(j.qp) + q0 + i)
                                          : _mm512_loadu_ps(static_cast<const float*>(j.qp) + q0 + i));
    std::fill_n(acc, H * D, 0.f);
    std::fill_n(lsum, H * 16, 0.f);
    std::fill_n(mx, H, -INFINITY);
    for (int64_t i = a; i < e; ++i, ++u) {
      prefetch_to(std::min(u1, u + 1 + ahead));
      // tokens [skip, n) of the tile are the row's: skip > 0 only in a window's first tile (at least one token stays)
      const int64_t t0 = (i + lo / 16) * 16, n = std::min<int64_t>(16, len - t0), skip = std::max<int64_t>(0, lo - t0);
      const __mmask16 live = static_cast<__mmask16>((n >= 16 ? 0xffffu : (1u << n) - 1) & ~((1u << skip) - 1));
      int64_t tok[16];
      if (one_block) {
        const int64_t c = cell0(in, t0);
        for (int64_t k = 0; k < 16; ++k) tok[k] = k < n && k >= skip && c >= 0 ? c + k * HKV : -1;
      } else {
        for (int64_t k = 0; k < 16; ++k) tok[k] = k < n && k >= skip ? cell0(in, t0 + k) : -1;
      }
      for (int64_t h = 0; h < HKV; ++h) {
        const __m512 kscale = int8 ? _mm512_mul_ps(scales16(j.ksp, tok, h), vscale) : vscale;
        const uint16_t* rows[16];
        if (bf16_pairs && int8) {
#if defined(__AVX512BF16__)
          uint16_t* kt = reinterpret_cast<uint16_t*>(tile);  // [16, D] bf16
          for (int k = 0; k < 16; ++k) {
            rows[k] = tok[k] < 0 ? zeros : kt + k * D;
            if (tok[k] < 0) continue;
            const int8_t* r = static_cast<const int8_t*>(j.kp) + (tok[k] + h) * D;
            for (int64_t d = 0; d < D; d += 32) {
              const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r + d))));
              const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r + d + 16))));
              _mm512_storeu_si512(kt + k * D + d, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
            }
          }
#endif
        } else if (bf16_pairs) {
          for (int k = 0; k < 16; ++k) rows[k] = tok[k] < 0 ? zeros : static_cast<const uint16_t*>(j.kp) + (tok[k] + h) * D;
        } else {
          load_rows(j.kp, st, tok, h, D, tile);
        }
        for (int64_t g = 0; g < G; ++g) {
          const int64_t nq = h * G + g;
          __m512 parts[16];
          if (bf16_pairs) {
            // bf16 keys and query: vdpbf16ps multiplies the rows in pairs (bf16 products are exact in fp32, summed
            // in fp32 as the fp32 path does)
            const uint16_t* qg = static_cast<const uint16_t*>(j.qp) + q0 + nq * D;
            for (int k = 0; k < 16; ++k) {
              __m512 s = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
              for (int64_t d = 0; d < D; d += 32)
                s = _mm512_dpbf16_ps(s, (__m512bh)_mm512_loadu_si512(rows[k] + d), (__m512bh)_mm512_loadu_si512(qg + d));
#endif
              parts[k] = s;
            }
          } else {
            for (int k = 0; k < 16; ++k) parts[k] = dot_lanes(qf + nq * D, tile + k * D, D);
          }
          // dot then scale, as the torch path does (sum first, then * scale)
          const __m512 sc = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live, _mm512_mul_ps(hsum16(parts), kscale));
          const float top = _mm512_reduce_max_ps(sc);
          float* an = acc + nq * D;
          if (top > mx[nq]) {  // the weights so far were relative to a smaller maximum (e^-inf = 0 on the first tile)
            const __m512 r = _mm512_set1_ps(std::exp(mx[nq] - top));
            mx[nq] = top;
            _mm512_storeu_ps(lsum + nq * 16, _mm512_mul_ps(_mm512_loadu_ps(lsum + nq * 16), r));
            for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(an + d, _mm512_mul_ps(_mm512_loadu_ps(an + d), r));
          }
          const __m512 w = _mm512_maskz_mov_ps(live, exp_nonpos(_mm512_sub_ps(sc, _mm512_set1_ps(mx[nq]))));
          _mm512_storeu_ps(lsum + nq * 16, _mm512_add_ps(_mm512_loadu_ps(lsum + nq * 16), w));
          _mm512_storeu_ps(pr + nq * 16, w);
        }
        // Weighted values (int8: the weights times the rows' scales).
        if (int8) {
          const __m512 vsc = scales16(j.vsp, tok, h);
          for (int64_t g = 0; g < G; ++g)
            _mm512_storeu_ps(pr + (h * G + g) * 16, _mm512_mul_ps(_mm512_loadu_ps(pr + (h * G + g) * 16), vsc));
        }
        float* ah = acc + h * G * D;
        const float* wh = pr + h * G * 16;
        if constexpr (DC > 0) {
          if (st == ScalarType::BFloat16)
            weigh_heads<DC, 1>(j.vp, tok, h, n, G, wh, ah);
          else if (int8)
            weigh_heads<DC, 2>(j.vp, tok, h, n, G, wh, ah);
          else
            weigh_heads<DC, 0>(j.vp, tok, h, n, G, wh, ah);
          continue;
        }
        // any other head_dim: the rows as fp32 once for the G heads, each head's accumulator read and written once
        // per tile (updating it in memory per value stalled on store forwarding)
        load_rows(j.vp, st, tok, h, D, tile);
        for (int64_t g = 0; g < G; ++g) {
          float* an = ah + g * D;
          const float* pg = wh + g * 16;
          for (int64_t d = 0; d < D; d += 16) {
            __m512 x = _mm512_loadu_ps(an + d);
            for (int64_t k = 0; k < n; ++k) x = _mm512_fmadd_ps(_mm512_set1_ps(pg[k]), _mm512_loadu_ps(tile + k * D + d), x);
            _mm512_storeu_ps(an + d, x);
          }
        }
      }
    }
    if (a == 0 && e == first[b + 1] - first[b]) {  // the whole sequence: its output
      for (int64_t nq = 0; nq < H; ++nq) {
        const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(_mm512_loadu_ps(lsum + nq * 16)));
        for (int64_t d = 0; d < D; d += 16) {
          const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(acc + nq * D + d), inv);
          const int64_t o = q0 + nq * D + d;
          if (!out_bf16) {
            _mm512_storeu_ps(static_cast<float*>(j.yp) + o, v);
            continue;
          }
          uint16_t* y = static_cast<uint16_t*>(j.yp) + o;  // round to nearest even, as f32_to_bf16 and torch do
#if defined(__AVX512BF16__)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), (__m256i)_mm512_cvtneps_pbh(v));
#else
          alignas(64) float f[16];
          _mm512_store_ps(f, v);
          for (int k = 0; k < 16; ++k) y[k] = f32_to_bf16(f[k]);
#endif
        }
      }
    } else {  // a piece of it: the state, for combine()
      float* s = sp.slot_at(part, first[b] + a == u0 ? 0 : 1);
      for (int64_t nq = 0; nq < H; ++nq) {
        s[nq] = mx[nq];
        s[H + nq] = _mm512_reduce_add_ps(_mm512_loadu_ps(lsum + nq * 16));
      }
      std::copy_n(acc, H * D, s + 2 * H);
    }
  }
}

#if defined(GLOWPLUG_AMX)
// The bf16 path on AMX (bf16 cache and queries, blocks of a multiple of 16 tokens, head_dim a multiple of 32 up to
// 128, at most 16 query heads). Why: the vector path's scores are 16 dot products per key tile per query head, each
// reduced across its lanes, and with its value pass that kept it at ~4x its arithmetic (230 us per layer, batch 64,
// 110 tokens, warm), too slow to hide the cache reads behind. Here a 16-token tile of one kv head's keys is an A
// tile straight from the cache (rows a head's stride apart), and the queries are B tiles with one column per query
// head, so one tile multiply per 32 dimensions gives 16 tokens x every query head at once: scores land as rows of 16
// heads, and the softmax and the weighted values run across heads in whole vectors.
//
// Tasks: one per sequence, or per (sequence, kv head) when the batch is too small to keep every thread busy. Each
// task prefetches the next task's rows while it computes, so the cache stream overlaps the arithmetic (blocks sit
// anywhere in the cache, and the hardware prefetcher does not follow them).
// The weighted values of NG query heads n0.. of one kv head (offset hd in a cache row), over a task's positions
// lo .. len - 1: each value row is converted once for the NG heads, which accumulate in NG x DC registers; out: the
// heads' rows.
template <int DC, int NG, class Rows, class Ahead>
inline void weigh_values(const Rows& rows_at, const Ahead& ahead, const float* s, int64_t lo, int64_t len, int64_t hd,
                         int64_t n0, const float* inv, uint16_t* out, int64_t row) {
  __m512 a[NG][DC];
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < DC; ++c) a[g][c] = _mm512_setzero_ps();
  for (int64_t i = lo / 16; i * 16 < len; ++i) {
    const uint16_t* vr = rows_at(i);
    if (vr == nullptr) continue;  // zero values add nothing
    const int64_t n = std::min<int64_t>(16, len - i * 16);
    for (int64_t t = std::max<int64_t>(0, lo - i * 16); t < n; ++t) {
      ahead(i, t);
      const uint16_t* v = vr + t * row + hd;
      const float* p = s + (i * 16 + t) * 16 + n0;
      __m512 x[DC];
      for (int c = 0; c < DC; ++c) x[c] = load_bf16x16(v + c * 16);
      for (int g = 0; g < NG; ++g) {
        const __m512 pg = _mm512_set1_ps(p[g]);
        for (int c = 0; c < DC; ++c) a[g][c] = _mm512_fmadd_ps(pg, x[c], a[g][c]);
      }
    }
  }
  for (int g = 0; g < NG; ++g) {
    const __m512 sc = _mm512_set1_ps(inv[n0 + g]);
    for (int c = 0; c < DC; ++c)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + g * DC * 16 + c * 16),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(a[g][c], sc)));
  }
}

template <int DC>
void attend_amx(const Job& j, int64_t split, int64_t t0, int64_t t1) {
  constexpr int64_t D = DC * 16, CH = DC / 2;  // CH: 32-dimension chunks, one A tile each
  constexpr int GB = DC == 4 ? 4 : 2;         // query heads per value pass: GB x DC accumulators in registers
  const int64_t G = j.G, HKV = j.HKV, H = j.H, W = j.W, BS = j.BS, NBLK = j.NBLK, cols = j.cols;
  const int64_t hper = HKV / split, row = HKV * D;  // kv heads per task; elements between consecutive tokens
  const int64_t* pk = j.pk;
  const uint16_t* kp = static_cast<const uint16_t*>(j.kp);
  const uint16_t* vp = static_cast<const uint16_t*>(j.vp);
  const uint32_t* qp = static_cast<const uint32_t*>(j.qp);  // bf16 pairs
  uint16_t* yp = static_cast<uint16_t*>(j.yp);
  amx::configure(16);
  std::vector<uint32_t> qt(static_cast<size_t>(HKV * CH * 256));          // B tiles: [h][chunk][16 pairs][16 heads]
  std::vector<float> s(static_cast<size_t>((W * BS + 16) * 16));          // scores, then weights: [token][16 heads]
  // (b, first kv head, context length, first position attended: the window's)
  auto span = [&](int64_t task) __attribute__((always_inline)) {
    const int64_t b = task / split, len = std::min<int64_t>(std::max<int64_t>(pk[b * cols + kContextCol], 0), W * BS);
    return std::array<int64_t, 4>{b, task % split * hper, len, j.lo(len)};
  };
  // Rows of tile i (tokens 16i..16i+15) of a task, for heads [h0, h0 + hper): the block's address, or null.
  auto rows_at = [&](const uint16_t* base, int64_t b, int64_t i) __attribute__((always_inline)) -> const uint16_t* {
    const int64_t blk = pk[b * cols + kDecodeCols + i * 16 / BS];
    return blk < 0 || blk >= NBLK ? nullptr : base + (blk * BS + i * 16 % BS) * row;
  };
  for (int64_t task = t0; task < t1; ++task) {
    const auto [b, h0, len, lo] = span(task);
    const std::array<int64_t, 4> nx = task + 1 < t1 ? span(task + 1) : std::array<int64_t, 4>{0, 0, 0, 0};
    const int64_t tiles = (len + 15) / 16;
    if (len == 0) {  // a padding row attends to nothing
      for (int64_t h = h0; h < h0 + hper; ++h) std::fill_n(yp + (b * H + h * G) * D, G * D, uint16_t{0});
      continue;
    }
    // B tiles: row r of chunk c holds, in column n, query head n's dimension pair (32c + 2r, 32c + 2r + 1).
    for (int64_t h = h0; h < h0 + hper; ++h)
      for (int64_t c = 0; c < CH; ++c) {
        uint32_t* t = qt.data() + (h * CH + c) * 256;
        std::fill_n(t, 256, 0u);
        for (int64_t n = h * G; n < (h + 1) * G; ++n)
          for (int64_t r = 0; r < 16; ++r) t[r * 16 + n] = qp[(b * H + n) * (D / 2) + c * 16 + r];
      }
    // Scores: per 16-token tile, every (kv head, chunk) multiply into one accumulator of [16 tokens][16 heads]. With
    // a window, from the tile holding its first position (the tokens before it there are scored, then left out).
    for (int64_t i = lo / 16; i < tiles; ++i) {
      float* si = s.data() + i * 256;
      const uint16_t* kr = rows_at(kp, b, i);
      if (kr == nullptr) {  // a block the engine never sends: zero keys, as the reference reads them
        std::fill_n(si, 256, 0.f);
        continue;
      }
      _tile_zero(0);
      for (int64_t h = h0; h < h0 + hper; ++h)
        for (int64_t c = 0; c < CH; ++c) {
          if (c & 1) {
            _tile_loadd(3, kr + h * D + c * 32, row * 2);
            _tile_loadd(4, qt.data() + (h * CH + c) * 256, 64);
            _tile_dpbf16ps(0, 3, 4);
          } else {
            _tile_loadd(1, kr + h * D + c * 32, row * 2);
            _tile_loadd(2, qt.data() + (h * CH + c) * 256, 64);
            _tile_dpbf16ps(0, 1, 2);
          }
        }
      _tile_stored(0, si, 64);
    }
    // Softmax per head (lane), over the context's tokens: dot then scale, as the reference does.
    const __m512 vscale = _mm512_set1_ps(j.fscale);
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t t = lo; t < len; ++t) {
      const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(s.data() + t * 16), vscale);
      _mm512_storeu_ps(s.data() + t * 16, v);
      mx = _mm512_max_ps(mx, v);
    }
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = lo; t < len; ++t) {
      const __m512 e = exp_nonpos(_mm512_sub_ps(_mm512_loadu_ps(s.data() + t * 16), mx));
      _mm512_storeu_ps(s.data() + t * 16, e);
      sum = _mm512_add_ps(sum, e);
    }
    alignas(64) float inv[16];
    _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), sum));
    // Weighted values: per kv head, GB query heads at a time, each value row converted once for them.
    for (int64_t h = h0; h < h0 + hper; ++h)
      for (int64_t g0 = 0; g0 < G; g0 += GB) {
        const int64_t gc = std::min<int64_t>(GB, G - g0), n0 = h * G + g0;
        // The next task's keys and values, for the same token and head position, prefetched as this task's values
        // are weighed: a few lines per row, so the cache stream overlaps the arithmetic (a burst per tile filled the
        // core's miss buffers and stalled it). Into L2 (T1): a task's rows are more than L1 holds. Against T0 the op
        // alone (30 layers at batch 64 and 90 tokens, cache evicted between runs) measured the same within this
        // machine's noise, on huge pages and on 4 KiB ones; issue 10's closing note at stop 29 has the figures.
        const bool first = g0 == 0 && nx[2] > 0;
        const int64_t nh = nx[1] + h - h0, shift = nx[3] / 16 - lo / 16;  // this task's tile i is the next's i + shift
        const uint16_t *nk = nullptr, *nv = nullptr;
        int64_t ni = -1;
        const auto ahead = [&](int64_t i, int64_t t) __attribute__((always_inline)) {
          if (!first) return;
          if (i != ni) {
            ni = i;
            nk = (i + shift) * 16 < nx[2] ? rows_at(kp, nx[0], i + shift) : nullptr;
            nv = (i + shift) * 16 < nx[2] ? rows_at(vp, nx[0], i + shift) : nullptr;
          }
          if (nk == nullptr) return;
          const char* kr = reinterpret_cast<const char*>(nk + t * row + nh * D);
          const char* vr = reinterpret_cast<const char*>(nv + t * row + nh * D);
          for (int64_t o = 0; o < D * 2; o += 64) {
            _mm_prefetch(kr + o, _MM_HINT_T1);
            _mm_prefetch(vr + o, _MM_HINT_T1);
          }
        };
        const auto vr_at = [&](int64_t i) __attribute__((always_inline)) { return rows_at(vp, b, i); };
        uint16_t* yo = yp + (b * H + n0) * D;  // the heads' output rows
        switch (gc) {
          case 1: weigh_values<DC, 1>(vr_at, ahead, s.data(), lo, len, h * D, n0, inv, yo, row); break;
          case 2: weigh_values<DC, 2>(vr_at, ahead, s.data(), lo, len, h * D, n0, inv, yo, row); break;
          case 3: weigh_values<DC, 3>(vr_at, ahead, s.data(), lo, len, h * D, n0, inv, yo, row); break;
          default: weigh_values<DC, GB>(vr_at, ahead, s.data(), lo, len, h * D, n0, inv, yo, row); break;
        }
      }
  }
  _tile_release();
}
#endif

#else
// The portable kernel (any ISA level without AVX512: the avx2 build, the portable one, other architectures): the
// vector path's arithmetic on common.h's 16-lane vectors, without its bf16-pair and prefetch refinements, and still
// split per (sequence, kv head) with two passes (scores, then values) rather than into tiles (Split). Every cache
// dtype is widened to fp32 rows first; each score is a dot product in 16 lanes, then the lanes' sum, then the scale.

// e^x for x <= 0, as exp_nonpos above, with 2^n made from its exponent bits instead of vscalefps; so x is clamped
// at -87, where 2^n is still a normal float (e^-87 ~ 1.6e-38: no weight next to the maximum's e^0 = 1 notices).
GLOWPLUG_VINLINE F16 vexp_nonpos(F16 x) {
  x = vmax(x, vsplat(-87.f));
  const float shift = 12582912.f;  // 1.5 * 2^23: (v + shift) - shift rounds v to an integer, half to even
  const F16 n = (x * 1.44269504088896341f + shift) - shift;
  F16 r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  F16 p = vsplat(1.f / 720.f);
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const I16 e = (to_int(n) + 127) << 23;
  return p * bitcast<vf32>(e);
}

// D values of a cache row (bf16, fp32 or int8 times its scale) as fp32 into dst (D % 16 == 0).
inline void row_f32(const void* base, ScalarType st, int64_t offset, float scale, int64_t D, float* dst) {
  if (st == ScalarType::Float) {
    std::memcpy(dst, static_cast<const float*>(base) + offset, static_cast<size_t>(D) * 4);
  } else if (st == ScalarType::BFloat16) {
    const uint16_t* p = static_cast<const uint16_t*>(base) + offset;
    for (int64_t d = 0; d < D; d += 16) vstore(dst + d, vload_bf16(p + d));
  } else {  // int8 with one fp32 scale per (token, head): kernels/formats.dequantize_kv
    const int8_t* p = static_cast<const int8_t*>(base) + offset;
    for (int64_t d = 0; d < D; d += 16) vstore(dst + d, vload_i8(p + d) * scale);
  }
}

// As load_tile above: rows t0..t0 + 15 as fp32 [16, D], zeros past the context and for blocks never sent.
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

template <int DC>
void attend_tasks(const Job& j, int64_t t0, int64_t t1) {
  const int64_t D = DC > 0 ? DC * 16 : j.D;
  const int64_t G = j.G, HKV = j.HKV, H = j.H, W = j.W, BS = j.BS, NBLK = j.NBLK, cols = j.cols;
  const int64_t* pk = j.pk;
  const bool out_bf16 = j.out_bf16;
  std::vector<float> qf(static_cast<size_t>(G * D)), acc(static_cast<size_t>(G * D));
  std::vector<float> probs, tile(static_cast<size_t>(16 * D));
  std::vector<int64_t> cells;
  for (int64_t task = t0; task < t1; ++task) {
    const int64_t b = task / HKV, h = task % HKV;
    const int64_t* in = pk + b * cols;
    // A row past its table's capacity, or a padding row (length 0), attends to nothing. The task's len positions
    // are lo .. end - 1 (lo > 0 only with a window), cells[i] position lo + i's.
    const int64_t end = std::min<int64_t>(std::max<int64_t>(in[kContextCol], 0), W * BS), lo = j.lo(end);
    const int64_t len = end - lo;
    const int64_t lp = (len + 15) / 16 * 16;  // a head's scores, padded to whole vectors with -inf
    const int64_t q0 = (b * H + h * G) * D;   // the task's G query heads, and their outputs, are contiguous
    for (int64_t i = 0; i < G * D; ++i)
      qf[i] = out_bf16 ? bf16_to_f32(static_cast<const uint16_t*>(j.qp)[q0 + i]) : static_cast<const float*>(j.qp)[q0 + i];
    std::fill(acc.begin(), acc.end(), 0.f);
    probs.assign(static_cast<size_t>(G * lp), -INFINITY);
    cells.resize(static_cast<size_t>(len));
    for (int64_t t = lo; t < end;) {  // block by block, from the one holding position lo
      const int64_t blk = in[kDecodeCols + t / BS];
      const bool ok = blk >= 0 && blk < NBLK;
      for (int64_t o = t % BS; o < BS && t < end; ++o, ++t) cells[t - lo] = ok ? (blk * BS + o) * HKV + h : -1;
    }
    for (int64_t k0 = 0; k0 < len; k0 += 16) {
      const int64_t n = std::min<int64_t>(16, len - k0);
      load_tile(j.kp, j.ksp, j.st, cells.data(), k0, n, D, tile.data());
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = qf.data() + g * D;
        for (int64_t i = 0; i < n; ++i) {
          const float* kr = tile.data() + i * D;
          F16 a = vsplat(0.f);
          for (int64_t d = 0; d < D; d += 16) a += vload<F16>(qg + d) * vload<F16>(kr + d);
          probs[g * lp + k0 + i] = vsum(a) * j.fscale;  // dot then scale, as the torch path does
        }
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      float* p = probs.data() + g * lp;
      F16 top = vsplat(-INFINITY);
      for (int64_t t = 0; t < lp; t += 16) top = vmax(top, vload<F16>(p + t));
      const float mx = vmax_lane(top);
      F16 sum = vsplat(0.f);
      for (int64_t t = 0; t < lp; t += 16) {
        const F16 v = vload<F16>(p + t);
        F16 e = vexp_nonpos(v - mx);
        GLOWPLUG_PARTS(i) e.v[i] = v.v[i] > -INFINITY ? e.v[i] : vf32{};  // the padding weighs 0
        vstore(p + t, e);
        sum += e;
      }
      const float inv = 1.f / vsum(sum);
      for (int64_t t = 0; t < lp; t += 16) vstore(p + t, vload<F16>(p + t) * inv);
    }
    for (int64_t k0 = 0; k0 < len; k0 += 16) {
      const int64_t n = std::min<int64_t>(16, len - k0);
      load_tile(j.vp, j.vsp, j.st, cells.data(), k0, n, D, tile.data());
      for (int64_t g = 0; g < G; ++g) {
        const float* pg = probs.data() + g * lp + k0;
        float* ag = acc.data() + g * D;
        if constexpr (DC > 0) {  // the head's chunks in registers across the tile: DC independent chains
          F16 a[DC];
          for (int c = 0; c < DC; ++c) a[c] = vload<F16>(ag + c * 16);
          for (int64_t i = 0; i < n; ++i)
            for (int c = 0; c < DC; ++c) a[c] += pg[i] * vload<F16>(tile.data() + i * D + c * 16);
          for (int c = 0; c < DC; ++c) vstore(ag + c * 16, a[c]);
        } else {
          for (int64_t d = 0; d < D; d += 16) {
            F16 a = vload<F16>(ag + d);
            for (int64_t i = 0; i < n; ++i) a += pg[i] * vload<F16>(tile.data() + i * D + d);
            vstore(ag + d, a);
          }
        }
      }
    }
    for (int64_t i = 0; i < G * D; ++i) {  // bf16: round to nearest even, as torch does
      if (out_bf16)
        static_cast<uint16_t*>(j.yp)[q0 + i] = f32_to_bf16(acc[i]);
      else
        static_cast<float*>(j.yp)[q0 + i] = acc[i];
    }
  }
}
#endif  // __AVX512F__

#if defined(__AVX512F__)
// Finishes sequence b from the states its pieces left (Split): each piece's weights are relative to its own
// maximum, so its sum and weighted values are rescaled to the largest before the division.
void combine(const Job& j, const Split& sp, int64_t b) {
  const int64_t H = j.H, D = j.D, f0 = sp.first[b], f1 = sp.first[b + 1];
  std::vector<const float*> pieces;
  for (int64_t p = 0; p < sp.parts; ++p) {
    const int64_t r0 = sp.begin(p), r1 = sp.begin(p + 1);
    if (std::max(r0, f0) < std::min(r1, f1)) pieces.push_back(sp.slot_at(p, f0 <= r0 ? 0 : 1));
  }
  std::vector<float> out(static_cast<size_t>(D));
  for (int64_t n = 0; n < H; ++n) {
    float top = -INFINITY, sum = 0.f;
    for (const float* s : pieces) top = std::max(top, s[n]);
    std::fill(out.begin(), out.end(), 0.f);
    for (const float* s : pieces) {
      const float r = std::exp(s[n] - top);
      sum += s[H + n] * r;
      for (int64_t d = 0; d < D; ++d) out[d] += s[2 * H + n * D + d] * r;
    }
    const float inv = 1.f / sum;
    const int64_t o = (b * H + n) * D;
    for (int64_t d = 0; d < D; ++d) {
      if (j.out_bf16)
        static_cast<uint16_t*>(j.yp)[o + d] = f32_to_bf16(out[d] * inv);
      else
        static_cast<float*>(j.yp)[o + d] = out[d] * inv;
    }
  }
}
#endif

Tensor attend(const Tensor& q, const Tensor& kc, const Tensor& vc, const Tensor* ks, const Tensor* vs,
              const Tensor& packed, double scale, int64_t window) {
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
                ksp, vsp, st, q.scalar_type() == ScalarType::BFloat16, static_cast<float>(scale), y.mutable_data_ptr(),
                window};
#if defined(GLOWPLUG_AMX)
  // one sequence goes to tiles only over a long context (see the top of the file): the positions it reads
  const int64_t len0 = B == 1 ? std::min<int64_t>(std::max<int64_t>(pk[kContextCol], 0), W * BS) : 0;
  const bool enough = B >= 2 || (B == 1 && len0 - job.lo(len0) >= kAmxMinContext);
  if (st == ScalarType::BFloat16 && job.out_bf16 && BS % 16 == 0 && (D == 64 || D == 128) && H <= 16 && enough &&
      amx::available()) {
    // per sequence once the batch fills the threads several times over, else per (sequence, kv head)
    const int64_t split = B >= 4 * torch::stable::get_num_threads() ? 1 : HKV;
    torch::stable::parallel_for(0, B * split, 1, [&](int64_t t0, int64_t t1) {
      if (D == 64)
        attend_amx<4>(job, split, t0, t1);
      else
        attend_amx<8>(job, split, t0, t1);
    });
    return y;
  }
#endif
#if defined(__AVX512F__)
  // Per-call scratch, kept by the calling thread between calls (the step calls this op once a layer).
  static thread_local std::vector<int64_t> first;
  static thread_local std::vector<float> scratch;
  first.resize(static_cast<size_t>(B + 1));
  first[0] = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = std::min<int64_t>(std::max<int64_t>(pk[b * cols + kContextCol], 0), W * BS);
    first[b + 1] = first[b] + (len + 15) / 16 - job.lo(len) / 16;  // the tiles from the window's first
    if (len == 0)  // a padding row, or one past its table's capacity, attends to nothing
      std::memset(static_cast<char*>(y.mutable_data_ptr()) + b * H * D * (job.out_bf16 ? 2 : 4), 0,
                  static_cast<size_t>(H * D * (job.out_bf16 ? 2 : 4)));
  }
  const int64_t total = first[B];
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(torch::stable::get_num_threads(), total / kMinTiles));
  const auto r16 = [](int64_t n) { return (n + 15) / 16 * 16; };  // whole 64-byte lines: no part shares one
  const int64_t stride = 2 * H * D + 2 * H * 16 + r16(H) + 16 * D + r16(D / 2), slot = r16(2 * H + H * D);
  scratch.resize(std::max(scratch.size(), static_cast<size_t>(parts * (stride + 2 * slot) + 16)));
  float* base = scratch.data() + (16 - reinterpret_cast<uintptr_t>(scratch.data()) / 4 % 16) % 16;
  const Split sp{first.data(), parts, total, stride, slot, base, base + parts * stride};
  torch::stable::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      if (D == 64)
        attend_part<4>(job, sp, p);
      else if (D == 128)
        attend_part<8>(job, sp, p);
      else
        attend_part<0>(job, sp, p);
    }
  });
  for (int64_t p = 1, last = -1; p < parts; ++p) {  // the sequences cut by a part boundary
    const int64_t u = sp.begin(p);
    if (u >= total) continue;
    const int64_t b = std::upper_bound(first.begin(), first.end(), u) - first.begin() - 1;
    if (first[b] == u || b == last) continue;
    combine(job, sp, b);
    last = b;
  }
#else
  torch::stable::parallel_for(0, B * HKV, 1, [&](int64_t t0, int64_t t1) {
    if (D == 64)
      attend_tasks<4>(job, t0, t1);
    else if (D == 128)
      attend_tasks<8>(job, t0, t1);
    else
      attend_tasks<0>(job, t0, t1);
  });
#endif
  return y;
}

Tensor decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor packed, double scale, int64_t window) {
  return attend(q, k_cache, v_cache, nullptr, nullptr, packed, scale, window);
}

Tensor decode_attention_int8(Tensor q, Tensor k_cache, Tensor v_cache, Tensor k_scale, Tensor v_scale, Tensor packed,
                             double scale, int64_t window) {
  return attend(q, k_cache, v_cache, &k_scale, &v_scale, packed, scale, window);
}

}  // namespace
}  // namespace glowplug

STABLE_TORCH_LIBRARY_FRAGMENT(glowplug_native, m) {
  // window <= 0: every position of the context; else each row's last `window` positions (the top of the file)
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor packed, float scale, int window=0) -> "
        "Tensor");
  m.def("decode_attention_int8(Tensor q, Tensor k_cache, Tensor v_cache, Tensor k_scale, Tensor v_scale, "
        "Tensor packed, float scale, int window=0) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(glowplug_native, CPU, m) {
  m.impl("decode_attention", TORCH_BOX(&glowplug::decode_attention));
  m.impl("decode_attention_int8", TORCH_BOX(&glowplug::decode_attention_int8));
}
