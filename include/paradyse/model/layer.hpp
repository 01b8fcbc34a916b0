// paradyse/model/layer.hpp: one pre-norm Transformer layer over the unified layout, with a strategy per sublayer.
//
//   y = x + Attention(Norm1(x)),  z = y + Mlp(Norm2(y))        x, y, z: [b, n_r, h] on rank r
//
// The norms are token-wise and replicated, so they run locally on the rank's tokens; the attention and MLP
// sublayers run the strategies chosen for this call (Switchable indices). Switching strategy between the two
// sublayers or between layers costs nothing: every strategy takes and returns the unified layout and leaves the
// gradients of the same shards. Norm weight gradients are partial sums over the rank's tokens; layer_backward
// adds them to a caller's buffer so a stack reduces all layers' norm gradients in one all-reduce
// (reduce_norm_gradients).
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/contract/layer_config.hpp"
#include "paradyse/contract/weight_shards.hpp"
#include "paradyse/ops/backend.hpp"
#include "paradyse/strategy/buffer_pool.hpp"
#include "paradyse/strategy/policy.hpp"
#include "paradyse/strategy/switchable.hpp"

#include <cstdint>
#include <span>

namespace paradyse {

namespace layer_detail {
inline TensorView<const float> vector_view(std::span<const float> v) { return {v.data(), Shape{std::int64_t(v.size())}}; }
inline TensorView<float> vector_view(std::span<float> v) { return {v.data(), Shape{std::int64_t(v.size())}}; }
}  // namespace layer_detail

// y: [b, n, h] (overwritten) = norm(x) with gamma, beta (beta unused by RMSNorm); mean, rstd: [b*n] saved.
template <class Backend>
void norm_forward(const LayerConfig& c, TensorView<const float> x, std::span<const float> gamma,
                  std::span<const float> beta, TensorView<float> y, TensorView<float> mean, TensorView<float> rstd) {
  using layer_detail::vector_view;
  if (c.norm == NormKind::layer_norm)
    Backend::layer_norm_forward(x, vector_view(gamma), vector_view(beta), float(c.norm_eps), y, mean, rstd);
  else
    Backend::rms_norm_forward(x, vector_view(gamma), float(c.norm_eps), y, rstd);
}

// Accumulates dx: [b, n, h], dgamma and dbeta: [h] (dbeta untouched by RMSNorm).
template <class Backend>
void norm_backward(const LayerConfig& c, TensorView<const float> x, std::span<const float> gamma,
                   TensorView<const float> mean, TensorView<const float> rstd, TensorView<const float> dy,
                   TensorView<float> dx, std::span<float> dgamma, std::span<float> dbeta) {
  using layer_detail::vector_view;
  if (c.norm == NormKind::layer_norm)
    Backend::layer_norm_backward(x, vector_view(gamma), mean, rstd, dy, dx, vector_view(dgamma), vector_view(dbeta));
  else
    Backend::rms_norm_backward(x, vector_view(gamma), rstd, dy, dx, vector_view(dgamma));
}

// x: an activation that a bf16 run stores in bf16 without a compute op in between (the residual stream after each
// sublayer, forward and backward), rounded to the backend's activation type in place: ops::CpuBf16 rounds it
// (ops/cpu/bf16_backend.hpp); an fp32 backend has no store_activation and nothing happens.
template <class Backend>
void store_activation(TensorView<float> x) {
  if constexpr (requires { Backend::store_activation(x); }) Backend::store_activation(x);
}

// What a layer's forward keeps for its backward.
template <class Strategies>
struct LayerSaved {
  Tensor<float> x;      // [b, n_r, h]: the layer input (Norm1's input)
  Tensor<float> y;      // [b, n_r, h]: after the attention residual (Norm2's input)
  Tensor<float> stats;  // [4, b*n_r]: Norm1 mean, Norm1 rstd, Norm2 mean, Norm2 rstd
  typename Strategies::AttentionSaved attention;
  typename Strategies::MlpSaved mlp;
  SublayerChoice choice;
  // Selective recomputation (TransformerStack::set_selective_recompute): attention's core tensors were dropped after
  // forward (Switchable::drop_attention_core); attention_half_backward re-runs the core first.
  bool attention_core_dropped = false;
};

// The layer in two halves, one per sublayer, so that a dry run (cost/dry_run.hpp) can trace each sublayer with the
// norm and residual around it exactly as the layer runs it.

// saved.x, saved.y, saved.stats and saved.attention <- y = x + Attention(Norm1(x)), x: [b, n_r, h].
template <class Backend = ops::Cpu, class Strategies, Communicator C>
void attention_half_forward(const Strategies& strategies, int strategy, C& comm, const SublayerContext& ctx,
                            const LayerWeights& w, TensorView<const float> x, LayerSaved<Strategies>& saved) {
  const LayerConfig& c = ctx.layer();
  const std::int64_t rows = ctx.local_rows(comm.rank());
  saved.x = copy_tensor<Backend>(x);
  saved.y = Tensor<float>(x.shape());
  saved.stats = Tensor<float>(Shape{4, rows});
  auto stat = [&](int i) { return saved.stats.view().slice(0, i, 1).reshape(Shape{rows}); };
  {
    PooledBuffer<float> normed = ctx.pool->acquire<float>(x.shape());
    norm_forward<Backend>(c, x, w.norms.norm1_gamma(), w.norms.norm1_beta(), normed.view(), stat(0), stat(1));
    saved.attention = strategies.attention_forward(strategy, comm, ctx, w.attention, normed.view(), saved.y.view());
  }
  Backend::add_into(saved.y.view(), x);  // y = x + attention
  store_activation<Backend>(saved.y.view());
}

// z: [b, n_r, h] (overwritten) = y + Mlp(Norm2(y)), y = saved.y; saved.mlp <- what the MLP keeps.
template <class Backend = ops::Cpu, class Strategies, Communicator C>
void mlp_half_forward(const Strategies& strategies, int strategy, C& comm, const SublayerContext& ctx,
                      const LayerWeights& w, LayerSaved<Strategies>& saved, TensorView<float> z) {
  const LayerConfig& c = ctx.layer();
  const std::int64_t rows = ctx.local_rows(comm.rank());
  auto stat = [&](int i) { return saved.stats.view().slice(0, i, 1).reshape(Shape{rows}); };
  {
    PooledBuffer<float> normed = ctx.pool->acquire<float>(saved.y.shape());
    norm_forward<Backend>(c, saved.y.view(), w.norms.norm2_gamma(), w.norms.norm2_beta(), normed.view(), stat(2), stat(3));
    saved.mlp = strategies.mlp_forward(strategy, comm, ctx, w.mlp, normed.view(), z);
  }
  Backend::add_into(z, TensorView<const float>(saved.y.view()));  // z = y + mlp
  store_activation<Backend>(z);
}

// dy: [b, n_r, h] (overwritten) = dz + Norm2'(Mlp'(dz)); MLP gradients accumulate into grad, norm2's into
// norm_partial rows 2 and 3.
template <class Backend = ops::Cpu, class Strategies, Communicator C>
void mlp_half_backward(const Strategies& strategies, C& comm, const SublayerContext& ctx, const LayerWeights& w,
                       LayerSaved<Strategies>& saved, TensorView<const float> dz, TensorView<float> dy,
                       LayerWeights& grad, TensorView<float> norm_partial) {
  const LayerConfig& c = ctx.layer();
  const std::int64_t rows = ctx.local_rows(comm.rank()), h = ctx.hidden();
  auto stat = [&](int i) { return TensorView<const float>(saved.stats.view()).slice(0, i, 1).reshape(Shape{rows}); };
  auto partial = [&](int i) { return std::span<float>(norm_partial.data() + i * h, std::size_t(h)); };
  Backend::copy(dz, dy);
  PooledBuffer<float> dnormed = ctx.pool->acquire<float>(dz.shape());
  strategies.mlp_backward(comm, ctx, w.mlp, saved.mlp, dz, dnormed.view(), grad.mlp);
  norm_backward<Backend>(c, saved.y.view(), w.norms.norm2_gamma(), stat(2), stat(3), dnormed.view(), dy, partial(2),
                         partial(3));
  store_activation<Backend>(dy);
}

// dx: [b, n_r, h] (overwritten) = dy + Norm1'(Attention'(dy)); attention gradients accumulate into grad, norm1's
// into norm_partial rows 0 and 1.
template <class Backend = ops::Cpu, class Strategies, Communicator C>
void attention_half_backward(const Strategies& strategies, C& comm, const SublayerContext& ctx, const LayerWeights& w,
                             LayerSaved<Strategies>& saved, TensorView<const float> dy, TensorView<float> dx,
                             LayerWeights& grad, TensorView<float> norm_partial) {
  const LayerConfig& c = ctx.layer();
  const std::int64_t rows = ctx.local_rows(comm.rank()), h = ctx.hidden();
  auto stat = [&](int i) { return TensorView<const float>(saved.stats.view()).slice(0, i, 1).reshape(Shape{rows}); };
  auto partial = [&](int i) { return std::span<float>(norm_partial.data() + i * h, std::size_t(h)); };
  if (saved.attention_core_dropped) {  // selective recomputation: the core again, from the kept q, k, v
    strategies.recompute_attention_core(comm, ctx, w.attention, saved.attention);
    saved.attention_core_dropped = false;
  }
  Backend::copy(dy, dx);
  PooledBuffer<float> dnormed = ctx.pool->acquire<float>(dy.shape());
  strategies.attention_backward(comm, ctx, w.attention, saved.attention, dy, dnormed.view(), grad.attention);
  norm_backward<Backend>(c, saved.x.view(), w.norms.norm1_gamma(), stat(0), stat(1), dnormed.view(), dx, partial(0),
                         partial(1));
  store_activation<Backend>(dx);
}

// z: [b, n_r, h] (overwritten) = the layer applied to x: [b, n_r, h], with the strategies of `choice`.
template <class Backend = ops::Cpu, class Strategies, Communicator C>
LayerSaved<Strategies> layer_forward(const Strategies& strategies, SublayerChoice choice, C& comm,
                                     const SublayerContext& ctx, const LayerWeights& w, TensorView<const float> x,
                                     TensorView<float> z) {
  ctx.check_activation("layer_forward", "x", x, comm.rank());
  ctx.check_activation("layer_forward", "z", z, comm.rank());
  LayerSaved<Strategies> saved;
  saved.choice = choice;
  attention_half_forward<Backend>(strategies, choice.attention, comm, ctx, w, x, saved);
  mlp_half_forward<Backend>(strategies, choice.mlp, comm, ctx, w, saved, z);
  return saved;
}

// dx: [b, n_r, h] (overwritten) from dz: [b, n_r, h]. The attention and MLP shard gradients accumulate (fully
// reduced) into grad; the norm gradients of this rank's tokens accumulate into norm_partial: [4, h], to be
// all-reduced by reduce_norm_gradients.
template <class Backend = ops::Cpu, class Strategies, Communicator C>
void layer_backward(const Strategies& strategies, C& comm, const SublayerContext& ctx, const LayerWeights& w,
                    LayerSaved<Strategies>& saved, TensorView<const float> dz, TensorView<float> dx, LayerWeights& grad,
                    TensorView<float> norm_partial) {
  ctx.check_activation("layer_backward", "dz", dz, comm.rank());
  ctx.check_activation("layer_backward", "dx", dx, comm.rank());
  check(norm_partial.shape() == Shape{4, ctx.hidden()} && norm_partial.is_contiguous(),
        "layer_backward: norm_partial {} must be [4, {}]", norm_partial.shape(), ctx.hidden());
  PooledBuffer<float> dy = ctx.pool->acquire<float>(dz.shape());
  mlp_half_backward<Backend>(strategies, comm, ctx, w, saved, dz, dy.view(), grad, norm_partial);
  attention_half_backward<Backend>(strategies, comm, ctx, w, saved, TensorView<const float>(dy.view()), dx, grad,
                                   norm_partial);
}

// grad_norms (each layer's [4, h]) += the sum over ranks of partial: [layers, 4, h]. One all-reduce.
template <class Backend = ops::Cpu, Communicator C>
void reduce_norm_gradients(C& comm, TensorView<float> partial, std::span<NormWeights*> grad_norms) {
  check(partial.is_contiguous() && partial.extent(0) == std::int64_t(grad_norms.size()),
        "reduce_norm_gradients: partial {} must hold one [4, h] block per layer ({} layers)", partial.shape(),
        grad_norms.size());
  comm.all_reduce(TensorView<const float>(partial).span(), partial.span(), ReduceOp::sum);
  const std::int64_t block = partial.numel() / std::max<std::int64_t>(partial.extent(0), 1);
  for (std::size_t l = 0; l < grad_norms.size(); ++l)
    Backend::add_into(grad_norms[l]->packed.span(), std::span<const float>(partial.data() + std::int64_t(l) * block, std::size_t(block)));
}

}  // namespace paradyse
