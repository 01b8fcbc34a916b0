// bench/moe_policies.cpp: the MoE serving policies compared (examples/moe_infer.cpp serves a trace under one of them).
// Serves a request trace with the MoE inference engine (serve/engine.hpp) on p thread ranks under each layout policy
// (serve/named_policies.hpp): static TP, static EP, EP + EPLB (the vLLM baselines), EP + token sorting, EP + on-demand
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
#include "paradyse/cli/flags.hpp"
#include "paradyse/comm/threads.hpp"
#include "paradyse/core/csv_table.hpp"
#include "paradyse/cost/builtin_profiles.hpp"
#include "paradyse/cost/emulation.hpp"
#include "paradyse/moe/sensitivity.hpp"
#include "paradyse/serve/engine.hpp"
#include "paradyse/serve/named_policies.hpp"
#include "paradyse/serve/policy_rounds.hpp"
#include "paradyse/serve/request_trace.hpp"
#include "paradyse/serve/serving_metrics.hpp"
#include "paradyse/serve/synthetic_decoder.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
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
  TraceShape trace;  // serve/request_trace.hpp: requests, arrivals, lengths, seed
  std::int64_t step_tokens = 64;
  std::string policies = kPolicyKeys;
  std::string budget, sensitivity;
  bool alloc_t = false;
  int rounds = 3;
  std::string csv, emulate;
  bool explain = false;
};

// A policy as measured here: its runs over the rounds, and every step of them.
struct Named {
  std::string key, name;
  EnginePolicy policy;
  bool full_budget_baseline = false;
  std::vector<ServeRun> runs;                       // one per round
  std::vector<double> step_s, pred_tp_s, pred_ep_s;  // every step of every round (for --explain)
  std::vector<std::int64_t> step_tokens;
  std::vector<MoeMode> step_mode;
};

Spread metric_spread(const Named& n, ServeMetric m) {
  std::vector<double> v;
  for (const ServeRun& r : n.runs) v.push_back(r.metric[m]);
  return spread_of(v);
}

// "12.3" or "1234" by magnitude.
std::string number(double x) { return std::abs(x) >= 100 ? fmt::format("{:.0f}", x) : fmt::format("{:.2f}", x); }

}  // namespace

int main(int argc, char** argv) {
  Options o;
  cli::Flags flags("moe_policies", "Serves a request trace on p thread ranks under each MoE layout policy and "
                                        "compares them, in alternating rounds.");
  flags.text("--model", o.model, "Hugging Face model folder (default: synthetic Mixtral-shaped MoE)", "DIR");
  flags.integer("--hidden", o.hidden, std::int64_t(8), std::int64_t(8192), "synthetic: hidden size");
  flags.integer("--layers", o.layers, std::int64_t(1), std::int64_t(256), "synthetic: layers");
  flags.integer("--experts", o.experts, std::int64_t(1), std::int64_t(1024), "synthetic: experts");
  flags.integer("--top-k", o.top_k, std::int64_t(1), std::int64_t(1024), "synthetic: experts per token");
  flags.integer("--ffn", o.ffn, std::int64_t(1), std::int64_t(65536), "synthetic: expert width");
  flags.number("--skew", o.skew, {.min = 0, .max = 10}, "synthetic: router skew");
  flags.integer("--ranks", o.ranks, 1, 64, "thread ranks");
  flags.integer("--requests", o.trace.requests, std::int64_t(1), std::int64_t(1'000'000), "requests in the trace");
  flags.number("--rate", o.trace.rate, {.min = 0, .max = 1e6, .min_open = true}, "Poisson arrivals, requests/s");
  flags.flag("--bursty", o.trace.bursty, "bursts instead: --burst requests every --period seconds");
  flags.integer("--burst", o.trace.burst, std::int64_t(1), std::int64_t(1'000'000), "requests per burst");
  flags.number("--period", o.trace.period, {.min = 0, .max = 1e6, .min_open = true}, "seconds between bursts");
  flags.integers("--prompt", o.trace.prompt_min, o.trace.prompt_max, std::int64_t(1), std::int64_t(1) << 20,
                 "prompt length range MIN MAX");
  flags.integers("--output", o.trace.output_min, o.trace.output_max, std::int64_t(1), std::int64_t(1) << 20,
                 "output length range MIN MAX");
  flags.integer("--step-tokens", o.step_tokens, std::int64_t(1), std::int64_t(1) << 20, "tokens per engine step");
  flags.text("--policies", o.policies, "comma-separated subset of tp,ep,eplb,sort,ondemand,dynamic", "LIST");
  flags.integer("--seed", o.trace.seed, std::uint64_t(0), std::numeric_limits<std::uint64_t>::max(),
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
  try {
    check_policy_keys(o.policies);
  } catch (const Error& e) {
    usage(fmt::format("--policies: {}", e.what()));
  }
  if (o.trace.prompt_min > o.trace.prompt_max)
    usage(fmt::format("--prompt {} {}: the minimum exceeds the maximum", o.trace.prompt_min, o.trace.prompt_max));
  if (o.trace.output_min > o.trace.output_max)
    usage(fmt::format("--output {} {}: the minimum exceeds the maximum", o.trace.output_min, o.trace.output_max));
  try {
    const LoadedDecoder model =
        o.model.empty()
            ? synthetic_decoder([&] {
                const DecoderConfig sc = synthetic_config(o.hidden, o.layers, 8, 4, o.experts, o.top_k, o.ffn, 1024);
                check_fits_host(sc, 2, "--experts, --ffn, --hidden or --layers");
                return sc;
              }(), o.trace.seed, o.skew)
            : load_decoder(o.model);
    const DecoderConfig& c = model.config;
    const std::vector<ServeRequest> trace = make_trace(o.trace, c.vocab);
    const EngineOptions opt = serving_options(trace, o.step_tokens);
    const std::string trace_name = serve::trace_name(o.trace);
    fmt::print("moe_policies: {} ({} layers, h {}, {} experts top-{}, expert ffn {}), {} thread ranks, {} requests, {}, "
               "{} rounds\n",
               o.model.empty() ? "synthetic MoE" : o.model, c.layers, c.hidden, c.moe.experts, c.moe.top_k,
               c.moe.expert_ffn, o.ranks, o.trace.requests, trace_name, o.rounds);

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
    // Every policy with the measured rates: the switcher's, and every policy's predicted costs (--explain).
    const std::vector<NamedPolicy> chosen = select_policies(standard_policies(rates), o.policies);
    if (chosen.empty()) usage(fmt::format("--policies {}: none of {}", o.policies, kPolicyKeys));
    const double switch_margin = standard_policies(rates).back().policy.switching.margin;  // the dynamic policy's
    std::vector<Named> all;
    for (const NamedPolicy& n : chosen) all.push_back({n.key, n.name, n.policy});
    if (!o.budget.empty()) {  // every policy under the budget; the first selected one also at the full budget
      SensitivityTable table;
      if (!o.sensitivity.empty()) {
        table = load_sensitivity(o.sensitivity);
        check_sensitivity_model(table, model_identity(c), o.sensitivity);
      }
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
        const std::vector<ServeRequest> at_once = all_at_once(trace);
        EngineOptions one = opt;
        one.wall_clock = false;
        EnginePolicy policy;
        policy.budget = n.policy.budget;
        run_ranks(1, [&](ThreadCommunicator& comm) { reference[budgeted] = serve_requests(comm, model, at_once, one, policy); });
      }
    auto check_against_reference = [&](const Named& n, const std::vector<RequestOutcome>& out, int round) {
      if (!check_tokens) return;
      const std::vector<RequestOutcome>& ref = reference.at(n.policy.budget.active());
      check(out.size() == ref.size(), "moe_policies: {} returned {} requests, expected {}", n.name, out.size(), ref.size());
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
      const std::vector<ServeRequest> at_once = all_at_once(trace);
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
    // TPOT is the time per output token after the first: with one output token per request it does not exist, and a
    // ratio of two zeros says nothing ("TPOT 0.00x"), so it is reported as undefined.
    bool tpot_defined = false;
    for (const Named& n : all)
      for (const ServeRun& r : n.runs) tpot_defined = tpot_defined || r.tpot_requests > 0;
    const auto tpot_ratio = [&](const Named& a, const Named& b) {
      return tpot_defined ? fmt::format("{:.2f}x", metric_spread(a, tpot50).median /
                                                       std::max(1e-9, metric_spread(b, tpot50).median))
                          : std::string("undefined (1 output token)");
    };
    if (!tpot_defined) fmt::print("\nTPOT is undefined: every request outputs 1 token (--output); its columns show 0\n");
    fmt::print("\nmedians over {} rounds\n{:<29} {:>9} {:>9} {:>9} {:>9} {:>9} {:>6} {:>8} {:>9} {:>10} {:>14} {:>9}\n",
               o.rounds, "policy", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "tokens/s", "steps", "EP steps",
               "sw/rebal", "exposed ms", "rank max/mean", "act/token");
    for (const Named& n : all) {
      std::vector<double> steps, ep_steps, rebalances, activations;
      for (const ServeRun& r : n.runs)
        steps.push_back(double(r.steps)), ep_steps.push_back(double(r.ep_steps)),
            rebalances.push_back(double(r.rebalances)), activations.push_back(r.activations);
      std::string imbalance;
      for (std::size_t l = 0; l < n.runs[0].rank_imbalance.size(); ++l) {
        std::vector<double> v;
        for (const ServeRun& r : n.runs) v.push_back(r.rank_imbalance[l]);
        imbalance += fmt::format("{}{:.2f}", imbalance.empty() ? "" : " ", median(v));
      }
      fmt::print("{:<29} {:>7.1f}ms {:>7.1f}ms {:>7.2f}ms {:>7.2f}ms {:>9.1f} {:>6.0f} {:>8.0f} {:>9} {:>10.2f} {:>14} {:>9.2f}\n",
                 n.name, metric_spread(n, ttft50).median, metric_spread(n, ttft99).median,
                 metric_spread(n, tpot50).median, metric_spread(n, tpot99).median,
                 metric_spread(n, tokens_per_s).median, median(steps), median(ep_steps),
                 fmt::format("{:g}/{:g}", metric_spread(n, switches).median, median(rebalances)),
                 metric_spread(n, exposed_ms).median, imbalance, median(activations));
    }
    fmt::print("\nspreads over the rounds (min-max)\n{:<29}", "policy");
    for (int m = 0; m < metric_count; ++m) fmt::print(" {:>17}", kMetricName[m]);
    fmt::print("\n");
    for (const Named& n : all) {
      fmt::print("{:<29}", n.name);
      for (int m = 0; m < metric_count; ++m) {
        const Spread s = metric_spread(n, ServeMetric(m));
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
      for (const ServeMetric m : {ttft50, ttft99, tpot50, tpot99, tokens_per_s}) {
        if (!tpot_defined && (m == tpot50 || m == tpot99)) {
          fmt::print("{:<12} undefined: every request outputs 1 token (TPOT is the time per token after the first)\n",
                     kMetricName[m]);
          continue;
        }
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
        fmt::print("dynamic vs {:<10}: TTFT p50 {:.2f}x, TPOT p50 {} lower; throughput {:.2f}x (medians)\n", n->name,
                   metric_spread(*n, ttft50).median / std::max(1e-9, metric_spread(*dyn_row, ttft50).median),
                   tpot_ratio(*n, *dyn_row),
                   metric_spread(*dyn_row, tokens_per_s).median / std::max(1e-9, metric_spread(*n, tokens_per_s).median));
      // The verdict of the trace, on the metrics a user sees: TTFT p50, TPOT p50 and throughput.
      std::vector<double> ep_share;
      for (const ServeRun& r : dyn_row->runs) ep_share.push_back(r.steps ? double(r.ep_steps) / double(r.steps) : 0.0);
      const double dyn_ep = median(ep_share), dyn_switches = metric_spread(*dyn_row, switches).median,
                   dyn_exposed = metric_spread(*dyn_row, exposed_ms).median;
      // Dynamic with no switch and no EP step did exactly static TP's work: a measured gap to static TP is the
      // machine's run-to-run error (beyond the rounds' spread), not the policy.
      const bool same_as_tp = dyn_switches == 0 && dyn_ep == 0;
      int slower = 0, faster = 0;
      std::string which, noise;
      for (const ServeMetric m : {ttft50, tpot50, tokens_per_s}) {
        if (!versus.count(m)) continue;  // TPOT undefined
        const PolicyComparison& cmp = versus[m];
        if (cmp.verdict == Verdict::within_noise || cmp.verdict == Verdict::no_spread) continue;
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
      if (o.rounds == 1)
        fmt::print("verdict ({}): none: no spread with 1 round to tell a difference from run-to-run error (--rounds 3 "
                   "or more; {})\n", trace_name, how);
      else if (slower == 0 && faster == 0)
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
      fmt::print("{} vs {}: TTFT p50 {:.2f}x, TPOT p50 {} lower; throughput {:.2f}x (medians)\n", all[1].name,
                 all[0].name, metric_spread(all[0], ttft50).median / std::max(1e-9, metric_spread(all[1], ttft50).median),
                 tpot_ratio(all[0], all[1]),
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
                   "rates; dynamic switches to EP when the model's EP is {:.0f}% below TP\n", 100 * switch_margin);
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
          const double t_tp = median(tp_s), t_ep = median(ep_s), m_tp = median(model_tp), m_ep = median(model_ep);
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
                     m_ep < (1 - switch_margin) * m_tp ? "EP" : (m_tp <= m_ep ? "TP" : "TP (margin)"), dyn_ep);
        }
      }
    }

    if (!o.csv.empty()) {
      std::vector<std::string> columns{"trace", "policy", "rounds"};
      for (int m = 0; m < metric_count; ++m)
        for (const char* of : {"_median", "_min", "_max"}) columns.push_back(kMetricKey[m] + std::string(of));
      for (const char* column : {"steps_median", "ep_steps_median", "rebalances_median"}) columns.push_back(column);
      if (dyn_row)
        for (const char* column : {"dynamic_vs_best_static_ttft_p50", "dynamic_vs_best_static_tpot_p50",
                                   "dynamic_vs_best_static_tokens_per_s"})
          columns.push_back(column);
      CsvTable csv(o.csv, columns);
      for (const Named& n : all) {
        std::vector<std::string> row{trace_name, n.name, fmt::format("{}", n.runs.size())};
        for (int m = 0; m < metric_count; ++m) {
          const Spread s = metric_spread(n, ServeMetric(m));
          for (const double x : {s.median, s.min, s.max}) row.push_back(fmt::format("{:.6g}", x));
        }
        std::vector<double> steps, ep_steps, rebalances;
        for (const ServeRun& r : n.runs)
          steps.push_back(double(r.steps)), ep_steps.push_back(double(r.ep_steps)), rebalances.push_back(double(r.rebalances));
        for (const double x : {median(steps), median(ep_steps), median(rebalances)}) row.push_back(fmt::format("{:g}", x));
        if (dyn_row)
          for (const ServeMetric m : {ttft50, tpot50, tokens_per_s})
            row.push_back(&n == dyn_row && !versus.empty() ? fmt::format("{:.4f}", versus[m].ratio) : std::string());
        csv.row_of(row);
      }
      csv.close();  // throws (naming the file and the reason) before saying it was written
      fmt::print("wrote {}\n", o.csv);
    }
  } catch (const std::exception& e) {
    fmt::print(stderr, "moe_policies: {}\n", e.what());
    return 1;
  }
  return 0;
}
