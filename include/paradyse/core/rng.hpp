// paradyse/core/rng.hpp: a small deterministic random generator for tests, examples and initialisation.
//
// SplitMix64: the same seed gives the same stream on every platform and compiler (unlike std::normal_distribution).
#pragma once

#include "paradyse/core/tensor.hpp"

#include <cmath>
#include <cstdint>
#include <numbers>
#include <span>

namespace paradyse {

class Rng {
public:
  explicit Rng(std::uint64_t seed) : state_(seed) {}

  std::uint64_t next_u64() noexcept {
    std::uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, 1) with 53 random bits.
  double uniform() noexcept { return double(next_u64() >> 11) * 0x1.0p-53; }
  double uniform(double lo, double hi) noexcept { return lo + (hi - lo) * uniform(); }
  // Standard normal (Box-Muller).
  double normal() noexcept {
    const double u1 = 1.0 - uniform(), u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
  }
  // Uniform integer in [0, n).
  std::uint64_t below(std::uint64_t n) noexcept { return n ? next_u64() % n : 0; }

  template <class T>
  void fill_uniform(std::span<T> out, double lo = -1.0, double hi = 1.0) {
    for (T& x : out) x = T(uniform(lo, hi));
  }
  template <class T>
  void fill_normal(std::span<T> out, double stddev = 1.0) {
    for (T& x : out) x = T(stddev * normal());
  }

private:
  std::uint64_t state_;
};

// A tensor of `shape` with uniform entries in [lo, hi).
template <class T>
Tensor<T> random_uniform(Shape shape, Rng& rng, double lo = -1.0, double hi = 1.0) {
  Tensor<T> t(shape);
  rng.fill_uniform(t.span(), lo, hi);
  return t;
}

}  // namespace paradyse
