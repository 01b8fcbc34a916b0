// paradyse/ops/cuda/normalization.hpp: LayerNorm and RMSNorm on the GPU: declarations of ops::cpu's functions of the
// same names (ops/cpu/normalization.hpp), with the same signatures and contracts, over views of device memory.
//
// Forward outputs (y, mean, rstd) are overwritten; backward gradients ACCUMULATE (+=) into dx, dgamma, dbeta. The
// parameter gradients are reduced over rows in a fixed order (per-chunk partial sums, then one sum per column), so
// results are reproducible run to run. Work runs asynchronously on device::current_stream(); argument errors throw
// before anything is launched, with ops::cpu's messages. Definitions: kernels/normalization.cuh (nvcc).
#pragma once

#include "paradyse/core/tensor.hpp"
#include "paradyse/ops/cpu/normalization.hpp"

namespace paradyse::ops::cuda {

// x, y: [..., h] (y may alias x); gamma, beta: [h]; mean, rstd: one float per row, contiguous.
void layer_norm_forward(TensorView<const float> x, TensorView<const float> gamma, TensorView<const float> beta,
                        float epsilon, TensorView<float> y, TensorView<float> mean, TensorView<float> rstd);

// dx += ..., dgamma += sum over rows of dy * xhat, dbeta += sum over rows of dy.
void layer_norm_backward(TensorView<const float> x, TensorView<const float> gamma, TensorView<const float> mean,
                         TensorView<const float> rstd, TensorView<const float> dy, TensorView<float> dx,
                         TensorView<float> dgamma, TensorView<float> dbeta);

// x, y: [..., h] (y may alias x); gamma: [h]; rstd: one float per row, contiguous.
void rms_norm_forward(TensorView<const float> x, TensorView<const float> gamma, float epsilon, TensorView<float> y,
                      TensorView<float> rstd);

// dx += ..., dgamma += sum over rows of dy * xhat.
void rms_norm_backward(TensorView<const float> x, TensorView<const float> gamma, TensorView<const float> rstd,
                       TensorView<const float> dy, TensorView<float> dx, TensorView<float> dgamma);

}  // namespace paradyse::ops::cuda
