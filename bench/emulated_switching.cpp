// bench/emulated_switching: the planner's plan against every static strategy, measured on an emulated device node.
//
// On this CPU communication is a memcpy and every strategy costs about the same. Here the thread communicator
// paces every transfer at the device's link latency and bandwidth, slowed by the ratio of the device's GEMM rate to
// this machine's calibrated one (cost/emulation.hpp), so an 8x A100 NVLink node's balance of compute and
// communication is reproduced. For inputs of several lengths drawn from the bundled length distribution
// (data/lengths/paradyse_table3.csv, GitHubCode by default, scaled down by --scale to CPU-sized sequences), it runs
// one training step (forward + backward) of the GPT layer stack (model/gpt.hpp, as examples/train_gpt.cpp does) with
// the exact planner's plan and with every strategy used everywhere, and prints each one's measured step time (median
// of --reps, wall clock, the slowest rank) next to the cost model's prediction for the emulated node.
//
//   emulated_switching --help    (the flags and their defaults, generated from parse())
//
// --profile: this machine's calibrated profile (else a quick wall-clock calibration at the start). --cap-mib: the
// memory budget per rank (the planner plans within it; a static strategy whose predicted peak is above it is
// reported as not fitting and not run); default: no cap.
#include "paradyse/cli/flags.hpp"
#include "paradyse/cli/model_flags.hpp"
#include "paradyse/comm/threads.hpp"
#include "paradyse/cost/builtin_profiles.hpp"
#include "paradyse/cost/calibrate.hpp"
#include "paradyse/core/rng.hpp"
#include "paradyse/core/statistics.hpp"
#include "paradyse/core/timer.hpp"
#include "paradyse/cost/emulation.hpp"
#include "paradyse/model/gpt.hpp"
#include "paradyse/plan/gpt_costs.hpp"
#include "paradyse/plan/planner.hpp"
#include "paradyse/plan/stack_plan.hpp"
#include "paradyse/strategy/strategies.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace pd = paradyse;
using Strategies = pd::AllStrategies<>;
using Model = pd::Gpt<Strategies>;

namespace {

struct Options {
  std::string device = "a100", dataset = "githubcode", profile;
  int ranks = 2, layers = 2, count = 5, reps = 3;
  std::int64_t hidden = 128, heads = 4, scale = 64;
  std::uint64_t seed = 7;
  double cap_mib = 0;
};

Options parse(int argc, char** argv) {
  Options o;
  pd::cli::Flags flags("emulated_switching",
                         "The planner's plan against every static strategy, one training step each, on thread ranks "
                         "whose transfers are paced like the device node's links (scaled by the ratio of the device's "
                         "GEMM rate to this machine's).");
  flags.text("--device", o.device, "the emulated node (a built-in hardware profile)", "a100|h100|h200");
  flags.integer("--ranks", o.ranks, 1, 1024, "thread ranks");
  flags.integer("--layers", o.layers, 1, 100'000, "layers");
  flags.integer("--hidden", o.hidden, std::int64_t(8), std::int64_t(1) << 20, "hidden size");
  flags.integer("--heads", o.heads, std::int64_t(1), std::int64_t(1) << 16, "attention heads");
  flags.text("--dataset", o.dataset, "length distribution of the paper's Table 3", "githubcode|grch38");
  flags.integer("--count", o.count, 1, 1'000'000, "sequences (steps)");
  flags.integer("--scale", o.scale, std::int64_t(1), std::int64_t(1) << 30, "divides the dataset's lengths");
  flags.integer("--seed", o.seed, std::uint64_t(0), std::numeric_limits<std::uint64_t>::max(), "sampling seed");
  flags.integer("--reps", o.reps, 1, 1000, "repetitions per step (the median is printed)");
  flags.number("--cap-mib", o.cap_mib, {.min = 1, .max = double(std::int64_t(1) << 40)},
               "memory cap per rank in MiB (default: none)")
      .without_default();
  flags.text("--profile", o.profile, "this machine's calibrated profile (default: calibrate)", "FILE.json");
  flags.parse(argc, argv);
  try {  // the head dimension is --hidden / --heads, never truncated (it was: 4097 / 32 ran as 128)
    pd::cli::head_dim_of(o.hidden, o.heads);
  } catch (const std::invalid_argument& e) {
    flags.fail(e.what());
  }
  return o;
}

// `count` lengths drawn from the dataset's bucket shares (uniform within a bucket), divided by `scale`, rounded up
// to a multiple of `multiple`; sorted.
std::vector<std::int64_t> draw_lengths(const Options& o, std::int64_t multiple) {
  // The repository's copy: from the working directory, or above the executable (build/bench/).
  std::ifstream file;
  std::error_code ignored;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ignored).parent_path();
  for (const std::filesystem::path& root : {std::filesystem::path("."), exe.parent_path().parent_path(), exe.parent_path()}) {
    file.open(root / "data/lengths/paradyse_table3.csv");
    if (file) break;
  }
  pd::check(bool(file), "cannot find data/lengths/paradyse_table3.csv (run from the repository or its build folder)");
  struct Bucket {
    double lo, hi, prob;
  };
  std::vector<Bucket> buckets;
  for (std::string line; std::getline(file, line);) {
    if (line.empty() || line[0] == '#' || line.rfind("dataset", 0) == 0) continue;
    std::stringstream fields(line);
    std::string name, lo, hi, prob;
    std::getline(fields, name, ',');
    std::getline(fields, lo, ',');
    std::getline(fields, hi, ',');
    std::getline(fields, prob, ',');
    if (name == o.dataset) buckets.push_back({std::stod(lo), std::stod(hi), std::stod(prob)});
  }
  pd::check(!buckets.empty(), "--dataset {}: not in the length distribution (githubcode, grch38)", o.dataset);
  pd::Rng rng(o.seed);
  std::vector<std::int64_t> lengths;
  for (int i = 0; i < o.count; ++i) {
    double u = rng.uniform(0.0, 1.0), total = 0;
    for (const Bucket& b : buckets) total += b.prob;
    u *= total;
    const Bucket* pick = &buckets.back();
    for (const Bucket& b : buckets) {
      if (u < b.prob) {
        pick = &b;
        break;
      }
      u -= b.prob;
    }
    const double tokens = rng.uniform(pick->lo, pick->hi) / double(o.scale);
    lengths.push_back(std::max<std::int64_t>(multiple, (std::int64_t(std::ceil(tokens)) + multiple - 1) / multiple * multiple));
  }
  std::sort(lengths.begin(), lengths.end());
  return lengths;
}

// Median wall seconds of one training step (forward + backward) with `plan`, the slowest rank's; nullopt when a
// rank ran out of memory under the cap.
std::optional<double> measure_step(const pd::GptConfig& config, const Options& o, const pd::plan::Plan& plan,
                                   std::int64_t s, const pd::LinkPacing& pacing, std::size_t cap) {
  const pd::StackPlan stack_plan = pd::plan::stack_plan<Strategies>(plan);
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(s)), targets(static_cast<std::size_t>(s));
  for (std::int64_t i = 0; i < s; ++i) {
    tokens[std::size_t(i)] = std::int32_t((i * 31 + 7) % config.vocab);
    targets[std::size_t(i)] = std::int32_t((i * 31 + 38) % config.vocab);
  }
  pd::RunOptions options;
  options.pacing = pacing;
  options.memory_cap_per_rank = cap;
  std::vector<double> times;
  try {
    pd::run_ranks(o.ranks, [&](pd::ThreadCommunicator& comm) {
      Model model(config, o.ranks, comm.rank(), 1234);
      pd::BufferPool pool;
      const pd::SequenceLayout layout(s, o.ranks, config.layer.zigzag);
      const pd::Tensor<std::int32_t> x = pd::shard_tokens(tokens, 1, layout, comm.rank());
      const pd::Tensor<std::int32_t> y = pd::shard_tokens(targets, 1, layout, comm.rank());
      for (int r = 0; r <= o.reps; ++r) {  // the first run warms up
        model.zero_gradients();
        pool.trim();
        comm.barrier();
        const pd::Timer timer;
        (void)model.forward_backward(comm, pool, stack_plan, s, x.view(), y.view());
        double seconds = timer.seconds(), slowest = 0;
        comm.all_reduce(std::span<const double>(&seconds, 1), std::span<double>(&slowest, 1), pd::ReduceOp::max);
        if (r > 0 && comm.rank() == 0) times.push_back(slowest);
      }
    }, options);
  } catch (const pd::OutOfMemory&) {
    return std::nullopt;
  }
  return pd::median(std::move(times));
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Options o = parse(argc, argv);
    const pd::cost::HardwareProfile device = pd::cost::builtin_profile(o.device);
    pd::GptConfig config;
    config.layer = pd::LayerConfig::make(o.hidden, o.heads);
    config.layer.causal = true;
    config.layer.zigzag = true;
    config.layer.rope = true;
    config.layers = o.layers;
    config.vocab = 256;
    config.validate();

    // This machine: a calibrated profile (given, or measured now on the same ranks, in wall-clock time).
    pd::cost::HardwareProfile machine;
    if (!o.profile.empty()) {
      machine = pd::cost::load_profile(o.profile);
      pd::cost::use_gemm_engines(machine);
    } else {
      pd::cost::CalibrationOptions options;
      options.clock = pd::cost::TimeSource::wall;
      options.repetitions = 3;
      options.attention_heads = o.heads;
      options.head_dim = o.hidden / o.heads;  // whole: checked in parse
      const pd::Timer timer;
      pd::run_ranks(o.ranks, [&](pd::ThreadCommunicator& comm) {
        pd::cost::Calibration c = pd::cost::calibrate<pd::ops::Cpu>(comm, options);
        if (comm.rank() == 0) machine = c.profile;
      });
      fmt::print("# calibrated {} ranks in {:.1f} s (wall clock)\n", o.ranks,
                 timer.seconds());
    }
    const pd::cost::Emulation emulation = pd::cost::emulate(device, machine);
    const pd::plan::GptCosts<Model> costs{config, o.ranks, &emulation.profile};
    const std::int64_t cap = o.cap_mib > 0 ? std::int64_t(o.cap_mib * 1024 * 1024) : std::numeric_limits<std::int64_t>::max() / 4;
    const std::vector<std::int64_t> lengths = draw_lengths(o, 2 * o.ranks);

    fmt::print("# emulated node: {} ranks with {}'s links; this machine's GEMM rate {:.1f} GFLOP/s against the "
               "device's {:.0f} TFLOP/s: slowdown {:.0f}x\n",
               o.ranks, device.name, machine.gemm_peak_flops_per_s() / 1e9, device.gemm.flops_per_s / 1e12,
               emulation.slowdown);
    fmt::print("# pacing: launch {:.3g} s, {:.3g} s per step, collectives {:.3g} MB/s bus, point to point {:.3g} MB/s\n",
               emulation.pacing.launch_s, emulation.pacing.alpha_s, 1e-6 / emulation.pacing.collective_s_per_byte,
               1e-6 / emulation.pacing.p2p_s_per_byte);
    fmt::print("# model: GPT, {} layers, h={}, {} heads, causal, zigzag, RoPE; lengths from {} / {} (seed {}): ", o.layers,
               o.hidden, o.heads, o.dataset, o.scale, o.seed);
    for (std::int64_t s : lengths) fmt::print("{} ", s);
    fmt::print("\n# cap per rank: {}\n", o.cap_mib > 0 ? fmt::format("{:.0f} MiB", o.cap_mib) : std::string("none"));
    fmt::print("# time: median of {} steps (forward + backward, wall clock, slowest rank), ms; pred: the cost model's "
               "time for the emulated node; '-': predicted over the cap; 'oom': ran out of memory\n", o.reps);

    const pd::plan::CostTable first = costs.table(lengths.front());
    const int strategies = first.strategy_count();
    std::string header = fmt::format("{:>7}", "len");
    for (int k = 0; k < strategies; ++k) header += fmt::format(" {:>11}", first.strategy_name(k));
    header += fmt::format(" {:>11} {:>11} {:>11}  {}", "planner", "pred", "best static", "planner's plan");
    fmt::print("{}\n", header);

    std::vector<double> static_total(static_cast<std::size_t>(strategies), 0.0);
    std::vector<int> static_steps(static_cast<std::size_t>(strategies), 0);
    double planner_total = 0, planner_total_where_best_ran = 0, best_total = 0;
    int planner_steps = 0, planner_not_slower = 0, compared = 0;
    for (const std::int64_t s : lengths) {
      const pd::plan::CostTable table = costs.table(s);
      std::string line = fmt::format("{:>7}", s);
      std::optional<double> best;
      std::vector<std::optional<double>> measured(static_cast<std::size_t>(strategies));
      for (int k = 0; k < strategies; ++k) {
        std::optional<pd::plan::Plan> plan;
        try {
          plan = pd::plan::plan_of(table, pd::plan::uniform_layers(table, k), cap);
        } catch (const pd::Error&) {
        }
        if (!plan || !plan->fits() || !std::isfinite(plan->time_s)) {
          line += fmt::format(" {:>11}", "-");
          continue;
        }
        measured[std::size_t(k)] = measure_step(config, o, *plan, s, emulation.pacing, std::size_t(cap));
        if (!measured[std::size_t(k)]) {
          line += fmt::format(" {:>11}", "oom");
          continue;
        }
        const double t = *measured[std::size_t(k)];
        line += fmt::format(" {:>11.1f}", t * 1e3);
        static_total[std::size_t(k)] += t;
        ++static_steps[std::size_t(k)];
        if (!best || t < *best) best = t;
      }
      std::optional<pd::plan::Plan> planned;
      try {
        planned = pd::plan::plan_exact(table, cap);
      } catch (const pd::plan::NoFeasiblePlan&) {
      }
      if (!planned) {
        fmt::print("{} {:>11}\n", line, "no plan");
        continue;
      }
      const std::optional<double> mine = measure_step(config, o, *planned, s, emulation.pacing, std::size_t(cap));
      line += mine ? fmt::format(" {:>11.1f}", *mine * 1e3) : fmt::format(" {:>11}", "oom");
      line += fmt::format(" {:>11.1f} {:>11.1f}  {}", planned->time_s * 1e3, best ? *best * 1e3 : 0.0, planned->summary());
      fmt::print("{}\n", line);
      std::fflush(stdout);
      if (mine) {
        planner_total += *mine;
        ++planner_steps;
        if (best) {
          ++compared;
          planner_total_where_best_ran += *mine;
          best_total += *best;
          if (*mine <= *best * 1.02) ++planner_not_slower;  // within 2%: the timing noise of this shared machine
        }
      }
    }
    fmt::print("\n# whole run: total measured seconds over the steps each could run\n");
    for (int k = 0; k < strategies; ++k)
      fmt::print("  {:<12} {:>9.3f} s over {} of {} steps\n", first.strategy_name(k), static_total[std::size_t(k)],
                 static_steps[std::size_t(k)], lengths.size());
    fmt::print("  {:<12} {:>9.3f} s over {} of {} steps\n", "planner", planner_total, planner_steps, lengths.size());
    fmt::print("  per step, the planner against the best static strategy of that step: not slower (within 2%) on {} "
               "of {} steps; {:.3f} s against {:.3f} s in total ({:+.1f}%)\n",
               planner_not_slower, compared, planner_total_where_best_ran, best_total,
               best_total > 0 ? 100 * (planner_total_where_best_ran / best_total - 1) : 0.0);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "emulated_switching: %s\n", e.what());
    return 1;
  }
}
