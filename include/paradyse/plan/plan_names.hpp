// paradyse/plan/plan_names.hpp: a plan as train_gpt's per-step tables name it, "attention/ffn" per layer, layers apart by
// a space: compact (each strategy by the capitals of its name, "MegatronTS" -> "MTS": "MTS/MTS UZ/METP") for the
// printed tables, or in full names for the CSV. The dense GPT's plans (plan::Plan) and the MoE GPT's (plan::MoePlan:
// the FFN's strategy, "EP" or "ETP" for an MoE layer).
#pragma once

#include "paradyse/plan/moe_plan.hpp"
#include "paradyse/plan/planner.hpp"

#include <fmt/format.h>

#include <cctype>
#include <string>
#include <string_view>

namespace paradyse::plan {

// The capitals of a strategy's name: "MegatronTS" -> "MTS", "ExpertParallel" -> "EP".
inline std::string initials(std::string_view name) {
  std::string out;
  for (char c : name)
    if (std::isupper(static_cast<unsigned char>(c))) out += c;
  return out;
}

// "MTS/MTS UZ/METP": each layer's attention/mlp strategy by its initials.
inline std::string compact_plan(const Plan& plan) {
  std::string out;
  for (const auto& layer : plan.layers)
    out += fmt::format("{}{}/{}", out.empty() ? "" : " ", initials(plan.strategy_name(layer.strategies.attention)),
                       initials(plan.strategy_name(layer.strategies.mlp)));
  return out;
}

// "MegatronTS/MegatronTS UlyssesZ/METP": each layer's attention/mlp strategy by its full name.
inline std::string full_plan(const Plan& plan) {
  std::string out;
  for (const auto& layer : plan.layers)
    out += fmt::format("{}{}/{}", out.empty() ? "" : " ", plan.strategy_name(layer.strategies.attention),
                       plan.strategy_name(layer.strategies.mlp));
  return out;
}

// "MTS/MTS MTS/EP": each layer's attention strategy, then its FFN's (the dense MLP's, or the MoE layer's EP or ETP).
inline std::string compact_plan(const MoePlan& plan) {
  std::string out;
  for (const MoeLayerPlan& l : plan.layers)
    out += fmt::format("{}{}/{}", out.empty() ? "" : " ", initials(plan.strategy_names.at(std::size_t(l.attention))),
                       initials(plan.ffn_name(l)));
  return out;
}

}  // namespace paradyse::plan
