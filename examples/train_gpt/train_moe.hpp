// examples/train_gpt/train_moe.hpp: train_gpt's MoE mode (--experts E --top-k K [--shared-experts N] [--first-dense N]): a
// small byte-level MoE GPT trained on the bundled corpus, every step planned per layer and sublayer (attention,
// the dense MLP of the first_k_dense layers, the MoE FFN: ExpertParallel or ExpertTensorParallel) by the exact
// planner (plan/moe_plan.hpp), with the router's load-balancing and z losses logged and, every few steps, each MoE
// layer's expert load (min / mean / max assignments per expert over the group). --save writes a Hugging Face folder
// (model/hf_checkpoint.hpp: Mixtral names, or Qwen2-MoE's with shared experts or dense layers). Training
// checkpoints (--checkpoint-every, --keep, --stop-after, --resume; model/resume.hpp) hold the
// attention and expert weights, the router, every AdamW moment, the step and the data position (the schedule is a
// function of the seed and options, saved with it): a run stopped and resumed gives the uninterrupted run's losses
// bit for bit on thread ranks. --csv writes the per-step table. --pack-documents B packs the windows back to back
// into ONE sequence of up to B tokens per step (data/packing.hpp's pack_sequences): attention is masked to each
// document and RoPE positions restart at each (the stack's set_documents), the MoE FFN is per token, every target is
// the next byte of the same document, and the planner plans the step from its documents' lengths.
//
// The model: RMSNorm, RoPE, causal, SwiGLU; experts of width ffn / K (so that the active FFN width is the dense
// one's), shared experts of the same width behind a sigmoid gate (Qwen2-MoE), softmax routing with renormalised
// top-k weights; aux-loss coefficient 0.01 and z-loss 0.001 unless given.
#pragma once

#include "paradyse/core/csv_table.hpp"
#include "divergence.hpp"
#include "rank_model.hpp"
#include "training_data.hpp"
#include "training_options.hpp"

#include "paradyse/comm/ranks.hpp"
#include "paradyse/comm/threads.hpp"
#include "paradyse/core/timer.hpp"
#include "paradyse/data/packing.hpp"
#include "paradyse/cost/profile.hpp"
#include "paradyse/model/checkpoint.hpp"
#include "paradyse/model/gpt.hpp"
#include "paradyse/model/hf_checkpoint.hpp"
#include "paradyse/model/resume.hpp"
#include "paradyse/moe/moe_strategies.hpp"
#include "paradyse/plan/moe_plan.hpp"
#include "paradyse/plan/plan_names.hpp"

#include <fmt/core.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

namespace paradyse::examples {

// The MoE GPT train_gpt --experts trains (model/byte_gpt.hpp).
inline GptConfig moe_gpt_config(const TrainingOptions& o) { return paradyse::moe_gpt_config(byte_gpt_shape(o)); }

namespace train_moe_detail {

struct Load {
  std::int64_t min = 0, max = 0;
  double mean = 0;
};
inline Load load_of(const std::vector<std::int64_t>& routed) {
  Load l;
  if (routed.empty()) return l;
  l.min = *std::min_element(routed.begin(), routed.end());
  l.max = *std::max_element(routed.begin(), routed.end());
  l.mean = double(std::accumulate(routed.begin(), routed.end(), std::int64_t(0))) / double(routed.size());
  return l;
}

}  // namespace train_moe_detail

// Runs the MoE training of Model (Gpt<AllStrategies<B>, B>) on `ranks` (thread or MPI ranks over ops::Cpu, or
// cuda_local ranks over ops::Cuda: DeviceRanks); returns the exit status. `hardware`: the profile the planner
// predicts with (its predicted step time is the CSV's predicted_s).
template <class Model, class RanksT>
int train_moe(const TrainingOptions& o, const cost::HardwareProfile& hardware, RanksT& ranks) {
  using namespace train_moe_detail;
  using Strategies = typename StrategiesOf<Model>::type;
  constexpr bool on_device = StrategiesOf<Model>::on_device;
  constexpr double kMiB = 1024.0 * 1024.0;
  if (on_device) refuse_device_checkpoints(o);
  const GptConfig config = moe_gpt_config(o);
  config.validate_for(o.ranks);
  if (!o.save.empty()) check_hf_exportable(config);

  // The steps: one window each, padded at its end to the group's minimum with masked tokens; or (--pack-documents)
  // the windows back to back in one sequence each, first-fit decreasing up to the budget (examples/train_gpt/training_data.hpp).
  const TrainingData data = training_data(o, {o.ranks, config.layer.zigzag}, 0);
  const std::vector<data::Document>& docs = data.docs;
  const std::vector<data::Step>& steps = data.steps;
  const int n_steps = int(steps.size());

  const plan::MoeGptCosts<Model> costs{config, o.ranks, &hardware};
  const std::int64_t budget =
      o.cap_mib > 0 ? std::int64_t(o.cap_mib * kMiB) : hardware.usable_memory_bytes();
  const MoeConfig& m = config.moe->moe;
  fmt::print("model: MoE GPT, {} layers ({} dense first, {} MoE), h={}, {} heads, {} experts of ffn {} (top-{}, "
             "renormalised){}, vocab {} (bytes), RMSNorm + RoPE + causal; {:.2f} M parameters\n",
             o.layers, o.first_dense, o.layers - o.first_dense, o.hidden, o.heads, m.experts, m.expert_ffn, m.top_k,
             m.has_shared() ? fmt::format(", {} shared expert(s) of ffn {} behind a sigmoid gate", m.shared_experts, m.shared_ffn)
                            : std::string(),
             config.vocab, double(config.parameter_count()) / 1e6);
  fmt::print("router losses: load balancing x {}, z-loss x {} (both in the gradient; the loss column is the "
             "cross-entropy)\n", m.aux_loss_coef, m.z_loss_coef);
  fmt::print("data: {} documents in {}; {} windows, lengths {}..{}, order {}, seed {}\n", docs.size(),
             data.corpus_dir.string(), o.steps, o.min_len, o.max_len, o.sorted ? "sorted" : "random", o.seed);
  if (o.pack_documents > 0)
    fmt::print("packing: {} windows in {} steps, each one sequence of up to {} tokens (documents back to back, "
               "attention within each, positions restarting at each)\n", o.steps, n_steps, o.pack_documents);
  else
    fmt::print("steps: one window each\n");
  fmt::print("ranks: {} {}; the planner's budget {:.0f} MiB per rank; plan: attention/ffn per layer (ffn: the dense "
             "MLP's strategy, or EP = ExpertParallel, ETP = ExpertTensorParallel)\n\n",
             o.ranks, o.backend == RankBackend::mpi ? "MPI processes" : "threads", double(budget) / kMiB);

  ranks.run([&](auto&, int r) {
    ranks.models[std::size_t(r)] = std::make_unique<Model>(config, o.ranks, r, o.seed);
    ranks.pools[std::size_t(r)] = std::make_unique<BufferPool>();
  });
  // Training checkpoints (model/resume.hpp): resumed from, and written on the way.
  TrainingCheckpoints checkpoints(resume_options(o), n_steps, data_description(o, n_steps, 0), ranks);
  const int first_step = checkpoints.first_step(), end_step = checkpoints.end_step();
  if (!o.resume.empty())
    fmt::print("resumed from {}: attention, expert and router weights, AdamW moments and optimizer step {}; the data "
               "continues at step {} of {}\n\n", o.resume, ranks.models[std::size_t(ranks.first_local())]->steps_taken(),
               first_step, n_steps);
  CsvTable csv(ranks.reports() ? o.csv : std::string(),
               {"step", "length", "rows", "tokens", "padding", "plan", "loss", "seconds", "tokens_per_s", "aux", "z",
                "predicted_s"},
               CsvTable::OnFailure::warns);

  ops::AdamWConfig adamw;
  adamw.weight_decay = 0.01f;
  const int warmup = std::max(1, std::min(8, n_steps / 8));
  fmt::print("{:>4}  {:>6}  {:>4}  {:<{}}  {:>7}  {:>7}  {:>8}  {:>7}\n", "step", "len", "docs", "plan", 8 * o.layers,
             "loss", "aux", "z", "time s");
  std::vector<double> losses;
  std::map<std::string, int> usage;
  std::int64_t tokens = 0, padding = 0;
  double seconds = 0;
  for (int step = first_step; step < end_step; ++step) {
    checkpoints.before_step(ranks, step);
    // The step's one sequence [1, s]: a window padded with masked tokens, or the packed windows back to back.
    const data::Step& batch = steps[std::size_t(step)];
    const std::int64_t s = batch.length, real = batch.real_tokens();
    const std::vector<std::int64_t> document_starts = batch.document_starts();  // empty: one document
    std::vector<std::int32_t> inputs, targets;
    data::step_tokens(batch, docs, ops::cpu::kIgnoreIndex, inputs, targets);
    // Packed: the planner's table of the step's documents (attention costed within each document).
    const plan::MoePlan plan = plan::plan_moe_exact(
        document_starts.size() > 1 ? costs.packed_table(batch.document_lengths()) : costs.table(s), budget);
    const StackPlan stack_plan = plan.stack_plan<Strategies>();
    for (const plan::MoeLayerPlan& l : plan.layers) {
      ++usage[fmt::format("attention {}", plan.strategy_names.at(std::size_t(l.attention)))];
      ++usage[fmt::format("{} {}", l.moe ? "moe" : "mlp", plan.ffn_name(l))];
    }
    adamw.learning_rate = float(o.lr * std::min(1.0, double(step + 1) / warmup));
    double loss = 0;
    std::vector<MoeLayerStats> stats;
    const Timer start;
    ranks.run([&](auto& comm, int r) {
      Model& model = *ranks.models[std::size_t(r)];
      BufferPool& pool = *ranks.pools[std::size_t(r)];
      const SequenceLayout layout(s, o.ranks, config.layer.zigzag);
      const RankTokens<on_device> tokens(inputs, targets, 1, layout, r);
      model.zero_gradients();
      const GptStepResult result = model.forward_backward(comm, pool, stack_plan, s, tokens.inputs.view(),
                                                          tokens.targets.view(), document_starts);
      if (const auto why = divergence(result.loss, step, config.vocab, double(adamw.learning_rate), o.lr))
        throw Error(*why);  // on every rank (the loss is the group's)
      model.optimizer_step(adamw);
      if (r == ranks.first_local()) {
        loss = result.loss;
        stats = model.stack().moe_stats();
      }
    });
    const double elapsed = start.seconds();
    seconds += elapsed;
    tokens += real;
    padding += s - real;
    losses.push_back(loss);
    double aux = 0, z = 0;
    for (const MoeLayerStats& st : stats) aux += st.aux / double(stats.size()), z += st.z / double(stats.size());
    fmt::print("{:>4}  {:>6}  {:>4}  {:<{}}  {:>7.4f}  {:>7.4f}  {:>8.4f}  {:>7.3f}\n", step, s, batch.rows.size(),
               compact_plan(plan), 8 * o.layers, loss, aux, z, elapsed);
    csv.row(step, s, 1, real, s - real, compact_plan(plan), fmt::format("{:.17g}", loss), elapsed,
            elapsed > 0 ? double(real) / elapsed : 0.0, fmt::format("{:.17g}", aux), fmt::format("{:.17g}", z),
            plan.time_s);
    if (o.load_every > 0 && (step % o.load_every == 0 || step + 1 == n_steps)) {
      std::string line;
      for (const MoeLayerStats& st : stats) {
        const Load l = load_of(st.routed);
        line += fmt::format("{}L{} {}/{:.1f}/{}", line.empty() ? "" : "  ", st.layer, l.min, l.mean, l.max);
      }
      fmt::print("      expert load (tokens per expert, min/mean/max): {}\n", line);
    }
  }
  checkpoints.at_end(ranks);
  fmt::print("\nsummary\n");
  if (!losses.empty()) {
    const std::size_t window = std::max<std::size_t>(1, std::min<std::size_t>(4, losses.size() / 2));
    const double first = std::accumulate(losses.begin(), losses.begin() + std::ptrdiff_t(window), 0.0) / double(window);
    const double last = std::accumulate(losses.end() - std::ptrdiff_t(window), losses.end(), 0.0) / double(window);
    fmt::print("  loss                       first {:.4f}, last {:.4f} (means of the first and last {} steps: {:.4f} -> {:.4f})\n",
               losses.front(), losses.back(), window, first, last);
  }
  fmt::print("  total time                 {:.1f} s ({:.0f} tokens/s)\n", seconds, seconds > 0 ? double(tokens) / seconds : 0.0);
  fmt::print("  tokens trained             {}; {} padding tokens ({:.1f}% of the tokens run)\n", tokens, padding,
             tokens + padding > 0 ? 100.0 * double(padding) / double(tokens + padding) : 0.0);
  std::string used;
  for (const auto& [name, count] : usage) used += fmt::format("{}{}x {}", used.empty() ? "" : ", ", count, name);
  fmt::print("  sublayers run              {}\n", used);
  csv.close();
  if (!o.save.empty()) {
    ranks.run([&](auto& comm, int r) {
      save_hf_checkpoint(comm, *ranks.models[std::size_t(r)], o.save, o.max_len);
    });
    fmt::print("  saved                      {} (model.safetensors + config.json, {} layout)\n", o.save,
               hf_family_of(config) == HfMoeFamily::mixtral ? "Mixtral" : "Qwen2-MoE");
  }
  return finished(csv.failed() || checkpoints.failed());  // examples/train_gpt/divergence.hpp
}

}  // namespace paradyse::examples
