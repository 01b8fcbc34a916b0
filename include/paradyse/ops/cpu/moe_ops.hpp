// paradyse/ops/cpu/moe_ops.hpp: the data ops of a mixture-of-experts layer (router scores and top-k, the router's
// backward with its auxiliary losses, row gathers and weighted scatter-adds by an index list, row dots, sigmoid).
//
// Index lists (the chosen experts, the rows of a permutation) are host metadata (std::span of int64); the float data
// are views. Every view here is 2-D [rows, width] (or 1-D [rows]) and contiguous. Forward outputs are overwritten;
// the backward ops and the scatter-add ACCUMULATE (+=), as every ops::cpu backward does.
//
// Router conventions (moe/router.hpp builds on them):
//   - scores: softmax over the E logits of a token, or sigmoid of each logit;
//   - top-k on the logits (the scoring is monotone, so this is top-k on the scores): the largest first, and between
//     equal logits the lower expert index first (deterministic ties);
//   - a token may select any number of experts in [0, E] (offsets give per-token counts: Alloc-T needs it);
//   - gate weight of a selected expert j: scale * p_j, or scale * p_j / sum_{selected} p when normalising.
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/tensor.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <span>
#include <string_view>
#include <vector>

namespace paradyse::ops {

enum class RouterScoring : std::uint8_t { softmax, sigmoid };

constexpr std::string_view name_of(RouterScoring s) { return s == RouterScoring::softmax ? "softmax" : "sigmoid"; }

}  // namespace paradyse::ops

namespace paradyse::ops::cpu {

namespace moe_detail {
inline void check_matrix(const char* op, const char* what, const TensorView<const float>& x) {
  check(x.rank() == 2 && x.is_contiguous(), "{}: {} must be a contiguous [rows, width] view; got shape {} strides {}",
        op, what, x.shape(), x.strides());
}
// A per-row vector: `rows` contiguous elements (any shape: [rows] or [rows, 1]).
inline void check_vector(const char* op, const char* what, const TensorView<const float>& x, std::int64_t rows) {
  check(x.numel() == rows && x.is_contiguous(), "{}: {} must hold {} contiguous elements; got shape {} strides {}", op,
        what, rows, x.shape(), x.strides());
}
inline void check_offsets(const char* op, std::span<const std::int64_t> offsets, std::int64_t tokens,
                          std::int64_t experts) {
  check(std::int64_t(offsets.size()) == tokens + 1 && offsets[0] == 0,
        "{}: offsets must hold tokens + 1 = {} entries starting at 0; got {} entries", op, tokens + 1, offsets.size());
  for (std::int64_t t = 0; t < tokens; ++t) {
    const std::int64_t count = offsets[std::size_t(t + 1)] - offsets[std::size_t(t)];
    check(count >= 0 && count <= experts, "{}: token {} selects {} experts, expected 0..{}", op, t, count, experts);
  }
}
inline void check_rows_index(const char* op, std::span<const std::int64_t> rows, std::int64_t m, std::int64_t n) {
  if (rows.empty()) {
    check(m == 0 || m == n, "{}: an empty row list means the identity, which needs {} rows to equal {}", op, m, n);
    return;
  }
  check(std::int64_t(rows.size()) == m, "{}: the row list holds {} entries, expected {}", op, rows.size(), m);
  for (std::size_t i = 0; i < rows.size(); ++i)
    check(rows[i] >= 0 && rows[i] < n, "{}: row index {} (entry {}) is outside [0, {})", op, rows[i], i, n);
}
inline std::int64_t row_of(std::span<const std::int64_t> rows, std::int64_t i) {
  return rows.empty() ? i : rows[std::size_t(i)];
}
}  // namespace moe_detail

// Router forward for n tokens and E experts.
//   logits: [n, E]; probs: [n, E] (overwritten: the scores); lse: [n] (overwritten: logsumexp of each token's logits)
//   offsets: [n + 1] token t selects offsets[t+1] - offsets[t] experts (0..E)
//   experts: [offsets[n]] (overwritten: chosen experts, best first); gates: [offsets[n]] (overwritten: gate weights)
//   stats: [E + 1] (overwritten: the column sums of probs, then the sum over tokens of lse^2)
inline void router_forward(TensorView<const float> logits, RouterScoring scoring, bool normalize, float scale,
                           std::span<const std::int64_t> offsets, TensorView<float> probs, TensorView<float> lse,
                           std::span<std::int64_t> experts, TensorView<float> gates, TensorView<float> stats) {
  constexpr const char* op = "router_forward";
  moe_detail::check_matrix(op, "logits", logits);
  moe_detail::check_matrix(op, "probs", probs);
  check(probs.shape() == logits.shape(), "{}: probs {} must match logits {}", op, probs.shape(), logits.shape());
  const std::int64_t n = logits.extent(0), e_count = logits.extent(1);
  moe_detail::check_vector(op, "lse", lse, n);
  moe_detail::check_offsets(op, offsets, n, e_count);
  const std::int64_t assignments = offsets[std::size_t(n)];
  check(std::int64_t(experts.size()) == assignments, "{}: experts holds {} entries, expected {}", op, experts.size(),
        assignments);
  moe_detail::check_vector(op, "gates", gates, assignments);
  moe_detail::check_vector(op, "stats", stats, e_count + 1);
  std::vector<double> column(static_cast<std::size_t>(e_count), 0.0);
  double z_sum = 0;
  std::vector<std::int64_t> order(static_cast<std::size_t>(e_count));
  for (std::int64_t t = 0; t < n; ++t) {
    const float* l = logits.data() + t * e_count;
    float* p = probs.data() + t * e_count;
    float top = -std::numeric_limits<float>::infinity();
    for (std::int64_t e = 0; e < e_count; ++e) {
      check(std::isfinite(l[e]), "{}: logit [{}, {}] = {} is not finite", op, t, e, l[e]);
      top = std::max(top, l[e]);
    }
    double sum = 0;
    for (std::int64_t e = 0; e < e_count; ++e) sum += std::exp(double(l[e]) - top);
    const double log_sum = double(top) + std::log(sum);
    lse.data()[t] = float(log_sum);
    z_sum += log_sum * log_sum;
    for (std::int64_t e = 0; e < e_count; ++e)
      p[e] = scoring == RouterScoring::softmax ? float(std::exp(double(l[e]) - log_sum))
                                               : float(1.0 / (1.0 + std::exp(-double(l[e]))));
    for (std::int64_t e = 0; e < e_count; ++e) column[std::size_t(e)] += p[e];
    const std::int64_t begin = offsets[std::size_t(t)], k = offsets[std::size_t(t + 1)] - begin;
    std::iota(order.begin(), order.end(), std::int64_t(0));
    std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](std::int64_t a, std::int64_t b) {
      return l[a] > l[b] || (l[a] == l[b] && a < b);
    });
    double selected = 0;
    for (std::int64_t j = 0; j < k; ++j) selected += p[order[std::size_t(j)]];
    const double factor = normalize && selected > 0 ? double(scale) / selected : double(scale);
    for (std::int64_t j = 0; j < k; ++j) {
      experts[std::size_t(begin + j)] = order[std::size_t(j)];
      gates.data()[begin + j] = float(factor * p[order[std::size_t(j)]]);
    }
  }
  for (std::int64_t e = 0; e < e_count; ++e) stats.data()[e] = float(column[std::size_t(e)]);
  stats.data()[e_count] = float(z_sum);
}

// Router backward: dlogits [n, E] += the gradient through
//   - the gate weights: dgates [offsets[n]] (dL/dgate of each assignment, in the order of `experts`);
//   - the load-balancing loss: aux_grad [E] = dL/dprobs[t, e] for every token t (the loss is linear in the probs);
//   - the z-loss: z_grad = dL/d(lse_t^2) for every token (coefficient / tokens).
// logits, probs, lse, offsets, experts are those of router_forward (same scoring, normalize and scale).
inline void router_backward(TensorView<const float> logits, TensorView<const float> probs, TensorView<const float> lse,
                            RouterScoring scoring, bool normalize, float scale, std::span<const std::int64_t> offsets,
                            std::span<const std::int64_t> experts, TensorView<const float> dgates,
                            TensorView<const float> aux_grad, float z_grad, TensorView<float> dlogits) {
  constexpr const char* op = "router_backward";
  moe_detail::check_matrix(op, "logits", logits);
  moe_detail::check_matrix(op, "probs", probs);
  moe_detail::check_matrix(op, "dlogits", dlogits);
  check(probs.shape() == logits.shape() && dlogits.shape() == logits.shape(),
        "{}: probs {} and dlogits {} must match logits {}", op, probs.shape(), dlogits.shape(), logits.shape());
  const std::int64_t n = logits.extent(0), e_count = logits.extent(1);
  moe_detail::check_vector(op, "lse", lse, n);
  moe_detail::check_offsets(op, offsets, n, e_count);
  const std::int64_t assignments = offsets[std::size_t(n)];
  check(std::int64_t(experts.size()) == assignments, "{}: experts holds {} entries, expected {}", op, experts.size(),
        assignments);
  moe_detail::check_vector(op, "dgates", dgates, assignments);
  moe_detail::check_vector(op, "aux_grad", aux_grad, e_count);
  std::vector<double> dp(static_cast<std::size_t>(e_count));
  for (std::int64_t t = 0; t < n; ++t) {
    const float* l = logits.data() + t * e_count;
    const float* p = probs.data() + t * e_count;
    float* dl = dlogits.data() + t * e_count;
    for (std::int64_t e = 0; e < e_count; ++e) dp[std::size_t(e)] = aux_grad.data()[e];
    const std::int64_t begin = offsets[std::size_t(t)], k = offsets[std::size_t(t + 1)] - begin;
    const auto chosen = [&](std::int64_t j) { return experts[std::size_t(begin + j)]; };
    if (normalize && k > 0) {
      double selected = 0, weighted = 0;
      for (std::int64_t j = 0; j < k; ++j) selected += p[chosen(j)];
      for (std::int64_t j = 0; j < k; ++j) weighted += double(dgates.data()[begin + j]) * p[chosen(j)];
      if (selected > 0)
        for (std::int64_t j = 0; j < k; ++j)
          dp[std::size_t(chosen(j))] += double(scale) / selected * (dgates.data()[begin + j] - weighted / selected);
    } else {
      for (std::int64_t j = 0; j < k; ++j) dp[std::size_t(chosen(j))] += double(scale) * dgates.data()[begin + j];
    }
    if (scoring == RouterScoring::softmax) {
      double dot = 0;
      for (std::int64_t e = 0; e < e_count; ++e) dot += dp[std::size_t(e)] * p[e];
      for (std::int64_t e = 0; e < e_count; ++e) dl[e] += float(p[e] * (dp[std::size_t(e)] - dot));
    } else {
      for (std::int64_t e = 0; e < e_count; ++e) dl[e] += float(dp[std::size_t(e)] * p[e] * (1.0 - p[e]));
    }
    if (z_grad != 0) {
      const double z = lse.data()[t];
      for (std::int64_t e = 0; e < e_count; ++e)
        dl[e] += float(2.0 * double(z_grad) * z * std::exp(double(l[e]) - z));
    }
  }
}

// to: [m, h] (overwritten) row i = scale[i] * from[rows[i]] (from: [n, h]). rows empty: the identity (m = n);
// scale a default (rank-0) view: 1.
inline void gather_rows(TensorView<const float> from, std::span<const std::int64_t> rows, TensorView<const float> scale,
                        TensorView<float> to) {
  constexpr const char* op = "gather_rows";
  moe_detail::check_matrix(op, "from", from);
  moe_detail::check_matrix(op, "to", to);
  check(from.extent(1) == to.extent(1), "{}: from {} and to {} differ in width", op, from.shape(), to.shape());
  const std::int64_t m = to.extent(0), h = to.extent(1);
  moe_detail::check_rows_index(op, rows, m, from.extent(0));
  if (scale.rank() > 0) moe_detail::check_vector(op, "scale", scale, m);
  for (std::int64_t i = 0; i < m; ++i) {
    const float* src = from.data() + moe_detail::row_of(rows, i) * h;
    float* dst = to.data() + i * h;
    if (scale.rank() == 0) {
      std::copy_n(src, h, dst);
    } else {
      const float s = scale.data()[i];
      for (std::int64_t c = 0; c < h; ++c) dst[c] = s * src[c];
    }
  }
}

// to: [n, h] row rows[i] += scale[i] * from[i] (from: [m, h]), in order of i (deterministic). rows empty: the
// identity; scale a default (rank-0) view: 1.
inline void scatter_add_rows(TensorView<float> to, std::span<const std::int64_t> rows, TensorView<const float> from,
                             TensorView<const float> scale) {
  constexpr const char* op = "scatter_add_rows";
  moe_detail::check_matrix(op, "to", to);
  moe_detail::check_matrix(op, "from", from);
  check(from.extent(1) == to.extent(1), "{}: from {} and to {} differ in width", op, from.shape(), to.shape());
  const std::int64_t m = from.extent(0), h = from.extent(1);
  moe_detail::check_rows_index(op, rows, m, to.extent(0));
  if (scale.rank() > 0) moe_detail::check_vector(op, "scale", scale, m);
  for (std::int64_t i = 0; i < m; ++i) {
    const float* src = from.data() + i * h;
    float* dst = to.data() + moe_detail::row_of(rows, i) * h;
    const float s = scale.rank() > 0 ? scale.data()[i] : 1.0f;
    for (std::int64_t c = 0; c < h; ++c) dst[c] += s * src[c];
  }
}

// out: [m] (overwritten) out[i] = dot(a[rows[i]], b[i]) (a: [n, h], b: [m, h]); rows empty: the identity.
inline void gathered_row_dot(TensorView<const float> a, std::span<const std::int64_t> rows, TensorView<const float> b,
                             TensorView<float> out) {
  constexpr const char* op = "gathered_row_dot";
  moe_detail::check_matrix(op, "a", a);
  moe_detail::check_matrix(op, "b", b);
  check(a.extent(1) == b.extent(1), "{}: a {} and b {} differ in width", op, a.shape(), b.shape());
  const std::int64_t m = b.extent(0), h = b.extent(1);
  moe_detail::check_rows_index(op, rows, m, a.extent(0));
  moe_detail::check_vector(op, "out", out, m);
  for (std::int64_t i = 0; i < m; ++i) {
    const float* x = a.data() + moe_detail::row_of(rows, i) * h;
    const float* y = b.data() + i * h;
    double dot = 0;
    for (std::int64_t c = 0; c < h; ++c) dot += double(x[c]) * y[c];
    out.data()[i] = float(dot);
  }
}

// y = sigmoid(x) (contiguous, equal element counts).
inline void sigmoid_forward(TensorView<const float> x, TensorView<float> y) {
  check(x.is_contiguous() && y.is_contiguous() && x.numel() == y.numel(),
        "sigmoid_forward: x {} and y {} must be contiguous with equal element counts", x.shape(), y.shape());
  for (std::int64_t i = 0; i < x.numel(); ++i) y.data()[i] = float(1.0 / (1.0 + std::exp(-double(x.data()[i]))));
}

// dx += dy * y (1 - y), y = sigmoid(x) as sigmoid_forward wrote it.
inline void sigmoid_backward(TensorView<const float> y, TensorView<const float> dy, TensorView<float> dx) {
  check(y.is_contiguous() && dy.is_contiguous() && dx.is_contiguous() && y.numel() == dy.numel() &&
            y.numel() == dx.numel(),
        "sigmoid_backward: y {}, dy {} and dx {} must be contiguous with equal element counts", y.shape(), dy.shape(),
        dx.shape());
  for (std::int64_t i = 0; i < y.numel(); ++i) {
    const float s = y.data()[i];
    dx.data()[i] += dy.data()[i] * s * (1.0f - s);
  }
}

}  // namespace paradyse::ops::cpu
