// paradyse/serve/policy_rounds.hpp: comparing serving policies measured on a noisy machine, in alternating rounds.
//
// Policies run one after the other share the machine with whatever else runs on it, and a fixed order biases the
// comparison (the first one pays the cold caches, a load that comes and goes favours whoever runs in the quiet).
// So every policy runs once per round, round r in the order rotated by r (policy i at position (i - r) mod n, so
// each policy takes every position over n rounds), and each metric is reported as its median over the rounds with
// the spread (min - max) beside it. Two policies' medians differ "within noise" when their spreads overlap.
//
//   for (std::size_t r = 0; r < rounds; ++r)
//     for (const std::size_t i : rotated_order(policies.size(), r)) samples[i].push_back(measure(policies[i]));
//   const Spread s = spread_of(samples[i]);                       // median, min, max
//   const PolicyComparison c = compare_to_best(dyn, {tp, ep, eplb}, Better::lower);
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/statistics.hpp"

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

namespace paradyse::serve {

// The order of the n policies in round `round`: a rotation of 0..n-1 starting at round mod n.
inline std::vector<std::size_t> rotated_order(std::size_t policies, std::size_t round) {
  std::vector<std::size_t> order(policies);
  for (std::size_t k = 0; k < policies; ++k) order[k] = (round + k) % policies;
  return order;
}

// One metric over the rounds: core/statistics.hpp's median and extremes.
using paradyse::Spread;
using paradyse::spread_of;

enum class Better { lower, higher };  // latencies: lower; throughput: higher

// no_spread: a side measured once has no run-to-run error to judge a difference by, so no verdict is given.
enum class Verdict { within_noise, faster, slower, no_spread };

inline const char* name_of(Verdict v) {
  return v == Verdict::within_noise ? "matches within noise"
         : v == Verdict::faster     ? "faster"
         : v == Verdict::slower     ? "slower"
                                    : "no verdict: no spread with 1 round";
}

// A policy's metric against the best of some baselines (by median).
struct PolicyComparison {
  std::size_t best = 0;  // index into the baselines
  double ratio = 1;      // > 1: the policy is better (best / policy for lower-is-better, policy / best otherwise)
  Verdict verdict = Verdict::within_noise;  // within noise when the spreads overlap; no_spread after 1 repetition
};

inline PolicyComparison compare_to_best(const Spread& policy, const std::vector<Spread>& baselines, Better better) {
  check(!baselines.empty(), "compare_to_best: no baselines");
  PolicyComparison c;
  for (std::size_t i = 1; i < baselines.size(); ++i) {
    const bool improves = better == Better::lower ? baselines[i].median < baselines[c.best].median
                                                  : baselines[i].median > baselines[c.best].median;
    if (improves) c.best = i;
  }
  const Spread& best = baselines[c.best];
  const double num = better == Better::lower ? best.median : policy.median;
  const double den = better == Better::lower ? policy.median : best.median;
  c.ratio = den > 0 ? num / den : (num > 0 ? 1e300 : 1.0);
  if (policy.count == 1 || best.count == 1)
    c.verdict = Verdict::no_spread;
  else if (policy.overlaps(best))
    c.verdict = Verdict::within_noise;
  else
    c.verdict = c.ratio > 1 ? Verdict::faster : Verdict::slower;
  return c;
}

}  // namespace paradyse::serve
