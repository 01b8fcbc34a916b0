// Tests of search/stage_group.hpp: under --trainer train_gpt a dense layer's stage group (cp x tp) is priced as
// train_gpt's planner prices it. Reference: train_gpt's own path (examples/train_gpt/train_mesh.hpp): plan::GptCosts
// of the byte GPT on the group, factorised as train_mesh factorises it, on the profile train_gpt plans with (the
// calibrated one, or cost::emulate's under --emulate), plan_exact under a cap, the plan's per-layer cost and picks.
// Links, the micro-batch and the recomputation are drawn at random (the seed in the test's INFO).
#include "paradyse/cost/builtin_profiles.hpp"
#include "paradyse/cost/emulation.hpp"
#include "paradyse/model/byte_gpt.hpp"
#include "paradyse/model/gpt.hpp"
#include "paradyse/plan/gpt_costs.hpp"
#include "paradyse/search/search.hpp"
#include "paradyse/search/stage_group.hpp"

#include "support/fresh_seed.hpp"

#include <doctest/doctest.h>

#include <random>
#include <vector>

using namespace paradyse;
using namespace paradyse::search;

namespace {

constexpr std::int64_t kSeq = 384;  // divisible by 2 cp tp for every group below (zigzag chunks)

// train_gpt's byte GPT (--layers 4 --hidden 192 --heads 12: groups of 2, 3, 4, 6 ranks hold whole heads) as the
// search's model.
TrainingModel byte_model() {
  return {.name = "train_gpt", .layers = 4, .hidden = 192, .heads = 12, .kv_heads = 12, .head_dim = 16, .ffn = 768,
          .vocab = 256};
}
TrainingSetup train_gpt_setup() {
  TrainingSetup s{.seq = kSeq, .global_batch = 16};
  s.activation_bytes = 4;
  s.precision = {.parameter_bytes = 4, .gradient_bytes = 4, .optimizer_bytes = 8};
  s.trainer = Trainer::train_gpt;
  return s;
}

// A profile with randomly drawn links (launch, step latency, bus and point-to-point bandwidth).
cost::HardwareProfile drawn_profile(std::mt19937_64& rng) {
  cost::HardwareProfile hw = cost::a100_sxm4_80gb_x8();
  std::uniform_real_distribution<double> log10(0, 1);
  auto draw = [&](double low, double decades) { return low * std::pow(10.0, decades * log10(rng)); };
  hw.intra_node = {draw(1e-6, 2), draw(1e-6, 2), draw(1e9, 2), draw(1e9, 2)};
  hw.inter_node = hw.intra_node;
  return hw;
}
// The cluster search_then_run.sh makes of a profile: one level, the profile's link.
ClusterProfile one_node(const cost::HardwareProfile& hw, bool paced) {
  ClusterProfile c;
  c.name = "node";
  c.device = hw;
  c.peak_flops_per_s = hw.gemm.flops_per_s;
  c.levels = {{"threads", 0, hw.intra_node.step_latency_s, hw.intra_node.bus_bytes_per_s, hw.intra_node.launch_s,
               hw.intra_node.p2p_bytes_per_s}};
  c.paced_links = paced;
  return c;
}

// train_gpt's plan for one micro-batch on the stage group of `c` (train_mesh.hpp's GptCosts and plan_exact).
plan::Plan train_gpt_plan(const ParallelConfig& c, const cost::HardwareProfile& hw) {
  GptConfig config = byte_gpt_config({.layers = 4, .hidden = 192, .heads = 12});
  const int tp = c.tp(), group = c.cp * tp;
  const bool cp_by_tp = c.cp > 1 && tp > 1;
  const int grid_inner = cp_by_tp ? tp : c.tp_x > 1 ? c.tp_x : 0;
  const int grid_x = cp_by_tp && c.tp_x > 1 ? c.tp_x : grid_inner;
  plan::GptCosts<Gpt<MeshStrategies<>>> costs{config, group, &hw, &cost::mesh_catalog(), grid_inner,
                                              std::max(grid_x, 1)};
  costs.stash.recompute = c.recompute == Recompute::selective ? PipelineRecompute::selective
                          : c.recompute == Recompute::full    ? PipelineRecompute::full
                                                              : PipelineRecompute::none;
  const plan::CostTable table = costs.table(kSeq, c.micro_batch);
  if (tp > 1 && grid_inner == 0)  // a tp group alone: MegatronTS everywhere
    return plan::plan_of(table, plan::uniform_layers(table, cost::mesh_catalog().index_of("MegatronTS")), 1ll << 50);
  return plan::plan_exact(table, 1ll << 50);
}

std::vector<ParallelConfig> stage_meshes() {
  return {{.dp = 4, .cp = 2},           {.dp = 2, .cp = 4},         {.dp = 2, .cp = 2, .tp_y = 2},
          {.dp = 1, .cp = 3},           {.dp = 1, .cp = 3, .tp_y = 2}, {.dp = 4, .tp_y = 2},
          {.dp = 2, .tp_x = 2, .tp_y = 2}, {.dp = 1, .cp = 6},       {.dp = 1, .cp = 3, .tp_x = 2, .tp_y = 2}};
}

}  // namespace

TEST_CASE("stage group: the price of each dense layer is train_gpt's plan_exact per-layer cost, picks included") {
  PARADYSE_FRESH_RNG(rng);
  for (bool paced : {false, true})
    for (ParallelConfig c : stage_meshes()) {
      const cost::HardwareProfile drawn = drawn_profile(rng);
      // Emulated: train_gpt plans with cost::emulate's profile, the search prices the paced links of that link.
      const cost::HardwareProfile hw = paced ? cost::emulate(cost::h100_sxm_80gb_x8(), drawn).profile : drawn;
      c.micro_batch = std::uniform_int_distribution<int>(1, 3)(rng);
      c.recompute = Recompute(std::uniform_int_distribution<int>(0, 2)(rng));
      CAPTURE(to_string(c));
      CAPTURE(paced);
      const plan::Plan reference = train_gpt_plan(c, hw);
      const StageGroupPrice price = price_stage_group(byte_model(), train_gpt_setup(), one_node(hw, paced), c);
      // The planner weighs full recomputation's option as its forward twice; the price is one pass (the search adds
      // the recomputation itself).
      const auto weighed = [&](const SublayerPrice& s) {
        return s.time_s() + (c.recompute == Recompute::full ? s.forward_compute_s + s.forward_comm_s : 0.0);
      };
      for (const plan::LayerPlan& layer : reference.layers) {
        CHECK(weighed(price.sublayers[0]) + weighed(price.sublayers[1]) ==
              doctest::Approx(layer.time_s()).epsilon(1e-9));
        CHECK(weighed(price.sublayers[0]) == doctest::Approx(layer.attention_s).epsilon(1e-9));
        CHECK(weighed(price.sublayers[1]) == doctest::Approx(layer.mlp_s).epsilon(1e-9));
        CHECK(price.sublayers[0].strategy == reference.strategy_name(layer.strategies.attention));
        CHECK(price.sublayers[1].strategy == reference.strategy_name(layer.strategies.mlp));
      }
    }
}

TEST_CASE("stage group: the performance model prices train_gpt's dense layers by it, memoised; megatron unchanged") {
  const cost::HardwareProfile hw = cost::a100_sxm4_80gb_x8();
  const ParallelConfig c{.dp = 2, .cp = 2, .tp_y = 2, .micro_batch = 2};
  const PerformanceModel gpt(byte_model(), one_node(hw, false), train_gpt_setup(), 8);
  TrainingSetup megatron_setup = train_gpt_setup();
  megatron_setup.trainer = Trainer::megatron;
  const PerformanceModel megatron(byte_model(), one_node(hw, false), megatron_setup, 8);
  const Estimate a = gpt.evaluate(c), b = gpt.evaluate(c);
  REQUIRE(a.valid);
  CHECK(a.step_s == b.step_s);
  // One micro-batch's layers on the stage group: 4 layers of the price, its communication on cp.
  const StageGroupPrice price = price_stage_group(byte_model(), train_gpt_setup(), one_node(hw, false), c);
  double comm = 0;
  for (const SublayerPrice& s : price.sublayers) comm += s.forward_comm_s + s.backward_comm_s;
  const double m = double(search::micro_batches(train_gpt_setup(), c));
  CHECK(a.exposed(CommDim::tp) == 0);
  CHECK(a.exposed(CommDim::cp) >= doctest::Approx(m * 4 * comm).epsilon(1e-9));
  CHECK(megatron.evaluate(c).exposed(CommDim::tp) > 0);  // Megatron's closed form
}

TEST_CASE("stage group: across nodes each transfer is priced on the level its own sub-group spans") {
  // dgx-h100: nodes of 8 devices on NVLink, InfiniBand across. cp 2 x tp 8, tp innermost (ranks 8 j .. 8 j + 7 the
  // tp sub-group j): the tp sub-groups inside a node, the cp ring (ranks 8 apart) and the whole group across two.
  const ClusterProfile cluster = cluster_preset("dgx-h100");
  const LinkLevel &nvlink = cluster.levels[0], &infiniband = cluster.levels[1];
  const ParallelConfig c{.dp = 1, .cp = 2, .tp_y = 8};
  const cost::HardwareProfile hw = stage_hardware(cluster, c);
  const double bytes = 3 << 20;
  CHECK(hw.collective_time(Collective::all_gather, 8, bytes, 8) ==
        doctest::Approx(nvlink.launch_s + 7 * nvlink.alpha_s + 7.0 / 8 * bytes / nvlink.bytes_per_s).epsilon(1e-12));
  CHECK(hw.collective_time(Collective::send_recv, 2, bytes, 9) ==
        doctest::Approx(infiniband.launch_s + infiniband.alpha_s + bytes / infiniband.send_bytes_per_s())
            .epsilon(1e-12));
  // Every transfer of every strategy of the mesh catalog on the group (16 heads: 2 per tp rank), as the cluster
  // prices its sub-group: inside a node, a send across, or a ring collective over the whole group. (Across nodes a
  // collective of a strided sub-group takes the whole group's ring bandwidth, and an all-to-all too, where the
  // cluster prices each part on the level it crosses: stage_hardware's two links.)
  const TrainingModel m{.name = "wide", .layers = 4, .hidden = 256, .heads = 16, .kv_heads = 16, .head_dim = 16,
                        .ffn = 1024, .vocab = 256};
  TrainingSetup s = train_gpt_setup();
  s.seq = 512;
  const cost::ModelShape shape = plan::shape_for_batch(stage_layer_shape(m, s, c), plan::Batch::single(s.seq, 1));
  const cost::StrategyCatalog& catalog = cost::mesh_catalog();
  int inside = 0, across = 0, strategies = 0;
  for (int i = 0; i < catalog.count(); ++i) {
    if (!catalog.supports(i, shape, 16)) continue;
    ++strategies;
    for (cost::Sublayer part : cost::kAllSublayers)
      catalog.visit_trace(i, part, shape, 16, 0, [&](const cost::SublayerTraceView& trace) {
        for (std::span<const TraceEvent> events : {trace.forward, trace.backward})
          for (const TraceEvent& e : events) {
            if (e.kind != TraceKind::post || e.transfer == TransferKind::barrier) continue;
            const int size = e.group > 0 ? e.group : 16, span = e.span > 0 ? e.span : size;
            const std::int64_t stride = size > 1 ? (span - 1) / (size - 1) : 1;  // the trace's span: first to last
            const bool in_node = span <= 8, send = e.transfer == TransferKind::send_recv;
            const Collective op = cost::trace_cost_detail::collective_of(e.transfer);
            if (!in_node && !send && (size < 16 || op == Collective::all_to_all)) continue;
            CAPTURE(catalog.name(i));
            CAPTURE(size);
            CAPTURE(span);
            CHECK(hw.collective_time(op, size, e.bytes, span) ==
                  doctest::Approx(cluster.collective_time(op, GroupSpan{size, size * stride}, e.bytes))
                      .epsilon(1e-12));
            ++(in_node ? inside : across);
          }
      });
  }
  MESSAGE(strategies << " strategies, " << inside << " transfers inside a node, " << across << " across");
  CHECK(strategies >= 3);
  CHECK(inside > 0);
  CHECK(across > 0);
}
