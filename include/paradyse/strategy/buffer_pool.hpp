// paradyse/strategy/buffer_pool.hpp: one pool of transient buffers per rank, keyed by size, shared by every
// strategy.
//
// ParaDySe's reference code hands out named, grow-only buffers per strategy ("zero3_i", "ring_attention_i", ...), so
// a run that mixes strategies keeps the buffers of every strategy it ever used alive. Here a buffer is keyed only by
// its size class, so any strategy reuses any other's free buffer of that size, and the pool never holds more bytes
// than the largest working set it has served: a miss first frees cached buffers until
//   in use + cached + requested <= high-water mark of (in use + requested),
// so after switching from strategy A to B the pool holds max(W_A, W_B) bytes, not W_A + W_B.
//
// Size classes: m * 2^k bytes with m in [8, 16) (at most 12.5% slack), at least 256 bytes. Buffers come from the
// MemoryTracker current where the pool was created (the rank's), so peaks count them. A pool belongs to one rank
// and is not thread-safe. Contents of an acquired buffer are unspecified (a strategy that needs zeros fills through
// its Backend, so the pool works in every memory space). When the tracker records a Trace, every loan and return is
// recorded (the pool's own allocations and evictions are not: a model replays them through the pool's rule).
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/memory.hpp"
#include "paradyse/core/tensor.hpp"

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <vector>
#include <utility>

namespace paradyse {

struct BufferPoolStats {
  std::uint64_t hits = 0;        // requests served from a cached buffer
  std::uint64_t misses = 0;      // requests that allocated
  std::uint64_t evictions = 0;   // cached buffers freed to make room
  std::size_t in_use_bytes = 0;  // bytes handed out now
  std::size_t cached_bytes = 0;  // bytes kept for reuse
  std::size_t high_water_bytes = 0;  // the largest in_use_bytes seen (the bound on in_use + cached)
};

class BufferPool;

// A buffer on loan from the pool, viewed as T with a shape; returns to the pool when destroyed.
template <TensorElement T>
class PooledBuffer {
public:
  PooledBuffer() = default;
  PooledBuffer(PooledBuffer&& other) noexcept { swap(other); }
  PooledBuffer& operator=(PooledBuffer&& other) noexcept {
    PooledBuffer moved(std::move(other));
    swap(moved);
    return *this;
  }
  PooledBuffer(const PooledBuffer&) = delete;
  PooledBuffer& operator=(const PooledBuffer&) = delete;
  ~PooledBuffer();

  // No buffer on loan (default-constructed, moved from, or a zero-size request).
  bool empty() const noexcept { return storage_.data() == nullptr; }
  T* data() const noexcept { return reinterpret_cast<T*>(const_cast<std::byte*>(storage_.data())); }
  const Shape& shape() const noexcept { return shape_; }
  std::int64_t numel() const noexcept { return shape_.numel(); }
  TensorView<T> view() const noexcept { return {data(), shape_}; }
  operator TensorView<T>() const noexcept { return view(); }
  operator TensorView<const T>() const noexcept { return view(); }
  std::span<T> span() const noexcept { return {data(), std::size_t(numel())}; }
  // Reinterpret the same bytes under another shape of no more elements.
  void reshape(Shape shape) {
    check(storage_bytes(shape, sizeof(T)) <= storage_.bytes(), "PooledBuffer: shape {} needs {} bytes, the buffer has {}",
          shape, std::size_t(shape.numel()) * sizeof(T), storage_.bytes());
    shape_ = shape;
  }

  void swap(PooledBuffer& other) noexcept {
    std::swap(pool_, other.pool_);
    storage_.swap(other.storage_);
    std::swap(shape_, other.shape_);
    std::swap(requested_, other.requested_);
  }

private:
  friend class BufferPool;
  PooledBuffer(BufferPool* pool, Tensor<std::byte> storage, Shape shape, std::size_t requested = 0)
      : pool_(pool), storage_(std::move(storage)), shape_(shape), requested_(requested) {}

  BufferPool* pool_ = nullptr;
  Tensor<std::byte> storage_;
  Shape shape_;
  std::size_t requested_ = 0;  // bytes asked for (the trace records loans as requested)
};

class BufferPool {
public:
  BufferPool() : tracker_(MemoryTracker::current().handle()) {}
  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;

  // The size class that a request of `bytes` is served from.
  static std::size_t size_class(std::size_t bytes) noexcept {
    if (bytes <= 256) return 256;
    const int shift = std::bit_width(bytes - 1) - 4;  // keep 4 significant bits: m in [8, 16)
    const std::size_t unit = std::size_t(1) << shift;
    return (bytes + unit - 1) / unit * unit;
  }

  // A buffer of `shape` elements of T.
  template <TensorElement T>
  PooledBuffer<T> acquire(Shape shape) {
    const std::size_t bytes = storage_bytes(shape, sizeof(T));  // OutOfMemory beyond kMaxTrackedBytes
    if (bytes == 0) return PooledBuffer<T>(this, Tensor<std::byte>(), shape);
    const std::size_t size = size_class(bytes);
    if (Trace* trace = tracker_.trace()) trace->record({.kind = TraceKind::pool_acquire, .bytes = double(bytes)});
    const Trace::Pause quiet(tracker_.trace());
    Tensor<std::byte> storage;
    if (auto it = find_cached(size); it != cached_.end()) {
      storage = std::move(it->second);
      cached_.erase(it);
      stats_.cached_bytes -= size;
      ++stats_.hits;
    } else {
      ++stats_.misses;
      stats_.high_water_bytes = std::max(stats_.high_water_bytes, stats_.in_use_bytes + size);
      // Free cached buffers, largest first, until the pool stays within its high-water mark.
      while (!cached_.empty() && stats_.in_use_bytes + stats_.cached_bytes + size > stats_.high_water_bytes) {
        stats_.cached_bytes -= cached_.back().first;  // the largest, the latest of its size
        cached_.pop_back();
        ++stats_.evictions;
      }
      storage = Tensor<std::byte>::uninitialized(Shape{std::int64_t(size)}, tracker_);
    }
    stats_.in_use_bytes += size;
    return PooledBuffer<T>(this, std::move(storage), shape, bytes);
  }

  // Frees every cached buffer (those on loan are unaffected).
  void trim() {
    const Trace::Pause quiet(tracker_.trace());
    cached_.clear();
    stats_.cached_bytes = 0;
  }
  // Starts a new high-water window at the current use (for example after trim, between benchmark runs).
  void reset_high_water() noexcept { stats_.high_water_bytes = stats_.in_use_bytes; }

  const BufferPoolStats& stats() const noexcept { return stats_; }

private:
  template <TensorElement T>
  friend class PooledBuffer;

  void give_back(Tensor<std::byte>&& storage, std::size_t requested) {
    if (Trace* trace = tracker_.trace()) trace->record({.kind = TraceKind::pool_give_back, .bytes = double(requested)});
    const std::size_t size = storage.bytes();
    stats_.in_use_bytes -= size;
    stats_.cached_bytes += size;
    // After every cached buffer of the same size (multimap order: a hit takes the earliest of its size).
    const auto after = std::upper_bound(cached_.begin(), cached_.end(), size,
                                        [](std::size_t bytes, const Cached& c) { return bytes < c.first; });
    cached_.emplace(after, size, std::move(storage));
  }
  using Cached = std::pair<std::size_t, Tensor<std::byte>>;
  // The earliest cached buffer of class `size`, or end().
  std::vector<Cached>::iterator find_cached(std::size_t size) {
    const auto it = std::lower_bound(cached_.begin(), cached_.end(), size,
                                     [](const Cached& c, std::size_t bytes) { return c.first < bytes; });
    return it != cached_.end() && it->first == size ? it : cached_.end();
  }

  MemoryTracker::Handle tracker_;  // the rank's tracker, kept alive by the pool (it may outlive the tracker object)
  std::vector<Cached> cached_;  // by size class, ascending; a few entries (a flat list beats a tree's allocations)
  BufferPoolStats stats_;
};

template <TensorElement T>
PooledBuffer<T>::~PooledBuffer() {
  if (pool_ && storage_.data()) pool_->give_back(std::move(storage_), requested_);
}

}  // namespace paradyse
