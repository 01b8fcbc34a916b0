// paradyse/comm/cuda_reduce.hpp: the device reductions of the CUDA communicators: declarations of the launchers
// whose kernels are in kernels/comm_reduce.cuh (compiled once per program by nvcc, see kernels/all.cuh).
//
// Host code. Both launchers run asynchronously on `stream`; argument errors throw before anything is launched.
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/dtype.hpp"

#include <cuda_runtime_api.h>

#include <cstddef>

namespace paradyse::comm_cuda {

// The most inputs one reduce_in_rank_order call takes (their pointers travel as a kernel argument).
inline constexpr int kMaxReduceRanks = 64;

// out[i] = in[0][i] (op) in[1][i] (op) ... (op) in[ranks-1][i] for i in [begin, end), in rank order, element by
// element; avg divides the sum by `ranks` once at the end. bf16 accumulates in float and rounds once (to nearest
// even), integers divide with truncation: bitwise the host reduction of the threads backend
// (threads_detail::reduce_in_rank_order). `out` may alias an input at the same index. Device (or managed) pointers;
// dtype f32, f64, bf16, i32 or i64; 1 <= ranks <= kMaxReduceRanks.
void reduce_in_rank_order(DType dtype, std::byte* out, const std::byte* const* in, int ranks, std::size_t begin,
                          std::size_t end, ReduceOp op, cudaStream_t stream);

// data[i] = data[i] / divisor for i in [0, count) (the avg of a summed collective; integers truncate, bf16 divides in
// float and rounds once). Device pointer; dtype f32, f64, bf16, i32 or i64; divisor >= 1.
void divide_in_place(DType dtype, std::byte* data, std::size_t count, int divisor, cudaStream_t stream);

}  // namespace paradyse::comm_cuda
