// paradyse/plan/memory_cap.hpp: the default per-rank memory cap of a GPT run (train_gpt without --cap-mib): from the
// memory model, between what all-METP and all-MegatronTS need at the longest length, so that the longest inputs fit
// with METP (with room) but not with MegatronTS, and the planner has to switch.
#pragma once

#include "paradyse/cost/dry_run.hpp"

#include <cstdint>

namespace paradyse::plan {

// The predicted peaks at the longest length and the cap between them.
struct DefaultCap {
  std::int64_t metp_peak = 0;  // all-METP's predicted peak per rank
  std::int64_t ts_peak = 0;    // all-MegatronTS's
  std::int64_t cap = 0;        // a quarter of the way from METP's to MegatronTS's, rounded up to a MiB
};

// `costs`: a plan/gpt_costs.hpp GptCosts (uniform_peak per strategy of the default catalog) at `max_len` tokens.
template <class Costs>
DefaultCap default_memory_cap(const Costs& costs, std::int64_t max_len) {
  constexpr std::int64_t kMiB = std::int64_t(1) << 20;
  DefaultCap out;
  out.metp_peak = costs.uniform_peak(max_len, cost::default_catalog().index_of("METP"));
  out.ts_peak = costs.uniform_peak(max_len, cost::default_catalog().index_of("MegatronTS"));
  // METP fits with room; MegatronTS needs more from ~60% of max-len on.
  out.cap = (out.metp_peak + (out.ts_peak - out.metp_peak) / 4 + kMiB - 1) / kMiB * kMiB;
  return out;
}

}  // namespace paradyse::plan
