// paradyse/serve/named_policies.hpp: the engine's layout policies by name, as the serving example and the policy
// benchmark offer them: static TP, static EP, EP + EPLB (the vLLM baselines), EP + token sorting, EP + on-demand
// expert loading from the owning rank, and dynamic TP<->EP switching.
//
//   const std::vector<NamedPolicy> all = standard_policies(measure_machine_rates(config.moe, ranks));
//   const std::vector<NamedPolicy> chosen = select_policies(all, "tp,dynamic");   // in the order above
#pragma once

#include "paradyse/serve/engine.hpp"

#include <algorithm>
#include <string>
#include <vector>

namespace paradyse::serve {

struct NamedPolicy {
  std::string key, name;  // "eplb", "EP + EPLB"
  EnginePolicy policy;
};

inline constexpr const char* kPolicyKeys = "tp,ep,eplb,sort,ondemand,dynamic";

// Every policy, each with `rates` (the dynamic policy's switching costs, and every policy's predicted step costs).
// EPLB rebalances every 32 steps; dynamic switches when the time model's other layout is 10% cheaper for 2 steps in a
// row and those steps' savings pay for the switch, at least 8 steps after the last switch (SwitchPolicy).
inline std::vector<NamedPolicy> standard_policies(const MachineRates& rates) {
  EnginePolicy tp, ep, eplb, sort, ondemand, dyn;
  ep.mode = ModePolicy::static_ep;
  eplb.mode = ModePolicy::static_ep;
  eplb.eplb = true;
  eplb.eplb_interval = 32;
  sort.mode = ModePolicy::static_ep;
  sort.token_sorting = true;
  ondemand.mode = ModePolicy::static_ep;
  ondemand.on_demand = true;
  dyn.mode = ModePolicy::dynamic;
  dyn.switching = {0.1, 2, 8, 32, true};
  std::vector<NamedPolicy> all{{"tp", "static TP", tp},          {"ep", "static EP", ep},
                               {"eplb", "EP + EPLB", eplb},      {"sort", "EP + token sorting", sort},
                               {"ondemand", "EP + on-demand", ondemand}, {"dynamic", "dynamic TP/EP", dyn}};
  for (NamedPolicy& n : all) n.policy.rates = rates;
  return all;
}

// The policies of `all` whose keys are in the comma-separated `keys`, in all's order (empty when none is).
// Throws unless `keys` is a comma-separated list of names from kPolicyKeys, naming the first that is not (a typo
// such as "tp,dynamc" must not quietly run tp alone).
inline void check_policy_keys(const std::string& keys) {
  const std::string known = std::string(",") + kPolicyKeys + ",";
  std::size_t from = 0;
  while (true) {
    const std::size_t comma = std::min(keys.find(',', from), keys.size());
    const std::string key = keys.substr(from, comma - from);
    check(!key.empty() && known.find("," + key + ",") != std::string::npos,
          "policies \"{}\": {} policy; expected a comma-separated subset of {}", keys,
          key.empty() ? std::string("an empty") : fmt::format("unknown \"{}\"", key), kPolicyKeys);
    if (comma == keys.size()) return;
    from = comma + 1;
  }
}

inline std::vector<NamedPolicy> select_policies(const std::vector<NamedPolicy>& all, const std::string& keys) {
  check_policy_keys(keys);
  std::vector<NamedPolicy> selected;
  for (const NamedPolicy& n : all)
    if (("," + keys + ",").find("," + n.key + ",") != std::string::npos) selected.push_back(n);
  return selected;
}

}  // namespace paradyse::serve
