// glowplug native CPU kernels, the row-major (K-major) ones: dense GEMV for fp32 (and bf16 on CPUs without
// AVX512-BF16) and w8a8 with per-token int8 activations. The bf16-activation kernels for packed and dense bf16 weights
// are in blocked.cpp. Built at run time with the machine's g++, one build per ISA level, against torch's stable C ABI
// only (kernels/native.py); every op has a pure-torch reference in kernels/reference.py that tests/kernels compare it to.
//
// dense_linear streams each weight row once, in address order, and reuses it for all M activation rows (16 rows at a
// time, so later activation blocks re-read the tile from L1/L2); M > small_m goes to aten's GEMM (oneDNN).
// w8a8_linear quantizes x per row exactly as kernels/formats.quantize_per_token does and multiplies with VNNI, or,
// for batches on a CPU with AMX, with int8 tile multiplies (the weight rows are the A tiles as stored).
#include "amx.h"
#include "common.h"

namespace glowplug {
namespace {

// ------------------------------------------------------------------------------------------------ dense
// One weight row against up to MB activation rows; bf16 weights and bf16 activations use vdpbf16ps (32 products per
// instruction, accumulated in fp32); everything else converts to fp32 and uses FMA.
template <int MB>
void dense_rows_bf16(const uint16_t* w, const uint16_t* x, int64_t K, int64_t N, int64_t n0, int64_t n1,
                     const OutWriter& out, int64_t m0) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* wr = w + n * K;
    float res[MB];
#if defined(__AVX512BF16__)
    __m512 acc[MB][2];
    _Pragma("GCC unroll 8")
    for (int m = 0; m < MB; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
      __m512bh w0 = (__m512bh)_mm512_loadu_si512(wr + k);
      __m512bh w1 = (__m512bh)_mm512_loadu_si512(wr + k + 32);
      _Pragma("GCC unroll 8")
      for (int m = 0; m < MB; ++m) {
        const uint16_t* xr = x + (m0 + m) * K + k;
        acc[m][0] = _mm512_dpbf16_ps(acc[m][0], w0, (__m512bh)_mm512_loadu_si512(xr));
        acc[m][1] = _mm512_dpbf16_ps(acc[m][1], w1, (__m512bh)_mm512_loadu_si512(xr + 32));
      }
    }
    for (; k + 32 <= K; k += 32) {
      __m512bh w0 = (__m512bh)_mm512_loadu_si512(wr + k);
      _Pragma("GCC unroll 8")
      for (int m = 0; m < MB; ++m)
        acc[m][0] = _mm512_dpbf16_ps(acc[m][0], w0, (__m512bh)_mm512_loadu_si512(x + (m0 + m) * K + k));
    }
    _Pragma("GCC unroll 8")
    for (int m = 0; m < MB; ++m) res[m] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]));
#elif defined(__AVX512F__)
    __m512 acc[MB];
    _Pragma("GCC unroll 8")
    for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
      __m512 wv = load_bf16x16(wr + k);
      _Pragma("GCC unroll 8")
      for (int m = 0; m < MB; ++m) acc[m] = _mm512_fmadd_ps(wv, load_bf16x16(x + (m0 + m) * K + k), acc[m]);
    }
    _Pragma("GCC unroll 8")
    for (int m = 0; m < MB; ++m) res[m] = _mm512_reduce_add_ps(acc[m]);
#else  // 16 lanes per row: GCC does not vectorize a scalar fp32 sum (it may not reorder the additions)
    F16 acc[MB];
    _Pragma("GCC unroll 8")
    for (int m = 0; m < MB; ++m) acc[m] = vsplat(0.f);
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
      const F16 wv = vload_bf16(wr + k);
      _Pragma("GCC unroll 8")
      for (int m = 0; m < MB; ++m) acc[m] += wv * vload_bf16(x + (m0 + m) * K + k);
    }
    _Pragma("GCC unroll 8")
    for (int m = 0; m < MB; ++m) res[m] = vsum(acc[m]);
#endif
    for (; k < K; ++k) {
      float wv = bf16_to_f32(wr[k]);
      _Pragma("GCC unroll 8")
      for (int m = 0; m < MB; ++m) res[m] += wv * bf16_to_f32(x[(m0 + m) * K + k]);
    }
    _Pragma("GCC unroll 8")
    for (int m = 0; m < MB; ++m) out.put(m0 + m, n, res[m]);
  }
}

template <int MB>
void dense_rows_f32(const float* w, const float* x, int64_t K, int64_t n0, int64_t n1, const OutWriter& out,
                    int64_t m0) {
  for (int64_t n = n0; n < n1; ++n) {
    const float* wr = w + n * K;
    float res[MB];
    int64_t k = 0;
#if defined(__AVX512F__)
    __m512 acc[MB][2];
    _Pragma("GCC unroll 8")
    for (int m = 0; m < MB; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (; k + 32 <= K; k += 32) {
      _mm_prefetch(reinterpret_cast<const char*>(wr + k) + 2048, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(wr + k) + 2048 + 64, _MM_HINT_T0);
      __m512 w0 = _mm512_loadu_ps(wr + k), w1 = _mm512_loadu_ps(wr + k + 16);
      _Pragma("GCC unroll 8")
      for (int m = 0; m < MB; ++m) {
        const float* xr = x + (m0 + m) * K + k;
        acc[m][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr), acc[m][0]);
        acc[m][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), acc[m][1]);
      }
    }
    _Pragma("GCC unroll 8")
    for (int m = 0; m < MB; ++m) res[m] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]));
#else  // 16 lanes per row, as in dense_rows_bf16
    F16 acc[MB];
    _Pragma("GCC unroll 8")
    for (int m = 0; m < MB; ++m) acc[m] = vsplat(0.f);
    for (; k + 16 <= K; k += 16) {
      const F16 wv = vload<F16>(wr + k);
      _Pragma("GCC unroll 8")
      for (int m = 0; m < MB; ++m) acc[m] += wv * vload<F16>(x + (m0 + m) * K + k);
    }
    _Pragma("GCC unroll 8")
    for (int m = 0; m < MB; ++m) res[m] = vsum(acc[m]);
#endif
    for (; k < K; ++k)
      _Pragma("GCC unroll 8")
      for (int m = 0; m < MB; ++m) res[m] += wr[k] * x[(m0 + m) * K + k];
    _Pragma("GCC unroll 8")
    for (int m = 0; m < MB; ++m) out.put(m0 + m, n, res[m]);
  }
}

// Run `rows(mb, m0, n0, n1)` over all rows of W in parallel and over the M activation rows in blocks of <= 4. Rows
// are taken in tiles of kTile so that, for M > 4, a tile's weights are re-read from L1/L2 by the later activation
// blocks instead of from memory.
constexpr int64_t kTile = 16;
template <class F>
void for_rows(int64_t M, int64_t N, const F& rows) {
  torch::stable::parallel_for(0, N, kGrain, [&](int64_t n0, int64_t n1) {
    for (int64_t t0 = n0; t0 < n1; t0 += kTile) {
      const int64_t t1 = std::min(t0 + kTile, n1);
      for (int64_t m0 = 0; m0 < M; m0 += 4) rows(std::min<int64_t>(4, M - m0), m0, t0, t1);
    }
  });
}

#define GLOWPLUG_DISPATCH_MB(mb, FN, ...) \
  switch (mb) {                           \
    case 1: FN<1>(__VA_ARGS__); break;    \
    case 2: FN<2>(__VA_ARGS__); break;    \
    case 3: FN<3>(__VA_ARGS__); break;    \
    default: FN<4>(__VA_ARGS__); break;   \
  }

Tensor dense_linear(Tensor x, Tensor w, int64_t small_m) {
  STD_TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "dense_linear: w must be a contiguous [N, K] tensor");
  const int64_t N = w.size(0), K = w.size(1), M = x.size(0);
  check_x(x, K);
  STD_TORCH_CHECK(x.scalar_type() == w.scalar_type(), "dense_linear: x and w must have the same dtype");
  if (M > small_m) return torch::stable::matmul(x, torch::stable::transpose(w, 0, 1));
  Tensor y = new_out(x, M, N);
  OutWriter out{y.mutable_data_ptr(), x.scalar_type() == ScalarType::BFloat16, N};
  if (x.scalar_type() == ScalarType::BFloat16) {
    const uint16_t* wp = static_cast<const uint16_t*>(w.const_data_ptr());
    const uint16_t* xp = static_cast<const uint16_t*>(x.const_data_ptr());
    for_rows(M, N, [&](int64_t mb, int64_t m0, int64_t n0, int64_t n1) {
      GLOWPLUG_DISPATCH_MB(mb, dense_rows_bf16, wp, xp, K, N, n0, n1, out, m0)
    });
  } else {
    const float* wp = static_cast<const float*>(w.const_data_ptr());
    const float* xp = static_cast<const float*>(x.const_data_ptr());
    for_rows(M, N, [&](int64_t mb, int64_t m0, int64_t n0, int64_t n1) {
      GLOWPLUG_DISPATCH_MB(mb, dense_rows_f32, wp, xp, K, n0, n1, out, m0)
    });
  }
  return y;
}

// -------------------------------------------------------------------------------------------------- w8a8
// x is quantized per row exactly as kernels/formats.quantize_per_token does (scale = max|x| / 127, round half to
// even, clamp), shifted to uint8 for vpdpbusd / tdpbsud (u8 x s8), and the shift is taken back with the weight row
// sums. With SmoothQuant, x is multiplied by 1 / smooth first (`inv`, or null). Reads x (bf16 or fp32) as it is:
// an fp32 copy per call cost page faults and a pass over memory.
struct XRows {
  const void* x;
  bool bf16;
  const float* inv;
  int64_t K;
  float at(int64_t m, int64_t k) const {
    const float v = bf16 ? bf16_to_f32(static_cast<const uint16_t*>(x)[m * K + k]) : static_cast<const float*>(x)[m * K + k];
    return inv ? v * inv[k] : v;
  }
#if defined(__AVX512F__)
  __m512 load(int64_t m, int64_t k, __mmask16 live) const {  // inputs k .. k+15 of row m (lanes off `live`: 0)
    __m512 v = bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(
                          live, static_cast<const uint16_t*>(x) + m * K + k)), 16))
                    : _mm512_maskz_loadu_ps(live, static_cast<const float*>(x) + m * K + k);
    return inv ? _mm512_mul_ps(v, _mm512_maskz_loadu_ps(live, inv + k)) : v;
  }
#endif
};

// Row m of x quantized into o[0..K); returns its scale.
inline float quantize_row(const XRows& x, int64_t m, uint8_t* o) {
  const int64_t K = x.K;
#if defined(__AVX512F__)
  auto live = [K](int64_t k) { return K - k >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << (K - k)) - 1); };
  __m512 va = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) va = _mm512_max_ps(va, _mm512_abs_ps(x.load(m, k, live(k))));
  const float scale = std::max(_mm512_reduce_max_ps(va) / 127.f, 1e-10f);
  const __m512 vs = _mm512_set1_ps(scale), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  for (int64_t k = 0; k < K; k += 16) {  // x / scale, rounded half to even as nearbyint does, then clamped
    const __mmask16 l = live(k);
    __m512 v = _mm512_roundscale_ps(_mm512_div_ps(x.load(m, k, l), vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm512_min_ps(hi, _mm512_max_ps(lo, v));
    _mm_mask_storeu_epi8(o + k, l, _mm512_cvtepi32_epi8(_mm512_add_epi32(_mm512_cvtps_epi32(v), _mm512_set1_epi32(128))));
  }
#else
  float amax = 0.f;
  for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(x.at(m, k)));
  const float scale = std::max(amax / 127.f, 1e-10f);
  for (int64_t k = 0; k < K; ++k) {
    const float v = std::min(127.f, std::max(-127.f, std::nearbyint(x.at(m, k) / scale)));
    o[k] = static_cast<uint8_t>(static_cast<int>(v) + 128);
  }
#endif
  return scale;
}

#ifdef GLOWPLUG_AMX
// r[i] <- column i of the 16 x 16 dword matrix whose rows were r[0..15].
inline void transpose16(__m512i (&r)[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int g = 0; g < 4; ++g) {  // u[4g + c], per 128-bit lane L: rows 4g..4g+3 of column c + 4L
    u[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xDD);
    const __m512i w0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88), w1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xDD);
    r[c] = _mm512_shuffle_i32x4(v0, w0, 0x88);
    r[c + 8] = _mm512_shuffle_i32x4(v0, w0, 0xDD);
    r[c + 4] = _mm512_shuffle_i32x4(v1, w1, 0x88);
    r[c + 12] = _mm512_shuffle_i32x4(v1, w1, 0xDD);
  }
}

// Batches from this many rows take the AMX path. Measured one-threaded on SmolLM2's 3072 x 576 weight: at 2 rows
// 38 us on tiles against 58 on VNNI (3 rows: 43 against 94), at 1 row about even (reports/kernels.md has per-shape
// speeds).
constexpr int64_t kMinRowsW8A8 = 2;

// y^T = W x^T on tiles: A = 16 weight rows x 64 inputs (signed, straight from the row-major weight), B = 64 inputs
// of 16 activation rows (unsigned, transposed once per call into `xt`), C = 16 outputs x 16 rows in int32, exact.
// A pass takes up to two blocks of 16 outputs against up to two tiles of 16 rows (four accumulators), so every tile
// it loads feeds two multiplies. Tile registers are not renamed: a load into a tile waits until the multiplies that
// read its last contents are done, and with one weight tile feeding four row tiles each load waited on that chain
// (about 130 cycles per row tile and 64 inputs at 64 rows, against the 16 a multiply takes).
// `next` (or null): the next pair's 32 weight rows, fetched into L2 over this pass (2 KiB per 64 inputs). The weight
// tiles are 16 rows K bytes apart, a pattern the hardware prefetcher does not follow; without this the loads of the
// weight tiles were most of the kernel's time at 64 rows (per-shape speeds: reports/kernels.md, w8a8 rows).
// xt: [row tile][K / 64][16 input quads][16 rows][4]. c[2n + j]: output block n, row tile j.
template <int RN, int RJ>
inline void w8a8_tiles(const int8_t* a0, const int8_t* a1, int64_t K, const uint8_t* x0, const uint8_t* x1, int64_t KT,
                       int32_t (*c)[256], const int8_t* next) {
  _tile_zero(0);
  if constexpr (RJ > 1) _tile_zero(1);
  if constexpr (RN > 1) _tile_zero(2);
  if constexpr (RN > 1 && RJ > 1) _tile_zero(3);
  for (int64_t t = 0; t < KT; ++t) {
    if (next) amx::prefetch_span<0, 2048, _MM_HINT_T1>(next + t * 2048);
    _tile_loadd(4, a0 + t * 64, K);
    _tile_loadd(6, x0 + t * 1024, 64);
    _tile_dpbsud(0, 4, 6);
    if constexpr (RN > 1) { _tile_loadd(5, a1 + t * 64, K); _tile_dpbsud(2, 5, 6); }
    if constexpr (RJ > 1) {
      _tile_loadd(7, x1 + t * 1024, 64);
      _tile_dpbsud(1, 4, 7);
      if constexpr (RN > 1) _tile_dpbsud(3, 5, 7);
    }
  }
  _tile_stored(0, c[0], 64);
  if constexpr (RJ > 1) _tile_stored(1, c[1], 64);
  if constexpr (RN > 1) _tile_stored(2, c[2], 64);
  if constexpr (RN > 1 && RJ > 1) _tile_stored(3, c[3], 64);
}

// Rows j*16 .. j*16+15 of x (rows from M on are zero inputs, 128) quantized, then transposed into this tile's part
// of xt. K % 64 == 0. `buf` holds the tile's 16 quantized rows. One task per tile, so a batch's tiles quantize on
// all threads (on one, the quantization was about half the call at 64 rows and 576 inputs).
void quantize_tile(const XRows& x, int64_t M, int64_t j, uint8_t* buf, uint8_t* xt, float* xs) {
  const int64_t K = x.K;
  for (int64_t i = 0; i < 16; ++i) {
    const int64_t m = j * 16 + i;
    if (m < M)
      xs[m] = quantize_row(x, m, buf + i * K);
    else
      std::memset(buf + i * K, 128, static_cast<size_t>(K));
  }
  for (int64_t t = 0; t < K / 64; ++t) {
    __m512i r[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(buf + i * K + t * 64);
    transpose16(r);
    for (int i = 0; i < 16; ++i) _mm512_storeu_si512(xt + (t * 16 + i) * 64, r[i]);
  }
}

void w8a8_amx(const XRows& x, const int8_t* qp, const float* ws, const int32_t* wsm,
              int64_t M, int64_t N, int64_t K, const OutWriter& out) {
  const int64_t MT = (M + 15) / 16, KT = K / 64, NT = (N + 15) / 16;
  // Scratch reused across calls (the calling thread's, and each worker's): fresh vectors cost page faults and
  // zero-fills on every call.
  thread_local std::vector<uint8_t> xt_store;
  thread_local std::vector<float> xs_store;
  xt_store.resize(static_cast<size_t>(MT * KT * 1024));
  xs_store.resize(static_cast<size_t>(M));
  uint8_t* xtp = xt_store.data();
  float* xs = xs_store.data();
  torch::stable::parallel_for(0, MT, 1, [&](int64_t j0, int64_t j1) {
    thread_local std::vector<uint8_t> buf;
    buf.resize(static_cast<size_t>(16 * K));
    for (int64_t j = j0; j < j1; ++j) quantize_tile(x, M, j, buf.data(), xtp + j * KT * 1024, xs);
  });
  torch::stable::parallel_for(0, (NT + 1) / 2, 1, [&](int64_t p0, int64_t p1) {
    amx::configure(16);
    alignas(64) int32_t c[4][256];
    std::vector<int8_t> tail;  // the last 16 weight rows, zero-padded, when N is not a multiple of 16
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t nb0 = 2 * p, RN = std::min<int64_t>(2, NT - nb0);
      const int8_t* a[2] = {qp + nb0 * 16 * K, qp + (nb0 + 1) * 16 * K};
      for (int64_t n = 0; n < RN; ++n) {
        const int64_t nv = std::min<int64_t>(16, N - (nb0 + n) * 16);
        if (nv < 16) {
          tail.assign(static_cast<size_t>(16 * K), 0);
          std::memcpy(tail.data(), a[n], static_cast<size_t>(nv * K));
          a[n] = tail.data();
        }
      }
      for (int64_t j0 = 0; j0 < MT; j0 += 2) {
        const int64_t RJ = std::min<int64_t>(2, MT - j0);
        const int8_t* next = (j0 == 0 && (nb0 + 4) * 16 <= N) ? qp + (nb0 + 2) * 16 * K : nullptr;
        const uint8_t* x0 = xtp + j0 * KT * 1024;
        const uint8_t* x1 = x0 + KT * 1024;
        if (RN == 2 && RJ == 2) w8a8_tiles<2, 2>(a[0], a[1], K, x0, x1, KT, c, next);
        else if (RN == 2) w8a8_tiles<2, 1>(a[0], a[1], K, x0, x1, KT, c, next);
        else if (RJ == 2) w8a8_tiles<1, 2>(a[0], a[1], K, x0, x1, KT, c, next);
        else w8a8_tiles<1, 1>(a[0], a[1], K, x0, x1, KT, c, next);
        for (int64_t n = 0; n < RN; ++n) {
          const int64_t n0 = (nb0 + n) * 16, nv = std::min<int64_t>(16, N - n0);
          const __mmask16 live = nv >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << nv) - 1);
          const __m512i shift = _mm512_mullo_epi32(_mm512_maskz_loadu_epi32(live, wsm + n0), _mm512_set1_epi32(128));
          const __m512 wsv = _mm512_maskz_loadu_ps(live, ws + n0);
          for (int64_t r = 0; r < RJ; ++r) {
            __m512i rows[16];  // c[2n + r] is [output][activation row]: transposed, row i is activation row i's outputs
            for (int i = 0; i < 16; ++i) rows[i] = _mm512_load_si512(c[2 * n + r] + 16 * i);
            transpose16(rows);
            const int64_t m0 = (j0 + r) * 16, valid = std::min<int64_t>(16, M - m0);
            for (int64_t i = 0; i < valid; ++i) {
              const __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(rows[i], shift)), wsv),
                                             _mm512_set1_ps(xs[m0 + i]));
              if (out.bf16)
                _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out.base) + (m0 + i) * out.ld + n0, live,
                                         (__m256i)_mm512_cvtneps_pbh(v));
              else
                _mm512_mask_storeu_ps(static_cast<float*>(out.base) + (m0 + i) * out.ld + n0, live, v);
            }
          }
        }
      }
    }
    _tile_release();
  });
}
#endif

Tensor w8a8_linear(Tensor x, Tensor q, Tensor wscale, Tensor wsum, Tensor inv_smooth) {
  STD_TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && q.scalar_type() == ScalarType::Char,
                  "w8a8_linear: q must be a contiguous int8 [N, K] tensor");
  const int64_t N = q.size(0), K = q.size(1), M = x.size(0);
  check_x(x, K);
  STD_TORCH_CHECK(wscale.numel() == N && wscale.scalar_type() == ScalarType::Float && wscale.is_contiguous(),
                  "w8a8_linear: wscale must be contiguous float32 [N]");
  STD_TORCH_CHECK(wsum.numel() == N && wsum.scalar_type() == ScalarType::Int && wsum.is_contiguous(),
                  "w8a8_linear: wsum must be contiguous int32 [N]");
  STD_TORCH_CHECK(inv_smooth.numel() == 0 || (inv_smooth.numel() == K && inv_smooth.scalar_type() == ScalarType::Float),
                  "w8a8_linear: inv_smooth must be empty or float32 [K]");
  const int8_t* qp = static_cast<const int8_t*>(q.const_data_ptr());
  const float* ws = static_cast<const float*>(wscale.const_data_ptr());
  const int32_t* wsm = static_cast<const int32_t*>(wsum.const_data_ptr());
  const float* is = inv_smooth.numel() ? static_cast<const float*>(inv_smooth.const_data_ptr()) : nullptr;
  Tensor y = new_out(x, M, N);
  OutWriter out{y.mutable_data_ptr(), x.scalar_type() == ScalarType::BFloat16, N};
  const XRows xin{x.const_data_ptr(), out.bf16, is, K};
#ifdef GLOWPLUG_AMX
  if (M >= kMinRowsW8A8 && K % 64 == 0 && amx::available()) {  // AMX, which reads whole 16-row activation tiles
    w8a8_amx(xin, qp, ws, wsm, M, N, K, out);
    return y;
  }
#endif
  std::vector<uint8_t> xq(static_cast<size_t>(M * K));
  std::vector<float> xs(static_cast<size_t>(M));
  for (int64_t m = 0; m < M; ++m) xs[m] = quantize_row(xin, m, xq.data() + m * K);
  torch::stable::parallel_for(0, N, kGrain, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const int8_t* qr = qp + n * K;
      for (int64_t m = 0; m < M; ++m) {
        const uint8_t* xr = xq.data() + m * K;
        int64_t k = 0;
        int32_t acc = 0;
#if defined(__AVX512VNNI__)
        __m512i a = _mm512_setzero_si512();
        for (; k + 64 <= K; k += 64) {
          if (m == 0) _mm_prefetch(reinterpret_cast<const char*>(qr + k) + 4096, _MM_HINT_T0);
          a = _mm512_dpbusd_epi32(a, _mm512_loadu_si512(xr + k), _mm512_loadu_si512(qr + k));
        }
        acc = _mm512_reduce_add_epi32(a);
#endif
        for (; k < K; ++k) acc += static_cast<int32_t>(xr[k]) * static_cast<int32_t>(qr[k]);
        const int64_t dot = static_cast<int64_t>(acc) - 128 * static_cast<int64_t>(wsm[n]);
        out.put(m, n, static_cast<float>(static_cast<double>(dot) * static_cast<double>(xs[m]) * static_cast<double>(ws[n])));
      }
    }
  });
  return y;
}

}  // namespace
}  // namespace glowplug

STABLE_TORCH_LIBRARY(glowplug_native, m) {
  m.def("dense_linear(Tensor x, Tensor w, int small_m) -> Tensor");
  m.def("w8a8_linear(Tensor x, Tensor q, Tensor wscale, Tensor wsum, Tensor inv_smooth) -> Tensor");
  // blocked.cpp
  m.def("dense_blocked(Tensor x, Tensor wp, int n) -> Tensor");
  m.def("intn_blocked(Tensor x, Tensor wp, int n, int bits, int group_size) -> Tensor");
  m.def("int8_blocked(Tensor x, Tensor wp, int n, int group_size) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(glowplug_native, CPU, m) {
  m.impl("dense_linear", TORCH_BOX(&glowplug::dense_linear));
  m.impl("w8a8_linear", TORCH_BOX(&glowplug::w8a8_linear));
}
