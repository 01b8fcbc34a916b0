// Tests of the GEMM model's size classes (cost/profile.hpp GemmModel::by_rows, cost/calibrate.hpp fit_gemm_classes
// and calibrate_gemm_classes, the "by_rows" field of cost/profile_json.hpp): the fit recovers known per-class rates,
// the class of a GEMM at the bounds, old profile JSON (one fit, no classes) loading as it did, bad classes refused.
#include "paradyse/comm/threads.hpp"
#include "paradyse/core/rng.hpp"
#include "paradyse/cost/calibrate.hpp"
#include "paradyse/cost/profile.hpp"
#include "paradyse/cost/profile_json.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

using namespace paradyse;
using namespace paradyse::cost;

namespace {

// A profile's single fit and two classes, rates far apart so that a sample taken from the wrong class shows.
GemmModel known_model() {
  GemmModel g;
  g.overhead_s = 2e-6, g.flops_per_s = 150e9, g.bytes_per_s = 20e9;
  g.by_rows = {{.max_rows = 16, .overhead_s = 9e-6, .flops_per_s = 40e9, .bytes_per_s = 3e9, .outputs_per_s = 2e8},
               {.max_rows = 128, .overhead_s = 4e-6, .flops_per_s = 90e9, .bytes_per_s = 7e9, .outputs_per_s = 1e9}};
  return g;
}

}  // namespace

TEST_CASE("gemm classes: the fit recovers each class's overhead, rate and bandwidth from synthetic samples") {
  for (const std::uint64_t seed : {1u, 2u, 3u}) {
    Rng rng(seed);
    const GemmModel truth = known_model();
    std::vector<GemmSample> samples;
    for (int i = 0; i < 40; ++i) {  // rows in both classes and above them (left to the single fit)
      const double lo[] = {1, 17, 129}, hi[] = {16, 128, 400};
      const int c = i % 3;
      const auto m = std::int64_t(lo[c] + rng.uniform() * (hi[c] - lo[c] + 1)), n = std::int64_t(64 + rng.uniform() * 2048),
                 k = std::int64_t(64 + rng.uniform() * 2048);
      samples.push_back({m, n, k, truth.time(double(m), double(n), double(k), 4)});
    }
    std::vector<Fit> fits;
    const std::vector<GemmRowClass> got = fit_gemm_classes(samples, {16, 128}, 4, &fits);
    REQUIRE(got.size() == 2);
    REQUIRE(fits.size() == 2);
    for (std::size_t c = 0; c < 2; ++c) {
      CAPTURE(seed);
      CAPTURE(c);
      CHECK(got[c].max_rows == truth.by_rows[c].max_rows);
      CHECK(got[c].overhead_s == doctest::Approx(truth.by_rows[c].overhead_s).epsilon(1e-6).scale(0));
      CHECK(got[c].flops_per_s == doctest::Approx(truth.by_rows[c].flops_per_s).epsilon(1e-6));
      CHECK(got[c].bytes_per_s == doctest::Approx(truth.by_rows[c].bytes_per_s).epsilon(1e-6));
      CHECK(got[c].outputs_per_s == doctest::Approx(truth.by_rows[c].outputs_per_s).epsilon(1e-6));
      CHECK(fits[c].worst_relative_error < 1e-9);
    }
  }
}

TEST_CASE("gemm classes: a GEMM takes the first class whose max_rows holds its rows, above them the single fit") {
  const GemmModel g = known_model();
  CHECK(g.row_class(1) == 0);
  CHECK(g.row_class(16) == 0);    // the bound belongs to its class
  CHECK(g.row_class(16.5) == 1);  // step_cost's EP split gives fractional rows
  CHECK(g.row_class(17) == 1);
  CHECK(g.row_class(128) == 1);
  CHECK(g.row_class(129) == -1);
  const double n = 1024, k = 256, b = 4;
  // A class: its weight bytes and output elements; the single fit: all operand bytes.
  auto in_class = [&](double m, double overhead, double rate, double bandwidth, double outputs) {
    return overhead + 2 * m * n * k / rate + n * k * b / bandwidth + m * n / outputs;
  };
  auto single_fit = [&](double m) { return 2e-6 + 2 * m * n * k / 150e9 + (m * k + k * n + m * n) * b / 20e9; };
  CHECK(g.time(16, n, k, 4) == doctest::Approx(in_class(16, 9e-6, 40e9, 3e9, 2e8)).scale(0));
  CHECK(g.time(17, n, k, 4) == doctest::Approx(in_class(17, 4e-6, 90e9, 7e9, 1e9)).scale(0));
  CHECK(g.time(128, n, k, 4) == doctest::Approx(in_class(128, 4e-6, 90e9, 7e9, 1e9)).scale(0));
  CHECK(g.time(129, n, k, 4) == doctest::Approx(single_fit(129)).scale(0));
  CHECK(g.time(0, n, k, 4) == 0);
  GemmModel single = g;
  single.by_rows.clear();  // no classes: the single fit for every size, as before them
  CHECK(single.time(4, n, k, 4) == doctest::Approx(single_fit(4)).scale(0));
}

TEST_CASE("gemm classes: profile JSON without them loads as the single fit; with them it round-trips") {
  // A profile as written before the classes existed.
  const json::Value old = json::parse(R"({"format": "paradyse.hardware_profile/1", "name": "old", "devices_per_node": 2,
      "memory_bytes": 1000000000, "reserved_bytes": 0,
      "gemm": {"overhead_s": 1.46e-6, "flops_per_s": 1.664e11, "bytes_per_s": 3.22e9},
      "attention": {"overhead_s": 0, "forward_flops_per_s": 1e10, "backward_flops_per_s": 1e10},
      "elementwise_bytes_per_s": 1e10, "overlap": 0,
      "intra_node": {"launch_s": 0, "step_latency_s": 1e-6, "bus_bytes_per_s": 1e10, "p2p_bytes_per_s": 1e10},
      "inter_node": {"launch_s": 0, "step_latency_s": 1e-6, "bus_bytes_per_s": 1e10, "p2p_bytes_per_s": 1e10},
      "collectives": []})");
  const HardwareProfile p = profile_from_json(old);
  CHECK(p.gemm.by_rows.empty());
  CHECK(p.gemm.time(4, 1024, 256, 4) ==
        doctest::Approx(1.46e-6 + 2.0 * 4 * 1024 * 256 / 1.664e11 + (4.0 * 256 + 256 * 1024 + 4 * 1024) * 4 / 3.22e9)
            .scale(0));
  CHECK_FALSE(to_json(p)["gemm"].contains("by_rows"));  // and is written back the same way

  HardwareProfile q = p;
  q.gemm.by_rows = known_model().by_rows;
  const HardwareProfile back = profile_from_json(json::parse(json::dump(to_json(q))));
  CHECK(back.gemm.by_rows == q.gemm.by_rows);
  CHECK(back.gemm.time(17, 1024, 256, 4) == q.gemm.time(17, 1024, 256, 4));
}

TEST_CASE("gemm classes: bad classes are refused by name") {
  HardwareProfile p;
  p.name = "bad";
  p.memory_bytes = 1 << 30;
  p.gemm.by_rows = {{.max_rows = 128, .overhead_s = 0, .flops_per_s = 1e9},
                    {.max_rows = 16, .overhead_s = 0, .flops_per_s = 1e9}};
  CHECK_THROWS_WITH_AS(profile_from_json(to_json(p)),
                       doctest::Contains("gemm.by_rows[1].max_rows = 16 must be above the previous class's 128"), Error);
  json::Value v = to_json(p);
  v["gemm"]["by_rows"][0]["flops"] = 1;
  CHECK_THROWS_WITH_AS(profile_from_json(v), doctest::Contains("unknown key \"flops\""), Error);
  v = to_json(p);
  v["gemm"]["by_rows"][0]["max_rows"] = 2.5;
  CHECK_THROWS_WITH_AS(profile_from_json(v), doctest::Contains("\"max_rows\" = 2.5 must be an integer"), Error);
  // Too few samples in a class.
  const std::vector<GemmSample> three = {{1, 64, 64, 1e-6}, {2, 64, 64, 2e-6}, {3, 64, 64, 3e-6}, {40, 64, 64, 1e-5}};
  CHECK_THROWS_WITH_AS(fit_gemm_classes(three, {16, 128}, 4),
                       doctest::Contains("the class 0 < m <= 16 has 3 GEMM samples, at least 4 are needed"), Error);
  CHECK_THROWS_WITH_AS(fit_gemm_classes(three, {16, 8}, 4), doctest::Contains("class bounds must ascend"), Error);
}

TEST_CASE("gemm classes: calibrate_gemm_classes measures the shapes on every rank and fits them") {
  GemmClassOptions options;
  options.repetitions = 1;
  options.cold_bytes = std::int64_t(1) << 20;  // a small cold pool: this checks the plumbing, not the machine
  options.max_rows = {4, 32};
  for (const std::int64_t m : {1, 2, 4, 8, 16, 32, 64})
    for (const std::int64_t n : {64, 128})
      for (const std::int64_t k : {64, 96}) options.shapes.push_back({m, n, k});
  std::vector<GemmClassCalibration> got(2);
  run_ranks(2, [&](ThreadCommunicator& comm) { got[std::size_t(comm.rank())] = calibrate_gemm_classes(comm, options); });
  REQUIRE(got[0].classes.size() == 2);
  CHECK(got[0].classes == got[1].classes);  // every rank the same (the slowest rank's times)
  CHECK(got[0].samples.size() == options.shapes.size());
  CHECK(got[0].compared.size() == 24);  // the 64-row shapes are above the classes
  for (const GemmSample& s : got[0].samples) CHECK(s.seconds > 0);
}
