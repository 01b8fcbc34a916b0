// examples/moe_infer.cpp: serves a request trace with the MoE inference engine (serve/engine.hpp) on p thread ranks
// under each layout policy, measured in the same run: static TP, static EP, EP + EPLB (the vLLM baselines), EP +
// token sorting, EP + on-demand expert loading from the owning rank, and dynamic TP<->EP switching (ours). Prints
// TTFT and TPOT (p50, p99), throughput, switches and the time they exposed, and the expert load imbalance per
// layer, with a progress line while each policy runs.
//
// The model: a Hugging Face folder (--model DIR: Mixtral, Qwen2-MoE or OLMoE), or by default a synthetic
// Mixtral-shaped MoE with seeded random weights (serve/synthetic_decoder.hpp; --skew makes the router favour some
// experts). Arrivals: Poisson at --rate requests/s, or --bursty (bursts of --burst requests every --period seconds).
// Prompt and output lengths are uniform in the given ranges (seeded), token ids uniform over the vocabulary.
// --budget X runs every policy under an Alloc-MoE activation budget (serve/routing_budget.hpp): K_l per MoE layer by
// Alloc-L from --sensitivity FILE (the table moe_budget --table writes for this model) or by uniform top-k reduction,
// and with --alloc-t pooled over each chunk's tokens; the first policy is also run at the full budget, in the same
// run, as the baseline.
#include "command_line.hpp"

#include "paradyse/comm/threads.hpp"
#include "paradyse/moe/sensitivity.hpp"
#include "paradyse/serve/engine.hpp"
#include "paradyse/serve/synthetic_decoder.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <limits>
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

struct Row {
  std::string name;
  double ttft50 = 0, ttft99 = 0, tpot50 = 0, tpot99 = 0, throughput = 0, exposed_ms = 0, activations = 0;
  std::int64_t switches = 0, rebalances = 0, steps = 0, ep_steps = 0;
  std::vector<double> expert_imbalance, rank_imbalance;
  FetchStats fetch;
};

}  // namespace

int main(int argc, char** argv) {
  Options o;
  examples::Flags flags("moe_infer", "Serves a request trace on p thread ranks under each MoE layout policy and "
                                     "compares them.");
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
    fmt::print("moe_infer: {} ({} layers, h {}, {} experts top-{}, expert ffn {}), {} thread ranks, {} requests, {}\n",
               o.model.empty() ? "synthetic MoE" : o.model, c.layers, c.hidden, c.moe.experts, c.moe.top_k,
               c.moe.expert_ffn, o.ranks, o.requests,
               o.bursty ? fmt::format("bursts of {} every {} s", o.burst, o.period) : fmt::format("Poisson {} req/s", o.rate));

    struct Named { std::string key, name; EnginePolicy policy; };
    std::vector<Named> all;
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
    dyn.rates = measure_machine_rates(c.moe, o.ranks);
    fmt::print("cost model rates (measured): GEMM {:.1f} GFLOP/s, half rate at {:.0f} columns, weights streamed at "
               "{:.1f} GB/s\n", dyn.rates.flops_per_s / 1e9, dyn.rates.half_rate_columns,
               dyn.rates.memory_bytes_per_s / 1e9);
    all.push_back({"tp", "static TP", tp});
    all.push_back({"ep", "static EP", ep});
    all.push_back({"eplb", "EP + EPLB", eplb});
    all.push_back({"sort", "EP + token sorting", sort});
    all.push_back({"ondemand", "EP + on-demand", ondemand});
    all.push_back({"dynamic", "dynamic TP/EP", dyn});
    if (!o.budget.empty()) {  // every policy under the budget; the first selected one also at the full budget
      SensitivityTable table;
      if (!o.sensitivity.empty()) table = load_sensitivity(o.sensitivity);
      const RoutingBudget budget =
          make_routing_budget(c, parse_budget(o.budget), o.sensitivity.empty() ? nullptr : &table, o.alloc_t);
      fmt::print("budget {}: {} ({})\n", o.budget, describe(c, budget),
                 o.sensitivity.empty() ? "uniform top-k reduction" : "Alloc-L from " + o.sensitivity);
      std::vector<Named> budgeted;
      for (const Named& n : all) {
        if (("," + o.policies + ",").find("," + n.key + ",") == std::string::npos) continue;
        if (budgeted.empty()) budgeted.push_back({n.key, n.name + " (full)", n.policy});
        Named b = n;
        b.name += " (budget)";
        b.policy.budget = budget;
        budgeted.push_back(b);
      }
      all = budgeted;
    }
    {  // a short untimed run first, so that no policy pays the first touch of the weights and pools
      std::vector<ServeRequest> warm(trace.begin(), trace.begin() + std::min<std::size_t>(4, trace.size()));
      for (ServeRequest& r : warm) r.arrival = 0, r.max_new_tokens = std::min<std::int64_t>(r.max_new_tokens, 4);
      run_ranks(o.ranks, [&](ThreadCommunicator& comm) { serve_requests(comm, model, warm, opt, tp); });
    }
    std::vector<Row> rows;
    for (const Named& n : all) {
      if (o.budget.empty() && ("," + o.policies + ",").find("," + n.key + ",") == std::string::npos) continue;
      EngineStats stats;
      std::vector<RequestOutcome> out;
      run_ranks(o.ranks, [&](ThreadCommunicator& comm) {
        auto got = serve_requests(comm, model, trace, opt, n.policy, comm.rank() == 0 ? &stats : nullptr,
                                  [&](const EngineProgress& p) {
                                    if (p.step % 8 == 0 || p.finished == p.total)
                                      fmt::print(stderr, "\r  {:<20} step {:>5}  done {:>4}/{:<4} running {:>3}  mode {}   ",
                                                 n.name, p.step, p.finished, p.total, p.running, name_of(p.mode));
                                  });
        if (comm.rank() == 0) out = std::move(got);
      });
      fmt::print(stderr, "\n");
      Row row;
      row.name = n.name;
      std::vector<double> ttft, tpot;
      std::int64_t tokens = 0;
      for (const RequestOutcome& r : out) {
        ttft.push_back(r.first_token - r.arrival);
        if (r.tokens.size() > 1) tpot.push_back((r.finish - r.first_token) / double(r.tokens.size() - 1));
        tokens += std::int64_t(r.tokens.size());
      }
      row.ttft50 = percentile(ttft, 0.5) * 1e3;
      row.ttft99 = percentile(ttft, 0.99) * 1e3;
      row.tpot50 = percentile(tpot, 0.5) * 1e3;
      row.tpot99 = percentile(tpot, 0.99) * 1e3;
      row.throughput = double(tokens) / stats.elapsed_s;
      row.switches = stats.switches;
      row.rebalances = stats.rebalances;
      row.exposed_ms = stats.switch_exposed_s * 1e3;
      row.steps = stats.steps;
      row.ep_steps = std::count(stats.mode_of_step.begin(), stats.mode_of_step.end(), MoeMode::ep);
      for (std::int64_t l = 0; l < c.layers; ++l) {
        row.expert_imbalance.push_back(stats.expert_mean[std::size_t(l)] > 0 ? stats.expert_max[std::size_t(l)] / stats.expert_mean[std::size_t(l)] : 1.0);
        row.rank_imbalance.push_back(stats.rank_mean[std::size_t(l)] > 0 ? stats.rank_max[std::size_t(l)] / stats.rank_mean[std::size_t(l)] : 1.0);
      }
      row.fetch = stats.fetch;
      row.activations = stats.tokens > 0 ? double(stats.routed_activations) / double(stats.tokens) : 0.0;
      rows.push_back(std::move(row));
    }
    fmt::print("\n{:<29} {:>9} {:>9} {:>9} {:>9} {:>10} {:>6} {:>8} {:>9} {:>11} {:>14} {:>9}\n", "policy", "TTFT p50", "TTFT p99",
               "TPOT p50", "TPOT p99", "tokens/s", "steps", "EP steps", "sw/rebal", "exposed ms", "rank max/mean",
               "act/token");
    for (const Row& r : rows) {
      std::string imbalance;
      for (double x : r.rank_imbalance) imbalance += fmt::format("{}{:.2f}", imbalance.empty() ? "" : " ", x);
      fmt::print("{:<29} {:>7.1f}ms {:>7.1f}ms {:>7.2f}ms {:>7.2f}ms {:>10.1f} {:>6} {:>8} {:>9} {:>11.2f} {:>14} {:>9.2f}\n",
                 r.name, r.ttft50, r.ttft99, r.tpot50, r.tpot99, r.throughput, r.steps, r.ep_steps,
                 fmt::format("{}/{}", r.switches, r.rebalances), r.exposed_ms, imbalance, r.activations);
    }
    if (!rows.empty()) {
      std::string experts;
      for (double x : rows[0].expert_imbalance) experts += fmt::format(" {:.2f}", x);
      fmt::print("expert load max/mean per layer (routing, same for every policy):{}\n", experts);
    }
    fmt::print("(sw/rebal: TP<->EP switches / EPLB placements installed; exposed ms: the time both took on the critical "
               "path; rank max/mean: per MoE layer, the rows of the busiest rank over the mean, summed over steps; act/token: routed "
               "expert activations per token summed over the MoE layers)\n");
    for (const Row& r : rows)
      if (r.fetch.fetches)
        fmt::print("{}: {} experts fetched ({:.1f} MB), {} cache hits, {} evictions{}\n", r.name, r.fetch.fetches,
                   double(r.fetch.bytes_fetched) / 1e6, r.fetch.hits, r.fetch.evictions,
                   r.fetch.wait_s > 0 ? fmt::format("; rank 0 waited {:.1f} ms on fetch messages", r.fetch.wait_s * 1e3)
                                      : std::string());
    const auto dyn_row = std::find_if(rows.begin(), rows.end(), [](const Row& r) { return r.name == "dynamic TP/EP"; });
    if (dyn_row != rows.end())
      for (const Row& r : rows)
        if (&r != &*dyn_row)
          fmt::print("dynamic vs {:<20}: TTFT p50 {:.2f}x, TPOT p50 {:.2f}x lower; throughput {:.2f}x\n", r.name,
                     r.ttft50 / std::max(1e-9, dyn_row->ttft50), r.tpot50 / std::max(1e-9, dyn_row->tpot50),
                     dyn_row->throughput / std::max(1e-9, r.throughput));
    if (!o.budget.empty() && rows.size() >= 2)  // rows[0]: the first policy at the full budget, rows[1]: budgeted
      fmt::print("{} vs {}: TTFT p50 {:.2f}x, TPOT p50 {:.2f}x lower; throughput {:.2f}x\n", rows[1].name, rows[0].name,
                 rows[0].ttft50 / std::max(1e-9, rows[1].ttft50), rows[0].tpot50 / std::max(1e-9, rows[1].tpot50),
                 rows[1].throughput / std::max(1e-9, rows[0].throughput));
  } catch (const std::exception& e) {
    fmt::print(stderr, "moe_infer: {}\n", e.what());
    return 1;
  }
  return 0;
}
