// paradyse/device/transfer.hpp: copies between host and device memory, for views of any (positive) strides.
//
//   to_host(device view)               -> a new host tensor (from the calling thread's tracker when it is a host
//                                         tracker, else the process default one)
//   to_device(host view, tracker)      -> a new tensor of the device tracker
//   copy_to_device(host view, device view), copy_to_host(device view, host view): into existing storage
//
// All four are synchronous: they run on the calling thread's stream (device::current_stream(), so they are ordered
// after the work already issued there) and return when the copy is complete, so a host source may be changed and a
// host destination read at once. A contiguous pair of views is one cudaMemcpyAsync; otherwise rows of the last two
// dimensions go as 2-D copies (cudaMemcpy2DAsync), one per outer index (slow for views with many small pieces; for
// the device side prefer ops::cuda::copy into a contiguous tensor first). Each call checks that the device side is
// device memory and the host side is not, naming the view.
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/memory.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/device/runtime.hpp"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <cstdint>
#include <string_view>
#include <type_traits>

namespace paradyse::device {

namespace transfer_detail {

// Whether `p` is device memory (device or managed allocation) as the driver sees it.
inline bool is_device_pointer(const void* p) {
  cudaPointerAttributes attributes{};
  const cudaError_t status = cudaPointerGetAttributes(&attributes, p);
  if (status != cudaSuccess) {
    (void)cudaGetLastError();
    check(status, "cudaPointerGetAttributes");
  }
  return attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged;
}

inline void check_side(const void* p, bool want_device, std::string_view what, std::string_view role) {
  if (!p) return;
  const bool device = is_device_pointer(p);
  paradyse::check(device == want_device, "{}: the {} view ({}) is {} memory, expected {} memory", what, role, p,
                  device ? "device" : "host", want_device ? "device" : "host");
}

// to = from, on `stream`, views of equal shape, one side host and the other device (`kind`).
template <class T>
void copy_views(TensorView<const T> from, TensorView<T> to, cudaMemcpyKind kind, std::string_view what) {
  paradyse::check(from.shape() == to.shape(), "{}: source shape {} differs from destination shape {}", what,
                  from.shape(), to.shape());
  if (from.numel() == 0) return;
  const cudaStream_t stream = current_stream();
  constexpr std::size_t size = sizeof(T);
  if (from.is_contiguous() && to.is_contiguous()) {
    PARADYSE_CUDA_CHECK(cudaMemcpyAsync(to.data(), from.data(), std::size_t(from.numel()) * size, kind, stream));
    return;
  }
  const int rank = from.rank();
  for (int d = 0; d < rank; ++d)
    paradyse::check(from.shape()[d] <= 1 || (from.strides()[d] > 0 && to.strides()[d] > 0),
                    "{}: dimension {} of shape {} has strides {} (source) and {} (destination); only positive "
                    "strides can be copied",
                    what, d, from.shape(), from.strides()[d], to.strides()[d]);
  const std::int64_t inner = from.shape()[rank - 1];
  const bool unit_rows = rank >= 2 && (inner <= 1 || (from.strides()[rank - 1] == 1 && to.strides()[rank - 1] == 1));
  // A pitch for `extent` items of `stride` elements each; any pitch >= width serves a single item.
  const auto pitch = [](std::int64_t extent, std::int64_t stride, std::size_t width) {
    return extent <= 1 ? width : std::size_t(stride) * size;
  };
  // unit_rows: one 2-D copy per index of dims [0, rank - 2): rows of `inner` elements, extent[rank - 2] of them.
  // otherwise: one 2-D copy per index of dims [0, rank - 1): `inner` items of one element each.
  const int outer_rank = unit_rows ? rank - 2 : rank - 1;
  std::int64_t outer = 1;
  for (int d = 0; d < outer_rank; ++d) outer *= from.shape()[d];
  std::int64_t index[kMaxRank] = {};
  for (std::int64_t o = 0; o < outer; ++o) {
    std::int64_t src = 0, dst = 0;
    for (int d = 0; d < outer_rank; ++d) src += index[d] * from.strides()[d], dst += index[d] * to.strides()[d];
    if (unit_rows) {
      const std::int64_t rows = from.shape()[rank - 2];
      const std::size_t width = std::size_t(inner) * size;
      PARADYSE_CUDA_CHECK(cudaMemcpy2DAsync(to.data() + dst, pitch(rows, to.strides()[rank - 2], width),
                                            from.data() + src, pitch(rows, from.strides()[rank - 2], width), width,
                                            std::size_t(rows), kind, stream));
    } else {
      PARADYSE_CUDA_CHECK(cudaMemcpy2DAsync(to.data() + dst, pitch(inner, to.strides()[rank - 1], size),
                                            from.data() + src, pitch(inner, from.strides()[rank - 1], size), size,
                                            std::size_t(inner), kind, stream));
    }
    for (int d = outer_rank - 1; d >= 0; --d) {
      if (++index[d] < from.shape()[d]) break;
      index[d] = 0;
    }
  }
}

}  // namespace transfer_detail

// host = device (equal shapes, any positive strides); returns when `host` holds the data.
template <TensorElement T>
void copy_to_host(TensorView<T> device_view, TensorView<std::remove_const_t<T>> host_view) {
  transfer_detail::check_side(device_view.data(), true, "copy_to_host", "source");
  transfer_detail::check_side(host_view.data(), false, "copy_to_host", "destination");
  transfer_detail::copy_views(TensorView<const std::remove_const_t<T>>(device_view), host_view,
                              cudaMemcpyDeviceToHost, "copy_to_host");
  synchronize();
}

// device = host (equal shapes, any positive strides); returns when the copy is done (the host view may change).
template <TensorElement T>
void copy_to_device(TensorView<T> host_view, TensorView<std::remove_const_t<T>> device_view) {
  transfer_detail::check_side(host_view.data(), false, "copy_to_device", "source");
  transfer_detail::check_side(device_view.data(), true, "copy_to_device", "destination");
  transfer_detail::copy_views(TensorView<const std::remove_const_t<T>>(host_view), device_view,
                              cudaMemcpyHostToDevice, "copy_to_device");
  synchronize();
}

// A host copy of a device view (contiguous result of the view's shape).
template <TensorElement T>
Tensor<std::remove_const_t<T>> to_host(TensorView<T> device_view) {
  MemoryTracker& current = MemoryTracker::current();
  MemoryTracker& host = current.space() == MemorySpace::host ? current : MemoryTracker::process_default();
  Tensor<std::remove_const_t<T>> result(device_view.shape(), host.handle());
  copy_to_host(device_view, result.view());
  return result;
}
template <TensorElement T>
Tensor<T> to_host(const Tensor<T>& device_tensor) {
  return to_host(device_tensor.view());
}

// A device copy of a host view, from `device_tracker` (a device tracker: device::make_tracker).
template <TensorElement T>
Tensor<std::remove_const_t<T>> to_device(TensorView<T> host_view, MemoryTracker& device_tracker) {
  paradyse::check(device_tracker.space() == MemorySpace::device && device_tracker.allocator() != nullptr,
                  "to_device: the tracker is a {} tracker{}; expected a device tracker (device::make_tracker)",
                  name_of(device_tracker.space()),
                  device_tracker.allocator() ? "" : " without a device allocator");
  Tensor<std::remove_const_t<T>> result(host_view.shape(), device_tracker.handle());
  copy_to_device(host_view, result.view());
  return result;
}
template <TensorElement T>
Tensor<T> to_device(const Tensor<T>& host_tensor, MemoryTracker& device_tracker) {
  return to_device(host_tensor.view(), device_tracker);
}

}  // namespace paradyse::device
