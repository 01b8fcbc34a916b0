// Cost arithmetic at lengths a user can type (issue 15): up to 10^12 tokens and beyond, through the dry runs
// (cost/dry_run.hpp, cost/trace_cost.hpp) and plan::build_cost_table. Every table built holds non-negative byte
// counts and finite times; a length or model whose memory per rank would pass 2^60 bytes is refused with an Error
// saying it is beyond what any plan can hold, never a wrapped count, a negative extent or std::bad_alloc.
#include "paradyse/cost/builtin_profiles.hpp"
#include "paradyse/model/gpt.hpp"
#include "paradyse/plan/gpt_costs.hpp"
#include "paradyse/plan/planner.hpp"
#include "paradyse/strategy/strategies.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <string>

using namespace paradyse;
using cost::Sublayer;

namespace {

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// The paper's layer: h = 12288, 96 heads, bf16, 8 layers on p = 8.
plan::ModelConfig paper_model(int layers = 8) {
  cost::ModelShape shape = cost::ModelShape::mha(12288, 96);
  shape.causal = shape.zigzag = true;
  return plan::ModelConfig::uniform(shape, layers);
}

// Either a table with sane numbers, or an Error saying the length is beyond what any plan can hold. Returns whether
// a table was built.
bool table_is_sane_or_refused(const plan::ModelConfig& model, int p, std::int64_t length, std::int64_t samples = 1) {
  CAPTURE(length);
  const cost::HardwareProfile hw = cost::builtin_profile("a100");
  std::optional<plan::CostTable> table;
  try {
    table = plan::build_cost_table(model, hw, p, plan::Batch::single(length, samples));
  } catch (const plan::NoFeasiblePlan&) {
    FAIL("build_cost_table throws no NoFeasiblePlan");
  } catch (const Error& e) {
    CAPTURE(e.what());
    CHECK(contains(e.what(), "beyond what any plan can hold"));
    return false;
  }
  CHECK(table->fixed_bytes > 0);
  CHECK(table->model_state_bytes > 0);
  CHECK(table->stack_bytes >= 0);
  int allowed = 0;
  for (int s = 0; s < table->strategy_count(); ++s)
    for (Sublayer part : cost::kAllSublayers) {
      const plan::CostTable::Entry& e = table->entry(0, part, s);
      if (!e.option) {
        CHECK(!e.forbidden_reason.empty());
        continue;
      }
      ++allowed;
      CHECK(e.option->saved_bytes >= 0);
      CHECK(e.option->transient_bytes >= 0);
      CHECK(std::isfinite(e.option->time_s));
      CHECK(e.option->time_s >= 0);
      const plan::Evaluation u = plan::evaluate(*table, plan::uniform_layers(*table, s));
      if (u.allowed) {
        CHECK(u.peak_bytes() >= table->fixed_bytes);
        CHECK(u.peak_bytes() <= 4 * plan::kMaxPlanBytes);  // no sum near 2^63
      }
    }
  CHECK(allowed > 0);
  // Planning either finds a plan or says by how much nothing fits (a positive shortfall).
  try {
    const plan::Plan best = plan::plan_exact(*table, hw.usable_memory_bytes());
    CHECK(best.fits());
  } catch (const plan::NoFeasiblePlan& e) {
    CHECK(e.shortfall_bytes() > 0);
    CHECK(e.least_peak_bytes() > 0);
  }
  return true;
}

}  // namespace

TEST_CASE("overflow: lengths from 10^3 to 10^12 tokens give sane cost tables or a clear refusal") {
  const plan::ModelConfig model = paper_model();
  for (std::int64_t length : {std::int64_t(1000), std::int64_t(1) << 20, std::int64_t(500'000'000),
                              std::int64_t(1'000'000'000), std::int64_t(10'000'000'000), std::int64_t(1'000'000'000'000)})
    CHECK(table_is_sane_or_refused(model, 8, length));  // the paper's model holds its states; each length is planned
}

TEST_CASE("overflow: a strategy whose dry run passes 2^60 bytes is forbidden, saying so; the others are costed") {
  // ColossalZ keeps the s x s/p scores: 12 heads x 6.25e7 x 5e8 floats = 1.5e18 bytes per rank at s = 5e8 (the
  // tally wrapped to "negative cost ... saved -9223361212530556864" before, and the dry run threw a negative extent).
  const plan::CostTable table =
      plan::build_cost_table(paper_model(), cost::builtin_profile("a100"), 8, plan::Batch::single(500'000'000));
  const int colossal = cost::default_catalog().index_of("ColossalZ");
  const plan::CostTable::Entry& e = table.entry(0, Sublayer::attention, colossal);
  CHECK(!e.option);
  CHECK(contains(e.forbidden_reason, "ColossalZ: length 500000000 is beyond what it can hold on 8 ranks"));
  CHECK(table.option(0, Sublayer::attention, cost::default_catalog().index_of("MegatronTS")) != nullptr);
}

TEST_CASE("overflow: lengths and models beyond 2^60 bytes per rank are refused as beyond what any plan can hold") {
  const cost::HardwareProfile hw = cost::builtin_profile("a100");
  auto error_of = [&](const plan::ModelConfig& model, int p, plan::Batch batch) -> std::string {
    try {
      plan::build_cost_table(model, hw, p, batch);
    } catch (const Error& e) {
      return e.what();
    }
    return "no error";
  };
  // 2^51 tokens: beyond the longest length planned.
  CHECK(contains(error_of(paper_model(), 8, plan::Batch::single(std::int64_t(1) << 51)),
                 "length 2251799813685248 is beyond what any plan can hold (lengths up to 2^50"));
  // 10^12 tokens of a 2^20-wide layer in a batch of 2^20 samples: one activation alone is 2^60+ bytes per rank.
  {
    cost::ModelShape wide = cost::ModelShape::mha(1 << 20, 1 << 10);
    const std::string message = error_of(plan::ModelConfig::uniform(wide, 1), 1,
                                         plan::Batch::single(1'000'000'000'000, 1 << 20));
    CHECK(contains(message, "length 1000000000000 is beyond what any plan can hold: one activation of 1048576 x "
                            "1000000000000 tokens x 1048576"));
  }
  // plan_trace's largest flags (h = 2^20, ffn = 2^24, 100000 layers): the states alone overflow 64 bits.
  {
    cost::ModelShape huge = cost::ModelShape::mha(1 << 20, 1 << 16);
    huge.head_dim = 1 << 16;
    huge.ffn = 1 << 24;
    CHECK(contains(error_of(plan::ModelConfig::uniform(huge, 100'000), 1, plan::Batch::single(4096)),
                   "the model is beyond what any plan can hold: its weights, gradients and optimizer states need"));
  }
  // Every strategy's dry run passes 2^60 bytes: the length is beyond any plan, naming each strategy's reason.
  {
    const std::string message = error_of(paper_model(), 8, plan::Batch::single(std::int64_t(1) << 50));
    CHECK(contains(message, "is beyond what any plan can hold"));
  }
}

TEST_CASE("overflow: plan::GptCosts at 10^12 tokens plans or refuses, and never wraps") {
  using Model = Gpt<AllStrategies<>>;
  GptConfig config;
  config.layer = LayerConfig::make(128, 4);
  config.layer.causal = config.layer.zigzag = config.layer.rope = true;
  config.layers = 4;
  config.vocab = 256;
  const cost::HardwareProfile hw = cost::builtin_profile("a100");
  const plan::GptCosts<Model> costs{config, 4, &hw};
  for (std::int64_t s : {std::int64_t(4096), std::int64_t(1'000'000'000), std::int64_t(1'000'000'000'000)}) {
    CAPTURE(s);
    try {
      const std::int64_t peak = costs.uniform_peak(s, cost::default_catalog().index_of("METP"));
      CHECK(peak > 0);
      CHECK(peak <= 4 * plan::kMaxPlanBytes);
    } catch (const Error& e) {
      CAPTURE(e.what());
      CHECK(contains(e.what(), "beyond what"));
    }
  }
}
