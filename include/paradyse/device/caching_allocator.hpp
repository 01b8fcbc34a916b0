// paradyse/device/caching_allocator.hpp: device memory for MemoryTracker, through a caching allocator.
//
// cudaMalloc and cudaFree are slow and synchronise the device, so a freed block is not given back to the driver:
// it goes to a free list of its size class and the next allocation of that class takes it (no cudaMalloc). Sizes
// round up to 512 bytes, and above 1 MiB to whole 2 MiB, so that the allocations of a training step, the same
// every step, find their blocks again: steady-state training makes no cudaMalloc. A block is reused only for a
// request of exactly its class (no splitting: simple, and no fragmentation bookkeeping).
//
// When cudaMalloc runs out of memory, the allocator waits for the device, gives every cached block back to the
// driver and tries once more; if that fails too the tracker throws OutOfMemory naming the requested bytes, the
// bytes in use and the cap (core/memory.hpp), with this allocator's numbers. The tracker does the counting
// (current, peak, cap, trace) exactly as on the host; its counts are the requested bytes (rounded to 64), the
// allocator's stats() are the blocks (rounded to the size classes) and the driver's.
//
// THE RULE THAT MAKES REUSE SAFE: a freed block is handed out again at once, while kernels issued before the free
// may still be running; that is safe because the new owner's work is issued on the same stream, after them. Each
// rank's work is ordered on its own stream (cuda_local installs one per rank thread, device::ScopedStream), and
// make_tracker gives each tracker, so each rank, its own allocator: a block comes back only to the rank (the
// stream) that freed it. The limit: a buffer that was used on ANOTHER stream than its tracker's (handed to another
// rank's stream, a copy stream, a communicator's stream) must be synchronised with (Event::wait, or
// device::synchronize on that stream) before it is freed. An allocator shared by several trackers (make_tracker's
// second form) needs those trackers' work on one stream, or the same care.
//
// Thread safety: every member may be called from any thread (a mutex; cuda_local runs several rank threads on one
// GPU, and a tensor may be freed by another thread than the one that made it).
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/memory.hpp"
#include "paradyse/device/runtime.hpp"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <cstddef>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <unordered_map>
#include <vector>

namespace paradyse::device {

// What a caching allocator holds and has done.
struct CachingAllocatorStats {
  std::size_t reserved_bytes = 0;  // held from the driver: blocks in use plus cached blocks
  std::size_t cached_bytes = 0;    // in the free lists, ready for reuse
  std::size_t malloc_calls = 0;    // successful cudaMalloc calls
  std::size_t free_calls = 0;      // cudaFree calls (only when the cache is released)
  std::size_t reuses = 0;          // allocations served from the free lists
  std::size_t releases = 0;        // times the cache was given back to the driver (release_cache, out of memory)
};

class CachingAllocator final : public SpaceAllocator {
public:
  static constexpr std::size_t kSmallGranule = 512;
  static constexpr std::size_t kLargeThreshold = std::size_t(1) << 20;  // above 1 MiB: whole 2 MiB blocks
  static constexpr std::size_t kLargeGranule = std::size_t(2) << 20;

  // An allocator for the device current on the calling thread (or `device`).
  CachingAllocator() : device_(current_device()) {}
  explicit CachingAllocator(int device) : device_(device) {
    paradyse::check(device >= 0, "CachingAllocator: device {} is not a device index", device);
  }
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;
  // Gives the cached blocks back to the driver. Blocks still in use are the trackers' (each holds the allocator
  // through its counts until its last allocation is freed, so none is left when this runs).
  ~CachingAllocator() override {
    try {
      release_cache();
    } catch (...) {  // at process exit the driver may be gone already; nothing to give back then
    }
  }

  // The block a request of `bytes` gets: 512-byte multiples up to 1 MiB, 2 MiB multiples above.
  static constexpr std::size_t block_size(std::size_t bytes) noexcept {
    const std::size_t granule = bytes > kLargeThreshold ? kLargeGranule : kSmallGranule;
    return (bytes + granule - 1) / granule * granule;
  }

  int device() const noexcept { return device_; }

  // A block of block_size(bytes) from the free list of its class, else from cudaMalloc (after one release of the
  // cache and a retry when the device is full); nullptr when the device has no more.
  void* allocate(std::size_t bytes) override {
    const std::size_t size = block_size(bytes);
    std::lock_guard lock(mutex_);
    if (auto it = free_.find(size); it != free_.end() && !it->second.empty()) {
      void* p = it->second.back();
      it->second.pop_back();
      stats_.cached_bytes -= size;
      ++stats_.reuses;
      return p;
    }
    DeviceGuard on(device_);
    void* p = nullptr;
    cudaError_t status = cudaMalloc(&p, size);
    if (status == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();  // not sticky, but it must not surface in the next check_launch
      release_cache_locked();
      status = cudaMalloc(&p, size);
      if (status == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError();
        failed_request_ = size;
        return nullptr;
      }
    }
    check(status, fmt::format("cudaMalloc of {} bytes on device {}", size, device_));
    stats_.reserved_bytes += size;
    ++stats_.malloc_calls;
    return p;
  }

  // Back to the free list of its class (no driver call, no wait: see the rule at the top).
  void deallocate(void* p, std::size_t bytes) noexcept override {
    if (!p) return;
    const std::size_t size = block_size(bytes);
    std::lock_guard lock(mutex_);
    try {
      free_[size].push_back(p);
      stats_.cached_bytes += size;
    } catch (...) {  // no memory for the list entry: give the block back to the driver instead
      DeviceGuard on(device_, std::nothrow);
      (void)cudaFree(p);
      (void)cudaGetLastError();
      stats_.reserved_bytes -= size;
      ++stats_.free_calls;
    }
  }

  // Zeroes `bytes` at p on the calling thread's stream (asynchronous, ordered before the owner's next work).
  void zero(void* p, std::size_t bytes) override {
    PARADYSE_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, current_stream()));
  }

  // "device 0: 12582912 bytes reserved from the driver, 0 cached, 3 cudaMalloc calls; cudaMalloc of 2097152 bytes
  // failed after releasing the cache; the device has 1048576 of 150 GB free".
  std::string describe() const override {
    std::lock_guard lock(mutex_);
    std::size_t free_bytes = 0, total_bytes = 0;
    {
      DeviceGuard on(device_, std::nothrow);
      if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) (void)cudaGetLastError();
    }
    return fmt::format("device {}: {} bytes reserved from the driver, {} cached, {} cudaMalloc calls; cudaMalloc of {} "
                       "bytes failed after releasing the cache; the device has {} of {} bytes free",
                       device_, stats_.reserved_bytes, stats_.cached_bytes, stats_.malloc_calls, failed_request_,
                       free_bytes, total_bytes);
  }

  // Waits for the device and gives every cached block back to the driver.
  void release_cache() {
    std::lock_guard lock(mutex_);
    release_cache_locked();
  }

  CachingAllocatorStats stats() const {
    std::lock_guard lock(mutex_);
    return stats_;
  }

private:
  static int current_device() {
    int device = 0;
    PARADYSE_CUDA_CHECK(cudaGetDevice(&device));
    return device;
  }

  // Makes `device` current for the scope and restores the previous one.
  class DeviceGuard {
  public:
    explicit DeviceGuard(int device) {
      PARADYSE_CUDA_CHECK(cudaGetDevice(&previous_));
      if (previous_ != device) PARADYSE_CUDA_CHECK(cudaSetDevice(device));
    }
    DeviceGuard(int device, std::nothrow_t) noexcept {
      if (cudaGetDevice(&previous_) != cudaSuccess) {
        (void)cudaGetLastError();
        previous_ = -1;
        return;
      }
      if (previous_ != device && cudaSetDevice(device) != cudaSuccess) (void)cudaGetLastError();
    }
    ~DeviceGuard() {
      int now = -1;
      if (previous_ >= 0 && cudaGetDevice(&now) == cudaSuccess && now != previous_) (void)cudaSetDevice(previous_);
      (void)cudaGetLastError();
    }
    DeviceGuard(const DeviceGuard&) = delete;
    DeviceGuard& operator=(const DeviceGuard&) = delete;

  private:
    int previous_ = -1;
  };

  void release_cache_locked() {
    if (stats_.cached_bytes == 0) return;
    DeviceGuard on(device_, std::nothrow);
    // Kernels issued before a block's free may still use it (the stream-order rule): let them finish first.
    if (cudaDeviceSynchronize() != cudaSuccess) (void)cudaGetLastError();
    for (auto& [size, blocks] : free_) {
      for (void* p : blocks) {
        (void)cudaFree(p);
        stats_.reserved_bytes -= size;
        ++stats_.free_calls;
      }
      blocks.clear();
    }
    (void)cudaGetLastError();
    stats_.cached_bytes = 0;
    ++stats_.releases;
  }

  int device_;
  mutable std::mutex mutex_;
  std::unordered_map<std::size_t, std::vector<void*>> free_;  // block size -> free blocks of that size
  CachingAllocatorStats stats_;
  std::size_t failed_request_ = 0;
};

// A device-memory tracker over its own caching allocator (one allocator per tracker, so per rank: see the rule at
// the top), for the device current on the calling thread. `cap` bounds the tracker's bytes in use as on the host.
inline MemoryTracker make_tracker(std::size_t cap = MemoryTracker::kNoCap) {
  return MemoryTracker(MemorySpace::device, std::make_shared<CachingAllocator>(), cap);
}
// A device-memory tracker over a given allocator (shared by several trackers: their work must be on one stream).
inline MemoryTracker make_tracker(std::shared_ptr<CachingAllocator> allocator, std::size_t cap = MemoryTracker::kNoCap) {
  paradyse::check(allocator != nullptr, "device::make_tracker: the allocator is null");
  return MemoryTracker(MemorySpace::device, std::move(allocator), cap);
}

// The caching allocator of a device tracker (nullptr for a tracker of another kind).
inline CachingAllocator* caching_allocator(const MemoryTracker& tracker) noexcept {
  return dynamic_cast<CachingAllocator*>(tracker.allocator());
}

}  // namespace paradyse::device
