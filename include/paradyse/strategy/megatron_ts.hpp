// paradyse/strategy/megatron_ts.hpp: MegatronTS, Megatron-LM tensor parallelism with sequence parallelism.
//
// The unified shards are exactly Megatron's tensor-parallel shards, so no weight ever moves; activations do.
// Attention: all-gather the sequence, q|k|v = x W_qkv_r^T for rank r's heads over the full sequence, attention
// over the full sequence, partial = out W_proj_r, reduce-scatter back to [b, n_r, h]. MLP: all-gather, the rank's
// f/p ffn columns, reduce-scatter. Backward re-gathers the saved local input instead of keeping the gathered one
// (saves b*s*h per sublayer for one extra all-gather), and all-gathers dy.
//
// Layouts: both sublayers compute on the whole sequence in natural token order, Replicate of [b, s, h], and write
// full-size partial sums, Partial(sum); the moves to and from the unified layout are the engine's all-gather and
// reduce-scatter (layout/reshard.hpp).
//
// Per rank and sublayer, with s tokens and p ranks. Communication: forward 2 collectives of b*s*h (all-gather,
// reduce-scatter), backward 3 (2 all-gathers, 1 reduce-scatter); weights: none. Saved for backward: attention
// x [b, n_r, h], q|k|v [b, s, R], out [b, s, h_q/p], lse [b, heads/p, s]; MLP x and the pre-activation
// [b*s, f/p] (2f/p for SwiGLU). Transient: the gathered input and the partial output, b*s*h each. The fastest on
// short sequences (no weight traffic), the first to run out of memory on long ones (full-sequence tensors).
// Requirements: those of the unified layout only (heads, kv_heads and ffn shardable over p).
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/contract/weight_shards.hpp"
#include "paradyse/ops/backend.hpp"
#include "paradyse/strategy/attention_heads.hpp"
#include "paradyse/strategy/mlp_activation.hpp"
#include "paradyse/strategy/policy.hpp"
#include "paradyse/strategy/rope_heads.hpp"

#include <string_view>

namespace paradyse {

template <class Backend = ops::Cpu>
struct MegatronTS : LayoutPolicy<Backend> {
  static constexpr std::string_view name = "MegatronTS";
  // Between calls x, y, dy, dx are cut along the sequence and the weights are the packed shards (policy.hpp).
  using unified_layout = SequenceShardedLayout;

  struct AttentionSaved {
    Tensor<float> x;    // [b, n_r, h]: the local input, re-gathered in backward
    Tensor<float> qkv;  // [b, s, R]: this rank's heads over the full sequence (after RoPE)
    Tensor<float> out;  // [b, s, heads/p * d]
    Tensor<float> lse;  // [b, heads/p, s]
  };
  struct MlpSaved {
    Tensor<float> x;    // [b, n_r, h]
    Tensor<float> pre;  // [b*s, ffn_in_rows]: pre-activation of this rank's ffn columns
  };

  Support supports(const SublayerContext& ctx) const {  // the unified layout's requirements suffice
    return common_support(name, ctx);
  }
  ComputeLayouts attention_layouts(const SublayerContext& ctx) const {
    return {ctx.replicated(ctx.hidden()), ctx.partial_sums(ctx.hidden())};
  }
  ComputeLayouts mlp_layouts(const SublayerContext& ctx) const { return attention_layouts(ctx); }

  template <Communicator C>
  AttentionSaved attention_forward(C& comm, const SublayerContext& ctx, const AttentionShard& w,
                                   TensorView<const float> x, TensorView<float> y) const {
    ctx.check_activation("MegatronTS attention", "x", x, comm.rank());
    ctx.check_activation("MegatronTS attention", "y", y, comm.rank());
    const ShardGeometry& g = ctx.geometry;
    const std::int64_t b = ctx.batch, s = ctx.length(), rows = ctx.global_rows(), h = ctx.hidden();
    // qkv unzeroed: the projection's GEMM writes it whole.
    AttentionSaved saved{copy_tensor<Backend>(x), Tensor<float>::uninitialized(Shape{b, s, g.qkv_rows}),
                         Tensor<float>(Shape{b, s, g.proj_rows}), Tensor<float>(Shape{b, g.q_heads, s})};
    {
      PooledBuffer<float> x_full = ctx.pool->acquire<float>(Shape{rows, h});
      gather(comm, ctx, x, x_full.view());
      Backend::matmul(x_full.view(), ops::Transpose::no, w.qkv(), ops::Transpose::yes, saved.qkv.view().reshape(Shape{rows, g.qkv_rows}));
    }
    rope_natural<Backend>(ctx, saved.qkv.view(), RopeDirection::forward);
    const ops::AttentionMask mask = ctx.attention_mask();
    attention_forward_heads<Backend>(g, saved.qkv.view(), saved.qkv.view(), mask, saved.out.view(), saved.lse.view());
    PooledBuffer<float> partial = ctx.pool->acquire<float>(Shape{rows, h});
    Backend::matmul(saved.out.view().reshape(Shape{rows, g.proj_rows}), ops::Transpose::no, w.proj(), ops::Transpose::no, partial.view());
    scatter(comm, ctx, partial.view(), y);
    return saved;
  }

  // Selective recomputation (strategy/policy.hpp): the core's output and lse dropped after forward, re-run from the
  // kept q, k, v before backward.
  static void drop_attention_core(AttentionSaved& saved) {
    saved.out = Tensor<float>();
    saved.lse = Tensor<float>();
  }
  template <Communicator C>
  void recompute_attention_core(C&, const SublayerContext& ctx, const AttentionShard&, AttentionSaved& saved) const {
    const ShardGeometry& g = ctx.geometry;
    const std::int64_t b = ctx.batch, s = ctx.length();
    saved.out = Tensor<float>(Shape{b, s, g.proj_rows});
    saved.lse = Tensor<float>(Shape{b, g.q_heads, s});
    attention_forward_heads<Backend>(g, saved.qkv.view(), saved.qkv.view(), ctx.attention_mask(), saved.out.view(),
                                     saved.lse.view());
  }

  template <Communicator C>
  void attention_backward(C& comm, const SublayerContext& ctx, const AttentionShard& w, AttentionSaved& saved,
                          TensorView<const float> dy, TensorView<float> dx, AttentionShard& grad) const {
    ctx.check_activation("MegatronTS attention backward", "dy", dy, comm.rank());
    ctx.check_activation("MegatronTS attention backward", "dx", dx, comm.rank());
    const ShardGeometry& g = ctx.geometry;
    const std::int64_t b = ctx.batch, s = ctx.length(), rows = ctx.global_rows(), h = ctx.hidden();
    PooledBuffer<float> dqkv = ctx.pool->acquire<float>(Shape{b, s, g.qkv_rows});
    Backend::fill(dqkv.view(), 0.0f);
    {
      PooledBuffer<float> dy_full = ctx.pool->acquire<float>(Shape{rows, h});
      gather(comm, ctx, dy, dy_full.view());
      PooledBuffer<float> dout = ctx.pool->acquire<float>(Shape{b, s, g.proj_rows});
      Backend::matmul(dy_full.view(), ops::Transpose::no, w.proj(), ops::Transpose::yes, dout.view().reshape(Shape{rows, g.proj_rows}));
      Backend::matmul(saved.out.view().reshape(Shape{rows, g.proj_rows}), ops::Transpose::yes, dy_full.view(), ops::Transpose::no,
                      grad.proj(), 1.0f, 1.0f);
      const ops::AttentionMask mask = ctx.attention_mask();
      attention_backward_heads<Backend>(g, saved.qkv.view(), saved.qkv.view(), saved.out.view(), saved.lse.view(),
                                        dout.view(), mask, dqkv.view(), dqkv.view());
    }
    rope_natural<Backend>(ctx, dqkv.view(), RopeDirection::backward);
    const TensorView<const float> dqkv_rows = TensorView<const float>(dqkv.view()).reshape(Shape{rows, g.qkv_rows});
    PooledBuffer<float> x_full = ctx.pool->acquire<float>(Shape{rows, h});
    gather(comm, ctx, saved.x.view(), x_full.view());
    QkvGradient<Backend> qkv_grad(ctx, grad.qkv());
    Backend::matmul(dqkv_rows, ops::Transpose::yes, x_full.view(), ops::Transpose::no, qkv_grad.target(), 1.0f, 1.0f);
    Backend::matmul(dqkv_rows, ops::Transpose::no, w.qkv(), ops::Transpose::no, x_full.view());  // dx_full overwrites x_full
    scatter(comm, ctx, x_full.view(), dx);
    qkv_grad.finish(comm);
  }

  template <Communicator C>
  MlpSaved mlp_forward(C& comm, const SublayerContext& ctx, const MlpShard& w, TensorView<const float> x,
                       TensorView<float> y) const {
    ctx.check_activation("MegatronTS mlp", "x", x, comm.rank());
    ctx.check_activation("MegatronTS mlp", "y", y, comm.rank());
    const ShardGeometry& g = ctx.geometry;
    const std::int64_t rows = ctx.global_rows(), h = ctx.hidden();
    MlpSaved saved{copy_tensor<Backend>(x), Tensor<float>::uninitialized(Shape{rows, g.ffn_in_rows})};  // GEMM's C
    PooledBuffer<float> x_full = ctx.pool->acquire<float>(Shape{rows, h});
    gather(comm, ctx, x, x_full.view());
    Backend::matmul(x_full.view(), ops::Transpose::no, w.in(), ops::Transpose::yes, saved.pre.view());
    PooledBuffer<float> act = ctx.pool->acquire<float>(Shape{rows, g.ffn});
    shard_activation_forward<Backend>(g, saved.pre.view(), act.view());
    Backend::matmul(act.view(), ops::Transpose::no, w.out(), ops::Transpose::no, x_full.view());  // partial overwrites x_full
    scatter(comm, ctx, x_full.view(), y);
    return saved;
  }

  template <Communicator C>
  void mlp_backward(C& comm, const SublayerContext& ctx, const MlpShard& w, MlpSaved& saved,
                    TensorView<const float> dy, TensorView<float> dx, MlpShard& grad) const {
    ctx.check_activation("MegatronTS mlp backward", "dy", dy, comm.rank());
    ctx.check_activation("MegatronTS mlp backward", "dx", dx, comm.rank());
    const ShardGeometry& g = ctx.geometry;
    const std::int64_t rows = ctx.global_rows(), h = ctx.hidden();
    PooledBuffer<float> dpre = ctx.pool->acquire<float>(Shape{rows, g.ffn_in_rows});
    {
      PooledBuffer<float> dy_full = ctx.pool->acquire<float>(Shape{rows, h});
      gather(comm, ctx, dy, dy_full.view());
      PooledBuffer<float> act = ctx.pool->acquire<float>(Shape{rows, g.ffn});
      shard_activation_forward<Backend>(g, saved.pre.view(), act.view());  // recomputed, not saved
      Backend::matmul(act.view(), ops::Transpose::yes, dy_full.view(), ops::Transpose::no, grad.out(), 1.0f, 1.0f);
      Backend::matmul(dy_full.view(), ops::Transpose::no, w.out(), ops::Transpose::yes, act.view());  // dact overwrites act
      shard_activation_backward<Backend>(g, saved.pre.view(), act.view(), dpre.view());
    }
    PooledBuffer<float> x_full = ctx.pool->acquire<float>(Shape{rows, h});
    gather(comm, ctx, saved.x.view(), x_full.view());
    Backend::matmul(dpre.view(), ops::Transpose::yes, x_full.view(), ops::Transpose::no, grad.in(), 1.0f, 1.0f);
    Backend::matmul(dpre.view(), ops::Transpose::no, w.in(), ops::Transpose::no, x_full.view());  // dx_full overwrites x_full
    scatter(comm, ctx, x_full.view(), dx);
  }

private:
  // full: [b*s, h], every token in natural order <- the unified x: [b, n_r, h] (all-gather).
  template <Communicator C>
  void gather(C& comm, const SublayerContext& ctx, TensorView<const float> x, TensorView<float> full) const {
    const std::int64_t h = ctx.hidden();
    this->reshard(comm, ctx, {x, ctx.unified(h)}, {full.reshape(Shape{ctx.batch, ctx.length(), h}), ctx.replicated(h)});
  }
  // y: [b, n_r, h] <- the sum over the group of partial: [b*s, h] (reduce-scatter).
  template <Communicator C>
  void scatter(C& comm, const SublayerContext& ctx, TensorView<const float> partial, TensorView<float> y) const {
    const std::int64_t h = ctx.hidden();
    this->reshard(comm, ctx, {partial.reshape(Shape{ctx.batch, ctx.length(), h}), ctx.partial_sums(h)}, {y, ctx.unified(h)});
  }
};

}  // namespace paradyse
