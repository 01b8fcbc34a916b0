// Tests of paradyse/plan/stack_plan.hpp: a plan runs on the model's layer stack, and stays within its budget.
#include "paradyse/comm/threads.hpp"
#include "paradyse/cost/builtin_profiles.hpp"
#include "paradyse/cost/memory_model.hpp"
#include "paradyse/plan/stack_plan.hpp"
#include "paradyse/strategy/strategies.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <string_view>
#include <vector>

using namespace paradyse;
using namespace paradyse::plan;

namespace {
Strategy id(std::string_view name) { return cost::default_catalog().index_of(name); }
}  // namespace

TEST_CASE("stack_plan: strategy names map to the stack's indices") {
  const LayerConfig config = LayerConfig::make(64, 4);
  const ModelConfig model = model_config_of(config, 3);
  const CostTable table = build_cost_table(model, cost::a100_sxm4_80gb_x8(), 4, Batch::single(512));
  const std::vector<LayerStrategies> layers{{id("METP"), id("MegatronTS")},
                                            {id("UlyssesZ"), id("ColossalZ")},
                                            {id("MegatronCZ"), id("METP")}};
  const Plan plan = plan_of(table, layers, std::int64_t(1) << 40);
  const StackPlan sp = stack_plan<AllStrategies<>>(plan);
  REQUIRE(sp.size() == 3);
  for (std::size_t l = 0; l < 3; ++l) {
    CHECK(AllStrategies<>::names[sp[l].attention] == cost::default_catalog().name(layers[l].attention));
    CHECK(AllStrategies<>::names[sp[l].mlp] == cost::default_catalog().name(layers[l].mlp));
    CHECK(plan.strategy_name(layers[l].attention) == table.strategy_name(layers[l].attention));
  }
}

TEST_CASE("stack_plan: a mixed plan runs on the stack within the planner's budget") {
  const LayerConfig config = LayerConfig::make(64, 4);
  const int p = 4, layers = 3;
  const std::int64_t seq = 1024;
  const ModelConfig model = model_config_of(config, layers);
  const CostTable table = build_cost_table(model, cost::a100_sxm4_80gb_x8(), p, Batch::single(seq));
  // A budget halfway between the least-memory plan and the fastest: the plan has to mix strategies.
  const std::int64_t least = least_memory_plan(table, 0).peak_bytes();
  const std::int64_t fastest = plan_exact(table, std::int64_t(1) << 40).peak_bytes();
  const std::int64_t budget = (least + fastest) / 2;
  const Plan plan = plan_exact(table, budget);
  REQUIRE(plan.fits());
  std::vector<std::int64_t> weights(p), peaks(p);
  run_ranks(p, [&](ThreadCommunicator& comm) {
    MemoryTracker& tracker = MemoryTracker::current();
    const std::size_t before = tracker.in_use();
    TransformerStack<AllStrategies<>> stack(config, layers, p, comm.rank(), 7);
    const SequenceLayout sequence(seq, p, false);
    const Shape shape{1, sequence.local_length(comm.rank()), config.hidden};
    Tensor<float> x(shape), out(shape), dout(shape), dx(shape);
    std::fill(x.data(), x.data() + x.numel(), 0.5f);
    std::fill(dout.data(), dout.data() + dout.numel(), 1e-3f);
    BufferPool pool;
    weights[std::size_t(comm.rank())] = std::int64_t(tracker.in_use() - before);
    tracker.reset_peak();
    const std::size_t start = tracker.in_use();
    stack.forward(comm, pool, stack_plan<AllStrategies<>>(plan), seq, x.view(), out.view());
    stack.backward(comm, pool, dout.view(), dx.view());
    peaks[std::size_t(comm.rank())] = std::int64_t(tracker.peak() - start);
  });
  const std::int64_t activations = *std::max_element(peaks.begin(), peaks.end());
  // The planner's budgeted activations (its peak minus the model states) cover what the stack used.
  CHECK(plan.peak_bytes() - table.model_state_bytes >= activations);
  // And the model states are what the stack allocated for weights and gradients (plus its inputs and outputs).
  const std::int64_t io = 4 * std::int64_t(config.hidden) * (seq / p) * 4;
  CHECK(std::abs(double(*std::max_element(weights.begin(), weights.end()) - io - table.model_state_bytes)) <=
        0.02 * double(table.model_state_bytes));
}
