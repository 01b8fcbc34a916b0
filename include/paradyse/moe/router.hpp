// paradyse/moe/router.hpp: the MoE router. logits = x W_r^T (h -> E), scores (softmax or sigmoid), top-k per token
// (the largest first; equal logits: the lower expert index wins), optional renormalisation of the selected scores,
// routed scaling; the routing it returns lists, per token, the chosen experts and their gate weights, flattened
// with per-token offsets so that the number of experts may vary from token to token (TopK, moe/moe_config.hpp).
// With TopK::pool_tokens the counts come from the scores themselves (Alloc-T, moe/alloc_tokens.hpp).
//
// Losses (both logged; each enters the training loss times its coefficient, and its gradient goes to the logits):
//   - load balancing (Switch form): aux = E * sum_i f_i P_i, f_i = the fraction of all (token, expert) assignments
//     that go to expert i (before any capacity drop), P_i = the mean over tokens of the score of expert i; with
//     MoeConfig::aux_scaling = per_token_hf, f_i = assignments to i per token, Hugging Face's Mixtral value (k times
//     the default for top-k routing), so that a Hugging Face router_aux_loss_coef carries over;
//   - z-loss: z = mean over tokens of logsumexp(logits)^2.
// Both are over every token of the group: router_statistics gives a rank's sums, which a parallel layer all-reduces
// before router_losses (a single rank uses its own).
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/memory.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/moe/alloc_tokens.hpp"
#include "paradyse/moe/moe_config.hpp"
#include "paradyse/ops/backend.hpp"
#include "paradyse/ops/cpu/gemm.hpp"
#include "paradyse/strategy/buffer_pool.hpp"

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <span>
#include <vector>

namespace paradyse {

// The router's decision for n tokens, and what its backward needs.
struct Routing {
  std::int64_t tokens = 0;               // n
  std::int64_t experts = 0;              // E
  std::vector<std::int64_t> offsets;     // [n + 1]: token t's assignments are [offsets[t], offsets[t+1])
  std::vector<std::int64_t> expert;      // [M]: chosen expert of each assignment, best first within a token
  Tensor<float> gates;                   // [M]: gate weight of each assignment
  Tensor<float> logits;                  // [n, E]
  Tensor<float> probs;                   // [n, E]: scores
  Tensor<float> lse;                     // [n]: logsumexp of each token's logits
  Tensor<float> stats;                   // [E + 1]: column sums of probs, then sum of lse^2 (this rank's tokens)

  std::int64_t assignments() const noexcept { return offsets.empty() ? 0 : offsets.back(); }
  std::int64_t count(std::int64_t token) const { return offsets[std::size_t(token + 1)] - offsets[std::size_t(token)]; }
};

// offsets [n + 1] for n tokens under `k` (per-token counts, a per-call k, or the config's top_k).
inline std::vector<std::int64_t> routing_offsets(const MoeConfig& c, std::int64_t tokens, TopK k) {
  std::vector<std::int64_t> offsets(static_cast<std::size_t>(tokens + 1), 0);
  if (!k.per_token.empty()) {
    check(std::int64_t(k.per_token.size()) == tokens, "router: {} per-token expert counts for {} tokens",
          k.per_token.size(), tokens);
    for (std::int64_t t = 0; t < tokens; ++t) {
      const std::int64_t count = k.per_token[std::size_t(t)];
      check(count >= 0 && count <= c.experts, "router: token {} asks for {} experts, expected 0..{}", t, count,
            c.experts);
      offsets[std::size_t(t + 1)] = offsets[std::size_t(t)] + count;
    }
    return offsets;
  }
  const std::int64_t each = k.k == 0 ? c.top_k : k.k;
  check(each >= 1 && each <= c.experts, "router: k = {} must be in [1, experts = {}]", each, c.experts);
  for (std::int64_t t = 0; t < tokens; ++t) offsets[std::size_t(t + 1)] = offsets[std::size_t(t)] + each;
  return offsets;
}

// Alloc-T's per-token counts (moe/alloc_tokens.hpp) from a call's logits: the scores are computed by the router's
// own op (router_forward with no assignment), so that they are bit for bit those the routing uses.
template <class Backend>
std::vector<std::int64_t> pooled_counts(const MoeConfig& c, TensorView<const float> logits, TopK k) {
  const std::int64_t n = logits.extent(0), each = k.k == 0 ? c.top_k : k.k;
  check(k.per_token.empty(), "router: pool_tokens and per-token counts exclude each other");
  Tensor<float> probs(Shape{n, c.experts}), lse(Shape{n}), gates(Shape{0}), stats(Shape{c.experts + 1});
  const std::vector<std::int64_t> none(static_cast<std::size_t>(n + 1), 0);
  std::vector<std::int64_t> no_experts;
  Backend::router_forward(logits, c.scoring, false, 1.0f, none, probs.view(), lse.view(), no_experts, gates.view(),
                          stats.view());
  // A dry run (meta tensors: shapes alone) has no scores: each pool's K T activations as K per token, the totals and
  // so every shape of the routed step (the caller realises its own expert loads: serve/decoder_step.hpp).
  if (probs.space() == MemorySpace::meta) return std::vector<std::int64_t>(std::size_t(n), each);
  return allocate_tokens(probs.span(), std::span<const float>(logits.data(), std::size_t(logits.numel())), n,
                         c.experts, each, k.pools)
      .counts;
}

// router: [E, h]; x: [n, h].
template <class Backend>
Routing route(const MoeConfig& c, TensorView<const float> router, TensorView<const float> x, TopK k = {}) {
  check(router.shape() == Shape{c.experts, c.hidden}, "route: the router weight is {}, expected [E, h] = [{}, {}]",
        router.shape(), c.experts, c.hidden);
  check(x.rank() == 2 && x.extent(1) == c.hidden && x.is_contiguous(), "route: x {} must be contiguous [n, h = {}]",
        x.shape(), c.hidden);
  Routing r;
  r.tokens = x.extent(0);
  r.experts = c.experts;
  // A pool of one row is plain top-k (batch-1 decode): the pooled path is taken only when some pool has two rows.
  bool pooled = k.pool_tokens && r.tokens > 1;
  if (pooled && !k.pools.empty())
    pooled = std::any_of(k.pools.begin(), k.pools.end(), [](std::int64_t rows) { return rows > 1; });
  if (k.pool_tokens && !pooled) {
    check(k.per_token.empty(), "router: pool_tokens and per-token counts exclude each other");
    const std::int64_t pooled_rows = std::accumulate(k.pools.begin(), k.pools.end(), std::int64_t(0));
    check(k.pools.empty() || pooled_rows == r.tokens, "route: the pools hold {} tokens, expected {}", pooled_rows,
          r.tokens);
    k = TopK{k.k};
  }
  if (pooled) {  // Alloc-T: the logits first, then each token's count from the pooled scores
    r.logits = Tensor<float>(Shape{r.tokens, c.experts});
    check(r.logits.space() != MemorySpace::device, "route: pool_tokens reads the scores; they must be on the host");
    if (r.tokens > 0) Backend::matmul(x, ops::Transpose::no, router, ops::Transpose::yes, r.logits.view());
    const std::vector<std::int64_t> counts = pooled_counts<Backend>(c, r.logits.view(), k);
    r.offsets = routing_offsets(c, r.tokens, TopK{0, counts});
    r.expert.assign(std::size_t(r.assignments()), 0);
    r.gates = Tensor<float>(Shape{r.assignments()});
    r.probs = Tensor<float>(Shape{r.tokens, c.experts});
    r.lse = Tensor<float>(Shape{r.tokens});
    r.stats = Tensor<float>(Shape{c.experts + 1});
    Backend::router_forward(r.logits.view(), c.scoring, c.norm_topk_prob, float(c.routed_scaling_factor), r.offsets,
                            r.probs.view(), r.lse.view(), r.expert, r.gates.view(), r.stats.view());
    return r;
  }
  r.offsets = routing_offsets(c, r.tokens, k);
  r.expert.assign(std::size_t(r.assignments()), 0);
  r.gates = Tensor<float>(Shape{r.assignments()});
  r.logits = Tensor<float>(Shape{r.tokens, c.experts});
  r.probs = Tensor<float>(Shape{r.tokens, c.experts});
  r.lse = Tensor<float>(Shape{r.tokens});
  r.stats = Tensor<float>(Shape{c.experts + 1});
  if (r.tokens > 0) Backend::matmul(x, ops::Transpose::no, router, ops::Transpose::yes, r.logits.view());
  Backend::router_forward(r.logits.view(), c.scoring, c.norm_topk_prob, float(c.routed_scaling_factor), r.offsets,
                          r.probs.view(), r.lse.view(), r.expert, r.gates.view(), r.stats.view());
  return r;
}

// A rank's sums for the losses: [2E + 3] = score column sums (E), assignments per expert (E), sum of lse^2, tokens,
// assignments. Add them over ranks (all-reduce) for the group's losses. On meta tensors the score sums read as 0.
// The score sums come to the host through Backend (from device memory over ops::Cuda, which waits for them).
template <class Backend = ops::Cpu>
std::vector<double> router_statistics(const Routing& r) {
  const std::int64_t e_count = r.experts;
  std::vector<double> s(static_cast<std::size_t>(2 * e_count + 3), 0.0);
  if (r.stats.space() != MemorySpace::meta) {
    std::vector<float> stats(static_cast<std::size_t>(e_count + 1));
    Backend::copy(r.stats.view(), TensorView<float>(stats.data(), Shape{e_count + 1}));
    Backend::synchronize();
    for (std::int64_t e = 0; e < e_count; ++e) s[std::size_t(e)] = stats[std::size_t(e)];
    s[std::size_t(2 * e_count)] = stats[std::size_t(e_count)];
  }
  for (const std::int64_t e : r.expert) s[std::size_t(e_count + e)] += 1;
  s[std::size_t(2 * e_count + 1)] = double(r.tokens);
  s[std::size_t(2 * e_count + 2)] = double(r.assignments());
  return s;
}

// The losses of a group from its summed statistics, and their gradients with respect to each token's scores and
// logsumexp (the same for every token, so one vector serves every rank).
struct RouterLosses {
  double aux = 0;                   // E * sum_i f_i P_i (1 when balanced; k with per_token_hf); loss += aux_loss_coef * aux
  double z = 0;                     // mean of lse^2; the loss adds z_loss_coef * z
  std::vector<double> load;         // [E]: f_i
  std::vector<std::int64_t> routed;  // [E]: assignments per expert over the group (before capacity drops)
  std::int64_t tokens = 0;          // over the group
  Tensor<float> aux_grad;           // [E]: d(aux_loss_coef * aux) / d score[t, i]
  float z_grad = 0;                 // d(z_loss_coef * z) / d lse_t^2
};

// aux_grad is made in the current tracker (device memory over ops::Cuda) and written through Backend.
template <class Backend = ops::Cpu>
RouterLosses router_losses(const MoeConfig& c, std::span<const double> sums) {
  const std::int64_t e_count = c.experts;
  check(std::int64_t(sums.size()) == 2 * e_count + 3, "router_losses: {} statistics, expected 2E + 3 = {}", sums.size(),
        2 * e_count + 3);
  RouterLosses l;
  l.tokens = std::int64_t(sums[std::size_t(2 * e_count + 1)]);
  const double n = double(l.tokens), assignments = sums[std::size_t(2 * e_count + 2)];
  l.load.assign(std::size_t(e_count), 0.0);
  l.routed.assign(std::size_t(e_count), 0);
  std::vector<float> grad(static_cast<std::size_t>(e_count), 0.0f);
  for (std::int64_t e = 0; e < e_count; ++e) {
    const double routed = sums[std::size_t(e_count + e)];
    l.routed[std::size_t(e)] = std::int64_t(routed);
    const double per = c.aux_scaling == AuxLossScaling::per_token_hf ? n : assignments;  // see MoeConfig::aux_scaling
    const double f = per > 0 ? routed / per : 0.0;
    const double mean_score = n > 0 ? sums[std::size_t(e)] / n : 0.0;
    l.load[std::size_t(e)] = f;
    l.aux += double(e_count) * f * mean_score;
    grad[std::size_t(e)] = n > 0 ? float(c.aux_loss_coef * double(e_count) * f / n) : 0.0f;
  }
  l.z = n > 0 ? sums[std::size_t(2 * e_count)] / n : 0.0;
  l.z_grad = n > 0 ? float(c.z_loss_coef / n) : 0.0f;
  l.aux_grad = Tensor<float>(Shape{e_count});
  if (l.aux_grad.space() != MemorySpace::meta) {
    Backend::copy(TensorView<const float>(grad.data(), Shape{e_count}), l.aux_grad.view());
    Backend::synchronize();  // grad is this function's: the copy is done before it goes
  }
  return l;
}

// Backward: dgates [M] (dL/dgate of each assignment) and the losses' gradients to the logits, then
// dx [n, h] += dlogits W_r and drouter [E, h] += dlogits^T x. dlogits is a transient from `pool`.
template <class Backend>
void route_backward(const MoeConfig& c, TensorView<const float> router, TensorView<const float> x, const Routing& r,
                    const RouterLosses& losses, TensorView<const float> dgates, TensorView<float> dx,
                    TensorView<float> drouter, BufferPool& pool) {
  check(dx.shape() == x.shape() && drouter.shape() == router.shape(),
        "route_backward: dx {} must match x {} and drouter {} the router {}", dx.shape(), x.shape(), drouter.shape(),
        router.shape());
  PooledBuffer<float> dlogits = pool.acquire<float>(Shape{r.tokens, c.experts});
  Backend::fill(dlogits.view(), 0.0f);
  Backend::router_backward(r.logits.view(), r.probs.view(), r.lse.view(), c.scoring, c.norm_topk_prob,
                           float(c.routed_scaling_factor), r.offsets, r.expert, dgates, losses.aux_grad.view(),
                           losses.z_grad, dlogits.view());
  if (r.tokens == 0) return;
  Backend::matmul(dlogits, ops::Transpose::no, router, ops::Transpose::no, dx, 1.0f, 1.0f);
  Backend::matmul(dlogits, ops::Transpose::yes, x, ops::Transpose::no, drouter, 1.0f, 1.0f);
}

}  // namespace paradyse
