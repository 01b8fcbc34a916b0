// tests/serve/switch_dry_run.cpp: the dynamic policy on the dry-run clock (serve/clock.hpp SimulatedClock). The
// switcher forecasts with the dry run of the step on its time model (what the clock charges: SimulatedClock::price)
// and the expert loads of serve/switch_policy.hpp's LoadForecast; on Mixtral-8x7B (8x H100) at 64 requests/s it takes
// EP as it does on an analytic clock forecasting with step_cost, where it had stayed in TP while step_cost forecast
// the dry run's steps.
#include "paradyse/comm/threads.hpp"
#include "paradyse/serve/cluster_spec.hpp"
#include "paradyse/serve/engine.hpp"
#include "paradyse/serve/model_shape_hf.hpp"
#include "paradyse/serve/request_trace.hpp"
#include "paradyse/serve/routing_source.hpp"
#include "paradyse/serve/shape_step.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <filesystem>
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
// cluster's), on `clock`; `price`: the switcher's cost of a step when set (else the dry run on the cluster).
Served serve_dynamic(const DecoderConfig& c, const SimulatedCluster& cluster, EngineClock& clock,
                     const std::vector<ServeRequest>& requests, StepPricer price = {}) {
  EnginePolicy policy;
  policy.mode = ModePolicy::dynamic;
  policy.time_model = cluster;
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
  CHECK(tp_s == dry_run_step_cost(c, tp_step, h100).total_s());
  // The forecast of the step in both layouts, by the engine's pricer (the dry run on the time model, a runner of its
  // own): exactly what the clock charges for each.
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
          "clock as on the analytic one") {
  const DecoderConfig c = mixtral();
  const SimulatedCluster h100 = simulated_cluster("h100", 2);
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
}
