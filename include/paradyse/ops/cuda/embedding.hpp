// paradyse/ops/cuda/embedding.hpp: token embedding lookup on the GPU: declarations of ops::cpu's functions of the same
// names (ops/cpu/embedding.hpp), with the same signatures and contracts, over views of device memory (tokens too).
//
// Token ids are checked on the device before any row is touched: a kernel records the first id outside
// [0, vocab), the call synchronises the stream and throws ops::cpu's message naming it (so every call costs one
// host round trip). Backward is deterministic and gives ops::cpu's bits: the (token, index) pairs are sorted by token
// with a stable radix sort (CUB), and each distinct token's rows are added into its dtable row in index order, the
// same additions in the same order as the CPU loop. Definitions: kernels/embedding.cuh (nvcc).
#pragma once

#include "paradyse/core/tensor.hpp"
#include "paradyse/ops/cpu/embedding.hpp"

#include <cstdint>

namespace paradyse::ops::cuda {

// tokens: [...] int32; table: [vocab, h]; out: [..., h] (overwritten). out[i] = table[tokens[i]].
void embedding_forward(TensorView<const std::int32_t> tokens, TensorView<const float> table, TensorView<float> out);

// tokens: [...]; dout: [..., h]; dtable: [vocab, h]. dtable[tokens[i]] += dout[i].
void embedding_backward(TensorView<const std::int32_t> tokens, TensorView<const float> dout, TensorView<float> dtable);

}  // namespace paradyse::ops::cuda
