// paradyse/plan/planner.hpp: the exact planner. Per layer and per sublayer a strategy, minimising predicted time
// subject to the memory budget, or a clear error saying that nothing fits and by how much.
//
//   auto table = plan::build_cost_table(model, profile, p, plan::Batch::single(s));
//   plan::Plan best = plan::plan_exact(table, budget);      // throws plan::NoFeasiblePlan
//
// The cost table gives every (layer kind, sublayer, strategy) its time, saved and transient bytes; the layers of
// one kind and sublayer form one group of identical slots, solved exactly by plan/exact_solver.hpp (which says why
// it is exact). Strategies a configuration forbids have no option and are never chosen. Within a kind, layers with
// larger transients are placed later, so that the predicted peak (all saved activations + the largest transient)
// is what the backward of the last layers actually reaches.
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/plan/cost_table.hpp"
#include "paradyse/plan/exact_solver.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace paradyse::plan {

inline std::string format_bytes(double bytes) {
  const double gib = 1024.0 * 1024.0 * 1024.0;
  if (std::abs(bytes) >= gib) return fmt::format("{:.2f} GiB", bytes / gib);
  if (std::abs(bytes) >= 1024.0 * 1024.0) return fmt::format("{:.1f} MiB", bytes / (1024.0 * 1024.0));
  return fmt::format("{:.0f} B", bytes);
}

struct LayerPlan {
  LayerStrategies strategies;
  double attention_s = 0;
  double mlp_s = 0;
  std::int64_t saved_bytes = 0;      // both sublayers
  std::int64_t transient_bytes = 0;  // the larger of the two
  double time_s() const { return attention_s + mlp_s; }
};

struct Plan {
  std::vector<LayerPlan> layers;
  double time_s = 0;
  cost::MemoryEstimate memory;  // model_states holds all fixed bytes
  std::int64_t budget_bytes = 0;
  std::vector<std::string> strategy_names;  // of the list the plan's indices refer to

  std::string_view strategy_name(int s) const { return strategy_names.at(std::size_t(s)); }

  std::int64_t peak_bytes() const { return memory.peak(); }
  bool fits() const { return peak_bytes() <= budget_bytes; }
  std::vector<LayerStrategies> strategies() const {
    std::vector<LayerStrategies> s;
    for (const LayerPlan& l : layers) s.push_back(l.strategies);
    return s;
  }
  // "attention 6x MegatronTS + 2x METP; mlp 8x MegatronTS"
  std::string summary() const {
    std::string out;
    for (Sublayer part : cost::kAllSublayers) {
      std::map<int, int> counts;
      for (const LayerPlan& l : layers)
        ++counts[int(part == Sublayer::attention ? l.strategies.attention : l.strategies.mlp)];
      out += fmt::format("{}{} ", out.empty() ? "" : "; ", cost::name_of(part));
      bool first = true;
      for (const auto& [s, n] : counts) {
        out += fmt::format("{}{}x {}", first ? "" : " + ", n, strategy_name(s));
        first = false;
      }
    }
    return out;
  }
};

// Nothing fits the budget: says by how much, and what the least-memory plan needs.
class NoFeasiblePlan : public Error {
public:
  NoFeasiblePlan(const std::string& message, std::int64_t least_peak_bytes, std::int64_t budget_bytes,
                 std::source_location where = std::source_location::current())
      : Error(message, where), least_peak_bytes_(least_peak_bytes), budget_bytes_(budget_bytes) {}
  std::int64_t least_peak_bytes() const noexcept { return least_peak_bytes_; }
  std::int64_t budget_bytes() const noexcept { return budget_bytes_; }
  std::int64_t shortfall_bytes() const noexcept { return least_peak_bytes_ - budget_bytes_; }

private:
  std::int64_t least_peak_bytes_, budget_bytes_;
};

// The plan of given per-layer strategies, with its predicted time and memory (forbidden choices throw).
inline Plan plan_of(const CostTable& table, const std::vector<LayerStrategies>& layers, std::int64_t budget_bytes) {
  const Evaluation e = evaluate(table, layers);
  check(e.allowed, "plan: forbidden choice: {}", e.forbidden);
  Plan plan;
  plan.strategy_names = table.strategy_names;
  plan.time_s = e.time_s;
  plan.memory = e.memory;
  plan.budget_bytes = budget_bytes;
  for (std::size_t l = 0; l < layers.size(); ++l) {
    const int kind = table.layer_kinds[l];
    const Option* a = table.option(kind, Sublayer::attention, layers[l].attention);
    const Option* m = table.option(kind, Sublayer::mlp, layers[l].mlp);
    plan.layers.push_back({layers[l], a->time_s, m->time_s, a->saved_bytes + m->saved_bytes,
                           std::max(a->transient_bytes, m->transient_bytes)});
  }
  return plan;
}

// The slot groups of a cost table: group 2k is the attention of layer kind k, group 2k+1 its MLP.
inline Problem problem_of(const CostTable& table, std::int64_t budget_bytes) {
  Problem problem;
  problem.fixed_bytes = table.fixed_bytes;
  problem.budget_bytes = budget_bytes;
  for (std::size_t k = 0; k < table.kind_names.size(); ++k) {
    const int count = int(std::count(table.layer_kinds.begin(), table.layer_kinds.end(), int(k)));
    for (Sublayer part : cost::kAllSublayers) {
      SlotGroup g;
      g.name = fmt::format("{} {}", table.kind_names[k], cost::name_of(part));
      g.count = count;
      std::string reasons;
      for (Strategy s = 0; s < table.strategy_count(); ++s) {
        if (const Option* o = table.option(int(k), part, s)) g.options.push_back(*o);
        else reasons += fmt::format("{}{}", reasons.empty() ? "" : "; ", table.entry(int(k), part, s).forbidden_reason);
      }
      check(count == 0 || !g.options.empty(), "plan: {} has no allowed strategy ({})", g.name, reasons);
      problem.groups.push_back(std::move(g));
    }
  }
  return problem;
}

// Per-layer strategies from group counts: within a kind, smaller transients first.
inline std::vector<LayerStrategies> layers_of(const CostTable& table, const Problem& problem, const Assignment& a) {
  std::vector<LayerStrategies> layers(std::size_t(table.layer_count()));
  for (std::size_t k = 0; k < table.kind_names.size(); ++k) {
    for (Sublayer part : cost::kAllSublayers) {
      const std::size_t g = 2 * k + std::size_t(part);
      const SlotGroup& group = problem.groups[g];
      std::vector<int> order;
      for (int i = 0; i < int(group.options.size()); ++i)
        if (a.counts[g][std::size_t(i)] > 0) order.push_back(i);
      std::stable_sort(order.begin(), order.end(), [&](int x, int y) {
        return group.options[std::size_t(x)].transient_bytes < group.options[std::size_t(y)].transient_bytes;
      });
      std::size_t next = 0;
      int left = order.empty() ? 0 : a.counts[g][std::size_t(order[0])];
      for (std::size_t l = 0; l < layers.size(); ++l) {
        if (table.layer_kinds[l] != int(k)) continue;
        while (left == 0) left = a.counts[g][std::size_t(order[++next])];
        const Strategy s = group.options[std::size_t(order[next])].strategy;
        (part == Sublayer::attention ? layers[l].attention : layers[l].mlp) = s;
        --left;
      }
    }
  }
  return layers;
}

inline std::string nothing_fits_message(const CostTable& table, const Plan& least, std::int64_t budget_bytes) {
  return fmt::format(
      "no plan fits the memory budget of {} per device: the least-memory plan ({}) needs {} (model states and fixed "
      "{}, saved activations {}, largest transient {}), {} more than the budget, for a batch of {} x {} tokens on "
      "{} ranks",
      format_bytes(double(budget_bytes)), least.summary(), format_bytes(double(least.peak_bytes())),
      format_bytes(double(least.memory.model_states)), format_bytes(double(least.memory.saved_activations)),
      format_bytes(double(least.memory.largest_transient)), format_bytes(double(least.peak_bytes() - budget_bytes)),
      table.batch.samples, table.batch.tokens_per_sample(), table.group_size);
}

// The least-memory plan (it may not fit): what nothing-fits errors report.
inline Plan least_memory_plan(const CostTable& table, std::int64_t budget_bytes) {
  const Problem problem = problem_of(table, budget_bytes);
  return plan_of(table, layers_of(table, problem, least_memory(problem)), budget_bytes);
}

// The fastest plan within `budget_bytes` per rank; throws NoFeasiblePlan when nothing fits.
inline Plan plan_exact(const CostTable& table, std::int64_t budget_bytes) {
  const Problem problem = problem_of(table, budget_bytes);
  const std::optional<Assignment> best = solve_exact(problem);
  if (!best) {
    const Plan least = plan_of(table, layers_of(table, problem, least_memory(problem)), budget_bytes);
    throw NoFeasiblePlan(nothing_fits_message(table, least, budget_bytes), least.peak_bytes(), budget_bytes);
  }
  return plan_of(table, layers_of(table, problem, *best), budget_bytes);
}

// All in one: predicts the costs, then plans. A negative budget means the profile's usable memory.
inline Plan plan_exact(const ModelConfig& model, const cost::HardwareProfile& hardware, int group_size,
                       const Batch& batch, std::int64_t budget_bytes = -1,
                       std::span<const Strategy> candidates = {}) {
  const CostTable table = build_cost_table(model, hardware, group_size, batch, candidates);
  return plan_exact(table, budget_bytes < 0 ? hardware.usable_memory_bytes() : budget_bytes);
}

}  // namespace paradyse::plan
