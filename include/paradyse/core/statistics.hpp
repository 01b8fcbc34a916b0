// paradyse/core/statistics.hpp: the median and spread of repeated measurements, and percentiles.
//
// Timings on a shared machine are noisy, so every benchmark and every measured comparison in the library reports
// the median of its repetitions (the mean of the middle two for an even count), with the extremes beside it where
// the spread matters:
//
//   const double t = median(times);                // seconds of the typical repetition
//   const Spread s = spread_of(times);             // median, min, max
//   if (s.overlaps(spread_of(other))) ...          // two medians within each other's noise
#pragma once

#include "paradyse/core/error.hpp"

#include <algorithm>
#include <cstddef>
#include <vector>

namespace paradyse {

// One metric over repetitions: the median and the extremes.
struct Spread {
  double median = 0, min = 0, max = 0;
  std::size_t count = 0;  // the repetitions (spread_of sets it; 0: not known). One repetition has no spread.

  // (max - min) / median: the run-to-run error relative to the value (0 for a zero median).
  double relative() const { return median != 0 ? (max - min) / median : 0.0; }
  bool overlaps(const Spread& other) const { return min <= other.max && other.min <= max; }
};

inline Spread spread_of(std::vector<double> values) {
  check(!values.empty(), "spread_of: no values (a metric needs at least one repetition)");
  std::sort(values.begin(), values.end());
  const std::size_t n = values.size();
  const double median = n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
  return {median, values.front(), values.back(), n};
}

inline double median(std::vector<double> values) { return spread_of(std::move(values)).median; }

// The q-quantile of `values` (q in [0, 1]), linear between the two nearest of the sorted values (0 for no values):
// percentile(v, 0.5) is the median, percentile(v, 0.99) the p99 of a latency distribution.
inline double percentile(std::vector<double> values, double q) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const double at = q * double(values.size() - 1);
  const std::size_t lo = std::size_t(at), hi = std::min(lo + 1, values.size() - 1);
  return values[lo] + (at - double(lo)) * (values[hi] - values[lo]);
}

}  // namespace paradyse
