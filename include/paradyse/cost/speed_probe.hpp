// paradyse/cost/speed_probe.hpp: how fast this machine runs now against the profile it was calibrated into.
//
//   profile.probe_baseline = slowdown_of(calibration_samples, profile);   // once, at calibration
//   const double s = slowdown_against_baseline(probe_slowdown<ops::Cpu>(comm, probe, profile), profile);  // 1: as then
//
// A shared machine's speed moves while its profile does not (docs/serving_simulation.md: the same decode step 0.89 ms
// in one 5-second round, 1.39 ms two rounds later, in thread CPU time; docs/trainer_validation.md: a training step's
// prediction 0.81-0.91 of its measurement in the run after one at 0.99-1.09, neither code nor load changed). The
// probe times GEMM shapes (cost::time_gemm_shape, as the profile's GEMMs were calibrated) on every rank at once and
// returns the median over the shapes of measured / the profile's price. It is measured apart from the work it then
// prices: a prediction times the slowdown is the prediction at the speed the machine ran, not a fit to the run.
// The workloads' shapes: serve/speed_probe.hpp (the served model's decode GEMMs); train_gpt --speed-probe (the
// calibration's compute-bound GEMMs, Calibration::gemm_samples its baseline: their median was 1.02x the single fit's
// price on this machine's train_gpt profile).
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/statistics.hpp"
#include "paradyse/cost/calibrate.hpp"
#include "paradyse/cost/profile.hpp"

#include <utility>
#include <vector>

namespace paradyse::cost {

// measured / priced, the median over the samples (the profile's GEMM model at the samples' shapes, 4-byte floats).
inline double slowdown_of(const std::vector<GemmSample>& samples, const HardwareProfile& profile) {
  check(!samples.empty(), "slowdown_of: no samples");
  std::vector<double> r;
  for (const GemmSample& x : samples) {
    const double priced = profile.gemm.time(double(x.m), double(x.n), double(x.k), int(sizeof(float)));
    check(priced > 0, "slowdown_of: the profile prices gemm {}x{}x{} at {} s", x.m, x.n, x.k, priced);
    r.push_back(x.seconds / priced);
  }
  return median(std::move(r));
}

// A probe's reading (probe_slowdown) as the machine's speed against the calibration: over the profile's baseline
// (HardwareProfile::probe_baseline: the probe's reading of the calibration's own samples of its shapes, so that the
// fit's error on them cancels) where it has one, as it is where not.
inline double slowdown_against_baseline(double reading, const HardwareProfile& profile) {
  return profile.probe_baseline > 0 ? reading / profile.probe_baseline : reading;
}

// The probe's slowdown now (time_gemm_shape on each shape). Every rank calls it (SPMD) and gets the same value.
template <class Backend = ops::Cpu, Communicator C>
double probe_slowdown(C& comm, const GemmClassOptions& probe, const HardwareProfile& profile) {
  std::vector<GemmSample> samples;
  for (const auto& shape : probe.shapes) samples.push_back(time_gemm_shape<Backend>(comm, probe, shape));
  return slowdown_of(samples, profile);
}

}  // namespace paradyse::cost
