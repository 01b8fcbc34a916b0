// tests/ops/reference_layers.hpp: plain float64 references of the row-wise ops (norms, activations, rope,
// embedding, cross-entropy, AdamW), written for clarity. Tensors are flat row-major std::vector<double>; `rows`
// and `width` describe a [rows, width] matrix. Backward functions return the gradients (they do not accumulate).
#pragma once

#include "ops/reference.hpp"

#include <cmath>
#include <cstdint>
#include <numbers>
#include <vector>

namespace paradyse::testing {

// ---- LayerNorm ---------------------------------------------------------------------------------------------------
struct ReferenceNorm {
  Vec y, mean, rstd;
};

inline ReferenceNorm reference_layer_norm(const Vec& x, const Vec& gamma, const Vec& beta, double eps,
                                          std::int64_t rows, std::int64_t h) {
  ReferenceNorm r{Vec(x.size()), Vec(rows), Vec(rows)};
  for (std::int64_t i = 0; i < rows; ++i) {
    double mean = 0.0;
    for (std::int64_t c = 0; c < h; ++c) mean += x[i * h + c];
    mean /= double(h);
    double var = 0.0;
    for (std::int64_t c = 0; c < h; ++c) var += (x[i * h + c] - mean) * (x[i * h + c] - mean);
    var /= double(h);
    const double rstd = 1.0 / std::sqrt(var + eps);
    for (std::int64_t c = 0; c < h; ++c) r.y[i * h + c] = (x[i * h + c] - mean) * rstd * gamma[c] + beta[c];
    r.mean[i] = mean;
    r.rstd[i] = rstd;
  }
  return r;
}

struct ReferenceNormGrads {
  Vec dx, dgamma, dbeta;
};

// y_c = xhat_c * gamma_c + beta_c with xhat = (x - mean) rstd. Through the chain rule over mean and rstd:
// dx_c = rstd * (g_c - mean_k g_k - xhat_c * mean_k (g_k xhat_k)) with g = dy * gamma.
inline ReferenceNormGrads reference_layer_norm_backward(const Vec& x, const Vec& gamma, const Vec& dy, double eps,
                                                        std::int64_t rows, std::int64_t h) {
  const ReferenceNorm f = reference_layer_norm(x, gamma, Vec(h, 0.0), eps, rows, h);
  ReferenceNormGrads g{Vec(x.size(), 0.0), Vec(h, 0.0), Vec(h, 0.0)};
  for (std::int64_t i = 0; i < rows; ++i) {
    double mean_g = 0.0, mean_gx = 0.0;
    for (std::int64_t c = 0; c < h; ++c) {
      const double xhat = (x[i * h + c] - f.mean[i]) * f.rstd[i];
      mean_g += dy[i * h + c] * gamma[c] / double(h);
      mean_gx += dy[i * h + c] * gamma[c] * xhat / double(h);
    }
    for (std::int64_t c = 0; c < h; ++c) {
      const double xhat = (x[i * h + c] - f.mean[i]) * f.rstd[i];
      g.dx[i * h + c] = f.rstd[i] * (dy[i * h + c] * gamma[c] - mean_g - xhat * mean_gx);
      g.dgamma[c] += dy[i * h + c] * xhat;
      g.dbeta[c] += dy[i * h + c];
    }
  }
  return g;
}

// ---- RMSNorm -----------------------------------------------------------------------------------------------------
inline ReferenceNorm reference_rms_norm(const Vec& x, const Vec& gamma, double eps, std::int64_t rows,
                                        std::int64_t h) {
  ReferenceNorm r{Vec(x.size()), Vec(rows, 0.0), Vec(rows)};
  for (std::int64_t i = 0; i < rows; ++i) {
    double mean_square = 0.0;
    for (std::int64_t c = 0; c < h; ++c) mean_square += x[i * h + c] * x[i * h + c] / double(h);
    const double rstd = 1.0 / std::sqrt(mean_square + eps);
    for (std::int64_t c = 0; c < h; ++c) r.y[i * h + c] = x[i * h + c] * rstd * gamma[c];
    r.rstd[i] = rstd;
  }
  return r;
}

// dx_c = rstd * (g_c - xhat_c * mean_k (g_k xhat_k)), g = dy * gamma, xhat = x rstd.
inline ReferenceNormGrads reference_rms_norm_backward(const Vec& x, const Vec& gamma, const Vec& dy, double eps,
                                                      std::int64_t rows, std::int64_t h) {
  const ReferenceNorm f = reference_rms_norm(x, gamma, eps, rows, h);
  ReferenceNormGrads g{Vec(x.size(), 0.0), Vec(h, 0.0), {}};
  for (std::int64_t i = 0; i < rows; ++i) {
    double mean_gx = 0.0;
    for (std::int64_t c = 0; c < h; ++c) mean_gx += dy[i * h + c] * gamma[c] * x[i * h + c] * f.rstd[i] / double(h);
    for (std::int64_t c = 0; c < h; ++c) {
      const double xhat = x[i * h + c] * f.rstd[i];
      g.dx[i * h + c] = f.rstd[i] * (dy[i * h + c] * gamma[c] - xhat * mean_gx);
      g.dgamma[c] += dy[i * h + c] * xhat;
    }
  }
  return g;
}

// ---- GELU (tanh form) and SwiGLU ---------------------------------------------------------------------------------
inline double reference_gelu(double x) {
  const double k = std::sqrt(2.0 / std::numbers::pi);
  return 0.5 * x * (1.0 + std::tanh(k * (x + 0.044715 * x * x * x)));
}
inline double reference_gelu_derivative(double x) {
  const double k = std::sqrt(2.0 / std::numbers::pi);
  const double t = std::tanh(k * (x + 0.044715 * x * x * x));
  return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * x * x);
}
inline double reference_sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }
inline double reference_swiglu(double gate, double up) { return gate * reference_sigmoid(gate) * up; }
// d/dgate and d/dup of gate * sigmoid(gate) * up.
inline double reference_swiglu_dgate(double gate, double up) {
  const double s = reference_sigmoid(gate);
  return up * (s + gate * s * (1.0 - s));
}
inline double reference_swiglu_dup(double gate) { return gate * reference_sigmoid(gate); }

// ---- RoPE --------------------------------------------------------------------------------------------------------
// x: [b, s, heads, d]. Pairs (j, j + d/2) for halves, (2j, 2j + 1) for interleaved; angle position * theta^(-2j/d);
// position = offset + i, minus the start of its document when documents are given.
inline Vec reference_rope(const Vec& x, std::int64_t b, std::int64_t s, std::int64_t heads, std::int64_t d,
                          std::int64_t offset, double theta, bool interleaved,
                          const std::vector<std::int64_t>& document_starts, bool inverse) {
  Vec y(x.size());
  for (std::int64_t bi = 0; bi < b; ++bi)
    for (std::int64_t i = 0; i < s; ++i) {
      std::int64_t position = offset + i;
      std::int64_t start = 0;
      for (std::int64_t st : document_starts)
        if (st <= position) start = st;
      position -= start;
      for (std::int64_t h = 0; h < heads; ++h)
        for (std::int64_t j = 0; j < d / 2; ++j) {
          const double angle = double(position) * std::pow(theta, -2.0 * double(j) / double(d));
          const double c = std::cos(angle), sn = inverse ? -std::sin(angle) : std::sin(angle);
          const std::int64_t base = ((bi * s + i) * heads + h) * d;
          const std::int64_t first = base + (interleaved ? 2 * j : j);
          const std::int64_t second = base + (interleaved ? 2 * j + 1 : j + d / 2);
          y[first] = x[first] * c - x[second] * sn;
          y[second] = x[first] * sn + x[second] * c;
        }
    }
  return y;
}

// ---- cross-entropy -----------------------------------------------------------------------------------------------
struct ReferenceCrossEntropy {
  double loss_sum = 0.0;
  std::int64_t counted = 0;
  Vec dlogits;
};

inline ReferenceCrossEntropy reference_cross_entropy(const Vec& logits, const std::vector<std::int32_t>& targets,
                                                     std::int64_t rows, std::int64_t vocab, double grad_scale,
                                                     std::int32_t ignore_index) {
  ReferenceCrossEntropy r{0.0, 0, Vec(logits.size(), 0.0)};
  for (std::int64_t i = 0; i < rows; ++i) {
    if (targets[i] == ignore_index) continue;
    double top = -std::numeric_limits<double>::infinity();
    for (std::int64_t c = 0; c < vocab; ++c) top = std::max(top, logits[i * vocab + c]);
    double sum = 0.0;
    for (std::int64_t c = 0; c < vocab; ++c) sum += std::exp(logits[i * vocab + c] - top);
    const double lse = top + std::log(sum);
    r.loss_sum += lse - logits[i * vocab + targets[i]];
    ++r.counted;
    for (std::int64_t c = 0; c < vocab; ++c)
      r.dlogits[i * vocab + c] = grad_scale * (std::exp(logits[i * vocab + c] - lse) - (c == targets[i] ? 1.0 : 0.0));
  }
  return r;
}

// ---- AdamW -------------------------------------------------------------------------------------------------------
inline void reference_adamw(Vec& p, const Vec& g, Vec& m, Vec& v, double lr, double beta1, double beta2, double eps,
                            double weight_decay, std::int64_t step) {
  for (std::size_t i = 0; i < p.size(); ++i) {
    m[i] = beta1 * m[i] + (1 - beta1) * g[i];
    v[i] = beta2 * v[i] + (1 - beta2) * g[i] * g[i];
    const double m_hat = m[i] / (1 - std::pow(beta1, double(step)));
    const double v_hat = v[i] / (1 - std::pow(beta2, double(step)));
    p[i] -= lr * (m_hat / (std::sqrt(v_hat) + eps) + weight_decay * p[i]);
  }
}

}  // namespace paradyse::testing
