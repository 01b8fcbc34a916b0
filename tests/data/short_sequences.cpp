// Short sequences (issue 27): a window shorter than a token per chunk runs padded (data/packing.hpp), and the
// planners cost it at that padded length through the same rule (data::padded_length): plan::GptCosts and
// plan::MoeGptCosts give a sequence of 1..7 tokens on p = 4 (zigzag: 8 chunks) the table of 8 tokens instead of
// SequenceLayout's refusal (train_gpt --min-len 1 --max-len 3 on 4 ranks failed with it), and the default memory cap
// is computed from it. The rule and pack_steps agree on the padded length.

#include "paradyse/cost/builtin_profiles.hpp"
#include "paradyse/data/document_balance.hpp"
#include "paradyse/data/packing.hpp"
#include "paradyse/model/gpt.hpp"
#include "paradyse/plan/gpt_costs.hpp"
#include "paradyse/plan/memory_cap.hpp"
#include "paradyse/plan/moe_plan.hpp"
#include "paradyse/strategy/strategies.hpp"

#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

using namespace paradyse;

namespace {

// Every option of two tables equal (time and bytes), and what every plan needs.
void check_same_table(const plan::CostTable& a, const plan::CostTable& b) {
  CHECK(a.fixed_bytes == b.fixed_bytes);
  CHECK(a.model_state_bytes == b.model_state_bytes);
  CHECK(a.stack_bytes == b.stack_bytes);
  REQUIRE(a.entries.size() == b.entries.size());
  for (std::size_t kind = 0; kind < a.entries.size(); ++kind)
    for (std::size_t part = 0; part < 2; ++part) {
      REQUIRE(a.entries[kind][part].size() == b.entries[kind][part].size());
      for (std::size_t s = 0; s < a.entries[kind][part].size(); ++s) {
        const auto& x = a.entries[kind][part][s];
        const auto& y = b.entries[kind][part][s];
        REQUIRE(x.option.has_value() == y.option.has_value());
        if (!x.option) continue;
        CHECK(x.option->time_s == y.option->time_s);
        CHECK(x.option->saved_bytes == y.option->saved_bytes);
        CHECK(x.option->transient_bytes == y.option->transient_bytes);
      }
    }
}

GptConfig small_gpt() {
  GptConfig config;
  config.layer = LayerConfig::make(64, 4);
  config.layer.causal = config.layer.zigzag = config.layer.rope = true;
  config.layers = 2;
  config.vocab = 256;
  return config;
}

}  // namespace

TEST_CASE("short sequences: the group's minimum is a token per chunk, and shorter ones run at it") {
  CHECK(data::min_sequence_length({4, true}) == 8);
  CHECK(data::min_sequence_length({4, false}) == 4);
  CHECK(data::min_sequence_length({1, true}) == 2);
  CHECK(data::padded_length(1, {8, false}) == 8);
  CHECK(data::padded_length(7, {8, false}) == 8);
  CHECK(data::padded_length(9, {8, false}) == 9);
  CHECK(data::padded_length(9, {8, true}) == 16);
  CHECK(data::padded_length(17, {8, true}) == 17);
  CHECK_THROWS_AS(data::padded_length(0, {8, true}), Error);
  CHECK_THROWS_AS(data::min_sequence_length({0, true}), Error);
  // pack_steps pads each window to the same length the rule gives.
  std::vector<data::Window> windows;
  for (std::int64_t length : {1, 3, 7, 8, 12}) windows.push_back({0, 0, length});
  const data::SequenceSplit group{4, true};
  const std::vector<data::Step> steps = data::pack_steps(windows, 0, data::min_sequence_length(group));
  REQUIRE(steps.size() == windows.size());
  for (std::size_t i = 0; i < steps.size(); ++i) CHECK(steps[i].length == data::padded_length(windows[i].length, group));
}

TEST_CASE("short sequences: GptCosts costs a sequence shorter than the group's minimum at its padded length") {
  using Model = Gpt<AllStrategies<>>;
  const GptConfig config = small_gpt();
  const cost::HardwareProfile hw = cost::builtin_profile("a100");
  const plan::GptCosts<Model> costs{config, 4, &hw};  // zigzag: 8 chunks
  const plan::CostTable padded = costs.table(8);
  for (std::int64_t s = 1; s < 8; ++s) {
    CAPTURE(s);
    const plan::CostTable t = costs.table(s);  // SequenceLayout refused these before
    CHECK(t.batch.tokens_per_sample() == 8);
    check_same_table(t, padded);
    CHECK(costs.max_local_tokens(s) == 2);
  }
  // The default cap at --max-len 3 is the one at 8 tokens (train_gpt --min-len 1 --max-len 3 on 4 ranks).
  const plan::DefaultCap at3 = plan::default_memory_cap(costs, 3), at8 = plan::default_memory_cap(costs, 8);
  CHECK(at3.cap == at8.cap);
  CHECK(at3.metp_peak == at8.metp_peak);
  // A packed sequence of short documents: the padding is a document of its own at the end.
  const plan::CostTable packed = costs.packed_table({2, 3});
  CHECK(packed.batch.tokens_per_sample() == 8);
  CHECK(packed.batch.lengths == std::vector<std::int64_t>{2, 3, 3});
  // Contiguous groups (no zigzag): p chunks.
  GptConfig contiguous = config;
  contiguous.layer.zigzag = false;
  const plan::GptCosts<Model> flat{contiguous, 4, &hw};
  CHECK(flat.table(3).batch.tokens_per_sample() == 4);
  CHECK(flat.table(5).batch.tokens_per_sample() == 5);
}

TEST_CASE("short sequences: MoeGptCosts costs a sequence shorter than the group's minimum at its padded length") {
  GptConfig config = small_gpt();
  config.layer.activation = Activation::swiglu;
  config.layer.norm = NormKind::rms_norm;
  MoeConfig m;
  m.hidden = 64;
  m.experts = 4;
  m.top_k = 2;
  m.expert_ffn = 64;
  config.moe = MoeLayers{m, 0};
  const cost::HardwareProfile hw = cost::builtin_profile("a100");
  const plan::MoeGptCosts<Gpt<>> costs{config, 4, &hw};
  const plan::MoeCostTable padded = costs.table(8);
  for (std::int64_t s : {1, 3, 7}) {
    CAPTURE(s);
    const plan::MoeCostTable t = costs.table(s);
    check_same_table(t.dense, padded.dense);
    CHECK(plan::plan_moe_exact(t, std::int64_t(1) << 40).layers.size() == 2);
  }
}
