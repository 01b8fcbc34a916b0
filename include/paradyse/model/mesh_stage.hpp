// paradyse/model/mesh_stage.hpp: one rank's part of the GPT (model/gpt.hpp) on a dp x pp x cp mesh
// (mesh/device_mesh.hpp, cp innermost) and the forward and backward of its step.
//
//   cp  every stage of every replica is a cp group of C ranks: the sequence is sharded over it in the unified layout
//       and the strategies switch per layer inside it, as in the single-group Gpt;
//   tp  (the stage's group a tp group, a cp x tp group or a tp_x x tp_y grid) with shard_vocabulary, the
//       embedding and the head are sharded by vocabulary rows over the stage's tp ranks (the whole grid for 2-D tp:
//       model/vocab_parallel.hpp, V/T rows each, uneven allowed), replicated over its cp ranks; the final norm stays
//       whole on every rank. Without, every rank of the group holds them whole.
//   pp  the L layers are cut into P stages (uneven allowed; or into P * v virtual stages, v chunks per rank, on the
//       interleaved 1F1B schedule); the stages run the 1F1B schedule of model/pipeline.hpp
//       over the micro-batches, activations [b, n_r, h] passed point to point between the cp ranks of the same cp
//       index. Stage 0 holds the embedding, stage P-1 the final norm, the LM head and the loss
//       (model/head_loss.hpp, as Gpt's);
//   dp  each replica trains its own rows or packed sequence (data/mesh_steps.hpp); the gradients are summed over the
//       dp group by model/mesh_optimizer.hpp's MeshOptimizer;
//       With ZeRO-3 (shard_over_dp), each dp replica keeps 1/D of every parameter and gradient
//       (model/zero3_shards.hpp): a layer's weights are all-gathered over dp before its forward and again before
//       its backward and freed after each, its gradients reduce-scattered over dp after its backward, each gather
//       posted while the layer before it computes and each reduce-scatter finished after the next layer's backward
//       (model/zero3_prefetch.hpp; set_zero3_prefetch(false): each waited for where it is posted); the embedding
//       and the head likewise around each micro-batch's use; an MoE layer's experts, router and shared experts
//       likewise over their edp group (when edp > 1).
//   ep  with MoE layers, the experts over an expert group (e.g. dp x cp) while attention keeps its cp group; with pp
//       stages each stage's MoE layers over its own expert group (the dp x cp ranks of that stage), every replica
//       running as many micro-batches (the all-to-alls of micro-batch i meet the other replicas' micro-batch i);
//       the router losses (aux, z) enter as their mean over a step's micro-batches. Expert data parallelism
//       (ep < dp x cp): the stage's dp x cp ranks split into edp expert groups of ep consecutive ranks, each holding
//       every expert (set_expert_replicas): the all-to-alls run inside each expert group, the router statistics are
//       summed over the edp group as well (so the router losses are the micro-batch's, as with one expert group),
//       and MeshOptimizer sums the MoE tensors' gradients over the edp group. With tp, each expert's columns over
//       the whole tp group or (etp < tp, set_expert_column_group) over etp consecutive ranks of it, the experts then
//       replicated over the tp / etp column groups as well (model/expert_groups.hpp says every group).
//
// Weights are drawn from the seed as Gpt(config, cp, cp_rank, seed) draws them (gpt_detail::init_row), so a mesh
// trains the single group's model. Micro-batches: `rows_per_micro_batch` rows each (the last one the rest), one row
// with pp stages and a replica's rows at once without by default; without pp stages several micro-batches accumulate
// their gradients (forward, backward, forward, ...). Pipeline activations (set_recompute): with
// PipelineRecompute::full (the default) a stage keeps only each in-flight micro-batch's input and recomputes its
// layers' forward before the backward (every micro-batch, the last stage's too: the search prices it so, as Megatron-LM
// runs it); with PipelineRecompute::none it keeps every in-flight micro-batch's activations (the stack's, taken out
// after each forward and put back before that micro-batch's backward: TransformerStack::Activations) and recomputes
// nothing; PipelineRecompute::selective keeps them as none does, less attention's core tensors, which each layer
// re-runs from its kept q, k, v before its backward.
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/layout/chunking.hpp"
#include "paradyse/model/gpt.hpp"
#include "paradyse/model/head_loss.hpp"
#include "paradyse/model/pipeline.hpp"
#include "paradyse/model/stack.hpp"
#include "paradyse/model/vocab_parallel.hpp"
#include "paradyse/model/zero3_prefetch.hpp"
#include "paradyse/model/zero3_shards.hpp"
#include "paradyse/moe/expert_columns.hpp"
#include "paradyse/moe/moe_weights.hpp"
#include "paradyse/ops/backend.hpp"
#include "paradyse/strategy/buffer_pool.hpp"
#include "paradyse/strategy/sequence_layout.hpp"

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <utility>
#include <vector>

namespace paradyse {

// One rank's part of the GPT on the mesh: the layers of its pp stage sharded over its cp group, plus the embedding
// (first stage) or the final norm and LM head (last stage), their gradients, and an optimizer per tensor over dp.
// A PipelineStage (model/pipeline.hpp) over the cp group `C`.
template <class Strategies, Communicator C>
class MeshGptStage {
public:
  using Stack = TransformerStack<Strategies>;
  struct Saved {
    Tensor<float> input;  // [b, n_r, h]: the stage's input, to recompute its forward (PipelineRecompute::full)
    std::optional<typename Stack::Activations> activations;  // the forward's activations (none, selective)
  };

  // Stage `stage` of `stages` holds layers `layers` (global indices) of `config`, sharded over cp rank `cp_rank`
  // of `cp_size` (the MoE layers' experts over ep rank `ep_rank` of `ep_size`), drawn from `seed` as
  // Gpt(config, cp_size, cp_rank, seed) draws them. With `expert_columns` (etp folded over tp: the stage's group is a
  // tp group) each expert is further split by columns over the stage's group (moe/expert_columns.hpp), or with
  // `etp` > 0 over the etp consecutive ranks of it that hold this rank (etp < tp: the experts replicated over the
  // tp / etp column groups; set_expert_column_group gives the group).
  MeshGptStage(const GptConfig& config, int stage, int stages, ChunkRange layers, int cp_size, int cp_rank,
               int ep_size, int ep_rank, std::uint64_t seed, bool expert_columns = false, int etp = 0)
      : config_(config), first_(stage == 0), last_(stage == stages - 1), layers_(layers),
        group_size_(cp_size), group_rank_(cp_rank), vocab_rows_{0, config.vocab},
        stack_(make_stack(config, layers, cp_size, cp_rank, ep_size, ep_rank, seed, expert_columns,
                          etp > 0 ? etp : cp_size)) {
    check(etp >= 0 && (etp == 0 || cp_size % etp == 0), "MeshGptStage: etp = {} must divide the stage's group of {} "
          "ranks", etp, cp_size);
    stack_.set_expert_columns_over_group(expert_columns && config.moe);
    const std::int64_t v = config.vocab, h = config.layer.hidden;
    check(!config.tied_head, "--mesh: the GPT's head is untied");
    // Stages without the embedding or the head hold them empty ([0, h]; a default Tensor is a scalar).
    embedding_ = Tensor<float>(Shape{0, h});
    embedding_grad_ = Tensor<float>(Shape{0, h});
    head_ = Tensor<float>(Shape{0, h});
    head_grad_ = Tensor<float>(Shape{0, h});
    if (first_) {
      embedding_ = Tensor<float>(Shape{v, h});
      embedding_grad_ = Tensor<float>(Shape{v, h});
      for (std::int64_t i = 0; i < v; ++i)
        gpt_detail::init_row(config, seed, gpt_detail::Part::embedding, i, gpt_detail::row_span(embedding_, i));
    }
    if (last_) {  // rows: head [v], final gamma, final beta
      head_ = Tensor<float>(Shape{v + 2, h});
      head_grad_ = Tensor<float>(Shape{v + 2, h});
      for (std::int64_t i = 0; i < v; ++i)
        gpt_detail::init_row(config, seed, gpt_detail::Part::head, i, gpt_detail::row_span(head_, i));
      std::ranges::fill(gpt_detail::row_span(head_, v), 1.0f);
    }
  }

  bool first() const noexcept { return first_; }
  bool last() const noexcept { return last_; }
  const GptConfig& config() const noexcept { return config_; }
  ChunkRange layers() const noexcept { return layers_; }  // the global layers this stage holds
  Stack& stack() noexcept { return stack_; }

  // The step's context: the cp group, the expert group (the cp group itself without experts), the pool, the
  // stage's slice of the plan, the sequence length and its packed documents (global starts; empty: one document).
  void begin_step(C& cp, C& ep, BufferPool& pool, StackPlan plan, std::int64_t seq_len,
                  std::span<const std::int64_t> document_starts = {}) {
    stack_.set_documents(document_starts);
    cp_ = &cp;
    ep_ = &ep;
    pool_ = &pool;
    plan_ = std::move(plan);
    seq_len_ = seq_len;
    lookups_.clear();
    stack_.zero_gradients();
    if (first_) Backend::fill(embedding_grad_.view(), 0.0f);
    if (last_) Backend::fill(head_grad_.view(), 0.0f);
    for (Zero3Tensor& t : zero3_) t.zero_gradient();
    for (Zero3Tensor& t : expert_zero3_) t.zero_gradient();
  }

  // Vocabulary parallelism (kept for the run; before shard_over_dp): from now on this rank holds only rows
  // vocab_rows(V, T, r) of the embedding and of the head (model/vocab_parallel.hpp), r its rank in `tp`, a group of T
  // consecutive ranks of the stage's group (its tp ranks: the whole group for a tp group or a 2-D grid, the tp
  // sub-group of a cp x tp group), and `replicas` the ranks of the stage's group holding the same rows (the cp
  // sub-group; a group of one without cp). The lookup, the logits and the loss run over tp; the rows' gradients are
  // summed over `replicas` (reduce_replicated), the final norm's over both. Collective over tp.
  void shard_vocabulary(C& tp, C& replicas) {
    check(zero3_.empty(), "MeshGptStage::shard_vocabulary: shard the vocabulary before ZeRO-3 (shard_over_dp)");
    check(vocab_ == nullptr, "MeshGptStage::shard_vocabulary: sharded already");
    const int t = int(tp.size());
    check(t * int(replicas.size()) == group_size_, "MeshGptStage::shard_vocabulary: a vocabulary group of {} and {} "
          "replicas for a stage group of {} ranks", t, replicas.size(), group_size_);
    // The tp ranks are consecutive ranks of the stage's group (tp innermost): their tokens' counts follow from it.
    const std::int64_t mine = group_rank_;
    std::vector<std::int64_t> ranks(std::size_t(t), 0);
    tp.all_gather(std::span<const std::int64_t>(&mine, 1), std::span<std::int64_t>(ranks));
    vocab_first_ = group_rank_ - int(tp.rank());
    for (int q = 0; q < t; ++q)
      check(ranks[std::size_t(q)] == vocab_first_ + q, "MeshGptStage::shard_vocabulary: rank {} of the vocabulary "
            "group is rank {} of the stage's group, expected {} (consecutive ranks)", q, ranks[std::size_t(q)],
            vocab_first_ + q);
    vocab_ = &tp;
    vocab_replicas_ = &replicas;
    vocab_rows_ = vocab_rows(config_.vocab, t, int(tp.rank()));
    const std::int64_t h = config_.layer.hidden;
    // Keeps this rank's vocabulary rows of `whole`, and the `extra` rows after row V (the head's final norm).
    const auto keep = [&](Tensor<float>& whole, std::int64_t extra) {
      Tensor<float> kept(Shape{vocab_rows_.length + extra, h});
      Backend::copy(TensorView<const float>(whole.view()).slice(0, vocab_rows_.start, vocab_rows_.length),
                    kept.view().slice(0, 0, vocab_rows_.length));
      if (extra > 0)
        Backend::copy(TensorView<const float>(whole.view()).slice(0, config_.vocab, extra),
                      kept.view().slice(0, vocab_rows_.length, extra));
      whole = std::move(kept);
    };
    if (first_) {
      keep(embedding_, 0);
      embedding_grad_ = Tensor<float>(embedding_.shape());
    }
    if (last_) {
      keep(head_, 2);
      head_grad_ = Tensor<float>(head_.shape());
    }
  }
  // The vocabulary rows this rank's embedding and head hold ([0, V) without shard_vocabulary), and the group they
  // are sharded over (null without).
  ChunkRange vocabulary_rows() const noexcept { return vocab_rows_; }
  C* vocabulary_group() const noexcept { return vocab_; }

  // ZeRO-3 over `dp` (kept for the run): from now on this rank keeps only its chunk of every parameter and gradient
  // (zero3_shards()), the full tensors gathered around each use. An MoE layer's attention and norms are sharded as a
  // dense layer's (its MLP shard is empty). Its MoE tensors (router, routed experts, shared experts: parameters()
  // with over_dp = false) are held by every rank of their edp group alone, not by the dp group (each expert lives
  // on one rank of its expert group, which spans dp): with expert data parallelism (set_expert_replicas first, edp >
  // 1) they are sharded over edp the same way (expert_zero3_shards()): all-gathered over edp around the layer's
  // forward and backward, their gradients reduce-scattered (summed) over edp. Without (edp = 1) they stay whole.
  void shard_over_dp(C& dp) {
    check(zero3_.empty(), "MeshGptStage::shard_over_dp: sharded already");
    dp_ = &dp;
    const int d = int(dp.size()), r = int(dp.rank());
    for (std::size_t l = 0; l < stack_.weights().size(); ++l) {
      LayerWeights& w = stack_.weights()[l];
      LayerWeights& g = stack_.gradients()[l];
      zero3_.emplace_back(&w.attention.packed, &g.attention.packed, w.attention.packed.numel(), d, r);
      zero3_.emplace_back(&w.mlp.packed, &g.mlp.packed, w.mlp.packed.numel(), d, r);
      zero3_.emplace_back(&w.norms.packed, &g.norms.packed, 0, d, r);
    }
    if (first_) zero3_.emplace_back(&embedding_, &embedding_grad_, embedding_.numel(), d, r);
    if (last_) zero3_.emplace_back(&head_, &head_grad_, head_matrix_elements(), d, r);
    shard_experts_over_edp();
    using Member = typename Zero3Schedule<C>::Member;
    std::vector<typename Zero3Schedule<C>::Layer> layers;
    for (std::size_t l = 0; l < stack_.weights().size(); ++l) {
      auto& layer = layers.emplace_back();
      for (int i = 0; i < 3; ++i)  // attention, MLP, norms (stage_backward allocates and reduces the norms' gradients)
        layer.push_back(Member{&zero3_[3 * l + std::size_t(i)], dp_, i < 2});
      for (Zero3Tensor& e : expert_zero3_of_layer(l)) layer.push_back(Member{&e, edp_, true});
    }
    zero3_schedule_ = Zero3Schedule<C>(std::move(layers), zero3_prefetch_);
    using Use = typename Stack::LayerUse;
    stack_.set_layer_hook([this](int l, Use use, bool begin) { zero3_schedule_.on_layer(l, use == Use::backward, begin); });
  }
  // ZeRO-3: each layer's gather posted while the layer before it computes and each gradient's reduce-scatter
  // finished after the next layer's backward (on, the default), or each waited for where it is posted (off); the
  // same values either way (model/zero3_prefetch.hpp). Kept for the run; before or after shard_over_dp.
  void set_zero3_prefetch(bool on) {
    zero3_prefetch_ = on;
    zero3_schedule_.set_prefetch(on);
  }
  bool zero3_prefetch() const noexcept { return zero3_prefetch_; }
  bool sharded() const noexcept { return !zero3_.empty(); }
  // ZeRO-3 with expert data parallelism: the shard over edp of the MoE tensor `value` (one of parameters()'s with
  // over_dp = false), or none (not sharded: no ZeRO-3, edp = 1, or an empty tensor).
  Zero3Tensor* expert_zero3_of(const Tensor<float>* value) noexcept {
    for (Zero3Tensor& t : expert_zero3_)
      if (t.full() == value) return &t;
    return nullptr;
  }
  // ZeRO-3 with expert data parallelism: every MoE tensor's shard over edp, in parameters()'s order.
  std::span<Zero3Tensor> expert_zero3_shards() noexcept { return expert_zero3_; }

  // What the stage keeps of each in-flight micro-batch from the next forward on (kept for the run).
  void set_recompute(PipelineRecompute recompute) noexcept {
    recompute_ = recompute;
    stack_.set_selective_recompute(recompute == PipelineRecompute::selective);
  }
  PipelineRecompute recompute() const noexcept { return recompute_; }
  // Whether this step runs without a pipeline (one stage, one chunk): each backward then follows its own forward and
  // full recomputation keeps the activations as none does (mesh_forward_backward sets it each step).
  void set_unpipelined(bool unpipelined) noexcept { unpipelined_ = unpipelined; }

  // etp < tp: the expert columns over `etp` (kept for the run), the etp consecutive ranks of the stage's group
  // holding this rank, instead of the whole group.
  void set_expert_column_group(C& etp) { columns_ = &etp; }

  // Expert data parallelism: this rank's MoE shards (its experts, the router, the shared experts) are replicated over
  // `edp` (kept for the run), the ranks of the other expert groups of the stage holding the same experts and
  // running other tokens of the same micro-batches. Their router statistics are summed over it (the router losses of
  // the whole micro-batch); their gradients are partial until summed over it (MeshOptimizer's expert replicas).
  void set_expert_replicas(C& edp) {
    check(!sharded(), "MeshGptStage::set_expert_replicas: give the edp group before shard_over_dp (ZeRO-3 shards the "
          "MoE tensors over it)");
    edp_ = &edp;
    if (edp.size() > 1)
      stack_.set_router_statistics_over_replicas([this](std::span<double> stats) {
        edp_->all_reduce(std::span<const double>(stats), stats, ReduceOp::sum);
      });
  }
  // ZeRO-3: every sharded tensor of this rank (per layer attention, MLP, norms; then the embedding, the head).
  std::span<Zero3Tensor> zero3_shards() noexcept { return zero3_; }

  Saved forward(int micro_batch, TensorView<const float> x, TensorView<float> y) {
    stack_.forward(*cp_, *ep_, columns_ ? *columns_ : *cp_, *pool_, plan_, seq_len_, x, y);
    if (recompute_ != PipelineRecompute::full || unpipelined_) return Saved{Tensor<float>(), stack_.take_activations()};
    stack_.discard_step();  // full: recomputed before its backward, even when that comes next (last stage)
    return Saved{Tensor<float>::copy_of(x), std::nullopt};
  }
  void backward(int, Saved& saved, TensorView<const float> dy, TensorView<float> dx) {
    if (saved.activations) {  // kept by its forward
      stack_.restore_activations(std::move(*saved.activations));
      saved.activations.reset();
    } else {  // full: recompute the forward of this micro-batch
      PooledBuffer<float> y = pool_->acquire<float>(saved.input.shape());
      stack_.forward(*cp_, *ep_, columns_ ? *columns_ : *cp_, *pool_, plan_, seq_len_, saved.input.view(), y.view());
    }
    if (sharded())  // the norm gradients are written after every layer's backward: allocated around the whole
      for (std::size_t l = 0; l < stack_.weights().size(); ++l) zero3_[3 * l + 2].begin_gradient();
    stack_.backward(*cp_, *ep_, columns_ ? *columns_ : *cp_, *pool_, dy, dx);
    if (sharded())
      for (std::size_t l = 0; l < stack_.weights().size(); ++l) zero3_[3 * l + 2].reduce_gradient(*dp_);
    saved.input = Tensor<float>();
  }

  // First stage: x [b, n_r, h] <- the embedding of tokens [b, n_r] of micro-batch `micro_batch`; and its backward
  // (accumulates). Sharded vocabulary: collective over the tp group, the forward's lookup kept for the backward.
  void embed(int micro_batch, TensorView<const std::int32_t> tokens, TensorView<float> x) {
    if (sharded()) zero3_end(false).gather(*dp_);
    const TensorView<const float> table(embedding_.view());
    if (vocab_) {
      const std::int64_t rows = tokens.numel(), h = config_.layer.hidden;
      const std::vector<std::int64_t> counts = vocab_counts(tokens.extent(0));
      const VocabLookup& lookup = lookups_[micro_batch] = vocab_lookup(
          *vocab_, std::span<const std::int64_t>(counts), vocab_rows_, tokens.reshape(Shape{rows}), h);
      vocab_parallel_embedding_forward<Backend>(*vocab_, lookup, table, x.reshape(Shape{rows, h}));
    } else {
      Backend::embedding_forward(tokens, table, x);
    }
    if (sharded()) zero3_end(false).release();
  }
  void embed_backward(int micro_batch, TensorView<const std::int32_t> tokens, TensorView<const float> dx) {
    if (sharded()) zero3_end(false).begin_gradient();
    if (vocab_) {
      const auto lookup = lookups_.find(micro_batch);
      check(lookup != lookups_.end(), "MeshGptStage::embed_backward: micro-batch {} has no forward lookup",
            micro_batch);
      const TensorView<const float> rows = dx.reshape(Shape{tokens.numel(), config_.layer.hidden});  // [b n_r, h]
      vocab_parallel_embedding_backward<Backend>(*vocab_, lookup->second, rows, embedding_grad_.view());
      lookups_.erase(lookup);
    } else {
      Backend::embedding_backward(tokens, dx, embedding_grad_.view());
    }
    if (sharded()) zero3_end(false).reduce_gradient(*dp_);
  }

  // Last stage: the final norm, the LM head and the cross-entropy of y [b, n_r, h] against targets [b, n_r]; dy
  // (zeroed by the caller) <- the loss gradient, each token's scaled by grad_scale. Returns the loss sum.
  double head_loss(TensorView<const float> y, TensorView<const std::int32_t> targets, TensorView<float> dy,
                   float grad_scale) {
    if (sharded()) {
      zero3_end(true).gather(*dp_);
      zero3_end(true).begin_gradient();
    }
    const double loss = head_loss_full(y, targets, dy, grad_scale);
    if (sharded()) {
      zero3_end(true).release();
      zero3_end(true).reduce_gradient(*dp_);
    }
    return loss;
  }
  double head_loss_full(TensorView<const float> y, TensorView<const std::int32_t> targets, TensorView<float> dy,
                        float grad_scale) {
    const std::int64_t v = vocab_rows_.length, h = config_.layer.hidden;
    const HeadParameters head{gpt_detail::row_span(head_, v), gpt_detail::row_span(head_, v + 1),
                              TensorView<const float>(head_.view()).slice(0, 0, v), gpt_detail::row_span(head_grad_, v),
                              gpt_detail::row_span(head_grad_, v + 1), head_grad_.view().slice(0, 0, v)};
    if (!vocab_) return norm_head_loss<Backend>(config_.layer, y, targets, head, grad_scale, dy);
    // Sharded vocabulary: the head's rows over tp; the final norm's gradient of this use summed over tp here (its
    // rows differ in place between tp ranks under ZeRO-3), over the replicas by reduce_replicated.
    const std::int64_t rows = targets.numel();
    const std::vector<std::int64_t> counts = vocab_counts(targets.extent(0));
    Tensor<float> norm_grad(Shape{2, h});
    HeadParameters local = head;
    local.gamma_grad = gpt_detail::row_span(norm_grad, 0);
    local.beta_grad = gpt_detail::row_span(norm_grad, 1);
    const double loss = norm_around<Backend>(config_.layer, y, local, dy, [&](TensorView<const float> normed,
                                                                             TensorView<float> dnormed) {
      return vocab_parallel_head_loss<Backend>(*vocab_, std::span<const std::int64_t>(counts), vocab_rows_, normed,
                                               targets.reshape(Shape{rows}), head.weights, grad_scale,
                                               head.weights_grad, dnormed);
    });
    vocab_->all_reduce(std::span<const float>(norm_grad.span()), norm_grad.span(), ReduceOp::sum);
    Backend::add_into(head_grad_.view().slice(0, v, 2), TensorView<const float>(norm_grad.view()));
    return loss;
  }

  // After the step's micro-batches: the replicated gradients summed over the cp group (they are partial sums over
  // the rank's tokens; the layers' norm gradients the stack reduced already). Sharded vocabulary: over the ranks
  // holding the same rows (the replicas: the rows' gradients hold the tp group's tokens already, and the final
  // norm's head_loss summed over tp).
  void reduce_replicated(C& cp_group) {
    C& cp = vocab_ ? *vocab_replicas_ : cp_group;
    if (sharded()) {  // the owned chunks of the embedding's and the head's gradients (the same chunk on every cp rank)
      if (first_) cp.all_reduce(std::span<const float>(zero3_end(false).gradient().span()), zero3_end(false).gradient().span(), ReduceOp::sum);
      if (last_) cp.all_reduce(std::span<const float>(zero3_end(true).gradient().span()), zero3_end(true).gradient().span(), ReduceOp::sum);
      return;
    }
    for (Tensor<float>* g : {&embedding_grad_, &head_grad_})
      if (g->numel() > 0) cp.all_reduce(std::span<const float>(g->span()), g->span(), ReduceOp::sum);
  }

  // Every (parameter, gradient, decays, replicated over dp) of this rank, in a fixed order (the same on every dp
  // replica for those replicated over dp; the MoE layers' expert shards, router and shared experts are not: their
  // gradients are already reduced over the expert group, which spans dp, and are summed over the expert data
  // parallel group, if any, by the optimizer: set_expert_replicas).
  struct Parameter {
    Tensor<float>* value;
    Tensor<float>* gradient;
    bool decays;
    bool over_dp = true;
  };
  std::vector<Parameter> parameters() {
    std::vector<Parameter> out;
    for (std::size_t l = 0; l < stack_.weights().size(); ++l) {
      LayerWeights& w = stack_.weights()[l];
      LayerWeights& g = stack_.gradients()[l];
      out.push_back({&w.attention.packed, &g.attention.packed, true});
      out.push_back({&w.mlp.packed, &g.mlp.packed, true});
      out.push_back({&w.norms.packed, &g.norms.packed, false});
    }
    for (std::size_t l = 0; l < stack_.weights().size(); ++l) {
      if (!stack_.is_moe_layer(int(l))) continue;
      MoeShard& w = stack_.moe_weights()[l];
      MoeShard& g = stack_.moe_gradients()[l];
      for (auto member : {&MoeShard::router, &MoeShard::expert_in, &MoeShard::expert_out, &MoeShard::shared_in,
                          &MoeShard::shared_out, &MoeShard::shared_gate})
        out.push_back({&(w.*member), &(g.*member), true, false});
    }
    if (first_) out.push_back({&embedding_, &embedding_grad_, true});
    if (last_) out.push_back({&head_, &head_grad_, true});  // the norm rows are split off by the caller
    return out;
  }
  std::int64_t head_matrix_elements() const { return vocab_rows_.length * config_.layer.hidden; }

private:
  using Backend = ops::Cpu;
  // Sharded vocabulary: the tokens each rank of the tp group brings in a micro-batch of `batch` rows (their ranks'
  // shares of the sequence in the unified layout).
  std::vector<std::int64_t> vocab_counts(std::int64_t batch) const {
    const SequenceLayout layout(seq_len_, group_size_, config_.layer.zigzag);
    std::vector<std::int64_t> counts;
    for (int q = 0; q < int(vocab_->size()); ++q) counts.push_back(batch * layout.local_length(vocab_first_ + q));
    return counts;
  }
  // ZeRO-3 (shard_over_dp) with edp > 1: every non-empty MoE tensor sharded over edp, layer by layer in
  // parameters()'s order; expert_zero3_first_[l] .. [l + 1] are layer l's.
  void shard_experts_over_edp() {
    const bool sharding = edp_ != nullptr && edp_->size() > 1;
    expert_zero3_first_.assign(1, 0);
    for (std::size_t l = 0; l < stack_.weights().size(); ++l) {
      if (sharding && stack_.is_moe_layer(int(l))) {
        MoeShard& w = stack_.moe_weights()[l];
        MoeShard& g = stack_.moe_gradients()[l];
        for (auto member : {&MoeShard::router, &MoeShard::expert_in, &MoeShard::expert_out, &MoeShard::shared_in,
                            &MoeShard::shared_out, &MoeShard::shared_gate})
          if ((w.*member).numel() > 0)
            expert_zero3_.emplace_back(&(w.*member), &(g.*member), (w.*member).numel(), int(edp_->size()),
                                       int(edp_->rank()));
      }
      expert_zero3_first_.push_back(expert_zero3_.size());
    }
  }
  std::span<Zero3Tensor> expert_zero3_of_layer(std::size_t l) {
    return std::span<Zero3Tensor>(expert_zero3_).subspan(expert_zero3_first_[l],
                                                         expert_zero3_first_[l + 1] - expert_zero3_first_[l]);
  }
  // ZeRO-3: the embedding's (head = false) or the head's shard.
  Zero3Tensor& zero3_end(bool head) {
    const std::size_t layers = 3 * stack_.weights().size();
    return zero3_[layers + (head && first_ ? 1 : 0)];
  }
  // This stage's slice of the layers; with MoE layers, dense shards over cp and expert shards over ep, each drawn
  // from seed + global layer index as Gpt's stack draws them.
  static Stack make_stack(const GptConfig& config, ChunkRange layers, int cp_size, int cp_rank, int ep_size,
                          int ep_rank, std::uint64_t seed, bool expert_columns, int etp) {
    const int count = int(layers.length);
    const std::uint64_t first = seed + std::uint64_t(layers.start);
    if (!config.moe || config.moe->first_k_dense >= layers.end()) return Stack(config.layer, count, cp_size, cp_rank, first);
    const MoeLayers moe{config.moe->moe, int(std::max<std::int64_t>(0, config.moe->first_k_dense - layers.start))};
    std::vector<LayerWeights> dense;
    std::vector<MoeShard> experts;
    for (int l = 0; l < count; ++l) {
      dense.push_back(init_shard(config.layer, cp_size, cp_rank, first + std::uint64_t(l)));
      if (!moe.is_moe(l)) experts.push_back(MoeShard{});
      else if (!expert_columns) experts.push_back(init_moe_shard(moe.moe, ep_size, ep_rank, first + std::uint64_t(l)));
      else experts.push_back(etp_columns(init_moe_shard(moe.moe, ep_size, ep_rank, first + std::uint64_t(l)), moe.moe,
                                         etp, cp_rank % etp));
    }
    return Stack(config.layer, std::move(dense), std::move(experts), moe, cp_size);
  }
  GptConfig config_;
  bool first_, last_;
  ChunkRange layers_;
  int group_size_, group_rank_;  // the stage's group (cp, tp or cp x tp) and this rank in it
  ChunkRange vocab_rows_;        // the vocabulary rows of the embedding and the head held here
  Stack stack_;
  Tensor<float> embedding_, embedding_grad_;  // first stage: [V_r, h] (V_r = V unless the vocabulary is sharded)
  Tensor<float> head_, head_grad_;            // last stage: [V_r + 2, h]: the head, the final gamma and beta
  C* vocab_ = nullptr;            // sharded vocabulary: the tp group (null: whole)
  C* vocab_replicas_ = nullptr;   // the ranks of the stage's group holding the same rows
  int vocab_first_ = 0;           // the stage-group rank of the tp group's rank 0
  std::map<int, VocabLookup> lookups_;  // the in-flight micro-batches' embedding lookups
  C* cp_ = nullptr;
  C* ep_ = nullptr;
  BufferPool* pool_ = nullptr;
  StackPlan plan_;
  std::int64_t seq_len_ = 0;
  PipelineRecompute recompute_ = PipelineRecompute::full;
  bool unpipelined_ = false;  // set_unpipelined
  C* edp_ = nullptr;               // expert data parallelism: the replicas of this rank's experts
  C* columns_ = nullptr;           // etp < tp: the expert columns' group (none: the stage's group)
  C* dp_ = nullptr;                // ZeRO-3: the dp group
  std::vector<Zero3Tensor> zero3_;  // ZeRO-3: this rank's chunks (empty: not sharded)
  std::vector<Zero3Tensor> expert_zero3_;          // ZeRO-3 with edp > 1: the MoE tensors' chunks over edp
  std::vector<std::size_t> expert_zero3_first_;    // [layers + 1]: each layer's first in expert_zero3_
  bool zero3_prefetch_ = true;                     // set_zero3_prefetch
  Zero3Schedule<C> zero3_schedule_;                // ZeRO-3: when each layer's collectives run (the stack's hook)
};

// The forward and backward of one step on this rank: `chunks` (begun with begin_step) run this replica's rows `mine`
// of the step's sequences (inputs, targets: the whole step's [rows, s] tokens), in micro-batches of
// `rows_per_micro_batch` rows (the last one the rest; 0: one row with pp stages (pp_group's size) and all at once
// without), through the 1F1B schedule, or with v > 1 chunks per rank the interleaved 1F1B schedule (chunk c of pp
// rank r is virtual stage c * P + r of P * v, each built as stage c * P + r of P * v; the micro-batch count must then
// be a multiple of P); each token's loss gradient is scaled by
// grad_scale (1 / the step's counted tokens); then the replicated gradients are summed over cp_group. Returns this
// rank's loss sum (the last virtual stage's tokens; 0 on the others and on a replica without rows).
template <class Strategies, Communicator C>
double mesh_forward_backward(std::span<MeshGptStage<Strategies, C>> chunks, C& pp_group, C& cp_group, ChunkRange mine,
                             std::int64_t s, std::span<const std::int32_t> inputs,
                             std::span<const std::int32_t> targets, float grad_scale,
                             std::int64_t rows_per_micro_batch = 0) {
  check(!chunks.empty(), "mesh_forward_backward: no model chunk");
  check(rows_per_micro_batch >= 0, "mesh_forward_backward: rows_per_micro_batch = {} must be at least 0",
        rows_per_micro_batch);
  MeshGptStage<Strategies, C>& stage = chunks.front();  // the embedding's, if any
  MeshGptStage<Strategies, C>& end = chunks.back();     // the head's, if any
  const bool pipelined = pp_group.size() > 1;
  const int cp_rank = int(cp_group.rank());
  // Micro-batches of the rows: [b, n_r] tokens and targets of this cp rank.
  const std::int64_t per_micro = rows_per_micro_batch > 0 ? rows_per_micro_batch
                                  : pipelined               ? 1
                                                            : std::max<std::int64_t>(mine.length, 1);
  const int micro_batches = int((mine.length + per_micro - 1) / per_micro);
  // [b_i, n_r, h]: micro-batch i's rows.
  const auto rows_of = [&](int i) { return std::min(per_micro, mine.length - i * per_micro); };
  const SequenceLayout layout(s, int(cp_group.size()), stage.config().layer.zigzag);
  const std::int64_t n = layout.local_length(cp_rank), h = stage.config().layer.hidden;
  std::vector<Tensor<std::int32_t>> x_tokens, y_tokens;
  for (int i = 0; i < micro_batches; ++i) {
    const std::int64_t first_row = mine.start + i * per_micro, b = rows_of(i);
    const auto slice = [&](std::span<const std::int32_t> all) { return all.subspan(std::size_t(first_row * s), std::size_t(b * s)); };
    x_tokens.push_back(shard_tokens(slice(inputs), b, layout, cp_rank));
    y_tokens.push_back(shard_tokens(slice(targets), b, layout, cp_rank));
  }
  // The router losses of an MoE step enter as their mean over its micro-batches (each micro-batch's over its expert
  // group's tokens), as the cross-entropy is the mean over the step's tokens.
  for (MeshGptStage<Strategies, C>& chunk : chunks) {
    chunk.stack().set_router_loss_scale(1.0 / std::max(micro_batches, 1));
    chunk.set_unpipelined(!pipelined && chunks.size() == 1);
  }
  double loss_sum = 0.0;
  if (micro_batches > 0) {
    Tensor<float> embedded;
    PipelineIo io;
    io.input = [&](int i) {
      embedded = Tensor<float>(Shape{rows_of(i), n, h});
      stage.embed(i, x_tokens[std::size_t(i)].view(), embedded.view());
      return TensorView<const float>(embedded.view());
    };
    io.loss_gradient = [&](int i, TensorView<const float> y, TensorView<float> dy) {
      loss_sum += end.head_loss(y, y_tokens[std::size_t(i)].view(), dy, grad_scale);
    };
    io.input_gradient = [&](int i, TensorView<const float> dx) { stage.embed_backward(i, x_tokens[std::size_t(i)].view(), dx); };
    const PipelineBoundary boundary = [&](int i) { return Shape{rows_of(i), n, h}; };
    if (chunks.size() == 1) run_pipeline(pp_group, stage, micro_batches, boundary, io);
    else run_interleaved_pipeline(pp_group, chunks, micro_batches, boundary, io);
  }
  for (MeshGptStage<Strategies, C>& chunk : chunks) chunk.reduce_replicated(cp_group);
  return loss_sum;
}
// One chunk per rank (the 1F1B schedule).
template <class Strategies, Communicator C>
double mesh_forward_backward(MeshGptStage<Strategies, C>& stage, C& pp_group, C& cp_group, ChunkRange mine,
                             std::int64_t s, std::span<const std::int32_t> inputs,
                             std::span<const std::int32_t> targets, float grad_scale,
                             std::int64_t rows_per_micro_batch = 0) {
  return mesh_forward_backward(std::span<MeshGptStage<Strategies, C>>(&stage, 1), pp_group, cp_group, mine, s, inputs,
                               targets, grad_scale, rows_per_micro_batch);
}

}  // namespace paradyse
