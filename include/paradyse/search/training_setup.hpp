// paradyse/search/training_setup.hpp: what a training run fixes besides the model and the cluster (sequence
// length, global batch, precision, software features), and the structural checks of a configuration against them.
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/cost/model_shape.hpp"
#include "paradyse/search/parallel_config.hpp"
#include "paradyse/search/training_model.hpp"

#include <fmt/format.h>

#include <cstdint>
#include <string>

namespace paradyse::search {

struct TrainingSetup {
  std::int64_t seq = 4096;             // s: tokens per sequence
  std::int64_t global_batch = 1024;    // B: sequences per optimizer step
  // bf16 weights, fp32 gradients, fp32 master weights and Adam moments (18 bytes per parameter): Megatron-LM's
  // default, whose bf16 gradients accumulate into fp32 main gradients; those are what data parallelism reduces.
  cost::TrainingPrecision precision{.parameter_bytes = 2, .gradient_bytes = 4, .optimizer_bytes = 12};
  int gradient_reduce_bytes = 4;
  int activation_bytes = 2;            // bf16
  bool causal = true;                  // decoder: flash attention skips the masked half
  // Software features: flash attention (no s x s scores in memory) and overlap of the data-parallel gradient
  // reduction with the backward pass. Megatron-LM as of SC'21 had neither: the validation turns them off.
  bool flash_attention = true;
  bool overlap_grad_reduce = true;
};

inline void validate(const TrainingSetup& s) {
  check(s.seq >= 1 && s.global_batch >= 1, "seq = {} and global_batch = {} must be positive", s.seq, s.global_batch);
  check(s.gradient_reduce_bytes == 2 || s.gradient_reduce_bytes == 4, "gradient_reduce_bytes = {} must be 2 or 4",
        s.gradient_reduce_bytes);
  check(s.activation_bytes == 2 || s.activation_bytes == 4, "activation_bytes = {} must be 2 or 4",
        s.activation_bytes);
}

// Micro-batches per pipeline per step: B / (dp * mb).
inline std::int64_t micro_batches(const TrainingSetup& s, const ParallelConfig& c) {
  return s.global_batch / (std::int64_t(c.dp) * c.micro_batch);
}

// Why a configuration cannot run this model and setup on `devices` devices; empty when it can. Every divisibility
// the sharding needs: heads over tp_y (key/value heads over tp_y or replicated), the sequence chunk over cp and
// tp, widths over their axes, layers over pp * v, experts over ep, ep inside dp x cp, etp inside tp, the batch over
// dp * mb, and interleaving's micro-batches over pp.
inline std::string structural_problem(const TrainingModel& m, const TrainingSetup& s, const ParallelConfig& c,
                                      std::int64_t devices) {
  if (c.dp < 1 || c.pp < 1 || c.cp < 1 || c.tp_x < 1 || c.tp_y < 1 || c.ep < 1 || c.etp < 1 || c.micro_batch < 1 ||
      c.virtual_stages < 1)
    return "every degree must be at least 1";
  if (c.devices() != devices) return fmt::format("dp*pp*cp*tp_x*tp_y = {} but the cluster has {}", c.devices(), devices);
  if (c.zero < 0 || c.zero > 3) return fmt::format("ZeRO stage {} is not 0-3", c.zero);
  if (m.heads % c.tp_y != 0) return fmt::format("heads = {} not divisible by tp_y = {}", m.heads, c.tp_y);
  if (m.kv_heads % c.tp_y != 0 && c.tp_y % m.kv_heads != 0)
    return fmt::format("kv_heads = {} neither divides nor is divided by tp_y = {}", m.kv_heads, c.tp_y);
  if (m.hidden % c.tp() != 0) return fmt::format("hidden = {} not divisible by tp = {}", m.hidden, c.tp());
  if (m.dense_mlp_layers() > 0 && m.ffn % c.tp_y != 0)
    return fmt::format("ffn = {} not divisible by tp_y = {}", m.ffn, c.tp_y);
  if (m.vocab % c.tp_y != 0) return fmt::format("vocab = {} not divisible by tp_y = {}", m.vocab, c.tp_y);
  if (s.seq % (std::int64_t(c.cp) * c.tp()) != 0)
    return fmt::format("seq = {} not divisible by cp * tp = {}", s.seq, c.cp * c.tp());
  if (m.layers % (std::int64_t(c.pp) * c.virtual_stages) != 0)
    return fmt::format("layers = {} not divisible by pp * v = {}", m.layers, c.pp * c.virtual_stages);
  if (c.virtual_stages > 1 && c.pp == 1) return "virtual stages need pp > 1";
  if (s.global_batch % (std::int64_t(c.dp) * c.micro_batch) != 0)
    return fmt::format("global batch {} not divisible by dp * mb = {}", s.global_batch, c.dp * c.micro_batch);
  if (c.virtual_stages > 1 && micro_batches(s, c) % c.pp != 0)
    return fmt::format("interleaving needs micro-batches ({}) divisible by pp = {}", micro_batches(s, c), c.pp);
  if (!m.is_moe()) {
    if (c.ep != 1 || c.etp != 1) return "ep and etp must be 1 for a dense model";
  } else {
    if (m.experts % c.ep != 0) return fmt::format("experts = {} not divisible by ep = {}", m.experts, c.ep);
    if ((c.dp * c.cp) % c.ep != 0) return fmt::format("ep = {} does not divide dp * cp = {}", c.ep, c.dp * c.cp);
    if (c.tp() % c.etp != 0) return fmt::format("etp = {} does not divide tp = {}", c.etp, c.tp());
    if (m.expert_ffn % c.etp != 0) return fmt::format("expert_ffn = {} not divisible by etp = {}", m.expert_ffn, c.etp);
  }
  return {};
}

}  // namespace paradyse::search
