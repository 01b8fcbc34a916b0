// kernels/tensor_ops.cuh: the kernels of copy, fill and add-into over device views of any strides, and the
// definitions of the launchers that ops/cuda/tensor_ops.hpp declares (nvcc only; included once per program through
// kernels/all.cuh).
//
// Contiguous views take flat paths (cudaMemcpyAsync for copy; a flat element loop for fill and add-into). Other
// strides take one kernel per op: each thread turns its linear index (row-major over the shape) into an element
// offset per view, with the shape and both views' strides passed by value (StridedPair, up to kMaxRank dims).
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/device/runtime.hpp"
#include "paradyse/ops/cuda/tensor_ops.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace paradyse::kernels::tensor_ops {

// The shape of two views of equal shape and the strides of each (a and b), by value into a kernel.
struct StridedPair {
  int rank = 0;
  long long shape[kMaxRank] = {};
  long long a_strides[kMaxRank] = {};
  long long b_strides[kMaxRank] = {};
};

template <class A, class B>
StridedPair strided_pair(const TensorView<A>& a, const TensorView<B>& b) {
  StridedPair pair;
  pair.rank = a.rank();
  for (int d = 0; d < pair.rank; ++d) {
    pair.shape[d] = a.shape()[d];
    pair.a_strides[d] = a.strides()[d];
    pair.b_strides[d] = b.strides()[d];
  }
  return pair;
}

// Element offsets in a and b of the element at row-major linear index i.
__device__ inline void offsets_of(const StridedPair& pair, long long i, long long& a, long long& b) {
  a = 0;
  b = 0;
  for (int d = pair.rank - 1; d >= 0; --d) {
    const long long extent = pair.shape[d];
    const long long index = i % extent;
    i /= extent;
    a += index * pair.a_strides[d];
    b += index * pair.b_strides[d];
  }
}

constexpr unsigned kThreads = 256;

// Blocks for a grid-stride loop over n elements (n > 0).
inline unsigned blocks_for(long long n) {
  return unsigned(std::min<long long>((n + kThreads - 1) / kThreads, 65536LL * 8));
}

// to[b] = from[a] over the pair's shape.
__global__ void copy_strided_kernel(const float* __restrict__ from, float* __restrict__ to, StridedPair pair,
                                    long long n) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    long long a, b;
    offsets_of(pair, i, a, b);
    to[b] = from[a];
  }
}

__global__ void fill_flat_kernel(float* __restrict__ x, float value, long long n) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    x[i] = value;
}

// x[a] = value over the pair's shape (b unused).
__global__ void fill_strided_kernel(float* __restrict__ x, float value, StridedPair pair, long long n) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    long long a, b;
    offsets_of(pair, i, a, b);
    x[a] = value;
  }
}

__global__ void add_flat_kernel(float* __restrict__ to, const float* __restrict__ from, long long n) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    to[i] += from[i];
}

// to[a] += from[b] over the pair's shape.
__global__ void add_strided_kernel(float* __restrict__ to, const float* __restrict__ from, StridedPair pair,
                                   long long n) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    long long a, b;
    offsets_of(pair, i, a, b);
    to[a] += from[b];
  }
}

}  // namespace paradyse::kernels::tensor_ops

namespace paradyse::ops::cuda {

void copy(TensorView<const float> from, TensorView<float> to) {
  namespace k = kernels::tensor_ops;
  check(from.shape() == to.shape(), "copy: source shape {} differs from destination shape {}", from.shape(), to.shape());
  const long long n = from.numel();
  if (n == 0) return;
  const cudaStream_t stream = device::current_stream();
  if (from.is_contiguous() && to.is_contiguous()) {
    // cudaMemcpyDefault: either side may also be host memory (a model placing its host-drawn weights, a test
    // reading a result back); strided copies are device to device.
    PARADYSE_CUDA_CHECK(
        cudaMemcpyAsync(to.data(), from.data(), std::size_t(n) * sizeof(float), cudaMemcpyDefault, stream));
    return;
  }
  k::copy_strided_kernel<<<k::blocks_for(n), k::kThreads, 0, stream>>>(from.data(), to.data(),
                                                                          k::strided_pair(from, to), n);
  device::check_launch("copy_strided_kernel");
}

void fill(TensorView<float> x, float value) {
  namespace k = kernels::tensor_ops;
  const long long n = x.numel();
  if (n == 0) return;
  const cudaStream_t stream = device::current_stream();
  if (x.is_contiguous()) {
    k::fill_flat_kernel<<<k::blocks_for(n), k::kThreads, 0, stream>>>(x.data(), value, n);
    device::check_launch("fill_flat_kernel");
    return;
  }
  k::fill_strided_kernel<<<k::blocks_for(n), k::kThreads, 0, stream>>>(x.data(), value, k::strided_pair(x, x), n);
  device::check_launch("fill_strided_kernel");
}

void add_into(TensorView<float> to, TensorView<const float> from) {
  namespace k = kernels::tensor_ops;
  check(to.shape() == from.shape(), "add_into: destination {} and source {} differ in shape", to.shape(), from.shape());
  const long long n = to.numel();
  if (n == 0) return;
  const cudaStream_t stream = device::current_stream();
  if (to.is_contiguous() && from.is_contiguous()) {
    k::add_flat_kernel<<<k::blocks_for(n), k::kThreads, 0, stream>>>(to.data(), from.data(), n);
    device::check_launch("add_flat_kernel");
    return;
  }
  k::add_strided_kernel<<<k::blocks_for(n), k::kThreads, 0, stream>>>(to.data(), from.data(),
                                                                         k::strided_pair(to, from), n);
  device::check_launch("add_strided_kernel");
}

void synchronize() { device::synchronize(); }

}  // namespace paradyse::ops::cuda
