// paradyse/strategy/ulysses_z.hpp: UlyssesZ, DeepSpeed-Ulysses sequence parallelism with ZeRO-3 weights.
//
// Attention: q|k|v for the rank's own tokens and EVERY head group comes out of the ring column linear (the W_qkv^T
// shards rotate; block j, rank j's head group, lands straight in chunk j of the all-to-all send buffer). The
// all-to-all trades tokens for heads: each rank then holds its own head group over the full sequence, runs
// attention, and a second all-to-all brings every head group's output back to the token owners. The output
// projection multiplies those chunks with the all-gathered W_proj. Backward mirrors it (two all-to-alls, the
// W_proj all-gather and gradient reduce-scatter, the rotating W_qkv^T shards with their gradients).
// MLP: the ZeRO-3 MLP (strategy/zero3_mlp.hpp).
//
// Layouts: q|k|v and the attention output per head group form [p, b, s, W] (group j at index j). The ring linear
// leaves each rank its own tokens of every group, Shard(2) (zigzag when the layer is); attention computes on one
// group over every token, Shard(0). The all-to-all between the two is the engine's Shard(2) <-> Shard(0) step,
// whose head-group chunks are sent in place. The MLP computes in the unified layout (its weights move, not tokens).
//
// Per rank and sublayer. Communication: activations 2 all-to-alls forward (b*n_r*(R + h_q/p) elements out of rank
// r, about 4bsh/p per rank for MHA), 2 backward; weights ~ (3h/p + h/p) h (p-1) forward, twice that plus the
// gradients backward, independent of s. Saved: x [b, n_r, h], q|k|v [b, s, R], out [b, s, h_q/p], lse, and the
// projection input [p, b*n_r, h_q/p]. Requirements: heads % p == 0 (the unified layout's), with GQA and
// kv_heads < p the kv heads are replicated on the ranks that share them (they travel in every rank's group).
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/contract/weight_shards.hpp"
#include "paradyse/ops/backend.hpp"
#include "paradyse/strategy/attention_heads.hpp"
#include "paradyse/strategy/policy.hpp"
#include "paradyse/strategy/rope_heads.hpp"
#include "paradyse/strategy/zero3_linear.hpp"
#include "paradyse/strategy/zero3_mlp.hpp"

#include <string_view>

namespace paradyse {

template <class Backend = ops::Cpu>
struct UlyssesZ : LayoutPolicy<Backend> {
  static constexpr std::string_view name = "UlyssesZ";
  // Its MLP sublayer is zero3_mlp.hpp's, op for op: a planner dry-runs it once for every strategy that says so.
  static constexpr std::string_view mlp_sublayer = "zero3_mlp";
  // Between calls its tensors are in the unified layout (policy.hpp), though attention computes by head groups.
  using unified_layout = SequenceShardedLayout;

  struct AttentionSaved {
    Tensor<float> x;    // [b, n_r, h]
    Tensor<float> qkv;  // [b, s, R]: this rank's head group over the full sequence (after RoPE)
    Tensor<float> out;  // [b, s, heads/p * d]
    Tensor<float> lse;  // [b, heads/p, s]
    Tensor<float> a;    // [p, b*n_r, heads/p * d]: chunk j = head group j's output for this rank's tokens
  };
  using MlpSaved = Zero3MlpSaved;

  Support supports(const SublayerContext& ctx) const {
    if (ctx.layer().heads % ctx.ranks() != 0)
      return {fmt::format("{}: heads = {} must be divisible by the group size p = {}", name, ctx.layer().heads, ctx.ranks())};
    return common_support(name, ctx);
  }
  ComputeLayouts attention_layouts(const SublayerContext& ctx) const {
    return {by_heads(ctx, ctx.geometry.qkv_rows), by_heads(ctx, ctx.geometry.proj_rows)};
  }
  ComputeLayouts mlp_layouts(const SublayerContext& ctx) const { return {ctx.unified(ctx.hidden()), ctx.unified(ctx.hidden())}; }

  template <Communicator C>
  AttentionSaved attention_forward(C& comm, const SublayerContext& ctx, const AttentionShard& w,
                                   TensorView<const float> x, TensorView<float> y) const {
    ctx.check_activation("UlyssesZ attention", "x", x, comm.rank());
    ctx.check_activation("UlyssesZ attention", "y", y, comm.rank());
    require(supports(ctx));
    const ShardGeometry& g = ctx.geometry;
    const int p = ctx.ranks();
    const std::int64_t b = ctx.batch, s = ctx.length(), m = ctx.local_rows(comm.rank()), h = ctx.hidden();
    const std::int64_t R = g.qkv_rows, W = g.proj_rows;
    AttentionSaved saved{copy_tensor<Backend>(x), Tensor<float>(Shape{b, s, R}), Tensor<float>(Shape{b, s, W}),
                         Tensor<float>(Shape{b, g.q_heads, s}), Tensor<float>(Shape{p, m, W})};
    {
      PooledBuffer<float> send = ctx.pool->acquire<float>(Shape{p, m, R});
      const TensorView<float> chunks = send.view();
      ring_column_linear_forward<Backend>(comm, *ctx.pool, x.reshape(Shape{m, h}), w.qkv(), [&](int j) {
        return TensorView<float>(chunks.data() + std::int64_t(j) * m * R, Shape{m, R});
      });
      to_heads(comm, ctx, chunks, saved.qkv.view());
    }
    rope_natural<Backend>(ctx, saved.qkv.view(), RopeDirection::forward);
    const ops::AttentionMask mask = ctx.attention_mask();
    attention_forward_heads<Backend>(g, saved.qkv.view(), saved.qkv.view(), mask, saved.out.view(), saved.lse.view());
    to_tokens(comm, ctx, saved.out.view(), saved.a.view());
    const TensorView<const float> a = saved.a.view();
    gathered_row_linear_forward<Backend>(comm, *ctx.pool, w.proj(),
                                         [&](int j) { return a.slice(0, j, 1).reshape(Shape{m, W}); },
                                         y.reshape(Shape{m, h}));
    return saved;
  }

  // Selective recomputation (strategy/policy.hpp): the core's output (both layouts) and lse dropped after forward;
  // before backward the core re-runs from the kept q, k, v and its output returns to the tokens' layout (all-to-all).
  static void drop_attention_core(AttentionSaved& saved) {
    saved.out = Tensor<float>();
    saved.lse = Tensor<float>();
    saved.a = Tensor<float>();
  }
  template <Communicator C>
  void recompute_attention_core(C& comm, const SublayerContext& ctx, const AttentionShard&, AttentionSaved& saved) const {
    const ShardGeometry& g = ctx.geometry;
    const std::int64_t b = ctx.batch, s = ctx.length(), m = ctx.local_rows(comm.rank());
    saved.out = Tensor<float>(Shape{b, s, g.proj_rows});
    saved.lse = Tensor<float>(Shape{b, g.q_heads, s});
    saved.a = Tensor<float>(Shape{ctx.ranks(), m, g.proj_rows});
    attention_forward_heads<Backend>(g, saved.qkv.view(), saved.qkv.view(), ctx.attention_mask(), saved.out.view(),
                                     saved.lse.view());
    to_tokens(comm, ctx, saved.out.view(), saved.a.view());
  }

  template <Communicator C>
  void attention_backward(C& comm, const SublayerContext& ctx, const AttentionShard& w, AttentionSaved& saved,
                          TensorView<const float> dy, TensorView<float> dx, AttentionShard& grad) const {
    ctx.check_activation("UlyssesZ attention backward", "dy", dy, comm.rank());
    ctx.check_activation("UlyssesZ attention backward", "dx", dx, comm.rank());
    const ShardGeometry& g = ctx.geometry;
    const int p = ctx.ranks();
    const std::int64_t b = ctx.batch, s = ctx.length(), m = ctx.local_rows(comm.rank()), h = ctx.hidden();
    const std::int64_t R = g.qkv_rows, W = g.proj_rows;
    PooledBuffer<float> dqkv = ctx.pool->acquire<float>(Shape{b, s, R});
    Backend::fill(dqkv.view(), 0.0f);
    {
      PooledBuffer<float> dout = ctx.pool->acquire<float>(Shape{b, s, W});
      {
        PooledBuffer<float> da = ctx.pool->acquire<float>(Shape{p, m, W});
        const TensorView<float> da_view = da.view();
        const TensorView<const float> a = saved.a.view();
        gathered_row_linear_backward<Backend>(
            comm, *ctx.pool, w.proj(), [&](int j) { return a.slice(0, j, 1).reshape(Shape{m, W}); },
            dy.reshape(Shape{m, h}), [&](int j) { return da_view.slice(0, j, 1).reshape(Shape{m, W}); }, grad.proj());
        to_heads(comm, ctx, da_view, dout.view());
      }
      const ops::AttentionMask mask = ctx.attention_mask();
      attention_backward_heads<Backend>(g, saved.qkv.view(), saved.qkv.view(), saved.out.view(), saved.lse.view(),
                                        dout.view(), mask, dqkv.view(), dqkv.view());
    }
    rope_natural<Backend>(ctx, dqkv.view(), RopeDirection::backward);
    PooledBuffer<float> dsend = ctx.pool->acquire<float>(Shape{p, m, R});
    const TensorView<float> dchunks = dsend.view();
    to_tokens(comm, ctx, dqkv.view(), dchunks);
    dqkv = PooledBuffer<float>();
    QkvGradient<Backend> qkv_grad(ctx, grad.qkv());
    ring_column_linear_backward<Backend>(
        comm, *ctx.pool, TensorView<const float>(saved.x.view()).reshape(Shape{m, h}), w.qkv(),
        [&](int j) { return TensorView<const float>(dchunks.data() + std::int64_t(j) * m * R, Shape{m, R}); },
        dx.reshape(Shape{m, h}), qkv_grad.target());
    qkv_grad.finish(comm);
  }

  template <Communicator C>
  MlpSaved mlp_forward(C& comm, const SublayerContext& ctx, const MlpShard& w, TensorView<const float> x,
                       TensorView<float> y) const {
    return zero3_mlp_forward<Backend>(comm, ctx, w, x, y, "UlyssesZ mlp");
  }
  template <Communicator C>
  void mlp_backward(C& comm, const SublayerContext& ctx, const MlpShard& w, MlpSaved& saved,
                    TensorView<const float> dy, TensorView<float> dx, MlpShard& grad) const {
    zero3_mlp_backward<Backend>(comm, ctx, w, saved, dy, dx, grad, "UlyssesZ mlp backward");
  }

private:
  // [p, b, s, width] per head group: this rank's tokens of every group, or one group over every token.
  static TensorLayout by_tokens(const SublayerContext& ctx, std::int64_t width) {
    return {Shape{ctx.ranks(), ctx.batch, ctx.length(), width}, DynamicLayout{ctx.sequence_placement(2)}};
  }
  static TensorLayout by_heads(const SublayerContext& ctx, std::int64_t width) {
    return {Shape{ctx.ranks(), ctx.batch, ctx.length(), width}, StaticLayout<Shard<0>>{}};
  }
  // natural: [b, s, W], this rank's head group over every token <- chunks: [p, b*n_r, W], chunk j this rank's
  // tokens of head group j (all-to-all).
  template <Communicator C>
  void to_heads(C& comm, const SublayerContext& ctx, TensorView<const float> chunks, TensorView<float> natural) const {
    const std::int64_t W = natural.shape()[2];
    const Shape local{ctx.ranks(), ctx.batch, ctx.local_tokens(comm.rank()), W};
    this->reshard(comm, ctx, {chunks.reshape(local), by_tokens(ctx, W)},
                  {natural.reshape(Shape{1, ctx.batch, ctx.length(), W}), by_heads(ctx, W)});
  }
  // The inverse: chunks: [p, b*n_r, W] <- natural: [b, s, W].
  template <Communicator C>
  void to_tokens(C& comm, const SublayerContext& ctx, TensorView<const float> natural, TensorView<float> chunks) const {
    const std::int64_t W = natural.shape()[2];
    const Shape local{ctx.ranks(), ctx.batch, ctx.local_tokens(comm.rank()), W};
    this->reshard(comm, ctx, {natural.reshape(Shape{1, ctx.batch, ctx.length(), W}), by_heads(ctx, W)},
                  {chunks.reshape(local), by_tokens(ctx, W)});
  }
};

}  // namespace paradyse
