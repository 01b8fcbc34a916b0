// The planner prices MegatronRing (cp x tp, tp_inner), Tp2d (tp_x x tp_y) and RingTp2d (both) from their dry runs: the symbolic
// communicator splits their sub-groups (comm/symbolic.hpp's split_by), their transfers are traced with the
// sub-group's size and span and priced at them, so a priced sublayer is the sum of its trace's pieces (kernels at the
// profile's rates, each transfer at its own sub-group's size, on the level its span reaches: a strided sub-group
// crosses nodes), with every transfer waited for at once (as posted, overlap hides some); cost::mesh_catalog() holds
// all eight strategies and
// a cost table prices the two where the shape carries their factorisation (forbidden, saying why, elsewhere); the
// exact planner chooses per sublayer among all eight. The MoE planner (plan/moe_plan.hpp) prices them as the dense
// one: its attention and dense MLP rows on the mesh catalog are the dense GPT's, and it picks them where cheapest.
#include "paradyse/comm/grid_groups.hpp"
#include "paradyse/comm/symbolic.hpp"
#include "paradyse/cost/builtin_profiles.hpp"
#include "paradyse/cost/dry_run.hpp"
#include "paradyse/cost/from_config.hpp"
#include "paradyse/cost/trace_cost.hpp"
#include "paradyse/model/gpt.hpp"
#include "paradyse/plan/gpt_costs.hpp"
#include "paradyse/plan/moe_plan.hpp"
#include "paradyse/plan/planner.hpp"
#include "paradyse/plan/stack_plan.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <set>
#include <string>
#include <vector>

using namespace paradyse;

namespace {

// One layer of h = 48 (6 heads of 8, MHA), causal with RoPE, 72 tokens: both strategies run it on 6 ranks.
cost::ModelShape six_rank_shape() {
  cost::ModelShape m = cost::ModelShape::mha(48, 6, 72);
  m.causal = true;
  m.rope = true;
  return m;
}

// A100 figures with no overlap, no measured collective entries (every transfer on its level's link model) and nodes
// of 2 devices, so that a sublayer's time is the plain sum of its pieces and a strided sub-group crosses nodes.
cost::HardwareProfile additive_profile() {
  cost::HardwareProfile hw = cost::a100_sxm4_80gb_x8();
  hw.overlap = 0;
  hw.collectives.clear();
  hw.devices_per_node = 2;
  hw.inter_node.bus_bytes_per_s /= 4;  // the levels apart
  return hw;
}

// The time of every event of a trace walked one by one: the sum of the trace's pieces, written here apart from the
// library's clock. A transfer runs over the sub-group its event names, of the group's p / inner x inner grid: the
// inner one (`inner` consecutive ranks) or the outer one (ranks `inner` apart); it is priced on the link model of
// the level its members' span reaches (nodes of devices_per_node consecutive ranks), and its recorded span is checked.
double sum_of_pieces(const cost::SublayerTrace& trace, const cost::HardwareProfile& hw, int inner) {
  double total = 0;
  for (const auto* phase : {&trace.forward, &trace.backward})
    for (const TraceEvent& e : *phase) {
      switch (e.kind) {
        case TraceKind::gemm: total += e.count * hw.gemm.time(e.m, e.n, e.k, 4); break;
        case TraceKind::attention_forward: total += e.count * hw.attention.forward_time(4 * e.k * e.n * e.m); break;
        case TraceKind::attention_backward: total += e.count * hw.attention.backward_time(4 * e.k * e.n * e.m); break;
        case TraceKind::elementwise: total += e.count * hw.elementwise_time(e.bytes); break;
        case TraceKind::activation: total += e.count * hw.activation_time(e.m, e.bytes); break;
        case TraceKind::transcendental: total += e.count * hw.scalar_math.time(cost::ScalarFunction(int(e.n)), e.m); break;
        case TraceKind::allocate:
          total += hw.fresh_memory.time(double(cost::round_allocation(e.bytes)), !e.unzeroed);
          break;
        case TraceKind::scratch: total += e.count * hw.fresh_memory.time(e.bytes); break;
        case TraceKind::post: {
          if (e.transfer == TransferKind::barrier) break;
          const int g = e.group, span = g == inner ? inner : (g - 1) * inner + 1;
          CHECK(e.span == span);
          const cost::LinkModel& link = span <= hw.devices_per_node ? hw.intra_node : hw.inter_node;
          const cost::Collective op = cost::trace_cost_detail::collective_of(e.transfer);
          const double bandwidth = op == cost::Collective::send_recv ? link.p2p_bytes_per_s : link.bus_bytes_per_s;
          total += link.launch_s + link.step_latency_s * cost::latency_steps(op, g) +
                   cost::bus_factor(op, g) * e.bytes / bandwidth;
          break;
        }
        default: break;
      }
    }
  return total;
}

// The trace with every transfer waited for as soon as it is posted (its later wait then a no-op): no compute overlaps
// a transfer, so its priced time is the plain sum of its pieces.
cost::SublayerTrace blocking(cost::SublayerTrace trace) {
  for (auto* phase : {&trace.forward, &trace.backward}) {
    std::vector<TraceEvent> events;
    for (const TraceEvent& e : *phase) {
      events.push_back(e);
      if (e.kind == TraceKind::post) events.push_back({.kind = TraceKind::wait, .request = e.request});
    }
    *phase = std::move(events);
  }
  return trace;
}

// The group sizes a trace's transfers run over.
std::set<int> transfer_groups(const cost::SublayerTrace& trace) {
  std::set<int> groups;
  for (const auto* phase : {&trace.forward, &trace.backward})
    for (const TraceEvent& e : *phase)
      if (e.kind == TraceKind::post) groups.insert(e.group);
  return groups;
}

// A100 figures with 4-rank collectives far slower than 2-rank ones: only MegatronRing and Tp2d keep every transfer of
// a 4-rank group factorised 2 x 2 in groups of 2.
cost::HardwareProfile slow_four_rank_collectives() {
  cost::HardwareProfile hw = cost::a100_sxm4_80gb_x8();
  hw.collectives.clear();
  for (cost::Collective op : cost::kAllCollectives) {
    hw.collectives.push_back({op, cost::LinkLevel::intra_node, 2, {1e-6, 1e-11}, 0});
    hw.collectives.push_back({op, cost::LinkLevel::intra_node, 4, {1e-3, 1e-6}, 0});
  }
  return hw;
}

}  // namespace

TEST_CASE("symbolic split_by: the sub-group of symbolic ranks, its members and its transfers' group size") {
  Trace trace;
  SymbolicCommunicator world(4, 6, trace);  // rank 4 = (o, i) = (2, 0) of a 3 x 2 grid
  GridGroups<SymbolicCommunicator> grid = split_grid(world, 2);
  CHECK(grid.inner.size() == 2);
  CHECK(grid.inner.rank() == 0);
  CHECK(grid.inner.members() == std::vector<int>{4, 5});
  CHECK(grid.outer.size() == 3);
  CHECK(grid.outer.rank() == 2);
  CHECK(grid.outer.members() == std::vector<int>{0, 2, 4});
  // A sub-group of a sub-group names its ranks in the first group's numbering.
  const SymbolicCommunicator last = split_by(grid.outer, [](int r) { return std::pair{r == 0 ? 0 : 1, r}; });
  CHECK(last.members() == std::vector<int>{2, 4});
  CHECK(trace.size() == 0);  // splitting records nothing
  std::vector<float> in(3), out(9);
  grid.outer.all_gather(std::span<const float>(in), std::span<float>(out));
  REQUIRE(trace.size() == 2);
  CHECK(trace.events()[0].group == 3);
  CHECK(trace.events()[0].span == 5);  // ranks 0, 2, 4
  CHECK_THROWS_WITH_AS(world.split(0, 0), doctest::Contains("split_by"), Error);
}

TEST_CASE("MegatronRing and Tp2d: a priced dry run is the sum of its trace's pieces, each transfer at its sub-group "
          "(waited for at once; overlapped as posted, at most that); the planner's table holds it") {
  const cost::StrategyCatalog& catalog = cost::mesh_catalog();
  const cost::HardwareProfile hw = additive_profile();
  struct Case {
    std::string strategy;
    int tp_inner, tp_x;
    std::set<int> groups;  // the sub-groups' sizes
  };
  // p = 6: MegatronRing over cp x tp = 3 x 2, Tp2d over tp_x x tp_y = 3 x 2; no transfer over all 6.
  for (const Case& c : {Case{"MegatronRing", 2, 1, {2, 3}}, Case{"Tp2d", 0, 3, {3, 2}}}) {
    cost::ModelShape m = six_rank_shape();
    m.tp_inner = c.tp_inner;
    m.tp_x = c.tp_x;
    const int index = catalog.index_of(c.strategy);
    REQUIRE(catalog.supports(index, m, 6).ok());
    for (cost::Sublayer part : cost::kAllSublayers) {
      INFO(c.strategy, " ", cost::name_of(part));
      const cost::SublayerTrace trace = catalog.trace(index, part, m, 6);
      CHECK(transfer_groups(trace) == c.groups);
      const double pieces = sum_of_pieces(trace, hw, c.tp_inner > 0 ? c.tp_inner : c.tp_x);
      CHECK(pieces > 0);
      CHECK(cost::cost_of(blocking(trace), &hw, 4).time_s() == doctest::Approx(pieces).epsilon(1e-9));
      // As the strategy posts them (ring shifts in flight under compute), overlap can only hide transfer time.
      const cost::SublayerCost priced = cost::cost_of(trace, &hw, 4);
      CHECK(priced.time_s() <= pieces * (1 + 1e-12));
      CHECK(priced.time_s() >= priced.compute_s);
      // The planner's table holds that priced dry run (at the shape's 2-byte elements).
      const plan::CostTable table =
          plan::build_cost_table(plan::ModelConfig::uniform(m, 1), hw, 6, plan::Batch::single(m.seq), {}, catalog);
      REQUIRE(table.option(0, part, index) != nullptr);
      CHECK(table.option(0, part, index)->time_s ==
            doctest::Approx(cost::cost_of(trace, &hw, m.dtype_bytes).time_s()).epsilon(1e-12));
    }
  }
}

TEST_CASE("the mesh catalog prices MegatronRing and Tp2d where the factorisation is set; the planner picks among all "
          "eight") {
  const cost::StrategyCatalog& catalog = cost::mesh_catalog();
  REQUIRE(catalog.count() == 8);
  for (int s = 0; s < 5; ++s) CHECK(catalog.name(s) == cost::default_catalog().name(s));
  const int ring = catalog.index_of("MegatronRing"), tp2d = catalog.index_of("Tp2d");
  const int ring_tp2d = catalog.index_of("RingTp2d");
  LayerConfig config = LayerConfig::make(64, 4);
  config.causal = true;
  config.zigzag = true;
  const int p = 4, layers = 3;
  const plan::Batch batch = plan::Batch::single(256);
  plan::ModelConfig model = plan::model_config_of(config, layers);

  SUBCASE("no factorisation: both forbidden, naming it") {
    const plan::CostTable table = plan::build_cost_table(model, cost::a100_sxm4_80gb_x8(), p, batch, {}, catalog);
    for (cost::Sublayer part : cost::kAllSublayers) {
      CHECK(table.option(0, part, ring) == nullptr);
      CHECK(table.entry(0, part, ring).forbidden_reason.find("tp_inner") != std::string::npos);
      CHECK(table.option(0, part, tp2d) == nullptr);
      CHECK(table.entry(0, part, tp2d).forbidden_reason.find("tp_x") != std::string::npos);
      CHECK(table.option(0, part, ring_tp2d) == nullptr);
      CHECK(table.entry(0, part, ring_tp2d).forbidden_reason.find("tp_inner = 0") != std::string::npos);
    }
  }

  for (plan::LayerKind& kind : model.kinds) {
    kind.shape.tp_inner = 2;
    kind.shape.tp_x = 2;
  }
  // Each sublayer's cheapest option, over all eight: the exact planner's choice when memory does not bind.
  const auto check_cheapest = [&](const plan::CostTable& table) {
    const plan::Plan plan = plan::plan_exact(table, std::int64_t(1) << 40);
    for (const plan::LayerPlan& layer : plan.layers)
      for (cost::Sublayer part : cost::kAllSublayers) {
        double best = 1e300;
        for (int s = 0; s < 8; ++s)
          if (const plan::Option* o = table.option(0, part, s)) best = std::min(best, o->time_s);
        const int chosen = part == cost::Sublayer::attention ? layer.strategies.attention : layer.strategies.mlp;
        CHECK(table.option(0, part, chosen)->time_s == doctest::Approx(best).scale(0));
      }
    return plan;
  };

  SUBCASE("factorised: both priced, and chosen where cheapest") {
    const plan::CostTable table = plan::build_cost_table(model, cost::a100_sxm4_80gb_x8(), p, batch, {}, catalog);
    for (cost::Sublayer part : cost::kAllSublayers)
      for (int s = 0; s < 8; ++s) {
        INFO(catalog.name(s), " ", cost::name_of(part), ": ", table.entry(0, part, s).forbidden_reason);
        REQUIRE(table.option(0, part, s) != nullptr);
        CHECK(table.option(0, part, s)->time_s > 0);
      }
    check_cheapest(table);
  }

  SUBCASE("collectives over 4 ranks far slower than over 2: only the three keep every transfer in groups of 2") {
    const plan::CostTable table = plan::build_cost_table(model, slow_four_rank_collectives(), p, batch, {}, catalog);
    const plan::Plan plan = check_cheapest(table);
    const auto factorised = [&](int s) { return s == ring || s == tp2d || s == ring_tp2d; };
    for (const plan::LayerPlan& layer : plan.layers) {
      CHECK(factorised(layer.strategies.attention));
      CHECK(factorised(layer.strategies.mlp));
    }
    // The stack runs the plan by name: MeshStrategies holds the three.
    const StackPlan stack = plan::stack_plan<MeshStrategies<>>(plan);
    CHECK(stack.size() == std::size_t(layers));
  }
}

TEST_CASE("the MoE planner prices MegatronRing and Tp2d as the dense planner does: on the mesh catalog with the "
          "group's factorisation its attention and dense MLP rows are the dense GPT's, all eight priced, and it picks "
          "the two where they are cheapest") {
  GptConfig config;
  config.layer = LayerConfig::make(64, 4);
  config.layer.causal = config.layer.zigzag = config.layer.rope = true;
  config.layer.activation = Activation::swiglu;
  config.layers = 3;
  config.vocab = 64;
  MoeConfig moe;
  moe.hidden = 64;
  moe.experts = 5;
  moe.top_k = 2;
  moe.expert_ffn = 48;
  config.moe = MoeLayers{moe, 1};  // a dense first layer, two MoE layers
  const int p = 4, inner = 2;
  const std::int64_t s = 256;
  const cost::StrategyCatalog& catalog = cost::mesh_catalog();
  const int ring = catalog.index_of("MegatronRing"), tp2d = catalog.index_of("Tp2d");
  const int ring_tp2d = catalog.index_of("RingTp2d");
  for (const bool slow_four : {false, true}) {
    CAPTURE(slow_four);
    const cost::HardwareProfile hw = slow_four ? slow_four_rank_collectives() : cost::a100_sxm4_80gb_x8();
    const plan::MoeGptCosts<Gpt<>> moe_costs{config, p, &hw, &catalog, inner, inner};
    const plan::GptCosts<Gpt<>> dense_costs{config, p, &hw, &catalog, inner, inner};
    const plan::MoeCostTable table = moe_costs.table(s);
    const plan::CostTable dense = dense_costs.table(s);
    REQUIRE(table.dense.strategy_count() == 8);
    for (int kind : {plan::MoeCostTable::kDenseKind, plan::MoeCostTable::kMoeKind})
      for (cost::Sublayer part : cost::kAllSublayers) {
        if (kind == plan::MoeCostTable::kMoeKind && part == cost::Sublayer::mlp) continue;  // the MoE FFN's instead
        for (int strategy = 0; strategy < 8; ++strategy) {
          INFO(catalog.name(strategy), " ", cost::name_of(part), " kind ", kind, ": ",
               table.dense.entry(kind, part, strategy).forbidden_reason);
          const plan::Option* got = table.dense.option(kind, part, strategy);
          const plan::Option* want = dense.option(0, part, strategy);
          REQUIRE(got != nullptr);
          REQUIRE(want != nullptr);
          CHECK(got->time_s == want->time_s);
          CHECK(got->saved_bytes == want->saved_bytes);
          CHECK(got->transient_bytes == want->transient_bytes);
        }
      }
    // The exact plan takes each attention's and dense MLP's cheapest of the eight.
    const plan::MoePlan plan = plan::plan_moe_exact(table, std::int64_t(1) << 40);
    for (const plan::MoeLayerPlan& layer : plan.layers) {
      const int kind = layer.moe ? plan::MoeCostTable::kMoeKind : plan::MoeCostTable::kDenseKind;
      for (cost::Sublayer part : cost::kAllSublayers) {
        if (layer.moe && part == cost::Sublayer::mlp) continue;
        double best = 1e300;
        for (int strategy = 0; strategy < 8; ++strategy)
          best = std::min(best, table.dense.option(kind, part, strategy)->time_s);
        const int chosen = part == cost::Sublayer::attention ? layer.attention : layer.ffn;
        CHECK(table.dense.option(kind, part, chosen)->time_s == doctest::Approx(best).scale(0));
      }
    }
    // With 4-rank collectives far slower, every attention and dense MLP runs MegatronRing, Tp2d or RingTp2d.
    const auto factorised = [&](int s) { return s == ring || s == tp2d || s == ring_tp2d; };
    if (slow_four)
      for (const plan::MoeLayerPlan& layer : plan.layers) {
        CHECK(factorised(layer.attention));
        if (!layer.moe) CHECK(factorised(layer.ffn));
      }
    const StackPlan stack = plan.stack_plan<MeshStrategies<>>();  // the stack runs it by name
    CHECK(stack.size() == std::size_t(config.layers));
  }
}
