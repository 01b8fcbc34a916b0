// paradyse/serve/speed_probe.hpp: how fast this machine runs now against the profile it was calibrated into.
//
//   cost::GemmClassOptions probe = speed_probe_options(c, ranks, profile_classes);  // the decode GEMMs
//   const double s = probe_slowdown<ops::Cpu>(comm, probe, profile);   // measured / priced now (1: as calibrated)
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

// measured / priced, the median over the samples (the profile's GEMM model at the samples' shapes, 4-byte floats).
inline double slowdown_of(const std::vector<cost::GemmSample>& samples, const cost::HardwareProfile& profile) {
  check(!samples.empty(), "slowdown_of: no samples");
  std::vector<double> r;
  for (const cost::GemmSample& x : samples) {
    const double priced = profile.gemm.time(double(x.m), double(x.n), double(x.k), int(sizeof(float)));
    check(priced > 0, "slowdown_of: the profile prices gemm {}x{}x{} at {} s", x.m, x.n, x.k, priced);
    r.push_back(x.seconds / priced);
  }
  std::sort(r.begin(), r.end());
  const std::size_t n = r.size();
  return n % 2 ? r[n / 2] : 0.5 * (r[n / 2 - 1] + r[n / 2]);
}

// The probe's slowdown now (cost::time_gemm_shape on each shape). Every rank calls it (SPMD) and gets the same value.
template <class Backend = ops::Cpu, Communicator C>
double probe_slowdown(C& comm, const cost::GemmClassOptions& probe, const cost::HardwareProfile& profile) {
  std::vector<cost::GemmSample> samples;
  for (const auto& shape : probe.shapes) samples.push_back(cost::time_gemm_shape<Backend>(comm, probe, shape));
  return slowdown_of(samples, profile);
}

}  // namespace paradyse::serve
