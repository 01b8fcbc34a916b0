// bench/strategy_bench: every strategy of the list (strategy/strategies.hpp) on one pre-norm Transformer layer over
// p thread ranks, for sequence lengths from 512 to 64K, and what the table implies.
//
//   strategy_bench                      h = 256, 8 heads, ffn 1024, p = 4; timed up to 4K, memory up to 64K
//   strategy_bench --time-max 65536     time every length (slow: attention is O(s^2))
//   strategy_bench --quick              a short run (timed up to 2K, memory up to 16K, no cap search)
//   options: --p N --h N --heads N --ffn N --reps N --time-max S --mem-max S --cap-mib M --causal --switch-seq S
//
// Table 1, per length and strategy: forward + backward of the layer (both sublayers with the strategy), as the
// busiest rank's thread CPU time (the machine has fewer cores than ranks, so wall time mostly measures the
// scheduler; CPU time counts each rank's own compute and copies) and wall time; the speedup over the same layer on
// ONE rank (no communication; the baseline, measured in this run at each timed length); the ratio to MegatronTS;
// the per-rank peak bytes (MemoryTracker: weights, inputs, saved and transient tensors, pool); bytes sent per rank.
// Lengths above --time-max are not timed: they run with the compute ops replaced by no-ops ("dry": same
// allocations, same messages, so peak memory and bytes are exact up to the ops' internal tile scratch), under the
// per-rank cap. Then: the fastest strategy at each timed length and where it changes; the longest sequence each
// strategy runs under the cap (dry runs, doubling then bisection); and the switching cost of mixing strategies in a
// 2-layer stack: time and bytes of a mixed plan minus the mean of the two uniform plans (bytes: exactly zero).
// Medians of --reps repetitions; nothing is asserted.
#include "paradyse/cli/flags.hpp"
#include "paradyse/comm/threads.hpp"
#include "paradyse/core/memory.hpp"
#include "paradyse/core/rng.hpp"
#include "paradyse/core/statistics.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/core/timer.hpp"
#include "paradyse/model/layer.hpp"
#include "paradyse/model/stack.hpp"
#include "paradyse/contract/weight_shards.hpp"
#include "paradyse/ops/backend.hpp"
#include "paradyse/strategy/strategies.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <vector>

using namespace paradyse;

namespace {

// The CPU ops with the O(s^2) and GEMM work removed: the strategies allocate, communicate and copy exactly as
// with ops::Cpu, so the tracker's peak and the bytes sent are those of a real run (less the ops' tile scratch).
struct DryCpu : ops::Cpu {
  static constexpr std::string_view name = "dry";
  static void gemm(ops::Transpose, ops::Transpose, std::int64_t, std::int64_t, std::int64_t, float, const float*,
                   std::int64_t, const float*, std::int64_t, float, float*, std::int64_t) {}
  static void matmul(TensorView<const float>, ops::Transpose, TensorView<const float>, ops::Transpose, TensorView<float>,
                     float = 1.0f, float = 0.0f) {}
  static void attention_forward(TensorView<const float>, TensorView<const float>, TensorView<const float>,
                                const ops::AttentionMask&, TensorView<float>, TensorView<float>) {}
  static void attention_backward(TensorView<const float>, TensorView<const float>, TensorView<const float>,
                                 TensorView<const float>, TensorView<const float>, TensorView<const float>,
                                 const ops::AttentionMask&, TensorView<float>, TensorView<float>, TensorView<float>) {}
};

struct Options {
  int ranks = 4;
  std::int64_t hidden = 256, heads = 8, ffn = 1024;
  int reps = 3;
  std::int64_t time_max = 4096, mem_max = 65536, switch_seq = 2048;
  std::size_t cap_mib = 1024;
  bool causal = false, quick = false, cap_search = true;
};

Options parse(int argc, char** argv) {
  Options o;
  paradyse::cli::Flags flags("strategy_bench", "Every strategy on one layer over p thread ranks: time vs 1 rank, "
                                                 "peak memory, bytes sent.");
  // First, so that flags given with it override what it sets (CLI11 applies options in the order defined here).
  flags.flag("--quick", [&o] {
    o.quick = true;
    o.time_max = 2048;
    o.mem_max = 16384;
    o.reps = 3;
    o.cap_search = false;
    o.switch_seq = 1024;
  }, "shorter sweeps: --time-max 2048 --mem-max 16384 --reps 3 --switch-seq 1024 --no-cap-search");
  flags.integer("--p", o.ranks, 1, 1024, "thread ranks");
  flags.integer("--h", o.hidden, std::int64_t(1), std::int64_t(1) << 20, "hidden size");
  flags.integer("--heads", o.heads, std::int64_t(1), std::int64_t(1) << 16, "attention heads");
  flags.integer("--ffn", o.ffn, std::int64_t(1), std::int64_t(1) << 24, "FFN width");
  flags.integer("--reps", o.reps, 1, 1000, "repetitions per measurement");
  flags.integer("--time-max", o.time_max, std::int64_t(1), std::int64_t(1) << 24, "longest sequence timed");
  flags.integer("--mem-max", o.mem_max, std::int64_t(1), std::int64_t(1) << 24, "longest sequence of the memory sweep");
  flags.integer("--cap-mib", o.cap_mib, std::size_t(1), std::size_t(1) << 30, "memory cap per rank in MiB");
  flags.flag("--causal", o.causal, "causal attention");
  flags.integer("--switch-seq", o.switch_seq, std::int64_t(1), std::int64_t(1) << 24, "sequence of the switching table");
  flags.flag("--no-cap-search", [&o] { o.cap_search = false; }, "skip the search for the memory cap");
  flags.parse(argc, argv);
  return o;
}

LayerConfig layer_config(const Options& o) {
  LayerConfig c = LayerConfig::make(o.hidden, o.heads);
  c.ffn = o.ffn;
  c.causal = o.causal;
  c.zigzag = o.causal;  // causal ring attention balances with zigzag; every strategy takes the same order
  return c;
}

struct Measurement {
  bool fits = true;          // no rank ran out of memory under the cap
  double cpu_ms = 0.0;       // median over repetitions of the busiest rank's CPU time
  double wall_ms = 0.0;      // median wall time of the step (barrier to barrier)
  std::size_t peak = 0;      // the largest per-rank peak (bytes)
  std::uint64_t sent = 0;    // the largest per-rank bytes sent in one step
};

// Runs `layers` layers with `plan` forward + backward on p ranks, `reps` times (timed: reps >= 1 after a warm-up).
template <class Backend>
Measurement run(const LayerConfig& c, int p, std::int64_t s, const StackPlan& plan, int reps, std::size_t cap) {
  using Strategies = AllStrategies<Backend>;
  Measurement m;
  const int layers = int(plan.size());
  std::vector<std::vector<double>> cpu(static_cast<std::size_t>(p));
  std::vector<double> wall;
  std::vector<std::uint64_t> sent(static_cast<std::size_t>(p), 0);
  RunOptions options;
  options.memory_cap_per_rank = cap;
  try {
    const RunReport report = run_ranks(
        p,
        [&](ThreadCommunicator& comm) {
          const int r = comm.rank();
          BufferPool pool;
          TransformerStack<Strategies, Backend> stack(c, layers, p, r, 42);
          const SequenceLayout layout(s, p, c.zigzag);
          Rng rng(std::uint64_t(7 + r));
          const Tensor<float> x = random_uniform<float>(Shape{1, layout.local_length(r), c.hidden}, rng);
          const Tensor<float> dz = random_uniform<float>(x.shape(), rng);
          Tensor<float> z(x.shape()), dx(x.shape());
          for (int rep = -1; rep < reps; ++rep) {  // rep -1: warm-up (pool, page faults)
            comm.barrier();
            comm.reset_stats();
            const double t0 = thread_cpu_seconds(), w0 = wall_seconds();
            stack.forward(comm, pool, plan, s, x.view(), z.view());
            stack.backward(comm, pool, dz.view(), dx.view());
            const double t1 = thread_cpu_seconds();
            sent[std::size_t(r)] = std::max<std::uint64_t>(sent[std::size_t(r)], comm.stats().bytes_sent);
            comm.barrier();
            if (rep >= 0) {
              cpu[std::size_t(r)].push_back(1e3 * (t1 - t0));
              if (r == 0) wall.push_back(1e3 * (wall_seconds() - w0));
            }
          }
        },
        options);
    m.peak = *std::max_element(report.peak_bytes.begin(), report.peak_bytes.end());
  } catch (const OutOfMemory&) {
    m.fits = false;
    return m;
  }
  std::vector<double> busiest;
  for (int rep = 0; rep < reps; ++rep) {
    double worst = 0.0;
    for (int r = 0; r < p; ++r) worst = std::max(worst, cpu[std::size_t(r)][std::size_t(rep)]);
    busiest.push_back(worst);
  }
  m.cpu_ms = median(busiest);
  m.wall_ms = median(wall);
  m.sent = *std::max_element(sent.begin(), sent.end());
  return m;
}

std::string length_name(std::int64_t s) {
  return s % 1024 == 0 ? fmt::format("{}K", s / 1024) : fmt::format("{}", s);
}
std::string mib(double bytes) { return fmt::format("{:.1f}", bytes / (1024.0 * 1024.0)); }

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  const LayerConfig c = layer_config(o);
  using Names = AllStrategies<ops::Cpu>;
  const std::size_t n = Names::count;
  const std::size_t cap = o.cap_mib * 1024 * 1024;
  fmt::print("strategy_bench: one layer h={} heads={} d={} ffn={} GELU LayerNorm {}, b=1, p={} thread ranks, {} of {} reps\n",
             c.hidden, c.heads, c.head_dim, c.ffn, c.causal ? "causal (zigzag)" : "non-causal", o.ranks, "median", o.reps);
  fmt::print("cpu = busiest rank's thread CPU time; speedup = the same layer on 1 rank (baseline, this run) / cpu;\n"
             "peak = largest per-rank tracker peak; sent = bytes sent per rank per step; dry = compute skipped, "
             "memory and bytes exact; cap {} MiB per rank\n\n", o.cap_mib);
  fmt::print("{:>6} {:>11} {:>10} {:>10} {:>8} {:>8} {:>10} {:>10}\n", "s", "strategy", "cpu ms", "wall ms", "speedup",
             "vs TS", "peak MiB", "sent MiB");

  std::vector<std::int64_t> lengths;
  for (std::int64_t s = 512; s <= o.mem_max; s *= 2) lengths.push_back(s);
  std::map<std::int64_t, std::vector<Measurement>> table;
  for (std::int64_t s : lengths) {
    const bool timed = s <= o.time_max;
    double baseline_ms = 0.0;
    if (timed) {
      const Measurement one = run<ops::Cpu>(c, 1, s, uniform_plan<Names>(1, "MegatronTS"), o.reps, MemoryTracker::kNoCap);
      baseline_ms = one.cpu_ms;
      fmt::print("{:>6} {:>11} {:>10.1f} {:>10.1f} {:>8} {:>8} {:>10} {:>10}\n", length_name(s), "1 rank", one.cpu_ms,
                 one.wall_ms, "1.00", "", mib(double(one.peak)), "0");
    }
    double ts_ms = 0.0;
    for (std::size_t k = 0; k < n; ++k) {
      const StackPlan plan(1, SublayerChoice{k, k});
      const Measurement m = timed ? run<ops::Cpu>(c, o.ranks, s, plan, o.reps, cap) : run<DryCpu>(c, o.ranks, s, plan, 0, cap);
      table[s].push_back(m);
      if (k == 0) ts_ms = m.cpu_ms;
      if (!m.fits) {
        fmt::print("{:>6} {:>11} {:>10} {:>10} {:>8} {:>8} {:>10} {:>10}\n", length_name(s), Names::name(k), "", "", "",
                   "", fmt::format("> {}", o.cap_mib), "OOM");
        continue;
      }
      if (timed)
        fmt::print("{:>6} {:>11} {:>10.1f} {:>10.1f} {:>8.2f} {:>8.2f} {:>10} {:>10}\n", length_name(s), Names::name(k),
                   m.cpu_ms, m.wall_ms, baseline_ms / m.cpu_ms, ts_ms > 0 ? m.cpu_ms / ts_ms : 0.0, mib(double(m.peak)),
                   mib(double(m.sent)));
      else
        fmt::print("{:>6} {:>11} {:>10} {:>10} {:>8} {:>8} {:>10} {:>10}\n", length_name(s), Names::name(k), "dry", "",
                   "", "", mib(double(m.peak)), mib(double(m.sent)));
    }
  }

  // The fastest strategy per timed length, and where it changes.
  fmt::print("\nFastest strategy by length (busiest-rank CPU time):\n");
  std::string previous;
  for (std::int64_t s : lengths) {
    if (s > o.time_max) break;
    std::size_t best = n;
    for (std::size_t k = 0; k < n; ++k)
      if (table[s][k].fits && (best == n || table[s][k].cpu_ms < table[s][best].cpu_ms)) best = k;
    if (best == n) continue;
    const std::string name(Names::name(best));
    fmt::print("  s = {:>5}: {}{}\n", length_name(s), name, !previous.empty() && previous != name ? "   <- crossover" : "");
    previous = name;
  }

  // The longest sequence under the cap, per strategy. Dry peaks at 8K, 16K and 32K fix peak(s) = a + b s + c s^2
  // (the s^2 term is ColossalZ's score block); the predicted s_max is then checked by dry runs at the cap, stepping
  // by 3% until one fits and the next does not.
  if (o.cap_search) {
    fmt::print("\nLongest sequence under a {} MiB per-rank cap (one layer, forward + backward; dry runs verify the fit):\n",
               o.cap_mib);
    std::int64_t best_s = 0;
    std::string best_name;
    for (std::size_t k = 0; k < n; ++k) {
      const StackPlan plan(1, SublayerChoice{k, k});
      auto peak_at = [&](std::int64_t s) { return run<DryCpu>(c, o.ranks, s, plan, 0, cap); };
      auto fits = [&](std::int64_t s) { return peak_at(s).fits; };
      // Three points of the fit, halving them while the largest does not fit.
      std::int64_t s1 = 8192;
      Measurement m1, m2, m3;
      for (;; s1 /= 2) {
        m1 = peak_at(s1), m2 = peak_at(2 * s1), m3 = peak_at(4 * s1);
        if ((m1.fits && m2.fits && m3.fits) || s1 <= 64) break;
      }
      const double x1 = double(s1), y1 = double(m1.peak), y2 = double(m2.peak), y3 = double(m3.peak);
      // Second differences over the points s1, 2 s1, 4 s1.
      const double d12 = (y2 - y1) / x1, d23 = (y3 - y2) / (2 * x1), curvature = std::max(0.0, (d23 - d12) / (3 * x1));
      const double slope = d12 - curvature * 3 * x1, intercept = y1 - slope * x1 - curvature * x1 * x1;
      double predicted = 0.0;
      if (curvature > 0) predicted = (-slope + std::sqrt(slope * slope + 4 * curvature * (double(cap) - intercept))) / (2 * curvature);
      else predicted = (double(cap) - intercept) / std::max(slope, 1e-9);
      const std::int64_t unit = 2 * o.ranks;
      auto round_s = [&](double s) { return std::max<std::int64_t>(unit, std::int64_t(s / double(unit)) * unit); };
      std::int64_t s = round_s(predicted * 0.97);  // the fit runs a few percent high (pool size classes)
      std::int64_t ok = 0;
      for (int step = 0; step < 12; ++step) {  // walk in 3% steps to the boundary
        if (fits(s)) {
          ok = s;
          const std::int64_t up = round_s(double(s) * 1.03);
          if (up == s || !fits(up)) break;
          ok = up;
          s = round_s(double(up) * 1.03);
        } else {
          s = round_s(double(s) / 1.03);
        }
      }
      fmt::print("  {:>11}: s_max ~ {:>8} tokens ({:>5}); the fit predicted {:.0f}\n", Names::name(k), ok,
                 length_name(ok / 1024 * 1024), predicted);
      if (ok > best_s) {
        best_s = ok;
        best_name = std::string(Names::name(k));
      }
    }
    fmt::print("  the longest: {}\n", best_name);
  }

  // Switching cost: a 2-layer stack, mixed plans against the uniform ones.
  fmt::print("\nSwitching cost, 2-layer stack at s = {} (extra = mixed - mean of the two uniform plans):\n",
             length_name(o.switch_seq));
  fmt::print("  {:>30} {:>10} {:>12} {:>14}\n", "plan (layer0 | layer1)", "cpu ms", "sent bytes", "extra");
  const std::vector<std::pair<std::string, std::string>> pairs = {{"MegatronTS", "METP"}, {"UlyssesZ", "MegatronCZ"}};
  for (const auto& [a_name, b_name] : pairs) {
    const std::size_t a = Names::index_of(a_name), b = Names::index_of(b_name);
    const Measurement aa = run<ops::Cpu>(c, o.ranks, o.switch_seq, StackPlan{{a, a}, {a, a}}, o.reps, cap);
    const Measurement bb = run<ops::Cpu>(c, o.ranks, o.switch_seq, StackPlan{{b, b}, {b, b}}, o.reps, cap);
    const Measurement ab = run<ops::Cpu>(c, o.ranks, o.switch_seq, StackPlan{{a, a}, {b, b}}, o.reps, cap);
    const Measurement sub = run<ops::Cpu>(c, o.ranks, o.switch_seq, StackPlan{{a, b}, {b, a}}, o.reps, cap);
    const double mean_ms = 0.5 * (aa.cpu_ms + bb.cpu_ms);
    const double mean_bytes = 0.5 * (double(aa.sent) + double(bb.sent));
    auto line = [&](const std::string& plan, const Measurement& m, bool mixed) {
      fmt::print("  {:>30} {:>10.1f} {:>12} {:>14}\n", plan, m.cpu_ms, m.sent,
                 mixed ? fmt::format("{:+.1f} ms, {:+.0f} B", m.cpu_ms - mean_ms, double(m.sent) - mean_bytes) : "");
    };
    line(fmt::format("{0}x2 | {0}x2", a_name), aa, false);
    line(fmt::format("{0}x2 | {0}x2", b_name), bb, false);
    line(fmt::format("{}x2 | {}x2", a_name, b_name), ab, true);
    line(fmt::format("{},{} | {},{}", a_name, b_name, b_name, a_name), sub, true);
  }
  return 0;
}
