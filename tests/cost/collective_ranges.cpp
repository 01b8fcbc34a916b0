// Tests of a collective's size ranges (cost/calibration_fits.hpp message_ranges, fit_message_ranges;
// cost/calibrate_memory.hpp last_level_cache_bytes): the last-level cache read from a sysfs-shaped folder, the ranges
// it gives, each range's line fitted on its own samples (a line from 4 MiB through messages that left the cache priced
// them far low), and the calibration's profile holding one entry per range.
#include "paradyse/comm/threads.hpp"
#include "paradyse/cost/calibrate.hpp"
#include "cost/small_calibration.hpp"
#include "support/fresh_seed.hpp"
#include "support/temp_folder.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

using namespace paradyse;
using namespace paradyse::cost;

namespace collective_ranges_test {

namespace fs = std::filesystem;

constexpr std::int64_t MiB = std::int64_t(1) << 20;

struct CacheFolder : testing::TempFolder {
  CacheFolder() : TempFolder("paradyse_cache") {}
  // index<i>/level and index<i>/size as the kernel writes them ("32768K").
  void add(int index, const std::string& level, const std::string& size) const {
    const fs::path dir = path / ("index" + std::to_string(index));
    fs::create_directories(dir);
    std::ofstream(dir / "level") << level << "\n";
    std::ofstream(dir / "size") << size << "\n";
  }
};

// Seconds of a collective of `bytes` on a machine whose messages from `beyond` bytes leave the cache.
struct TwoRegimes {
  double alpha_s, in_cache_s_per_byte, beyond_s_per_byte;
  std::int64_t beyond;
  double operator()(std::int64_t bytes) const {
    return alpha_s + double(bytes) * (bytes < beyond ? in_cache_s_per_byte : beyond_s_per_byte);
  }
};

}  // namespace collective_ranges_test

using namespace collective_ranges_test;

TEST_CASE("collective ranges: the last-level cache is the highest level's size in a sysfs cache folder") {
  CacheFolder cache;
  cache.add(0, "1", "32K");  // data
  cache.add(1, "1", "32K");  // instructions
  cache.add(2, "2", "1024K");
  cache.add(3, "3", "32768K");
  CHECK(calibrate_detail::last_level_cache_bytes(cache.path) == 32 * MiB);
  cache.add(4, "3", "64M");  // a larger cache of the same level, in another unit
  CHECK(calibrate_detail::last_level_cache_bytes(cache.path) == 64 * MiB);
  cache.add(5, "4", "unknown");  // an unreadable size is passed over
  CHECK(calibrate_detail::last_level_cache_bytes(cache.path) == 64 * MiB);
  CHECK(calibrate_detail::last_level_cache_bytes(cache.path / "missing") == 0);
}

TEST_CASE("collective ranges: a range beyond the cache where two samples lie beyond it and two below") {
  const std::vector<std::int64_t> sizes = {MiB / 32, MiB / 4, MiB, 4 * MiB, 8 * MiB, 16 * MiB, 32 * MiB, 64 * MiB};
  // 2 ranks on 32 MiB: an all-gather's 3 messages of buffers leave it from 32/3 MiB.
  CHECK(message_ranges(4 * MiB, 32 * MiB, 2, sizes) == std::vector<std::int64_t>{0, 4 * MiB, 32 * MiB / 3});
  CHECK(message_ranges(4 * MiB, 0, 2, sizes) == std::vector<std::int64_t>{0, 4 * MiB});
  // 260 MiB: no sample beyond 86 MiB; 4 ranks on 32 MiB: one sample between 4 MiB and 6.4 MiB.
  CHECK(message_ranges(4 * MiB, 260 * MiB, 2, sizes) == std::vector<std::int64_t>{0, 4 * MiB});
  CHECK(message_ranges(4 * MiB, 32 * MiB, 4, sizes) == std::vector<std::int64_t>{0, 4 * MiB});
  // 8 MiB / 3 is below the large-message size: no third range.
  CHECK(message_ranges(4 * MiB, 8 * MiB, 2, sizes) == std::vector<std::int64_t>{0, 4 * MiB});
}

TEST_CASE("collective ranges: each range's line is fitted on its own samples") {
  PARADYSE_FRESH_RNG(rng);
  std::uniform_real_distribution<double> seconds(5e-6, 2e-5), rate(8e9, 30e9), slower(2.0, 5.0);
  const double in_cache = 1 / rate(rng);
  const TwoRegimes truth{seconds(rng), in_cache, in_cache * slower(rng), 32 * MiB / 3};
  const std::vector<std::int64_t> sizes = {4 * MiB, 8 * MiB, 16 * MiB, 32 * MiB, 64 * MiB};
  std::vector<std::vector<double>> rows;
  std::vector<double> y;
  for (const std::int64_t b : sizes) rows.push_back({1.0, double(b)}), y.push_back(truth(b));

  const std::vector<std::int64_t> from = message_ranges(4 * MiB, 32 * MiB, 2, sizes);
  REQUIRE(from.size() == 3);
  const std::vector<Fit> fits = fit_message_ranges(rows, y, from);
  REQUIRE(fits.size() == 3);
  // Each line is its regime's: exact on 4 and 8 MiB in the cache, on 16 to 64 MiB beyond it.
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    const Fit& f = fits[sizes[i] < from[2] ? 1 : 2];
    INFO(sizes[i], " B");
    CHECK(f.coefficients[0] + f.coefficients[1] * double(sizes[i]) == doctest::Approx(y[i]).epsilon(1e-6).scale(0));
  }
  // Without the cache's range, one line from 4 MiB misprices the samples on one side or the other.
  const std::vector<Fit> two = fit_message_ranges(rows, y, std::vector<std::int64_t>{0, 4 * MiB});
  double worst = 0;
  for (std::size_t i = 0; i < sizes.size(); ++i)
    worst = std::max(worst, std::abs(two[1].coefficients[0] + two[1].coefficients[1] * double(sizes[i]) - y[i]) / y[i]);
  CHECK(worst > 0.2);
  // A range without two samples is fitted on all of them.
  const std::vector<Fit> sparse = fit_message_ranges(rows, y, std::vector<std::int64_t>{0, 60 * MiB});
  CHECK(sparse[1].coefficients == fit_non_negative(rows, y).coefficients);
}

TEST_CASE("collective ranges: a calibration on 2 ranks prices each collective with a line per range") {
  CalibrationOptions options = testing::small_calibration_options();
  options.message_bytes = {1 << 10, 1 << 11, 1 << 12, 1 << 13, 1 << 14, 1 << 15};
  options.large_message_bytes = 1 << 12;
  options.cache_bytes = 3 << 14;  // 2 ranks: beyond it from 16 KiB
  const auto entries = [](const HardwareProfile& profile, Collective op) {
    std::vector<std::int64_t> from;
    for (const CollectiveCost& e : profile.collectives)
      if (e.op == op && e.group_size == 2) from.push_back(e.min_bytes);
    std::sort(from.begin(), from.end());
    return from;
  };
  Calibration three, two;
  run_ranks(2, [&](ThreadCommunicator& comm) {
    const Calibration c = calibrate<ops::Cpu>(comm, options);
    if (comm.rank() == 0) three = c;
  });
  options.cache_bytes = 0;
  run_ranks(2, [&](ThreadCommunicator& comm) {
    const Calibration c = calibrate<ops::Cpu>(comm, options);
    if (comm.rank() == 0) two = c;
  });
  for (const Collective op : kAllCollectives) {
    INFO(name_of(op));
    CHECK(entries(three.profile, op) == std::vector<std::int64_t>{0, 1 << 12, 1 << 14});
    CHECK(entries(two.profile, op) == std::vector<std::int64_t>{0, 1 << 12});
  }
  // Each sample is priced by its own range's line.
  const auto entry = [&](std::int64_t from) {
    for (const CollectiveCost& e : three.profile.collectives)
      if (e.op == Collective::all_gather && e.group_size == 2 && e.min_bytes == from) return e.cost;
    FAIL("no all_gather entry from ", from, " B");
    return AlphaBeta{};
  };
  CHECK(three.profile.collective_time(Collective::all_gather, 2, 1 << 15) == entry(1 << 14).time(1 << 15));
  CHECK(three.profile.collective_time(Collective::all_gather, 2, 1 << 13) == entry(1 << 12).time(1 << 13));
}
