// paradyse/serve/speed_probe.hpp: how fast this machine runs now against the profile it was calibrated into, on the
// served model's decode GEMMs (the probe itself: cost/speed_probe.hpp).
//
//   cost::GemmClassOptions probe = speed_probe_options(c, ranks, profile_classes);  // the decode GEMMs
//   profile.probe_baseline = probe_baseline(classes.samples, probe, profile);  // once, at calibration
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
// Why a baseline: the raw reading is not 1 on the machine that was just calibrated: the classes' fit is a few to
// fifteen percent off on the probe's shapes (the trained 4-layer MoE's probe read 1.09-1.16 seconds after its
// calibration). So the profile keeps the probe's reading of the calibration itself (HardwareProfile::probe_baseline:
// measured / priced over the calibration's own samples of the probe's shapes, which the classes' shapes include), and
// a later reading is taken over it (cost::slowdown_against_baseline). Taken from those samples rather than from a probe
// run after them: a probe seconds later read 1.59 once on the synthetic MoE (the shared L3 or the host's other tenants
// had turned slow in between), a baseline that would have set every later reading a third too fast.
#pragma once

#include "paradyse/cost/calibrate.hpp"
#include "paradyse/cost/speed_probe.hpp"
#include "paradyse/serve/serving_calibration.hpp"

#include <algorithm>
#include <array>
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

// The machine's speed now against `profile`'s calibration (1: as calibrated). Every rank calls it (SPMD).
template <class Backend = ops::Cpu, Communicator C>
double serving_slowdown(C& comm, const cost::GemmClassOptions& probe, const cost::HardwareProfile& profile) {
  return cost::slowdown_against_baseline(cost::probe_slowdown<Backend>(comm, probe, profile), profile);
}

// The probe's baseline for a profile just calibrated: its reading of the calibration's own samples (calibrate_gemm_
// classes' GemmClassCalibration::samples) of the probe's shapes against the profile's classes fitted on them.
inline double probe_baseline(const std::vector<cost::GemmSample>& calibration, const cost::GemmClassOptions& probe,
                             const cost::HardwareProfile& profile) {
  std::vector<cost::GemmSample> probed;
  for (const cost::GemmSample& x : calibration)
    if (std::find(probe.shapes.begin(), probe.shapes.end(), std::array<std::int64_t, 3>{x.m, x.n, x.k}) != probe.shapes.end())
      probed.push_back(x);
  check(!probed.empty(), "probe_baseline: the calibration's {} samples hold none of the probe's {} shapes",
        calibration.size(), probe.shapes.size());
  return cost::slowdown_of(probed, profile);
}

}  // namespace paradyse::serve
