// examples/train_gpt/dense_step.hpp: one step of the dense GPT on a group of ranks: its plan (the exact planner's,
// or --strategy everywhere, under the cap), and the collective forward, backward and AdamW step of every rank of
// this process, with the MPI undo: under MPI an out-of-memory rank could not stop the others inside a collective,
// so the step runs uncapped and is undone when any rank's peak passed the cap (exactly when the thread run's step
// fails with OutOfMemory, which run() rethrows).
#pragma once

#include "rank_model.hpp"
#include "training_options.hpp"

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/memory.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/core/timer.hpp"
#include "paradyse/cost/dry_run.hpp"
#include "paradyse/data/packing.hpp"
#include "paradyse/model/gpt.hpp"
#include "paradyse/plan/planner.hpp"
#include "paradyse/plan/stack_plan.hpp"
#include "paradyse/strategy/buffer_pool.hpp"
#include "paradyse/strategy/sequence_layout.hpp"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

namespace paradyse::examples {

// The plan of `batch`: the exact planner's, or the forced strategy's (with its predicted memory). Throws
// plan::NoFeasiblePlan when none fits `cap`.
template <class Costs>
plan::Plan plan_dense_step(const TrainingOptions& o, const Costs& costs, const data::Step& batch, std::int64_t cap) {
  const plan::CostTable table = batch.document_starts().size() > 1 ? costs.packed_table(batch.document_lengths())
                                                                   : costs.table(batch.length, batch.sequences());
  return o.strategy.empty()
             ? plan::plan_exact(table, cap)
             : plan::plan_of(table, plan::uniform_layers(table, cost::default_catalog().index_of(o.strategy)), cap);
}

// What a step gave: the loss (the same on every rank), each rank's peak, and whether it went over the cap (MPI).
struct DenseStepResult {
  double loss = 0;
  std::vector<double> peaks;  // per rank, bytes (this process's ranks; ranks.share() fills in the others)
  bool over_cap = false;      // MPI: the step went over the cap on some rank (and was undone)
  // The slowest rank's thread CPU time of the step (this process's ranks): forward, backward and AdamW, and AdamW
  // alone. What a rank that owned its core would take (waits block and do not count); on a machine whose cores are
  // shared the wall time also holds the time a rank waited for one (scripts/validate_trainer.sh compares both).
  double cpu_s = 0, optimizer_cpu_s = 0;
};

// Runs `batch` on every rank of this process with `plan` and takes the AdamW step. Collective. Rethrows an
// OutOfMemory of a thread rank (every model left as it was before the step: the caller recovers).
template <class Model, class RanksT>
DenseStepResult run_dense_step(RanksT& ranks, const TrainingOptions& o, const GptConfig& config,
                               const data::Step& batch, const std::vector<data::Document>& docs,
                               const plan::Plan& plan, const ops::AdamWConfig& adamw, std::int64_t cap, bool mpi) {
  using Strategies = typename StrategiesOf<Model>::type;
  constexpr bool on_device = StrategiesOf<Model>::on_device;
  // The step's rows [b, s]: one document each, padded with masked tokens; or (--pack-documents) one row holding
  // the documents back to back.
  const std::int64_t s = batch.length, rows = batch.sequences();
  const std::vector<std::int64_t> document_starts = batch.document_starts();  // empty: one document per row
  std::vector<std::int32_t> inputs, targets;
  data::step_tokens(batch, docs, ops::cpu::kIgnoreIndex, inputs, targets);
  const StackPlan stack_plan = plan::stack_plan<Strategies>(plan);
  DenseStepResult out;
  out.peaks.assign(std::size_t(o.ranks), 0.0);
  std::vector<double> cpu(std::size_t(o.ranks), 0.0), optimizer_cpu(std::size_t(o.ranks), 0.0);
  ranks.run([&](auto& comm, int r) {
    const double cpu_start = thread_cpu_seconds();
    Model& model = *ranks.models[std::size_t(r)];
    BufferPool& pool = *ranks.pools[std::size_t(r)];
    pool.trim();  // every step starts with an empty pool, as the memory model assumes
    pool.reset_high_water();
    ranks.tracker(r).reset_peak();
    const SequenceLayout layout(s, o.ranks, config.layer.zigzag);
    const RankTokens<on_device> tokens(inputs, targets, rows, layout, r);
    model.zero_gradients();
    // Under MPI the step runs uncapped and is undone when any rank's peak passed the cap (see the top).
    if (mpi) ranks.tracker(r).set_cap(std::numeric_limits<std::size_t>::max());
    const GptStepResult result = model.forward_backward(comm, pool, stack_plan, s, tokens.inputs.view(),
                                                        tokens.targets.view(), document_starts);
    if (mpi) {
      const double mine = double(ranks.tracker(r).peak());
      double most = 0;
      comm.all_reduce(std::span<const double>(&mine, 1), std::span<double>(&most, 1), ReduceOp::max);
      ranks.tracker(r).set_cap(std::size_t(cap));
      if (most > double(cap)) {
        out.over_cap = true;
        out.peaks[std::size_t(r)] = most;
        model.recover_from_failed_step();
        pool.trim();
        return;
      }
    }
    const double optimizer_start = thread_cpu_seconds();
    model.optimizer_step(adamw);
    const double cpu_end = thread_cpu_seconds();
    cpu[std::size_t(r)] = cpu_end - cpu_start;
    optimizer_cpu[std::size_t(r)] = cpu_end - optimizer_start;
    out.peaks[std::size_t(r)] = double(ranks.tracker(r).peak());
    if (r == ranks.first_local()) out.loss = result.loss;  // the same on every rank
  });
  out.cpu_s = *std::max_element(cpu.begin(), cpu.end());
  out.optimizer_cpu_s = *std::max_element(optimizer_cpu.begin(), optimizer_cpu.end());
  return out;
}

}  // namespace paradyse::examples
