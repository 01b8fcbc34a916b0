// paradyse/cost/least_squares.hpp: small non-negative least-squares fits for calibration.
//
// Fits y ~ sum_j c_j x_j with every c_j >= 0 (times are sums of non-negative costs), minimising the RELATIVE error
// sum_i ((fit_i - y_i) / y_i)^2: measurements span orders of magnitude, and a 10% error on a small GEMM matters as
// much as on a large one. Active set: solve the normal equations of the free coefficients, drop any that comes out
// negative, repeat (at most k times for k coefficients). Meant for k <= 4.
#pragma once

#include "paradyse/core/error.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <span>
#include <vector>

namespace paradyse::cost {

struct Fit {
  std::vector<double> coefficients;
  double worst_relative_error = 0;   // max_i |fit_i - y_i| / y_i
  double median_relative_error = 0;
};

// A fitted coefficient in seconds per unit as a rate in units per second; `unpriced` where it fitted to 0 (0: the
// term is left out; 1e30: the term costs nothing).
inline double rate_of(double seconds_per_unit, double unpriced = 0) {
  return seconds_per_unit > 0 ? 1 / seconds_per_unit : unpriced;
}

// rows[i]: the k features of sample i; y[i] > 0 its measurement.
inline Fit fit_non_negative(const std::vector<std::vector<double>>& rows, std::span<const double> y) {
  check(!rows.empty() && rows.size() == y.size(), "fit_non_negative: {} rows for {} measurements", rows.size(),
        y.size());
  const std::size_t k = rows[0].size();
  check(k >= 1 && k <= 8, "fit_non_negative: {} coefficients, expected 1 to 8", k);
  for (std::size_t i = 0; i < y.size(); ++i)
    check(rows[i].size() == k && y[i] > 0, "fit_non_negative: sample {} has {} features (want {}) and y = {}", i,
          rows[i].size(), k, y[i]);
  std::vector<bool> active(k, true);
  std::vector<double> c(k, 0.0);
  for (std::size_t round = 0; round <= k; ++round) {
    std::vector<std::size_t> free;
    for (std::size_t j = 0; j < k; ++j)
      if (active[j]) free.push_back(j);
    if (free.empty()) break;
    const std::size_t f = free.size();
    // Normal equations of the weighted problem: rows and targets divided by y.
    std::vector<double> a(f * f, 0.0), b(f, 0.0);
    for (std::size_t i = 0; i < y.size(); ++i) {
      const double w = 1.0 / y[i];
      for (std::size_t p = 0; p < f; ++p) {
        b[p] += rows[i][free[p]] * w;  // (row w) . (y w) = row w * 1
        for (std::size_t q = 0; q < f; ++q) a[p * f + q] += rows[i][free[p]] * rows[i][free[q]] * w * w;
      }
    }
    // Gaussian elimination with partial pivoting (f is tiny); a singular column gets a zero coefficient.
    std::vector<double> x(f, 0.0);
    std::vector<std::size_t> order(f);
    for (std::size_t p = 0; p < f; ++p) order[p] = p;
    for (std::size_t col = 0; col < f; ++col) {
      std::size_t pivot = col;
      for (std::size_t r = col + 1; r < f; ++r)
        if (std::abs(a[r * f + col]) > std::abs(a[pivot * f + col])) pivot = r;
      if (pivot != col) {
        for (std::size_t q = 0; q < f; ++q) std::swap(a[col * f + q], a[pivot * f + q]);
        std::swap(b[col], b[pivot]);
      }
      const double diagonal = a[col * f + col];
      if (std::abs(diagonal) < 1e-300) continue;
      for (std::size_t r = col + 1; r < f; ++r) {
        const double factor = a[r * f + col] / diagonal;
        for (std::size_t q = col; q < f; ++q) a[r * f + q] -= factor * a[col * f + q];
        b[r] -= factor * b[col];
      }
    }
    for (std::size_t col = f; col-- > 0;) {
      const double diagonal = a[col * f + col];
      if (std::abs(diagonal) < 1e-300) continue;
      double sum = b[col];
      for (std::size_t q = col + 1; q < f; ++q) sum -= a[col * f + q] * x[q];
      x[col] = sum / diagonal;
    }
    bool negative = false;
    std::fill(c.begin(), c.end(), 0.0);
    for (std::size_t p = 0; p < f; ++p) {
      if (x[p] < 0) active[free[p]] = false, negative = true;
      else c[free[p]] = x[p];
    }
    if (!negative) break;
  }
  Fit fit;
  fit.coefficients = c;
  std::vector<double> errors;
  for (std::size_t i = 0; i < y.size(); ++i) {
    double value = 0;
    for (std::size_t j = 0; j < k; ++j) value += c[j] * rows[i][j];
    errors.push_back(std::abs(value - y[i]) / y[i]);
  }
  std::sort(errors.begin(), errors.end());
  fit.worst_relative_error = errors.back();
  fit.median_relative_error = errors[errors.size() / 2];
  return fit;
}

}  // namespace paradyse::cost
