// paradyse/cost/gemm_engines.hpp: a calibrated CPU profile's GEMM engines (ops/cpu/gemm_choice.hpp), to and from
// the process's choice.
//
// A calibrated profile's GEMM rates hold for the engines the calibration ran (OpenBLAS or the built-in kernel, per
// size class), and so does the dry run's count of a step: a built-in GEMM packs its operands into a workspace (an
// allocation the time model prices), OpenBLAS's packing is its own. So a program that plans or runs with a
// calibrated profile makes the profile's engines its own first (use_gemm_engines): train_gpt, plan_trace and
// moe_simulate then price and run the same steps on one profile, whichever engine their own processes measured.
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/cost/profile.hpp"
#include "paradyse/ops/cpu/gemm_choice.hpp"

#include <algorithm>
#include <string>
#include <vector>

namespace paradyse::cost {

// The GEMM choice of `measurement` in a profile's terms, and back.
inline std::vector<GemmEngineChoice> gemm_engine_choices(const ops::cpu::GemmMeasurement& measurement) {
  std::vector<GemmEngineChoice> result;
  for (const ops::cpu::GemmSizeClass c : ops::cpu::kAllGemmSizeClasses) {
    const auto i = std::size_t(c);
    result.push_back({std::string(ops::cpu::name_of(c)), std::string(ops::cpu::name_of(measurement.engine[i])),
                      measurement.cblas_flops_per_s[i], measurement.fallback_flops_per_s[i]});
  }
  return result;
}

// Makes gemm() use the engines `profile` was calibrated with (process-wide; a calibrated profile loaded from a file
// saves the first GEMM's measurement and keeps the choice of the calibration run). A profile without a choice
// (built-in, or calibrated before the choice was recorded) changes nothing; one that chose CBLAS in a build without
// it is an Error naming the class.
inline void use_gemm_engines(const HardwareProfile& profile) {
  if (profile.gemm_engines.empty()) return;
  ops::cpu::GemmMeasurement m;
  for (const ops::cpu::GemmSizeClass c : ops::cpu::kAllGemmSizeClasses) {
    const auto i = std::size_t(c);
    const auto entry = std::find_if(profile.gemm_engines.begin(), profile.gemm_engines.end(),
                                    [&](const GemmEngineChoice& e) { return e.size_class == ops::cpu::name_of(c); });
    check(entry != profile.gemm_engines.end(), "use_gemm_engines: profile \"{}\" has no GEMM engine for {} GEMMs",
          profile.name, ops::cpu::name_of(c));
    check(entry->engine == "fallback" || ops::cpu::kGemmUsesCblas,
          "use_gemm_engines: profile \"{}\" chose cblas for {} GEMMs but this build has no CBLAS", profile.name,
          ops::cpu::name_of(c));
    m.engine[i] = entry->engine == "cblas" ? ops::cpu::GemmEngine::cblas : ops::cpu::GemmEngine::fallback;
    m.cblas_flops_per_s[i] = entry->cblas_flops_per_s;
    m.fallback_flops_per_s[i] = entry->fallback_flops_per_s;
  }
  ops::cpu::set_gemm_measurement(m);
}

}  // namespace paradyse::cost
