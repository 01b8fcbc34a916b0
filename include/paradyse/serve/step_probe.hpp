// paradyse/serve/step_probe.hpp: how the engine's steps run now against the price the simulated clock gives them: a
// short burst of requests served on the synchronised CPU clock (serve/clock.hpp CpuClock), each step's measured time
// over the time model's price of its trace: the slowdown at which the simulated clock charges those steps what they
// took, for the steps with a prompt chunk and for those of decode tokens alone (serve/clock.hpp StepSlowdown).
//
//   run_ranks(p, [&](ThreadCommunicator& plain) {
//     const ServedSteps s = serve_on_cpu_clock(std::move(plain), model, requests, options, policy);  // every rank
//     if (!s.traces.empty()) slowdown = step_slowdown(s, priced).by_kind;                    // rank 0 holds them
//   });
//   SimulatedClock clock(c, cluster);  clock.set_slowdown(slowdown);  // the simulation at the engine's speed now
//
// Why a probe of whole steps beside the GEMM probe (serve/speed_probe.hpp): on the shared 2-core machine of
// docs/serving_simulation.md the engine's steps were priced at 0.71-1.02x their measured time from one run to the
// next while the GEMM probe read the machine at its calibrated speed in both (the GEMMs alone, timed apart, do not see
// what moves: the weights' residency in an L3 that other tenants share, the calls and waits between the kernels).
// The burst is served apart from the requests it then prices, by the same engine, policy and clock, so the
// simulation is not fitted to the run it is compared with: it is told how fast the engine's steps ran around it, and
// the time model still decides how each step's cost follows its batch, KV lengths, layout and expert loads, and the
// engine's scheduling on the simulated clock decides the latencies.
// The calibration's own served run (moe_simulate --measure) takes each step's ratio (step_price_ratios) for the
// profile's step_jitter (serve/serving_calibration.hpp step_jitter_quantiles).
#pragma once

#include "paradyse/comm/cpu_marks.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/serve/clock.hpp"
#include "paradyse/serve/engine.hpp"

#include <numeric>
#include <utility>
#include <vector>

namespace paradyse::serve {

// A run's steps on the synchronised CPU clock, on rank 0 (empty on the others).
struct ServedSteps {
  std::vector<StepTrace> traces;
  std::vector<StepTiming> timings;  // traces[i]'s time (StepTiming::step_s: its pieces at their slowest rank)
  std::vector<RequestOutcome> outcomes;
  EngineStats stats;
};

// Serves `requests` under `policy` on the synchronised CPU clock. Every rank calls it (SPMD) with its thread
// communicator, which it takes over (the clock marks its collectives).
inline ServedSteps serve_on_cpu_clock(ThreadCommunicator&& plain, const LoadedDecoder& model,
                                      const std::vector<ServeRequest>& requests, EngineOptions options,
                                      const EnginePolicy& policy) {
  CpuMarkedCommunicator comm(std::move(plain));
  CpuClock clock(CpuClock::synchronised_by(comm));
  ServedSteps out;
  if (comm.rank() == 0)
    clock.observer = [&](const StepTrace& t, const StepTiming& s, double) {
      out.traces.push_back(t), out.timings.push_back(s);
    };
  options.clock = &clock;
  std::vector<RequestOutcome> outcomes = serve_requests(comm, model, requests, options, policy, &out.stats);
  if (comm.rank() == 0) out.outcomes = std::move(outcomes);
  return out;
}

// Each step's price on `priced` (SimulatedClock::price: without the step jitter, times the clock's slowdown), the
// steps in turn from no weight reads, as the clock advancing through them would price them.
inline std::vector<double> step_prices(const ServedSteps& steps, SimulatedClock& priced) {
  check(steps.traces.size() == steps.timings.size(), "step_prices: {} traces for {} timings", steps.traces.size(),
        steps.timings.size());
  std::vector<double> prices;
  std::vector<cost::WeightReads> reads;
  for (const StepTrace& trace : steps.traces) {
    prices.push_back(priced.price(trace, reads).total_s());
    check(prices.back() > 0, "step_prices: step {} is priced at {} s", prices.size() - 1, prices.back());
  }
  return prices;
}

// Each step's measured time over its price on `priced`.
inline std::vector<double> step_price_ratios(const ServedSteps& steps, SimulatedClock& priced) {
  std::vector<double> ratios = step_prices(steps, priced);
  for (std::size_t i = 0; i < ratios.size(); ++i) ratios[i] = steps.timings[i].step_s / ratios[i];
  return ratios;
}

// What the probe reads: the slowdown at which `priced` charges these steps, in expectation, the time they took, for
// each kind of step (StepSlowdown: those with a prompt chunk, those of decode tokens alone) and for all together: the
// steps' measured time over their price, both summed (time-weighted, as a run's latencies add up its steps), over the
// mean factor of the profile's step jitter (SimulatedClock draws one of HardwareProfile::step_jitter's quantiles for
// each step; they are taken around the calibration's median step, so their mean is a little over 1). 1: the steps run
// at their price. A kind the burst served no step of takes the factor of all.
struct StepProbeReading {
  StepSlowdown by_kind;  // what the simulated clock is set to (SimulatedClock::set_slowdown)
  double all = 1;        // one factor for every step (moe_simulate's rows "cpu @steps 1", for comparison)
};

inline StepProbeReading step_slowdown(const ServedSteps& steps, SimulatedClock& priced) {
  check(!steps.traces.empty(), "step_slowdown: the probe served no step");
  const std::vector<double> prices = step_prices(steps, priced);
  double measured[2] = {0, 0}, price[2] = {0, 0};  // [decode, prompt]
  for (std::size_t i = 0; i < prices.size(); ++i) {
    const int kind = steps.traces[i].has_prompt() ? 1 : 0;
    measured[kind] += steps.timings[i].step_s, price[kind] += prices[i];
  }
  const std::vector<double>& jitter = priced.cluster().profile.step_jitter;
  const double jitter_mean =
      jitter.empty() ? 1.0 : std::accumulate(jitter.begin(), jitter.end(), 0.0) / double(jitter.size());
  StepProbeReading r;
  r.all = (measured[0] + measured[1]) / (price[0] + price[1]) / jitter_mean;
  const auto of = [&](int kind) { return price[kind] > 0 ? measured[kind] / price[kind] / jitter_mean : r.all; };
  r.by_kind = {of(0), of(1)};
  return r;
}

}  // namespace paradyse::serve
