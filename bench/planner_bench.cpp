// bench/planner_bench.cpp: how long planning takes for a 96-layer, 5-strategy, 2-sublayer problem.
//
// GPT-3 175B layers (h = 12288, 96 heads) on 8x A100-80GB, with memory budgets placed between the least-memory plan
// (fraction 0) and the fastest plan (fraction 1), where the solver has the most to decide. Measured per call, median
// of repetitions: the exact solver alone (the 20 us goal), the whole exact planner (problem and plan assembly), the
// cost table (the cost models), ParaDySe's heuristic on the same table (the baseline: ratio = exact / heuristic), and
// a cache hit. A new length is timed twice: with the cost table's dry runs on the job pool (plan/job_pool.hpp: the
// caller and hardware threads - 1 workers) and on one thread (JobPool::Serial). Then where a new length's time goes (each strategy's dry run and cost walk;
// sublayers declared shared are run once by the table), and a stress run over
// random problems of the same size. Benchmarks print; they never fail.
#include "paradyse/cli/flags.hpp"
#include "paradyse/core/rng.hpp"
#include "paradyse/core/statistics.hpp"
#include "paradyse/core/timer.hpp"
#include "paradyse/cost/builtin_profiles.hpp"
#include "paradyse/plan/cache.hpp"
#include "paradyse/plan/exact_solver.hpp"
#include "paradyse/plan/heuristic.hpp"
#include "paradyse/plan/job_pool.hpp"
#include "paradyse/plan/planner.hpp"

#include <fmt/core.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

using namespace paradyse;
using namespace paradyse::plan;

namespace {

volatile double sink = 0;

// Median over `reps` batches of the per-call microseconds of `fn`, each batch `calls` calls long.
template <class Fn>
double median_us(Fn&& fn, int calls, int reps = 9) {
  std::vector<double> samples;
  for (int r = 0; r < reps; ++r) {
    const Timer timer;
    for (int c = 0; c < calls; ++c) sink = sink + fn();
    samples.push_back(1e6 * timer.seconds() / calls);
  }
  return median(std::move(samples));
}

cost::ModelShape gpt3_layer() { return cost::ModelShape::mha(12288, 96); }  // bf16 (the default dtype)

}  // namespace

int main(int argc, char** argv) {
  int layers = 96;
  paradyse::cli::Flags flags("planner_bench", "Planning time for a GPT of LAYERS layers x 5 strategies x 2 "
                                                "sublayers: a new length, a cached one, the solve.");
  flags.integer("LAYERS", layers, 1, 100000, "layers of the model");
  flags.parse(argc, argv);
  const cost::HardwareProfile hw = cost::a100_sxm4_80gb_x8();
  const ModelConfig model = ModelConfig::uniform(gpt3_layer(), layers);
  const int p = 8;

  fmt::print("planner_bench: {} layers x 5 strategies x 2 sublayers, GPT h=12288 on {}, p = {}\n", layers, hw.name, p);
  fmt::print("times are per call, median of 9 repetitions; goals: a new length (table from dry runs + exact solve, "
             "'new us') <= 200 us, a cached length ('hit us') <= 5 us\n");
  fmt::print("the dry runs run on the job pool: this thread and {} worker(s); 'new 1t us': the same on this thread "
             "alone\n\n", JobPool::shared().workers());
  fmt::print("{:>8} {:>6} | {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>9} | {:>8} | {:>9} {:>9} | {}\n", "seq", "budget",
             "solve us", "plan us", "table us", "new us", "new 1t us", "heur us", "hit us", "exact/h", "t exact", "t heur",
             "exact plan");
  for (std::int64_t s : {4096, 32768, 131072, 262144}) {
    const CostTable table = build_cost_table(model, hw, p, Batch::single(s));
    const std::int64_t least = least_memory_plan(table, 0).peak_bytes();
    const std::int64_t fastest = plan_exact(table, std::int64_t(1) << 55).peak_bytes();
    for (double fraction : {0.0, 0.25, 0.5, 0.75, 1.0}) {
      const std::int64_t budget = least + std::int64_t(double(fastest - least) * fraction);
      const Problem problem = problem_of(table, budget);
      const double solve = median_us([&] { return solve_exact(problem)->time_s; }, 200);
      const double whole = median_us([&] { return plan_exact(table, budget).time_s; }, 100);
      const double build = median_us([&] { return double(build_cost_table(model, hw, p, Batch::single(s)).fixed_bytes); }, 50);
      // A length never seen: the cost table from ten dry runs, then the exact solve.
      const double fresh = median_us([&] { return plan_exact(build_cost_table(model, hw, p, Batch::single(s)), budget).time_s; }, 50);
      double fresh_one_thread = 0;
      {
        const JobPool::Serial one_thread(JobPool::shared());
        fresh_one_thread =
            median_us([&] { return plan_exact(build_cost_table(model, hw, p, Batch::single(s)), budget).time_s; }, 50);
      }
      const double heuristic = median_us([&] { return plan_heuristic(table, budget).time_s; }, 50);
      PlanCache cache(model, hw, p, budget);
      cache.plan_for(Batch::single(s));
      const double hit = median_us([&] { return cache.plan_for(Batch::single(s)).time_s; }, 200);
      const Plan exact = plan_exact(table, budget);
      const Plan heur = plan_heuristic(table, budget);
      fmt::print("{:>8} {:>6.2f} | {:>10.2f} {:>10.2f} {:>10.2f} {:>10.2f} {:>10.2f} {:>10.2f} {:>9.2f} | {:>8.2f} | {:>9.2f} {:>9.2f}{} | {}\n", s,
                 fraction, solve, whole, build, fresh, fresh_one_thread, heuristic, hit, whole / heuristic, exact.time_s, heur.time_s,
                 heur.fits() ? " " : "*", exact.summary());
    }
  }
  fmt::print("(budget: fraction of the way from the least-memory plan's peak to the fastest plan's; t: predicted step "
             "seconds; * = the heuristic found nothing that fits)\n\n");

  // Where a new length's time goes: each strategy's dry run per sublayer (its own code on meta tensors, the counting
  // backend and the symbolic communicator) and the cost walk over its trace (memory replay and two-stream clock).
  {
    const std::int64_t s = 32768;
    const cost::StrategyCatalog& catalog = cost::default_catalog();
    const cost::ModelShape shape = shape_for_batch(model.kinds[0].shape, Batch::single(s));
    fmt::print("one new length (s = {}), per strategy and sublayer: trace events, dry-run us, cost-walk us\n", s);
    fmt::print("{:>12} {:>10} | {:>7} {:>7} {:>7} | {:>9} {:>9}\n", "strategy", "sublayer", "forward", "backward",
               "release", "dry us", "walk us");
    double dry_total = 0, walk_total = 0, shared_total = 0;
    for (int st = 0; st < catalog.count(); ++st)
      for (cost::Sublayer part : cost::kAllSublayers) {
        // A sublayer declared shared with a lower index (StrategyCatalog::shared_sublayer) is not run by the table.
        int shares = -1;
        for (int t = 0; t < st && shares < 0; ++t)
          if (!catalog.shared_sublayer(st, part).empty() && catalog.shared_sublayer(t, part) == catalog.shared_sublayer(st, part))
            shares = t;
        const cost::SublayerTrace trace = catalog.trace(st, part, shape, p);
        const double dry = median_us([&] {
          double events = 0;
          catalog.visit_trace(st, part, shape, p, 0, [&](const cost::SublayerTraceView& v) { events = double(v.forward.size()); });
          return events;
        }, 20);
        const double walk = median_us([&] { return cost::cost_of(trace, &hw, shape.dtype_bytes, false).time_s(); }, 50);
        dry_total += dry;
        walk_total += walk;
        if (shares >= 0) shared_total += dry + walk;
        fmt::print("{:>12} {:>10} | {:>7} {:>7} {:>7} | {:>9.2f} {:>9.2f}{}\n", catalog.name(st), cost::name_of(part),
                   trace.forward.size(), trace.backward.size(), trace.release.size(), dry, walk,
                   shares >= 0 ? fmt::format("  (the table copies {}'s)", catalog.name(shares)) : std::string());
      }
    fmt::print("{:>12} {:>10} | {:>23} | {:>9.2f} {:>9.2f}\n", "all", "", "", dry_total, walk_total);
    fmt::print("{:>12} {:>10} | {:>23} | {:>19.2f}\n\n", "table runs", "", "dry + walk", dry_total + walk_total - shared_total);
  }

  // Stress: random problems of the same size (2 groups of `layers` slots, 5 options each, budgets anywhere).
  Rng rng(2026);
  std::vector<double> times;
  int feasible = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    Problem problem;
    for (int g = 0; g < 2; ++g) {
      SlotGroup group{g == 0 ? "attention" : "mlp", layers, {}};
      for (int st = 0; st < 5; ++st)
        group.options.push_back({st, rng.uniform(1, 10), std::int64_t(rng.below(1u << 30)), std::int64_t(rng.below(1u << 30))});
      problem.groups.push_back(group);
    }
    const Assignment least = least_memory(problem);
    problem.budget_bytes = least.peak_bytes() + std::int64_t(rng.below(std::uint64_t(layers) << 30));
    // Each problem timed three times, the fastest kept: the machine is shared, and one preemption is not the solver.
    double fastest = 1e300;
    bool found = false;
    for (int repeat = 0; repeat < 3; ++repeat) {
      const Timer timer;
      found = solve_exact(problem).has_value();
      fastest = std::min(fastest, 1e6 * timer.seconds());
    }
    times.push_back(fastest);
    feasible += found;
  }
  std::sort(times.begin(), times.end());
  fmt::print("random problems ({} of them, {} feasible; each the fastest of 3 runs): exact solve median {:.2f} us, p90 {:.2f} us, p99 {:.2f} us, "
             "max {:.2f} us\n",
             times.size(), feasible, median(times), times[times.size() * 9 / 10],
             times[times.size() * 99 / 100], times.back());
  return 0;
}
