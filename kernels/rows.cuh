// kernels/rows.cuh: what the row-wise kernels (normalization, activation, rope, embedding, cross-entropy,
// adamw, convert; namespace kernels::dense) share: a view's row layout passed by value to a kernel and
// deterministic block reductions. Grid sizes (kernels::grid_for) and stream-ordered scratch (kernels::StreamScratch)
// come from kernels/stream_scratch.cuh.
//
// nvcc only (included by kernels/*.cuh). A host TensorView [..., w] with a unit-stride last dimension is a set of
// rows with arbitrary outer strides (ops/cpu/rows.hpp); RowLayout carries those outer extents and strides into the
// kernel so that row r starts at data + layout.offset(r), exactly as ops::cpu::detail::row_pointer computes it.
#pragma once

#include "paradyse/core/shape.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/device/runtime.hpp"
#include "stream_scratch.cuh"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace paradyse::kernels::dense {

// The outer dimensions of a [..., w] view: row r (row-major over the outer dimensions) starts at offset(r).
struct RowLayout {
  int outer_rank = 0;  // rank - 1
  std::int64_t extent[kMaxRank] = {};
  std::int64_t stride[kMaxRank] = {};

  __host__ __device__ std::int64_t offset(std::int64_t row) const {
    std::int64_t result = 0;
    for (int d = outer_rank - 1; d >= 0; --d) {
      result += (row % extent[d]) * stride[d];
      row /= extent[d];
    }
    return result;
  }
};

template <class T>
RowLayout row_layout(const TensorView<T>& x) {
  RowLayout layout;
  layout.outer_rank = std::max(0, x.rank() - 1);
  for (int d = 0; d < layout.outer_rank; ++d) {
    layout.extent[d] = x.shape()[d];
    layout.stride[d] = x.strides()[d];
  }
  return layout;
}

// Threads per block of the row kernels (a multiple of 32; block_reduce assumes it).
inline constexpr int kRowThreads = 256;

struct SumOp {
  template <class T>
  __device__ T operator()(T a, T b) const { return a + b; }
};
struct MaxOp {
  template <class T>
  __device__ T operator()(T a, T b) const { return b > a ? b : a; }
};

template <class T, class Op>
__device__ T warp_reduce(T value, Op op) {
  for (int offset = 16; offset > 0; offset >>= 1) value = op(value, __shfl_xor_sync(0xffffffffu, value, offset));
  return value;
}

// The reduction of every thread's `value` over the block, returned to all threads. The order is fixed by the block
// size alone (lanes by xor butterfly, then warps), so the result is reproducible run to run. `shared` holds 32
// elements; blockDim.x is a multiple of 32. Every thread of the block must call it.
template <class T, class Op>
__device__ T block_reduce(T value, T* shared, Op op, T identity) {
  const int lane = int(threadIdx.x) & 31, warp = int(threadIdx.x) >> 5, warps = int(blockDim.x) >> 5;
  value = warp_reduce(value, op);
  __syncthreads();  // an earlier call's readers of shared[0] are done
  if (lane == 0) shared[warp] = value;
  __syncthreads();
  value = lane < warps ? shared[lane] : identity;
  if (warp == 0) value = warp_reduce(value, op);
  if (threadIdx.x == 0) shared[0] = value;
  __syncthreads();
  return shared[0];
}

}  // namespace paradyse::kernels::dense
