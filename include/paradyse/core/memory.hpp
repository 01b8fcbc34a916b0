// paradyse/core/memory.hpp: the memory tracker that every allocation of the library goes through.
//
// Each rank (a thread of the threads backend, or a process under MPI) has its own tracker; `MemoryTracker::current()`
// is the tracker of the calling thread (a process-wide default unless a `ScopedTracker` installed another). It
// counts current and peak bytes exactly, and an optional cap makes an allocation beyond it throw `OutOfMemory`, so a
// CPU run can emulate the memory of a GPU and the memory model can be checked against reality.
//
// Every tracker serves one memory space: host (aligned_alloc), device (the GPU path), or meta. Meta memory has no
// storage: an allocation returns an address inside a reserved, inaccessible range (any touch faults), so that code
// can run on shapes alone while the tracker still counts every byte (the dry run, core/trace.hpp). A tracker may
// also record every allocation into a Trace.
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/trace.hpp"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <cstdint>
#include <limits>
#include <string_view>

namespace paradyse {

inline constexpr std::size_t kAlignment = 64;  // one cache line; also enough for AVX-512 loads

enum class MemorySpace : std::uint8_t { host, device, meta };

constexpr std::string_view name_of(MemorySpace space) {
  return space == MemorySpace::host ? "host" : space == MemorySpace::device ? "device" : "meta";
}

namespace memory_detail {
// Addresses for meta allocations: a reserved range that is never readable or writable, handed out round-robin
// (meta memory is never touched, so reuse is harmless; distinct live buffers get distinct addresses while the
// live bytes stay under the range).
inline void* meta_address(std::size_t rounded) {
  constexpr std::size_t kRange = std::size_t(1) << 40;  // 1 TiB of address space, no memory
  static char* const base = [] {
    void* p = ::mmap(nullptr, kRange, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    return p == MAP_FAILED ? reinterpret_cast<char*>(std::uintptr_t(1) << 44) : static_cast<char*>(p);
  }();
  static std::atomic<std::size_t> cursor{0};
  const std::size_t offset = cursor.fetch_add(rounded, std::memory_order_relaxed) % kRange;
  return base + offset / kAlignment * kAlignment;
}
}  // namespace memory_detail

class MemoryTracker {
public:
  static constexpr std::size_t kNoCap = std::numeric_limits<std::size_t>::max();

  MemoryTracker() = default;
  explicit MemoryTracker(std::size_t cap) : cap_(cap) {}
  explicit MemoryTracker(MemorySpace space, std::size_t cap = kNoCap) : cap_(cap), space_(space) {}
  MemoryTracker(const MemoryTracker&) = delete;
  MemoryTracker& operator=(const MemoryTracker&) = delete;

  // Bytes of `bytes`, 64-byte aligned; throws OutOfMemory beyond the cap. Zero bytes gives nullptr.
  void* allocate(std::size_t bytes) {
    if (bytes == 0) return nullptr;
    const std::size_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
    const std::size_t before = in_use_.fetch_add(rounded, std::memory_order_relaxed);
    if (before + rounded > cap_) {
      in_use_.fetch_sub(rounded, std::memory_order_relaxed);
      throw OutOfMemory(rounded, before, cap_);
    }
    if (trace_) trace_->record({.kind = TraceKind::allocate, .bytes = double(bytes)});
    if (space_ == MemorySpace::meta) {
      raise_peak(before + rounded);
      return memory_detail::meta_address(rounded);
    }
    void* p = std::aligned_alloc(kAlignment, rounded);
    if (!p) {
      in_use_.fetch_sub(rounded, std::memory_order_relaxed);
      throw OutOfMemory(rounded, before, cap_);
    }
    raise_peak(before + rounded);
    return p;
  }

  void deallocate(void* p, std::size_t bytes) noexcept {
    if (!p) return;
    const std::size_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
    in_use_.fetch_sub(rounded, std::memory_order_relaxed);
    if (trace_) trace_->record({.kind = TraceKind::deallocate, .bytes = double(bytes)});
    if (space_ != MemorySpace::meta) std::free(p);
  }

  std::size_t in_use() const noexcept { return in_use_.load(std::memory_order_relaxed); }
  std::size_t peak() const noexcept { return peak_.load(std::memory_order_relaxed); }
  std::size_t cap() const noexcept { return cap_; }
  MemorySpace space() const noexcept { return space_; }
  // Every allocation and free from now on is recorded into `trace` (nullptr: none).
  void set_trace(Trace* trace) noexcept { trace_ = trace; }
  Trace* trace() const noexcept { return trace_; }
  void set_cap(std::size_t cap) noexcept { cap_ = cap; }
  // Starts a new measurement window: the peak becomes the current usage.
  void reset_peak() noexcept { peak_.store(in_use(), std::memory_order_relaxed); }

  // The tracker of the calling thread.
  static MemoryTracker& current() noexcept { return slot() ? *slot() : process_default(); }
  static MemoryTracker& process_default() noexcept {
    static MemoryTracker tracker;
    return tracker;
  }

private:
  friend class ScopedTracker;
  static MemoryTracker*& slot() noexcept {
    thread_local MemoryTracker* tracker = nullptr;
    return tracker;
  }
  void raise_peak(std::size_t value) noexcept {
    std::size_t seen = peak_.load(std::memory_order_relaxed);
    while (value > seen && !peak_.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
    }
  }

  std::atomic<std::size_t> in_use_{0};
  std::atomic<std::size_t> peak_{0};
  std::size_t cap_ = kNoCap;
  MemorySpace space_ = MemorySpace::host;
  Trace* trace_ = nullptr;
};

// Makes `tracker` the calling thread's tracker for the lifetime of this object.
class ScopedTracker {
public:
  explicit ScopedTracker(MemoryTracker& tracker) : previous_(MemoryTracker::slot()) { MemoryTracker::slot() = &tracker; }
  ~ScopedTracker() { MemoryTracker::slot() = previous_; }
  ScopedTracker(const ScopedTracker&) = delete;
  ScopedTracker& operator=(const ScopedTracker&) = delete;

private:
  MemoryTracker* previous_;
};

}  // namespace paradyse
