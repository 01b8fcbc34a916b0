// examples/moe_infer.cpp: serving a MoE model with the inference engine (serve/engine.hpp) on p thread ranks.
//
// Loads a Hugging Face folder (--model DIR: Mixtral, Qwen2-MoE, OLMoE, Qwen3-MoE, DeepSeek) or synthesises a
// Mixtral-shaped MoE with seeded random weights (serve/synthetic_decoder.hpp), makes a request trace
// (serve/request_trace.hpp: Poisson at --rate requests/s, or --bursty), serves it under each layout policy of --policy
// (serve/named_policies.hpp; default the dynamic TP<->EP switching) and prints the latency and throughput table
// (serve/serving_metrics.hpp), a row per policy. --budget X serves under an Alloc-MoE activation budget
// (serve/routing_budget.hpp).
//
// --simulate CLUSTER serves on simulated time (serve/clock.hpp SimulatedClock, issue 25): the ranks compute the same
// tokens with the same scheduling, and each step advances the clock by the time model's cost of its dry run on p
// ranks of CLUSTER (serve/cluster_spec.hpp: a100, h100, h200 from their datasheets, or a hardware profile JSON), which
// is also the dynamic policy's time model; every policy by default, then the step-time breakdown (compute, exposed
// communication, exposed switch, host). --switch-csv FILE logs every step's time, tokens and layout
// (serve/switch_log.hpp; scripts/plot.py draws where the dynamic policy switched). Shapes that do not fit here,
// routing sources and production traces: examples/moe_simulate.cpp.
//
// The comparison of every policy in alternating rounds, with verdicts, --explain, --emulate and --csv, is the
// benchmark bench/moe_policies.cpp.
//
//   moe_infer --ranks 2 --requests 32 --rate 8 --policy dynamic
//   moe_infer --ranks 8 --requests 64 --rate 16 --simulate h100 --switch-csv switches.csv
#include "paradyse/cli/flags.hpp"
#include "paradyse/cli/lists.hpp"
#include "paradyse/core/host_malloc.hpp"
#include "paradyse/core/printable.hpp"
#include "paradyse/comm/threads.hpp"
#include "paradyse/moe/sensitivity.hpp"
#include "paradyse/serve/cluster_spec.hpp"
#include "paradyse/serve/engine.hpp"
#include "paradyse/serve/named_policies.hpp"
#include "paradyse/serve/request_trace.hpp"
#include "paradyse/serve/serving_metrics.hpp"
#include "paradyse/serve/switch_log.hpp"
#include "paradyse/serve/synthetic_decoder.hpp"

#include <fmt/format.h>

#include <cstdint>
#include <cstdio>
#include <exception>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

using namespace paradyse;
using namespace paradyse::serve;

int main(int argc, char** argv) {
  retain_freed_host_memory();  // a serving process reuses what it frees (core/host_malloc.hpp)
  std::string model_dir, policy_keys, budget_text, sensitivity, cluster_name, switch_csv;
  int dtype_bytes = 2;
  std::int64_t hidden = 256, layers = 2, experts = 8, top_k = 2, ffn = 512, step_tokens = 64;
  double skew = 0.3;
  int ranks = 2;
  bool alloc_t = false;
  bool analytic_forecast = true;  // dynamic: the switcher prices by step_cost's model (else the dry run)
  TraceShape shape;
  cli::Flags flags("moe_infer", "Serves a request trace on p thread ranks under one MoE layout policy and prints "
                                "latency and throughput (bench/moe_policies compares the policies).");
  flags.text("--model", model_dir, "Hugging Face model folder (default: synthetic Mixtral-shaped MoE)", "DIR")
      .nonempty("a Hugging Face model folder");
  flags.integer("--hidden", hidden, std::int64_t(8), std::int64_t(8192), "synthetic: hidden size");
  flags.integer("--layers", layers, std::int64_t(1), std::int64_t(256), "synthetic: layers");
  flags.integer("--experts", experts, std::int64_t(1), std::int64_t(1024), "synthetic: experts");
  flags.integer("--top-k", top_k, std::int64_t(1), std::int64_t(1024), "synthetic: experts per token");
  flags.integer("--ffn", ffn, std::int64_t(1), std::int64_t(65536), "synthetic: expert width");
  flags.number("--skew", skew, {.min = 0, .max = 10}, "synthetic: router skew");
  flags.integer("--ranks", ranks, 1, 64, "thread ranks");
  flags.integer("--requests", shape.requests, std::int64_t(1), std::int64_t(1'000'000), "requests in the trace");
  flags.number("--rate", shape.rate, {.min = 0, .max = 1e6, .min_open = true}, "Poisson arrivals, requests/s");
  flags.flag("--bursty", shape.bursty, "bursts instead: --burst requests every --period seconds");
  flags.integer("--burst", shape.burst, std::int64_t(1), std::int64_t(1'000'000), "requests per burst");
  flags.number("--period", shape.period, {.min = 0, .max = 1e6, .min_open = true}, "seconds between bursts");
  flags.integers("--prompt", shape.prompt_min, shape.prompt_max, std::int64_t(1), std::int64_t(1) << 20,
                 "prompt length range MIN MAX");
  flags.integers("--output", shape.output_min, shape.output_max, std::int64_t(1), std::int64_t(1) << 20,
                 "output length range MIN MAX");
  flags.integer("--step-tokens", step_tokens, std::int64_t(1), std::int64_t(1) << 20, "tokens per engine step");
  flags.text("--policy", policy_keys,
             "the layout policies, a comma-separated subset of tp,ep,eplb,sort,ondemand,dynamic, or all (default: "
             "dynamic; with --simulate: all)", "LIST")
      .nonempty("a list of policies");
  flags.text("--simulate", cluster_name,
             "serve on simulated time: each step costs its dry run on CLUSTER (a100, h100, h200: 8-GPU NVLink nodes; "
             "or a hardware profile .json); the same tokens and scheduling as on the wall clock", "CLUSTER")
      .nonempty("a cluster (a100, h100, h200) or a hardware profile .json");
  flags.integer("--dtype-bytes", dtype_bytes, 2, 4, "--simulate: bytes per weight and activation priced (2: bf16)");
  flags.text("--switch-csv", switch_csv, "write every step (policy, time, tokens, layout) to FILE", "FILE")
      .nonempty("a file name");
  flags.choice("--forecast", analytic_forecast, "analytic", "dry-run",
               "dynamic: the switcher prices a step by step_cost's model (analytic) or by its dry run "
               "(serve/switch_policy.hpp ForecastModel)");
  flags.integer("--seed", shape.seed, std::uint64_t(0), std::numeric_limits<std::uint64_t>::max(),
                "trace and weights seed");
  flags.text("--budget", budget_text,
             "Alloc-MoE activation budget: a share (\"0.5\", \"50%\") of sum_l top-k or a count (\"3\")", "X")
      .nonempty("a share (\"50%\", \"0.5\") or a count of activations");
  flags.text("--sensitivity", sensitivity,
             "Alloc-L: K_l from this sensitivity table (moe_budget --table); default uniform top-k", "FILE")
      .nonempty("a sensitivity table (moe_budget --table)");
  flags.flag("--alloc-t", alloc_t, "Alloc-T: the budget's K_l * T activations pooled over each chunk's T tokens");
  flags.parse(argc, argv);
  if (budget_text.empty() && (!sensitivity.empty() || alloc_t)) flags.fail("--sensitivity and --alloc-t need --budget");
  if (shape.prompt_min > shape.prompt_max || shape.output_min > shape.output_max)
    flags.fail("--prompt and --output take MIN MAX with MIN <= MAX");
  if (dtype_bytes == 3) flags.fail("--dtype-bytes 3: expected 2 (bf16) or 4 (float)");
  if (cluster_name.empty() && dtype_bytes != 2)
    flags.fail("--dtype-bytes prices a simulated cluster: it needs --simulate");
  // The policies, read strictly (cli/lists.hpp): an empty, unknown or repeated item is refused naming the flag.
  if (policy_keys.empty()) policy_keys = cluster_name.empty() ? "dynamic" : "all";
  if (policy_keys == "all") policy_keys = kPolicyKeys;
  try {
    const std::vector<std::string> keys = cli::list_items("--policy", policy_keys);
    cli::check_known("--policy", policy_keys, keys, {"tp", "ep", "eplb", "sort", "ondemand", "dynamic"});
    cli::check_unique("--policy", policy_keys, keys);
  } catch (const std::exception& e) {
    flags.fail(e.what());
  }
  try {
    const LoadedDecoder model =
        model_dir.empty()
            ? synthetic_decoder([&] {
                const DecoderConfig sc = synthetic_config(hidden, layers, 8, 4, experts, top_k, ffn, 1024);
                check_fits_host(sc, 2, "--experts, --ffn, --hidden or --layers");
                return sc;
              }(), shape.seed, skew)
            : load_decoder(model_dir);
    const DecoderConfig& c = model.config;
    const std::vector<ServeRequest> trace = make_trace(shape, c.vocab);
    const EngineOptions options = serving_options(trace, step_tokens);
    // Simulated: the cluster is the clock's time model and the dynamic policy's; else the policy prices by rates
    // measured on these ranks (EnginePolicy::rates).
    std::optional<SimulatedCluster> cluster;
    if (!cluster_name.empty()) {
      try {
        cluster = simulated_cluster(cluster_name, dtype_bytes);
      } catch (const Error& e) {
        throw Error(fmt::format("--simulate {}: {}", printable(cluster_name), error_reason(e)));
      }
    }
    std::vector<NamedPolicy> policies = select_policies(
        standard_policies(cluster ? MachineRates{} : measure_machine_rates(c.moe, ranks)), policy_keys);
    RoutingBudget budget;
    if (!budget_text.empty()) {
      SensitivityTable table;
      if (!sensitivity.empty()) {
        table = load_sensitivity(sensitivity);
        check_sensitivity_model(table, model_identity(c), sensitivity);
      }
      budget = make_routing_budget(c, parse_budget(budget_text), sensitivity.empty() ? nullptr : &table, alloc_t);
      fmt::print("budget {}: {}\n", budget_text, describe(c, budget));
    }
    for (NamedPolicy& named : policies) {
      named.policy.forecast = analytic_forecast ? ForecastModel::analytic : ForecastModel::dry_run;
      named.policy.time_model = cluster;
      named.policy.budget = budget;
    }
    fmt::print("moe_infer: {} ({} layers, h {}, {} experts top-{}, expert ffn {}), {} thread ranks, {} requests, {}, "
               "{}\n",
               model_dir.empty() ? "synthetic MoE" : model_dir, c.layers, c.hidden, c.moe.experts, c.moe.top_k,
               c.moe.expert_ffn, ranks, shape.requests, trace_name(shape),
               cluster ? fmt::format("simulated on {} ranks of {} ({} bytes per value): each step its dry run's cost",
                                     ranks, cluster->profile.name, dtype_bytes)
                       : std::string("on the wall clock"));

    SwitchLog switch_log(switch_csv, "--switch-csv");
    std::vector<ServeRun> runs;
    std::vector<StepCost> totals;  // simulated: each policy's time by term
    for (const NamedPolicy& named : policies) {
      std::vector<RequestOutcome> out;
      EngineStats stats;
      run_ranks(ranks, [&](ThreadCommunicator& comm) {
        std::unique_ptr<EngineClock> clock;
        if (cluster) clock = std::make_unique<SimulatedClock>(c, *cluster, named.policy.budget);
        else clock = std::make_unique<WallClock>();
        if (comm.rank() == 0) clock->observer = switch_log.observer(trace_name(shape), named.name);
        EngineOptions run = options;
        run.clock = clock.get();
        const auto progress = [&](const EngineProgress& p) {
          if (p.step % 8 == 0 || p.finished == p.total)
            fmt::print(stderr, "\r  {}: step {:>5}  done {:>4}/{:<4} running {:>3}  mode {}   ", named.key, p.step,
                       p.finished, p.total, p.running, name_of(p.mode));
        };
        auto got = serve_requests(comm, model, trace, run, named.policy, comm.rank() == 0 ? &stats : nullptr, progress);
        if (comm.rank() != 0) return;
        out = std::move(got);
        if (cluster) totals.push_back(static_cast<SimulatedClock&>(*clock).totals());
      });
      fmt::print(stderr, "\n");
      runs.push_back(summarize_run(out, stats, c));
    }
    switch_log.close();

    fmt::print("\n{:<22} {:>9} {:>9} {:>9} {:>9} {:>9} {:>6} {:>8} {:>9} {:>10}\n", "policy", "TTFT p50", "TTFT p99",
               "TPOT p50", "TPOT p99", "tokens/s", "steps", "EP steps", "switches", "exposed ms");
    for (std::size_t i = 0; i < runs.size(); ++i) {
      const ServeRun& run = runs[i];
      fmt::print("{:<22} {:>7.1f}ms {:>7.1f}ms {:>7.2f}ms {:>7.2f}ms {:>9.1f} {:>6} {:>8} {:>9.0f} {:>10.2f}\n",
                 policies[i].name, run.metric[ttft50], run.metric[ttft99], run.metric[tpot50], run.metric[tpot99],
                 run.metric[tokens_per_s], run.steps, run.ep_steps, run.metric[switches], run.metric[exposed_ms]);
    }
    if (runs.front().tpot_requests == 0)
      fmt::print("TPOT is undefined: every request output 1 token (TPOT is the time per token after the first; "
                 "--output 2 or more); its columns show 0\n");
    for (std::size_t i = 0; i < runs.size(); ++i) {
      std::string imbalance;
      for (const double x : runs[i].rank_imbalance) imbalance += fmt::format(" {:.2f}", x);
      fmt::print("{}: rank load max/mean per layer:{}; {:.2f} routed expert activations per token\n", policies[i].name,
                 imbalance, runs[i].activations);
    }
    if (cluster) {
      fmt::print("\nstep-time breakdown on {} (simulated ms, summed over the run's steps)\n{:<22} {:>12} {:>12} "
                 "{:>12} {:>12} {:>12}\n", cluster->profile.name, "policy", "compute", "exposed comm", "switch",
                 "host", "busy");
      for (std::size_t i = 0; i < totals.size(); ++i)
        fmt::print("{:<22} {:>10.3f}ms {:>10.3f}ms {:>10.3f}ms {:>10.3f}ms {:>10.3f}ms\n", policies[i].name,
                   1e3 * totals[i].compute_s, 1e3 * totals[i].communication_s, 1e3 * totals[i].switch_s,
                   1e3 * totals[i].host_s, 1e3 * totals[i].total_s());
    }
    if (switch_log.enabled()) fmt::print("wrote {}\n", switch_csv);
    if (switch_log.failed()) return 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "moe_infer: {}\n", paradyse::bounded_message(e.what()));  // a filesystem_error echoes paths whole
    return 1;
  }
  return 0;
}
