// paradyse/model/gpt.hpp: a GPT language model over the layer stack, trained with a per-layer strategy plan.
//
//   tokens [b, n_r] -> embedding -> TransformerStack (plan) -> final norm -> LM head -> logits [b, n_r, vocab]
//   loss = sum over every rank's counted tokens of cross_entropy(logits, next-token target) / counted tokens
//
// Layout. Rank r holds its tokens of the sequence in the unified layout (strategy/sequence_layout.hpp: contiguous
// chunk r, or chunks r and 2p-1-r when the model is causal-zigzag); `shard_tokens` cuts a global [b, s] token array
// that way. Targets are given per token (the next token, or ops::cpu::kIgnoreIndex to leave a token out).
//
// Weights. The layers hold their unified shards (contract/weight_shards.hpp), identical whichever strategy runs. The token
// embedding [vocab, h], the final norm and the LM head [vocab, h] are small and REPLICATED on every rank; their
// gradients are partial sums over the rank's tokens, all-reduced over the group once per step (one collective for
// all of them). The head is untied by default; with `tied_head` the head is the embedding table itself, so its
// gradient adds into the embedding's. The final norm, the LM head and the loss are model/head_loss.hpp's (in row
// chunks of kHeadChunkRows: memory O(chunk x vocab), not O(n_r x vocab)).
//
// Optimizer. AdamW on each rank's own shards and on the replicated weights (every rank applies the same update to
// them, since their gradients are identical after the all-reduce). Weight decay applies to matrices, not to norms.
//
// Mixed precision. Gpt<Strategies, ops::CpuBf16> (ops/cpu/bf16_backend.hpp) trains in bf16 mixed precision: the
// weights this class holds are the fp32 MASTER weights (AdamW, its moments and the gradients stay fp32), every
// compute op reads weights and activations as bf16 (the working copy: the masters rounded, as a copy cast after
// each step holds), and the residual stream is stored bf16 between sublayers (model/layer.hpp's store_activation).
// compute_dtype says which; checkpoints save the fp32 masters and say it (metadata compute_dtype).
//
// MoE. With GptConfig::moe the layers from first_k_dense on are MoE layers (model/moe_half.hpp): their FFN is the
// MoE sublayer, its expert shards are in stack().moe_weights(), the plan's SublayerChoice::moe picks its strategy,
// and its router losses (aux, z; their gradients enter backward times their coefficients) and expert load are in
// stack().moe_stats() after each forward. forward_backward's loss is the cross-entropy alone.
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/core/rng.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/contract/layer_config.hpp"
#include "paradyse/model/adamw.hpp"
#include "paradyse/model/head_loss.hpp"
#include "paradyse/model/layer.hpp"
#include "paradyse/model/moe_half.hpp"
#include "paradyse/model/placement.hpp"
#include "paradyse/moe/moe_weights.hpp"
#include "paradyse/model/stack.hpp"
#include "paradyse/contract/weight_shards.hpp"
#include "paradyse/ops/backend.hpp"
#include "paradyse/strategy/buffer_pool.hpp"
#include "paradyse/strategy/sequence_layout.hpp"
#include "paradyse/strategy/strategies.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <span>
#include <tuple>
#include <utility>
#include <vector>

namespace paradyse {

struct GptConfig {
  LayerConfig layer;        // every layer's shape; causal and zigzag are the model's
  int layers = 1;
  std::int64_t vocab = 256;
  bool tied_head = false;   // LM head = the embedding table
  std::optional<MoeLayers> moe;  // MoE layers from moe->first_k_dense on (none: a dense GPT)

  bool is_moe_layer(int l) const noexcept { return moe.has_value() && moe->is_moe(l); }

  void validate() const {
    layer.validate();
    check(layers >= 1, "GptConfig: layers = {} must be at least 1", layers);
    if (moe) moe->validate_for(layer, layers);
    check(vocab >= 2, "GptConfig: vocab = {} must be at least 2", vocab);
    check(vocab <= std::int64_t(1) << 31, "GptConfig: vocab = {} does not fit int32 token ids", vocab);
  }
  void validate_for(int ranks) const {
    validate();
    layer.validate_for(ranks);
  }
  // Rows of the replicated pack: embedding, head (untied only), final norm gamma and beta.
  std::int64_t replicated_rows() const { return vocab * (tied_head ? 1 : 2) + 2; }
  // Parameters of the whole model (global).
  std::int64_t parameter_count() const {
    const LayerConfig& c = layer;
    const std::int64_t attention = (2 * c.q_width() + 2 * c.kv_width()) * c.hidden + 4 * c.hidden;
    const std::int64_t mlp = (c.activation == Activation::swiglu ? 3 : 2) * c.ffn * c.hidden;
    std::int64_t total = replicated_rows() * c.hidden;
    for (int l = 0; l < layers; ++l) {
      total += attention;
      if (!is_moe_layer(l)) {
        total += mlp;
        continue;
      }
      const MoeConfig& m = moe->moe;
      total += m.experts * c.hidden + 3 * m.experts * m.expert_ffn * c.hidden + 3 * m.shared_width() * c.hidden +
               (m.shared_gate ? c.hidden : 0);
    }
    return total;
  }
  friend bool operator==(const GptConfig&, const GptConfig&) = default;
};

// The whole model, unsharded: float64 for references, float for checkpoints.
template <class T>
struct GlobalGptWeights {
  Tensor<T> embedding;    // [vocab, h]
  Tensor<T> head;         // [vocab, h]; empty when tied
  Tensor<T> final_gamma;  // [h]
  Tensor<T> final_beta;   // [h] (unused by RMSNorm)
  std::vector<GlobalLayerWeights<T>> layers;  // the dense MLP of an MoE layer is unused
  std::vector<GlobalMoeWeights<T>> moe_layers;  // per layer with MoE layers (empty weights for dense layers)

  GlobalGptWeights() = default;
  explicit GlobalGptWeights(const GptConfig& c)
      : embedding(Shape{c.vocab, c.layer.hidden}), head(Shape{c.tied_head ? 0 : c.vocab, c.layer.hidden}),
        final_gamma(Shape{c.layer.hidden}), final_beta(Shape{c.layer.hidden}) {
    for (int l = 0; l < c.layers; ++l) layers.emplace_back(c.layer);
    if (c.moe)
      for (int l = 0; l < c.layers; ++l) moe_layers.push_back(c.is_moe_layer(l) ? GlobalMoeWeights<T>(c.moe->moe) : GlobalMoeWeights<T>());
  }
};

namespace gpt_detail {

enum class Part : std::uint64_t { embedding = 0x51, head = 0x52 };

// Row `row` of the embedding or head drawn from its own stream, so every rank draws the same replicated weights.
template <class T>
void init_row(const GptConfig& c, std::uint64_t seed, Part part, std::int64_t row, std::span<T> out) {
  // Untied: unit-variance embeddings (the residual stream starts at the scale of the sublayers' outputs) and a head
  // of std 1/sqrt(h) (unit-variance logits from normalised rows). Tied: both roles share 1/sqrt(h).
  const double std_dev = part == Part::embedding && !c.tied_head ? 1.0 : 1.0 / std::sqrt(double(c.layer.hidden));
  Rng mix(seed ^ (std::uint64_t(part) * 0x9e3779b97f4a7c15ull));
  mix.next_u64();
  Rng rng(mix.next_u64() ^ (std::uint64_t(row) * 0xd1b54a32d192ed03ull));
  rng.fill_normal(out, std_dev);
}

inline std::span<float> row_span(Tensor<float>& t, std::int64_t row) {
  return {t.data() + row * t.extent(1), std::size_t(t.extent(1))};
}

}  // namespace gpt_detail

// The global model drawn from `seed` (what Gpt(config, ranks, rank, seed) shards assemble to, for any p).
template <class T>
GlobalGptWeights<T> init_global_gpt(const GptConfig& c, std::uint64_t seed) {
  c.validate();
  GlobalGptWeights<T> g(c);
  const std::int64_t h = c.layer.hidden;
  for (std::int64_t v = 0; v < c.vocab; ++v) {
    gpt_detail::init_row(c, seed, gpt_detail::Part::embedding, v, std::span<T>(g.embedding.data() + v * h, std::size_t(h)));
    if (!c.tied_head)
      gpt_detail::init_row(c, seed, gpt_detail::Part::head, v, std::span<T>(g.head.data() + v * h, std::size_t(h)));
  }
  g.final_gamma.fill(T(1));
  g.final_beta.fill(T(0));
  for (int l = 0; l < c.layers; ++l) g.layers[std::size_t(l)] = init_global<T>(c.layer, seed + std::uint64_t(l));
  for (int l = 0; l < c.layers; ++l)
    if (c.is_moe_layer(l)) g.moe_layers[std::size_t(l)] = init_global_moe<T>(c.moe->moe, seed + std::uint64_t(l));
  return g;
}

// Rank r's tokens [b, n_r] of a global token array [b, s] (row-major), in the order of the unified layout.
inline Tensor<std::int32_t> shard_tokens(std::span<const std::int32_t> global, std::int64_t batch,
                                         const SequenceLayout& layout, int rank) {
  const std::int64_t s = layout.length(), n = layout.local_length(rank);
  check(std::int64_t(global.size()) == batch * s, "shard_tokens: {} tokens given, expected b x s = {} x {}",
        global.size(), batch, s);
  Tensor<std::int32_t> local(Shape{batch, n});
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t i = 0; i < n; ++i) local(b, i) = global[std::size_t(b * s + layout.position(rank, i))];
  return local;
}

// What one forward-backward measured.
struct GptStepResult {
  double loss = 0;              // mean over the counted tokens of every rank
  std::int64_t counted = 0;     // tokens with a target, over every rank
};

template <class Strategies = AllStrategies<>, class Backend = ops::Cpu>
class Gpt {
public:
  using Stack = TransformerStack<Strategies, Backend>;
  // What activations and working weights are stored as: bf16 under a bf16 backend (ops::CpuBf16), else fp32.
  static constexpr DType compute_dtype = [] {
    if constexpr (requires { Backend::activation_dtype; }) return DType(Backend::activation_dtype);
    else return DType::f32;
  }();
  static constexpr std::int64_t kHeadChunkRows = paradyse::kHeadChunkRows;  // model/head_loss.hpp

  // Rank `rank`'s part of the model drawn from `seed` (the same global model for every group size).
  Gpt(const GptConfig& config, int ranks, int rank, std::uint64_t seed)
      : config_(checked(config, ranks)), ranks_(ranks), rank_(rank),
        stack_(make_stack(config, ranks, rank, seed)) {
    replicated_ = drawn_on_host<Backend>([&] {
      Tensor<float> pack(replicated_shape());
      const std::int64_t v = config.vocab;
      for (std::int64_t i = 0; i < v; ++i) {
        gpt_detail::init_row(config, seed, gpt_detail::Part::embedding, i, gpt_detail::row_span(pack, i));
        if (!config.tied_head)
          gpt_detail::init_row(config, seed, gpt_detail::Part::head, i, gpt_detail::row_span(pack, v + i));
      }
      std::ranges::fill(gpt_detail::row_span(pack, final_row()), 1.0f);  // the final norm's gamma
      return pack;
    });
    allocate_training_state();
  }

  // Rank `rank`'s part of given global weights (any element type, converted to float).
  template <class T>
  Gpt(const GptConfig& config, const GlobalGptWeights<T>& global, int ranks, int rank)
      : config_(checked(config, ranks)), ranks_(ranks), rank_(rank),
        stack_(stack_of(config, global, ranks, rank)) {
    replicated_ = drawn_on_host<Backend>([&] {
      Tensor<float> pack(replicated_shape());
      load_replicated(global, pack);
      return pack;
    });
    allocate_training_state();
  }

  const GptConfig& config() const noexcept { return config_; }
  int ranks() const noexcept { return ranks_; }
  int rank() const noexcept { return rank_; }
  Stack& stack() noexcept { return stack_; }
  const Stack& stack() const noexcept { return stack_; }
  std::int64_t steps_taken() const noexcept { return step_; }
  // The AdamW state, for checkpoints that resume training (model/checkpoint.hpp): the first and second moments of
  // the layer shards (per layer, shaped as the weights) and of the replicated pack, and the step count.
  std::vector<LayerWeights>& moment1() noexcept { return moment1_; }
  std::vector<LayerWeights>& moment2() noexcept { return moment2_; }
  Tensor<float>& replicated_moment1() noexcept { return replicated_m_; }
  Tensor<float>& replicated_moment2() noexcept { return replicated_v_; }
  // The AdamW moments of the MoE layers' expert shards (per layer, shaped as stack().moe_weights(); empty for dense
  // layers).
  std::vector<MoeShard>& moe_moment1() noexcept { return moe_moment1_; }
  std::vector<MoeShard>& moe_moment2() noexcept { return moe_moment2_; }
  void set_steps_taken(std::int64_t steps) {
    check(steps >= 0, "Gpt: steps taken = {} must be non-negative", steps);
    step_ = steps;
  }

  // The replicated weights and their gradients.
  TensorView<float> embedding() { return replicated_.view().slice(0, 0, config_.vocab); }               // [V, h]
  TensorView<float> head() { return replicated_.view().slice(0, head_row(), config_.vocab); }           // [V, h]
  std::span<float> final_gamma() { return final_norm_row(0); }
  std::span<float> final_beta() { return final_norm_row(1); }
  TensorView<float> embedding_gradient() { return replicated_grad_.view().slice(0, 0, config_.vocab); }
  TensorView<float> head_gradient() { return replicated_grad_.view().slice(0, head_row(), config_.vocab); }
  std::span<float> final_gamma_gradient() { return grad_row(final_row()); }
  std::span<float> final_beta_gradient() { return grad_row(final_row() + 1); }
  // The whole replicated pack [rows, h]: embedding, head (untied), final gamma, final beta.
  Tensor<float>& replicated() noexcept { return replicated_; }
  Tensor<float>& replicated_gradient() noexcept { return replicated_grad_; }

  void zero_gradients() {
    stack_.zero_gradients();
    zero_state<Backend>(replicated_grad_);
  }

  // Forward and backward of one batch; gradients ACCUMULATE (call zero_gradients() first for a fresh step).
  // tokens, targets: [b, n_r] int32, this rank's tokens of a sequence of seq_len tokens in the unified layout.
  // Every rank of the group calls it with the same plan, seq_len and documents. Returns the loss over every rank's
  // tokens. document_starts: packed documents of every sequence (global starts, first 0; attention within a
  // document, RoPE positions restarting at each); the caller keeps the loss inside documents: a token's target is
  // the next token of its own document or the ignore index (data/packing.hpp's packed windows carry their own
  // next bytes).
  template <Communicator C>
  GptStepResult forward_backward(C& comm, BufferPool& pool, const StackPlan& plan, std::int64_t seq_len,
                                 TensorView<const std::int32_t> tokens, TensorView<const std::int32_t> targets,
                                 std::span<const std::int64_t> document_starts = {}) {
    // Counted tokens over the group first: every token's loss gradient is scaled by 1 / total.
    double counts[2] = {0.0, check_batch(comm, seq_len, tokens, targets)};  // loss sum, counted tokens
    Tensor<std::int32_t> token_storage, target_storage;  // a device backend's copies of the batch
    tokens = placed_ids(tokens, token_storage);
    targets = placed_ids(targets, target_storage);
    double total_counted = 0.0;
    comm.all_reduce(std::span<const double>(&counts[1], 1), std::span<double>(&total_counted, 1), ReduceOp::sum);
    check(total_counted > 0, "Gpt: no token of the batch has a target (all {} are the ignore index)",
          tokens.extent(0) * seq_len);
    const float grad_scale = float(1.0 / total_counted);

    // This step's contributions to the replicated gradients, all-reduced at the end (so accumulation stays exact).
    Tensor<float> replicated_partial(replicated_grad_.shape());
    Tensor<float> hidden = embed_and_stack_forward(comm, pool, plan, seq_len, tokens, document_starts);
    const Shape activation = hidden.shape();  // [b, n_r, h]
    Tensor<float> dhidden(activation);
    counts[0] = norm_head_loss<Backend>(config_.layer, hidden.view(), targets, head_parameters(replicated_partial),
                                        grad_scale, dhidden.view());
    hidden = Tensor<float>();
    {
      Tensor<float> dx(activation);
      stack_.backward(comm, pool, dhidden.view(), dx.view());
      dhidden = Tensor<float>();
      Backend::embedding_backward(tokens, dx.view(),
                                  replicated_partial.view().slice(0, 0, config_.vocab));
    }
    comm.all_reduce(std::span<const float>(replicated_partial.span()), replicated_partial.span(), ReduceOp::sum);
    Backend::add_into(replicated_grad_.span(), std::span<const float>(replicated_partial.span()));
    double loss_sum = 0.0;
    comm.all_reduce(std::span<const double>(&counts[0], 1), std::span<double>(&loss_sum, 1), ReduceOp::sum);
    return {loss_sum / total_counted, std::int64_t(total_counted)};
  }

  // Forward only (evaluation, inference-time studies such as Alloc-MoE's with stack().set_moe_top_k): the mean
  // loss over every rank's counted tokens, as forward_backward's, with no gradient touched. Collective, as
  // forward_backward; stack().moe_stats() holds the MoE layers' losses and load afterwards.
  template <Communicator C>
  GptStepResult evaluate(C& comm, BufferPool& pool, const StackPlan& plan, std::int64_t seq_len,
                         TensorView<const std::int32_t> tokens, TensorView<const std::int32_t> targets,
                         std::span<const std::int64_t> document_starts = {}) {
    double counts[2] = {0.0, check_batch(comm, seq_len, tokens, targets)};  // loss sum, counted tokens
    Tensor<std::int32_t> token_storage, target_storage;  // a device backend's copies of the batch
    tokens = placed_ids(tokens, token_storage);
    targets = placed_ids(targets, target_storage);
    Tensor<float> hidden = embed_and_stack_forward(comm, pool, plan, seq_len, tokens, document_starts);
    stack_.discard_step();  // what forward kept for a backward
    counts[0] = norm_head_loss_forward<Backend>(config_.layer, hidden.view(), targets, final_gamma(), final_beta(),
                                                TensorView<const float>(head()));
    double sums[2] = {0.0, 0.0};
    comm.all_reduce(std::span<const double>(counts, 2), std::span<double>(sums, 2), ReduceOp::sum);
    check(sums[1] > 0, "Gpt::evaluate: no token of the batch has a target");
    return {sums[0] / sums[1], std::int64_t(sums[1])};
  }

  // One AdamW step (model/adamw.hpp) on this rank's shards and the replicated weights with the accumulated gradients:
  // decay on the matrices, none on the norms.
  void optimizer_step(const ops::AdamWConfig& adamw) {
    ++step_;
    std::vector<AdamWTensor> tensors;
    const auto add = [&](Tensor<float>& p, Tensor<float>& g, Tensor<float>& m, Tensor<float>& v, bool decays) {
      tensors.push_back({p.view(), g.view(), m.view(), v.view(), decays});
    };
    for (int l = 0; l < stack_.layers(); ++l) {
      LayerWeights& w = stack_.weights()[std::size_t(l)];
      LayerWeights& g = stack_.gradients()[std::size_t(l)];
      LayerWeights& m = moment1_[std::size_t(l)];
      LayerWeights& v = moment2_[std::size_t(l)];
      add(w.attention.packed, g.attention.packed, m.attention.packed, v.attention.packed, true);
      add(w.mlp.packed, g.mlp.packed, m.mlp.packed, v.mlp.packed, true);
      add(w.norms.packed, g.norms.packed, m.norms.packed, v.norms.packed, false);
      if (!stack_.is_moe_layer(l)) continue;
      MoeShard& mw = stack_.moe_weights()[std::size_t(l)];
      MoeShard& mg = stack_.moe_gradients()[std::size_t(l)];
      MoeShard& mm = moe_moment1_[std::size_t(l)];
      MoeShard& mv = moe_moment2_[std::size_t(l)];
      for (auto member : {&MoeShard::router, &MoeShard::expert_in, &MoeShard::expert_out, &MoeShard::shared_in,
                          &MoeShard::shared_out, &MoeShard::shared_gate})
        add(mw.*member, mg.*member, mm.*member, mv.*member, true);
    }
    // The replicated pack: matrices (rows before the final norm) with decay, the final norm without.
    const std::int64_t matrix_rows = final_row();
    const auto rows_of = [](Tensor<float>& t, std::int64_t start, std::int64_t count) { return t.view().slice(0, start, count); };
    for (const auto& [start, count, decays] : {std::tuple{std::int64_t(0), matrix_rows, true},
                                              std::tuple{matrix_rows, std::int64_t(2), false}})
      tensors.push_back({rows_of(replicated_, start, count), rows_of(replicated_grad_, start, count),
                         rows_of(replicated_m_, start, count), rows_of(replicated_v_, start, count), decays});
    adamw_update<Backend>(tensors, adamw, step_);
  }

  // After a failed step (an OutOfMemory on some rank, a communication error): drop what the step kept (saved
  // activations) and its partial gradients, so the model is as it was before the step. Allocates nothing, so it
  // works under the memory cap the step ran out of.
  void recover_from_failed_step() {
    stack_.discard_step();
    zero_gradients();
  }

  // Bytes this rank holds for the replicated weights, their gradients and AdamW moments.
  static std::int64_t replicated_state_bytes(const GptConfig& c) {
    return 4 * c.replicated_rows() * c.layer.hidden * std::int64_t(sizeof(float));
  }
  // The most bytes forward_backward allocates outside the stack at any one time on a rank with n_r tokens
  // (batch b), besides the replicated state: the step's replicated partial gradients plus the largest of the
  // phases (stack forward: embedding output and stack output; head: stack output, normed rows and their
  // gradient, norm statistics, one chunk of logits, the stack output's gradient; stack backward: two activations).
  static std::int64_t activation_bytes(const GptConfig& c, std::int64_t batch, std::int64_t local_tokens) {
    const auto bytes = [](std::int64_t floats) { return (floats * 4 + 63) / 64 * 64; };  // the tracker's rounding
    const std::int64_t rows = batch * local_tokens, act = bytes(rows * c.layer.hidden);
    const std::int64_t chunk = std::min(rows, kHeadChunkRows);
    const std::int64_t head_phase = 4 * act + bytes(2 * rows) + bytes(chunk * c.vocab);
    return bytes(c.replicated_rows() * c.layer.hidden) + std::max(2 * act, head_phase);
  }

private:
  // Throws unless this is the rank the model was built for and tokens, targets are its [b, n_r] of a sequence of
  // seq_len tokens with every target in [0, vocab) or the ignore index; returns how many targets are counted.
  template <Communicator C>
  double check_batch(C& comm, std::int64_t seq_len, TensorView<const std::int32_t> tokens,
                     TensorView<const std::int32_t> targets) const {
    check(comm.size() == ranks_ && comm.rank() == rank_, "Gpt: built for rank {} of {}, run on rank {} of {}", rank_,
          ranks_, comm.rank(), comm.size());
    const std::int64_t n = SequenceLayout(seq_len, ranks_, config_.layer.zigzag).local_length(rank_);
    const std::int64_t vocab = config_.vocab;
    check(tokens.rank() == 2 && tokens.extent(1) == n && tokens.is_contiguous(),
          "Gpt: tokens {} must be [b, n_r] with n_r = {} (rank {}'s tokens of a sequence of {} over {} ranks)",
          tokens.shape(), n, rank_, seq_len, ranks_);
    check(targets.shape() == tokens.shape() && targets.is_contiguous(), "Gpt: targets {} must have the shape of tokens {}",
          targets.shape(), tokens.shape());
    double counted = 0.0;
    for (std::int64_t i = 0; i < targets.numel(); ++i) {
      const std::int32_t t = targets.data()[i];
      check(t == ops::cpu::kIgnoreIndex || (t >= 0 && t < vocab),
            "Gpt: target {} at local index {} is outside [0, {}) and not the ignore index {}", t, i, vocab,
            ops::cpu::kIgnoreIndex);
      counted += t != ops::cpu::kIgnoreIndex ? 1.0 : 0.0;
    }
    return counted;
  }

  // The embedding and the stack's forward of this rank's (placed) tokens [b, n_r]: the stack's output [b, n_r, h].
  // The stack keeps what its backward needs; evaluate() discards it.
  template <Communicator C>
  Tensor<float> embed_and_stack_forward(C& comm, BufferPool& pool, const StackPlan& plan, std::int64_t seq_len,
                                        TensorView<const std::int32_t> tokens,
                                        std::span<const std::int64_t> document_starts) {
    const std::int64_t n = SequenceLayout(seq_len, ranks_, config_.layer.zigzag).local_length(rank_);
    const Shape activation{tokens.extent(0), n, config_.layer.hidden};
    Tensor<float> hidden(activation);
    Tensor<float> x(activation);
    Backend::embedding_forward(tokens, TensorView<const float>(embedding()), x.view());
    stack_.set_documents(document_starts);
    stack_.forward(comm, pool, plan, seq_len, x.view(), hidden.view());
    return hidden;
  }

  // Token ids (host memory, as the caller gives them) where Backend computes: the view itself for a host backend;
  // for a device backend a copy in the calling thread's tracker, held by `storage`.
  static TensorView<const std::int32_t> placed_ids(TensorView<const std::int32_t> ids, Tensor<std::int32_t>& storage) {
    if constexpr (!ops::on_device<Backend>) {
      return ids;
    } else {
      storage = Tensor<std::int32_t>(ids.shape());
      // A bit copy (the backend copies floats; ids are contiguous, checked by check_batch): no arithmetic touches them.
      const std::size_t n = std::size_t(ids.numel());
      Backend::copy(std::span<const float>(reinterpret_cast<const float*>(ids.data()), n),
                    std::span<float>(reinterpret_cast<float*>(storage.data()), n));
      return storage.view();
    }
  }

  static const GptConfig& checked(const GptConfig& c, int ranks) {
    c.validate_for(ranks);
    return c;
  }
  static Stack make_stack(const GptConfig& c, int ranks, int rank, std::uint64_t seed) {
    if (c.moe) return Stack(c.layer, c.layers, ranks, rank, seed, *c.moe);
    return Stack(c.layer, c.layers, ranks, rank, seed);
  }
  template <class T>
  static Stack stack_of(const GptConfig& c, const GlobalGptWeights<T>& global, int ranks, int rank) {
    if (!c.moe) return Stack(c.layer, shards_of(c, global, ranks, rank), ranks);
    check(std::int64_t(global.moe_layers.size()) == c.layers, "Gpt: the global weights have {} MoE layer entries, "
          "the config {} layers", global.moe_layers.size(), c.layers);
    std::vector<MoeShard> experts;
    for (int l = 0; l < c.layers; ++l)
      experts.push_back(c.is_moe_layer(l) ? drawn_on_host<Backend>([&] {
        return moe_shard_of(global.moe_layers[std::size_t(l)], c.moe->moe, ranks, rank);
      }) : empty_moe_shard());
    return Stack(c.layer, shards_of(c, global, ranks, rank), std::move(experts), *c.moe, ranks);
  }
  template <class T>
  static std::vector<LayerWeights> shards_of(const GptConfig& c, const GlobalGptWeights<T>& global, int ranks, int rank) {
    check(std::int64_t(global.layers.size()) == c.layers, "Gpt: the global weights have {} layers, the config {}",
          global.layers.size(), c.layers);
    std::vector<LayerWeights> shards;
    for (const GlobalLayerWeights<T>& layer : global.layers)
      shards.push_back(drawn_on_host<Backend>([&] { return shard_of(layer, c.layer, ranks, rank); }));
    return shards;
  }

  std::int64_t head_row() const noexcept { return config_.tied_head ? 0 : config_.vocab; }
  std::int64_t final_row() const noexcept { return config_.replicated_rows() - 2; }
  std::span<float> final_norm_row(int i) { return gpt_detail::row_span(replicated_, final_row() + i); }
  std::span<float> grad_row(std::int64_t row) { return gpt_detail::row_span(replicated_grad_, row); }
  static std::span<float> partial_row(Tensor<float>& t, std::int64_t row) { return gpt_detail::row_span(t, row); }

  // The replicated pack [rows, h]: embedding, head (untied), final gamma, final beta.
  Shape replicated_shape() const { return Shape{config_.replicated_rows(), config_.layer.hidden}; }
  // The replicated gradient and every AdamW moment (zeros, in the calling thread's tracker).
  void allocate_training_state() {
    replicated_grad_ = Tensor<float>(replicated_shape());
    replicated_m_ = Tensor<float>(replicated_.shape());
    replicated_v_ = Tensor<float>(replicated_.shape());
    for (int l = 0; l < config_.layers; ++l) {
      moment1_.emplace_back(config_.layer, ranks_);
      moment2_.emplace_back(config_.layer, ranks_);
      MoeShard& m1 = moe_moment1_.emplace_back(empty_moe_shard());
      MoeShard& m2 = moe_moment2_.emplace_back(empty_moe_shard());
      if (!config_.is_moe_layer(l)) continue;
      moment1_.back().mlp = MlpShard();  // an MoE layer has no dense MLP: empty moments [0, h]
      moment2_.back().mlp = MlpShard();
      moment1_.back().mlp.packed = Tensor<float>(Shape{0, config_.layer.hidden});
      moment2_.back().mlp.packed = Tensor<float>(Shape{0, config_.layer.hidden});
      const MoeShard& w = stack_.moe_weights()[std::size_t(l)];
      for (MoeShard* m : {&m1, &m2}) {
        m->router = Tensor<float>(w.router.shape());
        m->expert_in = Tensor<float>(w.expert_in.shape());
        m->expert_out = Tensor<float>(w.expert_out.shape());
        m->shared_in = Tensor<float>(w.shared_in.shape());
        m->shared_out = Tensor<float>(w.shared_out.shape());
        m->shared_gate = Tensor<float>(w.shared_gate.shape());
      }
    }
  }
  // The global embedding, head and final norm into `pack` (host memory, [rows, h]).
  template <class T>
  void load_replicated(const GlobalGptWeights<T>& global, Tensor<float>& pack) const {
    const std::int64_t v = config_.vocab, h = config_.layer.hidden;
    check(global.embedding.shape() == Shape{v, h}, "Gpt: the global embedding {} must be [vocab, h] = [{}, {}]",
          global.embedding.shape(), v, h);
    check(config_.tied_head || global.head.shape() == Shape{v, h}, "Gpt: the global head {} must be [{}, {}]",
          global.head.shape(), v, h);
    check(global.final_gamma.numel() == h && global.final_beta.numel() == h,
          "Gpt: the final norm has {} and {} elements, expected h = {}", global.final_gamma.numel(),
          global.final_beta.numel(), h);
    auto copy_rows = [&](const Tensor<T>& from, std::int64_t first_row) {
      float* to = pack.data() + first_row * h;
      for (std::int64_t i = 0; i < from.numel(); ++i) to[i] = float(from.data()[i]);
    };
    copy_rows(global.embedding, 0);
    if (!config_.tied_head) copy_rows(global.head, v);
    copy_rows(global.final_gamma, final_row());
    copy_rows(global.final_beta, final_row() + 1);
  }

  // The final norm and the head with their gradients in `partial` (the step's replicated partial gradients).
  HeadParameters head_parameters(Tensor<float>& partial) {
    return {final_gamma(), final_beta(), TensorView<const float>(head()), partial_row(partial, final_row()),
            partial_row(partial, final_row() + 1), partial.view().slice(0, head_row(), config_.vocab)};
  }

  GptConfig config_;
  int ranks_, rank_;
  Stack stack_;
  Tensor<float> replicated_, replicated_grad_, replicated_m_, replicated_v_;  // [replicated_rows, h]
  std::vector<LayerWeights> moment1_, moment2_;
  std::vector<MoeShard> moe_moment1_, moe_moment2_;  // per layer (empty for dense layers)
  std::int64_t step_ = 0;
};

}  // namespace paradyse
