// paradyse/serve/routing_budget.hpp: Alloc-MoE's activation budget in the serving decoder (issues 11 and 12).
//
// A RoutingBudget gives each MoE layer of a decoder its K_l (experts per token) and whether Alloc-T pools them over
// the tokens processed together. Made from a budget (moe/budget.hpp: B routed activations per token summed over the
// MoE layers, a share of sum_l top-k or a count) by either
//   - uniform top-k reduction (uniform_allocation), or
//   - Alloc-L: the exact DP over a sensitivity table (moe/alloc_layers.hpp; the table moe_budget saves, one row per
//     MoE layer in layer order, measured on this model: its top-k per layer must match).
// In decoder_step each MoE layer routes with TopK{K_l}; with pool_tokens each CHUNK of the batch (one request's
// prompt chunk, or its one decode token) is its own pool: the chunk's T tokens take the K_l * T largest scores
// (moe/alloc_tokens.hpp), at least one expert each. Pooling per chunk keeps a request's tokens independent of its
// batch mates (continuous batching stays deterministic per request); they still depend on how its prompt is cut
// into chunks (EngineOptions::step_tokens), and a decode token (T = 1) is plain top-K_l. Either way the layer runs
// K_l * T activations for T tokens, so the step's routed activations are B per token.
#pragma once

#include "paradyse/moe/alloc_layers.hpp"
#include "paradyse/moe/budget.hpp"
#include "paradyse/moe/moe_config.hpp"
#include "paradyse/moe/sensitivity.hpp"
#include "paradyse/serve/hf_config.hpp"

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace paradyse::serve {

struct RoutingBudget {
  std::vector<std::int64_t> layer_k;  // [layers]: K_l of each MoE layer, 0 for dense layers; empty: every top-k
  bool pool_tokens = false;           // Alloc-T over each chunk's tokens

  bool active() const noexcept { return !layer_k.empty() || pool_tokens; }

  // The routing of decoder layer l: K_l, pooled when asked (pools: the rows of each chunk, alive during the call).
  TopK top_k(std::int64_t layer, std::span<const std::int64_t> pools) const {
    TopK k;
    if (!layer_k.empty()) k.k = layer_k[std::size_t(layer)];
    if (pool_tokens) {
      k.pool_tokens = true;
      k.pools = pools;
    }
    return k;
  }

  // B: routed activations per token summed over the MoE layers (without pooling: exactly each token's).
  std::int64_t activations_per_token(const DecoderConfig& c) const {
    std::int64_t b = 0;
    for (std::int64_t l = 0; l < c.layers; ++l)
      if (c.is_moe(l)) b += layer_k.empty() ? c.moe.top_k : layer_k[std::size_t(l)];
    return b;
  }

  void validate(const DecoderConfig& c) const {
    if (layer_k.empty()) return;
    check(std::int64_t(layer_k.size()) == c.layers, "RoutingBudget: {} per-layer K for a decoder of {} layers",
          layer_k.size(), c.layers);
    for (std::int64_t l = 0; l < c.layers; ++l) {
      const std::int64_t k = layer_k[std::size_t(l)];
      if (c.is_moe(l))
        check(k >= 1 && k <= c.moe.experts, "RoutingBudget: MoE layer {} has K = {}; expected 1 to E = {}", l, k,
              c.moe.experts);
      else
        check(k == 0, "RoutingBudget: dense layer {} has K = {}; expected 0", l, k);
    }
  }
};

// The MoE layers' own top-k (one entry per MoE layer, in layer order).
inline std::vector<std::int64_t> moe_layer_top_k(const DecoderConfig& c) {
  std::vector<std::int64_t> k;
  for (std::int64_t l = 0; l < c.layers; ++l)
    if (c.is_moe(l)) k.push_back(c.moe.top_k);
  return k;
}

// Per-MoE-layer K (in MoE-layer order) spread onto the decoder's layers (0 for dense ones).
inline RoutingBudget routing_budget_of(const DecoderConfig& c, const std::vector<std::int64_t>& moe_k, bool pool_tokens) {
  RoutingBudget b;
  b.pool_tokens = pool_tokens;
  std::size_t next = 0;
  for (std::int64_t l = 0; l < c.layers; ++l) {
    if (!c.is_moe(l)) {
      b.layer_k.push_back(0);
      continue;
    }
    check(next < moe_k.size(), "routing_budget_of: {} K_l for more MoE layers", moe_k.size());
    b.layer_k.push_back(moe_k[next++]);
  }
  check(next == moe_k.size(), "routing_budget_of: {} K_l for {} MoE layers", moe_k.size(), next);
  b.validate(c);
  return b;
}

// The budget `spec` on this decoder: Alloc-L over `table` when given (its layers and top-k must be this model's),
// else uniform top-k reduction; K_l <= top-k (the table's K_max when it looks above).
inline RoutingBudget make_routing_budget(const DecoderConfig& c, const BudgetSpec& spec, const SensitivityTable* table,
                                         bool pool_tokens) {
  const std::vector<std::int64_t> top_k = moe_layer_top_k(c);
  if (!table) return routing_budget_of(c, uniform_allocation(top_k, resolve_budget(spec, top_k)), pool_tokens);
  table->validate();
  check(table->top_k == top_k,
        "make_routing_budget: the sensitivity table has {} MoE layers (top-k of the first: {}), the model {} with "
        "top-k {} (a table of another model?)",
        table->layers(), table->top_k.empty() ? 0 : table->top_k[0], top_k.size(), c.moe.top_k);
  const std::vector<std::int64_t> k_max = table->k_max();
  for (std::size_t l = 0; l < k_max.size(); ++l)
    check(k_max[l] <= c.moe.experts, "make_routing_budget: the table's MoE layer {} goes to K = {}, above E = {}", l,
          k_max[l], c.moe.experts);
  return routing_budget_of(c, allocate_layers(table->delta, resolve_budget(spec, top_k, k_max)).k, pool_tokens);
}

inline std::string describe(const DecoderConfig& c, const RoutingBudget& b) {
  if (!b.active()) return "full (each layer its top-k)";
  std::string ks;
  for (std::int64_t l = 0; l < c.layers; ++l)
    if (c.is_moe(l)) ks += fmt::format("{}{}", ks.empty() ? "" : ",", b.layer_k.empty() ? c.moe.top_k : b.layer_k[std::size_t(l)]);
  return fmt::format("B = {} activations/token, K_l = [{}]{}", b.activations_per_token(c), ks,
                     b.pool_tokens ? ", Alloc-T pooled per chunk" : "");
}

}  // namespace paradyse::serve
