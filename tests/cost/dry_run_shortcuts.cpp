// The dry run's two shortcuts give exactly what running gives (issue 8, planning speed):
//  - a declared shared sublayer (StrategyCatalog::shared_sublayer: UlyssesZ, MegatronCZ and ColossalZ run
//    zero3_mlp): the traces of the strategies that declare one code are equal, event for event, on every rank, and
//    the cost table that dry-runs it once holds each strategy's own cost;
//  - a repeated call replayed from its first recording (core/trace.hpp's record_or_replay: ring attention once per
//    METP head group): every strategy's trace with replays equals its trace with replays off, and the Trace's
//    replay renumbers requests, merges repeated kernels as recording does, and refuses a recording that waits
//    outside itself.
// Shapes: MHA, GQA with replicated kv heads, causal, zigzag with RoPE, packed documents; p = 1..4 with lengths that
// do not divide (uneven ranks); every rank.
#include "paradyse/comm/symbolic.hpp"
#include "paradyse/cost/builtin_profiles.hpp"
#include "paradyse/cost/dry_run.hpp"
#include "paradyse/cost/trace_cost.hpp"
#include "paradyse/plan/cost_table.hpp"

#include <doctest/doctest.h>

#include <span>
#include <vector>

using namespace paradyse;
using namespace paradyse::cost;

namespace {

std::vector<ModelShape> shortcut_shapes() {
  std::vector<ModelShape> shapes;
  shapes.push_back(ModelShape::mha(64, 4));
  ModelShape gqa = ModelShape::mha(96, 6);
  gqa.kv_heads = 2;  // replicated over p = 4 and 3
  gqa.swiglu = true;
  gqa.ffn = 192;
  gqa.causal = true;
  shapes.push_back(gqa);
  ModelShape zigzag = ModelShape::mha(48, 12);
  zigzag.causal = zigzag.zigzag = zigzag.rope = true;
  zigzag.batch = 2;
  shapes.push_back(zigzag);
  ModelShape packed = ModelShape::mha(64, 4);
  packed.causal = true;
  packed.packed_lengths = {1, 2};  // set per length below
  shapes.push_back(packed);
  return shapes;
}

// The shape at one length (a packed shape splits it into two documents).
ModelShape shortcut_at(ModelShape m, std::int64_t length) {
  m.seq = length;
  if (!m.packed_lengths.empty()) m.packed_lengths = {length / 3, length - length / 3};
  return m;
}

bool same_events(std::span<const TraceEvent> a, std::span<const TraceEvent> b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const TraceEvent &x = a[i], &y = b[i];
    if (x.kind != y.kind || x.transfer != y.transfer || x.request != y.request || x.count != y.count ||
        x.bytes != y.bytes || x.m != y.m || x.n != y.n || x.k != y.k)
      return false;
  }
  return true;
}

bool same_trace(const SublayerTrace& a, const SublayerTrace& b) {
  return a.group_size == b.group_size && same_events(a.forward, b.forward) && same_events(a.backward, b.backward) &&
         same_events(a.release, b.release);
}

// Replays off on this thread while it lives.
struct NoReplays {
  NoReplays() { Trace::replays_enabled() = false; }
  ~NoReplays() { Trace::replays_enabled() = true; }
};

}  // namespace

TEST_CASE("dry run shortcuts: strategies that declare one MLP code have the same MLP trace on every rank") {
  const StrategyCatalog& catalog = default_catalog();
  for (std::string_view name : {"UlyssesZ", "MegatronCZ", "ColossalZ"})
    CHECK(catalog.shared_sublayer(catalog.index_of(name), Sublayer::mlp) == "zero3_mlp");
  CHECK(catalog.shared_sublayer(catalog.index_of("METP"), Sublayer::mlp).empty());
  CHECK(catalog.shared_sublayer(catalog.index_of("MegatronTS"), Sublayer::attention).empty());
  int compared = 0;
  for (const ModelShape& base : shortcut_shapes())
    for (int p : {1, 2, 3, 4})
      for (std::int64_t length : {7, 64, 333}) {
        const ModelShape m = shortcut_at(base, length);
        CAPTURE(describe(m));
        CAPTURE(p);
        for (Sublayer part : kAllSublayers)
          for (int s = 0; s < catalog.count(); ++s)
            for (int t = s + 1; t < catalog.count(); ++t) {
              const std::string_view code = catalog.shared_sublayer(s, part);
              if (code.empty() || catalog.shared_sublayer(t, part) != code) continue;
              if (!catalog.supports(s, m, p).ok() || !catalog.supports(t, m, p).ok()) continue;
              CAPTURE(catalog.name(s));
              CAPTURE(catalog.name(t));
              for (int rank = 0; rank < p; ++rank) {
                CAPTURE(rank);
                CHECK(same_trace(catalog.trace(s, part, m, p, rank), catalog.trace(t, part, m, p, rank)));
                ++compared;
              }
            }
      }
  CHECK(compared > 100);
}

TEST_CASE("dry run shortcuts: every strategy's trace with replays equals its trace with replays off") {
  const StrategyCatalog& catalog = default_catalog();
  int compared = 0;
  for (const ModelShape& base : shortcut_shapes())
    for (int p : {1, 2, 3, 4})
      for (std::int64_t length : {8, 61, 200}) {
        const ModelShape m = shortcut_at(base, length);
        CAPTURE(describe(m));
        CAPTURE(p);
        for (int s = 0; s < catalog.count(); ++s) {
          if (!catalog.supports(s, m, p).ok()) continue;
          CAPTURE(catalog.name(s));
          for (Sublayer part : kAllSublayers)
            for (int rank : {0, p - 1}) {
              CAPTURE(rank);
              const SublayerTrace replayed = catalog.trace(s, part, m, p, rank);
              SublayerTrace ran;
              {
                const NoReplays off;
                ran = catalog.trace(s, part, m, p, rank);
              }
              CHECK(same_trace(replayed, ran));
              ++compared;
            }
        }
      }
  CHECK(compared > 200);
}

TEST_CASE("dry run shortcuts: Trace replay renumbers requests, merges as recording does, refuses outside waits") {
  Trace trace;
  SymbolicCommunicator comm(0, 2, trace);
  std::vector<float> in(4), out(8);
  const TraceEvent gemm{.kind = TraceKind::gemm, .m = 2, .n = 3, .k = 4};
  const auto call = [&] {
    trace.record(gemm);
    Request r = comm.all_gather_async(std::span<const float>(in), std::span<float>(out));
    trace.record(gemm);
    trace.record(gemm);  // merged into the one before: count 2
    r.wait();
  };
  record_or_replay(trace, {1}, call);
  const std::size_t first = trace.size();
  REQUIRE(first == 4);
  trace.record(gemm);  // a replay's first kernel merges into this one, as running the call would
  record_or_replay(trace, {1}, [] { FAIL("a recorded key runs again"); });
  Trace ran;
  {
    SymbolicCommunicator ran_comm(0, 2, ran);
    const auto run_call = [&] {
      ran.record(gemm);
      Request r = ran_comm.all_gather_async(std::span<const float>(in), std::span<float>(out));
      ran.record(gemm);
      ran.record(gemm);
      r.wait();
    };
    run_call();
    ran.record(gemm);
    run_call();
  }
  CHECK(same_events(trace.events(), ran.events()));
  CHECK(trace.events()[5].request == 1);  // the replay's post: the next request id
  CHECK(trace.events()[7].request == 1);
  CHECK(trace.new_request() == 2);
  // A recording that waits for a request posted before it is never replayed: the call runs again.
  Request outside = comm.all_gather_async(std::span<const float>(in), std::span<float>(out));
  int runs = 0;
  for (int i = 0; i < 2; ++i)
    record_or_replay(trace, {2}, [&] {
      ++runs;
      if (i == 0) outside.wait();
      trace.record(gemm);
    });
  CHECK(runs == 2);
  // A call that must transfer but whose recording holds no post (its communicator records elsewhere): never replayed.
  runs = 0;
  for (int i = 0; i < 2; ++i) record_or_replay(trace, {3}, [&] { ++runs, trace.record(gemm); }, 1);
  CHECK(runs == 2);
}

TEST_CASE("dry run shortcuts: the cost table's shared dry runs hold each strategy's own cost") {
  const HardwareProfile hw = a100_sxm4_80gb_x8();
  const StrategyCatalog& catalog = default_catalog();
  for (const ModelShape& base : shortcut_shapes())
    for (int p : {1, 2, 3, 4})
      for (std::int64_t length : {7, 333}) {
        const ModelShape m = shortcut_at(base, length);
        CAPTURE(describe(m));
        CAPTURE(p);
        const plan::Batch batch =
            m.packed_lengths.empty() ? plan::Batch::single(length, m.batch) : plan::Batch::packed(m.packed_lengths, m.batch);
        const plan::CostTable table = plan::build_cost_table(plan::ModelConfig::uniform(base, 2), hw, p, batch);
        const ModelShape shape = plan::shape_for_batch(base, batch);
        for (Sublayer part : kAllSublayers)
          for (int s = 0; s < catalog.count(); ++s) {
            CAPTURE(catalog.name(s));
            const plan::Option* option = table.option(0, part, s);
            REQUIRE((option != nullptr) == catalog.supports(s, shape, p).ok());
            if (!option) continue;
            const SublayerCost own = evaluate_sublayer(catalog, s, part, shape, p, &hw);
            CHECK(option->time_s == own.time_s());  // bitwise: the same trace
            CHECK(option->saved_bytes == own.saved_bytes);
            CHECK(option->transient_bytes == own.pool_bytes());
          }
      }
}
