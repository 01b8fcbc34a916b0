// MegatronTS against the float64 reference: output, input gradient and every rank's shard gradient, both
// sublayers, p in {1, 2, 3, 4, 8}, MHA/GQA (replicated kv heads too), causal or not, RoPE, zigzag, uneven s, b = 1, 2.
#include "paradyse/strategy/megatron_ts.hpp"

#include "strategy/harness.hpp"

#include <doctest/doctest.h>

TEST_CASE("MegatronTS: both sublayers match the float64 reference on 1, 2, 3, 4 and 8 ranks") {
  paradyse::testing::check_sublayers<paradyse::MegatronTS<>>();
}

TEST_CASE("MegatronTS: packed documents (1 token, fewer than p, across a chunk boundary) match the float64 reference on 1-4 ranks") {
  paradyse::testing::check_packed_sublayers<paradyse::MegatronTS<>>();
}
