// paradyse/ops/cpu/convert.hpp: element type conversion of buffers (f32 <-> bf16, f32 <-> f16, and identity).
//
// From float the conversions round to nearest, ties to even (core/dtype.hpp); to float they are exact.
#pragma once

#include "paradyse/core/dtype.hpp"
#include "paradyse/core/tensor.hpp"

#include <cstdint>
#include <type_traits>

namespace paradyse::ops::cpu {

template <class T>
concept FloatingStorage = std::is_same_v<T, float> || std::is_same_v<T, bf16> || std::is_same_v<T, f16>;

// to = from converted element by element; same shape, any strides.
template <FloatingStorage From, FloatingStorage To>
void convert(TensorView<const From> from, TensorView<To> to) {
  check(from.shape() == to.shape(), "convert: source shape {} differs from destination shape {}", from.shape(),
        to.shape());
  const auto cast = [](From x) {
    if constexpr (std::is_same_v<From, To>) return x;
    else if constexpr (std::is_same_v<To, float>) return float(x);
    else if constexpr (std::is_same_v<From, float>) return To(x);
    else return To(float(x));
  };
  if (from.is_contiguous() && to.is_contiguous()) {
    const From* src = from.data();
    To* dst = to.data();
    for (std::int64_t i = 0; i < from.numel(); ++i) dst[i] = cast(src[i]);
    return;
  }
  const int rank = from.rank();
  std::int64_t index[kMaxRank] = {};
  for (std::int64_t n = 0; n < from.numel(); ++n) {
    std::int64_t src = 0, dst = 0;
    for (int d = 0; d < rank; ++d) src += index[d] * from.strides()[d], dst += index[d] * to.strides()[d];
    to.data()[dst] = cast(from.data()[src]);
    for (int d = rank - 1; d >= 0; --d) {
      if (++index[d] < from.shape()[d]) break;
      index[d] = 0;
    }
  }
}
template <FloatingStorage From, FloatingStorage To>
void convert(TensorView<From> from, TensorView<To> to) { convert(TensorView<const From>(from), to); }

}  // namespace paradyse::ops::cpu
