// Shared by glowplug's native kernel files: stable-ABI includes, bf16/fp16 conversions, output writing.
#pragma once
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

using torch::stable::Tensor;
using torch::headeronly::ScalarType;

namespace glowplug {

inline constexpr int64_t kGrain = 32;  // rows per parallel chunk at least: small layers stay on one thread

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

#if defined(__F16C__)
inline float f16_to_f32(uint16_t v) { return _cvtsh_ss(v); }
#else
// IEEE binary16 -> binary32 by its bits, for builds without F16C (the portable level, other architectures). Exact:
// every half is a float; subnormal halves are normalised, inf and NaN keep their class and payload.
inline float f16_to_f32(uint16_t v) {
  const uint32_t sign = static_cast<uint32_t>(v & 0x8000u) << 16;
  uint32_t exp = (v >> 10) & 0x1fu, man = v & 0x3ffu, u;
  if (exp == 0x1fu) {
    u = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    u = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    u = sign;
  } else {  // subnormal: shift the leading 1 up to the implicit bit
    int e = 113;
    while ((man & 0x400u) == 0) {
      man <<= 1;
      --e;
    }
    u = sign | (static_cast<uint32_t>(e) << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
#endif

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

// ------------------------------------------------------------------------------------------ portable vectors
// 16 fp32 (or 32-bit integer) lanes for the kernels' portable paths, as kNV GCC/Clang vectors of the build's
// register width (1 AVX512, 2 AVX2, 4 SSE2 or NEON), so one source vectorizes at every level. Why not float[16]
// loops: GCC keeps such accumulators on the stack, every multiply-add chained through a store and a reload. Why not
// one 64-byte vector type: below AVX512 GCC keeps those in memory too, copied through general registers. Parts are
// indexed by unrolled constants only, so they stay in registers. Values never cross a non-inlined call, so the
// -Wpsabi notes about their calling convention do not apply.
#pragma GCC diagnostic ignored "-Wpsabi"
#if defined(__AVX512F__)
#define GLOWPLUG_VEC_BYTES 64
#elif defined(__AVX__)
#define GLOWPLUG_VEC_BYTES 32
#else
#define GLOWPLUG_VEC_BYTES 16
#endif
constexpr int kNV = 64 / GLOWPLUG_VEC_BYTES, kVL = GLOWPLUG_VEC_BYTES / 4;  // parts, lanes per part
typedef float vf32 __attribute__((vector_size(GLOWPLUG_VEC_BYTES)));
typedef int32_t vi32 __attribute__((vector_size(GLOWPLUG_VEC_BYTES)));
typedef uint32_t vu32 __attribute__((vector_size(GLOWPLUG_VEC_BYTES)));
typedef uint16_t vu16 __attribute__((vector_size(GLOWPLUG_VEC_BYTES / 2)));
typedef int8_t vi8 __attribute__((vector_size(GLOWPLUG_VEC_BYTES / 4)));

template <class T>
struct Lanes {
  T v[kNV];
};
using F16 = Lanes<vf32>;
using I16 = Lanes<vi32>;
using U16 = Lanes<vu32>;
template <class T>
struct is_lanes : std::false_type {};
template <class T>
struct is_lanes<Lanes<T>> : std::true_type {};

// always_inline: GCC left some of these small operators as calls, and a Lanes passed through memory is no faster
// than the plain loops
#define GLOWPLUG_VINLINE inline __attribute__((always_inline))
#define GLOWPLUG_PARTS(i) _Pragma("GCC unroll 4") for (int i = 0; i < kNV; ++i)
#define GLOWPLUG_LANES_OP(OP)                                                       \
  template <class T>                                                                \
  GLOWPLUG_VINLINE Lanes<T> operator OP(Lanes<T> a, const Lanes<T>& b) {            \
    GLOWPLUG_PARTS(i) a.v[i] = a.v[i] OP b.v[i];                                    \
    return a;                                                                       \
  }                                                                                 \
  template <class T, class S, class = std::enable_if_t<std::is_arithmetic_v<S>>>    \
  GLOWPLUG_VINLINE Lanes<T> operator OP(Lanes<T> a, S b) {                          \
    GLOWPLUG_PARTS(i) a.v[i] = a.v[i] OP b;                                         \
    return a;                                                                       \
  }
GLOWPLUG_LANES_OP(+)
GLOWPLUG_LANES_OP(-)
GLOWPLUG_LANES_OP(*)
GLOWPLUG_LANES_OP(&)
GLOWPLUG_LANES_OP(|)
GLOWPLUG_LANES_OP(<<)
GLOWPLUG_LANES_OP(>>)
#undef GLOWPLUG_LANES_OP
GLOWPLUG_VINLINE F16 operator*(float s, const F16& a) { return a * s; }
GLOWPLUG_VINLINE F16& operator+=(F16& a, const F16& b) {
  GLOWPLUG_PARTS(i) a.v[i] += b.v[i];
  return a;
}

// Unaligned loads and stores of a vector or of Lanes (part by part: a memcpy of the whole struct went through the
// stack).
template <class V>
GLOWPLUG_VINLINE V vload(const void* p) {
  V r;
  if constexpr (is_lanes<V>::value) {
    GLOWPLUG_PARTS(i) {
      decltype(r.v[0] + 0) t;
      std::memcpy(&t, static_cast<const char*>(p) + i * GLOWPLUG_VEC_BYTES, GLOWPLUG_VEC_BYTES);
      r.v[i] = t;
    }
  } else {
    std::memcpy(&r, p, sizeof(V));
  }
  return r;
}
template <class V>
GLOWPLUG_VINLINE void vstore(void* p, const V& v) {
  if constexpr (is_lanes<V>::value) {
    GLOWPLUG_PARTS(i) {
      const auto t = v.v[i];
      std::memcpy(static_cast<char*>(p) + i * GLOWPLUG_VEC_BYTES, &t, GLOWPLUG_VEC_BYTES);
    }
  } else {
    std::memcpy(p, &v, sizeof(V));
  }
}
GLOWPLUG_VINLINE F16 vsplat(float x) {
  F16 r;
  GLOWPLUG_PARTS(i) r.v[i] = vf32{} + x;
  return r;
}
template <class To, class From>
GLOWPLUG_VINLINE Lanes<To> bitcast(const Lanes<From>& a) {  // the same bits
  Lanes<To> r;
  GLOWPLUG_PARTS(i) r.v[i] = (To)a.v[i];
  return r;
}
GLOWPLUG_VINLINE F16 to_float(const I16& a) {  // signed 32-bit integers to fp32
  F16 r;
  GLOWPLUG_PARTS(i) r.v[i] = __builtin_convertvector(a.v[i], vf32);
  return r;
}
GLOWPLUG_VINLINE I16 to_int(const F16& a) {  // truncating
  I16 r;
  GLOWPLUG_PARTS(i) r.v[i] = __builtin_convertvector(a.v[i], vi32);
  return r;
}
GLOWPLUG_VINLINE F16 vmax(F16 a, const F16& b) {  // b where either is NaN, as maxps does
  GLOWPLUG_PARTS(i) a.v[i] = a.v[i] > b.v[i] ? a.v[i] : b.v[i];
  return a;
}

// 16 bf16 values widened to fp32 (exact).
GLOWPLUG_VINLINE F16 vload_bf16(const uint16_t* p) {
  U16 u;
  GLOWPLUG_PARTS(i) u.v[i] = __builtin_convertvector(vload<vu16>(p + i * kVL), vu32) << 16;
  return bitcast<vf32>(u);
}

// 16 int8 values widened to fp32 (exact).
GLOWPLUG_VINLINE F16 vload_i8(const int8_t* p) {
  F16 r;
  GLOWPLUG_PARTS(i) r.v[i] = __builtin_convertvector(vload<vi8>(p + i * kVL), vf32);
  return r;
}

// 16 fp16 values widened to fp32 (exact), branch-free so it vectorizes: the half's exponent and mantissa moved
// into a float's place and rebiased; subnormal halves renormalised by one exact float subtraction; inf and NaN
// get the full float exponent.
GLOWPLUG_VINLINE F16 vload_f16(const uint16_t* p) {
  F16 r;
  GLOWPLUG_PARTS(i) {
    const vi32 h = __builtin_convertvector(vload<vu16>(p + i * kVL), vi32);
    const vi32 em = (h & 0x7fff) << 13, e = em & (0x1f << 23);
    vi32 u = em + (112 << 23);
    u = e == (0x1f << 23) ? u + (112 << 23) : u;
    vf32 f = (vf32)(e == 0 ? u + (1 << 23) : u);
    f = e == 0 ? f - 6.103515625e-05f : f;  // 2^-14: the implicit 1 the subnormal does not have
    r.v[i] = (vf32)((vi32)f | ((h & 0x8000) << 16));
  }
  return r;
}

// The sum of the 16 lanes: the parts added, then halving within a part (lane i + lane i + kVL / 2, ...).
GLOWPLUG_VINLINE float vsum(const F16& a) {
  vf32 s = a.v[0];
  _Pragma("GCC unroll 4") for (int i = 1; i < kNV; ++i) s += a.v[i];
  float l[kVL];
  std::memcpy(l, &s, sizeof(s));
  _Pragma("GCC unroll 8") for (int w = kVL / 2; w >= 1; w /= 2) _Pragma("GCC unroll 8") for (int i = 0; i < w; ++i)
    l[i] += l[i + w];
  return l[0];
}

// The largest of the 16 lanes (NaNs aside).
inline float vmax_lane(const F16& a) {
  float l[16];
  vstore(l, a);
  float m = l[0];
  for (int i = 1; i < 16; ++i) m = std::max(m, l[i]);
  return m;
}

#if defined(__AVX512F__)
inline __m512 load_bf16x16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
#endif

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


inline void check_x(const Tensor& x, int64_t K) {
  STD_TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "glowplug linear: x must be a contiguous [M, K] tensor");
  STD_TORCH_CHECK(x.size(1) == K, "glowplug linear: x has ", x.size(1), " features, the weight expects ", K);
  STD_TORCH_CHECK(x.scalar_type() == ScalarType::BFloat16 || x.scalar_type() == ScalarType::Float,
                  "glowplug linear: x must be bfloat16 or float32");
}

inline Tensor new_out(const Tensor& x, int64_t M, int64_t N) {
  return torch::stable::new_empty(x, {M, N});
}

}  // namespace glowplug
