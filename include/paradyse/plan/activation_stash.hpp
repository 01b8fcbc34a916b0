// paradyse/plan/activation_stash.hpp: what a rank keeps of its layer stack's activations, and what it runs again,
// in the cost tables' unit: the one rule of both planners (plan/gpt_costs.hpp's GptCosts, plan/moe_plan.hpp's
// MoeGptCosts).
//
// A cost table prices one micro-batch through the whole stack: each option's saved bytes are what its sublayer keeps
// from forward to backward for one micro-batch, its time one forward and one backward. A rank of a pipeline
// (model/pipeline.hpp's 1F1B or interleaved schedule, L layers, k micro-batches in flight of the L_s layers it holds)
// keeps, per recompute mode (model/pipeline.hpp's PipelineRecompute):
//
//   none       every in-flight micro-batch's activations: saved x stashes, stashes = max over ranks of k L_s / L
//   selective  the same, less attention's core tensors: the dry runs drop them and re-run the core in backward
//              (cost::ModelShape::selective), so both the saved bytes and the time are the dry run's
//   full       each in-flight micro-batch's stage input, and one micro-batch's stage activations while it is
//              recomputed: at most one stack's, stashes = 1; the forward runs twice: time = 2 forward + backward
//
// Without pipeline stages (1 stage, 1 chunk) a micro-batch's backward follows its forward: one stash.
#pragma once

#include "paradyse/layout/chunking.hpp"
#include "paradyse/model/pipeline.hpp"
#include "paradyse/plan/cost_table.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace paradyse::plan {

// The micro-batch stashes of the whole stack of `layers` layers the busiest rank holds under `recompute` on `stages`
// pipeline ranks of `chunks` model chunks each (virtual stage c * stages + r of stages * chunks holds
// chunk_range(layers, stages * chunks, c * stages + r)) running `micro_batches` micro-batches. Interleaved (chunks >
// 1) runs whole rounds of `stages` micro-batches: a step of fewer is counted as its rounds.
inline double pipeline_stash_factor(PipelineRecompute recompute, int layers, int stages, int chunks,
                                    std::int64_t micro_batches) {
  check(layers >= stages * chunks && stages >= 1 && chunks >= 1 && micro_batches >= 1, "pipeline_stash_factor: {} "
        "layers over {} stages of {} chunks for {} micro-batches (want layers >= stages x chunks, all positive)",
        layers, stages, chunks, micro_batches);
  if (recompute == PipelineRecompute::full || (stages == 1 && chunks == 1)) return 1.0;
  if (chunks > 1) micro_batches = (micro_batches + stages - 1) / stages * stages;
  std::int64_t most = 0;
  for (int r = 0; r < stages; ++r)
    most = std::max(most, peak_stashed_layers(stages, r, chunks, int(micro_batches), [&](int c) {
                      return chunk_range(layers, stages * chunks, c * stages + r).length;
                    }));
  return double(most) / double(layers);
}

// What a rank keeps and re-runs (the rule above), applied to the options of a table priced for one micro-batch.
struct ActivationStash {
  PipelineRecompute recompute = PipelineRecompute::none;
  double stashes = 1.0;  // pipeline_stash_factor

  // The dry runs drop attention's core and re-run it (cost::ModelShape::selective).
  bool selective() const { return recompute == PipelineRecompute::selective; }
  // An option of one micro-batch as the rank runs it: its saved bytes times the stashes (rounded up), and under full
  // its forward once more.
  Option applied(Option o) const {
    o.saved_bytes = std::int64_t(std::ceil(double(o.saved_bytes) * stashes));
    if (recompute == PipelineRecompute::full) o.time_s += o.forward_s;
    return o;
  }
  void apply(CostTable::Entry& e) const {
    if (e.option) e.option = applied(*e.option);
  }
  CostTable apply(CostTable table) const {
    for (auto& kind : table.entries)
      for (auto& sublayer : kind)
        for (CostTable::Entry& e : sublayer) apply(e);
    return table;
  }
};

}  // namespace paradyse::plan
