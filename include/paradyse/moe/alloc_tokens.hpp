// paradyse/moe/alloc_tokens.hpp: Alloc-T, a layer's K_l experts per token pooled over the tokens routed together
// (issue 12).
//
// Instead of K_l experts in every row of the [T, E] score matrix, a pool of T tokens (a prefill sequence, or a batch
// when asked) takes the K_l * T largest scores of the whole matrix, with a floor of one expert per token:
//   1. every token first takes its own best expert (T selections);
//   2. the remaining (K_l - 1) * T selections are the largest scores among all other (token, expert) entries.
// Token t then runs k_t = (selected entries of row t) experts: confident tokens fewer, ambiguous ones more, and
// sum_t k_t = K_l * T exactly, so the layer's expert work (rows through the grouped GEMMs) is what top-K_l costs.
//
// Order (deterministic, a strict total order): the larger score first; equal scores: the larger secondary key (the
// router's logit, when given); then the lower token index; then the lower expert index. Within one row this is the
// router's own order (logit, then the lower expert; moe/router.hpp), since a row's scores are a monotone function of
// its logits; so the router's top-k_t of row t is exactly the set selected here.
//
// Scope and determinism: the selection couples the tokens of a pool. With T = 1 (batch-1 decode) it is plain
// top-K_l. Pooled over a batch, a request's experts depend on the other requests in the batch (its output changes
// with its batch mates); `pools` cuts the rows into independent pools (one per sequence) to avoid that.
#pragma once

#include "paradyse/core/error.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

namespace paradyse {

struct TokenAllocation {
  std::vector<std::int64_t> counts;  // [T]: k_t, experts run by each token
  std::vector<std::uint8_t> chosen;  // [T, E]: 1 where (t, e) is selected
};

// scores: [T, E] row-major, finite; logits: [T, E] secondary key (empty: none); k: K_l in [1, E]; pools: the row
// counts of consecutive independent pools summing to T (empty: one pool of all T rows).
inline TokenAllocation allocate_tokens(std::span<const float> scores, std::span<const float> logits,
                                       std::int64_t tokens, std::int64_t experts, std::int64_t k,
                                       std::span<const std::int64_t> pools = {}) {
  check(tokens >= 0 && experts >= 1, "allocate_tokens: {} tokens and {} experts; expected tokens >= 0, experts >= 1",
        tokens, experts);
  check(std::int64_t(scores.size()) == tokens * experts, "allocate_tokens: {} scores for [T, E] = [{}, {}]",
        scores.size(), tokens, experts);
  check(logits.empty() || logits.size() == scores.size(), "allocate_tokens: {} logits for {} scores", logits.size(),
        scores.size());
  check(k >= 1 && k <= experts, "allocate_tokens: K_l = {} must be in [1, experts = {}]", k, experts);
  for (std::size_t i = 0; i < scores.size(); ++i)
    check(std::isfinite(scores[i]), "allocate_tokens: score [{}, {}] = {} is not finite", std::int64_t(i) / experts,
          std::int64_t(i) % experts, scores[i]);
  std::int64_t pooled = 0;
  for (std::size_t g = 0; g < pools.size(); ++g) {
    check(pools[g] >= 0, "allocate_tokens: pool {} has {} tokens; expected a non-negative count", g, pools[g]);
    pooled += pools[g];
  }
  check(pools.empty() || pooled == tokens, "allocate_tokens: the pools hold {} tokens, expected T = {}", pooled,
        tokens);

  // a before b in the selection order (a, b: flat indices t * E + e).
  const auto before = [&](std::int64_t a, std::int64_t b) {
    const float sa = scores[std::size_t(a)], sb = scores[std::size_t(b)];
    if (sa != sb) return sa > sb;
    if (!logits.empty()) {
      const float la = logits[std::size_t(a)], lb = logits[std::size_t(b)];
      if (la != lb) return la > lb;
    }
    return a < b;  // the lower token, then the lower expert
  };

  TokenAllocation out;
  out.counts.assign(std::size_t(tokens), 0);
  out.chosen.assign(scores.size(), 0);
  std::vector<std::int64_t> rest;
  const auto select_pool = [&](std::int64_t first, std::int64_t count) {
    rest.clear();
    for (std::int64_t t = first; t < first + count; ++t) {
      std::int64_t best = t * experts;
      for (std::int64_t e = 1; e < experts; ++e)
        if (before(t * experts + e, best)) best = t * experts + e;
      out.chosen[std::size_t(best)] = 1;  // the floor: each token's own best expert
      for (std::int64_t e = 0; e < experts; ++e)
        if (t * experts + e != best) rest.push_back(t * experts + e);
    }
    const std::int64_t more = (k - 1) * count;  // <= (E - 1) * count = rest.size()
    if (more < std::int64_t(rest.size()))
      std::nth_element(rest.begin(), rest.begin() + more, rest.end(), before);
    for (std::int64_t i = 0; i < more; ++i) out.chosen[std::size_t(rest[std::size_t(i)])] = 1;
  };
  if (pools.empty()) {
    select_pool(0, tokens);
  } else {
    std::int64_t first = 0;
    for (const std::int64_t count : pools) {
      select_pool(first, count);
      first += count;
    }
  }
  for (std::int64_t t = 0; t < tokens; ++t)
    for (std::int64_t e = 0; e < experts; ++e) out.counts[std::size_t(t)] += out.chosen[std::size_t(t * experts + e)];
  return out;
}

}  // namespace paradyse
