// tests/support/fresh_seed.hpp: a seed drawn afresh for each run of a randomised test, logged, so that a failure names
// the inputs that made it.
//
//   PARADYSE_FRESH_RNG(rng);   // std::mt19937_64 rng, its seed in the test's INFO
#pragma once

#include <doctest/doctest.h>

#include <cstdint>
#include <random>

namespace paradyse::testing {

inline std::uint64_t fresh_seed() { return std::random_device{}(); }

}  // namespace paradyse::testing

#define PARADYSE_FRESH_RNG(name)                                         \
  const std::uint64_t name##_seed = ::paradyse::testing::fresh_seed();   \
  INFO("seed ", name##_seed);                                            \
  std::mt19937_64 name(name##_seed)
