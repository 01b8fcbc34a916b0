// tests/serve/switch_window.cpp: the dynamic policy's forecast of the coming steps (serve/switch_policy.hpp
// SwitchPolicy::window): forecast_batches plays serve_loop's batching forward; the switcher moves when the window pays
// for the switch; on a trace where prompt-chunk steps and decode steps alternate, the window forecast switches where
// the one-step forecast does not, and the reverse, with the same tokens and batches (the layout, and so the clock, is
// all that differs).
#include "paradyse/comm/threads.hpp"
#include "paradyse/serve/engine.hpp"
#include "paradyse/serve/request_trace.hpp"

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

// The mixtral fixture served on 2 thread ranks on the step clock (the same requests at time 0: admission depends on
// max_running and the KV pool alone), the switcher on `model`.
WindowRun serve_dynamic(const LoadedDecoder& m, const std::vector<ServeRequest>& requests, const SimulatedCluster& model,
          SwitchPolicy switching) {
  EnginePolicy policy;
  policy.mode = ModePolicy::dynamic;
  policy.switching = switching;
  policy.time_model = model;
  EngineOptions opt;
  opt.step_tokens = 8;
  opt.max_running = 3;
  opt.block_size = 4;
  opt.kv_blocks = 64;
  WindowRun r;
  run_ranks(2, [&](ThreadCommunicator& comm) {
    StepClock clock;
    EngineOptions o = opt;
    o.clock = &clock;
    if (comm.rank() == 0) clock.observer = [&](const StepTrace& t, const StepTiming&, double) { r.traces.push_back(t); };
    EngineStats stats;
    auto got = serve_requests(comm, m, requests, o, policy, &stats);
    if (comm.rank() == 0) r.out = std::move(got), r.stats = stats;
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

TEST_CASE("switch window: explore") {
  const LoadedDecoder m = load_decoder((std::filesystem::path(PARADYSE_TEST_DATA_DIR) / "hf" / "mixtral").string());
  std::vector<TraceRequest> t = poisson_trace(1.0, 12, {3, 11, 2, 7}, 5);
  for (TraceRequest& r : t) r.arrival_s = 0;
  const std::vector<ServeRequest> requests = to_serve_requests(t, m.config.vocab, 3);
  for (const double link : {1e6, 1e7, 1e8, 1e9, 1e10})
    for (const double memory : {1e8, 1e9, 1e10}) {
      SimulatedCluster model = time_model_of({memory, 1e12, 1e4});
      model.profile.intra_node.p2p_bytes_per_s = model.profile.intra_node.bus_bytes_per_s = link;
      const WindowRun a = serve_dynamic(m, requests, model, {0.1, 2, 2, 32, true, 0});
      const WindowRun b = serve_dynamic(m, requests, model, {0.1, 2, 2, 32, true, 4});
      MESSAGE(fmt::format("link {:g} memory {:g}: one-step {} switches, window {} switches, steps {} {}", link, memory,
                          a.stats.switches, b.stats.switches, a.stats.steps, b.stats.steps));
    }
}
