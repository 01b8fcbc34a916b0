// kernels/softmax.cuh: kernels and launchers of ops/cuda/softmax.hpp: the masked row softmax over a
// materialised score matrix and its backward. One block per row (grid-stride over rows), block reductions in fp32
// over the row's columns. nvcc only; included once per program through kernels/all.cuh.
#pragma once

#include "paradyse/device/runtime.hpp"
#include "stream_scratch.cuh"
#include "paradyse/ops/cpu/softmax.hpp"
#include "paradyse/ops/cuda/softmax.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

namespace paradyse::kernels::softmax_kernels {

constexpr unsigned kThreads = 256;

// The reduction of `v` over the block (every thread gets the result): warp shuffles, then the warps' values in warp
// order (deterministic). `shared` holds 32 values; the leading sync lets a caller reduce again at once.
template <class T, class Op>
__device__ T block_reduce(T v, Op op, T* shared) {
  for (int offset = 16; offset > 0; offset /= 2) v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
  const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = (blockDim.x + 31) / 32;
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  T total = shared[0];
  for (unsigned w = 1; w < warps; ++w) total = op(total, shared[w]);
  return total;
}

struct Max {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct Sum {
  __device__ float operator()(float a, float b) const { return a + b; }
};

// scores: rows x c, row r's query at query_positions[r % n]; key j at key_positions[j].
__global__ void masked_softmax_rows(float* scores, long long rows, long long n, long long c,
                                    const std::int64_t* query_positions, const std::int64_t* key_positions,
                                    bool causal) {
  __shared__ float shared[32];
  for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
    float* row = scores + r * c;
    const std::int64_t position = query_positions[r % n];
    float top = -INFINITY;
    for (long long j = threadIdx.x; j < c; j += blockDim.x)
      if (!causal || key_positions[j] <= position) top = fmaxf(top, row[j]);
    top = block_reduce(top, Max{}, shared);
    float sum = 0.0f;
    for (long long j = threadIdx.x; j < c; j += blockDim.x) {
      const float e = (!causal || key_positions[j] <= position) ? expf(row[j] - top) : 0.0f;
      row[j] = e;
      sum += e;
    }
    sum = block_reduce(sum, Sum{}, shared);
    for (long long j = threadIdx.x; j < c; j += blockDim.x) row[j] /= sum;
  }
}

// grads (in place) = probs * (grads - rowsum(probs * grads)), rows x c.
__global__ void softmax_backward_rows(const float* probs, float* grads, long long rows, long long c) {
  __shared__ float shared[32];
  for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* p = probs + r * c;
    float* g = grads + r * c;
    float dot = 0.0f;
    for (long long j = threadIdx.x; j < c; j += blockDim.x) dot += p[j] * g[j];
    dot = block_reduce(dot, Sum{}, shared);
    for (long long j = threadIdx.x; j < c; j += blockDim.x) g[j] = p[j] * (g[j] - dot);
  }
}

}  // namespace paradyse::kernels::softmax_kernels

namespace paradyse::ops::cuda {

void masked_softmax_forward(TensorView<float> scores, std::span<const PositionRun> query_runs,
                            std::span<const PositionRun> key_runs, bool causal) {
  const int rank = scores.rank();
  check(rank >= 2 && scores.is_contiguous(), "masked_softmax_forward: scores {} must be contiguous [..., n, c]",
        scores.shape());
  const std::int64_t n = scores.extent(rank - 2), c = scores.extent(rank - 1);
  const std::vector<std::int64_t> query_positions = cpu::softmax_detail::expand(query_runs, n, "query");
  const std::vector<std::int64_t> key_positions = cpu::softmax_detail::expand(key_runs, c, "key");
  const std::int64_t rows = c ? scores.numel() / c : 0;
  if (rows == 0) return;
  // Every row must see a key: with causal, the earliest key must not follow the query (ops::cpu's message; its
  // first failing row is the first failing query index, as rows cycle through the n queries).
  if (causal) {
    const std::int64_t first_key = *std::min_element(key_positions.begin(), key_positions.end());
    for (const std::int64_t position : query_positions)
      check(first_key <= position, "masked_softmax_forward: the query at position {} sees no key", position);
  }
  const cudaStream_t stream = device::current_stream();
  const kernels::StreamScratch queries = kernels::upload(std::span<const std::int64_t>(query_positions), stream);
  const kernels::StreamScratch keys = kernels::upload(std::span<const std::int64_t>(key_positions), stream);
  using namespace kernels::softmax_kernels;
  masked_softmax_rows<<<kernels::grid_for(rows, 1), kThreads, 0, stream>>>(
      scores.data(), rows, n, c, queries.as<std::int64_t>(), keys.as<std::int64_t>(), causal);
  device::check_launch("masked_softmax_rows");
}

void softmax_backward(TensorView<const float> probs, TensorView<float> grads) {
  check(probs.shape() == grads.shape() && probs.is_contiguous() && grads.is_contiguous() && probs.rank() >= 1,
        "softmax_backward: probs {} and grads {} must be contiguous and of one shape", probs.shape(), grads.shape());
  const std::int64_t c = probs.extent(-1), rows = c ? probs.numel() / c : 0;
  if (rows == 0) return;
  using namespace kernels::softmax_kernels;
  const cudaStream_t stream = device::current_stream();
  softmax_backward_rows<<<kernels::grid_for(rows, 1), kThreads, 0, stream>>>(probs.data(), grads.data(), rows, c);
  device::check_launch("softmax_backward_rows");
}

}  // namespace paradyse::ops::cuda
