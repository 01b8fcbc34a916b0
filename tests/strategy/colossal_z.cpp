// ColossalZ against the float64 reference: output, input gradient and every rank's shard gradient, both sublayers,
// p in {1, 2, 3, 4, 8}, MHA/GQA (replicated kv heads too), causal or not, RoPE, zigzag, uneven s, b = 1, 2.
#include "paradyse/strategy/colossal_z.hpp"

#include "strategy/harness.hpp"

#include <doctest/doctest.h>

TEST_CASE("ColossalZ: both sublayers match the float64 reference on 1, 2, 3, 4 and 8 ranks") {
  paradyse::testing::check_sublayers<paradyse::ColossalZ<>>();
}

TEST_CASE("ColossalZ: models the strategy concept") {
  static_assert(paradyse::SublayerStrategy<paradyse::ColossalZ<>, paradyse::ThreadCommunicator>);
}

TEST_CASE("ColossalZ: packed documents (1 token, fewer than p, across a chunk boundary) match the float64 reference on 1-4 ranks") {
  paradyse::testing::check_packed_sublayers<paradyse::ColossalZ<>>();
}
