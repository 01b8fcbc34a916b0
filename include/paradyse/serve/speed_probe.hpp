// paradyse/serve/speed_probe.hpp: how fast this machine runs now against the profile it was calibrated into, on the
// served model's decode GEMMs (the probe itself: cost/speed_probe.hpp).
//
//   cost::GemmClassOptions probe = speed_probe_options(c, ranks, profile_classes);  // the decode GEMMs
//   const double s = cost::probe_slowdown<ops::Cpu>(comm, probe, profile);  // measured / priced (1: as calibrated)
//   SimulatedClock clock(c, cluster);  clock.set_slowdown(s);           // the simulation at the machine's speed now
//
// Why: a shared machine's speed moves while its profile does not. On the 2-core machine of docs/serving_simulation.md
// (two cores of a host that other virtual machines share) the same one-token decode step of the synthetic MoE took
// 0.89 ms in one 5-second round and 1.39 ms two rounds later, rank 0's thread CPU time 0.72 and 1.26 ms: the cores
// themselves ran slower, so neither clock is immune. A round's TPOT p50 followed its speed (1.56 ms in the fast round,
// 2.95 in the slow one; simulated 1.63), and the rounds' spread (40-70%) was larger than the validation's bound.
// The probe times the served model's decode GEMMs (rows 1, 4 and 16 against every weight a step reads, each cycling
// through the same weight copies as the profile's GEMM classes were calibrated on, so that a machine at its
// calibrated speed measures 1 up to the classes' fit error) on every rank at once, and returns the median over the
// shapes of measured / the profile's price. It is measured apart from the steps it then prices (before and after a
// round): the simulation is not fitted to the run it is compared with; it is told how fast the machine ran.
#pragma once

#include "paradyse/cost/calibrate.hpp"
#include "paradyse/cost/speed_probe.hpp"
#include "paradyse/serve/serving_calibration.hpp"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace paradyse::serve {

// The probe's shapes: the decode rows (1, 4, 16) of serving_gemm_shapes, with `like`'s clock and weight copies (the
// options the profile's classes were calibrated with), one timed pass each after an untimed one.
inline cost::GemmClassOptions speed_probe_options(const DecoderConfig& c, int ranks, const cost::GemmClassOptions& like) {
  cost::GemmClassOptions o = like;
  o.repetitions = 1;
  o.shapes.clear();
  for (const auto& s : serving_gemm_shapes(c, ranks, 16))
    if (s[0] == 1 || s[0] == 4 || s[0] == 16) o.shapes.push_back(s);
  return o;
}

}  // namespace paradyse::serve
