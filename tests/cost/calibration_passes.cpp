// Tests of a calibration of several passes (cost/calibration_passes.hpp, CalibrationOptions::passes): the log replays
// every call's median over the recorded passes in call order and refuses passes that made other calls; measure()
// records what it timed and, in the replay, returns the median without running its function, the same on every rank
// (measured_quantity the same for a value read beside a measurement);
// median_of_passes runs a pass that many times and returns the replay; a whole calibration's replay gives every sample
// the median of the passes' and every rank the same profile; its GEMM samples (Calibration::gemm_samples, a speed
// probe's baseline) are the single fit's shapes in order, each the replayed median of that shape's sample, and the
// probe's reading of them is the median of measured / fitted over them.
#include "paradyse/comm/threads.hpp"
#include "paradyse/cost/calibrate.hpp"
#include "paradyse/cost/profile_json.hpp"
#include "paradyse/cost/speed_probe.hpp"

#include "cost/small_calibration.hpp"
#include "support/fresh_seed.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace calibration_passes_test {

using namespace paradyse;
using namespace paradyse::cost;

// The median as a reader would compute it: sorted, the middle one, or the mean of the middle two.
double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

TEST_CASE("calibration passes: the replay gives each call's median over the passes, in call order") {
  PARADYSE_FRESH_RNG(rng);
  std::uniform_real_distribution<double> seconds(1e-6, 1e-2);
  for (const int passes : {1, 2, 3, 4, 5}) {
    CAPTURE(passes);
    const int calls = 9;
    std::vector<std::vector<double>> recorded(static_cast<std::size_t>(passes));
    PassLog log;
    for (int p = 0; p < passes; ++p) {
      const ScopedPassLog recording(log, PassLog::Mode::record);
      CHECK(PassLog::current() == &log);
      for (int c = 0; c < calls; ++c) {
        recorded[std::size_t(p)].push_back(seconds(rng));
        log.record(recorded[std::size_t(p)].back());
      }
    }
    CHECK(PassLog::current() == nullptr);  // restored when the scope ends
    CHECK(log.passes() == std::size_t(passes));
    const std::vector<double> spreads = log.spreads();
    REQUIRE(spreads.size() == std::size_t(calls));
    const ScopedPassLog replaying(log, PassLog::Mode::replay);
    for (int c = 0; c < calls; ++c) {
      std::vector<double> values;
      for (int p = 0; p < passes; ++p) values.push_back(recorded[std::size_t(p)][std::size_t(c)]);
      CHECK_FALSE(log.replayed_all());
      CHECK(log.replay() == median_of(values));
      std::vector<double> sorted = values;
      std::sort(sorted.begin(), sorted.end());
      CHECK(spreads[std::size_t(c)] == doctest::Approx((sorted.back() - sorted.front()) / sorted[sorted.size() / 2]));
    }
    CHECK(log.replayed_all());
    CHECK_THROWS_WITH_AS(log.replay(), doctest::Contains("asked for measurement 10, the passes made 9"), Error);
  }
}

TEST_CASE("calibration passes: passes that made other calls, and calls outside their mode, are refused") {
  PassLog log;
  {
    const ScopedPassLog recording(log, PassLog::Mode::record);
    log.record(1.0);
    log.record(2.0);
    CHECK_THROWS_WITH_AS(log.replay(), doctest::Contains("replay() outside the replay"), Error);
  }
  {
    const ScopedPassLog recording(log, PassLog::Mode::record);
    log.record(1.0);
  }
  CHECK_THROWS_WITH_AS(ScopedPassLog(log, PassLog::Mode::replay),
                       doctest::Contains("pass 2 made 1 measurements, pass 1 made 2"), Error);
  PassLog empty;
  CHECK_THROWS_WITH_AS(ScopedPassLog(empty, PassLog::Mode::replay), doctest::Contains("at least one recorded pass"),
                       Error);
  CHECK_THROWS_WITH_AS(empty.record(1.0), doctest::Contains("record() outside a recording pass"), Error);
}

TEST_CASE("calibration passes: measure() records what it timed; the replay returns the median without timing") {
  for (const int ranks : {1, 2, 3}) {
    CAPTURE(ranks);
    std::vector<std::vector<double>> recorded(static_cast<std::size_t>(ranks)), replayed(recorded.size());
    std::vector<int> replay_calls(recorded.size(), 0);
    run_ranks(ranks, [&](ThreadCommunicator& comm) {
      const std::size_t r = std::size_t(comm.rank());
      PassLog log;
      volatile double sink = 0;
      for (int pass = 0; pass < 3; ++pass) {
        const ScopedPassLog recording(log, PassLog::Mode::record);
        for (int work : {1000, 20000}) {
          recorded[r].push_back(calibrate_detail::measure(comm, TimeSource::thread_cpu, 2, [&] {
            for (int i = 0; i < work * (comm.rank() + 1); ++i) sink = sink + 1e-9 * i;
          }));
        }
      }
      const ScopedPassLog replaying(log, PassLog::Mode::replay);
      for (int call = 0; call < 2; ++call)
        replayed[r].push_back(calibrate_detail::measure(comm, TimeSource::thread_cpu, 2, [&] { ++replay_calls[r]; }));
      CHECK(log.replayed_all());
    });
    for (int r = 0; r < ranks; ++r) {
      CHECK(replay_calls[std::size_t(r)] == 0);  // the replay runs nothing
      CHECK(recorded[std::size_t(r)] == recorded[0]);  // every rank records the slowest rank's time
      CHECK(replayed[std::size_t(r)] == replayed[0]);
    }
    for (std::size_t call = 0; call < 2; ++call)
      CHECK(replayed[0][call] == median_of({recorded[0][call], recorded[0][2 + call], recorded[0][4 + call]}));
  }
}

TEST_CASE("calibration passes: measured_quantity records the largest rank's value; the replay returns the median") {
  PARADYSE_FRESH_RNG(rng);
  std::uniform_real_distribution<double> u(0, 1);
  for (const int ranks : {1, 2, 3}) {
    CAPTURE(ranks);
    std::vector<std::vector<double>> drawn(3, std::vector<double>(std::size_t(ranks)));  // [pass][rank]
    for (auto& pass : drawn)
      for (double& x : pass) x = u(rng);
    std::vector<std::vector<double>> recorded(static_cast<std::size_t>(ranks)), replayed(recorded.size());
    run_ranks(ranks, [&](ThreadCommunicator& comm) {
      const std::size_t r = std::size_t(comm.rank());
      PassLog log;
      for (std::size_t pass = 0; pass < 3; ++pass) {
        const ScopedPassLog recording(log, PassLog::Mode::record);
        recorded[r].push_back(calibrate_detail::measured_quantity(comm, drawn[pass][r]));
      }
      const ScopedPassLog replaying(log, PassLog::Mode::replay);
      replayed[r].push_back(calibrate_detail::measured_quantity(comm, -1.0));  // not read in the replay
      CHECK(log.replayed_all());
    });
    std::vector<double> largest;
    for (const auto& pass : drawn) largest.push_back(*std::max_element(pass.begin(), pass.end()));
    for (int r = 0; r < ranks; ++r) {
      CHECK(recorded[std::size_t(r)] == largest);
      CHECK(replayed[std::size_t(r)][0] == median_of(largest));
    }
  }
}

TEST_CASE("calibration passes: median_of_passes returns the replay, each measurement the median of the passes'") {
  for (const int passes : {1, 2, 3}) {
    CAPTURE(passes);
    std::vector<std::vector<double>> runs;  // every run of the pass: the recorded ones, then the replay
    std::vector<double> result, spreads;
    run_ranks(2, [&](ThreadCommunicator& comm) {
      volatile double sink = 0;
      std::vector<double> spread;
      const std::vector<double> got = median_of_passes(
          passes,
          [&] {
            std::vector<double> seconds;
            for (const int work : {3000, 30000})
              seconds.push_back(calibrate_detail::measure(comm, TimeSource::thread_cpu, 1, [&] {
                for (int i = 0; i < work; ++i) sink = sink + 1e-9 * i;
              }));
            if (comm.rank() == 0) runs.push_back(seconds);
            return seconds;
          },
          &spread);
      if (comm.rank() == 0) result = got, spreads = spread;
    });
    if (passes == 1) {
      REQUIRE(runs.size() == 1);  // no replay: the one pass as measured
      CHECK(result == runs[0]);
      CHECK(spreads.empty());
      continue;
    }
    REQUIRE(runs.size() == std::size_t(passes) + 1);
    CHECK(result == runs.back());
    CHECK(spreads.size() == 2);
    for (std::size_t call = 0; call < 2; ++call) {
      std::vector<double> values;
      for (int p = 0; p < passes; ++p) values.push_back(runs[std::size_t(p)][call]);
      CHECK(result[call] == median_of(values));
    }
  }
  CHECK_THROWS_WITH_AS(median_of_passes(0, [] { return 1; }), doctest::Contains("passes = 0 must be at least 1"),
                       Error);
}

TEST_CASE("calibration passes: a calibration's replay gives every sample the median of the passes' samples") {
  const CalibrationOptions options = testing::small_calibration_options();
  for (const int ranks : {1, 2, 3}) {
    CAPTURE(ranks);
    std::vector<std::vector<Calibration>> passes(static_cast<std::size_t>(ranks));
    std::vector<Calibration> replayed(passes.size());
    run_ranks(ranks, [&](ThreadCommunicator& comm) {
      const std::size_t r = std::size_t(comm.rank());
      PassLog log;
      for (int pass = 0; pass < 3; ++pass) {
        const ScopedPassLog recording(log, PassLog::Mode::record);
        passes[r].push_back(calibrate_detail::calibrate_pass<ops::Cpu>(comm, options));
      }
      const ScopedPassLog replaying(log, PassLog::Mode::replay);
      replayed[r] = calibrate_detail::calibrate_pass<ops::Cpu>(comm, options);
      CHECK(log.replayed_all());
    });
    const std::vector<CalibrationSample>& samples = replayed[0].samples;
    REQUIRE(samples.size() == passes[0][0].samples.size());
    // Every sample is one measurement times a positive constant, so its median is the median of the passes' samples.
    for (std::size_t i = 0; i < samples.size(); ++i) {
      CAPTURE(samples[i].what);
      CHECK(samples[i].measured_s == median_of({passes[0][0].samples[i].measured_s, passes[0][1].samples[i].measured_s,
                                                passes[0][2].samples[i].measured_s}));
    }
    for (int r = 1; r < ranks; ++r)
      CHECK(json::dump(to_json(replayed[std::size_t(r)].profile)) == json::dump(to_json(replayed[0].profile)));
    // The single fit's GEMM samples: its shapes in order, as replayed; the probe's reading of them (its baseline).
    const std::vector<GemmSample>& gemms = replayed[0].gemm_samples;
    REQUIRE(gemms.size() == options.gemm_shapes.size());
    std::vector<double> measured_over_fitted;
    for (std::size_t i = 0; i < gemms.size(); ++i) {
      const auto [m, n, k] = options.gemm_shapes[i];
      CHECK((gemms[i].m == m && gemms[i].n == n && gemms[i].k == k));
      const auto sample = std::find_if(samples.begin(), samples.end(), [&](const CalibrationSample& x) {
        return x.what == "gemm " + std::to_string(m) + "x" + std::to_string(n) + "x" + std::to_string(k);
      });
      REQUIRE(sample != samples.end());
      CHECK(gemms[i].seconds == sample->measured_s);
      measured_over_fitted.push_back(sample->measured_s / sample->fitted_s);
    }
    CHECK(slowdown_of(gemms, replayed[0].profile) == doctest::Approx(median_of(measured_over_fitted)).epsilon(1e-12));
  }
}

TEST_CASE("calibration passes: calibrate() with passes reports their spreads; passes below 1 are refused by name") {
  CalibrationOptions options = testing::small_calibration_options();
  options.passes = 3;
  std::vector<Calibration> got(2);
  run_ranks(2, [&](ThreadCommunicator& comm) { got[std::size_t(comm.rank())] = calibrate<ops::Cpu>(comm, options); });
  CHECK_FALSE(got[0].pass_spreads.empty());
  CHECK(got[0].pass_spreads == got[1].pass_spreads);
  for (const double s : got[0].pass_spreads) CHECK(s >= 0);
  const std::string saved = json::dump(to_json(got[0].profile));
  CHECK(json::dump(to_json(profile_from_json(json::parse(saved)))) == saved);  // a valid profile
  options.passes = 1;
  Calibration one;
  run_ranks(1, [&](ThreadCommunicator& comm) { one = calibrate<ops::Cpu>(comm, options); });
  CHECK(one.pass_spreads.empty());
  options.passes = 0;
  run_ranks(1, [&](ThreadCommunicator& comm) {
    CHECK_THROWS_WITH_AS(calibrate<ops::Cpu>(comm, options), doctest::Contains("passes = 0 must be at least 1"), Error);
  });
}

}  // namespace calibration_passes_test
