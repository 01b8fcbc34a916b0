// paradyse/ops/cpu/rows.hpp: walking a view as rows of its last dimension.
//
// The row-wise ops (norms, activations, rope, embedding, cross-entropy) see an activation [..., h] as rows of h
// contiguous elements; the outer dimensions may have any strides (a slice of a packed tensor is fine).
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/tensor.hpp"

#include <cstdint>

namespace paradyse::ops::cpu::detail {

// Rows of a view: the product of all dimensions but the last (1 for a 1-D view).
template <class T>
std::int64_t row_count(const TensorView<T>& x) {
  const std::int64_t width = x.extent(-1);
  return width == 0 ? x.numel() == 0 ? 0 : 1 : x.numel() / width;
}

// The first element of row `row` (rows numbered in row-major order of the outer dimensions).
template <class T>
T* row_pointer(const TensorView<T>& x, std::int64_t row) {
  std::int64_t offset = 0;
  for (int d = x.rank() - 2; d >= 0; --d) {
    const std::int64_t extent = x.shape()[d];
    offset += (row % extent) * x.strides()[d];
    row /= extent;
  }
  return x.data() + offset;
}

// Throws unless x has rank >= 1 and a unit-stride last dimension.
template <class T>
void check_rows(const char* op, const char* name, const TensorView<T>& x) {
  check(x.rank() >= 1, "{}: {} must have at least one dimension", op, name);
  check(x.extent(-1) <= 1 || x.strides()[x.rank() - 1] == 1,
        "{}: the last dimension of {} must have unit stride; shape {} has strides {}", op, name, x.shape(), x.strides());
}

template <class A, class B>
void check_same_shape(const char* op, const char* a_name, const TensorView<A>& a, const char* b_name,
                      const TensorView<B>& b) {
  check(a.shape() == b.shape(), "{}: {} has shape {} but {} has shape {}", op, b_name, b.shape(), a_name, a.shape());
}

// A per-row vector (mean, rstd, targets...): `rows` elements, contiguous, any shape.
template <class T>
void check_per_row(const char* op, const char* name, const TensorView<T>& x, std::int64_t rows) {
  check(x.numel() == rows && x.is_contiguous(), "{}: {} must be contiguous with {} elements (one per row); got shape {}",
        op, name, rows, x.shape());
}

// A parameter vector of `width` elements (gamma, beta), contiguous.
template <class T>
void check_vector(const char* op, const char* name, const TensorView<T>& x, std::int64_t width) {
  check(x.numel() == width && x.is_contiguous(), "{}: {} must be contiguous with {} elements; got shape {}", op, name,
        width, x.shape());
}

}  // namespace paradyse::ops::cpu::detail
