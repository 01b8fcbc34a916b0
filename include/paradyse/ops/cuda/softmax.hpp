// paradyse/ops/cuda/softmax.hpp: the CUDA row softmax over a materialised score matrix (causal mask at global
// positions) and its backward: declarations of ops::cpu's functions of the same names (ops/cpu/softmax.hpp), with
// the same contracts, over views of device memory.
//
// The position runs are host metadata; each call expands and uploads them. Work runs asynchronously on
// device::current_stream(); argument errors throw before anything is launched, with ops::cpu's messages. The
// definitions are in kernels/softmax.cuh (compiled once per program by nvcc, see kernels/all.cuh).
#pragma once

#include "paradyse/core/tensor.hpp"
#include "paradyse/ops/cpu/softmax.hpp"

#include <span>

namespace paradyse::ops::cuda {

// scores: [..., n, c] device, in place -> the softmax of each row over the keys its query sees (masked columns 0).
// Every row must see a key (checked on the host from the runs). One difference from ops::cpu: a row whose visible
// scores are all -inf becomes NaN instead of an Error (the data are on the device; the check would cost a sync).
void masked_softmax_forward(TensorView<float> scores, std::span<const PositionRun> query_runs,
                            std::span<const PositionRun> key_runs, bool causal);

// grads: [..., c] device, in place dP -> dS = probs * (grads - rowsum(probs * grads)).
void softmax_backward(TensorView<const float> probs, TensorView<float> grads);

}  // namespace paradyse::ops::cuda
