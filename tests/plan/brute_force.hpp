// tests/plan/brute_force.hpp: plain exhaustive references for the planner tests.
#pragma once

#include "paradyse/cost/dry_run.hpp"
#include "paradyse/plan/cost_table.hpp"
#include "paradyse/plan/exact_solver.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <vector>

namespace paradyse::plan::testing {

struct BruteForceResult {
  bool feasible = false;
  double best_time = std::numeric_limits<double>::infinity();
  std::int64_t least_peak = std::numeric_limits<std::int64_t>::max();
};

// Every count vector of every group (slots within a group are identical, so counts are all there is).
inline BruteForceResult brute_force(const Problem& problem) {
  BruteForceResult r;
  std::vector<std::vector<int>> counts;
  for (const SlotGroup& g : problem.groups) counts.emplace_back(g.options.size(), 0);
  std::function<void(std::size_t, std::size_t, int)> visit = [&](std::size_t g, std::size_t i, int left) {
    if (g == problem.groups.size()) {
      double time = 0;
      std::int64_t saved = 0, transient = 0;
      for (std::size_t k = 0; k < problem.groups.size(); ++k)
        for (std::size_t j = 0; j < problem.groups[k].options.size(); ++j) {
          if (counts[k][j] == 0) continue;
          const Option& o = problem.groups[k].options[j];
          time += counts[k][j] * o.time_s;
          saved += counts[k][j] * o.saved_bytes;
          transient = std::max(transient, o.transient_bytes);
        }
      const std::int64_t peak = problem.fixed_bytes + saved + transient;
      r.least_peak = std::min(r.least_peak, peak);
      if (peak <= problem.budget_bytes) {
        r.feasible = true;
        r.best_time = std::min(r.best_time, time);
      }
      return;
    }
    const SlotGroup& group = problem.groups[g];
    if (group.options.empty() || i + 1 == group.options.size()) {
      if (!group.options.empty()) counts[g][i] = left;
      if (group.options.empty() && left > 0) return;
      visit(g + 1, 0, g + 1 < problem.groups.size() ? problem.groups[g + 1].count : 0);
      if (!group.options.empty()) counts[g][i] = 0;
      return;
    }
    for (int c = 0; c <= left; ++c) {
      counts[g][i] = c;
      visit(g, i + 1, left - c);
    }
    counts[g][i] = 0;
  };
  if (!problem.groups.empty()) visit(0, 0, problem.groups[0].count);
  return r;
}

// Every per-layer, per-sublayer assignment of a (small) cost table.
inline BruteForceResult brute_force_layers(const CostTable& table, std::int64_t budget) {
  BruteForceResult r;
  const int L = table.layer_count();
  std::vector<LayerStrategies> layers(static_cast<std::size_t>(L));
  std::function<void(int)> visit = [&](int slot) {
    if (slot == 2 * L) {
      const Evaluation e = evaluate(table, layers);
      if (!e.allowed) return;
      r.least_peak = std::min(r.least_peak, e.peak_bytes());
      if (e.peak_bytes() <= budget) {
        r.feasible = true;
        r.best_time = std::min(r.best_time, e.time_s);
      }
      return;
    }
    for (Strategy s = 0; s < table.strategy_count(); ++s) {
      (slot % 2 == 0 ? layers[std::size_t(slot / 2)].attention : layers[std::size_t(slot / 2)].mlp) = s;
      visit(slot + 1);
    }
  };
  visit(0);
  return r;
}

// The options of one layer kind written by hand: [sublayer][strategy], one per strategy of the default catalog.
using KindOptions = std::array<std::vector<Option>, 2>;

// Options for every strategy of the default catalog, all equal to `o` (each with its own strategy index).
inline KindOptions uniform_kind(Option o) {
  KindOptions kind;
  for (auto& part : kind)
    for (Strategy s = 0; s < cost::default_catalog().count(); ++s) {
      o.strategy = s;
      part.push_back(o);
    }
  return kind;
}

// A cost table written by hand: one layer kind per entry of `kinds`, options[kind][sublayer] per strategy of the
// default catalog (an option with negative time means forbidden).
inline CostTable synthetic_table(const std::vector<KindOptions>& kinds, std::vector<int> layer_kinds,
                                 std::int64_t fixed_bytes) {
  const std::size_t count = std::size_t(cost::default_catalog().count());
  CostTable t;
  t.group_size = 8;
  t.batch = Batch::single(1024);
  t.layer_kinds = std::move(layer_kinds);
  t.fixed_bytes = fixed_bytes;
  t.strategy_names = cost::default_catalog().names();
  t.entries.resize(kinds.size());
  for (std::size_t k = 0; k < kinds.size(); ++k) {
    t.kind_names.push_back(fmt::format("kind{}", k));
    for (std::size_t part = 0; part < 2; ++part) {
      check(kinds[k][part].size() == count, "synthetic_table: {} options, expected one per strategy ({})",
            kinds[k][part].size(), count);
      t.entries[k][part].resize(count);
      for (std::size_t s = 0; s < count; ++s) {
        Option o = kinds[k][part][s];
        o.strategy = Strategy(s);
        if (o.time_s < 0) t.entries[k][part][s].forbidden_reason = "forbidden by the test";
        else t.entries[k][part][s].option = o;
      }
    }
  }
  return t;
}

}  // namespace paradyse::plan::testing
