// tests/moe/moe_cost.cpp: the dry run of the MoE strategies. The bytes forward saves equal, to the byte, what a real
// run on thread ranks saves under the same (balanced) routing; ExpertParallel's traffic grows with the tokens and
// ExpertTensorParallel's does not; the time model reads both traces. The MoE half of a layer (norm, MoE, residual)
// costs its MoE's dry run plus the norm; the MoE planner (plan/moe_plan.hpp) against brute force over every per-layer
// choice, its plan runs on the layer stack, and it says clearly when nothing fits. MoeGptCosts::packed_table is the
// MoE table over Batch::packed (one document: table(s)), and its ring attention sees the documents' order.
#include "paradyse/comm/threads.hpp"
#include "paradyse/cost/builtin_profiles.hpp"
#include "paradyse/cost/moe_cost.hpp"
#include "paradyse/data/document_balance.hpp"
#include "paradyse/plan/moe_plan.hpp"

#include <doctest/doctest.h>

#include <vector>

using namespace paradyse;
using paradyse::data::max_rank_causal_pairs;

namespace {

MoeConfig cost_config() {
  MoeConfig c;
  c.hidden = 8;
  c.experts = 4;
  c.top_k = 2;
  c.expert_ffn = 6;
  c.shared_experts = 1;
  c.shared_ffn = 4;
  c.shared_gate = true;
  return c;
}

// What forward saves on each rank of a real run whose router sends local token t to experts t and t + 1 (mod E),
// as the counting router's stand-in does: the bytes freed when the saved state is destroyed.
template <template <class> class Strategy>
std::vector<std::int64_t> real_saved_bytes(const MoeConfig& c, int p, std::int64_t tokens) {
  std::vector<std::int64_t> saved_bytes(static_cast<std::size_t>(p));
  std::vector<int> as_assumed(static_cast<std::size_t>(p), 1);
  run_ranks(p, [&](ThreadCommunicator& comm) {
    BufferPool pool;
    const MoeContext ctx(c, pool);
    MoeShard w = MoeShard::zeros(c, p, comm.rank());
    for (std::int64_t e = 0; e < c.experts; ++e) w.router(e, e) = 1.0f;  // logit e = x[e]
    Tensor<float> x(Shape{1, tokens, c.hidden}), y(x.shape());
    for (std::int64_t t = 0; t < tokens; ++t) {
      x(0, t, t % c.experts) = 2.0f;
      x(0, t, (t + 1) % c.experts) = 1.0f;
    }
    std::size_t with = 0;
    {
      const MoeSaved saved = Strategy<ops::Cpu>{}.forward(comm, ctx, w, x.view(), y.view());
      for (std::int64_t t = 0; t < tokens; ++t)  // doctest's assertions are made on the main thread
        if (saved.routing.expert[std::size_t(2 * t)] != t % c.experts ||
            saved.routing.expert[std::size_t(2 * t + 1)] != (t + 1) % c.experts)
          as_assumed[std::size_t(comm.rank())] = 0;
      with = MemoryTracker::current().in_use();
    }
    saved_bytes[std::size_t(comm.rank())] = std::int64_t(with - MemoryTracker::current().in_use());
  });
  for (const int ok : as_assumed) CHECK(ok == 1);
  return saved_bytes;
}

double posted_bytes(const cost::SublayerTrace& t) {
  double bytes = 0;
  for (const auto* phase : {&t.forward, &t.backward})
    for (const TraceEvent& e : *phase)
      if (e.kind == TraceKind::post) bytes += e.bytes;
  return bytes;
}

}  // namespace

TEST_CASE("moe dry run: the saved bytes equal a real run's, to the byte") {
  const MoeConfig c = cost_config();
  for (int p : {1, 2, 4}) {
    CAPTURE(p);
    const std::vector<std::int64_t> ep = real_saved_bytes<ExpertParallel>(c, p, 8);
    const std::vector<std::int64_t> etp = real_saved_bytes<ExpertTensorParallel>(c, p, 8);
    for (int r = 0; r < p; ++r) {
      CAPTURE(r);
      CHECK(moe_cost<ExpertParallel>(c, p, r, 1, 8, nullptr).saved_bytes == ep[std::size_t(r)]);
      CHECK(moe_cost<ExpertTensorParallel>(c, p, r, 1, 8, nullptr).saved_bytes == etp[std::size_t(r)]);
    }
  }
}

TEST_CASE("moe dry run: ExpertParallel's traffic grows with the tokens, ExpertTensorParallel's does not; times") {
  MoeConfig c = cost_config();
  c.hidden = 64;
  c.experts = 8;
  c.expert_ffn = 128;
  const cost::HardwareProfile h100 = cost::builtin_profile("h100");
  const double ep_small = posted_bytes(moe_dry_run<ExpertParallel>(c, 4, 0, 1, 16));
  const double ep_large = posted_bytes(moe_dry_run<ExpertParallel>(c, 4, 0, 1, 1024));
  const double etp_small = posted_bytes(moe_dry_run<ExpertTensorParallel>(c, 4, 0, 1, 16));
  const double etp_large = posted_bytes(moe_dry_run<ExpertTensorParallel>(c, 4, 0, 1, 1024));
  CHECK(ep_large > 30 * ep_small);
  // ExpertTensorParallel moves the experts (and the small router statistics and replicated gradients).
  CHECK(etp_large == doctest::Approx(etp_small).epsilon(0.01));
  CHECK(etp_small > ep_small);
  const cost::SublayerCost ep = moe_cost<ExpertParallel>(c, 4, 0, 1, 1024, &h100);
  const cost::SublayerCost etp = moe_cost<ExpertTensorParallel>(c, 4, 0, 1, 1024, &h100);
  CHECK(ep.forward_s > 0);
  CHECK(ep.backward_s > ep.forward_s);
  CHECK(etp.forward_s > 0);
  CHECK(etp.backward_s > etp.forward_s);
  CHECK(ep.saved_bytes > 0);
}

namespace {

plan::MoeGptCosts<Gpt<>> planner_costs(int p) {
  GptConfig config;
  config.layer.hidden = 64;
  config.layer.heads = 4;
  config.layer.kv_heads = 4;
  config.layer.head_dim = 16;
  config.layer.ffn = 128;
  config.layer.activation = Activation::swiglu;
  config.layer.causal = true;
  config.layers = 3;
  config.vocab = 256;
  MoeConfig m;
  m.hidden = 64;
  m.experts = 6;
  m.top_k = 2;
  m.expert_ffn = 64;
  m.shared_experts = 1;
  m.shared_ffn = 32;
  config.moe = MoeLayers{m, 1};
  static const cost::HardwareProfile h100 = cost::builtin_profile("h100");
  return {config, p, &h100};
}

}  // namespace

TEST_CASE("moe half dry run: the MoE's saved bytes, and the norm's and residual's work on top") {
  const auto costs = planner_costs(4);
  const MoeConfig& m = costs.config.moe->moe;
  for (std::size_t s = 0; s < MoeStrategies<>::count; ++s) {
    const cost::SublayerCost half = moe_half_cost(costs.config.layer, m, s, 4, 1, 256, nullptr);
    const cost::SublayerCost alone = s == 0 ? moe_cost<ExpertParallel>(m, 4, 0, 1, 64, nullptr)
                                            : moe_cost<ExpertTensorParallel>(m, 4, 0, 1, 64, nullptr);
    CHECK(half.saved_bytes == alone.saved_bytes);  // the norm's statistics belong to the attention half
    CHECK(half.pool_bytes() >= alone.pool_bytes());
  }
}

TEST_CASE("moe planner: the exact plan against brute force over every per-layer choice, and on the stack") {
  for (int p : {2, 4}) {
    const auto costs = planner_costs(p);
    for (std::int64_t s : {64, 1024}) {
      const plan::MoeCostTable table = costs.table(s);
      const int n = table.dense.strategy_count();
      // Every choice: attention x (mlp or moe) per layer.
      std::vector<plan::MoePlan> all;
      std::vector<plan::MoeLayerPlan> choice(3);
      const int moe_count = int(MoeStrategies<>::count);
      for (int a0 = 0; a0 < n; ++a0)
        for (int f0 = 0; f0 < n; ++f0)
          for (int a1 = 0; a1 < n; ++a1)
            for (int f1 = 0; f1 < moe_count; ++f1)
              for (int a2 = 0; a2 < n; ++a2)
                for (int f2 = 0; f2 < moe_count; ++f2) {
                  choice[0] = {false, a0, f0};
                  choice[1] = {true, a1, f1};
                  choice[2] = {true, a2, f2};
                  try {
                    all.push_back(plan::moe_plan_of(table, choice, 0));
                  } catch (const Error&) {  // a forbidden strategy
                  }
                }
      REQUIRE(!all.empty());
      std::int64_t least = all.front().peak_bytes(), most = least;
      for (const plan::MoePlan& q : all) least = std::min(least, q.peak_bytes()), most = std::max(most, q.peak_bytes());
      for (const std::int64_t budget : {most, (least + most) / 2, least + (most - least) / 10}) {
        double best = std::numeric_limits<double>::infinity();
        for (const plan::MoePlan& q : all)
          if (q.peak_bytes() <= budget) best = std::min(best, q.time_s);
        const plan::MoePlan got = plan::plan_moe_exact(table, budget);
        INFO("p = " << p << ", s = " << s << ", budget " << budget << ": " << got.summary());
        CHECK(got.fits());
        CHECK(got.time_s == doctest::Approx(best).epsilon(1e-9));
        // Its own accounting agrees with the table's.
        const plan::MoePlan again = plan::moe_plan_of(table, got.layers, budget);
        CHECK(again.time_s == doctest::Approx(got.time_s).epsilon(1e-12));
        CHECK(again.peak_bytes() == got.peak_bytes());
        CHECK_FALSE(got.layers[0].moe);
        CHECK(got.layers[1].moe);
      }
      CHECK_THROWS_WITH_AS(plan::plan_moe_exact(table, least - 1), doctest::Contains("no plan fits the memory budget"),
                           plan::NoFeasiblePlan);
    }
  }
  // The plan runs on the stack of the GPT it was made for.
  const auto costs = planner_costs(2);
  const plan::MoePlan best = plan::plan_moe_exact(costs.table(16), std::int64_t(1) << 40);
  const StackPlan stack_plan = best.stack_plan<AllStrategies<>>();
  run_ranks(2, [&](ThreadCommunicator& comm) {
    Gpt<> model(costs.config, 2, comm.rank(), 7);
    BufferPool pool;
    Tensor<std::int32_t> tokens(Shape{1, 8}), targets(Shape{1, 8});
    for (std::int64_t i = 0; i < 8; ++i) tokens(0, i) = std::int32_t(i + comm.rank()), targets(0, i) = std::int32_t(i);
    const GptStepResult r = model.forward_backward(comm, pool, stack_plan, 16, tokens.view(), targets.view());
    CHECK(std::isfinite(r.loss));
    CHECK(model.stack().moe_stats().size() == 2);
  });
}

namespace {

// Two MoE cost tables hold the same numbers (every entry, its option or its reason, and the fixed bytes).
void check_same_table(const plan::MoeCostTable& a, const plan::MoeCostTable& b) {
  CHECK(a.dense.batch.lengths == b.dense.batch.lengths);
  CHECK(a.dense.batch.samples == b.dense.batch.samples);
  CHECK(a.dense.fixed_bytes == b.dense.fixed_bytes);
  CHECK(a.dense.model_state_bytes == b.dense.model_state_bytes);
  CHECK(a.dense.plain_bytes == b.dense.plain_bytes);
  CHECK(a.is_moe == b.is_moe);
  const auto same_entry = [](const plan::CostTable::Entry& x, const plan::CostTable::Entry& y) {
    REQUIRE(x.option.has_value() == y.option.has_value());
    CHECK(x.forbidden_reason == y.forbidden_reason);
    if (!x.option) return;
    CHECK(x.option->time_s == y.option->time_s);
    CHECK(x.option->saved_bytes == y.option->saved_bytes);
    CHECK(x.option->transient_bytes == y.option->transient_bytes);
  };
  REQUIRE(a.dense.entries.size() == b.dense.entries.size());
  for (std::size_t k = 0; k < a.dense.entries.size(); ++k)
    for (std::size_t part = 0; part < 2; ++part) {
      REQUIRE(a.dense.entries[k][part].size() == b.dense.entries[k][part].size());
      for (std::size_t s = 0; s < a.dense.entries[k][part].size(); ++s)
        same_entry(a.dense.entries[k][part][s], b.dense.entries[k][part][s]);
    }
  REQUIRE(a.moe.size() == b.moe.size());
  for (std::size_t s = 0; s < a.moe.size(); ++s) same_entry(a.moe[s], b.moe[s]);
}

}  // namespace

TEST_CASE("MoeGptCosts::packed_table: the MoE table of Batch::packed; one document is table(s); the order counts") {
  for (int p : {2, 4}) {
    CAPTURE(p);
    auto costs = planner_costs(p);
    costs.config.layer.zigzag = true;
    const std::vector<std::int64_t> lengths{40, 5, 7, 12};
    const std::int64_t s = 64;
    check_same_table(costs.packed_table(lengths),
                     plan::build_moe_cost_table(costs.config, *costs.hardware, p, plan::Batch::packed(lengths),
                                                {4, 4, 8}, costs.extra_bytes(s), *costs.catalog));
    check_same_table(costs.packed_table({s}), costs.table(s));
    // The order of the documents is the order on the zigzag ranks: the long document first gives its slowest rank
    // more query-key pairs than last does (data/document_balance.hpp), and the ring's time follows the slowest rank.
    const std::vector<std::int64_t> reordered{5, 7, 12, 40};
    REQUIRE(max_rank_causal_pairs(lengths, {p, true}) > max_rank_causal_pairs(reordered, {p, true}));
    const plan::MoeCostTable first = costs.packed_table(lengths), last = costs.packed_table(reordered);
    const int cz = cost::default_catalog().index_of("MegatronCZ");
    const plan::CostTable::Entry& a = first.dense.entry(plan::MoeCostTable::kMoeKind, plan::Sublayer::attention, cz);
    const plan::CostTable::Entry& b = last.dense.entry(plan::MoeCostTable::kMoeKind, plan::Sublayer::attention, cz);
    REQUIRE(a.option.has_value());
    REQUIRE(b.option.has_value());
    CHECK(a.option->time_s > b.option->time_s);
  }
  CHECK_THROWS_WITH_AS(planner_costs(2).packed_table({}), doctest::Contains("at least one document"), Error);
}
