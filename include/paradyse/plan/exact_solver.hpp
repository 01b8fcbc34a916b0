// paradyse/plan/exact_solver.hpp: the exact minimum-time strategy assignment under a memory budget.
//
// The problem. Slots come in groups of identical slots (the attention sublayers of all dense layers, the MLPs of
// all MoE layers, ...). Every slot takes one option (a strategy) with time t, saved bytes a and transient bytes m.
// Minimise sum(t) subject to   fixed + sum(a) + max(m) <= budget.
//
// Why the method below is exact.
//  1. The max. Let tau be the largest transient of an optimal assignment; it is one of the <= (groups x options)
//     distinct transient values. For each such value tau, restrict every slot to options with m <= tau and require
//     sum(a) <= budget - fixed - tau. Every assignment feasible there is feasible for the original problem (its max
//     is <= tau), and the optimum is feasible for its own tau. So the best over all tau is the optimum.
//  2. For one tau, a slot never needs a dominated option (one with more saved bytes and no less time than another):
//     swapping it for the dominating one keeps feasibility and does not add time. Within a group the remaining
//     options, sorted by saved bytes, get strictly faster. Take the least-saved one as the base; choosing option i
//     instead "upgrades" the slot with weight w_i = a_i - a_0 and gain v_i = t_0 - t_i. What is left is a
//     multiple-choice knapsack whose slots within a group are identical: maximise the gain of the upgrade counts
//     c[g][i] with sum c[g][i] <= n_g per group and sum c w <= capacity.
//  3. Branch and bound over the counts, group by group, fastest option first. The bound at a node is the
//     linear-programming relaxation of what is undecided: per group the concave hull of its (w, v) points, filled
//     greedily by slope (optimal for fractional multiple-choice knapsack). It is a true upper bound, so pruning
//     never discards an optimum; the search is exhaustive otherwise. Along one count c the node value "gain so far
//     + bound" is concave in c (an LP value is concave in its right-hand side), so children are visited best first
//     (from the peak outward), and each side stops at its first value that cannot beat the incumbent: every count
//     beyond it is worse still. Best-first order finds a near-optimal incumbent on the first dive.
//  4. Thresholds are visited best bound first and skipped once their bound cannot beat the incumbent.
// Times are compared with a relative tolerance of 1e-12 (ties between equal-time assignments break arbitrarily).
//
// Cost: no heap allocation inside the search; a 96-layer, 5-strategy, 2-sublayer problem solves in microseconds
// (bench/planner_bench.cpp).
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/plan/cost_table.hpp"

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

namespace paradyse::plan {

// `count` identical slots and the options allowed in them.
struct SlotGroup {
  std::string name;
  int count = 0;
  std::vector<Option> options;
};

struct Problem {
  std::vector<SlotGroup> groups;
  std::int64_t fixed_bytes = 0;   // needed by every assignment (model states, ...)
  std::int64_t budget_bytes = 0;
};

// How many slots of each group take each option (indices into the group's options), and what that costs.
struct Assignment {
  std::vector<std::vector<int>> counts;
  double time_s = 0;
  std::int64_t fixed_bytes = 0;
  std::int64_t saved_bytes = 0;
  std::int64_t largest_transient_bytes = 0;
  std::int64_t peak_bytes() const { return fixed_bytes + saved_bytes + largest_transient_bytes; }
};

inline constexpr int kMaxOptionsPerGroup = 16;

// The cost of given counts.
inline Assignment assignment_of(const Problem& problem, std::vector<std::vector<int>> counts) {
  Assignment a;
  a.fixed_bytes = problem.fixed_bytes;
  for (std::size_t g = 0; g < problem.groups.size(); ++g)
    for (std::size_t i = 0; i < problem.groups[g].options.size(); ++i) {
      const int c = counts[g][i];
      if (c == 0) continue;
      const Option& o = problem.groups[g].options[i];
      a.time_s += c * o.time_s;
      a.saved_bytes += c * o.saved_bytes;
      a.largest_transient_bytes = std::max(a.largest_transient_bytes, o.transient_bytes);
    }
  a.counts = std::move(counts);
  return a;
}

namespace detail {

struct Segment {
  double slope = 0;  // gain per byte
  double width = 0;  // bytes per slot
  int group = 0;
};

struct InnerGroup {
  int count = 0;
  int levels = 0;                                         // options kept after the filter, base first
  std::array<int, kMaxOptionsPerGroup> option{};          // index into the group's options
  std::array<std::int64_t, kMaxOptionsPerGroup> weight{}; // saved bytes above the base
  std::array<double, kMaxOptionsPerGroup> gain{};         // seconds saved against the base
  // hull[i]: the concave hull of levels 0..i-1 as segments, steepest first (hull[levels] is the whole group).
  std::array<std::array<Segment, kMaxOptionsPerGroup>, kMaxOptionsPerGroup + 1> hull{};
  std::array<int, kMaxOptionsPerGroup + 1> hull_size{};
};

class BranchAndBound {
public:
  explicit BranchAndBound(const Problem& problem) : problem_(problem) {
    const std::size_t g = problem.groups.size();
    groups_.resize(g);
    suffix_.resize(g + 1);
    for (auto& s : suffix_) s.reserve(g * kMaxOptionsPerGroup);
    counts_.assign(g, {});
    best_counts_.assign(g, {});
  }

  // Prepares the search for threshold tau; false when some group has no option or the base does not fit.
  bool prepare(std::int64_t tau) {
    base_time_ = 0;
    std::int64_t base_saved = 0;
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      const SlotGroup& group = problem_.groups[g];
      InnerGroup& inner = groups_[g];
      inner.count = group.count;
      inner.levels = 0;
      if (group.count == 0) continue;
      // Options within the threshold, by saved bytes then time; keep each only if strictly faster than all before.
      std::array<int, kMaxOptionsPerGroup> order{};
      int n = 0;
      for (int i = 0; i < int(group.options.size()); ++i)
        if (group.options[std::size_t(i)].transient_bytes <= tau) order[std::size_t(n++)] = i;
      if (n == 0) return false;
      std::sort(order.begin(), order.begin() + n, [&](int x, int y) {
        const Option& a = group.options[std::size_t(x)];
        const Option& b = group.options[std::size_t(y)];
        return a.saved_bytes != b.saved_bytes ? a.saved_bytes < b.saved_bytes : a.time_s < b.time_s;
      });
      const Option& base = group.options[std::size_t(order[0])];
      double fastest = std::numeric_limits<double>::infinity();
      for (int k = 0; k < n; ++k) {
        const Option& o = group.options[std::size_t(order[std::size_t(k)])];
        if (!(o.time_s < fastest)) continue;
        fastest = o.time_s;
        const auto l = std::size_t(inner.levels++);
        inner.option[l] = order[std::size_t(k)];
        inner.weight[l] = o.saved_bytes - base.saved_bytes;
        inner.gain[l] = base.time_s - o.time_s;
      }
      build_hulls(inner, int(g));
      base_time_ += double(group.count) * base.time_s;
      base_saved += std::int64_t(group.count) * base.saved_bytes;
    }
    capacity_ = problem_.budget_bytes - problem_.fixed_bytes - tau - base_saved;
    if (capacity_ < 0) return false;
    // Suffix segment lists: suffix_[g] = the whole hulls of groups g.., widths scaled by their counts, by slope.
    suffix_.back().clear();
    for (int g = int(groups_.size()) - 1; g >= 0; --g) {
      auto& s = suffix_[std::size_t(g)];
      s = suffix_[std::size_t(g) + 1];
      const InnerGroup& inner = groups_[std::size_t(g)];
      if (inner.count > 0)
        for (int k = 0; k < inner.hull_size[std::size_t(inner.levels)]; ++k) {
          Segment seg = inner.hull[std::size_t(inner.levels)][std::size_t(k)];
          seg.width *= inner.count;
          s.insert(std::upper_bound(s.begin(), s.end(), seg,
                                    [](const Segment& a, const Segment& b) { return a.slope > b.slope; }),
                   seg);
        }
    }
    return true;
  }

  // Lower bound on the time of any assignment for the prepared threshold.
  double bound_time() const { return base_time_ - fill(suffix_[0], nullptr, 0, double(capacity_)); }

  // Searches for assignments faster than `incumbent_time`; true when one was found (then best_* hold it).
  bool search(double incumbent_time) {
    tolerance_ = 1e-12 * std::max(1.0, std::abs(base_time_));
    best_gain_ = base_time_ - incumbent_time;
    found_ = false;
    for (std::size_t g = 0; g < groups_.size(); ++g) counts_[g].fill(0);
    descend(0, groups_.empty() ? 0 : groups_[0].levels - 1, groups_.empty() ? 0 : groups_[0].count, capacity_, 0.0);
    return found_;
  }

  double best_time() const { return base_time_ - best_gain_; }

  // The counts of the best assignment found, per original option index.
  std::vector<std::vector<int>> best_counts() const {
    std::vector<std::vector<int>> counts(groups_.size());
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      counts[g].assign(problem_.groups[g].options.size(), 0);
      for (int l = 0; l < groups_[g].levels; ++l)
        counts[g][std::size_t(groups_[g].option[std::size_t(l)])] += best_counts_[g][std::size_t(l)];
    }
    return counts;
  }

private:
  static void build_hulls(InnerGroup& inner, int group) {
    // hull[i] covers levels 0..i-1; levels have increasing weight and gain. Upper concave hull from (0, 0).
    for (int i = 1; i <= inner.levels; ++i) {
      std::array<int, kMaxOptionsPerGroup> chain{};
      int size = 0;
      chain[std::size_t(size++)] = 0;
      for (int l = 1; l < i; ++l) {
        const auto slope = [&](int from, int to) {
          return (inner.gain[std::size_t(to)] - inner.gain[std::size_t(from)]) /
                 double(inner.weight[std::size_t(to)] - inner.weight[std::size_t(from)]);
        };
        while (size >= 2 && slope(chain[std::size_t(size - 2)], chain[std::size_t(size - 1)]) <=
                                slope(chain[std::size_t(size - 1)], l))
          --size;
        chain[std::size_t(size++)] = l;
      }
      auto& hull = inner.hull[std::size_t(i)];
      inner.hull_size[std::size_t(i)] = size - 1;
      for (int k = 0; k + 1 < size; ++k) {
        const int from = chain[std::size_t(k)], to = chain[std::size_t(k + 1)];
        const double width = double(inner.weight[std::size_t(to)] - inner.weight[std::size_t(from)]);
        hull[std::size_t(k)] = {(inner.gain[std::size_t(to)] - inner.gain[std::size_t(from)]) / width, width, group};
      }
    }
    inner.hull_size[0] = 0;
  }

  // The LP gain of filling `capacity` bytes from `later` (already scaled) and `own` (scaled by own_slots here).
  static double fill(const std::vector<Segment>& later, const Segment* own, int own_size, double own_slots,
                     double capacity) {
    double gain = 0;
    std::size_t a = 0;
    int b = 0;
    while (capacity > 0 && (a < later.size() || b < own_size)) {
      const bool take_own = b < own_size && (a >= later.size() || own[b].slope > later[a].slope);
      const Segment& s = take_own ? own[b++] : later[a++];
      const double width = take_own ? s.width * own_slots : s.width;
      const double used = std::min(width, capacity);
      gain += used * s.slope;
      capacity -= used;
    }
    return gain;
  }
  double fill(const std::vector<Segment>& later, const Segment* own, int own_size, double capacity) const {
    return fill(later, own, own_size, 0.0, capacity);
  }

  // Deciding level `level` of group `g` with `slots` undecided slots there and `capacity` bytes left.
  void descend(std::size_t g, int level, int slots, std::int64_t capacity, double gain) {
    if (g == groups_.size()) {
      if (gain > best_gain_ + tolerance_) {  // strictly better than the incumbent (-inf before the first)
        best_gain_ = gain;
        found_ = true;
        best_counts_ = counts_;
      }
      return;
    }
    const InnerGroup& inner = groups_[g];
    if (inner.count == 0 || level <= 0) {  // the rest of this group stays on the base
      if (inner.count > 0) counts_[g][0] = slots;
      const std::size_t next = g + 1;
      descend(next, next < groups_.size() ? groups_[next].levels - 1 : 0,
              next < groups_.size() ? groups_[next].count : 0, capacity, gain);
      return;
    }
    const std::int64_t weight = inner.weight[std::size_t(level)];
    const double unit_gain = inner.gain[std::size_t(level)];
    const int most = int(std::min<std::int64_t>(slots, capacity / weight));
    const Segment* own = inner.hull[std::size_t(level)].data();
    const int own_size = inner.hull_size[std::size_t(level)];
    // Gain so far + LP bound of the rest, for `c` slots on this level: concave in c.
    const auto value = [&](int c) {
      return gain + c * unit_gain +
             fill(suffix_[g + 1], own, own_size, double(slots - c), double(capacity - c * weight));
    };
    const auto visit = [&](int c) {
      counts_[g][std::size_t(level)] = c;
      descend(g, level - 1, slots - c, capacity - c * weight, gain + c * unit_gain);
      counts_[g][std::size_t(level)] = 0;
    };
    // Best first: the peak of the concave values (binary search on the slope), then outward on both sides, the
    // larger value next. Values fall monotonically away from the peak, so a side ends at its first value that
    // cannot beat the incumbent.
    int lo = 0, hi = most;
    while (lo < hi) {
      const int mid = lo + (hi - lo) / 2;
      if (value(mid + 1) > value(mid)) lo = mid + 1;
      else hi = mid;
    }
    const double none = -std::numeric_limits<double>::infinity();
    if (value(lo) > best_gain_ + tolerance_) visit(lo);
    else return;
    int left = lo - 1, right = lo + 1;
    double left_value = left >= 0 ? value(left) : none, right_value = right <= most ? value(right) : none;
    while (true) {
      const bool go_left = left_value >= right_value;
      const double v = go_left ? left_value : right_value;
      if (!(v > best_gain_ + tolerance_)) break;  // the other side is no better
      if (go_left) {
        visit(left--);
        left_value = left >= 0 ? value(left) : none;
      } else {
        visit(right++);
        right_value = right <= most ? value(right) : none;
      }
    }
  }

  const Problem& problem_;
  std::vector<InnerGroup> groups_;
  std::vector<std::vector<Segment>> suffix_;
  std::vector<std::array<int, kMaxOptionsPerGroup>> counts_, best_counts_;
  double base_time_ = 0, best_gain_ = 0, tolerance_ = 0;
  std::int64_t capacity_ = 0;
  bool found_ = false;
};

inline void validate(const Problem& problem) {
  for (const SlotGroup& g : problem.groups) {
    check(g.count >= 0, "plan: group \"{}\" has count {}, expected >= 0", g.name, g.count);
    check(int(g.options.size()) <= kMaxOptionsPerGroup, "plan: group \"{}\" has {} options, at most {} supported",
          g.name, g.options.size(), kMaxOptionsPerGroup);
    for (const Option& o : g.options)
      check(o.saved_bytes >= 0 && o.transient_bytes >= 0 && o.time_s >= 0,
            "plan: group \"{}\" option (strategy {}) has negative cost (time {}, saved {}, transient {})", g.name,
            o.strategy, o.time_s, o.saved_bytes, o.transient_bytes);
  }
}

// The distinct transient values of the options of non-empty groups, ascending.
inline std::vector<std::int64_t> transient_levels(const Problem& problem) {
  std::vector<std::int64_t> levels;
  for (const SlotGroup& g : problem.groups)
    if (g.count > 0)
      for (const Option& o : g.options) levels.push_back(o.transient_bytes);
  std::sort(levels.begin(), levels.end());
  levels.erase(std::unique(levels.begin(), levels.end()), levels.end());
  return levels;
}

}  // namespace detail

// The fastest assignment within the budget, or nothing when none fits.
inline std::optional<Assignment> solve_exact(const Problem& problem) {
  detail::validate(problem);
  for (const SlotGroup& g : problem.groups)
    if (g.count > 0 && g.options.empty()) return std::nullopt;
  const std::vector<std::int64_t> levels = detail::transient_levels(problem);
  if (levels.empty()) {  // no slots at all
    if (problem.fixed_bytes > problem.budget_bytes) return std::nullopt;
    std::vector<std::vector<int>> counts;
    for (const SlotGroup& g : problem.groups) counts.emplace_back(g.options.size(), 0);
    return assignment_of(problem, std::move(counts));
  }
  detail::BranchAndBound search(problem);
  // Bounds first, then thresholds best bound first (at most groups x options of them).
  std::array<std::pair<double, std::int64_t>, 64> small{};
  std::vector<std::pair<double, std::int64_t>> large;
  std::pair<double, std::int64_t>* order = small.data();
  if (levels.size() > small.size()) large.resize(levels.size()), order = large.data();
  std::size_t n = 0;
  for (std::int64_t tau : levels)
    if (search.prepare(tau)) order[n++] = {search.bound_time(), tau};
  std::sort(order, order + n);
  double best_time = std::numeric_limits<double>::infinity();
  std::optional<std::vector<std::vector<int>>> best;
  for (std::size_t k = 0; k < n; ++k) {
    const auto [bound, tau] = order[k];
    if (best && bound >= best_time * (1 - 1e-12)) break;
    search.prepare(tau);
    if (search.search(best_time) && (!best || search.best_time() < best_time)) {
      best_time = search.best_time();
      best = search.best_counts();
    }
  }
  if (!best) return std::nullopt;
  return assignment_of(problem, std::move(*best));
}

// The assignment of least peak memory (ties: least time); it may exceed the budget. Throws when a non-empty group
// has no option at all.
inline Assignment least_memory(const Problem& problem) {
  detail::validate(problem);
  for (const SlotGroup& g : problem.groups)
    check(g.count == 0 || !g.options.empty(), "plan: group \"{}\" has no allowed strategy", g.name);
  std::optional<Assignment> best;
  for (std::int64_t tau : detail::transient_levels(problem)) {
    std::vector<std::vector<int>> counts;
    bool possible = true;
    for (const SlotGroup& g : problem.groups) {
      counts.emplace_back(g.options.size(), 0);
      int pick = -1;
      for (int i = 0; i < int(g.options.size()); ++i) {
        const Option& o = g.options[std::size_t(i)];
        if (o.transient_bytes > tau) continue;
        const Option* current = pick < 0 ? nullptr : &g.options[std::size_t(pick)];
        if (!current || o.saved_bytes < current->saved_bytes ||
            (o.saved_bytes == current->saved_bytes && o.time_s < current->time_s))
          pick = i;
      }
      if (g.count > 0 && pick < 0) possible = false;
      if (g.count > 0 && pick >= 0) counts.back()[std::size_t(pick)] = g.count;
    }
    if (!possible) continue;
    Assignment a = assignment_of(problem, std::move(counts));
    if (!best || a.peak_bytes() < best->peak_bytes() ||
        (a.peak_bytes() == best->peak_bytes() && a.time_s < best->time_s))
      best = std::move(a);
  }
  if (!best) {
    std::vector<std::vector<int>> counts;
    for (const SlotGroup& g : problem.groups) counts.emplace_back(g.options.size(), 0);
    best = assignment_of(problem, std::move(counts));
  }
  return *best;
}

}  // namespace paradyse::plan
