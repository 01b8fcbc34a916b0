// tests/serve/weight_reuse.cpp: the simulated clock prices each GEMM at its weight's reuse distance
// (cost/gemm_reuse.hpp, serve/step_dry_run.hpp dry_run_timeline's `reads`, serve/clock.hpp SimulatedClock). A step
// priced with the ranks' reads is its price without them plus, over its dry-run trace's GEMMs, each at its weight's
// distance (cost::gemm_time) less its plain price (one rank's whole trace in TP on 1 and 2 ranks, every rank alike;
// on 3 the ranks differ); tables with the same times at every
// cycle change nothing; the clock charges each step what price() said just before, advances its reads as it goes, and
// step_prices' sequence (serve/step_probe.hpp) is what the clock charged; a repeated decode step reads its weights
// nearer than the run's first.
#include "paradyse/serve/clock.hpp"
#include "paradyse/serve/cluster_spec.hpp"
#include "paradyse/serve/serving_calibration.hpp"
#include "paradyse/serve/step_dry_run.hpp"
#include "paradyse/serve/step_probe.hpp"
#include "paradyse/serve/synthetic_decoder.hpp"

#include "support/fresh_seed.hpp"

#include <doctest/doctest.h>

#include <random>
#include <vector>

using namespace paradyse;
using namespace paradyse::serve;

namespace weight_reuse_test {

// The served model's rank-0 shapes at rows 1..16, measured at three cycles: a decode step's weights (`near`, times
// scaled by near_scale), a whole step's (the calibration's: `measured`, random times) and memory (scaled by far_scale).
cost::GemmModel with_tables(const DecoderConfig& c, int ranks, std::mt19937_64& rng, double near_scale,
                            double far_scale) {
  std::uniform_real_distribution<double> u(2e-6, 2e-5);
  cost::GemmModel g = simulated_cluster("h100", 2).profile.gemm;
  cost::GemmMeasured mid{4, {}, double(step_weight_bytes(c, ranks))};
  for (const auto& s : serving_gemm_shapes(c, ranks, 16)) {
    const double m = double(s[0]), n = double(s[1]), k = double(s[2]);
    auto hit = std::find_if(mid.shapes.begin(), mid.shapes.end(), [&](const auto& x) { return x.n == n && x.k == k; });
    if (hit == mid.shapes.end()) mid.shapes.push_back({n, k, {}, {}}), hit = mid.shapes.end() - 1;
    hit->rows.push_back(m), hit->seconds.push_back(u(rng) * (1 + m / 16));
  }
  cost::GemmMeasured near = mid, far = mid;
  near.cycle_bytes = double(decode_weight_bytes(c, ranks)), far.cycle_bytes = 128e6;
  for (auto& s : near.shapes)
    for (double& x : s.seconds) x *= near_scale;
  for (auto& s : far.shapes)
    for (double& x : s.seconds) x *= far_scale;
  g.measured = mid;
  g.reuse = {near, far};
  return g;
}

StepTrace decode_batch(const DecoderConfig& c, int p, std::int64_t tokens, std::int64_t cached) {
  StepTrace t;
  t.ranks = p;
  for (std::int64_t i = 0; i < tokens; ++i) t.chunks.push_back({1, cached + i, true});
  for (std::int64_t l = 0; l < c.layers; ++l) {
    t.layout.push_back(ExpertLayout::tp());
    t.next.push_back(std::nullopt);
    std::vector<std::int64_t> routed(std::size_t(c.moe.experts), 0);
    for (std::int64_t j = 0; j < tokens * c.moe.top_k; ++j) ++routed[std::size_t((j * 3 + l) % c.moe.experts)];
    t.routed.push_back(routed);
  }
  return t;
}

// What pricing at the distances adds to `events`: each GEMM call at its weight's distance in `reads` (advanced as it
// goes) less its GemmModel::time.
double reuse_extra_s(const std::vector<TraceEvent>& events, const cost::GemmModel& g, cost::WeightReads& reads) {
  double extra = 0;
  for (const TraceEvent& e : events)
    if (e.kind == TraceKind::gemm) extra += e.count * (cost::gemm_time(e, g, 4, &reads) - g.time(e.m, e.n, e.k, 4));
  return extra;
}

}  // namespace weight_reuse_test

using namespace weight_reuse_test;

TEST_CASE("weight reuse: a step's price with the reads is its price without plus its GEMMs' at their distances") {
  PARADYSE_FRESH_RNG(rng);
  const DecoderConfig c = synthetic_config(64, 2, 4, 2, 4, 2, 96, 128);
  for (const int p : {1, 2, 3}) {
    INFO("p = ", p);
    SimulatedCluster cluster = simulated_cluster("h100", 2);
    cluster.dtype_bytes = 4;
    cluster.profile.gemm = with_tables(c, p, rng, 0.5, 2.0);
    SimulatedCluster plain = cluster;
    plain.profile.gemm.reuse.clear();
    const std::vector<StepTrace> steps = {decode_batch(c, p, 2, 40), decode_batch(c, p, 3, 41),
                                          decode_batch(c, p, 1, 7)};
    StepDryRunner runner(c);
    std::vector<cost::WeightReads> reads;
    cost::WeightReads reference;  // rank 0's reads, from its whole traces on the same shards (TP: ranks alike)
    for (const StepTrace& t : steps) {
      const double without = dry_run_step_cost(runner, t, plain).total_s();
      const double adjustment = reuse_extra_s(runner.run(t, 0).events, cluster.profile.gemm, reference);
      const double with = dry_run_step_cost(runner, t, cluster, true, &reads).total_s();
      CHECK(adjustment != 0);
      CHECK(reads[0].bytes_read() == reference.bytes_read());
      if (p <= 2) CHECK(with == doctest::Approx(without + adjustment).epsilon(1e-12));
      else CHECK(with != without);  // (3 ranks differ: per piece the slowest rank's, each at its own reads)
    }
    // Without reads, or with tables whose times are the same at every cycle: the plain price, to the bit.
    const StepTrace& t = steps[1];
    CHECK(dry_run_step_cost(runner, t, cluster).total_s() == dry_run_step_cost(runner, t, plain).total_s());
    SimulatedCluster flat = cluster;
    flat.profile.gemm.reuse = {cluster.profile.gemm.measured, cluster.profile.gemm.measured};
    flat.profile.gemm.reuse[0].cycle_bytes = 1, flat.profile.gemm.reuse[1].cycle_bytes = 1e9;
    std::vector<cost::WeightReads> flat_reads;
    for (const StepTrace& s : steps)
      CHECK(dry_run_step_cost(runner, s, flat, true, &flat_reads).total_s() ==
            dry_run_step_cost(runner, s, plain).total_s());
  }
}

TEST_CASE("weight reuse: the clock charges what price() said, its reads advancing; step_prices is that sequence") {
  PARADYSE_FRESH_RNG(rng);
  const DecoderConfig c = synthetic_config(64, 2, 4, 2, 4, 2, 96, 128);
  const int p = 2;
  SimulatedCluster cluster = simulated_cluster("h100", 2);
  cluster.dtype_bytes = 4;
  cluster.profile.gemm = with_tables(c, p, rng, 0.6, 1.5);
  SimulatedClock clock(c, cluster);
  clock.start();
  ServedSteps served;
  for (int k = 0; k < 6; ++k) served.traces.push_back(decode_batch(c, p, 1 + k % 2, 10 + k));
  std::vector<double> charged;
  for (const StepTrace& t : served.traces) {
    const double said = clock.price(t).total_s();
    CHECK(clock.price(t).total_s() == said);  // pricing records no reads
    clock.step_begin();
    const StepTiming timing = clock.step_end(t, 0);
    CHECK(timing.step_s == said);
    charged.push_back(timing.step_s);
    served.timings.push_back(timing);
  }
  // The run's first step reads every weight for the first time (the far tables); the same step again, nearer.
  CHECK(charged[2] < charged[0]);
  CHECK(step_prices(served, clock) == charged);
  // A clock started again forgets its reads: its first price is the first step's.
  clock.start();
  CHECK(clock.price(served.traces[0]).total_s() == charged[0]);
}
