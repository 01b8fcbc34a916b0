// paradyse/serve/serving_calibration.hpp: what a calibration measures to price serving steps of a model
// (moe_simulate --measure): the sizes a step of that model runs, so that the profile's fits price them from samples
// of their own sizes rather than by extrapolation from others.
//
//   expert_and_head_weights(c, ranks)             the weights of the step's expert and lm_head GEMMs
//   serving_gemm_shapes(c, ranks, step_tokens)    (m, n, k) of the step's GEMMs
//   add_decode_gemms(options, c, ranks)           calibrate()'s GEMM shapes with the decode GEMMs (1-16 rows)
//   step_weight_bytes(c, ranks)                   the weights rank 0 reads in a step that routes to every expert
//   decode_weight_bytes(c, ranks)                 those of a one-token decode step (top_k experts)
//   serving_gemm_classes(c, ranks, step_tokens)   calibrate_gemm_classes' options: those shapes, each cycling
//                                                 through step_weight_bytes of weight copies
//   serving_message_bytes(c, step_tokens)         the step's all-reduces: [tokens, h] floats, from a decode batch of
//                                                 one token to a prompt chunk of step_tokens
//   add_serving_messages(options, c, step_tokens) calibrate()'s collective sizes with those below its own
//   forecast_totals(steps)                        the forecasts that ran: their count, events and CPU seconds
//   fit_planning_rate(steps)                      the host's rate of the dynamic policy's forecast: dry-run trace
//                                                 events per second (HardwareProfile::planning_events_per_s) from
//                                                 a served run's steps
//   fit_serving_host(steps)                       the engine's other host work per step and per chunk
//                                                 (HardwareProfile::serving_host) from a served run's steps
//   step_jitter_quantiles(ratios)                 the steps' spread around their price
//                                                 (HardwareProfile::step_jitter) from a served run's steps
//   fit_rank_jitter(steps, ranks)                 the ranks' spread within a step (HardwareProfile::rank_jitter)
//                                                 from a served run's steps on the synchronised CPU clock (their
//                                                 wait beyond the slowest rank's own work, within the stepper's run)
//
// Why the messages: calibrate() measures collectives from 32 KB up (nccl-tests' sizes) and fits alpha + beta bytes
// below 4 MB on them; a decode step's all-reduces are 0.5-8 KB (a few tokens of h floats), priced at the fit's
// alpha, an extrapolation to 0 bytes that came out 1.9 us in one calibration and 22.9 us in the next on the same
// machine (the 4-layer MoE's decode step then carried 0.185 ms of all-reduces against 1.0 ms of compute).
// Why the working set: between two reads of one weight matrix a step reads every other weight of the rank once, so
// the matrix comes from the cache level that holds the rank's weights: from memory for a model larger than the last
// level cache, from it for a small one (the trained 4-layer MoE's 6.6 MB a rank, both ranks within this machine's
// 32 MB L3). moe_simulate --measure calibrates the profile's classes on them and simulates with classes cycling
// through 128 MB a rank (every weight from memory) beside them ("cpu mem"): on a quiet machine the working-set classes
// priced the trained model's steps 0.87-0.91x of their measured CPU time and the mem classes 1.31-1.59x; where other
// processes shared the L3 (stop 39) the two came out the other way round (docs/serving_simulation.md).
#pragma once

#include "paradyse/core/statistics.hpp"
#include "paradyse/cost/calibrate.hpp"
#include "paradyse/cost/least_squares.hpp"
#include "paradyse/serve/clock.hpp"
#include "paradyse/serve/rank_shard.hpp"
#include "paradyse/serve/step_dry_run.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <map>
#include <utility>
#include <vector>

namespace paradyse::serve {

// The weights (n, k) that rank 0 of `ranks` multiplies in a serving step's expert GEMMs (the TP slice and the whole
// expert, both products) and its lm_head: the GEMMs bound by reading their weights at decode.
inline std::vector<std::pair<std::int64_t, std::int64_t>> expert_and_head_weights(const DecoderConfig& c, int ranks) {
  const std::int64_t h = c.hidden, f = c.moe.expert_ffn;
  const std::int64_t fr = std::max<std::int64_t>(1, chunk_range(f, ranks, 0).length);  // rank 0's slice
  return {{2 * fr, h}, {h, fr}, {2 * f, h}, {h, f}, {c.vocab, h}};
}

// The GEMMs a serving step of `c` runs on rank 0 of `ranks`: (m, n, k) for the decode rows 1-16 and a prefill
// chunk's rows up to `step_tokens` (at most 128, the classes' top) against the attention projections, the router and
// expert_and_head_weights.
inline std::vector<std::array<std::int64_t, 3>> serving_gemm_shapes(const DecoderConfig& c, int ranks,
                                                                    std::int64_t step_tokens) {
  const std::int64_t h = c.hidden, d = c.head_dim;
  const std::int64_t hq = query_heads(c, ranks, 0).length, hk = kv_heads_of(c, ranks, 0).length;
  std::vector<std::pair<std::int64_t, std::int64_t>> weights = {{hq * d, h}, {hk * d, h}, {h, hq * d}, {c.moe.experts, h}};
  for (const auto& w : expert_and_head_weights(c, ranks)) weights.push_back(w);
  std::vector<std::array<std::int64_t, 3>> shapes;
  for (const std::int64_t m : {1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128}) {
    if (m > std::max<std::int64_t>(16, std::min<std::int64_t>(step_tokens, 128))) break;
    for (const auto& [n, k] : weights) shapes.push_back({m, n, k});
  }
  return shapes;
}

// calibrate()'s GEMM shapes with the serving step's decode GEMMs (1, 4 and 16 rows against
// expert_and_head_weights): bound by reading their weights, they give the single fit its operand-bytes term.
inline void add_decode_gemms(cost::CalibrationOptions& options, const DecoderConfig& c, int ranks) {
  for (const std::int64_t m : {1, 4, 16})
    for (const auto& [n, k] : expert_and_head_weights(c, ranks)) options.gemm_shapes.push_back({m, n, k});
}

namespace serving_calibration_detail {

// The bytes of the weight operands (n x k floats) of rank 0's GEMMs in a TP decode step of `tokens` one-token chunks
// whose MoE layers route routed[e] rows to expert e (a decode step's attention is the paged kernel, not a GEMM).
inline std::int64_t decode_gemm_weight_bytes(const DecoderConfig& c, int ranks, std::int64_t tokens,
                                             const std::vector<std::int64_t>& routed) {
  StepTrace t;
  t.ranks = ranks;
  t.chunks.assign(std::size_t(tokens), ChunkShape{1, 1, true});
  for (std::int64_t l = 0; l < c.layers; ++l) t.routed.push_back(c.is_moe(l) ? routed : std::vector<std::int64_t>{});
  t.layout.assign(std::size_t(c.layers), ExpertLayout::tp());
  t.next.assign(std::size_t(c.layers), std::nullopt);
  double bytes = 0;
  for (const TraceEvent& e : dry_run_step(c, t, 0).events)
    if (e.kind == TraceKind::gemm) bytes += double(e.count) * e.n * e.k * double(sizeof(float));
  return std::int64_t(bytes);
}

}  // namespace serving_calibration_detail

// The weights rank 0 reads in a decode step of one token per expert, each expert routed top_k rows: every weight a
// step reads (the projections, the router, every expert's slice in TP, the lm_head).
inline std::int64_t step_weight_bytes(const DecoderConfig& c, int ranks) {
  return serving_calibration_detail::decode_gemm_weight_bytes(
      c, ranks, std::max<std::int64_t>(1, c.moe.experts),
      std::vector<std::int64_t>(std::size_t(c.moe.experts), c.moe.top_k));
}

// The weights rank 0 reads in a decode step of one token, routed to top_k experts: the projections, the router,
// top_k experts' slices in TP, the lm_head (the fewest bytes between two uses of a weight read every step).
inline std::int64_t decode_weight_bytes(const DecoderConfig& c, int ranks) {
  std::vector<std::int64_t> routed(std::size_t(c.moe.experts), 0);
  for (std::int64_t e = 0; e < std::min(c.moe.top_k, c.moe.experts); ++e) routed[std::size_t(e)] = 1;
  return serving_calibration_detail::decode_gemm_weight_bytes(c, ranks, 1, routed);
}

// calibrate_gemm_classes' options for serving `c` on `ranks`: the step's GEMM shapes, each timed cycling through
// copies of its weights that add up to the weights a step reads (the same reuse distance as in the step).
inline cost::GemmClassOptions serving_gemm_classes(const DecoderConfig& c, int ranks, std::int64_t step_tokens) {
  cost::GemmClassOptions o;
  o.shapes = serving_gemm_shapes(c, ranks, step_tokens);
  o.cold_bytes = step_weight_bytes(c, ranks);
  return o;
}

// The bytes of a serving step's all-reduces (decoder_step sums [n, h] partial outputs twice a layer): n = 1, 4, 16
// decode tokens and a prompt chunk of `step_tokens`, ascending.
inline std::vector<std::int64_t> serving_message_bytes(const DecoderConfig& c, std::int64_t step_tokens) {
  std::vector<std::int64_t> bytes;
  for (const std::int64_t n : {std::int64_t(1), std::int64_t(4), std::int64_t(16), step_tokens})
    bytes.push_back(n * c.hidden * std::int64_t(sizeof(float)));
  std::sort(bytes.begin(), bytes.end());
  bytes.erase(std::unique(bytes.begin(), bytes.end()), bytes.end());
  return bytes;
}

// calibrate()'s collective sizes with the serving step's own below them (its sizes from the smallest of its own
// up are kept: the large-message line and the link model are fitted on them as before).
inline void add_serving_messages(cost::CalibrationOptions& options, const DecoderConfig& c, std::int64_t step_tokens) {
  const std::int64_t smallest = *std::min_element(options.message_bytes.begin(), options.message_bytes.end());
  std::vector<std::int64_t> bytes;
  for (const std::int64_t b : serving_message_bytes(c, step_tokens))
    if (b < smallest) bytes.push_back(b);
  bytes.insert(bytes.end(), options.message_bytes.begin(), options.message_bytes.end());
  options.message_bytes = std::move(bytes);
}

// One served step's forecast for fit_planning_rate: the trace events its dry runs recorded (StepTrace::planning_events)
// and rank 0's thread CPU in it (EngineStats::step_forecast_s).
struct ForecastSample {
  std::int64_t events = 0;
  double seconds = 0;
};

// The forecasts that ran among a served run's steps (CPU seconds positive and finite): their count, trace events and
// seconds, summed.
struct ForecastTotals {
  std::int64_t forecasts = 0;
  double events = 0, seconds = 0;
};
inline ForecastTotals forecast_totals(const std::vector<ForecastSample>& steps) {
  ForecastTotals t;
  for (const ForecastSample& s : steps)
    if (s.seconds > 0 && std::isfinite(s.seconds)) ++t.forecasts, t.events += double(s.events), t.seconds += s.seconds;
  return t;
}

// The host rate of the dynamic policy's forecast (HardwareProfile::planning_events_per_s) from the steps of a run
// served under the dynamic policy (a calibration run of its own): the events its dry runs recorded over the CPU
// seconds the forecasts took, summed over the steps whose forecast ran (a forecast that found every step remembered
// records no events; its time is spread over the others'). Measured in the engine, between its steps: timed alone,
// in a loop of forecasts, the same dry runs went twice as fast (12.2 M events/s against 5.9 in the engine on the
// trained 4-layer MoE; the steps between evict the dry runner's code and data). 0: no forecast ran (a static policy,
// a dense model), unpriced.
inline double fit_planning_rate(const std::vector<ForecastSample>& steps) {
  const ForecastTotals t = forecast_totals(steps);
  return t.events > 0 && t.seconds > 0 ? t.events / t.seconds : 0.0;
}

// One served step for fit_serving_host: its chunks and rank 0's host work in it (EngineStats::step_host_s) less what
// the simulation prices as communication there (engine_control_s: the plan's and tokens' broadcasts).
struct HostSample {
  std::int64_t chunks = 0;
  double seconds = 0;
};

// The engine's host work per step and per chunk (HardwareProfile::serving_host), from the steps of a served run (a
// calibration run on its own trace, not the run it is validated against): the median of the steps of each chunk
// count (counts with at least 3 steps and a positive median), fitted to step_s + chunk_s x chunks (non-negative,
// relative error); none: unpriced.
inline cost::ServingHostModel fit_serving_host(const std::vector<HostSample>& steps) {
  std::map<std::int64_t, std::vector<double>> by_chunks;
  for (const HostSample& s : steps) by_chunks[s.chunks].push_back(s.seconds);
  std::vector<std::vector<double>> rows;
  std::vector<double> y;
  for (auto& [chunks, seconds] : by_chunks) {
    if (seconds.size() < 3) continue;
    const double middle = median(seconds);
    if (middle > 0) rows.push_back({1.0, double(chunks)}), y.push_back(middle);
  }
  if (y.empty()) return {};
  if (y.size() == 1) return {y[0], 0.0};
  const cost::Fit fit = cost::fit_non_negative(rows, y);
  return {fit.coefficients[0], fit.coefficients[1]};
}

// The steps' spread around their price (HardwareProfile::step_jitter) from a served run of its own: each step's
// measured time over its simulated price, over the median of those ratios, as `n` equal-probability quantiles (the
// (i + 1/2) / n points, ascending). Their median is 1, so the jitter moves the tail, not the middle.
inline std::vector<double> step_jitter_quantiles(std::vector<double> ratios, int n = 20) {
  check(n >= 1, "step_jitter_quantiles: n = {} must be >= 1", n);
  std::erase_if(ratios, [](double r) { return !(r > 0) || !std::isfinite(r); });
  if (ratios.empty()) return {};
  std::sort(ratios.begin(), ratios.end());
  const double median = ratios[ratios.size() / 2];
  std::vector<double> q;
  for (int i = 0; i < n; ++i) {
    const std::size_t at = std::min(ratios.size() - 1, std::size_t((double(i) + 0.5) / double(n) * double(ratios.size())));
    q.push_back(ratios[at] / median);
  }
  return q;
}

// The ranks' spread within a step (HardwareProfile::rank_jitter) from a served run's steps on `ranks` ranks on the
// synchronised CPU clock (serve/clock.hpp CpuClock: StepTiming::pieces and the slowest rank's own time), read on the
// pieces within every rank's stepper run (StepTiming::kernels_begin, kernels_end, slowest_kernels_cpu_s). Where every
// rank's piece i takes T_i (1 + sigma z), z standard normal and independent, the pieces' maxima sum to sum T_i + sigma
// E_p sum T_i on average and the slowest rank's own total to sum T_i + sigma E_p sqrt(sum T_i^2) (each rank's total a
// normal of that spread), E_p = expected_max_of_normals(p): the wait beyond the slowest rank's own work is sigma E_p
// (sum T_i - sqrt(sum T_i^2)), T_i taken as the pieces measured. A rank slower throughout (its core shared for a while)
// lengthens both sides alike and cancels to first order; set against rank 0's own time instead, one calibration run
// on the synthetic MoE read sigma 0.34 where its measured rounds waited 5% of a step. The host work around the run
// (rank 0's planning and sampling) is left out: where it made rank 0 the slowest of its piece and of the step it took
// away those maxima's excess over the pieces' prices, and the fit on whole steps read sigma 1.10-1.31x high
// (tests/serve/serving_calibration.cpp). The steps' waits summed over their scales summed (a step's own ratio is
// skewed where it has few kernel pieces: their median read 0.71-0.85x of sigma at 3 pieces, the served synthetic
// MoE's count); 0 on one rank or without a step of two kernel pieces or more; at most 0.5 (a wider spread is not a
// normal one about the price).
inline double fit_rank_jitter(const std::vector<StepTiming>& steps, int ranks) {
  check(ranks >= 1, "fit_rank_jitter: ranks = {} must be >= 1", ranks);
  if (ranks == 1) return 0;
  const double e = expected_max_of_normals(ranks);
  double waits = 0, scales = 0;
  for (const StepTiming& s : steps) {
    const std::size_t end = std::min(s.kernels_end, s.pieces.size());
    double sum = 0, squares = 0;
    for (std::size_t i = s.kernels_begin; i < end; ++i) sum += s.pieces[i], squares += s.pieces[i] * s.pieces[i];
    const double scale = e * (sum - std::sqrt(squares));
    if (scale > 0 && std::isfinite(sum) && std::isfinite(s.slowest_kernels_cpu_s))
      waits += sum - s.slowest_kernels_cpu_s, scales += scale;
  }
  return scales > 0 ? std::clamp(waits / scales, 0.0, 0.5) : 0.0;
}

}  // namespace paradyse::serve
