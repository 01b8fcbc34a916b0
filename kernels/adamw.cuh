// kernels/adamw.cuh: the AdamW kernel and the launcher ops/cuda/adamw.hpp declares. One thread per element
// (grid-stride); the bias corrections are computed on the host in double, as ops::cpu does.
#pragma once

#include "stream_scratch.cuh"
#include "paradyse/ops/cuda/adamw.hpp"

#include <cmath>
#include <cstdint>

namespace paradyse::kernels::dense {

struct AdamWScalars {
  float lr, decay, eps, b1, b2, inv_c1, inv_sqrt_c2;
};

__global__ void adamw_kernel(float* p, const float* g, float* m, float* v, std::int64_t n, AdamWScalars s) {
  for (std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += std::int64_t(gridDim.x) * blockDim.x) {
    const float gi = g[i];
    const float mi = s.b1 * m[i] + (1.0f - s.b1) * gi;
    const float vi = s.b2 * v[i] + (1.0f - s.b2) * gi * gi;
    m[i] = mi;
    v[i] = vi;
    const float update = (mi * s.inv_c1) / (sqrtf(vi) * s.inv_sqrt_c2 + s.eps);
    p[i] -= s.lr * (update + s.decay * p[i]);
  }
}

}  // namespace paradyse::kernels::dense

namespace paradyse::ops::cuda {

void adamw_step(TensorView<float> params, TensorView<const float> grads, TensorView<float> m, TensorView<float> v,
                const AdamWConfig& config, std::int64_t step) {
  constexpr const char* op = "adamw_step";
  const std::int64_t n = params.numel();
  check(grads.numel() == n && m.numel() == n && v.numel() == n,
        "{}: params ({}), grads ({}), m ({}) and v ({}) must have the same number of elements", op, n, grads.numel(),
        m.numel(), v.numel());
  check(params.is_contiguous() && grads.is_contiguous() && m.is_contiguous() && v.is_contiguous(),
        "{}: params, grads, m and v must be contiguous", op);
  check(step >= 1, "{}: step = {} must be at least 1 (bias correction divides by 1 - beta^step)", op, step);
  check(config.beta1 >= 0.0f && config.beta1 < 1.0f && config.beta2 >= 0.0f && config.beta2 < 1.0f,
        "{}: beta1 = {} and beta2 = {} must be in [0, 1)", op, config.beta1, config.beta2);
  check(config.epsilon > 0.0f && config.learning_rate >= 0.0f && config.weight_decay >= 0.0f,
        "{}: epsilon = {} must be positive, learning_rate = {} and weight_decay = {} non-negative", op, config.epsilon,
        config.learning_rate, config.weight_decay);
  if (n == 0) return;
  const float correction1 = float(1.0 - std::pow(double(config.beta1), double(step)));
  const float correction2 = float(1.0 - std::pow(double(config.beta2), double(step)));
  const kernels::dense::AdamWScalars s{config.learning_rate, config.weight_decay, config.epsilon, config.beta1,
                                       config.beta2,         1.0f / correction1,  1.0f / std::sqrt(correction2)};
  constexpr unsigned kThreads = 256;
  kernels::dense::adamw_kernel<<<kernels::grid_for(n, kThreads), kThreads, 0, device::current_stream()>>>(
      params.data(), grads.data(), m.data(), v.data(), n, s);
  device::check_launch("adamw_kernel");
}

}  // namespace paradyse::ops::cuda
