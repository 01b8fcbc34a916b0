// bench/cost_validation.cpp: the cost models against the machine. Calibrates a profile on the thread backend
// (cost/calibrate.hpp), then runs the model's layer stack with every strategy over sequence lengths and compares:
//   - time: measured forward + backward (each rank's thread CPU time, the slowest rank; the fastest of the
//     repetitions) against the time model with the calibrated profile: error per run, MAPE and worst case per
//     strategy and overall (goal: MAPE <= 10%);
//   - memory: the tracker's peak against the ordered memory estimate (goal: within 5%) and the planner's bound.
// Thread CPU time is what a rank that owned its core would take; it keeps the numbers meaningful on a shared,
// loaded machine (wall-clock times of p thread ranks on 2 cores say more about the neighbours than about the model).
//
//   cost_validation --help    (the flags and their defaults, generated from main's statement of them)
#include "paradyse/cli/flags.hpp"
#include "paradyse/comm/threads.hpp"
#include "paradyse/core/statistics.hpp"
#include "paradyse/core/timer.hpp"
#include "paradyse/cost/calibrate.hpp"
#include "paradyse/cost/profile.hpp"
#include "paradyse/cost/stack_measurement.hpp"
#include "paradyse/cost/time_model.hpp"

#include <fmt/core.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

namespace pd = paradyse;
using Strategy = int;  // an index into pd::cost::default_catalog()

int main(int argc, char** argv) {
  int p = 4, layers = 1, reps = 2;
  std::int64_t min_seq = 512, max_seq = 32768, hidden = 128, heads = 4;
  std::string profile_path, save_path = "threads-calibrated.json";
  paradyse::cli::Flags flags(
      "cost_validation", "The time and memory models against the layer stack on thread ranks (MAPE per strategy).");
  flags.integer("--p", p, 1, 1024, "thread ranks");
  flags.integer("--min-seq", min_seq, std::int64_t(1), std::int64_t(1) << 24, "shortest sequence");
  flags.integer("--max-seq", max_seq, std::int64_t(1), std::int64_t(1) << 24, "longest sequence");
  flags.integer("--layers", layers, 1, 1000, "layers");
  flags.integer("--hidden", hidden, std::int64_t(1), std::int64_t(1) << 20, "hidden size");
  flags.integer("--heads", heads, std::int64_t(1), std::int64_t(1) << 16, "attention heads");
  flags.integer("--reps", reps, 1, 1000, "repetitions per measurement");
  flags.text("--profile", profile_path, "hardware profile to use instead of calibrating", "FILE.json");
  flags.text("--save-profile", save_path, "where the calibrated profile is saved", "FILE.json");
  flags.parse(argc, argv);

  pd::cost::HardwareProfile profile;
  if (!profile_path.empty()) {
    profile = pd::cost::load_profile(profile_path);
    fmt::print("profile: {} (loaded from {})\n", profile.name, profile_path);
  } else {
    const pd::Timer timer;
    pd::cost::Calibration calibration;
    pd::run_ranks(p, [&](pd::ThreadCommunicator& comm) {
      pd::cost::Calibration c = pd::cost::calibrate<pd::ops::Cpu>(comm);
      if (comm.rank() == 0) calibration = std::move(c);
    });
    profile = calibration.profile;
    pd::cost::save_profile(profile, save_path);
    fmt::print("calibrated {} in {:.1f} s (saved to {}): GEMM {:.1f} GFLOP/s + {:.1f} GB/s operands (fit: worst {:.1f}%, "
               "median {:.1f}%), attention {:.1f}/{:.1f} GFLOP/s fwd/bwd (worst {:.1f}%/{:.1f}%), copies {:.1f} GB/s, "
               "overlap {:.2f}\n",
               profile.name, timer.seconds(), save_path,
               profile.gemm.flops_per_s / 1e9, profile.gemm.bytes_per_s / 1e9,
               100 * calibration.gemm_fit.worst_relative_error, 100 * calibration.gemm_fit.median_relative_error,
               profile.attention.forward_flops_per_s / 1e9, profile.attention.backward_flops_per_s / 1e9,
               100 * calibration.attention_forward_fit.worst_relative_error,
               100 * calibration.attention_backward_fit.worst_relative_error, profile.elementwise_bytes_per_s / 1e9,
               profile.overlap);
  }

  pd::LayerConfig config = pd::LayerConfig::make(hidden, heads);
  fmt::print("\nlayer stack: {} layer(s) of {}, p = {} thread ranks, b = 1, float32; times: thread CPU time of the "
             "slowest rank in a second step (the pool warmed), fastest of {} run(s)\n\n",
             layers, config, p, reps);
  fmt::print("{:<11} {:>7} | {:>11} {:>11} {:>8} | {:>11} {:>11} {:>8} {:>8}\n", "strategy", "seq", "time ms",
             "model ms", "error", "peak MiB", "model MiB", "error", "bound");
  std::map<Strategy, std::vector<double>> errors;
  std::vector<double> all_errors, memory_errors;
  double worst = 0;
  std::string worst_case;
  const pd::cost::StrategyCatalog& catalog = pd::cost::default_catalog();
  for (Strategy s : catalog.all()) {
    for (std::int64_t seq = min_seq; seq <= max_seq; seq *= 2) {
      // ColossalZ keeps b h s^2/p float scores per layer: stop before they take gigabytes.
      if (catalog.name(s) == "ColossalZ" && double(heads) * double(seq) * double(seq) / p * 4 * layers > 1.5e9) break;
      pd::cost::StackMeasurement best;
      for (int r = 0; r < reps; ++r) {
        const auto m = pd::cost::measure_stack(s, config, p, 1, seq, layers, pd::cost::TimeSource::thread_cpu, 2);
        if (r == 0 || m.forward_s + m.backward_s < best.forward_s + best.backward_s) best = m;
      }
      const pd::cost::ModelShape shape = pd::cost::shape_of(config, 1, seq, 4, layers);
      const std::vector<pd::cost::LayerStrategies> plan(std::size_t(layers), {s, s});
      const double model = pd::cost::model_time(shape, p, plan, profile);
      const double measured = best.forward_s + best.backward_s;
      const double error = (model - measured) / measured;
      const std::int64_t predicted = pd::cost::predicted_activation_peak(s, config, p, 1, seq, layers);
      const std::int64_t bound = pd::cost::bounded_activation_peak(s, config, p, 1, seq, layers);
      const double memory_error = double(predicted - best.activation_peak_bytes) / double(best.activation_peak_bytes);
      errors[s].push_back(std::abs(error));
      all_errors.push_back(std::abs(error));
      memory_errors.push_back(std::abs(memory_error));
      if (std::abs(error) > worst) worst = std::abs(error), worst_case = fmt::format("{} at s = {}", catalog.name(s), seq);
      fmt::print("{:<11} {:>7} | {:>11.2f} {:>11.2f} {:>+7.1f}% | {:>11.3f} {:>11.3f} {:>+7.2f}% {:>+7.1f}%\n",
                 catalog.name(s), seq, measured * 1e3, model * 1e3, 100 * error,
                 double(best.activation_peak_bytes) / 1048576.0, double(predicted) / 1048576.0, 100 * memory_error,
                 100 * (double(bound) / double(best.activation_peak_bytes) - 1));
      std::fflush(stdout);
    }
  }
  const auto mean = [](const std::vector<double>& v) {
    double sum = 0;
    for (double x : v) sum += x;
    return v.empty() ? 0.0 : sum / double(v.size());
  };
  fmt::print("\n(time error: model / measured - 1; memory: the ordered estimate against the tracker's peak above the "
             "weights and inputs; bound: what the planner budgets, over the peak)\n\n");
  fmt::print("{:<11} {:>6} {:>12} {:>14} {:>10}\n", "strategy", "runs", "MAPE", "median APE", "worst");
  for (const auto& [s, e] : errors)
    fmt::print("{:<11} {:>6} {:>11.1f}% {:>13.1f}% {:>9.1f}%\n", catalog.name(s), e.size(), 100 * mean(e),
               100 * pd::median(e), 100 * *std::max_element(e.begin(), e.end()));
  fmt::print("{:<11} {:>6} {:>11.1f}% {:>13.1f}% {:>9.1f}%   (worst: {}; goal MAPE <= 10%)\n", "all", all_errors.size(),
             100 * mean(all_errors), 100 * pd::median(all_errors), 100 * worst, worst_case);
  fmt::print("memory: worst |error| {:.3f}% over {} runs (goal <= 5%)\n",
             100 * *std::max_element(memory_errors.begin(), memory_errors.end()), memory_errors.size());
  return 0;
}
