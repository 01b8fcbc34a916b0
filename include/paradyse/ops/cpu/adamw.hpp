// paradyse/ops/cpu/adamw.hpp: one AdamW step (decoupled weight decay, bias correction) over a flat shard.
//
// Each rank updates its own contiguous shard of the parameters with the fully reduced gradient of that shard.
//   m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g^2
//   p -= lr * ( (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + epsilon) + weight_decay * p )
// The decay multiplies the parameter itself (Loshchilov & Hutter), not the gradient.
#pragma once

#include "paradyse/core/tensor.hpp"

#include <cmath>
#include <cstdint>

namespace paradyse::ops {

struct AdamWConfig {
  float learning_rate = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float epsilon = 1e-8f;
  float weight_decay = 0.01f;
};

}  // namespace paradyse::ops

namespace paradyse::ops::cpu {

// params, grads, m, v: the same number of elements, contiguous (any shapes). step: 1 for the first step.
// Updates params, m and v in place.
inline void adamw_step(TensorView<float> params, TensorView<const float> grads, TensorView<float> m,
                       TensorView<float> v, const AdamWConfig& config, std::int64_t step) {
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
  const float correction1 = float(1.0 - std::pow(double(config.beta1), double(step)));
  const float correction2 = float(1.0 - std::pow(double(config.beta2), double(step)));
  const float lr = config.learning_rate, decay = config.weight_decay, eps = config.epsilon;
  const float b1 = config.beta1, b2 = config.beta2;
  float* p = params.data();
  const float* g = grads.data();
  float* mm = m.data();
  float* vv = v.data();
  const float inv_c1 = 1.0f / correction1, inv_sqrt_c2 = 1.0f / std::sqrt(correction2);
  for (std::int64_t i = 0; i < n; ++i) {
    const float gi = g[i];
    const float mi = b1 * mm[i] + (1.0f - b1) * gi;
    const float vi = b2 * vv[i] + (1.0f - b2) * gi * gi;
    mm[i] = mi;
    vv[i] = vi;
    const float update = (mi * inv_c1) / (std::sqrt(vi) * inv_sqrt_c2 + eps);
    p[i] -= lr * (update + decay * p[i]);
  }
}

}  // namespace paradyse::ops::cpu
