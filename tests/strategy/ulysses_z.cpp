// UlyssesZ against the float64 reference: output, input gradient and every rank's shard gradient, both
// sublayers, p in {1, 2, 3, 4, 8}, MHA/GQA (replicated kv heads too), causal or not, RoPE, zigzag, uneven s, b = 1, 2.
#include "paradyse/strategy/ulysses_z.hpp"

#include "strategy/harness.hpp"

#include <doctest/doctest.h>

TEST_CASE("UlyssesZ: both sublayers match the float64 reference on 1, 2, 3, 4 and 8 ranks") {
  paradyse::testing::check_sublayers<paradyse::UlyssesZ<>>();
}

TEST_CASE("UlyssesZ: constraints are checked before running") {
  using namespace paradyse;
  LayerConfig c = testing::small_config(6, 6, 12);
  BufferPool pool;
  // The unified layout itself refuses heads = 6 on 4 ranks, with a message naming both.
  CHECK_THROWS_WITH_AS(SublayerContext(c, 4, 1, 16, pool), doctest::Contains("heads = 6 must be divisible by the group size p = 4"), Error);
}

TEST_CASE("UlyssesZ: packed documents (1 token, fewer than p, across a chunk boundary) match the float64 reference on 1-4 ranks") {
  paradyse::testing::check_packed_sublayers<paradyse::UlyssesZ<>>();
}
