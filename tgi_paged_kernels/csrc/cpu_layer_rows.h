// fp32 row helpers of the native decoder layer (cpu_layer.cpp): the norms (RMSNorm, LayerNorm, q/k norms), the
// interleaved RoPE and the MLP activations, one row at a time. Internal linkage, like cpu_common.h. Torch
// reference: tgi_paged_kernels.cpu_layer_ref.decode_layer_ref.

#pragma once

#include "cpu_common.h"

namespace {

// 1 / sqrt(mean(x^2) + eps) over `width` values (the RMSNorm's scale, summed as rms_row_f32 does).
inline float rms_inv(const float* x, int64_t width, float eps) {
  float total = 0.0f;
#pragma omp simd reduction(+ : total)
  for (int64_t i = 0; i < width; ++i) total += x[i] * x[i];
  return 1.0f / std::sqrt(total / static_cast<float>(width) + eps);
}

// LayerNorm of one row, as torch's (x - mean) * rsqrt(var + eps) * w (+ b, when not null) (mean and variance
// summed in order; the reference is F.layer_norm, within the load-time check's tolerance).
inline void layer_norm_row_f32(const float* x, const float* w, const float* b, float* o, int64_t width, float eps) {
  float total = 0.0f;
#pragma omp simd reduction(+ : total)
  for (int64_t i = 0; i < width; ++i) total += x[i];
  const float mean = total / static_cast<float>(width);
  float var = 0.0f;
#pragma omp simd reduction(+ : var)
  for (int64_t i = 0; i < width; ++i) var += (x[i] - mean) * (x[i] - mean);
  const float inv = 1.0f / std::sqrt(var / static_cast<float>(width) + eps);
#pragma omp simd
  for (int64_t i = 0; i < width; ++i) o[i] = w[i] * ((x[i] - mean) * inv);
  if (b) {
#pragma omp simd
    for (int64_t i = 0; i < width; ++i) o[i] = o[i] + b[i];
  }
}

// The layer's norm of one row: RMSNorm, or LayerNorm without bias when `layer_norm`.
inline void norm_row(const float* x, const float* w, const float* b, float* o, int64_t width, float eps,
                     bool layer_norm) {
  if (layer_norm) {
    layer_norm_row_f32(x, w, b, o, width, eps);
  } else {
    rms_row_f32(x, w, o, width, eps);
  }
}

// One fp32 head of interleaved RoPE (Cohere): pairs (2i, 2i + 1) rotate, o = x * cos + rot(x) * sin with
// rot(x)[2i] = -x[2i + 1], rot(x)[2i + 1] = x[2i]; each product and the sum rounded apart, as torch's.
inline void rope_interleaved_row_f32(const float* x, const float* c, const float* s, float* o, int64_t head_dim) {
  for (int64_t i = 0; i < head_dim; i += 2) {
    const float a0 = x[i] * c[i], b0 = -x[i + 1] * s[i];
    const float a1 = x[i + 1] * c[i + 1], b1 = x[i] * s[i + 1];
    o[i] = a0 + b0;
    o[i + 1] = a1 + b1;
  }
}

// x[i] = w[i] * (x[i] * inv), in place.
inline void scale_row(float* x, const float* w, float inv, int64_t width) {
#pragma omp simd
  for (int64_t i = 0; i < width; ++i) x[i] = w[i] * (x[i] * inv);
}

// q/k RMSNorm of `heads` heads of D values at `x`, in place: each head over its own D values (mode 1, one
// [D] weight) or all heads as one row (mode 2, weight [heads * D]).
inline void qk_norm_heads(float* x, int heads, int64_t D, int mode, const float* w, float eps) {
  if (mode == 1) {
    for (int h = 0; h < heads; ++h) scale_row(x + h * D, w, rms_inv(x + h * D, D, eps), D);
  } else {
    scale_row(x, w, rms_inv(x, heads * D, eps), heads * D);
  }
}

// One fp32 row of gelu_tanh(gate) * up: 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) as torch's
// F.gelu(approximate="tanh") writes it, with tanh(|u|) = (1 - e) / (1 + e), e = exp(-2|u|) (vectorized;
// within a few ulp of tanh where it matters, ~1e-7 absolute near 0).
// kMul false: gelu_tanh(g) alone (an ungated MLP; u unused).
template <bool kMul = true>
inline void gelu_tanh_mul_row_f32(const float* g, const float* u, float* o, int64_t width) {
  constexpr float kBeta = 0.7978845608028654f, kKappa = 0.044715f;
#pragma omp simd
  for (int64_t i = 0; i < width; ++i) {
    const float x = g[i], cube = x * x * x;
    const float inner = kBeta * (x + kKappa * cube);
    const float e = exp_nonpositive(-2.0f * std::fabs(inner));
    const float t = (1.0f - e) / (1.0f + e);
    const float gelu = 0.5f * x * (1.0f + (inner >= 0.0f ? t : -t));
    o[i] = kMul ? gelu * u[i] : gelu;
  }
}

// One fp32 row of gelu(g) (* u when kMul), exact: 0.5 g (1 + erf(g / sqrt(2))), as torch's F.gelu.
template <bool kMul>
inline void gelu_erf_mul_row_f32(const float* g, const float* u, float* o, int64_t width) {
  constexpr float kInvSqrt2 = 0.7071067811865476f;
  for (int64_t i = 0; i < width; ++i) {
    const float gelu = g[i] * 0.5f * (1.0f + std::erf(g[i] * kInvSqrt2));
    o[i] = kMul ? gelu * u[i] : gelu;
  }
}

// One row normed in place: RMSNorm, or LayerNorm (with bias b when not null) when `layer_norm`.
inline void norm_in_place(float* x, const float* w, const float* b, int64_t width, float eps, bool layer_norm) {
  if (layer_norm) {
    layer_norm_row_f32(x, w, b, x, width, eps);
  } else {
    scale_row(x, w, rms_inv(x, width, eps), width);
  }
}

// One fp32 row of relu(g) (* u when kMul), as torch's F.relu (max(g, 0); NaN kept).
template <bool kMul>
inline void relu_mul_row_f32(const float* g, const float* u, float* o, int64_t width) {
#pragma omp simd
  for (int64_t i = 0; i < width; ++i) {
    const float r = g[i] > 0.0f ? g[i] : (g[i] == g[i] ? 0.0f : g[i]);
    o[i] = kMul ? r * u[i] : r;
  }
}

}  // namespace
