// Tests of the MoE planner's step time (plan/moe_plan.hpp): like a dense GPT's (tests/plan/outside_stack.cpp), a MoE
// GPT's predicted step holds the work outside its layer stack (embedding, final norm, LM head, loss, the replicated
// gradients' all-reduce, AdamW) and the first touch of the pool's working set; AdamW runs over the rank's experts
// (the ceil(E / p) it owns, the router, the shared experts), not over the token MLP the MoE layer kind is built with.
#include "paradyse/cost/builtin_profiles.hpp"
#include "paradyse/model/gpt.hpp"
#include "paradyse/plan/gpt_costs.hpp"
#include "paradyse/plan/moe_plan.hpp"

#include <doctest/doctest.h>

#include <cstdint>
#include <tuple>

using namespace paradyse;

namespace {

// 3 layers: one dense, two MoE; heads of 16 (h = 16 heads), E experts of width 64, one shared expert of width 32.
GptConfig moe_gpt(std::int64_t vocab, std::int64_t experts, std::int64_t heads = 4) {
  GptConfig c;
  c.layer.hidden = 16 * heads;
  c.layer.heads = heads;
  c.layer.kv_heads = heads;
  c.layer.head_dim = 16;
  c.layer.ffn = 32 * heads;
  c.layer.activation = Activation::swiglu;
  c.layer.causal = true;
  c.layers = 3;
  c.vocab = vocab;
  MoeConfig m;
  m.hidden = c.layer.hidden;
  m.experts = experts;
  m.top_k = 2;
  m.expert_ffn = 64;
  m.shared_experts = 1;
  m.shared_ffn = 32;
  c.moe = MoeLayers{m, 1};
  return c;
}

using MoeCosts = plan::MoeGptCosts<Gpt<>>;

// Every layer's attention on `attention`, the dense layer's MLP on `attention` too, the MoE layers on `moe`.
std::vector<plan::MoeLayerPlan> uniform_choices(const plan::MoeCostTable& t, int attention, int moe) {
  std::vector<plan::MoeLayerPlan> choices;
  for (int l = 0; l < t.layer_count(); ++l) choices.push_back({false, attention, t.is_moe[std::size_t(l)] ? moe : attention});
  return choices;
}

}  // namespace

TEST_CASE("moe planner, outside the stack: the head's parts as a dense GPT's, AdamW over the rank's experts") {
  for (const auto& [p, s, experts, heads] : {std::tuple{2, 1024, 6, 4}, std::tuple{4, 1000, 6, 4},
                                             std::tuple{3, 999, 5, 3}, std::tuple{1, 512, 4, 4}}) {
    CAPTURE(p);
    CAPTURE(s);
    CAPTURE(experts);
    const GptConfig config = moe_gpt(256, experts, heads);
    // Only elementwise traffic priced: AdamW reads and writes 7 floats per parameter.
    cost::HardwareProfile hw = cost::builtin_profile("h100");
    hw.gemm = {0, 1e30, 0};
    hw.elementwise_bytes_per_s = 1.7e9;
    const plan::MoeCostTable t = MoeCosts{config, p, &hw}.table(s);
    // The head, the loss, the embedding and the replicated all-reduce do not depend on the stack: a dense GPT's.
    GptConfig dense = config;
    dense.moe.reset();
    const plan::CostTable d = plan::GptCosts<Gpt<>>{dense, p, &hw}.table(s);
    CHECK(t.dense.outside_time.head_loss_s == doctest::Approx(d.outside_time.head_loss_s).epsilon(1e-12));
    CHECK(t.dense.outside_time.embedding_s == doctest::Approx(d.outside_time.embedding_s).epsilon(1e-12));
    CHECK(t.dense.outside_time.reduce_s == doctest::Approx(d.outside_time.reduce_s).epsilon(1e-12));
    CHECK(t.dense.outside_time.head_loss_s > 0);
    CHECK(t.dense.outside_time.embedding_s > 0);
    // AdamW: the replicated pack (untied embedding and head, final gamma and beta), the dense layer's shards, and per
    // MoE layer its attention and norms, its router [E, h], its ceil(E / p) experts (gate, up, down [f, h] each) and
    // its shared expert (3 x [32, h]).
    const double h = double(config.layer.hidden), replicated = (2 * 256.0 + 2) * h;
    cost::ModelShape attention_only = cost::shape_of(config.layer, 1, 1, 4);
    attention_only.ffn = 0;
    const double owned = double((experts + p - 1) / p);
    const double moe_layer = double(cost::parameters_per_rank(attention_only, p)) + double(experts) * h +
                             owned * 3 * 64 * h + 3 * 32 * h;
    const double dense_layer = double(cost::parameters_per_rank(cost::shape_of(config.layer, 1, 1, 4), p));
    CHECK(t.dense.outside_time.optimizer_s ==
          doctest::Approx(28 * (replicated + dense_layer + 2 * moe_layer) / 1.7e9).epsilon(1e-9));
  }
}

TEST_CASE("moe planner: a step prediction is the layers' time plus the work outside the stack and the pool's touch") {
  cost::HardwareProfile hw = cost::builtin_profile("h100");
  hw.fresh_memory = {2e10, 1.5e9, std::int64_t(1) << 16};
  for (const auto& [p, s, heads] : {std::tuple{2, 2048, 4}, std::tuple{3, 1000, 3}}) {
    CAPTURE(p);
    CAPTURE(s);
    const plan::MoeCostTable with = MoeCosts{moe_gpt(256, 6, heads), p, &hw}.table(s);
    plan::MoeCostTable without = with;  // the same layers, nothing outside the stack
    without.dense.outside_time = {};
    const plan::OutsideStackTime& o = with.dense.outside_time;
    CHECK(o.head_loss_s > 0);
    CHECK(o.reduce_s > 0);
    CHECK(o.optimizer_s > 0);
    int checked = 0;
    for (int a : cost::default_catalog().all())
      for (int moe = 0; moe < int(with.moe.size()); ++moe) {
        plan::MoePlan planned, bare;
        try {
          planned = plan::moe_plan_of(with, uniform_choices(with, a, moe), 0);
          bare = plan::moe_plan_of(without, uniform_choices(without, a, moe), 0);
        } catch (const Error&) {  // a strategy this shape forbids
          continue;
        }
        double layers = 0;
        for (const plan::MoeLayerPlan& l : planned.layers) layers += l.attention_s + l.ffn_s;
        const double touch = hw.fresh_memory.time(double(planned.memory.largest_transient), false);
        CHECK(touch > 0);
        // Each part named: the step holds all of them.
        CHECK(planned.time_s == doctest::Approx(layers + o.embedding_s + o.head_loss_s + o.reduce_s + o.optimizer_s +
                                                touch).epsilon(1e-12));
        CHECK(bare.time_s == doctest::Approx(layers + touch).epsilon(1e-12));
        ++checked;
      }
    CHECK(checked > 4);
    // The exact planner's plan is priced the same way.
    const plan::MoePlan best = plan::plan_moe_exact(with, std::int64_t(1) << 40);
    const plan::MoePlan again = plan::moe_plan_of(with, best.layers, std::int64_t(1) << 40);
    CHECK(best.time_s == doctest::Approx(again.time_s).epsilon(1e-12));
    double layers = 0;
    for (const plan::MoeLayerPlan& l : best.layers) layers += l.attention_s + l.ffn_s;
    const double touch = hw.fresh_memory.time(double(best.memory.largest_transient), /*zeroed=*/false);
    CHECK(best.time_s == doctest::Approx(layers + o.time_s() + touch).epsilon(1e-12));
  }
}
