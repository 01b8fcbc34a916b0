// paradyse/cost/moe_cost.hpp: an MoE strategy's memory and time on one rank, read off a dry run of its own code.
//
// moe_dry_run executes the strategy's real forward and backward (moe/moe_layer.hpp) on one rank of a p-rank group
// over meta tensors, with the counting backend (ops/counting.hpp) and a symbolic communicator (comm/symbolic.hpp),
// as cost/dry_run.hpp does for the dense sublayers; cost/trace_cost.hpp turns the trace into saved and transient
// bytes and forward and backward time. Routing is data-dependent, so the dry run assumes a balanced one: the
// counting router sends token t to experts t, t+1, ... (mod E), and every rank is assumed to route like this one
// (ExpertParallel's received counts). Skewed loads are not modelled yet.
//
// dry_run_moe_half traces the MoE half of a layer as the stack runs it (model/moe_half.hpp: norm2, the MoE FFN under
// a MoeStrategies index, the residual), as dry_run_sublayer does for the dense MLP half; the planner's MoE rows
// (plan/moe_plan.hpp) are its costs.
#pragma once

#include "paradyse/comm/symbolic.hpp"
#include "paradyse/core/memory.hpp"
#include "paradyse/core/trace.hpp"
#include "paradyse/cost/dry_run.hpp"
#include "paradyse/cost/profile.hpp"
#include "paradyse/cost/trace_cost.hpp"
#include "paradyse/contract/layer_config.hpp"
#include "paradyse/contract/weight_shards.hpp"
#include "paradyse/model/moe_half.hpp"
#include "paradyse/moe/moe_config.hpp"
#include "paradyse/moe/moe_layer.hpp"
#include "paradyse/moe/moe_strategies.hpp"
#include "paradyse/strategy/policy.hpp"
#include "paradyse/ops/counting.hpp"
#include "paradyse/strategy/buffer_pool.hpp"

#include <cstdint>
#include <optional>

namespace paradyse {

// The trace of one forward and backward of Strategy (ExpertParallel or ExpertTensorParallel) on rank `rank` of p,
// for activations [batch, local_tokens, h]. The weights, gradients and activations around the call are not part
// of it; the release of what forward saved is its last phase.
template <template <class> class Strategy>
cost::SublayerTrace moe_dry_run(const MoeConfig& c, int p, int rank, std::int64_t batch, std::int64_t local_tokens,
                                TopK k = {}) {
  using Backend = ops::Counting;
  check(batch >= 1 && local_tokens >= 0, "moe_dry_run: batch = {} must be at least 1 and local_tokens = {} >= 0", batch,
        local_tokens);
  cost::DryRun run(rank, p);
  const MoeContext ctx(c, run.pool, k);
  const MoeShard w = MoeShard::zeros(c, p, rank);
  MoeShard grad = MoeShard::zeros(c, p, rank);
  const Shape activation{batch, local_tokens, c.hidden};
  Tensor<float> x(activation), y(activation), dy(activation), dx(activation);
  run.record();
  std::optional<MoeSaved> saved = Strategy<Backend>{}.forward(run.comm, ctx, w, x.view(), y.view());
  run.end_forward();
  Strategy<Backend>{}.backward(run.comm, ctx, w, *saved, dy.view(), dx.view(), grad);
  run.end_backward();
  saved.reset();
  run.stop();
  return run.phases();
}

// Memory (always) and time (with a hardware profile) of one MoE sublayer call of Strategy on rank `rank` of p.
template <template <class> class Strategy>
cost::SublayerCost moe_cost(const MoeConfig& c, int p, int rank, std::int64_t batch, std::int64_t local_tokens,
                            const cost::HardwareProfile* hardware, int dtype_bytes = 4) {
  return cost::cost_of(moe_dry_run<Strategy>(c, p, rank, batch, local_tokens), hardware, dtype_bytes);
}

// The trace of the MoE half of a layer (norm2 + MoE FFN under MoeStrategies index `strategy` + residual) for
// `batch` samples of `seq` tokens of `layer` on rank `rank` of p, the most-loaded rank by default (rank 0 holds the
// most tokens). What exists around it (weights, the attention half's output and norm statistics) is not part of it;
// as for the dense MLP half, the release of what the MoE saved is its last phase.
inline cost::SublayerTrace dry_run_moe_half(const LayerConfig& layer, const MoeConfig& c, std::size_t strategy, int p,
                                            std::int64_t batch, std::int64_t seq, int rank = 0, TopK k = {}) {
  using Backend = ops::Counting;
  check(c.hidden == layer.hidden, "dry_run_moe_half: the MoE hidden size {} differs from the layer's {}", c.hidden,
        layer.hidden);
  cost::DryRun run(rank, p);
  const SublayerContext ctx(layer, p, batch, seq, run.pool);
  const MoeContext moe(c, run.pool, k);
  const std::int64_t n = ctx.local_tokens(rank), h = layer.hidden;
  const Shape activation{batch, n, h};
  LayerWeights weights(layer, p);
  const MoeShard w = MoeShard::zeros(c, p, rank);
  MoeShard grad = MoeShard::zeros(c, p, rank);
  Tensor<float> z(activation), dz(activation), norm_partial(Shape{4, h});
  struct {
    Tensor<float> y, stats;
  } saved;
  {
    const Trace::Pause quiet(&run.trace());  // made by the attention half
    saved.y = Tensor<float>(activation);
    saved.stats = Tensor<float>(Shape{4, batch * n});
  }
  run.record();
  std::optional<MoeSaved> moe_saved =
      moe_half_forward<Backend>(strategy, run.comm, ctx, moe, weights, w, saved, z.view());
  run.end_forward();
  PooledBuffer<float> dy = run.pool.acquire<float>(activation);
  moe_half_backward<Backend>(run.comm, ctx, moe, weights, w, saved, *moe_saved, TensorView<const float>(dz.view()),
                             dy.view(), grad, norm_partial.view());
  run.end_backward();
  moe_saved.reset();  // released with the layer
  run.stop();         // before dy goes back: that return belongs to the attention half
  return run.phases();
}

// Memory (always) and time (with a hardware profile) of the MoE half under MoeStrategies index `strategy`.
inline cost::SublayerCost moe_half_cost(const LayerConfig& layer, const MoeConfig& c, std::size_t strategy, int p,
                                        std::int64_t batch, std::int64_t seq, const cost::HardwareProfile* hardware,
                                        int dtype_bytes = 4) {
  return cost::cost_of(dry_run_moe_half(layer, c, strategy, p, batch, seq), hardware, dtype_bytes);
}

}  // namespace paradyse

