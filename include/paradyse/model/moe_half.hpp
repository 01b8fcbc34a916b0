// paradyse/model/moe_half.hpp: the MoE half of a pre-norm Transformer layer, the third sublayer kind of the stack.
//
//   z = y + MoE(Norm2(y))        y, z: [b, n_r, h] on rank r (y: after the attention residual, model/layer.hpp)
//
// An MoE layer is the attention half of model/layer.hpp followed by this half instead of the dense MLP half; the
// layer's norm weights and statistics are the same (Norm2 is the MoE's pre-norm). The MoE FFN runs the strategy of
// this call (MoeStrategies index: ExpertParallel or ExpertTensorParallel); every strategy takes and returns the
// unified layout and leaves the gradients of the same expert layout, so the choice may change per layer and per step.
// MoeLayers says which layers of a stack are MoE layers (all from first_k_dense on) and their shape.
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/contract/layer_config.hpp"
#include "paradyse/contract/weight_shards.hpp"
#include "paradyse/model/layer.hpp"
#include "paradyse/moe/expert_columns.hpp"
#include "paradyse/moe/moe_config.hpp"
#include "paradyse/moe/moe_layer.hpp"
#include "paradyse/moe/moe_strategies.hpp"
#include "paradyse/ops/backend.hpp"
#include "paradyse/strategy/buffer_pool.hpp"
#include "paradyse/strategy/policy.hpp"

#include <cstdint>
#include <span>
#include <vector>

namespace paradyse {

// The MoE layers of a stack: layers [first_k_dense, layers) run `moe` instead of the dense MLP (DeepSeek's
// first_k_dense_replace; Mixtral and Qwen2-MoE have 0).
struct MoeLayers {
  MoeConfig moe;
  int first_k_dense = 0;

  friend bool operator==(const MoeLayers&, const MoeLayers&) = default;

  bool is_moe(int layer) const noexcept { return layer >= first_k_dense; }
  void validate_for(const LayerConfig& layer, int layers) const {
    moe.validate();
    check(moe.hidden == layer.hidden, "MoeLayers: the MoE hidden size {} differs from the layer's {}", moe.hidden,
          layer.hidden);
    check(first_k_dense >= 0 && first_k_dense < layers,
          "MoeLayers: first_k_dense = {} must be in [0, layers = {}) (at least one MoE layer)", first_k_dense, layers);
  }
};

// What an MoE layer's forward reports: its router losses and expert load over the whole group.
struct MoeLayerStats {
  int layer = 0;
  double aux = 0;                      // E * sum_i f_i P_i (1: balanced)
  double z = 0;                        // mean logsumexp^2
  std::vector<std::int64_t> routed;    // [E]: assignments per expert over the group (before capacity drops)
  std::int64_t dropped = 0;            // assignments dropped by the capacity, over the group
  std::int64_t tokens = 0;             // over the group
};

inline MoeLayerStats moe_layer_stats(int layer, const MoeSaved& s) {
  return {layer, s.losses.aux, s.losses.z, s.losses.routed, s.dropped, s.losses.tokens};
}

namespace moe_half_detail {

// The row counts of `comm`'s sequence layout (b * n_q) of the ranks of `columns`, consecutive ranks of `comm` (all of
// it, or with etp < tp the etp group of this rank), in rank order.
template <Communicator C, Communicator T>
std::vector<std::int64_t> rows_of_group(const SublayerContext& ctx, C& comm, T& columns) {
  const int first = int(comm.rank()) - int(columns.rank());
  check(first >= 0 && first + int(columns.size()) <= int(comm.size()), "moe_half: the column group (rank {} of {}) "
        "is not consecutive ranks of the layer's group (rank {} of {})", columns.rank(), columns.size(), comm.rank(),
        comm.size());
  std::vector<std::int64_t> rows;
  for (int q = first; q < first + int(columns.size()); ++q) rows.push_back(ctx.local_rows(q));
  return rows;
}

}  // namespace moe_half_detail

// z: [b, n_r, h] (overwritten) = y + MoE(Norm2(y)), y = saved.y (a LayerSaved, model/layer.hpp); returns what the
// MoE keeps. The norm statistics go to saved.stats rows 2 and 3, as mlp_half_forward's.
//
// Expert group: the MoE FFN may run over another group than the attention's `comm` (dimension fusion: ep folded
// over dp x cp, each rank bringing the tokens of its own cp group and replica); `experts` is then that group's
// shard (owned_experts over expert_comm) and the rows are still this rank's of `comm`'s sequence layout.
// With `columns_over_comm` each expert's FFN is split by columns over `comm` as well (etp = comm's size, folded over
// tp: moe/expert_columns.hpp): `moe` then holds the column view (etp_view) and `experts` this rank's column shard.
// With a `column_comm` the columns are split over it instead: consecutive ranks of `comm` (etp < tp, the experts
// replicated over the tp / etp column groups of `comm`).
template <class Backend = ops::Cpu, Communicator C, Communicator E, class Saved>
MoeSaved moe_half_forward(std::size_t strategy, C& comm, E& expert_comm, const SublayerContext& ctx,
                          const MoeContext& moe, const LayerWeights& w, const MoeShard& experts, Saved& saved,
                          TensorView<float> z, bool columns_over_comm = false) {
  return moe_half_forward<Backend>(strategy, comm, expert_comm, comm, ctx, moe, w, experts, saved, z,
                                   columns_over_comm);
}
template <class Backend = ops::Cpu, Communicator C, Communicator E, Communicator T, class Saved>
MoeSaved moe_half_forward(std::size_t strategy, C& comm, E& expert_comm, T& column_comm, const SublayerContext& ctx,
                          const MoeContext& moe, const LayerWeights& w, const MoeShard& experts, Saved& saved,
                          TensorView<float> z, bool columns_over_comm) {
  const LayerConfig& c = ctx.layer();
  const std::int64_t rows = ctx.local_rows(comm.rank());
  auto stat = [&](int i) { return saved.stats.view().slice(0, i, 1).reshape(Shape{rows}); };
  MoeSaved out;
  {
    PooledBuffer<float> normed = ctx.pool->acquire<float>(saved.y.shape());
    norm_forward<Backend>(c, saved.y.view(), w.norms.norm2_gamma(), w.norms.norm2_beta(), normed.view(), stat(2), stat(3));
    if (columns_over_comm)
      out = etp_moe_forward<Backend>(strategy, column_comm, expert_comm, moe, experts,
                                     moe_half_detail::rows_of_group(ctx, comm, column_comm),
                                     TensorView<const float>(normed.view()), z);
    else
      out = MoeStrategies<Backend>::forward(strategy, expert_comm, moe, experts, normed.view(), z);
  }
  Backend::add_into(z, TensorView<const float>(saved.y.view()));  // z = y + moe
  store_activation<Backend>(z);  // model/layer.hpp: bf16 between layers in a bf16 run
  return out;
}
template <class Backend = ops::Cpu, Communicator C, class Saved>
MoeSaved moe_half_forward(std::size_t strategy, C& comm, const SublayerContext& ctx, const MoeContext& moe,
                          const LayerWeights& w, const MoeShard& experts, Saved& saved, TensorView<float> z) {
  return moe_half_forward<Backend>(strategy, comm, comm, ctx, moe, w, experts, saved, z);
}

// dy: [b, n_r, h] (overwritten) = dz + Norm2'(MoE'(dz)); the MoE gradients accumulate into grad (fully reduced),
// norm2's into norm_partial rows 2 and 3 (this rank's tokens).
// With an expert group (see moe_half_forward): grad is reduced over expert_comm; with columns_over_comm, as the
// forward ran.
template <class Backend = ops::Cpu, Communicator C, Communicator E, class Saved>
void moe_half_backward(C& comm, E& expert_comm, const SublayerContext& ctx, const MoeContext& moe,
                       const LayerWeights& w, const MoeShard& experts, Saved& saved, MoeSaved& moe_saved,
                       TensorView<const float> dz, TensorView<float> dy, MoeShard& grad,
                       TensorView<float> norm_partial, bool columns_over_comm = false) {
  moe_half_backward<Backend>(comm, expert_comm, comm, ctx, moe, w, experts, saved, moe_saved, dz, dy, grad,
                             norm_partial, columns_over_comm);
}
template <class Backend = ops::Cpu, Communicator C, Communicator E, Communicator T, class Saved>
void moe_half_backward(C& comm, E& expert_comm, T& column_comm, const SublayerContext& ctx, const MoeContext& moe,
                       const LayerWeights& w, const MoeShard& experts, Saved& saved, MoeSaved& moe_saved,
                       TensorView<const float> dz, TensorView<float> dy, MoeShard& grad,
                       TensorView<float> norm_partial, bool columns_over_comm) {
  const LayerConfig& c = ctx.layer();
  const std::int64_t rows = ctx.local_rows(comm.rank()), h = ctx.hidden();
  auto stat = [&](int i) { return TensorView<const float>(saved.stats.view()).slice(0, i, 1).reshape(Shape{rows}); };
  auto partial = [&](int i) { return std::span<float>(norm_partial.data() + i * h, std::size_t(h)); };
  Backend::copy(dz, dy);
  PooledBuffer<float> dnormed = ctx.pool->acquire<float>(dz.shape());
  if (columns_over_comm)
    etp_moe_backward<Backend>(column_comm, expert_comm, moe, experts, moe_saved,
                              moe_half_detail::rows_of_group(ctx, comm, column_comm), dz, dnormed.view(), grad);
  else
    MoeStrategies<Backend>::backward(expert_comm, moe, experts, moe_saved, dz, dnormed.view(), grad);
  norm_backward<Backend>(c, saved.y.view(), w.norms.norm2_gamma(), stat(2), stat(3), dnormed.view(), dy, partial(2),
                         partial(3));
  store_activation<Backend>(dy);
}
template <class Backend = ops::Cpu, Communicator C, class Saved>
void moe_half_backward(C& comm, const SublayerContext& ctx, const MoeContext& moe, const LayerWeights& w,
                       const MoeShard& experts, Saved& saved, MoeSaved& moe_saved, TensorView<const float> dz,
                       TensorView<float> dy, MoeShard& grad, TensorView<float> norm_partial) {
  moe_half_backward<Backend>(comm, comm, ctx, moe, w, experts, saved, moe_saved, dz, dy, grad, norm_partial);
}

}  // namespace paradyse
