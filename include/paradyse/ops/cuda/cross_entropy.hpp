// paradyse/ops/cuda/cross_entropy.hpp: softmax cross-entropy fused with its gradient on the GPU: the declaration of
// ops::cpu's function of the same name (ops/cpu/cross_entropy.hpp), with the same signature and contract, over views
// of device memory (targets too).
//
// One block per row: max, log-sum-exp, the loss lse - logit[target], dlogits = grad_scale * (softmax - onehot)
// (OVERWRITTEN; may alias logits); ignore_index rows get a zero gradient and no loss. The per-row losses are summed
// in double in a fixed order (one block, fixed strides, then a fixed tree), so the result is reproducible. The call
// synchronises the stream to return the host CrossEntropyResult; a target outside [0, vocab) that is not
// ignore_index throws ops::cpu's message naming the first such row. Definitions: kernels/cross_entropy.cuh (nvcc).
#pragma once

#include "paradyse/core/tensor.hpp"
#include "paradyse/ops/cpu/cross_entropy.hpp"

#include <cstdint>

namespace paradyse::ops::cuda {

// logits: [..., vocab]; targets: [...] int32 (contiguous); dlogits: [..., vocab].
cpu::CrossEntropyResult cross_entropy_forward_backward(TensorView<const float> logits,
                                                       TensorView<const std::int32_t> targets,
                                                       TensorView<float> dlogits, float grad_scale,
                                                       std::int32_t ignore_index = cpu::kIgnoreIndex);

}  // namespace paradyse::ops::cuda
