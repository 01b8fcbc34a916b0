// Tests of the elementwise size classes (cost/profile.hpp's ElementwiseClass): a call is priced at the rate of the
// class its bytes fall in, the trace clock prices a dry run's elementwise events that way (cost/trace_cost.hpp), the
// fit recovers known rates and bounds from synthetic samples and the calibration measures them on every rank
// (cost/calibrate.hpp), and profile JSON written before the classes loads and prices every size at the single rate.
#include "paradyse/comm/threads.hpp"
#include "paradyse/cost/builtin_profiles.hpp"
#include "paradyse/cost/calibrate.hpp"
#include "paradyse/cost/profile_json.hpp"
#include "paradyse/cost/trace_cost.hpp"

#include "support/fresh_seed.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <random>
#include <vector>

using namespace paradyse;
using namespace paradyse::cost;

namespace {

// Three classes of random rates: up to 1 MB, up to 16 MB, up to 64 MB (and above).
HardwareProfile with_classes(std::mt19937_64& rng) {
  std::uniform_real_distribution<double> rate(1e9, 8e10);
  HardwareProfile hw = a100_sxm4_80gb_x8();
  hw.elementwise_bytes_per_s = rate(rng);
  hw.elementwise_classes = {{1 << 20, rate(rng)}, {1 << 24, rate(rng)}, {1 << 26, rate(rng)}};
  return hw;
}

double elementwise_seconds(double bytes, const HardwareProfile& hw, int dtype_bytes = 4) {
  SublayerTrace trace;
  trace.forward = {{.kind = TraceKind::elementwise, .count = 3, .bytes = bytes}};
  return cost_of(trace, &hw, dtype_bytes).forward_s;
}

}  // namespace

TEST_CASE("elementwise classes: a call takes its size class's rate; without classes the single rate") {
  PARADYSE_FRESH_RNG(rng);
  const HardwareProfile hw = with_classes(rng);
  const auto& c = hw.elementwise_classes;
  for (const auto& [bytes, rate] : {std::pair{64.0, c[0].bytes_per_s}, std::pair{double(1 << 20), c[0].bytes_per_s},
                                    std::pair{double(1 << 20) + 1, c[1].bytes_per_s},
                                    std::pair{double(1 << 24), c[1].bytes_per_s},
                                    std::pair{double(1 << 24) + 64, c[2].bytes_per_s},
                                    std::pair{double(1 << 26), c[2].bytes_per_s},
                                    std::pair{double(1 << 30), c[2].bytes_per_s}}) {  // above the last: the last
    CAPTURE(bytes);
    CHECK(hw.elementwise_time(bytes) == doctest::Approx(bytes / rate).epsilon(1e-12).scale(0));
    // The trace clock: each call of a repeated event at its class's rate.
    CHECK(elementwise_seconds(bytes, hw) == doctest::Approx(3 * bytes / rate).epsilon(1e-12));
  }
  // bf16 halves the recorded float32 bytes: the class of the halved call.
  CHECK(elementwise_seconds(double(1 << 21), hw, 2) == doctest::Approx(3.0 * (1 << 20) / c[0].bytes_per_s).epsilon(1e-12));
  HardwareProfile single = hw;
  single.elementwise_classes.clear();
  CHECK(elementwise_seconds(double(1 << 24), single) ==
        doctest::Approx(3.0 * (1 << 24) / hw.elementwise_bytes_per_s).epsilon(1e-12));
  // Activations without an activation rate are memory-bound: priced through the classes too.
  HardwareProfile memory_bound = hw;
  memory_bound.activation_elements_per_s = 0;
  CHECK(memory_bound.activation_time(1000, double(1 << 22)) == doctest::Approx((1 << 22) / c[1].bytes_per_s).scale(0));
}

TEST_CASE("elementwise classes: the fit takes each sample's rate up to the geometric mean of its bytes and the next's") {
  const std::vector<ElementwiseSample> samples = {{1e5, 1e5 / 4e10}, {1e6, 1e6 / 2e10}, {1e7, 1e7 / 5e9}};
  const std::vector<ElementwiseClass> classes = fit_elementwise_classes(samples);
  REQUIRE(classes.size() == 3);
  CHECK(classes[0].max_bytes == std::round(std::sqrt(1e5 * 1e6)));
  CHECK(classes[1].max_bytes == std::round(std::sqrt(1e6 * 1e7)));
  CHECK(classes[2].max_bytes == 1e7);
  CHECK(classes[0].bytes_per_s == doctest::Approx(4e10));
  CHECK(classes[1].bytes_per_s == doctest::Approx(2e10));
  CHECK(classes[2].bytes_per_s == doctest::Approx(5e9));
  CHECK_THROWS_WITH_AS(fit_elementwise_classes({}), doctest::Contains("no samples"), Error);
  const std::vector<ElementwiseSample> descending = {{1e6, 1e-4}, {1e5, 1e-5}};
  CHECK_THROWS_WITH_AS(fit_elementwise_classes(descending), doctest::Contains("ascending in bytes"), Error);
  const std::vector<ElementwiseSample> zero = {{1e6, 0}};
  CHECK_THROWS_WITH_AS(fit_elementwise_classes(zero), doctest::Contains("seconds = 0"), Error);
}

TEST_CASE("elementwise classes: profile JSON without them loads at the single rate; with them it round-trips") {
  const json::Value old = json::parse(R"({"format": "paradyse.hardware_profile/1", "name": "old", "devices_per_node": 2,
      "memory_bytes": 1000000000, "reserved_bytes": 0,
      "gemm": {"overhead_s": 1.46e-6, "flops_per_s": 1.664e11, "bytes_per_s": 3.22e9},
      "attention": {"overhead_s": 0, "forward_flops_per_s": 1e10, "backward_flops_per_s": 1e10},
      "elementwise_bytes_per_s": 6.9e10, "overlap": 0,
      "intra_node": {"launch_s": 0, "step_latency_s": 1e-6, "bus_bytes_per_s": 1e10, "p2p_bytes_per_s": 1e10},
      "inter_node": {"launch_s": 0, "step_latency_s": 1e-6, "bus_bytes_per_s": 1e10, "p2p_bytes_per_s": 1e10},
      "collectives": []})");
  const HardwareProfile p = profile_from_json(old);
  CHECK(p.elementwise_classes.empty());
  CHECK(p.elementwise_time(96e6) == doctest::Approx(96e6 / 6.9e10).scale(0));
  CHECK_FALSE(to_json(p).contains("elementwise_classes"));  // and is written back the same way
  PARADYSE_FRESH_RNG(rng);
  HardwareProfile q = p;
  q.elementwise_classes = with_classes(rng).elementwise_classes;
  const HardwareProfile back = profile_from_json(json::parse(json::dump(to_json(q))));
  CHECK(back.elementwise_classes == q.elementwise_classes);
  CHECK(back.elementwise_time(3e7) == q.elementwise_time(3e7));
  // Refused by name: bounds not ascending, an unknown key, a rate of 0.
  HardwareProfile bad = q;
  std::swap(bad.elementwise_classes[0], bad.elementwise_classes[1]);
  CHECK_THROWS_WITH_AS(profile_from_json(to_json(bad)),
                       doctest::Contains("elementwise_classes[1].max_bytes = 1048576 must be above the previous class's"),
                       Error);
  json::Value v = to_json(q);
  v["elementwise_classes"][0]["rate"] = 1;
  CHECK_THROWS_WITH_AS(profile_from_json(v), doctest::Contains("unknown key \"rate\""), Error);
  v = to_json(q);
  v["elementwise_classes"][2]["bytes_per_s"] = 0;
  CHECK_THROWS_WITH_AS(profile_from_json(v), doctest::Contains("elementwise_classes[2].bytes_per_s"), Error);
}

TEST_CASE("elementwise classes: the calibration measures the kernel mix per size on every rank") {
  CalibrationOptions options;
  options.repetitions = 1;
  options.attention_heads = 2;
  options.head_dim = 16;
  options.elementwise_class_rows = {16, 256, 4096};
  std::vector<Calibration> got(2);
  run_ranks(2, [&](ThreadCommunicator& comm) {
    calibrate_detail::calibrate_elementwise_classes<ops::Cpu>(comm, options, got[std::size_t(comm.rank())]);
  });
  const std::vector<ElementwiseClass>& classes = got[0].profile.elementwise_classes;
  REQUIRE(classes.size() == 3);
  CHECK(classes == got[1].profile.elementwise_classes);  // the slowest rank's times on every rank
  // The mix records, per row of h = 32 floats: two copies (8 B a float each), a sum (12), LayerNorm forward (8) and
  // backward (12): 48 x 4 x 32 bytes over 5 calls.
  const double per_row = 48.0 * 32 / 5;
  CHECK(classes[2].max_bytes == std::round(4096 * per_row));
  CHECK(classes[0].max_bytes == std::round(std::sqrt(16 * per_row * 256 * per_row)));
  REQUIRE(got[0].samples.size() == 3);
  for (std::size_t i = 0; i < 3; ++i) {
    CHECK(classes[i].bytes_per_s > 0);
    CHECK(got[0].samples[i].fitted_s == doctest::Approx(got[0].samples[i].measured_s).epsilon(1e-9).scale(0));
  }
  // Without rows asked for: no classes (the default, as calibrations were before).
  Calibration none;
  run_ranks(1, [&](ThreadCommunicator& comm) {
    calibrate_detail::calibrate_elementwise_classes<ops::Cpu>(comm, CalibrationOptions{}, none);
  });
  CHECK(none.profile.elementwise_classes.empty());
}
