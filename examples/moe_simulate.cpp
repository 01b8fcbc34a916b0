// examples/moe_simulate.cpp: the serving engine (serve/engine.hpp) on simulated time (issue 25): a model shape read
// from a Hugging Face config.json alone (serve/model_shape_hf.hpp; data/model_shapes/ holds Mixtral-8x7B and 8x22B,
// Qwen2-57B-A14B, DeepSeek-V2-Lite) served by the engine's own scheduler, policies and KV accounting on p modelled
// ranks of a named cluster (serve/cluster_spec.hpp: a100 / h100 / h200 8-GPU NVLink nodes from their datasheets,
// more than 8 ranks across InfiniBand, or a profile JSON), each step advancing the clock by the time model's cost of
// its trace (serve/step_cost.hpp). The router's choices come from a routing source (serve/routing_source.hpp:
// zipf:S, published:FILE, recorded:FILE) named in the output. Traces: Poisson at each of --rates, bursts, or a
// production CSV (Azure LLM inference trace 2023 format).
//
// Prints, per trace, the table of a measured run (moe_infer's columns: TTFT and TPOT p50/p99, tokens/s, steps, EP
// steps, switches/rebalances, exposed switch ms, rank max/mean) for static TP, static EP, EP + EPLB and dynamic
// TP/EP, the step-time breakdown (compute, exposed communication, exposed switch), and the dynamic policy's ratio to
// the best static policy per metric beside the Dynamo-MoE paper's (6.75x TTFT, 1.59x TPOT, 1.5x throughput).
// The dynamic policy's switcher prices each step by step_cost's analytic model (--forecast analytic, the engine's
// default) or by the dry run the clock charges (--forecast dry-run: exact to the clock; its events are host work the
// clock charges at the profile's planning rate, which the built-in GPU profiles leave unpriced).
// --switch-csv FILE writes every step of every run (time, tokens, layout; scripts/plot.py draws the dynamic policy's
// batch size and layout over time); --csv FILE one row per trace and policy.
//
// --measure: the validation on this machine. A model that runs here (the synthetic default of moe_infer, or --hf DIR)
// is served on --ranks thread ranks on the wall clock (--rounds rounds after a warm-up, medians) and on the simulated
// clock of this machine's calibrated profile (--cluster FILE.json; written by calibrating the thread ranks first when
// FILE does not exist, on their thread CPU time unless --calibrate-clock wall), the same requests and policies; the
// table gives both and the relative error, for the measured run on the wall clock and on the ranks' thread CPU time
// (serve/clock.hpp's CpuClock, synchronised: each step cut where the ranks met in a collective, comm/cpu_marks.hpp,
// each piece at its slowest rank: the steps as they would take on cores of their own, which other processes sharing the
// cores do not lengthen). The calibration adds the step's own all-reduce sizes, GEMM size classes fitted on the served
// model's own GEMMs cycling through the weights a step reads (each weight from the cache level that holds the rank's
// weights; serve/serving_calibration.hpp; cost/calibrate.hpp calibrate_gemm_classes; --gemm-classes off simulates with
// the single fit alone) and the same GEMMs kept as measured, which price the model's own shapes (cost/profile.hpp
// GemmModel::measured; --gemm-measured off: the classes do), also timed cycling through a decode step's weights and
// through memory's 128 MB, so that the simulated clock can price each GEMM at its weight's reuse distance
// (GemmModel::reuse, cost/gemm_reuse.hpp; --gemm-reuse on; off, the default: at the step's cycle alone), the paged and
// latent attention loops' rates (serve/paged_attention_calibration.hpp) and the dynamic policy's forecast on the host
// (fit_planning_rate: a run served under it); the rows "cpu mem" simulate with the classes calibrated with every weight
// from memory (128 MB a rank) instead, when this run calibrated. The per-step table prices every round's steps on the
// CPU clock (their traces' dry run) against the CPU clock's step and rank 0's own CPU time (and of it the forecast's,
// beside its price), with each round's ratio (the machine's drift between rounds), by kind (decode only, of which right
// after a step with prefill; with prefill); its rows ", fits" price the same steps with the GEMM classes alone (what
// the measured shapes changed), its rows ", reuse distances" with each measured shape at its weight's reuse distance
// (with --gemm-reuse on: ", one cycle", at the step's cycle alone; what the choice changes).
// The policies take turns within each round (a slow or fast spell of the machine falls on one round of each). Each
// round is also simulated at the machine's speed around it: by the GEMM probe (rows "@speed", serve/speed_probe.hpp)
// and by the step probe (rows "cpu @steps", serve/step_probe.hpp: a burst of 32 requests of their own served under
// the round's policy; its steps with a prompt chunk and those of decode tokens alone each at their own slowdown; rows
// "cpu @steps 1": every step at the one slowdown of all together, for comparison). Each row ends in its count of
// cells within the bounds (10% on the p50s and tokens/s, 20% on the p99s). scripts/validate_serving.sh runs it and
// records the load average.
// --record-routing FILE writes the routing of the measured static-TP run (step, layer, tokens, counts per expert),
// which --routing recorded:FILE replays for any shape with the same expert count.
#include "paradyse/cli/flags.hpp"
#include "paradyse/cli/lists.hpp"
#include "paradyse/comm/cpu_marks.hpp"
#include "paradyse/comm/threads.hpp"
#include "paradyse/core/host_malloc.hpp"
#include "paradyse/core/printable.hpp"
#include "paradyse/core/statistics.hpp"
#include "paradyse/cost/calibrate.hpp"
#include "paradyse/serve/cluster_spec.hpp"
#include "paradyse/serve/engine.hpp"
#include "paradyse/serve/model_shape_hf.hpp"
#include "paradyse/serve/named_policies.hpp"
#include "paradyse/serve/paged_attention_calibration.hpp"
#include "paradyse/serve/request_trace.hpp"
#include "paradyse/serve/routing_source.hpp"
#include "paradyse/serve/serving_calibration.hpp"
#include "paradyse/serve/speed_probe.hpp"
#include "paradyse/serve/step_probe.hpp"
#include "paradyse/serve/serving_metrics.hpp"
#include "paradyse/serve/shape_step.hpp"
#include "paradyse/serve/switch_log.hpp"
#include "paradyse/serve/synthetic_decoder.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <filesystem>
#include <limits>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

using namespace paradyse;
using namespace paradyse::serve;

namespace {

struct Options {
  std::string model = "data/model_shapes/mixtral-8x7b.json", cluster = "h100", routing = "zipf:0.5";
  std::string traces = "poisson", rates = "1,2,4,8,16,32,64", policies = "tp,ep,eplb,dynamic";
  int ranks = 8, dtype_bytes = 2, rounds = 3;
  std::int64_t eplb_interval = 1000;
  std::int64_t switch_window = 0;  // dynamic: 0 forecasts the step being planned; K: it and the K steps after it
  bool analytic_forecast = true;   // dynamic: the switcher prices by step_cost's model (else the dry run)
  std::int64_t requests = 200, burst = 32, step_tokens = 512, max_running = 256, prompt_min = 64, prompt_max = 1024,
               output_min = 16, output_max = 256, block_size = 16, azure_requests = 1000;
  double period = 4;
  std::uint64_t seed = 1;
  std::string switch_csv, csv, record_routing, hf, steps_csv;
  bool measure = false;
  // --measure without --hf: the synthetic MoE's layers (2: a whole step reads 14 MB of weights a rank on 2 ranks, at
  // the edge of a 32 MB L3; 8: 54 MB, from memory).
  std::int64_t synthetic_layers = 2;
  // --measure's calibration: thread CPU time (what a rank that owned its core would take; robust to other processes
  // on the cores) or wall time.
  bool calibrate_cpu = true;
  // --measure's calibrations: passes, each measurement the median of theirs (cost/calibration_passes.hpp): one pass's
  // fits move with this shared machine's speed from second to second.
  int calibration_passes = 3;
  // --measure: the profile's GEMM size classes (GemmModel::by_rows) in the simulation; off: its single fit alone.
  bool gemm_classes = true;
  // --measure: the served model's own GEMM shapes priced by their measured times (GemmModel::measured); off: the
  // classes price them.
  bool gemm_measured = true;
  bool gemm_reuse = false;
};

// The table's metrics: serve/serving_metrics.hpp's first five (TTFT and TPOT p50/p99, tokens/s).
constexpr int kShown = tokens_per_s + 1;
constexpr const char* kMetric[kShown] = {"TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "tokens/s"};
// --measure's bounds on a metric's relative error (issue 25's validation): 10% on the medians and throughput, 20% on
// the tails.
constexpr double kBound[kShown] = {0.10, 0.20, 0.10, 0.20, 0.10};

struct Result {
  std::string key, name;
  double metric[kShown] = {};
  std::int64_t steps = 0, ep_steps = 0, switches = 0, rebalances = 0;
  double exposed_ms = 0, rank_imbalance = 1;
  StepCost totals;
};

// serving_metrics' summary of the run, with the rank load's max/mean averaged over the MoE layers.
Result summarize(const std::vector<RequestOutcome>& out, const EngineStats& stats, const DecoderConfig& c) {
  const ServeRun run = summarize_run(out, stats, c);
  Result r;
  std::copy(run.metric, run.metric + kShown, r.metric);
  r.steps = run.steps;
  r.ep_steps = run.ep_steps;
  r.switches = stats.switches;
  r.rebalances = run.rebalances;
  r.exposed_ms = run.metric[exposed_ms];
  double sum = 0;
  int layers = 0;
  for (std::int64_t l = 0; l < c.layers; ++l)
    if (c.is_moe(l) && stats.rank_mean[std::size_t(l)] > 0) sum += run.rank_imbalance[std::size_t(l)], ++layers;
  r.rank_imbalance = layers ? sum / layers : 1.0;
  return r;
}

ForecastModel forecast_of(const Options& o) {
  return o.analytic_forecast ? ForecastModel::analytic : ForecastModel::dry_run;
}

// The policies of `list` (serve/named_policies.hpp's, of them the four a shape serves: tp, ep, eplb, dynamic), each
// with `model` as its time model (the clock's cluster: the dynamic switcher's forecast), EPLB every `eplb_interval`
// steps; the switcher forecasts by `forecast` the step being planned, or with `window` > 0 it and the `window` steps
// after it.
std::vector<NamedPolicy> make_policies(const std::string& list, const SimulatedCluster& model,
                                       std::int64_t eplb_interval, std::int64_t window, ForecastModel forecast) {
  std::vector<NamedPolicy> chosen = select_policies(standard_policies(MachineRates{}), list);
  for (NamedPolicy& p : chosen) {
    p.policy.time_model = model;
    p.policy.eplb_interval = eplb_interval;
    p.policy.switching.window = window;
    p.policy.forecast = forecast;
  }
  return chosen;
}

std::vector<std::string> split(const std::string& s, char by) {
  std::vector<std::string> out;
  std::size_t at = 0;
  while (at <= s.size()) {
    const std::size_t next = s.find(by, at);
    out.push_back(s.substr(at, next == std::string::npos ? std::string::npos : next - at));
    if (next == std::string::npos) break;
    at = next + 1;
  }
  return out;
}

struct NamedTrace {
  std::string name;
  std::vector<TraceRequest> requests;
};

std::vector<NamedTrace> make_traces(const Options& o) {
  const LengthRanges lengths{o.prompt_min, o.prompt_max, o.output_min, o.output_max};
  std::vector<NamedTrace> out;
  for (const std::string& spec : split(o.traces, ',')) {
    if (spec == "poisson") {
      for (const std::string& rate : split(o.rates, ',')) {
        double r = 0;
        try {
          r = std::stod(rate);
        } catch (const std::exception&) {
          throw Error(fmt::format("--rates: \"{}\" is not a number", rate));
        }
        // moe_infer's rule (serve/request_trace.hpp): 1e-300 requests/s simulated an idle day at 0 tokens/s.
        std::vector<TraceRequest> t = poisson_trace(r, o.requests, lengths, o.seed);
        check_trace_span(t, o.rates == rate ? fmt::format("--rates {}", rate)
                                            : fmt::format("--rates {} (its rate {})", o.rates, rate),
                         poisson_shape(r), "raise the rate in --rates or lower --requests");
        out.push_back({fmt::format("Poisson {:g} req/s", r), std::move(t)});
      }
    } else if (spec == "bursty") {
      std::vector<TraceRequest> t = bursty_trace(o.burst, o.period, o.requests, lengths, o.seed);
      check_trace_span(t, fmt::format("--traces bursty --burst {} --period {:g}", o.burst, o.period),
                       bursty_shape(o.burst, o.period), trace_remedy(true));
      out.push_back({fmt::format("bursts of {} every {:g} s", o.burst, o.period), std::move(t)});
    } else if (spec.rfind("azure:", 0) == 0) {
      out.push_back({fmt::format("Azure code trace ({} requests of {})", o.azure_requests, spec.substr(6)),
                     read_azure_trace(spec.substr(6), o.azure_requests)});
    } else {
      throw Error(fmt::format("--traces: \"{}\" is none of poisson, bursty, azure:FILE", spec));
    }
  }
  return out;
}

std::unique_ptr<RoutingSource> make_routing(const std::string& spec, std::uint64_t seed) {
  const std::size_t colon = spec.find(':');
  const std::string kind = spec.substr(0, colon), arg = colon == std::string::npos ? "" : spec.substr(colon + 1);
  if (kind == "zipf") {
    double s = 0;
    try {
      s = std::stod(arg);
    } catch (const std::exception&) {
      throw Error(fmt::format("--routing {}: zipf:S needs an exponent S >= 0", spec));
    }
    return std::make_unique<ZipfRouting>(s, seed);
  }
  if (kind == "published") return std::make_unique<WeightedRouting>(published_routing(arg, seed));
  if (kind == "recorded") return std::make_unique<RecordedRouting>(load_routing_record(arg), arg);
  throw Error(fmt::format("--routing {}: expected zipf:S, published:FILE or recorded:FILE", spec));
}

// KV blocks of `block` positions one device holds beside its share of the weights (EPLB's redundant slots too).
std::int64_t kv_blocks_for(const ModelShape& shape, const SimulatedCluster& cluster, int p, std::int64_t block) {
  const DecoderConfig& c = shape.config;
  const double b = cluster.dtype_bytes;
  double weights = shape.parameters() * b / p;
  for (std::int64_t l = 0; l < c.layers; ++l)
    if (c.is_moe(l)) weights += 3.0 * double(c.hidden) * double(c.moe.expert_ffn) * b;  // one redundant slot
  // Rank 0's cache per position and layer: K and V of its key/value heads, or MLA's compressed latent (replicated).
  const double per_block = double(block) * double(c.layers) * double(c.kv_cache_floats(kv_heads_of(c, p, 0).length)) * b;
  const double free = double(cluster.profile.usable_memory_bytes()) - weights;
  check(free > per_block, "the weights ({:.1f} GB per device) leave no room for the KV cache on {} ({:.1f} GB usable)",
        weights / 1e9, cluster.profile.name, double(cluster.profile.usable_memory_bytes()) / 1e9);
  return std::min<std::int64_t>(std::int64_t(free / per_block), std::int64_t(1) << 20);
}

void print_table(const std::vector<Result>& rows) {
  fmt::print("{:<16} {:>10} {:>10} {:>9} {:>9} {:>9} {:>6} {:>8} {:>8} {:>10} {:>9} {:>10} {:>10} {:>10} {:>10}\n",
             "policy", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "tokens/s", "steps", "EP steps", "sw/rebal",
             "exposed ms", "rank max", "compute s", "comm s", "switch s", "host s");
  for (const Result& r : rows)
    fmt::print("{:<16} {:>8.1f}ms {:>8.1f}ms {:>7.2f}ms {:>7.2f}ms {:>9.0f} {:>6} {:>8} {:>8} {:>10.2f} {:>9.2f} {:>10.3f} "
               "{:>10.3f} {:>10.4f} {:>10.4f}\n",
               r.name, r.metric[ttft50], r.metric[ttft99], r.metric[tpot50], r.metric[tpot99], r.metric[tokens_per_s],
               r.steps, r.ep_steps, fmt::format("{}/{}", r.switches, r.rebalances), r.exposed_ms, r.rank_imbalance,
               r.totals.compute_s, r.totals.communication_s, r.totals.switch_s, r.totals.host_s);
}

// Dynamic over the best static policy per metric (> 1: dynamic better), beside the paper's claims; none without
// dynamic or without a static policy (--policies dynamic alone printed "infx").
std::vector<double> dynamic_ratios(const std::vector<Result>& rows) {
  const Result* dyn = nullptr;
  for (const Result& r : rows)
    if (r.key == "dynamic") dyn = &r;
  std::vector<double> ratio;
  if (!dyn || rows.size() < 2) return ratio;
  for (int m = 0; m < kShown; ++m) {
    double best = m == tokens_per_s ? 0 : std::numeric_limits<double>::infinity();
    for (const Result& r : rows)
      if (r.key != "dynamic") best = m == tokens_per_s ? std::max(best, r.metric[m]) : std::min(best, r.metric[m]);
    ratio.push_back(m == tokens_per_s ? dyn->metric[m] / std::max(1e-12, best) : best / std::max(1e-12, dyn->metric[m]));
  }
  return ratio;
}

int simulate(const Options& o) {
  const ModelShape shape = read_model_shape(o.model);
  const DecoderConfig& c = shape.config;
  const SimulatedCluster cluster = simulated_cluster(o.cluster, o.dtype_bytes);
  std::unique_ptr<RoutingSource> routing = make_routing(o.routing, o.seed);
  EngineOptions opt;
  opt.step_tokens = o.step_tokens;
  opt.max_running = o.max_running;
  opt.block_size = o.block_size;
  opt.kv_blocks = kv_blocks_for(shape, cluster, o.ranks, o.block_size);
  const std::vector<NamedPolicy> policies =
      make_policies(o.policies, cluster, o.eplb_interval, o.switch_window, forecast_of(o));
  fmt::print("moe_simulate: {} ({}: {} layers, h {}, {} heads / {} kv, {} experts top-{}, expert ffn {}, shared {}; "
             "{:.1f}B parameters){} on {} ranks of {} ({} bytes per value), KV pool {} blocks of {}; routing: {}; "
             "step {} tokens, at most {} running; the dynamic policy's forecast: {}\n",
             o.model, shape.architecture, c.layers, c.hidden, c.heads, c.kv_heads, c.moe.experts, c.moe.top_k,
             c.moe.expert_ffn, c.moe.shared_width(), shape.parameters() / 1e9,
             shape.note.empty() ? "" : " [" + shape.note + "]", o.ranks, cluster.profile.name, cluster.dtype_bytes,
             opt.kv_blocks, o.block_size, routing->describe(), o.step_tokens, o.max_running, name_of(forecast_of(o)));
  // Measured GEMM shapes (a profile written by calibrating, or by bench/serve_experts --profile-out) price only GEMMs
  // of their dtype: say so when they cannot apply.
  const cost::GemmMeasured& measured = cluster.profile.gemm.measured;
  if (!measured.shapes.empty() && measured.dtype_bytes != cluster.dtype_bytes)
    fmt::print("note: the profile's {} measured GEMM shapes are of {}-byte values; at {} bytes per value its fits "
               "price every GEMM\n", measured.shapes.size(), measured.dtype_bytes, cluster.dtype_bytes);
  SwitchLog switch_log(o.switch_csv, "--switch-csv");
  CsvTable csv(o.csv,
               {"trace", "policy", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "tokens_per_s", "steps",
                "ep_steps", "switches", "rebalances", "exposed_ms", "rank_imbalance", "compute_s", "communication_s",
                "switch_s", "host_s"},
               CsvTable::OnFailure::warns);
  std::vector<std::pair<std::string, std::vector<double>>> summary;
  for (const NamedTrace& trace : make_traces(o)) {
    const std::vector<ServeRequest> requests = to_serve_requests(trace.requests, c.vocab, o.seed);
    std::vector<Result> rows;
    std::string forecast_line;  // the dynamic policy's forecast: its host CPU here against the clock's charge
    for (const NamedPolicy& pol : policies) {
      SimulatedClock clock(c, cluster);
      EngineOptions run = opt;
      run.clock = &clock;
      clock.observer = switch_log.observer(trace.name, pol.name);
      EngineStats stats;
      std::vector<RequestOutcome> out;
      run_ranks(1, [&](ThreadCommunicator& comm) {
        ShapeStepper stepper(c, o.ranks, run, pol.policy.mode == ModePolicy::static_ep ? MoeMode::ep : MoeMode::tp,
                             *routing);
        out = serve_loop(comm, stepper, requests, run, pol.policy, clock, &stats);
      });
      Result r = summarize(out, stats, c);
      r.key = pol.key;
      r.name = pol.name;
      r.totals = clock.totals();
      if (pol.policy.mode == ModePolicy::dynamic && !stats.step_forecast_s.empty()) {
        const std::size_t steps = stats.step_forecast_s.size();
        const double cpu = std::accumulate(stats.step_forecast_s.begin(), stats.step_forecast_s.end(), 0.0);
        forecast_line = fmt::format("dynamic's forecast ({}): {:.3f} ms of this machine's CPU a step, mean of {} "
                                    "steps (the simulated clock charged {:.3f} ms of host work a step)\n",
                                    name_of(forecast_of(o)), 1e3 * cpu / double(steps), steps,
                                    1e3 * r.totals.host_s / double(steps));
      }
      rows.push_back(r);
      const auto g = [](double x) { return fmt::format("{:.6g}", x); };
      csv.row(trace.name, r.name, g(r.metric[ttft50]), g(r.metric[ttft99]), g(r.metric[tpot50]), g(r.metric[tpot99]),
              g(r.metric[tokens_per_s]), r.steps, r.ep_steps, r.switches, r.rebalances, g(r.exposed_ms),
              g(r.rank_imbalance), g(r.totals.compute_s), g(r.totals.communication_s), g(r.totals.switch_s),
              g(r.totals.host_s));
    }
    fmt::print("\n{} ({} requests)\n", trace.name, requests.size());
    print_table(rows);
    const std::vector<double> ratio = dynamic_ratios(rows);
    if (!ratio.empty()) {
      fmt::print("dynamic vs best static (> 1: dynamic better):");
      for (int m = 0; m < kShown; ++m) fmt::print(" {} {:.2f}x", kMetric[m], ratio[std::size_t(m)]);
      fmt::print("\n");
      summary.push_back({trace.name, ratio});
    }
    fmt::print("{}", forecast_line);
  }
  if (!summary.empty()) {
    fmt::print("\ndynamic vs the best static policy per metric (> 1: dynamic better; the best static is chosen per "
               "metric and trace)\n{:<44}", "trace");
    for (int m = 0; m < kShown; ++m) fmt::print(" {:>9}", kMetric[m]);
    fmt::print("\n");
    for (const auto& [name, ratio] : summary) {
      fmt::print("{:<44}", name);
      for (const double x : ratio) fmt::print(" {:>8.2f}x", x);
      fmt::print("\n");
    }
    fmt::print("{:<44} {:>8}x {:>9} {:>8}x {:>9} {:>8}x\n", "Dynamo-MoE paper (best case, vs vLLM)", "6.75", "", "1.59",
               "", "1.5");
  }
  switch_log.close();
  csv.close();
  if (switch_log.enabled()) fmt::print("wrote {}\n", o.switch_csv);
  if (csv.enabled()) fmt::print("wrote {}\n", o.csv);
  return switch_log.failed() || csv.failed() ? 1 : 0;
}

// ---- --measure: measured on thread ranks against simulated on this machine's calibrated profile ----------------

// The options the profile's GEMM size classes are calibrated with (and the speed probe times its shapes with): the
// serving step's own GEMMs, each cycling through the weights a step reads (serve/serving_calibration.hpp
// serving_gemm_classes: each weight comes from the cache level that holds the rank's weights, as in the step), on the
// calibration's clock.
cost::GemmClassOptions profile_class_options(const Options& o, const DecoderConfig& c) {
  cost::GemmClassOptions classes = serving_gemm_classes(c, o.ranks, o.step_tokens);
  classes.clock = o.calibrate_cpu ? cost::TimeSource::thread_cpu : cost::TimeSource::wall;
  return classes;
}

// The speed probe (serve/speed_probe.hpp): the served model's decode GEMMs, timed as the profile's classes were
// calibrated.
cost::GemmClassOptions speed_probe_of(const Options& o, const DecoderConfig& c) {
  return speed_probe_options(c, o.ranks, profile_class_options(o, c));
}

// The machine's speed against `profile`'s calibration now: the speed probe on every rank at once, over its baseline.
double probe_speed(const Options& o, const DecoderConfig& c, const cost::HardwareProfile& profile) {
  const cost::GemmClassOptions probe = speed_probe_of(o, c);
  double s = 0;
  run_ranks(o.ranks, [&](ThreadCommunicator& comm) {
    const double x = serving_slowdown(comm, probe, profile);
    if (comm.rank() == 0) s = x;
  });
  return s;
}

// The bandwidth at which a decode step's GEMMs read their operands. A serving step reads every active expert's
// weights once, and the next step reads them again after the rest of the model went through the cache: they come
// from memory. calibrate times each shape again and again on the same operands, from cache. Here: 1 and 4 rows
// against an expert's TP slice [2 f/p, h], cycling through copies of it that together exceed the cache (128 MB per
// rank), on every rank at once (as the ranks run); the operand bytes over the time the fit's overhead and FLOP
// terms leave, median over the ranks and rounds.
double cold_weight_bandwidth(const DecoderConfig& c, int ranks, const cost::GemmModel& g, cost::TimeSource clock) {
  const std::int64_t h = c.hidden, n = 2 * std::max<std::int64_t>(1, c.moe.expert_ffn / ranks);
  const std::int64_t copies = std::max<std::int64_t>(8, (std::int64_t(128) << 20) / (n * h * 4));
  std::vector<double> bandwidths;
  std::mutex mutex;
  run_ranks(ranks, [&](ThreadCommunicator& comm) {
    std::vector<Tensor<float>> w;
    for (std::int64_t i = 0; i < copies; ++i) w.emplace_back(Shape{n, h}), w.back().fill(0.25f);
    for (const std::int64_t m : {1, 4}) {
      Tensor<float> x(Shape{m, h}), y(Shape{m, n});
      x.fill(0.5f);
      for (int round = 0; round < 4; ++round) {
        comm.barrier();
        const double start = cost::now_seconds(clock);
        for (const Tensor<float>& wi : w) ops::Cpu::matmul(x.view(), ops::Transpose::no, wi.view(), ops::Transpose::yes, y.view());
        const double each = (cost::now_seconds(clock) - start) / double(copies);
        const double left = each - g.overhead_s - 2.0 * double(m * n * h) / g.flops_per_s;
        if (round > 0 && left > 0) {
          const std::lock_guard lock(mutex);
          bandwidths.push_back(double(m * h + n * h + m * n) * 4 / left);
        }
      }
    }
  });
  check(!bandwidths.empty(), "cold_weight_bandwidth: every measurement was within the fit's overhead and FLOP terms");
  return percentile(bandwidths, 0.5);
}

// One measured step on rank 0: its trace and its wall and CPU time.
struct MeasuredStep {
  StepTrace trace;
  StepTiming timing;
  double end = 0;    // on the run's clock
  double run_s = 0;       // rank 0's thread CPU in the stepper's compute (EngineStats::step_run_s)
  double forecast_s = 0;  // rank 0's thread CPU in the dynamic policy's forecast (EngineStats::step_forecast_s)
};

// The simulated clock's price of each step's trace (one dry runner: its meta shards kept from step to step; the
// steps in turn, each GEMM at its weight's reuse distance after the steps before it).
std::vector<StepCost> price_steps(const DecoderConfig& c, const SimulatedCluster& cluster,
                                  const std::vector<MeasuredStep>& steps) {
  StepDryRunner runner(c);
  std::vector<cost::WeightReads> reads;
  std::vector<StepCost> costs;
  for (const MeasuredStep& s : steps) costs.push_back(simulated_step_cost(runner, s.trace, cluster, &reads));
  return costs;
}

// --steps-csv: one row per step of a run (the clock's view of it), the step's layout, whether it switched, and the
// simulated clock's price of its trace (simulated_s: on the calibrated profile; fits_s: on the profile with the
// GEMMs' measured working-set table, the CPU clock's steps only, else empty).
void write_steps(CsvTable& f, const std::string& policy, const char* clock, int round,
                 const std::vector<MeasuredStep>& steps, const std::vector<StepCost>& costs,
                 const std::vector<StepCost>* fits = nullptr) {
  for (std::size_t i = 0; i < steps.size(); ++i) {
    const MeasuredStep& s = steps[i];
    std::int64_t decodes = 0;
    for (const ChunkShape& ch : s.trace.chunks) decodes += ch.decode ? 1 : 0;
    const auto f9 = [](double x) { return fmt::format("{:.9f}", x); };
    f.row(policy, clock, round, i, f9(s.end), f9(s.timing.step_s), f9(s.timing.cpu_s), f9(s.run_s), s.trace.tokens(),
          decodes, computed_layout(s.trace), s.trace.changes_layout() ? 1 : 0, f9(costs[i].total_s()),
          fits ? f9((*fits)[i].total_s()) : "", s.trace.planning_events, f9(s.forecast_s));
  }
}

// The measured steps of one kind against the simulated clock's cost of the same traces (the dry run): sums over the
// steps of every round on the CPU clock, and each round's own ratio (the machine's drift between rounds).
struct StepGroup {
  std::string kind;
  std::int64_t steps = 0, tokens = 0;
  double cpu_s = 0;    // the CPU clock's step: its pieces at their slowest ranks (what the simulation prices)
  double own_s = 0;    // rank 0's own CPU time in the step
  double run_s = 0;    // of which in the stepper's compute (decoder_step)
  double forecast_s = 0;           // of which in the dynamic policy's forecast
  double forecast_priced_s = 0;    // its price (the trace's planning events at the profile's host rate)
  StepCost simulated;
  double round_low = 0, round_high = 0;  // the rounds' simulated / cpu, smallest and largest
};

// rounds[r]: round r's steps on the CPU clock; costs[r]: the dry run's price of each on `profile`.
std::vector<StepGroup> step_breakdown(const std::vector<std::vector<MeasuredStep>>& rounds,
                                      const std::vector<std::vector<StepCost>>& costs,
                                      const cost::HardwareProfile& profile) {
  // Groups: 0 decode only, 1 of which right after a step with prefill, 2 with prefill, 3 all.
  std::vector<StepGroup> g{{"decode only"}, {"after prefill"}, {"with prefill"}, {"all steps"}};
  for (StepGroup& x : g) x.round_low = std::numeric_limits<double>::infinity();
  for (std::size_t r = 0; r < rounds.size(); ++r) {
    std::array<double, 4> cpu{}, sim{};
    bool after_prefill = false;
    for (std::size_t i = 0; i < rounds[r].size(); ++i) {
      const MeasuredStep& s = rounds[r][i];
      const bool prefill = s.trace.has_prompt();
      const StepCost& cost = costs[r][i];
      const auto add = [&](std::size_t k) {
        StepGroup& x = g[k];
        ++x.steps;
        x.tokens += s.trace.tokens();
        x.cpu_s += s.timing.step_s, cpu[k] += s.timing.step_s;
        x.own_s += s.timing.cpu_s;
        x.run_s += s.run_s;
        x.forecast_s += s.forecast_s;
        x.forecast_priced_s += forecast_host_s(s.trace, profile);
        x.simulated += cost;
        sim[k] += cost.total_s();
      };
      add(prefill ? 2 : 0);
      if (!prefill && after_prefill) add(1);
      add(3);
      after_prefill = prefill;
    }
    for (std::size_t k = 0; k < g.size(); ++k)
      if (cpu[k] > 0)
        g[k].round_low = std::min(g[k].round_low, sim[k] / cpu[k]), g[k].round_high = std::max(g[k].round_high, sim[k] / cpu[k]);
  }
  return g;
}

void print_breakdowns(const std::vector<std::pair<std::string, std::vector<StepGroup>>>& all) {
  std::size_t width = 16;  // the policy column: its longest name
  for (const auto& named : all) width = std::max(width, named.first.size());
  fmt::print("\nper step, every round on the CPU clock against the simulated clock's cost (the dry run) of the same steps' "
             "traces (means, ms): cpu = the step on the CPU clock (each piece between collectives at its slowest rank), rank 0 = rank 0's own, "
             "run = of which in decoder_step, forecast = of which in the dynamic policy's forecast; host = the "
             "engine's host work priced (its bookkeeping, the forecast), of which forecast; rounds = each round's "
             "sim/cpu, smallest to largest\n{:<{}} {:<13} {:>6} {:>7} {:>9} {:>9} {:>9} {:>9} {:>11} {:>9} {:>9} "
             "{:>9} {:>9} {:>9} {:>13}\n",
             "policy", width, "steps", "count", "tokens", "cpu", "rank 0", "run", "forecast", "simulated", "compute",
             "comm", "host", "forecast", "sim/cpu", "rounds");
  for (const auto& [name, groups] : all)
    for (const StepGroup& g : groups) {
      if (g.steps == 0) continue;
      const double k = 1e3 / double(g.steps);
      fmt::print("{:<{}} {:<13} {:>6} {:>7.1f} {:>9.3f} {:>9.3f} {:>9.3f} {:>9.3f} {:>11.3f} {:>9.3f} {:>9.3f} "
                 "{:>9.3f} {:>9.3f} {:>8.2f}x {:>6.2f}-{:.2f}x\n",
                 name, width, g.kind, g.steps, double(g.tokens) / double(g.steps), g.cpu_s * k, g.own_s * k, g.run_s * k,
                 g.forecast_s * k, g.simulated.total_s() * k, g.simulated.compute_s * k,
                 g.simulated.communication_s * k, g.simulated.host_s * k, g.forecast_priced_s * k,
                 g.simulated.total_s() / std::max(1e-12, g.cpu_s), g.round_low, g.round_high);
    }
}
// --measure's engine options for `requests`: the run's step and batch limits, and a KV pool that holds max_running
// requests of the longest (prompt and output).
EngineOptions measure_options(const Options& o, const std::vector<ServeRequest>& requests) {
  EngineOptions opt;
  opt.step_tokens = o.step_tokens, opt.max_running = o.max_running, opt.block_size = o.block_size;
  std::int64_t max_len = 0;
  for (const ServeRequest& r : requests) max_len = std::max(max_len, std::int64_t(r.prompt.size()) + r.max_new_tokens);
  opt.kv_blocks = o.max_running * ((max_len + o.block_size - 1) / o.block_size);
  return opt;
}

// The step probe's requests (serve/step_probe.hpp): a burst of its own, 32 requests of another seed at the run's
// first rate and lengths.
std::vector<ServeRequest> step_probe_requests(const Options& o, const DecoderConfig& c) {
  Options own = o;
  own.seed = o.seed + 2, own.requests = 32, own.traces = "poisson";
  return to_serve_requests(make_traces(own).front().requests, c.vocab, own.seed);
}

// The step probe: `requests` served under `policy` on the synchronised CPU clock; the slowdown at which the simulated
// clock on `cluster` charges their steps what they took. Beside the GEMM probe, it sees what the GEMMs alone do not
// (the engine's steps were priced at 0.71-1.02x their time from run to run while the GEMM probe read the machine at
// its calibrated speed).
StepProbeReading probe_steps(const Options& o, const LoadedDecoder& model, const std::vector<ServeRequest>& requests,
                             const EnginePolicy& policy, const SimulatedCluster& cluster) {
  const EngineOptions options = measure_options(o, requests);
  ServedSteps served;
  run_ranks(o.ranks, [&](ThreadCommunicator& plain) {
    ServedSteps s = serve_on_cpu_clock(std::move(plain), model, requests, options, policy);
    if (!s.traces.empty()) served = std::move(s);
  });
  SimulatedClock priced(model.config, cluster);
  return step_slowdown(served, priced);
}

// The mean of two step probe readings (before and after a round), factor by factor.
StepProbeReading mean_of(const StepProbeReading& a, const StepProbeReading& b) {
  const auto mean = [](double x, double y) { return 0.5 * (x + y); };
  return {{mean(a.by_kind.decode, b.by_kind.decode), mean(a.by_kind.prompt, b.by_kind.prompt)}, mean(a.all, b.all)};
}

// --measure's profile of this machine, calibrated on o.ranks thread ranks for the served model `model` and saved to
// o.cluster: calibrate's fits with the serving step's own GEMMs and messages, the weights' cold bandwidth, the GEMM
// size classes on the step's working set, the paged attention kernel, the dynamic policy's forecast, the engine's
// host work and the steps' spread around their price. Returns a GEMM model holding the classes and measured shapes
// calibrated with every weight from memory instead (simulated beside the profile: the rows "cpu mem"; not saved).
cost::GemmModel calibrate_profile(const Options& o, const LoadedDecoder& model) {
  const DecoderConfig& c = model.config;
  check(o.cluster.size() > 5 && o.cluster.substr(o.cluster.size() - 5) == ".json",
        "--measure: --cluster {} must be a profile .json (written by calibrating when absent)", o.cluster);
  fmt::print("calibrating {} thread ranks ({}) into {} ...\n", o.ranks, o.calibrate_cpu ? "thread CPU time" : "wall clock",
             o.cluster);
  cost::GemmModel gemm_mem;
  cost::HardwareProfile profile;
  // Besides calibrate's compute-bound shapes, the serving steps' own GEMMs at decode batches (1, 4 and 16 rows
  // against an expert's TP slice and whole expert, both products, and the lm_head): bound by reading their
  // weights, they give the fit its operand-bytes term (without them it came out 0 here, and a 1-row GEMM of the
  // synthetic model's 256 x 512 expert slice, measured at 148 us, was modelled at 20 us).
  cost::CalibrationOptions options;
  options.clock = o.calibrate_cpu ? cost::TimeSource::thread_cpu : cost::TimeSource::wall;
  options.call_overheads = true;  // a serving step's kernels run on a handful of rows: their fixed costs show
  options.passes = o.calibration_passes;
  add_decode_gemms(options, c, o.ranks);
  add_serving_messages(options, c, o.step_tokens);  // the step's all-reduces, 0.5-8 KB at decode
  options.copy_memory_bytes = std::int64_t(128) << 20;  // a layout switch's banks: copies from memory
  run_ranks(o.ranks, [&](ThreadCommunicator& comm) {
    const cost::Calibration cal = cost::calibrate<ops::Cpu>(comm, options);
    if (comm.rank() == 0) {
      profile = cal.profile;
      for (const cost::CalibrationSample& x : cal.samples)
        if (x.what.rfind("gemm", 0) == 0 || x.what.rfind("all_reduce", 0) == 0)
          fmt::print("  {:<22} measured {:>9.1f} us, fit {:>9.1f} us\n", x.what, x.measured_s * 1e6, x.fitted_s * 1e6);
    }
  });
  fmt::print("GEMM fit: {:.2f} us + flops / {:.1f} GFLOP/s + operand bytes / {:.2f} GB/s\n", profile.gemm.overhead_s * 1e6,
             profile.gemm.flops_per_s / 1e9, profile.gemm.bytes_per_s / 1e9);
  fmt::print("copies: {:.1f} GB/s read + written (the elementwise rate), {:.1f} GB/s from memory (a switch's banks)\n",
             profile.elementwise_bytes_per_s / 1e9, profile.memory_copy_bytes_per_s / 1e9);
  const double cold = cold_weight_bandwidth(c, o.ranks, profile.gemm, options.clock);
  fmt::print("decode GEMMs with their weights read from memory (not cache), all ranks at once: operand bytes at {:.2f} "
             "GB/s; the profile's GEMM operand term takes it\n", cold / 1e9);
  profile.gemm.bytes_per_s = cold;
  // The size classes (GemmModel::by_rows): decode rows (m <= 16) and a prefill chunk's expert rows (m <= 128) fitted
  // each on its own, on the serving step's own GEMMs; above 128 rows the single fit.
  // The profile's classes cycle through the weights a step reads (each from the cache level that holds the rank's
  // weights, as in the step); the rows "cpu mem" simulate with classes cycling through 128 MB a rank (every weight
  // from memory), which priced the trained 4-layer MoE's decode steps within 10% where other processes on the
  // machine's cache evicted the weights between steps, and 1.5x its measured CPU time on a quiet machine
  // (docs/serving_simulation.md).
  cost::GemmClassOptions classes = profile_class_options(o, c);
  classes.passes = o.calibration_passes;
  cost::GemmClassOptions from_memory = classes, decode_cycle = classes;
  from_memory.cold_bytes = cost::GemmClassOptions{}.cold_bytes;
  decode_cycle.cold_bytes = decode_weight_bytes(c, o.ranks);
  fmt::print("GEMM classes: weights cycled through {:.1f} MB a rank, the weights a step reads (\"mem\": {:.1f} MB); "
             "the shapes also at a decode step's {:.1f} MB and at {:.1f} MB (each GEMM priced at its weight's reuse "
             "distance between them)\n", double(classes.cold_bytes) / 1e6, double(from_memory.cold_bytes) / 1e6,
             double(decode_cycle.cold_bytes) / 1e6, double(from_memory.cold_bytes) / 1e6);
  run_ranks(o.ranks, [&](ThreadCommunicator& comm) {
    const cost::GemmClassCalibration mem = cost::calibrate_gemm_classes<ops::Cpu>(comm, from_memory);
    const cost::GemmClassCalibration decode = cost::calibrate_gemm_classes<ops::Cpu>(comm, decode_cycle);
    const cost::GemmClassCalibration cal = cost::calibrate_gemm_classes<ops::Cpu>(comm, classes);
    if (comm.rank() != 0) return;
    profile.gemm.by_rows = cal.classes;
    profile.gemm.measured = cal.measured;
    // The other cycles ascending, each apart from the step's (a dense step reads every weight in a decode step too;
    // a step of more than 128 MB a rank has memory's cycle below it).
    profile.gemm.reuse.clear();
    for (const cost::GemmMeasured& other : {decode.measured, mem.measured})
      if (other.cycle_bytes != cal.measured.cycle_bytes &&
          std::none_of(profile.gemm.reuse.begin(), profile.gemm.reuse.end(),
                       [&](const cost::GemmMeasured& t) { return t.cycle_bytes == other.cycle_bytes; }))
        profile.gemm.reuse.push_back(other);
    std::sort(profile.gemm.reuse.begin(), profile.gemm.reuse.end(),
              [](const cost::GemmMeasured& a, const cost::GemmMeasured& b) { return a.cycle_bytes < b.cycle_bytes; });
    gemm_mem.by_rows = mem.classes, gemm_mem.measured = mem.measured;
    profile.probe_baseline = probe_baseline(cal.samples, speed_probe_of(o, c), profile);
    const cost::GemmModel single{profile.gemm.overhead_s, profile.gemm.flops_per_s, profile.gemm.bytes_per_s};
    cost::GemmModel classes_only = profile.gemm;
    classes_only.measured = {};
    for (const cost::GemmSample& x : cal.samples) {
      const double m = double(x.m), n = double(x.n), k = double(x.k);
      fmt::print("  gemm {:>3}x{:>4}x{:>4} ws  measured {:>8.1f} us, class fit {:>8.1f} us, single fit {:>8.1f} us\n",
                 x.m, x.n, x.k, x.seconds * 1e6, classes_only.time(m, n, k, 4) * 1e6, single.time(m, n, k, 4) * 1e6);
    }
    for (std::size_t i = 0; i < cal.classes.size(); ++i)
      fmt::print("GEMM class m <= {:g}: {:.2f} us + flops / {:.1f} GFLOP/s + weight bytes / {:.2f} GB/s + outputs / "
                 "{:.1f} M/s (median error {:.1f}%, worst {:.1f}%)\n", cal.classes[i].max_rows,
                 cal.classes[i].overhead_s * 1e6, cal.classes[i].flops_per_s / 1e9, cal.classes[i].bytes_per_s / 1e9,
                 cal.classes[i].outputs_per_s / 1e6, 100 * cal.fits[i].median_relative_error,
                 100 * cal.fits[i].worst_relative_error);
  });
  fmt::print("the speed probe's reading of the calibration's samples: {:.3f} (its baseline: later readings are taken "
             "over it)\n", profile.probe_baseline);
  // The paged attention kernel (serve/paged_attention.hpp) at the served model's head dim and its heads per rank.
  PagedAttentionCalibrationOptions paged;
  paged.clock = options.clock;
  paged.passes = o.calibration_passes;
  paged.head_dims = {c.head_dim, 2 * c.head_dim};
  paged.query_heads = query_heads(c, o.ranks, 0).length;
  paged.kv_heads = kv_heads_of(c, o.ranks, 0).length;
  run_ranks(o.ranks, [&](ThreadCommunicator& comm) {
    const PagedAttentionCalibration cal = calibrate_paged_attention(comm, paged);
    if (comm.rank() != 0) return;
    profile.paged_attention = cal.model;
    fmt::print("paged attention: (query-key pair, head) visits / {:.1f} M/s + 4 d visits / {:.2f} GFLOP/s (median "
               "error {:.1f}%, worst {:.1f}%); flash attention's rate would price them at {:.2f} GFLOP/s\n",
               cal.model.visits_per_s / 1e6, cal.model.flops_per_s / 1e9, 100 * cal.fit.median_relative_error,
               100 * cal.fit.worst_relative_error, profile.attention.forward_flops_per_s / 1e9);
  });
  // MLA's latent attention (serve/mla_attention.hpp): at the served model's latent widths and heads per rank when it
  // is MLA, else at the defaults' (DeepSeek-V2's r_kv 512 among them), so that a DeepSeek shape simulated on this
  // profile prices its own loop.
  LatentAttentionCalibrationOptions latent;
  latent.clock = options.clock;
  latent.passes = o.calibration_passes;
  if (c.is_mla()) {
    latent.ranks = {c.mla.kv_lora_rank};
    latent.heads = {query_heads(c, o.ranks, 0).length};
    latent.rope = c.mla.rope;
  }
  run_ranks(o.ranks, [&](ThreadCommunicator& comm) {
    const LatentAttentionCalibration cal = calibrate_latent_attention(comm, latent);
    if (comm.rank() != 0) return;
    profile.latent_attention = cal.model;
    std::vector<double> paged_over_measured;
    for (const cost::LatentAttentionSample& x : cal.samples)
      paged_over_measured.push_back(profile.paged_attention_time(x.pairs, x.heads, x.width) / x.seconds);
    fmt::print("latent attention (MLA): visits / {:.1f} M/s + 4 d visits / {:.2f} GFLOP/s + d pairs / {:.2f} G/s "
               "(median error {:.1f}%, worst {:.1f}%); the paged kernel's model would price its samples at {:.2f}x "
               "their time (median)\n", cal.model.visits_per_s / 1e6, cal.model.flops_per_s / 1e9,
               cal.model.shared_per_s / 1e9, 100 * cal.fit.median_relative_error,
               100 * cal.fit.worst_relative_error, median(paged_over_measured));
  });
  fmt::print("SwiGLU forward: {:.1f} M elements/s (GELU forward + backward: {:.1f} M/s)\n", profile.swiglu_forward_elements_per_s / 1e6,
             profile.activation_elements_per_s / 1e6);
  fmt::print("fixed cost: {:.2f} us per non-GEMM kernel call\n", profile.call_overhead.kernel_call_s * 1e6);
  // The engine's other host work (planning the batch, statistics, sampling, the broadcasts' own CPU) and the
  // steps' spread around their price: a run of their own (64 requests of another seed at the first rate, static TP
  // on the thread ranks' synchronised CPU time); rank 0's host CPU per step less the control collectives' price
  // (serve/serving_calibration.hpp fit_serving_host), the ranks' spread within a step from each step's wait beyond
  // its slowest rank's own work (fit_rank_jitter), then each step's time over its price on the profile so far
  // (step_jitter_quantiles); and the dynamic policy's forecast on the same requests (fit_planning_rate).
  {
    Options own = o;
    own.seed = o.seed + 1, own.requests = 64, own.traces = "poisson";
    const std::vector<ServeRequest> requests = to_serve_requests(make_traces(own).front().requests, c.vocab, own.seed);
    const double speed_before = probe_speed(o, c, profile);
    ServedSteps served;
    const EngineOptions run = measure_options(o, requests);
    run_ranks(o.ranks, [&](ThreadCommunicator& plain) {
      ServedSteps s = serve_on_cpu_clock(std::move(plain), model, requests, run, EnginePolicy{});
      if (!s.traces.empty()) served = std::move(s);
    });
    std::vector<HostSample> steps;
    for (std::size_t i = 0; i < served.traces.size(); ++i)
      steps.push_back({std::int64_t(served.traces[i].chunks.size()),
                       served.stats.step_host_s[i] - engine_control_s(served.traces[i], profile)});
    const double speed = 0.5 * (speed_before + probe_speed(o, c, profile));
    // The dynamic policy's dry-run forecast before each step (host work on rank 0, while the other ranks wait;
    // ForecastModel::dry_run, whichever forecast this run simulates): the same requests served under it (its switcher
    // pricing on the profile so far), its events over its CPU time.
    if (c.any_moe()) {
      const SimulatedCluster on_profile{profile, 4};
      const NamedPolicy dynamic =
          make_policies("dynamic", on_profile, o.eplb_interval, o.switch_window, ForecastModel::dry_run).front();
      ServedSteps forecasting;
      run_ranks(o.ranks, [&](ThreadCommunicator& plain) {
        ServedSteps s = serve_on_cpu_clock(std::move(plain), model, requests, run, dynamic.policy);
        if (!s.traces.empty()) forecasting = std::move(s);
      });
      std::vector<ForecastSample> forecasts;
      for (std::size_t i = 0; i < forecasting.traces.size(); ++i)
        forecasts.push_back({forecasting.traces[i].planning_events, forecasting.stats.step_forecast_s[i]});
      profile.planning_events_per_s = fit_planning_rate(forecasts);
      const ForecastTotals ran = forecast_totals(forecasts);
      const double per_forecast = 1.0 / double(std::max<std::int64_t>(1, ran.forecasts));
      fmt::print("the dynamic policy's forecast: {:.2f} M dry-run trace events/s on the host (a served run's {} "
                 "steps; {:.0f} events and {:.1f} us a forecast)\n", profile.planning_events_per_s / 1e6,
                 forecasts.size(), ran.events * per_forecast, 1e6 * ran.seconds * per_forecast);
    }
    profile.rank_jitter = fit_rank_jitter(served.timings, o.ranks);
    double kernel_pieces = 0;
    for (const StepTiming& t : served.timings) kernel_pieces += double(t.kernels_end - t.kernels_begin);
    kernel_pieces /= double(std::max<std::size_t>(1, served.timings.size()));
    fmt::print("the ranks' spread within a step: sigma {:.3f} of their kernels (the slowest of {} later by {:.1f}% of "
               "them; {:.1f} pieces a step within the stepper's run)\n", profile.rank_jitter, o.ranks,
               100 * profile.straggle_s(1, o.ranks), kernel_pieces);
    profile.serving_host = fit_serving_host(steps);
    fmt::print("the engine's host work: {:.1f} us a step + {:.2f} us a chunk ({} steps)\n",
               profile.serving_host.step_s * 1e6, profile.serving_host.chunk_s * 1e6, steps.size());
    SimulatedCluster as_simulated{profile, 4};
    cost::use_gemm_engines(as_simulated.profile);
    SimulatedClock priced(c, as_simulated);
    const std::vector<double> ratios = step_price_ratios(served, priced);
    profile.step_jitter = step_jitter_quantiles(ratios);
    if (!profile.step_jitter.empty())
      fmt::print("the steps' spread around their price: {:.2f}x at the 2.5% point, {:.2f}x at 97.5% (the median 1; "
                 "median step {:.2f}x its price, {:.2f}x at the speed the probe read around the run, {:.2f}x)\n",
                 profile.step_jitter.front(), profile.step_jitter.back(), percentile(ratios, 0.5),
                 percentile(ratios, 0.5) / speed, speed);
  }
  cost::save_profile(profile, o.cluster);
  return gemm_mem;
}

int measure(const Options& o) {
  const LoadedDecoder model =
      o.hf.empty() ? synthetic_decoder(synthetic_config(256, o.synthetic_layers, 8, 4, 8, 2, 512, 1024), o.seed, 0.3)
                   : load_decoder(o.hf);
  const DecoderConfig& c = model.config;
  // Calibrated with every weight from memory ("mem"), when this run calibrates.
  const std::optional<cost::GemmModel> gemm_mem =
      std::filesystem::exists(o.cluster) ? std::nullopt : std::optional(calibrate_profile(o, model));
  SimulatedCluster cluster = simulated_cluster(o.cluster, 4);
  const auto loaded_reuse = cluster.profile.gemm.reuse;  // the measured shapes at other cycles, as calibrated
  // The GEMM model the options ask for: off drops the classes and the measured shapes with them (the single fit
  // alone), --gemm-measured off the measured shapes (and their other cycles), --gemm-reuse off their other cycles.
  const auto as_asked = [&](cost::GemmModel& g) {
    if (!o.gemm_classes) g.by_rows.clear();
    if (!o.gemm_classes || !o.gemm_measured) g.measured = {};
    if (!o.gemm_classes || !o.gemm_measured || !o.gemm_reuse) g.reuse.clear();
  };
  as_asked(cluster.profile.gemm);
  // The profile with the GEMM classes and shapes calibrated with every weight from memory, when this run calibrated
  // them: simulated beside it ("mem").
  SimulatedCluster mem_cluster = cluster;
  if (gemm_mem) {
    mem_cluster.profile.gemm.by_rows = gemm_mem->by_rows, mem_cluster.profile.gemm.measured = gemm_mem->measured;
    mem_cluster.profile.gemm.reuse.clear();  // every weight from memory, at any distance
    as_asked(mem_cluster.profile.gemm);
  }
  // The profile's fits alone, when it has measured shapes: the per-step table prices the steps on it too ("fits").
  SimulatedCluster fits_cluster = cluster;
  fits_cluster.profile.gemm.measured = {}, fits_cluster.profile.gemm.reuse.clear();
  // The measured shapes priced the other way than --gemm-reuse asks, when the profile has them at other cycles too: at
  // the calibration's step cycle alone (", one cycle") or each at its weight's reuse distance (", reuse distances").
  SimulatedCluster other_reuse = cluster;
  if (o.gemm_reuse)
    other_reuse.profile.gemm.reuse.clear();
  else if (o.gemm_classes && o.gemm_measured)
    other_reuse.profile.gemm.reuse = loaded_reuse;
  cost::use_gemm_engines(cluster.profile);
  const std::vector<NamedPolicy> policies =
      make_policies(o.policies, cluster, o.eplb_interval, o.switch_window, forecast_of(o));
  const std::vector<NamedPolicy> mem_policies =
      make_policies(o.policies, mem_cluster, o.eplb_interval, o.switch_window, forecast_of(o));
  const bool compare_mem = mem_cluster.profile.gemm.by_rows != cluster.profile.gemm.by_rows ||
                           mem_cluster.profile.gemm.measured != cluster.profile.gemm.measured;
  const bool compare_fits = !cluster.profile.gemm.measured.shapes.empty();
  const bool compare_reuse = cost::prices_reuse(cluster.profile.gemm) != cost::prices_reuse(other_reuse.profile.gemm);
  std::vector<std::pair<std::string, std::vector<StepGroup>>> breakdowns;
  CsvTable steps_csv(o.steps_csv,
                     {"policy", "clock", "round", "step", "end_s", "step_s", "cpu_s", "run_s", "tokens", "decodes",
                      "layout", "switch", "simulated_s", "fits_s", "planning_events", "forecast_s"},
                     CsvTable::OnFailure::warns, "--steps-csv");
  for (const NamedTrace& trace : make_traces(o)) {
    const std::vector<ServeRequest> requests = to_serve_requests(trace.requests, c.vocab, o.seed);
    const EngineOptions opt = measure_options(o, requests);
    fmt::print("\nmoe_simulate --measure: {} ({} layers, h {}, {} experts top-{}, ffn {}), {} thread ranks, {} ({} "
               "requests); simulated on {}; the dynamic policy's forecast: {}\n",
               o.hf.empty() ? "synthetic MoE" : o.hf, c.layers, c.hidden, c.moe.experts, c.moe.top_k, c.moe.expert_ffn,
               o.ranks, trace.name, requests.size(), cluster.profile.name, name_of(forecast_of(o)));
    // kind: 0 the wall clock, 1 the ranks' thread CPU time (serve/clock.hpp's CpuClock, synchronised), 2 simulated,
    // 3 simulated on the profile with the working set's GEMM classes (the policy's time model too).
    // slowdown: the simulated clocks' (the machine's speed against the profile, SimulatedClock::set_slowdown).
    auto serve = [&](std::size_t pi, int kind, RoutingRecorder* recorder, std::vector<MeasuredStep>* steps,
                     StepSlowdown slowdown = {}) {
      std::vector<RequestOutcome> out;
      EngineStats stats;
      run_ranks(o.ranks, [&](ThreadCommunicator& plain) {
        const auto serve_on = [&](auto& comm, std::unique_ptr<EngineClock> own) {
          if (comm.rank() == 0)
            own->observer = [&](const StepTrace& t, const StepTiming& timing, double end) {
              if (recorder) recorder->add(t);
              if (steps) steps->push_back({t, timing, end});
            };
          EngineOptions run = opt;
          run.clock = own.get();
          EngineStats s;
          auto got = serve_requests(comm, model, requests, run, (kind == 3 ? mem_policies : policies)[pi].policy, &s);
          if (comm.rank() == 0) {
            out = std::move(got), stats = s;
            if (steps)
              for (std::size_t i = 0; i < steps->size() && i < s.step_run_s.size(); ++i)
                (*steps)[i].run_s = s.step_run_s[i], (*steps)[i].forecast_s = s.step_forecast_s[i];
          }
        };
        if (kind == 2 || kind == 3) {  // every rank its own (alike)
          auto sim = std::make_unique<SimulatedClock>(c, kind == 2 ? cluster : mem_cluster);
          sim->set_slowdown(slowdown);
          serve_on(plain, std::move(sim));
        } else if (kind == 1) {  // each step's pieces between collectives at their slowest rank (comm/cpu_marks.hpp)
          CpuMarkedCommunicator marked(std::move(plain));
          serve_on(marked, std::make_unique<CpuClock>(CpuClock::synchronised_by(marked)));
        } else {
          serve_on(plain, std::make_unique<WallClock>());
        }
      });
      return summarize(out, stats, c);
    };
    const auto probe = [&] { return probe_speed(o, c, cluster.profile); };  // the machine's speed now
    // The engine's steps now against their price under policy pi (serve/step_probe.hpp).
    const std::vector<ServeRequest> probe_requests = step_probe_requests(o, c);
    const auto probe_engine = [&](std::size_t pi) {
      return probe_steps(o, model, probe_requests, policies[pi].policy, cluster);
    };
    // One policy's measured rounds: each round on both clocks (the per-step table takes the CPU clock's steps,
    // --steps-csv both); simulated at the machine's speed then by the GEMM probe and by the step probe (each probe
    // before and after the round, their mean).
    struct Rounds {
      std::vector<Result> measured, on_cpu, at_speed, at_step, at_step_all;
      std::vector<std::vector<MeasuredStep>> wall_steps, cpu_steps;
      std::vector<double> speed;
      std::vector<StepProbeReading> step_speed;
    };
    std::vector<Rounds> rounds(policies.size());
    RoutingRecorder recorder;
    bool recorded = false;  // static TP's first round was handed the recorder
    const auto tp_records = [&](std::size_t pi, int round) -> RoutingRecorder* {
      if (round != 0 || policies[pi].key != "tp" || o.record_routing.empty()) return nullptr;
      recorded = true;
      return &recorder;
    };
    // The policies take turns within each round (TP, EP, dynamic, TP, ...): the machine's speed drifts by tens of
    // percent over minutes (docs/serving_simulation.md), and a slow or fast spell then falls on one round of every
    // policy rather than on several rounds of one.
    for (std::size_t pi = 0; pi < policies.size(); ++pi) serve(pi, 0, nullptr, nullptr);  // warm-up
    for (int round = 0; round < o.rounds; ++round)
      for (std::size_t pi = 0; pi < policies.size(); ++pi) {
        Rounds& r = rounds[pi];
        const double before = probe();
        const StepProbeReading steps_before = probe_engine(pi);
        r.wall_steps.emplace_back(), r.cpu_steps.emplace_back();
        r.measured.push_back(serve(pi, 0, tp_records(pi, round), &r.wall_steps.back()));
        r.on_cpu.push_back(serve(pi, 1, nullptr, &r.cpu_steps.back()));
        r.step_speed.push_back(mean_of(steps_before, probe_engine(pi)));
        r.speed.push_back(0.5 * (before + probe()));
        r.at_speed.push_back(serve(pi, 2, nullptr, nullptr, StepSlowdown::uniform(r.speed.back())));
        r.at_step.push_back(serve(pi, 2, nullptr, nullptr, r.step_speed.back().by_kind));
        r.at_step_all.push_back(serve(pi, 2, nullptr, nullptr, StepSlowdown::uniform(r.step_speed.back().all)));
      }
    if (recorded) {
      recorder.save(o.record_routing, "--record-routing");
      fmt::print("(recorded the routing of static TP's first round to {})\n", o.record_routing);
    }
    // spread: the measured rounds' (largest - smallest) / median; an error inside it is not resolved by the run.
    // within: the row's errors inside kBound (unrounded).
    fmt::print("{:<16} {:>11} {:>34} {:>34} {:>34} {:>34} {:>34} {:>6}\n", "policy", "clock", "TTFT p50 ms",
               "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms", "tokens/s", "within");
    fmt::print("{:<16} {:>11}", "", "");
    for (int m = 0; m < kShown; ++m) fmt::print(" {:>9} {:>6} {:>9} {:>7}", "measured", "spread", "simulated", "error");
    fmt::print(" {:>6}\n", "bounds");
    for (std::size_t pi = 0; pi < policies.size(); ++pi) {
      const NamedPolicy& pol = policies[pi];
      const auto& [measured, on_cpu, at_speed, at_step, at_step_all, wall_steps, cpu_steps, speed, step_speed] =
          rounds[pi];
      std::vector<MeasuredStep> sim_steps;
      // Every round's CPU-clock steps priced once, for the per-step table and the CSV.
      std::vector<std::vector<StepCost>> cpu_costs, mem_costs, fits_costs, other_reuse_costs;
      for (const std::vector<MeasuredStep>& round : cpu_steps) {
        cpu_costs.push_back(price_steps(c, cluster, round));
        if (compare_mem) mem_costs.push_back(price_steps(c, mem_cluster, round));
        if (compare_fits) fits_costs.push_back(price_steps(c, fits_cluster, round));
        if (compare_reuse) other_reuse_costs.push_back(price_steps(c, other_reuse, round));
      }
      const auto breakdown = [&](const std::string& name, const auto& costs, const SimulatedCluster& on) {
        breakdowns.push_back({name, step_breakdown(cpu_steps, costs, on.profile)});
      };
      breakdown(pol.name, cpu_costs, cluster);
      if (compare_mem) breakdown(pol.name + ", mem", mem_costs, mem_cluster);
      if (compare_fits) breakdown(pol.name + ", fits", fits_costs, fits_cluster);
      if (compare_reuse)
        breakdown(pol.name + (o.gemm_reuse ? ", one cycle" : ", reuse distances"), other_reuse_costs, other_reuse);
      const Result sim = serve(pi, 2, nullptr, &sim_steps);
      if (steps_csv.enabled()) {
        for (int round = 0; round < o.rounds; ++round) {
          const std::vector<MeasuredStep>& wall = wall_steps[std::size_t(round)];
          write_steps(steps_csv, pol.key, "wall", round, wall, price_steps(c, cluster, wall));
          write_steps(steps_csv, pol.key, "cpu", round, cpu_steps[std::size_t(round)], cpu_costs[std::size_t(round)],
                      compare_fits ? &fits_costs[std::size_t(round)] : nullptr);
        }
        write_steps(steps_csv, pol.key, "simulated", 0, sim_steps, price_steps(c, cluster, sim_steps));
      }
      const Result sim_mem = compare_mem ? serve(pi, 3, nullptr, nullptr) : sim;
      // Rows: the wall and CPU clocks against the simulation; then the CPU clock against the simulation with the
      // working set's GEMM classes; then each round against the simulation at its speed, by the GEMM probe (@speed)
      // and by the step probe (@steps) (the median of the rounds' errors).
      for (const auto& [clock_name, runs, simulated, per_round] :
           {std::tuple<const char*, const std::vector<Result>*, const Result*, const std::vector<Result>*>{
                "wall", &measured, &sim, nullptr},
            {"cpu", &on_cpu, &sim, nullptr}, {"cpu mem", &on_cpu, &sim_mem, nullptr},
            {"wall @speed", &measured, nullptr, &at_speed}, {"cpu @speed", &on_cpu, nullptr, &at_speed},
            {"cpu @steps 1", &on_cpu, nullptr, &at_step_all}, {"cpu @steps", &on_cpu, nullptr, &at_step}}) {
        if (simulated == &sim_mem && !compare_mem) continue;
        fmt::print("{:<16} {:>11}", pol.name, clock_name);
        int within = 0;
        for (int m = 0; m < kShown; ++m) {
          std::vector<double> v, x, error;
          for (std::size_t r = 0; r < runs->size(); ++r) {
            const double got = (*runs)[r].metric[m];
            const double sim_m = simulated ? simulated->metric[m] : (*per_round)[r].metric[m];
            v.push_back(got), x.push_back(sim_m), error.push_back((sim_m - got) / std::max(1e-12, got));
          }
          const double med = percentile(v, 0.5);
          const double spread = (*std::max_element(v.begin(), v.end()) - *std::min_element(v.begin(), v.end())) /
                                std::max(1e-12, med);
          const double sim_m = simulated ? simulated->metric[m] : percentile(x, 0.5);
          const double err = simulated ? (sim_m - med) / std::max(1e-12, med) : percentile(error, 0.5);
          fmt::print(" {:>9.2f} {:>5.0f}% {:>9.2f} {:>6.0f}%", med, 100 * spread, sim_m, 100 * err);
          within += std::abs(err) <= kBound[m] ? 1 : 0;
        }
        fmt::print(" {:>4}/{}\n", within, kShown);
      }
      fmt::print("{:<16} {:>11}  speed probe (decode GEMMs, measured / the profile's price, over its baseline) around each round:", pol.name, "");
      for (const double x : speed) fmt::print(" {:.2f}", x);
      fmt::print("\n{:<16} {:>11}  step probe (a burst's steps on the CPU clock / their price) around each round:",
                 pol.name, "");
      for (const StepProbeReading& x : step_speed) fmt::print(" {:.2f}", x.all);
      fmt::print("\n{:<16} {:>11}  the same, steps with a prompt chunk / of decode tokens alone:", pol.name, "");
      for (const StepProbeReading& x : step_speed) fmt::print(" {:.2f}/{:.2f}", x.by_kind.prompt, x.by_kind.decode);
      fmt::print("\n");
    }
    print_breakdowns(breakdowns);
    breakdowns.clear();
  }
  steps_csv.close();
  return steps_csv.failed() ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  retain_freed_host_memory();  // a serving process reuses what it frees (core/host_malloc.hpp)
  Options o;
  cli::Flags flags("moe_simulate", "Serves request traces with the MoE engine on simulated time on a named "
                                        "cluster, every layout policy; --measure validates against thread ranks.");
  flags.text("--model", o.model, "model shape: a Hugging Face config.json (or its folder)", "FILE")
      .nonempty("a config.json or its folder");
  flags.text("--cluster", o.cluster, "a100, h100, h200 (8-GPU NVLink nodes) or a hardware profile .json", "NAME")
      .nonempty("a100, h100, h200 or a hardware profile .json");
  flags.integer("--ranks", o.ranks, 1, 4096, "ranks (GPUs) the engine runs on");
  flags.integer("--dtype-bytes", o.dtype_bytes, 2, 4, "bytes per weight and activation (2: bf16)");
  flags.text("--routing", o.routing, "zipf:S, published:FILE (EPLB statistics JSON) or recorded:FILE", "SOURCE")
      .nonempty("zipf:S, published:FILE or recorded:FILE");
  flags.text("--traces", o.traces, "comma-separated: poisson (at each of --rates), bursty, azure:FILE", "LIST");
  flags.text("--rates", o.rates, "Poisson rates, requests/s (comma-separated)", "LIST");
  flags.integer("--requests", o.requests, std::int64_t(1), std::int64_t(10'000'000), "requests per synthetic trace");
  flags.integer("--azure-requests", o.azure_requests, std::int64_t(0), std::int64_t(10'000'000),
                "first rows of an azure trace (0: all)");
  flags.integer("--burst", o.burst, std::int64_t(1), std::int64_t(1'000'000), "bursty: requests per burst");
  flags.number("--period", o.period, {.min = 0, .max = 1e6, .min_open = true}, "bursty: seconds between bursts");
  flags.integers("--prompt", o.prompt_min, o.prompt_max, std::int64_t(1), std::int64_t(1) << 20, "prompt lengths MIN MAX");
  flags.integers("--output", o.output_min, o.output_max, std::int64_t(1), std::int64_t(1) << 20, "output lengths MIN MAX");
  flags.integer("--step-tokens", o.step_tokens, std::int64_t(1), std::int64_t(1) << 20, "tokens per engine step");
  flags.integer("--max-running", o.max_running, std::int64_t(1), std::int64_t(1) << 20, "requests running at once");
  flags.integer("--eplb-interval", o.eplb_interval, std::int64_t(1), std::int64_t(1) << 40,
                "EP + EPLB: steps between rebalances (moe_infer: 32; vLLM's default: 3000)");
  flags.integer("--switch-window", o.switch_window, std::int64_t(0), std::int64_t(4096),
                "dynamic: forecast the K steps after the one being planned (0: that step alone; SwitchPolicy::window)");
  flags.choice("--forecast", o.analytic_forecast, "analytic", "dry-run",
               "dynamic: the switcher prices a step by step_cost's model (analytic) or by its dry run, what the "
               "simulated clock charges (serve/switch_policy.hpp ForecastModel)");
  flags.text("--policies", o.policies, "comma-separated subset of tp,ep,eplb,dynamic", "LIST");
  flags.integer("--seed", o.seed, std::uint64_t(0), std::numeric_limits<std::uint64_t>::max(), "traces and routing seed");
  flags.text("--switch-csv", o.switch_csv, "write every step (trace, policy, time, tokens, layout) to FILE", "FILE")
      .nonempty("a file name");
  flags.text("--csv", o.csv, "write one row per trace and policy to FILE", "FILE")
      .nonempty("a file name");
  flags.flag("--measure", o.measure, "validate: measured thread ranks against the calibrated profile's simulation");
  flags.text("--hf", o.hf, "--measure: a Hugging Face model folder (default: moe_infer's synthetic MoE)", "DIR")
      .nonempty("a Hugging Face model folder");
  flags.integer("--synthetic-layers", o.synthetic_layers, std::int64_t(1), std::int64_t(64),
                "--measure without --hf: layers of the synthetic MoE (h 256, 8 experts top-2, ffn 512; more layers "
                "put a step's weights further past a CPU's cache)");
  flags.integer("--rounds", o.rounds, 1, 100, "--measure: measured rounds per policy (medians)");
  flags.choice("--calibrate-clock", o.calibrate_cpu, "cpu", "wall",
               "--measure: the calibration's clock when --cluster FILE.json is absent (cpu: each rank's thread CPU "
               "time, as the per-step cpu column; wall: the wall clock, other processes' use of the cores included)");
  flags.integer("--calibration-passes", o.calibration_passes, 1, 15,
                "--measure: passes of each calibration when --cluster FILE.json is absent (each measurement the "
                "median of its passes'; cost/calibration_passes.hpp)");
  flags.choice("--gemm-classes", o.gemm_classes, "on", "off",
               "--measure: simulate with the profile's GEMM size classes (on) or with its single fit alone (off)");
  flags.choice("--gemm-measured", o.gemm_measured, "on", "off",
               "--measure: price the served model's own GEMM shapes by their calibrated times (on) or by the size "
               "classes (off)");
  flags.choice("--gemm-reuse", o.gemm_reuse, "on", "off",
               "--measure: price each of those GEMMs at its weight's reuse distance, between the shapes' times at "
               "the calibrated cycle sizes (on), or at the calibration's step cycle alone (off, the default: closer "
               "to the measured steps at 2 and 8 layers, stop 65)");
  flags.text("--record-routing", o.record_routing, "--measure: write static TP's routing record to FILE", "FILE")
      .nonempty("a file name");
  flags.text("--steps-csv", o.steps_csv,
             "--measure: write every step of every measured round on both clocks and of the simulated run (policy, "
             "clock, round, end, duration, CPU time, rank 0's CPU in the stepper, tokens, decodes, the layout computed "
             "in, whether the step switched, the simulated price and, for the CPU clock's steps, the price with the "
             "measured GEMM table, the dynamic policy's forecast: its dry-run events and rank 0's CPU in it) to FILE",
             "FILE")
      .nonempty("a file name");
  flags.parse(argc, argv);
  if (!o.hf.empty() && o.synthetic_layers != 2)
    flags.fail(fmt::format("--synthetic-layers {}: the synthetic MoE's, not --hf {}'s (its config gives its layers)",
                           o.synthetic_layers, printable(o.hf)));
  // The lists, read strictly (cli/lists.hpp): an empty, unknown or repeated item is refused naming the flag
  // ("--policies tp,dynamc" ran tp alone).
  try {
    const std::vector<std::string> policies = cli::list_items("--policies", o.policies);
    cli::check_known("--policies", o.policies, policies, {"tp", "ep", "eplb", "dynamic"});
    cli::check_unique("--policies", o.policies, policies);
    cli::check_unique("--traces", o.traces, cli::list_items("--traces", o.traces));
    const std::vector<std::string> rates = cli::list_items("--rates", o.rates);
    std::vector<std::string> values;  // as numbers: "4" and "4.0" are the same rate
    for (const std::string& rate : rates) {
      double r = 0;
      if (!cli::parse_number(rate, {.min = 0, .max = 1e6, .min_open = true}, r))
        throw std::invalid_argument(fmt::format("--rates \"{}\": \"{}\" is not a rate in (0, 1e6] requests/s",
                                                printable(o.rates), printable(rate)));
      values.push_back(fmt::format("{:g}", r));
    }
    cli::check_unique("--rates", o.rates, values);
  } catch (const std::exception& e) {
    flags.fail(e.what());
  }
  try {
    return o.measure ? measure(o) : simulate(o);
  } catch (const std::exception& e) {
    fmt::print(stderr, "moe_simulate: {}\n", paradyse::bounded_message(e.what()));  // a filesystem_error echoes paths whole
    return 1;
  }
}
