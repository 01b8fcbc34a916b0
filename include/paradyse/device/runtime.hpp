// paradyse/device/runtime.hpp: the CUDA runtime as the library uses it: error checks, "is there a device", and the
// calling thread's stream.
//
// Host code only (cuda_runtime_api.h): this header, and everything in device/, compiles with the host compiler and
// links against cudart; kernels live in kernels/ and are compiled once per program by nvcc (see kernels/all.cuh).
//
// Streams. Every op of ops::Cuda and every copy of the CUDA communicators runs on the calling thread's current
// stream, `device::current_stream()`. It is the per-thread default stream unless a `ScopedStream` installed
// another (cuda_local gives each rank thread its own stream this way), so ops issued by one thread are ordered and
// ops of different rank threads may overlap.
#pragma once

#include "paradyse/core/error.hpp"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <source_location>
#include <string>
#include <string_view>

namespace paradyse::device {

// A CUDA runtime call failed. The message names the call, the error and its explanation.
class DeviceError : public Error {
public:
  explicit DeviceError(const std::string& message, std::source_location where = std::source_location::current())
      : Error(message, where) {}
};

// Throws DeviceError naming `what` unless `status` is cudaSuccess.
inline void check(cudaError_t status, std::string_view what,
                  std::source_location where = std::source_location::current()) {
  if (status != cudaSuccess)
    throw DeviceError(fmt::format("CUDA error {} ({}) in {}", cudaGetErrorName(status), cudaGetErrorString(status),
                                  what),
                      where);
}
#define PARADYSE_CUDA_CHECK(expr) ::paradyse::device::check((expr), #expr)

// The number of CUDA devices this process can use; 0 where there is no driver or no GPU (CI).
inline int count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return n;
}
inline bool available() noexcept { return count() > 0; }

// Why there is no device, for skip messages ("no CUDA device: CUDA driver version is insufficient ...").
inline std::string unavailable_reason() {
  int n = 0;
  const cudaError_t status = cudaGetDeviceCount(&n);
  (void)cudaGetLastError();
  if (status != cudaSuccess) return fmt::format("no CUDA device: {}", cudaGetErrorString(status));
  return n == 0 ? "no CUDA device: the driver reports none" : "";
}

namespace runtime_detail {
inline cudaStream_t& stream_slot() noexcept {
  thread_local cudaStream_t stream = cudaStreamPerThread;
  return stream;
}
}  // namespace runtime_detail

// The stream the calling thread's device work runs on.
inline cudaStream_t current_stream() noexcept { return runtime_detail::stream_slot(); }

// Makes `stream` the calling thread's current stream for the lifetime of this object.
class ScopedStream {
public:
  explicit ScopedStream(cudaStream_t stream) : previous_(runtime_detail::stream_slot()) {
    runtime_detail::stream_slot() = stream;
  }
  ~ScopedStream() { runtime_detail::stream_slot() = previous_; }
  ScopedStream(const ScopedStream&) = delete;
  ScopedStream& operator=(const ScopedStream&) = delete;

private:
  cudaStream_t previous_;
};

// Waits for everything issued on the calling thread's stream; a kernel's failure surfaces here as a DeviceError.
inline void synchronize(std::source_location where = std::source_location::current()) {
  check(cudaStreamSynchronize(current_stream()), "cudaStreamSynchronize(current stream)", where);
}

// After a kernel launch: a bad launch configuration surfaces at once, naming the kernel.
inline void check_launch(std::string_view kernel, std::source_location where = std::source_location::current()) {
  check(cudaGetLastError(), fmt::format("launch of {}", kernel), where);
}

}  // namespace paradyse::device
