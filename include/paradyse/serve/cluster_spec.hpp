// paradyse/serve/cluster_spec.hpp: the cluster a simulated engine runs on, by name or file: a built-in profile
// (cost/builtin_profiles.hpp: A100-SXM4-80GB-x8, H100-SXM-80GB-x8, H200-SXM-141GB-x8, or a100 / h100 / h200: the
// datasheet rates of an 8-GPU NVLink/NVSwitch node with InfiniBand between nodes), or a hardware profile JSON file
// (cost/profile_json.hpp; what `calibrate` writes for the machine at hand). Ranks beyond devices_per_node use the
// inter-node links. Errors name the file and what is wrong. machine_rates_of gives the dynamic policy's switcher
// (serve/switch_policy.hpp) the cluster's rates.
#pragma once

#include "paradyse/cost/builtin_profiles.hpp"
#include "paradyse/cost/profile_json.hpp"
#include "paradyse/serve/step_cost.hpp"
#include "paradyse/serve/switch_policy.hpp"

#include <filesystem>
#include <string>

namespace paradyse::serve {

inline SimulatedCluster simulated_cluster(const std::string& spec, int dtype_bytes) {
  check(dtype_bytes == 2 || dtype_bytes == 4, "cluster {}: dtype of {} bytes; expected 2 (bf16) or 4 (float)", spec,
        dtype_bytes);
  SimulatedCluster c;
  c.dtype_bytes = dtype_bytes;
  if (spec.size() > 5 && spec.substr(spec.size() - 5) == ".json") {
    check(std::filesystem::exists(spec), "cluster {}: no such file (a hardware profile JSON, cost/profile_json.hpp)",
          spec);
    try {
      c.profile = cost::load_profile(spec);
    } catch (const std::exception& e) {
      throw Error(fmt::format("cluster {}: {}", spec, e.what()));
    }
  } else {
    c.profile = cost::builtin_profile(spec);
  }
  check(c.profile.gemm.flops_per_s > 0 && c.profile.intra_node.p2p_bytes_per_s > 0,
        "cluster {}: the profile needs a positive GEMM rate and link bandwidth", spec);
  return c;
}

// The switcher's rates for the cluster: its GEMM rate; the weight bandwidth scaled by 4 / dtype bytes (the switcher
// counts float weights); the half-rate width of the GemmModel's operand term: for m rows and n columns of depth k
// the time per flop is 1 / F + b (1/n + 1/m + 1/k) / (2 B), so in n alone the rate halves at n = F b / (2 B).
inline MachineRates machine_rates_of(const SimulatedCluster& c) {
  const cost::GemmModel& g = c.profile.gemm;
  MachineRates r;
  r.flops_per_s = g.flops_per_s;
  r.memory_bytes_per_s = g.bytes_per_s > 0 ? g.bytes_per_s * 4.0 / c.dtype_bytes : c.profile.elementwise_bytes_per_s;
  r.half_rate_columns = g.bytes_per_s > 0 ? g.flops_per_s * c.dtype_bytes / (2 * g.bytes_per_s) : 0.0;
  return r;
}

}  // namespace paradyse::serve
