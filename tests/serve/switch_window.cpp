// tests/serve/switch_window.cpp: the dynamic policy's forecast of the coming steps (serve/switch_policy.hpp
// SwitchPolicy::window): forecast_batches plays serve_loop's batching forward; the switcher moves when the window pays
// for the switch; serving Mixtral-8x7B's shape on a simulated 8x H100 node, the window forecast switches where the
// one-step forecast does not, and the reverse, with the same batches and tokens (the layouts, and so the clock, are
// all that differ).
#include "paradyse/comm/threads.hpp"
#include "paradyse/serve/cluster_spec.hpp"
#include "paradyse/serve/engine.hpp"
#include "paradyse/serve/model_shape_hf.hpp"
#include "paradyse/serve/request_trace.hpp"
#include "paradyse/serve/routing_source.hpp"
#include "paradyse/serve/shape_step.hpp"

#include "serve/launch_per_expert.hpp"

#include <doctest/doctest.h>

#include <filesystem>
#include <string>
#include <vector>

using namespace paradyse;
using namespace paradyse::serve;

namespace switch_window_test {

bool same_chunk(const ChunkShape& a, const ChunkShape& b) {
  return a.tokens == b.tokens && a.cached == b.cached && a.decode == b.decode;
}

struct WindowRun {
  std::vector<RequestOutcome> out;
  EngineStats stats;
  std::vector<StepTrace> traces;
};

// A model shape on 8 modelled ranks of `cluster` (serve/shape_step.hpp, Zipf 0.5 routing) on its simulated clock, the
// dynamic policy with `switching` forecasting with step_cost, the engine's default (the dry run's price, the clock's
// own less its control broadcasts: the runs below differ in the window alone); the requests at time 0 (the batches
// do not depend on the clock).
WindowRun serve_shape_dynamic(const DecoderConfig& c, const SimulatedCluster& cluster,
                              const std::vector<ServeRequest>& requests, std::int64_t max_running,
                              SwitchPolicy switching) {
  EnginePolicy policy;
  policy.mode = ModePolicy::dynamic;
  policy.switching = switching;
  policy.time_model = cluster;
  WindowRun r;
  run_ranks(1, [&](ThreadCommunicator& comm) {
    SimulatedClock clock(c, cluster);
    clock.observer = [&](const StepTrace& t, const StepTiming&, double) { r.traces.push_back(t); };
    EngineOptions o;
    o.step_tokens = 512;
    o.max_running = max_running;
    o.block_size = 16;
    o.kv_blocks = 1 << 16;
    o.clock = &clock;
    ZipfRouting routing(0.5, 1);
    ShapeStepper stepper(c, 8, o, MoeMode::tp, routing);
    r.out = serve_loop(comm, stepper, requests, o, policy, clock, &r.stats);
  });
  return r;
}

}  // namespace switch_window_test

using namespace switch_window_test;

TEST_CASE("switch window: forecast_batches plays the scheduler's batching forward") {
  // A decoding (2 tokens to go), B with 7 prompt tokens left, C queued; 4 tokens a step, 2 running at most.
  const std::vector<PendingRequest> running = {{0, 10, 2}, {7, 3, 2}}, queued = {{4, 0, 1}};
  const auto b = forecast_batches(running, queued, 4, 2, 6);
  const std::vector<std::vector<ChunkShape>> want = {
      {{1, 10, true}, {3, 3, false}},
      {{1, 11, true}, {3, 6, false}},             // A's last token: A leaves, C is admitted
      {{1, 9, false}, {3, 0, false}},             // B's last prompt token (its first output), C's chunk
      {{1, 10, true}, {1, 3, false}}};            // B's last token, C's last prompt token and only output
  REQUIRE(b.size() == want.size());               // nothing is left after 4 steps
  for (std::size_t s = 0; s < want.size(); ++s) {
    REQUIRE(b[s].size() == want[s].size());
    for (std::size_t i = 0; i < want[s].size(); ++i) {
      CAPTURE(s);
      CAPTURE(i);
      CHECK(same_chunk(b[s][i], want[s][i]));
    }
  }
  CHECK_THROWS_WITH_AS(forecast_batches(running, queued, 0, 2, 6), doctest::Contains("step_tokens 0"), Error);
}

TEST_CASE("switch window: the window in the other layout must be cheaper by the margin and its savings pay the switch") {
  SwitchPolicy w{.margin = 0.1, .patience = 1, .dwell = 0, .horizon = 32, .break_even = true, .window = 4};
  ModeSwitcher s(w, MoeMode::tp);
  CHECK(s.decide(LayoutForecast{{10, 9.5}, 0.1, 0.1}) == MoeMode::tp);  // 9.5 is not below 0.9 * 10
  CHECK(s.decide(LayoutForecast{{10, 8}, 1, 3}) == MoeMode::tp);       // saves 2, the switch to EP costs 3
  CHECK(s.decide(LayoutForecast{{10, 8}, 3, 2}) == MoeMode::ep);       // saves 2, the switch costs 2
  CHECK(s.decide(LayoutForecast{{7, 10}, 3.5, 0}) == MoeMode::ep);     // saves 3, back to TP costs 3.5
  CHECK(s.decide(LayoutForecast{{5, 10}, 3.5, 0}) == MoeMode::tp);
  // Alternating steps, one favouring EP by much, the next TP by little: the one-step switcher's streak never reaches
  // its patience; a window of 4 steps sums them and pays for the switch.
  const LayoutForecast prompt_step{{10, 5}, 0, 5}, decode_step{{3, 3.3}, 0, 5};
  const LayoutForecast window{{2 * 10 + 2 * 3, 2 * 5 + 2 * 3.3}, 0, 5};
  ModeSwitcher one({0.1, 2, 8, 32, true}, MoeMode::tp), four({0.1, 2, 8, 32, true, 4}, MoeMode::tp);
  for (int i = 0; i < 20; ++i) {
    one.decide(i % 2 ? decode_step : prompt_step);
    four.decide(window);
  }
  CHECK(one.switches() == 0);
  CHECK(four.switches() == 1);
  SwitchPolicy bad;
  bad.window = -1;
  CHECK_THROWS_WITH_AS(bad.validate(), doctest::Contains("window -1 >= 0"), Error);
}

// The same batches (requests at time 0, so admission does not depend on the clock): the same chunks every step and
// the same tokens; the layouts, and so the clock, are all that differ.
void same_batches(const WindowRun& a, const WindowRun& b) {
  REQUIRE(a.traces.size() == b.traces.size());
  for (std::size_t k = 0; k < a.traces.size(); ++k) {
    REQUIRE(a.traces[k].chunks.size() == b.traces[k].chunks.size());
    for (std::size_t i = 0; i < a.traces[k].chunks.size(); ++i) CHECK(same_chunk(a.traces[k].chunks[i], b.traces[k].chunks[i]));
  }
  REQUIRE(a.out.size() == b.out.size());
  for (std::size_t i = 0; i < a.out.size(); ++i) CHECK(a.out[i].tokens == b.out[i].tokens);
  CHECK(a.stats.step_tokens == b.stats.step_tokens);
}

TEST_CASE("switch window: on Mixtral-8x7B (8x H100) the window switches where one step does not, and the reverse, "
          "with the same batches and tokens") {
  const DecoderConfig c =
      read_model_shape((std::filesystem::path(PARADYSE_TEST_DATA_DIR).parent_path().parent_path() / "data" /
                        "model_shapes" / "mixtral-8x7b.json").string()).config;
  // Each expert GEMM its own launch: a crossover to find (tests/serve/launch_per_expert.hpp).
  const SimulatedCluster h100 = serve_scenarios::h100_launch_per_expert();
  auto at_once = [&](std::int64_t prompt, std::int64_t output) {
    std::vector<TraceRequest> t = poisson_trace(1.0, 24, {prompt, prompt, output, output}, 5);
    for (TraceRequest& r : t) r.arrival_s = 0;
    return to_serve_requests(t, c.vocab, 3);
  };
  auto busy = [](const WindowRun& r) {
    double s = 0;
    for (const double x : r.stats.step_seconds) s += x;
    return s;
  };
  {  // 24 prompts of 512 tokens, 4 outputs each, 4 running: prompt chunks beside a few decodes. The window of 16 steps
     // switches to EP sooner than the one-step forecast (which switches once, late: it forecast with step_cost and
     // the last step's loads scaled, 0 switches, 441.5 against 414.5 ms, before the switcher took the clock's price).
    const std::vector<ServeRequest> requests = at_once(512, 4);
    const WindowRun one = serve_shape_dynamic(c, h100, requests, 4, {0.1, 2, 8, 32, true, 0});
    const WindowRun window = serve_shape_dynamic(c, h100, requests, 4, {0.1, 2, 8, 32, true, 16});
    MESSAGE(fmt::format("512-token prompts, 4 running: one-step {} switches ({:.2f} ms busy), window of 16 {} ({:.2f} "
                        "ms)", one.stats.switches, busy(one) * 1e3, window.stats.switches, busy(window) * 1e3));
    CHECK(window.stats.switches >= 1);
    CHECK(busy(window) < busy(one));  // the earlier switch paid (deterministic: 421.4 against 445.0 ms)
    same_batches(one, window);
  }
  {  // 16 outputs each, 16 running: the one-step forecast switches once; a window of 4 does not (its 4 steps do not pay
     // for the switch). On the dry run's price the one switch pays over the whole run (511.4 against 526.5 ms; on
     // branch h1's step_cost with the scaled loads it had not: 533.1 against 517.2; on stop 58's, which priced prompt
     // steps up to 3.9% under the dry run, it switched at another step: 542.4 against 526.5): a window of 4 is shorter
     // than the run.
    const std::vector<ServeRequest> requests = at_once(512, 16);
    const WindowRun one = serve_shape_dynamic(c, h100, requests, 16, {0.1, 2, 8, 32, true, 0});
    const WindowRun window = serve_shape_dynamic(c, h100, requests, 16, {0.1, 2, 8, 32, true, 4});
    MESSAGE(fmt::format("16 outputs, 16 running: one-step {} switches ({:.2f} ms busy), window of 4 {} ({:.2f} ms)",
                        one.stats.switches, busy(one) * 1e3, window.stats.switches, busy(window) * 1e3));
    CHECK(one.stats.switches >= 1);
    CHECK(window.stats.switches == 0);
    CHECK(busy(one) < busy(window));
    same_batches(one, window);
  }
}
