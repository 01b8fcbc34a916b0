// Tests of paradyse/plan/activation_stash.hpp: the micro-batch stashes a pipeline rank holds (1F1B and interleaved,
// against hand counts of the schedules), what each recompute mode keeps and re-runs (none, selective, full), and
// that both planners (plan/gpt_costs.hpp's GptCosts, plan/moe_plan.hpp's MoeGptCosts) price their tables by it: every
// option's saved bytes times the stashes, selective's attention from the dry run without its core, full's time the
// forward twice plus the backward.
#include "paradyse/cost/builtin_profiles.hpp"
#include "paradyse/model/gpt.hpp"
#include "paradyse/plan/activation_stash.hpp"
#include "paradyse/plan/gpt_costs.hpp"
#include "paradyse/plan/moe_plan.hpp"

#include "plan/small_gpt.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <tuple>

using namespace paradyse;
using plan::ActivationStash;
using plan::pipeline_stash_factor;

namespace {

constexpr auto none = PipelineRecompute::none, selective = PipelineRecompute::selective,
               full = PipelineRecompute::full;

// 3 layers (the first dense, two MoE with `moe`), h = 64.
GptConfig gpt(bool moe) {
  const GptConfig c = testing::small_gpt(64, 128, 3, 96);
  return moe ? testing::with_moe(c) : c;
}

// Calls check(stashed, plain) for every allowed option of two tables of the same model.
void each_option(const plan::CostTable& stashed, const plan::CostTable& plain,
                 const std::function<void(const plan::Option&, const plan::Option&)>& check_pair) {
  int checked = 0;
  for (std::size_t k = 0; k < plain.entries.size(); ++k)
    for (std::size_t part = 0; part < 2; ++part)
      for (std::size_t s = 0; s < plain.entries[k][part].size(); ++s) {
        const auto& a = stashed.entries[k][part][s].option;
        const auto& b = plain.entries[k][part][s].option;
        REQUIRE(a.has_value() == b.has_value());
        if (!b) continue;
        CAPTURE(k);
        CAPTURE(part);
        CAPTURE(s);
        check_pair(*a, *b);
        ++checked;
      }
  CHECK(checked >= 4);
}

// The rule, checked on one option of one micro-batch.
void check_stashed(const ActivationStash& stash, const plan::Option& got, const plan::Option& one) {
  CHECK(got.saved_bytes == std::int64_t(std::ceil(double(one.saved_bytes) * stash.stashes)));
  CHECK(one.forward_s > 0);
  CHECK(one.forward_s < one.time_s);
  CHECK(got.forward_s == one.forward_s);
  CHECK(got.time_s == doctest::Approx(one.time_s + (stash.recompute == full ? one.forward_s : 0.0)).epsilon(1e-12));
}

}  // namespace

TEST_CASE("activation stash: 1F1B, the first stage holds min(p - r, m) micro-batches of its layers") {
  for (const PipelineRecompute r : {none, selective}) {
    // 5 layers on 2 stages: 3 + 2. Stage 0 holds 2 micro-batches of 3 layers, stage 1 one of 2: 6 of 5.
    CHECK(pipeline_stash_factor(r, 5, 2, 1, 8) == doctest::Approx(6.0 / 5));
    // 7 layers on 3 stages: 3 + 2 + 2; stage 0 holds 3 micro-batches (9 layers), stage 1 two (4), stage 2 one (2).
    CHECK(pipeline_stash_factor(r, 7, 3, 1, 8) == doctest::Approx(9.0 / 7));
    // Fewer micro-batches than stages: stage 0 holds all 2 of them (6 layers).
    CHECK(pipeline_stash_factor(r, 7, 3, 1, 2) == doctest::Approx(6.0 / 7));
    // One micro-batch: a stage's layers once; the largest stage's 3 of 7.
    CHECK(pipeline_stash_factor(r, 7, 3, 1, 1) == doctest::Approx(3.0 / 7));
    // No pipeline: one micro-batch at a time, the whole stack.
    CHECK(pipeline_stash_factor(r, 7, 1, 1, 5) == 1.0);
  }
}

TEST_CASE("activation stash: interleaved 1F1B holds (p - r - 1) 2 + (v - 1) p + 1 chunks at its peak") {
  for (const PipelineRecompute r : {none, selective}) {
    // 4 layers, 2 stages of 2 chunks: a layer per virtual stage. Stage 0 warms up with (2 - 0 - 1) 2 + (2 - 1) 2 = 4
    // chunk forwards, then holds a fifth before its first backward: 5 layers of 4.
    CHECK(pipeline_stash_factor(r, 4, 2, 2, 4) == doctest::Approx(5.0 / 4));
    // 3 micro-batches run as whole rounds of 2: 4.
    CHECK(pipeline_stash_factor(r, 4, 2, 2, 3) == doctest::Approx(5.0 / 4));
    // 8 layers, 2 per virtual stage: stage 0 holds 5 chunks of 2 layers, 10 of 8.
    CHECK(pipeline_stash_factor(r, 8, 2, 2, 8) == doctest::Approx(10.0 / 8));
    // 6 layers over 4 virtual stages (2, 2, 1, 1): stage 0's chunks are virtual stages 0 and 2 (2 and 1 layers): its
    // warm-up forwards are chunk 0 of micro-batches 0, 1, chunk 1 of 0, 1 (6 layers), then chunk 0 of micro-batch 2
    // (8), the backward of chunk 1 of micro-batch 0 (7), chunk 0 of micro-batch 3 (9): peak 9 of 6.
    CHECK(pipeline_stash_factor(r, 6, 2, 2, 4) == doctest::Approx(9.0 / 6));
  }
}

TEST_CASE("activation stash: full recompute keeps one stack and runs the forward twice") {
  CHECK(pipeline_stash_factor(full, 7, 3, 1, 8) == 1.0);
  CHECK(pipeline_stash_factor(full, 8, 2, 2, 8) == 1.0);
  const plan::Option one{3, 0.5, 1001, 77, 0.2};
  for (const ActivationStash stash : {ActivationStash{none, 1.25}, ActivationStash{selective, 9.0 / 7},
                                      ActivationStash{full, 1.0}, ActivationStash{none, 1.0}})
    check_stashed(stash, stash.applied(one), one);
  CHECK(ActivationStash{full, 1.0}.applied(one).time_s == doctest::Approx(2 * 0.2 + 0.3));
  CHECK(ActivationStash{none, 1.25}.applied(one).saved_bytes == 1252);  // ceil(1251.25)
  CHECK(ActivationStash{selective, 1.0}.selective());
  CHECK_THROWS_WITH_AS(pipeline_stash_factor(none, 3, 2, 2, 4),
                       doctest::Contains("3 layers over 2 stages of 2 chunks"), Error);
}

TEST_CASE("activation stash: the dense planner's tables, every option by the rule") {
  const cost::HardwareProfile hw = cost::a100_sxm4_80gb_x8();
  for (const auto& [p, s] : {std::tuple{2, 256}, std::tuple{4, 301}}) {
    CAPTURE(p);
    const plan::GptCosts<Gpt<>> plain{gpt(false), p, &hw};
    const plan::CostTable one = plain.table(s);
    for (const ActivationStash stash : {ActivationStash{none, 1.25}, ActivationStash{full, 1.0},
                                        ActivationStash{none, 8.0 / 6}}) {
      plan::GptCosts<Gpt<>> costs = plain;
      costs.stash = stash;
      each_option(costs.table(s), one, [&](const plan::Option& a, const plan::Option& b) { check_stashed(stash, a, b); });
    }
    // Selective: the attention's dry run without its core (less saved, the core's forward again), the MLP's as none's.
    plan::GptCosts<Gpt<>> costs = plain;
    costs.stash = {selective, 1.5};
    const plan::CostTable t = costs.table(s);
    for (int strategy = 0; strategy < t.strategy_count(); ++strategy) {
      const plan::Option *a = t.option(0, cost::Sublayer::attention, strategy), *b = one.option(0, cost::Sublayer::attention, strategy);
      if (a && b) {
        CHECK(a->saved_bytes < std::int64_t(std::ceil(double(b->saved_bytes) * 1.5)));
        CHECK(a->time_s > b->time_s);
      }
      const plan::Option *c = t.option(0, cost::Sublayer::mlp, strategy), *d = one.option(0, cost::Sublayer::mlp, strategy);
      if (c && d) check_stashed(costs.stash, *c, *d);
    }
  }
}

TEST_CASE("activation stash: the MoE planner's tables, dense and MoE rows by the same rule") {
  const cost::HardwareProfile hw = cost::a100_sxm4_80gb_x8();
  for (const auto& [p, s] : {std::tuple{2, 256}, std::tuple{4, 300}}) {
    CAPTURE(p);
    const plan::MoeGptCosts<Gpt<>> plain{gpt(true), p, &hw};
    const plan::MoeCostTable one = plain.table(s);
    for (const ActivationStash stash : {ActivationStash{none, 1.25}, ActivationStash{full, 1.0},
                                        ActivationStash{none, 9.0 / 7}}) {
      plan::MoeGptCosts<Gpt<>> costs = plain;
      costs.stash = stash;
      const plan::MoeCostTable t = costs.table(s);
      each_option(t.dense, one.dense, [&](const plan::Option& a, const plan::Option& b) { check_stashed(stash, a, b); });
      REQUIRE(t.moe.size() == one.moe.size());
      for (std::size_t i = 0; i < t.moe.size(); ++i)
        if (one.moe[i].option) check_stashed(stash, *t.moe[i].option, *one.moe[i].option);
    }
    // Selective: both layer kinds' attention without its core; the MoE FFN as none's.
    plan::MoeGptCosts<Gpt<>> costs = plain;
    costs.stash = {selective, 1.0};
    const plan::MoeCostTable t = costs.table(s);
    int checked = 0;
    for (int kind : {plan::MoeCostTable::kDenseKind, plan::MoeCostTable::kMoeKind})
      for (int strategy = 0; strategy < t.dense.strategy_count(); ++strategy) {
        const plan::Option *a = t.dense.option(kind, cost::Sublayer::attention, strategy),
                           *b = one.dense.option(kind, cost::Sublayer::attention, strategy);
        if (!a || !b) continue;
        CHECK(a->saved_bytes < b->saved_bytes);
        CHECK(a->time_s > b->time_s);
        ++checked;
      }
    CHECK(checked >= 2);
    for (std::size_t i = 0; i < t.moe.size(); ++i)
      if (one.moe[i].option) check_stashed(costs.stash, *t.moe[i].option, *one.moe[i].option);
  }
}
