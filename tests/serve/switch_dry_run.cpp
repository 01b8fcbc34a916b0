// tests/serve/switch_dry_run.cpp: the dynamic policy on the dry-run clock (serve/clock.hpp SimulatedClock). The
// switcher forecasts with the dry run of the step on its time model (ForecastModel::dry_run: what the clock charges,
// SimulatedClock::price) or with step_cost's analytic model (the default), and the expert loads of
// serve/switch_policy.hpp's LoadForecast; on Mixtral-8x7B (8x H100) at 64 requests/s it takes EP as it does on an
// analytic clock forecasting with step_cost, and the analytic forecast takes the dry run's decisions.
#include "paradyse/comm/threads.hpp"
#include "paradyse/core/rng.hpp"
#include "paradyse/serve/cluster_spec.hpp"
#include "paradyse/serve/engine.hpp"
#include "paradyse/serve/model_shape_hf.hpp"
#include "paradyse/serve/request_trace.hpp"
#include "paradyse/serve/routing_source.hpp"
#include "paradyse/serve/shape_step.hpp"

#include "serve/launch_per_expert.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <filesystem>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

using namespace paradyse;
using namespace paradyse::serve;

namespace switch_dry_run_test {

DecoderConfig mixtral() {
  return read_model_shape((std::filesystem::path(PARADYSE_TEST_DATA_DIR).parent_path().parent_path() / "data" /
                           "model_shapes" / "mixtral-8x7b.json").string()).config;
}

// The clock of the analytic model: each step advances by step_cost (serve/step_cost.hpp).
class AnalyticClock final : public EngineClock {
public:
  AnalyticClock(const DecoderConfig& c, const SimulatedCluster& cluster) : c_(c), cluster_(cluster) {}
  std::string_view name() const override { return "analytic"; }
  void start() override { now_ = 0; }
  double now() const override { return now_; }
  double elapsed_s() const override { return now_; }
  void idle(double next_arrival) override {
    if (std::isfinite(next_arrival)) now_ = std::max(now_, next_arrival);
  }
  void step_begin() override {}

private:
  StepTiming advance(const StepTrace& t, double) override {
    const StepCost s = step_cost(c_, t, cluster_);
    now_ += s.total_s();
    return {s.total_s(), s.switch_s};
  }
  const DecoderConfig& c_;
  const SimulatedCluster& cluster_;
  double now_ = 0;
};

struct Served {
  std::vector<RequestOutcome> out;
  EngineStats stats;
  std::int64_t ep_steps = 0, first_ep = -1;
};

// Mixtral on 8 modelled ranks (Zipf 0.5 routing), the dynamic policy as moe_simulate runs it (its time model the
// cluster's), on `clock`; `price`: the switcher's cost of a step when set (else `forecast` on the cluster).
Served serve_dynamic(const DecoderConfig& c, const SimulatedCluster& cluster, EngineClock& clock,
                     const std::vector<ServeRequest>& requests, StepPricer price = {},
                     ForecastModel forecast = ForecastModel::dry_run) {
  EnginePolicy policy;
  policy.mode = ModePolicy::dynamic;
  policy.time_model = cluster;
  policy.forecast = forecast;
  policy.forecast_price = std::move(price);
  policy.switching = {0.1, 2, 8, 32, true, 0};
  Served r;
  run_ranks(1, [&](ThreadCommunicator& comm) {
    EngineOptions o;
    o.step_tokens = 512;
    o.max_running = 256;
    o.block_size = 16;
    o.kv_blocks = 1 << 18;
    o.clock = &clock;
    ZipfRouting routing(0.5, 1);
    ShapeStepper stepper(c, 8, o, MoeMode::tp, routing);
    r.out = serve_loop(comm, stepper, requests, o, policy, clock, &r.stats);
  });
  for (std::size_t k = 0; k < r.stats.mode_of_step.size(); ++k)
    if (r.stats.mode_of_step[k] == MoeMode::ep) {
      if (r.first_ep < 0) r.first_ep = std::int64_t(k);
      ++r.ep_steps;
    }
  return r;
}

double ttft_p50(const std::vector<RequestOutcome>& out) {
  std::vector<double> t;
  for (const RequestOutcome& o : out) t.push_back(o.first_token - o.arrival);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// A step of `chunks` in the layouts `layout` with Zipf loads.
StepTrace step_of(const DecoderConfig& c, std::vector<ChunkShape> chunks, ExpertLayout layout) {
  StepTrace t;
  t.ranks = 8;
  t.chunks = std::move(chunks);
  ZipfRouting zipf(0.5, 7);
  std::int64_t moe = 0;
  for (std::int64_t l = 0; l < c.layers; ++l) {
    t.layout.push_back(c.is_moe(l) ? layout : ExpertLayout::tp());
    t.next.push_back(std::nullopt);
    t.routed.push_back(c.is_moe(l) ? zipf.counts(3, moe++, t.tokens(), c.moe.experts, c.moe.top_k)
                                   : std::vector<std::int64_t>{});
  }
  return t;
}

}  // namespace switch_dry_run_test

using namespace switch_dry_run_test;

TEST_CASE("switch dry run: the simulated clock prices a step as it advances by it, and the forecast is that price") {
  const DecoderConfig c = mixtral();
  const SimulatedCluster h100 = simulated_cluster("h100", 2);
  SimulatedClock clock(c, h100);
  clock.start();
  const ExpertLayout ep = ExpertLayout::ep(ExpertPlacement::chunked(c.moe.experts, 8).experts_of_rank);
  const StepTrace tp_step = step_of(c, {{512, 0, false}}, ExpertLayout::tp());
  StepTrace ep_step = tp_step;
  for (std::int64_t l = 0; l < c.layers; ++l) ep_step.layout[std::size_t(l)] = ep;
  const double tp_s = clock.price(tp_step).total_s(), ep_s = clock.price(ep_step).total_s();
  CHECK(clock.now() == 0);  // pricing does not advance
  CHECK(clock.price(tp_step).total_s() == tp_s);
  CHECK(tp_s == doctest::Approx(dry_run_step_cost(c, tp_step, h100).total_s() + engine_control_s(tp_step, h100.profile))
                    .epsilon(1e-12));
  // The forecast of the step in both layouts, by the engine's dry-run pricer (the dry run on the time model, a runner
  // of its own): exactly what the clock charges for each.
  StepDryRunner runner(c);
  const StepPricer price = [&](const StepTrace& t) { return simulated_step_cost(runner, t, h100); };
  const LayoutForecast f = forecast_layouts(c, tp_step.chunks, tp_step.routed, tp_step.layout, ep, 8, true, price);
  CHECK(f.step.tp_s == tp_s);
  CHECK(f.step.ep_s == ep_s);
  MESSAGE(fmt::format("512-token prompt step: TP {:.3f} ms, EP {:.3f} ms, switch to EP exposed {:.3f} ms", tp_s * 1e3,
                      ep_s * 1e3, f.to_ep_s * 1e3));
  clock.step_end(tp_step, 0);
  CHECK(clock.now() == tp_s);
  clock.step_end(ep_step, 0);
  CHECK(clock.now() == tp_s + ep_s);
}

TEST_CASE("switch dry run: the forecast's loads follow the recent routing's shares over the step's tokens") {
  const DecoderConfig c = mixtral();
  ZipfRouting zipf(0.5, 1);
  LoadForecast loads(c.layers);
  CHECK_FALSE(loads.ready());
  auto routed = [&](std::int64_t step, std::int64_t n) {
    std::vector<std::vector<std::int64_t>> r(std::size_t(c.layers));
    std::int64_t moe = 0;
    for (std::int64_t l = 0; l < c.layers; ++l)
      if (c.is_moe(l)) r[std::size_t(l)] = zipf.counts(step, moe++, n, c.moe.experts, c.moe.top_k);
    return r;
  };
  loads.observe(routed(0, 512), 512);
  loads.observe(routed(1, 1), 1);  // a decode of one token: 2 experts
  REQUIRE(loads.ready());
  for (const std::int64_t n : {1, 2, 89, 512}) {
    const auto f = loads.loads(n);
    for (std::int64_t l = 0; l < c.layers; ++l) {
      const auto& x = f[std::size_t(l)];
      CAPTURE(n);
      CAPTURE(l);
      REQUIRE(std::int64_t(x.size()) == c.moe.experts);
      CHECK(std::accumulate(x.begin(), x.end(), std::int64_t(0)) == n * c.moe.top_k);  // top-k pairs per token
      CHECK(*std::max_element(x.begin(), x.end()) <= n);                                // none above the tokens
      const auto active = std::count_if(x.begin(), x.end(), [](std::int64_t v) { return v > 0; });
      if (n == 1) CHECK(active == 2);                  // a token's 2 experts (the last 512 tokens' scaled: all 8)
      if (n >= 89) CHECK(active == c.moe.experts);     // every expert (the last decode's scaled: its 2)
    }
  }
  // The dry run takes them (it refuses loads that are not a step's top-k pairs).
  StepTrace t = step_of(c, {{89, 0, false}}, ExpertLayout::tp());
  t.routed = loads.loads(89);
  CHECK(dry_run_step_cost(c, t, simulated_cluster("h100", 2)).total_s() > 0);
  CHECK_THROWS_WITH_AS(LoadForecast(4, 1.0), doctest::Contains("decay 1"), Error);
}

TEST_CASE("switch dry run: at 64 requests/s on Mixtral-8x7B (8x H100) the dynamic policy takes EP on the dry-run "
          "clock as on the analytic one; there the analytic forecast takes the dry-run forecast's decisions") {
  const DecoderConfig c = mixtral();
  // Each expert GEMM its own launch: a crossover to find (tests/serve/launch_per_expert.hpp).
  const SimulatedCluster h100 = serve_scenarios::h100_launch_per_expert();
  // moe_simulate's Poisson trace at 64 requests/s (prompts 64-1024, outputs 16-256 tokens), its first 60 requests.
  const std::vector<ServeRequest> requests =
      to_serve_requests(poisson_trace(64.0, 60, {64, 1024, 16, 256}, 1), c.vocab, 1);
  SimulatedClock dry(c, h100);
  AnalyticClock analytic(c, h100);
  // The reference: the analytic clock, the switcher on step_cost (the last session's analytic tables).
  const Served d = serve_dynamic(c, h100, dry, requests),
               a = serve_dynamic(c, h100, analytic, requests, analytic_pricer(c, h100));
  MESSAGE(fmt::format("dynamic, dry-run clock: {} EP steps of {} (first {}), {} switches, TTFT p50 {:.1f} ms; analytic "
                      "clock: {} of {} (first {}), {} switches, TTFT p50 {:.1f} ms",
                      d.ep_steps, d.stats.steps, d.first_ep, d.stats.switches, ttft_p50(d.out) * 1e3, a.ep_steps,
                      a.stats.steps, a.first_ep, a.stats.switches, ttft_p50(a.out) * 1e3));
  // The steps of 512-token prompt chunks while the requests arrive are where EP is cheaper: both take it there. (The
  // switcher forecasting with step_cost on the dry-run clock: 212 EP steps of 318, the first at step 100, TTFT p50
  // 56.9 ms.)
  REQUIRE(a.first_ep >= 0);
  REQUIRE(d.first_ep >= 0);
  CHECK(std::abs(d.first_ep - a.first_ep) <= 8);
  CHECK(double(d.ep_steps) >= 0.95 * double(a.ep_steps));
  CHECK(ttft_p50(d.out) <= 1.15 * ttft_p50(a.out));

  // The engine's default forecast (step_cost on the time model) on the same dry-run clock: every step in the layout
  // the dry-run forecast chose, and no dry-run events to charge as host work.
  CHECK(EnginePolicy{}.forecast == ForecastModel::analytic);
  SimulatedClock dry_again(c, h100);
  std::int64_t events = 0;
  dry_again.observer = [&](const StepTrace& t, const StepTiming&, double) { events += t.planning_events; };
  const Served n = serve_dynamic(c, h100, dry_again, requests, {}, ForecastModel::analytic);
  CHECK(n.stats.switches > 0);
  CHECK(n.stats.mode_of_step == d.stats.mode_of_step);
  CHECK(events == 0);
  REQUIRE(n.out.size() == d.out.size());
  for (std::size_t i = 0; i < n.out.size(); ++i) CHECK(n.out[i].finish == d.out[i].finish);
}

TEST_CASE("switch dry run: the remembered dry runs forecast every step to the bit as fresh dry runs of every rank") {
  const DecoderConfig c = mixtral();
  const SimulatedCluster h100 = simulated_cluster("h100", 2);
  // 64 requests/s, short outputs: prompt steps in TP, then EP, and decode tails.
  const std::vector<ServeRequest> requests =
      to_serve_requests(poisson_trace(64.0, 12, {64, 1024, 16, 32}, 1), c.vocab, 1);
  // Each pricer's answers, call by call (the engine calls them in the same order while the decisions agree).
  struct Logged {
    std::vector<StepCost> calls;
    StepPricer wrap(StepPricer inner) {
      return [this, inner = std::move(inner)](const StepTrace& t) { return calls.emplace_back(inner(t)); };
    }
  };
  Logged remembered, fresh;
  DryRunPricer pricer(c, h100);  // the engine's dry-run pricer
  StepDryRunner runner(c);
  const auto reference = [&](const StepTrace& t) {  // every rank dry-run, every call
    return dry_run_step_cost(runner, t, h100, /*share_ranks=*/false);
  };
  SimulatedClock clock_a(c, h100), clock_b(c, h100);
  const Served a = serve_dynamic(c, h100, clock_a, requests, remembered.wrap(std::ref(pricer))),
               b = serve_dynamic(c, h100, clock_b, requests, fresh.wrap(reference));
  REQUIRE(remembered.calls.size() == fresh.calls.size());
  REQUIRE(!fresh.calls.empty());
  for (std::size_t i = 0; i < fresh.calls.size(); ++i) {
    INFO("call ", i);
    CHECK(remembered.calls[i].compute_s == fresh.calls[i].compute_s);
    CHECK(remembered.calls[i].communication_s == fresh.calls[i].communication_s);
    CHECK(remembered.calls[i].switch_s == fresh.calls[i].switch_s);
  }
  CHECK(a.stats.mode_of_step == b.stats.mode_of_step);
  CHECK(a.stats.switches == b.stats.switches);
  REQUIRE(a.out.size() == b.out.size());
  for (std::size_t i = 0; i < a.out.size(); ++i) {
    CHECK(a.out[i].first_token == b.out[i].first_token);
    CHECK(a.out[i].finish == b.out[i].finish);
  }
  // Three calls a forecast (TP, EP, the switch to the other layout); the third reuses the current layout's run.
  CHECK(fresh.calls.size() % 3 == 0);
  CHECK(pricer.hits() >= std::int64_t(fresh.calls.size() / 3));
  CHECK(pricer.misses() <= std::int64_t(2 * fresh.calls.size() / 3));
  MESSAGE(fmt::format("{} forecasts over {} steps ({} switches): {} dry runs, {} reused", fresh.calls.size() / 3,
                      a.stats.steps, a.stats.switches, pricer.misses(), pricer.hits()));
}

TEST_CASE("switch dry run: under Alloc-T's pooled routing the forecast of a step is the simulated clock's price of it") {
  const LoadedDecoder m = load_decoder((std::filesystem::path(PARADYSE_TEST_DATA_DIR) / "hf" / "mixtral").string());
  const DecoderConfig& c = m.config;
  const SimulatedCluster h100 = simulated_cluster("h100", 2);
  const int p = 2;
  EnginePolicy policy;
  policy.mode = ModePolicy::dynamic;
  policy.time_model = h100;
  policy.switching = {0.1, 2, 8, 32, true, 0};
  policy.budget = make_routing_budget(c, parse_budget("75%"), nullptr, /*pool_tokens=*/true);
  REQUIRE(policy.budget.pool_tokens);
  std::vector<ServeRequest> requests;
  Rng rng(5);
  for (std::int64_t i = 0; i < 6; ++i) {
    ServeRequest r;
    r.id = i;
    r.arrival = double(i) * 1e-3;
    r.max_new_tokens = 4;
    for (std::int64_t t = 0; t < 5 + 3 * i; ++t) r.prompt.push_back(std::int32_t(rng.below(std::uint64_t(c.vocab))));
    requests.push_back(std::move(r));
  }
  std::vector<std::pair<StepTrace, double>> steps;  // rank 0's: each step and what its clock advanced by
  run_ranks(p, [&](ThreadCommunicator& comm) {
    SimulatedClock clock(c, h100, policy.budget);  // every rank its own (alike)
    if (comm.rank() == 0)
      clock.observer = [&](const StepTrace& t, const StepTiming& timing, double) { steps.push_back({t, timing.step_s}); };
    EngineOptions o;
    o.step_tokens = 8;
    o.block_size = 4;
    o.kv_blocks = 64;
    o.clock = &clock;
    serve_requests(comm, m, requests, o, policy);
  });
  REQUIRE(!steps.empty());
  SimulatedClock clock(c, h100, policy.budget);
  DryRunPricer pricer(c, h100, policy.budget);
  const ExpertLayout ep = ExpertLayout::ep(ExpertPlacement::chunked(c.moe.experts, p).experts_of_rank);
  std::int64_t pooled = 0;
  for (std::size_t k = 0; k < steps.size(); ++k) {
    const StepTrace& t = steps[k].first;
    INFO("step ", k);
    for (const ChunkShape& ch : t.chunks) pooled += ch.tokens > 1;
    CHECK(clock.price(t).total_s() == steps[k].second);  // what the clock advanced by
    StepTrace in_tp = t, in_ep = t;
    for (std::int64_t l = 0; l < c.layers; ++l) {
      in_tp.next[std::size_t(l)].reset(), in_ep.next[std::size_t(l)].reset();
      if (!c.is_moe(l)) continue;
      in_tp.layout[std::size_t(l)] = ExpertLayout::tp();
      if (t.layout[std::size_t(l)].mode != MoeMode::ep) in_ep.layout[std::size_t(l)] = ep;
    }
    const LayoutForecast f = forecast_layouts(c, t.chunks, t.routed, t.layout, ep, p, t.pipelined_switch,
                                              StepPricer(std::ref(pricer)));
    // What the clock charges, less the engine's control collectives (the same in either layout).
    CHECK(f.step.tp_s + engine_control_s(in_tp, h100.profile) == doctest::Approx(clock.price(in_tp).total_s()).epsilon(1e-12));
    CHECK(f.step.ep_s + engine_control_s(in_ep, h100.profile) == doctest::Approx(clock.price(in_ep).total_s()).epsilon(1e-12));
  }
  CHECK(pooled > 0);  // prompt chunks of several tokens: pooled
}

TEST_CASE("switch dry run: each step's trace carries the events its forecast dry-ran; the clock charges them as host "
          "work at the profile's rate") {
  const DecoderConfig c = mixtral();
  SimulatedCluster h100 = simulated_cluster("h100", 2);
  // A dry run's events: every rank's trace of a TP step has the same shapes, so one rank is run; a remembered step
  // runs nothing.
  {
    DryRunPricer price(c, h100);
    const StepTrace tp_step = step_of(c, {{1, 300, true}, {1, 40, true}, {96, 0, false}}, ExpertLayout::tp());
    (void)price(tp_step);
    const std::int64_t one_rank = std::int64_t(dry_run_step(c, tp_step, 0).events.size());
    CHECK(one_rank > 0);
    CHECK(price.events() == one_rank);
    (void)price(tp_step);
    CHECK(price.events() == one_rank);
  }
  // The engine's count, step by step, against a pricer of the test's own forecasting the same run (the profile
  // charges no host work, so both runs take the same steps): each step's planning_events are the events that step's
  // forecast dry-ran.
  const std::vector<ServeRequest> requests = to_serve_requests(poisson_trace(64.0, 6, {64, 512, 4, 12}, 5), c.vocab, 1);
  std::vector<StepTrace> engine_traces;
  std::vector<std::int64_t> own_events;
  SimulatedClock engine_clock(c, h100), own_clock(c, h100);
  engine_clock.observer = [&](const StepTrace& t, const StepTiming&, double) { engine_traces.push_back(t); };
  const Served a = serve_dynamic(c, h100, engine_clock, requests);
  DryRunPricer own(c, h100);
  std::int64_t before = 0;
  own_clock.observer = [&](const StepTrace&, const StepTiming&, double) {
    own_events.push_back(own.events() - before);
    before = own.events();
  };
  const Served b = serve_dynamic(c, h100, own_clock, requests, std::ref(own));
  REQUIRE(engine_traces.size() == own_events.size());
  CHECK(a.stats.mode_of_step == b.stats.mode_of_step);
  std::int64_t forecast_steps = 0;
  for (std::size_t i = 0; i < own_events.size(); ++i) {
    INFO("step ", i);
    CHECK(engine_traces[i].planning_events == own_events[i]);
    forecast_steps += own_events[i] > 0 ? 1 : 0;
  }
  CHECK(forecast_steps >= std::int64_t(own_events.size()) / 2);
  // Charged at the host rate, beside the engine's other host work per step and chunk: a step's price with its events
  // less the same step's without is events / rate.
  h100.profile.planning_events_per_s = 2.5e7;
  h100.profile.serving_host = {30e-6, 2e-6};
  SimulatedClock charged(c, h100);
  for (const StepTrace& t : engine_traces) {
    StepTrace none = t;
    none.planning_events = 0;
    const StepCost with = charged.price(t), without = charged.price(none);
    CHECK(without.host_s == doctest::Approx(30e-6 + 2e-6 * double(t.chunks.size())).epsilon(1e-14));
    CHECK(with.host_s == doctest::Approx(without.host_s + double(t.planning_events) / 2.5e7).epsilon(1e-14));
    CHECK(with.compute_s == without.compute_s);
    CHECK(with.communication_s == without.communication_s);
    CHECK(with.total_s() == doctest::Approx(without.total_s() + double(t.planning_events) / 2.5e7).epsilon(1e-14));
  }
  charged.set_slowdown(2);
  const StepTrace& first = engine_traces.front();
  CHECK(charged.price(first).host_s ==
        doctest::Approx(2 * (double(first.planning_events) / 2.5e7 + 30e-6 + 2e-6 * double(first.chunks.size()))).epsilon(1e-14));
}

TEST_CASE("switch dry run: with the profile's step jitter the clock charges each step its price times a factor drawn for "
          "it, the same every run") {
  const DecoderConfig c = mixtral();
  SimulatedCluster h100 = simulated_cluster("h100", 2);
  h100.profile.step_jitter = {0.5, 1.0, 2.0};
  const StepTrace step = step_of(c, {{1, 300, true}, {1, 40, true}}, ExpertLayout::tp());
  SimulatedClock clock(c, h100);
  const auto run = [&] {
    clock.start();
    std::vector<double> factors;
    const double price = clock.price(step).total_s();
    for (int i = 0; i < 60; ++i) {
      const double before = clock.now();
      clock.step_end(step, 0);
      factors.push_back((clock.now() - before) / price);
    }
    return factors;
  };
  const std::vector<double> first = run(), again = run();
  CHECK(first == again);
  std::array<int, 3> seen{};
  for (const double f : first) {
    const bool known = std::abs(f - 0.5) < 1e-12 || std::abs(f - 1.0) < 1e-12 || std::abs(f - 2.0) < 1e-12;
    CHECK(known);
    ++seen[f < 0.75 ? 0 : f < 1.5 ? 1 : 2];
  }
  for (const int n : seen) CHECK(n >= 8);  // each of three factors drawn about 20 times in 60
  CHECK(clock.totals().total_s() == doctest::Approx(clock.now()).epsilon(1e-12));
}
