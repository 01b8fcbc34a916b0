// paradyse/plan/heuristic.hpp: ParaDySe's strategy selection (its Algorithm 1, `HeuristicPolicy.select_method`),
// over the same cost table as the exact planner, so that the two can be compared.
//
// Whole layers only (attention and MLP take the same strategy), and at most two strategies, as a prefix/suffix:
//   1. Score each strategy used by every layer; sort by (time, memory); drop any strategy slower than another that
//      needs no more memory (Pareto pruning).
//   2. (Optional, the paper's curriculum shortcut) once some batch found that nothing fits, return the least-memory
//      strategy everywhere at once; the paper's data arrive sorted short to long, so later batches cannot fit either.
//   3. For each strategy P[i] in order: if it fits everywhere and i = 0, return it; if it fits, keep it as an
//      option; otherwise, for each later P[k] that fits everywhere, try [P[i]] x e + [P[k]] x (L - e) for
//      e = 1 .. L-1 (the code's order), stopping at the first e that does not fit.
//   4. Return the fastest option, or the least-memory strategy everywhere when there is none (it does not fit).
// The paper's smoothing (keep the previous plan when within gamma of the new one) and its cache by (b, s) are in
// plan/cache.hpp, shared with the exact planner. Memory is tested with the same model as the exact planner (saved
// activations of all layers + the largest transient), not the paper's per-layer average.
#pragma once

#include "paradyse/plan/cost_table.hpp"
#include "paradyse/plan/planner.hpp"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace paradyse::plan {

struct HeuristicState {
  bool use_curriculum_shortcut = false;  // step 2 above; off by default (it is wrong for unsorted data)
  bool nothing_fit_before = false;
};

namespace detail {

// Per strategy: prefix sums over layers of time and saved bytes, prefix and suffix maxima of transients.
struct LayerSums {
  std::vector<double> time;              // time[l] = sum over layers < l
  std::vector<std::int64_t> saved;
  std::vector<std::int64_t> max_before;  // max transient over layers < l
  std::vector<std::int64_t> max_from;    // max transient over layers >= l
  bool allowed = true;

  LayerSums(const CostTable& table, Strategy s) {
    const std::size_t L = std::size_t(table.layer_count());
    time.assign(L + 1, 0);
    saved.assign(L + 1, 0);
    max_before.assign(L + 1, 0);
    max_from.assign(L + 1, 0);
    std::vector<std::int64_t> transient(L, 0);
    for (std::size_t l = 0; l < L; ++l) {
      const Option* a = table.option(table.layer_kinds[l], Sublayer::attention, s);
      const Option* m = table.option(table.layer_kinds[l], Sublayer::mlp, s);
      if (!a || !m) {
        allowed = false;
        return;
      }
      time[l + 1] = time[l] + a->time_s + m->time_s;
      saved[l + 1] = saved[l] + a->saved_bytes + m->saved_bytes;
      transient[l] = std::max(a->transient_bytes, m->transient_bytes);
      max_before[l + 1] = std::max(max_before[l], transient[l]);
    }
    for (std::size_t l = L; l-- > 0;) max_from[l] = std::max(max_from[l + 1], transient[l]);
  }
};

}  // namespace detail

inline Plan plan_heuristic(const CostTable& table, std::int64_t budget_bytes, HeuristicState* state = nullptr) {
  const int L = table.layer_count();
  struct Candidate {
    Strategy strategy;
    detail::LayerSums sums;
    double time;
    std::int64_t peak;
  };
  std::vector<Candidate> all;
  for (Strategy s = 0; s < table.strategy_count(); ++s) {
    detail::LayerSums sums(table, s);
    if (!sums.allowed) continue;
    const std::int64_t peak = table.fixed_bytes + sums.saved[std::size_t(L)] + sums.max_from[0];
    const double time = sums.time[std::size_t(L)];
    all.push_back({s, std::move(sums), time, peak});
  }
  check(!all.empty(), "plan_heuristic: no strategy is allowed in every layer");
  std::sort(all.begin(), all.end(), [](const Candidate& a, const Candidate& b) {
    return a.time != b.time ? a.time < b.time : a.peak < b.peak;
  });
  // Pareto pruning: drop a strategy when a faster one needs no more memory.
  std::vector<const Candidate*> P;
  for (const Candidate& c : all) {
    bool dominated = false;
    for (const Candidate& q : all) dominated = dominated || (q.time < c.time && q.peak <= c.peak);
    if (!dominated) P.push_back(&c);
  }
  const Candidate* least = &all.front();
  for (const Candidate& c : all)
    if (c.peak < least->peak || (c.peak == least->peak && c.time < least->time)) least = &c;
  const auto uniform = [&](const Candidate& c) {
    return plan_of(table, uniform_layers(table, c.strategy), budget_bytes);
  };
  if (state && state->use_curriculum_shortcut && state->nothing_fit_before) return uniform(*least);

  // The best option so far: strategy i on the first e layers, strategy k on the rest (e = L: i alone).
  double best_time = std::numeric_limits<double>::infinity();
  const Candidate* best_i = nullptr;
  const Candidate* best_k = nullptr;
  int best_e = 0;
  for (std::size_t i = 0; i < P.size(); ++i) {
    const Candidate& ci = *P[i];
    if (ci.peak <= budget_bytes) {
      if (i == 0) return uniform(ci);
      if (ci.time < best_time) best_time = ci.time, best_i = &ci, best_k = nullptr, best_e = L;
      continue;
    }
    for (std::size_t k = i + 1; k < P.size(); ++k) {
      const Candidate& ck = *P[k];
      if (ck.peak > budget_bytes) continue;
      for (int e = 1; e < L; ++e) {
        const auto E = std::size_t(e);
        const std::int64_t saved = ci.sums.saved[E] + ck.sums.saved[std::size_t(L)] - ck.sums.saved[E];
        const std::int64_t peak = table.fixed_bytes + saved + std::max(ci.sums.max_before[E], ck.sums.max_from[E]);
        if (peak > budget_bytes) break;  // the code's OOM short-circuit
        const double time = ci.sums.time[E] + ck.sums.time[std::size_t(L)] - ck.sums.time[E];
        if (time < best_time) best_time = time, best_i = &ci, best_k = &ck, best_e = e;
      }
    }
  }
  if (!best_i) {
    if (state) state->nothing_fit_before = true;
    return uniform(*least);
  }
  std::vector<LayerStrategies> layers(static_cast<std::size_t>(L));
  for (int l = 0; l < L; ++l) {
    const Strategy s = l < best_e || !best_k ? best_i->strategy : best_k->strategy;
    layers[std::size_t(l)] = {s, s};
  }
  return plan_of(table, layers, budget_bytes);
}

}  // namespace paradyse::plan
