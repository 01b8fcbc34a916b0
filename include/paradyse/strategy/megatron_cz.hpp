// paradyse/strategy/megatron_cz.hpp: MegatronCZ, Megatron-LM context parallelism (ring attention) with ZeRO-3
// weights.
//
// Attention: every head of the rank's own tokens. q|k|v comes out of the ring column linear (the W_qkv^T shards
// rotate; block j, rank j's head group, lands in columns [j R, (j+1) R) of [b*n_r, p R]), is reordered into heads
// with RoPE at the tokens' global positions (strategy/ring_heads.hpp), and ring attention
// (strategy/ring_attention.hpp) passes the K/V blocks around the ring: double-buffered shifts, a stable log-sum-exp
// merge, causal blocks skipped, zigzag balancing when the layout is zigzag. The output projection multiplies with
// the all-gathered W_proj. Backward: W_proj all-gather and gradient reduce-scatter, ring attention backward (dK/dV
// travel with K/V and return to their owners), the W_qkv^T shards rotating again with their gradients.
// MLP: the ZeRO-3 MLP (strategy/zero3_mlp.hpp).
//
// Per rank and sublayer. Communication: K/V 2 b (s - n_{r+1}) hkv d forward (independent of p per rank: about
// 2 b s hkv d), twice that plus the dK/dV sums backward; weights as the other ZeRO-3 strategies (~4 h^2 (p-1)/p
// forward for MHA, independent of s). Saved: x [b, n_r, h], q|k|v heads [b, n_r, hq + 2 hkv, d] (after RoPE),
// out [b, n_r, hq d], lse [b, hq, n_r]. Transient: two K/V blocks forward, five backward (ring buffers), the packed
// projection [b n_r, p R], the gathered W_proj. Requirements: those of the unified layout only (heads % p == 0);
// with kv heads replicated (kv_heads < p) every replica's K/V travels and the replicas' gradients are summed.
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/contract/weight_shards.hpp"
#include "paradyse/ops/backend.hpp"
#include "paradyse/strategy/policy.hpp"
#include "paradyse/strategy/ring_attention.hpp"
#include "paradyse/strategy/ring_heads.hpp"
#include "paradyse/strategy/zero3_linear.hpp"
#include "paradyse/strategy/zero3_mlp.hpp"

#include <string_view>

namespace paradyse {

template <class Backend = ops::Cpu>
struct MegatronCZ : LayoutPolicy<Backend> {
  static constexpr std::string_view name = "MegatronCZ";
  // Its MLP sublayer is zero3_mlp.hpp's, op for op: a planner dry-runs it once for every strategy that says so.
  static constexpr std::string_view mlp_sublayer = "zero3_mlp";
  // Both sublayers compute in the unified layout: K/V blocks pass around the ring and the ZeRO-3 weights move, not tokens.
  ComputeLayouts attention_layouts(const SublayerContext& ctx) const {
    return {ctx.unified(ctx.hidden()), ctx.unified(ctx.hidden())};
  }
  ComputeLayouts mlp_layouts(const SublayerContext& ctx) const { return attention_layouts(ctx); }

  struct AttentionSaved {
    Tensor<float> x;      // [b, n_r, h]
    Tensor<float> heads;  // [b, n_r, hq + 2 hkv, d]: q, k, v of every head group (RoPE applied)
    Tensor<float> out;    // [b, n_r, hq, d]: attention output in global head order
    Tensor<float> lse;    // [b, hq, n_r]
  };
  using MlpSaved = Zero3MlpSaved;

  Support supports(const SublayerContext& ctx) const {
    if (ctx.layer().heads % ctx.ranks() != 0)
      return {fmt::format("{}: heads = {} must be divisible by the group size p = {}", name, ctx.layer().heads, ctx.ranks())};
    return common_support(name, ctx);
  }

  template <Communicator C>
  AttentionSaved attention_forward(C& comm, const SublayerContext& ctx, const AttentionShard& w,
                                   TensorView<const float> x, TensorView<float> y) const {
    ctx.check_activation("MegatronCZ attention", "x", x, comm.rank());
    ctx.check_activation("MegatronCZ attention", "y", y, comm.rank());
    require(supports(ctx));
    const ShardGeometry& g = ctx.geometry;
    const int p = ctx.ranks(), rank = comm.rank();
    const std::int64_t b = ctx.batch, n = ctx.local_tokens(rank), m = ctx.local_rows(rank), h = ctx.hidden();
    const std::int64_t R = g.qkv_rows;
    const QkvPacking packing = QkvPacking::of(g, p);
    AttentionSaved saved{copy_tensor<Backend>(x), Tensor<float>(Shape{b, n, packing.heads(), g.head_dim}),
                         Tensor<float>(Shape{b, n, packing.q_heads(), g.head_dim}),
                         Tensor<float>(Shape{b, packing.q_heads(), n})};
    {
      PooledBuffer<float> packed = ctx.pool->acquire<float>(Shape{m, p * R});
      const TensorView<float> columns = packed.view();
      ring_column_linear_forward<Backend>(comm, *ctx.pool, x.reshape(Shape{m, h}), w.qkv(),
                                          [&](int j) { return columns.slice(1, j * R, R); });
      unpack_heads<Backend>(packing, positions(ctx, rank), columns.reshape(Shape{b, n, p * R}), saved.heads.view());
    }
    const HeadViews<const float> qkv = head_views(TensorView<const float>(saved.heads.view()), packing);
    ring_attention_forward<Backend>(comm, ring_spec(ctx), *ctx.pool, qkv.q, qkv.k, qkv.v, saved.out.view(),
                                    saved.lse.view());
    const TensorView<const float> a = TensorView<const float>(saved.out.view()).reshape(Shape{m, p * g.proj_rows});
    gathered_row_linear_forward<Backend>(comm, *ctx.pool, w.proj(),
                                         [&](int j) { return a.slice(1, j * g.proj_rows, g.proj_rows); },
                                         y.reshape(Shape{m, h}));
    return saved;
  }

  template <Communicator C>
  void attention_backward(C& comm, const SublayerContext& ctx, const AttentionShard& w, AttentionSaved& saved,
                          TensorView<const float> dy, TensorView<float> dx, AttentionShard& grad) const {
    ctx.check_activation("MegatronCZ attention backward", "dy", dy, comm.rank());
    ctx.check_activation("MegatronCZ attention backward", "dx", dx, comm.rank());
    const ShardGeometry& g = ctx.geometry;
    const int p = ctx.ranks(), rank = comm.rank();
    const std::int64_t b = ctx.batch, n = ctx.local_tokens(rank), m = ctx.local_rows(rank), h = ctx.hidden();
    const std::int64_t R = g.qkv_rows, W = g.proj_rows;
    const QkvPacking packing = QkvPacking::of(g, p);
    PooledBuffer<float> dpacked = ctx.pool->acquire<float>(Shape{m, p * R});
    {
      PooledBuffer<float> dheads = ctx.pool->acquire<float>(saved.heads.shape());
      Backend::fill(dheads.view(), 0.0f);
      {
        PooledBuffer<float> dout = ctx.pool->acquire<float>(saved.out.shape());
        const TensorView<const float> a = TensorView<const float>(saved.out.view()).reshape(Shape{m, p * W});
        const TensorView<float> da = dout.view().reshape(Shape{m, p * W});
        gathered_row_linear_backward<Backend>(
            comm, *ctx.pool, w.proj(), [&](int j) { return a.slice(1, j * W, W); }, dy.reshape(Shape{m, h}),
            [&](int j) { return da.slice(1, j * W, W); }, grad.proj());
        const HeadViews<const float> qkv = head_views(TensorView<const float>(saved.heads.view()), packing);
        const HeadViews<float> dqkv = head_views(dheads.view(), packing);
        ring_attention_backward<Backend>(comm, ring_spec(ctx), *ctx.pool, qkv.q, qkv.k, qkv.v, saved.out.view(),
                                         saved.lse.view(), dout.view(), dqkv.q, dqkv.k, dqkv.v);
      }
      pack_head_gradients<Backend>(packing, positions(ctx, rank), dheads.view(),
                                   dpacked.view().reshape(Shape{b, n, p * R}));
    }
    const TensorView<const float> dcolumns = dpacked.view();
    QkvGradient<Backend> qkv_grad(ctx, grad.qkv());
    ring_column_linear_backward<Backend>(comm, *ctx.pool, TensorView<const float>(saved.x.view()).reshape(Shape{m, h}),
                                         w.qkv(), [&](int j) { return dcolumns.slice(1, j * R, R); },
                                         dx.reshape(Shape{m, h}), qkv_grad.target());
    qkv_grad.finish(comm);
  }

  template <Communicator C>
  MlpSaved mlp_forward(C& comm, const SublayerContext& ctx, const MlpShard& w, TensorView<const float> x,
                       TensorView<float> y) const {
    return zero3_mlp_forward<Backend>(comm, ctx, w, x, y, "MegatronCZ mlp");
  }
  template <Communicator C>
  void mlp_backward(C& comm, const SublayerContext& ctx, const MlpShard& w, MlpSaved& saved,
                    TensorView<const float> dy, TensorView<float> dx, MlpShard& grad) const {
    zero3_mlp_backward<Backend>(comm, ctx, w, saved, dy, dx, grad, "MegatronCZ mlp backward");
  }

private:
  static RingAttentionSpec ring_spec(const SublayerContext& ctx) {
    return RingAttentionSpec{.layout = ctx.sequence, .causal = ctx.layer().causal, .document_starts = ctx.document_starts};
  }
  static TokenPositions positions(const SublayerContext& ctx, int rank) {
    return TokenPositions{&ctx.layer(), &ctx.sequence, rank, ctx.document_starts};
  }
};

}  // namespace paradyse
