// paradyse/moe/budget.hpp: the activation budget of Alloc-MoE (issue 12).
//
// B counts ROUTED-expert activations per token, summed over the MoE layers: a model whose L MoE layers each run
// top-k_l has the full budget sum_l k_l. Shared experts are always on and are not counted; dense layers (before
// first_k_dense) are not MoE layers and are not counted either. A per-layer allocation K = [K_0 .. K_{L-1}] meets a
// budget B when sum_l K_l = B with 1 <= K_l <= K_max_l (every layer keeps at least one expert).
//
// A budget is given either as a share of the model's own full budget or as a number of activations:
//   "50%"  -> half of sum_l k_l      "0.5" -> the same (a decimal fraction, must contain a '.')
//   "78"   -> exactly 78 activations per token (an integer without '.' or '%')
// A share resolves to round(share * full) (halves away from zero), and the result must be feasible: at least L (one
// expert per layer) and at most sum_l K_max_l. Every refusal names the text or the value and the range expected.
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/printable.hpp"

#include <charconv>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

namespace paradyse {

struct BudgetSpec {
  enum class Kind { share, count };
  Kind kind = Kind::share;
  double share = 1.0;       // Kind::share: a fraction of the full budget, in (0, ...]
  std::int64_t count = 0;   // Kind::count: activations per token over all MoE layers

  static BudgetSpec of_share(double s) { return {Kind::share, s, 0}; }
  static BudgetSpec of_count(std::int64_t n) { return {Kind::count, 1.0, n}; }
};

// "50%", "0.5" or "78" (see the top of this file).
inline BudgetSpec parse_budget(std::string_view text) {
  std::string_view body = text;
  while (!body.empty() && body.front() == ' ') body.remove_prefix(1);
  while (!body.empty() && body.back() == ' ') body.remove_suffix(1);
  check(!body.empty(), "budget: an empty budget; expected a share (\"50%\", \"0.5\") or a count of activations (\"78\")");
  const bool percent = body.back() == '%';
  if (percent) body.remove_suffix(1);
  const bool decimal = body.find_first_of(".eE") != std::string_view::npos;
  if (percent || decimal) {
    double value = 0;
    const auto [end, ec] = std::from_chars(body.data(), body.data() + body.size(), value);
    check(ec == std::errc() && end == body.data() + body.size() && std::isfinite(value),
          "budget: \"{}\" is not a number; expected a share (\"50%\", \"0.5\") or a count of activations (\"78\")",
          text);
    const double share = percent ? value / 100.0 : value;
    check(share > 0, "budget: \"{}\" is a share of {}; expected a share above 0", text, share);
    return BudgetSpec::of_share(share);
  }
  std::int64_t value = 0;
  const auto [end, ec] = std::from_chars(body.data(), body.data() + body.size(), value);
  check(ec == std::errc() && end == body.data() + body.size(),
        "budget: \"{}\" is not a number; expected a share (\"50%\", \"0.5\") or a count of activations (\"78\")",
        printable(text));
  check(value >= 1, "budget: \"{}\" activations; expected a count of at least 1", printable(text));
  return BudgetSpec::of_count(value);
}

// The model's own budget: sum of each MoE layer's top-k. Each must be >= 1.
inline std::int64_t full_budget(std::span<const std::int64_t> layer_top_k) {
  check(!layer_top_k.empty(), "budget: the model has no MoE layer");
  std::int64_t sum = 0;
  for (std::size_t l = 0; l < layer_top_k.size(); ++l) {
    check(layer_top_k[l] >= 1, "budget: MoE layer {} has top-k = {}; expected at least 1", l, layer_top_k[l]);
    sum += layer_top_k[l];
  }
  return sum;
}

// The number of activations per token a budget means for a model with these top-k (the full budget) and these
// most experts per layer (k_max: the bound of each K_l; at least its top-k). Throws when infeasible.
inline std::int64_t resolve_budget(const BudgetSpec& spec, std::span<const std::int64_t> layer_top_k,
                                   std::span<const std::int64_t> layer_k_max) {
  const std::int64_t full = full_budget(layer_top_k);
  check(layer_k_max.size() == layer_top_k.size(), "budget: {} per-layer K_max for {} MoE layers", layer_k_max.size(),
        layer_top_k.size());
  const std::int64_t layers = std::int64_t(layer_top_k.size());
  std::int64_t most = 0;
  for (std::size_t l = 0; l < layer_k_max.size(); ++l) {
    check(layer_k_max[l] >= layer_top_k[l], "budget: MoE layer {} has K_max = {} below its top-k = {}", l,
          layer_k_max[l], layer_top_k[l]);
    most += layer_k_max[l];
  }
  std::int64_t budget = 0;
  if (spec.kind == BudgetSpec::Kind::share) {
    check(std::isfinite(spec.share) && spec.share > 0, "budget: a share of {}; expected a share above 0", spec.share);
    budget = std::llround(spec.share * double(full));
    check(budget >= layers && budget <= most,
          "budget: a share of {} of the full budget {} is {} activations per token; expected {} (one expert in each "
          "of the {} MoE layers) to {} (K_max in every layer), i.e. a share in [{:.4g}, {:.4g}]",
          spec.share, full, budget, layers, layers, most, double(layers) / double(full), double(most) / double(full));
  } else {
    budget = spec.count;
    check(budget >= layers && budget <= most,
          "budget: {} activations per token; expected {} (one expert in each of the {} MoE layers) to {} (K_max in "
          "every layer)",
          budget, layers, layers, most);
  }
  return budget;
}

// The same with K_max = the top-k of each layer (no layer may run more experts than it was trained with).
inline std::int64_t resolve_budget(const BudgetSpec& spec, std::span<const std::int64_t> layer_top_k) {
  return resolve_budget(spec, layer_top_k, layer_top_k);
}

// Uniform top-k reduction, the baseline: every layer keeps one expert, and the other budget - L activations are
// shared in proportion to each layer's own k_l - 1 (for a model with the same k in every layer: budget / L each),
// the remainders by largest remainder, the lower layer index first on a tie. So sum_l K_l = budget exactly and
// 1 <= K_l <= k_l. Needs L <= budget <= full.
inline std::vector<std::int64_t> uniform_allocation(std::span<const std::int64_t> layer_top_k, std::int64_t budget) {
  const std::int64_t full = full_budget(layer_top_k), layers = std::int64_t(layer_top_k.size());
  check(budget >= layers && budget <= full,
        "uniform_allocation: budget {} outside [{} (one expert per layer), {} (the model's own top-k)]", budget, layers,
        full);
  std::vector<std::int64_t> k(layer_top_k.size(), 1);
  const std::int64_t spare = budget - layers, room = full - layers;
  if (room == 0) return k;
  std::vector<std::int64_t> remainder(layer_top_k.size());
  std::int64_t given = 0;
  for (std::size_t l = 0; l < k.size(); ++l) {
    const std::int64_t scaled = spare * (layer_top_k[l] - 1);  // < 2^63 for any real model
    k[l] += scaled / room;
    remainder[l] = scaled % room;
    given += scaled / room;
  }
  for (std::int64_t left = spare - given; left > 0; --left) {
    std::size_t best = 0;
    for (std::size_t l = 1; l < k.size(); ++l)
      if (remainder[l] > remainder[best]) best = l;
    ++k[best];
    remainder[best] = -1;
  }
  return k;
}

}  // namespace paradyse
