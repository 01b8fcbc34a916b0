// paradyse/ops/cuda/activation.hpp: GELU (tanh form) and SwiGLU on the GPU: declarations of ops::cpu's functions of
// the same names (ops/cpu/activation.hpp), with the same signatures and contracts, over views of device memory.
//
// Element-wise over views of one shape (any outer strides, unit-stride last dimension). Forward outputs are
// overwritten (and may alias an input); backward gradients ACCUMULATE (+=). The formulas are ops::cpu's (tanh as
// 1 - 2 / (e^{2u} + 1), sigmoid as 1 / (1 + e^-x)) with the device's expf in place of exp_approx. Work runs
// asynchronously on device::current_stream(). Definitions: kernels/activation.cuh (nvcc).
#pragma once

#include "paradyse/core/tensor.hpp"
#include "paradyse/ops/cpu/activation.hpp"

namespace paradyse::ops::cuda {

// x, y: [..., f]. y = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
void gelu_forward(TensorView<const float> x, TensorView<float> y);

// x, dy, dx: [..., f]. dx += dy * gelu'(x).
void gelu_backward(TensorView<const float> x, TensorView<const float> dy, TensorView<float> dx);

// gate, up, y: [..., f]. y = silu(gate) * up.
void swiglu_forward(TensorView<const float> gate, TensorView<const float> up, TensorView<float> y);

// gate, up, dy, dgate, dup: [..., f]. dgate += dy * up * silu'(gate); dup += dy * silu(gate).
void swiglu_backward(TensorView<const float> gate, TensorView<const float> up, TensorView<const float> dy,
                     TensorView<float> dgate, TensorView<float> dup);

}  // namespace paradyse::ops::cuda
