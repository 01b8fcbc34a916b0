// Tests of the GEMM model's measured shapes (cost/profile.hpp GemmModel::measured, cost/calibrate.hpp measured_gemms
// and calibrate_gemm_classes' `measured`, the "measured" field of cost/profile_json.hpp): a measured row is priced at
// its own time, a row between two at the line between them, anything else (rows outside, another shape, another
// dtype) by the fits as before; the table made from samples holds each sample's time; JSON round trips and bad tables
// are refused by name.
#include "paradyse/comm/threads.hpp"
#include "paradyse/cost/calibrate.hpp"
#include "paradyse/cost/profile.hpp"
#include "paradyse/cost/profile_json.hpp"

#include "support/fresh_seed.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

using namespace paradyse;
using namespace paradyse::cost;

namespace gemm_measured_test {

// Fits (a single fit, two row classes, a head-width class) with random rates, and a measured 256 x 512 shape at rows
// 1, 4 and 16 with random times far from any fit's.
GemmModel random_model(std::mt19937_64& rng) {
  std::uniform_real_distribution<double> u(0.5, 2.0);
  GemmModel g{3e-6 * u(rng), 2e11 * u(rng), 8e9 * u(rng)};
  g.by_rows = {{16, 2e-6 * u(rng), 3e11 * u(rng), 6e9 * u(rng), 0},
               {128, 4e-6 * u(rng), 2e11 * u(rng), 7e9 * u(rng), 0}};
  g.thin = {64, 1e-6 * u(rng), 5e10 * u(rng), 4e9 * u(rng)};
  g.measured = {4, {{256, 512, {1, 4, 16}, {1e-3 * u(rng), 2e-3 * u(rng), 5e-3 * u(rng)}}}};
  return g;
}

}  // namespace gemm_measured_test

using namespace gemm_measured_test;

TEST_CASE("gemm measured: a measured row is its own time, between rows the line, the rest the fits") {
  PARADYSE_FRESH_RNG(rng);
  const GemmModel g = random_model(rng);
  GemmModel fits = g;
  fits.measured = {};
  const GemmMeasuredShape& s = g.measured.shapes[0];
  for (std::size_t i = 0; i < s.rows.size(); ++i) CHECK(g.time(s.rows[i], 256, 512, 4) == s.seconds[i]);
  CHECK(g.time(2, 256, 512, 4) == doctest::Approx(s.seconds[0] + (s.seconds[1] - s.seconds[0]) / 3).scale(0));
  CHECK(g.time(10, 256, 512, 4) == doctest::Approx(s.seconds[1] + (s.seconds[2] - s.seconds[1]) / 2).scale(0));
  CHECK(g.time(3.5, 256, 512, 4) == doctest::Approx(s.seconds[0] + (s.seconds[1] - s.seconds[0]) * 2.5 / 3).scale(0));
  // Outside the measured rows, another shape, the transposed shape, another dtype: the fits, unchanged.
  for (const double m : {0.5, 17.0, 64.0, 300.0}) CHECK(g.time(m, 256, 512, 4) == fits.time(m, 256, 512, 4));
  CHECK(g.time(4, 512, 256, 4) == fits.time(4, 512, 256, 4));
  CHECK(g.time(4, 256, 256, 4) == fits.time(4, 256, 256, 4));
  CHECK(g.time(4, 256, 512, 2) == fits.time(4, 256, 512, 2));
  CHECK(g.time(0, 256, 512, 4) == 0);
  // Before the head-width class too: a measured shape the thin class would hold is priced as measured.
  GemmModel thin = g;
  thin.thin.max_side = 512;
  CHECK(thin.time(4, 256, 512, 4) == s.seconds[1]);
  CHECK(thin.time(4, 256, 256, 4) == thin.thin.time(4, 256, 256, 4));
}

TEST_CASE("gemm measured: the head-width class prices its timed shapes at their times, others by its fit; in JSON") {
  // The output-heavy orientation ran 1.4x its fit where the other ran 0.9x: one linear fit cannot hold both.
  PARADYSE_FRESH_RNG(rng);
  std::uniform_real_distribution<double> u(0.5, 2.0);
  GemmModel g = random_model(rng);
  g.measured = {};
  const GemmThinClass fit = g.thin;
  std::vector<GemmSample> timed;
  for (const std::int64_t n : {256, 512, 1024})
    for (const auto& [rows, cols, depth] : {std::array<std::int64_t, 3>{n, n, 32}, {n, 32, n}})
      timed.push_back({rows, cols, depth, fit.time(double(rows), double(cols), double(depth), 4) * u(rng)});
  g.thin.timed = measured_gemms(timed, 4);
  for (const GemmSample& x : timed) {
    CHECK(g.time(double(x.m), double(x.n), double(x.k), 4) == x.seconds);
    // Another row count, the other dtype: the fit.
    const double other_rows = double(x.m) + 1;
    CHECK(g.time(other_rows, double(x.n), double(x.k), 4) == fit.time(other_rows, double(x.n), double(x.k), 4));
    CHECK(g.time(double(x.m), double(x.n), double(x.k), 2) == fit.time(double(x.m), double(x.n), double(x.k), 2));
  }
  CHECK(g.time(768, 768, 32, 4) == fit.time(768, 768, 32, 4));  // between timed shapes: the fit, not a line
  HardwareProfile p;
  p.name = "thin timed";
  p.memory_bytes = 1 << 30;
  p.gemm = g;
  const HardwareProfile back = profile_from_json(json::parse(json::dump(to_json(p))));
  CHECK(back.gemm.thin == g.thin);
  for (const GemmSample& x : timed) CHECK(back.gemm.time(double(x.m), double(x.n), double(x.k), 4) == x.seconds);
  json::Value v = to_json(p);
  v["gemm"]["thin"]["timed"]["shapes"][0]["seconds"][0] = -1;
  CHECK_THROWS_WITH_AS(profile_from_json(v), doctest::Contains("gemm.thin.timed.shapes[0].seconds[0] = -1"), Error);
  p.gemm.thin.timed = {};
  CHECK_FALSE(to_json(p)["gemm"]["thin"].contains("timed"));  // profiles without timed shapes read as before
}

TEST_CASE("gemm measured: measured_gemms holds every sample's time, a repeated row at its median") {
  PARADYSE_FRESH_RNG(rng);
  std::uniform_real_distribution<double> u(1e-6, 1e-3);
  std::vector<GemmSample> samples;
  for (const std::int64_t m : {16, 1, 4, 2, 64})  // rows out of order: the table sorts them
    for (const auto& [n, k] : {std::pair<std::int64_t, std::int64_t>{512, 256}, {256, 512}, {8, 256}})
      samples.push_back({m, n, k, u(rng)});
  std::shuffle(samples.begin(), samples.end(), rng);
  const GemmMeasured table = measured_gemms(samples, 4);
  CHECK(table.dtype_bytes == 4);
  REQUIRE(table.shapes.size() == 3);
  for (const GemmMeasuredShape& s : table.shapes) {
    CHECK(s.rows == std::vector<double>{1, 2, 4, 16, 64});
    CHECK(s.seconds.size() == s.rows.size());
  }
  GemmModel g;
  g.measured = table;
  for (const GemmSample& x : samples) CHECK(g.time(double(x.m), double(x.n), double(x.k), 4) == x.seconds);
  // A row measured three times: its median.
  std::vector<GemmSample> repeated = {{8, 64, 64, 3e-6}, {8, 64, 64, 1e-6}, {8, 64, 64, 2e-6}, {16, 64, 64, 5e-6}};
  g.measured = measured_gemms(repeated, 4);
  CHECK(g.time(8, 64, 64, 4) == 2e-6);
  CHECK(g.time(12, 64, 64, 4) == doctest::Approx(3.5e-6).scale(0));
  CHECK_THROWS_WITH_AS(measured_gemms({{4, 64, 64, 0}}, 4), doctest::Contains("sample 4x64x64 took 0 s"), Error);
  CHECK_THROWS_WITH_AS(measured_gemms({{0, 64, 64, 1e-6}}, 4), doctest::Contains("sample 0x64x64"), Error);
  CHECK_THROWS_WITH_AS(measured_gemms(samples, 0), doctest::Contains("dtype_bytes = 0"), Error);
}

TEST_CASE("gemm measured: profile JSON round trips the table; absent, none; bad tables refused by name") {
  PARADYSE_FRESH_RNG(rng);
  HardwareProfile p;
  p.name = "measured";
  p.memory_bytes = 1 << 30;
  p.gemm = random_model(rng);
  const HardwareProfile back = profile_from_json(json::parse(json::dump(to_json(p))));
  CHECK(back.gemm.measured == p.gemm.measured);
  for (const double m : {1.0, 3.0, 16.0, 20.0}) CHECK(back.gemm.time(m, 256, 512, 4) == p.gemm.time(m, 256, 512, 4));
  HardwareProfile none = p;
  none.gemm.measured = {};
  CHECK_FALSE(to_json(none)["gemm"].contains("measured"));
  CHECK(profile_from_json(to_json(none)).gemm.measured.shapes.empty());

  const auto refused = [&](auto&& edit, const std::string& message) {
    json::Value v = to_json(p);
    edit(v["gemm"]["measured"]);
    CHECK_THROWS_WITH_AS(profile_from_json(v), doctest::Contains(message.c_str()), Error);
  };
  refused([](json::Value& m) { m["shapes"][0]["rows"] = {1, 16, 4}; },
          "gemm.measured.shapes[0].rows[2] = 4 must be a whole row count from 1, above the row before");
  refused([](json::Value& m) { m["shapes"][0]["rows"][0] = 1.5; }, "rows[0] = 1.5 must be a whole row count");
  refused([](json::Value& m) { m["shapes"][0]["seconds"] = {1e-3, 2e-3}; },
          "gemm.measured.shapes[0] has 3 rows and 2 seconds");
  refused([](json::Value& m) { m["shapes"][0]["seconds"][1] = 0; }, "seconds[1] = 0 must be a time in (0, 1] seconds");
  refused([](json::Value& m) { m["shapes"].push_back(m["shapes"][0]); },
          "gemm.measured.shapes[1] repeats the shape n = 256, k = 512");
  refused([](json::Value& m) { m["shapes"][0]["m"] = 1; }, "unknown key \"m\"");
  refused([](json::Value& m) { m["dtype_bytes"] = 0; }, "\"dtype_bytes\" = 0 must be an integer in [1, 8]");
  refused([](json::Value& m) { m.erase("shapes"); }, "missing key \"shapes\"");
}

TEST_CASE("gemm measured: calibrate_gemm_classes keeps its samples as the measured shapes, the same on every rank") {
  GemmClassOptions options;
  options.repetitions = 1;
  options.cold_bytes = std::int64_t(1) << 20;  // a small cold pool: this checks the plumbing, not the machine
  options.max_rows = {4, 32};
  for (const std::int64_t m : {1, 2, 4, 8, 16, 32})
    for (const std::int64_t n : {64, 128}) options.shapes.push_back({m, n, 96});
  for (const int ranks : {2, 3}) {
    std::vector<GemmClassCalibration> got(static_cast<std::size_t>(ranks));
    run_ranks(ranks, [&](ThreadCommunicator& comm) {
      got[std::size_t(comm.rank())] = calibrate_gemm_classes(comm, options);
    });
    for (const GemmClassCalibration& g : got) CHECK(g.measured == got[0].measured);
    REQUIRE(got[0].measured.shapes.size() == 2);
    GemmModel model;
    model.measured = got[0].measured;
    for (const GemmSample& x : got[0].samples) CHECK(model.time(double(x.m), double(x.n), double(x.k), 4) == x.seconds);
  }
}
