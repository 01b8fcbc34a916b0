// paradyse/strategy/policy.hpp: what a strategy is (the SublayerStrategy concept), the context every call gets, and
// the gradient rule every strategy follows.
//
// This is PUBLIC API, the contract between a strategy and the model around it (the library's layer, or a user's own
// block: examples/parallel_block.hpp); docs/CONTRACT.md states both sides in full. A strategy promises the unified
// layout in and out, the same weight shards, gradients fully reduced on the owning rank, its requirements in
// supports(), its compute layouts and a reshard between them, and a Saved state that owns what its backward needs.
// A model hands it a SublayerContext, the contract's weight shards, activations in the unified layout, zeroed
// gradient buffers, and the Saved state of the forward back to its backward; norms, residuals and the reduction of
// whatever the model replicates are the model's.
//
// A strategy is a small default-constructible type, templated on the compute Backend (ops::Cpu by default), with
// two sublayers, attention and MLP, each with a forward and a backward (a layer may use different strategies for
// its two sublayers):
//
//   static constexpr std::string_view name;                       // "MegatronTS", ...
//   Support supports(const SublayerContext&) const;               // whether it can run this call, and why not
//   ComputeLayouts attention_layouts(ctx) const, mlp_layouts(ctx) const;   // the layouts it computes in
//   void reshard(comm, ctx, ShardedView<const float> from, ShardedView<float> to) const;  // between layouts
//   struct AttentionSaved; struct MlpSaved;                       // what forward keeps for backward (move-only)
//   AttentionSaved attention_forward(comm, ctx, const AttentionShard& w, x, y) const;
//   void attention_backward(comm, ctx, const AttentionShard& w, AttentionSaved&, dy, dx, AttentionShard& grad) const;
//   MlpSaved mlp_forward(comm, ctx, const MlpShard& w, x, y) const;
//   void mlp_backward(comm, ctx, const MlpShard& w, MlpSaved&, dy, dx, MlpShard& grad) const;
//   optional, selective recomputation (model/layer.hpp): static void drop_attention_core(AttentionSaved&) frees the
//   attention core's own tensors (output, lse, probabilities); recompute_attention_core(comm, ctx, w, AttentionSaved&)
//   const re-runs the core from what forward kept (q, k, v), before attention_backward.
//
// Contract (the unified layout, docs/DESIGN.md and docs/CONTRACT.md):
//   - x, y, dy, dx: [b, n_r, h], contiguous, rank r's tokens in the order of ctx.sequence (contiguous chunk r, or
//     zigzag chunks r and 2p-1-r). y and dx are overwritten; no norm and no residual inside a sublayer.
//   - w: rank r's packed shard (contract/weight_shards.hpp), the same for every strategy.
//   - grad: ACCUMULATES (+=) the fully reduced gradient of rank r's own shard (summed over every token of every
//     rank; with replicated kv heads, over every replica too). So the next layer, whatever its strategy, and the
//     optimizer see the same thing whichever strategy ran, and no redistribution happens between sublayers.
//   - Every rank of the group calls the same sublayer with the same strategy in the same order (collectives).
//   - Saved: move-only and default-constructible; backward takes the Saved of its own forward, with the same ctx and
//     w; the strategy object keeps no state (one object serves every layer).
//   - Transient buffers come from ctx.pool (one pool per rank, keyed by size, shared by all strategies); saved
//     tensors are owned by the Saved struct and freed when it dies.
// Layouts. A strategy is a policy over the Layout concept of layout/: the group is a one-axis mesh, the unified
// layout of an activation [b, s, W] is Shard(1) (zigzag when the layer is), and each strategy names the layouts
// its sublayers compute in (ComputeLayouts: the tensor the core reads and the one it writes). reshard moves a
// tensor between the two through layout/'s engine (LayoutPolicy below; the sequence all-gather / reduce-scatter
// and the sequence <-> head all-to-all are the engine's steps). Strategies that compute in the unified layout
// itself (MegatronCZ, ColossalZ, METP) move weights or K/V blocks around the ring instead
// (strategy/ring_schedule.hpp), so a strategy file holds only its schedule.
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/comm/grid_groups.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/contract/layer_config.hpp"
#include "paradyse/contract/weight_shards.hpp"
#include "paradyse/layout/reshard.hpp"
#include "paradyse/layout/tensor_layout.hpp"
#include "paradyse/ops/attention_mask.hpp"
#include "paradyse/strategy/buffer_pool.hpp"
#include "paradyse/strategy/sequence_layout.hpp"

#include <fmt/format.h>

#include <concepts>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace paradyse {

// Everything a sublayer call needs besides its tensors; built once per layer call (cheap).
struct SublayerContext {
  const LayerConfig* config = nullptr;
  ShardGeometry geometry;    // the shard sizes of this group size
  SequenceLayout sequence;   // which tokens each rank holds
  std::int64_t batch = 0;    // b
  BufferPool* pool = nullptr;
  // Packed documents: the sorted GLOBAL start position of every document of the sequence (first = 0, each < s),
  // the same for every sample of the batch; empty: the sequence is one document. Attention stays within a
  // document and RoPE positions restart at each start. Global positions need no translation per shard: every
  // strategy hands the ops its tokens' global positions (mask offsets, RoPE runs), so the ops read the same starts.
  // The span must outlive the context (the stack keeps a copy for its step).
  std::span<const std::int64_t> document_starts = {};
  // 2-D tensor parallelism (strategy/tp2d.hpp): the group as a tp_x x (p / tp_x) grid; 1: no grid (Tp2d refused).
  int tp_x = 1;
  // The group's cp x tp factorisation when a mesh runs tensor parallelism inside a cp group: the size of the inner
  // (tp) sub-groups, rank r = c * tp_inner + t; 0: the group is not factorised. Only strategies that compute over
  // the two sub-groups read it (strategy/megatron_ring.hpp); the unified layout is over all p ranks either way.
  int tp_inner = 0;
  // The factorisations' sub-groups, split once per group and held by the layer stack (comm/grid_groups.hpp):
  // tp_inner's (MegatronRing's tp and cp sub-groups), tp_x's (Tp2d's tp_x and tp_y groups) and, when tp_x divides
  // tp_inner, the tp sub-group's own tp_x x tp_y grid (RingTp2d's, split from tp_inner_groups' inner group);
  // nullptr: each call splits its own.
  const AnyGridGroups* tp_inner_groups = nullptr;
  const AnyGridGroups* tp_x_groups = nullptr;
  const AnyGridGroups* tp_grid_groups = nullptr;

  SublayerContext() = default;
  // A context for a group of `ranks` ranks running batch x seq_len tokens of `config`.
  SublayerContext(const LayerConfig& config_, int ranks, std::int64_t batch_, std::int64_t seq_len, BufferPool& pool_)
      : config(&config_), geometry(config_, ranks), sequence(seq_len, ranks, config_.zigzag), batch(batch_),
        pool(&pool_) {
    check(batch_ >= 1, "SublayerContext: batch = {} must be at least 1", batch_);
  }

  const LayerConfig& layer() const noexcept { return *config; }
  // Sets the packed documents (see document_starts); throws unless they are 0 first, strictly increasing and < s.
  void set_documents(std::span<const std::int64_t> starts) {
    check_document_starts(starts, length());
    document_starts = starts;
  }
  // The mask of a self-attention over this call's sequence: the layer's causality, the documents, global positions
  // from `q_offset` and `kv_offset`.
  ops::AttentionMask attention_mask(std::int64_t q_offset = 0, std::int64_t kv_offset = 0) const {
    return ops::AttentionMask{.causal = config->causal, .q_offset = q_offset, .kv_offset = kv_offset,
                              .document_starts = document_starts};
  }
  // Throws unless `starts` are packed-document starts of a sequence of `length` tokens: empty, or 0 first, strictly
  // increasing, each < length.
  static void check_document_starts(std::span<const std::int64_t> starts, std::int64_t length) {
    if (starts.empty()) return;
    check(starts[0] == 0, "document starts: the first document must start at position 0, not {}", starts[0]);
    for (std::size_t i = 1; i < starts.size(); ++i)
      check(starts[i] > starts[i - 1], "document starts: entry {} = {} must be greater than entry {} = {} (sorted, "
            "no empty document)", i, starts[i], i - 1, starts[i - 1]);
    check(starts.back() < length, "document starts: the last document starts at {}, expected < the sequence length {}",
          starts.back(), length);
  }
  int ranks() const noexcept { return sequence.ranks(); }
  std::int64_t hidden() const noexcept { return config->hidden; }
  std::int64_t length() const noexcept { return sequence.length(); }  // s, global
  std::int64_t local_tokens(int rank) const { return sequence.local_length(rank); }  // n_r
  std::int64_t local_rows(int rank) const { return batch * sequence.local_length(rank); }  // b * n_r
  std::int64_t global_rows() const noexcept { return batch * sequence.length(); }  // b * s

  // Layouts over the group of a [b, s, width] activation: the unified one (tokens cut by the sequence's chunking),
  // every token on every rank, and full-size partial sums over the group.
  Placement sequence_placement(int dim = 1) const noexcept {
    return Placement::shard(dim, sequence.zigzag() ? Chunking::zigzag : Chunking::contiguous);
  }
  TensorLayout unified(std::int64_t width) const { return {Shape{batch, length(), width}, DynamicLayout{sequence_placement()}}; }
  TensorLayout replicated(std::int64_t width) const { return {Shape{batch, length(), width}, StaticLayout<Replicate>{}}; }
  TensorLayout partial_sums(std::int64_t width) const {
    return {Shape{batch, length(), width}, StaticLayout<Partial<ReduceOp::sum>>{}};
  }

  // Throws unless `x` is this rank's activation [b, n_r, h], contiguous.
  void check_activation(const char* who, const char* what, TensorView<const float> x, int rank) const {
    const Shape want{batch, sequence.local_length(rank), config->hidden};
    check(x.shape() == want && x.is_contiguous(), "{}: {} has shape {}{}, expected contiguous [b, n_r, h] = {} on rank {}",
          who, what, x.shape(), x.is_contiguous() ? "" : " (strided)", want, rank);
  }
};

// Whether a strategy can run a call: an empty reason means yes. Each strategy states its requirements once, in its
// supports(); the planner skips what is not supported (and shows the reason), the layer stack refuses it.
struct Support {
  std::string reason;
  bool ok() const noexcept { return reason.empty(); }
  explicit operator bool() const noexcept { return ok(); }
};

// What every strategy needs of a call besides the unified layout (contract/layer_config.hpp): a token for every rank.
inline Support common_support(std::string_view strategy, const SublayerContext& ctx) {
  if (ctx.length() < ctx.ranks())
    return {fmt::format("{} needs at least p = {} tokens per sample, got {}", strategy, ctx.ranks(), ctx.length())};
  return {};
}

// For strategies whose collectives move equal blocks (Tp2d, RingTp2d): every rank holds as many tokens.
inline Support even_tokens_support(std::string_view strategy, const SublayerContext& ctx) {
  for (int r = 1; r < ctx.ranks(); ++r)
    if (ctx.local_tokens(r) != ctx.local_tokens(0))
      return {fmt::format("{}: every rank must hold as many tokens; s = {} splits unevenly over {} ranks{} (give s a "
                          "multiple of {})", strategy, ctx.length(), ctx.ranks(), ctx.sequence.zigzag() ? " (zigzag)" : "",
                          ctx.sequence.chunks())};
  return {};
}

// The layouts a strategy computes one sublayer in, over its group: the tensor its core reads, after the input's
// move from the unified layout, and the one it writes, before the output's move back.
struct ComputeLayouts {
  TensorLayout input;
  TensorLayout output;
};

// The unified layout as a type: activations [b, s, h] cut along s (dim 1) over the group, contiguous or zigzag
// chunks (the layer's run-time choice, ctx.sequence), and weights in contract/weight_shards.hpp's packed shards.
// Every strategy states the layout it takes and gives its tensors in between calls as
// `using unified_layout = SequenceShardedLayout;`, so that strategy/switchable.hpp can check at compile time that the
// policies it switches between share one (which is what makes switching free).
struct SequenceShardedLayout {
  static constexpr int sequence_dim = 1;
};

// The reshard every strategy exposes: a tensor from one layout over the group to another, through layout/'s engine,
// staging in the call's buffer pool. Collective over the group.
template <class Backend>
struct LayoutPolicy {
  template <Communicator C>
  void reshard(C& comm, const SublayerContext& ctx, ShardedView<const float> from, ShardedView<float> to) const {
    reshard_into<Backend>(comm, from, to, *ctx.pool);
  }
};

// Throws the reason unless supported.
inline void require(const Support& support) {
  if (!support.ok()) throw Error(support.reason);
}

// The concept: the operations above for a communicator C.
template <class S, class C>
concept SublayerStrategy =
    Communicator<C> && std::default_initializable<S> && requires(const S& s, C& comm, const SublayerContext& ctx,
                                                                  const AttentionShard& aw, AttentionShard& ag,
                                                                  const MlpShard& mw, MlpShard& mg,
                                                                  typename S::AttentionSaved& as,
                                                                  typename S::MlpSaved& ms, TensorView<const float> in,
                                                                  TensorView<float> out) {
      { S::name } -> std::convertible_to<std::string_view>;
      typename S::unified_layout;
      { s.supports(ctx) } -> std::same_as<Support>;
      { s.attention_layouts(ctx) } -> std::same_as<ComputeLayouts>;
      { s.mlp_layouts(ctx) } -> std::same_as<ComputeLayouts>;
      s.reshard(comm, ctx, ShardedView<const float>{in, ctx.unified(1)}, ShardedView<float>{out, ctx.unified(1)});
      { s.attention_forward(comm, ctx, aw, in, out) } -> std::same_as<typename S::AttentionSaved>;
      s.attention_backward(comm, ctx, aw, as, in, out, ag);
      { s.mlp_forward(comm, ctx, mw, in, out) } -> std::same_as<typename S::MlpSaved>;
      s.mlp_backward(comm, ctx, mw, ms, in, out, mg);
    };

// A new tensor (in the current tracker's space) holding a copy of x, through the backend.
template <class Backend>
Tensor<float> copy_tensor(TensorView<const float> x) {
  Tensor<float> t = Tensor<float>::uninitialized(x.shape());
  Backend::copy(x, t.view());
  return t;
}

// Spans as the communicators take them.
inline std::span<const float> read_span(TensorView<const float> x) { return x.span(); }
inline std::span<float> write_span(TensorView<float> x) { return x.span(); }
template <class T>
std::span<const T> read_span(const PooledBuffer<T>& x) { return {x.data(), std::size_t(x.numel())}; }

// Where a backward accumulates its W_qkv^T gradient. Without replicated kv heads: straight into the shard's
// gradient. With them (kv_heads < p), the p/kv ranks sharing a kv head each computed only their own queries' part
// of its k and v rows' gradient: this call's contribution goes to a zeroed scratch, finish() sums the k and v rows
// over the replicas (one all-reduce of kv_heads * 2 * d * h elements over the group) and adds the result.
template <class Backend>
class QkvGradient {
public:
  QkvGradient(const SublayerContext& ctx, TensorView<float> grad_qkv /*[qkv_rows, h]*/)
      : geometry_(ctx.geometry), grad_(grad_qkv), pool_(ctx.pool) {
    if (geometry_.kv_replicated()) {
      scratch_ = pool_->acquire<float>(grad_qkv.shape());
      Backend::fill(scratch_.view(), 0.0f);
    }
  }
  // The tensor to accumulate into: [qkv_rows, h].
  TensorView<float> target() const { return geometry_.kv_replicated() ? scratch_.view() : grad_; }

  template <Communicator C>
  void finish(C& comm) {
    if (!geometry_.kv_replicated()) return;
    const ShardGeometry& g = geometry_;
    const std::int64_t d = g.head_dim, h = g.hidden, kv_global = g.ranks / g.kv_replicas;
    const std::int64_t slot = 2 * d * h;  // k rows then v rows of one kv head
    PooledBuffer<float> all = pool_->acquire<float>(Shape{kv_global, slot});
    Backend::fill(all.view(), 0.0f);
    const std::span<float> mine = all.span().subspan(std::size_t(g.first_kv_head(comm.rank()) * slot), std::size_t(slot));
    // the one local group: q rows, then k, then v
    const std::span<float> k_rows = scratch_.span().subspan(std::size_t(g.group_size * d * h), std::size_t(slot));
    Backend::copy(std::span<const float>(k_rows), mine);
    comm.all_reduce(read_span(all), all.span(), ReduceOp::sum);
    Backend::copy(std::span<const float>(mine), k_rows);
    Backend::add_into(grad_, TensorView<const float>(scratch_.view()));
  }

private:
  ShardGeometry geometry_;
  TensorView<float> grad_;
  BufferPool* pool_;
  PooledBuffer<float> scratch_;
};

}  // namespace paradyse
