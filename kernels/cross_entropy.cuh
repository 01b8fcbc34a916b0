// kernels/cross_entropy.cuh: the fused cross-entropy kernels and the launcher ops/cuda/cross_entropy.hpp
// declares.
//
// cross_entropy_rows_kernel: one block per row (grid-stride): the target logit is read first (dlogits may alias
// logits; the block reductions that follow order every read before any write), then the row maximum (NaN skipped as
// ops::cpu's maximum does), sum of e^(l - max), lse = max + log(sum), and dlogits. Each row's loss (a double, as the
// CPU accumulates) and whether it counted go to a per-row scratch; cross_entropy_total_kernel then sums them in one
// block in a fixed order.
#pragma once

#include "rows.cuh"
#include "paradyse/ops/cpu/rows.hpp"
#include "paradyse/ops/cuda/cross_entropy.hpp"

#include <cstdint>
#include <cstring>
#include <limits>

namespace paradyse::kernels::dense {

__global__ void cross_entropy_rows_kernel(const float* logits, RowLayout logit_rows, const std::int32_t* targets,
                                          float* dlogits, RowLayout dlogit_rows, std::int64_t rows,
                                          std::int64_t vocab, float grad_scale, std::int32_t ignore_index,
                                          double* row_loss, int* row_counted, unsigned long long* first_bad_row) {
  __shared__ float shared[32];
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* lr = logits + logit_rows.offset(r);
    float* dr = dlogits + dlogit_rows.offset(r);
    const std::int32_t target = targets[r];
    if (target == ignore_index || target < 0 || target >= vocab) {
      if (target != ignore_index && threadIdx.x == 0) atomicMin(first_bad_row, static_cast<unsigned long long>(r));
      for (std::int64_t c = threadIdx.x; c < vocab; c += blockDim.x) dr[c] = 0.0f;
      if (threadIdx.x == 0) row_loss[r] = 0.0, row_counted[r] = 0;
      continue;
    }
    const float target_logit = lr[target];
    float top = -INFINITY;
    for (std::int64_t c = threadIdx.x; c < vocab; c += blockDim.x) top = lr[c] > top ? lr[c] : top;
    top = block_reduce(top, shared, MaxOp{}, -INFINITY);
    float total = 0.0f;
    for (std::int64_t c = threadIdx.x; c < vocab; c += blockDim.x) total += expf(lr[c] - top);
    total = block_reduce(total, shared, SumOp{}, 0.0f);  // its barriers: every read of lr above precedes any write
    const float lse = top + logf(total);
    for (std::int64_t c = threadIdx.x; c < vocab; c += blockDim.x) {
      float g = grad_scale * expf(lr[c] - lse);
      if (c == target) g -= grad_scale;
      dr[c] = g;
    }
    if (threadIdx.x == 0) row_loss[r] = double(lse) - double(target_logit), row_counted[r] = 1;
    __syncthreads();  // the next row's reads of shared come after this row's last use
  }
}

// One block: totals[0] = sum of row_loss, counted[0] = sum of row_counted, in a fixed order.
__global__ void cross_entropy_total_kernel(const double* row_loss, const int* row_counted, std::int64_t rows,
                                           double* total_loss, long long* total_counted) {
  __shared__ double shared_loss[32];
  __shared__ long long shared_count[32];
  double loss = 0.0;
  long long counted = 0;
  for (std::int64_t r = threadIdx.x; r < rows; r += blockDim.x) loss += row_loss[r], counted += row_counted[r];
  loss = block_reduce(loss, shared_loss, SumOp{}, 0.0);
  counted = block_reduce(counted, shared_count, SumOp{}, 0LL);
  if (threadIdx.x == 0) *total_loss = loss, *total_counted = counted;
}

}  // namespace paradyse::kernels::dense

namespace paradyse::ops::cuda {

cpu::CrossEntropyResult cross_entropy_forward_backward(TensorView<const float> logits,
                                                       TensorView<const std::int32_t> targets,
                                                       TensorView<float> dlogits, float grad_scale,
                                                       std::int32_t ignore_index) {
  namespace d = ops::cpu::detail;
  namespace kd = kernels::dense;
  constexpr const char* op = "cross_entropy_forward_backward";
  d::check_rows(op, "logits", logits);
  d::check_rows(op, "dlogits", dlogits);
  d::check_same_shape(op, "logits", logits, "dlogits", dlogits);
  const std::int64_t vocab = logits.extent(-1), rows = d::row_count(logits);
  d::check_per_row(op, "targets", targets, rows);
  check(vocab > 0, "{}: the vocabulary is empty (logits {})", op, logits.shape());
  cpu::CrossEntropyResult result;
  if (rows == 0) return result;
  const cudaStream_t stream = device::current_stream();
  const kernels::StreamScratch row_loss(std::size_t(rows) * sizeof(double), stream);
  const kernels::StreamScratch row_counted(std::size_t(rows) * sizeof(int), stream);
  // totals: [loss (double), counted (long long), first bad row (unsigned long long)]
  const kernels::StreamScratch totals(3 * sizeof(std::uint64_t), stream);
  auto* first_bad = totals.as<unsigned long long>() + 2;
  PARADYSE_CUDA_CHECK(cudaMemsetAsync(first_bad, 0xff, sizeof(unsigned long long), stream));
  kd::cross_entropy_rows_kernel<<<kernels::grid_for(rows, 1), kd::kRowThreads, 0, stream>>>(
      logits.data(), kd::row_layout(logits), targets.data(), dlogits.data(), kd::row_layout(dlogits), rows, vocab,
      grad_scale, ignore_index, row_loss.as<double>(), row_counted.as<int>(), first_bad);
  device::check_launch("cross_entropy_rows_kernel");
  kd::cross_entropy_total_kernel<<<1, 1024, 0, stream>>>(row_loss.as<double>(), row_counted.as<int>(), rows,
                                                         totals.as<double>(), totals.as<long long>() + 1);
  device::check_launch("cross_entropy_total_kernel");
  std::uint64_t host[3] = {};
  PARADYSE_CUDA_CHECK(cudaMemcpyAsync(host, totals.as<void>(), sizeof host, cudaMemcpyDeviceToHost, stream));
  device::synchronize();
  if (host[2] != std::numeric_limits<std::uint64_t>::max()) {
    std::int32_t target = 0;
    PARADYSE_CUDA_CHECK(
        cudaMemcpyAsync(&target, targets.data() + host[2], sizeof target, cudaMemcpyDeviceToHost, stream));
    device::synchronize();
    throw Error(fmt::format("{}: target {} of row {} is outside [0, {}) and not ignore_index = {}", op, target, host[2],
                            vocab, ignore_index));
  }
  std::memcpy(&result.loss_sum, &host[0], sizeof(double));
  result.counted = std::int64_t(host[1]);
  return result;
}

}  // namespace paradyse::ops::cuda
