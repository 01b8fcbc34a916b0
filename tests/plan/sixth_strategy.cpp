// A sixth strategy defined in this file only: the catalog names it, the planner costs it from its dry run and
// plans with it, its own supports() rules it out with its reason, and the layer stack runs it, with its measured
// peak equal to the memory model's. No library file knows it (issue: "one statement per strategy").
#include "paradyse/comm/threads.hpp"
#include "paradyse/cost/builtin_profiles.hpp"
#include "paradyse/cost/dry_run.hpp"
#include "paradyse/cost/from_config.hpp"
#include "paradyse/cost/memory_model.hpp"
#include "paradyse/model/stack.hpp"
#include "paradyse/plan/planner.hpp"
#include "paradyse/plan/stack_plan.hpp"
#include "paradyse/strategy/strategies.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <string>
#include <vector>

using namespace paradyse;

namespace {

// MegatronTS's schedule under another name, with a requirement of its own: at least 4 tokens per rank.
template <class Backend = ops::Cpu>
struct ToyTS : MegatronTS<Backend> {
  static constexpr std::string_view name = "ToyTS";
  Support supports(const SublayerContext& ctx) const {
    if (ctx.length() < 4 * ctx.ranks())
      return {fmt::format("ToyTS needs 4 tokens per rank: s = {} < 4 p = {}", ctx.length(), 4 * ctx.ranks())};
    return MegatronTS<Backend>::supports(ctx);
  }
};

template <class Backend = ops::Cpu>
using SixStrategies = Switchable<MegatronTS<Backend>, UlyssesZ<Backend>, MegatronCZ<Backend>, METP<Backend>,
                                 ColossalZ<Backend>, ToyTS<Backend>>;

}  // namespace

TEST_CASE("a sixth strategy, defined in the test only, is costed, planned with and run") {
  const cost::StrategyCatalog catalog = cost::StrategyCatalog::of<SixStrategies<ops::Counting>>();
  REQUIRE(catalog.count() == 6);
  const int toy = catalog.index_of("ToyTS");
  CHECK(toy == 5);

  LayerConfig config = LayerConfig::make(64, 4);
  config.causal = true;
  config.zigzag = true;
  const int layers = 2, p = 4;
  const std::int64_t seq = 256;
  const cost::HardwareProfile hw = cost::a100_sxm4_80gb_x8();
  const plan::ModelConfig model = plan::model_config_of(config, layers);

  // Costed from its own code, and the only candidate: the planner plans with it.
  const std::vector<int> only_toy{toy};
  const plan::CostTable table = plan::build_cost_table(model, hw, p, plan::Batch::single(seq), only_toy, catalog);
  for (cost::Sublayer part : cost::kAllSublayers) {
    const plan::Option* option = table.option(0, part, toy);
    REQUIRE(option != nullptr);
    CHECK(option->time_s > 0);
    CHECK(option->saved_bytes > 0);
  }
  const plan::Plan plan = plan::plan_exact(table, std::int64_t(1) << 40);
  for (const plan::LayerPlan& l : plan.layers) {
    CHECK(plan.strategy_name(l.strategies.attention) == "ToyTS");
    CHECK(plan.strategy_name(l.strategies.mlp) == "ToyTS");
  }
  // Same code as MegatronTS: the same predicted cost.
  const plan::CostTable both = plan::build_cost_table(model, hw, p, plan::Batch::single(seq), {}, catalog);
  CHECK(both.option(0, cost::Sublayer::attention, toy)->time_s ==
        doctest::Approx(both.option(0, cost::Sublayer::attention, catalog.index_of("MegatronTS"))->time_s).scale(0));

  // Its requirement, stated once in supports(), reaches the planner with its reason.
  const plan::CostTable short_table = plan::build_cost_table(model, hw, p, plan::Batch::single(8), {}, catalog);
  CHECK(short_table.option(0, cost::Sublayer::attention, toy) == nullptr);
  CHECK(short_table.entry(0, cost::Sublayer::attention, toy).forbidden_reason.find("ToyTS needs 4 tokens per rank") !=
        std::string::npos);

  // The stack runs the plan; its output equals MegatronTS's; its peak equals the memory model's, to the byte.
  const StackPlan toy_plan = plan::stack_plan<SixStrategies<>>(plan);
  const cost::ModelShape shape = cost::shape_of(config, 1, seq, 4, layers);
  const std::int64_t predicted =
      cost::estimate_memory(shape, p, plan.strategies(), {4, 4, 0}, catalog).ordered_activations;
  std::vector<std::int64_t> peaks(static_cast<std::size_t>(p));
  std::vector<std::vector<float>> toy_out(static_cast<std::size_t>(p)), ts_out(static_cast<std::size_t>(p));
  run_ranks(p, [&](ThreadCommunicator& comm) {
    const int rank = comm.rank();
    const SequenceLayout sequence(seq, p, config.zigzag);
    const Shape local{1, sequence.local_length(rank), config.hidden};
    Tensor<float> x(local), out(local), dout(local), dx(local);
    for (std::int64_t i = 0; i < x.numel(); ++i) x.data()[i] = float((i * 7919 + rank * 104729) % 2001) / 1000.0f - 1.0f;
    dout.fill(1e-3f);
    {
      TransformerStack<SixStrategies<>> stack(config, layers, p, rank, 4321);
      BufferPool pool;
      MemoryTracker& tracker = MemoryTracker::current();
      comm.barrier();
      const std::size_t baseline = tracker.in_use();
      tracker.reset_peak();
      stack.forward(comm, pool, toy_plan, seq, x.view(), out.view());
      stack.backward(comm, pool, dout.view(), dx.view());
      peaks[std::size_t(rank)] = std::int64_t(tracker.peak() - baseline);
      toy_out[std::size_t(rank)].assign(dx.data(), dx.data() + dx.numel());
    }
    TransformerStack<AllStrategies<>> stack(config, layers, p, rank, 4321);
    BufferPool pool;
    stack.forward(comm, pool, uniform_plan<AllStrategies<>>(std::size_t(layers), "MegatronTS"), seq, x.view(), out.view());
    stack.backward(comm, pool, dout.view(), dx.view());
    ts_out[std::size_t(rank)].assign(dx.data(), dx.data() + dx.numel());
  });
  CHECK(*std::max_element(peaks.begin(), peaks.end()) == predicted);
  CHECK(toy_out == ts_out);
}
