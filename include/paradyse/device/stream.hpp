// paradyse/device/stream.hpp: owning handles for a CUDA stream and a CUDA event.
//
// Stream: a non-blocking stream (it does not synchronise with the legacy default stream), e.g. one per rank thread
// of cuda_local, installed with device::ScopedStream. Event: a point in a stream's work, to order another stream
// after it (wait), to wait for it on the host (synchronize), or to time the work between two events (elapsed_ms).
// Both are movable, not copyable; destroying them never throws.
//
// Host code only (cuda_runtime_api.h).
#pragma once

#include "paradyse/device/runtime.hpp"

#include <cuda_runtime_api.h>

#include <utility>

namespace paradyse::device {

class Stream {
public:
  // A new non-blocking stream on the current device.
  Stream() { PARADYSE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)); }
  Stream(Stream&& other) noexcept : stream_(std::exchange(other.stream_, nullptr)) {}
  Stream& operator=(Stream&& other) noexcept {
    if (this != &other) {
      reset();
      stream_ = std::exchange(other.stream_, nullptr);
    }
    return *this;
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  // Waits for the stream's work first, so that memory freed into a caching allocator while the stream still used
  // it is never handed to a new stream that happens to get the same handle.
  ~Stream() { reset(); }

  cudaStream_t get() const noexcept { return stream_; }
  // Waits on the host for everything issued on this stream.
  void synchronize() const { PARADYSE_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

private:
  void reset() noexcept {
    if (!stream_) return;
    (void)cudaStreamSynchronize(stream_);
    (void)cudaStreamDestroy(stream_);
    (void)cudaGetLastError();  // a failure at teardown (the driver already gone at exit) must not leak into checks
    stream_ = nullptr;
  }

  cudaStream_t stream_ = nullptr;
};

class Event {
public:
  // An event that can time (timing = true) or only order work (cheaper: cudaEventDisableTiming).
  explicit Event(bool timing = true) {
    PARADYSE_CUDA_CHECK(cudaEventCreateWithFlags(&event_, timing ? cudaEventDefault : cudaEventDisableTiming));
  }
  Event(Event&& other) noexcept : event_(std::exchange(other.event_, nullptr)) {}
  Event& operator=(Event&& other) noexcept {
    if (this != &other) {
      reset();
      event_ = std::exchange(other.event_, nullptr);
    }
    return *this;
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  ~Event() { reset(); }

  cudaEvent_t get() const noexcept { return event_; }

  // Marks the point after everything issued so far on `stream` (default: the calling thread's current stream).
  void record(cudaStream_t stream = current_stream()) { PARADYSE_CUDA_CHECK(cudaEventRecord(event_, stream)); }
  // Work issued on `stream` from now on starts only after the recorded point (no host wait).
  void wait(cudaStream_t stream = current_stream()) const {
    PARADYSE_CUDA_CHECK(cudaStreamWaitEvent(stream, event_, 0));
  }
  // Waits on the host until the recorded point is reached.
  void synchronize() const { PARADYSE_CUDA_CHECK(cudaEventSynchronize(event_)); }
  // Whether the recorded point has been reached (no wait).
  bool done() const {
    const cudaError_t status = cudaEventQuery(event_);
    if (status == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return false;
    }
    check(status, "cudaEventQuery");
    return true;
  }

private:
  void reset() noexcept {
    if (!event_) return;
    (void)cudaEventDestroy(event_);
    (void)cudaGetLastError();
    event_ = nullptr;
  }

  cudaEvent_t event_ = nullptr;
};

// Milliseconds of device time from `start` to `stop`, both recorded with timing on; waits for `stop`.
inline float elapsed_ms(const Event& start, const Event& stop) {
  stop.synchronize();
  float ms = 0;
  PARADYSE_CUDA_CHECK(cudaEventElapsedTime(&ms, start.get(), stop.get()));
  return ms;
}

}  // namespace paradyse::device
