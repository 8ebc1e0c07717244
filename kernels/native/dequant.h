// Packed blocked weights (blocked.cpp's layout) decoded to bf16, for the kernels that multiply a batch of rows by
// one decoded N-block: the AMX tile kernels (amx.h) and the AVX512-BF16 batch path of blocked.cpp.
#pragma once
#include "common.h"

#if defined(__AVX512BF16__)
namespace glowplug {

// The packed formats become real bf16 weights, 32 inputs of an N-block at a time (a "tile": 512 bf16), in a
// per-thread scratch block: a tile row is 16 lanes of (even input, odd input) bf16 pairs, which is both AMX's B-tile
// layout and blocked.cpp's dense bf16 layout, so the AMX tiles and the AVX512 dense kernel (batches on the AVX512
// levels) read the same scratch. Both halves are computed in fp32 and rounded to bf16 together
// (vcvtne2ps2bf16 puts the 16 even values below the 16 odd ones; one vpermw interleaves them). So each weight is
// rounded to bf16 once, the precision of the bf16 model's own weights, and the tile product needs no per-group
// scaling: with per-group scales applied per 16 rows of every group, the vector epilogue, not the tiles, bounded
// batches of 16 and more (reports/kernels.md, "M=16" and "M=64").
inline __m512i pair_bf16(__m512 even, __m512 odd) {
  const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                       23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(idx, (__m512i)_mm512_cvtne2ps_pbh(odd, even));
}

// int4 / int2. blk: the N-block's stream (codes, then G x 16 fp16 scales, then G x 16 fp16 mins). Chunk c's plane
// p is B row c * PLANES + p (inputs k0 + 2p, k0 + 2p + 1 of the chunk, as blocked.cpp's AVX512 kernel pairs them).
// A code q with the exponent of 128 OR-ed in is the number 128 + q (bf16 0x4300 | q, and fp32 once shifted up), so
// w = q * scale + min = (128 + q) * scale + (min - 128 * scale): one FMA per weight.
template <int BITS, int AHEAD>
inline void intn_dequant(const uint8_t* blk, int64_t K, int64_t gs, int64_t t, uint16_t* dst) {
  constexpr int PLANES = 16 / BITS, CHUNKS = 32 / (2 * PLANES);
  const int64_t G = K / gs, g = t * 32 / gs;
  const uint16_t* scales = reinterpret_cast<const uint16_t*>(blk + K * BITS * 2);
  const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + g * 16)));
  const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + (G + g) * 16)));
  const __m512 adj = _mm512_fnmadd_ps(_mm512_set1_ps(128.f), s, mn);
  const __m512i mask = _mm512_set1_epi16((1 << BITS) - 1), expo = _mm512_set1_epi16(0x4300);
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  const uint8_t* chunk = blk + t * CHUNKS * 64;
  uint16_t* b = dst + t * 512;
  _Pragma("GCC unroll 4") for (int c = 0; c < CHUNKS; ++c, chunk += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(chunk) + AHEAD, _MM_HINT_T0);
    const __m512i v = _mm512_loadu_si512(chunk);
    _Pragma("GCC unroll 16") for (int p = 0; p < PLANES; ++p) {
      const __m512i sh = p == 0 ? v : _mm512_srli_epi16(v, BITS * p);
      const __m512i w = p == PLANES - 1 ? _mm512_or_si512(sh, expo) : _mm512_ternarylogic_epi32(sh, mask, expo, 0xEA);
      const __m512 even = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(w, 16)), s, adj);
      const __m512 odd = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(w, high)), s, adj);
      _mm512_store_si512(b + (c * PLANES + p) * 32, pair_bf16(even, odd));
    }
  }
}

// int8. blk: the N-block's stream (K / 4 chunks, then G x 16 fp32 scales); chunk c is inputs 4c..4c+3, a byte
// u = q + 128 each, so it gives B rows 2c and 2c + 1. A byte with the fp32 exponent of 2^23 OR-ed in is 2^23 + u,
// and subtracting 2^23 + 128 leaves q exactly. With one group (per-output scales) the codes stay exact in bf16
// (|q| <= 128) and the caller scales the sums; with several, each weight is q * scale rounded to bf16.
template <int AHEAD>
inline void int8_dequant(const uint8_t* blk, int64_t K, int64_t gs, int64_t t, uint16_t* dst) {
  const int64_t g = t * 32 / gs;
  const bool grouped = gs < K;
  const __m512 s = grouped ? _mm512_loadu_ps(reinterpret_cast<const float*>(blk + K * 16) + g * 16) : _mm512_set1_ps(1.f);
  const __m512i byte = _mm512_set1_epi32(0xFF), expo = _mm512_set1_epi32(0x4B000000);
  const __m512 bias = _mm512_set1_ps(8388608.f + 128.f);
  const uint8_t* chunk = blk + t * 8 * 64;
  uint16_t* b = dst + t * 512;
  const auto code = [&](__m512i v, int i) {
    const __m512i u = i == 0 ? v : _mm512_srli_epi32(v, 8 * i);
    const __m512 q = _mm512_sub_ps(_mm512_castsi512_ps(_mm512_ternarylogic_epi32(u, byte, expo, 0xEA)), bias);
    return grouped ? _mm512_mul_ps(q, s) : q;
  };
  _Pragma("GCC unroll 8") for (int c = 0; c < 8; ++c, chunk += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(chunk) + AHEAD, _MM_HINT_T0);
    const __m512i v = _mm512_loadu_si512(chunk);
    _mm512_store_si512(b + (2 * c) * 32, pair_bf16(code(v, 0), code(v, 1)));
    _mm512_store_si512(b + (2 * c + 1) * 32, pair_bf16(code(v, 2), code(v, 3)));
  }
}

}  // namespace glowplug
#endif
