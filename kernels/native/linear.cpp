// glowplug native CPU linear kernels: y[M, N] = x[M, K] @ W^T for dense (bf16/fp32) and packed weights.
//
// Built at run time with the machine's g++ (-O3 -march=native) against torch's stable C ABI only, so a build takes
// about a second and the library loads into any torch >= 2.10 (see kernels/native.py). Every op here has a pure-torch
// reference in kernels/reference.py; tests/kernels compare them.
//
// These are the decode step's kernels (M = the decode batch). Each streams every weight row once from memory, in
// address order, and reuses it for all M activation rows, 16 rows at a time so that later activation blocks re-read
// the tile from L1/L2: at M=1 the step is memory-bound, and what matters is touching every weight byte exactly once
// with enough independent accumulators that the loads never wait on the arithmetic. dense_linear hands M > small_m
// to aten's GEMM (oneDNN), which wins once the product is compute-bound; the packed formats have no such fallback
// here (prefill goes through the eager dispatcher in kernels/dispatch.py).
//
// Layouts (kernel-side; derived from the canonical formats in kernels/formats.py at load time):
//   dense   w [N, K] in x's dtype.
//   int8    q int8 [N, K], scales fp32 [N, G]: w = q * scale[n, k / (K / G)].
//   intn    fused rows uint8 [N + pad, K * bits / 8 + 4 * G]: each row's codes, planar within each group (formats.py:
//           byte j of a group holds code j + i * gs / per at bits * i), then its G fp16 scales and G fp16 mins:
//           w = q * scale + min. A few zero rows at the end let vector loads run past the last row.
//   w8a8    q int8 [N, K], wscale fp32 [N], wsum int32 [N] = sum_k q[n, k]; x is quantized per row to int8 here.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <map>
#include <memory>
#include <mutex>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

using torch::stable::Tensor;
using torch::headeronly::ScalarType;

namespace {

constexpr int64_t kGrain = 32;  // rows per parallel chunk at least: small layers stay on one thread

inline float bf16_to_f32(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as torch does
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float f16_to_f32(uint16_t v) { return _cvtsh_ss(v); }

inline float sum_f32(const float* p, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#if defined(__AVX512F__)
  __m512 a = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) a = _mm512_add_ps(a, _mm512_loadu_ps(p + i));
  s = _mm512_reduce_add_ps(a);
#endif
  for (; i < n; ++i) s += p[i];
  return s;
}

#if defined(__AVX512F__)
inline __m512 load_bf16x16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
#endif

// x [M, K] in bf16 or fp32 -> fp32 copy (rows contiguous).
std::vector<float> x_as_f32(const Tensor& x, int64_t M, int64_t K) {
  std::vector<float> out(static_cast<size_t>(M * K));
  if (x.scalar_type() == ScalarType::Float) {
    std::memcpy(out.data(), x.const_data_ptr(), out.size() * 4);
  } else {
    const uint16_t* p = static_cast<const uint16_t*>(x.const_data_ptr());
    size_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= out.size(); i += 16) _mm512_storeu_ps(out.data() + i, load_bf16x16(p + i));
#endif
    for (; i < out.size(); ++i) out[i] = bf16_to_f32(p[i]);
  }
  return out;
}

// Write one fp32 result into y (bf16 or fp32).
struct OutWriter {
  void* base;
  bool bf16;
  int64_t ld;
  inline void put(int64_t m, int64_t n, float v) const {
    if (bf16)
      static_cast<uint16_t*>(base)[m * ld + n] = f32_to_bf16(v);
    else
      static_cast<float*>(base)[m * ld + n] = v;
  }
};


void check_x(const Tensor& x, int64_t K) {
  STD_TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "glowplug linear: x must be a contiguous [M, K] tensor");
  STD_TORCH_CHECK(x.size(1) == K, "glowplug linear: x has ", x.size(1), " features, the weight expects ", K);
  STD_TORCH_CHECK(x.scalar_type() == ScalarType::BFloat16 || x.scalar_type() == ScalarType::Float,
                  "glowplug linear: x must be bfloat16 or float32");
}

Tensor new_out(const Tensor& x, int64_t M, int64_t N) {
  return torch::stable::new_empty(x, {M, N});
}

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
#else
    int64_t k = 0;
    _Pragma("GCC unroll 8")
    for (int m = 0; m < MB; ++m) res[m] = 0.f;
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
#else
    _Pragma("GCC unroll 8")
    for (int m = 0; m < MB; ++m) res[m] = 0.f;
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

// ------------------------------------------------------------------------------------------------- int8
template <int MB>
void int8_rows(const int8_t* q, const float* scales, int64_t G, const float* x, int64_t K, int64_t n0, int64_t n1,
               const OutWriter& out, int64_t m0) {
  const int64_t gs = K / G;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* qr = q + n * K;
    const float* sr = scales + n * G;
    float res[MB] = {};
    for (int64_t g = 0; g < G; ++g) {
      const int64_t kb = g * gs, ke = kb + gs;
      float part[MB];
      int64_t k = kb;
#if defined(__AVX512F__)
      __m512 acc[MB][2];
      _Pragma("GCC unroll 8")
      for (int m = 0; m < MB; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
      for (; k + 32 <= ke; k += 32) {
        __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qr + k))));
        __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qr + k + 16))));
        _Pragma("GCC unroll 8")
        for (int m = 0; m < MB; ++m) {
          const float* xr = x + (m0 + m) * K + k;
          acc[m][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr), acc[m][0]);
          acc[m][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), acc[m][1]);
        }
      }
      _Pragma("GCC unroll 8")
      for (int m = 0; m < MB; ++m) part[m] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]));
#else
      _Pragma("GCC unroll 8")
      for (int m = 0; m < MB; ++m) part[m] = 0.f;
#endif
      for (; k < ke; ++k)
        _Pragma("GCC unroll 8")
        for (int m = 0; m < MB; ++m) part[m] += static_cast<float>(qr[k]) * x[(m0 + m) * K + k];
      _Pragma("GCC unroll 8")
      for (int m = 0; m < MB; ++m) res[m] += part[m] * sr[g];
    }
    _Pragma("GCC unroll 8")
    for (int m = 0; m < MB; ++m) out.put(m0 + m, n, res[m]);
  }
}

Tensor int8_linear(Tensor x, Tensor q, Tensor scales) {
  STD_TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && q.scalar_type() == ScalarType::Char,
                  "int8_linear: q must be a contiguous int8 [N, K] tensor");
  const int64_t N = q.size(0), K = q.size(1), M = x.size(0);
  check_x(x, K);
  STD_TORCH_CHECK(scales.dim() == 2 && scales.size(0) == N && scales.is_contiguous() &&
                      scales.scalar_type() == ScalarType::Float && K % scales.size(1) == 0,
                  "int8_linear: scales must be contiguous float32 [N, G] with G dividing K");
  const int64_t G = scales.size(1);
  const int8_t* qp = static_cast<const int8_t*>(q.const_data_ptr());
  const float* sp = static_cast<const float*>(scales.const_data_ptr());
  std::vector<float> xf = x_as_f32(x, M, K);
  Tensor y = new_out(x, M, N);
  OutWriter out{y.mutable_data_ptr(), x.scalar_type() == ScalarType::BFloat16, N};
  const float* xp = xf.data();
  for_rows(M, N, [&](int64_t mb, int64_t m0, int64_t n0, int64_t n1) {
    GLOWPLUG_DISPATCH_MB(mb, int8_rows, qp, sp, G, xp, K, n0, n1, out, m0)
  });
  return y;
}

// ------------------------------------------------------------------------------------------- int4 / int2
// Fused rows: each weight row is its packed codes (K * BITS / 8 bytes) followed by its G fp16 scales and G fp16 mins,
// so one row is one sequential stream. Separate scale arrays cost a DRAM round trip per row here: the prefetcher
// does not follow three interleaved short streams (and masked loads are not prefetched at all).
struct IntnLayout {
  int64_t K, G, gs, bits, per, plane, code_bytes, stride;
  IntnLayout(int64_t k, int64_t b, int64_t group)
      : K(k), G(k / group), gs(group), bits(b), per(8 / b), plane(group / (8 / b)), code_bytes(k * b / 8),
        stride(k * b / 8 + 4 * (k / group)) {}
  const uint16_t* scales(const uint8_t* row) const { return reinterpret_cast<const uint16_t*>(row + code_bytes); }
  const uint16_t* mins(const uint8_t* row) const { return scales(row) + G; }
};

inline float intn_dequant(const uint8_t* row, const IntnLayout& L, int64_t k) {
  const int64_t g = k / L.gs, r = k % L.gs, i = r / L.plane, j = r % L.plane;
  const uint32_t code = (row[g * L.plane + j] >> (L.bits * i)) & ((1u << L.bits) - 1);
  return static_cast<float>(code) * f16_to_f32(L.scales(row)[g]) + f16_to_f32(L.mins(row)[g]);
}

// Portable path (fp32 activations, or no AVX512-BF16): dequantize one row into an fp32 buffer, then dot.
template <int MB>
void intn_rows_f32(const uint8_t* rows, const IntnLayout& L, const float* x, int64_t n0, int64_t n1,
                   const OutWriter& out, int64_t m0) {
  std::vector<float> w(static_cast<size_t>(L.K));
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = rows + n * L.stride;
    for (int64_t k = 0; k < L.K; ++k) w[k] = intn_dequant(row, L, k);
    float res[MB] = {};
    for (int64_t k = 0; k < L.K; ++k) {
      _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) res[m] += w[k] * x[(m0 + m) * L.K + k];
    }
    _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) out.put(m0 + m, n, res[m]);
  }
}

#if defined(__AVX512BF16__)
// bf16 activations. A row's codes are read in 64-byte chunks as 32 16-bit words; word l holds bytes 2l and 2l+1, and
// the 2 * PER bit-planes of those bytes are pulled out with a shift and a mask each (no shuffles: on this CPU the
// shuffle unit, not the FMA units, limited the first versions). A plane of codes q becomes bf16 by OR-ing in the
// exponent of 128: the bits (0x4300 | q) are exactly the bf16 number 128 + q, so vdpbf16ps yields
// sum (128 + q) x = 128 * sum(x) + sum(q x), and the 128 * xsum term is taken back through the group's min term:
// w = q * s + m  =>  sum_k w x = sum_g s_g * acc_g + (m_g - 128 s_g) * xsum_g.
// The activations were permuted once per call (`xperm`) into plane order: plane p of chunk c meets
// xperm[(c * 2 * PER + p) * 32 ..]. Lane L of a chunk's accumulator covers bytes 4L..4L+3, which lie in one group, so
// one FMA with a per-lane scale vector applies the group scales; the per-lane group indices (bidx, relative to a
// pair of 16-group windows starting at bwin) are the same for every row and are precomputed per call.
// Chunks may run past the codes into the row's scales (or the tensor's padding): those lanes meet zero activations.
template <int BITS, int MB>
void intn_rows_bf16(const uint8_t* rows, const IntnLayout& L, const uint16_t* xperm, int64_t xstride,
                    const float* xsum, const int32_t* bwin, const int32_t* bidx, int64_t n0, int64_t n1,
                    const OutWriter& out, int64_t m0) {
  constexpr int PER = 8 / BITS, PLANES = 2 * PER;
  const int64_t nchunks = (L.code_bytes + 63) / 64, G = L.G;
  const __m512i mask = _mm512_set1_epi16((1 << BITS) - 1);
  const __m512i expo = _mm512_set1_epi16(0x4300);
  const __m512 c128 = _mm512_set1_ps(128.f);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = rows + n * L.stride;
    const uint16_t* sr = L.scales(row);
    const uint16_t* mr = L.mins(row);
    // sum_g (min_g - 128 scale_g) * xsum_g, 16 groups at a time (lanes past G zeroed in registers).
    __m512 mt[MB];
    _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) mt[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g += 16) {
      const __mmask16 gm = G - g >= 16 ? __mmask16(0xffff) : __mmask16((1u << (G - g)) - 1);
      const __m512 sc = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sr + g)));
      const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mr + g)));
      const __m512 adj = _mm512_maskz_mov_ps(gm, _mm512_fnmadd_ps(c128, sc, mn));
      _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m)
        mt[m] = _mm512_fmadd_ps(adj, _mm512_loadu_ps(xsum + (m0 + m) * (G + 16) + g), mt[m]);
    }
    int64_t wbase = -1;
    __m512 sv0 = _mm512_setzero_ps(), sv1 = _mm512_setzero_ps();
    auto chunk = [&](int64_t c, __m512* tt) __attribute__((always_inline)) {
      const int64_t w = bwin[c];
      if (w != wbase) {
        wbase = w;
        sv0 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sr + 16 * w)));
        sv1 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sr + 16 * w + 16)));
      }
      const __m512 svb = _mm512_permutex2var_ps(sv0, _mm512_loadu_si512(bidx + 16 * c), sv1);
      const __m512i v = _mm512_loadu_si512(row + 64 * c);
      __m512 acc[MB];
      _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
      _Pragma("GCC unroll 16") for (int p = 0; p < PLANES; ++p) {
        const __m512i sh = p == 0 ? v : _mm512_srli_epi16(v, BITS * p);
        // (sh & mask) | expo in one ternary-logic op; the top plane has no higher bits to clear
        const __m512i bits = p == PLANES - 1 ? _mm512_or_si512(sh, expo) : _mm512_ternarylogic_epi32(sh, mask, expo, 0xEA);
        _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) acc[m] = _mm512_dpbf16_ps(
            acc[m], (__m512bh)bits, (__m512bh)_mm512_loadu_si512(xperm + (m0 + m) * xstride + (c * PLANES + p) * 32));
      }
      _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) tt[m] = _mm512_fmadd_ps(acc[m], svb, tt[m]);
    };
    __m512 t0[MB], t1[MB];
    _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) t0[m] = t1[m] = _mm512_setzero_ps();
    int64_t c = 0;
    for (; c + 2 <= nchunks; c += 2) {
      chunk(c, t0);
      chunk(c + 1, t1);
    }
    if (c < nchunks) chunk(c, t0);
    _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m)
      out.put(m0 + m, n, _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(t0[m], t1[m]), mt[m])));
  }
}

template <int BITS>
void intn_bf16_mb(int64_t mb, const uint8_t* rows, const IntnLayout& L, const uint16_t* xq, int64_t xstride,
                  const float* xs, const int32_t* bw, const int32_t* bi, int64_t n0, int64_t n1, const OutWriter& out,
                  int64_t m0) {
  switch (mb) {
    case 1: intn_rows_bf16<BITS, 1>(rows, L, xq, xstride, xs, bw, bi, n0, n1, out, m0); break;
    case 2: intn_rows_bf16<BITS, 2>(rows, L, xq, xstride, xs, bw, bi, n0, n1, out, m0); break;
    case 3: intn_rows_bf16<BITS, 3>(rows, L, xq, xstride, xs, bw, bi, n0, n1, out, m0); break;
    default: intn_rows_bf16<BITS, 4>(rows, L, xq, xstride, xs, bw, bi, n0, n1, out, m0); break;
  }
}
#endif

#if defined(__AVX512BF16__)
// What the bf16 kernel needs besides the weights, a function of the layout alone and so built once per layout:
// `gather` maps each xperm slot to its activation index (-1: a lane past the codes, which reads zero), and bwin/bidx
// give each chunk's scale window pair and per-lane group index (clamped to the last group so lanes past the codes
// never meet a non-finite value).
struct IntnPlan {
  int64_t xstride = 0;
  std::vector<int32_t> gather, bwin, bidx;
};

const IntnPlan& intn_plan(const IntnLayout& L) {
  static std::mutex mu;
  static std::map<std::array<int64_t, 3>, std::unique_ptr<IntnPlan>> plans;
  std::lock_guard<std::mutex> lock(mu);
  auto& slot = plans[{L.K, L.bits, L.gs}];
  if (slot) return *slot;
  auto plan = std::make_unique<IntnPlan>();
  const int planes = static_cast<int>(2 * L.per);
  const int64_t nchunks = (L.code_bytes + 63) / 64;
  plan->xstride = nchunks * 64 * L.per;
  plan->gather.assign(static_cast<size_t>(plan->xstride), -1);
  for (int64_t byte = 0; byte < L.code_bytes; ++byte) {
    const int64_t g = byte / L.plane, pos = byte % L.plane, c = byte / 64, l = (byte % 64) / 2;
    const int hi = static_cast<int>(byte & 1);
    for (int i = 0; i < L.per; ++i)
      plan->gather[(c * planes + hi * L.per + i) * 32 + l] = static_cast<int32_t>(g * L.gs + i * L.plane + pos);
  }
  plan->bwin.resize(static_cast<size_t>(nchunks));
  plan->bidx.resize(static_cast<size_t>(nchunks * 16));
  for (int64_t c = 0; c < nchunks; ++c) {
    const int64_t w = std::min<int64_t>(c * 64 / L.plane, L.G - 1) / 16;
    plan->bwin[c] = static_cast<int32_t>(w);
    for (int lane = 0; lane < 16; ++lane) {
      const int64_t g = std::min<int64_t>((c * 64 + 4 * lane) / L.plane, L.G - 1);
      plan->bidx[c * 16 + lane] = static_cast<int32_t>(g - 16 * w);
    }
  }
  slot = std::move(plan);
  return *slot;
}
#endif

Tensor intn_linear(Tensor x, Tensor rows, int64_t out_features, int64_t in_features, int64_t bits, int64_t group_size) {
  STD_TORCH_CHECK(bits == 4 || bits == 2, "intn_linear: bits must be 4 or 2, got ", bits);
  const int64_t N = out_features, K = in_features, M = x.size(0);
  check_x(x, K);
  STD_TORCH_CHECK(group_size > 0 && K % group_size == 0 && group_size % (8 / bits) == 0,
                  "intn_linear: group_size ", group_size, " must divide K=", K);
  const IntnLayout L(K, bits, group_size);
  STD_TORCH_CHECK(rows.dim() == 2 && rows.is_contiguous() && rows.scalar_type() == ScalarType::Byte &&
                      rows.size(1) == L.stride && rows.size(0) >= N + (64 + L.stride - 1) / L.stride,
                  "intn_linear: rows must be the packed uint8 [N + pad, K * bits / 8 + 4 * G] tensor of "
                  "glowplug.kernels.native.pack_intn_rows");
  const uint8_t* rp = static_cast<const uint8_t*>(rows.const_data_ptr());
  Tensor y = new_out(x, M, N);
  OutWriter out{y.mutable_data_ptr(), x.scalar_type() == ScalarType::BFloat16, N};
#if defined(__AVX512BF16__)
  if (x.scalar_type() == ScalarType::BFloat16 && L.plane % 4 == 0) {
    const IntnPlan& plan = intn_plan(L);
    const int64_t xstride = plan.xstride;
    std::vector<uint16_t> xperm(static_cast<size_t>(M * xstride));
    std::vector<float> xsum(static_cast<size_t>(M * (L.G + 16)), 0.f);  // padded: the kernel reads 16 at a time
    const uint16_t* xb = static_cast<const uint16_t*>(x.const_data_ptr());
    for (int64_t m = 0; m < M; ++m) {
      const uint16_t* xr = xb + m * K;
      uint16_t* dst = xperm.data() + m * xstride;
      for (int64_t i = 0; i < xstride; ++i) {
        const int32_t src = plan.gather[i];
        dst[i] = src < 0 ? uint16_t{0} : xr[src];
      }
      for (int64_t g = 0; g < L.G; ++g) {
        float s = 0.f;
        for (int64_t k = 0; k < group_size; ++k) s += bf16_to_f32(xr[g * group_size + k]);
        xsum[m * (L.G + 16) + g] = s;
      }
    }
    const int32_t* bw = plan.bwin.data();
    const int32_t* bi = plan.bidx.data();
    const uint16_t* xq = xperm.data();
    const float* xs = xsum.data();
    for_rows(M, N, [&](int64_t mb, int64_t m0, int64_t n0, int64_t n1) {
      if (bits == 4)
        intn_bf16_mb<4>(mb, rp, L, xq, xstride, xs, bw, bi, n0, n1, out, m0);
      else
        intn_bf16_mb<2>(mb, rp, L, xq, xstride, xs, bw, bi, n0, n1, out, m0);
    });
    return y;
  }
#endif
  std::vector<float> xf = x_as_f32(x, M, K);
  const float* xp = xf.data();
  for_rows(M, N, [&](int64_t mb, int64_t m0, int64_t n0, int64_t n1) {
    GLOWPLUG_DISPATCH_MB(mb, intn_rows_f32, rp, L, xp, n0, n1, out, m0)
  });
  return y;
}

// -------------------------------------------------------------------------------------------------- w8a8
// x is quantized per row exactly as kernels/formats.quantize_per_token does (scale = max|x| / 127, round half to
// even, clamp), shifted to uint8 for vpdpbusd (u8 x s8), and the shift is taken back with the weight row sums.
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
  std::vector<float> xf = x_as_f32(x, M, K);
  if (inv_smooth.numel()) {
    const float* is = static_cast<const float*>(inv_smooth.const_data_ptr());
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) xf[m * K + k] *= is[k];
  }
  std::vector<uint8_t> xq(static_cast<size_t>(M * K));
  std::vector<float> xs(static_cast<size_t>(M));
  for (int64_t m = 0; m < M; ++m) {
    float amax = 0.f;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(xf[m * K + k]));
    const float scale = std::max(amax / 127.f, 1e-10f);
    xs[m] = scale;
    for (int64_t k = 0; k < K; ++k) {
      float v = std::nearbyint(xf[m * K + k] / scale);
      v = std::min(127.f, std::max(-127.f, v));
      xq[m * K + k] = static_cast<uint8_t>(static_cast<int>(v) + 128);
    }
  }
  const int8_t* qp = static_cast<const int8_t*>(q.const_data_ptr());
  const float* ws = static_cast<const float*>(wscale.const_data_ptr());
  const int32_t* wsm = static_cast<const int32_t*>(wsum.const_data_ptr());
  Tensor y = new_out(x, M, N);
  OutWriter out{y.mutable_data_ptr(), x.scalar_type() == ScalarType::BFloat16, N};
  torch::stable::parallel_for(0, N, kGrain, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const int8_t* qr = qp + n * K;
      for (int64_t m = 0; m < M; ++m) {
        const uint8_t* xr = xq.data() + m * K;
        int64_t k = 0;
        int32_t acc = 0;
#if defined(__AVX512VNNI__)
        __m512i a = _mm512_setzero_si512();
        for (; k + 64 <= K; k += 64)
          a = _mm512_dpbusd_epi32(a, _mm512_loadu_si512(xr + k), _mm512_loadu_si512(qr + k));
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

STABLE_TORCH_LIBRARY(glowplug_native, m) {
  m.def("dense_linear(Tensor x, Tensor w, int small_m) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor q, Tensor scales) -> Tensor");
  m.def("intn_linear(Tensor x, Tensor rows, int out_features, int in_features, int bits, int group_size) -> Tensor");
  m.def("w8a8_linear(Tensor x, Tensor q, Tensor wscale, Tensor wsum, Tensor inv_smooth) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(glowplug_native, CPU, m) {
  m.impl("dense_linear", TORCH_BOX(&dense_linear));
  m.impl("int8_linear", TORCH_BOX(&int8_linear));
  m.impl("intn_linear", TORCH_BOX(&intn_linear));
  m.impl("w8a8_linear", TORCH_BOX(&w8a8_linear));
}
