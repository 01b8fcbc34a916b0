// paradyse/ops/cuda/moe_ops.hpp: the CUDA data ops of a mixture-of-experts layer: declarations of ops::cpu's
// functions of the same names (ops/cpu/moe_ops.hpp), with the same contracts, over views of device memory.
//
// Index lists (offsets, experts, rows) are host spans, as on the CPU: each call uploads them. Float views are device
// memory. Forward outputs are overwritten; router_backward, scatter_add_rows and sigmoid_backward ACCUMULATE (+=).
// Work runs asynchronously on device::current_stream(), except router_forward: it writes the chosen experts to a
// host span, so it synchronizes the stream before it returns (and then reports a non-finite logit as ops::cpu does).
// Top-k ties break as on the CPU (the lower expert index first), so both choose the same experts on equal logits.
// scatter_add_rows is deterministic: every destination row adds its source rows in increasing order, no atomics.
// The definitions are in kernels/moe_ops.cuh (compiled once per program by nvcc, see kernels/all.cuh).
#pragma once

#include "paradyse/core/tensor.hpp"
#include "paradyse/ops/cpu/moe_ops.hpp"

#include <cstdint>
#include <span>

namespace paradyse::ops::cuda {

// logits: [n, E]; probs: [n, E]; lse: [n]; offsets: [n + 1] (host); experts: [offsets[n]] (host, overwritten);
// gates: [offsets[n]]; stats: [E + 1] (column sums of probs, then the sum of lse^2).
void router_forward(TensorView<const float> logits, RouterScoring scoring, bool normalize, float scale,
                    std::span<const std::int64_t> offsets, TensorView<float> probs, TensorView<float> lse,
                    std::span<std::int64_t> experts, TensorView<float> gates, TensorView<float> stats);

// dlogits [n, E] += the gradient through dgates [offsets[n]], aux_grad [E] and z_grad (see ops::cpu).
void router_backward(TensorView<const float> logits, TensorView<const float> probs, TensorView<const float> lse,
                     RouterScoring scoring, bool normalize, float scale, std::span<const std::int64_t> offsets,
                     std::span<const std::int64_t> experts, TensorView<const float> dgates,
                     TensorView<const float> aux_grad, float z_grad, TensorView<float> dlogits);

// to: [m, h] (overwritten) row i = scale[i] * from[rows[i]]; rows empty: identity; scale rank-0: 1.
void gather_rows(TensorView<const float> from, std::span<const std::int64_t> rows, TensorView<const float> scale,
                 TensorView<float> to);

// to: [n, h] row rows[i] += scale[i] * from[i], in order of i per destination row; rows empty: identity.
void scatter_add_rows(TensorView<float> to, std::span<const std::int64_t> rows, TensorView<const float> from,
                      TensorView<const float> scale);

// out: [m] (overwritten) out[i] = dot(a[rows[i]], b[i]) (float64 accumulation); rows empty: identity.
void gathered_row_dot(TensorView<const float> a, std::span<const std::int64_t> rows, TensorView<const float> b,
                      TensorView<float> out);

// y = sigmoid(x) (contiguous, equal element counts).
void sigmoid_forward(TensorView<const float> x, TensorView<float> y);

// dx += dy * y (1 - y).
void sigmoid_backward(TensorView<const float> y, TensorView<const float> dy, TensorView<float> dx);

}  // namespace paradyse::ops::cuda
