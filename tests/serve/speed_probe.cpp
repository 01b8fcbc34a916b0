// tests/serve/speed_probe.cpp: the machine's speed against its profile (serve/speed_probe.hpp) and the simulated
// clock at that speed. slowdown_of is the median of measured / the profile's price over the samples (exactly, and
// unmoved by one outlier); the probe's shapes are the served model's decode GEMMs; a probe on thread ranks gives every
// rank the same finite value, taken over the profile's baseline where it has one (the probe's reading of the
// calibration's own samples of its shapes); a SimulatedClock slowed by s charges exactly s times every part of every
// step's price, and a run on it takes the same decisions and produces the same tokens as at speed 1, every time stamp
// s times (arrivals at 0); slowed by kind, a step with a prompt chunk is charged the prompt factor and one of decode
// tokens alone the decode factor; a slowdown that is not positive and finite is refused by name. The step probe
// (serve/step_probe.hpp): a burst served on the synchronised CPU clock on 2 and 3 thread ranks hands rank 0 every
// step's trace and timing (the others nothing) and the tokens a simulated run of the same requests produces; its
// slowdown, of all steps and of each kind (steps scaled by random factors), is the steps' time over their price, both
// summed, over the mean of the profile's step jitter, exactly; a clock set to the kinds' slowdowns charges each kind
// what it took; a burst of one kind gives the other the factor of all; a clock slowed by s reads it s times lower.
#include "paradyse/comm/threads.hpp"
#include "paradyse/serve/cluster_spec.hpp"
#include "paradyse/serve/engine.hpp"
#include "paradyse/serve/hf_checkpoint.hpp"
#include "paradyse/serve/request_trace.hpp"
#include "paradyse/serve/speed_probe.hpp"
#include "paradyse/serve/step_probe.hpp"
#include "support/fresh_seed.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <filesystem>
#include <limits>
#include <random>
#include <vector>

using namespace paradyse;
using namespace paradyse::serve;

namespace speed_probe_test {

std::filesystem::path repo() { return std::filesystem::path(__FILE__).parent_path().parent_path().parent_path(); }

// A profile with two GEMM size classes and a single fit above them, the rates drawn at random.
cost::HardwareProfile random_profile(std::mt19937_64& rng) {
  std::uniform_real_distribution<double> u(0.5, 2.0);
  cost::HardwareProfile p;
  p.gemm = {3e-6 * u(rng), 2e11 * u(rng), 8e9 * u(rng)};
  p.gemm.by_rows = {{16, 2e-6 * u(rng), 3e11 * u(rng), 6e9 * u(rng), 0}, {128, 4e-6 * u(rng), 2e11 * u(rng), 7e9 * u(rng), 0}};
  return p;
}

struct Outcomes {
  std::vector<RequestOutcome> out;
  EngineStats stats;
};

Outcomes serve_on_simulated(const LoadedDecoder& m, const std::vector<ServeRequest>& requests, double slowdown) {
  Outcomes r;
  run_ranks(2, [&](ThreadCommunicator& comm) {
    SimulatedClock clock(m.config, simulated_cluster("h100", 2));
    clock.set_slowdown(slowdown);
    EngineOptions o;
    o.step_tokens = 8, o.max_running = 5, o.block_size = 4, o.kv_blocks = 24, o.clock = &clock;
    EnginePolicy policy;  // prefill favours EP, decode TP: it switches both ways, on its own (unslowed) time model
    policy.mode = ModePolicy::dynamic;
    policy.switching = {0.0, 1, 1};
    policy.rates = {1e9, 1e12, 1e4};
    EngineStats stats;
    auto got = serve_requests(comm, m, requests, o, policy, &stats);
    if (comm.rank() == 0) r.out = std::move(got), r.stats = stats;
  });
  return r;
}


TEST_CASE("speed probe: the slowdown is the median of measured / priced, exactly, and one outlier does not move it") {
  PARADYSE_FRESH_RNG(rng);
  const DecoderConfig c = load_decoder((repo() / "tests" / "data" / "hf" / "mixtral").string()).config;
  for (int trial = 0; trial < 20; ++trial) {
    const cost::HardwareProfile p = random_profile(rng);
    const double s = std::uniform_real_distribution<double>(0.5, 3.0)(rng);
    const cost::GemmClassOptions probe = speed_probe_options(c, 1 + trial % 3, {});
    std::vector<cost::GemmSample> samples;
    for (const auto& [m, n, k] : probe.shapes)
      samples.push_back({m, n, k, s * p.gemm.time(double(m), double(n), double(k), 4)});
    CHECK(cost::slowdown_of(samples, p) == doctest::Approx(s).epsilon(1e-12));
    samples.front().seconds *= 50;  // one shape hit by a burst of load elsewhere
    CHECK(cost::slowdown_of(samples, p) == doctest::Approx(s).epsilon(1e-12));
    // The median: a third of the samples twice as slow moves it to at most their neighbours' ratio.
    for (std::size_t i = 0; i < samples.size(); i += 3) samples[i].seconds *= 2;
    CHECK(cost::slowdown_of(samples, p) == doctest::Approx(s).epsilon(1e-12));
  }
  CHECK_THROWS_WITH_AS(cost::slowdown_of({}, cost::HardwareProfile{}), doctest::Contains("no samples"), Error);
}

TEST_CASE("speed probe: its shapes are the model's decode GEMMs, timed as the profile's classes were calibrated") {
  const DecoderConfig c = load_decoder((repo() / "tests" / "data" / "hf" / "mixtral").string()).config;
  for (const int p : {1, 2, 3}) {
    cost::GemmClassOptions like = serving_gemm_classes(c, p, 64);
    like.cold_bytes = 1 << 20;
    like.clock = cost::TimeSource::wall;
    const cost::GemmClassOptions probe = speed_probe_options(c, p, like);
    CHECK(probe.cold_bytes == like.cold_bytes);
    CHECK(probe.clock == like.clock);
    CHECK(probe.repetitions == 3);  // the fastest of three, as a class's sample
    std::vector<std::array<std::int64_t, 3>> decode;
    for (const auto& s : serving_gemm_shapes(c, p, 64))
      if (s[0] == 1 || s[0] == 4 || s[0] == 16) decode.push_back(s);
    CHECK(probe.shapes == decode);
    CHECK(probe.shapes.size() == 3 * (4 + expert_and_head_weights(c, p).size()));
  }
}

TEST_CASE("speed probe: on thread ranks every rank gets the same positive, finite slowdown") {
  const DecoderConfig c = load_decoder((repo() / "tests" / "data" / "hf" / "mixtral").string()).config;
  for (const int p : {1, 2, 3}) {
    cost::GemmClassOptions like;
    like.cold_bytes = 1 << 18;
    const cost::GemmClassOptions probe = speed_probe_options(c, p, like);
    PARADYSE_FRESH_RNG(rng);
    const cost::HardwareProfile profile = random_profile(rng);
    std::vector<double> got(std::size_t(p), -1);
    run_ranks(p, [&](ThreadCommunicator& comm) { got[std::size_t(comm.rank())] = cost::probe_slowdown<ops::Cpu>(comm, probe, profile); });
    for (const double g : got) {
      CHECK(g == got[0]);
      CHECK(std::isfinite(g));
      CHECK(g > 0);
    }
  }
}

TEST_CASE("speed probe: a reading is taken over the profile's baseline, its reading of the calibration's own samples") {
  cost::HardwareProfile profile;
  CHECK(slowdown_against_baseline(1.3, profile) == 1.3);  // no baseline: the reading as it is
  profile.probe_baseline = 1.25;
  CHECK(slowdown_against_baseline(1.25, profile) == 1);   // the reading the calibration's machine gave
  CHECK(slowdown_against_baseline(1.5, profile) == doctest::Approx(1.2).epsilon(1e-15));
  CHECK(slowdown_against_baseline(1.0, profile) == doctest::Approx(0.8).epsilon(1e-15));
  // The baseline: the probe's reading of the calibration's own samples of its shapes (the others left out), s where
  // every probed shape measured s times its price.
  const DecoderConfig c = load_decoder((repo() / "tests" / "data" / "hf" / "mixtral").string()).config;
  PARADYSE_FRESH_RNG(rng);
  for (const int p : {1, 2, 3}) {
    const cost::GemmClassOptions probe = speed_probe_options(c, p, {});
    const cost::HardwareProfile q = random_profile(rng);
    const double s = std::uniform_real_distribution<double>(0.7, 1.6)(rng);
    std::vector<cost::GemmSample> calibration;
    for (const auto& [m, n, k] : serving_gemm_shapes(c, p, 64)) {
      const bool probed = std::find(probe.shapes.begin(), probe.shapes.end(), std::array<std::int64_t, 3>{m, n, k}) != probe.shapes.end();
      calibration.push_back({m, n, k, (probed ? s : 9.0) * q.gemm.time(double(m), double(n), double(k), 4)});
    }
    CHECK(probe_baseline(calibration, probe, q) == doctest::Approx(s).epsilon(1e-12));
    std::vector<double> now(std::size_t(p), -1);
    cost::HardwareProfile with = q;
    with.probe_baseline = s;
    run_ranks(p, [&](ThreadCommunicator& comm) { now[std::size_t(comm.rank())] = serving_slowdown(comm, probe, with); });
    for (const double x : now) {
      CHECK(x == now[0]);
      CHECK(std::isfinite(x));
      CHECK(x > 0);
    }
  }
  CHECK_THROWS_WITH_AS(probe_baseline({{2, 3, 5, 1e-6}}, speed_probe_options(c, 2, {}), profile),
                       doctest::Contains("hold none of the probe's"), Error);
}

TEST_CASE("simulated clock: slowed by s it charges s times every part of a step's price; a run takes the same decisions") {
  const LoadedDecoder m = load_decoder((repo() / "tests" / "data" / "hf" / "mixtral").string());
  std::vector<TraceRequest> t = poisson_trace(1.0, 10, {3, 11, 2, 7}, 5);
  for (TraceRequest& r : t) r.arrival_s = 0;
  const std::vector<ServeRequest> requests = to_serve_requests(t, m.config.vocab, 3);
  const Outcomes base = serve_on_simulated(m, requests, 1.0);
  CHECK(base.stats.switches > 0);
  for (const double s : {0.5, 1.37, 3.0}) {
    const Outcomes slow = serve_on_simulated(m, requests, s);
    REQUIRE(slow.out.size() == base.out.size());
    for (std::size_t i = 0; i < base.out.size(); ++i) {
      CHECK(slow.out[i].tokens == base.out[i].tokens);
      CHECK(slow.out[i].first_token == doctest::Approx(s * base.out[i].first_token).epsilon(1e-9));
      CHECK(slow.out[i].finish == doctest::Approx(s * base.out[i].finish).epsilon(1e-9));
    }
    CHECK(slow.stats.step_tokens == base.stats.step_tokens);
    CHECK(slow.stats.mode_of_step == base.stats.mode_of_step);
    CHECK(slow.stats.switches == base.stats.switches);
    REQUIRE(slow.stats.step_seconds.size() == base.stats.step_seconds.size());
    for (std::size_t k = 0; k < base.stats.step_seconds.size(); ++k)
      CHECK(slow.stats.step_seconds[k] == doctest::Approx(s * base.stats.step_seconds[k]).epsilon(1e-12));
  }
  // price(): each part (compute, communication, switch) times s.
  SimulatedClock one(m.config, simulated_cluster("h100", 2)), slowed(m.config, simulated_cluster("h100", 2));
  slowed.set_slowdown(2.5);
  StepTrace trace;
  trace.ranks = 2;
  trace.chunks = {{3, 0, false}, {1, 9, true}};
  for (std::int64_t l = 0; l < m.config.layers; ++l) {
    std::vector<std::int64_t> routed(std::size_t(m.config.moe.experts), 0);
    if (m.config.is_moe(l)) routed[0] = 4, routed[1] = 4;
    trace.routed.push_back(m.config.is_moe(l) ? routed : std::vector<std::int64_t>{});
  }
  trace.layout.assign(std::size_t(m.config.layers), ExpertLayout::tp());
  trace.next.assign(std::size_t(m.config.layers), std::nullopt);
  const StepCost a = one.price(trace), b = slowed.price(trace);
  CHECK(a.total_s() > 0);
  CHECK(b.compute_s == doctest::Approx(2.5 * a.compute_s).epsilon(1e-12));
  CHECK(b.communication_s == doctest::Approx(2.5 * a.communication_s).epsilon(1e-12));
  CHECK(b.switch_s == doctest::Approx(2.5 * a.switch_s).epsilon(1e-12));
  // By kind: the step with a prompt chunk at the prompt factor, the same batch as decode tokens alone at the decode's.
  SimulatedClock kinds(m.config, simulated_cluster("h100", 2));
  kinds.set_slowdown(StepSlowdown{1.5, 3.0});
  CHECK(trace.has_prompt());
  CHECK(kinds.price(trace).total_s() == doctest::Approx(3.0 * a.total_s()).epsilon(1e-12));
  StepTrace decodes = trace;
  decodes.chunks = {{1, 4, true}, {1, 9, true}, {1, 5, true}, {1, 7, true}};  // the same 4 tokens, 8 pairs
  CHECK_FALSE(decodes.has_prompt());
  CHECK(kinds.price(decodes).total_s() == doctest::Approx(1.5 * one.price(decodes).total_s()).epsilon(1e-12));
  for (const double bad : {0.0, -1.0, std::numeric_limits<double>::infinity(), std::nan("")}) {
    CHECK_THROWS_WITH_AS(slowed.set_slowdown(bad), doctest::Contains("slowdown"), Error);
    CHECK_THROWS_WITH_AS(slowed.set_slowdown(StepSlowdown{1.0, bad}), doctest::Contains("slowdown"), Error);
    CHECK_THROWS_WITH_AS(slowed.set_slowdown(StepSlowdown{bad, 1.0}), doctest::Contains("slowdown"), Error);
  }
}

TEST_CASE("step probe: a burst on the CPU clock, its steps' time over their price, by kind and all together, over "
          "the step jitter's mean") {
  const LoadedDecoder m = load_decoder((repo() / "tests" / "data" / "hf" / "mixtral").string());
  PARADYSE_FRESH_RNG(rng);
  for (const int ranks : {2, 3}) {
    CAPTURE(ranks);
    std::vector<TraceRequest> t = poisson_trace(50.0, 7, {2, 9, 2, 6}, 11 + ranks);
    for (TraceRequest& r : t) r.arrival_s = 0;
    const std::vector<ServeRequest> requests = to_serve_requests(t, m.config.vocab, 5);
    EngineOptions options;
    options.step_tokens = 8, options.max_running = 4, options.block_size = 4, options.kv_blocks = 20;
    ServedSteps served;
    std::vector<RequestOutcome> simulated;
    std::vector<std::size_t> held(std::size_t(ranks), 0);  // each rank's steps handed back
    run_ranks(ranks, [&](ThreadCommunicator& plain) {
      const int rank = plain.rank();
      ServedSteps s = serve_on_cpu_clock(std::move(plain), m, requests, options, EnginePolicy{});
      held[std::size_t(rank)] = s.traces.size();
      if (rank == 0) served = std::move(s);
    });
    run_ranks(ranks, [&](ThreadCommunicator& comm) {
      SimulatedClock clock(m.config, simulated_cluster("h100", 4));
      EngineOptions run = options;
      run.clock = &clock;
      auto got = serve_requests(comm, m, requests, run, EnginePolicy{});
      if (comm.rank() == 0) simulated = std::move(got);
    });
    for (int r = 1; r < ranks; ++r) CHECK(held[std::size_t(r)] == 0);  // rank 0 alone holds them
    REQUIRE(served.traces.size() == served.timings.size());
    CHECK(std::int64_t(served.traces.size()) == served.stats.steps);
    for (const StepTiming& x : served.timings) {
      CHECK(x.step_s > 0);
      CHECK(x.step_s >= x.slowest_cpu_s * (1 - 1e-12));  // each piece at its slowest rank: at least one rank's whole
    }
    // The same tokens as a run of the same requests on the simulated clock (nothing but the clock differs).
    REQUIRE(served.outcomes.size() == simulated.size());
    for (std::size_t i = 0; i < simulated.size(); ++i) {
      CHECK(served.outcomes[i].id == simulated[i].id);
      CHECK(served.outcomes[i].tokens == simulated[i].tokens);
      CHECK_FALSE(served.outcomes[i].tokens.empty());
    }
    // Each step's ratio exactly; the slowdown: time over price, both summed, over the step jitter's mean factor.
    SimulatedClock priced(m.config, simulated_cluster("h100", 4));
    SimulatedCluster jittered_cluster = simulated_cluster("h100", 4);
    jittered_cluster.profile.step_jitter = {0.8, 0.95, 1.0, 1.1, 1.4};  // mean 1.05
    SimulatedClock jittered(m.config, jittered_cluster);
    ServedSteps scaled = served;
    std::vector<double> factors;
    double time = 0, price = 0;
    for (std::size_t i = 0; i < scaled.traces.size(); ++i) {
      factors.push_back(std::uniform_real_distribution<double>(0.5, 2.0)(rng));
      const double p = priced.price(scaled.traces[i]).total_s();
      scaled.timings[i].step_s = factors.back() * p;
      time += scaled.timings[i].step_s, price += p;
    }
    const std::vector<double> ratios = step_price_ratios(scaled, priced);
    REQUIRE(ratios.size() == factors.size());
    for (std::size_t i = 0; i < ratios.size(); ++i) CHECK(ratios[i] == doctest::Approx(factors[i]).epsilon(1e-12));
    CHECK(step_slowdown(scaled, priced).all == doctest::Approx(time / price).epsilon(1e-12));
    CHECK(step_slowdown(scaled, jittered).all == doctest::Approx(time / price / 1.05).epsilon(1e-12));
    SimulatedClock slowed(m.config, simulated_cluster("h100", 4));
    slowed.set_slowdown(1.6);
    CHECK(step_slowdown(served, slowed).all == doctest::Approx(step_slowdown(served, priced).all / 1.6).epsilon(1e-12));

    // By kind: the steps with a prompt chunk and those of decode tokens alone, each summed on its own; the burst
    // serves both kinds (every request's prompt, then its decode tokens).
    double kind_time[2] = {0, 0}, kind_price[2] = {0, 0};  // [decode, prompt]
    for (std::size_t i = 0; i < scaled.traces.size(); ++i) {
      const StepTrace& t = scaled.traces[i];
      const bool prompt =
          std::any_of(t.chunks.begin(), t.chunks.end(), [](const ChunkShape& ch) { return !ch.decode; });
      CHECK(t.has_prompt() == prompt);
      kind_time[prompt ? 1 : 0] += scaled.timings[i].step_s;
      kind_price[prompt ? 1 : 0] += priced.price(t).total_s();
    }
    REQUIRE(kind_price[0] > 0);
    REQUIRE(kind_price[1] > 0);
    const StepProbeReading read = step_slowdown(scaled, jittered);
    CHECK(read.by_kind.decode == doctest::Approx(kind_time[0] / kind_price[0] / 1.05).epsilon(1e-12));
    CHECK(read.by_kind.prompt == doctest::Approx(kind_time[1] / kind_price[1] / 1.05).epsilon(1e-12));
    // A clock set to the kinds' slowdowns charges the burst what it took, each kind to the rounding (in expectation
    // over the jitter; without it, exactly).
    SimulatedClock by_kind(m.config, simulated_cluster("h100", 4));
    by_kind.set_slowdown(step_slowdown(scaled, priced).by_kind);
    double charged[2] = {0, 0};
    for (const StepTrace& t : scaled.traces) charged[t.has_prompt() ? 1 : 0] += by_kind.price(t).total_s();
    CHECK(charged[0] == doctest::Approx(kind_time[0]).epsilon(1e-12));
    CHECK(charged[1] == doctest::Approx(kind_time[1]).epsilon(1e-12));
    // A burst of one kind: the other kind takes the factor of all.
    ServedSteps decodes;
    for (std::size_t i = 0; i < scaled.traces.size(); ++i)
      if (!scaled.traces[i].has_prompt())
        decodes.traces.push_back(scaled.traces[i]), decodes.timings.push_back(scaled.timings[i]);
    REQUIRE_FALSE(decodes.traces.empty());
    const StepProbeReading alone = step_slowdown(decodes, priced);
    CHECK(alone.by_kind.decode == doctest::Approx(kind_time[0] / kind_price[0]).epsilon(1e-12));
    CHECK(alone.by_kind.prompt == alone.all);
    CHECK(alone.all == alone.by_kind.decode);
  }
  ServedSteps uneven;
  uneven.traces.resize(2);
  uneven.timings.resize(1);
  SimulatedClock priced(m.config, simulated_cluster("h100", 2));
  CHECK_THROWS_WITH_AS(step_price_ratios(uneven, priced), doctest::Contains("2 traces for 1 timings"), Error);
  CHECK_THROWS_WITH_AS(step_slowdown(uneven, priced), doctest::Contains("2 traces for 1 timings"), Error);
  CHECK_THROWS_WITH_AS(step_slowdown(ServedSteps{}, priced), doctest::Contains("served no step"), Error);
}

}  // namespace speed_probe_test
