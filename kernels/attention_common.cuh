// kernels/attention_common.cuh: what the CUDA attention kernels share: strided head views, the mask on the
// device (which keys each query sees), the upload of document starts, and the argument checks of the launchers.
//
// The launchers are defined (not inline) in these .cuh files: kernels/all.cuh is compiled in exactly one translation
// unit of a program, and the host code that calls them (g++) sees only the declarations in ops/cuda/attention.hpp,
// so the definitions must be emitted as ordinary external functions there.
#pragma once

#include "paradyse/core/dtype.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/device/runtime.hpp"
#include "paradyse/ops/attention_mask.hpp"
#include "paradyse/ops/cpu/attention.hpp"  // the argument checks, shared with the CPU op
#include "paradyse/ops/cuda/attention.hpp"

#include <cuda_runtime.h>

#include <cstdint>
#include <limits>

namespace paradyse::kernels::attention {

using Index = long long;
using paradyse::check;

// Element (b, i, h, c) of a [b, s, heads, d] view with unit stride in d: data[b * sb + i * ss + h * sh + c].
template <class T>
struct HeadView {
  T* data;
  Index sb, ss, sh;
  __device__ T* row(Index b, Index i, Index h) const { return data + b * sb + i * ss + h * sh; }
};

// Element (b, h, i) of lse: [b, heads, sq].
template <class T>
struct LseView {
  T* data;
  Index sb, sh, si;
  __device__ T& at(Index b, Index h, Index i) const { return data[b * sb + h * sh + i * si]; }
};

template <class T, class U>
HeadView<T> head_view(TensorView<U> x) {
  return {reinterpret_cast<T*>(x.data()), x.strides()[0], x.strides()[1], x.strides()[2]};
}
template <class T, class U>
LseView<T> lse_view(TensorView<U> x) {
  return {reinterpret_cast<T*>(x.data()), x.strides()[0], x.strides()[1], x.strides()[2]};
}

// The mask on the device: the same rule as ops::visible_key_range (attention_mask.hpp), evaluated per query.
struct DeviceMask {
  bool causal;
  Index q_offset, kv_offset;
  const Index* starts;  // device copy of document_starts (nullptr: one document)
  int n_starts;
  Index q_len, kv_len;

  // Local key indices [first, last) that query i of the block sees (first == last: none). Both ends are
  // non-decreasing in i, so the queries that see a key tile form one interval (found by binary search).
  __device__ void key_range(Index i, Index& first, Index& last) const {
    const Index position = q_offset + i;
    Index lo = std::numeric_limits<Index>::min(), hi = std::numeric_limits<Index>::max();
    if (n_starts > 0) {
      int a = 0, b = n_starts;  // upper_bound: first start > position
      while (a < b) {
        const int m = (a + b) / 2;
        if (starts[m] <= position) a = m + 1; else b = m;
      }
      lo = starts[a - 1];  // starts[0] == 0 <= position, so a >= 1
      if (a < n_starts) hi = starts[a];
    }
    if (causal && position + 1 < hi) hi = position + 1;
    first = local(lo);
    last = local(hi);
    if (last < first) last = first;
  }
  __device__ Index local(Index position) const {
    if (position <= kv_offset) return 0;
    const Index l = position - kv_offset;
    return l < kv_len ? l : kv_len;
  }
  // Keys [first, last) seen by any of the queries [i0, i1) (empty when i0 >= i1).
  __device__ void tile_key_range(Index i0, Index i1, Index& first, Index& last) const {
    Index f0, l0, f1, l1;
    key_range(i0, f0, l0);
    key_range(i1 - 1, f1, l1);
    first = f0;
    last = l1;
    if (last < first) last = first;
  }
  // Queries [lo, hi) that see at least one key of [j0, j1): last(i) > j0 (a suffix) and first(i) < j1 (a prefix).
  __device__ void query_range(Index j0, Index j1, Index& lo, Index& hi) const {
    Index a = 0, b = q_len;
    while (a < b) {
      const Index m = (a + b) / 2;
      Index f, l;
      key_range(m, f, l);
      if (l > j0) b = m; else a = m + 1;
    }
    lo = a;
    a = lo;
    b = q_len;
    while (a < b) {
      const Index m = (a + b) / 2;
      Index f, l;
      key_range(m, f, l);
      if (f < j1) a = m + 1; else b = m;
    }
    hi = a;
  }
};

// The document starts of one call on the device, freed in stream order after the kernels that read them.
class UploadedMask {
public:
  UploadedMask(const ops::AttentionMask& mask, Index q_len, Index kv_len) {
    device_mask_ = {mask.causal, mask.q_offset, mask.kv_offset, nullptr, int(mask.document_starts.size()), q_len,
                    kv_len};
    check(mask.document_starts.size() < std::size_t(std::numeric_limits<int>::max()),
          "attention: {} document starts are too many", mask.document_starts.size());
    if (!mask.document_starts.empty()) {
      const std::size_t bytes = mask.document_starts.size() * sizeof(Index);
      PARADYSE_CUDA_CHECK(cudaMallocAsync(&starts_, bytes, device::current_stream()));
      // From pageable memory: returns once the source has been staged, so the host span may go away afterwards.
      PARADYSE_CUDA_CHECK(cudaMemcpyAsync(starts_, mask.document_starts.data(), bytes, cudaMemcpyHostToDevice,
                                          device::current_stream()));
      device_mask_.starts = static_cast<const Index*>(starts_);
    }
  }
  ~UploadedMask() {
    if (starts_) (void)cudaFreeAsync(starts_, device::current_stream());
  }
  UploadedMask(const UploadedMask&) = delete;
  UploadedMask& operator=(const UploadedMask&) = delete;
  const DeviceMask& device() const { return device_mask_; }

private:
  DeviceMask device_mask_{};
  void* starts_ = nullptr;
};

// A float view with the shape and strides of `x` (the argument checks read only shapes and strides).
template <class T>
TensorView<const float> shape_only(TensorView<T> x) {
  return TensorView<const float>(reinterpret_cast<const float*>(x.data()), x.shape(), x.strides());
}

// Grid dimensions must fit: blocks in y and z are limited to 65535.
inline void check_grid(const char* op, Index y, Index z) {
  check(y <= 65535 && z <= 65535, "{}: grid of {} x {} blocks in y and z exceeds 65535 (batch or heads too large)",
        op, y, z);
}

__device__ inline float warp_max(float x) {
  for (int o = 16; o > 0; o /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ inline float warp_sum(float x) {
  for (int o = 16; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Sets the dynamic shared memory limit of `kernel` to `bytes`, or throws naming what needs it.
template <class Kernel>
void allow_shared_memory(Kernel kernel, std::size_t bytes, const char* what) {
  int device_id = 0, optin = 0;
  PARADYSE_CUDA_CHECK(cudaGetDevice(&device_id));
  PARADYSE_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device_id));
  check(bytes <= std::size_t(optin), "{}: needs {} bytes of shared memory per block, the device allows {}", what,
        bytes, optin);
  PARADYSE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
}

}  // namespace paradyse::kernels::attention
