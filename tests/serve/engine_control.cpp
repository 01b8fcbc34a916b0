// tests/serve/engine_control.cpp: the engine's own collectives around a step (serve/step_dry_run.hpp
// engine_control_s), counted on a real run. The engine on 2 and 3 thread ranks, its broadcasts recorded: every step
// makes two broadcasts before decoder_step (the plan's length, the plan) and at most one after it (the sampled
// tokens), the plan of the size engine_control_s prices (its admissions counted in the step's trace), the sampled
// tokens no larger, and nothing else outside decoder_step's own
// all-reduces; on one rank none, and engine_control_s is 0.
#include "paradyse/comm/threads.hpp"
#include "paradyse/serve/cluster_spec.hpp"
#include "paradyse/serve/engine.hpp"
#include "paradyse/serve/hf_checkpoint.hpp"
#include "paradyse/serve/request_trace.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <filesystem>
#include <vector>

using namespace paradyse;
using namespace paradyse::serve;

namespace engine_control_test {

std::filesystem::path repo() { return std::filesystem::path(__FILE__).parent_path().parent_path().parent_path(); }

// The thread communicator with rank 0's broadcasts recorded (bytes, in order).
struct RecordingBroadcasts : ThreadCommunicator {
  RecordingBroadcasts(ThreadCommunicator&& c, std::vector<std::int64_t>* log) : ThreadCommunicator(std::move(c)), log(log) {}
  RecordingBroadcasts split(int color, int key) { return {ThreadCommunicator::split(color, key), log}; }
  template <CommElement T> void broadcast(std::span<T> buffer, int root) {
    if (rank() == 0) log->push_back(std::int64_t(buffer.size_bytes()));
    ThreadCommunicator::broadcast(buffer, root);
  }
  std::vector<std::int64_t>* log;
};

TEST_CASE("engine control: two broadcasts before every step and at most one after, the sizes engine_control_s prices") {
  const LoadedDecoder m = load_decoder((repo() / "tests" / "data" / "hf" / "mixtral").string());
  std::vector<TraceRequest> t = poisson_trace(1.0, 9, {3, 11, 2, 7}, 5);
  for (TraceRequest& r : t) r.arrival_s = 0;  // no idle steps: every step has chunks
  const std::vector<ServeRequest> requests = to_serve_requests(t, m.config.vocab, 3);
  for (const int p : {1, 2, 3}) {
    INFO("p = ", p);
    std::vector<std::int64_t> log;
    std::vector<StepTrace> steps;
    run_ranks(p, [&](ThreadCommunicator& plain) {
      RecordingBroadcasts comm(std::move(plain), &log);
      StepClock clock;
      if (comm.rank() == 0)  // after the step's last broadcast: a marker in the log (-1)
        clock.observer = [&](const StepTrace& s, const StepTiming&, double) { steps.push_back(s), log.push_back(-1); };
      EngineOptions o;
      o.step_tokens = 8, o.max_running = 5, o.block_size = 4, o.kv_blocks = 24, o.clock = &clock;
      serve_requests(comm, m, requests, o, EnginePolicy{});
    });
    REQUIRE(!steps.empty());
    const cost::HardwareProfile& hw = simulated_cluster("h100", 2).profile;
    if (p == 1) {
      CHECK(std::count(log.begin(), log.end(), -1) == std::int64_t(log.size()));  // markers only
      CHECK(engine_control_s(steps.front(), hw) == 0);
      continue;
    }
    // Walk the log step by step: [length, plan], the sampled tokens when the step sampled any, the step's marker.
    std::size_t i = 0;
    for (const StepTrace& s : steps) {
      const std::int64_t chunks = std::int64_t(s.chunks.size()), word = 8;
      REQUIRE(i + 3 <= log.size());
      CHECK(log[i] == word);
      CHECK(log[i + 1] == word * (5 + s.admitted + 2 * chunks));
      i += 2;
      // The sampled tokens: one per decode chunk and per chunk that ends its prompt.
      std::int64_t decodes = 0;
      for (const ChunkShape& ch : s.chunks) decodes += ch.decode;
      if (log[i] != -1) {
        CHECK(log[i] <= word * chunks);
        CHECK(log[i] >= word * decodes);
        ++i;
      } else {
        CHECK(decodes == 0);  // a step that sampled nothing: prompt chunks that did not end their prompts
      }
      REQUIRE(log[i] == -1);
      ++i;
      CHECK(engine_control_s(s, hw) > 0);
    }
    CHECK(i == log.size());  // nothing else broadcast
  }
}

}  // namespace engine_control_test
