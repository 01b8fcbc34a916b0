// kernels/stream_scratch.cuh: device scratch for the host metadata of one op (index lists, positions,
// partial sums), allocated and freed in the order of a stream (cudaMallocAsync / cudaFreeAsync), so the memory stays
// alive until every kernel issued before the free on that stream has consumed it, without a synchronization.
// Host code (runtime API only); used by the launchers in kernels/.
#pragma once

#include "paradyse/device/runtime.hpp"

#include <cuda_runtime_api.h>

#include <cstddef>
#include <span>
#include <utility>

namespace paradyse::kernels {

class StreamScratch {
public:
  StreamScratch() = default;
  // `bytes` of device memory on `stream` (none when 0: data() is null).
  StreamScratch(std::size_t bytes, cudaStream_t stream) : stream_(stream) {
    if (bytes) PARADYSE_CUDA_CHECK(cudaMallocAsync(&data_, bytes, stream));
  }
  StreamScratch(StreamScratch&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), stream_(other.stream_) {}
  StreamScratch& operator=(StreamScratch&& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(stream_, other.stream_);
    return *this;
  }
  StreamScratch(const StreamScratch&) = delete;
  StreamScratch& operator=(const StreamScratch&) = delete;
  ~StreamScratch() {
    if (data_) (void)cudaFreeAsync(data_, stream_);  // stream-ordered: after the kernels already issued
  }

  template <class T>
  T* as() const noexcept {
    return static_cast<T*>(data_);
  }

private:
  void* data_ = nullptr;
  cudaStream_t stream_ = nullptr;
};

// A device copy of the host elements `host`, issued on `stream` (the host span may change once this returns: a copy
// from pageable memory is staged before cudaMemcpyAsync returns).
template <class T>
StreamScratch upload(std::span<const T> host, cudaStream_t stream) {
  StreamScratch scratch(host.size_bytes(), stream);
  if (!host.empty())
    PARADYSE_CUDA_CHECK(
        cudaMemcpyAsync(scratch.as<T>(), host.data(), host.size_bytes(), cudaMemcpyHostToDevice, stream));
  return scratch;
}

// Blocks for a grid-stride loop over `count` items with `threads` per block (at least 1, at most 2^20).
inline unsigned grid_for(long long count, unsigned threads) {
  const long long blocks = (count + threads - 1) / threads;
  return unsigned(blocks < 1 ? 1 : blocks > (1LL << 20) ? (1LL << 20) : blocks);
}

}  // namespace paradyse::kernels
