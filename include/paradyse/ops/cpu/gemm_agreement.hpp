// paradyse/ops/cpu/gemm_agreement.hpp: every rank of a multi-process job runs rank 0's GEMM engines.
//
// gemm_choice.hpp measures the engines once per process (or reads its cache). Processes of one job that measure on
// their own, while other work shares the cores, may choose differently, and then ranks that must agree to the bit
// (replicas, a resumed run against its original) round differently. agree_gemm_engines(world) makes rank 0's choice
// (measured, cached or forced by $PARADYSE_GEMM there) every rank's: collective over `world`, once, before the first
// step. With thread ranks all ranks share one process and one choice already; the call then changes nothing.
#pragma once

#include "paradyse/ops/cpu/gemm_choice.hpp"

#include <array>
#include <cstddef>
#include <span>

namespace paradyse::ops::cpu {

template <class Comm>
void agree_gemm_engines(Comm& world) {
  // Per size class: engine (0 cblas, 1 fallback), then the two measured rates.
  std::array<double, 3 * kGemmSizeClasses> packed{};
  if (world.rank() == 0) {
    const GemmMeasurement m = gemm_measurement();
    for (std::size_t i = 0; i < kGemmSizeClasses; ++i)
      packed[3 * i] = double(m.engine[i]), packed[3 * i + 1] = m.cblas_flops_per_s[i],
      packed[3 * i + 2] = m.fallback_flops_per_s[i];
  }
  world.broadcast(std::span<double>(packed), 0);
  if (world.rank() == 0) return;
  GemmMeasurement m;
  for (std::size_t i = 0; i < kGemmSizeClasses; ++i) {
    m.engine[i] = GemmEngine(int(packed[3 * i]));
    m.cblas_flops_per_s[i] = packed[3 * i + 1];
    m.fallback_flops_per_s[i] = packed[3 * i + 2];
  }
  set_gemm_measurement(m);
}

}  // namespace paradyse::ops::cpu
