// paradyse/cost/moe_cost.hpp: an MoE strategy's memory and time on one rank, read off a dry run of its own code.
//
// moe_dry_run executes the strategy's real forward and backward (moe/moe_layer.hpp) on one rank of a p-rank group
// over meta tensors, with the counting backend (ops/counting.hpp) and a symbolic communicator (comm/symbolic.hpp),
// as cost/dry_run.hpp does for the dense sublayers; cost/trace_cost.hpp turns the trace into saved and transient
// bytes and forward and backward time. Routing is data-dependent, so the dry run assumes a balanced one: the
// counting router sends token t to experts t, t+1, ... (mod E), and every rank is assumed to route like this one
// (ExpertParallel's received counts). Skewed loads are not modelled yet.
//
// Not yet done (issue 10): the MoE sublayer in the layer stack and the planner's cost table.
#pragma once

#include "paradyse/comm/symbolic.hpp"
#include "paradyse/core/memory.hpp"
#include "paradyse/core/trace.hpp"
#include "paradyse/cost/dry_run.hpp"
#include "paradyse/cost/profile.hpp"
#include "paradyse/cost/trace_cost.hpp"
#include "paradyse/moe/moe_config.hpp"
#include "paradyse/moe/moe_layer.hpp"
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

}  // namespace paradyse
