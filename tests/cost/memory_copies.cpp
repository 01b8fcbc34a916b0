// Tests of the copies from memory (cost/profile.hpp HardwareProfile::memory_copy_bytes_per_s, cost/calibrate.hpp
// calibrate_memory_copies): the calibration times a pass over pieces cycled through its working set on every rank and
// keeps the pass's bytes read + written per second; without a working set it measures nothing and the profile prices
// such copies at the elementwise rate; a piece that is not whole floats, or too large for a source and a destination
// in the working set, is refused by name.
#include "paradyse/comm/threads.hpp"
#include "paradyse/cost/calibrate.hpp"
#include "cost/small_calibration.hpp"

#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

using namespace paradyse;
using namespace paradyse::cost;

TEST_CASE("memory copies: the calibration's pass over its pieces gives the rate, every rank the same") {
  const CalibrationOptions options = testing::small_calibration_options();  // 8 pairs of 4 KiB pieces
  for (const int ranks : {1, 2, 3}) {
    CAPTURE(ranks);
    std::vector<Calibration> got(static_cast<std::size_t>(ranks));
    run_ranks(ranks, [&](ThreadCommunicator& comm) {
      calibrate_detail::calibrate_memory_copies<ops::Cpu>(comm, options, got[std::size_t(comm.rank())]);
    });
    REQUIRE(got[0].samples.size() == 1);
    const CalibrationSample& s = got[0].samples[0];
    CHECK(s.what == "copy from memory 8 x 4096 B");
    CHECK(s.measured_s > 0);
    const double moved = 2.0 * 8 * 4096;  // every piece read and written once a pass
    CHECK(got[0].profile.memory_copy_bytes_per_s == doctest::Approx(moved / s.measured_s).epsilon(1e-12).scale(0));
    CHECK(s.fitted_s == doctest::Approx(s.measured_s).epsilon(1e-12).scale(0));
    for (const Calibration& c : got) {  // the slowest rank's pass, on every rank
      CHECK(c.profile.memory_copy_bytes_per_s == got[0].profile.memory_copy_bytes_per_s);
      CHECK(c.samples.size() == 1);
    }
  }
}

TEST_CASE("memory copies: none measured without a working set; the profile falls back to the elementwise rate") {
  CalibrationOptions options = testing::small_calibration_options();
  options.copy_memory_bytes = 0;
  Calibration got;
  got.profile.elementwise_bytes_per_s = 4e10;
  run_ranks(1, [&](ThreadCommunicator& comm) {
    calibrate_detail::calibrate_memory_copies<ops::Cpu>(comm, options, got);
  });
  CHECK(got.samples.empty());
  CHECK(got.profile.memory_copy_bytes_per_s == 0);
  CHECK(got.profile.memory_copy_time(8e6) == doctest::Approx(8e6 / 4e10).epsilon(1e-15).scale(0));
  got.profile.memory_copy_bytes_per_s = 1e10;
  CHECK(got.profile.memory_copy_time(8e6) == doctest::Approx(8e6 / 1e10).epsilon(1e-15).scale(0));
  CHECK(got.profile.memory_copy_time(0) == 0);
}

TEST_CASE("memory copies: a piece that is not whole floats or leaves no room for its destination is refused") {
  using Case = std::pair<std::int64_t, std::int64_t>;  // piece, working set
  for (const auto& [piece, total] : {Case{4098, 1 << 16}, Case{1 << 16, 1 << 16}, Case{0, 64}}) {
    CAPTURE(piece);
    CalibrationOptions options = testing::small_calibration_options();
    options.copy_memory_piece_bytes = piece;
    options.copy_memory_bytes = total;
    const std::string expected = "copy_memory_piece_bytes = " + std::to_string(piece);
    run_ranks(1, [&](ThreadCommunicator& comm) {
      Calibration got;
      CHECK_THROWS_WITH_AS(calibrate_detail::calibrate_memory_copies<ops::Cpu>(comm, options, got),
                           doctest::Contains(expected.c_str()), Error);
    });
  }
}
