// tests/serve/launch_per_expert.hpp: the built-in H100 node with every expert GEMM a launch of its own, as an engine
// without a grouped expert GEMM runs there: the trade-off the dynamic policy's scenario tests drive the switcher
// through.
//
// On the built-in profile an MoE layer's expert GEMMs are one grouped launch per projection (ops/cpu/gemm_grouped.hpp,
// cost/builtin_profiles.hpp), and under Zipf 0.5 routing Mixtral-8x7B's TP decode steps on 8 ranks cost 1-10% less
// than EP's from 16 to 1024 tokens: no crossover for a switcher to find (docs/serving_simulation.md, stop 62).
// Charging each expert's GEMMs their 6 us launch (TP runs every routed expert's slice on every rank, EP only its own
// experts') puts TP above EP from 4 tokens on and below it at one: the scenarios these tests were built on.
#pragma once

#include "paradyse/serve/cluster_spec.hpp"

namespace serve_scenarios {

inline paradyse::serve::SimulatedCluster h100_launch_per_expert() {
  paradyse::serve::SimulatedCluster c = paradyse::serve::simulated_cluster("h100", 2);
  c.profile.gemm.grouped_item_s.reset();
  return c;
}

}  // namespace serve_scenarios
