// paradyse/ops/cuda_backend.hpp: ops::Cuda, the backend policy over device memory.
//
// The members of ops/op_table.inc with the signatures and contracts of ops::Cpu (ops/backend.hpp): forward outputs
// are overwritten, backward gradients ACCUMULATE (+=), cross_entropy_forward_backward overwrites dlogits. Every
// TensorView's data is device memory (a tensor made while a device tracker is current, device/caching_allocator.hpp);
// host-side index spans (document starts, rows, experts, offsets) stay host memory, as on the CPU. Every op runs
// asynchronously on the calling thread's stream (device/runtime.hpp); an op that returns a host value (the loss) or
// writes a host span (the router's expert choices) synchronises that stream first.
//
// This header is host code: it declares the launchers (ops/cuda/*.hpp), whose definitions are the kernels of
// kernels/all.cuh, compiled once per program by nvcc (cmake/paradyse_kernels.cu).
#pragma once

#include "paradyse/ops/attention_mask.hpp"
#include "paradyse/ops/cuda/activation.hpp"
#include "paradyse/ops/cuda/adamw.hpp"
#include "paradyse/ops/cuda/attention.hpp"
#include "paradyse/ops/cuda/convert.hpp"
#include "paradyse/ops/cuda/cross_entropy.hpp"
#include "paradyse/ops/cuda/embedding.hpp"
#include "paradyse/ops/cuda/gemm.hpp"
#include "paradyse/ops/cuda/moe_ops.hpp"
#include "paradyse/ops/cuda/normalization.hpp"
#include "paradyse/ops/cuda/rope.hpp"
#include "paradyse/ops/cuda/softmax.hpp"
#include "paradyse/ops/cuda/tensor_ops.hpp"

#include <cstdint>
#include <span>
#include <string_view>

namespace paradyse::ops {

// The CUDA backend: every op of ops/op_table.inc, forwarded to ops::cuda.
namespace cuda_backend {
namespace impl = cuda;
struct Cuda {
  static constexpr std::string_view name = "cuda";
  static constexpr MemorySpace space = MemorySpace::device;  // where the tensors it computes on live
#include "paradyse/ops/op_table.inc"
};
}  // namespace cuda_backend
using cuda_backend::Cuda;

}  // namespace paradyse::ops
