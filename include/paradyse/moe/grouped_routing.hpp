// paradyse/moe/grouped_routing.hpp: DeepSeek's group-limited top-k routing (inference), as Hugging Face
// transformers computes it (DeepseekV2MoEGate, DeepseekV3TopkRouter).
//
// The E experts form n_group groups of E / n_group consecutive experts. Per token:
//   - group_limited_greedy (DeepSeek-V2): scores = softmax(logits); a group's score is its largest score; the
//     topk_group best groups stay, every other expert's score is set to 0; the top-k of what remains are chosen and
//     weighted by their scores (never renormalised: transformers' DeepseekV2 ignores norm_topk_prob) times
//     routed_scaling_factor;
//   - noaux_tc (DeepSeek-V3): scores = sigmoid(logits); the choice reads scores + e_score_correction_bias [E] (the
//     bias chooses, it never weights); a group's score is the sum of its 2 largest choice values; the topk_group best
//     groups stay, every other expert's choice value is set to 0 (as transformers' masked_fill does: a negative
//     choice value of a kept group can lose to a dropped expert's 0); the top-k choice values are chosen; their
//     weights are the plain sigmoid scores, divided by their sum (+ 1e-20) under norm_topk_prob, times
//     routed_scaling_factor.
// Ties: the lower index wins (groups and experts). A per-call k (TopK::k) replaces top_k; per-token counts and
// pooled tokens (Alloc-T) are refused by name, since the grouped choice fixes k per token.
// The result is a Routing (moe/router.hpp) with offsets, experts, gates, logits and scores; lse and stats are those
// of the logits' softmax (the router's losses are a training concern and grouped routing is not trained here).
// Generic over the backend as route() is: on ops::Counting (a serving step's dry run) it records the router's GEMM and
// the choice's stream and computes nothing.
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/core/trace.hpp"
#include "paradyse/moe/moe_config.hpp"
#include "paradyse/moe/router.hpp"
#include "paradyse/ops/counting.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <span>
#include <vector>

namespace paradyse {

// router [E, h]; bias [E] (noaux_tc; empty otherwise); x [n, h] on the host.
template <class Backend>
Routing route_grouped(const MoeConfig& c, TensorView<const float> router, std::span<const float> bias,
                      TensorView<const float> x, TopK k = {}) {
  check(c.topk_method != TopkMethod::greedy, "route_grouped: topk_method greedy routes through route()");
  check(k.per_token.empty() && !k.pool_tokens, "route_grouped: topk_method {} chooses a fixed k per token; per-token "
        "counts and pooled tokens (Alloc-T) are not supported with it", name_of(c.topk_method));
  check(router.shape() == Shape{c.experts, c.hidden}, "route_grouped: the router weight is {}, expected [E, h] = [{}, {}]",
        router.shape(), c.experts, c.hidden);
  check(x.rank() == 2 && x.extent(1) == c.hidden && x.is_contiguous(), "route_grouped: x {} must be contiguous [n, h = {}]",
        x.shape(), c.hidden);
  const bool v3 = c.topk_method == TopkMethod::noaux_tc;
  check(!v3 || std::int64_t(bias.size()) == c.experts, "route_grouped: noaux_tc needs e_score_correction_bias [{}], got "
        "{} values", c.experts, bias.size());
  const std::int64_t n = x.extent(0), E = c.experts, groups = c.n_group, per = E / groups,
                     top = k.k == 0 ? c.top_k : k.k;
  check(top >= 1 && top <= c.topk_group * per, "route_grouped: k = {} must be in [1, topk_group x experts per group = "
        "{}]", top, c.topk_group * per);
  Routing r;
  r.tokens = n;
  r.experts = E;
  r.offsets = routing_offsets(c, n, TopK{top});
  r.expert.assign(std::size_t(r.assignments()), 0);
  r.gates = Tensor<float>(Shape{r.assignments()});
  r.logits = Tensor<float>(Shape{n, E});
  r.probs = Tensor<float>(Shape{n, E});
  r.lse = Tensor<float>(Shape{n});
  r.stats = Tensor<float>(Shape{E + 1});
  if (n > 0) Backend::matmul(x, ops::Transpose::no, router, ops::Transpose::yes, r.logits.view());
  // The scores and the grouped choice are a host loop, recorded where a Trace is installed by the router kernel's
  // counting rule (the logits read, the scores written, the choices); a dry run (ops::Counting, meta tensors) stops
  // there with the rule's placeholder assignments (the caller realises its loads).
  if (Trace::current())
    ops::counting::router_forward(r.logits.view(), c.scoring, c.norm_topk_prob, float(c.routed_scaling_factor),
                                  r.offsets, r.probs.view(), r.lse.view(), r.expert, r.gates.view(), r.stats.view());
  if constexpr (requires { requires Backend::records_trace; }) return r;
  std::vector<double> column(static_cast<std::size_t>(E), 0.0), choice(static_cast<std::size_t>(E)),
      group_score(static_cast<std::size_t>(groups));
  std::vector<std::int64_t> order(static_cast<std::size_t>(std::max(E, groups)));
  std::vector<char> kept(static_cast<std::size_t>(groups));
  double z_sum = 0;
  for (std::int64_t t = 0; t < n; ++t) {
    const float* l = r.logits.data() + t * E;
    float* p = r.probs.data() + t * E;
    float top_logit = -INFINITY;
    for (std::int64_t e = 0; e < E; ++e) {
      check(std::isfinite(l[e]), "route_grouped: logit [{}, {}] = {} is not finite", t, e, l[e]);
      top_logit = std::max(top_logit, l[e]);
    }
    double sum = 0;
    for (std::int64_t e = 0; e < E; ++e) sum += std::exp(double(l[e]) - top_logit);
    const double log_sum = double(top_logit) + std::log(sum);
    r.lse.data()[t] = float(log_sum);
    z_sum += log_sum * log_sum;
    for (std::int64_t e = 0; e < E; ++e) {
      const double score = v3 ? 1.0 / (1.0 + std::exp(-double(l[e]))) : std::exp(double(l[e]) - log_sum);
      p[e] = float(score);
      column[std::size_t(e)] += score;
      choice[std::size_t(e)] = v3 ? double(p[e]) + double(bias[std::size_t(e)]) : double(p[e]);
    }
    // Group scores: the largest choice value (V2) or the sum of the two largest (V3).
    for (std::int64_t g = 0; g < groups; ++g) {
      const auto first = choice.begin() + g * per;
      if (!v3) {
        group_score[std::size_t(g)] = *std::max_element(first, first + per);
      } else {
        double a = -INFINITY, b = -INFINITY;
        for (auto it = first; it != first + per; ++it) {
          if (*it > a) b = a, a = *it;
          else if (*it > b) b = *it;
        }
        group_score[std::size_t(g)] = a + b;
      }
    }
    const auto better = [](const std::vector<double>& v) {
      return [&v](std::int64_t a, std::int64_t b) { return v[std::size_t(a)] > v[std::size_t(b)] || (v[std::size_t(a)] == v[std::size_t(b)] && a < b); };
    };
    std::iota(order.begin(), order.begin() + groups, std::int64_t(0));
    std::partial_sort(order.begin(), order.begin() + c.topk_group, order.begin() + groups, better(group_score));
    std::fill(kept.begin(), kept.end(), char(0));
    for (std::int64_t j = 0; j < c.topk_group; ++j) kept[std::size_t(order[std::size_t(j)])] = 1;
    for (std::int64_t e = 0; e < E; ++e)
      if (!kept[std::size_t(e / per)]) choice[std::size_t(e)] = 0.0;
    std::iota(order.begin(), order.begin() + E, std::int64_t(0));
    std::partial_sort(order.begin(), order.begin() + top, order.begin() + E, better(choice));
    const std::int64_t begin = r.offsets[std::size_t(t)];
    double selected = 0;
    for (std::int64_t j = 0; j < top; ++j) selected += double(p[order[std::size_t(j)]]);
    const double factor = v3 && c.norm_topk_prob ? c.routed_scaling_factor / (selected + 1e-20) : c.routed_scaling_factor;
    for (std::int64_t j = 0; j < top; ++j) {
      r.expert[std::size_t(begin + j)] = order[std::size_t(j)];
      r.gates.data()[begin + j] = float(factor * double(p[order[std::size_t(j)]]));
    }
  }
  for (std::int64_t e = 0; e < E; ++e) r.stats.data()[e] = float(column[std::size_t(e)]);
  r.stats.data()[E] = float(z_sum);
  return r;
}

}  // namespace paradyse
