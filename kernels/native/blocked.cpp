// N-blocked decode kernels for bf16 activations: dense bf16, int4/int2 and int8 weights. AVX512-BF16 + VNNI kernels
// (and AMX for batches) where the build has them, a portable path (below, "portable") for every other ISA level.
// int4 from the AVX2 level up (below the AMX batches): integer dot products on int8 activations ("int4, integer dot
// products").
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
// term is taken back with the group's activation sum. int8 codes (offset to 0..255) are multiplied as bytes with
// 16-bit fixed-point activations by VNNI instead (see the int8 section).
//
// Batches: a chunk's planes are decoded once and used for every activation row of the block (up to 8 at a time, 16
// for int4/int2 from 9 rows on), so the cost grows with the batch only by the multiply-adds; int8 from 32 rows on
// decodes each N-block to bf16 once and runs the dense kernel on it. The multiply-adds grow one instruction per
// row, and from a few rows on (amx::kMinRows*) the AMX tile kernels of amx.h take over, where one instruction covers
// 16 rows.
#include "amx.h"
#include "common.h"

#include <cstdlib>
#include <memory>
#include <type_traits>

namespace glowplug {
namespace {

// Software prefetch, this many bytes ahead in the weight stream. The packed formats do several operations per cache
// line, and at that pace the hardware prefetcher fell behind: the int4 kernel stalled on its weight loads (8.6 GB/s
// single-threaded without prefetch, 15.7 at 4 KiB ahead; two threads 15 -> 26 GB/s). Distances measured on the
// 2-core EPYC: 3-6 KiB for the packed formats, 2 KiB for dense bf16. On the 2-core Intel Xeon a sweep over a whole
// decode step's GEMVs (distinct weights, batch 1; 2, 4, 8 and 16 KiB ahead) was fastest at 8 KiB for int4 and flat
// for dense bf16, so the packed formats use 8 KiB. Per-shape speeds: reports/kernels.md.
// A second prefetch, 16 KiB ahead into L2 (hint T1), keeps more lines in flight than the L1 one alone: a core
// has few L1 fill buffers, and L2 prefetches do not hold them. On a simulated batch-1 decode step (all 121 GEMVs on
// distinct weights, 2 threads, three runs each, Intel Xeon): dense bf16 11.0-11.4 ms -> 9.7-10.0, int4 2.93-3.00 ->
// 2.71-2.89, int8 3.77-4.15 -> 3.41-3.79 (the decode step: reports/decode-quantized.md).
#if defined(__x86_64__) || defined(__i386__)
constexpr int kHintT0 = _MM_HINT_T0, kHintT1 = _MM_HINT_T1;
template <int DIST, int HINT = kHintT0>
inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p) + DIST, static_cast<_mm_hint>(HINT)); }
#else  // __builtin_prefetch's locality: 3 keeps the line in every cache level (as T0 does), 2 from L2 on (T1)
constexpr int kHintT0 = 3, kHintT1 = 2;
template <int DIST, int HINT = kHintT0>
inline void prefetch(const void* p) { __builtin_prefetch(static_cast<const char*>(p) + DIST, 0, HINT); }
#endif
constexpr int kPackedAhead = 8192, kDenseAhead = 2048, kL2Ahead = 16384;

void check_blocked(const Tensor& x, const Tensor& wp, int64_t N, int64_t K, int64_t block_bytes, const char* op) {
  STD_TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) == K && x.scalar_type() == ScalarType::BFloat16, op,
                  ": x must be a contiguous bfloat16 [M, ", K, "] tensor");
  STD_TORCH_CHECK(wp.is_contiguous() && wp.numel() * static_cast<int64_t>(wp.element_size()) == (N + 15) / 16 * block_bytes,
                  op, ": the packed weight does not match N=", N, ", K=", K, "; pack it with kernels.native.pack_blocked");
}

// The argument checks of the packed ops, shared by every build so that each level accepts the same weights. int8's
// groups are multiples of 32 inputs because the AVX512 kernel's activation blocks are.
int64_t intn_block_bytes(const Tensor& x, const Tensor& wp, int64_t N, int64_t bits, int64_t group_size) {
  const int64_t K = x.size(1);
  STD_TORCH_CHECK(bits == 4 || bits == 2, "intn_blocked: bits must be 4 or 2");
  const int64_t kc = 32 / bits;
  STD_TORCH_CHECK(group_size % kc == 0 && K % group_size == 0, "intn_blocked: group_size ", group_size,
                  " must divide K=", K, " and be a multiple of ", kc);
  const int64_t block_bytes = K * bits * 2 + (K / group_size) * 64;
  check_blocked(x, wp, N, K, block_bytes, "intn_blocked");
  return block_bytes;
}

int64_t int8_block_bytes(const Tensor& x, const Tensor& wp, int64_t N, int64_t group_size) {
  const int64_t K = x.size(1);
  STD_TORCH_CHECK(group_size % 32 == 0 && K % group_size == 0, "int8_blocked: group_size ", group_size,
                  " must divide K=", K, " and be a multiple of ", 32);
  const int64_t block_bytes = K * 16 + (K / group_size) * 64;
  check_blocked(x, wp, N, K, block_bytes, "int8_blocked");
  return block_bytes;
}

// The frame every op shares: y [M, N] in x's dtype = run(M, K, N, x's bf16 data, the packed weight as W, y's writer,
// args...), where `run` is the op's body for this build's ISA level.
template <class W, class Run, class... Args>
Tensor run_blocked(const Tensor& x, const Tensor& wp, int64_t N, Run run, Args... args) {
  const int64_t M = x.size(0), K = x.size(1);
  Tensor y = torch::stable::new_empty(x, {M, N});
  const OutWriter out{y.mutable_data_ptr(), true, N};
  run(M, K, N, static_cast<const uint16_t*>(x.const_data_ptr()), static_cast<const W*>(wp.const_data_ptr()), out, args...);
  return y;
}

#if defined(__AVX2__)
// ------------------------------------------------------------------------------- int4, integer dot products
// For int4 weights every x86 level from AVX2 up multiplies in integers, with the activations taken to int8 per
// (row, weight group), as llama.cpp's Q8 activations are. The codes meet them as bytes, with no conversion: a mask
// (and a shift) leaves each code a byte, and each row's activations are stored permuted so that a 32-bit lane's
// bytes line up with the codes it holds. AVX2 multiplies with vpmaddubsw (32 byte pairs, adjacent products added),
// AVX512-VNNI with vpdpbusd (four byte products added into each 32-bit lane): per code and row, a quarter of an
// instruction, where the fp32 path (the portable section) spends a conversion and a multiply-add. On AVX2 that path
// held batch 1 to a third of the streaming-read probe and made a batch of 16 cost 5x one row, bound by the FMA
// ports; the AVX512-BF16 kernel above it decodes each code to bf16 first.
// Exact in integers: |code x| <= 15 * 127, four products per 16-bit lane <= 7620, 32-bit sums per group. The one
// rounding is the activations' (oracle: reference.quantize_x8): y = scale * dx * sum(q xq) + min * dx * sum(xq), the
// dequantized weights times the dequantized activations. The min term takes the quantized sum too, not the bf16
// inputs' exact one: then the rounding errors meet the weights themselves (centred, small), where with the exact
// sum they would meet the raw codes 0..15, and the error measured twice as large (1.2% of the largest output,
// against 0.5%, at SmolLM2's shapes).
//
// Word j of a chunk (row j) holds its codes s = 0..7 (k = k0 + s) at bit offsets 4 (s / 2) + 16 (s % 2) (the
// layout above): after `& 0x0f0f0f0f` its bytes are codes (0, 4, 1, 5), after `>> 4` and the mask (2, 6, 3, 7);
// each row's int8 activations are stored per chunk of 8 in that order.
constexpr int kQ8Order[8] = {0, 2, 4, 6, 1, 3, 5, 7};  // input s of a chunk goes to byte kQ8Order[s]

struct Q8Rows {
  std::vector<int8_t> q;  // [M, K], each chunk of 8 inputs permuted by kQ8Order
  std::vector<float> d;   // [M, G]: the step of each (row, group): x ~ d * q
  std::vector<float> s;   // [M, G]: d * the sum of the group's q, the dequantized activations' sum
};

// One group of gs inputs (a multiple of 32) to int8, stored permuted; returns the sum of the codes. Vectorized: at a
// batch of 64 the scalar loop took longer than the multiply-adds it feeds (K = 1536: 248 us against 170 for the
// whole bf16 kernel); here it is about a tenth of them.
inline int32_t quantize_group32(const uint16_t* p, int64_t gs, float inv, int8_t* q) {
  const __m256 scale = _mm256_set1_ps(inv);
  const __m256i lanes = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  // within each 8 bytes: byte b takes input (0, 4, 1, 5, 2, 6, 3, 7)[b], so input s lands at byte kQ8Order[s]
  const __m256i bytes = _mm256_setr_epi8(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15,
                                         0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
  __m256i sum = _mm256_setzero_si256();
  for (int64_t k = 0; k < gs; k += 32) {
    __m256i v[4];
    for (int i = 0; i < 4; ++i) {
      const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + k + 8 * i)));
      v[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(h, 16)), scale));  // nearest even
      sum = _mm256_add_epi32(sum, v[i]);
    }
    // packs interleave the 128-bit lanes: dwords (0-3, 8-11, 16-19, 24-27 | 4-7, ...) before the lane permute
    const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
    const __m256i ordered = _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(b, lanes), bytes);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k), ordered);
  }
  const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  const __m128i s2 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
  return _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0xb1)));
}

inline float group_amax(const uint16_t* p, int64_t gs) {
  __m256 m = _mm256_setzero_ps();
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  int64_t k = 0;
  for (; k + 8 <= gs; k += 8) {
    const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + k)));
    m = _mm256_max_ps(m, _mm256_and_ps(_mm256_castsi256_ps(_mm256_slli_epi32(h, 16)), abs_mask));
  }
  alignas(32) float a[8];
  _mm256_store_ps(a, m);
  float r = *std::max_element(a, a + 8);
  for (; k < gs; ++k) r = std::max(r, std::fabs(bf16_to_f32(p[k])));
  return r;
}

Q8Rows quantize_x8(const uint16_t* x, int64_t M, int64_t K, int64_t gs) {
  const int64_t G = K / gs;
  Q8Rows r{std::vector<int8_t>(static_cast<size_t>(M * K)), std::vector<float>(static_cast<size_t>(M * G)),
           std::vector<float>(static_cast<size_t>(M * G))};
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      const uint16_t* p = x + m * K + g * gs;
      const float amax = group_amax(p, gs);
      const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      int8_t* q = r.q.data() + m * K + g * gs;
      int32_t sum = 0;
      if (gs % 32 == 0) {
        sum = quantize_group32(p, gs, inv, q);
      } else {  // groups of 8 or 16 inputs (int4 takes any multiple of 8)
        for (int64_t k = 0; k < gs; ++k) {
          const int32_t v = static_cast<int32_t>(std::nearbyint(bf16_to_f32(p[k]) * inv));
          q[k / 8 * 8 + kQ8Order[k % 8]] = static_cast<int8_t>(v);
          sum += v;
        }
      }
      r.d[static_cast<size_t>(m * G + g)] = d;
      r.s[static_cast<size_t>(m * G + g)] = d * static_cast<float>(sum);
    }
  return r;
}

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline void store_rows16(const OutWriter& out, int64_t m, int64_t n0, int64_t N, const float* a) {
  const int64_t n = std::min<int64_t>(16, N - n0);
  for (int64_t i = 0; i < n; ++i) out.put(m, n0 + i, a[i]);
}

// The vector operations of int4_q8_block on an N-block's 16 rows, per ISA level: Q8Sums holds their int32 sums,
// Q8Totals their fp32 totals, Q8Chunk a chunk's codes as bytes (lo: codes 0,4,1,5 of each row; hi: 2,6,3,7),
// Q8Group a group's fp16 scales and mins in fp32.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int kQ8Rows = 8;  // accumulators per pass: 8 of the 32 registers, and 8 totals

// One register holds a whole chunk (the block's 16 rows); vpdpbusd adds the four byte products of each lane.
struct Q8Sums {
  __m512i v;
  static Q8Sums zero() { return {_mm512_setzero_si512()}; }
};
struct Q8Totals {
  __m512 v;
  static Q8Totals zero() { return {_mm512_setzero_ps()}; }
};
struct Q8Chunk {
  __m512i lo, hi;
};
struct Q8Group {
  __m512 scale, min;
};

GLOWPLUG_VINLINE Q8Chunk q8_chunk(const uint8_t* chunk) {
  const __m512i mask = _mm512_set1_epi8(0x0f);
  const __m512i w = _mm512_loadu_si512(chunk);
  const __m512i lo = _mm512_and_si512(w, mask), hi = _mm512_and_si512(_mm512_srli_epi32(w, 4), mask);
  return {lo, hi};
}

// acc += the chunk's codes times one row's 8 int8 activations xq[at..at + 7] (stored permuted: see kQ8Order).
GLOWPLUG_VINLINE Q8Sums q8_madd(Q8Sums acc, const Q8Chunk& w, const int8_t* xq, int64_t at) {
  acc.v = _mm512_dpbusd_epi32(acc.v, w.lo, _mm512_set1_epi32(load_i32(xq + at)));
  acc.v = _mm512_dpbusd_epi32(acc.v, w.hi, _mm512_set1_epi32(load_i32(xq + at + 4)));
  return acc;
}

GLOWPLUG_VINLINE Q8Group q8_group(const uint16_t* scales, const uint16_t* mins, int64_t at) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + at))),
          _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mins + at)))};
}

// tot + scale * d * acc + min * sx: one row's group, d = xd[at] its activations' step, sx = xs[at] their sum.
GLOWPLUG_VINLINE Q8Totals q8_add_group(Q8Totals tot, const Q8Group& f, Q8Sums acc, const float* xd, const float* xs,
                                       int64_t at) {
  const __m512 d = _mm512_set1_ps(xd[at]), sx = _mm512_set1_ps(xs[at]);
  return {_mm512_fmadd_ps(_mm512_mul_ps(f.scale, d), _mm512_cvtepi32_ps(acc.v), _mm512_fmadd_ps(f.min, sx, tot.v))};
}

GLOWPLUG_VINLINE void q8_store(const OutWriter& out, int64_t m, int64_t n0, int64_t N, Q8Totals tot) {
  alignas(64) float a[16];
  _mm512_store_ps(a, tot.v);
  store_rows16(out, m, n0, N, a);
}
#else
constexpr int kQ8Rows = 4;  // 8 accumulators of the 16 registers, 4 decoded halves, 2 broadcasts

// A chunk is two registers of 8 rows each.
struct Q8Sums {
  __m256i v[2];
  static Q8Sums zero() { return {{_mm256_setzero_si256(), _mm256_setzero_si256()}}; }
};
struct Q8Totals {
  __m256 v[2];
  static Q8Totals zero() { return {{_mm256_setzero_ps(), _mm256_setzero_ps()}}; }
};
struct Q8Chunk {
  __m256i lo[2], hi[2];
};
struct Q8Group {
  __m256 scale[2], min[2];
};

GLOWPLUG_VINLINE Q8Chunk q8_chunk(const uint8_t* chunk) {
  const __m256i mask = _mm256_set1_epi8(0x0f);
  const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk));
  const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 32));
  const __m256i lo0 = _mm256_and_si256(w0, mask), hi0 = _mm256_and_si256(_mm256_srli_epi16(w0, 4), mask);
  const __m256i lo1 = _mm256_and_si256(w1, mask), hi1 = _mm256_and_si256(_mm256_srli_epi16(w1, 4), mask);
  return {{lo0, lo1}, {hi0, hi1}};
}

// acc (8 rows' 32-bit sums) += a chunk half's codes (lo: codes 0,4,1,5; hi: 2,6,3,7) times the row's activations.
GLOWPLUG_VINLINE __m256i madd_q8(__m256i acc, __m256i lo, __m256i hi, __m256i a, __m256i b) {
  const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, a), _mm256_maddubs_epi16(hi, b));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}

// acc += the chunk's codes times one row's 8 int8 activations xq[at..at + 7] (stored permuted: see kQ8Order).
GLOWPLUG_VINLINE Q8Sums q8_madd(Q8Sums acc, const Q8Chunk& w, const int8_t* xq, int64_t at) {
  const __m256i a = _mm256_set1_epi32(load_i32(xq + at));
  const __m256i b = _mm256_set1_epi32(load_i32(xq + at + 4));
  acc.v[0] = madd_q8(acc.v[0], w.lo[0], w.hi[0], a, b);
  acc.v[1] = madd_q8(acc.v[1], w.lo[1], w.hi[1], a, b);
  return acc;
}

GLOWPLUG_VINLINE Q8Group q8_group(const uint16_t* scales, const uint16_t* mins, int64_t at) {
  return {{_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + at))),
           _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + at + 8)))},
          {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mins + at))),
           _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mins + at + 8)))}};
}

// tot + scale * d * acc + min * sx: one row's group, d = xd[at] its activations' step, sx = xs[at] their sum.
GLOWPLUG_VINLINE Q8Totals q8_add_group(Q8Totals tot, const Q8Group& f, Q8Sums acc, const float* xd, const float* xs,
                                       int64_t at) {
  const __m256 d = _mm256_set1_ps(xd[at]), sx = _mm256_set1_ps(xs[at]);
  tot.v[0] = _mm256_fmadd_ps(_mm256_mul_ps(f.scale[0], d), _mm256_cvtepi32_ps(acc.v[0]), _mm256_fmadd_ps(f.min[0], sx, tot.v[0]));
  tot.v[1] = _mm256_fmadd_ps(_mm256_mul_ps(f.scale[1], d), _mm256_cvtepi32_ps(acc.v[1]), _mm256_fmadd_ps(f.min[1], sx, tot.v[1]));
  return tot;
}

GLOWPLUG_VINLINE void q8_store(const OutWriter& out, int64_t m, int64_t n0, int64_t N, Q8Totals tot) {
  alignas(32) float a[16];
  _mm256_store_ps(a, tot.v[0]);
  _mm256_store_ps(a + 8, tot.v[1]);
  store_rows16(out, m, n0, N, a);
}
#endif

// MB activation rows (from m0) times one N-block: per group, the integer sums of codes times int8 activations, then
// y += scale * dx * sum(q xq) + min * dx * sum(xq). xq, xd, xs: quantize_x8's rows from m0.
template <int MB>
void int4_q8_block(const uint8_t* blk, int64_t K, int64_t gs, const int8_t* xq, const float* xd, const float* xs,
                   int64_t m0, int64_t nb, int64_t N, const OutWriter& out) {
  const int64_t G = K / gs, chunks_per_group = gs / 8;
  const uint16_t* scales = reinterpret_cast<const uint16_t*>(blk + K * 8);
  const uint16_t* mins = scales + G * 16;
  Q8Totals tot[MB];
  _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) tot[m] = Q8Totals::zero();
  const uint8_t* chunk = blk;
  for (int64_t g = 0; g < G; ++g) {
    Q8Sums acc[MB];
    _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) acc[m] = Q8Sums::zero();
    for (int64_t c = 0; c < chunks_per_group; ++c, chunk += 64) {
      prefetch<kPackedAhead>(chunk);
      prefetch<kL2Ahead, kHintT1>(chunk);
      const Q8Chunk w = q8_chunk(chunk);
      const int64_t k0 = (g * chunks_per_group + c) * 8;
      _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) acc[m] = q8_madd(acc[m], w, xq, m * K + k0);
    }
    const Q8Group f = q8_group(scales, mins, g * 16);
    _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) tot[m] = q8_add_group(tot[m], f, acc[m], xd, xs, m * G + g);
  }
  _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) q8_store(out, m0 + m, nb * 16, N, tot[m]);
}

// y [M, N] = x [M, K] times the int4 blocked weight w, through int4_q8_block, kQ8Rows activation rows per pass.
void int4_q8_run(int64_t M, int64_t K, int64_t N, const uint16_t* xp, const uint8_t* w, const OutWriter& out,
                 int64_t gs, int64_t block_bytes) {
  const int64_t G = K / gs;
  const Q8Rows xq = quantize_x8(xp, M, K, gs);
  torch::stable::parallel_for(0, (N + 15) / 16, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb)
      for (int64_t m0 = 0; m0 < M; m0 += kQ8Rows) {
        const int64_t mb = std::min<int64_t>(kQ8Rows, M - m0);
#define CALL(MB_)                                                                                        \
  int4_q8_block<std::min(MB_, kQ8Rows)>(w + nb * block_bytes, K, gs, xq.q.data() + m0 * K,            \
                                        xq.d.data() + m0 * G, xq.s.data() + m0 * G, m0, nb, N, out); \
  break
        switch (mb) {
          case 1: CALL(1);
          case 2: CALL(2);
          case 3: CALL(3);
          case 4: CALL(4);
          case 5: CALL(5);
          case 6: CALL(6);
          case 7: CALL(7);
          default: CALL(8);
        }
#undef CALL
      }
  });
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)

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
// STREAM: wb is the packed weight in memory (prefetched ahead); false for a block decoded into scratch, already in
// L1/L2. scale: 16 per-output factors the sums are multiplied by before the store (int8 with per-output scales), or
// null.
template <int MB, bool STREAM = true>
void dense_block(const uint16_t* wb, int64_t K, const uint16_t* x, int64_t m0, int64_t nb, int64_t N,
                 const OutWriter& out, const float* scale = nullptr) {
  __m512 a0[MB], a1[MB];
  _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
  const int64_t pairs = K / 2;
  int64_t p = 0;
  for (; p + 2 <= pairs; p += 2) {
    if constexpr (STREAM) {
      prefetch<kDenseAhead>(wb + p * 32);
      prefetch<kDenseAhead>(wb + p * 32 + 32);
      prefetch<kL2Ahead, _MM_HINT_T1>(wb + p * 32);
      prefetch<kL2Ahead, _MM_HINT_T1>(wb + p * 32 + 32);
    }
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
  const __m512 s = scale ? _mm512_loadu_ps(scale) : _mm512_set1_ps(1.f);
  _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) {
    const __m512 v = _mm512_add_ps(a0[m], a1[m]);
    store16(out, m0 + m, nb * 16, N, scale ? _mm512_mul_ps(v, s) : v);
  }
}

// ---------------------------------------------------------------------------------------------- int4 / int2
// A block is [K / KC chunks of 64 bytes][G x 16 fp16 scales][G x 16 fp16 mins], KC = 8 (int4) or 16 (int2) codes of
// each row per chunk; w = q * scale + min.
//
// Rows per pass: up to 8 with the running totals in registers, NA accumulators per row; 9 to 16 (NA = 1) with one
// accumulator per row (up to 16 independent vdpbf16ps chains) and the totals in L1 (`RowTotals`), which 16
// accumulators leave no registers for (their update is three memory operations per row and group, against gs / 2
// multiply-adds). Why the wide pass: at 16 rows two passes of 8 each decoded every chunk, each with only 8 dependent
// chains, and came out ~20% behind the dense bf16 kernel on the same shapes. Single-threaded with the weights
// streamed from memory (int4-g128, SmolLM2's shapes), one wide pass took 15-30% less time than two 8-row passes at
// 12 to 32 rows, and at 16 rows matched or beat dense bf16. It stays exact (codes times activations, scaled per
// group), unlike decoding the block to bf16 first, which measured no faster here at 16 rows or more.
template <int MB, bool IN_L1 = (MB > 8)>
struct RowTotals {  // in registers
  __m512 v[MB];
  GLOWPLUG_VINLINE RowTotals() { _Pragma("GCC unroll 16") for (int m = 0; m < MB; ++m) v[m] = _mm512_setzero_ps(); }
  GLOWPLUG_VINLINE __m512 get(int m) const { return v[m]; }
  GLOWPLUG_VINLINE void set(int m, __m512 t) { v[m] = t; }
};
template <int MB>
struct RowTotals<MB, true> {  // in L1
  alignas(64) float v[MB][16] = {};
  GLOWPLUG_VINLINE __m512 get(int m) const { return _mm512_load_ps(v[m]); }
  GLOWPLUG_VINLINE void set(int m, __m512 t) { _mm512_store_ps(v[m], t); }
};

template <int BITS, int MB, int NA>
void intn_block(const uint8_t* blk, int64_t K, int64_t gs, const uint16_t* x, const float* xsum, int64_t m0,
                int64_t nb, int64_t N, const OutWriter& out) {
  static_assert(MB <= 8 || NA == 1, "from 9 rows on, one accumulator per row");
  constexpr int PLANES = 16 / BITS, KC = 2 * PLANES;
  const int64_t G = K / gs, chunks_per_group = gs / KC;
  const uint16_t* scales = reinterpret_cast<const uint16_t*>(blk + K * BITS * 2);
  const uint16_t* mins = scales + G * 16;
  const __m512i mask = _mm512_set1_epi16((1 << BITS) - 1);
  const __m512i expo = _mm512_set1_epi16(0x4300);
  const __m512 c128 = _mm512_set1_ps(128.f);
  RowTotals<MB> tot;
  const uint8_t* chunk = blk;
  for (int64_t g = 0; g < G; ++g) {
    __m512 acc[MB][NA];
    _Pragma("GCC unroll 16") for (int m = 0; m < MB; ++m) _Pragma("GCC unroll 4") for (int a = 0; a < NA; ++a)
      acc[m][a] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks_per_group; ++c, chunk += 64) {
      prefetch<kPackedAhead>(chunk);
      prefetch<kL2Ahead, _MM_HINT_T1>(chunk);
      const __m512i v = _mm512_loadu_si512(chunk);
      const int64_t k0 = (g * chunks_per_group + c) * KC;
      _Pragma("GCC unroll 16") for (int p = 0; p < PLANES; ++p) {
        const __m512i sh = p == 0 ? v : _mm512_srli_epi16(v, BITS * p);
        // (sh & mask) | expo in one ternary-logic op; the top plane has no higher bits to clear
        const __m512i w = p == PLANES - 1 ? _mm512_or_si512(sh, expo) : _mm512_ternarylogic_epi32(sh, mask, expo, 0xEA);
        _Pragma("GCC unroll 16") for (int m = 0; m < MB; ++m)
          acc[m][p % NA] = dp(acc[m][p % NA], w, bcast_pair(x + (m0 + m) * K + k0 + 2 * p));
      }
    }
    const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + g * 16)));
    const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mins + g * 16)));
    const __m512 adj = _mm512_fnmadd_ps(c128, s, mn);  // min - 128 * scale: takes the 128 offset back
    _Pragma("GCC unroll 16") for (int m = 0; m < MB; ++m) {
      __m512 a = acc[m][0];
      _Pragma("GCC unroll 4") for (int i = 1; i < NA; ++i) a = _mm512_add_ps(a, acc[m][i]);
      const __m512 t = _mm512_fmadd_ps(a, s, tot.get(m));
      tot.set(m, _mm512_fmadd_ps(adj, _mm512_set1_ps(xsum[(m0 + m) * G + g]), t));
    }
  }
  _Pragma("GCC unroll 16") for (int m = 0; m < MB; ++m) store16(out, m0 + m, nb * 16, N, tot.get(m));
}

// -------------------------------------------------------------------------------------------------------- int8
// A block is [K / 4 chunks of 64 bytes][G x 16 fp32 scales]; dword j of a chunk holds row j's codes at k0..k0 + 3 as
// unsigned bytes u = q + 128. vpdpbusd multiplies those with 4 signed activation bytes broadcast to every lane, so a
// chunk costs two multiply-adds and no decoding.
//
// The activations are taken to 16-bit fixed point first (`x16_digits`, reference kernels/reference.quantize_x16):
// per row and per 32 inputs, xq = round(x / s) with s = max|x| / 32639, split into two signed bytes xq = 256 hi + lo.
// Its error (at most s / 2, 2^-16 of the block's largest input) is far below the bf16 rounding the inputs already
// carry (2^-9 of each value), and it is what takes the decoding off the critical path: the previous nibble-plane
// kernel split each chunk into four planes for four bf16 dot products, and that arithmetic, not the weight stream,
// bounded it (speeds per shape: reports/kernels.md; the decode step: reports/decode-quantized.md). Per 32-input block
// the integer sum u xq - 128 sum xq = sum q xq is exact in int32 (|.| < 2^28) and is scaled by s in fp32.
constexpr int64_t kXBlock = 32;

struct X16 {
  std::vector<int8_t> hi, lo;  // [M, K]
  std::vector<float> scale;    // [M, K / 32]
  std::vector<int32_t> sum;    // [M, K / 32]: 128 * sum xq, the offset of the unsigned weight bytes
};

X16 x16_digits(const uint16_t* x, int64_t M, int64_t K) {
  const int64_t KB = K / kXBlock;
  X16 d{std::vector<int8_t>(static_cast<size_t>(M * K)), std::vector<int8_t>(static_cast<size_t>(M * K)),
        std::vector<float>(static_cast<size_t>(M * KB)), std::vector<int32_t>(static_cast<size_t>(M * KB))};
  const __m512i c128 = _mm512_set1_epi32(128), c255 = _mm512_set1_epi32(255);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < KB; ++b) {
      const int64_t at = m * K + b * kXBlock;
      const __m512 x0 = load_bf16x16(x + at), x1 = load_bf16x16(x + at + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
      const float s = amax / 32639.f;
      d.scale[m * KB + b] = s;
      if (s == 0.f) continue;  // all zero (the vectors start zeroed); NaN/inf inputs give NaN outputs via s
      const __m512 sv = _mm512_set1_ps(s);
      int32_t total = 0;
      for (int h = 0; h < 2; ++h) {
        const __m512i q = _mm512_cvtps_epi32(_mm512_div_ps(h ? x1 : x0, sv));  // round half to even
        const __m512i t = _mm512_add_epi32(q, c128);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(d.hi.data() + at + 16 * h), _mm512_cvtepi32_epi8(_mm512_srai_epi32(t, 8)));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(d.lo.data() + at + 16 * h),
                         _mm512_cvtepi32_epi8(_mm512_sub_epi32(_mm512_and_si512(t, c255), c128)));
        total += _mm512_reduce_add_epi32(q);
      }
      d.sum[m * KB + b] = 128 * total;
    }
  return d;
}

#ifdef GLOWPLUG_AMX
// For the AMX int8 kernel with per-output scales (amx::int8_digits_block): per row, x24 = round(x / s) with
// s = max|x| / 8355000 (a little under 127 * 65793 = 8355711, the most three balanced signed-byte digits hold, so
// the row maximum stays inside after x / s rounds), x24 = 65536 d2 + 256 d1 + d0.
// Its error, at most s / 2 = 2^-24 of the row's largest input, is far below the bf16 rounding the inputs carry; per
// row rather than per 32 inputs, so the integer sums run over the whole K with no rescaling. off: 128 * each
// digit's row sum, the unsigned weight bytes' offset (u = q + 128), so every digit's sum of q d is exact in int32.
struct X24 {
  std::vector<int8_t> d[3];     // [M, K]: d2, d1, d0
  std::vector<float> scale;     // [M]
  std::vector<int32_t> off[3];  // [M]
};

X24 x24_digits(const uint16_t* x, int64_t M, int64_t K) {
  X24 r;
  for (int i = 0; i < 3; ++i) {
    r.d[i].assign(static_cast<size_t>(M * K), 0);
    r.off[i].assign(static_cast<size_t>(M), 0);
  }
  r.scale.assign(static_cast<size_t>(M), 0.f);
  const __m512i c128 = _mm512_set1_epi32(128), c255 = _mm512_set1_epi32(255);
  const auto digit = [&](__m512i v) { return _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(v, c128), c255), c128); };
  for (int64_t m = 0; m < M; ++m) {
    const uint16_t* xr = x + m * K;
    __m512 amax = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(load_bf16x16(xr + k)));
    const float s = _mm512_reduce_max_ps(amax) / 8355000.f;
    r.scale[static_cast<size_t>(m)] = s;
    if (s == 0.f) continue;  // all zero; NaN/inf inputs give NaN outputs via s
    const __m512 sv = _mm512_set1_ps(s);
    __m512i sum[3] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
    for (int64_t k = 0; k < K; k += 16) {
      const __m512i q = _mm512_cvtps_epi32(_mm512_div_ps(load_bf16x16(xr + k), sv));  // round half to even
      const __m512i d0 = digit(q), q1 = _mm512_srai_epi32(_mm512_sub_epi32(q, d0), 8);
      const __m512i d1 = digit(q1), d2 = _mm512_srai_epi32(_mm512_sub_epi32(q1, d1), 8);
      const __m512i ds[3] = {d2, d1, d0};
      for (int i = 0; i < 3; ++i) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(r.d[i].data() + m * K + k), _mm512_cvtepi32_epi8(ds[i]));
        sum[i] = _mm512_add_epi32(sum[i], ds[i]);
      }
    }
    for (int i = 0; i < 3; ++i) r.off[i][static_cast<size_t>(m)] = 128 * _mm512_reduce_add_epi32(sum[i]);
  }
  return r;
}
#endif

inline __m512i bcast_quad(const int8_t* p) {  // (p[0..3]) in every 32-bit lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

template <int MB, int NA>
void int8_block(const uint8_t* blk, int64_t K, int64_t gs, const X16& xd, int64_t m0, int64_t nb, int64_t N,
                const OutWriter& out) {
  const int64_t G = K / gs, KB = K / kXBlock, blocks_per_group = gs / kXBlock;
  const float* scales = reinterpret_cast<const float*>(blk + K * 16);
  __m512 tot[MB];
  _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) tot[m] = _mm512_setzero_ps();
  const uint8_t* chunk = blk;
  for (int64_t g = 0; g < G; ++g) {
    __m512 gacc[MB];
    _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) gacc[m] = _mm512_setzero_ps();
    for (int64_t bb = 0; bb < blocks_per_group; ++bb) {
      const int64_t b = g * blocks_per_group + bb, k0 = b * kXBlock;
      __m512i hi[MB][NA], lo[MB][NA];
      _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) _Pragma("GCC unroll 4") for (int a = 0; a < NA; ++a)
        hi[m][a] = lo[m][a] = _mm512_setzero_si512();
      // 8 chunks of 4 inputs; chunk c into accumulator c % NA (a compile-time index once unrolled: an accumulator
      // array indexed at run time lives on the stack, and an Intel Xeon stalled on its store-reload).
      _Pragma("GCC unroll 8") for (int c = 0; c < kXBlock / 4; ++c, chunk += 64) {
        prefetch<kPackedAhead>(chunk);
        prefetch<kL2Ahead, _MM_HINT_T1>(chunk);
        const __m512i v = _mm512_loadu_si512(chunk);
        _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) {
          const int64_t at = (m0 + m) * K + k0 + 4 * c;
          hi[m][c % NA] = _mm512_dpbusd_epi32(hi[m][c % NA], v, bcast_quad(xd.hi.data() + at));
          lo[m][c % NA] = _mm512_dpbusd_epi32(lo[m][c % NA], v, bcast_quad(xd.lo.data() + at));
        }
      }
      _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) {
        __m512i h = hi[m][0], l = lo[m][0];
        _Pragma("GCC unroll 4") for (int a = 1; a < NA; ++a) {
          h = _mm512_add_epi32(h, hi[m][a]);
          l = _mm512_add_epi32(l, lo[m][a]);
        }
        const int64_t xb = (m0 + m) * KB + b;
        const __m512i exact = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(h, 8), l), _mm512_set1_epi32(xd.sum[xb]));
        gacc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), _mm512_set1_ps(xd.scale[xb]), gacc[m]);
      }
    }
    const __m512 s = _mm512_loadu_ps(scales + g * 16);
    _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) tot[m] = _mm512_fmadd_ps(gacc[m], s, tot[m]);
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

// Run `block(mb, m0, nb)` over every N-block in parallel and over the rows in passes of up to `rows`.
template <class F>
void for_blocks(int64_t M, int64_t NB, const F& block, int64_t rows = 8) {
  torch::stable::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb)
      for (int64_t m0 = 0; m0 < M; m0 += rows) block(std::min<int64_t>(rows, M - m0), m0, nb);
  });
}

// Rows per pass of the int2 kernel (intn_block's 16 accumulators from 9 rows on; int4 takes the integer section).
constexpr int64_t kWideRows = 16;
#define GLOWPLUG_WIDE_SWITCH(mb, CALL) \
  switch (mb) {                        \
    case 9: CALL(9); break;            \
    case 10: CALL(10); break;          \
    case 11: CALL(11); break;          \
    case 12: CALL(12); break;          \
    case 13: CALL(13); break;          \
    case 14: CALL(14); break;          \
    case 15: CALL(15); break;          \
    default: CALL(16); break;          \
  }


// Per thread, dequantized N-blocks (K / 32 tiles of 512 bf16 per N-block, 64-byte aligned; the AMX pair of blocks
// asks for 2K), reused across blocks and calls.
uint16_t* decode_scratch(int64_t K) {
  struct Free {
    void operator()(uint16_t* p) const { std::free(p); }
  };
  thread_local std::unique_ptr<uint16_t, Free> buf;
  thread_local int64_t have = 0;
  if (have < K) {
    buf.reset(static_cast<uint16_t*>(std::aligned_alloc(64, static_cast<size_t>(K) * 32)));
    have = K;
  }
  return buf.get();
}

#ifdef GLOWPLUG_AMX
// Batches of min_rows rows or more go to the AMX tile kernels (amx.h) where the OS grants the tile state.
bool use_amx(int64_t M, int64_t K, int64_t min_rows) { return M >= min_rows && K % 32 == 0 && amx::available(); }

// x with its rows padded by zeros to amx::padded_rows(M): tiles read whole 16-row tiles. Empty when no padding.
std::vector<uint16_t> padded_x(const uint16_t* x, int64_t M, int64_t K) {
  const int64_t Mp = amx::padded_rows(M);
  if (Mp == M) return {};
  std::vector<uint16_t> out(static_cast<size_t>(Mp * K), 0);
  std::memcpy(out.data(), x, static_cast<size_t>(M * K) * 2);
  return out;
}

#endif

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

// ------------------------------------------------------------------------------------- int8 batches, decoded
// From kDecodedRowsInt8 rows on, an int8 N-block is decoded to bf16 once (dequant.h, into a per-thread scratch
// block of K x 16 bf16, which stays in L1/L2) and the batch runs the dense kernel on it, 8 rows per pass. Why: the
// VNNI kernel needs two vpdpbusd per row and 4 inputs (the activations' two fixed-point bytes) where bf16 needs one
// vdpbf16ps per 2 inputs, the same count, but adds five operations per row and 32 inputs to scale each fixed-point
// block; the decode instead costs the same whatever the rows. Single-threaded, on SmolLM2's shapes with the weights
// streamed from memory, the decoded path ran 15-25% slower than the VNNI kernel at 12-16 rows, even at 24, a few
// percent faster at 32 and 10-15% faster at 64.
// Numerics: per-output scales keep the codes exact (|q| <= 128 is a bf16 number), scaled after the sum, and the bf16
// activations are multiplied exactly rather than in 16-bit fixed point; grouped int8 weights are rounded to bf16
// once (q * scale), as on the AMX tiles.
constexpr int64_t kDecodedRowsInt8 = 32;

// decode(nb, wb): N-block nb into wb (K x 16 bf16 in the dense layout); returns the 16 per-output scales to apply
// after the sums, or null.
template <class Decode>
void for_decoded_blocks(int64_t M, int64_t K, int64_t NB, const uint16_t* x, int64_t N, const OutWriter& out,
                        const Decode& decode) {
  torch::stable::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    uint16_t* wb = decode_scratch(K);
    for (int64_t nb = b0; nb < b1; ++nb) {
      const float* scale = decode(nb, wb);
      for (int64_t m0 = 0; m0 < M; m0 += 8) {
#define CALL(MB_, NA_) dense_block<MB_, false>(wb, K, x, m0, nb, N, out, scale)
        GLOWPLUG_MB_SWITCH(std::min<int64_t>(8, M - m0), CALL)
#undef CALL
      }
    }
  });
}

void dense_run(int64_t M, int64_t K, int64_t N, const uint16_t* xp, const uint16_t* w, const OutWriter& out) {
#ifdef GLOWPLUG_AMX
  if (use_amx(M, K, amx::kMinRowsDense)) {
    const std::vector<uint16_t> xpad = padded_x(xp, M, K);
    const uint16_t* xa = xpad.empty() ? xp : xpad.data();
    amx::for_block_pairs(M, K, xa, (N + 15) / 16, [&](int64_t nb, int) {
      const uint16_t* wb = w + nb * K * 16;
      return amx::block(
          [wb](int64_t t, bool) {
            amx::prefetch_span<kDenseAhead, 1024>(wb + t * 512);
            return wb + t * 512;
          },
          [&out, nb, N](int64_t m, __m512 v) { store16(out, m, nb * 16, N, v); });
    });
    return;
  }
#endif
  for_blocks(M, (N + 15) / 16, [&](int64_t mb, int64_t m0, int64_t nb) {
#define CALL(MB_, NA_) dense_block<MB_>(w + nb * K * 16, K, xp, m0, nb, N, out)
    GLOWPLUG_MB_SWITCH(mb, CALL)
#undef CALL
  });
}

void intn_run(int64_t M, int64_t K, int64_t N, const uint16_t* xp, const uint8_t* w, const OutWriter& out,
              int64_t bits, int64_t group_size, int64_t block_bytes) {
#ifdef GLOWPLUG_AMX
  if (use_amx(M, K, amx::kMinRowsIntN) && group_size % 32 == 0) {
    const std::vector<uint16_t> xpad = padded_x(xp, M, K);
    const uint16_t* xa = xpad.empty() ? xp : xpad.data();
    const auto run = [&](auto bits_c) {
      constexpr int B = decltype(bits_c)::value;
      amx::for_block_pairs(M, K, xa, (N + 15) / 16, [&](int64_t nb, int slot) {
        const uint8_t* blk = w + nb * block_bytes;
        uint16_t* scratch = decode_scratch(2 * K) + slot * K * 16;
        return amx::block(
            [blk, scratch, K, group_size](int64_t t, bool first) {
              if (first) {
                if (t == 0) intn_dequant<B, kPackedAhead>(blk, K, group_size, 0, scratch);
                if ((t + 1) * 32 < K) intn_dequant<B, kPackedAhead>(blk, K, group_size, t + 1, scratch);
              }
              return static_cast<const uint16_t*>(scratch + t * 512);
            },
            [&out, nb, N](int64_t m, __m512 v) { store16(out, m, nb * 16, N, v); });
      });
    };
    if (bits == 4)
      run(std::integral_constant<int, 4>{});
    else
      run(std::integral_constant<int, 2>{});
    return;
  }
#endif
  // int4 below the AMX batches: integer dot products on int8 activations (the int4 section above). Measured against
  // the bf16 kernels below at SmolLM2's shapes (2-core EPYC): equal at batch 1, 15-35% faster from 8 rows on.
  if (bits == 4) return int4_q8_run(M, K, N, xp, w, out, group_size, block_bytes);
  // int2 (the bf16-decode kernels below; int4 no longer takes them outside AMX)
  const std::vector<float> xs = group_sums(xp, M, K, group_size);
  const float* xsum = xs.data();
  for_blocks(M, (N + 15) / 16, [&](int64_t mb, int64_t m0, int64_t nb) {
    const uint8_t* blk = w + nb * block_bytes;
    if (mb > 8) {
#define CALL(MB_) intn_block<2, MB_, 1>(blk, K, group_size, xp, xsum, m0, nb, N, out)
      GLOWPLUG_WIDE_SWITCH(mb, CALL)
#undef CALL
    } else {
#define CALL(MB_, NA_) intn_block<2, MB_, NA_>(blk, K, group_size, xp, xsum, m0, nb, N, out)
      GLOWPLUG_MB_SWITCH(mb, CALL)
#undef CALL
    }
  }, kWideRows);
}

void int8_run(int64_t M, int64_t K, int64_t N, const uint16_t* xp, const uint8_t* w, const OutWriter& out,
              int64_t group_size, int64_t block_bytes) {
#ifdef GLOWPLUG_AMX
  if (M <= 16 && group_size == K && K % 64 == 0 && use_amx(M, K, amx::kMinRowsInt8)) {
    const X24 xd = x24_digits(xp, M, K);
    amx::for_blocks(M, (N + 15) / 16, [&](int64_t nb) {
      const uint8_t* blk = w + nb * block_bytes;
      const __m512 ws = _mm512_loadu_ps(reinterpret_cast<const float*>(blk + K * 16));
      alignas(64) int32_t c[3][256];
      amx::int8_digits_block(blk, K, xd.d[0].data(), xd.d[1].data(), xd.d[2].data(), c);
      for (int64_t m = 0; m < M; ++m) {  // each digit's sum of q d, then 65536 d2 + 256 d1 + d0, then the scales
        const size_t r = static_cast<size_t>(m);
        __m512 part[3];
        for (int i = 0; i < 3; ++i)
          part[i] = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_load_si512(c[i] + 16 * m), _mm512_set1_epi32(xd.off[i][r])));
        const __m512 v = _mm512_fmadd_ps(part[0], _mm512_set1_ps(65536.f), _mm512_fmadd_ps(part[1], _mm512_set1_ps(256.f), part[2]));
        store16(out, m, nb * 16, N, _mm512_mul_ps(v, _mm512_mul_ps(ws, _mm512_set1_ps(xd.scale[r]))));
      }
    });
    return;
  }
  if (use_amx(M, K, amx::kMinRowsInt8)) {
    const std::vector<uint16_t> xpad = padded_x(xp, M, K);
    const uint16_t* xa = xpad.empty() ? xp : xpad.data();
    const bool grouped = group_size < K;  // else the codes stay exact and the sums take the per-output scales
    amx::for_block_pairs(M, K, xa, (N + 15) / 16, [&](int64_t nb, int slot) {
      const uint8_t* blk = w + nb * block_bytes;
      uint16_t* scratch = decode_scratch(2 * K) + slot * K * 16;
      const __m512 s = grouped ? _mm512_set1_ps(1.f) : _mm512_loadu_ps(reinterpret_cast<const float*>(blk + K * 16));
      return amx::block(
          [blk, scratch, K, group_size](int64_t t, bool first) {
            if (first) {
              if (t == 0) int8_dequant<kPackedAhead>(blk, K, group_size, 0, scratch);
              if ((t + 1) * 32 < K) int8_dequant<kPackedAhead>(blk, K, group_size, t + 1, scratch);
            }
            return static_cast<const uint16_t*>(scratch + t * 512);
          },
          [&out, nb, N, s](int64_t m, __m512 v) { store16(out, m, nb * 16, N, _mm512_mul_ps(v, s)); });
    });
    return;
  }
#endif
  if (M >= kDecodedRowsInt8) {
    const bool grouped = group_size < K;
    for_decoded_blocks(M, K, (N + 15) / 16, xp, N, out, [&](int64_t nb, uint16_t* wb) -> const float* {
      const uint8_t* blk = w + nb * block_bytes;
      for (int64_t t = 0; t < K / 32; ++t) int8_dequant<kPackedAhead>(blk, K, group_size, t, wb);
      return grouped ? nullptr : reinterpret_cast<const float*>(blk + K * 16);
    });
    return;
  }
  const X16 xd = x16_digits(xp, M, K);
  for_blocks(M, (N + 15) / 16, [&](int64_t mb, int64_t m0, int64_t nb) {
#define CALL(MB_, NA_) int8_block<MB_, NA_>(w + nb * block_bytes, K, group_size, xd, m0, nb, N, out)
    GLOWPLUG_MB_SWITCH(mb, CALL)
#undef CALL
  });
}

#else  // no AVX512-BF16 / VNNI: the portable kernels
// Plain C++ on the 16-lane vectors of common.h (F16), vectorized over the 16 rows of an N-block (one lane per row),
// so they compile at every ISA level: 2 AVX2 registers per F16 in the avx2 build, 1 in the avx512 one, 4 SSE2 or
// NEON in the portable one. Codes are decoded with integer masks and conversions only (no bf16 trick), and every
// product is an fp32 multiply-add:
//   int4/int2  per group, acc = sum q x, then y += scale * acc + min * sum x (w = q * scale + min, regrouped);
//   int8       per group, acc = sum u x with the stored bytes u = q + 128, then y += scale * (acc - 128 sum x). The
//              activations stay in fp32 (the AVX512 kernel's 16-bit fixed point is only a VNNI operand format), so
//              these results are, if anything, closer to the fp32 product than that kernel's.
// Decoding without shifts: a code at bit offset o is taken as (word & (mask << o)), converted, and multiplied with
// an activation pre-scaled by 2^-o (`scaled_x`, exact: a power of two); only the top code of a word, whose bits
// would turn into the sign, is shifted down instead. Batches: a chunk is decoded once per kPortRows activation rows,
// whose accumulators stay in registers.
#if defined(__AVX512F__)
constexpr int kPortRows = 8;  // 32 vector registers: 8 accumulators and 8 totals
#else
constexpr int kPortRows = 4;
#endif

inline void store16(const OutWriter& out, int64_t m, int64_t n0, int64_t N, F16 v) {
  float a[16];
  vstore(a, v);
  const int64_t n = std::min<int64_t>(16, N - n0);
  for (int64_t i = 0; i < n; ++i) out.put(m, n0 + i, a[i]);
}

template <class F>
void for_blocks(int64_t M, int64_t NB, const F& block) {
  torch::stable::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb)
      for (int64_t m0 = 0; m0 < M; m0 += kPortRows) block(std::min<int64_t>(kPortRows, M - m0), m0, nb);
  });
}

// mb <= kPortRows: the cases above it never run, and std::min keeps them from being compiled as separate kernels
#define GLOWPLUG_PORT_SWITCH(mb, CALL)               \
  switch (mb) {                                      \
    case 1: CALL(1); break;                          \
    case 2: CALL(2); break;                          \
    case 3: CALL(3); break;                          \
    case 4: CALL(std::min(4, kPortRows)); break;     \
    case 5: CALL(std::min(5, kPortRows)); break;     \
    case 6: CALL(std::min(6, kPortRows)); break;     \
    case 7: CALL(std::min(7, kPortRows)); break;     \
    default: CALL(kPortRows); break;                 \
  }

// x [M, K] bf16 -> fp32, input k multiplied by 2^-o for the bit offset o its code has in a word of a chunk of KC
// inputs (below), or by 1 for the word's top code (dense bf16: BITS = 16, both codes on top, all factors 1).
template <int BITS>
constexpr int code_offset(int s) {  // s: the input's place in its chunk
  return BITS == 8 ? 8 * s : BITS * (s / 2) + 16 * (s % 2);
}
template <int BITS>
constexpr bool top_code(int s) { return code_offset<BITS>(s) + BITS == 32; }

template <int BITS>
std::vector<float> scaled_x(const uint16_t* x, int64_t M, int64_t K) {
  constexpr int KC = BITS == 8 ? 4 : 32 / BITS;
  float f[KC];
  for (int s = 0; s < KC; ++s) f[s] = top_code<BITS>(s) ? 1.f : std::ldexp(1.f, -code_offset<BITS>(s));
  std::vector<float> out(static_cast<size_t>(M * K));
  for (int64_t i = 0; i < M * K; ++i) out[static_cast<size_t>(i)] = bf16_to_f32(x[i]) * f[i % KC];
  return out;
}

// Activation sums per (row, group), in fp32 from the bf16 inputs.
std::vector<float> group_sums(const uint16_t* x, int64_t M, int64_t K, int64_t gs) {
  const int64_t G = K / gs;
  std::vector<float> out(static_cast<size_t>(M * G));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      const uint16_t* p = x + m * K + g * gs;
      F16 a = vsplat(0.f);
      int64_t k = 0;
      for (; k + 16 <= gs; k += 16) a += vload_bf16(p + k);
      float s = vsum(a);
      for (; k < gs; ++k) s += bf16_to_f32(p[k]);
      out[static_cast<size_t>(m * G + g)] = s;
    }
  return out;
}

// Code (of BITS bits) number s of each row's 32-bit word (w: 16 rows' words) as fp32, times 2^o (see above).
template <int BITS, int S>
GLOWPLUG_VINLINE F16 code(U16 w) {
  constexpr int o = code_offset<BITS>(S);
  constexpr uint32_t mask = (1u << BITS) - 1;
  if constexpr (top_code<BITS>(S))
    return to_float(bitcast<vi32>(w >> o));
  else
    return to_float(bitcast<vi32>(w & (mask << o)));
}

// acc[m] += code s of w * xs[row m0 + m][k0 + s], for s in [S, KC): one code decoded for all MB rows at a time.
template <int BITS, int KC, int MB, int S = 0>
GLOWPLUG_VINLINE void madd_codes(F16 (&acc)[MB], U16 w, const float* xs, int64_t K, int64_t k0) {
  if constexpr (S < KC) {
    const F16 q = code<BITS, S>(w);
    _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) acc[m] += q * xs[m * K + k0 + S];
    madd_codes<BITS, KC, MB, S + 1>(acc, w, xs, K, k0);
  }
}

// ------------------------------------------------------------------------------------------------- dense bf16
// A chunk is 16 32-bit words, row j's (k, k + 1) bf16 pair in word j (little-endian: k in the low half), so the
// pair widens to fp32 with one shift and one mask. xf: the rows' fp32 activations (from row m0).
template <int MB>
void dense_block(const uint16_t* wb, int64_t K, const float* xf, int64_t m0, int64_t nb, int64_t N,
                 const OutWriter& out) {
  F16 a0[MB], a1[MB];
  _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) a0[m] = a1[m] = vsplat(0.f);
  for (int64_t p = 0; p < K / 2; ++p) {
    prefetch<kDenseAhead>(wb + p * 32);
    prefetch<kL2Ahead, kHintT1>(wb + p * 32);
    const U16 w = vload<U16>(wb + p * 32);
    const F16 lo = bitcast<vf32>(w << 16), hi = bitcast<vf32>(w & 0xffff0000u);
    _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) {
      a0[m] += lo * xf[m * K + 2 * p];
      a1[m] += hi * xf[m * K + 2 * p + 1];
    }
  }
  _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) store16(out, m0 + m, nb * 16, N, a0[m] + a1[m]);
}

// ---------------------------------------------------------------------------------------- int4 / int2 / int8
// Layout as above: [K / KC chunks of 64 bytes] (K * BITS * 2 bytes of codes), then per group the 16 rows' factors:
//   int4/int2  KC = 32 / BITS; [G x 16 fp16 scales][G x 16 fp16 mins], w = q * scale + min.
//   int8       KC = 4, word j holds row j's bytes u = q + 128 at k0..k0 + 3; [G x 16 fp32 scales],
//              w = (u - 128) * scale.
// xs: scaled_x<BITS> from row m0; xsum: group_sums from row m0.
template <int BITS, int MB>
void packed_block(const uint8_t* blk, int64_t K, int64_t gs, const float* xs, const float* xsum, int64_t m0,
                  int64_t nb, int64_t N, const OutWriter& out) {
  constexpr int KC = BITS == 8 ? 4 : 32 / BITS;
  const int64_t G = K / gs, chunks_per_group = gs / KC;
  const uint16_t* scales = reinterpret_cast<const uint16_t*>(blk + K * BITS * 2);  // int4/int2: fp16, then the mins
  const uint16_t* mins = scales + G * 16;
  const float* scales32 = reinterpret_cast<const float*>(blk + K * BITS * 2);  // int8: fp32
  F16 tot[MB];
  _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) tot[m] = vsplat(0.f);
  const uint8_t* chunk = blk;
  for (int64_t g = 0; g < G; ++g) {
    F16 acc[MB];
    _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) acc[m] = vsplat(0.f);
    for (int64_t c = 0; c < chunks_per_group; ++c, chunk += 64) {
      prefetch<kPackedAhead>(chunk);
      prefetch<kL2Ahead, kHintT1>(chunk);
      madd_codes<BITS, KC, MB>(acc, vload<U16>(chunk), xs, K, (g * chunks_per_group + c) * KC);
    }
    if constexpr (BITS == 8) {
      const F16 s = vload<F16>(scales32 + g * 16);
      _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) tot[m] += s * (acc[m] - 128.f * xsum[m * G + g]);
    } else {
      const F16 s = vload_f16(scales + g * 16), mn = vload_f16(mins + g * 16);
      _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) tot[m] += s * acc[m] + mn * xsum[m * G + g];
    }
  }
  _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) store16(out, m0 + m, nb * 16, N, tot[m]);
}

// y = x times a packed weight of BITS bits through packed_block, kPortRows activation rows per pass.
template <int BITS>
void packed_run(int64_t M, int64_t K, int64_t N, const uint16_t* xp, const uint8_t* w, const OutWriter& out,
                int64_t group_size, int64_t block_bytes) {
  const int64_t G = K / group_size;
  const std::vector<float> xsum = group_sums(xp, M, K, group_size);
  const std::vector<float> xs = scaled_x<BITS>(xp, M, K);
  for_blocks(M, (N + 15) / 16, [&](int64_t mb, int64_t m0, int64_t nb) {
    const uint8_t* blk = w + nb * block_bytes;
    const float *xr = xs.data() + m0 * K, *sr = xsum.data() + m0 * G;
#define CALL(MB_) packed_block<BITS, MB_>(blk, K, group_size, xr, sr, m0, nb, N, out)
    GLOWPLUG_PORT_SWITCH(mb, CALL)
#undef CALL
  });
}

void dense_run(int64_t M, int64_t K, int64_t N, const uint16_t* xp, const uint16_t* w, const OutWriter& out) {
  const std::vector<float> xf = scaled_x<16>(xp, M, K);
  for_blocks(M, (N + 15) / 16, [&](int64_t mb, int64_t m0, int64_t nb) {
#define CALL(MB_) dense_block<MB_>(w + nb * K * 16, K, xf.data() + m0 * K, m0, nb, N, out)
    GLOWPLUG_PORT_SWITCH(mb, CALL)
#undef CALL
  });
}

void intn_run(int64_t M, int64_t K, int64_t N, const uint16_t* xp, const uint8_t* w, const OutWriter& out,
              int64_t bits, int64_t group_size, int64_t block_bytes) {
#if defined(__AVX2__)
  if (bits == 4) return int4_q8_run(M, K, N, xp, w, out, group_size, block_bytes);
#endif
  if (bits == 4) return packed_run<4>(M, K, N, xp, w, out, group_size, block_bytes);
  packed_run<2>(M, K, N, xp, w, out, group_size, block_bytes);
}

void int8_run(int64_t M, int64_t K, int64_t N, const uint16_t* xp, const uint8_t* w, const OutWriter& out,
              int64_t group_size, int64_t block_bytes) {
  packed_run<8>(M, K, N, xp, w, out, group_size, block_bytes);
}

#undef GLOWPLUG_PORT_SWITCH
#endif

// The ops: their argument checks, then this build's body in the shared frame.
Tensor dense_blocked(Tensor x, Tensor wp, int64_t N) {
  const int64_t K = x.size(1);
  STD_TORCH_CHECK(K % 2 == 0, "dense_blocked: K must be even");
  check_blocked(x, wp, N, K, K * 32, "dense_blocked");
  return run_blocked<uint16_t>(x, wp, N, dense_run);
}

Tensor intn_blocked(Tensor x, Tensor wp, int64_t N, int64_t bits, int64_t group_size) {
  const int64_t block_bytes = intn_block_bytes(x, wp, N, bits, group_size);
  return run_blocked<uint8_t>(x, wp, N, intn_run, bits, group_size, block_bytes);
}

Tensor int8_blocked(Tensor x, Tensor wp, int64_t N, int64_t group_size) {
  return run_blocked<uint8_t>(x, wp, N, int8_run, group_size, int8_block_bytes(x, wp, N, group_size));
}

}  // namespace
}  // namespace glowplug

STABLE_TORCH_LIBRARY_IMPL(glowplug_native, CPU, m) {
  m.impl("dense_blocked", TORCH_BOX(&glowplug::dense_blocked));
  m.impl("intn_blocked", TORCH_BOX(&glowplug::intn_blocked));
  m.impl("int8_blocked", TORCH_BOX(&glowplug::int8_blocked));
}

