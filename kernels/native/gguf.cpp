// Linear layers and embedding rows computed on GGUF blocks as the file stores them: the weights are views of the
// mapped .gguf (no copy, no repack), so a decode step reads exactly the file's bytes per weight (Q4_K 4.5 bits, Q5_0
// 5.5, Q6_K 6.56, Q8_0 8.5) and a start maps the file instead of converting it.
//
// Types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (32-weight blocks), Q4_K, Q5_K, Q6_K (256-weight super-blocks), and the
// floats F32, F16, BF16 (for a float part of a fused layer). The block layouts are ggml's (see ggml-common.h's
// block_q4_K etc.); kernels/reference.py `gguf_linear` is the oracle, de-quantizing with the gguf package.
//
// Arithmetic, the same for every row whatever the batch (batch invariance): each activation row is taken to int8
// on its own, per 32 inputs for the 32-weight blocks ("q8b": scale d = amax / 127, and s = d * sum(q)) and per 256
// for the super-blocks ("q8k": one scale, plus the sums of q per 16 and per 32 inputs), rounding half to even. The
// weight codes times the activation bytes are integer dot products (exact), scaled per block or super-block in fp32
// in a fixed order (every fused multiply-add spelled out, so the compiler's contraction of a*b+c cannot differ
// between two instantiations). A batch only changes how many activation rows share one decoded weight block, never a
// row's arithmetic. Per type (x = d_x * q_x):
//   Q4_K/Q5_K  d * d_x * sum_j sc_j * <q, q_x>_j  -  dmin * d_x * sum_j m_j * sum32_j     (j: 32-weight sub-blocks)
//   Q6_K       d * d_x * sum_g sc_g * (<q, q_x>_g - 32 * sum16_g)                         (g: 16-weight groups)
//   Q4_0/Q5_0  d * d_x * <q, q_x>  -  8 (16) * d * s_x;   Q4_1/Q5_1  d * d_x * <q, q_x>  +  m * s_x;   Q8_0  d * d_x * <q, q_x>
// AVX2 (and up): the codes are unsigned bytes, multiplied with the signed activation bytes by vpmaddubsw, the pairs
// summed (and for the K-quants scaled by their integer sub-block scale) by vpmaddwd; Q8_0's signed codes use the sign
// trick. None of these saturates (the largest pair sum is 2 * 63 * 127 for Q6_K). The portable level computes the
// same integer sums in plain loops.
//
// Work split: the weight rows of all segments are cut into one contiguous byte range per thread; each thread runs its
// rows against all activation rows, in blocks of activation rows that stay in L2 (a prompt re-reads the weights once
// per block), MR rows at a time so one decoded weight block serves MR rows. From a few activation rows (takes_gemm: a
// prompt, or a batch of that many sequences) the quantized segments take a GEMM path instead (AVX2 and up): a panel
// of weight rows is unpacked once (K-quants: into bytes and 16-bit scale vectors; 32-weight blocks: 8 rows side by
// side as the lanes of each vector) and every activation row runs against it in register tiles, with the same
// integer sums and the same fp32 operations per row as the tiles above, so a row's output is the same bits on either
// path.
#include "common.h"

#include <memory>

namespace glowplug {
namespace {

constexpr int64_t kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13,
                  kQ6_K = 14, kBF16 = 30;

struct Fmt {
  int64_t weights;  // per block
  int64_t bytes;    // per block
  bool kquant;      // 256-weight super-block, q8k activations
  bool is_float;
};

bool fmt_of(int64_t t, Fmt* f) {
  switch (t) {
    case kF32: *f = {1, 4, false, true}; return true;
    case kF16: *f = {1, 2, false, true}; return true;
    case kBF16: *f = {1, 2, false, true}; return true;
    case kQ4_0: *f = {32, 18, false, false}; return true;
    case kQ4_1: *f = {32, 20, false, false}; return true;
    case kQ5_0: *f = {32, 22, false, false}; return true;
    case kQ5_1: *f = {32, 24, false, false}; return true;
    case kQ8_0: *f = {32, 34, false, false}; return true;
    case kQ4_K: *f = {256, 144, true, false}; return true;
    case kQ5_K: *f = {256, 176, true, false}; return true;
    case kQ6_K: *f = {256, 210, true, false}; return true;
    default: return false;
  }
}

inline float fp16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return f16_to_f32(v);
}

// ---------------------------------------------------------------------------------------------- activations
// One call's activations, quantized once and shared by every segment. Rows are contiguous: q [M, K], scales and sums
// [M, K / block].
struct Act {
  int64_t M = 0, K = 0;
  std::vector<float> xf;                      // fp32 copy, for float segments
  std::vector<int8_t> qb;                     // q8b
  std::vector<float> db, sb;                  // q8b: d and d * sum(q) per 32
  std::vector<int8_t> qk;                     // q8k
  std::vector<int8_t> qki;                    // q8k in the prompt GEMM's pair order (AVX2), else empty
  std::vector<float> dk;                      // q8k: d per 256
  std::vector<int16_t> s16, s32;              // q8k: sum(q) per 16 and per 32
};

// Round x * id to the nearest integer, ties to even (as torch.round), for |x * id| <= 127.
inline int8_t q8(float v) { return static_cast<int8_t>(std::nearbyint(v)); }

// Quantize n (32 or 256) fp32 values to int8 with one scale; returns d and writes q.
inline float quantize_block(const float* x, int64_t n, int8_t* q) {
  float amax = 0.f;
#if defined(__AVX2__)
  __m256 m = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t i = 0; i < n; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  amax = _mm_cvtss_f32(h);
#else
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
#endif
  if (!(amax > 0.f)) {  // all zeros (or NaN: propagated through d)
    std::memset(q, 0, n);
    return amax == 0.f ? 0.f : amax;
  }
  const float id = 127.f / amax;
#if defined(__AVX2__)
  const __m256 vid = _mm256_set1_ps(id);
  for (int64_t i = 0; i < n; i += 32) {
    __m256i a = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    __m256i b = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8), vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    __m256i c = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i + 16), vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    __m256i d = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i + 24), vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    __m256i ab = _mm256_packs_epi32(a, b), cd = _mm256_packs_epi32(c, d);
    __m256i r = _mm256_packs_epi16(ab, cd);
    // packs work per 128-bit lane: the dwords come out in the order 0 2 4 6 1 3 5 7 of 4-byte groups
    r = _mm256_permutevar8x32_epi32(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), r);
  }
#else
  for (int64_t i = 0; i < n; ++i) q[i] = q8(x[i] * id);
#endif
  return amax / 127.f;
}

inline int32_t sum_i8(const int8_t* q, int64_t n) {
  int32_t s = 0;
  for (int64_t i = 0; i < n; ++i) s += q[i];
  return s;
}

void quantize_rows(Act& a, const Tensor& x, bool need_b, bool need_k, bool need_f) {
  const int64_t M = x.size(0), K = x.size(1);
  a.M = M;
  a.K = K;
  if (need_f) a.xf.resize(M * K);
  if (need_b) {
    a.qb.resize(M * K);
    a.db.resize(M * (K / 32));
    a.sb.resize(M * (K / 32));
  }
  if (need_k) {
    a.qk.resize(M * K);
    a.dk.resize(M * (K / 256));
    a.s16.resize(M * (K / 16));
    a.s32.resize(M * (K / 32));
  }
  const bool bf16 = x.scalar_type() == ScalarType::BFloat16;
  const void* base = x.data_ptr();
  auto row = [&](int64_t m, float* buf) {
    float* xf = need_f ? a.xf.data() + m * K : buf;
    if (bf16) {
      const uint16_t* src = static_cast<const uint16_t*>(base) + m * K;
      for (int64_t k = 0; k < K; ++k) xf[k] = bf16_to_f32(src[k]);
    } else {
      std::memcpy(xf, static_cast<const float*>(base) + m * K, K * sizeof(float));
    }
    if (need_b) {
      for (int64_t b = 0; b < K / 32; ++b) {
        int8_t* q = a.qb.data() + m * K + b * 32;
        const float d = quantize_block(xf + b * 32, 32, q);
        a.db[m * (K / 32) + b] = d;
        a.sb[m * (K / 32) + b] = d * static_cast<float>(sum_i8(q, 32));
      }
    }
    if (need_k) {
      for (int64_t b = 0; b < K / 256; ++b) {
        int8_t* q = a.qk.data() + m * K + b * 256;
        a.dk[m * (K / 256) + b] = quantize_block(xf + b * 256, 256, q);
        for (int g = 0; g < 16; ++g) {
          const int32_t s = sum_i8(q + g * 16, 16);
          a.s16[m * (K / 16) + b * 16 + g] = static_cast<int16_t>(s);
        }
        for (int g = 0; g < 8; ++g)
          a.s32[m * (K / 32) + b * 8 + g] =
              static_cast<int16_t>(a.s16[m * (K / 16) + b * 16 + 2 * g] + a.s16[m * (K / 16) + b * 16 + 2 * g + 1]);
      }
    }
  };
  if (M * K < (1 << 15)) {
    std::vector<float> buf(K);
    for (int64_t m = 0; m < M; ++m) row(m, buf.data());
    return;
  }
  torch::stable::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    std::vector<float> buf(K);
    for (int64_t m = m0; m < m1; ++m) row(m, buf.data());
  });
}

// One tile of activation rows (row r of the tile is activation row m0 + r), as plain pointers so that the kernels'
// inner loops do no index arithmetic.
template <int MR>
struct Rows {
  const int8_t* qk_[MR];
  const int8_t* qi_[MR];
  const float* dk_[MR];
  const int16_t* s16_[MR];
  const int16_t* s32_[MR];
  const int8_t* qb_[MR];
  const float* db_[MR];
  const float* sb_[MR];
  const float* xf_[MR];
  Rows(const Act& a, int64_t m0) {
    const int64_t K = a.K;
    for (int r = 0; r < MR; ++r) {
      const int64_t m = m0 + r;
      qk_[r] = a.qk.empty() ? nullptr : a.qk.data() + m * K;
      qi_[r] = a.qki.empty() ? nullptr : a.qki.data() + m * K;
      dk_[r] = a.dk.empty() ? nullptr : a.dk.data() + m * (K / 256);
      s16_[r] = a.s16.empty() ? nullptr : a.s16.data() + m * (K / 16);
      s32_[r] = a.s32.empty() ? nullptr : a.s32.data() + m * (K / 32);
      qb_[r] = a.qb.empty() ? nullptr : a.qb.data() + m * K;
      db_[r] = a.db.empty() ? nullptr : a.db.data() + m * (K / 32);
      sb_[r] = a.sb.empty() ? nullptr : a.sb.data() + m * (K / 32);
      xf_[r] = a.xf.empty() ? nullptr : a.xf.data() + m * K;
    }
  }
  const int8_t* qk(int r) const { return qk_[r]; }
  const int8_t* qi(int r) const { return qi_[r]; }
  const float* dk(int r) const { return dk_[r]; }
  const int16_t* s16(int r) const { return s16_[r]; }
  const int16_t* s32(int r) const { return s32_[r]; }
  const int8_t* qb(int r) const { return qb_[r]; }
  const float* db(int r) const { return db_[r]; }
  const float* sb(int r) const { return sb_[r]; }
  const float* xf(int r) const { return xf_[r]; }
};

// The 8 6-bit scales and 8 6-bit mins of a Q4_K/Q5_K super-block from its 12 packed bytes: sub-blocks 0-3 in the
// low 6 bits of bytes 0-3 (scales) and 4-7 (mins); 4-7 in the nibbles of bytes 8-11 with their top 2 bits in the
// top 2 bits of bytes 0-3 (scales) and 4-7 (mins). out[0..7] scales, out[8..15] mins.
GLOWPLUG_VINLINE void k_scales(const uint8_t* s, uint8_t* out) {
  uint32_t u[3];
  std::memcpy(u, s, 12);
  const uint32_t lo6 = 0x3f3f3f3fu, lo4 = 0x0f0f0f0fu, lo2 = 0x03030303u;
  const uint32_t sc03 = u[0] & lo6, mn03 = u[1] & lo6;
  const uint32_t sc47 = (u[2] & lo4) | (((u[0] >> 6) & lo2) << 4);
  const uint32_t mn47 = ((u[2] >> 4) & lo4) | (((u[1] >> 6) & lo2) << 4);
  const uint32_t w[4] = {sc03, sc47, mn03, mn47};
  std::memcpy(out, w, 16);
}

// Whether a segment of type t takes the prompt GEMM path (AVX2 and up) for M activation rows; below its threshold,
// and for the float parts always, the GEMV tiles decode the blocks in registers. The 4- and 5-bit 32-weight blocks
// unpack cheaply enough to gain from 8 rows on; the K-quants and Q8_0 (twice the panel) from 16.
constexpr int64_t kGemmMinM = 16, kGemmMinMq32 = 8;
inline bool takes_gemm(int64_t t, int64_t M) {
  if (t == kF32 || t == kF16 || t == kBF16) return false;
  return M >= (t == kQ4_0 || t == kQ4_1 || t == kQ5_0 || t == kQ5_1 ? kGemmMinMq32 : kGemmMinM);
}

// Bytes of a 32-weight block of type T.
template <int64_t T>
constexpr int64_t q32_bytes() {
  return T == kQ4_0 ? 18 : T == kQ4_1 ? 20 : T == kQ5_0 ? 22 : T == kQ5_1 ? 24 : 34;
}

#if defined(__AVX2__)
// ------------------------------------------------------------------------------------------------- AVX2
// Every kernel below computes a tile of NR weight rows against MR activation rows: one decoded weight block serves MR
// rows and one loaded activation block NR weight rows. A (weight row, activation row) pair's arithmetic does not
// depend on the tile it is computed in.
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float hsum128(__m128 s) {
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
GLOWPLUG_VINLINE __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
GLOWPLUG_VINLINE __m128i load128(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }

// Unsigned codes (< 64) times signed activation bytes, pairs summed, then times 16-bit scales and pairs summed.
GLOWPLUG_VINLINE __m256i dot_scaled(__m256i codes, __m256i x, __m256i scale16) {
  return _mm256_madd_epi16(scale16, _mm256_maddubs_epi16(codes, x));
}

GLOWPLUG_VINLINE void prefetch_w(const uint8_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0); }
constexpr int64_t kAhead = 4096;  // bytes of the weight stream fetched ahead of the block being computed

// k_scales in vector registers: the 8 scales and 8 mins of a Q4_K/Q5_K super-block as 16-bit lanes (scales 0-7, mins
// 8-15), from the 12 bytes at p (16 are loaded: the 4 after them are the block's own codes, masked away).
GLOWPLUG_VINLINE __m256i k_scales16(const uint8_t* p) {
  const __m128i u = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  // a: [s0-3, s8-11, s4-7, s8-11]; top: the high 2 bits of s0-3 (for scales 4-7) and s4-7 (for mins 4-7), in place
  const __m128i a = _mm_shuffle_epi8(u, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
  const __m128i hi = _mm_shuffle_epi8(u, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
  const __m128i top = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(hi, 6), _mm_set1_epi8(0x03)), 4);
  const __m128i low6 = _mm_and_si128(a, _mm_set1_epi8(0x3F));  // scales 0-3, mins 0-3
  const __m128i nib_lo = _mm_and_si128(a, _mm_set1_epi8(0x0F));  // scales 4-7: low nibbles of s8-11
  const __m128i nib_hi = _mm_and_si128(_mm_srli_epi16(a, 4), _mm_set1_epi8(0x0F));  // mins 4-7: high nibbles
  const __m128i first = _mm_setr_epi8(-1, -1, -1, -1, 0, 0, 0, 0, -1, -1, -1, -1, 0, 0, 0, 0);
  const __m128i minsel = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, -1, -1, -1, -1);
  const __m128i nib = _mm_blendv_epi8(nib_lo, nib_hi, minsel);
  const __m128i bytes = _mm_blendv_epi8(_mm_or_si128(nib, top), low6, first);
  // bytes: [sc0-3, sc4-7, m0-3, m4-7]
  return _mm256_cvtepu8_epi16(bytes);
}

// Shuffle masks that broadcast 16-bit lane j (j = 0..7) of each 128-bit half to all 8 lanes of that half, 32 bytes
// each, in order of j.
alignas(32) constexpr uint8_t kBcast16[256] = {
#define GLOWPLUG_B16(j) 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, \
  2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1
    GLOWPLUG_B16(0), GLOWPLUG_B16(0), GLOWPLUG_B16(1), GLOWPLUG_B16(1), GLOWPLUG_B16(2), GLOWPLUG_B16(2),
    GLOWPLUG_B16(3), GLOWPLUG_B16(3), GLOWPLUG_B16(4), GLOWPLUG_B16(4), GLOWPLUG_B16(5), GLOWPLUG_B16(5),
    GLOWPLUG_B16(6), GLOWPLUG_B16(6), GLOWPLUG_B16(7), GLOWPLUG_B16(7)
#undef GLOWPLUG_B16
};

// Shuffle mask that broadcasts 16-bit lane j of each 128-bit half to all 8 lanes of that half.
GLOWPLUG_VINLINE __m256i bcast16(int j) {
  const int8_t lo = static_cast<int8_t>(2 * j), hi = static_cast<int8_t>(2 * j + 1);
  return _mm256_setr_epi8(lo, hi, lo, hi, lo, hi, lo, hi, lo, hi, lo, hi, lo, hi, lo, hi, lo, hi, lo, hi, lo, hi,
                          lo, hi, lo, hi, lo, hi, lo, hi, lo, hi);
}

// Q4_K (144 bytes: d, dmin, 12 scale bytes, 128 nibble bytes; chunk c of 64 weights: low nibbles of bytes 32c..32c+31
// are sub-block 2c, high nibbles sub-block 2c + 1) and Q5_K (176 bytes: the same plus 32 bytes of fifth bits before
// the nibbles: bit j of byte l is weight l of sub-block j).
template <int NR, int MR, bool FIVE>
void kq45_tile(const uint8_t* const* w, int64_t nsb, const Rows<MR>& x, float (*res)[MR]) {
  constexpr int64_t kBytes = FIVE ? 176 : 144;
  __m256 acc[NR][MR];
  __m128 accm[NR][MR];
  for (int n = 0; n < NR; ++n)
    for (int r = 0; r < MR; ++r) acc[n][r] = _mm256_setzero_ps(), accm[n][r] = _mm_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0x0F), m1 = _mm256_set1_epi8(0x01);
  for (int64_t i = 0; i < nsb; ++i) {
    // Per weight row: its 8 scales for the chunks below, and its mins' part of the dot product, taken now so that
    // only the scales stay live through the chunks (fewer registers: no spills).
    __m256i sc16[NR], hb[NR];
    _Pragma("GCC unroll 4") for (int n = 0; n < NR; ++n) {
      const uint8_t* b = w[n] + i * kBytes;
      for (int64_t off = 0; off < kBytes; off += 64) prefetch_w(b + kAhead + off);
      const __m256i sm16 = k_scales16(b + 4);
      sc16[n] = _mm256_permute2x128_si256(sm16, sm16, 0x00);  // scales 0-7 in both halves
      const __m128i mn16 = _mm256_extracti128_si256(sm16, 1);
      const __m128 dmin = _mm_cvtph_ps(_mm_cvtsi32_si128(b[2] | (b[3] << 8)));
      _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
        const __m128i prod = _mm_madd_epi16(mn16, load128(x.s32(r) + i * 8));
        const __m128 scale = _mm_broadcastss_ps(_mm_mul_ss(dmin, _mm_set_ss(x.dk(r)[i])));  // dmin * dx
        accm[n][r] = _mm_fmadd_ps(scale, _mm_cvtepi32_ps(prod), accm[n][r]);
      }
      if constexpr (FIVE) hb[n] = load256(b + 16);
    }
    __m256i sumi[NR][MR];
    for (int n = 0; n < NR; ++n)
      for (int r = 0; r < MR; ++r) sumi[n][r] = _mm256_setzero_si256();
    // Weight rows outer, activation rows inner: one row's decoded chunk (four registers) is live at a time, and the
    // activation bytes are reloaded from L1 for each weight row rather than held.
    _Pragma("GCC unroll 4") for (int c = 0; c < 4; ++c) {
      const __m256i bl = load256(kBcast16 + 64 * c), bh = load256(kBcast16 + 64 * c + 32);
      _Pragma("GCC unroll 4") for (int n = 0; n < NR; ++n) {
        const __m256i q4 = load256(w[n] + i * kBytes + (FIVE ? 48 : 16) + 32 * c);
        __m256i ql = _mm256_and_si256(q4, m4);
        __m256i qh = _mm256_and_si256(_mm256_srli_epi16(q4, 4), m4);
        if constexpr (FIVE) {
          ql = _mm256_or_si256(ql, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb[n], 2 * c), m1), 4));
          qh = _mm256_or_si256(qh, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb[n], 2 * c + 1), m1), 4));
        }
        const __m256i sl = _mm256_shuffle_epi8(sc16[n], bl), sh = _mm256_shuffle_epi8(sc16[n], bh);
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
          const int8_t* xq = x.qk(r) + i * 256 + 64 * c;
          sumi[n][r] = _mm256_add_epi32(sumi[n][r], _mm256_add_epi32(dot_scaled(ql, load256(xq), sl),
                                                                     dot_scaled(qh, load256(xq + 32), sh)));
        }
      }
    }
    _Pragma("GCC unroll 4") for (int n = 0; n < NR; ++n) {
      const __m128 d = _mm_cvtph_ps(_mm_cvtsi32_si128(w[n][i * kBytes] | (w[n][i * kBytes + 1] << 8)));
      _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
        const __m256 scale = _mm256_broadcastss_ps(_mm_mul_ss(d, _mm_set_ss(x.dk(r)[i])));  // d * dx
        acc[n][r] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(sumi[n][r]), acc[n][r]);
      }
    }
  }
  for (int n = 0; n < NR; ++n)
    for (int r = 0; r < MR; ++r) res[n][r] = hsum(acc[n][r]) - hsum128(accm[n][r]);
}

// Q6_K (210 bytes: 128 low-nibble bytes, 64 bytes of 2-bit high parts, 16 int8 scales, d). Weights 128h + 32q + l
// (h half, q quarter, l < 32): low nibble of byte 64h + l (q even) or 64h + 32 + l (q odd), low (q < 2) or high
// nibble; high bits (2q..2q+1) of byte 128 + 32h + l; scale 8h + 2q + l / 16. So sub-chunk j = 4h + q covers
// weights 32j..32j+31 with scales 2j (first 16) and 2j + 1.
template <int NR, int MR>
void q6k_tile(const uint8_t* const* w, int64_t nsb, const Rows<MR>& x, float (*res)[MR]) {
  __m256 acc[NR][MR];
  for (int n = 0; n < NR; ++n)
    for (int r = 0; r < MR; ++r) acc[n][r] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(0x03);
  for (int64_t i = 0; i < nsb; ++i) {
    __m256i sc16[NR], sumi[NR][MR];
    _Pragma("GCC unroll 2") for (int n = 0; n < NR; ++n) {
      const uint8_t* b = w[n] + i * 210;
      for (int64_t off = 0; off < 210; off += 64) prefetch_w(b + kAhead + off);
      sc16[n] = _mm256_cvtepi8_epi16(load128(b + 192));  // scales 0-15 as int16
      _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r)
        // the -32 of every code, taken back per 16-weight group: 32 * sum_g sc_g * sum16_g
        sumi[n][r] = _mm256_sub_epi32(_mm256_setzero_si256(),
                                      _mm256_slli_epi32(_mm256_madd_epi16(sc16[n], load256(x.s16(r) + i * 16)), 5));
    }
    _Pragma("GCC unroll 2") for (int h = 0; h < 2; ++h) {
      _Pragma("GCC unroll 4") for (int qq = 0; qq < 4; ++qq) {
        // lanes 0-7: scale 2j (j = 4h + qq), lanes 8-15: 2j + 1, taken from the half's 8 scales in both lanes
        const int8_t a0 = static_cast<int8_t>(4 * qq), a1 = static_cast<int8_t>(4 * qq + 1);
        const int8_t b0 = static_cast<int8_t>(4 * qq + 2), b1 = static_cast<int8_t>(4 * qq + 3);
        const __m256i mask = _mm256_setr_epi8(a0, a1, a0, a1, a0, a1, a0, a1, a0, a1, a0, a1, a0, a1, a0, a1, b0, b1,
                                              b0, b1, b0, b1, b0, b1, b0, b1, b0, b1, b0, b1, b0, b1);
        __m256i q[NR], s[NR];
        _Pragma("GCC unroll 2") for (int n = 0; n < NR; ++n) {
          const uint8_t* b = w[n] + i * 210;
          const __m256i lo = load256(b + 64 * h + 32 * (qq & 1)), hh = load256(b + 128 + 32 * h);
          const __m256i nib = (qq < 2) ? _mm256_and_si256(lo, m4) : _mm256_and_si256(_mm256_srli_epi16(lo, 4), m4);
          q[n] = _mm256_or_si256(nib, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hh, 2 * qq), m3), 4));
          const __m256i half = h == 0 ? _mm256_permute2x128_si256(sc16[n], sc16[n], 0x00)
                                      : _mm256_permute2x128_si256(sc16[n], sc16[n], 0x11);
          s[n] = _mm256_shuffle_epi8(half, mask);
        }
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
          const __m256i xq = load256(x.qk(r) + i * 256 + 128 * h + 32 * qq);
          _Pragma("GCC unroll 2") for (int n = 0; n < NR; ++n)
            sumi[n][r] = _mm256_add_epi32(sumi[n][r], dot_scaled(q[n], xq, s[n]));
        }
      }
    }
    _Pragma("GCC unroll 2") for (int n = 0; n < NR; ++n) {
      const float d = fp16(w[n] + i * 210 + 208);
      _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r)
        acc[n][r] = _mm256_fmadd_ps(_mm256_set1_ps(d * x.dk(r)[i]), _mm256_cvtepi32_ps(sumi[n][r]), acc[n][r]);
    }
  }
  for (int n = 0; n < NR; ++n)
    for (int r = 0; r < MR; ++r) res[n][r] = hsum(acc[n][r]);
}

// The 32 fifth bits of a Q5_0/Q5_1 block (a little-endian uint32: bit j is weight j's) as 0x10 in byte j.
GLOWPLUG_VINLINE __m256i fifth_bits(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)),
                                             _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2,
                                                              2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i sel = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  const __m256i on = _mm256_cmpeq_epi8(_mm256_and_si256(spread, sel), sel);
  return _mm256_and_si256(on, _mm256_set1_epi8(0x10));
}

// The 32-weight blocks. Codes of Q4_x/Q5_x are unsigned (byte j's low nibble is weight j, its high nibble weight
// j + 16); Q8_0's are signed (multiplied by the sign trick: |q| times x with q's sign).
// A 32-weight block's codes as 32 bytes in weight order (Q8_0: the signed bytes as stored).
template <int64_t T>
GLOWPLUG_VINLINE __m256i q32_codes(const uint8_t* b) {
  if constexpr (T == kQ8_0) {
    return load256(b + 2);
  } else {
    constexpr int64_t at = T == kQ4_0 ? 2 : T == kQ4_1 ? 4 : T == kQ5_0 ? 6 : 8;
    const __m128i nib = load128(b + at);
    __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(nib, 4), nib), _mm256_set1_epi8(0x0F));
    if constexpr (T == kQ5_0 || T == kQ5_1) q = _mm256_or_si256(q, fifth_bits(b + (T == kQ5_0 ? 2 : 4)));
    return q;
  }
}

// The block's offset term per unit of s_x: Q4_0 / Q5_0: w = d * (q - 8 or 16); Q4_1 / Q5_1: w = d * q + m; Q8_0:
// w = d * q (none).
template <int64_t T>
GLOWPLUG_VINLINE float q32_off(const uint8_t* b, float d) {
  return T == kQ4_0 ? -8.f * d : T == kQ5_0 ? -16.f * d : (T == kQ4_1 || T == kQ5_1) ? fp16(b + 2) : 0.f;
}

template <int64_t T, int NR, int MR>
void q32_tile(const uint8_t* const* w, int64_t nb, const Rows<MR>& x, float (*res)[MR]) {
  constexpr int64_t kBytes = q32_bytes<T>();
  __m256 acc[NR][MR];
  float corr[NR][MR];
  for (int n = 0; n < NR; ++n)
    for (int r = 0; r < MR; ++r) acc[n][r] = _mm256_setzero_ps(), corr[n][r] = 0.f;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t i = 0; i < nb; ++i) {
    __m256i q[NR];
    float d[NR], off[NR];
    _Pragma("GCC unroll 2") for (int n = 0; n < NR; ++n) {
      const uint8_t* b = w[n] + i * kBytes;
      if ((i & 1) == 0) prefetch_w(b + kAhead);
      d[n] = fp16(b);
      q[n] = q32_codes<T>(b);
      off[n] = q32_off<T>(b, d[n]);
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
      const __m256i xq = load256(x.qb(r) + i * 32);
      const float dx = x.db(r)[i];
      _Pragma("GCC unroll 2") for (int n = 0; n < NR; ++n) {
        __m256i p;
        if constexpr (T == kQ8_0) {
          p = _mm256_madd_epi16(ones, _mm256_maddubs_epi16(_mm256_sign_epi8(q[n], q[n]), _mm256_sign_epi8(xq, q[n])));
        } else {
          p = _mm256_madd_epi16(ones, _mm256_maddubs_epi16(q[n], xq));
          corr[n][r] = std::fma(off[n], x.sb(r)[i], corr[n][r]);
        }
        acc[n][r] = _mm256_fmadd_ps(_mm256_set1_ps(d[n] * dx), _mm256_cvtepi32_ps(p), acc[n][r]);
      }
    }
  }
  for (int n = 0; n < NR; ++n)
    for (int r = 0; r < MR; ++r) res[n][r] = hsum(acc[n][r]) + corr[n][r];
}

// Float weights (a float part of a fused layer) against the fp32 activations.
template <int64_t T, int NR, int MR>
void float_tile(const uint8_t* const* w, int64_t K, const Rows<MR>& x, float (*res)[MR]) {
  for (int n = 0; n < NR; ++n) {
    __m256 acc[MR];
    for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
      __m256 wv;
      if constexpr (T == kF32) wv = _mm256_loadu_ps(reinterpret_cast<const float*>(w[n]) + k);
      else if constexpr (T == kF16) wv = _mm256_cvtph_ps(load128(reinterpret_cast<const uint16_t*>(w[n]) + k));
      else wv = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(load128(reinterpret_cast<const uint16_t*>(w[n]) + k)), 16));
      _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) acc[r] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x.xf(r) + k), acc[r]);
    }
    for (int r = 0; r < MR; ++r) {
      float s = hsum(acc[r]);
      for (int64_t kk = k; kk < K; ++kk) {
        float wf;
        if constexpr (T == kF32) {
          std::memcpy(&wf, w[n] + 4 * kk, 4);
        } else {
          uint16_t h;
          std::memcpy(&h, w[n] + 2 * kk, 2);
          wf = T == kF16 ? f16_to_f32(h) : bf16_to_f32(h);
        }
        s = std::fma(wf, x.xf(r)[kk], s);
      }
      res[n][r] = s;
    }
  }
}

// ----------------------------------------------------------------------------------- AVX2 prompt GEMM
// For a prompt's many activation rows, the K-quant rows are unpacked once into a panel (codes as bytes, each chunk's
// 16-bit scale vector, the per-super-block terms) that every activation row then runs against, instead of decoding
// each block again for every tile of activation rows. The micro-kernel forms the same 8 integer lanes per
// (weight row, activation row, super-block) as kq45_tile / q6k_tile: lane l of chunk j is bytes 4l..4l+3 of the
// 32 weights 32j..32j+31 times their scale (integer sums, exact in any order), and folds them into fp32 with the
// same fused multiply-adds in the same super-block order, so its outputs are the GEMV path's bit for bit.

// A std::allocator for vectors of floats read and written as aligned 256-bit vectors.
template <class T>
struct Aligned32 {
  using value_type = T;
  Aligned32() = default;
  template <class U>
  Aligned32(const Aligned32<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(32))); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(32)); }
  template <class U>
  bool operator==(const Aligned32<U>&) const { return true; }
  template <class U>
  bool operator!=(const Aligned32<U>&) const { return false; }
};

// One super-block of one weight row, unpacked, with its chunks taken two at a time: chunk pair t holds chunks j = 2t
// and j' = 2t + 1 as a[t] (in each 4-byte group g: bytes 4g, 4g+1 of j, then of j') and b[t] (bytes 4g+2, 4g+3 of
// each), so that maddubs(a, x_a) + maddubs(b, x_b) puts group g of j in 16-bit lane 2g and of j' in 2g+1, and one
// maddwd by s[t] (lane 2g: j's scale, 2g+1: j''s) gives the same 32-bit lane g as the two chunks' own products.
struct alignas(32) Unpacked {
  uint8_t a[4][32], b[4][32];  // codes: Q4_K 0..15, Q5_K 0..31, Q6_K 0..63
  int16_t s[4][16];            // the pairs' multipliers
  int16_t e[16];               // Q4/5_K: the 8 mins in both halves; Q6_K: the 16 scales (for the -32 offset)
  float d, dmin;
  float pad_[6];
};
static_assert(sizeof(Unpacked) == 448, "a panel entry is 14 vectors");

// Chunks j and j' (32 bytes or 16 16-bit lanes each) as the a / b halves of a pair (see Unpacked).
GLOWPLUG_VINLINE __m256i pair_lo(__m256i j, __m256i j2) {
  return _mm256_blend_epi16(j, _mm256_slli_epi32(j2, 16), 0xAA);
}
GLOWPLUG_VINLINE __m256i pair_hi(__m256i j, __m256i j2) {
  return _mm256_blend_epi16(_mm256_srli_epi32(j, 16), j2, 0xAA);
}

// Store chunks 0-7 (codes[j], multipliers mul[j]) of a super-block as its four pairs.
GLOWPLUG_VINLINE void store_pairs(const __m256i* codes, const __m256i* mul, Unpacked* u) {
  for (int t = 0; t < 4; ++t) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(u->a[t]), pair_lo(codes[2 * t], codes[2 * t + 1]));
    _mm256_store_si256(reinterpret_cast<__m256i*>(u->b[t]), pair_hi(codes[2 * t], codes[2 * t + 1]));
    _mm256_store_si256(reinterpret_cast<__m256i*>(u->s[t]), pair_lo(mul[2 * t], mul[2 * t + 1]));
  }
}

template <bool FIVE>
void unpack_kq45(const uint8_t* b, Unpacked* u) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), m1 = _mm256_set1_epi8(0x01);
  const __m256i sm16 = k_scales16(b + 4);
  const __m256i sc = _mm256_permute2x128_si256(sm16, sm16, 0x00);
  __m256i codes[8], mul[8];
  for (int j = 0; j < 8; ++j) mul[j] = _mm256_shuffle_epi8(sc, load256(kBcast16 + 32 * j));
  _mm256_store_si256(reinterpret_cast<__m256i*>(u->e), _mm256_permute2x128_si256(sm16, sm16, 0x11));
  u->d = fp16(b);
  u->dmin = fp16(b + 2);
  const __m256i hb = FIVE ? load256(b + 16) : _mm256_setzero_si256();
  for (int c = 0; c < 4; ++c) {
    const __m256i q4 = load256(b + (FIVE ? 48 : 16) + 32 * c);
    __m256i ql = _mm256_and_si256(q4, m4), qh = _mm256_and_si256(_mm256_srli_epi16(q4, 4), m4);
    if constexpr (FIVE) {
      ql = _mm256_or_si256(ql, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * c), m1), 4));
      qh = _mm256_or_si256(qh, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * c + 1), m1), 4));
    }
    codes[2 * c] = ql;
    codes[2 * c + 1] = qh;
  }
  store_pairs(codes, mul, u);
}

void unpack_q6k(const uint8_t* b, Unpacked* u) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(0x03);
  const __m256i sc16 = _mm256_cvtepi8_epi16(load128(b + 192));
  _mm256_store_si256(reinterpret_cast<__m256i*>(u->e), sc16);
  u->d = fp16(b + 208);
  u->dmin = 0.f;
  __m256i codes[8], mul[8];
  for (int h = 0; h < 2; ++h) {
    const __m256i half = h == 0 ? _mm256_permute2x128_si256(sc16, sc16, 0x00)
                                : _mm256_permute2x128_si256(sc16, sc16, 0x11);
    const __m256i hh = load256(b + 128 + 32 * h);
    for (int qq = 0; qq < 4; ++qq) {
      const int8_t a0 = static_cast<int8_t>(4 * qq), a1 = static_cast<int8_t>(4 * qq + 1);
      const int8_t b0 = static_cast<int8_t>(4 * qq + 2), b1 = static_cast<int8_t>(4 * qq + 3);
      const __m256i mask = _mm256_setr_epi8(a0, a1, a0, a1, a0, a1, a0, a1, a0, a1, a0, a1, a0, a1, a0, a1, b0, b1,
                                            b0, b1, b0, b1, b0, b1, b0, b1, b0, b1, b0, b1, b0, b1);
      mul[4 * h + qq] = _mm256_shuffle_epi8(half, mask);
      const __m256i lo = load256(b + 64 * h + 32 * (qq & 1));
      const __m256i nib = qq < 2 ? _mm256_and_si256(lo, m4) : _mm256_and_si256(_mm256_srli_epi16(lo, 4), m4);
      codes[4 * h + qq] = _mm256_or_si256(nib, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hh, 2 * qq), m3), 4));
    }
  }
  store_pairs(codes, mul, u);
}

// A quantized activation row's bytes in the pairs' order (see Unpacked): per 64 bytes, the a half then the b half.
void pair_activations(const int8_t* q, int64_t K, int8_t* out) {
  for (int64_t k = 0; k < K; k += 64) {
    const __m256i j = load256(q + k), j2 = load256(q + k + 32);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), pair_lo(j, j2));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k + 32), pair_hi(j, j2));
  }
}

// The fp32 lanes of the (weight row, activation row) pairs, carried across the K-blocks of the super-blocks: for
// weight row n and activation row m, acc[(n * ld + m) * 8 ..] (sum over super-blocks of d * d_x * lane sums) and
// accm[(n * ld + m) * 4 ..] (Q4/5_K: of dmin * d_x * mins x sums), so two neighbouring activation rows' accm lanes
// form one vector.
struct PairAcc {
  float* acc;
  float* accm;
  int64_t ld;
};

// NR unpacked weight rows (p[n] + i: row n's super-block i) against MR activation rows (rows m0 + r of st) over
// super-blocks [i0, i1). SIX: Q6_K (the -32 offset; no mins). m0 is even, so rows (m0 + 2t, m0 + 2t + 1) share a
// vector of mins lanes.
template <int NR, int MR, bool SIX>
void kq_micro(const Unpacked* const* p, int64_t i0, int64_t i1, const Rows<MR>& x, const PairAcc& st, int64_t m0) {
  for (int64_t i = i0; i < i1; ++i) {
    __m256i sumi[NR][MR];
    for (int n = 0; n < NR; ++n)
      for (int r = 0; r < MR; ++r) sumi[n][r] = _mm256_setzero_si256();
    _Pragma("GCC unroll 4") for (int t = 0; t < 4; ++t) {
      _Pragma("GCC unroll 4") for (int n = 0; n < NR; ++n) {
        const __m256i ca = _mm256_load_si256(reinterpret_cast<const __m256i*>(p[n][i].a[t]));
        const __m256i cb = _mm256_load_si256(reinterpret_cast<const __m256i*>(p[n][i].b[t]));
        const __m256i s = _mm256_load_si256(reinterpret_cast<const __m256i*>(p[n][i].s[t]));
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
          const int8_t* xp = x.qi(r) + i * 256 + 64 * t;
          // lanes at most 2 * 2 * 63 * 127 in magnitude: no 16-bit overflow
          const __m256i p16 = _mm256_add_epi16(_mm256_maddubs_epi16(ca, load256(xp)),
                                               _mm256_maddubs_epi16(cb, load256(xp + 32)));
          sumi[n][r] = _mm256_add_epi32(sumi[n][r], _mm256_madd_epi16(s, p16));
          // keep each sum in its register pair by pair (left alone, GCC computes all the pairs' products first,
          // through the stack, and adds them as a tree)
          asm("" : "+x"(sumi[n][r]));
        }
      }
    }
    __m256 dx[MR];
    _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) dx[r] = _mm256_broadcast_ss(x.dk(r) + i);
    _Pragma("GCC unroll 4") for (int n = 0; n < NR; ++n) {
      const Unpacked& u = p[n][i];
      const __m256 d = _mm256_set1_ps(u.d);
      float* acc = st.acc + (n * st.ld + m0) * 8;
      _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
        __m256i si = sumi[n][r];
        if constexpr (SIX) {
          const __m256i e = _mm256_load_si256(reinterpret_cast<const __m256i*>(u.e));
          si = _mm256_sub_epi32(si, _mm256_slli_epi32(_mm256_madd_epi16(e, load256(x.s16(r) + i * 16)), 5));
        }
        const __m256 prev = i == 0 ? _mm256_setzero_ps() : _mm256_load_ps(acc + 8 * r);  // the lanes start at +0
        _mm256_store_ps(acc + 8 * r, _mm256_fmadd_ps(_mm256_mul_ps(d, dx[r]), _mm256_cvtepi32_ps(si), prev));
      }
      if constexpr (!SIX) {
        // lanes 0-3: activation row r, 4-7: row r + 1 (each the 4 lanes of kq45_tile's 128-bit mins product)
        const __m256i mn = _mm256_load_si256(reinterpret_cast<const __m256i*>(u.e));
        const __m256 dmin = _mm256_set1_ps(u.dmin);
        float* accm = st.accm + (n * st.ld + m0) * 4;
        int r = 0;
        for (; r + 2 <= MR; r += 2) {
          const __m256i s2 = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(x.s32(r + 1) + i * 8),
                                                 reinterpret_cast<const __m128i*>(x.s32(r) + i * 8));
          const __m256 dx2 = _mm256_blend_ps(dx[r], dx[r + 1], 0xF0);
          const __m256i prod = _mm256_madd_epi16(mn, s2);
          const __m256 prev = i == 0 ? _mm256_setzero_ps() : _mm256_load_ps(accm + 4 * r);
          _mm256_store_ps(accm + 4 * r, _mm256_fmadd_ps(_mm256_mul_ps(dmin, dx2), _mm256_cvtepi32_ps(prod), prev));
        }
        if (r < MR) {
          const __m128i prod = _mm_madd_epi16(_mm256_castsi256_si128(mn), load128(x.s32(r) + i * 8));
          const __m128 prev = i == 0 ? _mm_setzero_ps() : _mm_load_ps(accm + 4 * r);
          _mm_store_ps(accm + 4 * r, _mm_fmadd_ps(_mm256_castps256_ps128(_mm256_mul_ps(dmin, dx[r])),
                                                  _mm_cvtepi32_ps(prod), prev));
        }
      }
    }
  }
}

constexpr int kGemmMR = 4;  // activation rows per micro-tile
constexpr int kGemmNR = 2;  // weight rows per micro-tile
static_assert(kGemmMR % 2 == 0, "tiles start at even rows (kq_micro pairs the rows' mins lanes)");
constexpr int64_t kPanelRows = 8;  // weight rows unpacked at once
constexpr int64_t kPanelBytes = 16 << 10;  // one K-block of the panel: stays in L1 while the activation rows pass
constexpr int64_t kGemmRows = 128;  // activation rows per pass over the K-blocks: their fp32 lanes stay in L2
static_assert(kGemmRows % kGemmMR == 0, "a pass holds whole tiles");

// Weight rows [r0, r1) of a K-quant segment against all M activation rows. Per panel of kPanelRows rows: unpack once,
// then per K-block (super-blocks whose panel slice fits L1) every activation tile against every weight tile, the
// pairs' fp32 lanes kept in `st` between K-blocks.
template <class Put>
void gemm_rows(int64_t type, const uint8_t* base, int64_t stride, int64_t r0, int64_t r1, int64_t K, const Act& a,
               const Put& put) {
  const int64_t nsb = K / 256, M = a.M;
  const int64_t kb = std::max<int64_t>(1, kPanelBytes / (kPanelRows * int64_t(sizeof(Unpacked))));
  static thread_local std::vector<Unpacked> panel;
  static thread_local std::vector<float, Aligned32<float>> acc_lanes, accm_lanes;
  panel.resize(kPanelRows * nsb);
  const int64_t ld = (M + 1) / 2 * 2;  // even: a pair of rows' mins lanes is one aligned vector
  acc_lanes.resize(kPanelRows * ld * 8);
  accm_lanes.resize(kPanelRows * ld * 4);
  const PairAcc st{acc_lanes.data(), accm_lanes.data(), ld};
  const int64_t bytes = type == kQ4_K ? 144 : type == kQ5_K ? 176 : 210;
  const bool six = type == kQ6_K;
  for (int64_t p0 = r0; p0 < r1; p0 += kPanelRows) {
    const int64_t nb = std::min(kPanelRows, r1 - p0);
    for (int64_t n = 0; n < nb; ++n) {
      const uint8_t* row = base + (p0 + n) * stride;
      Unpacked* u = panel.data() + n * nsb;
      for (int64_t i = 0; i < nsb; ++i) {
        if (type == kQ4_K) unpack_kq45<false>(row + i * bytes, u + i);
        else if (type == kQ5_K) unpack_kq45<true>(row + i * bytes, u + i);
        else unpack_q6k(row + i * bytes, u + i);
      }
    }
    for (int64_t mb = 0; mb < M; mb += kGemmRows) {
      const int64_t me = std::min(M, mb + kGemmRows);
      for (int64_t i0 = 0; i0 < nsb; i0 += kb) {
        const int64_t i1 = std::min(nsb, i0 + kb);
        for (int64_t m = mb; m < me; m += kGemmMR) {
          auto tiles = [&](auto mr_c) {
            constexpr int MR = decltype(mr_c)::value;
            const Rows<MR> x(a, m);
            int64_t n = 0;
            for (; n + kGemmNR <= nb; n += kGemmNR) {
              const Unpacked* w[kGemmNR];
              for (int t = 0; t < kGemmNR; ++t) w[t] = panel.data() + (n + t) * nsb;
              const PairAcc at{st.acc + n * ld * 8, st.accm + n * ld * 4, ld};
              if (six) kq_micro<kGemmNR, MR, true>(w, i0, i1, x, at, m);
              else kq_micro<kGemmNR, MR, false>(w, i0, i1, x, at, m);
            }
            for (; n < nb; ++n) {
              const Unpacked* w[1] = {panel.data() + n * nsb};
              const PairAcc at{st.acc + n * ld * 8, st.accm + n * ld * 4, ld};
              if (six) kq_micro<1, MR, true>(w, i0, i1, x, at, m);
              else kq_micro<1, MR, false>(w, i0, i1, x, at, m);
            }
          };
          switch (std::min<int64_t>(kGemmMR, me - m)) {
            case 1: tiles(std::integral_constant<int, 1>{}); break;
            case 2: tiles(std::integral_constant<int, 2>{}); break;
            case 3: tiles(std::integral_constant<int, 3>{}); break;
            default: tiles(std::integral_constant<int, kGemmMR>{}); break;
          }
        }
      }
    }
    for (int64_t n = 0; n < nb; ++n)
      for (int64_t m = 0; m < M; ++m) {
        const float v = hsum(_mm256_load_ps(st.acc + (n * ld + m) * 8));
        put(m, p0 + n, six ? v : v - hsum128(_mm_load_ps(st.accm + (n * ld + m) * 4)));
      }
  }
}

// The 32-weight blocks at prompt size: a panel of 8 weight rows is unpacked once, per block, into 8 vectors whose
// 32-bit lane n holds 4 codes of row n (vector g: weights 4g..4g+3), so that one broadcast 4-byte group of an
// activation row meets all 8 rows in one vpmaddubsw. The integer sums and the fp32 operations per row are q32_tile's
// (see q32_micro), with the rows as lanes: a tile decodes each block again for every 4 activation rows and scales
// each (row, activation row) pair's lanes on its own; the panel is decoded once and scales 8 rows per instruction.
struct alignas(32) Q32Panel {
  uint8_t c[8][32];  // vector g: lane n = row n's codes 4g..4g+3 (Q8_0: their magnitudes)
  uint8_t sg[8][32];  // Q8_0: the signed codes, for the sign trick
  float d[8];
  float off[8];
};
static_assert(sizeof(Q32Panel) == 576, "a panel block is 18 vectors");

// Rows' 32-byte vectors r[0..7] (8 dwords each) transposed: out[g] lane n = r[n] dword g.
GLOWPLUG_VINLINE void transpose8x8(const __m256i* r, __m256i* out) {
  __m256i t[8], u[8];
  for (int j = 0; j < 4; ++j) {
    t[2 * j] = _mm256_unpacklo_epi32(r[2 * j], r[2 * j + 1]);
    t[2 * j + 1] = _mm256_unpackhi_epi32(r[2 * j], r[2 * j + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // rows 4h..4h+3
    u[4 * h + 0] = _mm256_unpacklo_epi64(t[4 * h], t[4 * h + 2]);
    u[4 * h + 1] = _mm256_unpackhi_epi64(t[4 * h], t[4 * h + 2]);
    u[4 * h + 2] = _mm256_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);
    u[4 * h + 3] = _mm256_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);
  }
  for (int g = 0; g < 4; ++g) {
    out[g] = _mm256_permute2x128_si256(u[g], u[4 + g], 0x20);
    out[g + 4] = _mm256_permute2x128_si256(u[g], u[4 + g], 0x31);
  }
}

// Weight rows rows[0..nr) (nr <= 8; the rest of the panel is zero) of nb blocks into panel[0..nb).
template <int64_t T>
void unpack_q32(const uint8_t* const* rows, int64_t nr, int64_t nb, Q32Panel* panel) {
  constexpr int64_t kBytes = q32_bytes<T>();
  for (int64_t i = 0; i < nb; ++i) {
    __m256i r[8], c[8];
    Q32Panel& u = panel[i];
    for (int n = 0; n < 8; ++n) {
      if (n < nr) {
        const uint8_t* b = rows[n] + i * kBytes;
        if ((i & 1) == 0) prefetch_w(b + kAhead);
        r[n] = q32_codes<T>(b);
        u.d[n] = fp16(b);
        u.off[n] = q32_off<T>(b, u.d[n]);
      } else {
        r[n] = _mm256_setzero_si256();
        u.d[n] = u.off[n] = 0.f;
      }
    }
    transpose8x8(r, c);
    for (int g = 0; g < 8; ++g) {
      if constexpr (T == kQ8_0) {
        _mm256_store_si256(reinterpret_cast<__m256i*>(u.sg[g]), c[g]);
        c[g] = _mm256_sign_epi8(c[g], c[g]);
      }
      _mm256_store_si256(reinterpret_cast<__m256i*>(u.c[g]), c[g]);
    }
  }
}

// The panel's 8 weight rows against one activation row over all nb blocks: lane n of the result is row n's output.
// Group g's 32-bit lane n is the integer sum q32_tile's lane g forms for row n, and it is scaled and accumulated with
// the same operations: 8 fp32 chains (one per group), folded at the end in hsum's order, plus the offset chain.
template <int64_t T>
__m256 q32_micro(const Q32Panel* panel, int64_t nb, const int8_t* xq, const float* dx, const float* sx) {
  __m256 acc[8], corr = _mm256_setzero_ps();
  for (int g = 0; g < 8; ++g) acc[g] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t i = 0; i < nb; ++i) {
    const Q32Panel& u = panel[i];
    const __m256 scale = _mm256_mul_ps(_mm256_load_ps(u.d), _mm256_set1_ps(dx[i]));
    _Pragma("GCC unroll 8") for (int g = 0; g < 8; ++g) {
      int32_t v;
      std::memcpy(&v, xq + i * 32 + 4 * g, 4);
      const __m256i xb = _mm256_set1_epi32(v);
      const __m256i c = _mm256_load_si256(reinterpret_cast<const __m256i*>(u.c[g]));
      __m256i p;
      if constexpr (T == kQ8_0)
        p = _mm256_maddubs_epi16(c, _mm256_sign_epi8(xb, _mm256_load_si256(reinterpret_cast<const __m256i*>(u.sg[g]))));
      else
        p = _mm256_maddubs_epi16(c, xb);
      acc[g] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(_mm256_madd_epi16(ones, p)), acc[g]);
    }
    if constexpr (T != kQ8_0) corr = _mm256_fmadd_ps(_mm256_load_ps(u.off), _mm256_set1_ps(sx[i]), corr);
  }
  // hsum's order: ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))
  const __m256 s0 = _mm256_add_ps(_mm256_add_ps(acc[0], acc[4]), _mm256_add_ps(acc[2], acc[6]));
  const __m256 s1 = _mm256_add_ps(_mm256_add_ps(acc[1], acc[5]), _mm256_add_ps(acc[3], acc[7]));
  return _mm256_add_ps(_mm256_add_ps(s0, s1), corr);
}

// Weight rows [r0, r1) of a 32-weight-block segment against all M activation rows, a panel of 8 rows at a time.
template <int64_t T, class Put>
void gemm_rows_q32(const uint8_t* base, int64_t stride, int64_t r0, int64_t r1, int64_t K, const Act& a,
                   const Put& put) {
  const int64_t nb = K / 32, M = a.M;
  static thread_local std::vector<Q32Panel> panel;
  panel.resize(nb);
  for (int64_t p0 = r0; p0 < r1; p0 += 8) {
    const int64_t nr = std::min<int64_t>(8, r1 - p0);
    const uint8_t* rows[8];
    for (int64_t n = 0; n < nr; ++n) rows[n] = base + (p0 + n) * stride;
    unpack_q32<T>(rows, nr, nb, panel.data());
    alignas(32) float o[8];
    for (int64_t m = 0; m < M; ++m) {
      _mm256_store_ps(o, q32_micro<T>(panel.data(), nb, a.qb.data() + m * K, a.db.data() + m * nb, a.sb.data() + m * nb));
      for (int64_t n = 0; n < nr; ++n) put(m, p0 + n, o[n]);
    }
  }
}

// The prompt GEMM of one segment: the K-quants' panel GEMM or the 32-weight blocks'.
template <class Put>
void gemm_segment(int64_t type, const uint8_t* base, int64_t stride, int64_t r0, int64_t r1, int64_t K, const Act& a,
                  const Put& put) {
  switch (type) {
    case kQ4_0: return gemm_rows_q32<kQ4_0>(base, stride, r0, r1, K, a, put);
    case kQ4_1: return gemm_rows_q32<kQ4_1>(base, stride, r0, r1, K, a, put);
    case kQ5_0: return gemm_rows_q32<kQ5_0>(base, stride, r0, r1, K, a, put);
    case kQ5_1: return gemm_rows_q32<kQ5_1>(base, stride, r0, r1, K, a, put);
    case kQ8_0: return gemm_rows_q32<kQ8_0>(base, stride, r0, r1, K, a, put);
    default: return gemm_rows(type, base, stride, r0, r1, K, a, put);
  }
}

#else
// -------------------------------------------------------------------------------------------- portable
// The same integer sums in plain loops (the compiler vectorizes them for the level's flags).
inline int32_t idot(const uint8_t* q, const int8_t* x, int n) {
  int32_t s = 0;
  for (int i = 0; i < n; ++i) s += static_cast<int32_t>(q[i]) * x[i];
  return s;
}

template <int MR, bool FIVE>
void kq45_rows(const uint8_t* w, int64_t nsb, const Rows<MR>& x, float* res) {
  constexpr int64_t kBytes = FIVE ? 176 : 144;
  float acc[MR] = {}, accm[MR] = {};
  uint8_t codes[256];
  for (int64_t i = 0; i < nsb; ++i) {
    const uint8_t* b = w + i * kBytes;
    uint8_t sm[16];
    k_scales(b + 4, sm);
    const uint8_t* qs = b + (FIVE ? 48 : 16);
    for (int c = 0; c < 4; ++c)
      for (int l = 0; l < 32; ++l) {
        uint8_t lo = qs[32 * c + l] & 0x0F, hi = qs[32 * c + l] >> 4;
        if (FIVE) {
          lo |= ((b[16 + l] >> (2 * c)) & 1) << 4;
          hi |= ((b[16 + l] >> (2 * c + 1)) & 1) << 4;
        }
        codes[64 * c + l] = lo;
        codes[64 * c + 32 + l] = hi;
      }
    const float d = fp16(b), dmin = fp16(b + 2);
    for (int r = 0; r < MR; ++r) {
      int32_t s = 0, sm_ = 0;
      for (int j = 0; j < 8; ++j) {
        s += static_cast<int32_t>(sm[j]) * idot(codes + 32 * j, x.qk(r) + i * 256 + 32 * j, 32);
        sm_ += static_cast<int32_t>(sm[8 + j]) * x.s32(r)[i * 8 + j];
      }
      acc[r] = std::fma(d * x.dk(r)[i], static_cast<float>(s), acc[r]);
      accm[r] = std::fma(dmin * x.dk(r)[i], static_cast<float>(sm_), accm[r]);
    }
  }
  for (int r = 0; r < MR; ++r) res[r] = acc[r] - accm[r];
}

template <int MR>
void q6k_rows(const uint8_t* w, int64_t nsb, const Rows<MR>& x, float* res) {
  float acc[MR] = {};
  uint8_t codes[256];
  for (int64_t i = 0; i < nsb; ++i) {
    const uint8_t* b = w + i * 210;
    for (int h = 0; h < 2; ++h)
      for (int l = 0; l < 32; ++l) {
        const uint8_t l0 = b[64 * h + l], l1 = b[64 * h + 32 + l], hh = b[128 + 32 * h + l];
        codes[128 * h + l] = (l0 & 0x0F) | ((hh & 3) << 4);
        codes[128 * h + 32 + l] = (l1 & 0x0F) | (((hh >> 2) & 3) << 4);
        codes[128 * h + 64 + l] = (l0 >> 4) | (((hh >> 4) & 3) << 4);
        codes[128 * h + 96 + l] = (l1 >> 4) | (((hh >> 6) & 3) << 4);
      }
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = fp16(b + 208);
    for (int r = 0; r < MR; ++r) {
      int32_t s = 0;
      for (int g = 0; g < 16; ++g)
        s += sc[g] * (idot(codes + 16 * g, x.qk(r) + i * 256 + 16 * g, 16) - 32 * x.s16(r)[i * 16 + g]);
      acc[r] = std::fma(d * x.dk(r)[i], static_cast<float>(s), acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) res[r] = acc[r];
}

template <int64_t T, int MR>
void q32_rows(const uint8_t* w, int64_t nb, const Rows<MR>& x, float* res) {
  constexpr int64_t kBytes = q32_bytes<T>();
  float acc[MR] = {};
  uint8_t codes[32];
  for (int64_t i = 0; i < nb; ++i) {
    const uint8_t* b = w + i * kBytes;
    const float d = fp16(b);
    int32_t sq[MR];
    if (T == kQ8_0) {
      for (int r = 0; r < MR; ++r) {
        int32_t s = 0;
        const int8_t* xq = x.qb(r) + i * 32;
        for (int l = 0; l < 32; ++l) s += static_cast<int8_t>(b[2 + l]) * xq[l];
        sq[r] = s;
      }
    } else {
      const int64_t at = T == kQ4_0 ? 2 : T == kQ4_1 ? 4 : T == kQ5_0 ? 6 : 8;
      uint32_t bits = 0;
      if (T == kQ5_0 || T == kQ5_1) std::memcpy(&bits, b + (T == kQ5_0 ? 2 : 4), 4);
      for (int l = 0; l < 16; ++l) {
        codes[l] = (b[at + l] & 0x0F) | (((bits >> l) & 1) << 4);
        codes[l + 16] = (b[at + l] >> 4) | (((bits >> (l + 16)) & 1) << 4);
      }
      for (int r = 0; r < MR; ++r) sq[r] = idot(codes, x.qb(r) + i * 32, 32);
    }
    const float off = T == kQ4_0 ? -8.f * d : T == kQ5_0 ? -16.f * d : (T == kQ4_1 || T == kQ5_1) ? fp16(b + 2) : 0.f;
    for (int r = 0; r < MR; ++r)
      acc[r] = std::fma(off, x.sb(r)[i], std::fma(d * x.db(r)[i], static_cast<float>(sq[r]), acc[r]));
  }
  for (int r = 0; r < MR; ++r) res[r] = acc[r];
}

template <int64_t T, int MR>
void float_rows(const uint8_t* w, int64_t K, const Rows<MR>& x, float* res) {
  for (int r = 0; r < MR; ++r) {
    float s = 0.f;
    for (int64_t k = 0; k < K; ++k) {
      float wf;
      if (T == kF32) {
        std::memcpy(&wf, w + 4 * k, 4);
      } else {
        uint16_t h;
        std::memcpy(&h, w + 2 * k, 2);
        wf = T == kF16 ? f16_to_f32(h) : bf16_to_f32(h);
      }
      s = std::fma(wf, x.xf(r)[k], s);
    }
    res[r] = s;
  }
}

template <int NR, int MR, bool FIVE>
void kq45_tile(const uint8_t* const* w, int64_t nsb, const Rows<MR>& x, float (*res)[MR]) {
  for (int n = 0; n < NR; ++n) kq45_rows<MR, FIVE>(w[n], nsb, x, res[n]);
}
template <int NR, int MR>
void q6k_tile(const uint8_t* const* w, int64_t nsb, const Rows<MR>& x, float (*res)[MR]) {
  for (int n = 0; n < NR; ++n) q6k_rows<MR>(w[n], nsb, x, res[n]);
}
template <int64_t T, int NR, int MR>
void q32_tile(const uint8_t* const* w, int64_t nb, const Rows<MR>& x, float (*res)[MR]) {
  for (int n = 0; n < NR; ++n) q32_rows<T, MR>(w[n], nb, x, res[n]);
}
template <int64_t T, int NR, int MR>
void float_tile(const uint8_t* const* w, int64_t K, const Rows<MR>& x, float (*res)[MR]) {
  for (int n = 0; n < NR; ++n) float_rows<T, MR>(w[n], K, x, res[n]);
}
#endif

// NR weight rows against MR activation rows.
template <int NR, int MR>
void tile_dot(int64_t type, const uint8_t* const* w, int64_t K, const Rows<MR>& x, float (*res)[MR]) {
  switch (type) {
    case kQ4_K: return kq45_tile<NR, MR, false>(w, K / 256, x, res);
    case kQ5_K: return kq45_tile<NR, MR, true>(w, K / 256, x, res);
    case kQ6_K: return q6k_tile<NR, MR>(w, K / 256, x, res);
    case kQ4_0: return q32_tile<kQ4_0, NR, MR>(w, K / 32, x, res);
    case kQ4_1: return q32_tile<kQ4_1, NR, MR>(w, K / 32, x, res);
    case kQ5_0: return q32_tile<kQ5_0, NR, MR>(w, K / 32, x, res);
    case kQ5_1: return q32_tile<kQ5_1, NR, MR>(w, K / 32, x, res);
    case kQ8_0: return q32_tile<kQ8_0, NR, MR>(w, K / 32, x, res);
    case kF32: return float_tile<kF32, NR, MR>(w, K, x, res);
    case kF16: return float_tile<kF16, NR, MR>(w, K, x, res);
    default: return float_tile<kBF16, NR, MR>(w, K, x, res);
  }
}

// Activation rows per tile: up to kMR; a pass over fewer rows (a batch's last rows) pairs weight rows instead.
constexpr int kMR = 4;
constexpr int kGroup1 = 2;  // weight rows per tile of one activation row (2 or 4)

// Weight rows [r0, r1) of one segment against activation rows [m0, m1), writing their outputs: weight rows outer (a
// group of four rows stays in L1 while every activation tile passes it), activation tiles of up to kMR rows inner. A
// tile of one activation row takes four weight rows at once and one of two rows two (the loads of x serve them all);
// wider tiles one.
template <class Put>
void run_rows(int64_t type, const uint8_t* base, int64_t stride, int64_t r0, int64_t r1, int64_t K, const Act& a,
              int64_t m0, int64_t m1, const Put& put) {
  auto tile = [&](auto nr_c, auto mr_c, int64_t r, int64_t m) {
    constexpr int NR = decltype(nr_c)::value, MR = decltype(mr_c)::value;
    const uint8_t* w[NR];
    for (int n = 0; n < NR; ++n) w[n] = base + (r + n) * stride;
    float res[NR][MR];
    tile_dot<NR, MR>(type, w, K, Rows<MR>(a, m), res);
    for (int n = 0; n < NR; ++n)
      for (int i = 0; i < MR; ++i) put(m + i, r + n, res[n][i]);
  };
  using I1 = std::integral_constant<int, 1>;
  using I2 = std::integral_constant<int, 2>;
  using I3 = std::integral_constant<int, 3>;
  using I4 = std::integral_constant<int, 4>;
  using I4r = std::integral_constant<int, 4>;
  for (int64_t r = r0; r < r1; r += 4) {
    const int64_t g = std::min<int64_t>(4, r1 - r);  // weight rows in this group
    for (int64_t m = m0; m < m1; m += kMR) {
      const int64_t mr = std::min<int64_t>(kMR, m1 - m);
      if (kGroup1 == 4 && mr == 1 && g == 4) {
        tile(I4r{}, I1{}, r, m);
        continue;
      }
      int64_t n = 0;
      if (mr <= 2)
        for (; n + 2 <= g; n += 2) mr == 1 ? tile(I2{}, I1{}, r + n, m) : tile(I2{}, I2{}, r + n, m);
      for (; n < g; ++n) {
        if (mr == 1) tile(I1{}, I1{}, r + n, m);
        else if (mr == 2) tile(I1{}, I2{}, r + n, m);
        else if (mr == 3) tile(I1{}, I3{}, r + n, m);
        else tile(I1{}, I4{}, r + n, m);
      }
    }
  }
}

struct Segment {
  const uint8_t* data = nullptr;
  int64_t rows = 0, row_stride = 0, row_bytes = 0, type = 0, col0 = 0;
  const int32_t* perm = nullptr;  // output column (within the segment) of each stored row, or none
};

Segment segment(const Tensor& w, int64_t type, const Tensor& perm, int64_t K, int64_t col0, int idx) {
  Segment s;
  if (w.numel() == 0) return s;
  Fmt f;
  STD_TORCH_CHECK(fmt_of(type, &f), "gguf_linear: segment ", idx, " has GGUF type ", type,
                  ", which has no native kernel (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, F32, F16, BF16)");
  STD_TORCH_CHECK(w.dim() == 2 && w.scalar_type() == ScalarType::Byte && w.stride(1) == 1,
                  "gguf_linear: segment ", idx, " must be a uint8 [rows, row bytes] tensor with contiguous rows");
  STD_TORCH_CHECK(K % f.weights == 0, "gguf_linear: K=", K, " is not a multiple of the ", f.weights,
                  "-weight block of segment ", idx);
  s.row_bytes = K / f.weights * f.bytes;
  STD_TORCH_CHECK(w.size(1) == s.row_bytes, "gguf_linear: segment ", idx, " rows are ", w.size(1),
                  " bytes; K=", K, " of type ", type, " takes ", s.row_bytes);
  s.data = static_cast<const uint8_t*>(w.data_ptr());
  s.rows = w.size(0);
  s.row_stride = w.stride(0);
  s.type = type;
  s.col0 = col0;
  if (perm.numel() != 0) {
    STD_TORCH_CHECK(perm.scalar_type() == ScalarType::Int && perm.numel() == s.rows && perm.is_contiguous(),
                    "gguf_linear: the row order of segment ", idx, " must be int32 [rows]");
    s.perm = static_cast<const int32_t*>(perm.data_ptr());
  }
  return s;
}

// Activation rows per block: the quantized rows of one block stay in L2 while the thread's weight rows stream by.
int64_t act_block(int64_t M, int64_t K) {
  const int64_t rows = std::max<int64_t>(kMR, (int64_t(192) << 10) / std::max<int64_t>(K, 1) / kMR * kMR);
  return std::min(M, rows);
}

}  // namespace

// y [M, N0 + N1 + N2] = x [M, K] @ W^T for up to three segments of stored GGUF rows (a fused layer's parts); an empty
// segment tensor is absent. perm_i: for llama-family q/k rows, each stored row's column within its segment.
Tensor gguf_linear(Tensor x, Tensor w0, int64_t t0, Tensor p0, Tensor w1, int64_t t1, Tensor p1, Tensor w2,
                   int64_t t2, Tensor p2) {
  STD_TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "gguf_linear: x must be a contiguous [M, K] tensor");
  STD_TORCH_CHECK(x.scalar_type() == ScalarType::BFloat16 || x.scalar_type() == ScalarType::Float,
                  "gguf_linear: x must be bfloat16 or float32");
  const int64_t M = x.size(0), K = x.size(1);
  Segment segs[3];
  int64_t N = 0;
  const Tensor* ws[3] = {&w0, &w1, &w2};
  const Tensor* ps[3] = {&p0, &p1, &p2};
  const int64_t ts[3] = {t0, t1, t2};
  bool need_b = false, need_k = false, need_f = false;
  for (int i = 0; i < 3; ++i) {
    segs[i] = segment(*ws[i], ts[i], *ps[i], K, N, i);
    N += segs[i].rows;
    if (segs[i].rows == 0) continue;
    Fmt f;
    fmt_of(ts[i], &f);
    need_f |= f.is_float;
    need_k |= f.kquant;
    need_b |= !f.is_float && !f.kquant;
  }
  Tensor y = new_out(x, M, N);
  if (M == 0 || N == 0) return y;
  // Kept by the calling thread between calls; the workers read it through this reference (a thread_local named
  // inside the parallel region would be each worker's own, empty one).
  static thread_local Act tls_act;
  Act& act = tls_act;
  quantize_rows(act, x, need_b, need_k, need_f);
  const OutWriter out{y.data_ptr(), y.scalar_type() == ScalarType::BFloat16, N};
  // Byte-balanced ranges of the rows (segments laid end to end), one per thread.
  int64_t total = 0;
  for (auto& s : segs) total += s.rows * s.row_bytes;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(torch::stable::get_num_threads(),
                                                                  total / (int64_t(64) << 10) + 1));
  const int64_t MB = act_block(M, K);
#if defined(__AVX2__)
  auto on_gemm = [&](int64_t t) { return takes_gemm(t, M); };
  act.qki.clear();
  if (need_k && M >= kGemmMinM) {
    act.qki.resize(M * K);
    for (int64_t m = 0; m < M; ++m) pair_activations(act.qk.data() + m * K, K, act.qki.data() + m * K);
  }
#else
  auto on_gemm = [](int64_t) { return false; };
#endif
  auto work = [&](int64_t part) {
    const int64_t b0 = total * part / threads, b1 = total * (part + 1) / threads;
    // fn(segment, r0, r1) for this thread's rows of each segment: those whose first byte falls in [b0, b1)
    auto each = [&](const auto& fn) {
      int64_t at = 0;
      for (const Segment& s : segs) {
        const int64_t bytes = s.rows * s.row_bytes;
        const int64_t lo = std::max(b0, at), hi = std::min(b1, at + bytes);
        if (lo < hi)
          fn(s, (lo - at + s.row_bytes - 1) / s.row_bytes, (hi - at + s.row_bytes - 1) / s.row_bytes);
        at += bytes;
      }
    };
    for (int64_t mb = 0; mb < M; mb += MB) {
      const int64_t me = std::min(M, mb + MB);
      each([&](const Segment& s, int64_t r0, int64_t r1) {
        if (on_gemm(s.type)) return;
        run_rows(s.type, s.data, s.row_stride, r0, r1, K, act, mb, me, [&](int64_t m, int64_t r, float v) {
          out.put(m, s.col0 + (s.perm ? s.perm[r] : r), v);
        });
      });
    }
#if defined(__AVX2__)
    each([&](const Segment& s, int64_t r0, int64_t r1) {
      if (!on_gemm(s.type)) return;
      gemm_segment(s.type, s.data, s.row_stride, r0, r1, K, act, [&](int64_t m, int64_t r, float v) {
        out.put(m, s.col0 + (s.perm ? s.perm[r] : r), v);
      });
    });
#endif
  };
  if (threads == 1) {
    work(0);
  } else {
    torch::stable::parallel_for(0, threads, 1, [&](int64_t p0_, int64_t p1_) {
      for (int64_t p = p0_; p < p1_; ++p) work(p);
    });
  }
  return y;
}

namespace {
// One stored row of n weights de-quantized to fp32 (the embedding lookup): the file's arithmetic, in fp32, as
// gguf.quants.dequantize computes it.
void dequant_row(int64_t type, const uint8_t* b, int64_t n, float* out) {
  switch (type) {
    case kF32: std::memcpy(out, b, n * 4); return;
    case kF16:
    case kBF16:
      for (int64_t k = 0; k < n; ++k) {
        uint16_t h;
        std::memcpy(&h, b + 2 * k, 2);
        out[k] = type == kF16 ? f16_to_f32(h) : bf16_to_f32(h);
      }
      return;
    case kQ4_K:
    case kQ5_K:
      for (int64_t i = 0; i < n / 256; ++i, b += type == kQ4_K ? 144 : 176, out += 256) {
        uint8_t sm[16];
        k_scales(b + 4, sm);
        const float d = fp16(b), dmin = fp16(b + 2);
        const uint8_t* qs = b + (type == kQ4_K ? 16 : 48);
        for (int c = 0; c < 4; ++c) {
          const float d1 = d * sm[2 * c], m1 = dmin * sm[8 + 2 * c], d2 = d * sm[2 * c + 1], m2 = dmin * sm[8 + 2 * c + 1];
          for (int l = 0; l < 32; ++l) {
            int lo = qs[32 * c + l] & 0x0F, hi = qs[32 * c + l] >> 4;
            if (type == kQ5_K) {
              lo += ((b[16 + l] >> (2 * c)) & 1) << 4;
              hi += ((b[16 + l] >> (2 * c + 1)) & 1) << 4;
            }
            out[64 * c + l] = d1 * lo - m1;
            out[64 * c + 32 + l] = d2 * hi - m2;
          }
        }
      }
      return;
    case kQ6_K:
      for (int64_t i = 0; i < n / 256; ++i, b += 210, out += 256) {
        const float d = fp16(b + 208);
        const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
        for (int h = 0; h < 2; ++h)
          for (int l = 0; l < 32; ++l) {
            const uint8_t l0 = b[64 * h + l], l1 = b[64 * h + 32 + l], hh = b[128 + 32 * h + l];
            const int q[4] = {((l0 & 0x0F) | ((hh & 3) << 4)) - 32, ((l1 & 0x0F) | (((hh >> 2) & 3) << 4)) - 32,
                              ((l0 >> 4) | (((hh >> 4) & 3) << 4)) - 32, ((l1 >> 4) | (((hh >> 6) & 3) << 4)) - 32};
            for (int qq = 0; qq < 4; ++qq) out[128 * h + 32 * qq + l] = d * sc[8 * h + 2 * qq + l / 16] * q[qq];
          }
      }
      return;
    default: {  // the 32-weight blocks
      Fmt f;
      fmt_of(type, &f);
      for (int64_t i = 0; i < n / 32; ++i, b += f.bytes, out += 32) {
        const float d = fp16(b);
        if (type == kQ8_0) {
          for (int l = 0; l < 32; ++l) out[l] = d * static_cast<int8_t>(b[2 + l]);
          continue;
        }
        const int64_t at = type == kQ4_0 ? 2 : type == kQ4_1 ? 4 : type == kQ5_0 ? 6 : 8;
        uint32_t bits = 0;
        if (type == kQ5_0 || type == kQ5_1) std::memcpy(&bits, b + (type == kQ5_0 ? 2 : 4), 4);
        const float m = (type == kQ4_1 || type == kQ5_1) ? fp16(b + 2) : 0.f;
        const int mid = type == kQ4_0 ? 8 : type == kQ5_0 ? 16 : 0;
        for (int l = 0; l < 16; ++l) {
          const int lo = (b[at + l] & 0x0F) | (((bits >> l) & 1) << 4);
          const int hi = (b[at + l] >> 4) | (((bits >> (l + 16)) & 1) << 4);
          out[l] = mid ? d * (lo - mid) : d * lo + m;
          out[l + 16] = mid ? d * (hi - mid) : d * hi + m;
        }
      }
      return;
    }
  }
}
}  // namespace

// Rows `ids` of a stored [V, K] GGUF matrix, de-quantized: fp32, or bf16 (rounded once) when `bf16` is nonzero.
Tensor gguf_rows(Tensor w, int64_t type, int64_t K, Tensor ids, int64_t bf16) {
  Fmt f;
  STD_TORCH_CHECK(fmt_of(type, &f), "gguf_rows: GGUF type ", type, " has no native kernel");
  STD_TORCH_CHECK(w.dim() == 2 && w.scalar_type() == ScalarType::Byte && w.stride(1) == 1 &&
                      w.size(1) == K / f.weights * f.bytes && K % f.weights == 0,
                  "gguf_rows: w must be uint8 [rows, ", K / f.weights * f.bytes, "] for K=", K);
  STD_TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == ScalarType::Long, "gguf_rows: ids must be an int64 vector");
  const int64_t T = ids.size(0), V = w.size(0), step = ids.stride(0), wstride = w.stride(0);
  Tensor out = torch::stable::new_empty(w, {T, K}, bf16 ? ScalarType::BFloat16 : ScalarType::Float);
  const int64_t* id = static_cast<const int64_t*>(ids.data_ptr());
  for (int64_t t = 0; t < T; ++t)
    STD_TORCH_CHECK(id[t * step] >= 0 && id[t * step] < V, "gguf_rows: token id ", id[t * step], " is outside the ",
                    V, " rows");
  const uint8_t* base = static_cast<const uint8_t*>(w.data_ptr());
  auto one = [&](int64_t t, float* buf) {
    const uint8_t* row = base + id[t * step] * wstride;
    if (bf16) {
      dequant_row(type, row, K, buf);
      uint16_t* o = static_cast<uint16_t*>(out.data_ptr()) + t * K;
      for (int64_t k = 0; k < K; ++k) o[k] = f32_to_bf16(buf[k]);
    } else {
      dequant_row(type, row, K, static_cast<float*>(out.data_ptr()) + t * K);
    }
  };
  torch::stable::parallel_for(0, T, 16, [&](int64_t a, int64_t b) {
    std::vector<float> buf(K);
    for (int64_t t = a; t < b; ++t) one(t, buf.data());
  });
  return out;
}

}  // namespace glowplug

STABLE_TORCH_LIBRARY_FRAGMENT(glowplug_native, m) {
  m.def("gguf_linear(Tensor x, Tensor w0, int t0, Tensor p0, Tensor w1, int t1, Tensor p1, Tensor w2, int t2, "
        "Tensor p2) -> Tensor");
  m.def("gguf_rows(Tensor w, int type, int k, Tensor ids, int bf16) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(glowplug_native, CPU, m) {
  m.impl("gguf_linear", TORCH_BOX(&glowplug::gguf_linear));
  m.impl("gguf_rows", TORCH_BOX(&glowplug::gguf_rows));
}
