// paradyse/strategy/ring_tp2d.hpp: RingTp2d, context parallelism over a cp ring of 2-D tensor-parallel grids: the
// composition of MegatronRing's cp ring (strategy/megatron_ring.hpp) with Tp2d's 2-D linears (strategy/tp2d.hpp),
// inside one group of p = cp x C ranks, C = tp_x x tp_y, over the unified layout of all p ranks.
//
// The group. ctx.tp_inner = C factorises it as MegatronRing's cp x tp (rank r = c C + t: grid rank t of cp rank c,
// the grid holding cp rank c's share of the sequence, n_c tokens); ctx.tp_x = x splits each grid as Tp2d does
// (t = j x + i). Grid rank t computes what MegatronRing's tp rank t computes: the heads and ffn columns of the
// unified shards t, t + C, ... of its cp sub-group (all-gathered over it, their gradients reduce-scattered back), here
// seen as one "grid shard" (t's rows of a C-rank split: each part (q|k|v, proj; in, out) the cp shards' side by side).
// Over those grid shards the grid runs Tp2d on its n_c tokens (in the cp rank's order, MegatronRing's): weights
// block (j, i) of the y-rank packing, x gathered to [b, n_c, h / x] (column block i), the MLP exactly as Tp2d's.
// Attention differs in its core only: the A -> B reduce-scatter over tp_x splits q|k|v's columns (grid shard t's
// heads, every token of the share) rather than its tokens, so ring attention runs over the cp sub-group as in
// MegatronRing (K/V of grid shard t's heads travel), and its output is all-gathered over tp_x back to head block j.
//
// Per rank and sublayer: Tp2d's traffic on the grid over n_c tokens (its qkv column reduce-scatter and output
// all-gather move as much as Tp2d's token-block ones), plus MegatronRing's over the cp sub-group: the weights
// all-gathered (and their gradients reduce-scattered back) and the ring's K/V of grid shard t's heads. Saved: the
// unified x [b, n, h], the heads of grid shard t [b, n_c, hq/C + 2 hkv/C, d] (RoPE applied), out, lse (attention);
// Tp2d's MLP state over n_c tokens.
//
// Requirements (supports()): ctx.tp_inner = C dividing p, tp_x > 1 dividing C, h % tp_x == 0, kv_heads % p == 0
// (replicated kv heads are refused), every rank the same token count (s % p == 0; zigzag: s % 2p == 0). The groups:
// cp and grid from ctx.tp_inner_groups, the grid's tp_x and tp_y from ctx.tp_grid_groups (each split once by the
// layer stack), or split for the call when none are held.
#pragma once

#include "paradyse/comm/grid_groups.hpp"
#include "paradyse/strategy/megatron_ring.hpp"
#include "paradyse/strategy/policy.hpp"
#include "paradyse/strategy/ring_attention.hpp"
#include "paradyse/strategy/ring_heads.hpp"
#include "paradyse/strategy/tp2d.hpp"

#include <fmt/format.h>

#include <cstdint>
#include <string_view>
#include <vector>

namespace paradyse {

template <class Backend = ops::Cpu>
struct RingTp2d : LayoutPolicy<Backend> {
  static constexpr std::string_view name = "RingTp2d";
  using unified_layout = SequenceShardedLayout;

  struct AttentionSaved {
    Tensor<float> x;      // [b, n, h]: the unified input, re-gathered in backward
    Tensor<float> heads;  // [b, n_c, hq/C + 2 hkv/C, d]: q, k, v of grid shard t's heads (RoPE applied)
    Tensor<float> out;    // [b, n_c, hq/C, d]
    Tensor<float> lse;    // [b, hq/C, n_c]
  };
  using MlpSaved = typename Tp2d<Backend>::MlpSaved;

  Support supports(const SublayerContext& ctx) const {
    const int p = ctx.ranks(), C = ctx.tp_inner, x = ctx.tp_x;
    const LayerConfig& c = ctx.layer();
    if (C < 1 || p % C != 0 || x <= 1 || C % x != 0)
      return {fmt::format("RingTp2d needs a cp x (tp_x x tp_y) factorisation of the group of {} ranks: tp_inner = {} "
                          "(the grid's size) must divide it and tp_x = {} must be > 1 and divide tp_inner", p, C, x)};
    if (c.hidden % x != 0) return {fmt::format("RingTp2d: hidden = {} must be divisible by tp_x = {}", c.hidden, x)};
    if (c.kv_heads % p != 0)
      return {fmt::format("RingTp2d: kv_heads = {} must be divisible by the group size {} (replicated kv heads are not "
                          "supported)", c.kv_heads, p)};
    if (Support even = even_tokens_support(name, ctx); !even) return even;
    return common_support(name, ctx);
  }
  ComputeLayouts attention_layouts(const SublayerContext& ctx) const {
    return {ctx.unified(ctx.hidden()), ctx.unified(ctx.hidden())};
  }
  ComputeLayouts mlp_layouts(const SublayerContext& ctx) const { return attention_layouts(ctx); }

  template <Communicator C>
  AttentionSaved attention_forward(C& comm, const SublayerContext& ctx, const AttentionShard& w,
                                   TensorView<const float> x, TensorView<float> y) const {
    const Grid<C> grid(comm, ctx, "RingTp2d attention", x, y);
    const ShardGeometry& gy = grid.cy.geometry;
    const auto [b, n, nx, hx] = grid.sizes;
    const QkvPacking packing = QkvPacking::of(ctx.geometry, grid.f.cp);
    AttentionSaved saved{copy_tensor<Backend>(x), Tensor<float>(Shape{b, n, packing.heads(), ctx.geometry.head_dim}),
                         Tensor<float>(), Tensor<float>()};
    const PooledBuffer<float> wb = weight_block(grid, ctx, w.packed.view(), Sublayer::attention);
    const TensorView<const float> w_qkv = TensorView<const float>(wb).slice(0, 0, gy.qkv_rows);
    const TensorView<const float> w_proj = TensorView<const float>(wb).slice(0, gy.qkv_rows, gy.proj_rows);
    {
      PooledBuffer<float> x_full = ctx.pool->acquire<float>(Shape{b, n, hx});
      tp2d_.gather_columns(grid, ctx, x, x_full.view());
      PooledBuffer<float> partial = ctx.pool->acquire<float>(Shape{b, n, gy.qkv_rows});  // partial over i
      Backend::matmul(rows_of(x_full.view()), ops::Transpose::no, w_qkv, ops::Transpose::yes, rows_of(partial.view()));
      x_full = PooledBuffer<float>();
      PooledBuffer<float> mine = ctx.pool->acquire<float>(Shape{b, n, packing.width()});  // grid shard t's q|k|v
      tp2d_.scatter_blocks(grid, ctx, partial.view(), mine.view(), 2);
      unpack_heads<Backend>(packing, MegatronRing<Backend>::positions(ctx, grid.f), mine.view(), saved.heads.view());
    }
    ring_core(grid, ctx, saved);
    PooledBuffer<float> out_full = ctx.pool->acquire<float>(Shape{b, n, gy.proj_rows});  // head block j
    tp2d_.gather_blocks(grid, ctx, out_as_rows(saved.out), out_full.view(), 2);
    PooledBuffer<float> partial = ctx.pool->acquire<float>(Shape{b, n, hx});
    Backend::matmul(rows_of(out_full.view()), ops::Transpose::no, w_proj, ops::Transpose::no, rows_of(partial.view()));
    out_full = PooledBuffer<float>();
    tp2d_.scatter_columns(grid, ctx, partial.view(), y);
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
    ring_core(Grid<C>(comm, ctx), ctx, saved);
  }

  template <Communicator C>
  void attention_backward(C& comm, const SublayerContext& ctx, const AttentionShard& w, AttentionSaved& saved,
                          TensorView<const float> dy, TensorView<float> dx, AttentionShard& grad) const {
    const Grid<C> grid(comm, ctx, "RingTp2d attention backward", dy, dx);
    const ShardGeometry& gy = grid.cy.geometry;
    const auto [b, n, nx, hx] = grid.sizes;
    const QkvPacking packing = QkvPacking::of(ctx.geometry, grid.f.cp);
    const PooledBuffer<float> wb = weight_block(grid, ctx, w.packed.view(), Sublayer::attention);
    PooledBuffer<float> gb = ctx.pool->acquire<float>(wb.shape());  // block (j, i)'s gradient
    Backend::fill(gb.view(), 0.0f);
    const TensorView<const float> w_qkv = TensorView<const float>(wb).slice(0, 0, gy.qkv_rows);
    const TensorView<const float> w_proj = TensorView<const float>(wb).slice(0, gy.qkv_rows, gy.proj_rows);
    const TensorView<float> g_qkv = gb.view().slice(0, 0, gy.qkv_rows), g_proj = gb.view().slice(0, gy.qkv_rows, gy.proj_rows);
    PooledBuffer<float> dpacked = ctx.pool->acquire<float>(Shape{b, n, packing.width()});  // grid shard t's d(q|k|v)
    {
      PooledBuffer<float> dout = ctx.pool->acquire<float>(saved.out.shape());
      {
        PooledBuffer<float> dy_full = ctx.pool->acquire<float>(Shape{b, n, hx});
        tp2d_.gather_columns(grid, ctx, dy, dy_full.view());
        PooledBuffer<float> out_full = ctx.pool->acquire<float>(Shape{b, n, gy.proj_rows});
        tp2d_.gather_blocks(grid, ctx, out_as_rows(saved.out), out_full.view(), 2);
        Backend::matmul(rows_of(out_full.view()), ops::Transpose::yes, rows_of(dy_full.view()), ops::Transpose::no,
                        g_proj, 1.0f, 1.0f);
        Backend::matmul(rows_of(dy_full.view()), ops::Transpose::no, w_proj, ops::Transpose::yes,
                        rows_of(out_full.view()));  // d(out) of head block j, partial over i: overwrites out_full
        tp2d_.scatter_blocks(grid, ctx, out_full.view(), dout.view().reshape(Shape{b, n, packing.q_heads() * ctx.geometry.head_dim}), 2);
      }
      PooledBuffer<float> dheads = ctx.pool->acquire<float>(saved.heads.shape());
      Backend::fill(dheads.view(), 0.0f);  // the ring accumulates
      const HeadViews<const float> qkv = head_views(TensorView<const float>(saved.heads.view()), packing);
      const HeadViews<float> dqkv = head_views(dheads.view(), packing);
      ring_attention_backward<Backend>(grid.cp, MegatronRing<Backend>::ring_spec(ctx, grid.f), *ctx.pool, qkv.q, qkv.k,
                                       qkv.v, saved.out.view(), saved.lse.view(), dout.view(), dqkv.q, dqkv.k, dqkv.v);
      pack_head_gradients<Backend>(packing, MegatronRing<Backend>::positions(ctx, grid.f), dheads.view(),
                                   dpacked.view());
    }
    PooledBuffer<float> dpre = ctx.pool->acquire<float>(Shape{b, n, gy.qkv_rows});  // head block j, every token
    tp2d_.gather_blocks(grid, ctx, dpacked.view(), dpre.view(), 2);
    dpacked = PooledBuffer<float>();
    tp2d_.linear_input_backward(grid, ctx, saved.x.view(), w_qkv, dpre.view(), g_qkv, dx);
    return_gradient(grid, ctx, gb.view(), Sublayer::attention, grad.packed.view());
  }

  template <Communicator C>
  MlpSaved mlp_forward(C& comm, const SublayerContext& ctx, const MlpShard& w, TensorView<const float> x,
                       TensorView<float> y) const {
    const Grid<C> grid(comm, ctx, "RingTp2d mlp", x, y);
    const PooledBuffer<float> wb = weight_block(grid, ctx, w.packed.view(), Sublayer::mlp);
    return tp2d_.mlp_block_forward(grid, ctx, wb.view(), x, y);
  }

  template <Communicator C>
  void mlp_backward(C& comm, const SublayerContext& ctx, const MlpShard& w, MlpSaved& saved,
                    TensorView<const float> dy, TensorView<float> dx, MlpShard& grad) const {
    const Grid<C> grid(comm, ctx, "RingTp2d mlp backward", dy, dx);
    const PooledBuffer<float> wb = weight_block(grid, ctx, w.packed.view(), Sublayer::mlp);
    const PooledBuffer<float> gb = tp2d_.mlp_block_backward(grid, ctx, wb.view(), saved, dy, dx);
    return_gradient(grid, ctx, gb.view(), Sublayer::mlp, grad.packed.view());
  }

private:
  enum class Sublayer { attention, mlp };
  using Tp2dSizes = typename Tp2d<Backend>::Sizes;  // {b, s, sx, hx}: here s = n_c, the cp rank's share

  // One call's prologue: its checks, the rank's factors (MegatronRing's, cp x C), its groups (cp and grid; the
  // grid's tp_x and tp_y: held or split for the call), place (i, j) on the grid, the contexts of the grid shards' and
  // y-rank shards' geometries, the sizes, and the grid's token order (the cp rank's): what Tp2d's pieces ask of a grid.
  template <Communicator C>
  struct Grid {
    megatron_ring_detail::Factors f;
    GridGroupsOfCall<C> cp_grid;  // inner: the grid (the tp sub-group), outer: the cp sub-group
    GridGroupsOfCall<C> xy;       // the grid's: inner tp_x, outer tp_y
    C& cp;
    C& along_x;  // ranks (., j) of my grid, my index i
    C& along_y;  // ranks (i, .) of my grid, my index j
    int x = 1, y = 1, i = 0, j = 0;
    SublayerContext cc;  // grid shard geometry (a C-rank split)
    SublayerContext cy;  // y-rank shard geometry
    Tp2dSizes sizes;
    Grid(C& comm, const SublayerContext& ctx, const char* who, TensorView<const float> in, TensorView<const float> out)
        : Grid(comm, checked(comm, ctx, who, in, out)) {}
    // A call on saved tensors alone (selective recomputation): its forward checked the activations.
    Grid(C& comm, const SublayerContext& ctx)
        : f(ctx, comm.rank()), cp_grid(ctx.tp_inner_groups, comm, f.tp), xy(ctx.tp_grid_groups, cp_grid.inner(), ctx.tp_x),
          cp(cp_grid.outer()), along_x(xy.inner()), along_y(xy.outer()), x(ctx.tp_x), y(f.tp / ctx.tp_x), i(f.t % x),
          j(f.t / x), cc(ctx), cy(ctx), sizes{ctx.batch, f.cp_tokens, f.cp_tokens / x, ctx.hidden() / x} {
      cc.geometry = ShardGeometry(ctx.layer(), f.tp);
      cy.geometry = ShardGeometry(ctx.layer(), y);
    }
    static const SublayerContext& checked(C& comm, const SublayerContext& ctx, const char* who,
                                          TensorView<const float> in, TensorView<const float> out) {
      require(RingTp2d().supports(ctx));
      ctx.check_activation(who, "input", in, comm.rank());
      ctx.check_activation(who, "output", out, comm.rank());
      return ctx;
    }
    // full: [b, n_c, width] (the cp rank's order) <- rank_major: [C][b, n, width] (the grid's ranks' tokens), and back.
    void rank_major_to_full(const SublayerContext& ctx, std::int64_t width, const float* rank_major, float* full) const {
      const std::int64_t m = ctx.batch * f.cp_tokens;
      megatron_ring_detail::members_to_cp_order<Backend>(f, TensorView<const float>(rank_major, Shape{m, width}),
                                                         TensorView<float>(full, Shape{m, width}));
    }
    void full_to_rank_major(const SublayerContext& ctx, std::int64_t width, const float* full, float* rank_major) const {
      const std::int64_t m = ctx.batch * f.cp_tokens;
      megatron_ring_detail::cp_order_to_members<Backend>(f, TensorView<const float>(full, Shape{m, width}),
                                                         TensorView<float>(rank_major, Shape{m, width}));
    }
  };

  template <class T>
  static TensorView<T> rows_of(TensorView<T> t) { return Tp2d<Backend>::rows_of(t); }
  // out: [b, n_c, hq/C, d] as [b, n_c, hq/C d].
  static TensorView<const float> out_as_rows(const Tensor<float>& out) {
    const Shape& s = out.shape();
    return out.view().reshape(Shape{s[0], s[1], s[2] * s[3]});
  }

  // MegatronRing's attention core over the cp sub-group, from the kept heads: saved.out and saved.lse (made here).
  template <class G>
  static void ring_core(const G& grid, const SublayerContext& ctx, AttentionSaved& saved) {
    MegatronRing<Backend>::core_tensors(ctx, grid.f, saved);
    MegatronRing<Backend>::ring_core(grid.cp, ctx, grid.f, saved);
  }

  // The parts of a sublayer's shard in a context's geometry (Tp2d's: c_start, rows; y_start in the y-rank packing).
  template <class G>
  static auto parts(const G& grid, const SublayerContext& ctx, Sublayer which) {
    return which == Sublayer::attention ? Tp2d<Backend>::attention_pieces(ctx, grid.cy.geometry)
                                        : Tp2d<Backend>::mlp_pieces(ctx, grid.cy.geometry);
  }
  // block: [rows_y, h / x], block (j, i) of the y-rank packing <- my unified shard packed: [rows_p, h]: the cp
  // sub-group's shards all-gathered into grid shard t ([cp rows_p, h]: part q of cp shard k at cp c_start + k rows),
  // then Tp2d's all-to-all over tp_x.
  template <class G>
  PooledBuffer<float> weight_block(G& grid, const SublayerContext& ctx, TensorView<const float> packed,
                                   Sublayer which) const {
    const int cp = grid.f.cp;
    const std::int64_t rows = packed.extent(0), h = packed.extent(1);
    PooledBuffer<float> shards = MegatronRing<Backend>::gather_weights(grid.cp, ctx, packed, cp);  // [cp, rows, h]
    PooledBuffer<float> mine = ctx.pool->acquire<float>(Shape{cp * rows, h});
    for (int k = 0; k < cp; ++k)
      for (const auto& part : parts(grid, ctx, which))
        Backend::copy(TensorView<const float>(shards.view()).slice(0, k, 1).reshape(Shape{rows, h}).slice(0, part.c_start, part.rows),
                      mine.view().slice(0, cp * part.c_start + k * part.rows, part.rows));
    shards = PooledBuffer<float>();
    return tp2d_.gather_weights(grid, grid.cc, mine.view(), parts(grid, grid.cc, which));
  }
  // grad: [rows_p, h] += my unified shard's gradient, from the weight blocks' g_block: [rows_y, h / x]: Tp2d's inverse
  // all-to-all over tp_x to grid shard t's gradient, then its cp shards summed back to their owners over cp.
  template <class G>
  void return_gradient(G& grid, const SublayerContext& ctx, TensorView<const float> g_block, Sublayer which,
                       TensorView<float> grad) const {
    const int cp = grid.f.cp;
    const std::int64_t rows = grad.extent(0), h = grad.extent(1);
    PooledBuffer<float> mine = ctx.pool->acquire<float>(Shape{cp * rows, h});
    Backend::fill(mine.view(), 0.0f);
    tp2d_.scatter_gradient(grid, grid.cc, g_block, parts(grid, grid.cc, which), mine.view());
    PooledBuffer<float> shards = ctx.pool->acquire<float>(Shape{cp, rows, h});
    for (int k = 0; k < cp; ++k)
      for (const auto& part : parts(grid, ctx, which))
        Backend::copy(TensorView<const float>(mine.view()).slice(0, cp * part.c_start + k * part.rows, part.rows),
                      shards.view().slice(0, k, 1).reshape(Shape{rows, h}).slice(0, part.c_start, part.rows));
    mine = PooledBuffer<float>();
    PooledBuffer<float> summed = ctx.pool->acquire<float>(Shape{rows, h});
    grid.cp.reduce_scatter(read_span(shards), summed.span(), ReduceOp::sum);
    Backend::add_into(grad, TensorView<const float>(summed.view()));
  }

  Tp2d<Backend> tp2d_;
};

}  // namespace paradyse
