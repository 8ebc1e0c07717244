// Row reductions for the sampler: each row's index of its first maximum (greedy decoding's token), over float32 or
// bfloat16 logits (the compiled decode step returns them in the model's dtype; bf16 widens to fp32 exactly, so the
// index is the one the fp32 copy would give, read from half the bytes).
//
// Why native: torch 2.13's max(dim=-1).indices over a batch of vocabulary rows tracks the index in a scalar loop,
// and it led the sampling part of a batch-64 decode step's profile. Here each row is one pass of 16-lane compares
// (a lane keeps its first strict maximum; the lanes' minimum index among the maximum breaks ties), rows split
// across the threads. The step it is part of: reports/decode-quantized.md.
#include "common.h"

namespace glowplug {
namespace {

// Element i, and 16 elements, of fp32 or bf16 (uint16_t) logits as fp32.
inline float value(const float* x, int64_t i) { return x[i]; }
inline float value(const uint16_t* x, int64_t i) { return bf16_to_f32(x[i]); }
#if defined(__AVX512F__)
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const uint16_t* x) { return load_bf16x16(x); }
#endif

// The index of the first maximum of x[0..n), as torch's max(dim).indices gives it; a NaN is the maximum (torch
// propagates it), so the first NaN's index when there is one.
template <class T>
int64_t first_max(const T* x, int64_t n) {
#if defined(__AVX512F__)
  if (n >= 16) {
    __m512 best = load16(x);
    __m512i at = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512i idx = at;
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 nan = _mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q);
    int64_t i = 16;
    for (; i + 16 <= n; i += 16) {
      idx = _mm512_add_epi32(idx, step);
      const __m512 v = load16(x + i);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);  // strictly greater: each lane keeps its first
      best = _mm512_mask_mov_ps(best, gt, v);
      at = _mm512_mask_mov_epi32(at, gt, idx);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    if (nan == 0) {  // else the scalar pass below finds the first NaN
      float m = _mm512_reduce_max_ps(best);
      // among the lanes holding the maximum, the smallest index; then the tail, whose indices are all larger
      const __mmask16 top = _mm512_cmp_ps_mask(best, _mm512_set1_ps(m), _CMP_EQ_OQ);
      int64_t arg = _mm512_mask_reduce_min_epi32(top, at);
      for (; i < n; ++i) {
        const float v = value(x, i);
        if (std::isnan(v)) return i;
        if (v > m) m = v, arg = i;
      }
      return arg;
    }
  }
#endif
  int64_t arg = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(value(x, i))) return i;
    if (value(x, i) > value(x, arg)) arg = i;
  }
  return arg;
}

Tensor argmax_rows(Tensor x) {
  const bool bf16 = x.scalar_type() == ScalarType::BFloat16;
  STD_TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (bf16 || x.scalar_type() == ScalarType::Float) && x.size(1) > 0,
                  "argmax_rows: x must be a contiguous float32 or bfloat16 [rows, n] tensor with n > 0");
  const int64_t rows = x.size(0), n = x.size(1);
  Tensor out = torch::stable::new_empty(x, {rows}, ScalarType::Long);
  const void* xp = x.const_data_ptr();
  int64_t* op = static_cast<int64_t*>(out.mutable_data_ptr());
  torch::stable::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      op[r] = bf16 ? first_max(static_cast<const uint16_t*>(xp) + r * n, n)
                   : first_max(static_cast<const float*>(xp) + r * n, n);
  });
  return out;
}

}  // namespace
}  // namespace glowplug

STABLE_TORCH_LIBRARY_FRAGMENT(glowplug_native, m) { m.def("argmax_rows(Tensor x) -> Tensor"); }

STABLE_TORCH_LIBRARY_IMPL(glowplug_native, CPU, m) { m.impl("argmax_rows", TORCH_BOX(&glowplug::argmax_rows)); }
