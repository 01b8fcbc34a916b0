// kernels/comm_reduce.cuh: the kernels of the CUDA communicators' reductions and the definitions of their
// launchers (declared in comm/cuda_reduce.hpp).
//
// nvcc only. A grid-stride loop over elements; each thread reads every rank's element in rank order, accumulates in
// the type the host reduction uses (float for bf16), so results are bitwise those of the threads backend.
#pragma once

#include "paradyse/comm/cuda_reduce.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/device/runtime.hpp"

#include <cuda_bf16.h>
#include <fmt/format.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace paradyse::comm_cuda {

namespace reduce_kernels {

// Every input pointer, by value (kMaxReduceRanks * 8 bytes of kernel arguments).
struct Inputs {
  const void* at[kMaxReduceRanks];
};

template <class T> struct Accumulator { using type = T; };
template <> struct Accumulator<__nv_bfloat16> { using type = float; };

template <class T>
__device__ typename Accumulator<T>::type widen(T x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return __bfloat162float(x);
  else return x;
}
template <class T>
__device__ T narrow(typename Accumulator<T>::type x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return __float2bfloat16_rn(x);
  else return x;
}

template <class T>
__global__ void reduce_in_rank_order_kernel(T* out, Inputs in, int ranks, std::size_t begin, std::size_t end,
                                            ReduceOp op) {
  using Acc = typename Accumulator<T>::type;
  const std::size_t stride = std::size_t(gridDim.x) * blockDim.x;
  for (std::size_t i = begin + std::size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < end; i += stride) {
    Acc acc = widen(static_cast<const T*>(in.at[0])[i]);
    for (int r = 1; r < ranks; ++r) {
      const Acc x = widen(static_cast<const T*>(in.at[r])[i]);
      if (op == ReduceOp::max) acc = acc < x ? x : acc;  // std::max(acc, x), as the host
      else acc += x;
    }
    if (op == ReduceOp::avg) acc = Acc(acc / Acc(ranks));
    out[i] = narrow<T>(acc);
  }
}

template <class T>
__global__ void divide_in_place_kernel(T* data, std::size_t count, int divisor) {
  using Acc = typename Accumulator<T>::type;
  const std::size_t stride = std::size_t(gridDim.x) * blockDim.x;
  for (std::size_t i = std::size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride)
    data[i] = narrow<T>(Acc(widen(data[i]) / Acc(divisor)));
}

inline constexpr int kThreads = 256;
inline unsigned blocks_for(std::size_t n) {
  const std::size_t blocks = (n + kThreads - 1) / kThreads;
  return unsigned(std::clamp<std::size_t>(blocks, 1, 8192));  // grid-stride beyond: 2M threads keep HBM busy
}

template <class T>
void launch_reduce(std::byte* out, const std::byte* const* in, int ranks, std::size_t begin, std::size_t end,
                   ReduceOp op, cudaStream_t stream) {
  Inputs inputs{};
  for (int r = 0; r < ranks; ++r) inputs.at[r] = in[r];
  reduce_in_rank_order_kernel<T><<<blocks_for(end - begin), kThreads, 0, stream>>>(reinterpret_cast<T*>(out), inputs,
                                                                                     ranks, begin, end, op);
  device::check_launch("reduce_in_rank_order_kernel");
}

template <class T>
void launch_divide(std::byte* data, std::size_t count, int divisor, cudaStream_t stream) {
  divide_in_place_kernel<T><<<blocks_for(count), kThreads, 0, stream>>>(reinterpret_cast<T*>(data), count, divisor);
  device::check_launch("divide_in_place_kernel");
}

}  // namespace reduce_kernels

void reduce_in_rank_order(DType dtype, std::byte* out, const std::byte* const* in, int ranks, std::size_t begin,
                          std::size_t end, ReduceOp op, cudaStream_t stream) {
  check(ranks >= 1 && ranks <= kMaxReduceRanks, "reduce_in_rank_order: {} ranks, expected 1 to {}", ranks,
        kMaxReduceRanks);
  check(begin <= end, "reduce_in_rank_order: begin {} after end {}", begin, end);
  if (begin == end) return;
  using namespace reduce_kernels;
  switch (dtype) {
    case DType::f32: return launch_reduce<float>(out, in, ranks, begin, end, op, stream);
    case DType::f64: return launch_reduce<double>(out, in, ranks, begin, end, op, stream);
    case DType::bf16: return launch_reduce<__nv_bfloat16>(out, in, ranks, begin, end, op, stream);
    case DType::i32: return launch_reduce<std::int32_t>(out, in, ranks, begin, end, op, stream);
    case DType::i64: return launch_reduce<std::int64_t>(out, in, ranks, begin, end, op, stream);
    default: break;
  }
  throw Error(fmt::format("reduce_in_rank_order: cannot reduce {} (f32, f64, bf16, i32 or i64)", name_of(dtype)));
}

void divide_in_place(DType dtype, std::byte* data, std::size_t count, int divisor, cudaStream_t stream) {
  check(divisor >= 1, "divide_in_place: divisor {} must be at least 1", divisor);
  if (count == 0) return;
  using namespace reduce_kernels;
  switch (dtype) {
    case DType::f32: return launch_divide<float>(data, count, divisor, stream);
    case DType::f64: return launch_divide<double>(data, count, divisor, stream);
    case DType::bf16: return launch_divide<__nv_bfloat16>(data, count, divisor, stream);
    case DType::i32: return launch_divide<std::int32_t>(data, count, divisor, stream);
    case DType::i64: return launch_divide<std::int64_t>(data, count, divisor, stream);
    default: break;
  }
  throw Error(fmt::format("divide_in_place: cannot divide {} (f32, f64, bf16, i32 or i64)", name_of(dtype)));
}

}  // namespace paradyse::comm_cuda
