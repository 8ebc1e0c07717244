// AMX (Advanced Matrix Extensions) versions of blocked.cpp's block kernels, for batches of several activation rows.
//
// Why: the AVX512 block kernels spend one vdpbf16ps / vpdpbusd per activation row per 64 weight bytes, so at batch 16
// they are bound by arithmetic, not by the weight stream (reports/decode-quantized.md, "step / batch-1 step"). One
// AMX tile multiply takes a 16-row activation tile against 1 KiB of weights, and the step goes back to streaming.
//
// Every format runs the same bf16 tile product (`block_rows`, two N-blocks at a time in `block_rows_pair`); only
// where its B tiles come from differs:
//   dense bf16  the blocked layout is already AMX's "VNNI" B-tile layout: 16 consecutive chunks (pairs k..k+31 of
//               the block's 16 rows) are one 16 x 64-byte B tile, loaded straight from the packed weight;
//   int4/int2   a chunk's bit-planes and int8's bytes are dequantized to bf16 B tiles in a per-thread scratch block
//   int8        (`intn_dequant`, `int8_dequant`), one tile ahead of the multiply.
// Products are summed in fp32 over the whole K. Against the AVX512 kernels, which multiply exact codes and scale per
// group, the packed formats here round each dequantized weight to bf16 once (int8 with per-output scales stays
// exact), and the fp32 additions run in another order.
//
// Tiles: 0-3 accumulators (rows x 16 fp32), 4, 5 activations (rows x 32 bf16), 6, 7 weights. Tile rows are fixed
// by one configuration per thread and call, so batches above 16 rows are padded to a multiple of 16 (`rows_for`).
#pragma once
#include "common.h"
#include "dequant.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__) && defined(__AVX512BF16__)
#define GLOWPLUG_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

namespace glowplug {
namespace amx {

// Batches with fewer rows than these stay on the AVX512 kernels: there a tile is mostly padding, and dequantizing
// the weights to tiles costs more than the vector dot products they replace. Crossovers measured one-threaded on a
// 3072 x 576 weight (the gate/up projection of SmolLM2; reports/kernels.md has per-shape speeds on both sides):
// dense bf16 and int4 are faster on tiles from 4 rows; int8, whose AVX512 kernel needs no decoding, ties at 8 rows
// and is faster on tiles from 12.
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

// Accumulators and activation tiles have `rows` rows (of 16 fp32 / 32 bf16); weight tiles are 16 input pairs.
inline void configure(int rows) {
  TileConfig c;
  for (int t : {0, 1, 2, 3, 4, 5}) c.rows[t] = static_cast<uint8_t>(rows), c.colsb[t] = 64;
  for (int t : {6, 7}) c.rows[t] = 16, c.colsb[t] = 64;
  _tile_loadconfig(&c);
}

template <int DIST, int BYTES, int HINT = _MM_HINT_T0>
inline void prefetch_span(const void* p) {  // every cache line of [p + DIST, p + DIST + BYTES), into L1 (T0) or L2 (T1)
  const char* c = static_cast<const char*>(p) + DIST;
  _Pragma("GCC unroll 16") for (int i = 0; i < BYTES; i += 64) _mm_prefetch(c + i, static_cast<_mm_hint>(HINT));
}

// ------------------------------------------------------------------------------------------ the tile product
// One N-block (16 outputs) against R 16-row activation tiles: for each 32-input step t, the block's B tile (1 KiB:
// 16 input pairs x 16 outputs, bf16) is loaded once and multiplied into R accumulators (tiles 0..R-1), each of which
// sums over the whole K. So the weights are read once per R row tiles, and nothing is stored until the end.
// `tile(t)` gives B tile t (straight from a dense block, or decoded into scratch). With one row tile two accumulators
// alternate, so consecutive multiplies do not wait on each other. c[r]: row tile r's 16 x 16 fp32 result.
template <int R, class Tile>
inline void multiply_tiles(int64_t K, const Tile& tile, const uint16_t* xa, float (*c)[256]) {
  const int64_t T = K / 32, ld = K * 2;
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (R > 2) _tile_zero(2);
  if constexpr (R > 3) _tile_zero(3);
  // GCC's tile intrinsics take tile numbers as literals (pasted into the instruction), hence a macro.
#define GLOWPLUG_AMX_STEP(BT, C1)                                                           \
  do {                                                                                      \
    _tile_loadd(BT, tile(t), 64);                                                           \
    _tile_loadd(4, xa + t * 32, ld);                                                        \
    _tile_dpbf16ps(C1, 4, BT);                                                              \
    if constexpr (R > 1) { _tile_loadd(5, xa + 16 * K + t * 32, ld); _tile_dpbf16ps(1, 5, BT); } \
    if constexpr (R > 2) { _tile_loadd(4, xa + 32 * K + t * 32, ld); _tile_dpbf16ps(2, 4, BT); } \
    if constexpr (R > 3) { _tile_loadd(5, xa + 48 * K + t * 32, ld); _tile_dpbf16ps(3, 5, BT); } \
  } while (0)
  for (int64_t t = 0; t < T; ++t) {
    if (t & 1) {
      if constexpr (R == 1) GLOWPLUG_AMX_STEP(7, 1);
      else GLOWPLUG_AMX_STEP(7, 0);
    } else {
      GLOWPLUG_AMX_STEP(6, 0);
    }
  }
#undef GLOWPLUG_AMX_STEP
  _tile_stored(0, c[0], 64);
  _tile_stored(1, c[1], 64);
  if constexpr (R > 2) _tile_stored(2, c[2], 64);
  if constexpr (R > 3) _tile_stored(3, c[3], 64);
  if constexpr (R == 1)
    for (int i = 0; i < 256; i += 16) _mm512_store_ps(c[0] + i, _mm512_add_ps(_mm512_load_ps(c[0] + i), _mm512_load_ps(c[1] + i)));
}

// One N-block for a whole M-row batch (x padded to whole 16-row tiles above 16 rows), in groups of up to 4 row
// tiles. tile(t, first): B tile t, where `first` is true for the first group (a decoding source decodes then, one
// tile ahead of the multiply so the vector work overlaps the tile work, and the later groups reuse the block).
// st(m, v): row m's 16 outputs.
template <class Tile, class Store>
inline void block_rows(int64_t M, int64_t K, const uint16_t* x, const Tile& tile, const Store& st) {
  const int64_t tiles = M <= 16 ? 1 : (M + 15) / 16;
  alignas(64) float c[4][256];
  for (int64_t r0 = 0; r0 < tiles; r0 += 4) {
    const int64_t R = std::min<int64_t>(4, tiles - r0);
    const bool first = r0 == 0;
    const auto tl = [&](int64_t t) { return tile(t, first); };
    const uint16_t* xa = x + r0 * 16 * K;
    switch (R) {
      case 1: multiply_tiles<1>(K, tl, xa, c); break;
      case 2: multiply_tiles<2>(K, tl, xa, c); break;
      case 3: multiply_tiles<3>(K, tl, xa, c); break;
      default: multiply_tiles<4>(K, tl, xa, c); break;
    }
    for (int64_t r = 0; r < R; ++r) {
      const int64_t m0 = (r0 + r) * 16, valid = std::min<int64_t>(16, M - m0);
      for (int64_t m = 0; m < valid; ++m) st(m0 + m, _mm512_load_ps(c[r] + 16 * m));
    }
  }
}

// Two N-blocks (A and B) against one or two row tiles: accumulators 0, 1 are block A's row tiles, 2, 3 block B's.
// Each activation tile load feeds two multiplies. Why: at 64 rows, one N-block at a time re-reads the whole batch's
// activations (64 x K bf16, more than L1 holds) from L2 for every 16 outputs, and that traffic, not the tile
// multiplies or the dequantization, bounded the step; pairing the blocks halves it (per-shape speeds:
// reports/kernels.md, rows M=16 and M=64; the decode step: reports/decode-quantized.md).
template <int R, class TileA, class TileB>
inline void multiply_pair(int64_t K, const TileA& ta, const TileB& tb, const uint16_t* xa, float (*c)[256]) {
  const int64_t T = K / 32, ld = K * 2;
  _tile_zero(0);
  _tile_zero(2);
  if constexpr (R > 1) {
    _tile_zero(1);
    _tile_zero(3);
  }
  for (int64_t t = 0; t < T; ++t) {
    _tile_loadd(6, ta(t), 64);
    _tile_loadd(7, tb(t), 64);
    _tile_loadd(4, xa + t * 32, ld);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 4, 7);
    if constexpr (R > 1) {
      _tile_loadd(5, xa + 16 * K + t * 32, ld);
      _tile_dpbf16ps(1, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c[0], 64);
  _tile_stored(2, c[2], 64);
  if constexpr (R > 1) {
    _tile_stored(1, c[1], 64);
    _tile_stored(3, c[3], 64);
  }
}

// block_rows for two N-blocks at once, in groups of up to 2 row tiles.
template <class TileA, class TileB, class StoreA, class StoreB>
inline void block_rows_pair(int64_t M, int64_t K, const uint16_t* x, const TileA& ta, const TileB& tb,
                            const StoreA& sa, const StoreB& sb) {
  const int64_t tiles = M <= 16 ? 1 : (M + 15) / 16;
  alignas(64) float c[4][256];
  for (int64_t r0 = 0; r0 < tiles; r0 += 2) {
    const int64_t R = std::min<int64_t>(2, tiles - r0);
    const bool first = r0 == 0;
    const auto la = [&](int64_t t) { return ta(t, first); };
    const auto lb = [&](int64_t t) { return tb(t, first); };
    const uint16_t* xa = x + r0 * 16 * K;
    if (R == 1)
      multiply_pair<1>(K, la, lb, xa, c);
    else
      multiply_pair<2>(K, la, lb, xa, c);
    for (int64_t r = 0; r < R; ++r) {
      const int64_t m0 = (r0 + r) * 16, valid = std::min<int64_t>(16, M - m0);
      for (int64_t m = 0; m < valid; ++m) {
        sa(m0 + m, _mm512_load_ps(c[r] + 16 * m));
        sb(m0 + m, _mm512_load_ps(c[2 + r] + 16 * m));
      }
    }
  }
}

// ---------------------------------------------------------------------------------- int8, per-output scales
// With one scale per output the weight bytes need no dequantizing: the activations are taken to 24-bit fixed point
// per row and split into three signed bytes (blocked.cpp `x24_digits`), and each digit row multiplies the unsigned
// weight bytes straight from the packed layout (16 consecutive chunks = inputs k..k+63 = one 16 x 64-byte B tile)
// with tdpbsud, into its own exact int32 accumulator over the whole K: three tile multiplies per weight tile and no
// vector work. Its three accumulators and three activation tiles leave room for one row tile, so it serves batches
// of up to 16 rows; above that, the bf16 path shares each dequantized tile among four row tiles. Measured on a
// simulated decode step (all 121 int8 GEMVs on distinct weights, 2 threads): 10.7-10.9 ms at 16 rows against
// 11.7 on the bf16 path, and even at 64 rows. d2/d1/d0: [*, K] digit rows; c: the three 16 x 16 int32 results.
// Prefetch: each weight tile 16 KiB ahead into L2 and 2 KiB ahead into L1. With only the L1 prefetch (8 KiB ahead)
// the weight stream stalled: a core has few L1 fill buffers, and L2 prefetches are not bound by them. On the
// simulated step above (2 threads, Intel Xeon, three runs each): 7.1-8.1 ms against 5.4-5.5 at 8 rows, 8.9-9.9
// against 7.3-9.1 at 16 (per-shape speeds: reports/kernels.md, int8 rows at M=16).
constexpr int kDigitsNear = 2048, kDigitsFar = 16384;
inline void int8_digits_block(const uint8_t* blk, int64_t K, const int8_t* d2, const int8_t* d1, const int8_t* d0,
                              int32_t (*c)[256]) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  // GCC's tile intrinsics take tile numbers as literals (pasted into the instruction), hence a macro; the weight
  // tile alternates between 6 and 7 so the next load need not wait for the multiplies reading the last one.
#define GLOWPLUG_DIGITS_STEP(BT)             \
  do {                                       \
    _tile_loadd(BT, blk + t * 1024, 64);     \
    _tile_loadd(3, d2 + t * 64, K);          \
    _tile_dpbsud(0, 3, BT);                  \
    _tile_loadd(4, d1 + t * 64, K);          \
    _tile_dpbsud(1, 4, BT);                  \
    _tile_loadd(5, d0 + t * 64, K);          \
    _tile_dpbsud(2, 5, BT);                  \
  } while (0)
  for (int64_t t = 0; t < K / 64; ++t) {
    prefetch_span<kDigitsFar, 1024, _MM_HINT_T1>(blk + t * 1024);
    prefetch_span<kDigitsNear, 1024>(blk + t * 1024);
    if (t & 1)
      GLOWPLUG_DIGITS_STEP(7);
    else
      GLOWPLUG_DIGITS_STEP(6);
  }
#undef GLOWPLUG_DIGITS_STEP
  _tile_stored(0, c[0], 64);
  _tile_stored(1, c[1], 64);
  _tile_stored(2, c[2], 64);
}

// What a format gives the driver for one N-block: its B tiles (tile(t, first), as block_rows takes them) and where
// its outputs go (store(m, v)).
template <class Tile, class Store>
struct Block {
  Tile tile;
  Store store;
};
template <class Tile, class Store>
Block<Tile, Store> block(Tile tile, Store store) { return {tile, store}; }

// Run every N-block in parallel, two at a time (block_rows_pair; an odd last block alone), each thread configuring
// its tiles once (rows from rows_for(M)) and giving the tile state back at the end. source(nb, slot) returns N-block
// nb's Block; slot (0 or 1) is its place in the pair, so a decoding source keeps the two in separate scratch.
template <class Source>
void for_block_pairs(int64_t M, int64_t K, const uint16_t* x, int64_t NB, const Source& source) {
  torch::stable::parallel_for(0, (NB + 1) / 2, 1, [&](int64_t p0, int64_t p1) {
    configure(rows_for(M));
    for (int64_t p = p0; p < p1; ++p) {
      const auto a = source(2 * p, 0);
      if (2 * p + 1 < NB) {
        const auto b = source(2 * p + 1, 1);
        block_rows_pair(M, K, x, a.tile, b.tile, a.store, b.store);
      } else {
        block_rows(M, K, x, a.tile, a.store);
      }
    }
    _tile_release();
  });
}

// Run `block(nb)` over every N-block in parallel (for kernels with their own tile product), each thread configuring
// its tiles once and giving the tile state back at the end.
template <class F>
void for_blocks(int64_t M, int64_t NB, const F& block) {
  torch::stable::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    configure(rows_for(M));
    for (int64_t nb = b0; nb < b1; ++nb) block(nb);
    _tile_release();
  });
}

}  // namespace amx
}  // namespace glowplug
#endif
