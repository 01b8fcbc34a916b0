// paradyse/serve/clock.hpp: the clock the serving engine (serve/engine.hpp) runs on. Nothing but the clock differs
// between the modes: the engine admits, batches, accounts KV blocks, decides layouts and samples alike; the clock
// says what time it is (arrivals are admitted when their time has come; outcomes are stamped with it) and how long
// a step and its exposed layout change took.
//   StepClock: time counts engine steps (a request arriving at 3 joins at step 3), steps measured on the wall clock.
//   WallClock: wall seconds since start() (core/timer.hpp); waiting for an arrival sleeps (up to 50 ms).
//   CpuClock: seconds of thread CPU time: each step advances it by the CPU time the rank's thread ran in the step
//     (what the step takes on a core of its own: waiting for a core, or for the other ranks, does not count), or,
//     given `slowest` (a reduction over the ranks, every rank's CpuClock calling it at each step's end), by the
//     slowest rank's: the step as it takes when every rank has a core of its own, as SimulatedClock prices it (the
//     slowest modelled rank; rank 0's alone misses the others' longer expert work under EP's imbalance); with nothing
//     to run it jumps to the next arrival. A measured run that other processes on the cores do not slow down, the
//     measured counterpart of SimulatedClock on a shared machine; synchronised (its ranks' communicators marking
//     their collectives, comm/cpu_marks.hpp), by the pieces between the collectives, each at its slowest rank
//     (moe_simulate --measure).
//   SimulatedClock: seconds of a cluster: each step advances it by the time model's cost of the dry run of the step
//     (serve/step_dry_run.hpp: decoder_step on shapes alone, per modelled rank, on the step's batch, layouts and
//     expert loads; DeepSeek's latent attention too, serve/mla_attention.hpp); with nothing to run it
//     jumps to the next arrival; the engine's host work (its bookkeeping per step and chunk, the dynamic policy's
//     forecast: StepTrace::planning_events, at the profile's calibrated rates) is charged with the step; with the
//     profile's step_jitter each step's price is multiplied by a factor drawn for it (seeded, so a run is the same
//     every time; price() is without it); set_slowdown multiplies every price by the machine's slowdown at the
//     moment of a measured run against its calibrated profile (StepSlowdown: one factor for the steps with a prompt
//     chunk, one for those of decode tokens alone; serve/speed_probe.hpp reads one for both, serve/step_probe.hpp
//     each). Deterministic: the same trace sequence gives the same times to the bit. It totals the breakdown
//     (compute, exposed communication, switch, host). It prices a step without advancing (price). On a profile with
//     GEMM tables at several reuse distances (cost::GemmModel::reuse) it keeps, per modelled rank, the weights read so
//     far (cost/gemm_reuse.hpp WeightReads) and prices each GEMM at its weight's distance: a decode step amid decode
//     steps reads its weights back sooner than one after a prompt chunk that routed to every expert. The dynamic
//     policy's switcher forecasts with the same dry run on its time model (serve/engine.hpp), so it ranks TP and EP by
//     the cost the clock charges (forecasting with step_cost while the clock ran the dry run, Mixtral-8x7B at 64
//     requests/s on 8x H100 stayed in TP through 366 steps of 512 tokens: TTFT p50 0.60x of static EP's).
// Every clock calls `observer`, when set, after each step with the step's trace, its timing and the time it ended
// (recording the routing, or the layout over time).
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/core/rng.hpp"
#include "paradyse/core/timer.hpp"
#include "paradyse/serve/step_cost.hpp"
#include "paradyse/serve/step_dry_run.hpp"
#include "paradyse/serve/step_trace.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <functional>
#include <limits>
#include <memory>
#include <span>
#include <string_view>
#include <thread>
#include <vector>

namespace paradyse::serve {

// How much slower than its profile the machine runs the engine's steps, by the step's kind: each price is multiplied
// by its kind's factor. Two kinds because they need not move together: on the shared 2-core machine of
// docs/serving_simulation.md the steps with a prompt chunk ran 3-13% further over their price than the decode steps
// under static EP in every round of two runs (one of each model), and one factor for all steps, time-weighted,
// follows the decode steps (four fifths of the time).
struct StepSlowdown {
  double decode = 1;  // steps of decode tokens alone
  double prompt = 1;  // steps with a prompt chunk
  static StepSlowdown uniform(double s) { return {s, s}; }
  double of(const StepTrace& t) const { return t.has_prompt() ? prompt : decode; }
};

struct StepTiming {
  double step_s = 0;            // the step, planning to sampled tokens
  double switch_exposed_s = 0;  // of which the layout change on the critical path
  double cpu_s = 0;             // wall and step clocks: CPU seconds this rank's thread ran in the step (the rest of
                                // step_s it waited: for other ranks, or for a core)
  // The synchronised CPU clock (else empty): each piece between the ranks' collectives at its slowest rank (step_s is
  // their sum), and the slowest rank's own CPU time in the step (its pieces summed). step_s - slowest_cpu_s is what
  // the ranks lost to waiting for one another piece by piece beyond the slowest rank's own work.
  std::vector<double> pieces = {};
  double slowest_cpu_s = 0;
  // Of those, pieces[kernels_begin, kernels_end) lay within every rank's stepper run (EngineClock::stepper_ran; all
  // of them where none was told): the ranks' kernels alone, without the host work around the run (planning on rank 0,
  // sampling), and slowest_kernels_cpu_s the slowest rank's own CPU time over them.
  std::size_t kernels_begin = 0, kernels_end = 0;
  double slowest_kernels_cpu_s = 0;
};

class EngineClock {
public:
  virtual ~EngineClock() = default;
  virtual std::string_view name() const = 0;
  // The run begins: time 0.
  virtual void start() = 0;
  // Now, in the clock's unit (steps or seconds).
  virtual double now() const = 0;
  // Seconds the run has taken so far.
  virtual double elapsed_s() const = 0;
  // Rank 0 has nothing to run before `arrival` (called while planning).
  virtual void wait_for(double /*arrival*/) {}
  // A step found no work; the earliest arrival still to come is `next_arrival`.
  virtual void idle(double next_arrival) = 0;
  // The engine counts the idle step in its statistics (the step clock's time is the step count).
  virtual bool counts_idle_steps() const { return false; }
  virtual void step_begin() { wall_step_.restart(), cpu_begin_ = thread_cpu_seconds(); }
  // This rank's stepper computed the step between these thread CPU times (thread_cpu_seconds); the rest of the step
  // was host work. Only the synchronised CPU clock reads it (StepTiming::kernels_begin).
  virtual void stepper_ran(double /*cpu_begin*/, double /*cpu_end*/) {}
  // The step described by `trace` ended; `measured_switch_s`: the wall time its layout change took on the critical
  // path.
  StepTiming step_end(const StepTrace& trace, double measured_switch_s) {
    StepTiming t = advance(trace, measured_switch_s);  // not const: returned without a copy of its pieces
    if (observer) observer(trace, t, now());
    return t;
  }

  std::function<void(const StepTrace&, const StepTiming&, double end)> observer;

protected:
  virtual StepTiming advance(const StepTrace& trace, double measured_switch_s) = 0;
  double wall_step_s() const { return wall_step_.seconds(); }
  double cpu_step_s() const { return thread_cpu_seconds() - cpu_begin_; }
  Timer wall_step_;
  double cpu_begin_ = 0;
};

class StepClock final : public EngineClock {
public:
  std::string_view name() const override { return "steps"; }
  void start() override { steps_ = 0, wall_.restart(); }
  double now() const override { return double(steps_); }
  double elapsed_s() const override { return wall_.seconds(); }
  void idle(double) override { ++steps_; }
  bool counts_idle_steps() const override { return true; }

private:
  StepTiming advance(const StepTrace&, double measured_switch_s) override {
    ++steps_;
    return {wall_step_s(), measured_switch_s, cpu_step_s()};
  }
  std::int64_t steps_ = 0;
  Timer wall_;
};

class WallClock final : public EngineClock {
public:
  std::string_view name() const override { return "wall"; }
  void start() override { wall_.restart(); }
  double now() const override { return elapsed_s(); }
  double elapsed_s() const override { return wall_.seconds(); }
  void wait_for(double arrival) override {
    const double wait = arrival - now();
    if (wait > 0) std::this_thread::sleep_for(std::chrono::duration<double>(std::min(wait, 0.05)));
  }
  void idle(double) override {}

private:
  StepTiming advance(const StepTrace&, double measured_switch_s) override {
    return {wall_step_s(), measured_switch_s, cpu_step_s()};
  }
  Timer wall_;
};

class CpuClock final : public EngineClock {
public:
  // `slowest`: this rank's CPU time in the step to the slowest rank's, e.g. [&comm](double t) { return
  // max_over_ranks(comm, t); } (comm/communicator.hpp); empty: this rank's own.
  explicit CpuClock(std::function<double(double)> slowest = {}) : slowest_(std::move(slowest)) {}
  // Synchronised: the step cut where the ranks met (`marks`: this rank's thread CPU time as each of its blocking
  // collectives returned since the last call, comm/cpu_marks.hpp's take_marks), each piece taken at its slowest rank
  // (`max_over_ranks`: an element-wise max all-reduce over the ranks, in place, on a communicator that does not mark)
  // and the pieces summed: the step as ranks with cores of their own take it, waiting for one another at every
  // collective, as the simulated clock prices it piece by piece. (The slowest rank's total alone is short of it where
  // the slowest rank differs from piece to piece.) Every rank's step must meet the same number of collectives.
  struct Synchronised {
    std::function<std::vector<double>()> marks;
    std::function<void(std::span<double>)> max_over_ranks;
  };
  explicit CpuClock(Synchronised s) : synchronised_(std::move(s)) {
    check(bool(synchronised_.marks) && bool(synchronised_.max_over_ranks),
          "CpuClock: a synchronised clock needs both the marks and the max over the ranks");
  }
  // Synchronised on a communicator that marks its collectives (comm/cpu_marks.hpp's CpuMarkedCommunicator: its
  // take_marks(), and max_over_ranks on its unmarked() self). `comm` must outlive the clock.
  template <class Marked>
  static Synchronised synchronised_by(Marked& comm) {
    return {[&comm] { return comm.take_marks(); }, [&comm](std::span<double> x) { max_over_ranks(comm.unmarked(), x); }};
  }
  std::string_view name() const override { return "cpu"; }
  void start() override { now_ = 0; }
  double now() const override { return now_; }
  double elapsed_s() const override { return now_; }
  void idle(double next_arrival) override {
    if (std::isfinite(next_arrival)) now_ = std::max(now_, next_arrival);
  }

  void step_begin() override {
    if (synchronised_.marks) (void)synchronised_.marks();  // the collectives before the step (an idle plan's)
    EngineClock::step_begin();
    run_begin_ = -kInfinity, run_end_ = kInfinity;
  }
  void stepper_ran(double cpu_begin, double cpu_end) override { run_begin_ = cpu_begin, run_end_ = cpu_end; }

private:
  StepTiming advance(const StepTrace&, double measured_switch_s) override {
    if (synchronised_.marks) {
      StepTiming t = synchronised_step();
      t.switch_exposed_s = measured_switch_s;
      now_ += t.step_s;
      return t;
    }
    const double cpu = cpu_step_s();
    const double step = slowest_ ? slowest_(cpu) : cpu;
    now_ += step;
    return {step, measured_switch_s, cpu};  // the step's time on this clock: its (slowest rank's) CPU time
  }
  StepTiming synchronised_step() {
    const std::vector<double> marks = synchronised_.marks();
    const double end = thread_cpu_seconds();
    // Piece i runs from bounds[i] to bounds[i + 1] of this rank's thread CPU time.
    std::vector<double> bounds = {cpu_begin_};
    bounds.insert(bounds.end(), marks.begin(), marks.end());
    bounds.push_back(end);
    const std::size_t n = bounds.size() - 1;
    // This rank's pieces within its stepper run: [first, last).
    std::size_t first = 0, last = n;
    while (first < n && bounds[first] < run_begin_) ++first;
    while (last > first && bounds[last] > run_end_) --last;
    // [count, -count, first, -last] maxed: a rank that met fewer collectives than another, and the pieces within
    // every rank's run.
    const double met = double(marks.size());
    std::vector<double> counts = {met, -met, double(first), -double(last)};
    synchronised_.max_over_ranks(counts);
    check(counts[0] == -counts[1], "CpuClock: the ranks' steps met between {} and {} collectives (every rank's step "
          "must meet the same ones)", -counts[1], counts[0]);
    StepTiming t;
    t.kernels_begin = std::size_t(counts[2]);
    t.kernels_end = std::max(t.kernels_begin, std::size_t(-counts[3]));
    // [pieces..., own, own over the kernel pieces] maxed: each piece at its slowest rank, the slowest rank's totals.
    std::vector<double> x;
    for (std::size_t i = 0; i < n; ++i) x.push_back(bounds[i + 1] - bounds[i]);
    double kernels = 0;
    for (std::size_t i = t.kernels_begin; i < t.kernels_end; ++i) kernels += x[i];
    t.cpu_s = end - cpu_begin_;
    x.push_back(t.cpu_s), x.push_back(kernels);
    synchronised_.max_over_ranks(x);
    t.slowest_kernels_cpu_s = x.back();
    t.slowest_cpu_s = x[n];
    t.pieces.assign(x.begin(), x.begin() + std::ptrdiff_t(n));
    for (const double piece : t.pieces) t.step_s += piece;
    return t;
  }
  static constexpr double kInfinity = std::numeric_limits<double>::infinity();
  std::function<double(double)> slowest_;
  Synchronised synchronised_;
  double now_ = 0;
  double run_begin_ = -kInfinity, run_end_ = kInfinity;  // this step's stepper run (stepper_ran; untold: the step)
};

class SimulatedClock final : public EngineClock {
public:
  // `shape`: the model the time model costs (the engine's own, or a shape that does not fit here); `budget`: the
  // policy's routing budget (routed in the dry run as the step routes it).
  SimulatedClock(DecoderConfig shape, SimulatedCluster cluster, RoutingBudget budget = {})
      : shape_(std::move(shape)), cluster_(std::move(cluster)),
        dry_run_(std::make_unique<StepDryRunner>(shape_, std::move(budget))) {}

  std::string_view name() const override { return "simulated"; }
  void start() override { now_ = 0, total_ = {}, jitter_ = Rng(kJitterSeed), reads_.clear(); }
  double now() const override { return now_; }
  double elapsed_s() const override { return now_; }
  void idle(double next_arrival) override {
    if (std::isfinite(next_arrival)) now_ = std::max(now_, next_arrival);
  }
  void step_begin() override {}
  // What the clock advances by for the step `trace` (without advancing): the time model's cost, times the slowdown,
  // each GEMM at its weight's reuse distance after the steps this clock advanced by (cost/gemm_reuse.hpp; on a
  // profile with reuse tables).
  StepCost price(const StepTrace& trace) {
    std::vector<cost::WeightReads> after_these = reads_;
    return price(trace, after_these);
  }
  // The same after the weight reads of `reads` (one per rank; empty: none yet), which it advances by the step's: a
  // run's steps priced in turn from an empty `reads` are priced as the clock advances through them.
  StepCost price(const StepTrace& trace, std::vector<cost::WeightReads>& reads) {
    StepCost c = simulated_step_cost(*dry_run_, trace, cluster_, &reads);
    return c *= slowdown_.of(trace);
  }
  // How much slower than its profile the machine runs (a calibrated profile's machine at the moment of a measured
  // run: serve/speed_probe.hpp, serve/step_probe.hpp); every price is multiplied by its step kind's factor. 1 (the
  // default): the profile's speed.
  void set_slowdown(StepSlowdown s) {
    for (const double f : {s.decode, s.prompt})
      check(f > 0 && std::isfinite(f), "SimulatedClock: slowdown {} must be positive and finite", f);
    slowdown_ = s;
  }
  void set_slowdown(double s) { set_slowdown(StepSlowdown::uniform(s)); }
  // The totals over the steps since start().
  const StepCost& totals() const noexcept { return total_; }
  const SimulatedCluster& cluster() const noexcept { return cluster_; }
  const DecoderConfig& shape() const noexcept { return shape_; }

private:
  StepTiming advance(const StepTrace& trace, double) override {
    StepCost c = price(trace, reads_);
    // The machine's step-to-step spread (HardwareProfile::step_jitter): one factor drawn per step, seeded.
    const std::vector<double>& q = cluster_.profile.step_jitter;
    if (!q.empty()) c *= q[std::size_t(jitter_.below(q.size()))];
    total_ += c;
    now_ += c.total_s();
    return {c.total_s(), c.switch_s};
  }
  DecoderConfig shape_;
  SimulatedCluster cluster_;
  std::unique_ptr<StepDryRunner> dry_run_;  // the meta shards it keeps between steps
  std::vector<cost::WeightReads> reads_;     // per rank: the weights read so far (the GEMMs' reuse distances)
  static constexpr std::uint64_t kJitterSeed = 0x5eed5eed;
  StepSlowdown slowdown_;
  double now_ = 0;
  StepCost total_;
  Rng jitter_{kJitterSeed};
};

}  // namespace paradyse::serve
