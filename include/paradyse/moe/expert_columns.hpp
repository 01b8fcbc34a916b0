// paradyse/moe/expert_columns.hpp: expert tensor parallelism (etp) folded over a tensor-parallel group: each expert's
// FFN split by columns over the T ranks of the group, Megatron-style, while the experts themselves stay spread over the
// expert group (ep) as moe/moe_layer.hpp's strategies spread them.
//
//   expert e on etp rank t:  W_in^T rows [chunk t of the gate rows | chunk t of the up rows]  [2 f_t, h]
//                            W_out rows chunk t                                                 [f_t, h]
//   (f_t: chunk t of f, layout/chunking.hpp's rule, uneven allowed); the shared experts (one bank of width fs) likewise;
//   the router and the shared gate are replicated over the group.
//
// SwiGLU acts column by column, so an expert computed with its column chunk gives a partial sum of its output over
// the group. The group's ranks each hold their own rows of the sequence (sequence parallelism, as MegatronTS's norms
// and residuals); the layer:
//   forward:  x_all = all-gather over tp of the rows [sum n_t, h]; the MoE strategy over ep on x_all with the
//             column view of the config (etp_view: f_t, fs_t) and this rank's column shard: every tp rank routes the
//             same tokens the same way (the router is replicated) and gets the partial output; y = reduce-scatter over
//             tp of it (own rows, summed).
//   backward: dy_all = all-gather over tp; the strategy's backward on the column shard. Everything it returns that is
//             linear in the partial expert outputs is itself partial: dx, the gate weights' gradient and through them
//             the router's and the shared gate's. The router losses' own gradient (aux, z) is not partial, so the view
//             divides their coefficients by T: summed over tp, each rank's 1/T share makes the whole. dx =
//             reduce-scatter over tp; the router and shared-gate gradients are all-reduced over tp (after the ep
//             all-reduce the strategy does), the column shards' gradients are this rank's own.
// With T = 1 every step is the plain strategy. The group may be part of the tp group (etp < tp: etp consecutive tp
// ranks, the experts replicated over the tp / etp such groups; model/expert_groups.hpp): it gathers its own ranks'
// rows only, and the router losses and gradients are then summed over the replicas by the caller.
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/layout/chunking.hpp"
#include "paradyse/moe/moe_config.hpp"
#include "paradyse/moe/moe_layer.hpp"
#include "paradyse/moe/moe_strategies.hpp"
#include "paradyse/ops/backend.hpp"
#include "paradyse/strategy/buffer_pool.hpp"

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <span>
#include <utility>
#include <vector>

namespace paradyse {

// The config as etp rank `rank` of `ranks` computes it: every expert of width f_t (its column chunk), the shared
// experts one bank of width fs_t, the router loss coefficients divided by `ranks`. Refused, by name, when a rank would
// hold no column of an expert or of the shared bank.
inline MoeConfig etp_view(const MoeConfig& c, int ranks, int rank) {
  c.validate();
  check(ranks >= 1 && rank >= 0 && rank < ranks, "etp_view: rank {} outside [0, {})", rank, ranks);
  check(c.expert_ffn >= ranks, "expert tensor parallelism: the expert width {} is split over etp = {} ranks; it must "
        "be at least etp (every rank holding a column)", c.expert_ffn, ranks);
  check(!c.has_shared() || c.shared_width() >= ranks, "expert tensor parallelism: the shared experts' width {} is split "
        "over etp = {} ranks; it must be at least etp", c.shared_width(), ranks);
  MoeConfig v = c;
  v.expert_ffn = chunk_range(c.expert_ffn, ranks, rank).length;
  if (c.has_shared()) {
    v.shared_experts = 1;
    v.shared_ffn = chunk_range(c.shared_width(), ranks, rank).length;
  }
  v.aux_loss_coef = c.aux_loss_coef / ranks;
  v.z_loss_coef = c.z_loss_coef / ranks;
  return v;
}

// Etp rank `rank`'s columns of `whole`, a shard of whole experts of `c` (its ep rank's experts; the router, shared
// experts and gate): the shapes of MoeShard::zeros(etp_view(c, ranks, rank), ...).
inline MoeShard etp_columns(const MoeShard& whole, const MoeConfig& c, int ranks, int rank) {
  const MoeConfig v = etp_view(c, ranks, rank);
  const std::int64_t h = c.hidden, f = c.expert_ffn, fs = c.shared_width(), owned = whole.expert_in.extent(0);
  check(whole.expert_in.shape() == Shape{owned, 2 * f, h} && whole.expert_out.shape() == Shape{owned, f, h},
        "etp_columns: expert_in {} and expert_out {} are not whole experts of width {} (h = {})",
        whole.expert_in.shape(), whole.expert_out.shape(), f, h);
  MoeShard s;
  s.router = Tensor<float>::copy_of(whole.router.view());
  s.shared_gate = Tensor<float>::copy_of(whole.shared_gate.view());
  // Rows [start, start + length) of each of `blocks` consecutive blocks of `rows` rows of `from`, into `to`.
  const auto take = [&](const Tensor<float>& from, Tensor<float>& to, std::int64_t blocks, std::int64_t rows,
                        ChunkRange chunk) {
    const std::span<const float> in = from.span();
    float* out = to.data();
    for (std::int64_t b = 0; b < blocks; ++b)
      for (std::int64_t r = chunk.start; r < chunk.end(); ++r, out += h)
        std::copy_n(in.data() + (b * rows + r) * h, h, out);
  };
  const ChunkRange cols = chunk_range(f, ranks, rank);
  s.expert_in = Tensor<float>(Shape{owned, 2 * v.expert_ffn, h});
  s.expert_out = Tensor<float>(Shape{owned, v.expert_ffn, h});
  take(whole.expert_in, s.expert_in, 2 * owned, f, cols);  // per expert: gate rows, then up rows
  take(whole.expert_out, s.expert_out, owned, f, cols);
  const std::int64_t fs_t = v.shared_width();
  s.shared_in = Tensor<float>(Shape{2 * fs_t, h});
  s.shared_out = Tensor<float>(Shape{fs_t, h});
  if (fs > 0) {
    const ChunkRange shared = chunk_range(fs, ranks, rank);
    take(whole.shared_in, s.shared_in, 2, fs, shared);
    take(whole.shared_out, s.shared_out, 1, fs, shared);
  }
  return s;
}

// The inverse of etp_columns: whole experts (and shared experts) of `c` from every etp rank's column shard `columns`
// of them, gathered over `etp` (every rank gets them; the router and the shared gate taken from this rank).
template <Communicator T>
MoeShard etp_gather(T& etp, const MoeConfig& c, const MoeShard& columns) {
  const int ranks = int(etp.size());
  const std::int64_t h = c.hidden, f = c.expert_ffn, fs = c.shared_width(), owned = columns.expert_in.extent(0);
  MoeShard whole;
  whole.router = Tensor<float>::copy_of(columns.router.view());
  whole.shared_gate = Tensor<float>::copy_of(columns.shared_gate.view());
  whole.expert_in = Tensor<float>(Shape{owned, 2 * f, h});
  whole.expert_out = Tensor<float>(Shape{owned, f, h});
  whole.shared_in = Tensor<float>(Shape{2 * fs, h});
  whole.shared_out = Tensor<float>(Shape{fs, h});
  // `part` holds `blocks` blocks of each rank's chunk of `rows` rows; into `to`, `blocks` blocks of `rows` rows.
  const auto gather = [&](const Tensor<float>& part, Tensor<float>& to, std::int64_t blocks, std::int64_t rows) {
    if (rows == 0) return;
    std::vector<std::int64_t> counts;
    for (int t = 0; t < ranks; ++t) counts.push_back(blocks * chunk_range(rows, ranks, t).length * h);
    std::vector<float> all(static_cast<std::size_t>(blocks * rows * h));
    etp.all_gather_v(std::span<const float>(part.span()), std::span<float>(all), std::span<const std::int64_t>(counts));
    const float* in = all.data();
    for (int t = 0; t < ranks; ++t) {
      const ChunkRange chunk = chunk_range(rows, ranks, t);
      for (std::int64_t b = 0; b < blocks; ++b, in += chunk.length * h)
        std::copy_n(in, chunk.length * h, to.data() + (b * rows + chunk.start) * h);
    }
  };
  gather(columns.expert_in, whole.expert_in, 2 * owned, f);  // per expert: gate rows, then up rows
  gather(columns.expert_out, whole.expert_out, owned, f);
  gather(columns.shared_in, whole.shared_in, 2, fs);
  gather(columns.shared_out, whole.shared_out, 1, fs);
  return whole;
}

namespace etp_detail {

// Elements of each tp rank's rows: rows[q] * h.
inline std::vector<std::int64_t> element_counts(std::span<const std::int64_t> rows, std::int64_t h) {
  std::vector<std::int64_t> counts;
  for (const std::int64_t r : rows) counts.push_back(r * h);
  return counts;
}

}  // namespace etp_detail

// y: [b, n_r, h] (overwritten) = MoE(x) for this rank's rows x: [b, n_r, h], the experts' columns over `tp` (`rows`:
// every tp rank's row count, in tp rank order), the experts over `ep`, with `strategy` (MoeStrategies index). `ctx`
// holds the column view (etp_view) and `w` this rank's column shard (etp_columns). Returns what backward needs.
template <class Backend = ops::Cpu, Communicator T, Communicator E>
MoeSaved etp_moe_forward(std::size_t strategy, T& tp, E& ep, const MoeContext& ctx, const MoeShard& w,
                         std::span<const std::int64_t> rows, TensorView<const float> x, TensorView<float> y) {
  const std::int64_t h = ctx.moe().hidden;
  check(std::int64_t(rows.size()) == tp.size() && x.is_contiguous() && y.is_contiguous() &&
            x.numel() == rows[std::size_t(tp.rank())] * h && y.shape() == x.shape(),
        "etp_moe_forward: x {} and y {} must be this rank's {} rows of h = {} (rows of {} tp ranks given for a group "
        "of {})", x.shape(), y.shape(), rows.size() > std::size_t(tp.rank()) ? rows[std::size_t(tp.rank())] : -1, h,
        rows.size(), tp.size());
  if (tp.size() == 1) return MoeStrategies<Backend>::forward(strategy, ep, ctx, w, x, y);
  const std::vector<std::int64_t> counts = etp_detail::element_counts(rows, h);
  const std::int64_t total = std::accumulate(rows.begin(), rows.end(), std::int64_t(0));
  PooledBuffer<float> x_all = ctx.pool->acquire<float>(Shape{total, h});
  tp.all_gather_v(std::span<const float>(x.data(), std::size_t(x.numel())), x_all.span(),
                  std::span<const std::int64_t>(counts));
  PooledBuffer<float> y_all = ctx.pool->acquire<float>(Shape{total, h});
  MoeSaved saved = MoeStrategies<Backend>::forward(strategy, ep, ctx, w, TensorView<const float>(x_all.view()),
                                                   y_all.view());
  tp.reduce_scatter_v(std::span<const float>(y_all.span()), std::span<float>(y.data(), std::size_t(y.numel())),
                      std::span<const std::int64_t>(counts), ReduceOp::sum);
  return saved;
}

// dx (overwritten) for this rank's rows from dy, as etp_moe_forward ran; grad ACCUMULATES: the column shard's expert
// and shared-expert gradients (this rank's own), the router's and the shared gate's summed over every token of ep x tp.
template <class Backend = ops::Cpu, Communicator T, Communicator E>
void etp_moe_backward(T& tp, E& ep, const MoeContext& ctx, const MoeShard& w, MoeSaved& saved,
                      std::span<const std::int64_t> rows, TensorView<const float> dy, TensorView<float> dx,
                      MoeShard& grad) {
  const std::int64_t h = ctx.moe().hidden;
  check(std::int64_t(rows.size()) == tp.size() && dy.is_contiguous() && dx.is_contiguous() &&
            dy.numel() == rows[std::size_t(tp.rank())] * h && dx.shape() == dy.shape(),
        "etp_moe_backward: dy {} and dx {} must be this rank's rows of h = {}", dy.shape(), dx.shape(), h);
  if (tp.size() == 1) return MoeStrategies<Backend>::backward(ep, ctx, w, saved, dy, dx, grad);
  const std::vector<std::int64_t> counts = etp_detail::element_counts(rows, h);
  const std::int64_t total = std::accumulate(rows.begin(), rows.end(), std::int64_t(0));
  PooledBuffer<float> dy_all = ctx.pool->acquire<float>(Shape{total, h});
  tp.all_gather_v(std::span<const float>(dy.data(), std::size_t(dy.numel())), dy_all.span(),
                  std::span<const std::int64_t>(counts));
  PooledBuffer<float> dx_all = ctx.pool->acquire<float>(Shape{total, h});
  // This call's router and shared-gate gradients apart (partial over tp until summed); the column shards' gradients
  // accumulate in place (moved in and back).
  MoeShard part;
  part.router = Tensor<float>(grad.router.shape());
  part.shared_gate = Tensor<float>(grad.shared_gate.shape());
  Backend::fill(part.router.view(), 0.0f);
  Backend::fill(part.shared_gate.view(), 0.0f);
  part.expert_in = std::move(grad.expert_in);
  part.expert_out = std::move(grad.expert_out);
  part.shared_in = std::move(grad.shared_in);
  part.shared_out = std::move(grad.shared_out);
  const auto restore = [&] {
    grad.expert_in = std::move(part.expert_in);
    grad.expert_out = std::move(part.expert_out);
    grad.shared_in = std::move(part.shared_in);
    grad.shared_out = std::move(part.shared_out);
  };
  try {
    MoeStrategies<Backend>::backward(ep, ctx, w, saved, TensorView<const float>(dy_all.view()), dx_all.view(), part);
  } catch (...) {
    restore();
    throw;
  }
  restore();
  for (Tensor<float>* g : {&part.router, &part.shared_gate})
    if (g->numel() > 0) tp.all_reduce(std::span<const float>(g->span()), g->span(), ReduceOp::sum);
  Backend::add_into(grad.router.view(), TensorView<const float>(part.router.view()));
  Backend::add_into(grad.shared_gate.view(), TensorView<const float>(part.shared_gate.view()));
  tp.reduce_scatter_v(std::span<const float>(dx_all.span()), std::span<float>(dx.data(), std::size_t(dx.numel())),
                      std::span<const std::int64_t>(counts), ReduceOp::sum);
}

}  // namespace paradyse
