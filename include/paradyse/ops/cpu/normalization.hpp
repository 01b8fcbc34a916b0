// paradyse/ops/cpu/normalization.hpp: LayerNorm and RMSNorm over the last dimension, forward and backward.
//
// Conventions of every ops::cpu backward: gradients ACCUMULATE (+=) into the gradient outputs (input and
// parameter gradients alike), so a caller zeroes them once and a residual stream or several micro-batches add up.
// Forward outputs are overwritten. Statistics are saved per row (mean and rstd = 1/sqrt(var + eps)).
#pragma once

#include "paradyse/core/tensor.hpp"
#include "paradyse/ops/cpu/rows.hpp"
#include "paradyse/ops/cpu/vector_math.hpp"

#include <cmath>
#include <cstdint>

namespace paradyse::ops::cpu {

// x: [..., h]; gamma, beta: [h]; y: [..., h] (overwritten; may alias x); mean, rstd: one float per row, contiguous
// (e.g. [b, s] for x [b, s, h]), overwritten and saved for backward. y = (x - mean) * rstd * gamma + beta.
inline void layer_norm_forward(TensorView<const float> x, TensorView<const float> gamma, TensorView<const float> beta,
                               float epsilon, TensorView<float> y, TensorView<float> mean, TensorView<float> rstd) {
  constexpr const char* op = "layer_norm_forward";
  detail::check_rows(op, "x", x);
  detail::check_rows(op, "y", y);
  detail::check_same_shape(op, "x", x, "y", y);
  const std::int64_t h = x.extent(-1), rows = detail::row_count(x);
  detail::check_vector(op, "gamma", gamma, h);
  detail::check_vector(op, "beta", beta, h);
  detail::check_per_row(op, "mean", mean, rows);
  detail::check_per_row(op, "rstd", rstd, rows);
  check(epsilon >= 0.0f && h > 0, "{}: epsilon = {} must be non-negative and h = {} positive", op, epsilon, h);
  const float* g = gamma.data();
  const float* b = beta.data();
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* xr = detail::row_pointer(x, r);
    float* yr = detail::row_pointer(y, r);
    const float mu = sum(xr, h) / float(h);
    const float variance = sum_of_squares(xr, h, mu) / float(h);  // two-pass: no cancellation
    const float inv = 1.0f / std::sqrt(variance + epsilon);
    for (std::int64_t c = 0; c < h; ++c) yr[c] = (xr[c] - mu) * inv * g[c] + b[c];
    mean.data()[r] = mu;
    rstd.data()[r] = inv;
  }
}

// Accumulates dx: [..., h], dgamma, dbeta: [h] from dy: [..., h] and the saved mean, rstd.
// With xhat = (x - mean) * rstd and g = dy * gamma: dx += rstd * (g - mean(g) - xhat * mean(g * xhat)),
// dgamma += sum over rows of dy * xhat, dbeta += sum over rows of dy.
inline void layer_norm_backward(TensorView<const float> x, TensorView<const float> gamma,
                                TensorView<const float> mean, TensorView<const float> rstd,
                                TensorView<const float> dy, TensorView<float> dx, TensorView<float> dgamma,
                                TensorView<float> dbeta) {
  constexpr const char* op = "layer_norm_backward";
  detail::check_rows(op, "x", x);
  detail::check_rows(op, "dy", dy);
  detail::check_rows(op, "dx", dx);
  detail::check_same_shape(op, "x", x, "dy", dy);
  detail::check_same_shape(op, "x", x, "dx", dx);
  const std::int64_t h = x.extent(-1), rows = detail::row_count(x);
  detail::check_vector(op, "gamma", gamma, h);
  detail::check_vector(op, "dgamma", dgamma, h);
  detail::check_vector(op, "dbeta", dbeta, h);
  detail::check_per_row(op, "mean", mean, rows);
  detail::check_per_row(op, "rstd", rstd, rows);
  const float* g = gamma.data();
  float* dg = dgamma.data();
  float* db = dbeta.data();
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* xr = detail::row_pointer(x, r);
    const float* dyr = detail::row_pointer(dy, r);
    float* dxr = detail::row_pointer(dx, r);
    const float mu = mean.data()[r], inv = rstd.data()[r];
    float lanes_g[kReductionLanes] = {}, lanes_gx[kReductionLanes] = {};
    std::int64_t c = 0;
    for (; c + kReductionLanes <= h; c += kReductionLanes)
      for (int l = 0; l < kReductionLanes; ++l) {
        const float xhat = (xr[c + l] - mu) * inv, gc = dyr[c + l] * g[c + l];
        lanes_g[l] += gc;
        lanes_gx[l] += gc * xhat;
      }
    float sum_g = 0.0f, sum_gx = 0.0f;
    for (int l = 0; l < kReductionLanes; ++l) sum_g += lanes_g[l], sum_gx += lanes_gx[l];
    for (; c < h; ++c) {
      const float xhat = (xr[c] - mu) * inv, gc = dyr[c] * g[c];
      sum_g += gc;
      sum_gx += gc * xhat;
    }
    const float mean_g = sum_g / float(h), mean_gx = sum_gx / float(h);
    for (c = 0; c < h; ++c) {
      const float xhat = (xr[c] - mu) * inv;
      dxr[c] += inv * (dyr[c] * g[c] - mean_g - xhat * mean_gx);
      dg[c] += dyr[c] * xhat;
      db[c] += dyr[c];
    }
  }
}

// x: [..., h]; gamma: [h]; y: [..., h] (overwritten; may alias x); rstd: one float per row, contiguous, saved.
// y = x * rstd * gamma with rstd = 1 / sqrt(mean(x^2) + epsilon).
inline void rms_norm_forward(TensorView<const float> x, TensorView<const float> gamma, float epsilon,
                             TensorView<float> y, TensorView<float> rstd) {
  constexpr const char* op = "rms_norm_forward";
  detail::check_rows(op, "x", x);
  detail::check_rows(op, "y", y);
  detail::check_same_shape(op, "x", x, "y", y);
  const std::int64_t h = x.extent(-1), rows = detail::row_count(x);
  detail::check_vector(op, "gamma", gamma, h);
  detail::check_per_row(op, "rstd", rstd, rows);
  check(epsilon >= 0.0f && h > 0, "{}: epsilon = {} must be non-negative and h = {} positive", op, epsilon, h);
  const float* g = gamma.data();
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* xr = detail::row_pointer(x, r);
    float* yr = detail::row_pointer(y, r);
    const float inv = 1.0f / std::sqrt(sum_of_squares(xr, h, 0.0f) / float(h) + epsilon);
    for (std::int64_t c = 0; c < h; ++c) yr[c] = xr[c] * inv * g[c];
    rstd.data()[r] = inv;
  }
}

// Accumulates dx: [..., h] and dgamma: [h]. With xhat = x * rstd and g = dy * gamma:
// dx += rstd * (g - xhat * mean(g * xhat)), dgamma += sum over rows of dy * xhat.
inline void rms_norm_backward(TensorView<const float> x, TensorView<const float> gamma, TensorView<const float> rstd,
                              TensorView<const float> dy, TensorView<float> dx, TensorView<float> dgamma) {
  constexpr const char* op = "rms_norm_backward";
  detail::check_rows(op, "x", x);
  detail::check_rows(op, "dy", dy);
  detail::check_rows(op, "dx", dx);
  detail::check_same_shape(op, "x", x, "dy", dy);
  detail::check_same_shape(op, "x", x, "dx", dx);
  const std::int64_t h = x.extent(-1), rows = detail::row_count(x);
  detail::check_vector(op, "gamma", gamma, h);
  detail::check_vector(op, "dgamma", dgamma, h);
  detail::check_per_row(op, "rstd", rstd, rows);
  const float* g = gamma.data();
  float* dg = dgamma.data();
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* xr = detail::row_pointer(x, r);
    const float* dyr = detail::row_pointer(dy, r);
    float* dxr = detail::row_pointer(dx, r);
    const float inv = rstd.data()[r];
    float lanes[kReductionLanes] = {};
    std::int64_t c = 0;
    for (; c + kReductionLanes <= h; c += kReductionLanes)
      for (int l = 0; l < kReductionLanes; ++l) lanes[l] += dyr[c + l] * g[c + l] * xr[c + l] * inv;
    float sum_gx = 0.0f;
    for (int l = 0; l < kReductionLanes; ++l) sum_gx += lanes[l];
    for (; c < h; ++c) sum_gx += dyr[c] * g[c] * xr[c] * inv;
    const float mean_gx = sum_gx / float(h);
    for (c = 0; c < h; ++c) {
      const float xhat = xr[c] * inv;
      dxr[c] += inv * (dyr[c] * g[c] - xhat * mean_gx);
      dg[c] += dyr[c] * xhat;
    }
  }
}

}  // namespace paradyse::ops::cpu
