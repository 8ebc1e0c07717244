// Shared by glowplug's native kernel files: stable-ABI includes, bf16/fp16 conversions, output writing.
#pragma once
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
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
