// paradyse/strategy/unified_ring.hpp: the skeleton of the strategies that compute in the unified layout itself
// (MegatronCZ, ColossalZ, METP): no token moves; weight shards and K/V blocks pass around the ring instead.
//
// UnifiedRing<Derived, Backend> states once what the three share: the unified layout as both sublayers' compute
// layouts, the one requirement (heads % p == 0, the unified layout's), the checks and sizes every sublayer call
// starts with (RingCall), and the global positions and ring spec the attention core works with.
//
// Zero3Ring<Derived, Backend> adds the ZeRO-3 projections around an attention core that sees q|k|v of EVERY head
// for the rank's own tokens (MegatronCZ, ColossalZ). Forward: the ring column linear (the W_qkv^T shards rotate;
// block j, rank j's head group, lands in columns [j R, (j+1) R) of [b n_r, p R]), reordered into heads with RoPE at
// the tokens' global positions (strategy/ring_heads.hpp) into saved.heads, the core, then out [b, n_r, hq, d] times
// the all-gathered W_proj. Backward: W_proj all-gather and gradient reduce-scatter, the core's backward into the
// heads' gradient, the W_qkv^T shards rotating again with their gradients. MLP: the ZeRO-3 MLP
// (strategy/zero3_mlp.hpp). Derived holds only its core:
//   struct AttentionSaved { Tensor<float> x, heads, out, ...; };  // x [b, n_r, h], heads [b, n_r, hq + 2 hkv, d],
//                                                                   // out [b, n_r, hq, d], plus the core's own
//   static void make_core(ctx, packing, call, AttentionSaved&);  // (re)allocates the core's own tensors (zeroed)
//   static void drop_core(AttentionSaved&);                      // frees them (selective recomputation)
//   void core_forward(C& comm, ctx, packing, call, AttentionSaved&);    // saved.heads -> saved.out
//   void core_backward(C& comm, ctx, packing, call, AttentionSaved&, TensorView<const float> dout /*[b, n_r, hq, d]*/,
//                      const HeadViews<float>& dqkv);                   // += into the zeroed heads' gradient
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/contract/weight_shards.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/ops/backend.hpp"
#include "paradyse/strategy/policy.hpp"
#include "paradyse/strategy/ring_attention.hpp"
#include "paradyse/strategy/ring_heads.hpp"
#include "paradyse/strategy/zero3_linear.hpp"
#include "paradyse/strategy/zero3_mlp.hpp"

#include <fmt/format.h>

#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace paradyse {

// The sizes of one sublayer call on one rank.
struct RingCall {
  const ShardGeometry& g;
  int p, rank;
  std::int64_t b, n, m, h;  // batch, the rank's tokens n_r, its rows b n_r, hidden
};

namespace unified_ring_detail {
inline constexpr std::string_view attention = " attention", attention_backward = " attention backward";
inline constexpr std::string_view mlp = " mlp", mlp_backward = " mlp backward";
// "<Name><Suffix>", NUL-terminated, built at compile time (the label of a call's checks).
template <const std::string_view& Name, const std::string_view& Suffix>
inline constexpr auto label = [] {
  std::array<char, Name.size() + Suffix.size() + 1> text{};
  std::size_t i = 0;
  for (const char c : Name) text[i++] = c;
  for (const char c : Suffix) text[i++] = c;
  return text;
}();
}  // namespace unified_ring_detail

template <class Derived, class Backend>
struct UnifiedRing : LayoutPolicy<Backend> {
  // The layout x, y, dy, dx and the weights stay in between calls (strategy/policy.hpp).
  using unified_layout = SequenceShardedLayout;

  // Both sublayers compute in the unified layout: weight shards and K/V blocks pass around the ring, not tokens.
  ComputeLayouts attention_layouts(const SublayerContext& ctx) const {
    return {ctx.unified(ctx.hidden()), ctx.unified(ctx.hidden())};
  }
  ComputeLayouts mlp_layouts(const SublayerContext& ctx) const { return attention_layouts(ctx); }

  Support supports(const SublayerContext& ctx) const {
    if (ctx.layer().heads % ctx.ranks() != 0)
      return {fmt::format("{}: heads = {} must be divisible by the group size p = {}", Derived::name, ctx.layer().heads,
                          ctx.ranks())};
    return common_support(Derived::name, ctx);
  }

protected:
  // The checks an attention forward starts with (x and y this rank's activations, the call supported), and its sizes.
  template <Communicator C>
  RingCall attention_call(C& comm, const SublayerContext& ctx, TensorView<const float> x, TensorView<float> y) const {
    constexpr const char* who = unified_ring_detail::label<Derived::name, unified_ring_detail::attention>.data();
    ctx.check_activation(who, "x", x, comm.rank());
    ctx.check_activation(who, "y", y, comm.rank());
    require(static_cast<const Derived&>(*this).supports(ctx));
    return call_sizes(comm, ctx);
  }
  // The checks an attention backward starts with (dy and dx this rank's activations), and its sizes.
  template <Communicator C>
  static RingCall attention_backward_call(C& comm, const SublayerContext& ctx, TensorView<const float> dy,
                                          TensorView<float> dx) {
    constexpr const char* who = unified_ring_detail::label<Derived::name, unified_ring_detail::attention_backward>.data();
    ctx.check_activation(who, "dy", dy, comm.rank());
    ctx.check_activation(who, "dx", dx, comm.rank());
    return call_sizes(comm, ctx);
  }
  // The labels of the MLP's checks: "<name> mlp", "<name> mlp backward".
  static constexpr const char* mlp_label() { return unified_ring_detail::label<Derived::name, unified_ring_detail::mlp>.data(); }
  static constexpr const char* mlp_backward_label() {
    return unified_ring_detail::label<Derived::name, unified_ring_detail::mlp_backward>.data();
  }

  template <Communicator C>
  static RingCall call_sizes(C& comm, const SublayerContext& ctx) {
    const int rank = comm.rank();
    return {ctx.geometry, ctx.ranks(), rank, ctx.batch, ctx.local_tokens(rank), ctx.local_rows(rank), ctx.hidden()};
  }
  static RingAttentionSpec ring_spec(const SublayerContext& ctx) {
    return RingAttentionSpec{.layout = ctx.sequence, .causal = ctx.layer().causal, .document_starts = ctx.document_starts};
  }
  // The global positions of rank's tokens (RoPE, masks).
  static TokenPositions positions(const SublayerContext& ctx, int rank) {
    return TokenPositions{&ctx.layer(), &ctx.sequence, rank, ctx.document_starts};
  }
};

template <class Derived, class Backend>
struct Zero3Ring : UnifiedRing<Derived, Backend> {
  // Its MLP sublayer is zero3_mlp.hpp's, op for op: a planner dry-runs it once for every strategy that says so.
  static constexpr std::string_view mlp_sublayer = "zero3_mlp";
  using MlpSaved = Zero3MlpSaved;

  template <Communicator C>
  auto attention_forward(C& comm, const SublayerContext& ctx, const AttentionShard& w, TensorView<const float> x,
                         TensorView<float> y) const {
    const RingCall call = this->attention_call(comm, ctx, x, y);
    const auto& [g, p, rank, b, n, m, h] = call;
    const std::int64_t R = g.qkv_rows, W = g.proj_rows;
    const QkvPacking packing = QkvPacking::of(g, p);
    auto saved = make_saved(ctx, packing, call, x);
    {
      PooledBuffer<float> packed = ctx.pool->acquire<float>(Shape{m, p * R});
      const TensorView<float> columns = packed.view();
      ring_column_linear_forward<Backend>(comm, *ctx.pool, x.reshape(Shape{m, h}), w.qkv(),
                                          [&](int j) { return columns.slice(1, j * R, R); });
      unpack_heads<Backend>(packing, this->positions(ctx, rank), columns.reshape(Shape{b, n, p * R}),
                            saved.heads.view());
    }
    self().core_forward(comm, ctx, packing, call, saved);
    const TensorView<const float> a = TensorView<const float>(saved.out.view()).reshape(Shape{m, p * W});
    gathered_row_linear_forward<Backend>(comm, *ctx.pool, w.proj(), [&](int j) { return a.slice(1, j * W, W); },
                                         y.reshape(Shape{m, h}));
    return saved;
  }

  template <Communicator C, class Saved>
    requires std::same_as<Saved, typename Derived::AttentionSaved>
  void attention_backward(C& comm, const SublayerContext& ctx, const AttentionShard& w, Saved& saved,
                          TensorView<const float> dy, TensorView<float> dx, AttentionShard& grad) const {
    const RingCall call = this->attention_backward_call(comm, ctx, dy, dx);
    const auto& [g, p, rank, b, n, m, h] = call;
    const std::int64_t R = g.qkv_rows, W = g.proj_rows;
    const QkvPacking packing = QkvPacking::of(g, p);
    PooledBuffer<float> dpacked = ctx.pool->acquire<float>(Shape{m, p * R});
    {
      PooledBuffer<float> dheads = ctx.pool->acquire<float>(saved.heads.shape());
      Backend::fill(dheads.view(), 0.0f);
      {
        PooledBuffer<float> dout = ctx.pool->acquire<float>(saved.out.shape());
        const TensorView<const float> a = TensorView<const float>(saved.out.view()).reshape(Shape{m, p * W});
        const TensorView<float> da = dout.view().reshape(Shape{m, p * W});
        gathered_row_linear_backward<Backend>(
            comm, *ctx.pool, w.proj(), [&](int j) { return a.slice(1, j * W, W); }, dy.reshape(Shape{m, h}),
            [&](int j) { return da.slice(1, j * W, W); }, grad.proj());
        self().core_backward(comm, ctx, packing, call, saved, TensorView<const float>(dout.view()),
                             head_views(dheads.view(), packing));
      }
      pack_head_gradients<Backend>(packing, this->positions(ctx, rank), dheads.view(),
                                   dpacked.view().reshape(Shape{b, n, p * R}));
    }
    const TensorView<const float> dcolumns = dpacked.view();
    QkvGradient<Backend> qkv_grad(ctx, grad.qkv());
    ring_column_linear_backward<Backend>(comm, *ctx.pool, TensorView<const float>(saved.x.view()).reshape(Shape{m, h}),
                                         w.qkv(), [&](int j) { return dcolumns.slice(1, j * R, R); },
                                         dx.reshape(Shape{m, h}), qkv_grad.target());
    qkv_grad.finish(comm);
  }

  // Selective recomputation (strategy/policy.hpp): the core's own tensors (Derived::drop_core) dropped after
  // forward; before backward they are allocated again (Derived::make_core) and the core re-runs from the kept heads.
  template <class Saved>
    requires std::same_as<Saved, typename Derived::AttentionSaved>
  static void drop_attention_core(Saved& saved) {
    Derived::drop_core(saved);
  }
  template <Communicator C, class Saved>
    requires std::same_as<Saved, typename Derived::AttentionSaved>
  void recompute_attention_core(C& comm, const SublayerContext& ctx, const AttentionShard&, Saved& saved) const {
    const RingCall call = this->call_sizes(comm, ctx);
    const QkvPacking packing = QkvPacking::of(call.g, call.p);
    Derived::make_core(ctx, packing, call, saved);
    self().core_forward(comm, ctx, packing, call, saved);
  }

  template <Communicator C>
  MlpSaved mlp_forward(C& comm, const SublayerContext& ctx, const MlpShard& w, TensorView<const float> x,
                       TensorView<float> y) const {
    return zero3_mlp_forward<Backend>(comm, ctx, w, x, y, this->mlp_label());
  }
  template <Communicator C>
  void mlp_backward(C& comm, const SublayerContext& ctx, const MlpShard& w, MlpSaved& saved,
                    TensorView<const float> dy, TensorView<float> dx, MlpShard& grad) const {
    zero3_mlp_backward<Backend>(comm, ctx, w, saved, dy, dx, grad, this->mlp_backward_label());
  }

private:
  const Derived& self() const noexcept { return static_cast<const Derived&>(*this); }
  // What a forward saves: the input, the heads [b, n_r, hq + 2 hkv, d] (unzeroed: unpacked whole from the ring
  // linear's columns), and the core's own tensors (Derived::make_core). `auto`: Derived is incomplete where this
  // template is instantiated as its base.
  static auto make_saved(const SublayerContext& ctx, const QkvPacking& packing, const RingCall& call,
                         TensorView<const float> x) {
    typename Derived::AttentionSaved saved{};
    saved.x = copy_tensor<Backend>(x);
    saved.heads = Tensor<float>::uninitialized(Shape{call.b, call.n, packing.heads(), ctx.geometry.head_dim});
    Derived::make_core(ctx, packing, call, saved);
    return saved;
  }
};

}  // namespace paradyse
