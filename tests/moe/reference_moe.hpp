// tests/moe/reference_moe.hpp: a float64 single-rank MoE FFN written plainly (loops over tokens, experts and
// columns), forward and backward, the reference that every MoE op and strategy is checked against; plus the random
// problems and the float shards cut from them.
//
// The loss whose gradients it returns: L = sum(y * dy) + aux_loss_coef * aux + z_loss_coef * z. The reference's own
// gradients are checked against central finite differences of that loss (tests/moe/moe_layer.cpp), so it does not
// have to be trusted.
#pragma once

#include "paradyse/core/rng.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/layout/chunking.hpp"
#include "paradyse/moe/moe_config.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <span>
#include <vector>

namespace paradyse::testing {

struct ReferenceMoe {
  MoeConfig config;
  std::vector<double> router;       // [E, h]
  std::vector<double> expert_in;    // [E, 2f, h]: gate rows, then up rows
  std::vector<double> expert_out;   // [E, f, h]
  std::vector<double> shared_in;    // [2 fs, h]
  std::vector<double> shared_out;   // [fs, h]
  std::vector<double> shared_gate;  // [h] (empty without a gate)
};

struct ReferenceResult {
  std::vector<double> y;                          // [T, h]
  double aux = 0, z = 0;
  std::vector<std::int64_t> routed;               // [E] assignments before the capacity
  std::int64_t dropped = 0;
  std::vector<std::vector<std::int64_t>> chosen;  // per token, best first
  std::vector<double> dx, drouter, dexpert_in, dexpert_out, dshared_in, dshared_out, dshared_gate;
};

namespace reference_detail {
inline double silu(double v) { return v / (1.0 + std::exp(-v)); }
inline double sigmoid(double v) { return 1.0 / (1.0 + std::exp(-v)); }
inline double silu_derivative(double v) {
  const double s = sigmoid(v);
  return s * (1.0 + v * (1.0 - s));
}

// out [h] = W_out^T (silu(W_in[:f] x) * W_in[f:] x).
inline void swiglu_expert(const double* in, const double* out_w, std::int64_t f, std::int64_t h, const double* x,
                          double* out) {
  std::fill(out, out + h, 0.0);
  for (std::int64_t i = 0; i < f; ++i) {
    double a = 0, u = 0;
    for (std::int64_t c = 0; c < h; ++c) a += in[i * h + c] * x[c], u += in[(f + i) * h + c] * x[c];
    const double act = silu(a) * u;
    for (std::int64_t c = 0; c < h; ++c) out[c] += act * out_w[i * h + c];
  }
}

// Accumulates the expert's gradients for dout [h] at x [h]: din, dout_w, dx.
inline void swiglu_expert_backward(const double* in, const double* out_w, std::int64_t f, std::int64_t h,
                                   const double* x, const double* dout, double* din, double* dout_w, double* dx) {
  for (std::int64_t i = 0; i < f; ++i) {
    double a = 0, u = 0, dact = 0;
    for (std::int64_t c = 0; c < h; ++c) a += in[i * h + c] * x[c], u += in[(f + i) * h + c] * x[c];
    for (std::int64_t c = 0; c < h; ++c) dact += dout[c] * out_w[i * h + c];
    const double act = silu(a) * u;
    for (std::int64_t c = 0; c < h; ++c) dout_w[i * h + c] += act * dout[c];
    const double da = dact * u * silu_derivative(a), du = dact * silu(a);
    for (std::int64_t c = 0; c < h; ++c) {
      din[i * h + c] += da * x[c];
      din[(f + i) * h + c] += du * x[c];
      dx[c] += da * in[i * h + c] + du * in[(f + i) * h + c];
    }
  }
}
}  // namespace reference_detail

// x, dy: [T, h]; k: [T] experts per token; groups: each rank's token ids in its local order (the capacity applies
// per group, as the layer applies it per rank).
inline ReferenceResult reference_moe(const ReferenceMoe& m, const std::vector<double>& x, const std::vector<double>& dy,
                                     const std::vector<std::int64_t>& k,
                                     const std::vector<std::vector<std::int64_t>>& groups) {
  using namespace reference_detail;
  const MoeConfig& c = m.config;
  const std::int64_t h = c.hidden, e_count = c.experts, f = c.expert_ffn, fs = c.shared_width();
  const std::int64_t tokens = std::int64_t(k.size());
  const double scale = c.routed_scaling_factor;
  ReferenceResult r;
  r.y.assign(std::size_t(tokens * h), 0.0);
  r.routed.assign(std::size_t(e_count), 0);
  r.chosen.resize(std::size_t(tokens));
  std::vector<double> logits(static_cast<std::size_t>(tokens * e_count)), probs(logits.size()), lse(static_cast<std::size_t>(tokens));
  std::vector<std::vector<double>> gates(static_cast<std::size_t>(tokens));
  for (std::int64_t t = 0; t < tokens; ++t) {
    const double* xt = &x[std::size_t(t * h)];
    double* l = &logits[std::size_t(t * e_count)];
    double* p = &probs[std::size_t(t * e_count)];
    double top = -1e300;
    for (std::int64_t e = 0; e < e_count; ++e) {
      l[e] = 0;
      for (std::int64_t col = 0; col < h; ++col) l[e] += xt[col] * m.router[std::size_t(e * h + col)];
      top = std::max(top, l[e]);
    }
    double sum = 0;
    for (std::int64_t e = 0; e < e_count; ++e) sum += std::exp(l[e] - top);
    lse[std::size_t(t)] = top + std::log(sum);
    for (std::int64_t e = 0; e < e_count; ++e)
      p[e] = c.scoring == RouterScoring::softmax ? std::exp(l[e] - lse[std::size_t(t)]) : sigmoid(l[e]);
    std::vector<std::int64_t> order(static_cast<std::size_t>(e_count));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) { return l[a] > l[b]; });
    order.resize(std::size_t(k[std::size_t(t)]));
    double selected = 0;
    for (const std::int64_t e : order) selected += p[e];
    for (const std::int64_t e : order) {
      gates[std::size_t(t)].push_back(scale * p[e] / (c.norm_topk_prob && selected > 0 ? selected : 1.0));
      ++r.routed[std::size_t(e)];
    }
    r.chosen[std::size_t(t)] = order;
  }
  // Capacity per group, in the group's token order.
  std::vector<std::vector<bool>> kept(static_cast<std::size_t>(tokens));
  for (std::int64_t t = 0; t < tokens; ++t) kept[std::size_t(t)].assign(r.chosen[std::size_t(t)].size(), true);
  if (c.capacity_factor > 0) {
    for (const auto& group : groups) {
      std::int64_t assignments = 0;
      for (const std::int64_t t : group) assignments += k[std::size_t(t)];
      const std::int64_t cap = std::int64_t(std::ceil(c.capacity_factor * double(assignments) / double(e_count)));
      std::vector<std::int64_t> used(static_cast<std::size_t>(e_count), 0);
      for (const std::int64_t t : group)
        for (std::size_t j = 0; j < r.chosen[std::size_t(t)].size(); ++j) {
          const std::int64_t e = r.chosen[std::size_t(t)][j];
          if (used[std::size_t(e)] < cap) {
            ++used[std::size_t(e)];
          } else {
            kept[std::size_t(t)][j] = false;
            ++r.dropped;
          }
        }
    }
  }
  // Forward through the experts.
  std::vector<double> out(static_cast<std::size_t>(h)), shared(static_cast<std::size_t>(h)), dout(static_cast<std::size_t>(h));
  std::vector<double> sig(static_cast<std::size_t>(tokens), 1.0);
  const auto expert_in = [&](std::int64_t e) { return &m.expert_in[std::size_t(e * 2 * f * h)]; };
  const auto expert_out = [&](std::int64_t e) { return &m.expert_out[std::size_t(e * f * h)]; };
  for (std::int64_t t = 0; t < tokens; ++t) {
    const double* xt = &x[std::size_t(t * h)];
    double* yt = &r.y[std::size_t(t * h)];
    for (std::size_t j = 0; j < r.chosen[std::size_t(t)].size(); ++j) {
      if (!kept[std::size_t(t)][j]) continue;
      const std::int64_t e = r.chosen[std::size_t(t)][j];
      swiglu_expert(expert_in(e), expert_out(e), f, h, xt, out.data());
      for (std::int64_t col = 0; col < h; ++col) yt[col] += gates[std::size_t(t)][j] * out[std::size_t(col)];
    }
    if (c.has_shared()) {
      swiglu_expert(m.shared_in.data(), m.shared_out.data(), fs, h, xt, shared.data());
      if (c.shared_gate) {
        double z = 0;
        for (std::int64_t col = 0; col < h; ++col) z += m.shared_gate[std::size_t(col)] * xt[col];
        sig[std::size_t(t)] = sigmoid(z);
      }
      for (std::int64_t col = 0; col < h; ++col) yt[col] += sig[std::size_t(t)] * shared[std::size_t(col)];
    }
  }
  // Losses.
  std::int64_t assignments = 0;
  for (const std::int64_t n : r.routed) assignments += n;
  std::vector<double> load(static_cast<std::size_t>(e_count), 0.0);
  for (std::int64_t e = 0; e < e_count; ++e) {
    load[std::size_t(e)] = assignments > 0 ? double(r.routed[std::size_t(e)]) / double(assignments) : 0.0;
    double mean = 0;
    for (std::int64_t t = 0; t < tokens; ++t) mean += probs[std::size_t(t * e_count + e)];
    mean /= double(tokens);
    r.aux += double(e_count) * load[std::size_t(e)] * mean;
  }
  for (std::int64_t t = 0; t < tokens; ++t) r.z += lse[std::size_t(t)] * lse[std::size_t(t)] / double(tokens);
  if (dy.empty()) return r;

  // Backward.
  r.dx.assign(x.size(), 0.0);
  r.drouter.assign(m.router.size(), 0.0);
  r.dexpert_in.assign(m.expert_in.size(), 0.0);
  r.dexpert_out.assign(m.expert_out.size(), 0.0);
  r.dshared_in.assign(m.shared_in.size(), 0.0);
  r.dshared_out.assign(m.shared_out.size(), 0.0);
  r.dshared_gate.assign(m.shared_gate.size(), 0.0);
  for (std::int64_t t = 0; t < tokens; ++t) {
    const double* xt = &x[std::size_t(t * h)];
    const double* dyt = &dy[std::size_t(t * h)];
    double* dxt = &r.dx[std::size_t(t * h)];
    const std::vector<std::int64_t>& chosen = r.chosen[std::size_t(t)];
    std::vector<double> dgate(chosen.size(), 0.0);
    for (std::size_t j = 0; j < chosen.size(); ++j) {
      if (!kept[std::size_t(t)][j]) continue;
      const std::int64_t e = chosen[j];
      swiglu_expert(expert_in(e), expert_out(e), f, h, xt, out.data());
      for (std::int64_t col = 0; col < h; ++col) {
        dgate[j] += dyt[col] * out[std::size_t(col)];
        dout[std::size_t(col)] = gates[std::size_t(t)][j] * dyt[col];
      }
      swiglu_expert_backward(expert_in(e), expert_out(e), f, h, xt, dout.data(),
                             &r.dexpert_in[std::size_t(e * 2 * f * h)], &r.dexpert_out[std::size_t(e * f * h)], dxt);
    }
    // Router: through the gates, the load-balancing loss and the z-loss.
    const double* p = &probs[std::size_t(t * e_count)];
    const double* l = &logits[std::size_t(t * e_count)];
    std::vector<double> dp(static_cast<std::size_t>(e_count));
    for (std::int64_t e = 0; e < e_count; ++e)
      dp[std::size_t(e)] = c.aux_loss_coef * double(e_count) * load[std::size_t(e)] / double(tokens);
    double selected = 0, weighted = 0;
    for (std::size_t j = 0; j < chosen.size(); ++j) selected += p[chosen[j]], weighted += dgate[j] * p[chosen[j]];
    for (std::size_t j = 0; j < chosen.size(); ++j)
      dp[std::size_t(chosen[j])] += c.norm_topk_prob ? scale / selected * (dgate[j] - weighted / selected)
                                                     : scale * dgate[j];
    std::vector<double> dl(static_cast<std::size_t>(e_count));
    double dot = 0;
    for (std::int64_t e = 0; e < e_count; ++e) dot += dp[std::size_t(e)] * p[e];
    for (std::int64_t e = 0; e < e_count; ++e) {
      dl[std::size_t(e)] = c.scoring == RouterScoring::softmax ? p[e] * (dp[std::size_t(e)] - dot)
                                                               : dp[std::size_t(e)] * p[e] * (1 - p[e]);
      dl[std::size_t(e)] +=
          c.z_loss_coef / double(tokens) * 2 * lse[std::size_t(t)] * std::exp(l[e] - lse[std::size_t(t)]);
      for (std::int64_t col = 0; col < h; ++col) {
        dxt[col] += dl[std::size_t(e)] * m.router[std::size_t(e * h + col)];
        r.drouter[std::size_t(e * h + col)] += dl[std::size_t(e)] * xt[col];
      }
    }
    // Shared experts.
    if (c.has_shared()) {
      const double s = sig[std::size_t(t)];
      for (std::int64_t col = 0; col < h; ++col) dout[std::size_t(col)] = s * dyt[col];
      if (c.shared_gate) {
        swiglu_expert(m.shared_in.data(), m.shared_out.data(), fs, h, xt, shared.data());
        double dsig = 0;
        for (std::int64_t col = 0; col < h; ++col) dsig += dyt[col] * shared[std::size_t(col)];
        const double dz = dsig * s * (1 - s);
        for (std::int64_t col = 0; col < h; ++col) {
          r.dshared_gate[std::size_t(col)] += dz * xt[col];
          dxt[col] += dz * m.shared_gate[std::size_t(col)];
        }
      }
      swiglu_expert_backward(m.shared_in.data(), m.shared_out.data(), fs, h, xt, dout.data(), r.dshared_in.data(),
                             r.dshared_out.data(), dxt);
    }
  }
  return r;
}

// L = sum(y * dy) + aux_loss_coef * aux + z_loss_coef * z (for finite differences).
inline double reference_loss(const ReferenceMoe& m, const std::vector<double>& x, const std::vector<double>& dy,
                             const std::vector<std::int64_t>& k, const std::vector<std::vector<std::int64_t>>& groups) {
  const ReferenceResult r = reference_moe(m, x, {}, k, groups);
  double loss = m.config.aux_loss_coef * r.aux + m.config.z_loss_coef * r.z;
  for (std::size_t i = 0; i < r.y.size(); ++i) loss += r.y[i] * dy[i];
  return loss;
}

// ---- random problems ----

struct MoeProblem {
  ReferenceMoe model;
  std::int64_t batch = 1, length = 1;     // tokens [b, s]
  std::vector<double> x, dy;              // [b * s, h] in (batch, position) order
  std::vector<std::int64_t> k;            // [b * s]
};

// Weights and inputs drawn from `seed`; k_per_token: random counts in [0, E] instead of the config's top_k.
inline MoeProblem random_problem(const MoeConfig& c, std::int64_t batch, std::int64_t length, std::uint64_t seed,
                                 bool k_per_token = false) {
  Rng rng(seed);
  MoeProblem p;
  p.model.config = c;
  p.batch = batch;
  p.length = length;
  const std::int64_t h = c.hidden, f = c.expert_ffn, fs = c.shared_width(), tokens = batch * length;
  const auto fill = [&](std::vector<double>& v, std::int64_t n, double scale) {
    v.resize(std::size_t(n));
    for (double& e : v) e = rng.uniform(-scale, scale);
  };
  fill(p.model.router, c.experts * h, 1.0);
  fill(p.model.expert_in, c.experts * 2 * f * h, 0.6);
  fill(p.model.expert_out, c.experts * f * h, 0.6);
  fill(p.model.shared_in, 2 * fs * h, 0.6);
  fill(p.model.shared_out, fs * h, 0.6);
  fill(p.model.shared_gate, c.shared_gate ? h : 0, 0.6);
  fill(p.x, tokens * h, 1.0);
  fill(p.dy, tokens * h, 1.0);
  p.k.assign(std::size_t(tokens), c.top_k);
  if (k_per_token)
    for (auto& v : p.k) v = std::int64_t(rng.below(std::uint64_t(c.experts + 1)));
  return p;
}

// Rank r's token ids under the unified layout: chunk r of every sample's positions, batch-major.
inline std::vector<std::int64_t> rank_tokens(const MoeProblem& p, int ranks, int rank) {
  const ChunkRange chunk = chunk_range(p.length, ranks, rank);
  std::vector<std::int64_t> ids;
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t s = chunk.start; s < chunk.end(); ++s) ids.push_back(b * p.length + s);
  return ids;
}

inline std::vector<std::vector<std::int64_t>> rank_groups(const MoeProblem& p, int ranks) {
  std::vector<std::vector<std::int64_t>> groups;
  for (int r = 0; r < ranks; ++r) groups.push_back(rank_tokens(p, ranks, r));
  return groups;
}

// Rows `ids` of a [T, width] matrix, as float.
inline Tensor<float> float_rows(const std::vector<double>& m, std::int64_t width, const std::vector<std::int64_t>& ids,
                                Shape shape) {
  Tensor<float> t(shape);
  std::size_t at = 0;
  for (const std::int64_t id : ids)
    for (std::int64_t c = 0; c < width; ++c) t.span()[at++] = float(m[std::size_t(id * width + c)]);
  return t;
}
inline std::vector<double> double_rows(const std::vector<double>& m, std::int64_t width,
                                       const std::vector<std::int64_t>& ids) {
  std::vector<double> out;
  for (const std::int64_t id : ids)
    for (std::int64_t c = 0; c < width; ++c) out.push_back(m[std::size_t(id * width + c)]);
  return out;
}
inline void assign(Tensor<float>& t, std::span<const double> v) {
  for (std::size_t i = 0; i < v.size(); ++i) t.span()[i] = float(v[i]);
}

// Rank r's float shard of the model (its experts whole; router and shared experts replicated).
inline MoeShard float_shard(const ReferenceMoe& m, int ranks, int rank) {
  const MoeConfig& c = m.config;
  const std::int64_t h = c.hidden, f = c.expert_ffn;
  const ChunkRange mine = owned_experts(c, ranks, rank);
  MoeShard s = MoeShard::zeros(c, ranks, rank);
  assign(s.router, m.router);
  assign(s.expert_in, std::span(m.expert_in).subspan(std::size_t(mine.start * 2 * f * h), std::size_t(mine.length * 2 * f * h)));
  assign(s.expert_out, std::span(m.expert_out).subspan(std::size_t(mine.start * f * h), std::size_t(mine.length * f * h)));
  assign(s.shared_in, m.shared_in);
  assign(s.shared_out, m.shared_out);
  assign(s.shared_gate, m.shared_gate);
  return s;
}

// The slice of a full expert gradient [E, rows, h] that rank r owns.
inline std::vector<double> owned_slice(const MoeConfig& c, const std::vector<double>& full, std::int64_t per_expert,
                                       int ranks, int rank) {
  const ChunkRange mine = owned_experts(c, ranks, rank);
  return {full.begin() + mine.start * per_expert, full.begin() + mine.end() * per_expert};
}

}  // namespace paradyse::testing
