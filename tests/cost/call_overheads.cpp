// Tests of the fixed cost per kernel call (issue 25; cost/profile.hpp CallOverheadModel): the trace clock adds
// kernel_call_s to each call of an elementwise, activation or paged-attention kernel, and nothing to GEMMs, flash
// attention, transcendental calls (they have their own terms) or allocations (cost/trace_cost.hpp), and event_seconds
// is that charge event by event (what a split of a step by piece adds up); a serving step's dry run on one rank costs
// exactly its calls more (serve/step_dry_run.hpp); the calibration measures it on this machine (cost/calibrate.hpp);
// profile JSON keeps it, and a profile without it loads with the term unpriced (cost/profile_json.hpp).
#include "paradyse/comm/threads.hpp"
#include "paradyse/cost/builtin_profiles.hpp"
#include "paradyse/cost/calibrate.hpp"
#include "paradyse/cost/profile_json.hpp"
#include "paradyse/cost/trace_cost.hpp"
#include "paradyse/serve/step_dry_run.hpp"
#include "paradyse/serve/synthetic_decoder.hpp"

#include <doctest/doctest.h>

#include <optional>
#include <utility>
#include <vector>

using namespace paradyse;
using namespace paradyse::cost;

namespace {

double call_overheads_forward_s(std::vector<TraceEvent> forward, const HardwareProfile& hw) {
  SublayerTrace trace;
  trace.forward = std::move(forward);
  return cost_of(trace, &hw, 4).forward_s;
}

// A serving step of the synthetic MoE on one rank: the chunks, TP, loads spread over the experts.
serve::StepTrace call_overheads_step(const serve::DecoderConfig& c, std::vector<serve::ChunkShape> chunks) {
  serve::StepTrace t;
  t.chunks = std::move(chunks);
  const std::int64_t pairs = t.tokens() * c.moe.top_k;
  for (std::int64_t l = 0; l < c.layers; ++l) {
    std::vector<std::int64_t> loads(std::size_t(c.moe.experts), 0);
    for (std::int64_t j = 0; j < pairs; ++j) ++loads[std::size_t((j * 3 + l) % c.moe.experts)];
    t.routed.push_back(loads);
  }
  t.layout.assign(std::size_t(c.layers), serve::ExpertLayout::tp());
  t.next.assign(std::size_t(c.layers), std::nullopt);
  return t;
}

// Every kind of event the clock prices, kernels with repeated calls among them.
std::vector<TraceEvent> call_overheads_mix() {
  return {
      {.kind = TraceKind::gemm, .count = 3, .m = 16, .n = 256, .k = 256},
      {.kind = TraceKind::attention_forward, .m = 1024, .n = 4, .k = 32},
      {.kind = TraceKind::elementwise, .count = 5, .bytes = 4096},
      {.kind = TraceKind::activation, .count = 2, .bytes = 3 * 4096, .m = 1024, .n = 1},
      {.kind = TraceKind::transcendental, .m = 512, .n = 0},
      {.kind = TraceKind::paged_attention, .m = 300, .n = 4, .k = 32},
      {.kind = TraceKind::allocate, .bytes = 4096},
      {.kind = TraceKind::allocate, .bytes = 65536},
      {.kind = TraceKind::deallocate, .bytes = 4096},
      {.kind = TraceKind::scratch, .bytes = 1024},
      {.kind = TraceKind::latent_attention, .m = 120, .n = 8, .k = 544},
  };
}

}  // namespace

TEST_CASE("call overheads: each non-GEMM kernel call adds its fixed cost") {
  HardwareProfile hw = a100_sxm4_80gb_x8();
  const std::vector<TraceEvent> events = call_overheads_mix();
  const double without = call_overheads_forward_s(events, hw);
  hw.call_overhead = {1.5e-6};
  const double with = call_overheads_forward_s(events, hw);
  // 5 elementwise + 2 activation + 1 paged attention + 1 latent attention calls.
  CHECK(with - without == doctest::Approx(9 * 1.5e-6).epsilon(1e-9));

  // GEMMs, flash attention, transcendental calls and memory events alone: unchanged.
  const std::vector<TraceEvent> own_terms = {events[0], events[1], events[4], events[6], events[7], events[8], events[9]};
  HardwareProfile plain = hw;
  plain.call_overhead = {};
  CHECK(call_overheads_forward_s(own_terms, hw) == call_overheads_forward_s(own_terms, plain));
}

TEST_CASE("call overheads: event_seconds is the clock's charge for one event, its calls' fixed costs included") {
  HardwareProfile hw = a100_sxm4_80gb_x8();
  hw.call_overhead = {1.5e-6};
  const std::vector<TraceEvent> events = call_overheads_mix();
  // With no transfer in it, a trace's time is its events' charges added up (what a split by piece sums to).
  double sum = 0;
  for (const TraceEvent& e : events) sum += event_seconds(hw, e, 1.0, 4);
  CHECK(sum == doctest::Approx(call_overheads_forward_s(events, hw)).epsilon(1e-12));
  // Written out: count calls of the kernel at its rate, each with the fixed cost; bytes at the dtype's width.
  const double elementwise = 5 * (hw.elementwise_time(4096, ElementwiseFamily::other) + 1.5e-6);
  CHECK(event_seconds(hw, events[2], 1.0, 4) == doctest::Approx(elementwise).epsilon(1e-12));
  CHECK(event_seconds(hw, events[2], 0.5, 2) ==
        doctest::Approx(5 * (hw.elementwise_time(2048, ElementwiseFamily::other) + 1.5e-6)).epsilon(1e-12));
  CHECK(event_seconds(hw, events[0], 1.0, 4) == doctest::Approx(3 * hw.gemm.time(16, 256, 256, 4)).epsilon(1e-12));
  CHECK(event_seconds(hw, events[9], 1.0, 4) == doctest::Approx(hw.fresh_memory.time(1024)).epsilon(1e-12));
  // Transfers, waits, frees and the pool's loans take no compute-stream time of their own.
  for (const TraceKind kind : {TraceKind::post, TraceKind::wait, TraceKind::deallocate, TraceKind::pool_acquire,
                               TraceKind::pool_give_back})
    CHECK(event_seconds(hw, {.kind = kind, .bytes = 65536}, 1.0, 4) == 0);
}

TEST_CASE("call overheads: a serving step's dry run costs exactly its kernel calls more") {
  const serve::DecoderConfig c = serve::synthetic_config(64, 2, 4, 2, 4, 2, 96, 128);
  serve::SimulatedCluster cluster{a100_sxm4_80gb_x8(), 4};
  for (const auto& chunks : {std::vector<serve::ChunkShape>{{1, 20, true}, {1, 7, true}, {1, 33, true}},
                             std::vector<serve::ChunkShape>{{24, 0, false}, {1, 9, true}}}) {
    const serve::StepTrace t = call_overheads_step(c, chunks);
    const double without = serve::dry_run_step_cost(c, t, cluster).total_s();
    double calls = 0;
    for (const TraceEvent& e : serve::dry_run_step(c, t, 0).events)
      if (e.kind == TraceKind::elementwise || e.kind == TraceKind::activation || e.kind == TraceKind::paged_attention ||
          e.kind == TraceKind::latent_attention)
        calls += e.count;
    CAPTURE(t.tokens());
    CHECK(calls > 10 * c.layers);  // norms, RoPE per chunk, the KV append per chunk, the experts' SwiGLU, ...
    cluster.profile.call_overhead = {2e-6};
    const double with = serve::dry_run_step_cost(c, t, cluster).total_s();
    cluster.profile.call_overhead = {};
    CHECK(with - without == doctest::Approx(calls * 2e-6).epsilon(1e-9));
  }
}

TEST_CASE("call overheads: calibrated on this machine when asked, 0 otherwise") {
  for (const int p : {1, 2}) {
    CAPTURE(p);
    for (const bool asked : {true, false}) {
      Calibration result;
      result.profile.elementwise_bytes_per_s = 2e10;
      result.profile.activation_elements_per_s = 1e9;
      CalibrationOptions options;
      options.repetitions = 3;
      options.call_overheads = asked;
      run_ranks(p, [&](ThreadCommunicator& comm) {
        Calibration mine = result;
        calibrate_detail::calibrate_call_overheads<ops::Cpu>(comm, options, mine);
        if (comm.rank() == 0) result = mine;
      });
      if (!asked) {
        CHECK(result.profile.call_overhead == CallOverheadModel{});
        continue;
      }
      // About a microsecond each here; the bounds only say it is a per-call cost, not a kernel's work.
      CHECK(result.profile.call_overhead.kernel_call_s > 1e-8);
      CHECK(result.profile.call_overhead.kernel_call_s < 5e-5);
      REQUIRE(result.samples.size() == 1);
      CHECK(result.samples[0].fitted_s == doctest::Approx(result.samples[0].measured_s).epsilon(1e-9));
    }
  }
}

TEST_CASE("call overheads: profile JSON keeps them; without the key they are unpriced; bad values are named") {
  HardwareProfile hw = a100_sxm4_80gb_x8();
  CHECK(profile_from_json(to_json(hw)).call_overhead == CallOverheadModel{});
  CHECK_FALSE(to_json(hw).contains("call_overhead"));
  hw.call_overhead = {1.25e-6};
  const HardwareProfile back = profile_from_json(to_json(hw));
  CHECK(back.call_overhead == hw.call_overhead);
  json::Value v = to_json(hw);
  v["call_overhead"]["kernel_call_s"] = -1.0;
  CHECK_THROWS_WITH_AS(profile_from_json(v), doctest::Contains("kernel_call_s"), Error);
  v = to_json(hw);
  v["call_overhead"]["per_byte"] = 1.0;
  CHECK_THROWS_WITH_AS(profile_from_json(v), doctest::Contains("per_byte"), Error);
}
