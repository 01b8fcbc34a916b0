// Switchable: choice by index and by name, backward runs the strategy that ran forward (the saved state's variant
// index records it), a choice gives the numbers of the chosen strategy called directly, and a bad choice is an error
// that says what went wrong.
#include "paradyse/strategy/switchable.hpp"

#include "paradyse/strategy/strategies.hpp"
#include "strategy/harness.hpp"

#include <doctest/doctest.h>

using namespace paradyse;
using namespace paradyse::testing;
using Strategies = AllStrategies<>;

TEST_CASE("Switchable: names, indices and bad choices") {
  CHECK(Strategies::count >= 2);
  CHECK(Strategies::index_of("MegatronTS") == 0);
  CHECK(Strategies::name(Strategies::index_of("UlyssesZ")) == "UlyssesZ");
  CHECK_THROWS_WITH_AS(Strategies::index_of("HotSPa"), doctest::Contains("no strategy named 'HotSPa'"), Error);
  CHECK_THROWS_WITH_AS(Strategies::name(99), doctest::Contains("strategy index 99 is out of range"), Error);
  const Strategies strategies;
  CHECK(strategies.select(1).index() == 1);
  static_assert(SublayerStrategy<MegatronTS<>, ThreadCommunicator>);
  static_assert(SublayerStrategy<UlyssesZ<>, ThreadCommunicator>);
}

TEST_CASE("Switchable: the same results as the strategy itself, saved state records the strategy") {
  const SublayerCase test = standard_cases(3)[2];  // GQA, causal, SwiGLU
  const LayerConfig& c = test.config;
  const Problem problem = make_problem(c, test.batch, test.length, 5);
  Findings findings;
  run_ranks(3, [&](ThreadCommunicator& comm) {
    const int r = comm.rank();
    BufferPool pool;
    const SublayerContext ctx(c, 3, test.batch, test.length, pool);
    const LayerWeights w = shard_of(problem.weights, c, 3, r);
    const Tensor<float> x = local_tokens(problem.x, ctx.sequence, r), dy = local_tokens(problem.dy, ctx.sequence, r);
    const Strategies strategies;
    for (std::size_t choice = 0; choice < Strategies::count; ++choice) {
      // Through the Switchable.
      Tensor<float> y1(x.shape()), dx1(x.shape());
      LayerWeights g1(c, 3);
      auto saved = strategies.attention_forward(choice, comm, ctx, w.attention, x.view(), y1.view());
      if (saved.index() != choice) findings.fail("saved state does not record the strategy that made it");
      strategies.attention_backward(comm, ctx, w.attention, saved, dy.view(), dx1.view(), g1.attention);
      auto mlp_saved = strategies.mlp_forward(choice, comm, ctx, w.mlp, x.view(), y1.view());
      if (mlp_saved.index() != choice) findings.fail("MLP saved state does not record the strategy that made it");
      strategies.mlp_backward(comm, ctx, w.mlp, mlp_saved, dy.view(), dx1.view(), g1.mlp);
      // The chosen policy itself (select), called directly.
      std::visit([&](const auto& policy) {
        const std::string name(policy.name);
        if (name != Strategies::name(choice)) findings.fail(fmt::format("select({}) gave {}", choice, name));
        Tensor<float> y2(x.shape()), dx2(x.shape());
        LayerWeights g2(c, 3);
        auto own = policy.attention_forward(comm, ctx, w.attention, x.view(), y2.view());
        policy.attention_backward(comm, ctx, w.attention, own, dy.view(), dx2.view(), g2.attention);
        auto own_mlp = policy.mlp_forward(comm, ctx, w.mlp, x.view(), y2.view());
        policy.mlp_backward(comm, ctx, w.mlp, own_mlp, dy.view(), dx2.view(), g2.mlp);
        findings.compare(y2.span(), std::span<const float>(y1.span()), fmt::format("rank {} {} y", r, name), kFloat64);
        findings.compare(dx2.span(), std::span<const float>(dx1.span()), fmt::format("rank {} {} dx", r, name), kFloat64);
        findings.compare(g2.attention.packed.span(), std::span<const float>(g1.attention.packed.span()), fmt::format("rank {} {} attention grad", r, name), kFloat64);
        findings.compare(g2.mlp.packed.span(), std::span<const float>(g1.mlp.packed.span()), fmt::format("rank {} {} mlp grad", r, name), kFloat64);
      }, strategies.select(choice));
    }
  });
  findings.check_all("Switchable vs the strategy itself");
}

namespace {
// MegatronTS's schedule declared over another unified layout, and one that declares none.
struct OtherLayout {};
struct OtherLayoutTS : MegatronTS<> {
  using unified_layout = OtherLayout;
};
struct Undeclared {};
}  // namespace

TEST_CASE("Switchable: its policies share one unified layout, checked at compile time") {
  static_assert(std::same_as<unified_layout_t<MegatronTS<>>, SequenceShardedLayout>);
  static_assert(std::same_as<unified_layout_t<METP<>>, SequenceShardedLayout>);
  static_assert(ShareUnifiedLayout<MegatronTS<>, UlyssesZ<>, MegatronCZ<>, METP<>, ColossalZ<>>);
  static_assert(!ShareUnifiedLayout<MegatronTS<>, OtherLayoutTS>);  // Switchable's static_assert would fire
  static_assert(!ShareUnifiedLayout<Undeclared>);
  static_assert(SublayerStrategy<OtherLayoutTS, ThreadCommunicator>);  // a strategy, but not one to mix with these
  CHECK(Strategies::count == 5);
}
