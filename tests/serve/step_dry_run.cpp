// tests/serve/step_dry_run.cpp: the simulated step is a dry run of decoder_step (serve/step_dry_run.hpp). Its
// kernel list is the real CPU step's (same kernels, same shapes, in order) for loaded models on p = 1..3 in TP and
// EP; a simulated step's cost is cost/trace_cost.hpp's time of that step's dry-run trace (computed here from the
// traces); a layout change costs the ranks' own work (new banks, kept pieces) beside its transfers, written out; the
// analytic model the switcher forecasts with (serve/step_cost.hpp) is its cost to rounding, kernel for kernel, on the
// published shapes and the fixtures' configs; DeepSeek's latent attention runs as the absorbed GEMMs and one
// latent-attention kernel over the latents (written out on DeepSeek-V2-Lite).
#include "paradyse/comm/threads.hpp"
#include "paradyse/ops/backend.hpp"
#include "paradyse/serve/cluster_spec.hpp"
#include "paradyse/serve/model_shape_hf.hpp"
#include "paradyse/serve/step_dry_run.hpp"
#include "paradyse/serve/synthetic_decoder.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

// A backend that computes as ops::Cpu and records each op as ops::Counting does: a real step's kernel list.
namespace paradyse::ops::listing_test {
struct Both {
  static constexpr std::string_view name = "listing";
#define PARADYSE_BOTH(op)                                \
  template <class... A>                                  \
  static decltype(auto) op(A&&... a) {                   \
    counting::op(a...);                                  \
    return cpu::op(std::forward<A>(a)...);               \
  }
#define PARADYSE_OP PARADYSE_BOTH
#include "paradyse/ops/op_names.inc"
#undef PARADYSE_OP
#undef PARADYSE_BOTH
};
using Listing = BackendOf<Both>;
}  // namespace paradyse::ops::listing_test

using namespace paradyse;
using namespace paradyse::serve;

namespace step_dry_run_test {

using ops::listing_test::Listing;

std::filesystem::path repo() { return std::filesystem::path(__FILE__).parent_path().parent_path().parent_path(); }

// A trace's kernels, identical neighbours merged as Trace::record merges them (a real step's thread communicator
// records nothing between two kernels that a dry run's collective separates: DeepSeek's shared expert's add, the
// all-reduce, the residual add).
std::vector<TraceEvent> kernels(std::span<const TraceEvent> events) {
  std::vector<TraceEvent> k;
  for (const TraceEvent& e : events) {
    if (!e.is_kernel()) continue;
    if (!k.empty() && k.back().same_kernel(e))
      k.back().count += e.count;
    else
      k.push_back(e);
  }
  return k;
}

void same_kernels(const std::vector<TraceEvent>& real, const std::vector<TraceEvent>& dry) {
  REQUIRE(real.size() == dry.size());
  for (std::size_t i = 0; i < real.size(); ++i) {
    INFO("kernel ", i, " of ", real.size());
    CHECK(int(real[i].kind) == int(dry[i].kind));
    CHECK(real[i].count == dry[i].count);
    CHECK(real[i].m == dry[i].m);
    CHECK(real[i].n == dry[i].n);
    CHECK(real[i].k == dry[i].k);
    CHECK(real[i].bytes == dry[i].bytes);
    CHECK(real[i].grouped == dry[i].grouped);
  }
}

// A step's trace as the engine hands it to the clock.
StepTrace step_of(const DecoderConfig& c, int p, const std::vector<ChunkShape>& chunks, const ExpertLayout& layout,
                  const std::vector<std::vector<std::int64_t>>& routed) {
  StepTrace t;
  t.ranks = p;
  t.chunks = chunks;
  t.routed = routed;
  t.layout.assign(std::size_t(c.layers), ExpertLayout::tp());
  for (std::int64_t l = 0; l < c.layers; ++l)
    if (c.is_moe(l)) t.layout[std::size_t(l)] = layout;
  t.next.assign(std::size_t(c.layers), std::nullopt);
  return t;
}

// Loads for a shape: `tokens` k pairs spread over the experts with a skew (expert e gets weight e + 1).
std::vector<std::vector<std::int64_t>> skewed_loads(const DecoderConfig& c, std::int64_t tokens) {
  std::vector<std::vector<std::int64_t>> routed(std::size_t(c.layers));
  const std::int64_t E = c.moe.experts, pairs = tokens * c.moe.top_k, weight = E * (E + 1) / 2;
  for (std::int64_t l = 0; l < c.layers; ++l) {
    if (!c.is_moe(l)) continue;
    std::vector<std::int64_t>& r = routed[std::size_t(l)];
    std::int64_t given = 0;
    for (std::int64_t e = 0; e < E; ++e) r.push_back(pairs * (e + 1) / weight), given += r.back();
    r[std::size_t((l % E))] += pairs - given;
  }
  return routed;
}

// The real CPU step's kernel lists on each of p ranks against the dry run's (a runner given `budget`), two steps of
// the fixture `name` in `mode`.
void same_kernels_as_real_steps(const char* name, int p, MoeMode mode, bool pooled) {
  const LoadedDecoder m = load_decoder((repo() / "tests" / "data" / "hf" / name).string());
  const DecoderConfig& c = m.config;
  // Alloc-T at each layer's top-k: a chunk's tokens take k T activations, some tokens more than k.
  const RoutingBudget budget = pooled ? routing_budget_of(c, moe_layer_top_k(c), true) : RoutingBudget{};
  INFO(name, " p = ", p, " ", name_of(mode), pooled ? " Alloc-T" : "");
  Rng rng(std::uint64_t(p) * 7 + 1);
  // Step 1: two prompts (7 and 3 tokens); step 2: a decode token of each and a third prompt of 4.
  std::vector<std::vector<SequenceChunk>> steps(2);
  for (const auto& [step, request, length] :
       std::vector<std::tuple<int, std::int64_t, int>>{{0, 0, 7}, {0, 1, 3}, {1, 0, 1}, {1, 1, 1}, {1, 2, 4}}) {
    SequenceChunk ch{request, {}, false};
    for (int t = 0; t < length; ++t) ch.tokens.push_back(std::int32_t(rng.below(std::uint64_t(c.vocab))));
    steps[std::size_t(step)].push_back(ch);
  }
  std::vector<std::vector<std::vector<TraceEvent>>> real(2, std::vector<std::vector<TraceEvent>>(std::size_t(p)));
  std::vector<std::vector<std::vector<std::int64_t>>> routed(2);
  std::vector<std::vector<ChunkShape>> shapes(2);
  run_ranks(p, [&](ThreadCommunicator& comm) {
    const RankShard s = make_rank_shard(c, m.weights, p, comm.rank(), mode);
    PagedKvCache cache(kv_cache_shape(c, s, 16, 4));
    BufferPool pool;
    for (std::size_t k = 0; k < steps.size(); ++k) {
      std::vector<ChunkShape> shape;
      for (const SequenceChunk& ch : steps[k]) {
        cache.reserve(ch.request, std::int64_t(ch.tokens.size()));
        shape.push_back({std::int64_t(ch.tokens.size()), cache.length(ch.request), ch.tokens.size() == 1});
      }
      Trace trace;
      StepResult out;
      {
        const ScopedTrace listing(trace);
        out = decoder_step<Listing>(comm, c, s, cache, std::span<const SequenceChunk>(steps[k]), pool, {}, {},
                                    budget);
      }
      real[k][std::size_t(comm.rank())] = kernels(trace.events());
      if (comm.rank() != 0) continue;
      shapes[k] = shape;
      for (const MoeLayerLoad& load : out.moe_load) routed[k].push_back(load.routed);
    }
  });
  // Each projection of a rank's experts is one grouped GEMM (TP's bank, EP's tasks as one batch): the first step's
  // 10 tokens reach several experts on one rank, so some items ride on a first's launch.
  std::int64_t grouped = 0;
  for (const TraceEvent& e : real[0][0]) grouped += e.kind == TraceKind::gemm && e.grouped ? e.count : 0;
  CHECK(grouped > 0);
  const ExpertLayout layout = mode == MoeMode::tp
                                  ? ExpertLayout::tp()
                                  : ExpertLayout::ep(ExpertPlacement::chunked(c.moe.experts, p).experts_of_rank);
  StepDryRunner runner(c, budget);
  for (std::size_t k = 0; k < steps.size(); ++k) {
    const StepTrace t = step_of(c, p, shapes[k], layout, routed[k]);
    for (int r = 0; r < p; ++r) {
      INFO("step ", k, " rank ", r);
      same_kernels(real[k][std::size_t(r)], kernels(runner.run(t, r).events));
    }
  }
}

TEST_CASE("step dry run: its kernel list is the real CPU step's (same kernels, same shapes) on p = 1..3, TP and EP") {
  // DeepSeek's latent attention: with q_lora_rank (V2, V3), without (V2-Lite), under YaRN and with RoPE on halves.
  for (const char* name : {"mixtral", "qwen2_moe", "olmoe", "qwen3_moe", "deepseek_v2", "deepseek_v2_lite_yarn",
                           "deepseek_v3_yarn", "deepseek_v3_rope_halves"})
    for (const int p : {1, 2, 3})
      for (const MoeMode mode : {MoeMode::tp, MoeMode::ep}) same_kernels_as_real_steps(name, p, mode, false);
}

TEST_CASE("step dry run: under Alloc-T's pooled routing too (the scoring pass, each chunk's k T activations)") {
  for (const char* name : {"mixtral", "qwen2_moe", "olmoe", "qwen3_moe"})
    for (const int p : {1, 2, 3})
      for (const MoeMode mode : {MoeMode::tp, MoeMode::ep}) same_kernels_as_real_steps(name, p, mode, true);
}

TEST_CASE("step dry run: ranks of equal trace keys record the same events, so the step is priced from one of them") {
  const ModelShape mixtral = read_model_shape((repo() / "data" / "model_shapes" / "mixtral-8x7b.json").string());
  const SimulatedCluster h100 = simulated_cluster("h100", 2);
  const ModelShape lite = read_model_shape((repo() / "data" / "model_shapes" / "deepseek-v2-lite.json").string());
  std::vector<DecoderConfig> configs{mixtral.config, lite.config};
  for (const char* name : {"qwen2_moe", "olmoe", "qwen3_moe", "deepseek_v3"})
    configs.push_back(load_decoder((repo() / "tests" / "data" / "hf" / name).string()).config);
  const std::vector<ChunkShape> batch{{1, 90, true}, {1, 37, true}, {12, 0, false}, {5, 20, false}};
  for (const DecoderConfig& c : configs) {
    for (const int p : {1, 2, 3, 4, 8}) {
      if (p > c.heads) continue;
      const ExpertLayout ep = ExpertLayout::ep(ExpertPlacement::chunked(c.moe.experts, p).experts_of_rank);
      for (const ExpertLayout& layout : {ExpertLayout::tp(), ep}) {
        INFO("h = ", c.hidden, " p = ", p, " ", name_of(layout.mode));
        StepTrace t = step_of(c, p, batch, layout, skewed_loads(c, 19));
        StepDryRunner runner(c);
        std::vector<RankStepTrace> runs;
        for (int r = 0; r < p; ++r) runs.push_back(runner.run(t, r));
        std::int64_t distinct = 0;
        for (int r = 0; r < p; ++r) {
          bool first = true;
          for (int q = 0; q < r && first; ++q) {
            if (runner.trace_key(t, q) != runner.trace_key(t, r)) continue;
            first = false;
            const std::vector<TraceEvent>&a = runs[std::size_t(q)].events, &b = runs[std::size_t(r)].events;
            REQUIRE(a.size() == b.size());
            CHECK(runs[std::size_t(q)].layer_end == runs[std::size_t(r)].layer_end);
            for (std::size_t i = 0; i < a.size(); ++i) {
              INFO("ranks ", q, " and ", r, " event ", i);
              CHECK(int(a[i].kind) == int(b[i].kind));
              CHECK(int(a[i].transfer) == int(b[i].transfer));
              CHECK(a[i].request == b[i].request);
              CHECK(a[i].count == b[i].count);
              CHECK(a[i].group == b[i].group);
              CHECK(a[i].span == b[i].span);
              CHECK(a[i].bytes == b[i].bytes);
              CHECK(a[i].m == b[i].m);
              CHECK(a[i].n == b[i].n);
              CHECK(a[i].k == b[i].k);
            }
          }
          distinct += first;
        }
        // Mixtral's 32 heads, 8 kv heads and expert width 14336 split evenly over 2, 4, 8: in TP one rank stands for
        // all (over 3 every rank differs).
        if (c.hidden == mixtral.config.hidden && layout.mode == MoeMode::tp) CHECK(distinct == (p == 3 ? 3 : 1));
        if (layout.mode == MoeMode::ep) CHECK(distinct == p);
        // Priced from the distinct ranks: to the bit the price of every rank's run, with a layout change too.
        for (const bool pipelined : {true, false}) {
          t.pipelined_switch = pipelined;
          for (std::int64_t l = 0; l < c.layers; ++l)
            if (c.is_moe(l)) t.next[std::size_t(l)] = layout.mode == MoeMode::tp ? ep : ExpertLayout::tp();
          const StepCost shared = dry_run_step_cost(runner, t, h100), every = dry_run_step_cost(runner, t, h100, false);
          CHECK(shared.compute_s == every.compute_s);
          CHECK(shared.communication_s == every.communication_s);
          CHECK(shared.switch_s == every.switch_s);
          if (p > 1 && !pipelined) CHECK(shared.switch_s > 0);  // (pipelined, the fixtures' moves hide in the step)
        }
      }
    }
  }
}

TEST_CASE("step dry run: a simulated step's cost is trace_cost's time of the step's dry-run trace") {
  const ModelShape mixtral = read_model_shape((repo() / "data" / "model_shapes" / "mixtral-8x7b.json").string());
  const DecoderConfig& c = mixtral.config;
  const SimulatedCluster h100 = simulated_cluster("h100", 2);
  const std::vector<ChunkShape> batch{{1, 900, true}, {1, 37, true}, {1, 2500, true}, {512, 0, false},
                                      {200, 1024, false}};
  std::int64_t n = 0;
  for (const ChunkShape& ch : batch) n += ch.tokens;
  const auto whole = [&](const StepTrace& t, int r) {
    const RankStepTrace dry = dry_run_step(c, t, r);
    return cost::cost_of(cost::SublayerTraceView{dry.events, {}, {}, t.ranks}, &h100.profile, 2, false);
  };
  // One rank, and TP on 2 and 8 ranks (every rank alike): the step is one rank's whole trace.
  for (const int p : {1, 2, 8}) {
    INFO("TP p = ", p);
    const StepTrace t = step_of(c, p, batch, ExpertLayout::tp(), skewed_loads(c, n));
    const cost::SublayerCost one = whole(t, 0);
    const StepCost step = dry_run_step_cost(c, t, h100);
    CHECK(step.total_s() == doctest::Approx(one.forward_s).epsilon(1e-12).scale(0));  // the same sum in another order
    CHECK(step.compute_s == doctest::Approx(one.compute_s).epsilon(1e-12).scale(0));
    CHECK(step.switch_s == 0);
    const double control = engine_control_s(t, h100.profile);  // the engine's broadcasts around the step
    CHECK((p == 1 ? control == 0 : control > 0));
    CHECK(simulated_step_cost(c, t, h100).total_s() == doctest::Approx(step.total_s() + control).epsilon(1e-12));
  }
  // EP on 3 ranks under skewed loads (the ranks differ): per collective the slowest rank's piece, summed here from
  // the traces; bounded below by the slowest rank's whole trace.
  const ExpertLayout ep = ExpertLayout::ep(ExpertPlacement::chunked(c.moe.experts, 3).experts_of_rank);
  const StepTrace t = step_of(c, 3, batch, ep, skewed_loads(c, n));
  std::vector<RankStepTrace> ranks;
  for (int r = 0; r < 3; ++r) ranks.push_back(dry_run_step(c, t, r));
  std::vector<std::size_t> at(3, 0);
  double expected = 0, slowest_whole = 0;
  for (;;) {  // walk the ranks collective by collective (a wait closes each)
    double piece = 0;
    bool more = false;
    for (int r = 0; r < 3; ++r) {
      const std::vector<TraceEvent>& e = ranks[std::size_t(r)].events;
      std::size_t end = at[std::size_t(r)];
      while (end < e.size() && e[end].kind != TraceKind::wait) ++end;
      if (end < e.size()) ++end, more = true;
      const std::span<const TraceEvent> part(e.data() + at[std::size_t(r)], end - at[std::size_t(r)]);
      const cost::SublayerTraceView view{part, {}, {}, 3};
      piece = std::max(piece, cost::cost_of(view, &h100.profile, 2, false).forward_s);
      at[std::size_t(r)] = end;
    }
    expected += piece;
    if (!more) break;
  }
  for (int r = 0; r < 3; ++r) slowest_whole = std::max(slowest_whole, whole(t, r).forward_s);
  const StepCost step = dry_run_step_cost(c, t, h100);
  CHECK(step.total_s() == doctest::Approx(expected).epsilon(1e-12).scale(0));
  CHECK(step.total_s() >= slowest_whole * (1 - 1e-12));
  CHECK(step.total_s() > whole(t, 0).forward_s);  // rank 0 holds the light experts: the others set the pace
  // A layout change: unpipelined, the step computes in the new layout after a stall of the whole exchange;
  // pipelined, what is in flight when the step ends.
  StepTrace change = step_of(c, 3, batch, ExpertLayout::tp(), skewed_loads(c, n));
  for (std::int64_t l = 0; l < c.layers; ++l) change.next[std::size_t(l)] = ep;
  change.pipelined_switch = false;
  const StepCost stalled = dry_run_step_cost(c, change, h100);
  CHECK(stalled.compute_s + stalled.communication_s == doctest::Approx(step.total_s()).epsilon(1e-12).scale(0));
  double stall = 0;
  const LayerSwitch layer = layer_switch(c, ExpertLayout::tp(), ep, 3, h100.profile, 2);
  CHECK(layer.exchange_s == step_cost_detail::exchange_time(h100.profile, 3, layer.bytes));
  for (std::int64_t l = 0; l < c.layers; ++l) stall += layer.exchange_s + layer.host_s;
  CHECK(stalled.switch_s == doctest::Approx(stall).epsilon(1e-12).scale(0));
  change.pipelined_switch = true;
  const StepCost piped = dry_run_step_cost(c, change, h100);
  CHECK(piped.switch_s > 0);
  CHECK(piped.switch_s < stall);
}

TEST_CASE("step dry run: a switch charges the ranks' new banks and kept pieces beside the exchange") {
  // 4 experts of width 8 over h 16 on 2 ranks, float: TP -> EP with experts {0, 1} on rank 0, {2, 3} on rank 1. Each
  // rank keeps its half of the columns of its 2 experts (8 columns of 3 rows of 16 floats: 1,536 bytes, copied: a
  // read and a write) and makes banks [2, 16, 16] and [2, 8, 16] (2,048 and 1,024 bytes).
  const DecoderConfig c = synthetic_config(16, 2, 2, 2, 4, 2, 8, 32);
  const ExpertLayout tp = ExpertLayout::tp(), ep = ExpertLayout::ep({{0, 1}, {2, 3}});
  cost::HardwareProfile hw = cost::h100_sxm_80gb_x8();
  hw.elementwise_classes.clear();
  hw.elementwise_bytes_per_s = 1e9;
  hw.fresh_memory = {};
  for (const RankMoveBytes& m : move_bytes(redistribution_plan(tp, ep, 4, 8, 2), 16, 2, 4)) {
    CHECK(m.kept == 1536);  // and the other half of the columns to the other rank, from it the same
    CHECK(m.sent == 1536);
    CHECK(m.received == 1536);
  }
  CHECK(layer_switch(c, tp, ep, 2, hw, 4).bytes == 1536);
  CHECK(layer_switch(c, tp, ep, 2, hw, 4).host_s == doctest::Approx(2 * 1536 / 1e9).epsilon(1e-12).scale(0));
  // Banks from new pages pay their faults (unzeroed): here from 2,048 bytes, so the first bank does, the second not.
  hw.fresh_memory = {.zero_bytes_per_s = 4e9, .fresh_bytes_per_s = 1e9, .fresh_min_bytes = 2048};
  const double host = 2048 / 1e9 - 2048 / 4e9 + 2 * 1536 / 1e9;
  CHECK(layer_switch(c, tp, ep, 2, hw, 4).host_s == doctest::Approx(host).epsilon(1e-12).scale(0));
  // The exchange: the link's launch and step latency, then its bytes at the point-to-point rate, or copied from memory
  // (read and written) where that is slower, as here at 1 GB/s against NVLink's.
  const cost::LinkModel& link = hw.link(hw.level_of(2));
  CHECK(layer_switch(c, tp, ep, 2, hw, 4).exchange_s ==
        doctest::Approx(link.launch_s + link.step_latency_s + 2 * 1536 / 1e9).epsilon(1e-12).scale(0));
  // A profile's own rate for copies from memory (a CPU's, below its hot elementwise rate) prices the kept pieces and
  // the exchange; the link's bandwidth still bounds the exchange where it is the slower.
  cost::HardwareProfile cold = hw;
  cold.memory_copy_bytes_per_s = 2.5e8;
  const LayerSwitch slow = layer_switch(c, tp, ep, 2, cold, 4);
  CHECK(slow.host_s == doctest::Approx(2048 / 1e9 - 2048 / 4e9 + 2 * 1536 / 2.5e8).epsilon(1e-12).scale(0));
  CHECK(slow.exchange_s ==
        doctest::Approx(link.launch_s + link.step_latency_s + 2 * 1536 / 2.5e8).epsilon(1e-12).scale(0));
  cold.intra_node.p2p_bytes_per_s = 1e8;
  CHECK(layer_switch(c, tp, ep, 2, cold, 4).exchange_s ==
        doctest::Approx(link.launch_s + link.step_latency_s + 1536 / 1e8).epsilon(1e-12).scale(0));

  // In the step: unpipelined, the ranks' work and the exchange stall the step whole; pipelined on links that overlap
  // nothing (a CPU's thread copies), the same exchange costs as much; on links that overlap fully, less.
  StepTrace t;
  t.ranks = 2;
  t.chunks = {{1, 5, true}, {1, 9, true}};
  t.routed.assign(2, {1, 1, 1, 1});
  t.layout.assign(2, tp);
  t.next.assign(2, ep);
  t.pipelined_switch = false;
  const SimulatedCluster cluster{hw, 4};
  const double x = layer_switch(c, tp, ep, 2, hw, 4).exchange_s;
  CHECK(x > 0);
  const std::vector<double> layer_end{1e-3, 2e-3};
  CHECK(switch_exposed_s(c, t, cluster, layer_end, 2e-3) == doctest::Approx(2 * (host + x)).epsilon(1e-12).scale(0));
  t.pipelined_switch = true;
  SimulatedCluster none = cluster, full = cluster;
  none.profile.overlap = 0;
  full.profile.overlap = 1;
  CHECK(switch_exposed_s(c, t, none, layer_end, 2e-3) == doctest::Approx(2 * (host + x)).epsilon(1e-12).scale(0));
  // Fully overlapped: layer 0's exchange runs under layer 1; layer 1's, posted at the end, is exposed whole.
  CHECK(switch_exposed_s(c, t, full, layer_end, 2e-3) == doctest::Approx(2 * host + x).epsilon(1e-12).scale(0));
}

TEST_CASE("step dry run: the ranks' spread adds sigma E[max of p] x each piece's slowest kernels as waiting") {
  const ModelShape mixtral = read_model_shape((repo() / "data" / "model_shapes" / "mixtral-8x7b.json").string());
  const DecoderConfig& c = mixtral.config;
  const std::vector<ChunkShape> batch{{1, 900, true}, {1, 37, true}, {300, 0, false}};
  std::int64_t n = 0;
  for (const ChunkShape& ch : batch) n += ch.tokens;
  const SimulatedCluster plain = simulated_cluster("h100", 2);
  SimulatedCluster spread = plain;
  spread.profile.rank_jitter = 0.05;
  for (const int p : {1, 2, 3, 8}) {
    INFO("p = ", p);
    const ExpertLayout ep = ExpertLayout::ep(ExpertPlacement::chunked(c.moe.experts, p).experts_of_rank);
    for (const ExpertLayout& layout : {ExpertLayout::tp(), ep}) {
      const StepTrace t = step_of(c, p, batch, layout, skewed_loads(c, n));
      const StepCost without = dry_run_step_cost(c, t, plain), with = dry_run_step_cost(c, t, spread);
      // compute_s is the pieces' slowest kernels summed, so their straggle sums to the profile's on it.
      CHECK(with.compute_s == without.compute_s);
      const double wait = p == 1 ? 0.0 : 0.05 * expected_max_of_normals(p) * without.compute_s;
      CHECK(with.communication_s - without.communication_s == doctest::Approx(wait).epsilon(1e-9).scale(without.compute_s));
      // So does the analytic model, on each layer's two synchronised halves and on the logits after the last.
      const StepCost analytic = step_cost(c, t, plain), analytic_spread = step_cost(c, t, spread);
      const double analytic_wait = p == 1 ? 0.0 : 0.05 * expected_max_of_normals(p) * analytic.compute_s;
      CHECK(analytic_spread.communication_s - analytic.communication_s ==
            doctest::Approx(analytic_wait).epsilon(1e-9).scale(analytic.compute_s));
    }
  }
}

TEST_CASE("step dry run: the analytic step cost is the dry run's, kernel for kernel") {
  // Built-in profiles, and one with every term the two price per kernel: the call's fixed cost, the families' rates,
  // size classes, the cos/sin calls, the paged and latent kernels' per-visit models, the ranks' spread (per half-layer
  // against per piece), fresh allocations (which neither charges: the dry run's meta tensors record none).
  const SimulatedCluster h100 = simulated_cluster("h100", 2), h200 = simulated_cluster("h200", 2);
  SimulatedCluster every = h200;
  cost::HardwareProfile& hw = every.profile;
  hw.call_overhead.kernel_call_s = 3e-6;
  hw.scalar_math.sincos_per_s = 2e9;
  hw.elementwise_families[std::size_t(ElementwiseFamily::rows)] = {.overhead_s = 1e-6, .bytes_per_s = 1e12};
  hw.elementwise_families[std::size_t(ElementwiseFamily::copy)] = {.overhead_s = 2e-6, .bytes_per_s = 5e11};
  hw.paged_attention = {.visits_per_s = 1e10, .flops_per_s = 2e13};
  hw.latent_attention = {.visits_per_s = 3e10, .flops_per_s = 5e13, .shared_per_s = 4e10};
  hw.elementwise_classes = {{.max_bytes = 1e6, .bytes_per_s = 1e12}, {.max_bytes = 1e9, .bytes_per_s = 3e12}};
  hw.rank_jitter = 0.05;
  hw.fresh_memory = {.zero_bytes_per_s = 1e10, .fresh_bytes_per_s = 1e10, .fresh_min_bytes = 1 << 20};
  const SimulatedCluster* clusters[] = {&h100, &h200, &every};
  // The published shapes (Qwen2-57B: q/k/v biases, a gated shared expert; DeepSeek-V2-Lite: latent attention without
  // q_lora_rank, a dense first layer) and the fixtures' configs: OLMoE's q/k norm over whole projections, Qwen3-MoE's
  // per-head q/k norms and a dense layer, Qwen2-MoE's dense layer, DeepSeek-V3's latent attention with q_lora_rank and
  // YaRN's RoPE.
  std::vector<std::filesystem::path> configs;
  for (const char* model : {"mixtral-8x7b", "mixtral-8x22b", "qwen2-57b-a14b", "deepseek-v2-lite"})
    configs.push_back(repo() / "data" / "model_shapes" / (std::string(model) + ".json"));
  for (const char* fixture : {"olmoe", "qwen3_moe", "qwen2_moe", "deepseek_v3_yarn"})
    configs.push_back(repo() / "tests" / "data" / "hf" / fixture / "config.json");
  for (const std::filesystem::path& config : configs) {
    const ModelShape shape = read_model_shape(config.string());
    const DecoderConfig& c = shape.config;
    const std::string model = config.parent_path().filename().string() + "/" + config.filename().string();
    for (const int p : {1, 2, 3, 8}) {
      if (p > c.heads) continue;
      const ExpertPlacement chunked = ExpertPlacement::chunked(c.moe.experts, p);
      const ExpertLayout ep = ExpertLayout::ep(chunked.experts_of_rank);
      ExpertPlacement replicated = chunked;  // EPLB's kind: rank r also holds a replica of expert E - 1 - (r mod E)
      for (int r = 0; r < p; ++r)
        replicated.experts_of_rank[std::size_t(r)].push_back(c.moe.experts - 1 - r % c.moe.experts);
      std::vector<ExpertLayout> layouts{ExpertLayout::tp(), ep};
      if (p > 1) layouts.push_back(ExpertLayout::ep(replicated.experts_of_rank));
      for (const ExpertLayout& layout : layouts) {
        std::vector<ChunkShape> mixed(48, ChunkShape{1, 700, true});  // decode tokens and a prompt's second chunk
        mixed.push_back({384, 512, false});
        using Batch = std::vector<ChunkShape>;
        for (const Batch& batch : {Batch{{1, 1000, true}}, Batch(64, ChunkShape{1, 700, true}), Batch{{2048, 0, false}},
                                   Batch{{89, 0, false}, {1, 5, true}}, mixed}) {
          std::int64_t n = 0;
          for (const ChunkShape& ch : batch) n += ch.tokens;
          INFO(model, " p = ", p, " ", name_of(layout.mode), " ", batch.size(), " chunks of ", n, " tokens");
          const StepTrace t = step_of(c, p, batch, layout, skewed_loads(c, n));
          const auto switching = [&](bool pipelined) {  // every MoE layer changing to the other layout
            StepTrace s = t;
            s.pipelined_switch = pipelined;
            for (std::int64_t l = 0; l < c.layers; ++l)
              if (c.is_moe(l)) s.next[std::size_t(l)] = layout.mode == MoeMode::tp ? ep : ExpertLayout::tp();
            return s;
          };
          for (const StepTrace& step : {t, switching(true), switching(false)}) {
            for (const SimulatedCluster* cluster : clusters) {
              const StepCost dry = dry_run_step_cost(c, step, *cluster), analytic = step_cost(c, step, *cluster);
              CHECK(analytic.compute_s == doctest::Approx(dry.compute_s).epsilon(1e-12).scale(0));
              CHECK(analytic.communication_s ==
                    doctest::Approx(dry.communication_s).epsilon(1e-12).scale(dry.total_s()));
              CHECK(analytic.switch_s == doctest::Approx(dry.switch_s).epsilon(1e-12).scale(dry.total_s()));
            }
          }
        }
      }
    }
  }
}

TEST_CASE("step dry run: DeepSeek's latent attention runs as absorbed GEMMs and one kernel over the latents") {
  // DeepSeek-V2-Lite (h 2048, 16 heads, r_kv 512, d_r 64, d_n = d_v = 128, no q_lora_rank) on rank 0 of 2 (8 heads):
  // a 4-token prompt and a decode token after 10 cached positions, n = 5.
  const ModelShape lite = read_model_shape((repo() / "data" / "model_shapes" / "deepseek-v2-lite.json").string());
  const DecoderConfig& c = lite.config;
  const StepTrace t = step_of(c, 2, {{4, 0, false}, {1, 10, true}}, ExpertLayout::tp(), skewed_loads(c, 5));
  const std::vector<TraceEvent> events = kernels(dry_run_step(c, t, 0).events);
  // The first layer's attention, in order among its other kernels (norms, copies, RoPE).
  using K = TraceKind;
  const std::vector<TraceEvent> expected{
      {.kind = K::gemm, .m = 5, .n = 8 * 192, .k = 2048},                  // q [5, 8 (d_n + d_r)]
      {.kind = K::gemm, .m = 5, .n = 576, .k = 2048},                      // [c_kv | k_pe] [5, r_kv + d_r]
      {.kind = K::gemm, .m = 5, .n = 512, .k = 128},                       // q_nope W_uk, an item a head: the first,
      {.kind = K::gemm, .grouped = true, .count = 7, .m = 5, .n = 512, .k = 128},  // the rest in its launch
      {.kind = K::elementwise, .bytes = 4 * 2 * 4 * 576.0},                // the prompt's latents appended
      {.kind = K::elementwise, .bytes = 4 * 2 * 1 * 576.0},                // the decode token's
      {.kind = K::latent_attention, .m = 4 * 5 / 2 + 11, .n = 8, .k = 544},  // the causal pairs; r_kv + d_r / 2
      {.kind = K::elementwise, .bytes = 4 * (4 + 11) * 576.0},             // each position's latent, read once
      {.kind = K::gemm, .m = 5, .n = 128, .k = 512},                       // o_lat W_uv^T, likewise
      {.kind = K::gemm, .grouped = true, .count = 7, .m = 5, .n = 128, .k = 512},
      {.kind = K::gemm, .m = 5, .n = 2048, .k = 8 * 128}};                 // the output projection
  std::size_t at = 0;
  for (const TraceEvent& want : expected) {
    INFO("expected kernel ", &want - expected.data());
    while (at < events.size() && !(int(events[at].kind) == int(want.kind) && events[at].count == want.count &&
                                   events[at].grouped == want.grouped && events[at].m == want.m &&
                                   events[at].n == want.n && events[at].k == want.k && events[at].bytes == want.bytes))
      ++at;
    REQUIRE(at < events.size());
    ++at;
  }
  // The simulated clock takes the dry run's cost (with the engine's broadcasts around it).
  const SimulatedCluster h100 = simulated_cluster("h100", 2);
  CHECK(simulated_step_cost(c, t, h100).total_s() ==
        doctest::Approx(dry_run_step_cost(c, t, h100).total_s() + engine_control_s(t, h100.profile)).epsilon(1e-12));
}

}  // namespace step_dry_run_test
