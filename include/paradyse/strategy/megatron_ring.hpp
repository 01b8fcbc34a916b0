// paradyse/strategy/megatron_ring.hpp: MegatronRing, Megatron-LM's context x tensor parallelism (cp x tp) inside one
// group of p = cp * tp ranks, over the unified layout of all p ranks.
//
// The group is factorised as ctx.tp_inner = tp (tp innermost): rank r = c * tp + t is tp rank t of tp sub-group c
// (ranks c tp .. c tp + tp - 1) and cp rank c of cp sub-group t (ranks t, t + tp, ...). Tensor rank t computes the
// heads and ffn columns of the unified shards of its cp sub-group (shards t, t + tp, ...: cp head groups, cp ffn
// column blocks); it all-gathers those weights over the cp sub-group (as MegatronCZ does over the whole group) and
// sums their gradients back to the owners with a reduce-scatter over it, so the weights stay the unified shards.
// Activations move as in Megatron's sequence parallelism, over the tp sub-group: the all-gather of its ranks'
// tokens is the cp rank's share of the sequence, one run of positions (two under zigzag: the tp ranks' first
// chunks, then their second ones; SequenceLayout::grouped), for any length s, so ring attention runs over the cp
// sub-group on that grouped layout.
// Attention: q|k|v of the rank's heads for those tokens (RoPE at their global positions), ring attention over the
// cp sub-group (strategy/ring_attention.hpp: K/V blocks travel, causal blocks skipped, zigzag balanced), the output
// projection's partial sums reduce-scattered over the tp sub-group. MLP: the rank's ffn columns of the gathered
// tokens, reduce-scattered likewise. Backward mirrors both (dy all-gathered over tp, ring attention backward over cp,
// the input gradient's partial sums reduce-scattered over tp, the weight gradients reduce-scattered over cp).
//
// Per rank and sublayer (n_c = the tp sub-group's tokens, about s / cp). Communication: activations as Megatron-SP
// on the tp sub-group (an all-gather and a reduce-scatter of b n_c h forward, 2 + 1 backward); K/V of the rank's
// heads around the cp ring (2 b (s - n_c) hkv/tp d forward, twice that backward); weights: the cp sub-group's
// shards all-gathered (about (cp - 1)/p of the layer's weights per sublayer, twice backward with the gradients'
// reduce-scatter). Saved: the gathered input [b, n_c, h], the rank's q|k|v heads [b, n_c, hq/tp + 2 hkv/tp, d],
// out and lse (attention); the gathered input and the pre-activation [cp, b n_c, ffn_in_rows] (MLP). Requirements:
// those of the unified layout and a factorisation tp_inner dividing p (0 refuses: the planner then never picks it).
// Its two sub-groups are the group's outer x inner grid with inner = tp (comm/grid_groups.hpp), taken from
// ctx.tp_inner_groups (split once per group; the layer stack keeps them), or split for the call when it has none.
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/comm/grid_groups.hpp"
#include "paradyse/contract/weight_shards.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/ops/backend.hpp"
#include "paradyse/strategy/mlp_activation.hpp"
#include "paradyse/strategy/policy.hpp"
#include "paradyse/strategy/ring_attention.hpp"
#include "paradyse/strategy/ring_heads.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace paradyse {

namespace megatron_ring_detail {

// One run of consecutive tokens of a tp sub-group member, in rows of one token: where it sits in the member-major
// buffer of an all_gather_v ([t][b][n_t]) and in the cp rank's own order ([b][n_c]).
struct TokenRun {
  std::int64_t member_row = 0, cp_row = 0, rows = 0;
};

// Rank r = c * tp + t of a group of p = cp * tp ranks, and where the tp sub-group's tokens go.
struct Factors {
  int cp = 1, tp = 1, c = 0, t = 0;
  SequenceLayout cp_layout;          // the sequence over the cp sub-group's ranks
  std::vector<std::int64_t> counts;  // tokens of each tp member (times b: rows of an all_gather_v)
  std::vector<TokenRun> runs;        // every token of the tp sub-group, once
  std::int64_t cp_tokens = 0;        // n_c

  // Empty when the factorisation fits the call, else why not.
  std::string why_not;

  Factors(const SublayerContext& ctx, int rank) {
    const int p = ctx.ranks();
    tp = ctx.tp_inner;
    if (tp < 1 || p % tp != 0) {
      why_not = tp == 0 ? "the group has no cp x tp factorisation (tp_inner = 0)"
                        : fmt::format("tp_inner = {} must divide the group size p = {}", tp, p);
      return;
    }
    cp = p / tp;
    c = rank / tp;
    t = rank % tp;
    const SequenceLayout& layout = ctx.sequence;
    cp_layout = SequenceLayout::grouped(layout, tp);
    cp_tokens = cp_layout.local_length(c);
    std::vector<TokenSegment> homes;  // cp rank c's segments
    for (int k = 0; k < cp_layout.segment_count(); ++k) homes.push_back(cp_layout.segment(c, k));
    const std::int64_t b = ctx.batch;
    std::int64_t member_base = 0, tokens = 0;
    for (int u = 0; u < tp; ++u) {
      const int member = c * tp + u;
      const std::int64_t n = layout.local_length(member);
      counts.push_back(b * n);
      tokens += n;
      for (int i = 0; i < layout.segment_count(); ++i) {
        const TokenSegment seg = layout.segment(member, i);
        if (seg.length == 0) continue;
        const TokenSegment* home = nullptr;
        for (const TokenSegment& cand : homes)
          if (seg.begin >= cand.begin && seg.begin + seg.length <= cand.begin + cand.length) home = &cand;
        check(home != nullptr, "MegatronRing: rank {}'s tokens [{}, {}) are not within cp rank {}'s share", member,
              seg.begin, seg.begin + seg.length, c);
        for (std::int64_t i_b = 0; i_b < b; ++i_b)
          runs.push_back({member_base + i_b * n + seg.local, i_b * cp_tokens + home->local + seg.begin - home->begin,
                          seg.length});
      }
      member_base += b * n;
    }
    check(tokens == cp_tokens, "MegatronRing: the tp sub-group {} holds {} tokens, cp rank {}'s share is {}", c, tokens,
          c, cp_tokens);
  }

};

// cp_order: [b n_c, width] <- members: [tp][b, n_t, width] (the tp sub-group's tokens, member-major), and back.
template <class Backend>
void members_to_cp_order(const Factors& f, TensorView<const float> members, TensorView<float> cp_order) {
  for (const TokenRun& run : f.runs)
    Backend::copy(members.slice(0, run.member_row, run.rows), cp_order.slice(0, run.cp_row, run.rows));
}
template <class Backend>
void cp_order_to_members(const Factors& f, TensorView<const float> cp_order, TensorView<float> members) {
  for (const TokenRun& run : f.runs)
    Backend::copy(cp_order.slice(0, run.cp_row, run.rows), members.slice(0, run.member_row, run.rows));
}

// cp_order: [b n_c, width] (overwritten) <- the tp sub-group's tokens of x: [b, n_r, width] (all_gather_v).
template <class Backend, Communicator C>
void gather_tokens(C& tp, const Factors& f, BufferPool& pool, TensorView<const float> x, TensorView<float> cp_order) {
  const std::int64_t width = x.extent(2);
  std::vector<std::int64_t> counts;
  std::int64_t total = 0;
  for (std::int64_t n : f.counts) counts.push_back(n * width), total += n;
  PooledBuffer<float> members = pool.acquire<float>(Shape{total, width});
  tp.all_gather_v(x.span(), members.span(), counts);
  members_to_cp_order<Backend>(f, members.view(), cp_order);
}

// y: [b, n_r, width] (overwritten) <- the sum over the tp sub-group of partial: [b n_c, width] (reduce_scatter_v).
template <class Backend, Communicator C>
void scatter_tokens(C& tp, const Factors& f, BufferPool& pool, TensorView<const float> partial, TensorView<float> y) {
  const std::int64_t width = partial.extent(1);
  std::vector<std::int64_t> counts;
  std::int64_t total = 0;
  for (std::int64_t n : f.counts) counts.push_back(n * width), total += n;
  PooledBuffer<float> members = pool.acquire<float>(Shape{total, width});
  cp_order_to_members<Backend>(f, partial, members.view());
  tp.reduce_scatter_v(read_span(members), y.span(), counts, ReduceOp::sum);
}

}  // namespace megatron_ring_detail

template <class Backend = ops::Cpu>
struct MegatronRing : LayoutPolicy<Backend> {
  static constexpr std::string_view name = "MegatronRing";
  // Between calls its tensors are in the unified layout over all p ranks (policy.hpp).
  using unified_layout = SequenceShardedLayout;

  struct AttentionSaved {
    Tensor<float> x;      // [b n_c, h]: the tp sub-group's tokens, in the cp rank's order
    Tensor<float> heads;  // [b, n_c, hq/tp + 2 hkv/tp, d]: q, k, v of the rank's cp head groups (RoPE applied)
    Tensor<float> out;    // [b, n_c, hq/tp, d]
    Tensor<float> lse;    // [b, hq/tp, n_c]
  };
  struct MlpSaved {
    Tensor<float> x;    // [b n_c, h]
    Tensor<float> pre;  // [cp, b n_c, ffn_in_rows]: pre-activation of each of the rank's cp ffn column blocks
  };

  Support supports(const SublayerContext& ctx) const {
    if (Support common = common_support(name, ctx); !common) return common;
    for (int rank = 0; rank < ctx.ranks(); rank += std::max(ctx.tp_inner, 1)) {  // one rank per tp sub-group
      const megatron_ring_detail::Factors f(ctx, rank);
      if (!f.why_not.empty()) return {fmt::format("{}: {}", name, f.why_not)};
    }
    return {};
  }
  // Layouts over the whole group: the rank's tokens come from its tp sub-group (a Replicate over it) and leave as
  // partial sums over it; in one-axis terms they are the unified layout before and after.
  ComputeLayouts attention_layouts(const SublayerContext& ctx) const {
    return {ctx.unified(ctx.hidden()), ctx.unified(ctx.hidden())};
  }
  ComputeLayouts mlp_layouts(const SublayerContext& ctx) const { return attention_layouts(ctx); }

  template <Communicator C>
  AttentionSaved attention_forward(C& comm, const SublayerContext& ctx, const AttentionShard& w,
                                   TensorView<const float> x, TensorView<float> y) const {
    const Call<C> call(comm, ctx, "MegatronRing attention", x, y);
    const megatron_ring_detail::Factors& f = call.f;
    const ShardGeometry& g = ctx.geometry;
    const auto [b, n, m, h] = call.sizes;
    const std::int64_t R = g.qkv_rows, W = g.proj_rows;
    const QkvPacking packing = QkvPacking::of(g, f.cp);
    AttentionSaved saved{Tensor<float>(Shape{m, h}), Tensor<float>(Shape{b, n, packing.heads(), g.head_dim}),
                         Tensor<float>(), Tensor<float>()};
    core_tensors(ctx, f, saved);
    megatron_ring_detail::gather_tokens<Backend>(call.tp, f, *ctx.pool, x, saved.x.view());
    PooledBuffer<float> weights = gather_weights(call.cp, ctx, w.packed.view(), f.cp);  // [cp, R + W, h]
    {
      PooledBuffer<float> packed = ctx.pool->acquire<float>(Shape{m, f.cp * R});
      for (int j = 0; j < f.cp; ++j)
        Backend::matmul(saved.x.view(), ops::Transpose::no, qkv_of(weights, j, g), ops::Transpose::yes,
                        packed.view().slice(1, j * R, R));
      unpack_heads<Backend>(packing, positions(ctx, f), TensorView<const float>(packed.view()).reshape(Shape{b, n, f.cp * R}),
                            saved.heads.view());
    }
    ring_core(call.cp, ctx, f, saved);
    const TensorView<const float> a = TensorView<const float>(saved.out.view()).reshape(Shape{m, f.cp * W});
    PooledBuffer<float> partial = ctx.pool->acquire<float>(Shape{m, h});
    for (int j = 0; j < f.cp; ++j)
      Backend::matmul(a.slice(1, j * W, W), ops::Transpose::no, proj_of(weights, j, g), ops::Transpose::no,
                      partial.view(), 1.0f, j == 0 ? 0.0f : 1.0f);
    megatron_ring_detail::scatter_tokens<Backend>(call.tp, f, *ctx.pool, TensorView<const float>(partial.view()), y);
    return saved;
  }

  // Selective recomputation (strategy/policy.hpp): the core's output and lse dropped after forward, re-run (ring
  // attention over the cp sub-group) from the kept heads before backward.
  static void drop_attention_core(AttentionSaved& saved) {
    saved.out = Tensor<float>();
    saved.lse = Tensor<float>();
  }
  template <Communicator C>
  void recompute_attention_core(C& comm, const SublayerContext& ctx, const AttentionShard&, AttentionSaved& saved) const {
    const Call<C> call(comm, ctx);
    core_tensors(ctx, call.f, saved);
    ring_core(call.cp, ctx, call.f, saved);
  }

  template <Communicator C>
  void attention_backward(C& comm, const SublayerContext& ctx, const AttentionShard& w, AttentionSaved& saved,
                          TensorView<const float> dy, TensorView<float> dx, AttentionShard& grad) const {
    const Call<C> call(comm, ctx, "MegatronRing attention backward", dy, dx);
    const megatron_ring_detail::Factors& f = call.f;
    const ShardGeometry& g = ctx.geometry;
    const auto [b, n, m, h] = call.sizes;
    const std::int64_t R = g.qkv_rows, W = g.proj_rows;
    const QkvPacking packing = QkvPacking::of(g, f.cp);
    PooledBuffer<float> weights = gather_weights(call.cp, ctx, w.packed.view(), f.cp);   // [cp, R + W, h]
    PooledBuffer<float> dweights = ctx.pool->acquire<float>(weights.shape());           // their gradients
    Backend::fill(dweights.view(), 0.0f);
    PooledBuffer<float> dpacked = ctx.pool->acquire<float>(Shape{m, f.cp * R});
    {
      PooledBuffer<float> dheads = ctx.pool->acquire<float>(saved.heads.shape());
      Backend::fill(dheads.view(), 0.0f);
      {
        PooledBuffer<float> dy_cp = ctx.pool->acquire<float>(Shape{m, h});
        megatron_ring_detail::gather_tokens<Backend>(call.tp, f, *ctx.pool, dy, dy_cp.view());
        PooledBuffer<float> dout = ctx.pool->acquire<float>(saved.out.shape());
        const TensorView<const float> a = TensorView<const float>(saved.out.view()).reshape(Shape{m, f.cp * W});
        const TensorView<float> da = dout.view().reshape(Shape{m, f.cp * W});
        for (int j = 0; j < f.cp; ++j) {
          Backend::matmul(dy_cp.view(), ops::Transpose::no, proj_of(weights, j, g), ops::Transpose::yes,
                          da.slice(1, j * W, W));
          Backend::matmul(a.slice(1, j * W, W), ops::Transpose::yes, dy_cp.view(), ops::Transpose::no,
                          proj_of(dweights, j, g), 1.0f, 1.0f);
        }
        const HeadViews<const float> qkv = head_views(TensorView<const float>(saved.heads.view()), packing);
        const HeadViews<float> dqkv = head_views(dheads.view(), packing);
        ring_attention_backward<Backend>(call.cp, ring_spec(ctx, f), *ctx.pool, qkv.q, qkv.k, qkv.v,
                                         saved.out.view(), saved.lse.view(), dout.view(), dqkv.q, dqkv.k, dqkv.v);
      }
      pack_head_gradients<Backend>(packing, positions(ctx, f), dheads.view(), dpacked.view().reshape(Shape{b, n, f.cp * R}));
    }
    {
      PooledBuffer<float> dx_cp = ctx.pool->acquire<float>(Shape{m, h});
      for (int j = 0; j < f.cp; ++j) {
        const TensorView<const float> dcolumns = TensorView<const float>(dpacked.view()).slice(1, j * R, R);
        Backend::matmul(dcolumns, ops::Transpose::yes, saved.x.view(), ops::Transpose::no, qkv_of(dweights, j, g), 1.0f,
                        1.0f);
        Backend::matmul(dcolumns, ops::Transpose::no, qkv_of(weights, j, g), ops::Transpose::no, dx_cp.view(), 1.0f,
                        j == 0 ? 0.0f : 1.0f);
      }
      megatron_ring_detail::scatter_tokens<Backend>(call.tp, f, *ctx.pool, TensorView<const float>(dx_cp.view()), dx);
    }
    PooledBuffer<float> mine = ctx.pool->acquire<float>(Shape{g.attention_rows(), h});
    call.cp.reduce_scatter(read_span(dweights), mine.span(), ReduceOp::sum);
    QkvGradient<Backend> qkv_grad(ctx, grad.qkv());
    Backend::add_into(qkv_grad.target(), TensorView<const float>(mine.view()).slice(0, 0, R));
    Backend::add_into(grad.proj(), TensorView<const float>(mine.view()).slice(0, R, W));
    qkv_grad.finish(comm);
  }

  template <Communicator C>
  MlpSaved mlp_forward(C& comm, const SublayerContext& ctx, const MlpShard& w, TensorView<const float> x,
                       TensorView<float> y) const {
    const Call<C> call(comm, ctx, "MegatronRing mlp", x, y);
    const megatron_ring_detail::Factors& f = call.f;
    const ShardGeometry& g = ctx.geometry;
    const std::int64_t m = call.sizes.m, h = call.sizes.h;
    MlpSaved saved{Tensor<float>(Shape{m, h}), Tensor<float>(Shape{f.cp, m, g.ffn_in_rows})};
    megatron_ring_detail::gather_tokens<Backend>(call.tp, f, *ctx.pool, x, saved.x.view());
    PooledBuffer<float> weights = gather_weights(call.cp, ctx, w.packed.view(), f.cp);  // [cp, in + out rows, h]
    PooledBuffer<float> act = ctx.pool->acquire<float>(Shape{m, g.ffn});
    PooledBuffer<float> partial = ctx.pool->acquire<float>(Shape{m, h});
    for (int j = 0; j < f.cp; ++j) {
      const TensorView<float> pre = pre_of(saved, j);
      Backend::matmul(saved.x.view(), ops::Transpose::no, in_of(weights, j, g), ops::Transpose::yes, pre);
      shard_activation_forward<Backend>(g, pre, act.view());
      Backend::matmul(act.view(), ops::Transpose::no, out_of(weights, j, g), ops::Transpose::no, partial.view(), 1.0f,
                      j == 0 ? 0.0f : 1.0f);
    }
    megatron_ring_detail::scatter_tokens<Backend>(call.tp, f, *ctx.pool, TensorView<const float>(partial.view()), y);
    return saved;
  }

  template <Communicator C>
  void mlp_backward(C& comm, const SublayerContext& ctx, const MlpShard& w, MlpSaved& saved,
                    TensorView<const float> dy, TensorView<float> dx, MlpShard& grad) const {
    const Call<C> call(comm, ctx, "MegatronRing mlp backward", dy, dx);
    const megatron_ring_detail::Factors& f = call.f;
    const ShardGeometry& g = ctx.geometry;
    const std::int64_t m = call.sizes.m, h = call.sizes.h;
    PooledBuffer<float> weights = gather_weights(call.cp, ctx, w.packed.view(), f.cp);  // [cp, in + out rows, h]
    PooledBuffer<float> dweights = ctx.pool->acquire<float>(weights.shape());
    Backend::fill(dweights.view(), 0.0f);
    {
      PooledBuffer<float> dy_cp = ctx.pool->acquire<float>(Shape{m, h});
      megatron_ring_detail::gather_tokens<Backend>(call.tp, f, *ctx.pool, dy, dy_cp.view());
      PooledBuffer<float> act = ctx.pool->acquire<float>(Shape{m, g.ffn});
      PooledBuffer<float> dpre = ctx.pool->acquire<float>(Shape{m, g.ffn_in_rows});
      PooledBuffer<float> dx_cp = ctx.pool->acquire<float>(Shape{m, h});
      for (int j = 0; j < f.cp; ++j) {
        const TensorView<const float> pre = pre_of(saved, j);
        shard_activation_forward<Backend>(g, pre, act.view());  // recomputed, not saved
        Backend::matmul(act.view(), ops::Transpose::yes, dy_cp.view(), ops::Transpose::no, out_of(dweights, j, g), 1.0f,
                        1.0f);
        Backend::matmul(dy_cp.view(), ops::Transpose::no, out_of(weights, j, g), ops::Transpose::yes, act.view());  // dact
        shard_activation_backward<Backend>(g, pre, act.view(), dpre.view());
        Backend::matmul(dpre.view(), ops::Transpose::yes, saved.x.view(), ops::Transpose::no, in_of(dweights, j, g), 1.0f,
                        1.0f);
        Backend::matmul(dpre.view(), ops::Transpose::no, in_of(weights, j, g), ops::Transpose::no, dx_cp.view(), 1.0f,
                        j == 0 ? 0.0f : 1.0f);
      }
      megatron_ring_detail::scatter_tokens<Backend>(call.tp, f, *ctx.pool, TensorView<const float>(dx_cp.view()), dx);
    }
    PooledBuffer<float> mine = ctx.pool->acquire<float>(Shape{g.mlp_rows(), h});
    call.cp.reduce_scatter(read_span(dweights), mine.span(), ReduceOp::sum);
    Backend::add_into(grad.packed.view(), TensorView<const float>(mine.view()));
  }

private:
  // One call's prologue: its checks (the call supported, its two activations this rank's), the rank's factors, the
  // two sub-groups (the context's, split once; or the call's own) and the sizes.
  struct Sizes {
    std::int64_t b, n, m, h;  // batch, the cp rank's tokens n_c, rows b n_c, hidden
  };
  template <Communicator C>
  struct Call {
    megatron_ring_detail::Factors f;
    GridGroupsOfCall<C> groups;  // inner: the tp sub-group, outer: the cp sub-group
    C& tp;
    C& cp;
    Sizes sizes;
    Call(C& comm, const SublayerContext& ctx, const char* who, TensorView<const float> in, TensorView<const float> out)
        : Call(comm, checked(comm, ctx, who, in, out)) {}
    // A call on saved tensors alone (selective recomputation): its forward checked the activations.
    Call(C& comm, const SublayerContext& ctx)
        : f(ctx, comm.rank()), groups(ctx.tp_inner_groups, comm, f.tp), tp(groups.inner()), cp(groups.outer()),
          sizes{ctx.batch, f.cp_tokens, ctx.batch * f.cp_tokens, ctx.hidden()} {}
    static const SublayerContext& checked(C& comm, const SublayerContext& ctx, const char* who,
                                          TensorView<const float> in, TensorView<const float> out) {
      ctx.check_activation(who, "input", in, comm.rank());
      ctx.check_activation(who, "output", out, comm.rank());
      require(MegatronRing().supports(ctx));
      return ctx;
    }
  };

public:
  // The pieces RingTp2d (strategy/ring_tp2d.hpp) composes with Tp2d's.
  // [cp, rows, h]: the packed shards of the cp sub-group (block j: cp rank j's, unified rank j tp + t).
  template <Communicator C>
  static PooledBuffer<float> gather_weights(C& cp, const SublayerContext& ctx, TensorView<const float> shard, int count) {
    PooledBuffer<float> all = ctx.pool->acquire<float>(Shape{count, shard.extent(0), shard.extent(1)});
    cp.all_gather(shard.span(), all.span());
    return all;
  }
  static RingAttentionSpec ring_spec(const SublayerContext& ctx, const megatron_ring_detail::Factors& f) {
    return RingAttentionSpec{.layout = f.cp_layout, .causal = ctx.layer().causal, .document_starts = ctx.document_starts};
  }
  static TokenPositions positions(const SublayerContext& ctx, const megatron_ring_detail::Factors& f) {
    return TokenPositions{&ctx.layer(), &f.cp_layout, f.c, ctx.document_starts};
  }
  // The attention core's tensors, fresh: saved.out [b, n_c, hq/tp, d] and saved.lse [b, hq/tp, n_c] (the heads of the
  // kept q|k|v, saved.heads).
  template <class Saved>
  static void core_tensors(const SublayerContext& ctx, const megatron_ring_detail::Factors& f, Saved& saved) {
    const std::int64_t q_heads = QkvPacking::of(ctx.geometry, f.cp).q_heads();
    saved.out = Tensor<float>(Shape{ctx.batch, f.cp_tokens, q_heads, ctx.geometry.head_dim});
    saved.lse = Tensor<float>(Shape{ctx.batch, q_heads, f.cp_tokens});
  }
  // The attention core: ring attention over the cp sub-group from saved.heads into saved.out and saved.lse.
  template <Communicator C, class Saved>
  static void ring_core(C& cp, const SublayerContext& ctx, const megatron_ring_detail::Factors& f, Saved& saved) {
    const HeadViews<const float> qkv =
        head_views(TensorView<const float>(saved.heads.view()), QkvPacking::of(ctx.geometry, f.cp));
    ring_attention_forward<Backend>(cp, ring_spec(ctx, f), *ctx.pool, qkv.q, qkv.k, qkv.v, saved.out.view(),
                                    saved.lse.view());
  }

private:
  // Block j's parts: W_qkv^T [R, h] and W_proj [W, h] of an attention shard; W_in^T [ffn_in_rows, h] and W_out
  // [f/p, h] of an MLP shard.
  static TensorView<float> block(const PooledBuffer<float>& all, int j) {
    return all.view().slice(0, j, 1).reshape(Shape{all.shape()[1], all.shape()[2]});
  }
  static TensorView<float> qkv_of(const PooledBuffer<float>& all, int j, const ShardGeometry& g) {
    return block(all, j).slice(0, 0, g.qkv_rows);
  }
  static TensorView<float> proj_of(const PooledBuffer<float>& all, int j, const ShardGeometry& g) {
    return block(all, j).slice(0, g.qkv_rows, g.proj_rows);
  }
  static TensorView<float> in_of(const PooledBuffer<float>& all, int j, const ShardGeometry& g) {
    return block(all, j).slice(0, 0, g.ffn_in_rows);
  }
  static TensorView<float> out_of(const PooledBuffer<float>& all, int j, const ShardGeometry& g) {
    return block(all, j).slice(0, g.ffn_in_rows, g.ffn);
  }
  static TensorView<float> pre_of(MlpSaved& saved, int j) {
    const Shape& s = saved.pre.shape();
    return saved.pre.view().slice(0, j, 1).reshape(Shape{s[1], s[2]});
  }
};

}  // namespace paradyse
