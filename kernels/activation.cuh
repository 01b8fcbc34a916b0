// kernels/activation.cuh: the GELU / SwiGLU kernels and the launchers ops/cuda/activation.hpp declares.
//
// One grid-stride loop over the elements of the [rows, f] views; element i is (row i / f, column i % f), each view
// located through its RowLayout (any outer strides). The math is ops::cpu's, expf in place of exp_approx.
#pragma once

#include "rows.cuh"
#include "paradyse/ops/cpu/rows.hpp"
#include "paradyse/ops/cuda/activation.hpp"

#include <cstdint>

namespace paradyse::kernels::dense {

namespace activation_detail {
inline constexpr float kSqrt2OverPi = 0.7978845608028654f;  // as ops::cpu::detail::kGeluSqrt2OverPi
inline constexpr float kCubic = 0.044715f;

// tanh(u) = 1 - 2 / (e^{2u} + 1): saturates to +-1 (e^{2u} = inf gives 1, 0 gives -1), as ops::cpu's tanh_approx.
__device__ inline float tanh_via_exp(float u) { return 1.0f - 2.0f / (expf(2.0f * u) + 1.0f); }
__device__ inline float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
}  // namespace activation_detail

enum class ActivationKind { gelu_forward, gelu_backward, swiglu_forward, swiglu_backward };

// Operand roles: gelu_forward (a = x, out0 = y); gelu_backward (a = x, b = dy, out0 = dx);
// swiglu_forward (a = gate, b = up, out0 = y); swiglu_backward (a = gate, b = up, c = dy, out0 = dgate, out1 = dup).
struct ActivationOperands {
  const float* a = nullptr;
  RowLayout a_rows;
  const float* b = nullptr;
  RowLayout b_rows;
  const float* c = nullptr;
  RowLayout c_rows;
  float* out0 = nullptr;
  RowLayout out0_rows;
  float* out1 = nullptr;
  RowLayout out1_rows;
};

template <ActivationKind kind>
__global__ void activation_kernel(ActivationOperands o, std::int64_t rows, std::int64_t f) {
  using namespace activation_detail;
  const std::int64_t n = rows * f;
  for (std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int64_t r = i / f, col = i % f;
    const float a = o.a[o.a_rows.offset(r) + col];
    if constexpr (kind == ActivationKind::gelu_forward) {
      const float t = tanh_via_exp(kSqrt2OverPi * (a + kCubic * a * a * a));
      o.out0[o.out0_rows.offset(r) + col] = 0.5f * a * (1.0f + t);
    } else if constexpr (kind == ActivationKind::gelu_backward) {
      const float dy = o.b[o.b_rows.offset(r) + col];
      const float t = tanh_via_exp(kSqrt2OverPi * (a + kCubic * a * a * a));
      const float du = kSqrt2OverPi * (1.0f + 3.0f * kCubic * a * a);
      o.out0[o.out0_rows.offset(r) + col] += dy * (0.5f * (1.0f + t) + 0.5f * a * (1.0f - t * t) * du);
    } else if constexpr (kind == ActivationKind::swiglu_forward) {
      const float up = o.b[o.b_rows.offset(r) + col];
      o.out0[o.out0_rows.offset(r) + col] = a * sigmoid(a) * up;
    } else {
      const float up = o.b[o.b_rows.offset(r) + col], dy = o.c[o.c_rows.offset(r) + col];
      const float s = sigmoid(a);
      o.out0[o.out0_rows.offset(r) + col] += dy * up * s * (1.0f + a * (1.0f - s));
      o.out1[o.out1_rows.offset(r) + col] += dy * a * s;
    }
  }
}

template <ActivationKind kind>
void launch_activation(const ActivationOperands& operands, std::int64_t rows, std::int64_t f, const char* name) {
  if (rows == 0 || f == 0) return;
  constexpr int kThreads = 256;
  // At most ~64 blocks of work per SM on an H200 (132 SMs); the grid-stride loop covers the rest.
  const unsigned blocks = std::min<unsigned>(grid_for(rows * f, kThreads), 132u * 64u);
  activation_kernel<kind><<<blocks, kThreads, 0, device::current_stream()>>>(operands, rows, f);
  device::check_launch(name);
}

}  // namespace paradyse::kernels::dense

namespace paradyse::ops::cuda {

void gelu_forward(TensorView<const float> x, TensorView<float> y) {
  namespace d = ops::cpu::detail;
  namespace kd = kernels::dense;
  constexpr const char* op = "gelu_forward";
  d::check_rows(op, "x", x);
  d::check_rows(op, "y", y);
  d::check_same_shape(op, "x", x, "y", y);
  kd::ActivationOperands o;
  o.a = x.data(), o.a_rows = kd::row_layout(x);
  o.out0 = y.data(), o.out0_rows = kd::row_layout(y);
  kd::launch_activation<kd::ActivationKind::gelu_forward>(o, d::row_count(x), x.extent(-1),
                                                                    "activation_kernel (gelu_forward)");
}

void gelu_backward(TensorView<const float> x, TensorView<const float> dy, TensorView<float> dx) {
  namespace d = ops::cpu::detail;
  namespace kd = kernels::dense;
  constexpr const char* op = "gelu_backward";
  d::check_rows(op, "x", x);
  d::check_rows(op, "dy", dy);
  d::check_rows(op, "dx", dx);
  d::check_same_shape(op, "x", x, "dy", dy);
  d::check_same_shape(op, "x", x, "dx", dx);
  kd::ActivationOperands o;
  o.a = x.data(), o.a_rows = kd::row_layout(x);
  o.b = dy.data(), o.b_rows = kd::row_layout(dy);
  o.out0 = dx.data(), o.out0_rows = kd::row_layout(dx);
  kd::launch_activation<kd::ActivationKind::gelu_backward>(o, d::row_count(x), x.extent(-1),
                                                                     "activation_kernel (gelu_backward)");
}

void swiglu_forward(TensorView<const float> gate, TensorView<const float> up, TensorView<float> y) {
  namespace d = ops::cpu::detail;
  namespace kd = kernels::dense;
  constexpr const char* op = "swiglu_forward";
  d::check_rows(op, "gate", gate);
  d::check_rows(op, "up", up);
  d::check_rows(op, "y", y);
  d::check_same_shape(op, "gate", gate, "up", up);
  d::check_same_shape(op, "gate", gate, "y", y);
  kd::ActivationOperands o;
  o.a = gate.data(), o.a_rows = kd::row_layout(gate);
  o.b = up.data(), o.b_rows = kd::row_layout(up);
  o.out0 = y.data(), o.out0_rows = kd::row_layout(y);
  kd::launch_activation<kd::ActivationKind::swiglu_forward>(o, d::row_count(gate), gate.extent(-1),
                                                                      "activation_kernel (swiglu_forward)");
}

void swiglu_backward(TensorView<const float> gate, TensorView<const float> up, TensorView<const float> dy,
                     TensorView<float> dgate, TensorView<float> dup) {
  namespace d = ops::cpu::detail;
  namespace kd = kernels::dense;
  constexpr const char* op = "swiglu_backward";
  d::check_rows(op, "gate", gate);
  d::check_rows(op, "up", up);
  d::check_rows(op, "dy", dy);
  d::check_rows(op, "dgate", dgate);
  d::check_rows(op, "dup", dup);
  d::check_same_shape(op, "gate", gate, "up", up);
  d::check_same_shape(op, "gate", gate, "dy", dy);
  d::check_same_shape(op, "gate", gate, "dgate", dgate);
  d::check_same_shape(op, "gate", gate, "dup", dup);
  kd::ActivationOperands o;
  o.a = gate.data(), o.a_rows = kd::row_layout(gate);
  o.b = up.data(), o.b_rows = kd::row_layout(up);
  o.c = dy.data(), o.c_rows = kd::row_layout(dy);
  o.out0 = dgate.data(), o.out0_rows = kd::row_layout(dgate);
  o.out1 = dup.data(), o.out1_rows = kd::row_layout(dup);
  kd::launch_activation<kd::ActivationKind::swiglu_backward>(o, d::row_count(gate), gate.extent(-1),
                                                                       "activation_kernel (swiglu_backward)");
}

}  // namespace paradyse::ops::cuda
