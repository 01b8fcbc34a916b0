// paradyse/moe/alloc_layers.hpp: Alloc-L, the exact per-layer allocation of an activation budget (issue 12).
//
// Given each MoE layer's sensitivity delta[l][k-1] = Delta_l(k) (the quality lost when only layer l runs k experts,
// k = 1 .. K_max_l; moe/sensitivity.hpp measures it) and a budget B (moe/budget.hpp), find integers K_l with
//   minimise sum_l Delta_l(K_l)  subject to  sum_l K_l = B,  1 <= K_l <= K_max_l.
// This is a grouped knapsack (one choice per group, exact total weight). Solved exactly by dynamic programming over
// suffixes:
//   S[L][0] = 0, S[L][b > 0] = +inf;  S[l][b] = min over k of ( Delta_l(k) + S[l+1][b-k] ),
// then walked forward from layer 0 with b = B, each layer taking the SMALLEST k that attains S[l][b]. Among all
// optimal allocations this returns the lexicographically smallest K (fewest experts to the lowest layers first): a
// deterministic tie rule that does not depend on the order of the table's floating-point sums beyond S itself.
// Time O(L B K_max), memory O(L B): DeepSeek-V2-Lite (L = 26, K_max = 6, B = 78) is ~12k steps, a few microseconds.
//
// The objective assumes the layers' losses add up (the separable approximation of the paper); it is exact for the
// table it is given, not for the model.
#pragma once

#include "paradyse/core/error.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

namespace paradyse {

struct LayerAllocation {
  std::vector<std::int64_t> k;  // [L]: K_l
  double predicted = 0;         // sum_l Delta_l(K_l) under the table (the separable estimate of the loss)
};

// delta: one row per MoE layer, row l = [Delta_l(1), ..., Delta_l(K_max_l)] (rows may differ in length); finite.
inline LayerAllocation allocate_layers(std::span<const std::vector<double>> delta, std::int64_t budget) {
  const std::size_t layers = delta.size();
  check(layers >= 1, "allocate_layers: an empty sensitivity table (no MoE layer)");
  std::int64_t most = 0;
  for (std::size_t l = 0; l < layers; ++l) {
    check(!delta[l].empty(), "allocate_layers: layer {} has no entry; expected Delta_l(1) .. Delta_l(K_max)", l);
    for (std::size_t j = 0; j < delta[l].size(); ++j)
      check(std::isfinite(delta[l][j]), "allocate_layers: Delta_{}({}) = {} is not finite", l, j + 1, delta[l][j]);
    most += std::int64_t(delta[l].size());
  }
  check(budget >= std::int64_t(layers) && budget <= most,
        "allocate_layers: budget {} outside [{} (one expert per layer), {} (K_max in every layer)]", budget, layers,
        most);
  constexpr double inf = std::numeric_limits<double>::infinity();
  const std::size_t width = std::size_t(budget) + 1;
  // suffix[l * width + b] = S[l][b]; row L is the empty suffix.
  std::vector<double> suffix((layers + 1) * width, inf);
  suffix[layers * width] = 0;
  for (std::size_t l = layers; l-- > 0;) {
    const double* next = &suffix[(l + 1) * width];
    double* row = &suffix[l * width];
    const std::int64_t k_max = std::int64_t(delta[l].size());
    for (std::int64_t b = 1; b <= budget; ++b) {
      double best = inf;
      for (std::int64_t k = 1; k <= std::min(k_max, b); ++k) {
        const double rest = next[b - k];
        if (rest == inf) continue;
        const double total = delta[l][std::size_t(k - 1)] + rest;
        if (total < best) best = total;
      }
      row[b] = best;
    }
  }
  LayerAllocation a;
  a.k.assign(layers, 0);
  a.predicted = suffix[std::size_t(budget)];
  std::int64_t b = budget;
  for (std::size_t l = 0; l < layers; ++l) {
    const double* next = &suffix[(l + 1) * width];
    const double target = suffix[l * width + std::size_t(b)];
    const std::int64_t k_max = std::int64_t(delta[l].size());
    for (std::int64_t k = 1; k <= std::min(k_max, b); ++k) {
      const double rest = next[b - k];
      if (rest != inf && delta[l][std::size_t(k - 1)] + rest == target) {  // the same sum that made S: exact
        a.k[l] = k;
        break;
      }
    }
    b -= a.k[l];
  }
  return a;
}

// sum_l Delta_l(K_l) for a given allocation (summed from the last layer, as the DP does).
inline double allocation_loss(std::span<const std::vector<double>> delta, std::span<const std::int64_t> k) {
  check(k.size() == delta.size(), "allocation_loss: {} K_l for {} layers", k.size(), delta.size());
  double sum = 0;
  for (std::size_t l = k.size(); l-- > 0;) {
    check(k[l] >= 1 && k[l] <= std::int64_t(delta[l].size()), "allocation_loss: K_{} = {} outside [1, {}]", l, k[l],
          delta[l].size());
    sum = delta[l][std::size_t(k[l] - 1)] + sum;
  }
  return sum;
}

}  // namespace paradyse
