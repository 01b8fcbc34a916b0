// Tests of the buffer pool's churn in the time model (cost/trace_cost.hpp): a sublayer's pool misses in steady
// state (its loans replayed twice through the pool's rule, detail::PoolReplay) are priced at the profile's
// pool_miss_bytes_per_s; loans the pool serves from what it keeps cost nothing; the calibration makes a real pool
// miss on every loan (cost/calibrate.hpp); profile JSON without the rate loads with the term unpriced.
#include "paradyse/comm/threads.hpp"
#include "paradyse/cost/builtin_profiles.hpp"
#include "paradyse/cost/calibrate.hpp"
#include "paradyse/cost/profile_json.hpp"
#include "paradyse/cost/trace_cost.hpp"

#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

using namespace paradyse;
using namespace paradyse::cost;

namespace {

// Every other rate as fast as a profile allows: only the pool's misses cost time.
HardwareProfile misses_only(double rate) {
  HardwareProfile hw = a100_sxm4_80gb_x8();
  hw.elementwise_bytes_per_s = 1e30;
  hw.activation_elements_per_s = 1e30;
  hw.pool_miss_bytes_per_s = rate;
  return hw;
}

TraceEvent loan(double bytes) { return {.kind = TraceKind::pool_acquire, .bytes = bytes}; }
TraceEvent back(double bytes) { return {.kind = TraceKind::pool_give_back, .bytes = bytes}; }

}  // namespace

TEST_CASE("pool misses: the pool's rule counts the bytes its misses allocate") {
  detail::PoolReplay pool;
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

TEST_CASE("pool misses: a sublayer's steady-state misses at the profile's rate, per phase") {
  const double a = 1 << 20, b = 1.25 * (1 << 20);  // two classes (m * 2^k, m in [8, 16))
  const HardwareProfile hw = misses_only(2e9);
  SublayerTrace churn;
  // Each phase lends a, then b (a given back first): under the high-water mark of one buffer each evicts the other,
  // in every layer; the backward's loan of c (a third class) adds its own.
  const double c3 = 1.5 * (1 << 20);
  churn.forward = {loan(a), back(a), loan(b), back(b)};
  churn.backward = {loan(a), back(a), loan(b), back(b), loan(c3), back(c3)};
  const SublayerCost c = cost_of(churn, &hw);
  CHECK(c.forward_s == doctest::Approx((a + b) / 2e9).epsilon(1e-12));
  CHECK(c.backward_s == doctest::Approx((a + b + c3) / 2e9).epsilon(1e-12));
  CHECK(c.compute_s == doctest::Approx((2 * a + 2 * b + c3) / 2e9).epsilon(1e-12));
  // One size throughout, or two lent at once (the high-water mark holds both): the pool keeps them, nothing to price.
  SublayerTrace steady;
  steady.forward = {loan(a), back(a), loan(a), back(a)};
  steady.backward = {loan(a), back(a)};
  CHECK(cost_of(steady, &hw).time_s() == doctest::Approx(0).epsilon(1e-15));
  SublayerTrace kept;
  kept.forward = {loan(a), loan(b), back(a), back(b)};
  kept.backward = {loan(b), loan(a), back(b), back(a)};
  CHECK(cost_of(kept, &hw).time_s() == doctest::Approx(0).epsilon(1e-15));
  // bf16: the recorded float32 bytes halve, and so does the price.
  CHECK(cost_of(churn, &hw, 2).forward_s == doctest::Approx((a + b) / 2 / 2e9).epsilon(1e-12));
  // Without the rate (built-in profiles, old profile JSON): unpriced, as before.
  const HardwareProfile unpriced = misses_only(0);
  CHECK(cost_of(churn, &unpriced).time_s() == doctest::Approx(0).epsilon(1e-15));
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

TEST_CASE("pool misses: the calibration makes a real pool miss on every loan, on every rank") {
  CalibrationOptions options;
  options.repetitions = 1;
  options.pool_miss_bytes = {std::int64_t(1) << 16, std::int64_t(1) << 18};
  std::vector<Calibration> got(2);
  run_ranks(2, [&](ThreadCommunicator& comm) {
    calibrate_detail::calibrate_pool_misses<ops::Cpu>(comm, options, got[std::size_t(comm.rank())]);
  });
  CHECK(got[0].profile.pool_miss_bytes_per_s > 0);
  CHECK(got[0].profile.pool_miss_bytes_per_s == got[1].profile.pool_miss_bytes_per_s);
  CHECK(got[0].samples.size() == 2);
  // The pattern misses on every loan (what the rate is per byte of).
  BufferPool pool;
  for (int i = 0; i < 6; ++i) (void)pool.acquire<float>(Shape{(i % 2 ? 5 : 4) * 16384});
  CHECK(pool.stats().misses == 6);
  // Not asked for: unpriced.
  Calibration none;
  run_ranks(1, [&](ThreadCommunicator& comm) {
    calibrate_detail::calibrate_pool_misses<ops::Cpu>(comm, CalibrationOptions{}, none);
  });
  CHECK(none.profile.pool_miss_bytes_per_s == 0);
}
