// AMX (Advanced Matrix Extensions) versions of blocked.cpp's block kernels, for batches of several activation rows.
//
// Why: the AVX512 block kernels spend one vdpbf16ps / vpdpbusd per activation row per 64 weight bytes, so at batch 16
// they are bound by arithmetic, not by the weight stream (reports/decode-quantized.md, "step / batch-1 step"). One
// AMX tile multiply takes a 16-row activation tile against 1 KiB of weights, and the step goes back to streaming.
//
// The blocked layouts are already AMX's "VNNI" B-tile layout, so nothing is repacked:
//   dense bf16  16 consecutive chunks (pairs k..k+31 of the block's 16 rows) are one 16 x 64-byte B tile;
//   int8        8 consecutive chunks (inputs k..k+31, 4 per dword) are one 8 x 64-byte B tile;
//   int4/int2   a chunk's bit-planes decode (as in blocked.cpp) to B-tile rows in a per-thread scratch block.
// The arithmetic matches the AVX512 kernels: bf16 products summed in fp32 (dense, int4/int2, with the same 128 + q
// codes and per-group scale and min), and exact int32 sums per 32 inputs for int8 (tdpbsud: signed activation
// digits times unsigned weight bytes). Only the order of the fp32 additions differs.
//
// Tiles: 0-3 accumulators (rows x 16 fp32), 4, 5 activations (rows x 32 inputs), 6, 7 weights. Tile rows are fixed
// by one configuration per thread and call, so batches above 16 rows are padded to a multiple of 16 (`rows_for`).
#pragma once
#include "common.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__) && defined(__AVX512BF16__)
#define GLOWPLUG_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

namespace glowplug {
namespace amx {

// Batches with fewer rows than these stay on the AVX512 kernels: there a tile is mostly padding, and its store and
// scaling cost more than the vector dot products they replace. Crossovers measured one-threaded on a 3072 x 576
// weight held in L2 (the gate/up projection of SmolLM2; reports/kernels.md has per-shape speeds on both sides): dense
// bf16 and int4 are faster on tiles from 4 rows, int8 (whose AVX512 kernel needs no decoding) from 8.
constexpr int64_t kMinRowsDense = 4, kMinRowsIntN = 4, kMinRowsInt8 = 8;

// Linux hands AMX's 8 KiB tile state only to a process that asks for it (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA, once per process, for all its threads). Where it refuses, the AVX512 kernels run.
inline bool available() {
  static const bool granted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}

// Rows per tile for a batch of M rows: M itself up to 16, else 16 (the batch padded to a multiple of 16).
inline int rows_for(int64_t M) { return M <= 16 ? static_cast<int>(M) : 16; }
inline int64_t padded_rows(int64_t M) { return M <= 16 ? M : (M + 15) / 16 * 16; }

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// a_bytes: bytes per activation-tile row (64: 32 bf16; 32: 32 int8 digits); its B tile has a_bytes / 4 rows.
inline void configure(int rows, int a_bytes) {
  TileConfig c;
  for (int t : {0, 1, 2, 3}) c.rows[t] = static_cast<uint8_t>(rows), c.colsb[t] = 64;
  for (int t : {4, 5}) c.rows[t] = static_cast<uint8_t>(rows), c.colsb[t] = static_cast<uint16_t>(a_bytes);
  for (int t : {6, 7}) c.rows[t] = static_cast<uint8_t>(a_bytes / 4), c.colsb[t] = 64;
  _tile_loadconfig(&c);
}

template <int DIST, int BYTES>
inline void prefetch_span(const void* p) {  // every cache line of [p + DIST, p + DIST + BYTES)
  const char* c = static_cast<const char*>(p) + DIST;
  _Pragma("GCC unroll 16") for (int i = 0; i < BYTES; i += 64) _mm_prefetch(c + i, _MM_HINT_T0);
}

// ------------------------------------------------------------------------------------------------- dense bf16
// x: [*, K] bf16 with at least m0 + rows rows; wb: the N-block's [K / 2, 16, 2] stream.
template <int AHEAD, class Store>
inline void dense_block(const uint16_t* wb, int64_t K, const uint16_t* x, int64_t m0, int valid, const Store& st) {
  const int64_t T = K / 32;
  const uint16_t* xa = x + m0 * K;
  _tile_zero(0);
  _tile_zero(1);
  int64_t t = 0;
  for (; t + 2 <= T; t += 2) {
    prefetch_span<AHEAD, 2048>(wb + t * 512);
    _tile_loadd(6, wb + t * 512, 64);
    _tile_loadd(4, xa + t * 32, K * 2);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, wb + (t + 1) * 512, 64);
    _tile_loadd(5, xa + (t + 1) * 32, K * 2);
    _tile_dpbf16ps(1, 5, 7);
  }
  if (t < T) {
    _tile_loadd(6, wb + t * 512, 64);
    _tile_loadd(4, xa + t * 32, K * 2);
    _tile_dpbf16ps(0, 4, 6);
  }
  alignas(64) float c0[256], c1[256];
  _tile_stored(0, c0, 64);
  _tile_stored(1, c1, 64);
  for (int m = 0; m < valid; ++m) st(m0 + m, _mm512_add_ps(_mm512_load_ps(c0 + 16 * m), _mm512_load_ps(c1 + 16 * m)));
}

// ------------------------------------------------------------------------------------ packed weights (shared)
// The packed formats become bf16 B tiles in a scratch block (`*_decode`), and `grouped_multiply` runs the tiles.
// The codes decode to exact bf16 numbers with a fixed exponent (0x4300 | q = 128 + q, as in blocked.cpp), so each
// group's partial sum needs its group's scale: y = sum_g (s_g * C_g + adj_g * xsum_g), with C_g the tile product over
// the group and adj_g taking the code offset back. Each group gets an accumulator tile that is stored and scaled on
// the vector units.
//
// Scheduling: decoding a whole block and then multiplying it runs the vector work and the tile work one after the
// other; decoding the next input tile while the current one multiplies overlaps them, and measured faster on a
// simulated int4 decode step at batch 16 (all 121 GEMVs on distinct weights; per-shape speeds: reports/kernels.md).
// Storing a tile product must wait for it, so four accumulators rotate (tiles 0-3; activations in 4/5, weights in 6/7): group
// g's multiply is issued, then group g - 1's accumulator is stored and group g - 2's stored sums are scaled. Batches
// above 16 rows decode the block once and every 16-row tile reads it.
//
// decode(t): writes activation tile t's B tile into scratch + t * 512 (called one tile ahead; never when the
// block is already decoded). scale(g, s, adj): group g's scale and offset vectors.
template <class Decode, class Scale, class Store>
inline void grouped_multiply(int64_t K, int64_t G, const uint16_t* scratch, const Decode& decode, bool decoded,
                             const uint16_t* x, const float* xsum, int64_t m0, int valid, const Scale& scale,
                             const Store& st) {
  const int64_t T = K / 32, tiles_per_group = T / G;
  const uint16_t* xa = x + m0 * K;
  alignas(64) float c[4][256];
  __m512 tot[16];
  for (int m = 0; m < 16; ++m) tot[m] = _mm512_setzero_ps();
  const auto epilogue = [&](int64_t g) {
    __m512 s, adj;
    scale(g, s, adj);
    const float* cg = c[g & 3];
    for (int m = 0; m < valid; ++m) {
      tot[m] = _mm512_fmadd_ps(_mm512_load_ps(cg + 16 * m), s, tot[m]);
      tot[m] = _mm512_fmadd_ps(adj, _mm512_set1_ps(xsum[(m0 + m) * G + g]), tot[m]);
    }
  };
  if (!decoded) decode(0);
  int64_t t = 0;  // the next activation tile
  // GCC's tile intrinsics take tile numbers as literals (pasted into the instruction), hence a macro.
#define GLOWPLUG_TILE_MUL(C, A, B)                                                       \
  do {                                                                                   \
    _tile_loadd(A, xa + t * 32, K * 2);                                                  \
    _tile_loadd(B, scratch + t * 512, 64);                                               \
    _tile_dpbf16ps(C, A, B);                                                             \
  } while (0)
#define GLOWPLUG_GROUP_STEP(C, PREV, g)                                                  \
  do {                                                                                   \
    if ((g) < G) {                                                                       \
      _tile_zero(C);                                                                     \
      for (int64_t i = 0; i < tiles_per_group; ++i, ++t) {                               \
        if (!decoded && t + 1 < T) decode(t + 1);                                        \
        if (t & 1) GLOWPLUG_TILE_MUL(C, 5, 7);                                           \
        else GLOWPLUG_TILE_MUL(C, 4, 6);                                                 \
      }                                                                                  \
    }                                                                                    \
    if ((g) >= 1 && (g) - 1 < G) _tile_stored(PREV, c[((g) - 1) & 3], 64);              \
    if ((g) >= 2 && (g) - 2 < G) epilogue((g) - 2);                                      \
  } while (0)
  for (int64_t g = 0; g < G + 2; g += 4) {
    GLOWPLUG_GROUP_STEP(0, 3, g);
    GLOWPLUG_GROUP_STEP(1, 0, g + 1);
    GLOWPLUG_GROUP_STEP(2, 1, g + 2);
    GLOWPLUG_GROUP_STEP(3, 2, g + 3);
  }
#undef GLOWPLUG_GROUP_STEP
#undef GLOWPLUG_TILE_MUL
  for (int m = 0; m < valid; ++m) st(m0 + m, tot[m]);
}

// ---------------------------------------------------------------------------------------------- int4 / int2
// blk: the N-block's stream (codes, then G x 16 fp16 scales, then G x 16 fp16 mins). Activation tile t's B tile:
// chunk c of the tile, plane p is B row (pair) c * PLANES + p, exactly the pairs the AVX512 kernel multiplies.
template <int BITS, int AHEAD>
inline void intn_decode(const uint8_t* blk, int64_t t, uint16_t* scratch) {
  constexpr int PLANES = 16 / BITS, CHUNKS = 32 / (2 * PLANES);
  const __m512i mask = _mm512_set1_epi16((1 << BITS) - 1);
  const __m512i expo = _mm512_set1_epi16(0x4300);
  const uint8_t* chunk = blk + t * CHUNKS * 64;
  uint16_t* b = scratch + t * 512;
  _Pragma("GCC unroll 4") for (int c = 0; c < CHUNKS; ++c, chunk += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(chunk) + AHEAD, _MM_HINT_T0);
    const __m512i v = _mm512_loadu_si512(chunk);
    _Pragma("GCC unroll 16") for (int p = 0; p < PLANES; ++p) {
      const __m512i sh = p == 0 ? v : _mm512_srli_epi16(v, BITS * p);
      const __m512i w = p == PLANES - 1 ? _mm512_or_si512(sh, expo) : _mm512_ternarylogic_epi32(sh, mask, expo, 0xEA);
      _mm512_storeu_si512(b + (c * PLANES + p) * 32, w);
    }
  }
}

template <int BITS>
inline void intn_scale(const uint8_t* blk, int64_t K, int64_t G, int64_t g, __m512& s, __m512& adj) {
  const uint16_t* scales = reinterpret_cast<const uint16_t*>(blk + K * BITS * 2);
  s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + g * 16)));
  const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + (G + g) * 16)));
  adj = _mm512_fnmadd_ps(_mm512_set1_ps(128.f), s, mn);  // min - 128 * scale: takes the code offset back
}

// -------------------------------------------------------------------------------------------------------- int8
// blk: the N-block's stream (K / 4 chunks, then G x 16 fp32 scales); hi/lo [*, K] signed activation digits,
// xscale/xsum128 [*, K / 32] (blocked.cpp's X16).
template <int AHEAD, class Store>
inline void int8_block(const uint8_t* blk, int64_t K, int64_t gs, const int8_t* hi, const int8_t* lo,
                       const float* xscale, const int32_t* xsum128, int64_t m0, int valid, const Store& st) {
  const int64_t G = K / gs, KB = K / 32, blocks_per_group = gs / 32;
  const float* scales = reinterpret_cast<const float*>(blk + K * 16);
  alignas(64) int32_t ch[256], cl[256];
  __m512 tot[16], gacc[16];
  for (int m = 0; m < 16; ++m) tot[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    for (int m = 0; m < valid; ++m) gacc[m] = _mm512_setzero_ps();
    for (int64_t bb = 0; bb < blocks_per_group; ++bb) {
      const int64_t b = g * blocks_per_group + bb;
      prefetch_span<AHEAD, 512>(blk + b * 512);
      _tile_zero(0);
      _tile_zero(1);
      _tile_loadd(6, blk + b * 512, 64);
      _tile_loadd(4, hi + m0 * K + b * 32, K);
      _tile_loadd(5, lo + m0 * K + b * 32, K);
      _tile_dpbsud(0, 4, 6);
      _tile_dpbsud(1, 5, 6);
      _tile_stored(0, ch, 64);
      _tile_stored(1, cl, 64);
      for (int m = 0; m < valid; ++m) {
        const int64_t xb = (m0 + m) * KB + b;
        const __m512i h = _mm512_load_si512(ch + 16 * m), l = _mm512_load_si512(cl + 16 * m);
        const __m512i exact =
            _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(h, 8), l), _mm512_set1_epi32(xsum128[xb]));
        gacc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), _mm512_set1_ps(xscale[xb]), gacc[m]);
      }
    }
    const __m512 s = _mm512_loadu_ps(scales + g * 16);
    for (int m = 0; m < valid; ++m) tot[m] = _mm512_fmadd_ps(gacc[m], s, tot[m]);
  }
  for (int m = 0; m < valid; ++m) st(m0 + m, tot[m]);
}

// Run `block(nb)` over every N-block in parallel, each thread configuring its tiles once (rows from rows_for(M),
// a_bytes as in configure) and giving the tile state back at the end. A block covers every row of the batch in
// 16-row tiles (`for_rows`), so its weights come from memory once and from cache for the later tiles.
template <class F>
void for_blocks(int64_t M, int64_t NB, int a_bytes, const F& block) {
  torch::stable::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    configure(rows_for(M), a_bytes);
    for (int64_t nb = b0; nb < b1; ++nb) block(nb);
    _tile_release();
  });
}

// f(m0, valid) for each 16-row tile of an M-row batch.
template <class F>
inline void for_rows(int64_t M, const F& f) {
  for (int64_t m0 = 0; m0 < M; m0 += 16) f(m0, static_cast<int>(std::min<int64_t>(16, M - m0)));
}

}  // namespace amx
}  // namespace glowplug
#endif
