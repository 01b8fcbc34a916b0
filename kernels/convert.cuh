// kernels/convert.cuh: the element conversion kernel and ops::cuda::convert (ops/cuda/convert.hpp) with its
// nine explicit instantiations.
//
// The roundings are core/dtype.hpp's bit manipulations written again as device functions (the host ones are not
// __device__), so every result is bitwise the CPU's. One thread per element (grid-stride); contiguous pairs index
// directly, other views decompose the flat index over the shape (rank <= kMaxRank).
#pragma once

#include "paradyse/core/dtype.hpp"
#include "stream_scratch.cuh"
#include "paradyse/ops/cuda/convert.hpp"

#include <cstdint>
#include <type_traits>

namespace paradyse::kernels::dense {

namespace convert_detail {

__device__ inline float bf16_to_float(std::uint16_t bits) { return __uint_as_float(std::uint32_t(bits) << 16); }

// As bf16::from_float.
__device__ inline std::uint16_t float_to_bf16(float value) {
  const std::uint32_t u = __float_as_uint(value);
  if ((u & 0x7fffffffu) > 0x7f800000u) return std::uint16_t((u >> 16) | 0x0040u);  // quiet NaN, keep sign
  const std::uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);                          // ties to even
  return std::uint16_t((u + rounding) >> 16);
}

// As f16::from_float.
__device__ inline std::uint16_t float_to_f16(float value) {
  const std::uint32_t u = __float_as_uint(value);
  const std::uint16_t sign = std::uint16_t((u >> 16) & 0x8000u);
  const std::uint32_t magnitude = u & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (magnitude >= 0x477ff000u) return sign | 0x7c00u;  // rounds beyond 65504: infinity
  if (magnitude < 0x38800000u) {                        // subnormal half: the float adder rounds to even
    const float scaled = __fadd_rn(__uint_as_float(magnitude), 0.5f);
    return sign | std::uint16_t(__float_as_uint(scaled) - 0x3f000000u);
  }
  const std::uint32_t rounding = 0xfffu + ((magnitude >> 13) & 1u);
  return sign | std::uint16_t((magnitude - 0x38000000u + rounding) >> 13);
}

// As f16::to_float.
__device__ inline float f16_to_float(std::uint16_t h) {
  const std::uint32_t sign = std::uint32_t(h & 0x8000u) << 16;
  const std::uint32_t exponent = (h >> 10) & 0x1fu;
  const std::uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1f) return __uint_as_float(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {
    const float magnitude = __fmul_rn(float(mantissa), 5.9604644775390625e-8f);
    return sign ? -magnitude : magnitude;
  }
  return __uint_as_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

template <class T>
__device__ float load_float(const T* p) {
  if constexpr (std::is_same_v<T, float>) return *p;
  else if constexpr (std::is_same_v<T, bf16>) return bf16_to_float(p->bits);
  else return f16_to_float(p->bits);
}

template <class From, class To>
__device__ void convert_element(const From* from, To* to) {
  if constexpr (std::is_same_v<From, To>) {
    if constexpr (std::is_same_v<To, float>) *to = *from;
    else to->bits = from->bits;  // the identity copies the bits (NaN payloads too), as ops::cpu does
  } else {
    const float value = load_float(from);
    if constexpr (std::is_same_v<To, float>) *to = value;
    else if constexpr (std::is_same_v<To, bf16>) to->bits = float_to_bf16(value);
    else to->bits = float_to_f16(value);
  }
}

}  // namespace convert_detail

struct ConvertGeometry {
  int rank = 0;
  bool contiguous = false;
  std::int64_t extent[kMaxRank] = {};
  std::int64_t from_stride[kMaxRank] = {};
  std::int64_t to_stride[kMaxRank] = {};
};

template <class From, class To>
__global__ void convert_kernel(const From* from, To* to, std::int64_t n, ConvertGeometry g) {
  for (std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += std::int64_t(gridDim.x) * blockDim.x) {
    std::int64_t src = i, dst = i;
    if (!g.contiguous) {
      src = 0, dst = 0;
      std::int64_t rest = i;
      for (int d = g.rank - 1; d >= 0; --d) {
        const std::int64_t index = rest % g.extent[d];
        rest /= g.extent[d];
        src += index * g.from_stride[d];
        dst += index * g.to_stride[d];
      }
    }
    convert_detail::convert_element(from + src, to + dst);
  }
}

}  // namespace paradyse::kernels::dense

namespace paradyse::ops::cuda {

template <cpu::FloatingStorage From, cpu::FloatingStorage To>
void convert(TensorView<const From> from, TensorView<To> to) {
  check(from.shape() == to.shape(), "convert: source shape {} differs from destination shape {}", from.shape(),
        to.shape());
  const std::int64_t n = from.numel();
  if (n == 0) return;
  kernels::dense::ConvertGeometry g;
  g.rank = from.rank();
  g.contiguous = from.is_contiguous() && to.is_contiguous();
  for (int d = 0; d < g.rank; ++d)
    g.extent[d] = from.shape()[d], g.from_stride[d] = from.strides()[d], g.to_stride[d] = to.strides()[d];
  constexpr unsigned kThreads = 256;
  kernels::dense::convert_kernel<From, To>
      <<<kernels::grid_for(n, kThreads), kThreads, 0, device::current_stream()>>>(from.data(), to.data(), n, g);
  device::check_launch("convert_kernel");
}

template void convert<float, float>(TensorView<const float>, TensorView<float>);
template void convert<float, bf16>(TensorView<const float>, TensorView<bf16>);
template void convert<float, f16>(TensorView<const float>, TensorView<f16>);
template void convert<bf16, float>(TensorView<const bf16>, TensorView<float>);
template void convert<bf16, bf16>(TensorView<const bf16>, TensorView<bf16>);
template void convert<bf16, f16>(TensorView<const bf16>, TensorView<f16>);
template void convert<f16, float>(TensorView<const f16>, TensorView<float>);
template void convert<f16, bf16>(TensorView<const f16>, TensorView<bf16>);
template void convert<f16, f16>(TensorView<const f16>, TensorView<f16>);

}  // namespace paradyse::ops::cuda
