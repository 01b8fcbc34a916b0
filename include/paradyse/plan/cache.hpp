// paradyse/plan/cache.hpp: plans cached by (samples, length bucket), and ParaDySe's smoothing: keep the previous
// plan while it is predicted within gamma (5%) of the new optimum and still fits.
//
// Buckets. A length is rounded up to its bucket's upper edge and the plan is made for that edge: memory and time
// grow with length, so the plan fits every length in the bucket (the cache never returns a plan that runs out of
// memory); near the limit, where the edge does not fit but the length does, the length is planned exactly.
// Buckets are geometric above `min_width`: 2^fraction_bits buckets per octave (default 8, so a bucket is
// at most 12.5% wide), which keeps the cache small for long-tailed length distributions.
// Packed batches (several lengths per sample) are planned directly, not cached: their attention cost depends on
// every length, and planning takes microseconds.
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/plan/cost_table.hpp"
#include "paradyse/plan/heuristic.hpp"
#include "paradyse/plan/planner.hpp"

#include <bit>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace paradyse::plan {

struct Bucketing {
  std::int64_t min_width = 256;  // lengths up to here share buckets of this width
  int fraction_bits = 3;         // above: 2^fraction_bits buckets per octave

  // The upper edge of the bucket holding `length` (>= length).
  std::int64_t edge(std::int64_t length) const {
    check(length >= 1, "Bucketing: length {} must be positive", length);
    std::int64_t width = min_width;
    const int octave = std::bit_width(std::uint64_t(length)) - 1;
    if (octave - fraction_bits >= 0) width = std::max(width, std::int64_t(1) << (octave - fraction_bits));
    return (length + width - 1) / width * width;
  }
};

// A planning function over a cost table and a budget (plan_exact, or plan_heuristic with its state).
using PlanSolver = std::function<Plan(const CostTable&, std::int64_t)>;

inline PlanSolver exact_solver() {
  return [](const CostTable& t, std::int64_t budget) { return plan_exact(t, budget); };
}
inline PlanSolver heuristic_solver(HeuristicState* state = nullptr) {
  return [state](const CostTable& t, std::int64_t budget) { return plan_heuristic(t, budget, state); };
}

struct CacheStats {
  std::uint64_t hits = 0;
  std::uint64_t misses = 0;
  std::uint64_t kept_previous = 0;  // smoothing kept the previous plan
  std::uint64_t exact_fallbacks = 0;  // the bucket's edge did not fit, so the exact length was planned
};

class PlanCache {
public:
  // `candidates`: the strategies plans may use (empty: every strategy of the list).
  PlanCache(ModelConfig model, cost::HardwareProfile hardware, int group_size, std::int64_t budget_bytes,
            PlanSolver solver = exact_solver(), double gamma = 0.05, Bucketing bucketing = {},
            std::vector<Strategy> candidates = {})
      : model_(std::move(model)), hardware_(std::move(hardware)), group_size_(group_size),
        budget_bytes_(budget_bytes), solver_(std::move(solver)), gamma_(gamma), bucketing_(bucketing),
        candidates_(std::move(candidates)) {
    check(gamma >= 0, "PlanCache: gamma = {} must not be negative", gamma);
  }

  // The plan for a batch: cached by (samples, bucket), then smoothed against the previous plan. When nothing fits
  // the bucket's edge, the exact length is planned (uncached); NoFeasiblePlan only when that does not fit either.
  Plan plan_for(const Batch& batch) {
    if (batch.lengths.size() != 1) {
      const CostTable table = build_cost_table(model_, hardware_, group_size_, batch, candidates_);
      return smooth(table, solver_(table, budget_bytes_));
    }
    const std::pair<std::int64_t, std::int64_t> key{batch.samples, bucketing_.edge(batch.lengths[0])};
    auto it = entries_.find(key);
    if (it == entries_.end()) {
      ++stats_.misses;
      Entry entry{build_cost_table(model_, hardware_, group_size_, Batch::single(key.second, key.first), candidates_),
                  {}, {}};
      try {
        entry.optimum = solver_(entry.table, budget_bytes_);
      } catch (const NoFeasiblePlan& e) {
        entry.failure = std::make_shared<NoFeasiblePlan>(e);
      }
      it = entries_.emplace(key, std::move(entry)).first;
    } else {
      ++stats_.hits;
    }
    if (!it->second.failure && it->second.optimum->fits()) return smooth(it->second.table, *it->second.optimum);
    // Nothing fits the bucket's edge: the length itself may still fit (it is shorter). Plan it exactly, uncached.
    if (key.second != batch.lengths[0]) {
      ++stats_.exact_fallbacks;
      const CostTable table = build_cost_table(model_, hardware_, group_size_, batch, candidates_);
      return smooth(table, solver_(table, budget_bytes_));
    }
    if (it->second.failure) throw *it->second.failure;
    return smooth(it->second.table, *it->second.optimum);
  }

  const CacheStats& stats() const { return stats_; }
  std::size_t size() const { return entries_.size(); }
  void clear() {
    entries_.clear();
    previous_.reset();
  }
  const Bucketing& bucketing() const { return bucketing_; }

private:
  struct Entry {
    CostTable table;
    std::optional<Plan> optimum;
    std::shared_ptr<NoFeasiblePlan> failure;
  };

  // Keeps the previous plan when it is allowed, fits and is predicted within (1 + gamma) of the new optimum.
  Plan smooth(const CostTable& table, const Plan& optimum) {
    if (previous_ && *previous_ != optimum.strategies()) {
      const Evaluation e = evaluate(table, *previous_);
      if (e.allowed && e.peak_bytes() <= budget_bytes_ && e.time_s < (1 + gamma_) * optimum.time_s) {
        ++stats_.kept_previous;
        return plan_of(table, *previous_, budget_bytes_);
      }
    }
    previous_ = optimum.strategies();
    return optimum;
  }

  ModelConfig model_;
  cost::HardwareProfile hardware_;
  int group_size_;
  std::int64_t budget_bytes_;
  PlanSolver solver_;
  double gamma_;
  Bucketing bucketing_;
  std::vector<Strategy> candidates_;
  std::map<std::pair<std::int64_t, std::int64_t>, Entry> entries_;
  std::optional<std::vector<LayerStrategies>> previous_;
  CacheStats stats_;
};

}  // namespace paradyse::plan
