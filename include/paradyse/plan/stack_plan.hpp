// paradyse/plan/stack_plan.hpp: from the planner to the model: a plan as the layer stack's StackPlan
// (model/stack.hpp), and the planner's ModelConfig of a model LayerConfig.
//
//   const plan::ModelConfig model = plan::model_config_of(layer, layers);
//   const plan::Plan best = plan::plan_exact(model, profile, p, plan::Batch::single(s), budget);
//   stack.forward(comm, pool, plan::stack_plan<AllStrategies<>>(best), s, x, out);
#pragma once

#include "paradyse/cost/from_config.hpp"
#include "paradyse/contract/layer_config.hpp"
#include "paradyse/model/stack.hpp"
#include "paradyse/plan/cost_table.hpp"
#include "paradyse/plan/planner.hpp"

#include <string>

namespace paradyse::plan {

// `layers` layers of `config`; activations of `dtype_bytes` bytes (4: the CPU backend's float32); model states of
// `precision` (the CPU stack keeps float32 weights and gradients, no optimizer state).
inline ModelConfig model_config_of(const LayerConfig& config, int layers, int dtype_bytes = 4,
                                   cost::TrainingPrecision precision = {4, 4, 0}) {
  ModelConfig m = ModelConfig::uniform(cost::shape_of(config, 1, 1, dtype_bytes), layers);
  m.precision = precision;
  return m;
}

// The stack's per-layer choices (indices into the strategy list `Strategies`) of a plan.
template <class Strategies>
StackPlan stack_plan(const Plan& plan) {
  StackPlan out;
  for (const LayerPlan& layer : plan.layers)
    out.push_back({Strategies::index_of(plan.strategy_name(layer.strategies.attention)),
                   Strategies::index_of(plan.strategy_name(layer.strategies.mlp))});
  return out;
}

}  // namespace paradyse::plan
