// tests/support/fresh_seed.hpp: a seed drawn afresh for each run of a randomised test (log it with INFO, so that a
// failure names the inputs that made it).
#pragma once

#include <cstdint>
#include <random>

namespace paradyse::testing {

inline std::uint64_t fresh_seed() { return std::random_device{}(); }

}  // namespace paradyse::testing
