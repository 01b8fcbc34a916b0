// Tests of paradyse/plan/planner.hpp (and cost_table.hpp): the exact planner on real cost tables, checked against
// exhaustive search over every per-layer, per-sublayer assignment; forbidden strategies; the nothing-fits error.
#include "paradyse/cost/builtin_profiles.hpp"
#include "paradyse/plan/planner.hpp"

#include "plan/brute_force.hpp"

#include <doctest/doctest.h>

#include <array>
#include <string_view>
#include <vector>

using namespace paradyse;
using namespace paradyse::plan;

namespace {

cost::ModelShape layer_shape(std::int64_t heads, std::int64_t ffn) {
  cost::ModelShape m;
  m.hidden = 512;
  m.heads = heads;
  m.kv_heads = heads;
  m.head_dim = 64;
  m.ffn = ffn;
  m.dtype_bytes = 2;
  return m;
}

Strategy id(std::string_view name) { return cost::default_catalog().index_of(name); }

// Dense layers with 8 heads and "wide" layers with 4 heads and a wider MLP (both run on 4 ranks).
ModelConfig mixed_model() {
  ModelConfig m;
  m.kinds.push_back({"dense", layer_shape(8, 2048)});
  m.kinds.push_back({"wide", layer_shape(4, 8192)});
  m.layer_kinds = {0, 1, 0};
  return m;
}

// The same with a kind of 6 heads, which no strategy runs on 4 ranks (the unified layout gives each rank heads/p
// whole heads).
ModelConfig model_with_six_heads() {
  ModelConfig m = mixed_model();
  m.kinds.push_back({"six", layer_shape(6, 2048)});
  m.layer_kinds = {0, 2, 0};
  return m;
}

void check_budgets(const CostTable& table) {
  const auto all = testing::brute_force_layers(table, std::int64_t(1) << 60);
  std::int64_t largest = 0;
  for (Strategy s = 0; s < table.strategy_count(); ++s) {
    const Evaluation e = evaluate(table, uniform_layers(table, s));
    if (e.allowed) largest = std::max(largest, e.peak_bytes());
  }
  for (int k = 0; k <= 8; ++k) {
    const std::int64_t budget = all.least_peak + (largest - all.least_peak) * k / 8 + (k == 0 ? -1 : 0);
    const auto want = testing::brute_force_layers(table, budget);
    if (!want.feasible) {
      CHECK_THROWS_AS(plan_exact(table, budget), NoFeasiblePlan);
      continue;
    }
    const Plan got = plan_exact(table, budget);
    CHECK(got.time_s == doctest::Approx(want.best_time).epsilon(1e-12));
    CHECK(got.fits());
    const Evaluation again = evaluate(table, got.strategies());
    CHECK(again.allowed);
    CHECK(again.peak_bytes() == got.peak_bytes());
    CHECK(again.time_s == doctest::Approx(got.time_s).scale(0));
  }
}

}  // namespace

TEST_CASE("planner: the exact plan equals exhaustive search over every layer and sublayer (uniform model)") {
  const cost::HardwareProfile hw = cost::a100_sxm4_80gb_x8();
  const ModelConfig model = ModelConfig::uniform(layer_shape(8, 2048), 3);
  for (std::int64_t s : {1024, 8192, 65536}) check_budgets(build_cost_table(model, hw, 4, Batch::single(s)));
}

TEST_CASE("planner: the exact plan equals exhaustive search on mixed layer kinds, packed batches too") {
  const cost::HardwareProfile hw = cost::h100_sxm_80gb_x8();
  check_budgets(build_cost_table(mixed_model(), hw, 4, Batch::single(16384)));
  const CostTable whole = build_cost_table(mixed_model(), hw, 4, Batch::single(16384, 2));
  check_budgets(whole);
  // A packed sample of the same 16384 tokens: the dry runs carry the document mask, so every flash-style strategy's
  // attention costs less (pairs within documents only) while its MLP costs the same (every token). ColossalZ
  // materialises every score row whatever the mask, and masks the other documents' columns on top: no cheaper.
  const CostTable packed = build_cost_table(mixed_model(), hw, 4, Batch::packed({12000, 3000, 1384}, 2));
  check_budgets(packed);
  int compared = 0;
  for (int kind = 0; kind < int(whole.kind_names.size()); ++kind)
    for (Strategy s = 0; s < whole.strategy_count(); ++s) {
      const Option* a = whole.option(kind, Sublayer::attention, s);
      const Option* b = packed.option(kind, Sublayer::attention, s);
      const Option* m = whole.option(kind, Sublayer::mlp, s);
      const Option* n = packed.option(kind, Sublayer::mlp, s);
      if (!a || !b || !m || !n) continue;
      INFO(whole.strategy_name(s), " kind ", kind);
      if (whole.strategy_name(s) == "ColossalZ") CHECK(b->time_s >= a->time_s);
      else CHECK(b->time_s < a->time_s);
      CHECK(n->time_s == doctest::Approx(m->time_s).epsilon(1e-9));
      ++compared;
    }
  CHECK(compared >= 4);
}

TEST_CASE("planner: forbidden strategies are never chosen") {
  const cost::HardwareProfile hw = cost::a100_sxm4_80gb_x8();
  const Strategy ulysses = id("UlyssesZ");
  // Make Ulysses the fastest attention if it were allowed: a profile whose all-to-all is free. It is not a
  // candidate, so it is forbidden everywhere, with the reason.
  cost::HardwareProfile free_all_to_all = hw;
  free_all_to_all.set_collective(cost::Collective::all_to_all, cost::LinkLevel::intra_node, 4, {0, 0});
  std::vector<Strategy> others;
  for (Strategy s = 0; s < cost::default_catalog().count(); ++s)
    if (s != ulysses) others.push_back(s);
  const CostTable table = build_cost_table(mixed_model(), free_all_to_all, 4, Batch::single(32768), others);
  CHECK(table.option(1, Sublayer::attention, ulysses) == nullptr);
  CHECK(table.entry(1, Sublayer::attention, ulysses).forbidden_reason.find("UlyssesZ is not a candidate") !=
        std::string::npos);
  CHECK(table.option(0, Sublayer::attention, ulysses) == nullptr);
  for (Strategy s : others) CHECK(table.option(1, Sublayer::attention, s) != nullptr);
  const Evaluation uniform_ulysses = evaluate(table, uniform_layers(table, ulysses));
  CHECK_FALSE(uniform_ulysses.allowed);
  CHECK(uniform_ulysses.forbidden.find("layer 0 attention") != std::string::npos);
  CHECK_THROWS_WITH_AS(plan_of(table, uniform_layers(table, ulysses), 1 << 30),
                       doctest::Contains("forbidden choice"), Error);
  const auto all = testing::brute_force_layers(table, std::int64_t(1) << 60);
  for (int k = 0; k <= 10; ++k) {
    const std::int64_t budget = all.least_peak + (std::int64_t(1) << 24) * k * k;
    const Plan plan = plan_exact(table, budget);
    for (std::size_t l = 0; l < plan.layers.size(); ++l) {
      CHECK(plan.layers[l].strategies.attention != ulysses);
      CHECK(plan.layers[l].strategies.mlp != ulysses);
    }
  }
  // A kind no strategy supports (6 heads on 4 ranks: the unified layout needs heads/p whole heads per rank): every
  // strategy is forbidden there with the strategies' own reason, and the planner's error says so.
  const CostTable six = build_cost_table(model_with_six_heads(), hw, 4, Batch::single(4096));
  for (Strategy s = 0; s < six.strategy_count(); ++s) {
    CHECK(six.option(2, Sublayer::attention, s) == nullptr);
    CHECK(six.entry(2, Sublayer::attention, s).forbidden_reason.find("heads = 6 must be divisible by the group size "
                                                                     "p = 4") != std::string::npos);
    CHECK(six.option(0, Sublayer::attention, s) != nullptr);
  }
  CHECK_THROWS_WITH_AS(plan_exact(six, std::int64_t(1) << 40), doctest::Contains("six attention has no allowed strategy"),
                       Error);
  // Only Ulysses as a candidate: every layer gets it.
  const std::array only{ulysses};
  const Plan ulysses_only = plan_exact(build_cost_table(mixed_model(), hw, 4, Batch::single(4096), only),
                                       std::int64_t(1) << 40);
  for (const LayerPlan& l : ulysses_only.layers) CHECK(l.strategies == LayerStrategies{ulysses, ulysses});
  // A candidate outside the list is an error.
  const std::array bad{Strategy(cost::default_catalog().count())};
  CHECK_THROWS_WITH_AS(build_cost_table(mixed_model(), hw, 4, Batch::single(4096), bad),
                       doctest::Contains("is not in the list"), Error);
}

TEST_CASE("planner: nothing fits: the error says by how much, from the least-memory plan") {
  const cost::HardwareProfile hw = cost::a100_sxm4_80gb_x8();
  const CostTable table = build_cost_table(mixed_model(), hw, 4, Batch::single(65536));
  const auto all = testing::brute_force_layers(table, std::int64_t(1) << 60);
  const std::int64_t budget = all.least_peak - 12345;
  try {
    plan_exact(table, budget);
    FAIL("expected NoFeasiblePlan");
  } catch (const NoFeasiblePlan& e) {
    CHECK(e.least_peak_bytes() == all.least_peak);
    CHECK(e.shortfall_bytes() == 12345);
    CHECK(e.budget_bytes() == budget);
    const std::string message = e.what();
    CHECK(message.find("no plan fits the memory budget") != std::string::npos);
    CHECK(message.find("more than the budget") != std::string::npos);
    CHECK(message.find("65536 tokens on 4 ranks") != std::string::npos);
  }
  CHECK(least_memory_plan(table, budget).peak_bytes() == all.least_peak);
  CHECK_NOTHROW(plan_exact(table, all.least_peak));
}

TEST_CASE("planner: layers with larger transients come later within a kind") {
  const cost::HardwareProfile hw = cost::a100_sxm4_80gb_x8();
  const ModelConfig model = ModelConfig::uniform(layer_shape(8, 2048), 8);
  const CostTable table = build_cost_table(model, hw, 4, Batch::single(65536));
  const Plan fastest = plan_exact(table, std::int64_t(1) << 50);
  const Plan least = least_memory_plan(table, 0);
  // A budget between the two forces a mix.
  const Plan mixed = plan_exact(table, (fastest.peak_bytes() + least.peak_bytes()) / 2);
  for (Sublayer part : cost::kAllSublayers) {
    std::int64_t previous = 0;
    for (int l = 0; l < 8; ++l) {
      const Strategy s = part == Sublayer::attention ? mixed.layers[std::size_t(l)].strategies.attention
                                                     : mixed.layers[std::size_t(l)].strategies.mlp;
      const std::int64_t transient = table.option(0, part, s)->transient_bytes;
      CHECK(transient >= previous);
      previous = transient;
    }
  }
  CHECK(mixed.time_s >= fastest.time_s);
  CHECK(mixed.time_s <= least.time_s);
  CHECK(!mixed.summary().empty());
}

TEST_CASE("planner: the one-call form uses the profile's usable memory") {
  const cost::HardwareProfile hw = cost::a100_sxm4_80gb_x8();
  const ModelConfig model = ModelConfig::uniform(layer_shape(8, 2048), 4);
  const Plan plan = plan_exact(model, hw, 8, Batch::single(4096));
  CHECK(plan.budget_bytes == hw.usable_memory_bytes());
  CHECK(plan.layers.size() == 4);
  CHECK_THROWS_WITH_AS(build_cost_table(model, hw, 8, Batch{1, {}}), doctest::Contains("lengths"), Error);
  CHECK_THROWS_WITH_AS(build_cost_table(model, hw, 8, Batch::single(0)), doctest::Contains("length 0"), Error);
}
