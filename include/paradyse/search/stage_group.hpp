// paradyse/search/stage_group.hpp: a dense layer's stage group (cp x tp ranks) priced as train_gpt's planner prices
// it, for the search under --trainer train_gpt.
//
// train_gpt --mesh (examples/train_gpt/train_mesh.hpp) runs each pipeline stage's cp x tp ranks (tp_x x tp_y where
// given; consecutive ranks) as one group in which, per layer and sublayer, its planner picks a strategy of the mesh
// catalog (cost::mesh_catalog(): the five, MegatronRing and Tp2d where the group is factorised, and whatever is
// added to it) by the strategy's own dry run priced on the profile: plan::plan_exact over plan::build_cost_table.
// The search prices that group the same way (perf_model.hpp, dense layers of a non-MLA model):
// - the table: one layer of the model's shape (dtype = activation bytes; causal; zigzag and RoPE, as train_gpt's
//   byte GPT) for one micro-batch (mb sequences of s tokens) over the group, factorised as train_mesh.hpp factorises
//   it (stage_factorisation); the pick per sublayer is plan_exact's (no memory cap: the layers of one kind all take
//   the cheapest), or MegatronTS in every sublayer on a tp group alone, as train_gpt runs it;
// - the links: each transfer on the level its own sub-group spans (stage_hardware: a group inside a node on its link;
//   one across nodes with its tp sub-groups inside a node on the node's link and the cp ring, or the whole group, on
//   the network's); with paced links (emulation) every collective from that link model and overlap 1, as
//   cost::emulate gives train_gpt --emulate's planner;
// - each pick's forward and backward split into compute and exposed communication (cost::SublayerCost), so that
//   shared cores stretch the compute alone (perf_model.hpp);
// - with tp, the vocabulary sharded over it (train_gpt's default): the collectives of the embedding and of the head
//   and loss per micro-batch, as plan::outside_stack_time prices them for train_gpt's planner.
// StageGroupPrices memoises the price by (cp, tp_x, tp_y, micro-batch, recomputation): a search visits
// each at most once per model.
#pragma once

#include "paradyse/cost/dry_run.hpp"
#include "paradyse/cost/trace_cost.hpp"
#include "paradyse/plan/activation_stash.hpp"
#include "paradyse/plan/cost_table.hpp"
#include "paradyse/plan/outside_stack.hpp"
#include "paradyse/plan/planner.hpp"
#include "paradyse/search/cluster.hpp"
#include "paradyse/search/parallel_config.hpp"
#include "paradyse/search/training_model.hpp"
#include "paradyse/search/training_setup.hpp"

#include <array>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

namespace paradyse::search {

// How train_gpt factorises a stage group of cp x tp ranks (train_mesh.hpp's grid_inner and grid_x): cp and tp both,
// an outer x inner grid with inner = tp (MegatronRing's tp inside cp, Tp2d's inner side) and, where tp is a tp_x x
// tp_y grid, tp_x = tp_x (RingTp2d's grid); a tp_x x tp_y grid alone, inner = tp_x; otherwise none. A tp group alone
// runs MegatronTS in every sublayer.
struct StageFactorisation {
  int ranks = 1;          // cp x tp
  int tp_inner = 0;       // cost::ModelShape::tp_inner (0: none)
  int tp_x = 1;           // cost::ModelShape::tp_x (1: none)
  bool megatron_ts = false;
};
inline StageFactorisation stage_factorisation(const ParallelConfig& c) {
  const int tp = c.tp();
  const bool cp_by_tp = c.cp > 1 && tp > 1;
  const int inner = cp_by_tp ? tp : c.tp_x > 1 ? c.tp_x : 0;
  const int x = cp_by_tp && c.tp_x > 1 ? c.tp_x : std::max(inner, 1);
  return {.ranks = c.cp * tp, .tp_inner = inner, .tp_x = x, .megatron_ts = tp > 1 && inner == 0};
}

// Whether the stage group of a dense layer is priced here: train_gpt's step, a group of more than one rank, a model
// with dense layers that the planner's layer describes (not MLA).
inline bool prices_stage_group(const TrainingModel& m, const TrainingSetup& s, const ParallelConfig& c) {
  return s.trainer == Trainer::train_gpt && c.cp * c.tp() > 1 && !m.is_mla() && m.dense_mlp_layers() > 0;
}

// One dense layer on the group for one micro-batch, as the planner's cost table describes it.
inline cost::ModelShape stage_layer_shape(const TrainingModel& m, const TrainingSetup& s, const ParallelConfig& c) {
  const StageFactorisation f = stage_factorisation(c);
  return {.hidden = m.hidden, .heads = m.heads, .kv_heads = m.kv_heads, .head_dim = m.head_dim, .ffn = m.ffn,
          .dtype_bytes = s.activation_bytes, .swiglu = m.swiglu, .causal = s.causal, .zigzag = true, .rope = true,
          .packed_lengths = {}, .tp_inner = f.tp_inner, .tp_x = f.tp_x,
          .selective = c.recompute == Recompute::selective};
}

// The device with the cluster's links as the stage group's transfers run on them (see the header): each transfer on
// the level its own sub-group spans (cost::HardwareProfile::collective_time by span). A group inside one domain of
// the cluster's first level runs on that level; one that straddles domains (a cp ring across nodes) runs its
// transfers over the whole group or across domains on the group's level (the group's ring bandwidth, a send at the
// level's point-to-point bandwidth), and those of sub-groups inside one domain of the level below (tp inside a node)
// on that level's link.
inline cost::HardwareProfile stage_hardware(const ClusterProfile& cluster, const ParallelConfig& c) {
  const GroupSpan group{c.cp * c.tp(), std::int64_t(c.cp) * c.tp()};
  const auto link = [&](int l, const GroupSpan& g) {
    const LinkLevel& level = cluster.levels[std::size_t(l)];
    return cost::LinkModel{level.launch_s, level.alpha_s, cluster.ring_bandwidth(g), level.send_bytes_per_s()};
  };
  const int top = cluster.level_of(group);
  cost::HardwareProfile hardware = cluster.device;
  hardware.inter_node = link(top, group);
  hardware.intra_node = hardware.inter_node;
  hardware.devices_per_node = int(group.span);
  if (top > 0) {  // sub-groups inside one domain of the level below: that level, a group filling the domain's ring
    const std::int64_t domain = cluster.levels[std::size_t(top - 1)].domain_devices;
    hardware.devices_per_node = int(domain);
    hardware.intra_node = link(top - 1, GroupSpan{int(domain), domain});
  }
  if (cluster.paced_links) {
    hardware.collectives.clear();
    hardware.overlap = 1;
  }
  return hardware;
}

// The planner's cost table of one dense layer on the stage group for one micro-batch, each option's time as train_gpt's
// planner weighs it (plan/activation_stash.hpp: under full recomputation the forward twice). Memory is not capped
// here, so the stashes' count does not matter to the pick.
inline plan::CostTable stage_cost_table(const TrainingModel& m, const TrainingSetup& s, const ClusterProfile& cluster,
                                        const ParallelConfig& c) {
  const plan::ModelConfig layer = plan::ModelConfig::uniform(stage_layer_shape(m, s, c), 1, "dense");
  constexpr PipelineRecompute kRecompute[] = {PipelineRecompute::none, PipelineRecompute::selective,
                                              PipelineRecompute::full};
  const plan::ActivationStash stash{kRecompute[std::size_t(c.recompute)], 1.0};
  return stash.apply(plan::build_cost_table(layer, stage_hardware(cluster, c), stage_factorisation(c).ranks,
                                            plan::Batch::single(s.seq, c.micro_batch), {}, cost::mesh_catalog()));
}

// One sublayer's pick and its time on one rank, forward and backward, compute and exposed communication apart.
struct SublayerPrice {
  std::string strategy;
  double forward_compute_s = 0, forward_comm_s = 0, backward_compute_s = 0, backward_comm_s = 0;
  double time_s() const { return forward_compute_s + forward_comm_s + backward_compute_s + backward_comm_s; }
};
struct StageGroupPrice {
  std::array<SublayerPrice, 2> sublayers;  // by cost::Sublayer
  // Per micro-batch, the collectives of the vocabulary sharded over tp (train_gpt's --vocab-parallel, with tp): the
  // first stage's embedding and the last stage's head and loss (plan::outside_stack_time, as train_gpt's planner).
  double embedding_comm_s = 0, head_comm_s = 0;
  double time_s() const { return sublayers[0].time_s() + sublayers[1].time_s(); }
};

inline StageGroupPrice price_stage_group(const TrainingModel& m, const TrainingSetup& s, const ClusterProfile& cluster,
                                         const ParallelConfig& c) {
  const plan::CostTable table = stage_cost_table(m, s, cluster, c);
  const cost::StrategyCatalog& catalog = cost::mesh_catalog();
  const plan::Plan plan = stage_factorisation(c).megatron_ts
      ? plan::plan_of(table, plan::uniform_layers(table, catalog.index_of("MegatronTS")), plan::kMaxPlanBytes)
      : plan::plan_exact(table, plan::kMaxPlanBytes);
  const cost::ModelShape shape = plan::shape_for_batch(stage_layer_shape(m, s, c), table.batch);
  const cost::HardwareProfile hardware = stage_hardware(cluster, c);
  StageGroupPrice price;
  for (cost::Sublayer part : cost::kAllSublayers) {
    const cost::LayerStrategies& picked = plan.layers.front().strategies;
    const int strategy = part == cost::Sublayer::attention ? picked.attention : picked.mlp;
    // The table's cost of the pick (cost::evaluate_sublayer on rank 0: one sequence per sample), and of its forward
    // alone for the split.
    cost::SublayerCost whole, forward;
    catalog.visit_trace(strategy, part, shape, table.group_size, 0, [&](const cost::SublayerTraceView& trace) {
      whole = cost::cost_of(trace, &hardware, shape.dtype_bytes, /*keep_events=*/false);
      forward = cost::cost_of(cost::SublayerTraceView{trace.forward, {}, {}, trace.group_size}, &hardware,
                              shape.dtype_bytes, /*keep_events=*/false);
    });
    const double backward_compute = whole.compute_s - forward.compute_s;
    price.sublayers[std::size_t(part)] = {std::string(catalog.name(strategy)), forward.compute_s,
                                          whole.forward_s - forward.compute_s, backward_compute,
                                          whole.backward_s - backward_compute};
  }
  if (c.tp() > 1) {
    const plan::OutsideStack outside{.vocab = m.vocab, .tied_head = m.tied_embeddings, .vocab_shards = c.tp()};
    const plan::OutsideStackTime ends =
        plan::outside_stack_time(outside, cost::layer_config_of(shape), plan::outside_rows(c.micro_batch, s.seq,
                                 table.group_size), 0, table.group_size, hardware);
    price.embedding_comm_s = ends.embedding_comm_s;
    price.head_comm_s = ends.head_loss_comm_s;
  }
  return price;
}

// price_stage_group, memoised for one model, setup and cluster (a PerformanceModel's).
class StageGroupPrices {
public:
  const StageGroupPrice& operator()(const TrainingModel& m, const TrainingSetup& s, const ClusterProfile& cluster,
                                    const ParallelConfig& c) {
    const auto key = std::make_tuple(c.cp, c.tp_x, c.tp_y, c.micro_batch, c.recompute);
    const std::lock_guard lock(mutex_);
    auto at = prices_.find(key);
    if (at == prices_.end()) at = prices_.emplace(key, price_stage_group(m, s, cluster, c)).first;
    return at->second;
  }

private:
  std::mutex mutex_;
  std::map<std::tuple<int, int, int, int, Recompute>, StageGroupPrice> prices_;
};

}  // namespace paradyse::search
