// paradyse/serve/step_dry_run.hpp: one engine step's dry run, and its time on a cluster (what the simulated clock,
// serve/clock.hpp, advances by).
//
// The step's trace (serve/step_trace.hpp: its chunks' new tokens and cached positions, each MoE layer's layout and
// expert loads) is run through the real decoder_step (serve/decoder_step.hpp) on each of the p modelled ranks, on
// shapes alone: the rank's shard of the model as meta tensors (core/memory.hpp: a Mixtral-8x7B needs no memory),
// ops::Counting and the symbolic communicator (comm/symbolic.hpp), a cache that knows only each request's cached
// length (DryKvCache), and the routing source's expert loads in place of the router's choices. Each rank's Trace
// holds every kernel with its shape and every collective, in program order.
//
// Time (dry_run_step_cost): each rank's trace is cut after every collective and at every layer's end; a piece costs
// cost/trace_cost.hpp's time on the cluster's profile (kernels at the profile's rates, a collective at its link's
// alpha-beta time), and the step takes, piece by piece, the slowest rank's (the all-reduces synchronise the ranks),
// plus the wait for the ranks' spread about their price (HardwareProfile::straggle_s, 0 on built-in profiles).
// The layout change (a TP<->EP switch, an EPLB placement) is priced as serve/step_cost.hpp prices it
// (switch_exposed_s: layer l's pieces leave after layer l; unpipelined, a stall before the step, which then
// computes in the new layout).
//
// Ranks whose shards have the same shapes record the same events (rank_trace_key), so a step dry-runs one rank of each
// key (in TP with even splits one of p). DryRunPricer (the engine's dry-run forecast, ForecastModel::dry_run) keeps its
// last steps' timelines by what determines them, so the forecast's switch term reuses the current layout's run.
//
// A routing budget given to the runner is routed as the real step routes it: an Alloc-L budget's K_l, Alloc-T's pools
// (moe/router.hpp: the scoring pass recorded, each chunk's K_l T activations from the expert loads). DeepSeek's
// multi-head latent attention is dry-run as the others (serve/mla_attention.hpp on the counting backend).
#pragma once

#include "paradyse/comm/symbolic.hpp"
#include "paradyse/core/memory.hpp"
#include "paradyse/core/trace.hpp"
#include "paradyse/cost/gemm_reuse.hpp"
#include "paradyse/cost/trace_cost.hpp"
#include "paradyse/ops/counting.hpp"
#include "paradyse/serve/decoder_step.hpp"
#include "paradyse/serve/routing_budget.hpp"
#include "paradyse/serve/step_cost.hpp"
#include "paradyse/serve/step_trace.hpp"

#include <algorithm>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

namespace paradyse::serve {

// What decoder_step reads of the cache in a dry run: each request's cached length (requests are the chunk indices).
class DryKvCache {
public:
  explicit DryKvCache(std::vector<std::int64_t> lengths) : lengths_(std::move(lengths)) {}
  std::int64_t length(std::int64_t request) const { return lengths_.at(std::size_t(request)); }

private:
  std::vector<std::int64_t> lengths_;
};

// The layout each MoE layer computes in: the trace's, or the one it installs when the change stalls the step.
inline std::vector<ExpertLayout> computed_layouts(const StepTrace& t) {
  std::vector<ExpertLayout> layouts = t.layout;
  if (!t.pipelined_switch)
    for (std::size_t l = 0; l < layouts.size(); ++l)
      if (t.next[l]) layouts[l] = *t.next[l];
  return layouts;
}

// The replicated weights of `c` (embedding, final norm, lm_head), as tensors of the current tracker's space.
inline DecoderWeights shape_whole_weights(const DecoderConfig& c) {
  DecoderWeights w;
  w.embed = Tensor<float>(Shape{c.vocab, c.hidden});
  w.norm = Tensor<float>(Shape{c.hidden});
  w.lm_head = Tensor<float>(Shape{c.vocab, c.hidden});
  return w;
}

// Rank r of p's shard of `c` as make_rank_shard lays it out (serve/rank_shard.hpp), shapes only: tensors of the
// current tracker's space (meta in a dry run), each MoE layer in `layouts[l]`.
inline RankShard shape_rank_shard(const DecoderConfig& c, const DecoderWeights& whole, int p, int r,
                                  const std::vector<ExpertLayout>& layouts) {
  check(p >= 1 && p <= c.heads && r >= 0 && r < p, "shape_rank_shard: rank {} of {} for {} heads", r, p, c.heads);
  check(std::int64_t(layouts.size()) == c.layers, "shape_rank_shard: {} layouts for {} layers", layouts.size(),
        c.layers);
  const auto tensor = [](Shape s) { return Tensor<float>(s); };
  RankShard s;
  s.rank = r;
  s.ranks = p;
  s.whole = &whole;
  s.q_heads = query_heads(c, p, r);
  s.kv_heads = kv_heads_of(c, p, r);
  const std::int64_t d = c.head_dim, h = c.hidden, qn = s.q_heads.length * d, kn = s.kv_heads.length * d;
  const MlaShape& a = c.mla;
  for (std::int64_t l = 0; l < c.layers; ++l) {
    RankLayer L;
    L.attn_norm = tensor(Shape{h});
    L.ffn_norm = tensor(Shape{h});
    L.wo_t = tensor(Shape{s.q_heads.length * c.value_dim(), h});
    if (c.is_mla()) {  // no wk, wv: the latent's projections, replicated, and this rank's heads' rows of W_kvb
      L.wq = tensor(Shape{qn, a.q_lora_rank > 0 ? a.q_lora_rank : h});
      L.wk = tensor(Shape{0});
      L.wv = tensor(Shape{0});
      L.wq_a = a.q_lora_rank > 0 ? tensor(Shape{a.q_lora_rank, h}) : tensor(Shape{0});
      L.q_a_norm = a.q_lora_rank > 0 ? tensor(Shape{a.q_lora_rank}) : tensor(Shape{0});
      L.wkv_a = tensor(Shape{a.kv_lora_rank + a.rope, h});
      L.kv_a_norm = tensor(Shape{a.kv_lora_rank});
      L.wkv_b = tensor(Shape{s.q_heads.length * (a.nope + a.v), a.kv_lora_rank});
    } else {
      L.wq = tensor(Shape{qn, h});
      L.wk = tensor(Shape{kn, h});
      L.wv = tensor(Shape{kn, h});
    }
    L.bq = c.qkv_bias ? tensor(Shape{qn}) : tensor(Shape{0});
    L.bk = c.qkv_bias ? tensor(Shape{kn}) : tensor(Shape{0});
    L.bv = c.qkv_bias ? tensor(Shape{kn}) : tensor(Shape{0});
    L.q_norm = c.head_qk_norm ? tensor(Shape{d}) : c.qk_norm ? tensor(Shape{qn}) : tensor(Shape{0});
    L.k_norm = c.head_qk_norm ? tensor(Shape{d}) : c.qk_norm ? tensor(Shape{kn}) : tensor(Shape{0});
    if (!c.is_moe(l)) {
      const std::int64_t f = chunk_range(c.dense_ffn, p, r).length;
      L.dense_in = tensor(Shape{1, 2 * f, h});
      L.dense_out = tensor(Shape{1, f, h});
    } else {
      const MoeConfig& m = c.moe;
      L.router = tensor(Shape{m.experts, h});
      L.router_bias = m.topk_method == TopkMethod::greedy ? tensor(Shape{0}) : tensor(Shape{m.experts});
      if (m.has_shared()) {
        const std::int64_t fs = chunk_range(m.shared_width(), p, r).length;
        L.shared_in = tensor(Shape{1, 2 * fs, h});
        L.shared_out = tensor(Shape{1, fs, h});
        if (m.shared_gate) L.shared_gate = tensor(Shape{1, h});
      }
      const ExpertLayout& layout = layouts[std::size_t(l)];
      L.mode = layout.mode;
      if (layout.mode == MoeMode::tp) {
        const std::int64_t f = chunk_range(m.expert_ffn, p, r).length;
        L.expert_in = tensor(Shape{m.experts, 2 * f, h});
        L.expert_out = tensor(Shape{m.experts, f, h});
      } else {
        ExpertPlacement{layout.placement}.validate(m.experts, p);
        L.slot_expert = layout.placement[std::size_t(r)];
        L.placement = layout.placement;
        const std::int64_t slots = std::int64_t(L.slot_expert.size());
        L.expert_in = tensor(Shape{slots, 2 * m.expert_ffn, h});
        L.expert_out = tensor(Shape{slots, m.expert_ffn, h});
      }
    }
    s.layers.push_back(std::move(L));
  }
  return s;
}

// What a rank's dry run depends on besides the step: its heads and every weight's shape, and in an EP layer its rank
// (which experts it holds, which part of a replicated expert's rows it takes). Ranks of equal keys record the same
// events for the same step (decoder_step's rank-dependent work is all in these: tests/serve/step_dry_run.cpp), so
// dry_run_timeline runs one of them; in TP with even splits that is one rank of p.
inline std::vector<std::int64_t> rank_trace_key(const RankShard& s) {
  std::vector<std::int64_t> key{s.ranks, s.q_heads.length, s.kv_heads.length};
  const auto add = [&key](const Tensor<float>& w) {
    key.push_back(w.shape().rank());
    for (std::int64_t i = 0; i < w.shape().rank(); ++i) key.push_back(w.shape()[i]);
  };
  for (const RankLayer& L : s.layers) {
    for (const Tensor<float>* w : {&L.wq, &L.wk, &L.wv, &L.wo_t, &L.bq, &L.bk, &L.bv, &L.q_norm, &L.k_norm, &L.wq_a,
                                   &L.q_a_norm, &L.wkv_a, &L.kv_a_norm, &L.wkv_b, &L.dense_in, &L.dense_out, &L.router,
                                   &L.router_bias, &L.shared_in, &L.shared_out, &L.shared_gate, &L.expert_in,
                                   &L.expert_out})
      add(*w);
    key.push_back(std::int64_t(L.mode));
    if (L.mode == MoeMode::ep) key.push_back(s.rank);
  }
  return key;
}

// One rank's dry run of a step: its events, and where each layer ends (the event count after layer l).
struct RankStepTrace {
  std::vector<TraceEvent> events;
  std::vector<std::size_t> layer_end;  // [layers]
};

// Dry runs of the steps of one model: the replicated weights and each rank's shard live as meta tensors of the
// runner's own tracker, made once per set of layouts (a simulation runs many steps in one layout).
class StepDryRunner {
public:
  // `budget`: an Alloc-MoE budget's per-layer K_l, routed as the real step routes them (the loads must sum to
  // tokens x K_l); Alloc-T's pooling too: the router's scoring pass is recorded, and each chunk's K_l T activations
  // (how they fall on its tokens depends on the scores, the shapes do not) are the loads'.
  explicit StepDryRunner(DecoderConfig c, RoutingBudget budget = {}) : c_(std::move(c)), budget_(std::move(budget)) {
    budget_.validate(c_);
  }
  StepDryRunner(const StepDryRunner&) = delete;
  StepDryRunner& operator=(const StepDryRunner&) = delete;

  const DecoderConfig& config() const noexcept { return c_; }

  // Rank `rank` of t.ranks runs decoder_step for the step `t` on shapes alone.
  RankStepTrace run(const StepTrace& t, int rank) {
    check(std::int64_t(t.layout.size()) == c_.layers && std::int64_t(t.routed.size()) == c_.layers &&
              std::int64_t(t.next.size()) == c_.layers,
          "dry_run_step: a trace with {} layouts, {} routings, {} next layouts for {} layers", t.layout.size(),
          t.routed.size(), t.next.size(), c_.layers);
    const ScopedTracker on_meta(meta_);
    const RankShard& shard = shard_of(t, rank);
    Trace trace;
    const ScopedTrace recording(trace);
    SymbolicCommunicator comm(rank, t.ranks, trace);
    BufferPool pool;
    std::vector<SequenceChunk> batch(t.chunks.size());
    std::vector<std::int64_t> cached(t.chunks.size());
    for (std::size_t i = 0; i < t.chunks.size(); ++i) {
      batch[i].request = std::int64_t(i);
      batch[i].tokens.assign(std::size_t(t.chunks[i].tokens), 0);
      cached[i] = t.chunks[i].cached;
    }
    DryKvCache cache(std::move(cached));
    RankStepTrace out;
    decoder_step<ops::Counting>(comm, c_, shard, cache, std::span<const SequenceChunk>(batch), pool, {},
                                [&](std::int64_t) { out.layer_end.push_back(trace.size()); }, budget_,
                                std::span<const std::vector<std::int64_t>>(t.routed));
    out.events = trace.take();
    return out;
  }

  // rank_trace_key of rank `rank`'s shard for the step `t`.
  std::vector<std::int64_t> trace_key(const StepTrace& t, int rank) {
    const ScopedTracker on_meta(meta_);  // the shards are shapes alone
    return rank_trace_key(shard_of(t, rank));
  }

private:
  // The ranks' shards in the layouts the step computes in; the last few layout sets are kept (the dynamic policy's
  // forecast prices each step in TP and in EP besides the step itself).
  const RankShard& shard_of(const StepTrace& t, int rank) {
    std::vector<ExpertLayout> layouts = computed_layouts(t);
    auto hit = std::find_if(kept_.begin(), kept_.end(),
                            [&](const Shards& k) { return k.ranks == t.ranks && k.layouts == layouts; });
    if (hit == kept_.end()) {
      if (!whole_made_) whole_ = shape_whole_weights(c_), whole_made_ = true;
      if (kept_.size() == kKept) kept_.pop_back();
      Shards made{t.ranks, std::move(layouts), {}};
      for (int r = 0; r < t.ranks; ++r) made.shards.push_back(shape_rank_shard(c_, whole_, t.ranks, r, made.layouts));
      kept_.insert(kept_.begin(), std::move(made));
    } else if (hit != kept_.begin()) {
      std::rotate(kept_.begin(), hit, hit + 1);  // most recent first
    }
    check(rank >= 0 && rank < kept_.front().ranks, "dry_run_step: rank {} of {}", rank, kept_.front().ranks);
    return kept_.front().shards[std::size_t(rank)];
  }

  struct Shards {
    int ranks = 0;
    std::vector<ExpertLayout> layouts;
    std::vector<RankShard> shards;
  };
  static constexpr std::size_t kKept = 4;

  DecoderConfig c_;
  RoutingBudget budget_;
  MemoryTracker meta_{MemorySpace::meta};
  DecoderWeights whole_;
  bool whole_made_ = false;
  std::vector<Shards> kept_;  // most recently used first
};

// One rank's dry run of one step (a runner of its own).
inline RankStepTrace dry_run_step(const DecoderConfig& c, const StepTrace& t, int rank) {
  StepDryRunner runner(c);
  return runner.run(t, rank);
}

namespace step_dry_run_detail {

// The pieces of one rank's trace: cut after every collective's wait and at every layer's end.
inline std::vector<std::span<const TraceEvent>> pieces(const RankStepTrace& r) {
  std::vector<std::size_t> cuts;
  for (std::size_t i = 0; i < r.events.size(); ++i)
    if (r.events[i].kind == TraceKind::wait) cuts.push_back(i + 1);
  cuts.insert(cuts.end(), r.layer_end.begin(), r.layer_end.end());
  cuts.push_back(r.events.size());
  std::sort(cuts.begin(), cuts.end());
  std::vector<std::span<const TraceEvent>> out;
  std::size_t from = 0;
  for (const std::size_t to : cuts) {
    out.emplace_back(r.events.data() + from, to - from);
    from = to;
  }
  return out;
}

}  // namespace step_dry_run_detail

// The step's time on the cluster before its layout change: the slowest rank's pieces one after the other.
struct DryRunTimeline {
  double compute_s = 0;              // per piece the slowest rank's kernels, summed
  double communication_s = 0;        // the rest of the pieces' time (with the wait for the slowest rank's spread)
  double end_s = 0;                  // the last piece's end (the pieces summed in order)
  std::vector<double> layer_end_s;   // [layers]: seconds from the step's start to each layer's end
  std::int64_t events = 0;           // trace events the dry run recorded over the ranks it ran (its host work)
};

// Each rank's trace cut into pieces (after every collective and at every layer's end); a piece costs
// cost/trace_cost.hpp's time on the cluster's profile, and the step takes, piece by piece, the slowest rank's (the
// all-reduces synchronise the ranks) plus the profile's straggle on its kernels (HardwareProfile::straggle_s: the
// ranks' spread about their price makes the slowest of p later than any one; linear in the kernels, so where the cuts
// fall does not change it). With `share_ranks` a rank whose rank_trace_key equals an earlier rank's takes that rank's
// trace and piece costs (the same to the bit); without, every rank is dry-run (the reference).
// With `reads` (one cost::WeightReads per rank, kept across the steps of a run: cost/gemm_reuse.hpp), each GEMM is
// priced at its weight's reuse distance on its rank (the profile's GemmModel::reuse tables; none: no change) and the
// step's reads are recorded; a rank that takes an earlier rank's trace records nothing (its own weights' reads show
// when it runs its own).
inline DryRunTimeline dry_run_timeline(StepDryRunner& runner, const StepTrace& t, const SimulatedCluster& cluster,
                                       bool share_ranks = true, std::vector<cost::WeightReads>* reads = nullptr) {
  using namespace step_dry_run_detail;
  DryRunTimeline out;
  if (t.tokens() <= 0) return out;
  if (reads && std::ssize(*reads) < t.ranks) reads->resize(std::size_t(t.ranks));
  std::vector<RankStepTrace> runs;                  // the distinct ranks' traces
  std::vector<int> run_rank;                        // the rank each ran for
  std::vector<std::vector<std::int64_t>> keys;      // their keys
  for (int r = 0; r < t.ranks; ++r) {
    if (share_ranks) {
      std::vector<std::int64_t> key = runner.trace_key(t, r);
      if (std::find(keys.begin(), keys.end(), key) != keys.end()) continue;
      keys.push_back(std::move(key));
    }
    runs.push_back(runner.run(t, r));
    run_rank.push_back(r);
    out.events += std::int64_t(runs.back().events.size());
  }
  std::vector<std::vector<std::span<const TraceEvent>>> cut;
  for (const RankStepTrace& r : runs) {
    cut.push_back(pieces(r));
    check(cut.back().size() == cut.front().size(), "dry_run_step_cost: a rank ran {} pieces, rank 0 {} (the ranks' "
          "collectives differ)", cut.back().size(), cut.front().size());
  }
  // The cut before piece i + 1 is a layer's end when the layer_end list says so: time at each layer's end.
  std::size_t next_layer = 0, at = 0;
  const std::vector<std::size_t>& layer_end = runs.front().layer_end;
  for (std::size_t i = 0; i < cut.front().size(); ++i) {
    double piece = 0, compute = 0;
    for (std::size_t j = 0; j < cut.size(); ++j) {
      const cost::SublayerCost k =
          cost::cost_of(cost::SublayerTraceView{cut[j][i], {}, {}, t.ranks}, &cluster.profile, cluster.dtype_bytes,
                        /*keep_events=*/false, reads ? &(*reads)[std::size_t(run_rank[j])] : nullptr);
      piece = std::max(piece, k.forward_s);
      compute = std::max(compute, k.compute_s);
    }
    piece += cluster.profile.straggle_s(compute, t.ranks);  // the ranks meet at the piece's end: the slowest's spread
    out.end_s += piece;
    out.compute_s += compute;
    out.communication_s += piece - compute;
    at += cut.front()[i].size();
    while (next_layer < layer_end.size() && layer_end[next_layer] == at) {
      out.layer_end_s.push_back(out.end_s);
      ++next_layer;
    }
  }
  return out;
}

// The step's time: its timeline, then the layout change's exposed time as serve/step_cost.hpp prices it
// (switch_exposed_s: layer l's pieces leave after layer l; unpipelined, a stall before the step).
inline StepCost step_cost_of(const DecoderConfig& c, const StepTrace& t, const SimulatedCluster& cluster,
                             const DryRunTimeline& timeline) {
  StepCost out;
  if (t.tokens() <= 0) return out;
  out.compute_s = timeline.compute_s;
  out.communication_s = timeline.communication_s;
  out.switch_s = switch_exposed_s(c, t, cluster, timeline.layer_end_s, timeline.end_s);
  return out;
}

// The step's time on the cluster: per piece the slowest rank's trace_cost time, then the layout change's exposed
// time. compute_s: the slowest rank's kernels per piece; communication_s: the rest of the pieces' time.
inline StepCost dry_run_step_cost(StepDryRunner& runner, const StepTrace& t, const SimulatedCluster& cluster,
                                  bool share_ranks = true, std::vector<cost::WeightReads>* reads = nullptr) {
  return step_cost_of(runner.config(), t, cluster, dry_run_timeline(runner, t, cluster, share_ranks, reads));
}

inline StepCost dry_run_step_cost(const DecoderConfig& c, const StepTrace& t, const SimulatedCluster& cluster) {
  StepDryRunner runner(c);
  return dry_run_step_cost(runner, t, cluster);
}

// The engine's own collectives around a step on more than one rank (serve/engine.hpp serve_loop): rank 0 broadcasts
// the plan's length and the plan (5 + admissions + 2 per chunk int64s) before it, and the sampled tokens after it
// (priced at one per chunk and always; a step that ends no prompt and decodes nothing skips it). They are not
// decoder_step's, so its dry run does not record them; each is a collective on the critical path (on thread ranks a
// hand-off: a blocked rank woken, 23-33 us on the 2-core machine's wall clock, three a step against a 0.8-1.1 ms
// decode step of the trained 4-layer MoE).
inline double engine_control_s(const StepTrace& t, const cost::HardwareProfile& hw) {
  if (t.ranks <= 1) return 0;
  const double chunks = double(t.chunks.size()), word = double(sizeof(std::int64_t));
  return hw.collective_time(cost::Collective::broadcast, t.ranks, word) +
         hw.collective_time(cost::Collective::broadcast, t.ranks, word * (5 + double(t.admitted) + 2 * chunks)) +
         hw.collective_time(cost::Collective::broadcast, t.ranks, word * chunks);
}

// The engine's host work on the step's critical path (rank 0 plans a step after the last one's tokens are sampled,
// and samples after it computed): the trace events its forecast dry-ran (StepTrace::planning_events) at the
// profile's host rate (HardwareProfile::planning_events_per_s; a dry run of both layouts took 0.05 ms on the 2-core
// machine against a 0.34 ms decode step of the trained 4-layer MoE), and its other bookkeeping per step and per chunk
// (HardwareProfile::serving_host); both calibrated by serve/serving_calibration.hpp, 0 where the profile has none.
// forecast_host_s: the forecast's part alone.
inline double forecast_host_s(const StepTrace& t, const cost::HardwareProfile& hw) {
  return hw.planning_events_per_s > 0 ? double(t.planning_events) / hw.planning_events_per_s : 0.0;
}
inline double host_work_s(const StepTrace& t, const cost::HardwareProfile& hw) {
  const double forecast = forecast_host_s(t, hw);
  if (t.tokens() <= 0) return forecast;
  return forecast + hw.serving_host.step_s + hw.serving_host.chunk_s * double(t.chunks.size());
}

// The simulated step's cost: the dry run's; its communication includes the engine's control collectives
// (engine_control_s), and host_s the engine's host work (host_work_s). `reads`: the ranks' weight reads so far
// (dry_run_timeline), advanced by the step's.
inline StepCost simulated_step_cost(StepDryRunner& runner, const StepTrace& t, const SimulatedCluster& cluster,
                                    std::vector<cost::WeightReads>* reads = nullptr) {
  StepCost c = dry_run_step_cost(runner, t, cluster, /*share_ranks=*/true, reads);
  c.communication_s += engine_control_s(t, cluster.profile);
  c.host_s = host_work_s(t, cluster.profile);
  return c;
}
inline StepCost simulated_step_cost(const DecoderConfig& c, const StepTrace& t, const SimulatedCluster& cluster) {
  StepDryRunner runner(c);
  return simulated_step_cost(runner, t, cluster);
}

// ---- the dry run's price, remembered ------------------------------------------------------------------------------
//
// The dynamic policy prices each step in TP, in EP and with the switch to the other layout (serve/switch_policy.hpp
// forecast_layouts); the last is the current layout's run again (a pipelined switch computes in the old layout, and
// its exposed time is a function of that run's layer-end times). DryRunPricer keeps the timelines of the last few
// steps it ran, by what determines them: the ranks, the layouts the step computes in, each chunk's new tokens and
// cached positions, and every layer's expert loads; a step that matches one is priced from it (its switch term
// computed afresh), to the bit what a new dry run gives (tests/serve/switch_dry_run.cpp). It prices each GEMM at the
// profile's calibration cycle, not at its weight's reuse distance (the simulated clock's WeightReads): the forecast
// compares TP and EP on the step to come alone.
class DryRunPricer {
public:
  // (`cluster` must outlive the pricer.) `budget`: the policy's routing budget (StepDryRunner's).
  DryRunPricer(const DecoderConfig& c, const SimulatedCluster& cluster, RoutingBudget budget = {})
      : runner_(c, std::move(budget)), cluster_(cluster) {}

  // The dry run's price of `t` (remembered): simulated_step_cost's less the engine's control collectives, which do
  // not depend on the layouts the switcher compares.
  StepCost operator()(const StepTrace& t) {
    const DecoderConfig& c = runner_.config();
    Key key{t.ranks, computed_layouts(t), {}, t.routed};
    for (const ChunkShape& ch : t.chunks) key.chunks.push_back({ch.tokens, ch.cached});
    auto hit = std::find_if(kept_.begin(), kept_.end(), [&](const Kept& k) { return k.key == key; });
    if (hit == kept_.end()) {
      ++misses_;
      if (kept_.size() == kKept) kept_.pop_back();
      kept_.insert(kept_.begin(), Kept{std::move(key), dry_run_timeline(runner_, t, cluster_)});
      hit = kept_.begin();
      events_ += hit->timeline.events;
    } else {
      ++hits_;
      std::rotate(kept_.begin(), hit, hit + 1);  // most recent first
      hit = kept_.begin();
    }
    return step_cost_of(c, t, cluster_, hit->timeline);
  }
  std::int64_t hits() const noexcept { return hits_; }
  std::int64_t misses() const noexcept { return misses_; }
  // Trace events its dry runs recorded so far (the misses'; a remembered step records none): the forecast's host work.
  std::int64_t events() const noexcept { return events_; }

private:
  struct Key {
    int ranks = 0;
    std::vector<ExpertLayout> layouts;
    std::vector<std::pair<std::int64_t, std::int64_t>> chunks;  // (tokens, cached) of each chunk
    std::vector<std::vector<std::int64_t>> routed;
    friend bool operator==(const Key&, const Key&) = default;
  };
  struct Kept {
    Key key;
    DryRunTimeline timeline;
  };
  static constexpr std::size_t kKept = 8;

  StepDryRunner runner_;
  const SimulatedCluster& cluster_;
  std::vector<Kept> kept_;  // most recent first
  std::int64_t hits_ = 0, misses_ = 0, events_ = 0;
};

}  // namespace paradyse::serve
