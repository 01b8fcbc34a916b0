// paradyse/ops/cpu/tensor_ops.hpp: the data movement a strategy or model needs besides its kernels: copy, fill and
// add-into over views of any strides (and over contiguous spans).
//
// These are the only element loops that strategy/ and model/ reach (through their Backend), so the same strategy
// code runs on host memory here, on device memory with the CUDA backend, and on meta tensors with the counting
// backend (ops/counting.hpp).
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/tensor.hpp"

#include <algorithm>
#include <cstdint>
#include <span>

namespace paradyse::ops::cpu {

namespace tensor_ops_detail {
// Calls row(first element of `a`, of `b`, length, stride of `a`, of `b`) for every row of the last dimension of two
// views of equal shape.
template <class A, class B, class Row>
void for_each_row(TensorView<A> a, TensorView<B> b, Row&& row) {
  const int rank = a.rank();
  if (a.numel() == 0) return;
  const std::int64_t inner = rank ? a.shape()[rank - 1] : 1;
  const std::int64_t a_step = rank ? a.strides()[rank - 1] : 1, b_step = rank ? b.strides()[rank - 1] : 1;
  const std::int64_t rows = a.numel() / inner;
  std::int64_t index[kMaxRank] = {};
  for (std::int64_t r = 0; r < rows; ++r) {
    std::int64_t ao = 0, bo = 0;
    for (int d = 0; d + 1 < rank; ++d) ao += index[d] * a.strides()[d], bo += index[d] * b.strides()[d];
    row(a.data() + ao, b.data() + bo, inner, a_step, b_step);
    for (int d = rank - 2; d >= 0; --d) {
      if (++index[d] < a.shape()[d]) break;
      index[d] = 0;
    }
  }
}
}  // namespace tensor_ops_detail

// to = from (equal shapes, any strides; they must not overlap).
template <TensorElement T>
void copy(TensorView<const T> from, TensorView<T> to) {
  paradyse::copy(from, to);
}

// x = value.
template <TensorElement T>
void fill(TensorView<T> x, T value) {
  if (x.is_contiguous()) {
    std::fill_n(x.data(), x.numel(), value);
    return;
  }
  tensor_ops_detail::for_each_row(x, x, [&](T* row, T*, std::int64_t n, std::int64_t step, std::int64_t) {
    for (std::int64_t i = 0; i < n; ++i) row[i * step] = value;
  });
}

// to += from (equal shapes, any strides).
inline void add_into(TensorView<float> to, TensorView<const float> from) {
  check(to.shape() == from.shape(), "add_into: destination {} and source {} differ in shape", to.shape(), from.shape());
  if (to.is_contiguous() && from.is_contiguous()) {
    float* dst = to.data();
    const float* src = from.data();
    for (std::int64_t i = 0, n = to.numel(); i < n; ++i) dst[i] += src[i];
    return;
  }
  tensor_ops_detail::for_each_row(to, from,
                                  [](float* dst, const float* src, std::int64_t n, std::int64_t ds, std::int64_t ss) {
                                    for (std::int64_t i = 0; i < n; ++i) dst[i * ds] += src[i * ss];
                                  });
}

// Host ops run on the calling thread: nothing is left queued.
inline void synchronize() {}

}  // namespace paradyse::ops::cpu
