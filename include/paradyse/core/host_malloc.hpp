// paradyse/core/host_malloc.hpp: the C library's malloc told to keep freed host memory for reuse, as a training or
// serving process wants (retain_freed_host_memory); programs call it first thing in main.
//
// Host tensors (core/memory.hpp) come from aligned_alloc, and a training step allocates and frees its activations,
// gradients and workspaces again every step. By default glibc hands each allocation from its mmap threshold up (128
// KiB, then rising with what is freed) new pages with mmap and gives them back with munmap when freed, and trims its
// heaps when their free top grows: every step pays a page fault per 4 KiB of what it allocates (and the munmaps'
// TLB shootdowns across the other ranks' threads). Measured here (train_gpt, 2 thread ranks, h 128, 2,048 tokens,
// scripts/validate_trainer.sh): a MegatronTS step took 0.34 s of thread CPU time with the threshold fixed at 128 KiB,
// half of it in allocation, page faults and the kernel (perf), against 0.14 s with freed memory kept (this policy);
// the validation's system time fell from 42% of its CPU time to 12%. How long a fault takes moves with the host (a
// virtual machine's second-level faults), which made that half the largest and least predictable term of a step.
//
// retain_freed_host_memory() sets M_MMAP_THRESHOLD to kHostMmapThreshold (allocations below it come from the heap and
// are reused once freed; larger ones still get their own pages, faulted in fresh) and M_TRIM_THRESHOLD to the largest
// value (a heap's free top is given back only beyond 2 GiB), as PyTorch's caching allocators keep what they have
// allocated: the process's resident memory stays near its high-water mark. The cost model sees the same allocator:
// a calibration run in the same process (cost/calibrate.hpp) times fresh allocations on either side of the threshold
// (its profile's fresh_memory). Elsewhere than glibc it does nothing and returns false.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <limits>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace paradyse {

// Allocations from this size up get pages of their own (glibc's largest mmap threshold on 64-bit systems).
inline constexpr std::int64_t kHostMmapThreshold = std::int64_t(32) << 20;

namespace host_malloc_detail {
inline std::atomic<bool> retained{false};
}

// Makes the C library keep freed host memory for reuse (above). Returns whether it could (glibc: true).
inline bool retain_freed_host_memory() {
#if defined(__GLIBC__)
  const bool set = mallopt(M_MMAP_THRESHOLD, int(kHostMmapThreshold)) == 1 &&
                   mallopt(M_TRIM_THRESHOLD, std::numeric_limits<int>::max()) == 1;
  host_malloc_detail::retained = set;
  return set;
#else
  return false;
#endif
}

// The size from which host allocations get new pages, where this process knows it (retain_freed_host_memory()
// succeeded: kHostMmapThreshold); 0 where it does not (glibc's default threshold moves with what is freed).
inline std::int64_t host_new_pages_from() noexcept { return host_malloc_detail::retained ? kHostMmapThreshold : 0; }

}  // namespace paradyse
