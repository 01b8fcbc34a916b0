// paradyse/ops/cuda/tensor_ops.hpp: copy, fill and add-into over device views of any rank and strides: the
// declarations of ops::cpu's functions of the same names (ops/cpu/tensor_ops.hpp), with the same contracts and
// messages, over views whose data are device memory.
//
// Each call is asynchronous on device::current_stream(); shape errors throw before anything is issued. A pair of
// contiguous views takes the direct path (cudaMemcpyAsync, one flat kernel); other strides take one strided kernel
// that gets the shape and strides by value. The definitions are in kernels/tensor_ops.cuh (compiled once per
// program by nvcc, see kernels/all.cuh).
#pragma once

#include "paradyse/core/tensor.hpp"

namespace paradyse::ops::cuda {

// to = from (equal shapes, any strides; they must not overlap).
void copy(TensorView<const float> from, TensorView<float> to);

// x = value (any strides).
void fill(TensorView<float> x, float value);

// to += from (equal shapes, any strides).
void add_into(TensorView<float> to, TensorView<const float> from);

// Returns when the calling thread's stream (device::current_stream()) has done its queued work.
void synchronize();

}  // namespace paradyse::ops::cuda
