// paradyse/search/memory_estimate.hpp: bytes per device of a parallel configuration: model states per ZeRO stage
// and activations per recomputation policy and in-flight micro-batches, on the pipeline stage that needs most.
//
// Model states (bytes per parameter from TrainingPrecision: w weights, g gradients, o optimizer; 2 + 4 + 12):
//   ZeRO 0: (w + g + o) P;  1: (w + g) P + o P / d;  2: w P + (g + o) P / d;  3: (w + g + o) P / d
// with P the parameters the device holds after tensor/pipeline/expert sharding and d the data-parallel group of
// those parameters (dp * cp for dense ones, edp for experts); ZeRO-3 also holds two layers gathered (prefetch).
// Activations per layer and micro-batch follow Korthikanti et al. (MLSys'23) term by term, sharded over tp (the
// 2D layout and sequence parallelism shard every stored tensor; without sequence parallelism the norms' inputs,
// the projections' inputs and the dropout masks, Korthikanti's 10 s b h, are whole on every tp rank) and cp; in
// flight on the first stage: 1 micro-batch without a pipeline, min(m, pp) for 1F1B, pp + (pp - 1) / v for
// interleaved 1F1B (Megatron-LM's factor). Stages hold the layers of training_setup.hpp's StageLayout.
// tp inside cp as train_gpt's MegatronRing (TrainingSetup::cp_gathers_weights, cp > 1 and tp > 1): the layers'
// attention and dense MLP weights are sharded over cp x tp (their ZeRO group is then dp alone), and the sublayer
// running holds its cp sub-group's shards gathered (P / tp weights) and, in backward, their gradient before it is
// reduce-scattered back over cp (P / tp): the largest sublayer's two are transient. The same under train_gpt's step
// (TrainingSetup::trainer) for any cp > 1: its stage group holds every layer's weights in shards over cp x tp
// (model/mesh_stage.hpp), their optimizer over dp alone (model/mesh_optimizer.hpp).
#pragma once

#include "paradyse/search/parallel_config.hpp"
#include "paradyse/search/training_model.hpp"
#include "paradyse/search/training_setup.hpp"

#include <algorithm>
#include <cstdint>
#include <utility>

namespace paradyse::search {

struct MemoryEstimate {
  double weights = 0, gradients = 0, optimizer = 0;  // bytes
  double activations = 0;                            // stored for backward, all in-flight micro-batches
  double transient = 0;                              // one layer's working set, logits, ZeRO-3 gathered layers
  double in_flight = 0;                              // micro-batches whose activations are held
  double total() const { return weights + gradients + optimizer + activations + transient; }
};

// Parameters one device holds for `layers` consecutive layers starting at `first`: the part replicated over the
// data-parallel group (attention, dense MLPs, shared experts, norms, router, embedding) and the experts.
struct StageParameters {
  double dense = 0;
  double experts = 0;
};

inline StageParameters stage_parameters(const TrainingModel& m, const ParallelConfig& c, std::int64_t first,
                                        std::int64_t layers, bool embedding, bool output_layer) {
  StageParameters p;
  const double tp = c.tp();
  const std::int64_t moe = m.is_moe() ? std::clamp<std::int64_t>(first + layers - m.dense_layers, 0, layers) : 0;
  p.dense += double(layers) * (m.attention_parameters() + m.norm_parameters()) / tp;
  p.dense += double(layers - moe) * m.dense_mlp_parameters() / tp;
  p.dense += double(moe) * (m.shared_expert_parameters() / tp + m.router_parameters());
  p.experts += double(moe) * double(m.experts) * m.expert_parameters() / double(c.ep * c.etp);
  if (embedding) p.dense += m.embedding_parameters() / tp;
  if (output_layer && !(m.tied_embeddings && embedding)) p.dense += m.embedding_parameters() / tp;
  return p;
}

// Of stage_parameters' dense part for `layers` layers from `first`, the parameters sharded over cp as well (each
// device keeping 1 / cp of them) when tp runs inside cp as MegatronRing, or under train_gpt's step; 0 otherwise. In
// P / tp units, as there.
inline double cp_sharded_parameters(const TrainingModel& m, const TrainingSetup& s, const ParallelConfig& c,
                                    std::int64_t first, std::int64_t layers) {
  const bool sharded = s.trainer == Trainer::train_gpt || (s.cp_gathers_weights && c.tp() > 1);
  if (!sharded || c.cp <= 1) return 0;
  const std::int64_t moe = m.is_moe() ? std::clamp<std::int64_t>(first + layers - m.dense_layers, 0, layers) : 0;
  return (double(layers) * m.attention_parameters() + double(layers - moe) * m.dense_mlp_parameters()) / c.tp();
}

// Model-state bytes of `parameters` sharded by ZeRO `stage` over a group of `group` devices.
inline void add_model_states(MemoryEstimate& e, double parameters, int stage, double group,
                             const cost::TrainingPrecision& precision) {
  e.weights += parameters * precision.parameter_bytes / (stage >= 3 ? group : 1);
  e.gradients += parameters * precision.gradient_bytes / (stage >= 2 ? group : 1);
  e.optimizer += parameters * precision.optimizer_bytes / (stage >= 1 ? group : 1);
}

// Activation bytes one layer stores per token of its device (tokens already divided by cp and tp), by policy.
inline double stored_bytes_per_token(const TrainingModel& m, const TrainingSetup& s, const ParallelConfig& c,
                                     bool moe_layer, Recompute policy) {
  const double h = double(m.hidden), w = s.activation_bytes;
  // Tensors sharded by sequence parallelism are whole on each tp rank without it: tp times the per-token bytes.
  const double replicated = c.sequence_parallel ? 1.0 : double(c.tp());
  if (policy == Recompute::full) return w * h * replicated;  // the layer's input only
  // Attention: norm input, projection input, q/k/v, context, dropout mask; scores when not flash (5 a s: softmax
  // output, its dropout mask and dropout output, Korthikanti's term), unless recomputed (selective). Selective also
  // drops the context, the core's output, and re-runs the core for it as train_gpt does (model/stack.hpp): the
  // output projection's backward reads it after the re-run.
  double attention = w * m.qkv_width() + (policy == Recompute::selective ? 0 : w * m.context_width()) +
                     (w * 2 * h + h) * replicated;
  if (!s.flash_attention && policy == Recompute::none) attention += 5.0 * double(m.heads) * double(s.seq);
  // MLP: norm input, first projection input and output, activation output (recomputed by selective), mask.
  double mlp = 0;
  const bool drop_activation = policy == Recompute::selective;
  if (!moe_layer) {
    const double f = double(m.ffn), f_in = m.swiglu ? 2 * f : f;
    mlp = w * (f_in + (drop_activation ? 0 : f)) + (w * 2 * h + h) * replicated;
  } else {
    // Each token goes to k experts; with etp > 1 the dispatched tokens are gathered over etp, each etp rank
    // computing 1/etp of the width for etp times the tokens.
    const double fe = double(m.expert_ffn) / c.etp, k = double(m.top_k) * c.etp;
    mlp = w * k * (h + 2 * fe + (drop_activation ? 0 : fe)) + (w * 2 * h + h) * replicated + 4.0 * double(m.experts);
    if (m.shared_experts > 0) {
      const double fs = double(m.shared_experts * m.shared_ffn);
      mlp += w * (h + 2 * fs + (drop_activation ? 0 : fs));
    }
  }
  return attention + mlp;
}

// The whole estimate for the stage that needs most (the first, holding most micro-batches, or the last, holding
// the logits).
inline MemoryEstimate estimate_memory(const TrainingModel& m, const TrainingSetup& s, const ParallelConfig& c) {
  const StageLayout layout = stage_layout(m.layers, c.pp);
  const double tokens = double(c.micro_batch) * double(s.seq) / c.cp / c.tp();  // per device per micro-batch
  const std::int64_t mbs = micro_batches(s, c);
  MemoryEstimate best;
  for (int stage : layout.candidates()) {
    MemoryEstimate e;
    const std::int64_t first = layout.first_of(stage), per_stage = layout.layers_of(stage);
    const StageParameters p = stage_parameters(m, c, first, per_stage, stage == 0, stage == c.pp - 1);
    const double over_cp = cp_sharded_parameters(m, s, c, first, per_stage);  // 0 unless MegatronRing
    add_model_states(e, p.dense - over_cp, c.zero, double(c.dp) * c.cp, s.precision);
    add_model_states(e, over_cp / c.cp, c.zero, double(c.dp), s.precision);
    add_model_states(e, p.experts, c.zero, c.expert_dp(), s.precision);
    // In flight on this stage: the first holds the most; stage i of 1F1B holds pp - i.
    if (c.pp == 1) e.in_flight = 1;
    else if (c.virtual_stages == 1) e.in_flight = double(std::min<std::int64_t>(mbs, c.pp - stage));
    else e.in_flight = std::min(double(mbs), double(c.pp - stage) + double(c.pp - 1) / c.virtual_stages);
    double stored = 0, working = 0;
    const std::int64_t moe_layers = m.is_moe() ? std::clamp<std::int64_t>(first + per_stage - m.dense_layers, 0,
                                                                          per_stage) : 0;
    for (const auto& [moe_layer, count] : {std::pair{false, per_stage - moe_layers}, std::pair{true, moe_layers}}) {
      if (count == 0) continue;
      stored += stored_bytes_per_token(m, s, c, moe_layer, c.recompute) * tokens * double(count);
      if (c.recompute == Recompute::full)  // one layer recomputed at a time, all its activations
        working = std::max(working, stored_bytes_per_token(m, s, c, moe_layer, Recompute::none) * tokens);
    }
    e.activations = stored * e.in_flight;
    e.transient = working;
    if (stage == c.pp - 1)  // logits: bf16 output and fp32 softmax for cross-entropy
      e.transient += tokens * double(m.vocab) * (s.activation_bytes + 4);
    if (c.zero == 3) {      // two layers gathered (the current and the prefetched one), bf16
      const StageParameters one = stage_parameters(m, c, first, 1, false, false);
      const double one_over_cp = cp_sharded_parameters(m, s, c, first, 1);
      e.transient += 2.0 * (one.dense - one_over_cp * (1 - 1.0 / c.cp) + one.experts) * s.precision.parameter_bytes;
    }
    if (over_cp > 0) {  // MegatronRing: the largest sublayer's weights gathered over cp, and their gradient
      const double sublayer = std::max(m.attention_parameters(), m.dense_mlp_layers() > 0 ? m.dense_mlp_parameters() : 0.0);
      e.transient += sublayer / c.tp() * (s.precision.parameter_bytes + s.precision.gradient_bytes);
    }
    if (e.total() > best.total()) best = e;
  }
  return best;
}

}  // namespace paradyse::search
