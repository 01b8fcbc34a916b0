// paradyse/strategy/zero3_mlp.hpp: the MLP sublayer of the ZeRO-3 strategies (UlyssesZ, MegatronCZ, ColossalZ).
//
// Activations stay sequence-sharded (the MLP is token-wise, so each rank needs only its own n_r tokens) and the
// weights come to the tokens: pre = x W_in^T through the ring column linear (W_in^T shards rotate; block j is rank
// j's f/p ffn columns), act = activation(pre) block by block, y = act W_out through the all-gather row linear.
// Backward: all-gather W_out again and reduce-scatter its gradient; the W_in^T shards rotate again with their
// gradient accumulators.
//
// Per rank: weight traffic ~ 2 f h (p-1)/p forward (GELU; 3 f h for SwiGLU) and twice that plus the gradients
// backward, independent of s. Saved: x [b, n_r, h] and pre [b*n_r, p * ffn_in_rows] (the full ffn width for the
// rank's tokens: p times METP's). Transient: the gathered W_out (f x h) and its full-size gradient.
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/contract/weight_shards.hpp"
#include "paradyse/strategy/mlp_activation.hpp"
#include "paradyse/strategy/policy.hpp"
#include "paradyse/strategy/zero3_linear.hpp"

namespace paradyse {

struct Zero3MlpSaved {
  Tensor<float> x;    // [b, n_r, h]
  Tensor<float> pre;  // [b*n_r, p * ffn_in_rows]: block j = rank j's ffn columns (SwiGLU: gate, then up)
};

template <class Backend, Communicator C>
Zero3MlpSaved zero3_mlp_forward(C& comm, const SublayerContext& ctx, const MlpShard& w, TensorView<const float> x,
                                TensorView<float> y, const char* who) {
  ctx.check_activation(who, "x", x, comm.rank());
  ctx.check_activation(who, "y", y, comm.rank());
  const ShardGeometry& g = ctx.geometry;
  const int p = ctx.ranks();
  const std::int64_t m = ctx.local_rows(comm.rank()), h = ctx.hidden();
  // pre unzeroed: every owner's block of columns is one GEMM's whole output.
  Zero3MlpSaved saved{copy_tensor<Backend>(x), Tensor<float>::uninitialized(Shape{m, p * g.ffn_in_rows})};
  const TensorView<const float> x_rows = x.reshape(Shape{m, h});
  const TensorView<float> pre = saved.pre.view();
  ring_column_linear_forward<Backend>(comm, *ctx.pool, x_rows, w.in(),
                                      [&](int j) { return pre.slice(1, j * g.ffn_in_rows, g.ffn_in_rows); });
  PooledBuffer<float> act = ctx.pool->acquire<float>(Shape{m, p * g.ffn});
  const TensorView<float> act_view = act.view();
  for (int j = 0; j < p; ++j)
    shard_activation_forward<Backend>(g, pre.slice(1, j * g.ffn_in_rows, g.ffn_in_rows), act_view.slice(1, j * g.ffn, g.ffn));
  gathered_row_linear_forward<Backend>(comm, *ctx.pool, w.out(),
                                       [&](int j) { return TensorView<const float>(act_view.slice(1, j * g.ffn, g.ffn)); },
                                       y.reshape(Shape{m, h}));
  return saved;
}

template <class Backend, Communicator C>
void zero3_mlp_backward(C& comm, const SublayerContext& ctx, const MlpShard& w, Zero3MlpSaved& saved,
                        TensorView<const float> dy, TensorView<float> dx, MlpShard& grad, const char* who) {
  ctx.check_activation(who, "dy", dy, comm.rank());
  ctx.check_activation(who, "dx", dx, comm.rank());
  const ShardGeometry& g = ctx.geometry;
  const int p = ctx.ranks();
  const std::int64_t m = ctx.local_rows(comm.rank()), h = ctx.hidden();
  const TensorView<const float> pre = saved.pre.view();
  PooledBuffer<float> dpre = ctx.pool->acquire<float>(Shape{m, p * g.ffn_in_rows});
  const TensorView<float> dpre_view = dpre.view();
  {
    PooledBuffer<float> act = ctx.pool->acquire<float>(Shape{m, p * g.ffn});
    PooledBuffer<float> dact = ctx.pool->acquire<float>(Shape{m, p * g.ffn});
    const TensorView<float> act_view = act.view(), dact_view = dact.view();
    for (int j = 0; j < p; ++j)  // recomputed, not saved
      shard_activation_forward<Backend>(g, pre.slice(1, j * g.ffn_in_rows, g.ffn_in_rows), act_view.slice(1, j * g.ffn, g.ffn));
    gathered_row_linear_backward<Backend>(
        comm, *ctx.pool, w.out(), [&](int j) { return TensorView<const float>(act_view.slice(1, j * g.ffn, g.ffn)); },
        dy.reshape(Shape{m, h}), [&](int j) { return dact_view.slice(1, j * g.ffn, g.ffn); }, grad.out());
    for (int j = 0; j < p; ++j)
      shard_activation_backward<Backend>(g, pre.slice(1, j * g.ffn_in_rows, g.ffn_in_rows),
                                         dact_view.slice(1, j * g.ffn, g.ffn),
                                         dpre_view.slice(1, j * g.ffn_in_rows, g.ffn_in_rows));
  }
  ring_column_linear_backward<Backend>(
      comm, *ctx.pool, TensorView<const float>(saved.x.view()).reshape(Shape{m, h}), w.in(),
      [&](int j) { return TensorView<const float>(dpre_view.slice(1, j * g.ffn_in_rows, g.ffn_in_rows)); },
      dx.reshape(Shape{m, h}), grad.in());
}

}  // namespace paradyse
