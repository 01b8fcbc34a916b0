// paradyse/ops/backend.hpp: the backend policy that the strategies are written over, and ops::Cpu.
//
// A strategy takes a Backend template parameter and calls Backend::gemm(...), Backend::attention_forward(...) and
// so on. Every backend has the members of one list, ops/op_table.inc (their signatures, shapes and the contract
// they share): ops::Cpu forwards them to ops::cpu, ops::Cuda (ops/cuda_backend.hpp) to ops::cuda over device
// memory, ops::Counting (ops/counting.hpp) to the counting rules of a dry run. memory_space_of<Backend> says where
// a backend's tensors live.
#pragma once

#include "paradyse/core/memory.hpp"
#include "paradyse/ops/attention_mask.hpp"
#include "paradyse/ops/cpu/activation.hpp"
#include "paradyse/ops/cpu/adamw.hpp"
#include "paradyse/ops/cpu/attention.hpp"
#include "paradyse/ops/cpu/convert.hpp"
#include "paradyse/ops/cpu/cross_entropy.hpp"
#include "paradyse/ops/cpu/embedding.hpp"
#include "paradyse/ops/cpu/gemm.hpp"
#include "paradyse/ops/cpu/gemm_batched.hpp"
#include "paradyse/ops/cpu/gemm_grouped.hpp"
#include "paradyse/ops/cpu/moe_ops.hpp"
#include "paradyse/ops/cpu/normalization.hpp"
#include "paradyse/ops/cpu/rope.hpp"
#include "paradyse/ops/cpu/softmax.hpp"
#include "paradyse/ops/cpu/tensor_ops.hpp"

#include <cstdint>
#include <span>
#include <string_view>

namespace paradyse::ops {

// The CPU backend: every op of ops/op_table.inc, forwarded to ops::cpu.
namespace cpu_backend {
namespace impl = cpu;
struct Cpu {
  static constexpr std::string_view name = "cpu";
  static constexpr MemorySpace space = MemorySpace::host;  // where the tensors it computes on live
#include "paradyse/ops/op_table.inc"
};
}  // namespace cpu_backend
using cpu_backend::Cpu;

// Where a backend's tensors live: its `space` member, or the host for a backend that names none.
template <class Backend>
inline constexpr MemorySpace memory_space_of = [] {
  if constexpr (requires { Backend::space; }) return MemorySpace(Backend::space);
  else return MemorySpace::host;
}();
// Whether a backend computes on tensors in device memory.
template <class Backend>
inline constexpr bool on_device = memory_space_of<Backend> == MemorySpace::device;

// A backend whose ops are the static members of Impl, one for each name of ops/op_names.inc: a wrapper around
// another backend's ops (cost/op_times.hpp's OpTimed, the tests' and benchmarks' recording and deferring backends).
// Impl::name names it; its tensors live where Impl::space says (the host where Impl names none).
template <class Impl>
struct BackendOf {
  using impl = Impl;
  static constexpr std::string_view name = Impl::name;
  static constexpr MemorySpace space = memory_space_of<Impl>;
#include "paradyse/ops/op_table.inc"
};

}  // namespace paradyse::ops
