// examples/moe_infer.cpp: serving a MoE model with the inference engine (serve/engine.hpp) on p thread ranks.
//
// Loads a Hugging Face folder (--model DIR: Mixtral, Qwen2-MoE or OLMoE) or synthesises a Mixtral-shaped MoE with
// seeded random weights (serve/synthetic_decoder.hpp), makes a request trace (serve/request_trace.hpp: Poisson at
// --rate requests/s, or --bursty), serves it under one layout policy (--policy, serve/named_policies.hpp; default
// the dynamic TP<->EP switching) and prints the latency and throughput table (serve/serving_metrics.hpp). --budget X
// serves under an Alloc-MoE activation budget (serve/routing_budget.hpp).
//
// The comparison of every policy in alternating rounds, with verdicts, --explain, --emulate and --csv, is the
// benchmark bench/moe_policies.cpp.
//
//   moe_infer --ranks 2 --requests 32 --rate 8 --policy dynamic
#include "paradyse/cli/flags.hpp"
#include "paradyse/core/host_malloc.hpp"
#include "paradyse/core/printable.hpp"
#include "paradyse/comm/threads.hpp"
#include "paradyse/moe/sensitivity.hpp"
#include "paradyse/serve/engine.hpp"
#include "paradyse/serve/named_policies.hpp"
#include "paradyse/serve/request_trace.hpp"
#include "paradyse/serve/serving_metrics.hpp"
#include "paradyse/serve/synthetic_decoder.hpp"

#include <fmt/format.h>

#include <cstdint>
#include <cstdio>
#include <exception>
#include <limits>
#include <string>
#include <vector>

using namespace paradyse;
using namespace paradyse::serve;

int main(int argc, char** argv) {
  retain_freed_host_memory();  // a serving process reuses what it frees (core/host_malloc.hpp)
  std::string model_dir, policy_key = "dynamic", budget_text, sensitivity;
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
  flags.choice("--policy", policy_key, {"tp", "ep", "eplb", "sort", "ondemand", "dynamic"}, "the layout policy");
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
    NamedPolicy named = select_policies(standard_policies(measure_machine_rates(c.moe, ranks)), policy_key).at(0);
    named.policy.forecast = analytic_forecast ? ForecastModel::analytic : ForecastModel::dry_run;
    if (!budget_text.empty()) {
      SensitivityTable table;
      if (!sensitivity.empty()) {
        table = load_sensitivity(sensitivity);
        check_sensitivity_model(table, model_identity(c), sensitivity);
      }
      named.policy.budget =
          make_routing_budget(c, parse_budget(budget_text), sensitivity.empty() ? nullptr : &table, alloc_t);
      fmt::print("budget {}: {}\n", budget_text, describe(c, named.policy.budget));
    }
    fmt::print("moe_infer: {} ({} layers, h {}, {} experts top-{}, expert ffn {}), {} thread ranks, {} requests, {}, "
               "policy {}\n",
               model_dir.empty() ? "synthetic MoE" : model_dir, c.layers, c.hidden, c.moe.experts, c.moe.top_k,
               c.moe.expert_ffn, ranks, shape.requests, trace_name(shape), named.name);

    std::vector<RequestOutcome> out;
    EngineStats stats;
    run_ranks(ranks, [&](ThreadCommunicator& comm) {
      auto got = serve_requests(comm, model, trace, options, named.policy, comm.rank() == 0 ? &stats : nullptr,
                                [](const EngineProgress& p) {
                                  if (p.step % 8 == 0 || p.finished == p.total)
                                    fmt::print(stderr, "\r  step {:>5}  done {:>4}/{:<4} running {:>3}  mode {}   ",
                                               p.step, p.finished, p.total, p.running, name_of(p.mode));
                                });
      if (comm.rank() == 0) out = std::move(got);
    });
    fmt::print(stderr, "\n");

    const ServeRun run = summarize_run(out, stats, c);
    fmt::print("\n{:<22} {:>9} {:>9} {:>9} {:>9} {:>9} {:>6} {:>8} {:>9} {:>10}\n", "policy", "TTFT p50", "TTFT p99",
               "TPOT p50", "TPOT p99", "tokens/s", "steps", "EP steps", "switches", "exposed ms");
    fmt::print("{:<22} {:>7.1f}ms {:>7.1f}ms {:>7.2f}ms {:>7.2f}ms {:>9.1f} {:>6} {:>8} {:>9.0f} {:>10.2f}\n", named.name,
               run.metric[ttft50], run.metric[ttft99], run.metric[tpot50], run.metric[tpot99],
               run.metric[tokens_per_s], run.steps, run.ep_steps, run.metric[switches], run.metric[exposed_ms]);
    if (run.tpot_requests == 0)
      fmt::print("TPOT is undefined: every request output 1 token (TPOT is the time per token after the first; "
                 "--output 2 or more); its columns show 0\n");
    std::string imbalance;
    for (const double x : run.rank_imbalance) imbalance += fmt::format(" {:.2f}", x);
    fmt::print("rank load max/mean per layer:{}; {:.2f} routed expert activations per token\n", imbalance,
               run.activations);
  } catch (const std::exception& e) {
    fmt::print(stderr, "moe_infer: {}\n", paradyse::bounded_message(e.what()));  // a filesystem_error echoes paths whole
    return 1;
  }
  return 0;
}
