// examples/parallel_block.hpp: a block paradyse does not ship, written by a user from the library's sublayer
// strategies: the parallel attention + MLP block of GPT-J and PaLM, one norm shared by both branches:
//
//   n = Norm(x),  z = x + Attention(n) + Mlp(n)          x, n, z: [b, n_r, h] on rank r (the unified layout)
//
// What the model hands the strategies (docs/CONTRACT.md): the call's SublayerContext, the layer's weight shards
// (LayerWeights: the attention and MLP shards are the ones every strategy uses; of the norms only norm1's gamma and
// beta are used, the norm2 rows stay unused and their gradient zero), the input in the unified layout, and back in
// backward the Saved state its forward returned. What it gets: the output in the unified layout and, after backward,
// the fully reduced gradient of its own shards, whichever strategy ran each branch: so the two branches may run
// different strategies, chosen per call (SublayerChoice indices into the Switchable list), and nothing is
// redistributed between them or between blocks. The norm is token-wise and replicated: its gradient is a partial sum
// over the rank's tokens, added into rows 0 and 1 of a [4, h] buffer that the caller all-reduces once for all
// layers (reduce_norm_gradients, model/layer.hpp), as the library's own layer does.
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/contract/weight_shards.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/model/layer.hpp"
#include "paradyse/ops/backend.hpp"
#include "paradyse/strategy/policy.hpp"
#include "paradyse/strategy/switchable.hpp"

#include <cstdint>
#include <span>

namespace custom {

using namespace paradyse;

// What the block's forward keeps for its backward.
template <class Strategies>
struct ParallelBlockSaved {
  Tensor<float> x;      // [b, n_r, h]: the block input (the norm's input)
  Tensor<float> stats;  // [2, b*n_r]: the norm's mean and rstd
  typename Strategies::AttentionSaved attention;
  typename Strategies::MlpSaved mlp;
};

// z: [b, n_r, h] (overwritten) = x + Attention(Norm(x)) + Mlp(Norm(x)), each branch on the strategy of `choice`.
template <class Backend = ops::Cpu, class Strategies, Communicator C>
ParallelBlockSaved<Strategies> parallel_block_forward(const Strategies& strategies, SublayerChoice choice, C& comm,
                                                      const SublayerContext& ctx, const LayerWeights& w,
                                                      TensorView<const float> x, TensorView<float> z) {
  ctx.check_activation("parallel_block_forward", "x", x, comm.rank());
  ctx.check_activation("parallel_block_forward", "z", z, comm.rank());
  const std::int64_t rows = ctx.local_rows(comm.rank());
  ParallelBlockSaved<Strategies> saved;
  saved.x = copy_tensor<Backend>(x);
  saved.stats = Tensor<float>(Shape{2, rows});
  PooledBuffer<float> normed = ctx.pool->acquire<float>(x.shape());
  PooledBuffer<float> mlp_out = ctx.pool->acquire<float>(x.shape());
  norm_forward<Backend>(ctx.layer(), x, w.norms.norm1_gamma(), w.norms.norm1_beta(), normed.view(),
                        saved.stats.view().slice(0, 0, 1).reshape(Shape{rows}),
                        saved.stats.view().slice(0, 1, 1).reshape(Shape{rows}));
  saved.attention = strategies.attention_forward(choice.attention, comm, ctx, w.attention, normed.view(), z);
  saved.mlp = strategies.mlp_forward(choice.mlp, comm, ctx, w.mlp, normed.view(), mlp_out.view());
  Backend::add_into(z, TensorView<const float>(mlp_out.view()));  // attention + mlp
  Backend::add_into(z, x);                                         // + the residual
  return saved;
}

// dx: [b, n_r, h] (overwritten) = dz + Norm'(Attention'(dz) + Mlp'(dz)). The attention and MLP shard gradients
// accumulate (fully reduced) into grad; the norm's partial gradients into rows 0 and 1 of norm_partial: [4, h].
template <class Backend = ops::Cpu, class Strategies, Communicator C>
void parallel_block_backward(const Strategies& strategies, C& comm, const SublayerContext& ctx, const LayerWeights& w,
                             ParallelBlockSaved<Strategies>& saved, TensorView<const float> dz, TensorView<float> dx,
                             LayerWeights& grad, TensorView<float> norm_partial) {
  ctx.check_activation("parallel_block_backward", "dz", dz, comm.rank());
  ctx.check_activation("parallel_block_backward", "dx", dx, comm.rank());
  const std::int64_t rows = ctx.local_rows(comm.rank()), h = ctx.hidden();
  PooledBuffer<float> dnormed = ctx.pool->acquire<float>(dz.shape());
  PooledBuffer<float> dnormed_mlp = ctx.pool->acquire<float>(dz.shape());
  strategies.attention_backward(comm, ctx, w.attention, saved.attention, dz, dnormed.view(), grad.attention);
  strategies.mlp_backward(comm, ctx, w.mlp, saved.mlp, dz, dnormed_mlp.view(), grad.mlp);
  Backend::add_into(dnormed.view(), TensorView<const float>(dnormed_mlp.view()));  // both branches read the norm
  Backend::copy(dz, dx);                                                           // the residual
  const TensorView<const float> stats(saved.stats.view());
  norm_backward<Backend>(ctx.layer(), saved.x.view(), w.norms.norm1_gamma(), stats.slice(0, 0, 1).reshape(Shape{rows}),
                         stats.slice(0, 1, 1).reshape(Shape{rows}), dnormed.view(), dx,
                         std::span<float>(norm_partial.data(), std::size_t(h)),
                         std::span<float>(norm_partial.data() + h, std::size_t(h)));
}

}  // namespace custom
