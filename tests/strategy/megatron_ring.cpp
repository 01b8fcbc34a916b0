// MegatronRing (cp x tp inside one group) against the float64 reference: output, input gradient and every rank's
// shard gradient, both sublayers, for the factorisations cp x tp of p = 4 (2x2, 1x4, 4x1), 6 (3x2, 2x3) and 8 (2x4,
// 4x2), over the harness's standard and packed-document cases (MHA/GQA with replicated kv heads, causal or not,
// RoPE, zigzag, GELU/SwiGLU, b = 1, 2). A case whose length the factorisation cannot cut (the p-rank chunks must
// nest in the cp-rank ones) runs at the next length it can, so uneven lengths run wherever the layout allows.
#include "paradyse/strategy/megatron_ring.hpp"

#include "strategy/harness.hpp"

#include <doctest/doctest.h>

#include <string>
#include <utility>
#include <vector>

namespace {

using paradyse::MegatronRing;
using paradyse::testing::SublayerCase;

struct Factorisation {
  int cp, tp;
};
constexpr Factorisation factorisations[] = {{2, 2}, {1, 4}, {4, 1}, {3, 2}, {2, 3}, {2, 4}, {4, 2}};

bool supported(const SublayerCase& test) {
  paradyse::BufferPool pool;
  paradyse::SublayerContext ctx(test.config, test.ranks, test.batch, test.length, pool);
  ctx.tp_inner = test.tp_inner;
  return MegatronRing<>().supports(ctx).ok();
}

// The case with the factorisation set, at its own length or the next one the factorisation can cut.
SublayerCase factorised(SublayerCase test, Factorisation f) {
  test.tp_inner = f.tp;
  while (!supported(test)) ++test.length;
  test.name += fmt::format(" cp={} tp={} s={}", f.cp, f.tp, test.length);
  return test;
}

bool uneven(const SublayerCase& test) {
  return test.length % (test.config.zigzag ? 2 * test.ranks : test.ranks) != 0;
}

}  // namespace

TEST_CASE("MegatronRing: both sublayers match the float64 reference for cp x tp = 2x2, 1x4, 4x1, 3x2, 2x3, 2x4, 4x2") {
  int uneven_cases = 0;
  for (const Factorisation f : factorisations) {
    const int p = f.cp * f.tp;
    std::vector<SublayerCase> cases = paradyse::testing::standard_cases(p);
    for (SublayerCase& test : paradyse::testing::packed_cases(p)) cases.push_back(std::move(test));
    for (const SublayerCase& base : cases) {
      const SublayerCase test = factorised(base, f);
      uneven_cases += uneven(test);
      paradyse::testing::check_sublayer<MegatronRing<>>(test, paradyse::testing::Sublayer::attention);
      paradyse::testing::check_sublayer<MegatronRing<>>(test, paradyse::testing::Sublayer::mlp);
    }
  }
  CHECK(uneven_cases > 0);  // lengths that do not divide into the p-rank chunks ran too
}

TEST_CASE("MegatronRing: models the strategy concept") {
  static_assert(paradyse::SublayerStrategy<MegatronRing<>, paradyse::ThreadCommunicator>);
}

TEST_CASE("MegatronRing: refuses a group without a factorisation, a tp_inner that does not divide p, and lengths "
          "whose chunks do not nest") {
  const paradyse::LayerConfig c = paradyse::testing::small_config(8, 8, 32);
  paradyse::BufferPool pool;
  paradyse::SublayerContext ctx(c, 4, 1, 16, pool);
  const MegatronRing<> strategy;
  CHECK(strategy.supports(ctx).reason.find("no cp x tp factorisation (tp_inner = 0)") != std::string::npos);
  ctx.tp_inner = 3;
  CHECK(strategy.supports(ctx).reason.find("tp_inner = 3 must divide the group size p = 4") != std::string::npos);
  ctx.tp_inner = 2;
  CHECK(strategy.supports(ctx).ok());
  paradyse::SublayerContext odd(c, 4, 1, 10, pool);  // chunks 3, 3, 2, 2 over 4; 5, 5 over cp = 2
  odd.tp_inner = 2;
  CHECK(strategy.supports(odd).reason.find("do not nest") != std::string::npos);
  paradyse::SublayerContext nests(c, 4, 1, 9, pool);  // chunks 3, 2, 2, 2 over 4; 5, 4 over cp = 2
  nests.tp_inner = 2;
  CHECK(strategy.supports(nests).ok());
}
