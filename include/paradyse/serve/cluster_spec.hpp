// paradyse/serve/cluster_spec.hpp: the cluster a simulated engine runs on, by name or file: a built-in profile
// (cost/builtin_profiles.hpp: A100-SXM4-80GB-x8, H100-SXM-80GB-x8, H200-SXM-141GB-x8, or a100 / h100 / h200: the
// datasheet rates of an 8-GPU NVLink/NVSwitch node with InfiniBand between nodes), or a hardware profile JSON file
// (cost/profile_json.hpp; what `calibrate` writes for the machine at hand). Ranks beyond devices_per_node use the
// inter-node links. Errors name the file and what is wrong. The cluster is the simulated clock's time model and the
// dynamic policy's (EnginePolicy::time_model).
#pragma once

#include "paradyse/cost/builtin_profiles.hpp"
#include "paradyse/cost/profile_json.hpp"
#include "paradyse/serve/step_cost.hpp"

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
      throw Error(fmt::format("cluster {}: {}", spec, error_reason(e)));
    }
  } else {
    c.profile = cost::builtin_profile(spec);
  }
  check(c.profile.gemm.flops_per_s > 0 && c.profile.intra_node.p2p_bytes_per_s > 0,
        "cluster {}: the profile needs a positive GEMM rate and link bandwidth", spec);
  return c;
}

}  // namespace paradyse::serve
