// paradyse/moe/moe_layer.hpp: the MoE FFN sublayer, on one rank and under two parallel strategies over the unified
// activation layout.
//
// The sublayer: route (moe/router.hpp), permute the tokens by expert (moe/dispatch.hpp), run each expert's SwiGLU
// over its ragged block (moe/experts.hpp), unpermute and combine with the gate weights, add the shared experts
// (optionally times a sigmoid gate). No norm and no residual inside. Backward goes through combine, experts,
// dispatch and router (the router's gradient flows through the gate weights, the load-balancing loss and the
// z-loss).
//
// Layout (the same for both strategies, so a plan may switch per layer and per step at no cost):
//   - x, y, dy, dx: this rank's tokens, [b, n_r, h] (any token count per rank), contiguous;
//   - rank r owns whole experts [first_r, first_r + E_r) (moe_config.hpp, the chunking rule); the router and the
//     shared experts are replicated;
//   - backward ACCUMULATES into `grad` the fully reduced gradient of rank r's own shard: its experts' gradients
//     summed over every token of every rank, and the replicated weights' gradients summed over all ranks.
// Strategies:
//   - ExpertParallel moves tokens: all-to-all-v of the permuted rows to the experts' owners (per-expert counts
//     exchanged first), one GEMM per owned expert over the rows of all ranks (expert-major), all-to-all-v back.
//     Traffic grows with the routing skew.
//   - ExpertTensorParallel (ZeRO-style) moves weights: each owner's experts are broadcast in turn (the next owner's
//     while the current ones compute) and every rank runs its own tokens through them; backward broadcasts them again
//     and reduces each owner's weight gradients onto it. Traffic is 3 E f h per pass whatever the routing; a rank
//     holds at most two owners' experts at once, never all E.
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/moe/dispatch.hpp"
#include "paradyse/moe/experts.hpp"
#include "paradyse/moe/moe_config.hpp"
#include "paradyse/moe/router.hpp"
#include "paradyse/ops/backend.hpp"
#include "paradyse/strategy/buffer_pool.hpp"
#include "paradyse/strategy/owner_broadcast.hpp"

#include <algorithm>
#include <cstdint>
#include <functional>
#include <span>
#include <string_view>
#include <vector>

namespace paradyse {

// Everything a call needs besides its tensors.
struct MoeContext {
  const MoeConfig* config = nullptr;
  BufferPool* pool = nullptr;
  TopK k = {};  // experts per token for this call (per layer, or per token)
  // Expert data parallelism (the layer's tokens spread over several expert groups, each holding a replica of the
  // experts): sums the router statistics, already summed over this call's group, over the other expert groups of the
  // same tokens, so that the router losses (aux, z) and the load are the whole micro-batch's, as one group holding
  // every token computes them (Megatron-Core's global load balancing). Empty: the group holds every token.
  std::function<void(std::span<double>)> sum_statistics_over_replicas;

  MoeContext(const MoeConfig& c, BufferPool& p, TopK k_ = {}) : config(&c), pool(&p), k(k_) { c.validate(); }
  const MoeConfig& moe() const noexcept { return *config; }
};

// What forward keeps for backward, and what it reports (losses, load, drops over the whole group).
struct MoeSaved {
  std::string_view strategy;  // who made it ("single rank", or a strategy's name): backward checks it is its own
  Tensor<float> x;           // [n, h]
  Routing routing;
  RouterLosses losses;       // aux, z, load over the group
  Dispatch dispatch;         // this rank's tokens by expert
  std::int64_t dropped = 0;  // assignments dropped by the capacity, over the group
  Tensor<float> wp;          // [rows]: gate weight of each permuted row
  Tensor<float> hp;          // [rows, h]: the experts' outputs for this rank's permuted rows
  // The rows this rank's experts computed (expert-major), their pre-activations and block offsets. expert_x is kept
  // by ExpertParallel only (rows that came from other ranks); one rank and ExpertTensorParallel permute x again.
  Tensor<float> expert_x, expert_pre;
  std::vector<std::int64_t> expert_offsets;
  // ExpertParallel: rows sent to / received from each rank, and the received rows' permutation to expert-major.
  std::vector<std::int64_t> send_rows, recv_rows, perm, inverse;
  // Shared experts.
  Tensor<float> shared_pre;  // [n, 2 fs]
  Tensor<float> shared_y;    // [n, h] (gated only)
  Tensor<float> shared_sig;  // [n] (gated only)
};

namespace moe_detail {

inline TensorView<const float> rows_of(const MoeConfig& c, const char* who, const char* what,
                                       TensorView<const float> x) {
  check(x.is_contiguous() && x.rank() >= 2 && x.extent(-1) == c.hidden,
        "{}: {} has shape {}, expected contiguous [..., h = {}]", who, what, x.shape(), c.hidden);
  return x.reshape(Shape{x.numel() / c.hidden, c.hidden});
}
inline TensorView<float> rows_of(const MoeConfig& c, const char* who, const char* what, TensorView<float> x) {
  const TensorView<const float> r = rows_of(c, who, what, TensorView<const float>(x));
  return {x.data(), r.shape()};
}

inline void check_shard(const char* who, const MoeConfig& c, const MoeShard& w, int ranks, int rank) {
  const std::int64_t h = c.hidden, f = c.expert_ffn, fs = c.shared_width(), owned = owned_experts(c, ranks, rank).length;
  check(w.router.shape() == Shape{c.experts, h}, "{}: router is {}, expected [E, h] = [{}, {}]", who, w.router.shape(),
        c.experts, h);
  check(w.expert_in.shape() == Shape{owned, 2 * f, h} && w.expert_out.shape() == Shape{owned, f, h},
        "{}: rank {} of {} owns {} experts: expert_in must be [{}, {}, {}] and expert_out [{}, {}, {}]; got {} and {}",
        who, rank, ranks, owned, owned, 2 * f, h, owned, f, h, w.expert_in.shape(), w.expert_out.shape());
  check(w.shared_in.shape() == Shape{2 * fs, h} && w.shared_out.shape() == Shape{fs, h},
        "{}: shared_in {} and shared_out {} must be [{}, {}] and [{}, {}]", who, w.shared_in.shape(),
        w.shared_out.shape(), 2 * fs, h, fs, h);
  check(w.shared_gate.shape() == Shape{c.shared_gate ? 1 : 0, h}, "{}: shared_gate is {}, expected [{}, {}]", who,
        w.shared_gate.shape(), c.shared_gate ? 1 : 0, h);
}

// Sums `x` over the group, in place.
template <Communicator C, class T>
void sum_in_place(C& comm, std::span<T> x) {
  comm.all_reduce(std::span<const T>(x), x, ReduceOp::sum);
}

template <class Backend>
Tensor<float> copy_of(TensorView<const float> x) {
  Tensor<float> t(x.shape());
  Backend::copy(x, t.view());
  return t;
}

// The replicated weights' gradient scratch: router, shared in, shared out, shared gate, packed for one all-reduce.
struct ReplicatedGrads {
  PooledBuffer<float> buffer;
  TensorView<float> router, shared_in, shared_out, shared_gate;
};
template <class Backend>
ReplicatedGrads replicated_grads(const MoeShard& w, BufferPool& pool) {
  const std::int64_t sizes[] = {w.router.numel(), w.shared_in.numel(), w.shared_out.numel(), w.shared_gate.numel()};
  ReplicatedGrads g;
  g.buffer = pool.acquire<float>(Shape{sizes[0] + sizes[1] + sizes[2] + sizes[3]});
  Backend::fill(g.buffer.view(), 0.0f);
  float* at = g.buffer.data();
  g.router = {at, w.router.shape()};
  g.shared_in = {at += sizes[0], w.shared_in.shape()};
  g.shared_out = {at += sizes[1], w.shared_out.shape()};
  g.shared_gate = {at += sizes[2], w.shared_gate.shape()};
  return g;
}

// The sublayer around the experts. all_reduce(std::span<double>) and all_reduce(std::span<float>) sum over the
// group in place (nothing on one rank); experts(saved, xp, hp) runs the routed experts on this rank's permuted rows.
template <class Backend, class AllReduce, class Experts>
MoeSaved forward(std::string_view strategy, const MoeContext& ctx, const MoeShard& w, TensorView<const float> x_in,
                 TensorView<float> y_in, AllReduce&& all_reduce, Experts&& experts) {
  const MoeConfig& c = ctx.moe();
  const TensorView<const float> x = rows_of(c, "moe forward", "x", x_in);
  const TensorView<float> y = rows_of(c, "moe forward", "y", y_in);
  check(x.shape() == y.shape(), "moe forward: x {} and y {} differ in shape", x_in.shape(), y_in.shape());
  const std::int64_t n = x.extent(0), h = c.hidden;
  BufferPool& pool = *ctx.pool;
  MoeSaved s;
  s.strategy = strategy;
  s.x = copy_of<Backend>(x);
  s.routing = route<Backend>(c, w.router.view(), x, ctx.k);
  s.dispatch = dispatch_by_expert(s.routing.offsets, s.routing.expert, c.experts,
                                  expert_capacity(c.capacity_factor, s.routing.assignments(), c.experts));
  std::vector<double> stats = router_statistics<Backend>(s.routing);
  stats.push_back(double(s.dispatch.dropped));
  all_reduce(std::span<double>(stats));
  if (ctx.sum_statistics_over_replicas) ctx.sum_statistics_over_replicas(std::span<double>(stats));
  s.losses = router_losses<Backend>(c, std::span<const double>(stats).first(stats.size() - 1));
  s.dropped = std::int64_t(stats.back());

  const std::int64_t rows = s.dispatch.rows();
  Tensor<float> xp(Shape{rows, h});
  permute_tokens<Backend>(s.dispatch, x, xp.view());
  s.hp = Tensor<float>(Shape{rows, h});
  experts(s, std::move(xp), s.hp.view());
  xp = Tensor<float>();  // a transient: backward permutes x again where it needs these rows
  s.wp = Tensor<float>(Shape{rows});
  permuted_gates<Backend>(s.dispatch, s.routing.gates.view(), s.wp.view());
  Backend::fill(y, 0.0f);
  combine<Backend>(s.dispatch, s.hp.view(), s.wp.view(), y);

  if (c.has_shared()) {
    const std::int64_t fs = c.shared_width();
    const std::int64_t offsets[] = {0, n};
    s.shared_pre = Tensor<float>(Shape{n, 2 * fs});
    const ExpertBank<const float> bank{w.shared_in.view().reshape(Shape{1, 2 * fs, h}),
                                       w.shared_out.view().reshape(Shape{1, fs, h})};
    if (!c.shared_gate) {
      PooledBuffer<float> sy = pool.acquire<float>(Shape{n, h});
      experts_forward<Backend>(bank, offsets, x, s.shared_pre.view(), sy.view(), pool);
      Backend::add_into(y, sy);
    } else {
      s.shared_y = Tensor<float>(Shape{n, h});
      s.shared_sig = Tensor<float>(Shape{n});
      experts_forward<Backend>(bank, offsets, x, s.shared_pre.view(), s.shared_y.view(), pool);
      PooledBuffer<float> z = pool.acquire<float>(Shape{n, 1});
      if (n > 0) Backend::matmul(x, ops::Transpose::no, w.shared_gate.view(), ops::Transpose::yes, z.view());
      Backend::sigmoid_forward(z, s.shared_sig.view());
      Backend::scatter_add_rows(y, {}, s.shared_y.view(), s.shared_sig.view());
    }
  }
  return s;
}

// experts_backward(saved, dhp, dxp, grad) runs the routed experts' backward (dxp overwritten, grad accumulated).
template <class Backend, class AllReduce, class ExpertsBackward>
void backward(std::string_view strategy, const MoeContext& ctx, const MoeShard& w, MoeSaved& s,
              TensorView<const float> dy_in, TensorView<float> dx_in, MoeShard& grad, AllReduce&& all_reduce,
              ExpertsBackward&& run_experts_backward) {
  const MoeConfig& c = ctx.moe();
  check(s.strategy == strategy, "moe backward: {} was given what {} forward saved", strategy,
        s.strategy.empty() ? std::string_view("no") : s.strategy);
  const TensorView<const float> dy = rows_of(c, "moe backward", "dy", dy_in);
  const TensorView<float> dx = rows_of(c, "moe backward", "dx", dx_in);
  check(dy.shape() == s.x.shape() && dx.shape() == s.x.shape(), "moe backward: dy {} and dx {} must match x {}",
        dy.shape(), dx.shape(), s.x.shape());
  const std::int64_t n = s.x.extent(0), h = c.hidden, rows = s.dispatch.rows();
  BufferPool& pool = *ctx.pool;
  const TensorView<const float> x = s.x.view();
  Backend::fill(dx, 0.0f);
  PooledBuffer<float> dgates = pool.acquire<float>(Shape{s.routing.assignments()});
  Backend::fill(dgates.view(), 0.0f);
  {
    PooledBuffer<float> dhp = pool.acquire<float>(Shape{rows, h}), dxp = pool.acquire<float>(Shape{rows, h});
    {
      PooledBuffer<float> dwp = pool.acquire<float>(Shape{rows});
      combine_backward<Backend>(s.dispatch, s.hp.view(), s.wp.view(), dy, dhp.view(), dwp.view(), dgates.view());
    }
    run_experts_backward(s, TensorView<const float>(dhp.view()), dxp.view(), grad);
    unpermute_add<Backend>(s.dispatch, dxp, dx);
  }
  ReplicatedGrads g = replicated_grads<Backend>(w, pool);
  route_backward<Backend>(c, w.router.view(), x, s.routing, s.losses, dgates, dx, g.router, pool);

  if (c.has_shared()) {
    const std::int64_t fs = c.shared_width();
    const std::int64_t offsets[] = {0, n};
    const ExpertBank<const float> bank{w.shared_in.view().reshape(Shape{1, 2 * fs, h}),
                                       w.shared_out.view().reshape(Shape{1, fs, h})};
    const ExpertBank<float> gbank{g.shared_in.reshape(Shape{1, 2 * fs, h}), g.shared_out.reshape(Shape{1, fs, h})};
    PooledBuffer<float> dxs = pool.acquire<float>(Shape{n, h});
    if (!c.shared_gate) {
      experts_backward<Backend>(bank, offsets, x, s.shared_pre.view(), dy, dxs.view(), gbank, pool);
    } else {
      PooledBuffer<float> ds = pool.acquire<float>(Shape{n, h});
      PooledBuffer<float> dsig = pool.acquire<float>(Shape{n}), dz = pool.acquire<float>(Shape{n, 1});
      Backend::gather_rows(dy, {}, s.shared_sig.view(), ds.view());
      Backend::gathered_row_dot(dy, {}, s.shared_y.view(), dsig.view());
      Backend::fill(dz.view(), 0.0f);
      Backend::sigmoid_backward(s.shared_sig.view(), dsig, dz.view());
      if (n > 0) {
        Backend::matmul(dz, ops::Transpose::no, w.shared_gate.view(), ops::Transpose::no, dx, 1.0f, 1.0f);
        Backend::matmul(dz, ops::Transpose::yes, x, ops::Transpose::no, g.shared_gate, 1.0f, 1.0f);
      }
      experts_backward<Backend>(bank, offsets, x, s.shared_pre.view(), ds, dxs.view(), gbank, pool);
    }
    Backend::add_into(dx, dxs);
  }
  all_reduce(g.buffer.span());
  Backend::add_into(grad.router.view(), g.router);
  Backend::add_into(grad.shared_in.view(), g.shared_in);
  Backend::add_into(grad.shared_out.view(), g.shared_out);
  Backend::add_into(grad.shared_gate.view(), g.shared_gate);
}

// The routed experts of the whole bank on this rank's own rows (one rank): xp is kept for backward.
template <class Backend>
void local_experts_forward(MoeSaved& s, const ExpertBank<const float>& bank, TensorView<const float> xp,
                           TensorView<float> hp, BufferPool& pool) {
  s.expert_pre = Tensor<float>(Shape{xp.extent(0), 2 * bank.ffn()});
  s.expert_offsets = s.dispatch.offsets;
  experts_forward<Backend>(bank, s.expert_offsets, xp, s.expert_pre.view(), hp, pool);
}

// This rank's rows in dispatch order again (backward), instead of keeping them from forward: [rows, h].
template <class Backend>
PooledBuffer<float> permuted_again(const MoeSaved& s, BufferPool& pool) {
  PooledBuffer<float> xp = pool.acquire<float>(Shape{s.dispatch.rows(), s.x.extent(1)});
  permute_tokens<Backend>(s.dispatch, s.x.view(), xp.view());
  return xp;
}

}  // namespace moe_detail

// ---- one rank: `w` holds every expert (MoeShard::zeros(c, 1, 0)) ----

template <class Backend = ops::Cpu>
MoeSaved moe_forward(const MoeContext& ctx, const MoeShard& w, TensorView<const float> x, TensorView<float> y) {
  moe_detail::check_shard("moe_forward", ctx.moe(), w, 1, 0);
  return moe_detail::forward<Backend>(
      "single rank", ctx, w, x, y, [](auto) {},
      [&](MoeSaved& s, Tensor<float>&& xp, TensorView<float> hp) {
        moe_detail::local_experts_forward<Backend>(s, {w.expert_in.view(), w.expert_out.view()}, xp.view(), hp,
                                                   *ctx.pool);
      });
}

// y's gradient dy -> dx (overwritten); grad ACCUMULATES the gradient of every weight.
template <class Backend = ops::Cpu>
void moe_backward(const MoeContext& ctx, const MoeShard& w, MoeSaved& s, TensorView<const float> dy,
                  TensorView<float> dx, MoeShard& grad) {
  moe_detail::check_shard("moe_backward", ctx.moe(), grad, 1, 0);
  moe_detail::backward<Backend>(
      "single rank", ctx, w, s, dy, dx, grad, [](auto) {},
      [&](MoeSaved& saved, TensorView<const float> dhp, TensorView<float> dxp, MoeShard& g) {
        const PooledBuffer<float> xp = moe_detail::permuted_again<Backend>(saved, *ctx.pool);
        experts_backward<Backend>({w.expert_in.view(), w.expert_out.view()}, saved.expert_offsets, xp,
                                  saved.expert_pre.view(), dhp, dxp, {g.expert_in.view(), g.expert_out.view()},
                                  *ctx.pool);
      });
}

// ---- ExpertParallel: tokens travel to their experts' owners ----

template <class Backend = ops::Cpu>
struct ExpertParallel {
  static constexpr std::string_view name = "ExpertParallel";

  template <Communicator C>
  MoeSaved forward(C& comm, const MoeContext& ctx, const MoeShard& w, TensorView<const float> x,
                   TensorView<float> y) const {
    const MoeConfig& c = ctx.moe();
    const int p = comm.size(), r = comm.rank();
    moe_detail::check_shard("ExpertParallel forward", c, w, p, r);
    return moe_detail::forward<Backend>(
        name, ctx, w, x, y, [&](auto span) { moe_detail::sum_in_place(comm, span); },
        [&](MoeSaved& s, Tensor<float>&& xp, TensorView<float> hp) {
          const std::int64_t h = c.hidden;
          BufferPool& pool = *ctx.pool;
          const ChunkRange mine = owned_experts(c, p, r);
          // Per-expert row counts: each rank sends the counts of q's experts to q.
          std::vector<std::int64_t> counts_out(static_cast<std::size_t>(p)), counts_in(static_cast<std::size_t>(p), mine.length);
          std::vector<std::int64_t> block(static_cast<std::size_t>(c.experts));
          s.send_rows.assign(std::size_t(p), 0);
          for (int q = 0; q < p; ++q) {
            const ChunkRange theirs = owned_experts(c, p, q);
            counts_out[std::size_t(q)] = theirs.length;
            for (std::int64_t e = theirs.start; e < theirs.end(); ++e) {
              block[std::size_t(e)] = s.dispatch.count(e);
              s.send_rows[std::size_t(q)] += s.dispatch.count(e);
            }
          }
          // [source][local expert]. Pre-filled with this rank's own counts: a real exchange overwrites them, and a
          // communicator that moves nothing (the dry run's) leaves the assumption that every rank routes like this one.
          std::vector<std::int64_t> received(static_cast<std::size_t>(p * mine.length));
          for (int q = 0; q < p; ++q)
            for (std::int64_t e = 0; e < mine.length; ++e)
              received[std::size_t(q * mine.length + e)] = s.dispatch.count(mine.start + e);
          comm.all_to_all_v(std::span<const std::int64_t>(block), counts_out, std::span<std::int64_t>(received),
                            counts_in);
          // Received rows are source-major; the experts want them expert-major.
          s.recv_rows.assign(std::size_t(p), 0);
          std::vector<std::int64_t> source_start(static_cast<std::size_t>(p + 1), 0);
          for (int q = 0; q < p; ++q) {
            for (std::int64_t e = 0; e < mine.length; ++e)
              s.recv_rows[std::size_t(q)] += received[std::size_t(q * mine.length + e)];
            source_start[std::size_t(q + 1)] = source_start[std::size_t(q)] + s.recv_rows[std::size_t(q)];
          }
          const std::int64_t total = source_start.back();
          s.expert_offsets.assign(std::size_t(mine.length + 1), 0);
          s.perm.clear();
          s.perm.reserve(std::size_t(total));
          for (std::int64_t e = 0; e < mine.length; ++e) {
            for (int q = 0; q < p; ++q) {
              std::int64_t at = source_start[std::size_t(q)];
              for (std::int64_t before = 0; before < e; ++before) at += received[std::size_t(q * mine.length + before)];
              for (std::int64_t j = 0; j < received[std::size_t(q * mine.length + e)]; ++j) s.perm.push_back(at + j);
            }
            s.expert_offsets[std::size_t(e + 1)] = std::int64_t(s.perm.size());
          }
          s.inverse.assign(std::size_t(total), 0);
          for (std::int64_t i = 0; i < total; ++i) s.inverse[std::size_t(s.perm[std::size_t(i)])] = i;

          {
            PooledBuffer<float> arrived = pool.acquire<float>(Shape{total, h});
            exchange(comm, xp.view(), s.send_rows, arrived.view(), s.recv_rows, h);
            xp = Tensor<float>();  // the local rows are not needed any more
            s.expert_x = Tensor<float>(Shape{total, h});
            Backend::gather_rows(arrived, s.perm, {}, s.expert_x.view());
          }
          s.expert_pre = Tensor<float>(Shape{total, 2 * c.expert_ffn});
          PooledBuffer<float> out = pool.acquire<float>(Shape{total, h}), back = pool.acquire<float>(Shape{total, h});
          experts_forward<Backend>({w.expert_in.view(), w.expert_out.view()}, s.expert_offsets, s.expert_x.view(),
                                   s.expert_pre.view(), out.view(), pool);
          Backend::gather_rows(out, s.inverse, {}, back.view());
          exchange(comm, back.view(), s.recv_rows, hp, s.send_rows, h);
        });
  }

  template <Communicator C>
  void backward(C& comm, const MoeContext& ctx, const MoeShard& w, MoeSaved& s, TensorView<const float> dy,
                TensorView<float> dx, MoeShard& grad) const {
    const MoeConfig& c = ctx.moe();
    moe_detail::check_shard("ExpertParallel backward", c, grad, comm.size(), comm.rank());
    moe_detail::backward<Backend>(
        name, ctx, w, s, dy, dx, grad, [&](auto span) { moe_detail::sum_in_place(comm, span); },
        [&](MoeSaved& saved, TensorView<const float> dhp, TensorView<float> dxp, MoeShard& g) {
          const std::int64_t h = c.hidden, total = saved.expert_x.extent(0);
          BufferPool& pool = *ctx.pool;
          PooledBuffer<float> arrived = pool.acquire<float>(Shape{total, h}), dout = pool.acquire<float>(Shape{total, h});
          exchange(comm, dhp, saved.send_rows, arrived.view(), saved.recv_rows, h);
          Backend::gather_rows(arrived, saved.perm, {}, dout.view());
          PooledBuffer<float> din = pool.acquire<float>(Shape{total, h});
          experts_backward<Backend>({w.expert_in.view(), w.expert_out.view()}, saved.expert_offsets,
                                    saved.expert_x.view(), saved.expert_pre.view(), dout, din.view(),
                                    {g.expert_in.view(), g.expert_out.view()}, pool);
          Backend::gather_rows(din, saved.inverse, {}, arrived.view());
          exchange(comm, arrived, saved.recv_rows, dxp, saved.send_rows, h);
        });
  }

private:
  // all_to_all_v of row blocks: send_rows[q] rows of `from` to rank q, recv_rows[q] rows from rank q into `to`.
  template <Communicator C>
  static void exchange(C& comm, TensorView<const float> from, std::span<const std::int64_t> send_rows,
                       TensorView<float> to, std::span<const std::int64_t> recv_rows, std::int64_t h) {
    std::vector<std::int64_t> send(send_rows.begin(), send_rows.end()), recv(recv_rows.begin(), recv_rows.end());
    for (auto& v : send) v *= h;
    for (auto& v : recv) v *= h;
    comm.all_to_all_v(std::span<const float>(from.data(), std::size_t(from.numel())), send,
                      std::span<float>(to.data(), std::size_t(to.numel())), recv);
  }
};

// ---- ExpertTensorParallel (ZeRO-style): expert weights travel to the tokens ----

template <class Backend = ops::Cpu>
struct ExpertTensorParallel {
  static constexpr std::string_view name = "ExpertTensorParallel";

  template <Communicator C>
  MoeSaved forward(C& comm, const MoeContext& ctx, const MoeShard& w, TensorView<const float> x,
                   TensorView<float> y) const {
    const MoeConfig& c = ctx.moe();
    moe_detail::check_shard("ExpertTensorParallel forward", c, w, comm.size(), comm.rank());
    return moe_detail::forward<Backend>(
        name, ctx, w, x, y, [&](auto span) { moe_detail::sum_in_place(comm, span); },
        [&](MoeSaved& s, Tensor<float>&& xp, TensorView<float> hp) {
          s.expert_pre = Tensor<float>(Shape{xp.extent(0), 2 * c.expert_ffn});
          s.expert_offsets = s.dispatch.offsets;
          for_each_owner(comm, c, w, *ctx.pool, [&](int, ChunkRange experts, const ExpertBank<const float>& bank) {
            const Block b = block_of(s.expert_offsets, experts);
            experts_forward<Backend>(bank, b.offsets, TensorView<const float>(xp.view()).slice(0, b.first, b.rows),
                                     s.expert_pre.view().slice(0, b.first, b.rows), hp.slice(0, b.first, b.rows),
                                     *ctx.pool);
          });
        });
  }

  template <Communicator C>
  void backward(C& comm, const MoeContext& ctx, const MoeShard& w, MoeSaved& s, TensorView<const float> dy,
                TensorView<float> dx, MoeShard& grad) const {
    const MoeConfig& c = ctx.moe();
    moe_detail::check_shard("ExpertTensorParallel backward", c, grad, comm.size(), comm.rank());
    moe_detail::backward<Backend>(
        name, ctx, w, s, dy, dx, grad, [&](auto span) { moe_detail::sum_in_place(comm, span); },
        [&](MoeSaved& saved, TensorView<const float> dhp, TensorView<float> dxp, MoeShard& g) {
          BufferPool& pool = *ctx.pool;
          const std::int64_t h = c.hidden, f = c.expert_ffn;
          const PooledBuffer<float> xp = moe_detail::permuted_again<Backend>(saved, pool);
          for_each_owner(comm, c, w, pool, [&](int owner, ChunkRange experts, const ExpertBank<const float>& bank) {
            const Block b = block_of(saved.expert_offsets, experts);
            // This rank's part of the owner's experts' gradient, summed onto the owner.
            PooledBuffer<float> part = pool.acquire<float>(Shape{experts.length * 3 * f * h});
            Backend::fill(part.view(), 0.0f);
            const ExpertBank<float> gbank{{part.data(), Shape{experts.length, 2 * f, h}},
                                          {part.data() + experts.length * 2 * f * h, Shape{experts.length, f, h}}};
            experts_backward<Backend>(bank, b.offsets, TensorView<const float>(xp.view()).slice(0, b.first, b.rows),
                                      saved.expert_pre.view().slice(0, b.first, b.rows), dhp.slice(0, b.first, b.rows),
                                      dxp.slice(0, b.first, b.rows), gbank, pool);
            const bool mine = owner == comm.rank();
            PooledBuffer<float> sum = pool.acquire<float>(Shape{mine ? part.numel() : 0});
            comm.reduce(std::span<const float>(part.span()), sum.span(), ReduceOp::sum, owner);
            if (mine) {
              Backend::add_into(g.expert_in.span(), std::span<const float>(sum.span()).first(std::size_t(g.expert_in.numel())));
              Backend::add_into(g.expert_out.span(), std::span<const float>(sum.span()).subspan(std::size_t(g.expert_in.numel())));
            }
          });
        });
  }

private:
  // The permuted rows of experts [first, first + count): block offsets relative to their first row.
  struct Block {
    std::int64_t first = 0, rows = 0;
    std::vector<std::int64_t> offsets;
  };
  static Block block_of(const std::vector<std::int64_t>& offsets, ChunkRange experts) {
    Block b;
    b.first = offsets[std::size_t(experts.start)];
    b.rows = offsets[std::size_t(experts.end())] - b.first;
    for (std::int64_t e = experts.start; e <= experts.end(); ++e) b.offsets.push_back(offsets[std::size_t(e)] - b.first);
    return b;
  }

  // Calls body(owner, its experts, their weights) for every rank that owns experts, in rank order, each owner's
  // experts broadcast from it; the next owner's experts travel while body runs on the current ones. So a rank holds
  // at most two owners' experts at a time, never all E (ZeRO-3's prefetch of the next layer, per owner).
  template <Communicator C, class Body>
  static void for_each_owner(C& comm, const MoeConfig& c, const MoeShard& w, BufferPool& pool, Body&& body) {
    const int p = comm.size();
    const std::int64_t per_expert = 3 * c.expert_ffn * c.hidden, in_size = 2 * c.expert_ffn * c.hidden;
    std::vector<int> owners;
    std::int64_t most = 0;
    for (int q = 0; q < p; ++q) {
      const std::int64_t count = owned_experts(c, p, q).length;
      if (count > 0) owners.push_back(q);
      most = std::max(most, count);
    }
    OwnerBroadcast broadcast(
        comm,
        {pool.acquire<float>(Shape{most * per_expert}),
         pool.acquire<float>(Shape{owners.size() > 1 ? most * per_expert : 0})},
        owners, [&](int q) { return owned_experts(c, p, q).length * per_expert; },
        [&](std::span<float> weights) {  // the owner sends its own experts: [in of every expert | out of every expert]
          const std::size_t ins = std::size_t(owned_experts(c, p, comm.rank()).length * in_size);
          Backend::copy(w.expert_in.span(), weights.first(ins));
          Backend::copy(w.expert_out.span(), weights.subspan(ins));
        });
    for (const int owner : owners) {
      const float* at = broadcast.next().data();
      const ChunkRange experts = owned_experts(c, p, owner);
      const ExpertBank<const float> bank{{at, Shape{experts.length, 2 * c.expert_ffn, c.hidden}},
                                         {at + experts.length * in_size, Shape{experts.length, c.expert_ffn, c.hidden}}};
      body(owner, experts, bank);
    }
  }
};

}  // namespace paradyse
