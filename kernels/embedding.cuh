// kernels/embedding.cuh: the embedding kernels and the launchers ops/cuda/embedding.hpp declares.
//
// Forward: one block per token copies its table row. Backward, deterministic without atomics: CUB's stable radix
// sort orders the pairs (token id, token index) by id, keeping index order within an id; then one block per sorted
// position that starts a run of equal ids walks the run and adds the rows of dout, in index order, into the id's
// dtable row: acc = dtable[id][c]; acc += dout[i][c] for each i in order, exactly the CPU's sequence of additions.
#pragma once

#include "rows.cuh"
#include "paradyse/ops/cpu/rows.hpp"
#include "paradyse/ops/cuda/embedding.hpp"

#include <cub/device/device_radix_sort.cuh>

#include <bit>
#include <cstdint>
#include <limits>

namespace paradyse::kernels::dense {

// first_bad = the smallest index i with tokens[i] outside [0, vocab) (left at its initial all-ones value if none).
__global__ void find_bad_token_kernel(const std::int32_t* tokens, std::int64_t n, std::int64_t vocab,
                                      unsigned long long* first_bad) {
  for (std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int32_t t = tokens[i];
    if (t < 0 || t >= vocab) atomicMin(first_bad, static_cast<unsigned long long>(i));
  }
}

__global__ void embedding_forward_kernel(const std::int32_t* tokens, std::int64_t n, const float* table,
                                         std::int64_t ld, std::int64_t h, float* out, RowLayout out_rows) {
  for (std::int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const float* row = table + std::int64_t(tokens[i]) * ld;
    float* o = out + out_rows.offset(i);
    for (std::int64_t c = threadIdx.x; c < h; c += blockDim.x) o[c] = row[c];
  }
}

__global__ void iota_kernel(std::int32_t* values, std::int64_t n) {
  for (std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += std::int64_t(gridDim.x) * blockDim.x)
    values[i] = std::int32_t(i);
}

// sorted_ids / order: the ids sorted (stably) and the token index of each.
__global__ void embedding_backward_runs_kernel(const std::uint32_t* sorted_ids, const std::int32_t* order,
                                               std::int64_t n, const float* dout, RowLayout dout_rows,
                                               float* dtable, std::int64_t ld, std::int64_t h) {
  for (std::int64_t start = blockIdx.x; start < n; start += gridDim.x) {
    const std::uint32_t id = sorted_ids[start];
    if (start > 0 && sorted_ids[start - 1] == id) continue;  // not the first of its run (uniform over the block)
    float* row = dtable + std::int64_t(id) * ld;
    for (std::int64_t c = threadIdx.x; c < h; c += blockDim.x) {
      float acc = row[c];
      for (std::int64_t k = start; k < n && sorted_ids[k] == id; ++k) acc += dout[dout_rows.offset(order[k]) + c];
      row[c] = acc;
    }
  }
}

namespace embedding_detail {

// Throws ops::cpu's message for the first token outside [0, vocab); synchronises the stream.
inline void check_token_range(const char* op, const TensorView<const std::int32_t>& tokens, std::int64_t vocab) {
  const std::int64_t n = tokens.numel();
  if (n == 0) return;
  const cudaStream_t stream = device::current_stream();
  const StreamScratch bad_scratch(sizeof(unsigned long long), stream);
  unsigned long long* first_bad = bad_scratch.as<unsigned long long>();
  PARADYSE_CUDA_CHECK(cudaMemsetAsync(first_bad, 0xff, sizeof(unsigned long long), stream));
  constexpr int kThreads = 256;
  find_bad_token_kernel<<<grid_for(n, kThreads), kThreads, 0, stream>>>(tokens.data(), n, vocab, first_bad);
  device::check_launch("find_bad_token_kernel");
  unsigned long long bad = 0;
  PARADYSE_CUDA_CHECK(cudaMemcpyAsync(&bad, first_bad, sizeof bad, cudaMemcpyDeviceToHost, stream));
  device::synchronize();
  if (bad == std::numeric_limits<unsigned long long>::max()) return;
  std::int32_t token = 0;
  PARADYSE_CUDA_CHECK(cudaMemcpyAsync(&token, tokens.data() + bad, sizeof token, cudaMemcpyDeviceToHost, stream));
  device::synchronize();
  throw Error(fmt::format("{}: token {} at index {} is outside the vocabulary [0, {})", op, token, bad, vocab));
}

}  // namespace embedding_detail
}  // namespace paradyse::kernels::dense

namespace paradyse::ops::cuda {

void embedding_forward(TensorView<const std::int32_t> tokens, TensorView<const float> table, TensorView<float> out) {
  namespace kd = kernels::dense;
  constexpr const char* op = "embedding_forward";
  ops::cpu::detail::check_embedding_shapes(op, tokens, table, out);
  const std::int64_t vocab = table.extent(0), h = table.extent(1), n = tokens.numel();
  kd::embedding_detail::check_token_range(op, tokens, vocab);
  if (n == 0 || h == 0) return;
  const std::int64_t ld = vocab <= 1 ? h : table.strides()[0];
  kd::embedding_forward_kernel<<<kernels::grid_for(n, 1), 128, 0, device::current_stream()>>>(
      tokens.data(), n, table.data(), ld, h, out.data(), kd::row_layout(out));
  device::check_launch("embedding_forward_kernel");
}

void embedding_backward(TensorView<const std::int32_t> tokens, TensorView<const float> dout,
                        TensorView<float> dtable) {
  namespace kd = kernels::dense;
  constexpr const char* op = "embedding_backward";
  ops::cpu::detail::check_embedding_shapes(op, tokens, dtable, dout);
  const std::int64_t vocab = dtable.extent(0), h = dtable.extent(1), n = tokens.numel();
  check(n <= std::numeric_limits<std::int32_t>::max(), "{}: {} tokens exceed the 2^31 - 1 one call sorts", op, n);
  kd::embedding_detail::check_token_range(op, tokens, vocab);
  if (n == 0 || h == 0) return;
  const std::int64_t ld = vocab <= 1 ? h : dtable.strides()[0];
  const cudaStream_t stream = device::current_stream();
  // Every id is in [0, vocab) now, so as unsigned keys they sort like the signed ids and need only the low bits.
  const auto* ids = reinterpret_cast<const std::uint32_t*>(tokens.data());
  const int end_bit = std::max(1, int(std::bit_width(std::uint64_t(vocab - 1))));
  const kernels::StreamScratch sorted_scratch(std::size_t(n) * sizeof(std::uint32_t), stream);
  const kernels::StreamScratch indices_scratch(std::size_t(n) * sizeof(std::int32_t), stream);
  const kernels::StreamScratch order_scratch(std::size_t(n) * sizeof(std::int32_t), stream);
  std::uint32_t* sorted_ids = sorted_scratch.as<std::uint32_t>();
  std::int32_t* indices = indices_scratch.as<std::int32_t>();
  std::int32_t* order = order_scratch.as<std::int32_t>();
  kd::iota_kernel<<<kernels::grid_for(n, 256), 256, 0, stream>>>(indices, n);
  device::check_launch("iota_kernel");
  std::size_t temp_bytes = 0;
  PARADYSE_CUDA_CHECK(
      cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, ids, sorted_ids, indices, order, n, 0, end_bit, stream));
  temp_bytes = std::max<std::size_t>(temp_bytes, 1);  // a null temp pointer would make the next call a size query
  const kernels::StreamScratch temp(temp_bytes, stream);
  PARADYSE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.as<void>(), temp_bytes, ids, sorted_ids, indices, order, n,
                                                      0, end_bit, stream));
  kd::embedding_backward_runs_kernel<<<kernels::grid_for(n, 1), 128, 0, stream>>>(
      sorted_ids, order, n, dout.data(), kd::row_layout(dout), dtable.data(), ld, h);
  device::check_launch("embedding_backward_runs_kernel");
}

}  // namespace paradyse::ops::cuda
