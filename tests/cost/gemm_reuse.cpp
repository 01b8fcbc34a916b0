// Tests of a GEMM priced at its weight's reuse distance (cost/profile.hpp GemmModel::time_at_reuse and ::reuse,
// cost/gemm_reuse.hpp WeightReads and gemm_time, cost/trace_cost.hpp cost_of with reads, gemm.reuse in
// cost/profile_json.hpp): at a table's cycle the table's time, between two cycles the line between them, outside them
// the nearest, a shape no table holds the fits; a weight's distance is the bytes read since its last read plus its
// own, infinite before its first; cost_of prices each GEMM at its distance, the reads advancing as it goes, and
// without reads (or tables) at GemmModel::time; the counting backend names each
// GEMM's b operand; JSON round trips the tables and refuses bad ones by name.
#include "paradyse/core/memory.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/cost/gemm_reuse.hpp"
#include "paradyse/cost/builtin_profiles.hpp"
#include "paradyse/cost/profile.hpp"
#include "paradyse/cost/profile_json.hpp"
#include "paradyse/cost/trace_cost.hpp"
#include "paradyse/ops/counting.hpp"

#include "support/fresh_seed.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

using namespace paradyse;
using namespace paradyse::cost;

namespace gemm_reuse_test {

constexpr double kInf = std::numeric_limits<double>::infinity();

// One shape (n 8, k 4: 128 bytes of fp32 weight) at rows 1 and 16, measured at cycles of 1 KB (`near`), 4 KB (the
// calibration's: `measured`) and 64 KB (`far`), with random times; a single fit for the rest.
struct Tables {
  GemmModel g;
  double near[2], mid[2], far[2];
};
Tables random_tables(std::mt19937_64& rng) {
  std::uniform_real_distribution<double> u(1e-6, 1e-4);
  Tables t;
  for (int i = 0; i < 2; ++i) t.near[i] = u(rng), t.mid[i] = u(rng), t.far[i] = u(rng);
  t.g = GemmModel{2e-6, 1e11, 5e9};
  t.g.measured = {4, {{8, 4, {1, 16}, {t.mid[0], t.mid[1]}}}, 4096};
  t.g.reuse = {{4, {{8, 4, {1, 16}, {t.near[0], t.near[1]}}}, 1024},
               {4, {{8, 4, {1, 16}, {t.far[0], t.far[1]}}}, 65536}};
  return t;
}

TraceEvent gemm_event(double m, double n, double k, std::uintptr_t operand, std::int32_t count = 1) {
  return {.kind = TraceKind::gemm, .count = count, .m = m, .n = n, .k = k, .operand = operand};
}

}  // namespace gemm_reuse_test

using namespace gemm_reuse_test;

TEST_CASE("gemm reuse: a table's cycle gives its time, between cycles the line, outside the nearest, else the fits") {
  PARADYSE_FRESH_RNG(rng);
  const Tables t = random_tables(rng);
  const GemmModel& g = t.g;
  CHECK(g.time_at_reuse(1, 8, 4, 4, 1024) == t.near[0]);
  CHECK(g.time_at_reuse(16, 8, 4, 4, 4096) == t.mid[1]);
  CHECK(g.time_at_reuse(1, 8, 4, 4, 65536) == t.far[0]);
  // Between 1 KB and 4 KB, a third of the way; between 4 KB and 64 KB, a quarter; rows between measured ones too.
  CHECK(g.time_at_reuse(1, 8, 4, 4, 2048) == doctest::Approx(t.near[0] + (t.mid[0] - t.near[0]) / 3).scale(0));
  CHECK(g.time_at_reuse(16, 8, 4, 4, 19456) == doctest::Approx(t.mid[1] + (t.far[1] - t.mid[1]) / 4).scale(0));
  const double near_6 = t.near[0] + (t.near[1] - t.near[0]) / 3, mid_6 = t.mid[0] + (t.mid[1] - t.mid[0]) / 3;
  CHECK(g.time_at_reuse(6, 8, 4, 4, 3072) == doctest::Approx(near_6 + (mid_6 - near_6) * 2 / 3).scale(0));
  // Nearer than the nearest cycle, farther than the farthest (a weight not read before): the nearest table's.
  CHECK(g.time_at_reuse(1, 8, 4, 4, 128) == t.near[0]);
  CHECK(g.time_at_reuse(16, 8, 4, 4, 1e9) == t.far[1]);
  CHECK(g.time_at_reuse(16, 8, 4, 4, kInf) == t.far[1]);
  // Another shape, rows outside the tables, another dtype: the fits (GemmModel::time) at any distance.
  for (const double d : {128.0, 4096.0, kInf}) {
    CHECK(g.time_at_reuse(4, 16, 4, 4, d) == g.time(4, 16, 4, 4));
    CHECK(g.time_at_reuse(32, 8, 4, 4, d) == g.time(32, 8, 4, 4));
    CHECK(g.time_at_reuse(4, 8, 4, 2, d) == g.time(4, 8, 4, 2));
  }
  // Without a recorded cycle the tables say nothing about distance: time() at every distance.
  GemmModel unrecorded = g;
  unrecorded.measured.cycle_bytes = 0, unrecorded.reuse.clear();
  CHECK(unrecorded.time_at_reuse(1, 8, 4, 4, 1024) == t.mid[0]);
  CHECK(unrecorded.time_at_reuse(1, 8, 4, 4, kInf) == t.mid[0]);
}

TEST_CASE("gemm reuse: a weight's distance is the bytes read since its last read plus its own") {
  WeightReads reads;
  const TraceEvent a = gemm_event(1, 8, 4, 0x100), b = gemm_event(3, 16, 4, 0x200), kv = gemm_event(1, 8, 4, 0x300, 2);
  CHECK(reads.distance(a, 4) == kInf);
  reads.read(a, 4);   // 128 bytes
  CHECK(reads.distance(a, 4) == 128);
  reads.read(b, 4);   // 256
  reads.read(kv, 4);  // a merged run of 2: 256
  CHECK(reads.bytes_read() == 640);
  CHECK(reads.distance(a, 4) == 256 + 256 + 128);
  CHECK(reads.distance(b, 4) == 256 + 256);
  CHECK(reads.distance(kv, 4) == 256);
  CHECK(reads.distance(a, 2) == 256 + 256 + 64);  // (the bytes are the caller's dtype's; consistent within a run)
  reads.read(a, 4);
  CHECK(reads.distance(b, 4) == 256 + 128 + 256);
  // Forgetting the far ones: b was last read 384 bytes ago, kv 128, a 0.
  reads.forget_beyond(200);
  CHECK(reads.weights() == 2);
  CHECK(reads.distance(b, 4) == kInf);
  CHECK(reads.distance(kv, 4) == 128 + 256);
}

TEST_CASE("gemm reuse: cost_of prices each GEMM at its distance as the reads advance; without reads at time()") {
  PARADYSE_FRESH_RNG(rng);
  const Tables t = random_tables(rng);
  HardwareProfile hw = builtin_profile("h100");
  hw.gemm = t.g;
  // Weight x (8 x 4, the tables' shape) read at 1 and then at 16 rows, between them weight y (56 x 4: 896 bytes,
  // priced by the fits at every distance) and a merged run of 2 reads of z (8 x 4: 256 bytes in all), then an
  // element-wise kernel (its own price, the same with or without reads).
  const std::vector<TraceEvent> step = {gemm_event(1, 8, 4, 0x10), gemm_event(1, 56, 4, 0x20),
                                        gemm_event(1, 8, 4, 0x30, 2), gemm_event(16, 8, 4, 0x10),
                                        {.kind = TraceKind::elementwise, .bytes = 4096}};
  const SublayerTraceView view{step, {}, {}, 1};
  const double plain = cost_of(view, &hw, 4, false).forward_s;
  const double y = t.g.time(1, 56, 4, 4);
  const double elementwise = cost_of(SublayerTraceView{std::span(step).last(1), {}, {}, 1}, &hw, 4, false).forward_s;
  CHECK(plain == doctest::Approx(t.mid[0] + y + 2 * t.mid[0] + t.mid[1] + elementwise).epsilon(1e-12));
  WeightReads reads;
  // First: x, y and z not read before (as far as the farthest table); x again after y 896 + z 256 + its own 128 =
  // 1280 bytes: 256 / 3072 of the way from the 1 KB table to the 4 KB one.
  const double x_again = t.near[1] + (t.mid[1] - t.near[1]) * 256.0 / 3072.0;
  const double first = plain + (t.far[0] - t.mid[0]) + 2 * (t.far[0] - t.mid[0]) + (x_again - t.mid[1]);
  CHECK(cost_of(view, &hw, 4, false, &reads).forward_s == doctest::Approx(first).epsilon(1e-12));
  CHECK(reads.bytes_read() == 128 + 896 + 256 + 128);
  // Again: x at 128 bytes (its own: it was the last read), z at 896 + 128 + 256 + 128 = 1408 bytes, x at 1280 again.
  const double z_at = t.near[0] + (t.mid[0] - t.near[0]) * (1408.0 - 1024.0) / 3072.0;
  CHECK(gemm_time(step[0], t.g, 4, nullptr) == t.mid[0]);
  CHECK(cost_of(view, &hw, 4, false, &reads).forward_s ==
        doctest::Approx(plain + (t.near[0] - t.mid[0]) + 2 * (z_at - t.mid[0]) + (x_again - t.mid[1])).epsilon(1e-12));
  // One GEMM alone: at x's distance now (its 16-row read was the last: its own bytes), the read recorded.
  CHECK(gemm_time(step[0], t.g, 4, &reads) == t.near[0]);
  CHECK(reads.bytes_read() == 2 * (128 + 896 + 256 + 128) + 128);
  // A model with no reuse tables: the plain price, no reads recorded.
  hw.gemm.reuse.clear();
  WeightReads untouched;
  CHECK(cost_of(view, &hw, 4, false, &untouched).forward_s == cost_of(view, &hw, 4, false).forward_s);
  CHECK(untouched.bytes_read() == 0);
}

TEST_CASE("gemm reuse: the counting backend names each GEMM's b operand, the same tensor the same name") {
  MemoryTracker meta(MemorySpace::meta);
  const ScopedTracker on_meta(meta);
  Tensor<float> x(Shape{3, 4}), w1(Shape{8, 4}), w2(Shape{8, 4}), y(Shape{3, 8});
  Trace trace;
  {
    const ScopedTrace recording(trace);
    ops::Counting::matmul(x.view(), ops::Transpose::no, w1.view(), ops::Transpose::yes, y.view());
    ops::Counting::fill(y.view(), 0.0f);
    ops::Counting::matmul(x.view(), ops::Transpose::no, w2.view(), ops::Transpose::yes, y.view());
    ops::Counting::fill(y.view(), 0.0f);
    ops::Counting::matmul(x.view(), ops::Transpose::no, w1.view(), ops::Transpose::yes, y.view());
  }
  std::vector<std::uintptr_t> operands;
  for (const TraceEvent& e : trace.events())
    if (e.kind == TraceKind::gemm) operands.push_back(e.operand);
  REQUIRE(operands.size() == 3);
  CHECK(operands[0] == reinterpret_cast<std::uintptr_t>(w1.data()));
  CHECK(operands[1] == reinterpret_cast<std::uintptr_t>(w2.data()));
  CHECK(operands[0] != operands[1]);
  CHECK(operands[2] == operands[0]);
}

TEST_CASE("gemm reuse: profile JSON round trips the cycles and tables; bad ones refused by name") {
  PARADYSE_FRESH_RNG(rng);
  HardwareProfile p = builtin_profile("h100");
  p.gemm.measured = random_tables(rng).g.measured;
  p.gemm.reuse = random_tables(rng).g.reuse;
  const HardwareProfile back = profile_from_json(json::parse(json::dump(to_json(p))));
  CHECK(back.gemm.measured == p.gemm.measured);
  CHECK(back.gemm.reuse == p.gemm.reuse);
  CHECK_FALSE(to_json(builtin_profile("h100"))["gemm"].contains("reuse"));
  const auto refused = [&](auto&& edit, const std::string& message) {
    json::Value v = to_json(p);
    edit(v["gemm"]["reuse"]);
    CHECK_THROWS_WITH_AS(profile_from_json(v), doctest::Contains(message.c_str()), Error);
  };
  refused([](json::Value& r) { r[1]["cycle_bytes"] = 512; },
          "gemm.reuse[1] needs a cycle_bytes, positive and above the table's");
  refused([](json::Value& r) { r[0].erase("cycle_bytes"); }, "gemm.reuse[0] needs a cycle_bytes, positive");
  refused([](json::Value& r) { r[0]["cycle_bytes"] = 0; }, "cycle_bytes");
  refused([](json::Value& r) { r[0]["cycles"] = 1; }, "cycles");
}
