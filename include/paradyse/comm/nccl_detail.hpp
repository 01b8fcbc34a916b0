// paradyse/comm/nccl_detail.hpp: what the NCCL backend (comm/nccl.hpp) builds on: NCCL's data types and reduction
// operators for the communicator's element types, the error check every NCCL call goes through, and the State one
// communicator owns (the NCCL communicator, its device, its communication stream, whether it was aborted).
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/dtype.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/device/stream.hpp"

#include <cuda_runtime_api.h>
#include <fmt/format.h>
#include <nccl.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

namespace paradyse {

namespace nccl_detail {

template <class T>
ncclDataType_t data_type() {
  if constexpr (std::is_same_v<T, float>) return ncclFloat32;
  else if constexpr (std::is_same_v<T, double>) return ncclFloat64;
  else if constexpr (std::is_same_v<T, bf16>) return ncclBfloat16;
  else if constexpr (std::is_same_v<T, std::int32_t>) return ncclInt32;
  else if constexpr (std::is_same_v<T, std::int64_t>) return ncclInt64;
  else return ncclUint8;  // std::byte
}

// The NCCL reduction of `op` (avg: a sum, divided afterwards).
inline ncclRedOp_t red_op(ReduceOp op) { return op == ReduceOp::max ? ncclMax : ncclSum; }

// Throws CommError naming the result, NCCL's last error text and `what` unless `result` is ncclSuccess.
inline void check(ncclResult_t result, std::string_view what, ncclComm_t comm = nullptr) {
  if (result == ncclSuccess) return;
  const char* last = ncclGetLastError(comm);
  throw CommError(fmt::format("NCCL error {} ({}) in {}{}{}", int(result), ncclGetErrorString(result), what,
                              last && *last ? ": " : "", last ? last : ""));
}

inline bool overlaps(const void* a, std::size_t a_bytes, const void* b, std::size_t b_bytes) {
  const auto* x = static_cast<const std::byte*>(a);
  const auto* y = static_cast<const std::byte*>(b);
  return a_bytes && b_bytes && x < y + b_bytes && y < x + a_bytes;
}

// What one communicator owns: the NCCL communicator, its device, its communication stream, whether it was aborted.
struct State {
  ncclComm_t comm = nullptr;
  int rank = 0, size = 1, device = 0;
  std::chrono::milliseconds timeout{};
  device::Stream stream;  // the communication stream (created on `device`)
  bool aborted = false;
  std::string abort_reason;

  State(ncclComm_t c, int r, int n, int d, std::chrono::milliseconds t)
      : comm(c), rank(r), size(n), device(d), timeout(t) {}
  State(const State&) = delete;
  State& operator=(const State&) = delete;
  ~State() {
    if (!comm) return;
    if (aborted) return;  // ncclCommAbort freed it
    (void)cudaStreamSynchronize(stream.get());
    (void)ncclCommDestroy(comm);
  }

  void abort(std::string reason) {
    if (aborted) return;
    aborted = true;
    abort_reason = std::move(reason);
    (void)ncclCommAbort(comm);
  }
};

}  // namespace nccl_detail

}  // namespace paradyse
