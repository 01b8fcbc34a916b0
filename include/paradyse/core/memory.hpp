// paradyse/core/memory.hpp: the memory tracker that every allocation of the library goes through.
//
// Each rank (a thread of the threads backend, or a process under MPI) has its own tracker; `MemoryTracker::current()`
// is the tracker of the calling thread (a process-wide default unless a `ScopedTracker` installed another). It
// counts current and peak bytes exactly, and an optional cap makes an allocation beyond it throw `OutOfMemory`, so a
// CPU run can emulate the memory of a GPU and the memory model can be checked against reality.
//
// Every tracker serves one memory space: host (aligned_alloc), device (the GPU path), or meta. A tracker may be given
// a SpaceAllocator that provides its storage (the device path's caching allocator, device/caching_allocator.hpp);
// without one, host and device trackers use aligned_alloc (a "device" tracker without an allocator is host memory
// counted as device memory, as the dry runs and tests of the CPU path use it). Meta memory has no
// storage: an allocation returns an address inside a reserved, inaccessible range (any touch faults), so that code
// can run on shapes alone while the tracker still counts every byte (the dry run, core/trace.hpp). A tracker may
// also record every allocation into a Trace.
//
// A tracker's counts outlive the tracker object for as long as an allocation made through it is alive: every
// allocation holds a MemoryTracker::Handle, so a tensor may be destroyed after its tracker (a tensor made inside
// run_ranks and moved out of it) and still give its bytes back to the right counts. Destroying a tracker is always
// safe; nothing has to be kept alive by hand.
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/trace.hpp"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <string_view>

namespace paradyse {

inline constexpr std::size_t kAlignment = 64;  // one cache line; also enough for AVX-512 loads

enum class MemorySpace : std::uint8_t { host, device, meta };

// What a new allocation holds: zeros (a Tensor), or whatever the memory held before (Tensor::uninitialized, the
// buffer pool's storage, kernel workspaces and transfer buffers: the caller writes every byte before it reads one,
// and skips a fill at memory bandwidth; on the host a reused heap chunk then costs nothing at all). A build that
// defines PARADYSE_POISON_UNSPECIFIED (the tests do) fills unspecified host memory with 0xFF bytes, a NaN in every
// float type, so that code reading such memory before writing it shows in its results instead of passing on zeros.
enum class Contents : std::uint8_t { zeros, unspecified };

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

// Where a tracker's bytes come from when they are not host memory: the device path plugs its allocator in here, so
// that core/ knows nothing of CUDA. The tracker does the counting (current, peak, cap, trace) before it calls
// allocate(); the allocator only provides storage.
class SpaceAllocator {
public:
  virtual ~SpaceAllocator() = default;
  // Storage for `bytes` (> 0, a multiple of kAlignment), aligned to at least kAlignment; nullptr when the space is
  // exhausted (the tracker then throws OutOfMemory); other failures throw.
  virtual void* allocate(std::size_t bytes) = 0;
  // Gives back what allocate(bytes) returned, with the same `bytes`.
  virtual void deallocate(void* p, std::size_t bytes) noexcept = 0;
  // Sets `bytes` bytes at p to zero (asynchronously where the space allows: the device's stream order).
  virtual void zero(void* p, std::size_t bytes) = 0;
  // Says where the space stands, for an out-of-memory message ("device 0: 3 GiB reserved, ..."); may be empty.
  virtual std::string describe() const { return {}; }
};

namespace memory_detail {
// What a tracker counts. Shared by the tracker and by every allocation made through it (MemoryTracker::Handle), so
// that memory freed after the tracker object is gone (a tensor moved out of the run_ranks whose tracker held it)
// still goes back to these counts instead of to freed memory.
struct Accounts {
  Accounts(MemorySpace s, std::size_t c) : cap(c), space(s) {}
  Accounts(MemorySpace s, std::shared_ptr<SpaceAllocator> a, std::size_t c) : cap(c), space(s), allocator(std::move(a)) {}
  std::atomic<std::size_t> in_use{0};
  std::atomic<std::size_t> peak{0};
  std::size_t cap;
  MemorySpace space;
  Trace* trace = nullptr;
  std::shared_ptr<SpaceAllocator> allocator;  // null: aligned_alloc (host), or no storage (meta)

  void raise_peak(std::size_t value) noexcept {
    std::size_t seen = peak.load(std::memory_order_relaxed);
    while (value > seen && !peak.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
    }
  }

  void* allocate(std::size_t bytes, Contents contents) {
    if (bytes == 0) return nullptr;
    const std::size_t limit = std::min(cap, kMaxTrackedBytes);
    if (bytes > limit) throw OutOfMemory(bytes, in_use.load(std::memory_order_relaxed), limit);
    const std::size_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
    const std::size_t before = in_use.fetch_add(rounded, std::memory_order_relaxed);
    if (before + rounded > limit) {
      in_use.fetch_sub(rounded, std::memory_order_relaxed);
      throw OutOfMemory(rounded, before, limit);
    }
    if (trace) {
      trace->record(
          {.kind = TraceKind::allocate, .unzeroed = contents == Contents::unspecified, .bytes = double(bytes)});
    }
    if (space == MemorySpace::meta) {
      raise_peak(before + rounded);
      return meta_address(rounded);
    }
    void* p = nullptr;
    if (allocator) {
      try {
        p = allocator->allocate(rounded);
      } catch (...) {
        in_use.fetch_sub(rounded, std::memory_order_relaxed);
        throw;
      }
      if (!p) {
        in_use.fetch_sub(rounded, std::memory_order_relaxed);
        std::string where = allocator->describe();
        throw OutOfMemory(fmt::format("out of {} memory: requested {} bytes with {} in use, {}; the {} has no more{}{}",
                                      name_of(space), rounded, before,
                                      limit >= kMaxTrackedBytes ? std::string("no cap")
                                                                : fmt::format("cap is {} bytes", limit),
                                      name_of(space), where.empty() ? "" : " (", where.empty() ? "" : where + ")"),
                          rounded, before, limit);
      }
    } else {
      errno = 0;
      p = std::aligned_alloc(kAlignment, rounded);
    }
    if (!p) {  // the system refused, below any cap: say so with the real size and reason (not the 2^60 limit)
      const int error = errno;
      in_use.fetch_sub(rounded, std::memory_order_relaxed);
      throw OutOfMemory(fmt::format("out of host memory: requested {} bytes ({:.4g} GiB) with {} in use, {}; the "
                                    "system's allocator refused it: {}",
                                    rounded, double(rounded) / 1073741824.0, before,
                                    limit >= kMaxTrackedBytes ? std::string("no cap")
                                                              : fmt::format("cap is {} bytes", limit),
                                    error != 0 ? std::strerror(error) : "no reason given"),
                        rounded, before, limit);
    }
    raise_peak(before + rounded);
    if (contents == Contents::zeros) zero(p, bytes);
#ifdef PARADYSE_POISON_UNSPECIFIED
    else if (!allocator) std::memset(p, 0xFF, bytes);  // host memory: a NaN in every float type
#endif
    return p;
  }

  // Zeroes `bytes` bytes at p: memset on the host, the allocator's zero() (the device), nothing on meta.
  void zero(void* p, std::size_t bytes) {
    if (!p || bytes == 0 || space == MemorySpace::meta) return;
    if (allocator)
      allocator->zero(p, bytes);
    else
      std::memset(p, 0, bytes);
  }

  void deallocate(void* p, std::size_t bytes) noexcept {
    if (!p) return;
    const std::size_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
    in_use.fetch_sub(rounded, std::memory_order_relaxed);
    if (trace) trace->record({.kind = TraceKind::deallocate, .bytes = double(bytes)});
    if (space == MemorySpace::meta) return;
    if (allocator)
      allocator->deallocate(p, rounded);
    else
      std::free(p);
  }
};
}  // namespace memory_detail

class MemoryTracker {
public:
  static constexpr std::size_t kNoCap = std::numeric_limits<std::size_t>::max();

  // A share in a tracker's counts: what every allocation (Tensor, pooled buffer, workspace) holds, so that it can
  // always give its memory back, whichever of it and the tracker object goes first. Empty when default-constructed.
  class Handle {
  public:
    Handle() = default;
    void* allocate(std::size_t bytes, Contents contents) const { return accounts_->allocate(bytes, contents); }
    void deallocate(void* p, std::size_t bytes) const noexcept { accounts_->deallocate(p, bytes); }
    MemorySpace space() const noexcept { return accounts_ ? accounts_->space : MemorySpace::host; }
    Trace* trace() const noexcept { return accounts_ ? accounts_->trace : nullptr; }
    std::size_t in_use() const noexcept { return accounts_ ? accounts_->in_use.load(std::memory_order_relaxed) : 0; }
    explicit operator bool() const noexcept { return accounts_ != nullptr; }
    // Handles of the same tracker compare equal.
    friend bool operator==(const Handle&, const Handle&) = default;

  private:
    friend class MemoryTracker;
    explicit Handle(std::shared_ptr<memory_detail::Accounts> accounts) : accounts_(std::move(accounts)) {}
    std::shared_ptr<memory_detail::Accounts> accounts_;
  };

  MemoryTracker() : MemoryTracker(MemorySpace::host, kNoCap) {}
  explicit MemoryTracker(std::size_t cap) : MemoryTracker(MemorySpace::host, cap) {}
  explicit MemoryTracker(MemorySpace space, std::size_t cap = kNoCap)
      : accounts_(std::make_shared<memory_detail::Accounts>(space, cap)) {}
  // A tracker whose storage comes from `allocator` (device::make_tracker builds the device's).
  MemoryTracker(MemorySpace space, std::shared_ptr<SpaceAllocator> allocator, std::size_t cap = kNoCap)
      : accounts_(std::make_shared<memory_detail::Accounts>(space, std::move(allocator), cap)) {}
  MemoryTracker(const MemoryTracker&) = delete;
  MemoryTracker& operator=(const MemoryTracker&) = delete;
  // Allocations still alive keep the counts (and give their memory back later); the trace stops with the tracker.
  ~MemoryTracker() { accounts_->trace = nullptr; }

  // Bytes of `bytes`, 64-byte aligned, holding `contents` (zeros: stream-ordered on the device); throws OutOfMemory
  // beyond the cap (or kMaxTrackedBytes). Zero bytes gives nullptr.
  void* allocate(std::size_t bytes, Contents contents) { return accounts_->allocate(bytes, contents); }
  void deallocate(void* p, std::size_t bytes) noexcept { accounts_->deallocate(p, bytes); }
  // The allocator that provides this tracker's storage; null for plain host (aligned_alloc) and meta trackers.
  SpaceAllocator* allocator() const noexcept { return accounts_->allocator.get(); }

  // A share in this tracker's counts for an allocation to hold (see Handle).
  Handle handle() const noexcept { return Handle(accounts_); }

  std::size_t in_use() const noexcept { return accounts_->in_use.load(std::memory_order_relaxed); }
  std::size_t peak() const noexcept { return accounts_->peak.load(std::memory_order_relaxed); }
  std::size_t cap() const noexcept { return accounts_->cap; }
  MemorySpace space() const noexcept { return accounts_->space; }
  // Every allocation and free from now on is recorded into `trace` (nullptr: none).
  void set_trace(Trace* trace) noexcept { accounts_->trace = trace; }
  Trace* trace() const noexcept { return accounts_->trace; }
  void set_cap(std::size_t cap) noexcept { accounts_->cap = cap; }
  // Starts a new measurement window: the peak becomes the current usage.
  void reset_peak() noexcept { accounts_->peak.store(in_use(), std::memory_order_relaxed); }
  // The peak becomes at least `bytes` (restores a window after a nested measurement).
  void raise_peak_to(std::size_t bytes) noexcept { accounts_->raise_peak(bytes); }

  // The tracker of the calling thread.
  static MemoryTracker& current() noexcept { return slot() ? *slot() : process_default(); }
  // Never destroyed: memory freed during static destruction still has its tracker.
  static MemoryTracker& process_default() noexcept {
    static MemoryTracker* const tracker = new MemoryTracker;
    return *tracker;
  }

private:
  friend class ScopedTracker;
  static MemoryTracker*& slot() noexcept {
    thread_local MemoryTracker* tracker = nullptr;
    return tracker;
  }

  std::shared_ptr<memory_detail::Accounts> accounts_;
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
