// paradyse/cost/calibration_passes.hpp: a calibration run as several passes, each measurement the median of its
// passes' (CalibrationOptions::passes, cost/calibrate.hpp).
//
// One pass measures every sample once (the fastest of a few repetitions), seconds apart. On a shared machine the
// speed of a term moves at that time scale, and one pass's fits move with it: three calibrations of train_gpt's GEMMs
// minutes apart fitted 112 to 206 GFLOP/s, and one pass in four timed the buffer pool's misses without their page
// faults (150 GB/s against 2-3 GB/s in the others). So a calibration of P passes runs P passes recording every
// measurement in call order, then one more that replays, for each call, the median of the P recorded values instead
// of timing it; its fits see the medians. The passes make the same calls in the same order (the measurements never
// steer which calls follow); the replay checks it.
//
//   const Calibration c =
//       median_of_passes(3, [&] { return calibrate_detail::calibrate_pass<ops::Cpu>(comm, options); });
//   // = three passes recorded (ScopedPassLog(log, PassLog::Mode::record)), then one replayed: every measure() in the
//   //   last pass returns the median of its call's three recorded seconds
//
// The log in use is per thread (one per thread rank, as core/trace.hpp's ScopedTrace); every rank records the same
// values (calibrate_detail::measure records the slowest rank's time), so every rank replays the same medians.
#pragma once

#include "paradyse/core/error.hpp"

#include <algorithm>
#include <cstddef>
#include <vector>

namespace paradyse::cost {

class PassLog {
public:
  enum class Mode { record, replay };

  // Starts a pass: a recording one appends a new list of measurements; the replay checks that every recorded pass
  // made the same number of them and starts from the first.
  void begin(Mode mode) {
    mode_ = mode;
    next_ = 0;
    if (mode == Mode::record) {
      passes_.emplace_back();
      return;
    }
    check(!passes_.empty(), "PassLog: a replay needs at least one recorded pass");
    for (std::size_t p = 1; p < passes_.size(); ++p)
      check(passes_[p].size() == passes_[0].size(),
            "PassLog: pass {} made {} measurements, pass 1 made {} (the passes must make the same calls)", p + 1,
            passes_[p].size(), passes_[0].size());
  }
  Mode mode() const noexcept { return mode_; }
  std::size_t passes() const noexcept { return passes_.size(); }

  // A recording pass's next measurement.
  void record(double seconds) {
    check(mode_ == Mode::record && !passes_.empty(), "PassLog: record() outside a recording pass");
    passes_.back().push_back(seconds);
  }
  // The replay's next measurement: the median of that call's recorded values (the mean of the middle two for an even
  // number of passes).
  double replay() {
    check(mode_ == Mode::replay, "PassLog: replay() outside the replay");
    check(next_ < passes_[0].size(), "PassLog: the replay asked for measurement {}, the passes made {}", next_ + 1,
          passes_[0].size());
    std::vector<double> values;
    for (const std::vector<double>& pass : passes_) values.push_back(pass[next_]);
    ++next_;
    std::sort(values.begin(), values.end());
    const std::size_t n = values.size();
    return n % 2 == 1 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
  }
  // Whether the replay has asked for every recorded measurement.
  bool replayed_all() const noexcept { return mode_ == Mode::replay && next_ == passes_[0].size(); }

  // (max - min) / median of every call's recorded values, in call order (0 for one pass): how far the passes
  // disagreed.
  std::vector<double> spreads() const {
    std::vector<double> out;
    if (passes_.empty()) return out;
    for (std::size_t i = 0; i < passes_[0].size(); ++i) {
      std::vector<double> values;
      for (const std::vector<double>& pass : passes_)
        if (i < pass.size()) values.push_back(pass[i]);
      std::sort(values.begin(), values.end());
      const double median = values[values.size() / 2];
      out.push_back(median > 0 ? (values.back() - values.front()) / median : 0);
    }
    return out;
  }

  // The log this thread measures into, or nullptr (one pass: measurements are used as timed).
  static PassLog*& current() noexcept {
    thread_local PassLog* log = nullptr;
    return log;
  }

private:
  std::vector<std::vector<double>> passes_;  // per recorded pass, its measurements in call order
  Mode mode_ = Mode::record;
  std::size_t next_ = 0;  // the replay's next measurement
};

// Makes `log` this thread's current one for a pass in `mode` (begin()), restoring the previous one when destroyed.
class ScopedPassLog {
public:
  ScopedPassLog(PassLog& log, PassLog::Mode mode) : previous_(PassLog::current()) {
    log.begin(mode);
    PassLog::current() = &log;
  }
  ~ScopedPassLog() { PassLog::current() = previous_; }
  ScopedPassLog(const ScopedPassLog&) = delete;
  ScopedPassLog& operator=(const ScopedPassLog&) = delete;

private:
  PassLog* previous_;
};

// Runs `pass` (one calibration, every rank calls it: SPMD) `passes` times recording every measurement, then once more
// replaying each one's median, and returns that last result; `spreads`, when given, gets PassLog::spreads(). One pass:
// `pass` as it is. The calibrations of cost/calibrate.hpp and serve/paged_attention_calibration.hpp run through it.
template <class Pass>
auto median_of_passes(int passes, Pass&& pass, std::vector<double>* spreads = nullptr) {
  check(passes >= 1, "calibration: passes = {} must be at least 1", passes);
  if (passes == 1) return pass();
  PassLog log;
  for (int p = 0; p < passes; ++p) {
    const ScopedPassLog recording(log, PassLog::Mode::record);
    (void)pass();
  }
  const ScopedPassLog replaying(log, PassLog::Mode::replay);
  auto result = pass();
  check(log.replayed_all(), "calibration: the replay used fewer measurements than its passes made");
  if (spreads) *spreads = log.spreads();
  return result;
}

}  // namespace paradyse::cost
