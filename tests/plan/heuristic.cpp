// Tests of paradyse/plan/heuristic.hpp: ParaDySe's Algorithm 1 against exhaustive search over its own plan space
// (whole layers, one strategy or a prefix/suffix of two), and against the exact planner.
#include "paradyse/cost/builtin_profiles.hpp"
#include "paradyse/plan/heuristic.hpp"
#include "paradyse/plan/planner.hpp"

#include "plan/brute_force.hpp"

#include <doctest/doctest.h>

#include <limits>
#include <string_view>

using namespace paradyse;
using namespace paradyse::plan;

namespace {

// The best plan of the heuristic's space: uniform, or strategy a on the first e layers and b on the rest.
double best_two_strategy_time(const CostTable& table, std::int64_t budget) {
  const int L = table.layer_count();
  double best = std::numeric_limits<double>::infinity();
  for (Strategy a = 0; a < table.strategy_count(); ++a)
    for (Strategy b = 0; b < table.strategy_count(); ++b)
      for (int e = 1; e <= L; ++e) {
        std::vector<LayerStrategies> layers;
        for (int l = 0; l < L; ++l) layers.push_back(l < e ? LayerStrategies{a, a} : LayerStrategies{b, b});
        const Evaluation ev = evaluate(table, layers);
        if (ev.allowed && ev.peak_bytes() <= budget) best = std::min(best, ev.time_s);
      }
  return best;
}

cost::ModelShape gpt_like() { return cost::ModelShape::mha(2048, 16); }
Strategy id(std::string_view name) { return cost::default_catalog().index_of(name); }

}  // namespace

TEST_CASE("heuristic: finds the best plan of its own space, and never beats the exact planner") {
  const cost::HardwareProfile hw = cost::a100_sxm4_80gb_x8();
  const ModelConfig model = ModelConfig::uniform(gpt_like(), 6);
  for (std::int64_t s : {2048, 32768, 131072}) {
    const CostTable table = build_cost_table(model, hw, 8, Batch::single(s));
    const Plan least = least_memory_plan(table, 0);
    const Plan fastest = plan_exact(table, std::int64_t(1) << 50);
    for (int k = 0; k <= 6; ++k) {
      const std::int64_t budget = least.peak_bytes() + (fastest.peak_bytes() - least.peak_bytes()) * k / 6;
      const Plan h = plan_heuristic(table, budget);
      const double want = best_two_strategy_time(table, budget);
      if (want == std::numeric_limits<double>::infinity()) {
        CHECK_FALSE(h.fits());
        continue;
      }
      REQUIRE(h.fits());
      CHECK(h.time_s == doctest::Approx(want).epsilon(1e-12));
      CHECK(plan_exact(table, budget).time_s <= h.time_s * (1 + 1e-12));
    }
  }
}

TEST_CASE("heuristic: whole layers cannot mix sublayers; the exact planner can") {
  // Attention is fastest on A, the MLP on B; both are uniform-feasible. The exact plan mixes per sublayer.
  using testing::synthetic_table;
  const Strategy ts = id("MegatronTS"), metp = id("METP");
  testing::KindOptions kind = testing::uniform_kind({metp, 10.0, 100, 0});
  kind[0][std::size_t(ts)] = {ts, 1.0, 100, 0};
  kind[0][std::size_t(metp)] = {metp, 5.0, 100, 0};
  kind[1][std::size_t(ts)] = {ts, 5.0, 100, 0};
  kind[1][std::size_t(metp)] = {metp, 1.0, 100, 0};
  const CostTable table = synthetic_table({kind}, {0, 0, 0}, 0);
  const Plan h = plan_heuristic(table, 10000);
  const Plan exact = plan_exact(table, 10000);
  CHECK(h.time_s == doctest::Approx(18.0));
  CHECK(exact.time_s == doctest::Approx(6.0));
  for (const LayerPlan& l : exact.layers) {
    CHECK(l.strategies.attention == ts);
    CHECK(l.strategies.mlp == metp);
  }
}

TEST_CASE("heuristic: when nothing fits it returns the least-memory strategy, and the curriculum shortcut sticks") {
  const cost::HardwareProfile hw = cost::a100_sxm4_80gb_x8();
  const ModelConfig model = ModelConfig::uniform(gpt_like(), 4);
  const CostTable long_table = build_cost_table(model, hw, 8, Batch::single(131072));
  const CostTable short_table = build_cost_table(model, hw, 8, Batch::single(1024));
  const Plan least = least_memory_plan(long_table, 0);
  HeuristicState state{.use_curriculum_shortcut = true};
  const Plan none = plan_heuristic(long_table, least.peak_bytes() - 1, &state);
  CHECK_FALSE(none.fits());
  CHECK(state.nothing_fit_before);
  const Strategy s = none.layers[0].strategies.attention;
  for (const LayerPlan& l : none.layers) CHECK(l.strategies == LayerStrategies{s, s});
  CHECK(none.peak_bytes() == evaluate(long_table, uniform_layers(long_table, s)).peak_bytes());
  // With the shortcut a later short batch gets the least-memory uniform strategy too; without it, the fastest.
  const std::int64_t roomy = std::int64_t(1) << 50;
  Strategy least_short = id("METP");
  std::int64_t least_peak = std::numeric_limits<std::int64_t>::max();
  for (Strategy c = 0; c < short_table.strategy_count(); ++c) {
    const Evaluation e = evaluate(short_table, uniform_layers(short_table, c));
    if (e.peak_bytes() < least_peak) least_peak = e.peak_bytes(), least_short = c;
  }
  CHECK(plan_heuristic(short_table, roomy, &state).peak_bytes() == least_peak);
  CHECK(plan_heuristic(short_table, roomy, &state).layers[0].strategies.attention == least_short);
  HeuristicState plain;
  const Plan fast = plan_heuristic(short_table, roomy, &plain);
  CHECK(fast.time_s <= plan_heuristic(short_table, roomy, &state).time_s);
}
