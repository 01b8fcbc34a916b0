// paradyse/serve/speed_probe.hpp: how fast this machine runs now against the profile it was calibrated into, on the
// served model's decode GEMMs (the probe itself: cost/speed_probe.hpp).
//
//   cost::GemmClassOptions probe = speed_probe_options(c, ranks, profile_classes);  // the decode GEMMs
//   profile.serving_probe_baseline = probe_baseline(comm, probe, profile);  // once, right after calibrating
//   const double s = serving_slowdown(comm, probe, profile);            // now / then (1: as calibrated)
//   SimulatedClock clock(c, cluster);  clock.set_slowdown(s);           // the simulation at the machine's speed now
//
// Why: a shared machine's speed moves while its profile does not. On the 2-core machine of docs/serving_simulation.md
// (two cores of a host that other virtual machines share) the same one-token decode step of the synthetic MoE took
// 0.89 ms in one 5-second round and 1.39 ms two rounds later, rank 0's thread CPU time 0.72 and 1.26 ms: the cores
// themselves ran slower, so neither clock is immune. A round's TPOT p50 followed its speed (1.56 ms in the fast round,
// 2.95 in the slow one; simulated 1.63), and the rounds' spread (40-70%) was larger than the validation's bound.
// The probe times the served model's decode GEMMs (rows 1, 4 and 16 against every weight a step reads, each cycling
// through the same weight copies as the profile's GEMM classes were calibrated on) on every rank at once, and takes
// the median over the shapes of measured / the profile's price. It is measured apart from the steps it then prices
// (before and after a round): the simulation is not fitted to the run it is compared with; it is told how fast the
// machine ran.
// Why a baseline: the raw reading is not 1 on the machine that was just calibrated. Right after the trained 4-layer
// MoE's calibration it read 1.12-1.16 (one timed pass a shape) and 1.09-1.10 (the fastest of three): the classes' fit
// on the probe's shapes and the probe's statistic (one pass, against the calibration's median of passes) are
// themselves a few percent to fifteen off. So the profile keeps the probe's reading right after calibrating
// (HardwareProfile::serving_probe_baseline, the median of three) and a later reading is taken over it.
#pragma once

#include "paradyse/core/statistics.hpp"
#include "paradyse/cost/calibrate.hpp"
#include "paradyse/cost/speed_probe.hpp"
#include "paradyse/serve/serving_calibration.hpp"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace paradyse::serve {

// The probe's shapes: the decode rows (1, 4, 16) of serving_gemm_shapes, with `like`'s clock and weight copies (the
// options the profile's classes were calibrated with), the fastest of three timed passes each after an untimed one
// (as a class's sample is timed; one pass read 2-6% slower, its three readings four times as spread).
inline cost::GemmClassOptions speed_probe_options(const DecoderConfig& c, int ranks, const cost::GemmClassOptions& like) {
  cost::GemmClassOptions o = like;
  o.repetitions = 3;
  o.shapes.clear();
  for (const auto& s : serving_gemm_shapes(c, ranks, 16))
    if (s[0] == 1 || s[0] == 4 || s[0] == 16) o.shapes.push_back(s);
  return o;
}

// A probe's reading (cost::probe_slowdown) as the machine's speed against the calibration: over the profile's
// baseline where it has one, as it is where not.
inline double slowdown_against_baseline(double reading, const cost::HardwareProfile& profile) {
  return profile.serving_probe_baseline > 0 ? reading / profile.serving_probe_baseline : reading;
}

// The machine's speed now against `profile`'s calibration (1: as calibrated). Every rank calls it (SPMD).
template <class Backend = ops::Cpu, Communicator C>
double serving_slowdown(C& comm, const cost::GemmClassOptions& probe, const cost::HardwareProfile& profile) {
  return slowdown_against_baseline(cost::probe_slowdown<Backend>(comm, probe, profile), profile);
}

// The probe's baseline for a profile just calibrated (its GEMM classes in place): the median of `readings` raw
// readings. Every rank calls it (SPMD).
template <class Backend = ops::Cpu, Communicator C>
double probe_baseline(C& comm, const cost::GemmClassOptions& probe, const cost::HardwareProfile& profile, int readings = 3) {
  check(readings >= 1, "probe_baseline: readings = {} must be >= 1", readings);
  std::vector<double> r;
  for (int i = 0; i < readings; ++i) r.push_back(cost::probe_slowdown<Backend>(comm, probe, profile));
  return median(r);
}

}  // namespace paradyse::serve
