// paradyse/ops/cuda/rope.hpp: rotary position embedding on the GPU: declarations of ops::cpu's functions of the same
// names (ops/cpu/rope.hpp), with the same signatures and contracts, over views of device memory.
//
// document_starts is host memory (as on the CPU): each call uploads it, with the frequencies theta^(-2j/d), into a
// stream-ordered scratch. Angles are computed in double and their cosine and sine rounded to float, as ops::cpu
// does. Work runs asynchronously on device::current_stream(). Definitions: kernels/rope.cuh (nvcc).
#pragma once

#include "paradyse/core/tensor.hpp"
#include "paradyse/ops/cpu/rope.hpp"

#include <cstdint>
#include <span>

namespace paradyse::ops::cuda {

// x, y: [b, s, heads, d] (y overwritten; may be x itself). Token i at position position_offset + i (relative to its
// document when document_starts is given).
void rope_forward(TensorView<const float> x, TensorView<float> y, std::int64_t position_offset,
                  const RopeConfig& config = {}, std::span<const std::int64_t> document_starts = {});

// dy, dx: [b, s, heads, d]. dx += rotation^T dy. dx must not alias dy.
void rope_backward(TensorView<const float> dy, TensorView<float> dx, std::int64_t position_offset,
                   const RopeConfig& config = {}, std::span<const std::int64_t> document_starts = {});

}  // namespace paradyse::ops::cuda
