// examples/moe_infer.cpp: serves a request trace with the MoE inference engine (serve/engine.hpp) on p thread ranks
// under each layout policy: static TP, static EP, EP + EPLB (the vLLM baselines), EP + token sorting, EP + on-demand
// expert loading from the owning rank, and dynamic TP<->EP switching (ours). Prints TTFT and TPOT (p50, p99),
// throughput, switches and the time they exposed, and the expert load imbalance per layer, with a progress line.
//
// The policies are measured in alternating rounds (serve/policy_rounds.hpp): an untimed warm-up pass of the whole
// trace under every policy, then --rounds R rounds, each running every policy once, round r in the order rotated by
// r; each metric is the median over the rounds with its spread (min-max) beside it, so that a difference between
// policies can be told from the run-to-run error of this shared machine. Every run's greedy tokens are compared with
// those of the same requests served on one rank (p = 1, static TP, the same budget) and a difference stops the
// program. Then dynamic against the best static policy (TP, EP, EP + EPLB) per metric, and a verdict for the trace.
// --explain prints the cost model's predicted MoE time in TP and EP for the batch sizes the static runs saw against
// their measured step times (why the dynamic policy does or does not switch). --emulate NAME paces every collective
// and message of the thread ranks like NAME's NVLink node slowed down to this machine's compute (cost/emulation.hpp).
// --csv FILE writes one row per policy (medians and spreads).
//
// The model: a Hugging Face folder (--model DIR: Mixtral, Qwen2-MoE or OLMoE), or by default a synthetic
// Mixtral-shaped MoE with seeded random weights (serve/synthetic_decoder.hpp; --skew makes the router favour some
// experts). Arrivals: Poisson at --rate requests/s, or --bursty (bursts of --burst requests every --period seconds).
// Prompt and output lengths are uniform in the given ranges (seeded), token ids uniform over the vocabulary.
// --budget X runs every policy under an Alloc-MoE activation budget (serve/routing_budget.hpp): K_l per MoE layer by
// Alloc-L from --sensitivity FILE (the table moe_budget --table writes for this model) or by uniform top-k reduction,
// and with --alloc-t pooled over each chunk's tokens; the first policy is also run at the full budget, in the same
// rounds, as the baseline.
#include "command_line.hpp"

#include "paradyse/comm/threads.hpp"
#include "paradyse/cost/builtin_profiles.hpp"
#include "paradyse/cost/emulation.hpp"
#include "paradyse/moe/sensitivity.hpp"
#include "paradyse/serve/engine.hpp"
#include "paradyse/serve/policy_rounds.hpp"
#include "paradyse/serve/synthetic_decoder.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <map>
#include <numeric>
#include <string>
#include <vector>

using namespace paradyse;
using namespace paradyse::serve;

namespace {

struct Options {
  std::string model;
  std::int64_t hidden = 256, layers = 2, experts = 8, top_k = 2, ffn = 512;
  double skew = 0.3;
  int ranks = 2;
  std::int64_t requests = 32;
  double rate = 8;
  bool bursty = false;
  std::int64_t burst = 12;
  double period = 1.5;
  std::int64_t prompt_min = 8, prompt_max = 64, output_min = 8, output_max = 32;
  std::int64_t step_tokens = 64;
  std::string policies = "tp,ep,eplb,sort,ondemand,dynamic";
  std::uint64_t seed = 1;
  std::string budget, sensitivity;
  bool alloc_t = false;
  int rounds = 3;
  std::string csv, emulate;
  bool explain = false;
};

std::vector<ServeRequest> make_trace(const Options& o, std::int64_t vocab) {
  Rng rng(o.seed * 7919 + 13);
  std::vector<ServeRequest> trace;
  double t = 0;
  for (std::int64_t i = 0; i < o.requests; ++i) {
    ServeRequest r;
    r.id = i;
    if (o.bursty)
      r.arrival = double(i / o.burst) * o.period + 0.001 * double(i % o.burst);
    else
      r.arrival = (t += -std::log(1.0 - rng.uniform()) / o.rate);
    const std::int64_t len = o.prompt_min + std::int64_t(rng.below(std::uint64_t(o.prompt_max - o.prompt_min + 1)));
    for (std::int64_t k = 0; k < len; ++k) r.prompt.push_back(std::int32_t(rng.below(std::uint64_t(vocab))));
    r.max_new_tokens = o.output_min + std::int64_t(rng.below(std::uint64_t(o.output_max - o.output_min + 1)));
    trace.push_back(std::move(r));
  }
  return trace;
}

double percentile(std::vector<double> x, double q) {
  if (x.empty()) return 0;
  std::sort(x.begin(), x.end());
  const double at = q * double(x.size() - 1);
  const std::size_t lo = std::size_t(at), hi = std::min(lo + 1, x.size() - 1);
  return x[lo] + (at - double(lo)) * (x[hi] - x[lo]);
}

// The metrics of one run of one policy.
enum Metric { ttft50, ttft99, tpot50, tpot99, tokens_per_s, switches, exposed_ms, metric_count };
constexpr const char* kMetricName[metric_count] = {"TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms",
                                                   "tokens/s", "switches", "exposed ms"};
constexpr const char* kMetricKey[metric_count] = {"ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms",
                                                  "tokens_per_s", "switches", "exposed_ms"};

struct Run {
  double metric[metric_count] = {};
  std::int64_t rebalances = 0, steps = 0, ep_steps = 0;
  std::vector<double> expert_imbalance, rank_imbalance;  // per layer
  FetchStats fetch;
  double activations = 0;
};

struct Named {
  std::string key, name;
  EnginePolicy policy;
  bool full_budget_baseline = false;
  std::vector<Run> runs;                            // one per round
  std::vector<double> step_s, pred_tp_s, pred_ep_s;  // every step of every round (for --explain)
  std::vector<std::int64_t> step_tokens;
  std::vector<MoeMode> step_mode;
};

Run summarize_run(const std::vector<RequestOutcome>& out, const EngineStats& stats, const DecoderConfig& c) {
  Run run;
  std::vector<double> ttft, tpot;
  std::int64_t tokens = 0;
  for (const RequestOutcome& r : out) {
    ttft.push_back(r.first_token - r.arrival);
    if (r.tokens.size() > 1) tpot.push_back((r.finish - r.first_token) / double(r.tokens.size() - 1));
    tokens += std::int64_t(r.tokens.size());
  }
  run.metric[ttft50] = percentile(ttft, 0.5) * 1e3;
  run.metric[ttft99] = percentile(ttft, 0.99) * 1e3;
  run.metric[tpot50] = percentile(tpot, 0.5) * 1e3;
  run.metric[tpot99] = percentile(tpot, 0.99) * 1e3;
  run.metric[tokens_per_s] = double(tokens) / stats.elapsed_s;
  run.metric[switches] = double(stats.switches);
  run.metric[exposed_ms] = stats.switch_exposed_s * 1e3;
  run.rebalances = stats.rebalances;
  run.steps = stats.steps;
  run.ep_steps = std::count(stats.mode_of_step.begin(), stats.mode_of_step.end(), MoeMode::ep);
  for (std::int64_t l = 0; l < c.layers; ++l) {
    const std::size_t i = std::size_t(l);
    run.expert_imbalance.push_back(stats.expert_mean[i] > 0 ? stats.expert_max[i] / stats.expert_mean[i] : 1.0);
    run.rank_imbalance.push_back(stats.rank_mean[i] > 0 ? stats.rank_max[i] / stats.rank_mean[i] : 1.0);
  }
  run.fetch = stats.fetch;
  run.activations = stats.tokens > 0 ? double(stats.routed_activations) / double(stats.tokens) : 0.0;
  return run;
}

Spread metric_spread(const Named& n, Metric m) {
  std::vector<double> v;
  for (const Run& r : n.runs) v.push_back(r.metric[m]);
  return spread_of(v);
}

// "12.3" or "1234" by magnitude.
std::string number(double x) { return std::abs(x) >= 100 ? fmt::format("{:.0f}", x) : fmt::format("{:.2f}", x); }

}  // namespace

int main(int argc, char** argv) {
  Options o;
  examples::Flags flags("moe_infer", "Serves a request trace on p thread ranks under each MoE layout policy and "
                                     "compares them, in alternating rounds.");
  flags.text("--model", o.model, "Hugging Face model folder (default: synthetic Mixtral-shaped MoE)", "DIR");
  flags.integer("--hidden", o.hidden, std::int64_t(8), std::int64_t(8192), "synthetic: hidden size");
  flags.integer("--layers", o.layers, std::int64_t(1), std::int64_t(256), "synthetic: layers");
  flags.integer("--experts", o.experts, std::int64_t(1), std::int64_t(1024), "synthetic: experts");
  flags.integer("--top-k", o.top_k, std::int64_t(1), std::int64_t(1024), "synthetic: experts per token");
  flags.integer("--ffn", o.ffn, std::int64_t(1), std::int64_t(65536), "synthetic: expert width");
  flags.number("--skew", o.skew, {.min = 0, .max = 10}, "synthetic: router skew");
  flags.integer("--ranks", o.ranks, 1, 64, "thread ranks");
  flags.integer("--requests", o.requests, std::int64_t(1), std::int64_t(1'000'000), "requests in the trace");
  flags.number("--rate", o.rate, {.min = 0, .max = 1e6, .min_open = true}, "Poisson arrivals, requests/s");
  flags.flag("--bursty", o.bursty, "bursts instead: --burst requests every --period seconds");
  flags.integer("--burst", o.burst, std::int64_t(1), std::int64_t(1'000'000), "requests per burst");
  flags.number("--period", o.period, {.min = 0, .max = 1e6, .min_open = true}, "seconds between bursts");
  flags.integers("--prompt", o.prompt_min, o.prompt_max, std::int64_t(1), std::int64_t(1) << 20,
                 "prompt length range MIN MAX");
  flags.integers("--output", o.output_min, o.output_max, std::int64_t(1), std::int64_t(1) << 20,
                 "output length range MIN MAX");
  flags.integer("--step-tokens", o.step_tokens, std::int64_t(1), std::int64_t(1) << 20, "tokens per engine step");
  flags.text("--policies", o.policies, "comma-separated subset of tp,ep,eplb,sort,ondemand,dynamic", "LIST");
  flags.integer("--seed", o.seed, std::uint64_t(0), std::numeric_limits<std::uint64_t>::max(),
                "trace and weights seed");
  flags.text("--budget", o.budget,
             "Alloc-MoE activation budget: a share (\"0.5\", \"50%\") of sum_l top-k or a count (\"3\")", "X");
  flags.text("--sensitivity", o.sensitivity,
             "Alloc-L: K_l from this sensitivity table (moe_budget --table); default uniform top-k", "FILE");
  flags.flag("--alloc-t", o.alloc_t, "Alloc-T: the budget's K_l * T activations pooled over each chunk's T tokens");
  flags.integer("--rounds", o.rounds, 1, 1000, "rounds: every policy once per round, in a rotated order");
  flags.text("--csv", o.csv, "write one row per policy (medians and spreads over the rounds) to FILE", "FILE");
  flags.flag("--explain", o.explain,
             "print the cost model's predicted TP and EP time against the measured steps, per batch size");
  flags.choice("--emulate", o.emulate, {"a100", "h100", "h200"},
               "pace the thread ranks' communication like this NVLink node, slowed to this machine's compute");
  flags.parse(argc, argv);
  const auto usage = [&flags](const std::string& problem) { flags.fail(problem); };
  if (o.budget.empty() && (!o.sensitivity.empty() || o.alloc_t)) usage("--sensitivity and --alloc-t need --budget");
  if (o.prompt_min > o.prompt_max) usage(fmt::format("--prompt {} {}: the minimum exceeds the maximum", o.prompt_min, o.prompt_max));
  if (o.output_min > o.output_max) usage(fmt::format("--output {} {}: the minimum exceeds the maximum", o.output_min, o.output_max));
  try {
    const LoadedDecoder model =
        o.model.empty()
            ? synthetic_decoder(synthetic_config(o.hidden, o.layers, 8, 4, o.experts, o.top_k, o.ffn, 1024), o.seed, o.skew)
            : load_decoder(o.model);
    const DecoderConfig& c = model.config;
    const std::vector<ServeRequest> trace = make_trace(o, c.vocab);
    std::int64_t max_len = 0;
    for (const ServeRequest& r : trace) max_len = std::max(max_len, std::int64_t(r.prompt.size()) + r.max_new_tokens);
    EngineOptions opt;
    opt.wall_clock = true;
    opt.step_tokens = o.step_tokens;
    opt.max_running = 64;
    opt.block_size = 16;
    opt.kv_blocks = 64 * ((max_len + 15) / 16);
    const std::string trace_name =
        o.bursty ? fmt::format("bursts of {} every {} s", o.burst, o.period)
                 : (o.rate >= 1000 ? fmt::format("Poisson {} req/s (saturated)", o.rate)
                                                                             : fmt::format("Poisson {} req/s", o.rate));
    fmt::print("moe_infer: {} ({} layers, h {}, {} experts top-{}, expert ffn {}), {} thread ranks, {} requests, {}, "
               "{} rounds\n",
               o.model.empty() ? "synthetic MoE" : o.model, c.layers, c.hidden, c.moe.experts, c.moe.top_k,
               c.moe.expert_ffn, o.ranks, o.requests, trace_name, o.rounds);

    EnginePolicy tp, ep, eplb, sort, ondemand, dyn;
    ep.mode = ModePolicy::static_ep;
    eplb.mode = ModePolicy::static_ep;
    eplb.eplb = true;
    eplb.eplb_interval = 32;
    sort.mode = ModePolicy::static_ep;
    sort.token_sorting = true;
    ondemand.mode = ModePolicy::static_ep;
    ondemand.on_demand = true;
    dyn.mode = ModePolicy::dynamic;
    dyn.switching = {0.1, 2, 8};
    const MachineRates rates = measure_machine_rates(c.moe, o.ranks);
    const double tp_cols = double(std::max<std::int64_t>(1, c.moe.expert_ffn / o.ranks)), ep_cols = double(c.moe.expert_ffn);
    fmt::print("cost model rates (measured): GEMM {:.1f} GFLOP/s at the TP slice's {:g} columns, {:.1f} at the EP "
               "expert's {:g} (F {:.1f}, half rate at {:.0f} columns), weights streamed at {:.1f} GB/s\n",
               rates.gemm_rate(tp_cols) / 1e9, tp_cols, rates.gemm_rate(ep_cols) / 1e9, ep_cols,
               rates.flops_per_s / 1e9, rates.half_rate_columns, rates.memory_bytes_per_s / 1e9);
    RunOptions run_options;
    if (!o.emulate.empty()) {
      cost::HardwareProfile machine;
      machine.name = "this machine";
      machine.gemm.flops_per_s = rates.gemm_rate(ep_cols);  // measured, not the fit's extrapolated peak
      const cost::Emulation e = cost::emulate(cost::builtin_profile(o.emulate), machine);
      run_options.pacing = e.pacing;
      fmt::print("emulated links: {}'s NVLink slowed {:.0f}x (its GEMM rate over this machine's): launch {:.3g} ms, "
                 "{:.3g} ms per ring step, collectives {:.3g} MB/s, point to point {:.3g} MB/s\n",
                 o.emulate, e.slowdown, e.pacing.launch_s * 1e3, e.pacing.alpha_s * 1e3,
                 1e-6 / e.pacing.collective_s_per_byte, 1e-6 / e.pacing.p2p_s_per_byte);
    }
    std::vector<Named> all;
    all.push_back({"tp", "static TP", tp});
    all.push_back({"ep", "static EP", ep});
    all.push_back({"eplb", "EP + EPLB", eplb});
    all.push_back({"sort", "EP + token sorting", sort});
    all.push_back({"ondemand", "EP + on-demand", ondemand});
    all.push_back({"dynamic", "dynamic TP/EP", dyn});
    for (Named& n : all) n.policy.rates = rates;  // the switcher's, and every policy's predicted costs (--explain)
    {
      std::vector<Named> selected;
      for (const Named& n : all)
        if (("," + o.policies + ",").find("," + n.key + ",") != std::string::npos) selected.push_back(n);
      if (selected.empty()) usage(fmt::format("--policies {}: none of tp,ep,eplb,sort,ondemand,dynamic", o.policies));
      all = selected;
    }
    if (!o.budget.empty()) {  // every policy under the budget; the first selected one also at the full budget
      SensitivityTable table;
      if (!o.sensitivity.empty()) table = load_sensitivity(o.sensitivity);
      const RoutingBudget budget =
          make_routing_budget(c, parse_budget(o.budget), o.sensitivity.empty() ? nullptr : &table, o.alloc_t);
      fmt::print("budget {}: {} ({})\n", o.budget, describe(c, budget),
                 o.sensitivity.empty() ? "uniform top-k reduction" : "Alloc-L from " + o.sensitivity);
      std::vector<Named> budgeted;
      for (const Named& n : all) {
        if (budgeted.empty()) budgeted.push_back({n.key, n.name + " (full)", n.policy, true});
        Named b = n;
        b.name += " (budget)";
        b.policy.budget = budget;
        budgeted.push_back(b);
      }
      all = budgeted;
    }

    // The reference: every request served on one rank, static TP, with each budget the policies use (saturated:
    // greedy tokens do not depend on when a request arrives or who shares its batch).
    std::map<bool, std::vector<RequestOutcome>> reference;  // by "has a budget"
    const bool check_tokens = !o.alloc_t;  // Alloc-T pools over a chunk, and the chunks depend on the batch
    if (check_tokens)
      for (const Named& n : all) {
        const bool budgeted = n.policy.budget.active();
        if (reference.count(budgeted)) continue;
        std::vector<ServeRequest> at_once = trace;
        for (ServeRequest& r : at_once) r.arrival = 0;
        EngineOptions one = opt;
        one.wall_clock = false;
        EnginePolicy policy;
        policy.budget = n.policy.budget;
        run_ranks(1, [&](ThreadCommunicator& comm) { reference[budgeted] = serve_requests(comm, model, at_once, one, policy); });
      }
    auto check_against_reference = [&](const Named& n, const std::vector<RequestOutcome>& out, int round) {
      if (!check_tokens) return;
      const std::vector<RequestOutcome>& ref = reference.at(n.policy.budget.active());
      check(out.size() == ref.size(), "moe_infer: {} returned {} requests, expected {}", n.name, out.size(), ref.size());
      for (std::size_t i = 0; i < out.size(); ++i)
        if (out[i].tokens != ref[i].tokens) {
          std::size_t at = 0;
          while (at < std::min(out[i].tokens.size(), ref[i].tokens.size()) && out[i].tokens[at] == ref[i].tokens[at]) ++at;
          throw Error(fmt::format("{} (round {}) generated other greedy tokens than p = 1 for request {}: token {} is {}, "
                                  "p = 1 gives {}", n.name, round, out[i].id, at,
                                  at < out[i].tokens.size() ? fmt::format("{}", out[i].tokens[at]) : "missing",
                                  at < ref[i].tokens.size() ? fmt::format("{}", ref[i].tokens[at]) : "missing"));
        }
    };
    if (!check_tokens)
      fmt::print("(--alloc-t: the greedy tokens are not compared with p = 1: Alloc-T pools each chunk, and how a prompt "
                 "is chunked depends on its batch)\n");

    auto serve = [&](const Named& n, const std::vector<ServeRequest>& requests, EngineStats* stats,
                     const std::string& label) {
      std::vector<RequestOutcome> out;
      run_ranks(
          o.ranks,
          [&](ThreadCommunicator& comm) {
            auto got = serve_requests(comm, model, requests, opt, n.policy, comm.rank() == 0 ? stats : nullptr,
                                      [&](const EngineProgress& p) {
                                        if (p.step % 8 == 0 || p.finished == p.total)
                                          fmt::print(stderr, "\r  {:<12} {:<29} step {:>5}  done {:>4}/{:<4} running {:>3}  mode {}   ",
                                                     label, n.name, p.step, p.finished, p.total, p.running, name_of(p.mode));
                                      });
            if (comm.rank() == 0) out = std::move(got);
          },
          run_options);
      fmt::print(stderr, "\n");
      return out;
    };
    {  // the warm-up pass (not counted): the whole trace at once under every policy, so that no policy pays the
       // first touch of the weights, the pools and the KV cache
      std::vector<ServeRequest> at_once = trace;
      for (ServeRequest& r : at_once) r.arrival = 0;
      for (const Named& n : all) {
        EngineStats stats;
        serve(n, at_once, &stats, "warm-up");
      }
    }
    for (int round = 0; round < o.rounds; ++round)
      for (const std::size_t i : rotated_order(all.size(), std::size_t(round))) {
        Named& n = all[i];
        EngineStats stats;
        const std::vector<RequestOutcome> out = serve(n, trace, &stats, fmt::format("round {}/{}", round + 1, o.rounds));
        check_against_reference(n, out, round + 1);
        n.runs.push_back(summarize_run(out, stats, c));
        for (std::size_t k = 0; k < stats.step_seconds.size(); ++k) {
          n.step_s.push_back(stats.step_seconds[k]);
          n.step_tokens.push_back(stats.step_tokens[k]);
          n.pred_tp_s.push_back(stats.predicted[k].tp_s);
          n.pred_ep_s.push_back(stats.predicted[k].ep_s);
          n.step_mode.push_back(stats.mode_of_step[k]);
        }
      }
    if (check_tokens)
      fmt::print("greedy tokens: every run of every policy equals p = 1 ({} requests, {} runs)\n", trace.size(),
                 all.size() * std::size_t(o.rounds));

    // ---- the table: medians over the rounds, then the spreads ----
    const auto median_of = [](std::vector<double> v) { return spread_of(std::move(v)).median; };
    fmt::print("\nmedians over {} rounds\n{:<29} {:>9} {:>9} {:>9} {:>9} {:>9} {:>6} {:>8} {:>9} {:>10} {:>14} {:>9}\n",
               o.rounds, "policy", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "tokens/s", "steps", "EP steps",
               "sw/rebal", "exposed ms", "rank max/mean", "act/token");
    for (const Named& n : all) {
      std::vector<double> steps, ep_steps, rebalances, activations;
      for (const Run& r : n.runs)
        steps.push_back(double(r.steps)), ep_steps.push_back(double(r.ep_steps)),
            rebalances.push_back(double(r.rebalances)), activations.push_back(r.activations);
      std::string imbalance;
      for (std::size_t l = 0; l < n.runs[0].rank_imbalance.size(); ++l) {
        std::vector<double> v;
        for (const Run& r : n.runs) v.push_back(r.rank_imbalance[l]);
        imbalance += fmt::format("{}{:.2f}", imbalance.empty() ? "" : " ", median_of(v));
      }
      fmt::print("{:<29} {:>7.1f}ms {:>7.1f}ms {:>7.2f}ms {:>7.2f}ms {:>9.1f} {:>6.0f} {:>8.0f} {:>9} {:>10.2f} {:>14} {:>9.2f}\n",
                 n.name, metric_spread(n, ttft50).median, metric_spread(n, ttft99).median,
                 metric_spread(n, tpot50).median, metric_spread(n, tpot99).median,
                 metric_spread(n, tokens_per_s).median, median_of(steps), median_of(ep_steps),
                 fmt::format("{:g}/{:g}", metric_spread(n, switches).median, median_of(rebalances)),
                 metric_spread(n, exposed_ms).median, imbalance, median_of(activations));
    }
    fmt::print("\nspreads over the rounds (min-max)\n{:<29}", "policy");
    for (int m = 0; m < metric_count; ++m) fmt::print(" {:>17}", kMetricName[m]);
    fmt::print("\n");
    for (const Named& n : all) {
      fmt::print("{:<29}", n.name);
      for (int m = 0; m < metric_count; ++m) {
        const Spread s = metric_spread(n, Metric(m));
        fmt::print(" {:>17}", fmt::format("{}-{}", number(s.min), number(s.max)));
      }
      fmt::print("\n");
    }
    {
      std::string experts;
      for (double x : all[0].runs[0].expert_imbalance) experts += fmt::format(" {:.2f}", x);
      fmt::print("expert load max/mean per layer (routing, {}, round 1):{}\n", all[0].name, experts);
    }
    fmt::print("(sw/rebal: TP<->EP switches / EPLB placements installed; exposed ms: the time both took on the critical "
               "path; rank max/mean: per MoE layer, the rows of the busiest rank over the mean, summed over steps; act/token: routed "
               "expert activations per token summed over the MoE layers)\n");
    for (const Named& n : all)
      if (n.runs[0].fetch.fetches) {
        const FetchStats& f = n.runs[0].fetch;
        fmt::print("{} (round 1): {} experts fetched ({:.1f} MB), {} cache hits, {} evictions{}\n", n.name, f.fetches,
                   double(f.bytes_fetched) / 1e6, f.hits, f.evictions,
                   f.wait_s > 0 ? fmt::format("; rank 0 waited {:.1f} ms on fetch messages", f.wait_s * 1e3) : std::string());
      }

    // ---- dynamic against the best static policy ----
    const auto find = [&](const std::string& key) -> const Named* {
      for (const Named& n : all)
        if (n.key == key && !n.full_budget_baseline) return &n;
      return nullptr;
    };
    const Named* dyn_row = find("dynamic");
    std::vector<const Named*> statics;
    for (const char* key : {"tp", "ep", "eplb"})
      if (const Named* n = find(key)) statics.push_back(n);
    std::map<int, PolicyComparison> versus;
    if (dyn_row && !statics.empty()) {
      fmt::print("\ndynamic vs best static (of {}): ratio > 1 means dynamic is better\n{:<12} {:>18} {:>28} {:>8}  {}\n",
                 [&] { std::string s; for (const Named* n : statics) s += (s.empty() ? "" : ", ") + n->name; return s; }(),
                 "metric", "dynamic (min-max)", "best static (min-max)", "ratio", "verdict");
      for (const Metric m : {ttft50, ttft99, tpot50, tpot99, tokens_per_s}) {
        std::vector<Spread> base;
        for (const Named* n : statics) base.push_back(metric_spread(*n, m));
        const Spread d = metric_spread(*dyn_row, m);
        const PolicyComparison cmp = compare_to_best(d, base, m == tokens_per_s ? Better::higher : Better::lower);
        versus[m] = cmp;
        const Spread& b = base[cmp.best];
        fmt::print("{:<12} {:>18} {:>28} {:>7.2f}x  {}\n", kMetricName[m],
                   fmt::format("{} ({}-{})", number(d.median), number(d.min), number(d.max)),
                   fmt::format("{} {} ({}-{})", statics[cmp.best]->name, number(b.median), number(b.min), number(b.max)),
                   cmp.ratio, name_of(cmp.verdict));
      }
      for (const Named* n : statics)
        fmt::print("dynamic vs {:<10}: TTFT p50 {:.2f}x, TPOT p50 {:.2f}x lower; throughput {:.2f}x (medians)\n", n->name,
                   metric_spread(*n, ttft50).median / std::max(1e-9, metric_spread(*dyn_row, ttft50).median),
                   metric_spread(*n, tpot50).median / std::max(1e-9, metric_spread(*dyn_row, tpot50).median),
                   metric_spread(*dyn_row, tokens_per_s).median / std::max(1e-9, metric_spread(*n, tokens_per_s).median));
      // The verdict of the trace, on the metrics a user sees: TTFT p50, TPOT p50 and throughput.
      std::vector<double> ep_share;
      for (const Run& r : dyn_row->runs) ep_share.push_back(r.steps ? double(r.ep_steps) / double(r.steps) : 0.0);
      const double dyn_ep = median_of(ep_share), dyn_switches = metric_spread(*dyn_row, switches).median,
                   dyn_exposed = metric_spread(*dyn_row, exposed_ms).median;
      // Dynamic with no switch and no EP step did exactly static TP's work: a measured gap to static TP is the
      // machine's run-to-run error (beyond the rounds' spread), not the policy.
      const bool same_as_tp = dyn_switches == 0 && dyn_ep == 0;
      int slower = 0, faster = 0;
      std::string which, noise;
      for (const Metric m : {ttft50, tpot50, tokens_per_s}) {
        const PolicyComparison& cmp = versus[m];
        if (cmp.verdict == Verdict::within_noise) continue;
        const std::string text = fmt::format("{} {:.2f}x vs {}", kMetricName[m], cmp.ratio, statics[cmp.best]->name);
        if (same_as_tp && statics[cmp.best]->key == "tp") {
          noise += (noise.empty() ? "" : ", ") + text;
          continue;
        }
        (cmp.verdict == Verdict::slower ? slower : faster) += 1;
        which += (which.empty() ? "" : ", ") + text;
      }
      const std::string how =
          same_as_tp ? std::string("it stayed in TP on every step, as static TP")
                     : fmt::format("it ran {:.0f}% of its steps in EP, {:g} switches exposing {:.1f} ms", 100 * dyn_ep,
                                   dyn_switches, dyn_exposed);
      const std::string noise_note =
          noise.empty() ? std::string()
                        : fmt::format("; {}: the same work as static TP, so run-to-run error beyond the rounds' spread",
                                      noise);
      if (slower == 0 && faster == 0)
        fmt::print("verdict ({}): dynamic matches the best static policy within noise ({}{})\n", trace_name, how,
                   noise_note);
      else if (slower == 0)
        fmt::print("verdict ({}): dynamic faster ({}; {}{})\n", trace_name, which, how, noise_note);
      else
        fmt::print("verdict ({}): dynamic slower ({}; why: {}{}{})\n", trace_name, which, how,
                   same_as_tp ? ", the cost model predicting TP cheaper than EP by the margin at the batches it saw "
                                "(--explain) while an EP policy measured faster"
                              : "",
                   noise_note);
    }
    if (!o.budget.empty() && all.size() >= 2)  // all[0]: the first policy at the full budget, all[1]: budgeted
      fmt::print("{} vs {}: TTFT p50 {:.2f}x, TPOT p50 {:.2f}x lower; throughput {:.2f}x (medians)\n", all[1].name,
                 all[0].name, metric_spread(all[0], ttft50).median / std::max(1e-9, metric_spread(all[1], ttft50).median),
                 metric_spread(all[0], tpot50).median / std::max(1e-9, metric_spread(all[1], tpot50).median),
                 metric_spread(all[1], tokens_per_s).median / std::max(1e-9, metric_spread(all[0], tokens_per_s).median));

    // ---- --explain: the cost model against the measured steps, per batch size ----
    if (o.explain) {
      const Named* tp_row = find("tp");
      const Named* ep_row = find("ep");
      if (!tp_row || !ep_row) {
        fmt::print("\n--explain needs tp and ep among --policies\n");
      } else {
        fmt::print("\nthe cost model against the measured steps (every step of every round; medians per batch size): "
                   "measured: whole decoder step in static TP / static EP; model: the MoE layers only (the rest is the "
                   "same in both layouts, so compare the TP-EP differences), for each step's routing, at the measured "
                   "rates; dynamic switches to EP when the model's EP is {:.0f}% below TP\n", 100 * dyn.switching.margin);
        fmt::print("{:>10} {:>11} {:>9} {:>9} {:>9} {:>11} {:>11} {:>11} {:>12} {:>7} {:>11} {:>8}\n", "tokens",
                   "steps TP/EP", "TP ms", "EP ms", "TP-EP ms", "model TP ms", "model EP ms", "model TP-EP",
                   "TP/EP model", "faster", "model picks", "dyn EP %");
        for (std::int64_t lo = 1; lo <= o.step_tokens; lo *= 2) {
          const std::int64_t hi = std::min(2 * lo - 1, o.step_tokens);
          auto pick = [&](const Named* n, const std::vector<double>& of) {
            std::vector<double> v;
            for (std::size_t k = 0; k < n->step_tokens.size(); ++k)
              if (n->step_tokens[k] >= lo && n->step_tokens[k] <= hi) v.push_back(of[k]);
            return v;
          };
          const std::vector<double> tp_s = pick(tp_row, tp_row->step_s), ep_s = pick(ep_row, ep_row->step_s);
          if (tp_s.empty() || ep_s.empty()) continue;
          std::vector<double> model_tp = pick(tp_row, tp_row->pred_tp_s), model_ep = pick(tp_row, tp_row->pred_ep_s);
          const double t_tp = median_of(tp_s), t_ep = median_of(ep_s), m_tp = median_of(model_tp), m_ep = median_of(model_ep);
          std::string dyn_ep = "-";
          if (dyn_row) {
            std::vector<double> is_ep;
            for (std::size_t k = 0; k < dyn_row->step_tokens.size(); ++k)
              if (dyn_row->step_tokens[k] >= lo && dyn_row->step_tokens[k] <= hi)
                is_ep.push_back(dyn_row->step_mode[k] == MoeMode::ep ? 1.0 : 0.0);
            if (!is_ep.empty())
              dyn_ep = fmt::format("{:.0f}", 100 * std::accumulate(is_ep.begin(), is_ep.end(), 0.0) / double(is_ep.size()));
          }
          fmt::print("{:>10} {:>11} {:>9.2f} {:>9.2f} {:>9.2f} {:>11.3f} {:>11.3f} {:>11.3f} {:>12} {:>7} {:>11} {:>8}\n",
                     lo == hi ? fmt::format("{}", lo) : fmt::format("{}-{}", lo, hi),
                     fmt::format("{}/{}", tp_s.size(), ep_s.size()), t_tp * 1e3, t_ep * 1e3, (t_tp - t_ep) * 1e3,
                     m_tp * 1e3, m_ep * 1e3, (m_tp - m_ep) * 1e3,
                     fmt::format("{:.2f} {:.2f}", t_tp / t_ep, m_tp / std::max(1e-12, m_ep)), t_tp <= t_ep ? "TP" : "EP",
                     m_ep < (1 - dyn.switching.margin) * m_tp ? "EP" : (m_tp <= m_ep ? "TP" : "TP (margin)"), dyn_ep);
        }
      }
    }

    if (!o.csv.empty()) {
      std::ofstream f(o.csv);
      check(bool(f), "moe_infer: cannot write --csv {}", o.csv);
      f << "trace,policy,rounds";
      for (int m = 0; m < metric_count; ++m)
        f << ',' << kMetricKey[m] << "_median," << kMetricKey[m] << "_min," << kMetricKey[m] << "_max";
      f << ",steps_median,ep_steps_median,rebalances_median";
      if (dyn_row) f << ",dynamic_vs_best_static_ttft_p50,dynamic_vs_best_static_tpot_p50,dynamic_vs_best_static_tokens_per_s";
      f << '\n';
      for (const Named& n : all) {
        f << '"' << trace_name << "\",\"" << n.name << "\"," << n.runs.size();
        for (int m = 0; m < metric_count; ++m) {
          const Spread s = metric_spread(n, Metric(m));
          f << fmt::format(",{:.6g},{:.6g},{:.6g}", s.median, s.min, s.max);
        }
        std::vector<double> steps, ep_steps, rebalances;
        for (const Run& r : n.runs)
          steps.push_back(double(r.steps)), ep_steps.push_back(double(r.ep_steps)), rebalances.push_back(double(r.rebalances));
        f << fmt::format(",{:g},{:g},{:g}", median_of(steps), median_of(ep_steps), median_of(rebalances));
        if (dyn_row) {
          if (&n == dyn_row && !versus.empty())
            f << fmt::format(",{:.4f},{:.4f},{:.4f}", versus[ttft50].ratio, versus[tpot50].ratio, versus[tokens_per_s].ratio);
          else
            f << ",,,";
        }
        f << '\n';
      }
      fmt::print("wrote {}\n", o.csv);
    }
  } catch (const std::exception& e) {
    fmt::print(stderr, "moe_infer: {}\n", e.what());
    return 1;
  }
  return 0;
}
