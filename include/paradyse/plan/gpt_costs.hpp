// paradyse/plan/gpt_costs.hpp: the planner's view of a GPT (model/gpt.hpp) on a group of p ranks.
//
// A GPT is its layer stack plus what the model holds outside it on every rank: the replicated embedding, final
// norm and LM head with their gradients and AdamW moments, the step's activations outside the stack (the chunked
// LM head's logits, the final norm's input and output) and the rank's tokens and targets. GptCosts turns that into
// the cost table the planner reads for an input of s tokens (every strategy's cost from its own dry run), and the
// predicted peak of a uniform plan (what a user needs to choose a memory cap).
#pragma once

#include "paradyse/cost/dry_run.hpp"
#include "paradyse/cost/profile.hpp"
#include "paradyse/model/gpt.hpp"
#include "paradyse/plan/planner.hpp"
#include "paradyse/plan/stack_plan.hpp"
#include "paradyse/strategy/sequence_layout.hpp"

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace paradyse::plan {

template <class Model>
struct GptCosts {
  GptConfig config;
  int ranks = 1;
  const cost::HardwareProfile* hardware = nullptr;
  const cost::StrategyCatalog* catalog = &cost::default_catalog();

  // The most tokens any rank holds for a sequence of s tokens.
  std::int64_t max_local_tokens(std::int64_t s) const {
    const SequenceLayout layout(s, ranks, config.layer.zigzag);
    std::int64_t n = 0;
    for (int r = 0; r < ranks; ++r) n = std::max(n, layout.local_length(r));
    return n;
  }
  // Replicated weights and states, the step's activations outside the stack, the rank's tokens and targets (of
  // `batch` sequences).
  std::int64_t extra_bytes(std::int64_t s, std::int64_t batch = 1) const {
    const std::int64_t n = max_local_tokens(s);
    return Model::replicated_state_bytes(config) + Model::activation_bytes(config, batch, n) +
           2 * ((batch * n * 4 + 63) / 64 * 64);
  }
  // The cost table for `batch` sequences of s tokens (a step of several documents, one per row, padded to s):
  // float32 activations, weights and gradients, two AdamW moments.
  CostTable table(std::int64_t s, std::int64_t batch = 1) const {
    ModelConfig model = model_config_of(config.layer, config.layers, 4, {4, 4, 8});
    model.extra_bytes = extra_bytes(s, batch);
    return build_cost_table(model, *hardware, ranks, Batch::single(s, batch), {}, *catalog);
  }
  // The cost table for one sequence of packed documents of these lengths (attention within each document, so the
  // dry runs cost the causal-within-document fraction of the pairs).
  CostTable packed_table(std::vector<std::int64_t> lengths) const {
    if (lengths.size() == 1) return table(lengths[0]);
    ModelConfig model = model_config_of(config.layer, config.layers, 4, {4, 4, 8});
    const Batch batch = Batch::packed(std::move(lengths));
    model.extra_bytes = extra_bytes(batch.tokens_per_sample());
    return build_cost_table(model, *hardware, ranks, batch, {}, *catalog);
  }
  // The predicted peak per rank with every sublayer on `strategy` (an index of the catalog).
  std::int64_t uniform_peak(std::int64_t s, int strategy) const {
    const CostTable t = table(s);
    return plan_of(t, uniform_layers(t, strategy), 0).peak_bytes();
  }
};

}  // namespace paradyse::plan
