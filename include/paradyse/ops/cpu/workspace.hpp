// paradyse/ops/cpu/workspace.hpp: uninitialised scratch memory for a kernel, through the memory tracker.
//
// A Tensor zero-fills its storage; kernels that overwrite their scratch before reading it (GEMM packing buffers)
// take it from here instead, still counted by the calling thread's tracker (so peaks and caps stay exact).
#pragma once

#include "paradyse/core/memory.hpp"

#include <cstddef>

namespace paradyse::ops::cpu::detail {

template <class T>
class Workspace {
public:
  explicit Workspace(std::size_t count)
      : tracker_(MemoryTracker::current().handle()), bytes_(count * sizeof(T)),
        data_(static_cast<T*>(tracker_.allocate(bytes_, Contents::unspecified))) {}
  ~Workspace() { tracker_.deallocate(data_, bytes_); }
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;

  T* data() const noexcept { return data_; }

private:
  MemoryTracker::Handle tracker_;  // keeps the tracker's counts alive
  std::size_t bytes_;
  T* data_;
};

}  // namespace paradyse::ops::cpu::detail
