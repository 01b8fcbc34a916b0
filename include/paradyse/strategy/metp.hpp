// paradyse/strategy/metp.hpp: METP, the memory-efficient tensor parallelism of ParaDySe (Liang et al., FITEE 2025):
// no tensor is ever duplicated; weight shards and activation blocks are exchanged point to point, one at a time.
//
// Attention, a two-level loop. Outer: for i = 0..p-1 rank i's packed attention shard [W_qkv^T_i; W_proj_i] is
// broadcast (asynchronously, double-buffered: shard i+1 is on its way while head group i is computed). Inner: the
// rank's tokens are projected to head group i's q|k|v (x W_qkv^T_i: hq/p query heads, RoPE at global positions),
// ring attention over the sequence shards computes those heads (strategy/ring_attention.hpp), and
// y += a_i W_proj_i. Saved: x and every head group's output and log-sum-exp. Backward re-broadcasts the shards,
// recomputes q|k|v_i, runs the ring backward, and reduces the packed gradient [dW_qkv^T_i; dW_proj_i] of this rank's
// tokens to its owner i (asynchronously, double-buffered against the next head group).
// MLP: the packed shards [W_in^T_j; W_out_j] rotate around the ring (strategy/ring_schedule.hpp) and every step adds
// y += act(x W_in^T_j) W_out_j for the rank's own tokens. Backward rotates the shards again with their gradient
// sums, recomputing the activation, and one last hop brings each shard's gradient home.
//
// Per rank and sublayer. Transient: q|k|v of ONE head group for the rank's tokens (b n_r 3h/p for MHA) and one
// [b n_r, f/p] MLP block: p times less than the ZeRO-3 strategies, p^2 less than MegatronTS's full-sequence
// tensors; plus two weight shards. Communication: weights ~ (4h^2 + 8h^2)(p-1)/p forward independent of s (the
// paper's figure; MHA, f = 4h), K/V 2 b s h (p-1)/p as ring attention; backward about twice that. Saved: x and the
// attention output and lse ([b, n_r, h] + [b, hq, n_r]); the MLP saves only x. Requirements: those of the unified
// layout only; replicated kv heads (kv_heads < p) travel with every replica's head group and their gradients are
// summed over the replicas. The layouts, checks and requirement are strategy/unified_ring.hpp's UnifiedRing; the
// shards' broadcast is strategy/owner_broadcast.hpp's.
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/contract/weight_shards.hpp"
#include "paradyse/ops/backend.hpp"
#include "paradyse/strategy/mlp_activation.hpp"
#include "paradyse/strategy/policy.hpp"
#include "paradyse/strategy/ring_attention.hpp"
#include "paradyse/strategy/ring_heads.hpp"
#include "paradyse/strategy/owner_broadcast.hpp"
#include "paradyse/strategy/ring_schedule.hpp"
#include "paradyse/strategy/unified_ring.hpp"

#include <span>
#include <string_view>
#include <utility>
#include <vector>

namespace paradyse {

template <class Backend = ops::Cpu>
struct METP : UnifiedRing<METP<Backend>, Backend> {
  static constexpr std::string_view name = "METP";

  struct AttentionSaved {
    Tensor<float> x;    // [b, n_r, h]
    Tensor<float> out;  // [p, b, n_r, hq/p, d]: head group i's attention output for this rank's tokens
    Tensor<float> lse;  // [p, b, hq/p, n_r]
  };
  struct MlpSaved {
    Tensor<float> x;  // [b, n_r, h]
  };

  template <Communicator C>
  AttentionSaved attention_forward(C& comm, const SublayerContext& ctx, const AttentionShard& w,
                                   TensorView<const float> x, TensorView<float> y) const {
    const auto [g, p, rank, b, n, m, h] = this->attention_call(comm, ctx, x, y);
    AttentionSaved saved{copy_tensor<Backend>(x), Tensor<float>(Shape{p, b, n, g.q_heads, g.head_dim}),
                         Tensor<float>(Shape{p, b, g.q_heads, n})};
    const TensorView<const float> x_rows = x.reshape(Shape{m, h});
    const TensorView<float> y_rows = y.reshape(Shape{m, h});
    auto shards = shard_broadcast(comm, ctx, w);
    for (int i = 0; i < p; ++i) {
      const TensorView<const float> shard(shards.next().data(), w.packed.shape());  // [qkv_rows + proj_rows, h] of rank i
      const auto [out_i, lse_i] = head_group(saved, i);
      {
        PooledBuffer<float> heads = project_heads(ctx, rank, x_rows, shard.slice(0, 0, g.qkv_rows));
        const HeadViews<const float> qkv = head_views(TensorView<const float>(heads.view()), packing(g));
        ring_attention_forward<Backend>(comm, ring_spec(ctx), *ctx.pool, qkv.q, qkv.k, qkv.v, out_i, lse_i);
      }
      // y (+)= a_i: [m, hq/p * d] * W_proj_i: [hq/p * d, h]
      Backend::matmul(TensorView<const float>(out_i).reshape(Shape{m, g.proj_rows}), ops::Transpose::no,
                      shard.slice(0, g.qkv_rows, g.proj_rows), ops::Transpose::no, y_rows, 1.0f, i == 0 ? 0.0f : 1.0f);
    }
    return saved;
  }

  // Selective recomputation (strategy/policy.hpp): every head group's output and lse dropped after forward. METP keeps
  // no q, k, v (its backward projects them again), so the re-run before backward broadcasts the attention shards
  // again and projects each head group's q, k, v before its ring attention: the core and the projection feeding it.
  static void drop_attention_core(AttentionSaved& saved) {
    saved.out = Tensor<float>();
    saved.lse = Tensor<float>();
  }
  template <Communicator C>
  void recompute_attention_core(C& comm, const SublayerContext& ctx, const AttentionShard& w, AttentionSaved& saved) const {
    const ShardGeometry& g = ctx.geometry;
    const int p = ctx.ranks(), rank = int(comm.rank());
    const std::int64_t b = ctx.batch, n = ctx.local_tokens(rank), m = ctx.local_rows(rank), h = ctx.hidden();
    saved.out = Tensor<float>(Shape{p, b, n, g.q_heads, g.head_dim});
    saved.lse = Tensor<float>(Shape{p, b, g.q_heads, n});
    const TensorView<const float> x_rows = TensorView<const float>(saved.x.view()).reshape(Shape{m, h});
    auto shards = shard_broadcast(comm, ctx, w);
    for (int i = 0; i < p; ++i) {
      const TensorView<const float> shard(shards.next().data(), w.packed.shape());
      const auto [out_i, lse_i] = head_group(saved, i);
      PooledBuffer<float> heads = project_heads(ctx, rank, x_rows, shard.slice(0, 0, g.qkv_rows));
      const HeadViews<const float> qkv = head_views(TensorView<const float>(heads.view()), packing(g));
      ring_attention_forward<Backend>(comm, ring_spec(ctx), *ctx.pool, qkv.q, qkv.k, qkv.v, out_i, lse_i);
    }
  }

  template <Communicator C>
  void attention_backward(C& comm, const SublayerContext& ctx, const AttentionShard& w, AttentionSaved& saved,
                          TensorView<const float> dy, TensorView<float> dx, AttentionShard& grad) const {
    const auto [g, p, rank, b, n, m, h] = this->attention_backward_call(comm, ctx, dy, dx);
    const std::int64_t R = g.qkv_rows, W = g.proj_rows, A = g.attention_rows();
    const TensorView<const float> x_rows = TensorView<const float>(saved.x.view()).reshape(Shape{m, h});
    const TensorView<const float> dy_rows = dy.reshape(Shape{m, h});
    const TensorView<float> dx_rows = dx.reshape(Shape{m, h});
    QkvGradient<Backend> qkv_grad(ctx, grad.qkv());
    // This rank's tokens' part of head group i's packed gradient, reduced to owner i while group i+1 is computed.
    PooledBuffer<float> partials[2] = {ctx.pool->acquire<float>(Shape{A, h}), ctx.pool->acquire<float>(Shape{A, h})};
    PooledBuffer<float> received = ctx.pool->acquire<float>(Shape{A, h});
    Request reduction;
    int reducing = -1;  // the owner of the reduction in flight
    auto finish_reduction = [&] {
      reduction.wait();
      if (reducing != rank) return;
      const TensorView<const float> total = received.view();
      Backend::add_into(qkv_grad.target(), total.slice(0, 0, R));
      Backend::add_into(grad.proj(), total.slice(0, R, W));
    };
    auto shards = shard_broadcast(comm, ctx, w);
    for (int i = 0; i < p; ++i) {
      const TensorView<const float> shard(shards.next().data(), w.packed.shape());
      const TensorView<const float> w_qkv = shard.slice(0, 0, R), w_proj = shard.slice(0, R, W);
      const auto [out_i, lse_i] = head_group(saved, i);
      const TensorView<const float> a_i = TensorView<const float>(out_i).reshape(Shape{m, W});
      const TensorView<float> partial = partials[i % 2].view();  // its reduction (i - 2) finished at step i - 1
      PooledBuffer<float> dpacked = ctx.pool->acquire<float>(Shape{m, R});
      {
        PooledBuffer<float> dheads = ctx.pool->acquire<float>(Shape{b, n, packing(g).heads(), g.head_dim});
        Backend::fill(dheads.view(), 0.0f);
        {
          PooledBuffer<float> heads = project_heads(ctx, rank, x_rows, w_qkv);
          PooledBuffer<float> dout = ctx.pool->acquire<float>(Shape{b, n, g.q_heads, g.head_dim});
          // da_i = dy W_proj_i^T; dW_proj_i (these tokens) = a_i^T dy
          Backend::matmul(dy_rows, ops::Transpose::no, w_proj, ops::Transpose::yes, dout.view().reshape(Shape{m, W}));
          Backend::matmul(a_i, ops::Transpose::yes, dy_rows, ops::Transpose::no, partial.slice(0, R, W));
          const HeadViews<const float> qkv = head_views(TensorView<const float>(heads.view()), packing(g));
          const HeadViews<float> dqkv = head_views(dheads.view(), packing(g));
          ring_attention_backward<Backend>(comm, ring_spec(ctx), *ctx.pool, qkv.q, qkv.k, qkv.v, out_i, lse_i,
                                           dout.view(), dqkv.q, dqkv.k, dqkv.v);
        }
        pack_head_gradients<Backend>(packing(g), positions(ctx, rank), dheads.view(),
                                     dpacked.view().reshape(Shape{b, n, R}));
      }
      // dx (+)= dqkv_i W_qkv^T_i; dW_qkv^T_i (these tokens) = dqkv_i^T x
      Backend::matmul(dpacked.view(), ops::Transpose::no, w_qkv, ops::Transpose::no, dx_rows, 1.0f, i == 0 ? 0.0f : 1.0f);
      Backend::matmul(dpacked.view(), ops::Transpose::yes, x_rows, ops::Transpose::no, partial.slice(0, 0, R));
      finish_reduction();
      reduction = comm.reduce_async(std::span<const float>(partial.span()), received.span(), ReduceOp::sum, i);
      reducing = i;
    }
    finish_reduction();
    qkv_grad.finish(comm);
  }

  template <Communicator C>
  MlpSaved mlp_forward(C& comm, const SublayerContext& ctx, const MlpShard& w, TensorView<const float> x,
                       TensorView<float> y) const {
    ctx.check_activation(this->mlp_label(), "x", x, comm.rank());
    ctx.check_activation(this->mlp_label(), "y", y, comm.rank());
    const ShardGeometry& g = ctx.geometry;
    const std::int64_t m = ctx.local_rows(comm.rank()), h = ctx.hidden();
    const TensorView<const float> x_rows = x.reshape(Shape{m, h});
    const TensorView<float> y_rows = y.reshape(Shape{m, h});
    PooledBuffer<float> pre = ctx.pool->acquire<float>(Shape{m, g.ffn_in_rows});
    PooledBuffer<float> act = ctx.pool->acquire<float>(Shape{m, g.ffn});
    bool first = true;
    rotate_blocks(
        comm, *ctx.pool, [&](int) { return w.packed.numel(); }, [&](std::span<float> own) { copy_shard(w, own); },
        [&](int, std::span<const float> block) {
          const MlpBlock<const float> shard(g, block.data());
          Backend::matmul(x_rows, ops::Transpose::no, shard.in, ops::Transpose::yes, pre.view());
          shard_activation_forward<Backend>(g, pre.view(), act.view());
          Backend::matmul(act.view(), ops::Transpose::no, shard.out, ops::Transpose::no, y_rows, 1.0f,
                          first ? 0.0f : 1.0f);
          first = false;
        });
    return MlpSaved{copy_tensor<Backend>(x)};
  }

  template <Communicator C>
  void mlp_backward(C& comm, const SublayerContext& ctx, const MlpShard& w, MlpSaved& saved,
                    TensorView<const float> dy, TensorView<float> dx, MlpShard& grad) const {
    ctx.check_activation(this->mlp_backward_label(), "dy", dy, comm.rank());
    ctx.check_activation(this->mlp_backward_label(), "dx", dx, comm.rank());
    const ShardGeometry& g = ctx.geometry;
    const std::int64_t m = ctx.local_rows(comm.rank()), h = ctx.hidden();
    const TensorView<const float> x_rows = TensorView<const float>(saved.x.view()).reshape(Shape{m, h});
    const TensorView<const float> dy_rows = dy.reshape(Shape{m, h});
    const TensorView<float> dx_rows = dx.reshape(Shape{m, h});
    PooledBuffer<float> pre = ctx.pool->acquire<float>(Shape{m, g.ffn_in_rows});
    PooledBuffer<float> act = ctx.pool->acquire<float>(Shape{m, g.ffn});
    PooledBuffer<float> dact = ctx.pool->acquire<float>(Shape{m, g.ffn});
    PooledBuffer<float> dpre = ctx.pool->acquire<float>(Shape{m, g.ffn_in_rows});
    bool first = true;
    auto size = [&](int) { return w.packed.numel(); };
    rotate_blocks_with_sums<Backend>(
        comm, *ctx.pool, size, size, [&](std::span<float> own) { copy_shard(w, own); },
        [&](int, std::span<const float> block, std::span<float> sum) {
          const MlpBlock<const float> shard(g, block.data());
          const MlpBlock<float> shard_grad(g, sum.data());
          Backend::matmul(x_rows, ops::Transpose::no, shard.in, ops::Transpose::yes, pre.view());  // recomputed
          shard_activation_forward<Backend>(g, pre.view(), act.view());
          // dact = dy W_out_j^T; dW_out_j += act^T dy
          Backend::matmul(dy_rows, ops::Transpose::no, shard.out, ops::Transpose::yes, dact.view());
          Backend::matmul(act.view(), ops::Transpose::yes, dy_rows, ops::Transpose::no, shard_grad.out, 1.0f, 1.0f);
          shard_activation_backward<Backend>(g, pre.view(), dact.view(), dpre.view());
          // dx (+)= dpre W_in^T_j; dW_in^T_j += dpre^T x
          Backend::matmul(dpre.view(), ops::Transpose::no, shard.in, ops::Transpose::no, dx_rows, 1.0f,
                          first ? 0.0f : 1.0f);
          Backend::matmul(dpre.view(), ops::Transpose::yes, x_rows, ops::Transpose::no, shard_grad.in, 1.0f, 1.0f);
          first = false;
        },
        [&](std::span<const float> total) { Backend::add_into(grad.packed.span(), total); });
  }

private:
  using UnifiedRing<METP, Backend>::positions;
  using UnifiedRing<METP, Backend>::ring_spec;

  // Rank i's attention shard [A, h], one at a time, in rank order, double-buffered (the owner copies its own in).
  template <Communicator C>
  static auto shard_broadcast(C& comm, const SublayerContext& ctx, const AttentionShard& w) {
    const TensorView<const float> own = w.packed.view();
    std::vector<int> owners(std::size_t(ctx.ranks()));
    for (int i = 0; i < ctx.ranks(); ++i) owners[std::size_t(i)] = i;
    return OwnerBroadcast(comm, {ctx.pool->acquire<float>(own.shape()), ctx.pool->acquire<float>(own.shape())},
                          std::move(owners), [n = own.numel()](int) { return n; },
                          [own](std::span<float> block) { Backend::copy(own, TensorView<float>(block.data(), own.shape())); });
  }

  // W_in^T_j: [ffn_in_rows, h] and W_out_j: [f/p, h] of a packed MLP shard (or of its gradient).
  template <class T>
  struct MlpBlock {
    TensorView<T> in, out;
    MlpBlock(const ShardGeometry& g, T* packed)
        : in(packed, Shape{g.ffn_in_rows, g.hidden}), out(packed + g.ffn_in_rows * g.hidden, Shape{g.ffn, g.hidden}) {}
  };

  static void copy_shard(const MlpShard& w, std::span<float> to) { Backend::copy(w.packed.span(), to); }

  static QkvPacking packing(const ShardGeometry& g) { return QkvPacking::of(g, 1); }

  // Head group i's output [b, n_r, hq/p, d] and lse [b, hq/p, n_r] in the saved tensors.
  struct HeadGroupViews {
    TensorView<float> out, lse;
  };
  static HeadGroupViews head_group(AttentionSaved& saved, int i) {
    const Shape& o = saved.out.shape();
    const Shape& l = saved.lse.shape();
    return {saved.out.view().slice(0, i, 1).reshape(Shape{o[1], o[2], o[3], o[4]}),
            saved.lse.view().slice(0, i, 1).reshape(Shape{l[1], l[2], l[3]})};
  }

  // Head group i's q|k|v for this rank's tokens: x: [m, h] times w_qkv: [qkv_rows, h], reordered into heads
  // [b, n_r, hq/p + 2 kv, d] with RoPE applied. The packed product is freed on return.
  static PooledBuffer<float> project_heads(const SublayerContext& ctx, int rank, TensorView<const float> x_rows,
                                           TensorView<const float> w_qkv) {
    const ShardGeometry& g = ctx.geometry;
    const std::int64_t b = ctx.batch, n = ctx.local_tokens(rank), m = ctx.local_rows(rank);
    PooledBuffer<float> heads = ctx.pool->acquire<float>(Shape{b, n, packing(g).heads(), g.head_dim});
    PooledBuffer<float> packed = ctx.pool->acquire<float>(Shape{m, g.qkv_rows});
    Backend::matmul(x_rows, ops::Transpose::no, w_qkv, ops::Transpose::yes, packed.view());
    unpack_heads<Backend>(packing(g), positions(ctx, rank), TensorView<const float>(packed.view()).reshape(Shape{b, n, g.qkv_rows}),
                          heads.view());
    return heads;
  }
};

}  // namespace paradyse
