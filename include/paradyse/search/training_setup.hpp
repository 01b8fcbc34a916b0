// paradyse/search/training_setup.hpp: what a training run fixes besides the model and the cluster (sequence
// length, global batch, precision, software features, the FLOP convention of MFU), how the layers are cut into
// pipeline stages, and the structural checks of a configuration against them.
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/cost/model_shape.hpp"
#include "paradyse/search/parallel_config.hpp"
#include "paradyse/search/training_model.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace paradyse::search {

// How the model FLOPs of MFU (and of TFLOP/s per device) count causal attention: the half square a causal kernel
// computes (Llama 3's and most MFU figures' count; the default for causal models) or the full s x s square
// (Megatron-LM's eq. 3, PaLM's appendix B). At 131K tokens the two differ by 1.4x on Llama 3 405B.
enum class FlopConvention : std::uint8_t { causal, full };
inline constexpr std::array<FlopConvention, 2> kAllFlopConventions{FlopConvention::causal, FlopConvention::full};
constexpr std::string_view name_of(FlopConvention f) { return f == FlopConvention::causal ? "causal" : "full"; }

// What the trainer posts besides the model's own collectives, which sets how many operations pay a launch latency
// (perf_model.hpp): megatron, Megatron-LM's (and DeepSpeed's, FSDP's) data-parallel reduction, one bucket per layer,
// overlapped with the backward where overlap_grad_reduce; train_gpt, its mesh step (examples/train_gpt/
// train_mesh.hpp): MeshOptimizer's one collective per packed tensor after the last backward (model/
// mesh_optimizer.hpp), the dense group's all-reduce of the embedding's and the head's gradients, and two all-reduces
// over every rank (the step's loss and peak memory).
enum class Trainer : std::uint8_t { megatron, train_gpt };
constexpr std::string_view name_of(Trainer t) { return t == Trainer::megatron ? "megatron" : "train_gpt"; }

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
  // tp inside cp (cp > 1 and tp > 1): false, Megatron-LM's (each layer's weights sharded over tp, replicated over
  // cp); true, train_gpt's MegatronRing (strategy/megatron_ring.hpp: the weights sharded over the whole cp x tp
  // group, each sublayer all-gathering its cp sub-group's shards before use, forward and again in backward, and
  // reduce-scattering its weight gradient back over cp; perf_model.hpp prices the three, exposed).
  bool cp_gathers_weights = false;
  // train_gpt's ZeRO-3 (model/zero3_prefetch.hpp): each layer's gather posted while the layer before it computes and
  // each gradient reduce-scatter finished after the next layer's backward (true, --zero3-prefetch on), or each waited
  // for where it is posted (false); perf_model.hpp prices the overlap that schedule allows.
  bool zero3_prefetch = true;
  Trainer trainer = Trainer::megatron;
  FlopConvention flops = FlopConvention::causal;  // the model FLOPs of MFU (a non-causal model counts the full square)

  // Keys each token attends to in the model FLOPs of MFU.
  double flop_context() const {
    return causal && flops == FlopConvention::causal ? double(seq) / 2.0 : double(seq);
  }
};

// The layers of each pipeline stage: L layers on pp stages, q = ceil(L / pp) each, except that the d = q pp - L
// stages one layer short are taken from the ends, the first and the last first (the first stage holds the
// embedding, the last the logits): Llama 3 405B's 126 layers on 16 stages give 7, 8 x 14, 7. Each stage holds a
// contiguous range of layers (the model does not follow which chunk an interleaved schedule gives which stage; the
// chunks of a stage are cut from its layers, so every stage holds the same layers for every v).
struct StageLayout {
  std::int64_t layers = 0;  // L
  int pp = 1;
  std::int64_t q = 0;       // layers of a full stage
  std::int64_t short_front = 0, short_back = 0;  // stages one layer short at each end

  std::int64_t layers_of(int stage) const {
    const bool short_stage = stage < short_front || stage >= pp - short_back;
    return q - (short_stage ? 1 : 0);
  }
  std::int64_t first_of(int stage) const {
    const std::int64_t before = std::min<std::int64_t>(stage, short_front) +
                                std::max<std::int64_t>(0, std::int64_t(stage) - (pp - short_back));
    return std::int64_t(stage) * q - before;
  }
  std::int64_t fewest() const { return short_front + short_back > 0 ? q - 1 : q; }
  // The stages whose time or memory can be the largest: the first (embedding, most micro-batches in flight), the
  // last (logits) and, when the ends are short, the first full stage from each end.
  std::vector<int> candidates() const {
    std::vector<int> s{0};
    if (short_front + short_back > 0) {
      s.push_back(int(short_front));
      s.push_back(pp - 1 - int(short_back));
    }
    s.push_back(pp - 1);
    std::sort(s.begin(), s.end());
    s.erase(std::unique(s.begin(), s.end()), s.end());
    return s;
  }
};

inline StageLayout stage_layout(std::int64_t layers, int pp) {
  StageLayout s{.layers = layers, .pp = pp};
  s.q = (layers + pp - 1) / pp;
  const std::int64_t d = s.q * pp - layers;
  s.short_front = (d + 1) / 2;
  s.short_back = d / 2;
  return s;
}

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
// tp, widths over their axes, layers into pp * v chunks of at least one layer (uneven stages allowed), experts over
// ep, ep inside dp x cp, etp inside tp, the batch over dp * mb, and interleaving's micro-batches over pp; and
// sequence parallelism off only where it can be (1D tp, no experts under tp).
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
  if (const StageLayout stages = stage_layout(m.layers, c.pp); stages.fewest() < c.virtual_stages)
    return fmt::format("layers = {} cannot be cut into pp = {} stages of v = {} chunks of at least one layer (the "
                       "shortest stage would hold {})", m.layers, c.pp, c.virtual_stages, stages.fewest());
  if (c.virtual_stages > 1 && c.pp == 1) return "virtual stages need pp > 1";
  if (s.global_batch % (std::int64_t(c.dp) * c.micro_batch) != 0)
    return fmt::format("global batch {} not divisible by dp * mb = {}", s.global_batch, c.dp * c.micro_batch);
  if (c.virtual_stages > 1 && micro_batches(s, c) % c.pp != 0)
    return fmt::format("interleaving needs micro-batches ({}) divisible by pp = {}", micro_batches(s, c), c.pp);
  if (!c.sequence_parallel && c.tp_x > 1)
    return fmt::format("sequence parallelism off needs 1D tensor parallelism (tp_x = 1, not {}): the 2D layout "
                       "always shards the sequence", c.tp_x);
  if (!c.sequence_parallel && m.is_moe() && c.tp() > 1)
    return "sequence parallelism off with experts needs tp = 1 (expert layers dispatch the tp ranks' sequence shards)";
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
