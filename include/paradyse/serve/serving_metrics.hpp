// paradyse/serve/serving_metrics.hpp: what one run of the engine over a trace measured, as a user of a server sees
// it: time to first token (TTFT) and time per output token (TPOT) at p50 and p99, throughput, TP<->EP switches and
// the time they exposed, and how evenly the MoE layers' work spread (expert and rank load, max over mean).
//
//   EngineStats stats;
//   const std::vector<RequestOutcome> out = serve_requests(comm, model, trace, options, policy, &stats);
//   const ServeRun run = summarize_run(out, stats, model.config);
//   run.metric[ttft50];   // ms
#pragma once

#include "paradyse/core/statistics.hpp"
#include "paradyse/serve/engine.hpp"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace paradyse::serve {

// The metrics of one run, indexes of ServeRun::metric.
enum ServeMetric : int { ttft50, ttft99, tpot50, tpot99, tokens_per_s, switches, exposed_ms, metric_count };
inline constexpr const char* kMetricName[metric_count] = {"TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms",
                                                          "tokens/s",    "switches",    "exposed ms"};
inline constexpr const char* kMetricKey[metric_count] = {"ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms",
                                                         "tokens_per_s", "switches",   "exposed_ms"};

struct ServeRun {
  double metric[metric_count] = {};
  std::int64_t rebalances = 0, steps = 0, ep_steps = 0;
  std::vector<double> expert_imbalance, rank_imbalance;  // per layer: max over mean, summed over steps
  FetchStats fetch;
  double activations = 0;  // routed expert activations per token, summed over the MoE layers
  std::int64_t tpot_requests = 0;  // requests with 2+ output tokens: TPOT (tpot50, tpot99) is undefined when 0
};

inline ServeRun summarize_run(const std::vector<RequestOutcome>& out, const EngineStats& stats, const DecoderConfig& c) {
  ServeRun run;
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
  run.tpot_requests = std::int64_t(tpot.size());
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

}  // namespace paradyse::serve
