// paradyse/model/stack.hpp: a stack of Transformer layers run with a per-layer, per-sublayer strategy plan.
//
// Rank r holds, for every layer, its unified shards (contract/weight_shards.hpp) and their gradients. forward() runs the
// layers with the plan's strategies and keeps what backward needs; backward() runs them in reverse, accumulates
// every shard gradient (fully reduced, whichever strategy ran) and all-reduces the replicated norm gradients of
// all layers in one collective. Changing the plan from one step to the next, or from one layer to the next,
// moves no data: there is nothing to redistribute. The plan is checked against every strategy's requirements
// before any rank communicates, and every rank must pass the same plan.
//
// MoE layers (MoeLayers, model/moe_half.hpp): layers from first_k_dense on run the MoE FFN instead of the dense MLP,
// with the strategy SublayerChoice::moe of the plan; their expert shards (MoeShard) and gradients are held beside
// the dense shards (moe_weights(), moe_gradients()), their LayerWeights keep the attention and norms only (no MLP
// shard). A per-layer top-k override (set_moe_top_k) serves Alloc-MoE; each forward records every MoE layer's
// router losses and expert load (moe_stats()).
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/comm/grid_groups.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/contract/layer_config.hpp"
#include "paradyse/model/layer.hpp"
#include "paradyse/model/moe_half.hpp"
#include "paradyse/model/placement.hpp"
#include "paradyse/moe/expert_columns.hpp"
#include "paradyse/moe/moe_weights.hpp"
#include "paradyse/contract/weight_shards.hpp"
#include "paradyse/ops/backend.hpp"
#include "paradyse/strategy/buffer_pool.hpp"
#include "paradyse/strategy/policy.hpp"
#include "paradyse/strategy/strategies.hpp"
#include "paradyse/strategy/switchable.hpp"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <optional>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

namespace paradyse {

// One SublayerChoice per layer.
using StackPlan = std::vector<SublayerChoice>;

// The same strategy for every sublayer of every layer.
template <class Strategies>
StackPlan uniform_plan(std::size_t layers, std::string_view strategy) {
  const std::size_t index = Strategies::index_of(strategy);
  return StackPlan(layers, SublayerChoice{index, index});
}

template <class Strategies = AllStrategies<>, class Backend = ops::Cpu>
class TransformerStack {
public:
  // `layers` layers of `config` sharded over `ranks` ranks; this rank's shards drawn from seed + layer.
  TransformerStack(const LayerConfig& config, int layers, int ranks, int rank, std::uint64_t seed,
                   Strategies strategies = {})
      : config_(config), ranks_(ranks), strategies_(std::move(strategies)) {
    check(layers >= 1, "TransformerStack: layers = {} must be at least 1", layers);
    for (int l = 0; l < layers; ++l)
      weights_.push_back(drawn_on_host<Backend>([&] { return init_shard(config, ranks, rank, seed + std::uint64_t(l)); }));
    allocate_gradients();
  }
  // With MoE layers: layers from moe.first_k_dense on run the MoE FFN (their expert shards drawn from
  // seed + layer as well, from streams of their own).
  TransformerStack(const LayerConfig& config, int layers, int ranks, int rank, std::uint64_t seed,
                   const MoeLayers& moe, Strategies strategies = {})
      : config_(config), ranks_(ranks), strategies_(std::move(strategies)), moe_(moe) {
    check(layers >= 1, "TransformerStack: layers = {} must be at least 1", layers);
    moe.validate_for(config, layers);
    for (int l = 0; l < layers; ++l) {
      weights_.push_back(drawn_on_host<Backend>([&] { return init_shard(config, ranks, rank, seed + std::uint64_t(l)); }));
      moe_weights_.push_back(moe.is_moe(l) ? drawn_on_host<Backend>([&] {
        return init_moe_shard(moe.moe, ranks, rank, seed + std::uint64_t(l));
      }) : empty_moe_shard());
    }
    drop_moe_layers_mlp(weights_);
    allocate_gradients();
  }
  // With MoE layers, from given shards: expert shards for the MoE layers (anything, ignored, for the dense ones).
  TransformerStack(const LayerConfig& config, std::vector<LayerWeights> weights, std::vector<MoeShard> moe_weights,
                   const MoeLayers& moe, int ranks, Strategies strategies = {})
      : config_(config), ranks_(ranks), strategies_(std::move(strategies)), weights_(std::move(weights)),
        moe_weights_(std::move(moe_weights)), moe_(moe) {
    check(!weights_.empty(), "TransformerStack: no layers given");
    check(moe_weights_.size() == weights_.size(), "TransformerStack: {} expert shards for {} layers",
          moe_weights_.size(), weights_.size());
    config.validate_for(ranks);
    moe.validate_for(config, layers());
    for (std::size_t l = 0; l < moe_weights_.size(); ++l)
      if (!moe.is_moe(int(l))) moe_weights_[l] = empty_moe_shard();
    drop_moe_layers_mlp(weights_);
    allocate_gradients();
  }
  // From given shards (for example built by shard_of from global weights).
  TransformerStack(const LayerConfig& config, std::vector<LayerWeights> weights, int ranks, Strategies strategies = {})
      : config_(config), ranks_(ranks), strategies_(std::move(strategies)), weights_(std::move(weights)) {
    check(!weights_.empty(), "TransformerStack: no layers given");
    config.validate_for(ranks);
    allocate_gradients();
  }

  const LayerConfig& config() const noexcept { return config_; }
  int layers() const noexcept { return int(weights_.size()); }
  const Strategies& strategies() const noexcept { return strategies_; }
  std::vector<LayerWeights>& weights() noexcept { return weights_; }
  std::vector<LayerWeights>& gradients() noexcept { return gradients_; }
  // Called around each layer's forward and backward (layer: the stack's index; begin: before, else after), e.g. to
  // gather the layer's weights (and allocate its gradient) just before it runs and free them after (ZeRO-3). Norm
  // gradients are written after every layer's backward (reduce_norm_gradients), so they must outlive the hooks.
  enum class LayerUse : std::uint8_t { forward, backward };
  using LayerHook = std::function<void(int layer, LayerUse use, bool begin)>;
  void set_layer_hook(LayerHook hook) { layer_hook_ = std::move(hook); }

  void zero_gradients() {
    for (LayerWeights& g : gradients_) zero_state<Backend>(g);
    for (MoeShard& g : moe_gradients_) zero_state<Backend>(g);
  }

  // MoE layers (none unless built with MoeLayers).
  const std::optional<MoeLayers>& moe_layers() const noexcept { return moe_; }
  bool is_moe_layer(int layer) const noexcept { return moe_.has_value() && moe_->is_moe(layer); }
  std::vector<MoeShard>& moe_weights() noexcept { return moe_weights_; }      // per layer (empty for dense layers)
  std::vector<MoeShard>& moe_gradients() noexcept { return moe_gradients_; }  // per layer (empty for dense layers)
  const std::vector<MoeShard>& moe_weights() const noexcept { return moe_weights_; }
  // Experts per token of each MoE layer from the next forward on (an entry per layer; 0: the config's top_k);
  // empty: the config's everywhere.
  void set_moe_top_k(std::vector<std::int64_t> per_layer) {
    check(per_layer.empty() || per_layer.size() == weights_.size(), "set_moe_top_k: {} entries for {} layers",
          per_layer.size(), weights_.size());
    for (std::size_t l = 0; l < per_layer.size(); ++l)
      check(per_layer[l] == 0 || (moe_ && per_layer[l] >= 1 && per_layer[l] <= moe_->moe.experts),
            "set_moe_top_k: layer {} asks for k = {}, expected 0 (the config's) or 1..E{}", l, per_layer[l],
            moe_ ? fmt::format(" = {}", moe_->moe.experts) : std::string(" (the stack has no MoE layers)"));
    moe_top_k_ = std::move(per_layer);
  }
  // Router losses and expert load of every MoE layer in the last forward (in layer order).
  const std::vector<MoeLayerStats>& moe_stats() const noexcept { return moe_stats_; }
  // The weight of the router losses' gradients (aux and z, each times its coefficient) from the next forward on: 1 by
  // default; 1 / M when a step runs in M micro-batches (model/mesh_stage.hpp's pipeline), so that the step's router
  // losses are their mean over the micro-batches (Megatron's rule) as its cross-entropy is the mean over its tokens.
  // The recorded losses (moe_stats) stay unscaled.
  void set_router_loss_scale(double scale) {
    check(std::isfinite(scale) && scale > 0, "set_router_loss_scale: {} must be finite and positive", scale);
    router_loss_scale_ = scale;
  }
  double router_loss_scale() const noexcept { return router_loss_scale_; }
  // Expert tensor parallelism folded over the attention group (moe/expert_columns.hpp): from the next forward on each
  // MoE layer's experts are split by columns over the group the stack runs on (etp = its size; the tp group of a
  // mesh), the experts themselves over the expert group. The MoE shards must then be column shards (etp_columns).
  void set_expert_columns_over_group(bool on) noexcept { expert_columns_ = on; }
  bool expert_columns_over_group() const noexcept { return expert_columns_; }
  // Expert data parallelism: `sum` adds the MoE layers' router statistics over the other expert groups of the same
  // tokens (moe/moe_layer.hpp's MoeContext::sum_statistics_over_replicas); empty (the default): none.
  void set_router_statistics_over_replicas(std::function<void(std::span<double>)> sum) {
    router_statistics_over_replicas_ = std::move(sum);
  }
  // Packed documents of the sequences of the next forwards (the global start of each, first 0: attention stays
  // within a document and RoPE restarts at each; strategy/policy.hpp's SublayerContext::document_starts); empty:
  // each sequence is one document. Kept (copied) until set again; checked against the sequence length by forward.
  void set_documents(std::span<const std::int64_t> starts) { documents_.assign(starts.begin(), starts.end()); }
  // The group's cp x tp factorisation from the next forward on (SublayerContext::tp_inner: the inner tp sub-groups'
  // size, rank = c * tp + t; 0: none), for strategies that compute over the two sub-groups (MegatronRing).
  // `group` is the group the stack runs on: its tp and cp sub-groups are split now (collective over it, every rank
  // alike) and kept for every later forward (comm/grid_groups.hpp); 0 drops them.
  template <Communicator C>
  void set_tp_inner(C& group, int tp) {
    check(tp == 0 || (tp >= 1 && ranks_ % tp == 0), "TransformerStack: tp_inner = {} must be 0 (none) or divide the "
          "group size {}", tp, ranks_);
    tp_inner_groups_ = tp > 0 ? grid_of(group, tp) : AnyGridGroups();
    tp_inner_ = tp;
    hold_tp_grid(group);
  }
  std::span<const std::int64_t> documents() const noexcept { return documents_; }
  // The group as a tp_x x (p / tp_x) grid for 2-D tensor parallelism (SublayerContext::tp_x, strategy/tp2d.hpp);
  // 1: no grid. `group` as for set_tp_inner: its tp_x and tp_y groups split now and kept.
  template <Communicator C>
  void set_tp_x(C& group, int tp_x) {
    check(tp_x >= 1 && ranks_ % tp_x == 0, "TransformerStack: tp_x = {} must divide the group size {}", tp_x, ranks_);
    tp_x_groups_ = tp_x > 1 ? grid_of(group, tp_x) : AnyGridGroups();
    tp_x_ = tp_x;
    hold_tp_grid(group);
  }
  int tp_inner() const noexcept { return tp_inner_; }
  int tp_x() const noexcept { return tp_x_; }
  // Selective recomputation from the next forward on: each layer keeps its activations but attention's core tensors
  // (output, lse, probabilities: Switchable::drop_attention_core), which its backward re-runs from the kept q, k, v
  // first. Every strategy of the plan must have the pair (refused by name otherwise).
  void set_selective_recompute(bool on) noexcept { selective_ = on; }
  bool selective_recompute() const noexcept { return selective_; }
  // Drops what a step kept (the saved activations of the layers its forward ran, its context) and allocates
  // nothing: after a failed step the stack holds its weights and gradients only, as before the step.
  void discard_step() noexcept {
    saved_.clear();
    moe_saved_.clear();
    ctx_.reset();
  }

  // What a forward keeps for its backward (each layer's saved activations, the MoE layers' as well, and the step's
  // context), taken out of the stack so that several micro-batches' are held at once (model/mesh_stage.hpp's
  // pipeline without recomputation) and put back before the backward of the micro-batch they belong to.
  struct Activations {
    std::vector<LayerSaved<Strategies>> saved;
    std::vector<std::optional<MoeSaved>> moe_saved;
    std::optional<SublayerContext> ctx;
  };
  Activations take_activations() {
    check(ctx_.has_value() && saved_.size() == weights_.size(), "TransformerStack: no forward's activations to take");
    Activations a{std::move(saved_), std::move(moe_saved_), std::move(ctx_)};
    discard_step();
    return a;
  }
  // The stack must hold none (the forward's were taken, or its backward ran).
  void restore_activations(Activations a) {
    check(saved_.empty(), "TransformerStack: restoring activations over another forward's");
    check(a.ctx.has_value() && a.saved.size() == weights_.size(), "TransformerStack: {} layers' activations restored "
          "to a stack of {}", a.saved.size(), weights_.size());
    saved_ = std::move(a.saved);
    moe_saved_ = std::move(a.moe_saved);
    ctx_ = std::move(a.ctx);
  }

  // Throws unless every layer's choices exist and their strategies support this layer on this group and length.
  void check_plan(const StackPlan& plan, const SublayerContext& ctx) const {
    check(plan.size() == weights_.size(), "plan has {} layers, the stack has {}", plan.size(), weights_.size());
    for (std::size_t l = 0; l < plan.size(); ++l) {
      try {
        strategies_.check_supported(plan[l].attention, ctx);
        if (is_moe_layer(int(l))) (void)MoeStrategies<Backend>::name(plan[l].moe);
        else strategies_.check_supported(plan[l].mlp, ctx);
      } catch (const Error& e) {
        throw Error(fmt::format("layer {} of the plan: {}", l, error_reason(e)));
      }
    }
  }

  // out: [b, n_r, h] = the stack applied to x: [b, n_r, h] (rank r's tokens of a sequence of seq_len tokens).
  template <Communicator C>
  void forward(C& comm, BufferPool& pool, const StackPlan& plan, std::int64_t seq_len, TensorView<const float> x,
               TensorView<float> out) {
    forward(comm, comm, pool, plan, seq_len, x, out);
  }
  // The same with the MoE layers run over `expert_comm` (ep folded over other devices than the attention's group,
  // such as dp x cp: model/moe_half.hpp); the stack's expert shards are then expert_comm's.
  template <Communicator C, Communicator E>
  void forward(C& comm, E& expert_comm, BufferPool& pool, const StackPlan& plan, std::int64_t seq_len,
               TensorView<const float> x, TensorView<float> out) {
    forward(comm, expert_comm, comm, pool, plan, seq_len, x, out);
  }
  // The same with the expert columns (set_expert_columns_over_group) over `column_comm`, a group of consecutive
  // ranks of `comm` (etp < tp: model/moe_half.hpp) instead of all of `comm`.
  template <Communicator C, Communicator E, Communicator T>
  void forward(C& comm, E& expert_comm, T& column_comm, BufferPool& pool, const StackPlan& plan, std::int64_t seq_len,
               TensorView<const float> x, TensorView<float> out) {
    check(comm.size() == ranks_, "TransformerStack: built for {} ranks, run on a group of {}", ranks_, comm.size());
    check(x.rank() == 3, "TransformerStack: x {} must be [b, n_r, h]", x.shape());
    ctx_.emplace(config_, ranks_, x.extent(0), seq_len, pool);
    ctx_->set_documents(documents_);
    ctx_->tp_x = tp_x_;
    ctx_->tp_inner = tp_inner_;
    ctx_->tp_inner_groups = &tp_inner_groups_;
    ctx_->tp_x_groups = &tp_x_groups_;
    ctx_->tp_grid_groups = &tp_grid_groups_;
    check_plan(plan, *ctx_);
    saved_.clear();
    saved_.reserve(weights_.size());
    moe_saved_.clear();
    moe_saved_.resize(weights_.size());
    moe_stats_.clear();
    PooledBuffer<float> buffers[2];
    TensorView<const float> input = x;
    for (std::size_t l = 0; l < weights_.size(); ++l) {
      const bool last = l + 1 == weights_.size();
      TensorView<float> output = out;
      if (!last) {
        PooledBuffer<float>& next = buffers[l % 2];
        if (next.empty()) next = pool.acquire<float>(x.shape());
        output = next.view();
      }
      if (layer_hook_) layer_hook_(int(l), LayerUse::forward, true);
      if (is_moe_layer(int(l))) {
        ctx_->check_activation("TransformerStack", "x", input, comm.rank());
        LayerSaved<Strategies>& saved = saved_.emplace_back();
        saved.choice = plan[l];
        attention_half_forward<Backend>(strategies_, int(plan[l].attention), comm, *ctx_, weights_[l], input, saved);
        const MoeConfig scaled = moe_view(column_comm);
        MoeContext moe(scaled, pool, TopK{moe_top_k_.empty() ? 0 : moe_top_k_[l]});
        moe.sum_statistics_over_replicas = router_statistics_over_replicas_;
        moe_saved_[l] = moe_half_forward<Backend>(plan[l].moe, comm, expert_comm, column_comm, *ctx_, moe,
                                                  weights_[l], moe_weights_[l], saved, output, expert_columns_);
        moe_stats_.push_back(moe_layer_stats(int(l), *moe_saved_[l]));
      } else {
        saved_.push_back(layer_forward<Backend>(strategies_, plan[l], comm, *ctx_, weights_[l], input, output));
      }
      if (selective_) {  // attention's core tensors dropped, re-run before this layer's backward (layer.hpp)
        strategies_.drop_attention_core(saved_.back().attention);
        saved_.back().attention_core_dropped = true;
      }
      if (layer_hook_) layer_hook_(int(l), LayerUse::forward, false);
      input = output;
    }
  }

  // dx: [b, n_r, h] (overwritten) from dout: [b, n_r, h]; gradients accumulate into gradients().
  template <Communicator C>
  void backward(C& comm, BufferPool& pool, TensorView<const float> dout, TensorView<float> dx) {
    backward(comm, comm, pool, dout, dx);
  }
  // The same over the forward's expert group (and column group).
  template <Communicator C, Communicator E>
  void backward(C& comm, E& expert_comm, BufferPool& pool, TensorView<const float> dout, TensorView<float> dx) {
    backward(comm, expert_comm, comm, pool, dout, dx);
  }
  template <Communicator C, Communicator E, Communicator T>
  void backward(C& comm, E& expert_comm, T& column_comm, BufferPool& pool, TensorView<const float> dout,
                TensorView<float> dx) {
    check(ctx_.has_value() && saved_.size() == weights_.size(), "TransformerStack: backward without a forward");
    check(&pool == ctx_->pool, "TransformerStack: backward must use the buffer pool its forward used");
    const std::int64_t h = config_.hidden;
    PooledBuffer<float> norm_partial = pool.acquire<float>(Shape{layers(), 4, h});
    Backend::fill(norm_partial.view(), 0.0f);
    PooledBuffer<float> buffers[2];
    TensorView<const float> grad_in = dout;
    for (std::size_t l = weights_.size(); l-- > 0;) {
      TensorView<float> grad_out = dx;
      if (l > 0) {
        PooledBuffer<float>& next = buffers[l % 2];
        if (next.empty()) next = pool.acquire<float>(dout.shape());
        grad_out = next.view();
      }
      const TensorView<float> partial = norm_partial.view().slice(0, std::int64_t(l), 1).reshape(Shape{4, h});
      if (layer_hook_) layer_hook_(int(l), LayerUse::backward, true);
      if (is_moe_layer(int(l))) {
        PooledBuffer<float> dy = pool.acquire<float>(dout.shape());
        const MoeConfig scaled = moe_view(column_comm);
        const MoeContext moe(scaled, pool, TopK{moe_top_k_.empty() ? 0 : moe_top_k_[l]});
        moe_half_backward<Backend>(comm, expert_comm, column_comm, *ctx_, moe, weights_[l], moe_weights_[l],
                                   saved_[l], *moe_saved_[l], grad_in, dy.view(), moe_gradients_[l], partial,
                                   expert_columns_);
        moe_saved_[l].reset();
        attention_half_backward<Backend>(strategies_, comm, *ctx_, weights_[l], saved_[l],
                                         TensorView<const float>(dy.view()), grad_out, gradients_[l], partial);
      } else {
        layer_backward<Backend>(strategies_, comm, *ctx_, weights_[l], saved_[l], grad_in, grad_out, gradients_[l],
                                partial);
      }
      saved_[l] = LayerSaved<Strategies>();  // free as we go
      if (layer_hook_) layer_hook_(int(l), LayerUse::backward, false);
      grad_in = grad_out;
    }
    std::vector<NormWeights*> norms;
    for (LayerWeights& g : gradients_) norms.push_back(&g.norms);
    reduce_norm_gradients<Backend>(comm, norm_partial.view(), std::span<NormWeights*>(norms));
    saved_.clear();
    moe_saved_.clear();
  }

private:
  // `group`'s grid with this inner size: one held already (MegatronRing's and Tp2d's grids are one when
  // tp_inner = tp_x), else split now.
  template <Communicator C>
  AnyGridGroups grid_of(C& group, int inner) const {
    check(int(group.size()) == ranks_, "TransformerStack: built for {} ranks, its grid asked of a group of {}", ranks_,
          group.size());
    for (const AnyGridGroups* held : {&tp_inner_groups_, &tp_x_groups_})
      if (held->fits(group, inner)) return *held;
    return AnyGridGroups(group, inner);
  }
  // With both factorisations set and tp_x dividing tp_inner, the tp sub-group's own tp_x x tp_y grid (RingTp2d's,
  // strategy/ring_tp2d.hpp): kept while it fits, else split from the held tp sub-group (collective over `group`).
  template <Communicator C>
  void hold_tp_grid(C& group) {
    if (tp_inner_ < 1 || tp_x_ <= 1 || tp_inner_ % tp_x_ != 0) {
      tp_grid_groups_ = AnyGridGroups();
      return;
    }
    C& tp_group = tp_inner_groups_.of(group, tp_inner_).inner;
    if (!tp_grid_groups_.fits(tp_group, tp_x_)) tp_grid_groups_ = AnyGridGroups(tp_group, tp_x_);
  }
  // The MoE config a layer runs with, its expert columns over group `comm`: the router loss coefficients times
  // router_loss_scale_, and with expert columns this rank's column view.
  template <Communicator C>
  MoeConfig moe_view(C& comm) const {
    MoeConfig c = moe_->moe;
    c.aux_loss_coef *= router_loss_scale_;
    c.z_loss_coef *= router_loss_scale_;
    return expert_columns_ ? etp_view(c, int(comm.size()), int(comm.rank())) : c;
  }
  void allocate_gradients() {
    gradients_.clear();
    for (std::size_t l = 0; l < weights_.size(); ++l) gradients_.emplace_back(config_, ranks_);
    drop_moe_layers_mlp(gradients_);
    moe_gradients_.clear();
    if (moe_) {
      check(moe_weights_.size() == weights_.size(), "TransformerStack: {} expert shards for {} layers",
            moe_weights_.size(), weights_.size());
      for (std::size_t l = 0; l < weights_.size(); ++l) {
        MoeShard& g = moe_gradients_.emplace_back(empty_moe_shard());
        if (!moe_->is_moe(int(l))) continue;
        const MoeShard& w = moe_weights_[l];
        g.router = Tensor<float>(w.router.shape());
        g.expert_in = Tensor<float>(w.expert_in.shape());
        g.expert_out = Tensor<float>(w.expert_out.shape());
        g.shared_in = Tensor<float>(w.shared_in.shape());
        g.shared_out = Tensor<float>(w.shared_out.shape());
        g.shared_gate = Tensor<float>(w.shared_gate.shape());
      }
    }
  }
  // An MoE layer has no dense MLP shard (an empty one: [0, h]).
  void drop_moe_layers_mlp(std::vector<LayerWeights>& layers) const {
    if (!moe_) return;
    for (std::size_t l = 0; l < layers.size(); ++l)
      if (moe_->is_moe(int(l))) layers[l].mlp = empty_mlp_shard(config_.hidden);
  }
  static MlpShard empty_mlp_shard(std::int64_t hidden) {
    MlpShard m;
    m.packed = Tensor<float>(Shape{0, hidden});
    return m;
  }
  LayerConfig config_;
  int ranks_;
  Strategies strategies_;
  std::vector<LayerWeights> weights_, gradients_;
  std::vector<LayerSaved<Strategies>> saved_;
  std::optional<SublayerContext> ctx_;
  std::vector<std::int64_t> documents_;  // the packed documents ctx_ points to
  int tp_x_ = 1;                         // set_tp_x
  int tp_inner_ = 0;                     // the group's cp x tp factorisation (set_tp_inner)
  AnyGridGroups tp_inner_groups_, tp_x_groups_;  // their sub-groups, split when set
  AnyGridGroups tp_grid_groups_;                 // the tp sub-group's tp_x x tp_y grid (hold_tp_grid)
  std::vector<MoeShard> moe_weights_, moe_gradients_;  // per layer; empty for dense layers
  std::optional<MoeLayers> moe_;
  std::vector<std::int64_t> moe_top_k_;
  double router_loss_scale_ = 1.0;
  bool expert_columns_ = false;
  bool selective_ = false;  // set_selective_recompute
  std::function<void(std::span<double>)> router_statistics_over_replicas_;
  LayerHook layer_hook_;
  std::vector<std::optional<MoeSaved>> moe_saved_;
  std::vector<MoeLayerStats> moe_stats_;
};

}  // namespace paradyse
