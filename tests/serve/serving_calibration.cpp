// tests/serve/serving_calibration.cpp: a calibration for serving (serve/serving_calibration.hpp) samples the sizes
// a serving step prices: every all-reduce of a step's dry run (decode batches of 1-16 tokens, a prompt chunk) lies
// within the collective sizes calibrate() then measures, at most 4x from one of them, so the profile's small-message
// line is fitted on its own sizes, not extrapolated from 32 KB up; the GEMMs of the step are among the class shapes.
#include "paradyse/serve/cluster_spec.hpp"
#include "paradyse/serve/serving_calibration.hpp"
#include "paradyse/serve/step_dry_run.hpp"
#include "paradyse/serve/synthetic_decoder.hpp"
#include "support/fresh_seed.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

using namespace paradyse;
using namespace paradyse::serve;

namespace serving_calibration_test {

// A step of `chunks` on p ranks in `mode` (EP: the chunked placement), its (token, expert) pairs spread evenly.
StepTrace step_of(const DecoderConfig& c, int p, const std::vector<ChunkShape>& chunks, MoeMode mode) {
  StepTrace t;
  t.ranks = p;
  t.chunks = chunks;
  const ExpertLayout layout = mode == MoeMode::tp ? ExpertLayout::tp()
                                                  : ExpertLayout::ep(ExpertPlacement::chunked(c.moe.experts, p).experts_of_rank);
  const std::int64_t pairs = t.tokens() * c.moe.top_k, E = c.moe.experts;
  for (std::int64_t l = 0; l < c.layers; ++l) {
    std::vector<std::int64_t> routed;
    for (std::int64_t e = 0; e < E; ++e) routed.push_back(pairs / E + (e < pairs % E ? 1 : 0));
    t.routed.push_back(routed);
  }
  t.layout.assign(std::size_t(c.layers), layout);
  t.next.assign(std::size_t(c.layers), std::nullopt);
  return t;
}

}  // namespace serving_calibration_test

TEST_CASE("serving calibration: a step's all-reduces and GEMMs are within the sizes the calibration measures") {
  using namespace serving_calibration_test;
  const std::int64_t step_tokens = 64;
  // moe_infer's synthetic MoE, the trained 4-layer MoE's shape (h 128, 4 heads) and an uneven one (3 kv heads).
  for (const DecoderConfig& c : {synthetic_config(256, 2, 8, 4, 8, 2, 512, 1024), synthetic_config(128, 4, 4, 4, 8, 2, 256, 256),
                                 synthetic_config(96, 2, 6, 3, 6, 2, 160, 300)}) {
    cost::CalibrationOptions options;
    add_serving_messages(options, c, step_tokens);
    REQUIRE(std::is_sorted(options.message_bytes.begin(), options.message_bytes.end()));
    for (const int p : {2, 3})
      for (const MoeMode mode : {MoeMode::tp, MoeMode::ep}) {
        const auto shapes = serving_gemm_shapes(c, p, step_tokens);
        for (const std::vector<ChunkShape>& chunks :
             {std::vector<ChunkShape>{{1, 40, true}}, std::vector<ChunkShape>(5, {1, 33, true}),
              std::vector<ChunkShape>(16, {1, 7, true}), std::vector<ChunkShape>{{step_tokens, 0, false}},
              std::vector<ChunkShape>{{3, 20, true}, {step_tokens - 3, 0, false}}}) {
          const StepTrace t = step_of(c, p, chunks, mode);
          const RankStepTrace r = dry_run_step(c, t, 0);
          int all_reduces = 0;
          for (const TraceEvent& e : r.events) {
            INFO("h ", c.hidden, ", p ", p, mode == MoeMode::tp ? " TP" : " EP", ", ", t.tokens(), " tokens");
            if (e.kind == TraceKind::post && e.transfer == TransferKind::all_reduce) {
              ++all_reduces;
              INFO("an all-reduce of ", e.bytes, " B; calibrated from ", options.message_bytes.front(), " B");
              CHECK(e.bytes >= double(options.message_bytes.front()));
              CHECK(e.bytes < double(options.large_message_bytes));
              const bool near = std::any_of(options.message_bytes.begin(), options.message_bytes.end(),
                                            [&](std::int64_t b) { return e.bytes <= 4.0 * double(b) && double(b) <= 4.0 * e.bytes; });
              CHECK(near);
            }
            if (e.kind == TraceKind::gemm && e.m <= 16) {  // decode rows: the m <= 16 class is fitted on these
              INFO("GEMM ", e.m, "x", e.n, "x", e.k);
              const bool among = std::any_of(shapes.begin(), shapes.end(), [&](const std::array<std::int64_t, 3>& s) {
                return double(s[1]) == e.n && double(s[2]) == e.k;
              });
              CHECK(among);
            }
          }
          CHECK(all_reduces == 2 * c.layers);
        }
      }
  }
}

TEST_CASE("serving calibration: the GEMM classes cycle through the weights a step reads (rank 0's, counted by hand)") {
  for (const DecoderConfig& c : {synthetic_config(256, 2, 8, 4, 8, 2, 512, 1024), synthetic_config(128, 4, 4, 4, 8, 2, 256, 256),
                                 synthetic_config(96, 2, 6, 3, 6, 2, 160, 300)})
    for (const int p : {1, 2, 3}) {
      INFO("h ", c.hidden, ", p ", p);
      const std::int64_t h = c.hidden, d = c.head_dim, E = c.moe.experts;
      const std::int64_t hq = query_heads(c, p, 0).length, hk = kv_heads_of(c, p, 0).length;
      const std::int64_t fr = chunk_range(c.moe.expert_ffn, p, 0).length;
      // per layer: q and o [hq d, h], k and v [hk d, h], the router [E, h], every expert's slice in [2 fr, h] and
      // out [h, fr]; then the lm_head [V, h]
      const std::int64_t floats = c.layers * (2 * hq * d * h + 2 * hk * d * h + E * h + E * 3 * fr * h) + c.vocab * h;
      CHECK(step_weight_bytes(c, p) == 4 * floats);
      // a one-token decode step: top_k experts' slices instead of every expert's
      CHECK(decode_weight_bytes(c, p) == 4 * (floats - c.layers * (E - c.moe.top_k) * 3 * fr * h));
      const cost::GemmClassOptions o = serving_gemm_classes(c, p, 64);
      CHECK(o.cold_bytes == 4 * floats);
      CHECK(o.shapes == serving_gemm_shapes(c, p, 64));
    }
}

TEST_CASE("serving calibration: the forecast's host rate is its events over its time, summed over the steps whose "
          "forecast ran") {
  PARADYSE_FRESH_RNG(rng);
  std::uniform_real_distribution<double> rate_of(1e6, 5e7), seconds_of(1e-6, 1e-4);
  std::uniform_int_distribution<std::int64_t> events_of(10, 2000);
  const double rate = rate_of(rng);
  // Steps of several sizes at one rate, a forecast of remembered steps (no events, its time spread over the others'),
  // static steps (no forecast: 0 s, left out) and a sample that is not a time.
  std::vector<ForecastSample> steps;
  double events = 0, seconds = 0;
  for (int i = 0; i < 12; ++i) {
    const std::int64_t n = events_of(rng);
    const double t = double(n) / rate;
    steps.push_back({n, t});
    events += double(n), seconds += t;
  }
  const double remembered = seconds_of(rng);
  steps.push_back({0, remembered});
  steps.push_back({0, 0.0}), steps.push_back({0, 0.0});
  steps.push_back({100, std::numeric_limits<double>::quiet_NaN()});
  // The forecasts that ran: the 12 timed ones and the remembered one (events summed exactly: integers below 2^53).
  const ForecastTotals ran = forecast_totals(steps);
  CHECK(ran.forecasts == 13);
  CHECK(ran.events == events);
  CHECK(ran.seconds == doctest::Approx(seconds + remembered).epsilon(1e-12));
  CHECK(fit_planning_rate(steps) == doctest::Approx(events / (seconds + remembered)).epsilon(1e-12));
  CHECK(events / seconds == doctest::Approx(rate).epsilon(1e-12));
  CHECK(fit_planning_rate(steps) < rate);  // the remembered forecast's time costs the rate
  // No forecast ran (a static policy, a dense model): unpriced.
  CHECK(fit_planning_rate({}) == 0);
  CHECK(fit_planning_rate({{0, 0.0}, {0, 0.0}}) == 0);
  CHECK(fit_planning_rate({{0, 1e-5}}) == 0);
}

TEST_CASE("serving calibration: the engine's host work is fitted per step and per chunk on each chunk count's median") {
  // 20 us a step + 3 us a chunk, every count's steps with one outlier (a step the machine interrupted) that the median
  // ignores; a count seen twice is left out.
  std::vector<HostSample> steps;
  for (std::int64_t chunks = 1; chunks <= 6; ++chunks) {
    const double truth = 20e-6 + 3e-6 * double(chunks);
    for (const double f : {1.0, 1.0, 1.0, 1.0, 9.0}) steps.push_back({chunks, f * truth});
  }
  steps.push_back({40, 1e-3}), steps.push_back({40, 1e-3});
  const cost::ServingHostModel m = fit_serving_host(steps);
  CHECK(m.step_s == doctest::Approx(20e-6).epsilon(1e-9));
  CHECK(m.chunk_s == doctest::Approx(3e-6).epsilon(1e-9));
  // One count: its median a step; none (or only non-positive medians): unpriced.
  CHECK(fit_serving_host({{3, 5e-6}, {3, 6e-6}, {3, 7e-6}}) == cost::ServingHostModel{6e-6, 0});
  CHECK(fit_serving_host({}) == cost::ServingHostModel{});
  CHECK(fit_serving_host({{2, -1e-6}, {2, -2e-6}, {2, 1e-6}}) == cost::ServingHostModel{});
}

TEST_CASE("serving calibration: the steps' spread is their ratios' quantiles over the median (tail moved, middle kept)") {
  std::vector<double> ratios;
  for (int i = 100; i >= 1; --i) ratios.push_back(double(i));  // any order; the median is the 51st, 51
  ratios.push_back(0), ratios.push_back(-3);                     // not ratios: left out
  const std::vector<double> q = step_jitter_quantiles(ratios, 20);
  REQUIRE(q.size() == 20);
  CHECK(std::is_sorted(q.begin(), q.end()));
  CHECK(q.front() == 3.0 / 51);   // the 2.5% point: the 3rd of 100
  CHECK(q[10] == 53.0 / 51);      // the 52.5% point
  CHECK(q.back() == 98.0 / 51);   // the 97.5% point
  CHECK(step_jitter_quantiles({}).empty());
  CHECK(step_jitter_quantiles({2.0, 2.0, 2.0}, 4) == std::vector<double>{1, 1, 1, 1});
}

TEST_CASE("serving calibration: the ranks' spread from synchronised steps; no slow rank or host work inflates it") {
  // Steps of `n` pieces (12) on p ranks, each rank's piece its price times 1 + sigma z (z standard normal) times
  // `slow` on the last rank (a core shared throughout), rank 0's first piece with host work the others wait through
  // (outside the stepper's run: the kernel pieces are the others); the synchronised clock takes each piece's slowest
  // rank and the slowest rank's own totals. `told`: the clock was told the run (else every piece counts as the run's).
  const auto served = [](int p, double sigma, double slow, double host, std::uint64_t seed, bool told = true,
                         std::size_t n = 12) {
    Rng rng(seed);
    std::vector<StepTiming> steps;
    for (int s = 0; s < 400; ++s) {
      StepTiming x;
      x.kernels_begin = told ? 1 : 0, x.kernels_end = n;
      std::vector<double> own(std::size_t(p), 0.0), kernels(std::size_t(p), 0.0);
      for (std::size_t piece = 0; piece < n; ++piece) {
        const double price = 50e-6 * (1 + piece % 3);
        double slowest = 0;
        for (int r = 0; r < p; ++r) {
          double t = price * (1 + sigma * rng.normal()) * (r == p - 1 ? slow : 1.0);
          if (r == 0 && piece == 0) t += host;
          slowest = std::max(slowest, t);
          own[std::size_t(r)] += t;
          if (piece >= x.kernels_begin) kernels[std::size_t(r)] += t;
        }
        x.pieces.push_back(slowest);
        x.step_s += slowest;
      }
      x.cpu_s = own[0];
      x.slowest_cpu_s = *std::max_element(own.begin(), own.end());
      x.slowest_kernels_cpu_s = *std::max_element(kernels.begin(), kernels.end());
      steps.push_back(std::move(x));
    }
    return steps;
  };
  for (const int p : {2, 3, 5}) {
    for (const double sigma : {0.02, 0.08}) {
      INFO("p = ", p, ", sigma = ", sigma);
      const std::uint64_t seed = std::uint64_t(1000 * p) + std::uint64_t(sigma * 1000);
      const double without_host = fit_rank_jitter(served(p, sigma, 1.0, 0.0, seed), p);
      CHECK(without_host == doctest::Approx(sigma).epsilon(0.10).scale(0));  // 0.95-0.97x at these seeds
      // Host work outside the run (30 us): left out, read as without it (the kernel pieces drew the same numbers).
      CHECK(fit_rank_jitter(served(p, sigma, 1.0, 30e-6, seed), p) == without_host);
      // Counted in (the clock not told the run), it makes rank 0 the slowest of its piece and of the step, takes away
      // those maxima's excess over the pieces' prices and reads sigma high (1.10-1.31x at these seeds).
      CHECK(fit_rank_jitter(served(p, sigma, 1.0, 30e-6, seed, false), p) >= sigma * 1.08);
      // Three kernel pieces a step (a small model's): a step's own reading is skewed there (the steps' median read
      // 0.71-0.85x); the steps together are not.
      CHECK(fit_rank_jitter(served(p, sigma, 1.0, 30e-6, seed, true, 4), p) ==
            doctest::Approx(sigma).epsilon(0.10).scale(0));
      // A rank 30% slower throughout: its pieces set the pace alone; no spread is read into it.
      CHECK(fit_rank_jitter(served(p, sigma, 1.3, 0.0, seed), p) <= sigma * 1.15);
      CHECK(fit_rank_jitter(served(p, sigma, 1.0, 0.0, seed), 1) == 0);
    }
  }
  CHECK(fit_rank_jitter({}, 2) == 0);
  StepTiming one_piece;
  one_piece.pieces = {1e-3, 1e-3};
  one_piece.step_s = one_piece.slowest_cpu_s = 2e-3;
  one_piece.kernels_begin = 1, one_piece.kernels_end = 2, one_piece.slowest_kernels_cpu_s = 1e-3;
  CHECK(fit_rank_jitter({one_piece}, 2) == 0);  // one kernel piece: no wait to read
  StepTiming wide;
  wide.pieces = {1e-3, 1e-3};
  wide.step_s = 2e-3, wide.slowest_cpu_s = 1e-3;
  wide.kernels_end = 2, wide.slowest_kernels_cpu_s = 1e-3;
  CHECK(fit_rank_jitter({wide}, 2) == 0.5);  // a wait of half the step is no normal spread: clamped
  CHECK_THROWS_WITH_AS(fit_rank_jitter({}, 0), doctest::Contains("ranks = 0"), Error);
}
