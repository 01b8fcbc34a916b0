// paradyse/plan/gpt_costs.hpp: the planner's view of a GPT (model/gpt.hpp) on a group of p ranks.
//
// A GPT is its layer stack plus what the model holds outside it on every rank: the replicated (or, with
// vocab_shards, vocabulary-sharded) embedding and LM head and the final norm with their gradients and AdamW moments,
// the step's activations outside the stack (the chunked LM head's logits, the final norm's input and output) and the
// rank's tokens and targets. GptCosts turns that into the cost table the planner reads for an input of s tokens
// (every strategy's cost from its own dry run, as the rank keeps and re-runs it: plan/activation_stash.hpp), and the
// predicted peak of a uniform plan (what a user needs to choose a memory cap). The table's step time includes the
// work outside the stack (embedding, final norm, LM head, loss, replicated all-reduce, AdamW: plan/outside_stack.hpp).
// A sequence shorter than the group's minimum (a token per chunk) is costed at its padded length, as the trainer runs
// it (data::padded_length).
#pragma once

#include "paradyse/cost/dry_run.hpp"
#include "paradyse/cost/profile.hpp"
#include "paradyse/data/document_balance.hpp"
#include "paradyse/model/gpt.hpp"
#include "paradyse/plan/activation_stash.hpp"
#include "paradyse/plan/planner.hpp"
#include "paradyse/plan/stack_plan.hpp"
#include "paradyse/strategy/sequence_layout.hpp"

#include <algorithm>
#include <cmath>
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
  // The group's factorisation (cost::ModelShape::tp_inner, tp_x): with a catalog that holds MegatronRing and Tp2d
  // (cost::mesh_catalog()) the tables price them where it is set.
  int tp_inner = 0;
  int tp_x = 1;
  // What a rank keeps of the stack's activations and re-runs (plan/activation_stash.hpp: in-flight micro-batches of
  // a pipeline, recompute none, selective or full): applied to every option of the tables.
  ActivationStash stash{};
  // The ranks the embedding and the head are sharded over by vocabulary rows (train_gpt --mesh with tp,
  // --vocab-parallel on: model/vocab_parallel.hpp); 1: whole on every rank. Prices their bytes and time
  // (plan/outside_stack.hpp).
  int vocab_shards = 1;

  // The length a sequence of s tokens runs at on the group: padded to a token per chunk (data/document_balance.hpp).
  std::int64_t run_length(std::int64_t s) const { return data::padded_length(s, {ranks, config.layer.zigzag}); }
  // The most tokens any rank holds for a sequence of s tokens (padded).
  std::int64_t max_local_tokens(std::int64_t s) const {
    const SequenceLayout layout(run_length(s), ranks, config.layer.zigzag);
    std::int64_t n = 0;
    for (int r = 0; r < ranks; ++r) n = std::max(n, layout.local_length(r));
    return n;
  }
  // The model outside its stack (plan/outside_stack.hpp).
  OutsideStack outside() const { return {config.vocab, config.tied_head, vocab_shards}; }
  // Replicated (or vocabulary-sharded) weights and states, the step's activations outside the stack, the rank's
  // tokens and targets (of `batch` sequences).
  std::int64_t extra_bytes(std::int64_t s, std::int64_t batch = 1) const {
    const std::int64_t n = max_local_tokens(s), h = config.layer.hidden;
    const std::int64_t activations = vocab_shards > 1 ? outside().sharded_activation_bytes(h, batch * n)
                                                      : Model::activation_bytes(config, batch, n);
    return outside().state_bytes(h) + activations + 2 * ((batch * n * 4 + 63) / 64 * 64);
  }
  // The cost table for `batch` sequences of s tokens (a step of several documents, one per row, padded to s):
  // float32 activations, weights and gradients, two AdamW moments. Shorter than the group's minimum: padded.
  CostTable table(std::int64_t s, std::int64_t batch = 1) const {
    s = run_length(s);
    ModelConfig model = model_config();
    model.extra_bytes = extra_bytes(s, batch);
    model.outside = outside();
    return stash.apply(build_cost_table(model, *hardware, ranks, Batch::single(s, batch), {}, *catalog));
  }
  // The cost table for one sequence of packed documents of these lengths (attention within each document, so the
  // dry runs cost the causal-within-document fraction of the pairs).
  CostTable packed_table(std::vector<std::int64_t> lengths) const {
    if (lengths.size() == 1) return table(lengths[0]);
    ModelConfig model = model_config();
    Batch batch = Batch::packed(std::move(lengths));
    if (const std::int64_t s = batch.tokens_per_sample(), padded = run_length(s); padded > s)
      batch.lengths.push_back(padded - s);  // the padding at the end, a document of its own (data/packing.hpp)
    model.extra_bytes = extra_bytes(batch.tokens_per_sample());
    model.outside = outside();
    return stash.apply(build_cost_table(model, *hardware, ranks, batch, {}, *catalog));
  }
  // The planner's layers: float32, the group's factorisation.
  ModelConfig model_config() const {
    ModelConfig model = model_config_of(config.layer, config.layers, 4, {4, 4, 8});
    for (LayerKind& kind : model.kinds) {
      kind.shape.tp_inner = tp_inner;
      kind.shape.selective = stash.selective();
      kind.shape.tp_x = tp_x;
    }
    return model;
  }
  // The predicted peak per rank with every sublayer on `strategy` (an index of the catalog).
  std::int64_t uniform_peak(std::int64_t s, int strategy) const {
    const CostTable t = table(s);
    return plan_of(t, uniform_layers(t, strategy), 0).peak_bytes();
  }
};

}  // namespace paradyse::plan
