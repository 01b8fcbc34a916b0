// Tests of the buffer pool's misses in the time model: the pool's rule counts the bytes its misses allocate
// (cost/trace_cost.hpp detail::PoolReplay), the step's loans replayed in order give the misses of the first fill and
// of the churn between sublayers of other sizes (cost/memory_model.hpp ordered_replay; priced by plan/cost_table.hpp,
// tests/plan/outside_stack.cpp), the calibration makes a real pool miss on every loan and times it
// (cost/calibrate.hpp), and profile JSON without the rate loads with the term unpriced.
#include "paradyse/comm/threads.hpp"
#include "paradyse/cost/builtin_profiles.hpp"
#include "paradyse/cost/calibrate.hpp"
#include "paradyse/cost/memory_model.hpp"
#include "paradyse/cost/profile_json.hpp"
#include "paradyse/cost/trace_cost.hpp"

#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

using namespace paradyse;
using namespace paradyse::cost;

TEST_CASE("pool misses: the pool's rule counts the bytes its misses allocate") {
  cost::detail::PoolReplay pool;
  pool.acquire(1024);
  pool.give_back(1024);
  pool.acquire(1024);  // a hit
  pool.give_back(1024);
  CHECK(pool.missed() == 1024);
  pool.acquire(1280);  // another class: a miss, the cached 1024 evicted to stay under the high-water mark
  pool.give_back(1280);
  pool.acquire(1024);  // missed again
  CHECK(pool.missed() == 1024 + 1280 + 1024);
  CHECK(pool.held() == 1024);
}

TEST_CASE("pool misses: the step's loans in order through the pool's rule, the churn between sublayers counted") {
  // Attention lends a, the MLP b (another class), in forward and in backward, on two layers: under a high-water
  // mark of one buffer each loan evicts the other's, except where backward starts with the class forward ended on.
  const std::int64_t a = 1024, b = 1280;
  SublayerMemory attention, mlp;
  attention.forward_events = attention.backward_events = {{MemoryEvent::acquire, a}, {MemoryEvent::give_back, a}};
  mlp.forward_events = mlp.backward_events = {{MemoryEvent::acquire, b}, {MemoryEvent::give_back, b}};
  const std::vector<SublayerMemory> churn = {attention, mlp, attention, mlp};
  const OrderedReplay replay = ordered_replay(churn);
  CHECK(replay.pool_missed_bytes == 4 * a + 3 * b);  // forward a b a b, backward (b kept) a b a
  CHECK(replay.pool_misses == std::vector<std::int64_t>{a, b, a, b, a, b, a});
  CHECK(replay.peak == ordered_activation_peak(churn));
  // One class throughout: the first fill only.
  const std::vector<SublayerMemory> same = {attention, attention, attention, attention};
  CHECK(ordered_replay(same).pool_missed_bytes == a);
  // Both lent at once: the high-water mark holds both, the first fill only.
  SublayerMemory both;
  both.forward_events = both.backward_events = {{MemoryEvent::acquire, a}, {MemoryEvent::acquire, b},
                                                {MemoryEvent::give_back, a}, {MemoryEvent::give_back, b}};
  const std::vector<SublayerMemory> kept = {both, both, both, both};
  CHECK(ordered_replay(kept).pool_missed_bytes == a + b);
}

TEST_CASE("pool misses: profile JSON without the rate loads unpriced; with it it round-trips") {
  HardwareProfile p = a100_sxm4_80gb_x8();
  CHECK_FALSE(to_json(p).contains("pool_miss_bytes_per_s"));
  CHECK(profile_from_json(to_json(p)).pool_miss_bytes_per_s == 0);
  p.pool_miss_bytes_per_s = 1.5e9;
  CHECK(profile_from_json(json::parse(json::dump(to_json(p)))).pool_miss_bytes_per_s == 1.5e9);
  json::Value bad = to_json(p);
  bad["pool_miss_bytes_per_s"] = -1;
  CHECK_THROWS_WITH_AS(profile_from_json(bad), doctest::Contains("\"pool_miss_bytes_per_s\" = -1"), Error);
}

TEST_CASE("pool misses: the calibration makes a real pool miss on every loan, its rate the timed misses' bytes") {
  CalibrationOptions options;
  options.repetitions = 1;
  options.pool_miss_bytes = {std::int64_t(1) << 16, std::int64_t(1) << 18};
  // Fresh memory as calibrated before: zeroed at 20 GB/s below 256 KiB, new pages from it at 2 GB/s.
  const FreshMemoryModel fresh{20e9, 2e9, std::int64_t(1) << 18};
  std::vector<Calibration> got(2);
  for (Calibration& c : got) c.profile.fresh_memory = fresh;
  run_ranks(2, [&](ThreadCommunicator& comm) {
    calibrate_detail::calibrate_pool_misses<ops::Cpu>(comm, options, got[std::size_t(comm.rank())]);
  });
  // Loans of 64 KiB and 80 KiB in turn, then of 256 KiB and 320 KiB, 8 of each size class (classes are exact here).
  const double lent = 8.0 * (65536 + 81920 + 262144 + 327680);
  REQUIRE(got[0].samples.size() == 2);  // the timed misses per loan, each beside its price as unzeroed fresh memory
  const double timed = 16 * (got[0].samples[0].measured_s + got[0].samples[1].measured_s);
  REQUIRE(timed > 0);
  CHECK(got[0].profile.pool_miss_bytes_per_s == doctest::Approx(lent / timed).epsilon(1e-12));
  CHECK(got[0].profile.pool_miss_bytes_per_s == got[1].profile.pool_miss_bytes_per_s);
  CHECK(got[0].samples[0].fitted_s == 0);  // heap below the fresh size: the pool zeroes nothing
  const double faults = 8.0 * (262144 / 2e9 - 262144 / 20e9 + 327680 / 2e9 - 327680 / 20e9) / 16;
  CHECK(got[0].samples[1].fitted_s == doctest::Approx(faults).epsilon(1e-12));
  // The pattern misses on every loan (what the rate is per byte of).
  BufferPool pool;
  for (int i = 0; i < 6; ++i) (void)pool.acquire<float>(Shape{(i % 2 ? 5 : 4) * 16384});
  CHECK(pool.stats().misses == 6);
  // Not asked for: unpriced.
  Calibration none;
  none.profile.fresh_memory = fresh;
  run_ranks(1, [&](ThreadCommunicator& comm) {
    calibrate_detail::calibrate_pool_misses<ops::Cpu>(comm, CalibrationOptions{}, none);
  });
  CHECK(none.profile.pool_miss_bytes_per_s == 0);
}
