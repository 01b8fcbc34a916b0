// paradyse/ops/cuda/convert.hpp: element type conversion on the GPU: the declaration of ops::cpu's convert
// (ops/cpu/convert.hpp), with the same signature and contract, over views of device memory: f32, bf16 and f16 in
// every combination (the FloatingStorage types), same shape, any strides.
//
// The device code uses core/dtype.hpp's bit-exact rounding (to nearest, ties to even; NaN stays a NaN with the same
// quieting, infinities stay infinite), so results are bitwise ops::cpu's. Runs asynchronously on
// device::current_stream(). Definition and the nine explicit instantiations: kernels/convert.cuh (nvcc).
#pragma once

#include "paradyse/core/dtype.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/ops/cpu/convert.hpp"

namespace paradyse::ops::cuda {

// to = from converted element by element; same shape, any strides.
template <cpu::FloatingStorage From, cpu::FloatingStorage To>
void convert(TensorView<const From> from, TensorView<To> to);

template <cpu::FloatingStorage From, cpu::FloatingStorage To>
void convert(TensorView<From> from, TensorView<To> to) {
  convert(TensorView<const From>(from), to);
}

// Instantiated once, in kernels/convert.cuh.
extern template void convert<float, float>(TensorView<const float>, TensorView<float>);
extern template void convert<float, bf16>(TensorView<const float>, TensorView<bf16>);
extern template void convert<float, f16>(TensorView<const float>, TensorView<f16>);
extern template void convert<bf16, float>(TensorView<const bf16>, TensorView<float>);
extern template void convert<bf16, bf16>(TensorView<const bf16>, TensorView<bf16>);
extern template void convert<bf16, f16>(TensorView<const bf16>, TensorView<f16>);
extern template void convert<f16, float>(TensorView<const f16>, TensorView<float>);
extern template void convert<f16, bf16>(TensorView<const f16>, TensorView<bf16>);
extern template void convert<f16, f16>(TensorView<const f16>, TensorView<f16>);

}  // namespace paradyse::ops::cuda
