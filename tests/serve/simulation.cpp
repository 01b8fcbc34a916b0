// tests/serve/simulation.cpp: the engine on simulated time (issue 25). The same requests served on the wall clock,
// the step clock and the simulated clock give the same tokens and the same scheduling (steps, batches, layouts,
// switches, rebalances); a shape-only run replaying the routing recorded from a real run takes the same decisions;
// the simulated clock is deterministic and advances by exactly the cost of each step's dry run; the cost of a
// hand-built step matches its formula; TP is cheaper than EP at batch 1 and the reverse at large batches on an H100
// node (the roofline); routing sources, request traces, model shapes and clusters read and fail clearly; the switch
// log (serve/switch_log.hpp) holds a row per step in the layout the engine ran it in.
#include "paradyse/comm/cpu_marks.hpp"
#include "paradyse/comm/threads.hpp"
#include "paradyse/core/timer.hpp"
#include "paradyse/serve/cluster_spec.hpp"
#include "paradyse/serve/engine.hpp"
#include "paradyse/serve/model_shape_hf.hpp"
#include "paradyse/serve/request_trace.hpp"
#include "paradyse/serve/routing_source.hpp"
#include "paradyse/serve/shape_step.hpp"
#include "paradyse/serve/switch_log.hpp"

#include "serve/launch_per_expert.hpp"

#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

using namespace paradyse;
using namespace paradyse::serve;

// A named namespace (the unity build puts engine.cpp's anonymous helpers beside these): its test cases find these.
namespace simulation_test {

std::filesystem::path repo() { return std::filesystem::path(__FILE__).parent_path().parent_path().parent_path(); }
std::string scratch(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("paradyse_sim_" + name)).string();
}

// `seconds` of this thread's CPU time, busy.
void spin_cpu(double seconds) {
  const double start = thread_cpu_seconds();
  volatile double x = 1;
  while (thread_cpu_seconds() - start < seconds) x = x * 1.0000001;
}

// One step on p thread ranks, each with a marking communicator and a synchronised CPU clock (started): `step(comm,
// clock, meet)` runs it on every rank (clock.step_begin() to step_end(); meet() is a one-value all-reduce, a marked
// collective). Each rank's timing of the step.
template <class Step>
std::vector<StepTiming> synchronised_step(int p, Step step) {
  std::vector<StepTiming> timing(static_cast<std::size_t>(p));
  run_ranks(p, [&](ThreadCommunicator& plain) {
    CpuMarkedCommunicator comm(std::move(plain));
    CpuClock clock(CpuClock::synchronised_by(comm));
    clock.observer = [&](const StepTrace&, const StepTiming& t, double) { timing[std::size_t(comm.rank())] = t; };
    clock.start();
    double token = 0;
    const auto meet = [&] {
      comm.all_reduce(std::span<const double>(&token, 1), std::span<double>(&token, 1), ReduceOp::sum);
    };
    step(comm, clock, meet);
  });
  return timing;
}

// Twelve requests arriving at time 0 (admission then depends on the KV pool and max_running, not on the clock).
std::vector<ServeRequest> at_once(std::int64_t vocab) {
  std::vector<TraceRequest> t = poisson_trace(1.0, 12, {3, 11, 2, 7}, 5);
  for (TraceRequest& r : t) r.arrival_s = 0;
  return to_serve_requests(t, vocab, 3);
}

struct Run {
  std::vector<RequestOutcome> out;
  EngineStats stats;
  std::vector<StepTrace> traces;
};

Run run_on(const LoadedDecoder& m, const std::vector<ServeRequest>& requests, int p, EngineOptions opt,
           const EnginePolicy& policy, EngineClock* (*make)(const DecoderConfig&)) {
  Run r;
  run_ranks(p, [&](ThreadCommunicator& comm) {
    std::unique_ptr<EngineClock> clock(make ? make(m.config) : nullptr);
    EngineOptions o = opt;
    o.clock = clock.get();
    if (clock && comm.rank() == 0) clock->observer = [&](const StepTrace& t, const StepTiming&, double) { r.traces.push_back(t); };
    EngineStats stats;
    auto got = serve_requests(comm, m, requests, o, policy, &stats);
    if (comm.rank() == 0) r.out = std::move(got), r.stats = stats;
  });
  return r;
}

EngineClock* wall(const DecoderConfig&) { return new WallClock; }
EngineClock* steps(const DecoderConfig&) { return new StepClock; }
EngineClock* cpu(const DecoderConfig&) { return new CpuClock; }
EngineClock* simulated(const DecoderConfig& c) { return new SimulatedClock(c, simulated_cluster("h100", 2)); }

EnginePolicy switching_policy() {  // prefill favours EP, decode TP: the runs switch both ways
  EnginePolicy p;
  p.mode = ModePolicy::dynamic;
  p.switching = {0.0, 1, 1};
  p.rates = {1e9, 1e12, 1e4};
  p.eplb = true;
  p.eplb_interval = 2;
  return p;
}

EngineOptions small_pool() {
  EngineOptions o;
  o.step_tokens = 8;
  o.max_running = 5;
  o.block_size = 4;
  o.kv_blocks = 24;
  return o;
}

void same_schedule(const Run& a, const Run& b) {
  REQUIRE(a.out.size() == b.out.size());
  for (std::size_t i = 0; i < a.out.size(); ++i) CHECK(a.out[i].tokens == b.out[i].tokens);
  CHECK(a.stats.steps == b.stats.steps);
  CHECK(a.stats.step_tokens == b.stats.step_tokens);
  CHECK(a.stats.mode_of_step == b.stats.mode_of_step);
  CHECK(a.stats.switches == b.stats.switches);
  CHECK(a.stats.rebalances == b.stats.rebalances);
  CHECK(a.stats.tokens == b.stats.tokens);
}

TEST_CASE("simulation: wall, step and simulated clocks give the same tokens, batches, layouts and switches") {
  const LoadedDecoder m = load_decoder((repo() / "tests" / "data" / "hf" / "mixtral").string());
  const std::vector<ServeRequest> requests = at_once(m.config.vocab);
  for (const int p : {1, 2}) {
    INFO("p = ", p);
    const Run w = run_on(m, requests, p, small_pool(), switching_policy(), wall);
    const Run s = run_on(m, requests, p, small_pool(), switching_policy(), steps);
    const Run sim = run_on(m, requests, p, small_pool(), switching_policy(), simulated);
    const Run on_cpu = run_on(m, requests, p, small_pool(), switching_policy(), cpu);
    same_schedule(w, s);
    same_schedule(w, sim);
    same_schedule(w, on_cpu);
    if (p == 2) CHECK(sim.stats.switches > 0);
    // On the simulated clock the outcomes are stamped in the cluster's seconds: each step's cost, in order.
    double t = 0;
    for (const double x : sim.stats.step_seconds) t += x;
    CHECK(sim.stats.elapsed_s == doctest::Approx(t).epsilon(1e-12));
    for (const RequestOutcome& r : sim.out) CHECK((r.first_token > 0 && r.finish >= r.first_token && r.finish <= t));
  }
}

TEST_CASE("switch log: a row per step with the clock's time, the step's tokens and the layout the engine ran it in") {
  const LoadedDecoder m = load_decoder((repo() / "tests" / "data" / "hf" / "mixtral").string());
  const std::vector<ServeRequest> requests = at_once(m.config.vocab);
  for (const bool pipelined : {true, false}) {
    INFO("pipelined switches: ", pipelined);
    EnginePolicy policy = switching_policy();
    policy.pipelined_switch = pipelined;
    const std::string path = scratch(fmt::format("switch_log_{}.csv", pipelined));
    Run r;
    std::vector<double> ends;
    {
      SwitchLog log(path, "--switch-csv");
      run_ranks(2, [&](ThreadCommunicator& comm) {
        SimulatedClock clock(m.config, simulated_cluster("h100", 2));
        if (comm.rank() == 0) {
          auto logged = log.observer("at once", "dynamic, EPLB");
          clock.observer = [&, logged](const StepTrace& t, const StepTiming& timing, double end) {
            logged(t, timing, end);
            r.traces.push_back(t), ends.push_back(end);
          };
        }
        EngineOptions o = small_pool();
        o.clock = &clock;
        EngineStats stats;
        auto got = serve_requests(comm, m, requests, o, policy, &stats);
        if (comm.rank() == 0) r.out = std::move(got), r.stats = stats;
      });
      log.close();
      CHECK_FALSE(log.failed());
    }
    REQUIRE(r.stats.switches > 0);  // both layouts appear in the log
    std::ifstream in(path);
    std::string line;
    std::getline(in, line);
    CHECK(line == "trace,policy,step,time_s,tokens,layout");
    std::vector<std::string> rows;
    while (std::getline(in, line)) rows.push_back(line);
    // One row per step: the layout the engine recorded running it in (EngineStats::mode_of_step), its tokens and the
    // time it ended on the clock; the policy's name quoted (it holds a comma).
    REQUIRE(rows.size() == r.stats.mode_of_step.size());
    REQUIRE(rows.size() == ends.size());
    for (std::size_t i = 0; i < rows.size(); ++i)
      CHECK(rows[i] == fmt::format("at once,\"dynamic, EPLB\",{},{:.6g},{},{}", i, ends[i], r.traces[i].tokens(),
                                   name_of(r.stats.mode_of_step[i])));
    std::filesystem::remove(path);
  }
}

TEST_CASE("simulation: the CPU clock advances by each step's thread CPU time and jumps to arrivals when idle") {
  const LoadedDecoder m = load_decoder((repo() / "tests" / "data" / "hf" / "mixtral").string());
  std::vector<ServeRequest> requests = at_once(m.config.vocab);
  // Half the requests at 0, half 1000 s later: the wall clock would sleep 1000 s; the CPU clock jumps there.
  for (std::size_t i = requests.size() / 2; i < requests.size(); ++i) requests[i].arrival = 1000.0;
  for (const int p : {1, 2}) {
    INFO("p = ", p);
    const Timer wall;
    EnginePolicy policy = switching_policy();
    policy.forecast = ForecastModel::dry_run;  // its events are host work the clock charges
    const Run r = run_on(m, requests, p, small_pool(), policy, cpu);
    CHECK(wall.seconds() < 100);
    REQUIRE(r.out.size() == requests.size());
    double busy = 0;
    REQUIRE(r.stats.step_host_s.size() == r.stats.step_seconds.size());
    REQUIRE(r.stats.step_run_s.size() == r.stats.step_seconds.size());
    REQUIRE(r.stats.step_forecast_s.size() == r.stats.step_seconds.size());
    REQUIRE(r.traces.size() == r.stats.step_seconds.size());
    double forecasting = 0;
    std::int64_t forecast_events = 0;
    for (std::size_t i = 0; i < r.stats.step_seconds.size(); ++i) {
      const double x = r.stats.step_seconds[i];
      CHECK(x >= 0);
      CHECK(x < wall.seconds() + 1e-3);  // a thread's CPU time within a step is at most the step's wall time
      // The engine's host work (outside the stepper's compute): a part of the step's CPU time.
      CHECK(r.stats.step_host_s[i] >= -1e-9);
      CHECK(r.stats.step_host_s[i] <= x + 1e-9);
      // The stepper's compute (decoder_step): positive; with the host work and the forecast's own CPU within the
      // step's CPU time.
      CHECK(r.stats.step_run_s[i] > 0);
      CHECK(r.stats.step_forecast_s[i] >= 0);
      CHECK(r.stats.step_run_s[i] + r.stats.step_host_s[i] + r.stats.step_forecast_s[i] <= x + 1e-9);
      forecasting += r.stats.step_forecast_s[i];
      forecast_events += r.traces[i].planning_events;
      busy += x;
    }
    CHECK(busy > 0);
    // The dynamic policy forecast (its dry runs recorded events) and rank 0 timed it.
    CHECK(forecast_events > 0);
    CHECK(forecasting > 0);
    // Before the jump the clock is the sum of the steps' CPU times; after it, 1000 s plus the steps since.
    CHECK(r.stats.elapsed_s > 1000.0);
    CHECK(r.stats.elapsed_s <= 1000.0 + busy + 1e-9);
    std::size_t late = 0;
    for (const RequestOutcome& o : r.out) {
      late += o.arrival >= 1000.0;
      CHECK((o.arrival >= 1000.0 ? o.first_token >= 1000.0 : o.first_token < 1000.0));
      CHECK(o.finish >= o.first_token);
    }
    CHECK(late == requests.size() - requests.size() / 2);
  }
}

TEST_CASE("simulation: the CPU clock given a reduction advances every rank by the slowest rank's CPU time") {
  const LoadedDecoder m = load_decoder((repo() / "tests" / "data" / "hf" / "mixtral").string());
  const std::vector<ServeRequest> requests = at_once(m.config.vocab);
  for (const int p : {2, 3}) {
    INFO("p = ", p);
    std::vector<std::vector<StepTiming>> timings(static_cast<std::size_t>(p));  // per rank, per step
    std::vector<double> elapsed(timings.size());
    run_ranks(p, [&](ThreadCommunicator& comm) {
      const std::size_t r = std::size_t(comm.rank());
      CpuClock clock([&comm](double mine) { return max_over_ranks(comm, mine); });
      clock.observer = [&](const StepTrace&, const StepTiming& t, double) { timings[r].push_back(t); };
      EngineOptions o = small_pool();
      o.clock = &clock;
      EngineStats stats;
      (void)serve_requests(comm, m, requests, o, switching_policy(), &stats);
      elapsed[r] = clock.elapsed_s();
    });
    REQUIRE(!timings[0].empty());
    double sum = 0;
    for (std::size_t i = 0; i < timings[0].size(); ++i) {
      double slowest = 0;
      for (const std::vector<StepTiming>& rank : timings) {
        REQUIRE(rank.size() == timings[0].size());
        slowest = std::max(slowest, rank[i].cpu_s);  // each rank's own CPU time in the step
      }
      for (const std::vector<StepTiming>& rank : timings) CHECK(rank[i].step_s == slowest);
      sum += slowest;
    }
    for (const double e : elapsed) CHECK(e == doctest::Approx(sum).epsilon(1e-12));  // no idle jumps: all at 0
  }
}

TEST_CASE("simulation: the synchronised CPU clock takes each piece between collectives at its slowest rank") {
  // Rank k % p computes alone in piece k (10 ms of CPU), the others wait in the collective that ends it: on cores of
  // their own the step takes about 2p x 10 ms, each rank's own CPU time about 2 x 10 ms.
  for (const int p : {2, 3}) {
    INFO("p = ", p);
    const std::vector<StepTiming> timing = synchronised_step(p, [&](auto& comm, CpuClock& clock, const auto& meet) {
      meet();  // before the step
      clock.step_begin();
      for (int piece = 0; piece < 2 * p; ++piece) {
        if (piece % p == comm.rank()) spin_cpu(0.010);
        meet();
      }
      clock.step_end(StepTrace{}, 0);
    });
    double slowest_own = 0, all_own = 0;
    for (const StepTiming& t : timing) slowest_own = std::max(slowest_own, t.cpu_s), all_own += t.cpu_s;
    for (const StepTiming& t : timing) CHECK(t.step_s == timing[0].step_s);
    CHECK(timing[0].step_s >= 0.9 * double(p) * 0.020);
    CHECK(timing[0].step_s > 1.5 * slowest_own);  // the slowest rank's total alone would be about 20 ms
    CHECK(timing[0].step_s <= all_own + 1e-9);    // each piece at most every rank's work in it
    // The pieces it summed (2p collectives and the tail after the last), and the slowest rank's own total, alike on
    // every rank.
    for (const StepTiming& t : timing) {
      CHECK(t.pieces == timing[0].pieces);
      CHECK(t.slowest_cpu_s == timing[0].slowest_cpu_s);
    }
    REQUIRE(timing[0].pieces.size() == std::size_t(2 * p + 1));
    double sum = 0;
    for (const double piece : timing[0].pieces) sum += piece;
    CHECK(sum == timing[0].step_s);
    for (int piece = 0; piece < 2 * p; ++piece) CHECK(timing[0].pieces[std::size_t(piece)] >= 0.009);
    CHECK(timing[0].slowest_cpu_s == slowest_own);
    // Not told the stepper's run: every piece counts as the run's.
    CHECK(timing[0].kernels_begin == 0);
    CHECK(timing[0].kernels_end == timing[0].pieces.size());
    CHECK(timing[0].slowest_kernels_cpu_s == doctest::Approx(timing[0].slowest_cpu_s).epsilon(1e-12).scale(0));
  }
  // A rank whose step met fewer collectives than the others': every rank fails, naming the counts.
  CHECK_THROWS_WITH_AS(run_ranks(2, [](ThreadCommunicator& plain) {
                         CpuMarkedCommunicator comm(std::move(plain));
                         CpuClock clock(CpuClock::synchronised_by(comm));
                         clock.start();
                         clock.step_begin();
                         double v = 1;
                         if (comm.rank() == 0) comm.all_reduce(std::span<const double>(&v, 1), std::span<double>(&v, 1), ReduceOp::sum);
                         else comm.unmarked().all_reduce(std::span<const double>(&v, 1), std::span<double>(&v, 1), ReduceOp::sum);
                         clock.step_end(StepTrace{}, 0);
                       }),
                       doctest::Contains("met between 0 and 1 collectives"), Error);
}

TEST_CASE("simulation: the synchronised CPU clock's kernel pieces are those within every rank's stepper run") {
  // Rank 0 plans 10 ms before the run and samples 10 ms after it, then a broadcast; in the run rank k % p computes
  // 5 ms alone in piece k of 2p. Piece 0 (planning and the run's first piece) and piece 2p (sampling) straddle the
  // run's ends: the kernel pieces are 1 to 2p - 1, where rank 0 computes once and every other rank twice.
  for (const int p : {2, 3}) {
    INFO("p = ", p);
    std::vector<double> own_kernels(static_cast<std::size_t>(p));
    const std::vector<StepTiming> timing = synchronised_step(p, [&](auto& comm, CpuClock& clock, const auto& meet) {
      clock.step_begin();
      if (comm.rank() == 0) spin_cpu(0.010);
      const double run_begin = thread_cpu_seconds();
      double first_piece_end = 0;
      for (int piece = 0; piece < 2 * p; ++piece) {
        if (piece % p == comm.rank()) spin_cpu(0.005);
        meet();
        if (piece == 0) first_piece_end = thread_cpu_seconds();
      }
      const double run_end = thread_cpu_seconds();
      clock.stepper_ran(run_begin, run_end);
      own_kernels[std::size_t(comm.rank())] = run_end - first_piece_end;
      if (comm.rank() == 0) spin_cpu(0.010);
      meet();
      clock.step_end(StepTrace{}, 0);
    });
    for (const StepTiming& t : timing) {
      REQUIRE(t.pieces.size() == std::size_t(2 * p + 2));
      CHECK(t.kernels_begin == 1);
      CHECK(t.kernels_end == std::size_t(2 * p));
      CHECK(t.slowest_kernels_cpu_s == timing[0].slowest_kernels_cpu_s);
    }
    // The slowest rank's own time over the kernel pieces: a rank that computed twice there (10 ms), not rank 0 with
    // its 20 ms of host work (the slowest of the whole step). The clock's marks and the test's reads bracket the same
    // pieces a few instructions apart; on a loaded machine (CI, two tests at once) the two readings of the 10 ms
    // differed by 14 us (0.14%), so the bound is 1%, which still tells the kernel pieces from the whole step (2x).
    const double slowest = *std::max_element(own_kernels.begin(), own_kernels.end());
    CHECK(timing[0].slowest_kernels_cpu_s == doctest::Approx(slowest).epsilon(1e-2).scale(0));
    CHECK(timing[0].slowest_kernels_cpu_s >= 0.0095);
    CHECK(timing[0].slowest_kernels_cpu_s < 0.5 * timing[0].slowest_cpu_s);
    CHECK(timing[0].slowest_cpu_s >= 0.024);
  }
}

TEST_CASE("simulation: the simulated clock is deterministic and advances by the cost of each step's dry run") {
  const LoadedDecoder m = load_decoder((repo() / "tests" / "data" / "hf" / "mixtral").string());
  std::vector<ServeRequest> requests = at_once(m.config.vocab);
  for (std::size_t i = 0; i < requests.size(); ++i) requests[i].arrival = 2e-5 * double(i);  // staggered, in seconds
  const Run a = run_on(m, requests, 2, small_pool(), switching_policy(), simulated);
  const Run b = run_on(m, requests, 2, small_pool(), switching_policy(), simulated);
  REQUIRE(a.out.size() == b.out.size());
  for (std::size_t i = 0; i < a.out.size(); ++i) {
    CHECK(a.out[i].first_token == b.out[i].first_token);  // to the bit
    CHECK(a.out[i].finish == b.out[i].finish);
  }
  CHECK(a.stats.step_seconds == b.stats.step_seconds);
  REQUIRE(a.traces.size() == a.stats.step_seconds.size());
  const SimulatedCluster h100 = simulated_cluster("h100", 2);
  for (std::size_t k = 0; k < a.traces.size(); ++k) {
    CHECK(a.traces[k].tokens() == a.stats.step_tokens[k]);
    CHECK(a.stats.step_seconds[k] == simulated_step_cost(m.config, a.traces[k], h100).total_s());
  }
}

TEST_CASE("simulation: a shape-only run replaying the recorded routing takes the real run's decisions") {
  const LoadedDecoder m = load_decoder((repo() / "tests" / "data" / "hf" / "mixtral").string());
  const std::vector<ServeRequest> requests = at_once(m.config.vocab);
  const Run real = run_on(m, requests, 2, small_pool(), switching_policy(), simulated);
  RoutingRecorder rec;
  for (const StepTrace& t : real.traces) rec.add(t);
  const std::string path = scratch("routing.csv");
  rec.save(path);
  RecordedRouting routing(load_routing_record(path), "routing.csv");
  Run shape;
  run_ranks(1, [&](ThreadCommunicator& comm) {
    SimulatedClock clock(m.config, simulated_cluster("h100", 2));
    EngineOptions o = small_pool();
    o.clock = &clock;
    const EnginePolicy policy = switching_policy();
    ShapeStepper stepper(m.config, 2, o, MoeMode::tp, routing);
    shape.out = serve_loop(comm, stepper, requests, o, policy, clock, &shape.stats);
  });
  CHECK(shape.stats.steps == real.stats.steps);
  CHECK(shape.stats.step_tokens == real.stats.step_tokens);
  CHECK(shape.stats.mode_of_step == real.stats.mode_of_step);
  CHECK(shape.stats.switches == real.stats.switches);
  CHECK(shape.stats.rebalances == real.stats.rebalances);
  CHECK(shape.stats.step_seconds == real.stats.step_seconds);  // the same traces cost the same
  for (std::size_t i = 0; i < requests.size(); ++i) {
    CHECK(shape.out[i].tokens.size() == real.out[i].tokens.size());
    CHECK(shape.out[i].first_token == real.out[i].first_token);
  }
}

TEST_CASE("step cost: a hand-built step costs its formula; TP wins batch 1 and EP large batches on an H100 node") {
  DecoderConfig c = read_model_shape((repo() / "data" / "model_shapes" / "mixtral-8x7b.json").string()).config;
  cost::HardwareProfile hw;  // GEMMs only: no overhead, 1 TFLOP/s, operands at 1 TB/s; the rest free
  hw.gemm = {0, 1e12, 1e12};
  hw.attention = {0, 1e30, 1e30};
  hw.elementwise_bytes_per_s = 1e30;
  hw.intra_node = {0, 0, 1e30, 1e30};
  const SimulatedCluster free_links{hw, 2};
  StepTrace t;
  t.ranks = 1;
  t.chunks = {{1, 0, true}};
  t.layout.assign(std::size_t(c.layers), ExpertLayout::tp());
  t.next.resize(std::size_t(c.layers));
  t.routed.assign(std::size_t(c.layers), std::vector<std::int64_t>(8, 0));
  for (auto& r : t.routed) r[0] = r[3] = 1;
  const double h = 4096, f = 14336, d = 128, b = 2;
  auto g = [&](double m, double n, double k) { return 2 * m * n * k / 1e12 + (m * k + k * n + m * n) * b / 1e12; };
  const double per_layer = g(1, 32 * d, h) + 2 * g(1, 8 * d, h) + g(1, h, 32 * d) + g(1, 8, h) + 2 * (g(1, 2 * f, h) + g(1, h, f));
  const StepCost one = step_cost(c, t, free_links);
  CHECK(one.compute_s == doctest::Approx(32 * per_layer + g(1, 32000, h)).epsilon(1e-9));
  CHECK(one.communication_s == 0);
  CHECK(one.switch_s == 0);

  const SimulatedCluster h100 = simulated_cluster("h100", 2);
  auto moe_time = [&](std::int64_t tokens, MoeMode mode) {
    StepTrace s;
    s.ranks = 8;
    s.chunks = {{tokens, 0, false}};
    s.layout.assign(std::size_t(c.layers), mode == MoeMode::tp ? ExpertLayout::tp()
                                                              : ExpertLayout::ep(ExpertPlacement::chunked(8, 8).experts_of_rank));
    s.next.resize(std::size_t(c.layers));
    ZipfRouting z(0.0, 1);
    for (std::int64_t l = 0; l < c.layers; ++l) s.routed.push_back(z.counts(0, l, tokens, 8, 2));
    return step_cost(c, s, h100).total_s();
  };
  CHECK(moe_time(1, MoeMode::tp) < moe_time(1, MoeMode::ep));
  CHECK(moe_time(4096, MoeMode::ep) < moe_time(4096, MoeMode::tp));

  // A switch pipelined behind 32 layers hides; stalled, it is exposed whole.
  StepTrace s = t;
  s.ranks = 8;
  s.chunks = {{256, 0, false}};
  ZipfRouting z(0.0, 1);
  for (std::int64_t l = 0; l < c.layers; ++l) s.routed[std::size_t(l)] = z.counts(0, l, 256, 8, 2);
  for (auto& n : s.next) n = ExpertLayout::ep(ExpertPlacement::chunked(8, 8).experts_of_rank);
  const StepCost piped = step_cost(c, s, h100);
  s.pipelined_switch = false;
  const StepCost stalled = step_cost(c, s, h100);
  CHECK(stalled.switch_s > piped.switch_s);
  const double bytes = layer_switch(c, ExpertLayout::tp(), *s.next[0], 8, h100.profile, 2).bytes;
  CHECK(bytes == doctest::Approx(3.0 * 14336 * 4096 * 2 * 7.0 / 8));  // one expert, 7/8 of it from the others
}

// Mixtral-8x7B on 8 simulated H100s, the dynamic policy with the cluster as its time model, over `trace`.
struct RampRun {
  std::vector<RequestOutcome> out;
  EngineStats stats;
  std::vector<StepTrace> traces;
  std::vector<double> ends;  // each step's end on the simulated clock
};
RampRun serve_shape(const DecoderConfig& c, const SimulatedCluster& h100, const std::vector<ServeRequest>& requests,
                    EnginePolicy policy) {
  RampRun r;
  policy.time_model = h100;
  run_ranks(1, [&](ThreadCommunicator& comm) {
    SimulatedClock clock(c, h100);
    clock.observer = [&](const StepTrace& t, const StepTiming&, double end) { r.traces.push_back(t), r.ends.push_back(end); };
    EngineOptions o;
    o.step_tokens = 512;
    o.max_running = 256;
    o.block_size = 16;
    o.kv_blocks = 1 << 16;
    o.clock = &clock;
    ZipfRouting routing(0.5, 1);
    ShapeStepper stepper(c, 8, o, policy.mode == ModePolicy::static_ep ? MoeMode::ep : MoeMode::tp, routing);
    r.out = serve_loop(comm, stepper, requests, o, policy, clock, &r.stats);
  });
  return r;
}

TEST_CASE("dynamic policy: on a load ramp it starts in TP, goes EP past the step cost's crossover and back, and is "
          "never slower than the better static policy by more than its switches") {
  const DecoderConfig c = read_model_shape((repo() / "data" / "model_shapes" / "mixtral-8x7b.json").string()).config;
  // Each expert GEMM its own launch: a crossover to find (tests/serve/launch_per_expert.hpp).
  const SimulatedCluster h100 = serve_scenarios::h100_launch_per_expert();
  // The crossover the step cost predicts: decode batches of n tokens (512 cached each), Zipf 0.5 routing.
  auto decode_step = [&](std::int64_t n, MoeMode mode) {
    StepTrace t;
    t.ranks = 8;
    t.chunks.assign(std::size_t(n), ChunkShape{1, 512, true});
    t.layout.assign(std::size_t(c.layers),
                    mode == MoeMode::tp ? ExpertLayout::tp() : ExpertLayout::ep(ExpertPlacement::chunked(8, 8).experts_of_rank));
    t.next.resize(std::size_t(c.layers));
    ZipfRouting z(0.5, 1);
    for (std::int64_t l = 0; l < c.layers; ++l) t.routed.push_back(z.counts(0, l, n, 8, 2));
    return step_cost(c, t, h100).total_s();
  };
  std::int64_t crossover = 0;  // the smallest batch from which EP stays cheaper (powers of two up to 256)
  for (std::int64_t n = 256; n >= 1; n /= 2) {
    if (decode_step(n, MoeMode::ep) >= decode_step(n, MoeMode::tp)) break;
    crossover = n;
  }
  MESSAGE(fmt::format("step cost: TP {:.2f} / EP {:.2f} ms at batch 1, {:.2f} / {:.2f} ms at 64; crossover batch {}",
                      decode_step(1, MoeMode::tp) * 1e3, decode_step(1, MoeMode::ep) * 1e3,
                      decode_step(64, MoeMode::tp) * 1e3, decode_step(64, MoeMode::ep) * 1e3, crossover));
  REQUIRE(decode_step(1, MoeMode::tp) < decode_step(1, MoeMode::ep));
  REQUIRE(crossover > 1);
  // The ramp: 1 request/s for 20 s, 48 requests/s for 10 s, 1 request/s for 20 s.
  const LengthRanges lengths{64, 256, 64, 128};
  std::vector<TraceRequest> ramp;
  double t0 = 0;
  for (const auto& [rate, count] : std::vector<std::pair<double, std::int64_t>>{{1, 20}, {48, 480}, {1, 20}}) {
    for (TraceRequest r : poisson_trace(rate, count, lengths, 7)) {
      r.arrival_s += t0;
      ramp.push_back(r);
    }
    t0 = ramp.back().arrival_s;
  }
  const std::vector<ServeRequest> requests = to_serve_requests(ramp, c.vocab, 1);
  EnginePolicy tp, ep, dyn;
  ep.mode = ModePolicy::static_ep;
  dyn.mode = ModePolicy::dynamic;
  dyn.switching.break_even = true;
  const RampRun a = serve_shape(c, h100, requests, tp), b = serve_shape(c, h100, requests, ep),
                d = serve_shape(c, h100, requests, dyn);
  const std::vector<MoeMode>& modes = d.stats.mode_of_step;
  REQUIRE(!modes.empty());
  CHECK(modes.front() == MoeMode::tp);
  CHECK(modes.back() == MoeMode::tp);
  CHECK(d.stats.switches >= 2);
  // Each switch was decided when the load (the decode batch: the requests past their prompt) was on the far side
  // of the crossover (pipelined: step k - 1 decided the layout step k computes in).
  std::int64_t to_ep = 0, to_tp = 0;
  for (std::size_t k = 1; k < modes.size(); ++k) {
    if (modes[k] == modes[k - 1]) continue;
    std::int64_t n = 0;
    for (const ChunkShape& ch : d.traces[k - 1].chunks) n += ch.decode ? 1 : 0;
    if (modes[k] == MoeMode::ep) {
      ++to_ep;
      CHECK(n >= crossover / 2);
    } else {
      ++to_tp;
      CHECK(n <= 2 * crossover);
    }
    MESSAGE(fmt::format("step {} (at {:.2f} s): decided on {} decode tokens ({} in all), to {}", k, d.ends[k - 1], n,
                        d.stats.step_tokens[k - 1], name_of(modes[k])));
  }
  CHECK(to_ep >= 1);
  CHECK(to_tp >= 1);
  // Busy time (the sum of step times) and latency: never worse than the better static policy by more than the
  // switches' exposed time.
  auto busy = [](const RampRun& r) { return std::accumulate(r.stats.step_seconds.begin(), r.stats.step_seconds.end(), 0.0); };
  auto mean_tpot = [](const RampRun& r) {
    double sum = 0;
    for (const RequestOutcome& o : r.out) sum += (o.finish - o.first_token) / double(o.tokens.size() - 1);
    return sum / double(r.out.size());
  };
  MESSAGE(fmt::format("busy s: TP {:.3f}, EP {:.3f}, dynamic {:.3f} ({} switches, {:.3f} s exposed); mean TPOT ms: TP "
                      "{:.2f}, EP {:.2f}, dynamic {:.2f}", busy(a), busy(b), busy(d), d.stats.switches,
                      d.stats.switch_exposed_s, mean_tpot(a) * 1e3, mean_tpot(b) * 1e3, mean_tpot(d) * 1e3));
  CHECK(busy(d) <= std::min(busy(a), busy(b)) + d.stats.switch_exposed_s);
  CHECK(mean_tpot(d) <= std::min(mean_tpot(a), mean_tpot(b)) + d.stats.switch_exposed_s / double(d.out.size()));
}

TEST_CASE("routing sources: counts sum to n k with at most n per expert; seeded; Zipf skews; records round-trip") {
  ZipfRouting uniform(0.0, 7), skewed(1.5, 7);
  const std::vector<std::int64_t> a = uniform.counts(3, 1, 500, 8, 2), b = uniform.counts(3, 1, 500, 8, 2);
  CHECK(a == b);
  CHECK(std::accumulate(a.begin(), a.end(), std::int64_t(0)) == 1000);
  for (const std::int64_t x : a) CHECK(x <= 500);
  const std::vector<std::int64_t> s = skewed.counts(3, 1, 500, 8, 2);
  CHECK(*std::max_element(s.begin(), s.end()) > *std::max_element(a.begin(), a.end()));
  CHECK(uniform.describe().find("Zipf") != std::string::npos);

  WeightedRouting published = published_routing((repo() / "tests" / "data" / "hf" / "eplb_example.json").string(), 1);
  const std::vector<std::int64_t> p = published.counts(0, 0, 100, 8, 2);
  CHECK(std::accumulate(p.begin(), p.end(), std::int64_t(0)) == 200);
  CHECK(published.describe().find("eplb_example.json") != std::string::npos);

  RoutingRecord rec;
  rec.experts = 4;
  rec.rows = {{0, 0, 3, {3, 2, 1, 0}}, {0, 1, 3, {1, 1, 2, 2}}, {1, 0, 1, {1, 0, 0, 1}}, {1, 1, 1, {0, 1, 1, 0}}};
  RecordedRouting replay(rec, "hand");
  CHECK(replay.counts(0, 0, 3, 4, 2) == std::vector<std::int64_t>{3, 2, 1, 0});
  CHECK(replay.counts(1, 1, 1, 4, 2) == std::vector<std::int64_t>{0, 1, 1, 0});
  CHECK(replay.counts(2, 0, 3, 4, 2) == std::vector<std::int64_t>{3, 2, 1, 0});  // cyclic
  const std::vector<std::int64_t> scaled = replay.counts(0, 0, 6, 4, 2);
  CHECK(scaled == std::vector<std::int64_t>{6, 4, 2, 0});
  CHECK_THROWS_WITH_AS(replay.counts(0, 0, 3, 8, 2), doctest::Contains("recorded with 4 experts, the model has 8"),
                       Error);
  const std::string bad = scratch("bad_routing.csv");
  std::ofstream(bad) << "step,layer,tokens,e0,e1\n0,0,2,1,3\n0,1,2,x,1\n";
  CHECK_THROWS_WITH_AS(load_routing_record(bad), doctest::Contains("bad_routing.csv:3:7: \"x\" is not a count"), Error);
}

TEST_CASE("routing records: a count above its step's tokens is refused naming the file, line, step, layer and counts") {
  // Issue 27: it was loaded and clamped to the step's tokens when replayed.
  const std::string path = scratch("over_routing.csv");
  std::ofstream(path) << "step,layer,tokens,e0,e1\n0,0,4,2,2\n0,1,2,1,3\n";
  CHECK_THROWS_WITH_AS(load_routing_record(path),
                       doctest::Contains("over_routing.csv:3: step 0 layer 1: expert 1 (column 5) has 3 token-expert "
                                         "pairs, above the step's 2 tokens"),
                       Error);
  std::ofstream(path) << "step,layer,tokens,e0,e1\n0,0,4,4,4\n";  // every token picks both experts: the most
  CHECK(load_routing_record(path).rows.at(0).counts == std::vector<std::int64_t>{4, 4});
}

TEST_CASE("routing records: saving to a full disk is an Error naming the flag, the file and the reason") {
  // It wrote through an ofstream checked before its buffer was flushed: a full disk went unnoticed.
  RoutingRecorder recorder;
  StepTrace t;
  t.routed = {{2, 0, 1, 1}};
  t.chunks = {{.tokens = 2}};
  recorder.add(t);
  CHECK_THROWS_WITH_AS(recorder.save("/dev/full", "--record-routing"),
                       doctest::Contains("--record-routing /dev/full: writing failed: No space left on device"), Error);
}

TEST_CASE("request traces: arrivals past an hour are refused naming the flags that made the trace") {
  // One rule (check_trace_span) for moe_infer's --rate and --bursty and moe_simulate's --rates (issue 27: moe_simulate
  // reported 0 tokens/s for 1e-300 requests/s; moe_infer named --rate for a bursty trace).
  TraceShape poisson{.requests = 4, .rate = 1e-300};
  CHECK_THROWS_WITH_AS(make_trace(poisson, 100),
                       doctest::Contains("--rate 1e-300: request 1 of 4 would arrive at"), Error);
  CHECK_THROWS_WITH_AS(make_trace(poisson, 100), doctest::Contains("raise --rate or lower --requests"), Error);
  TraceShape bursty{.requests = 8, .bursty = true, .burst = 4, .period = 1e6};
  CHECK_THROWS_WITH_AS(make_trace(bursty, 100),
                       doctest::Contains("--bursty --burst 4 --period 1e+06: request 5 of 8 would arrive at 1e+06 s "
                                         "(bursts of 4 every 1e+06 s); at most 3600 s of arrivals are served: "
                                         "lower --period"),
                       Error);
  bursty.period = 1000;  // the last burst at 1000 s: served
  CHECK(make_trace(bursty, 100).size() == 8);
  const std::vector<TraceRequest> day = poisson_trace(1e-9, 4, {}, 1);
  CHECK_THROWS_WITH_AS(check_trace_span(day, "--rates 1e-9", poisson_shape(1e-9), "raise it"),
                       doctest::Contains("--rates 1e-9: request 1 of 4"), Error);
  CHECK_NOTHROW(check_trace_span(poisson_trace(100, 4, {}, 1), "--rates 100", poisson_shape(100), "raise it"));
}

TEST_CASE("request traces: Poisson and bursts seeded; the Azure CSV reads; bad rows name file, line and column") {
  const auto p = poisson_trace(4.0, 2000, {}, 1);
  CHECK(p == poisson_trace(4.0, 2000, {}, 1));
  CHECK(p.back().arrival_s / 2000 == doctest::Approx(0.25).epsilon(0.1).scale(0));
  const auto b = bursty_trace(5, 2.0, 12, {}, 1);
  CHECK(b[5].arrival_s == 2.0);
  CHECK(b[11].arrival_s == doctest::Approx(4.001));
  const auto azure = read_azure_trace((repo() / "tests" / "data" / "traces" / "azure_code_head20.csv").string());
  REQUIRE(azure.size() == 20);
  CHECK(azure[0].arrival_s == 0);
  CHECK(azure[0].prompt_tokens == 4808);
  CHECK(azure[0].output_tokens == 10);
  CHECK(azure[1].arrival_s == doctest::Approx(0.052).epsilon(1e-6));
  const auto requests = to_serve_requests(azure, 32000, 1);
  CHECK(requests[2].prompt.size() == 110);
  CHECK(requests[2].max_new_tokens == 27);

  const std::string bad = scratch("bad_trace.csv");
  std::ofstream(bad) << "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.98,10,2\n2023-11-16 18:17:04,ten,3\n";
  CHECK_THROWS_WITH_AS(read_azure_trace(bad), doctest::Contains("bad_trace.csv:3:21: ContextTokens \"ten\""), Error);
  std::ofstream(bad) << "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-13-16 18:17:03,10,2\n";
  CHECK_THROWS_WITH_AS(read_azure_trace(bad), doctest::Contains("bad_trace.csv:2:1: TIMESTAMP"), Error);
  std::ofstream(bad) << "when,ContextTokens\n1,2\n";
  CHECK_THROWS_WITH_AS(read_azure_trace(bad), doctest::Contains("lacks TIMESTAMP GeneratedTokens"), Error);
  CHECK_THROWS_WITH_AS(read_azure_trace(scratch("missing.csv")), doctest::Contains("cannot open"), Error);
}

TEST_CASE("model shapes: Mixtral-8x7B and 8x22B, Qwen2-57B-A14B and DeepSeek-V2-Lite from config.json alone") {
  const auto shape = [](const std::string& name) {
    return read_model_shape((repo() / "data" / "model_shapes" / (name + ".json")).string());
  };
  const ModelShape m7 = shape("mixtral-8x7b");
  CHECK(m7.config.hidden == 4096);
  CHECK(m7.config.layers == 32);
  CHECK(m7.config.kv_heads == 8);
  CHECK(m7.config.moe.experts == 8);
  CHECK(m7.config.moe.top_k == 2);
  CHECK(m7.config.moe.expert_ffn == 14336);
  CHECK(m7.parameters() / 1e9 == doctest::Approx(46.7).epsilon(0.01));  // "46.7B parameters"
  const ModelShape m22 = shape("mixtral-8x22b");
  CHECK(m22.parameters() / 1e9 == doctest::Approx(140.6).epsilon(0.01));  // "141B"
  const ModelShape q = shape("qwen2-57b-a14b");
  CHECK(q.config.moe.experts == 64);
  CHECK(q.config.moe.top_k == 8);
  CHECK(q.config.moe.shared_width() == 20480);
  CHECK(q.parameters() / 1e9 == doctest::Approx(57.4).epsilon(0.01));  // "57B"
  const ModelShape ds = shape("deepseek-v2-lite");
  CHECK(ds.architecture == "DeepseekV2ForCausalLM");
  CHECK(!ds.config.is_moe(0));
  CHECK(ds.config.is_moe(1));
  CHECK(ds.config.moe.shared_width() == 2 * 1408);
  CHECK(ds.config.moe.top_k == 6);
  // Multi-head latent attention read as such (it was approximated as MHA, with a note saying so): its KV cache is the
  // compressed latent, 27 layers x (512 + 64) values per token, not 27 x 2 x 16 heads x 192.
  CHECK(ds.config.is_mla());
  CHECK(ds.note.empty());
  CHECK(ds.kv_bytes_per_token(2) == 27.0 * (512 + 64) * 2);
  CHECK(ds.parameters() / 1e9 == doctest::Approx(15.7).epsilon(0.01));  // "15.7B total parameters"
  CHECK_THROWS_WITH_AS(read_model_shape(scratch("nowhere.json")), doctest::Contains("does not exist"), Error);
}

TEST_CASE("clusters: built-in names and profile files; bad ones give clear errors") {
  CHECK(simulated_cluster("h100", 2).profile.name == "H100-SXM-80GB-x8");
  CHECK_THROWS_WITH_AS(simulated_cluster("h900", 2), doctest::Contains("no built-in profile \"h900\""), Error);
  CHECK_THROWS_WITH_AS(simulated_cluster(scratch("absent.json"), 2), doctest::Contains("no such file"), Error);
  const std::string bad = scratch("bad_cluster.json");
  std::ofstream(bad) << "{\"name\": \"x\", \"gemm\": 3}";
  CHECK_THROWS_WITH_AS(simulated_cluster(bad, 2), doctest::Contains("bad_cluster.json"), Error);
  std::ofstream(bad) << "{\"name\": ";
  CHECK_THROWS_WITH_AS(simulated_cluster(bad, 2), doctest::Contains("bad_cluster.json"), Error);
  CHECK_THROWS_WITH_AS(simulated_cluster("h100", 3), doctest::Contains("expected 2 (bf16) or 4"), Error);
}

}  // namespace simulation_test
