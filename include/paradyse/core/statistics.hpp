// paradyse/core/statistics.hpp: the median and spread of repeated measurements, and percentiles.
//
// Timings on a shared machine are noisy, so every benchmark and every measured comparison in the library reports
// the median of its repetitions (the mean of the middle two for an even count), with the extremes beside it where
// the spread matters:
//
//   const double t = median(times);                // seconds of the typical repetition
//   const Spread s = spread_of(times);             // median, min, max
//   if (s.overlaps(spread_of(other))) ...          // two medians within each other's noise
//
// And one order statistic the time models use: p ranks that meet at a collective wait for the slowest, whose time
// exceeds the typical rank's by sigma x expected_max_of_normals(p) where each rank's time spreads normally by sigma.
#pragma once

#include "paradyse/core/error.hpp"

#include <algorithm>
#include <array>
#include <cmath>
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

namespace statistics_detail {
// E[max of p standard normals] = integral of x p phi(x) Phi(x)^(p-1) dx, by Simpson's rule on [-10, 10] (the
// integrand's tails beyond are below 1e-20 for the p it is asked for).
inline double expected_max_of_normals_integral(int p) {
  constexpr int steps = 2000;  // even
  constexpr double lo = -10, hi = 10, dx = (hi - lo) / steps;
  const double inv_sqrt_2pi = 1 / std::sqrt(2 * std::acos(-1.0));
  const auto f = [&](double x) {
    const double phi = inv_sqrt_2pi * std::exp(-0.5 * x * x), cdf = 0.5 * std::erfc(-x / std::sqrt(2.0));
    return x * double(p) * phi * std::pow(cdf, p - 1);
  };
  double sum = f(lo) + f(hi);
  for (int i = 1; i < steps; ++i) sum += (i % 2 ? 4 : 2) * f(lo + i * dx);
  return sum * dx / 3;
}
}  // namespace statistics_detail

// The expected maximum of p independent standard normal variables (0 for p = 1; 1/sqrt(pi) for 2, 3/(2 sqrt(pi)) for
// 3). Tabulated once for p <= 64 (a time model asks per collective), integrated beyond.
inline double expected_max_of_normals(int p) {
  check(p >= 1, "expected_max_of_normals: p = {} must be >= 1", p);
  constexpr int tabulated = 64;
  static const std::array<double, tabulated + 1> table = [] {
    std::array<double, tabulated + 1> t{};
    for (int q = 2; q <= tabulated; ++q) t[std::size_t(q)] = statistics_detail::expected_max_of_normals_integral(q);
    return t;
  }();
  return p <= tabulated ? table[std::size_t(p)] : statistics_detail::expected_max_of_normals_integral(p);
}

}  // namespace paradyse
