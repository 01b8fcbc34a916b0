// paradyse/ops/cpu/activation.hpp: GELU (tanh form) and SwiGLU, forward and backward.
//
// Element-wise over views of one shape (any outer strides, unit-stride last dimension; gate and up may be two
// halves of one packed [..., 2f] tensor). Forward outputs are overwritten (and may alias an input); backward
// gradients ACCUMULATE (+=). tanh and the sigmoid go through exp_approx (GELU: exp_approx_in_place over chunks of a row).
#pragma once

#include "paradyse/core/tensor.hpp"
#include "paradyse/ops/cpu/rows.hpp"
#include "paradyse/ops/cpu/simd.hpp"
#include "paradyse/ops/cpu/vector_math.hpp"

#include <algorithm>
#include <cstdint>

namespace paradyse::ops::cpu {

namespace detail {
inline constexpr float kGeluSqrt2OverPi = 0.7978845608028654f;  // sqrt(2 / pi)
inline constexpr float kGeluCubic = 0.044715f;
inline constexpr std::int64_t kGeluChunk = 256;  // elements per pass: the tanh of a chunk on the stack

// t[0..n) = tanh(sqrt(2/pi) (x + 0.044715 x^3)) as tanh_approx computes it (1 - 2 / (e^{2u} + 1)), with the exps of
// the chunk in one exp_approx_in_place pass (the scalar exp_approx does not vectorise in a loop). n <= kGeluChunk.
[[gnu::always_inline]] inline void gelu_tanh(const float* x, std::int64_t n, float* t) {
  for (std::int64_t c = 0; c < n; ++c) {
    const float v = x[c];
    t[c] = 2.0f * (kGeluSqrt2OverPi * (v + kGeluCubic * v * v * v));
  }
  exp_approx_in_place(t, n);
  for (std::int64_t c = 0; c < n; ++c) t[c] = 1.0f - 2.0f / (t[c] + 1.0f);
}

// One row of f elements: y = gelu(x) (y may be x).
[[gnu::always_inline]] inline void gelu_forward_row(const float* xr, float* yr, std::int64_t f) {
  for (std::int64_t c0 = 0; c0 < f; c0 += kGeluChunk) {
    const std::int64_t n = std::min(kGeluChunk, f - c0);
    float t[kGeluChunk];
    gelu_tanh(xr + c0, n, t);
    for (std::int64_t c = 0; c < n; ++c) yr[c0 + c] = 0.5f * xr[c0 + c] * (1.0f + t[c]);
  }
}

// One row of f elements: dx += dy * gelu'(x).
[[gnu::always_inline]] inline void gelu_backward_row(const float* xr, const float* dyr, float* dxr, std::int64_t f) {
  for (std::int64_t c0 = 0; c0 < f; c0 += kGeluChunk) {
    const std::int64_t n = std::min(kGeluChunk, f - c0);
    float t[kGeluChunk];
    gelu_tanh(xr + c0, n, t);
    for (std::int64_t c = 0; c < n; ++c) {
      const float v = xr[c0 + c];
      const float du = kGeluSqrt2OverPi * (1.0f + 3.0f * kGeluCubic * v * v);
      dxr[c0 + c] += dyr[c0 + c] * (0.5f * (1.0f + t[c]) + 0.5f * v * (1.0f - t[c] * t[c]) * du);
    }
  }
}

// The row functions compiled for each instruction set (simd.hpp), picked by simd_level(): without a target of its
// own GELU ran on SSE, 4% of train_gpt's time at 4K.
#define PARADYSE_GELU_ROWS(suffix, target)                                                                       \
  target inline void gelu_forward_row_##suffix(const float* x, float* y, std::int64_t f) {                       \
    gelu_forward_row(x, y, f);                                                                                   \
  }                                                                                                              \
  target inline void gelu_backward_row_##suffix(const float* x, const float* dy, float* dx, std::int64_t f) {    \
    gelu_backward_row(x, dy, dx, f);                                                                             \
  }
PARADYSE_GELU_ROWS(base, )
#if defined(PARADYSE_X86_DISPATCH)
PARADYSE_GELU_ROWS(avx2, PARADYSE_TARGET_AVX2)
PARADYSE_GELU_ROWS(avx512, PARADYSE_TARGET_AVX512)
#endif
#undef PARADYSE_GELU_ROWS

struct GeluRows {
  void (*forward)(const float*, float*, std::int64_t);
  void (*backward)(const float*, const float*, float*, std::int64_t);
};
inline GeluRows gelu_rows() {
  switch (simd_level()) {
#if defined(PARADYSE_X86_DISPATCH)
    case SimdLevel::avx512: return {gelu_forward_row_avx512, gelu_backward_row_avx512};
    case SimdLevel::avx2: return {gelu_forward_row_avx2, gelu_backward_row_avx2};
#endif
    default: return {gelu_forward_row_base, gelu_backward_row_base};
  }
}
}  // namespace detail

// x, y: [..., f]. y = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
inline void gelu_forward(TensorView<const float> x, TensorView<float> y) {
  constexpr const char* op = "gelu_forward";
  detail::check_rows(op, "x", x);
  detail::check_rows(op, "y", y);
  detail::check_same_shape(op, "x", x, "y", y);
  const std::int64_t f = x.extent(-1), rows = detail::row_count(x);
  const detail::GeluRows kernels = detail::gelu_rows();
  for (std::int64_t r = 0; r < rows; ++r) kernels.forward(detail::row_pointer(x, r), detail::row_pointer(y, r), f);
}

// x, dy, dx: [..., f]. dx += dy * gelu'(x), gelu'(x) = 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2).
inline void gelu_backward(TensorView<const float> x, TensorView<const float> dy, TensorView<float> dx) {
  constexpr const char* op = "gelu_backward";
  detail::check_rows(op, "x", x);
  detail::check_rows(op, "dy", dy);
  detail::check_rows(op, "dx", dx);
  detail::check_same_shape(op, "x", x, "dy", dy);
  detail::check_same_shape(op, "x", x, "dx", dx);
  const std::int64_t f = x.extent(-1), rows = detail::row_count(x);
  const detail::GeluRows kernels = detail::gelu_rows();
  for (std::int64_t r = 0; r < rows; ++r)
    kernels.backward(detail::row_pointer(x, r), detail::row_pointer(dy, r), detail::row_pointer(dx, r), f);
}

// gate, up, y: [..., f]. y = silu(gate) * up with silu(g) = g * sigmoid(g).
inline void swiglu_forward(TensorView<const float> gate, TensorView<const float> up, TensorView<float> y) {
  constexpr const char* op = "swiglu_forward";
  detail::check_rows(op, "gate", gate);
  detail::check_rows(op, "up", up);
  detail::check_rows(op, "y", y);
  detail::check_same_shape(op, "gate", gate, "up", up);
  detail::check_same_shape(op, "gate", gate, "y", y);
  const std::int64_t f = gate.extent(-1), rows = detail::row_count(gate);
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* gr = detail::row_pointer(gate, r);
    const float* ur = detail::row_pointer(up, r);
    float* yr = detail::row_pointer(y, r);
    for (std::int64_t c = 0; c < f; ++c) yr[c] = gr[c] * sigmoid_approx(gr[c]) * ur[c];
  }
}

// gate, up, dy, dgate, dup: [..., f]. dgate += dy * up * silu'(gate), silu'(g) = s (1 + g (1 - s)) with
// s = sigmoid(g); dup += dy * silu(gate).
inline void swiglu_backward(TensorView<const float> gate, TensorView<const float> up, TensorView<const float> dy,
                            TensorView<float> dgate, TensorView<float> dup) {
  constexpr const char* op = "swiglu_backward";
  detail::check_rows(op, "gate", gate);
  detail::check_rows(op, "up", up);
  detail::check_rows(op, "dy", dy);
  detail::check_rows(op, "dgate", dgate);
  detail::check_rows(op, "dup", dup);
  detail::check_same_shape(op, "gate", gate, "up", up);
  detail::check_same_shape(op, "gate", gate, "dy", dy);
  detail::check_same_shape(op, "gate", gate, "dgate", dgate);
  detail::check_same_shape(op, "gate", gate, "dup", dup);
  const std::int64_t f = gate.extent(-1), rows = detail::row_count(gate);
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* gr = detail::row_pointer(gate, r);
    const float* ur = detail::row_pointer(up, r);
    const float* dyr = detail::row_pointer(dy, r);
    float* dgr = detail::row_pointer(dgate, r);
    float* dur = detail::row_pointer(dup, r);
    for (std::int64_t c = 0; c < f; ++c) {
      const float g = gr[c], s = sigmoid_approx(g);
      dgr[c] += dyr[c] * ur[c] * s * (1.0f + g * (1.0f - s));
      dur[c] += dyr[c] * g * s;
    }
  }
}

}  // namespace paradyse::ops::cpu
