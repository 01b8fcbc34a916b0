// paradyse/core/tensor.hpp: Tensor<T> (owning, 64-byte aligned, tracked) and TensorView<T> (data, shape, strides).
//
// Activations and weights are row-major; a view may carry any strides (a slice along an outer dimension stays
// contiguous, a slice along an inner one does not). Tensors allocate through the MemoryTracker that is current on
// the constructing thread and give the memory back to that same tracker (whose counts the tensor keeps alive, so
// the tensor may outlive the tracker object: see core/memory.hpp); a tensor lives in that tracker's memory
// space (host, device, or meta: shape and bytes only, see core/memory.hpp). Host code here touches host tensors
// only; strategies and models touch data through their Backend (ops/backend.hpp), which works in any space.
#pragma once

#include "paradyse/core/dtype.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/core/memory.hpp"
#include "paradyse/core/shape.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>
#include <type_traits>
#include <utility>

namespace paradyse {

template <class T>
concept TensorElement = Element<std::remove_const_t<T>>;

template <TensorElement T>
class TensorView {
public:
  using value_type = std::remove_const_t<T>;

  TensorView() = default;
  TensorView(T* data, Shape shape) : data_(data), shape_(shape), strides_(shape.row_major_strides()) {}
  TensorView(T* data, Shape shape, Shape strides) : data_(data), shape_(shape), strides_(strides) {}
  // A mutable view converts to a read-only one.
  template <class U>
    requires(std::is_const_v<T> && std::is_same_v<U, value_type>)
  TensorView(TensorView<U> other) : data_(other.data()), shape_(other.shape()), strides_(other.strides()) {}

  T* data() const noexcept { return data_; }
  const Shape& shape() const noexcept { return shape_; }
  const Shape& strides() const noexcept { return strides_; }
  int rank() const noexcept { return shape_.rank(); }
  std::int64_t numel() const noexcept { return shape_.numel(); }
  std::int64_t extent(int dim) const { return shape_.extent(dim); }
  bool is_contiguous() const noexcept { return shape_.numel() <= 1 || strides_ == shape_.row_major_strides(); }

  // The elements of a contiguous view.
  std::span<T> span() const {
    check(is_contiguous(), "span() needs a contiguous view; shape {} has strides {}", shape_, strides_);
    return {data_, std::size_t(numel())};
  }

  template <class... I>
  T& operator()(I... index) const noexcept {
    static_assert(sizeof...(I) <= kMaxRank);
    std::int64_t offset = 0;
    int d = 0;
    ((offset += std::int64_t(index) * strides_[d++]), ...);
    return data_[offset];
  }

  // Elements [start, start + length) of `dim`; other dimensions untouched.
  TensorView slice(int dim, std::int64_t start, std::int64_t length) const {
    const int d = shape_.normalize(dim);
    if (start < 0 || length < 0 || start + length > shape_[d]) [[unlikely]]
      slice_out_of_range(dim, start, length);
    Shape shape = shape_;
    shape[d] = length;  // d is normalized already
    return TensorView(data_ + start * strides_[d], shape, strides_);
  }

  // The same elements under another shape (contiguous views only).
  TensorView reshape(Shape shape) const {
    check(shape.numel() == numel(), "cannot reshape {} ({} elements) to {} ({} elements)", shape_, numel(), shape,
          shape.numel());
    check(is_contiguous(), "reshape needs a contiguous view; shape {} has strides {}", shape_, strides_);
    return TensorView(data_, shape);
  }

private:
  // Out of line: slicing is hot (the dry runs slice per kernel) and inlines the check.
  [[noreturn, gnu::cold, gnu::noinline]] void slice_out_of_range(int dim, std::int64_t start, std::int64_t length) const {
    check(false, "slice [{}, {}) of dim {} is outside extent {} of shape {}", start, start + length, dim,
          shape_[shape_.normalize(dim)], shape_);
    __builtin_unreachable();
  }

  T* data_ = nullptr;
  Shape shape_;
  Shape strides_;
};

// The bytes of `shape` elements of `element_bytes` each; OutOfMemory (naming the shape) when they exceed
// kMaxTrackedBytes, checked without overflow however large the extents.
inline std::size_t storage_bytes(const Shape& shape, std::size_t element_bytes) {
  std::uint64_t bytes = element_bytes;
  bool beyond = false;
  for (const std::int64_t e : shape) {
    if (e == 0) return 0;
    if (!beyond && (__builtin_mul_overflow(bytes, std::uint64_t(e), &bytes) || bytes > kMaxTrackedBytes)) beyond = true;
  }
  if (beyond) {
    double exact = double(element_bytes);
    for (const std::int64_t e : shape) exact *= double(e);
    throw OutOfMemory(fmt::format("out of memory: a tensor of shape {} ({} bytes per element) needs {:.4g} bytes, "
                                  "beyond the 2^60 bytes (1 EiB) that any memory tracker counts",
                                  shape, element_bytes, exact),
                      MemoryTracker::kNoCap, MemoryTracker::current().in_use(), kMaxTrackedBytes);
  }
  return std::size_t(bytes);
}

template <TensorElement T>
class Tensor {
public:
  Tensor() = default;
  // Zero-initialised storage for `shape`, from the calling thread's tracker.
  explicit Tensor(Shape shape) : Tensor(shape, MemoryTracker::current().handle()) {}
  // Zero-initialised storage for `shape`, from `tracker`.
  Tensor(Shape shape, MemoryTracker::Handle tracker) : Tensor(shape, std::move(tracker), Contents::zeros) {}
  static Tensor zeros(Shape shape) { return Tensor(shape); }
  // Storage for `shape` whose contents are unspecified (core/memory.hpp Contents): for a result the caller's kernels
  // write whole before anything reads it (a GEMM's C with beta 0, a softmax's rows), which then skips the zero fill.
  static Tensor uninitialized(Shape shape, MemoryTracker::Handle tracker = MemoryTracker::current().handle()) {
    return Tensor(shape, std::move(tracker), Contents::unspecified);
  }
  static Tensor copy_of(TensorView<const T> source) {
    Tensor t = uninitialized(source.shape());
    copy(source, t.view());
    return t;
  }

  Tensor(Tensor&& other) noexcept { swap(other); }
  Tensor& operator=(Tensor&& other) noexcept {
    Tensor moved(std::move(other));
    swap(moved);
    return *this;
  }
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;
  ~Tensor() {
    if (data_) tracker_.deallocate(data_, std::size_t(shape_.numel()) * sizeof(T));
  }

  T* data() noexcept { return data_; }
  const T* data() const noexcept { return data_; }
  const Shape& shape() const noexcept { return shape_; }
  std::int64_t numel() const noexcept { return shape_.numel(); }
  std::int64_t extent(int dim) const { return shape_.extent(dim); }
  std::size_t bytes() const noexcept { return std::size_t(numel()) * sizeof(T); }
  // Where the storage lives (an empty tensor reports the host).
  MemorySpace space() const noexcept { return tracker_.space(); }
  // The tracker the storage came from (kept alive by the tensor: it may outlive the tracker object).
  const MemoryTracker::Handle& tracker() const noexcept { return tracker_; }

  TensorView<T> view() noexcept { return {data_, shape_}; }
  TensorView<const T> view() const noexcept { return {data_, shape_}; }
  operator TensorView<T>() noexcept { return view(); }
  operator TensorView<const T>() const noexcept { return view(); }
  std::span<T> span() noexcept { return {data_, std::size_t(numel())}; }
  std::span<const T> span() const noexcept { return {data_, std::size_t(numel())}; }

  template <class... I>
  T& operator()(I... index) noexcept { return data_[offset_of(index...)]; }
  template <class... I>
  const T& operator()(I... index) const noexcept { return data_[offset_of(index...)]; }

  // A new shape over the same storage (same element count).
  void reshape(Shape shape) {
    check(shape.numel() == numel(), "cannot reshape {} to {}", shape_, shape);
    shape_ = shape;
  }

  // Host tensors only (meta tensors have nothing to fill: a no-op).
  void fill(T value) {
    if (space() == MemorySpace::meta) return;
    check(space() == MemorySpace::host, "Tensor::fill on a {} tensor: use the backend's fill", name_of(space()));
    std::fill(data_, data_ + numel(), value);
  }

  void swap(Tensor& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(shape_, other.shape_);
    std::swap(tracker_, other.tracker_);
  }

private:
  Tensor(Shape shape, MemoryTracker::Handle tracker, Contents contents) : shape_(shape), tracker_(std::move(tracker)) {
    data_ = static_cast<T*>(tracker_.allocate(storage_bytes(shape, sizeof(T)), contents));
  }

  // The row-major offset of an index (fewer indices than dimensions: the first ones, as view() would index).
  template <class... I>
  std::int64_t offset_of(I... index) const noexcept {
    static_assert(sizeof...(I) <= kMaxRank);
    if (int(sizeof...(I)) != shape_.rank()) return &view()(index...) - data_;
    std::int64_t offset = 0;
    int d = 0;
    ((offset = offset * shape_[d++] + std::int64_t(index)), ...);  // Horner: no stride vector to build
    return offset;
  }

  T* data_ = nullptr;
  Shape shape_;
  MemoryTracker::Handle tracker_;  // shares the tracker's counts: freeing after the tracker is gone is safe
};

// Element-wise copy between views of equal shape (any strides).
template <TensorElement T>
void copy(TensorView<const T> from, TensorView<T> to) {
  check(from.shape() == to.shape(), "copy: source shape {} differs from destination shape {}", from.shape(), to.shape());
  if (from.is_contiguous() && to.is_contiguous()) {
    if (from.numel()) std::memmove(to.data(), from.data(), std::size_t(from.numel()) * sizeof(T));
    return;
  }
  // Walk the outer dimensions; copy rows of the last dimension.
  const int rank = from.rank();
  const std::int64_t inner = rank ? from.shape()[rank - 1] : 1;
  const std::int64_t rows = inner ? from.numel() / inner : 0;
  std::int64_t index[kMaxRank] = {};
  for (std::int64_t row = 0; row < rows; ++row) {
    std::int64_t src = 0, dst = 0;
    for (int d = 0; d + 1 < rank; ++d) {
      src += index[d] * from.strides()[d];
      dst += index[d] * to.strides()[d];
    }
    const std::int64_t sstride = rank ? from.strides()[rank - 1] : 1, dstride = rank ? to.strides()[rank - 1] : 1;
    for (std::int64_t i = 0; i < inner; ++i) to.data()[dst + i * dstride] = from.data()[src + i * sstride];
    for (int d = rank - 2; d >= 0; --d) {
      if (++index[d] < from.shape()[d]) break;
      index[d] = 0;
    }
  }
}
template <TensorElement T>
void copy(TensorView<T> from, TensorView<T> to) { copy(TensorView<const T>(from), to); }

}  // namespace paradyse
