// kernels/normalization.cuh: the LayerNorm / RMSNorm kernels and the launchers ops/cuda/normalization.hpp
// declares.
//
// Forward: one block per row (grid-stride over rows): two-pass mean and variance (as ops::cpu: no cancellation),
// then y. Backward: one block per row for dx (its two row sums, then dx +=); the parameter gradients in two passes
// without atomics: each (column tile, chunk of rows) block sums its rows in row order into a scratch of per-chunk
// partials, then one thread per column adds its chunks in chunk order and += the result into dgamma / dbeta. The
// summation order depends on the shape only, so every run gives the same bits.
#pragma once

#include "rows.cuh"
#include "paradyse/ops/cpu/rows.hpp"
#include "paradyse/ops/cuda/normalization.hpp"

#include <cstdint>

namespace paradyse::kernels::dense {

// mean == nullptr: RMSNorm (xhat = x * rstd).
__global__ void norm_forward_kernel(const float* x, RowLayout x_rows, const float* gamma, const float* beta,
                                    float epsilon, float* y, RowLayout y_rows, float* mean, float* rstd,
                                    std::int64_t rows, std::int64_t h) {
  __shared__ float shared[32];
  const bool layer_norm = mean != nullptr;
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* xr = x + x_rows.offset(r);
    float* yr = y + y_rows.offset(r);
    float mu = 0.0f;
    if (layer_norm) {
      float partial = 0.0f;
      for (std::int64_t c = threadIdx.x; c < h; c += blockDim.x) partial += xr[c];
      mu = block_reduce(partial, shared, SumOp{}, 0.0f) / float(h);
    }
    float squares = 0.0f;
    for (std::int64_t c = threadIdx.x; c < h; c += blockDim.x) {
      const float centered = xr[c] - mu;
      squares += centered * centered;
    }
    const float inv = 1.0f / sqrtf(block_reduce(squares, shared, SumOp{}, 0.0f) / float(h) + epsilon);
    // Each thread reads and writes only its own columns, so y may alias x.
    for (std::int64_t c = threadIdx.x; c < h; c += blockDim.x)
      yr[c] = layer_norm ? (xr[c] - mu) * inv * gamma[c] + beta[c] : xr[c] * inv * gamma[c];
    if (threadIdx.x == 0) {
      if (layer_norm) mean[r] = mu;
      rstd[r] = inv;
    }
  }
}

// dx += rstd * (g - mean(g) - xhat * mean(g * xhat)) (LayerNorm) or rstd * (g - xhat * mean(g * xhat)) (RMSNorm,
// mean == nullptr), g = dy * gamma.
__global__ void norm_backward_dx_kernel(const float* x, RowLayout x_rows, const float* gamma, const float* mean,
                                        const float* rstd, const float* dy, RowLayout dy_rows, float* dx,
                                        RowLayout dx_rows, std::int64_t rows, std::int64_t h) {
  __shared__ float shared[32];
  const bool layer_norm = mean != nullptr;
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* xr = x + x_rows.offset(r);
    const float* dyr = dy + dy_rows.offset(r);
    float* dxr = dx + dx_rows.offset(r);
    const float mu = layer_norm ? mean[r] : 0.0f, inv = rstd[r];
    float partial_g = 0.0f, partial_gx = 0.0f;
    for (std::int64_t c = threadIdx.x; c < h; c += blockDim.x) {
      const float g = dyr[c] * gamma[c];
      partial_g += g;
      partial_gx += g * (xr[c] - mu) * inv;
    }
    const float mean_g = layer_norm ? block_reduce(partial_g, shared, SumOp{}, 0.0f) / float(h) : 0.0f;
    const float mean_gx = block_reduce(partial_gx, shared, SumOp{}, 0.0f) / float(h);
    for (std::int64_t c = threadIdx.x; c < h; c += blockDim.x) {
      const float xhat = (xr[c] - mu) * inv;
      dxr[c] += inv * (dyr[c] * gamma[c] - mean_g - xhat * mean_gx);
    }
  }
}

// Pass 1 of the parameter gradients: block (column tile, chunk) writes, for each column of its tile, the sums over
// the chunk's rows (in row order) of dy * xhat into gamma_partials[chunk][column] and, when beta_partials is given,
// of dy into beta_partials[chunk][column].
__global__ void norm_parameter_partials_kernel(const float* x, RowLayout x_rows, const float* mean, const float* rstd,
                                               const float* dy, RowLayout dy_rows, std::int64_t rows, std::int64_t h,
                                               std::int64_t rows_per_chunk, float* gamma_partials,
                                               float* beta_partials) {
  const std::int64_t column = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::int64_t chunk = blockIdx.y;
  if (column >= h) return;
  const std::int64_t first = chunk * rows_per_chunk;
  const std::int64_t last = first + rows_per_chunk < rows ? first + rows_per_chunk : rows;
  float sum_gamma = 0.0f, sum_beta = 0.0f;
  for (std::int64_t r = first; r < last; ++r) {
    const float mu = mean ? mean[r] : 0.0f;
    const float d = dy[dy_rows.offset(r) + column];
    sum_gamma += d * (x[x_rows.offset(r) + column] - mu) * rstd[r];
    sum_beta += d;
  }
  gamma_partials[chunk * h + column] = sum_gamma;
  if (beta_partials) beta_partials[chunk * h + column] = sum_beta;
}

// Pass 2: out[column] += the sum of partials[0..chunks)[column], in chunk order.
__global__ void add_column_sums_kernel(const float* partials, std::int64_t chunks, std::int64_t h, float* out) {
  const std::int64_t column = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (column >= h) return;
  float sum = 0.0f;
  for (std::int64_t k = 0; k < chunks; ++k) sum += partials[k * h + column];
  out[column] += sum;
}

namespace normalization_detail {

// dgamma (+ dbeta when given) += the row sums, deterministically (see the top of this file).
inline void accumulate_parameter_gradients(const TensorView<const float>& x, const float* mean, const float* rstd,
                                           const TensorView<const float>& dy, float* dgamma, float* dbeta) {
  const std::int64_t h = x.extent(-1), rows = ops::cpu::detail::row_count(x);
  constexpr std::int64_t kColumnsPerBlock = 128, kMaxChunks = 65535;  // gridDim.y limit
  std::int64_t rows_per_chunk = 64;
  if ((rows + rows_per_chunk - 1) / rows_per_chunk > kMaxChunks) rows_per_chunk = (rows + kMaxChunks - 1) / kMaxChunks;
  const std::int64_t chunks = (rows + rows_per_chunk - 1) / rows_per_chunk;
  const cudaStream_t stream = device::current_stream();
  const StreamScratch gamma_scratch(std::size_t(chunks * h) * sizeof(float), stream);
  const StreamScratch beta_scratch(dbeta ? std::size_t(chunks * h) * sizeof(float) : 0, stream);
  float* gamma_partials = gamma_scratch.as<float>();
  float* beta_partials = beta_scratch.as<float>();
  const dim3 grid(grid_for(h, kColumnsPerBlock), unsigned(chunks));
  norm_parameter_partials_kernel<<<grid, kColumnsPerBlock, 0, stream>>>(
      x.data(), row_layout(x), mean, rstd, dy.data(), row_layout(dy), rows, h, rows_per_chunk, gamma_partials,
      beta_partials);
  device::check_launch("norm_parameter_partials_kernel");
  add_column_sums_kernel<<<grid_for(h, kColumnsPerBlock), kColumnsPerBlock, 0, stream>>>(gamma_partials, chunks,
                                                                                         h, dgamma);
  device::check_launch("add_column_sums_kernel");
  if (dbeta) {
    add_column_sums_kernel<<<grid_for(h, kColumnsPerBlock), kColumnsPerBlock, 0, stream>>>(beta_partials,
                                                                                           chunks, h, dbeta);
    device::check_launch("add_column_sums_kernel");
  }
}

}  // namespace normalization_detail
}  // namespace paradyse::kernels::dense

namespace paradyse::ops::cuda {

void layer_norm_forward(TensorView<const float> x, TensorView<const float> gamma, TensorView<const float> beta,
                        float epsilon, TensorView<float> y, TensorView<float> mean, TensorView<float> rstd) {
  namespace d = ops::cpu::detail;
  namespace kd = kernels::dense;
  constexpr const char* op = "layer_norm_forward";
  d::check_rows(op, "x", x);
  d::check_rows(op, "y", y);
  d::check_same_shape(op, "x", x, "y", y);
  const std::int64_t h = x.extent(-1), rows = d::row_count(x);
  d::check_vector(op, "gamma", gamma, h);
  d::check_vector(op, "beta", beta, h);
  d::check_per_row(op, "mean", mean, rows);
  d::check_per_row(op, "rstd", rstd, rows);
  check(epsilon >= 0.0f && h > 0, "{}: epsilon = {} must be non-negative and h = {} positive", op, epsilon, h);
  if (rows == 0) return;
  kd::norm_forward_kernel<<<kernels::grid_for(rows, 1), kd::kRowThreads, 0, device::current_stream()>>>(
      x.data(), kd::row_layout(x), gamma.data(), beta.data(), epsilon, y.data(), kd::row_layout(y),
      mean.data(), rstd.data(), rows, h);
  device::check_launch("norm_forward_kernel (layer_norm_forward)");
}

void layer_norm_backward(TensorView<const float> x, TensorView<const float> gamma, TensorView<const float> mean,
                         TensorView<const float> rstd, TensorView<const float> dy, TensorView<float> dx,
                         TensorView<float> dgamma, TensorView<float> dbeta) {
  namespace d = ops::cpu::detail;
  namespace kd = kernels::dense;
  constexpr const char* op = "layer_norm_backward";
  d::check_rows(op, "x", x);
  d::check_rows(op, "dy", dy);
  d::check_rows(op, "dx", dx);
  d::check_same_shape(op, "x", x, "dy", dy);
  d::check_same_shape(op, "x", x, "dx", dx);
  const std::int64_t h = x.extent(-1), rows = d::row_count(x);
  d::check_vector(op, "gamma", gamma, h);
  d::check_vector(op, "dgamma", dgamma, h);
  d::check_vector(op, "dbeta", dbeta, h);
  d::check_per_row(op, "mean", mean, rows);
  d::check_per_row(op, "rstd", rstd, rows);
  if (rows == 0 || h == 0) return;
  kd::norm_backward_dx_kernel<<<kernels::grid_for(rows, 1), kd::kRowThreads, 0, device::current_stream()>>>(
      x.data(), kd::row_layout(x), gamma.data(), mean.data(), rstd.data(), dy.data(), kd::row_layout(dy),
      dx.data(), kd::row_layout(dx), rows, h);
  device::check_launch("norm_backward_dx_kernel (layer_norm_backward)");
  kd::normalization_detail::accumulate_parameter_gradients(x, mean.data(), rstd.data(), dy, dgamma.data(),
                                                                dbeta.data());
}

void rms_norm_forward(TensorView<const float> x, TensorView<const float> gamma, float epsilon, TensorView<float> y,
                      TensorView<float> rstd) {
  namespace d = ops::cpu::detail;
  namespace kd = kernels::dense;
  constexpr const char* op = "rms_norm_forward";
  d::check_rows(op, "x", x);
  d::check_rows(op, "y", y);
  d::check_same_shape(op, "x", x, "y", y);
  const std::int64_t h = x.extent(-1), rows = d::row_count(x);
  d::check_vector(op, "gamma", gamma, h);
  d::check_per_row(op, "rstd", rstd, rows);
  check(epsilon >= 0.0f && h > 0, "{}: epsilon = {} must be non-negative and h = {} positive", op, epsilon, h);
  if (rows == 0) return;
  kd::norm_forward_kernel<<<kernels::grid_for(rows, 1), kd::kRowThreads, 0, device::current_stream()>>>(
      x.data(), kd::row_layout(x), gamma.data(), nullptr, epsilon, y.data(), kd::row_layout(y), nullptr,
      rstd.data(), rows, h);
  device::check_launch("norm_forward_kernel (rms_norm_forward)");
}

void rms_norm_backward(TensorView<const float> x, TensorView<const float> gamma, TensorView<const float> rstd,
                       TensorView<const float> dy, TensorView<float> dx, TensorView<float> dgamma) {
  namespace d = ops::cpu::detail;
  namespace kd = kernels::dense;
  constexpr const char* op = "rms_norm_backward";
  d::check_rows(op, "x", x);
  d::check_rows(op, "dy", dy);
  d::check_rows(op, "dx", dx);
  d::check_same_shape(op, "x", x, "dy", dy);
  d::check_same_shape(op, "x", x, "dx", dx);
  const std::int64_t h = x.extent(-1), rows = d::row_count(x);
  d::check_vector(op, "gamma", gamma, h);
  d::check_vector(op, "dgamma", dgamma, h);
  d::check_per_row(op, "rstd", rstd, rows);
  if (rows == 0 || h == 0) return;
  kd::norm_backward_dx_kernel<<<kernels::grid_for(rows, 1), kd::kRowThreads, 0, device::current_stream()>>>(
      x.data(), kd::row_layout(x), gamma.data(), nullptr, rstd.data(), dy.data(), kd::row_layout(dy),
      dx.data(), kd::row_layout(dx), rows, h);
  device::check_launch("norm_backward_dx_kernel (rms_norm_backward)");
  kd::normalization_detail::accumulate_parameter_gradients(x, nullptr, rstd.data(), dy, dgamma.data(), nullptr);
}

}  // namespace paradyse::ops::cuda
