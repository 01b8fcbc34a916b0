// Tests of paradyse/plan/cache.hpp: length buckets, cached plans that fit every length of their bucket, smoothing.
#include "paradyse/core/rng.hpp"
#include "paradyse/cost/builtin_profiles.hpp"
#include "paradyse/plan/cache.hpp"

#include "plan/brute_force.hpp"

#include <doctest/doctest.h>

#include <set>
#include <string_view>

using namespace paradyse;
using namespace paradyse::plan;

namespace {
cost::ModelShape shape() { return cost::ModelShape::mha(2048, 16); }
Strategy id(std::string_view name) { return cost::default_catalog().index_of(name); }
}  // namespace

TEST_CASE("cache: bucket edges cover their lengths, at most 2^bits buckets per octave") {
  const Bucketing b{.min_width = 256, .fraction_bits = 3};
  std::int64_t previous = 0;
  for (std::int64_t length = 1; length <= (1 << 16); length += 7) {
    const std::int64_t edge = b.edge(length);
    CHECK(edge >= length);
    CHECK(edge >= previous);
    CHECK(edge - length < std::max<std::int64_t>(256, length / 8 + 1));
    previous = edge;
  }
  for (int octave = 12; octave < 20; ++octave) {
    std::set<std::int64_t> edges;
    for (std::int64_t length = std::int64_t(1) << octave; length < (std::int64_t(2) << octave); length += 97)
      edges.insert(b.edge(length));
    CHECK(edges.size() <= 9);  // 8 buckets, the last edge may be the next octave's start
  }
  CHECK_THROWS_AS(b.edge(0), Error);
}

TEST_CASE("cache: a cached plan fits every length of its bucket; repeated lengths hit") {
  const cost::HardwareProfile hw = cost::a100_sxm4_80gb_x8();
  const ModelConfig model = ModelConfig::uniform(shape(), 8);
  // A budget tight enough that long sequences need memory-saving strategies.
  const CostTable at_100k = build_cost_table(model, hw, 8, Batch::single(100000));
  const std::int64_t budget = least_memory_plan(at_100k, 0).peak_bytes() + (std::int64_t(1) << 30);
  PlanCache cache(model, hw, 8, budget, exact_solver(), /*gamma=*/0.0);
  Rng rng(5);
  for (int i = 0; i < 40; ++i) {
    const std::int64_t length = 1000 + std::int64_t(rng.below(99000));
    const Plan plan = cache.plan_for(Batch::single(length));
    const Evaluation at_length = evaluate(build_cost_table(model, hw, 8, Batch::single(length)), plan.strategies());
    CHECK(at_length.peak_bytes() <= budget);
  }
  const auto misses = cache.stats().misses;
  cache.plan_for(Batch::single(5000));
  cache.plan_for(Batch::single(5001));
  CHECK(cache.stats().misses <= misses + 1);
  CHECK(cache.stats().hits >= 1);
}

TEST_CASE("cache: smoothing keeps the previous plan within gamma, and only then") {
  // A solver that wants MegatronTS below 10K tokens and METP above; smoothing decides whether the switch happens.
  const cost::HardwareProfile hw = cost::a100_sxm4_80gb_x8();
  const ModelConfig model = ModelConfig::uniform(shape(), 4);
  const std::int64_t budget = std::int64_t(1) << 50;
  const Strategy ts = id("MegatronTS"), metp = id("METP");
  const PlanSolver by_length = [ts, metp](const CostTable& t, std::int64_t b) {
    return plan_of(t, uniform_layers(t, t.batch.lengths[0] < 10000 ? ts : metp), b);
  };
  const Bucketing buckets;
  const CostTable long_table = build_cost_table(model, hw, 8, Batch::single(buckets.edge(65536)));
  const double ratio = evaluate(long_table, uniform_layers(long_table, ts)).time_s /
                       evaluate(long_table, uniform_layers(long_table, metp)).time_s;
  {
    PlanCache keep(model, hw, 8, budget, by_length, std::max(0.0, ratio - 1) + 0.01);
    CHECK(keep.plan_for(Batch::single(4096)).layers[0].strategies.attention == ts);
    const Plan kept = keep.plan_for(Batch::single(65536));
    CHECK(kept.layers[0].strategies.attention == ts);
    CHECK(keep.stats().kept_previous == 1);
    CHECK(kept.time_s == doctest::Approx(evaluate(long_table, kept.strategies()).time_s));
  }
  if (ratio > 1.01) {
    PlanCache change(model, hw, 8, budget, by_length, ratio - 1 - 0.01);
    change.plan_for(Batch::single(4096));
    CHECK(change.plan_for(Batch::single(65536)).layers[0].strategies.attention == metp);
    CHECK(change.stats().kept_previous == 0);
  }
  // A previous plan that no longer fits is never kept, whatever gamma.
  const CostTable short_table = build_cost_table(model, hw, 8, Batch::single(4096));
  const std::int64_t tight = evaluate(long_table, uniform_layers(long_table, metp)).peak_bytes();
  if (evaluate(long_table, uniform_layers(long_table, ts)).peak_bytes() > tight) {
    PlanCache fit(model, hw, 8, tight, by_length, 100.0);
    fit.plan_for(Batch::single(4096));
    CHECK(fit.plan_for(Batch::single(65536)).layers[0].strategies.attention == metp);
  }
  CHECK(short_table.layer_count() == 4);
}

TEST_CASE("cache: when the bucket's edge does not fit but the length does, the length is planned exactly") {
  const cost::HardwareProfile hw = cost::a100_sxm4_80gb_x8();
  const ModelConfig model = ModelConfig::uniform(shape(), 4);
  const Bucketing buckets;
  const std::int64_t length = 70000;
  REQUIRE(buckets.edge(length) > length);
  const std::int64_t budget =
      least_memory_plan(build_cost_table(model, hw, 8, Batch::single(length)), 0).peak_bytes();  // just fits
  PlanCache cache(model, hw, 8, budget);
  const Plan plan = cache.plan_for(Batch::single(length));
  CHECK(plan.fits());
  CHECK(cache.stats().exact_fallbacks == 1);
  CHECK_THROWS_AS(cache.plan_for(Batch::single(buckets.edge(length))), NoFeasiblePlan);
}

TEST_CASE("cache: a bucket where nothing fits throws every time; packed batches are planned exactly, uncached") {
  const cost::HardwareProfile hw = cost::a100_sxm4_80gb_x8();
  const ModelConfig model = ModelConfig::uniform(shape(), 4);
  PlanCache cache(model, hw, 8, std::int64_t(1) << 28);  // 256 MiB: not even the model states fit
  CHECK_THROWS_AS(cache.plan_for(Batch::single(4096)), NoFeasiblePlan);
  CHECK_THROWS_AS(cache.plan_for(Batch::single(4096)), NoFeasiblePlan);
  CHECK(cache.stats().misses == 1);
  // A packed batch is planned from its own dry runs (the document mask), not from a length bucket: nothing cached.
  PlanCache roomy(model, hw, 8, std::int64_t(1) << 40);
  const Plan packed = roomy.plan_for(Batch::packed({3000, 1000}));
  CHECK(packed.fits());
  CHECK(roomy.size() == 0);
}
