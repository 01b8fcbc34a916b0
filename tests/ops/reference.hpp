// tests/ops/reference.hpp: plain float64 references of the CPU ops, written for clarity, not speed.
//
// Every reference works on flat std::vector<double> in row-major order with the shapes in the comments, and
// spells the math out loop by loop (attention computes the full score row of each query, exactly as the formula
// reads). The kernels are compared against these; their gradients are checked against finite differences.
#pragma once

#include "paradyse/core/tensor.hpp"

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

namespace paradyse::testing {

using Vec = std::vector<double>;

// float tensor (any strides) -> flat float64 vector in row-major order.
template <class T>
Vec to_double(TensorView<const T> x) {
  Vec out;
  out.reserve(std::size_t(x.numel()));
  const int rank = x.rank();
  std::int64_t index[kMaxRank] = {};
  for (std::int64_t n = 0; n < x.numel(); ++n) {
    std::int64_t offset = 0;
    for (int d = 0; d < rank; ++d) offset += index[d] * x.strides()[d];
    out.push_back(double(x.data()[offset]));
    for (int d = rank - 1; d >= 0; --d) {
      if (++index[d] < x.shape()[d]) break;
      index[d] = 0;
    }
  }
  return out;
}
template <class T>
Vec to_double(const Tensor<T>& x) { return to_double(x.view()); }
template <class T>
Vec to_double(TensorView<T> x) { return to_double(TensorView<const T>(x)); }

// ---- GEMM -----------------------------------------------------------------------------------------------------
// c: [m, n] = alpha * op(a) op(b) + beta * c with a stored [m, k] (or [k, m] transposed), b [k, n] (or [n, k]).
inline void reference_gemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, double alpha,
                           const Vec& a, std::int64_t lda, const Vec& b, std::int64_t ldb, double beta, Vec& c,
                           std::int64_t ldc) {
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      double sum = 0.0;
      for (std::int64_t p = 0; p < k; ++p) {
        const double a_ip = trans_a ? a[p * lda + i] : a[i * lda + p];
        const double b_pj = trans_b ? b[j * ldb + p] : b[p * ldb + j];
        sum += a_ip * b_pj;
      }
      double& cij = c[i * ldc + j];
      cij = alpha * sum + (beta == 0.0 ? 0.0 : beta * cij);
    }
}

// ---- attention ---------------------------------------------------------------------------------------------------
struct ReferenceMask {
  bool causal = false;
  std::int64_t q_offset = 0, kv_offset = 0;
  std::vector<std::int64_t> document_starts;  // empty: one document
  double scale = 0.0;                          // 0: 1/sqrt(d)
};

// The document a global position belongs to: the number of documents that start at or before it, minus one.
inline std::int64_t reference_document(const std::vector<std::int64_t>& starts, std::int64_t position) {
  std::int64_t doc = -1;
  for (std::int64_t s : starts)
    if (s <= position) ++doc;
  return doc;
}

inline bool reference_visible(const ReferenceMask& mask, std::int64_t i, std::int64_t j) {
  const std::int64_t qp = mask.q_offset + i, kp = mask.kv_offset + j;
  if (mask.causal && kp > qp) return false;
  if (!mask.document_starts.empty() &&
      reference_document(mask.document_starts, qp) != reference_document(mask.document_starts, kp))
    return false;
  return true;
}

struct AttentionShape {
  std::int64_t b, sq, skv, hq, hkv, d;
  std::int64_t q_index(std::int64_t bi, std::int64_t i, std::int64_t h, std::int64_t c) const {
    return ((bi * sq + i) * hq + h) * d + c;
  }
  std::int64_t kv_index(std::int64_t bi, std::int64_t j, std::int64_t h, std::int64_t c) const {
    return ((bi * skv + j) * hkv + h) * d + c;
  }
  std::int64_t lse_index(std::int64_t bi, std::int64_t h, std::int64_t i) const { return (bi * hq + h) * sq + i; }
};

struct ReferenceAttention {
  Vec out;  // [b, sq, hq, d]
  Vec lse;  // [b, hq, sq]
};

// Softmax probabilities of one query over all keys of the block (0 where masked), and the log-sum-exp.
inline Vec reference_probabilities(const AttentionShape& s, const ReferenceMask& mask, const Vec& q, const Vec& k,
                                   std::int64_t bi, std::int64_t i, std::int64_t h, double& lse) {
  const double scale = mask.scale != 0.0 ? mask.scale : 1.0 / std::sqrt(double(s.d));
  const std::int64_t kvh = h / (s.hq / s.hkv);
  Vec scores(std::size_t(s.skv), -std::numeric_limits<double>::infinity());
  double max_score = -std::numeric_limits<double>::infinity();
  for (std::int64_t j = 0; j < s.skv; ++j) {
    if (!reference_visible(mask, i, j)) continue;
    double dot = 0.0;
    for (std::int64_t c = 0; c < s.d; ++c) dot += q[s.q_index(bi, i, h, c)] * k[s.kv_index(bi, j, kvh, c)];
    scores[j] = scale * dot;
    max_score = std::max(max_score, scores[j]);
  }
  Vec p(std::size_t(s.skv), 0.0);
  if (max_score == -std::numeric_limits<double>::infinity()) {
    lse = max_score;
    return p;
  }
  double sum = 0.0;
  for (std::int64_t j = 0; j < s.skv; ++j) sum += (p[j] = std::exp(scores[j] - max_score));
  for (double& x : p) x /= sum;
  lse = max_score + std::log(sum);
  return p;
}

inline ReferenceAttention reference_attention_forward(const AttentionShape& s, const ReferenceMask& mask, const Vec& q,
                                                      const Vec& k, const Vec& v) {
  ReferenceAttention r{Vec(std::size_t(s.b * s.sq * s.hq * s.d), 0.0), Vec(std::size_t(s.b * s.hq * s.sq), 0.0)};
  for (std::int64_t bi = 0; bi < s.b; ++bi)
    for (std::int64_t h = 0; h < s.hq; ++h)
      for (std::int64_t i = 0; i < s.sq; ++i) {
        double lse = 0.0;
        const Vec p = reference_probabilities(s, mask, q, k, bi, i, h, lse);
        r.lse[s.lse_index(bi, h, i)] = lse;
        const std::int64_t kvh = h / (s.hq / s.hkv);
        for (std::int64_t j = 0; j < s.skv; ++j)
          for (std::int64_t c = 0; c < s.d; ++c) r.out[s.q_index(bi, i, h, c)] += p[j] * v[s.kv_index(bi, j, kvh, c)];
      }
  return r;
}

struct ReferenceAttentionGrads {
  Vec dq, dk, dv;
};

// Gradients of sum(out * dout) with respect to q, k, v (softmax backward written out term by term).
inline ReferenceAttentionGrads reference_attention_backward(const AttentionShape& s, const ReferenceMask& mask,
                                                            const Vec& q, const Vec& k, const Vec& v, const Vec& dout) {
  const double scale = mask.scale != 0.0 ? mask.scale : 1.0 / std::sqrt(double(s.d));
  ReferenceAttentionGrads g{Vec(q.size(), 0.0), Vec(k.size(), 0.0), Vec(v.size(), 0.0)};
  for (std::int64_t bi = 0; bi < s.b; ++bi)
    for (std::int64_t h = 0; h < s.hq; ++h)
      for (std::int64_t i = 0; i < s.sq; ++i) {
        double lse = 0.0;
        const Vec p = reference_probabilities(s, mask, q, k, bi, i, h, lse);
        const std::int64_t kvh = h / (s.hq / s.hkv);
        // dp_j = dout_i . v_j; ds_j = p_j (dp_j - sum_l p_l dp_l)
        Vec dp(std::size_t(s.skv), 0.0);
        double expected_dp = 0.0;
        for (std::int64_t j = 0; j < s.skv; ++j) {
          for (std::int64_t c = 0; c < s.d; ++c) dp[j] += dout[s.q_index(bi, i, h, c)] * v[s.kv_index(bi, j, kvh, c)];
          expected_dp += p[j] * dp[j];
        }
        for (std::int64_t j = 0; j < s.skv; ++j) {
          if (p[j] == 0.0) continue;
          const double ds = p[j] * (dp[j] - expected_dp);
          for (std::int64_t c = 0; c < s.d; ++c) {
            g.dv[s.kv_index(bi, j, kvh, c)] += p[j] * dout[s.q_index(bi, i, h, c)];
            g.dq[s.q_index(bi, i, h, c)] += scale * ds * k[s.kv_index(bi, j, kvh, c)];
            g.dk[s.kv_index(bi, j, kvh, c)] += scale * ds * q[s.q_index(bi, i, h, c)];
          }
        }
      }
  return g;
}

// ---- finite differences ------------------------------------------------------------------------------------------
// Central differences of a scalar loss with respect to every element of `x` (step 1e-6), in float64.
inline Vec finite_difference(Vec& x, const std::function<double()>& loss, double step = 1e-6) {
  Vec grad(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double saved = x[i];
    x[i] = saved + step;
    const double up = loss();
    x[i] = saved - step;
    const double down = loss();
    x[i] = saved;
    grad[i] = (up - down) / (2 * step);
  }
  return grad;
}

inline double dot(const Vec& a, const Vec& b) {
  double s = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

}  // namespace paradyse::testing
