// paradyse/device/pinned.hpp: PinnedBuffer<T>, page-locked host memory (cudaMallocHost) for staging copies.
//
// Copies between the device and pinned memory run asynchronously at full bus speed; copies from pageable memory are
// staged by the driver. A pinned buffer is host memory outside the memory trackers (staging, not model state).
// Movable, not copyable; the elements are not initialised.
#pragma once

#include "paradyse/core/dtype.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/device/runtime.hpp"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <cstddef>
#include <span>
#include <utility>

namespace paradyse::device {

template <class T>
class PinnedBuffer {
public:
  PinnedBuffer() = default;
  // `count` elements of page-locked host memory.
  explicit PinnedBuffer(std::size_t count) : size_(count) {
    if (count == 0) return;
    paradyse::check(count <= kMaxTrackedBytes / sizeof(T), "PinnedBuffer: {} elements of {} bytes is too large",
                    count, sizeof(T));
    void* p = nullptr;
    check(cudaMallocHost(&p, count * sizeof(T)), fmt::format("cudaMallocHost of {} bytes", count * sizeof(T)));
    data_ = static_cast<T*>(p);
  }
  PinnedBuffer(PinnedBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}
  PinnedBuffer& operator=(PinnedBuffer&& other) noexcept {
    if (this != &other) {
      reset();
      data_ = std::exchange(other.data_, nullptr);
      size_ = std::exchange(other.size_, 0);
    }
    return *this;
  }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer() { reset(); }

  T* data() noexcept { return data_; }
  const T* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }
  std::size_t bytes() const noexcept { return size_ * sizeof(T); }
  std::span<T> span() noexcept { return {data_, size_}; }
  std::span<const T> span() const noexcept { return {data_, size_}; }
  T& operator[](std::size_t i) noexcept { return data_[i]; }
  const T& operator[](std::size_t i) const noexcept { return data_[i]; }

private:
  void reset() noexcept {
    if (data_) {
      (void)cudaFreeHost(data_);  // the owner must not free a buffer that an asynchronous copy still reads
      (void)cudaGetLastError();
    }
    data_ = nullptr;
    size_ = 0;
  }

  T* data_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace paradyse::device
