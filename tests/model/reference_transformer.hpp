// tests/model/reference_transformer.hpp: a plain float64, single-rank Transformer layer, forward and backward.
//
// Written for clarity, not speed: every sublayer is a few loops over the global weights (contract/weight_shards.hpp's
// GlobalLayerWeights), tokens in natural order x: [b, s, h]. Backward recomputes what it needs from the inputs.
// The strategies are checked against these functions; these functions are checked by finite differences
// (reference_transformer.cpp). Conventions shared with the CPU ops: GELU in its tanh form; SwiGLU = silu(gate) * up;
// RoPE rotates the pairs (i, i + d/2) by position * base^(-2i/d); the softmax scale is 1/sqrt(d).
#pragma once

#include "paradyse/core/tensor.hpp"
#include "paradyse/contract/layer_config.hpp"
#include "paradyse/contract/weight_shards.hpp"

#include <cmath>
#include <cstdint>
#include <limits>
#include <numbers>
#include <vector>

namespace paradyse::testing::ref {

using Matrix = Tensor<double>;

// y: [T, out] = x: [T, in] * w^T (w: [out, in]).
inline Matrix linear(const Matrix& x, const Matrix& w) {
  const std::int64_t tokens = x.extent(0), in = x.extent(1), out = w.extent(0);
  Matrix y(Shape{tokens, out});
  for (std::int64_t t = 0; t < tokens; ++t)
    for (std::int64_t o = 0; o < out; ++o) {
      double sum = 0.0;
      for (std::int64_t i = 0; i < in; ++i) sum += x(t, i) * w(o, i);
      y(t, o) = sum;
    }
  return y;
}
// dx += dy * w; dw += dy^T * x for y = x * w^T.
inline void linear_backward(const Matrix& x, const Matrix& w, const Matrix& dy, Matrix& dx, Matrix& dw) {
  const std::int64_t tokens = x.extent(0), in = x.extent(1), out = w.extent(0);
  for (std::int64_t t = 0; t < tokens; ++t)
    for (std::int64_t o = 0; o < out; ++o) {
      const double g = dy(t, o);
      for (std::int64_t i = 0; i < in; ++i) {
        dx(t, i) += g * w(o, i);
        dw(o, i) += g * x(t, i);
      }
    }
}
// y: [T, h] = a: [T, in] * w (w: [in, h]).
inline Matrix linear_rows(const Matrix& a, const Matrix& w) {
  const std::int64_t tokens = a.extent(0), in = a.extent(1), out = w.extent(1);
  Matrix y(Shape{tokens, out});
  for (std::int64_t t = 0; t < tokens; ++t)
    for (std::int64_t i = 0; i < in; ++i)
      for (std::int64_t o = 0; o < out; ++o) y(t, o) += a(t, i) * w(i, o);
  return y;
}
// da += dy * w^T; dw += a^T * dy for y = a * w.
inline void linear_rows_backward(const Matrix& a, const Matrix& w, const Matrix& dy, Matrix& da, Matrix& dw) {
  const std::int64_t tokens = a.extent(0), in = a.extent(1), out = w.extent(1);
  for (std::int64_t t = 0; t < tokens; ++t)
    for (std::int64_t i = 0; i < in; ++i)
      for (std::int64_t o = 0; o < out; ++o) {
        da(t, i) += dy(t, o) * w(i, o);
        dw(i, o) += a(t, i) * dy(t, o);
      }
}

inline Matrix as_tokens(const Matrix& x) {  // [b, s, h] -> [b*s, h] (a copy)
  Matrix y = Matrix::copy_of(x.view());
  y.reshape(Shape{x.extent(0) * x.extent(1), x.extent(2)});
  return y;
}

// ---- RoPE --------------------------------------------------------------------------------------------------------
// Rotates every head of x: [T, heads * d] (token t of batch row t / s at position t % s); inverse = true undoes it
// (the backward of a rotation is the rotation by the opposite angle).
// With `documents` (packed documents: the start of each in the sequence, first 0) a position counts from its
// document's start.
inline std::int64_t document_of(const std::vector<std::int64_t>& documents, std::int64_t position) {
  std::int64_t doc = -1;
  for (std::int64_t start : documents) doc += start <= position ? 1 : 0;
  return doc;
}
inline void rope(Matrix& x, std::int64_t seq, std::int64_t d, double base, bool inverse,
                 const std::vector<std::int64_t>& documents = {}) {
  const std::int64_t tokens = x.extent(0), heads = x.extent(1) / d, half = d / 2;
  for (std::int64_t t = 0; t < tokens; ++t) {
    const std::int64_t in_sequence = t % seq;
    const double position =
        double(documents.empty() ? in_sequence : in_sequence - documents[std::size_t(document_of(documents, in_sequence))]);
    for (std::int64_t head = 0; head < heads; ++head)
      for (std::int64_t i = 0; i < half; ++i) {
        const double angle = position * std::pow(base, -2.0 * double(i) / double(d)) * (inverse ? -1.0 : 1.0);
        const double c = std::cos(angle), s = std::sin(angle);
        double& a = x(t, head * d + i);
        double& b = x(t, head * d + i + half);
        const double a0 = a, b0 = b;
        a = a0 * c - b0 * s;
        b = a0 * s + b0 * c;
      }
  }
}

// ---- attention core ------------------------------------------------------------------------------------------------
// q: [b*s, hq*d], k, v: [b*s, hkv*d] -> out: [b*s, hq*d]; softmax(q k^T / sqrt(d)) v per (batch, head).
struct AttentionCore {
  std::int64_t batch, seq, q_heads, kv_heads, d;
  bool causal;
  std::vector<std::int64_t> documents = {};  // packed documents: a query sees keys of its own document only

  std::int64_t kv_of(std::int64_t head) const { return head / (q_heads / kv_heads); }
  bool visible(std::int64_t i, std::int64_t j) const {
    return (!causal || j <= i) && (documents.empty() || document_of(documents, i) == document_of(documents, j));
  }

  // probabilities [b, hq, s, s]
  Matrix probabilities(const Matrix& q, const Matrix& k) const {
    Matrix p(Shape{batch, q_heads, seq, seq});
    const double scale = 1.0 / std::sqrt(double(d));
    for (std::int64_t b = 0; b < batch; ++b)
      for (std::int64_t head = 0; head < q_heads; ++head)
        for (std::int64_t i = 0; i < seq; ++i) {
          std::vector<double> score(std::size_t(seq), -std::numeric_limits<double>::infinity());
          double max = -std::numeric_limits<double>::infinity();
          for (std::int64_t j = 0; j < seq; ++j) {
            if (!visible(i, j)) continue;
            double dot = 0.0;
            for (std::int64_t e = 0; e < d; ++e) dot += q(b * seq + i, head * d + e) * k(b * seq + j, kv_of(head) * d + e);
            score[std::size_t(j)] = dot * scale;
            max = std::max(max, score[std::size_t(j)]);
          }
          double sum = 0.0;
          for (std::int64_t j = 0; j < seq; ++j)
            if (visible(i, j)) sum += std::exp(score[std::size_t(j)] - max);
          for (std::int64_t j = 0; j < seq; ++j)
            p(b, head, i, j) = visible(i, j) ? std::exp(score[std::size_t(j)] - max) / sum : 0.0;
        }
    return p;
  }

  Matrix forward(const Matrix& q, const Matrix& k, const Matrix& v) const {
    const Matrix p = probabilities(q, k);
    Matrix out(Shape{batch * seq, q_heads * d});
    for (std::int64_t b = 0; b < batch; ++b)
      for (std::int64_t head = 0; head < q_heads; ++head)
        for (std::int64_t i = 0; i < seq; ++i)
          for (std::int64_t j = 0; j < seq; ++j)
            for (std::int64_t e = 0; e < d; ++e)
              out(b * seq + i, head * d + e) += p(b, head, i, j) * v(b * seq + j, kv_of(head) * d + e);
    return out;
  }

  // Accumulates dq, dk, dv.
  void backward(const Matrix& q, const Matrix& k, const Matrix& v, const Matrix& dout, Matrix& dq, Matrix& dk,
                Matrix& dv) const {
    const Matrix p = probabilities(q, k);
    const double scale = 1.0 / std::sqrt(double(d));
    for (std::int64_t b = 0; b < batch; ++b)
      for (std::int64_t head = 0; head < q_heads; ++head)
        for (std::int64_t i = 0; i < seq; ++i) {
          std::vector<double> dp(std::size_t(seq), 0.0);
          double row = 0.0;  // sum_j p_ij dp_ij
          for (std::int64_t j = 0; j < seq; ++j) {
            for (std::int64_t e = 0; e < d; ++e) {
              dp[std::size_t(j)] += dout(b * seq + i, head * d + e) * v(b * seq + j, kv_of(head) * d + e);
              dv(b * seq + j, kv_of(head) * d + e) += p(b, head, i, j) * dout(b * seq + i, head * d + e);
            }
            row += p(b, head, i, j) * dp[std::size_t(j)];
          }
          for (std::int64_t j = 0; j < seq; ++j) {
            const double ds = p(b, head, i, j) * (dp[std::size_t(j)] - row) * scale;
            for (std::int64_t e = 0; e < d; ++e) {
              dq(b * seq + i, head * d + e) += ds * k(b * seq + j, kv_of(head) * d + e);
              dk(b * seq + j, kv_of(head) * d + e) += ds * q(b * seq + i, head * d + e);
            }
          }
        }
  }
};

// ---- sublayers -----------------------------------------------------------------------------------------------------
// y: [b, s, h] = Attention(x: [b, s, h]) (no norm, no residual).
// documents: packed documents of every sample (the start of each, first 0); empty: one document.
inline Matrix attention_forward(const LayerConfig& c, const GlobalLayerWeights<double>& w, const Matrix& x,
                                const std::vector<std::int64_t>& documents = {}) {
  const std::int64_t batch = x.extent(0), seq = x.extent(1);
  const Matrix tokens = as_tokens(x);
  Matrix q = linear(tokens, w.w_q), k = linear(tokens, w.w_k), v = linear(tokens, w.w_v);
  if (c.rope) {
    rope(q, seq, c.head_dim, c.rope_base, false, documents);
    rope(k, seq, c.head_dim, c.rope_base, false, documents);
  }
  const AttentionCore core{batch, seq, c.heads, c.kv_heads, c.head_dim, c.causal, documents};
  Matrix y = linear_rows(core.forward(q, k, v), w.w_proj);
  y.reshape(x.shape());
  return y;
}

// dx = d Attention / dx * dy (overwritten); weight gradients accumulate into dw's w_q, w_k, w_v, w_proj.
inline Matrix attention_backward(const LayerConfig& c, const GlobalLayerWeights<double>& w, const Matrix& x,
                                 const Matrix& dy, GlobalLayerWeights<double>& dw,
                                 const std::vector<std::int64_t>& documents = {}) {
  const std::int64_t batch = x.extent(0), seq = x.extent(1);
  const Matrix tokens = as_tokens(x), dy_tokens = as_tokens(dy);
  Matrix q = linear(tokens, w.w_q), k = linear(tokens, w.w_k), v = linear(tokens, w.w_v);
  if (c.rope) {
    rope(q, seq, c.head_dim, c.rope_base, false, documents);
    rope(k, seq, c.head_dim, c.rope_base, false, documents);
  }
  const AttentionCore core{batch, seq, c.heads, c.kv_heads, c.head_dim, c.causal, documents};
  const Matrix out = core.forward(q, k, v);
  Matrix dout(out.shape());
  linear_rows_backward(out, w.w_proj, dy_tokens, dout, dw.w_proj);
  Matrix dq(q.shape()), dk(k.shape()), dv(v.shape());
  core.backward(q, k, v, dout, dq, dk, dv);
  if (c.rope) {
    rope(dq, seq, c.head_dim, c.rope_base, true, documents);
    rope(dk, seq, c.head_dim, c.rope_base, true, documents);
  }
  Matrix dx(tokens.shape());
  linear_backward(tokens, w.w_q, dq, dx, dw.w_q);
  linear_backward(tokens, w.w_k, dk, dx, dw.w_k);
  linear_backward(tokens, w.w_v, dv, dx, dw.w_v);
  dx.reshape(x.shape());
  return dx;
}

inline double gelu(double x) {
  const double c = std::sqrt(2.0 / std::numbers::pi);
  return 0.5 * x * (1.0 + std::tanh(c * (x + 0.044715 * x * x * x)));
}
inline double gelu_derivative(double x) {
  const double c = std::sqrt(2.0 / std::numbers::pi);
  const double t = std::tanh(c * (x + 0.044715 * x * x * x));
  return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * x * x);
}
inline double silu(double x) { return x / (1.0 + std::exp(-x)); }
inline double silu_derivative(double x) {
  const double sig = 1.0 / (1.0 + std::exp(-x));
  return sig * (1.0 + x * (1.0 - sig));
}

// y: [b, s, h] = Mlp(x: [b, s, h]).
inline Matrix mlp_forward(const LayerConfig& c, const GlobalLayerWeights<double>& w, const Matrix& x) {
  const Matrix tokens = as_tokens(x);
  Matrix act = linear(tokens, w.w_in);
  if (c.activation == Activation::gelu) {
    for (double& a : act.span()) a = gelu(a);
  } else {
    const Matrix up = linear(tokens, w.w_up);
    for (std::int64_t i = 0; i < act.numel(); ++i) act.span()[std::size_t(i)] = silu(act.span()[std::size_t(i)]) * up.span()[std::size_t(i)];
  }
  Matrix y = linear_rows(act, w.w_out);
  y.reshape(x.shape());
  return y;
}

inline Matrix mlp_backward(const LayerConfig& c, const GlobalLayerWeights<double>& w, const Matrix& x,
                           const Matrix& dy, GlobalLayerWeights<double>& dw) {
  const Matrix tokens = as_tokens(x), dy_tokens = as_tokens(dy);
  const Matrix pre = linear(tokens, w.w_in);
  const bool swiglu = c.activation == Activation::swiglu;
  Matrix up = swiglu ? linear(tokens, w.w_up) : Matrix();
  Matrix act(pre.shape());
  for (std::int64_t i = 0; i < act.numel(); ++i) {
    const double a = pre.span()[std::size_t(i)];
    act.span()[std::size_t(i)] = swiglu ? silu(a) * up.span()[std::size_t(i)] : gelu(a);
  }
  Matrix dact(act.shape());
  linear_rows_backward(act, w.w_out, dy_tokens, dact, dw.w_out);
  Matrix dpre(pre.shape()), dup(swiglu ? pre.shape() : Shape{0, 0});
  for (std::int64_t i = 0; i < act.numel(); ++i) {
    const std::size_t e = std::size_t(i);
    const double a = pre.span()[e];
    if (swiglu) {
      dpre.span()[e] = dact.span()[e] * up.span()[e] * silu_derivative(a);
      dup.span()[e] = dact.span()[e] * silu(a);
    } else {
      dpre.span()[e] = dact.span()[e] * gelu_derivative(a);
    }
  }
  Matrix dx(tokens.shape());
  linear_backward(tokens, w.w_in, dpre, dx, dw.w_in);
  if (swiglu) linear_backward(tokens, w.w_up, dup, dx, dw.w_up);
  dx.reshape(x.shape());
  return dx;
}

// ---- norms ---------------------------------------------------------------------------------------------------------
// y: [..., h] = norm(x) * gamma (+ beta for LayerNorm), per token.
inline Matrix norm_forward(const LayerConfig& c, const Matrix& x, const Matrix& gamma, const Matrix& beta) {
  const std::int64_t h = c.hidden, tokens = x.numel() / h;
  Matrix y(x.shape());
  for (std::int64_t t = 0; t < tokens; ++t) {
    const double* row = x.data() + t * h;
    double mean = 0.0, var = 0.0;
    if (c.norm == NormKind::layer_norm) {
      for (std::int64_t i = 0; i < h; ++i) mean += row[i];
      mean /= double(h);
    }
    for (std::int64_t i = 0; i < h; ++i) var += (row[i] - mean) * (row[i] - mean);
    const double rstd = 1.0 / std::sqrt(var / double(h) + c.norm_eps);
    for (std::int64_t i = 0; i < h; ++i)
      y.data()[t * h + i] = (row[i] - mean) * rstd * gamma(i) + (c.norm == NormKind::layer_norm ? beta(i) : 0.0);
  }
  return y;
}

// dx (returned) and accumulated dgamma, dbeta.
inline Matrix norm_backward(const LayerConfig& c, const Matrix& x, const Matrix& gamma, const Matrix& dy,
                            Matrix& dgamma, Matrix& dbeta) {
  const std::int64_t h = c.hidden, tokens = x.numel() / h;
  const bool layer = c.norm == NormKind::layer_norm;
  Matrix dx(x.shape());
  for (std::int64_t t = 0; t < tokens; ++t) {
    const double* row = x.data() + t * h;
    const double* g = dy.data() + t * h;
    double mean = 0.0, var = 0.0;
    if (layer) {
      for (std::int64_t i = 0; i < h; ++i) mean += row[i];
      mean /= double(h);
    }
    for (std::int64_t i = 0; i < h; ++i) var += (row[i] - mean) * (row[i] - mean);
    const double rstd = 1.0 / std::sqrt(var / double(h) + c.norm_eps);
    // xhat = (x - mean) * rstd; dxhat = dy * gamma;
    // dx = rstd * (dxhat - mean(dxhat) [LayerNorm only] - xhat * mean(dxhat * xhat))
    double sum_dxhat = 0.0, sum_dxhat_xhat = 0.0;
    for (std::int64_t i = 0; i < h; ++i) {
      const double xhat = (row[i] - mean) * rstd, dxhat = g[i] * gamma(i);
      sum_dxhat += dxhat;
      sum_dxhat_xhat += dxhat * xhat;
      dgamma(i) += g[i] * xhat;
      if (layer) dbeta(i) += g[i];
    }
    for (std::int64_t i = 0; i < h; ++i) {
      const double xhat = (row[i] - mean) * rstd, dxhat = g[i] * gamma(i);
      dx.data()[t * h + i] = rstd * (dxhat - (layer ? sum_dxhat / double(h) : 0.0) - xhat * sum_dxhat_xhat / double(h));
    }
  }
  return dx;
}

// ---- the layer -------------------------------------------------------------------------------------------------------
inline Matrix add(const Matrix& a, const Matrix& b) {
  Matrix y = Matrix::copy_of(a.view());
  for (std::int64_t i = 0; i < y.numel(); ++i) y.span()[std::size_t(i)] += b.span()[std::size_t(i)];
  return y;
}

// z: [b, s, h] = y + Mlp(Norm2(y)), y = x + Attn(Norm1(x)).
inline Matrix layer_forward(const LayerConfig& c, const GlobalLayerWeights<double>& w, const Matrix& x) {
  const Matrix y = add(x, attention_forward(c, w, norm_forward(c, x, w.norm1_gamma, w.norm1_beta)));
  return add(y, mlp_forward(c, w, norm_forward(c, y, w.norm2_gamma, w.norm2_beta)));
}

// dx (returned); every weight gradient accumulates into dw.
inline Matrix layer_backward(const LayerConfig& c, const GlobalLayerWeights<double>& w, const Matrix& x,
                             const Matrix& dz, GlobalLayerWeights<double>& dw) {
  const Matrix n1 = norm_forward(c, x, w.norm1_gamma, w.norm1_beta);
  const Matrix y = add(x, attention_forward(c, w, n1));
  const Matrix n2 = norm_forward(c, y, w.norm2_gamma, w.norm2_beta);
  const Matrix dn2 = mlp_backward(c, w, n2, dz, dw);
  const Matrix dy = add(dz, norm_backward(c, y, w.norm2_gamma, dn2, dw.norm2_gamma, dw.norm2_beta));
  const Matrix dn1 = attention_backward(c, w, n1, dy, dw);
  return add(dy, norm_backward(c, x, w.norm1_gamma, dn1, dw.norm1_gamma, dw.norm1_beta));
}

// A stack of layers: forward returns the output, backward the input gradient (per-layer dw accumulate).
inline Matrix stack_forward(const LayerConfig& c, const std::vector<GlobalLayerWeights<double>>& w, const Matrix& x) {
  Matrix h = Matrix::copy_of(x.view());
  for (const auto& layer : w) h = layer_forward(c, layer, h);
  return h;
}
inline Matrix stack_backward(const LayerConfig& c, const std::vector<GlobalLayerWeights<double>>& w, const Matrix& x,
                             const Matrix& dz, std::vector<GlobalLayerWeights<double>>& dw) {
  std::vector<Matrix> inputs;
  inputs.push_back(Matrix::copy_of(x.view()));
  for (std::size_t l = 0; l + 1 < w.size(); ++l) inputs.push_back(layer_forward(c, w[l], inputs.back()));
  Matrix grad = Matrix::copy_of(dz.view());
  for (std::size_t l = w.size(); l-- > 0;) grad = layer_backward(c, w[l], inputs[l], grad, dw[l]);
  return grad;
}

}  // namespace paradyse::testing::ref
