// paradyse/ops/cuda/adamw.hpp: one AdamW step on the GPU: the declaration of ops::cpu's function of the same name
// (ops/cpu/adamw.hpp), with the same signature, formula (bias correction, decoupled weight decay) and checks, over
// fp32 views of device memory (master weights and both moments in fp32). Runs asynchronously on
// device::current_stream(). Definition: kernels/adamw.cuh (nvcc).
#pragma once

#include "paradyse/core/tensor.hpp"
#include "paradyse/ops/cpu/adamw.hpp"

#include <cstdint>

namespace paradyse::ops::cuda {

// params, grads, m, v: the same number of elements, contiguous. step: 1 for the first step. Updates params, m, v.
void adamw_step(TensorView<float> params, TensorView<const float> grads, TensorView<float> m, TensorView<float> v,
                const AdamWConfig& config, std::int64_t step);

}  // namespace paradyse::ops::cuda
