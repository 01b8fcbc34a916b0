// MegatronRing (cp x tp inside one group) against the float64 reference: output, input gradient and every rank's
// shard gradient, both sublayers, for the factorisations cp x tp of p = 4 (2x2, 1x4, 4x1), 6 (3x2, 2x3) and 8 (2x4,
// 4x2), over the harness's standard and packed-document cases (MHA/GQA with replicated kv heads, causal or not,
// RoPE, zigzag, GELU/SwiGLU, b = 1, 2), their lengths uneven over p (the cp ranks' shares are grouped tp chunks:
// SequenceLayout::grouped).
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

// The case with the factorisation set.
SublayerCase factorised(SublayerCase test, Factorisation f) {
  test.tp_inner = f.tp;
  test.name += fmt::format(" cp={} tp={}", f.cp, f.tp);
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

TEST_CASE("MegatronRing: refuses a group without a factorisation and a tp_inner that does not divide p") {
  const paradyse::LayerConfig c = paradyse::testing::small_config(8, 8, 32);
  paradyse::BufferPool pool;
  paradyse::SublayerContext ctx(c, 4, 1, 16, pool);
  const MegatronRing<> strategy;
  CHECK(strategy.supports(ctx).reason.find("no cp x tp factorisation (tp_inner = 0)") != std::string::npos);
  ctx.tp_inner = 3;
  CHECK(strategy.supports(ctx).reason.find("tp_inner = 3 must divide the group size p = 4") != std::string::npos);
  ctx.tp_inner = 2;
  CHECK(strategy.supports(ctx).ok());
  paradyse::SublayerContext odd(c, 4, 1, 10, pool);  // chunks 3, 3, 2, 2 over 4: cp ranks hold 6 and 4 tokens
  odd.tp_inner = 2;
  CHECK(strategy.supports(odd).ok());
}

TEST_CASE("SequenceLayout::grouped: rank c holds the tokens of ranks c g .. c g + g - 1, one run or two (zigzag)") {
  using paradyse::SequenceLayout;
  for (const bool zigzag : {false, true})
    for (const std::int64_t length : {16, 17, 21, 23})
      for (const auto& [ranks, group] : {std::pair{4, 2}, std::pair{6, 3}, std::pair{6, 2}, std::pair{8, 4}}) {
        CAPTURE(zigzag);
        CAPTURE(length);
        CAPTURE(ranks);
        CAPTURE(group);
        const SequenceLayout fine(length, ranks, zigzag);
        const SequenceLayout coarse = SequenceLayout::grouped(fine, group);
        CHECK(coarse.ranks() == ranks / group);
        std::vector<int> owner(std::size_t(length), -1);
        for (int c = 0; c < coarse.ranks(); ++c) {
          std::int64_t held = 0;
          for (int u = 0; u < group; ++u) held += fine.local_length(c * group + u);
          CHECK(coarse.local_length(c) == held);
          std::int64_t previous = -1;
          for (std::int64_t i = 0; i < coarse.local_length(c); ++i) {
            const std::int64_t position = coarse.position(c, i);
            if (i != 0 && i != coarse.segment(c, 0).length) CHECK(position == previous + 1);  // runs of consecutive positions
            previous = position;
            owner[std::size_t(position)] = c;
          }
        }
        for (std::int64_t position = 0; position < length; ++position)  // each fine rank's tokens on its group's rank
          for (int r = 0; r < ranks; ++r)
            for (std::int64_t i = 0; i < fine.local_length(r); ++i)
              if (fine.position(r, i) == position) CHECK(owner[std::size_t(position)] == r / group);
      }
}

TEST_CASE("MegatronRing: the tp and cp sub-groups come from the held grid (as the stack holds it), split once for "
          "every call") {
  for (const Factorisation f : {Factorisation{2, 2}, Factorisation{3, 2}}) {
    const int p = f.cp * f.tp;
    paradyse::testing::check_grid_split_once<MegatronRing<>>(factorised(paradyse::testing::standard_cases(p)[2], f));
  }
}
