// paradyse/strategy/tp2d.hpp: Tp2d, Hypertron's 2-D tensor parallelism (strategy/tp2d_linear.hpp's scheme) as a
// strategy of the Switchable list: a group of C = tp_x x tp_y ranks, its input and output in the unified layout and
// its weights the unified shards, so a plan can switch to and from it per layer with no redistribution.
//
// The grid. The group of C ranks (ctx.tp_x = x > 1, y = C / x; ctx.tp_x = 1: no grid, refused) is split inside the
// strategy into rank r = j x + i: (i, j), i along tp_x (innermost), j along tp_y. With tp_x innermost the unified
// layout's pieces line up with tp2d's: the x ranks (., j) hold the tokens of tp2d's row block j, and their unified
// weight shards are the heads (ffn columns) of head block j of a y-rank split, so both re-layouts below are
// all-to-alls within a tp_x group.
//
// One sublayer (the attention projections or the MLP), on rank (i, j), T = b s tokens, n = s / C per rank:
//   weights   unified shards [rows_C, h] -> all-to-all over tp_x -> block (j, i): the y-rank shard j's rows,
//             columns block i: [rows_y, h / x] (rows reordered into the y-rank packing; SwiGLU: gate rows, then up)
//   x         unified [b, n, h] -> all-to-all over tp_x -> layout A [x][b, n, h / x] (row block j, column block i)
//             -> all-gather over tp_y -> [b, s, h / x] (every token in natural order, column block i)
//   A -> B    x W_1 block -> partial sums over i [b, s, n_1 / y] -> reduce-scatter over tp_x -> layout B
//             [b, s / x, n_1 / y] (tokens block i of every sample, column block j)
//   core      attention: RoPE at the block's global positions, keys and values of every token all-gathered over tp_x,
//             attention of the block's queries (causal, documents, GQA as the y-rank shard packs them);
//             MLP: the activation (GELU, or SwiGLU on the gate and up columns)
//   B -> A    all-gather over tp_x -> [b, s, n_2 / y] -> times W_2 block -> partial sums over j [b, s, h / x] ->
//             reduce-scatter over tp_y -> layout A -> all-to-all over tp_x -> unified [b, n, h]
// Backward: the transposes (all-gather dy over the reduce-scatter's group, reduce-scatter dx over the gather's),
// inputs re-gathered rather than kept, weight blocks re-gathered, and the weight gradient of block (j, i), summed over
// every token of the group, sent back to the unified shards by the inverse all-to-all over tp_x (accumulated).
//
// Per rank and sublayer (elements; W = the sublayer's unified weight shard, rows_C x h): forward: all-to-alls of
// T h / C twice (in, out), all-gather T h / x over tp_y (in), reduce-scatter T n_1 / y and all-gather
// T n_2 / y over tp_x, reduce-scatter T h / x over tp_y; attention also all-gathers the qkv block T R / y over tp_x;
// weights: one all-to-all of W (x - 1) / x. Backward: about twice the forward, plus the gradient's all-to-all of W.
// The weight all-to-alls are the price of the unified shards (a fixed 2-D layout would keep block (j, i) resident).
// The tp_x and tp_y groups are the group's outer x inner grid with inner = tp_x (comm/grid_groups.hpp), taken from
// ctx.tp_x_groups (split once per group; the layer stack keeps them), or split for the call when it has none. Saved: attention x [b, n, h], qkv block
// [b, s / x, R_y] (after RoPE), attention output [b, s / x, q_y d], lse; MLP x and pre-activation [b, s / x, in_y].
//
// Requirements (supports()): a grid (ctx.tp_x > 1 dividing C), h % tp_x == 0, kv_heads % C == 0 (replicated kv heads
// are refused), every rank the same token count (s % C == 0; zigzag: s % 2C == 0) and s % tp_x == 0.
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/comm/grid_groups.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/contract/weight_shards.hpp"
#include "paradyse/ops/backend.hpp"
#include "paradyse/strategy/attention_heads.hpp"
#include "paradyse/strategy/mlp_activation.hpp"
#include "paradyse/strategy/policy.hpp"
#include "paradyse/strategy/rope_heads.hpp"
#include "paradyse/strategy/sequence_layout.hpp"

#include <fmt/format.h>

#include <cstdint>
#include <string_view>
#include <vector>

namespace paradyse {

template <class Backend = ops::Cpu>
struct Tp2d : LayoutPolicy<Backend> {
  static constexpr std::string_view name = "Tp2d";
  using unified_layout = SequenceShardedLayout;

  struct AttentionSaved {
    Tensor<float> x;    // [b, n, h]: the unified input, re-gathered in backward
    Tensor<float> qkv;  // [b, s / x, R_y]: token block i's q, k, v of head block j (after RoPE)
    Tensor<float> out;  // [b, s / x, q_y d]
    Tensor<float> lse;  // [b, q_y, s / x]
  };
  struct MlpSaved {
    Tensor<float> x;    // [b, n, h]
    Tensor<float> pre;  // [b, s / x, in_y]: the pre-activation of token block i, ffn block j
  };

  Support supports(const SublayerContext& ctx) const {
    const int C = ctx.ranks(), x = ctx.tp_x;
    const LayerConfig& c = ctx.layer();
    if (x <= 1 || C % x != 0)
      return {fmt::format("Tp2d needs a tp_x x tp_y grid over the group of {} ranks: tp_x = {} must be > 1 and divide "
                          "it (the stage group's tp_x; none here)", C, x)};
    if (c.hidden % x != 0)
      return {fmt::format("Tp2d: hidden = {} must be divisible by tp_x = {}", c.hidden, x)};
    if (c.kv_heads % C != 0)
      return {fmt::format("Tp2d: kv_heads = {} must be divisible by the group size {} (replicated kv heads are not "
                          "supported)", c.kv_heads, C)};
    if (Support even = even_tokens_support(name, ctx); !even) return even;
    if (ctx.length() % x != 0)
      return {fmt::format("Tp2d: s = {} must be divisible by tp_x = {}", ctx.length(), x)};
    return common_support(name, ctx);
  }
  // Both sublayers take and give the unified layout; the re-layouts to tp2d's layouts happen inside.
  ComputeLayouts attention_layouts(const SublayerContext& ctx) const {
    return {ctx.unified(ctx.hidden()), ctx.unified(ctx.hidden())};
  }
  ComputeLayouts mlp_layouts(const SublayerContext& ctx) const { return attention_layouts(ctx); }

  template <Communicator C>
  AttentionSaved attention_forward(C& comm, const SublayerContext& ctx, const AttentionShard& w,
                                   TensorView<const float> x, TensorView<float> y) const {
    const Grid<C> grid(comm, ctx, "Tp2d attention", x, y);
    const ShardGeometry& g = grid.cy.geometry;
    const auto [b, s, sx, hx] = grid.sizes;
    AttentionSaved saved{copy_tensor<Backend>(x), Tensor<float>(Shape{b, sx, g.qkv_rows}),
                         Tensor<float>(Shape{b, sx, g.proj_rows}), Tensor<float>(Shape{b, g.q_heads, sx})};
    PooledBuffer<float> wb = gather_weights(grid, ctx, w.packed.view(), attention_pieces(ctx, g));
    const TensorView<const float> w_qkv = TensorView<const float>(wb.view()).slice(0, 0, g.qkv_rows);
    const TensorView<const float> w_proj = TensorView<const float>(wb.view()).slice(0, g.qkv_rows, g.proj_rows);
    {
      PooledBuffer<float> x_full = ctx.pool->acquire<float>(Shape{b, s, hx});
      gather_columns(grid, ctx, x, x_full.view());
      PooledBuffer<float> partial = ctx.pool->acquire<float>(Shape{b, s, g.qkv_rows});
      Backend::matmul(rows_of(x_full.view()), ops::Transpose::no, w_qkv, ops::Transpose::yes, rows_of(partial.view()));
      x_full = PooledBuffer<float>();
      scatter_blocks(grid, ctx, partial.view(), saved.qkv.view());
    }
    rope_block(grid.cy, grid, saved.qkv.view(), RopeDirection::forward);
    {
      PooledBuffer<float> all = ctx.pool->acquire<float>(Shape{b, s, g.qkv_rows});  // every token's k and v (and q)
      gather_blocks(grid, ctx, saved.qkv.view(), all.view());
      attention_forward_heads<Backend>(g, saved.qkv.view(), all.view(), block_mask(ctx, grid), saved.out.view(),
                                       saved.lse.view());
    }
    PooledBuffer<float> out_full = ctx.pool->acquire<float>(Shape{b, s, g.proj_rows});
    gather_blocks(grid, ctx, saved.out.view(), out_full.view());
    PooledBuffer<float> partial = ctx.pool->acquire<float>(Shape{b, s, hx});
    Backend::matmul(rows_of(out_full.view()), ops::Transpose::no, w_proj, ops::Transpose::no, rows_of(partial.view()));
    out_full = PooledBuffer<float>();
    scatter_columns(grid, ctx, partial.view(), y);
    return saved;
  }

  // Selective recomputation (strategy/policy.hpp): the core's output and lse dropped after forward; before backward
  // every token's k and v are gathered over tp_x again and the core re-runs from the kept q, k, v.
  static void drop_attention_core(AttentionSaved& saved) {
    saved.out = Tensor<float>();
    saved.lse = Tensor<float>();
  }
  template <Communicator C>
  void recompute_attention_core(C& comm, const SublayerContext& ctx, const AttentionShard&, AttentionSaved& saved) const {
    const Grid<C> grid(comm, ctx);
    const ShardGeometry& g = grid.cy.geometry;
    const auto [b, s, sx, hx] = grid.sizes;
    saved.out = Tensor<float>(Shape{b, sx, g.proj_rows});
    saved.lse = Tensor<float>(Shape{b, g.q_heads, sx});
    PooledBuffer<float> all = ctx.pool->acquire<float>(Shape{b, s, g.qkv_rows});
    gather_blocks(grid, ctx, saved.qkv.view(), all.view());
    attention_forward_heads<Backend>(g, saved.qkv.view(), all.view(), block_mask(ctx, grid), saved.out.view(),
                                     saved.lse.view());
  }

  template <Communicator C>
  void attention_backward(C& comm, const SublayerContext& ctx, const AttentionShard& w, AttentionSaved& saved,
                          TensorView<const float> dy, TensorView<float> dx, AttentionShard& grad) const {
    const Grid<C> grid(comm, ctx, "Tp2d attention backward", dy, dx);
    const ShardGeometry& g = grid.cy.geometry;
    const auto [b, s, sx, hx] = grid.sizes;
    const auto pieces = attention_pieces(ctx, g);
    PooledBuffer<float> wb = gather_weights(grid, ctx, w.packed.view(), pieces);
    PooledBuffer<float> gb = ctx.pool->acquire<float>(wb.view().shape());  // block (j, i)'s gradient
    Backend::fill(gb.view(), 0.0f);
    const TensorView<const float> w_qkv = TensorView<const float>(wb.view()).slice(0, 0, g.qkv_rows);
    const TensorView<const float> w_proj = TensorView<const float>(wb.view()).slice(0, g.qkv_rows, g.proj_rows);
    const TensorView<float> g_qkv = gb.view().slice(0, 0, g.qkv_rows), g_proj = gb.view().slice(0, g.qkv_rows, g.proj_rows);
    PooledBuffer<float> dqkv = ctx.pool->acquire<float>(Shape{b, sx, g.qkv_rows});  // token block i
    {
      PooledBuffer<float> dy_full = ctx.pool->acquire<float>(Shape{b, s, hx});
      gather_columns(grid, ctx, dy, dy_full.view());
      PooledBuffer<float> dout = ctx.pool->acquire<float>(Shape{b, sx, g.proj_rows});
      {
        PooledBuffer<float> out_full = ctx.pool->acquire<float>(Shape{b, s, g.proj_rows});
        gather_blocks(grid, ctx, saved.out.view(), out_full.view());
        Backend::matmul(rows_of(out_full.view()), ops::Transpose::yes, rows_of(dy_full.view()), ops::Transpose::no,
                        g_proj, 1.0f, 1.0f);
        Backend::matmul(rows_of(dy_full.view()), ops::Transpose::no, w_proj, ops::Transpose::yes,
                        rows_of(out_full.view()));  // d(out) over every token, partial over i: overwrites out_full
        dy_full = PooledBuffer<float>();
        scatter_blocks(grid, ctx, out_full.view(), dout.view());
      }
      PooledBuffer<float> all = ctx.pool->acquire<float>(Shape{b, s, g.qkv_rows});
      gather_blocks(grid, ctx, saved.qkv.view(), all.view());
      PooledBuffer<float> dall = ctx.pool->acquire<float>(Shape{b, s, g.qkv_rows});  // dk, dv of every token
      Backend::fill(dall.view(), 0.0f);
      Backend::fill(dqkv.view(), 0.0f);  // the ops accumulate
      attention_backward_heads<Backend>(g, saved.qkv.view(), all.view(), saved.out.view(), saved.lse.view(),
                                        dout.view(), block_mask(ctx, grid), dqkv.view(), dall.view());
      all = PooledBuffer<float>();
      PooledBuffer<float> dkv = ctx.pool->acquire<float>(Shape{b, sx, g.qkv_rows});
      scatter_blocks(grid, ctx, dall.view(), dkv.view());
      Backend::add_into(dqkv.view(), TensorView<const float>(dkv.view()));  // dq's columns of dkv are zero
    }
    rope_block(grid.cy, grid, dqkv.view(), RopeDirection::backward);
    PooledBuffer<float> dpre = ctx.pool->acquire<float>(Shape{b, s, g.qkv_rows});
    gather_blocks(grid, ctx, dqkv.view(), dpre.view());
    dqkv = PooledBuffer<float>();
    linear_input_backward(grid, ctx, saved.x.view(), w_qkv, dpre.view(), g_qkv, dx);
    scatter_gradient(grid, ctx, gb.view(), pieces, grad.packed.view());
  }

  template <Communicator C>
  MlpSaved mlp_forward(C& comm, const SublayerContext& ctx, const MlpShard& w, TensorView<const float> x,
                       TensorView<float> y) const {
    const Grid<C> grid(comm, ctx, "Tp2d mlp", x, y);
    const PooledBuffer<float> wb = gather_weights(grid, ctx, w.packed.view(), mlp_pieces(ctx, grid.cy.geometry));
    return mlp_block_forward(grid, ctx, wb.view(), x, y);
  }

  template <Communicator C>
  void mlp_backward(C& comm, const SublayerContext& ctx, const MlpShard& w, MlpSaved& saved,
                    TensorView<const float> dy, TensorView<float> dx, MlpShard& grad) const {
    const Grid<C> grid(comm, ctx, "Tp2d mlp backward", dy, dx);
    const auto pieces = mlp_pieces(ctx, grid.cy.geometry);
    const PooledBuffer<float> wb = gather_weights(grid, ctx, w.packed.view(), pieces);
    const PooledBuffer<float> gb = mlp_block_backward(grid, ctx, wb.view(), saved, dy, dx);
    scatter_gradient(grid, ctx, gb.view(), pieces, grad.packed.view());
  }

  // The pieces RingTp2d (strategy/ring_tp2d.hpp) composes: they run on any grid G of tp_x x tp_y ranks that has
  // Grid's members (its two groups, place (i, j), the y-rank context cy, sizes over its s tokens, and the order of
  // its tokens: rank_major_to_full / full_to_rank_major).

  // The MLP on a grid, its weight block wb: [ffn_in_rows_y + ffn_y, h / x] (gather_weights) in hand.
  template <class G>
  MlpSaved mlp_block_forward(G& grid, const SublayerContext& ctx, TensorView<const float> wb, TensorView<const float> x,
                             TensorView<float> y) const {
    const ShardGeometry& g = grid.cy.geometry;
    const auto [b, s, sx, hx] = grid.sizes;
    MlpSaved saved{copy_tensor<Backend>(x), Tensor<float>(Shape{b, sx, g.ffn_in_rows})};
    const TensorView<const float> w_in = wb.slice(0, 0, g.ffn_in_rows), w_out = wb.slice(0, g.ffn_in_rows, g.ffn);
    {
      PooledBuffer<float> x_full = ctx.pool->acquire<float>(Shape{b, s, hx});
      gather_columns(grid, ctx, x, x_full.view());
      PooledBuffer<float> partial = ctx.pool->acquire<float>(Shape{b, s, g.ffn_in_rows});
      Backend::matmul(rows_of(x_full.view()), ops::Transpose::no, w_in, ops::Transpose::yes, rows_of(partial.view()));
      x_full = PooledBuffer<float>();
      scatter_blocks(grid, ctx, partial.view(), saved.pre.view());
    }
    PooledBuffer<float> act_full = ctx.pool->acquire<float>(Shape{b, s, g.ffn});
    {
      PooledBuffer<float> act = ctx.pool->acquire<float>(Shape{b, sx, g.ffn});
      shard_activation_forward<Backend>(g, rows_of(saved.pre.view()), rows_of(act.view()));
      gather_blocks(grid, ctx, act.view(), act_full.view());
    }
    PooledBuffer<float> partial = ctx.pool->acquire<float>(Shape{b, s, hx});
    Backend::matmul(rows_of(act_full.view()), ops::Transpose::no, w_out, ops::Transpose::no, rows_of(partial.view()));
    act_full = PooledBuffer<float>();
    scatter_columns(grid, ctx, partial.view(), y);
    return saved;
  }

  // Its backward: dx, and the weight block's gradient (returned: [ffn_in_rows_y + ffn_y, h / x], for scatter_gradient).
  template <class G>
  PooledBuffer<float> mlp_block_backward(G& grid, const SublayerContext& ctx, TensorView<const float> wb,
                                         MlpSaved& saved, TensorView<const float> dy, TensorView<float> dx) const {
    const ShardGeometry& g = grid.cy.geometry;
    const auto [b, s, sx, hx] = grid.sizes;
    PooledBuffer<float> gb = ctx.pool->acquire<float>(wb.shape());
    Backend::fill(gb.view(), 0.0f);
    const TensorView<const float> w_in = wb.slice(0, 0, g.ffn_in_rows), w_out = wb.slice(0, g.ffn_in_rows, g.ffn);
    const TensorView<float> g_in = gb.view().slice(0, 0, g.ffn_in_rows), g_out = gb.view().slice(0, g.ffn_in_rows, g.ffn);
    PooledBuffer<float> dpre = ctx.pool->acquire<float>(Shape{b, sx, g.ffn_in_rows});
    {
      PooledBuffer<float> dy_full = ctx.pool->acquire<float>(Shape{b, s, hx});
      gather_columns(grid, ctx, dy, dy_full.view());
      PooledBuffer<float> act_full = ctx.pool->acquire<float>(Shape{b, s, g.ffn});
      {
        PooledBuffer<float> act = ctx.pool->acquire<float>(Shape{b, sx, g.ffn});
        shard_activation_forward<Backend>(g, rows_of(saved.pre.view()), rows_of(act.view()));  // recomputed
        gather_blocks(grid, ctx, act.view(), act_full.view());
      }
      Backend::matmul(rows_of(act_full.view()), ops::Transpose::yes, rows_of(dy_full.view()), ops::Transpose::no,
                      g_out, 1.0f, 1.0f);
      Backend::matmul(rows_of(dy_full.view()), ops::Transpose::no, w_out, ops::Transpose::yes,
                      rows_of(act_full.view()));  // d(act) over every token, partial over i: overwrites act_full
      dy_full = PooledBuffer<float>();
      PooledBuffer<float> dact = ctx.pool->acquire<float>(Shape{b, sx, g.ffn});
      scatter_blocks(grid, ctx, act_full.view(), dact.view());
      shard_activation_backward<Backend>(g, rows_of(saved.pre.view()), rows_of(dact.view()), rows_of(dpre.view()));
    }
    PooledBuffer<float> dpre_full = ctx.pool->acquire<float>(Shape{b, s, g.ffn_in_rows});
    gather_blocks(grid, ctx, dpre.view(), dpre_full.view());
    dpre = PooledBuffer<float>();
    linear_input_backward(grid, ctx, saved.x.view(), w_in, dpre_full.view(), g_in, dx);
    return gb;
  }

  // One call's prologue: its checks (the call supported, its two activations this rank's), my place (i, j) on the
  // grid, its two groups (the context's, split once; or the call's own), the context of the y-rank split (its shard
  // geometry: the heads and ffn columns of head block j), the sizes and the order of the group's tokens (natural).
  struct Sizes {
    std::int64_t b, s, sx, hx;  // batch, sequence, token block s / x, column block h / x
  };
  template <Communicator C>
  struct Grid {
    GridGroupsOfCall<C> groups;
    C& along_x;  // the tp_x group (ranks (., j)), my index i
    C& along_y;  // the tp_y group (ranks (i, .)), my index j
    int x = 1, y = 1, i = 0, j = 0;
    SublayerContext cy;
    Sizes sizes;
    Grid(C& comm, const SublayerContext& ctx, const char* who, TensorView<const float> in, TensorView<const float> out)
        : Grid(comm, checked(comm, ctx, who, in, out)) {}
    // A call on saved tensors alone (selective recomputation): its forward checked the activations.
    Grid(C& comm, const SublayerContext& ctx)
        : groups(ctx.tp_x_groups, comm, ctx.tp_x), along_x(groups.inner()), along_y(groups.outer()), x(ctx.tp_x),
          y(comm.size() / ctx.tp_x), i(comm.rank() % x), j(comm.rank() / x), cy(ctx),
          sizes{ctx.batch, ctx.length(), ctx.length() / x, ctx.hidden() / x} {
      cy.geometry = ShardGeometry(ctx.layer(), y);
    }
    // full: [b, s, width] (natural order) <- rank_major: [C][b, n, width] (the group's ranks' tokens), and back.
    void rank_major_to_full(const SublayerContext& ctx, std::int64_t width, const float* rank_major, float* full) const {
      rank_major_to_natural<Backend>(ctx.sequence, ctx.batch, width, rank_major, full);
    }
    void full_to_rank_major(const SublayerContext& ctx, std::int64_t width, const float* full, float* rank_major) const {
      natural_to_rank_major<Backend>(ctx.sequence, ctx.batch, width, full, rank_major);
    }
    // The context, once the call is checked.
    static const SublayerContext& checked(C& comm, const SublayerContext& ctx, const char* who,
                                          TensorView<const float> in, TensorView<const float> out) {
      require(Tp2d().supports(ctx));
      ctx.check_activation(who, "input", in, comm.rank());
      ctx.check_activation(who, "output", out, comm.rank());
      return ctx;
    }
  };
  // [b, len, w] as [b len, w].
  template <class T>
  static TensorView<T> rows_of(TensorView<T> t) { return t.reshape(Shape{t.extent(0) * t.extent(1), t.extent(2)}); }

  // The mask of token block i's queries over every token.
  template <class G>
  static ops::AttentionMask block_mask(const SublayerContext& ctx, const G& grid) {
    return ctx.attention_mask(std::int64_t(grid.i) * (ctx.length() / grid.x), 0);
  }
  // RoPE on a [b, s / x, R_y] block at its global positions i s / x, ...
  template <class G>
  static void rope_block(const SublayerContext& cy, const G& grid, TensorView<float> block, RopeDirection direction) {
    const std::int64_t sx = block.extent(1);
    rope_detail::rotate<Backend>(cy, block, direction, [&](auto&& run) { run(0, sx, std::int64_t(grid.i) * sx); });
  }

  // full: [b, s, h / x] (every token of the grid in its order, column block i) <- the unified x: [b, n, h].
  // All-to-all over tp_x (to layout A: row block j, column block i), then all-gather over tp_y.
  template <class G>
  void gather_columns(G& grid, const SublayerContext& ctx, TensorView<const float> x, TensorView<float> full) const {
    const std::int64_t b = ctx.batch, n = x.extent(1), hx = ctx.hidden() / grid.x;
    PooledBuffer<float> send = ctx.pool->acquire<float>(Shape{grid.x, b, n, hx});
    for (int k = 0; k < grid.x; ++k) Backend::copy(x.slice(2, k * hx, hx), send.view().slice(0, k, 1).reshape(Shape{b, n, hx}));
    PooledBuffer<float> a = ctx.pool->acquire<float>(Shape{grid.x, b, n, hx});  // layout A: ranks j x + k's tokens
    grid.along_x.all_to_all(read_span(send), a.span());
    send = PooledBuffer<float>();
    PooledBuffer<float> rank_major = ctx.pool->acquire<float>(Shape{grid.x * grid.y, b, n, hx});
    grid.along_y.all_gather(read_span(a), rank_major.span());  // rank r = j x + k at block r
    grid.rank_major_to_full(ctx, hx, rank_major.data(), full.data());
  }
  // y: [b, n, h] (overwritten, unified) <- the sum over tp_y of partial: [b, s, h / x] (the grid's order, column
  // block i).
  // Reduce-scatter over tp_y (to layout A), then all-to-all over tp_x.
  template <class G>
  void scatter_columns(G& grid, const SublayerContext& ctx, TensorView<const float> partial, TensorView<float> y) const {
    const std::int64_t b = ctx.batch, n = y.extent(1), hx = ctx.hidden() / grid.x;
    PooledBuffer<float> rank_major = ctx.pool->acquire<float>(Shape{grid.x * grid.y, b, n, hx});
    grid.full_to_rank_major(ctx, hx, partial.data(), rank_major.data());
    PooledBuffer<float> a = ctx.pool->acquire<float>(Shape{grid.x, b, n, hx});
    grid.along_y.reduce_scatter(read_span(rank_major), a.span(), ReduceOp::sum);
    rank_major = PooledBuffer<float>();
    PooledBuffer<float> mine = ctx.pool->acquire<float>(Shape{grid.x, b, n, hx});  // my tokens, column block k at k
    grid.along_x.all_to_all(read_span(a), mine.span());
    for (int k = 0; k < grid.x; ++k)
      Backend::copy(TensorView<const float>(mine.view()).slice(0, k, 1).reshape(Shape{b, n, hx}), y.slice(2, k * hx, hx));
  }
  // full: [b, s, w] <- block: [b, s / x, w], token block i of every sample (all-gather over tp_x). With dim = 2:
  // full: [b, s, x w] <- block: [b, s, w], column block i.
  template <class G>
  void gather_blocks(G& grid, const SublayerContext& ctx, TensorView<const float> block, TensorView<float> full,
                     int dim = 1) const {
    const std::int64_t len = block.extent(dim);
    PooledBuffer<float> all = ctx.pool->acquire<float>(Shape{grid.x, block.numel()});
    grid.along_x.all_gather(block.span(), all.span());
    for (int k = 0; k < grid.x; ++k)
      Backend::copy(TensorView<const float>(all.view()).slice(0, k, 1).reshape(block.shape()),
                    full.slice(dim, k * len, len));
  }
  // block: [b, s / x, w] (overwritten) <- the sum over tp_x of partial: [b, s, w], token block i (reduce-scatter).
  // With dim = 2: block: [b, s, w] <- partial: [b, s, x w], column block i.
  template <class G>
  void scatter_blocks(G& grid, const SublayerContext& ctx, TensorView<const float> partial, TensorView<float> block,
                      int dim = 1) const {
    const std::int64_t len = block.extent(dim);
    PooledBuffer<float> blocks = ctx.pool->acquire<float>(Shape{grid.x, block.numel()});
    for (int k = 0; k < grid.x; ++k)
      Backend::copy(partial.slice(dim, k * len, len), blocks.view().slice(0, k, 1).reshape(block.shape()));
    grid.along_x.reduce_scatter(read_span(blocks), block.span(), ReduceOp::sum);
  }
  // The backward of an A -> B linear for its input and weight: from dpre: [b, s, rows_y] (every token, natural), the
  // weight block's gradient g_w: [rows_y, h / x] += dpre^T x (x re-gathered from the unified x), and the unified
  // dx: [b, n, h] (overwritten) = dpre w, summed over tp_y.
  template <class G>
  void linear_input_backward(G& grid, const SublayerContext& ctx, TensorView<const float> x, TensorView<const float> w,
                             TensorView<const float> dpre, TensorView<float> g_w, TensorView<float> dx) const {
    const std::int64_t b = ctx.batch, s = grid.sizes.s, hx = ctx.hidden() / grid.x;
    PooledBuffer<float> x_full = ctx.pool->acquire<float>(Shape{b, s, hx});
    gather_columns(grid, ctx, x, x_full.view());
    Backend::matmul(rows_of(dpre), ops::Transpose::yes, rows_of(TensorView<const float>(x_full.view())),
                    ops::Transpose::no, g_w, 1.0f, 1.0f);
    Backend::matmul(rows_of(dpre), ops::Transpose::no, w, ops::Transpose::no, rows_of(x_full.view()));  // dx partial
    scatter_columns(grid, ctx, x_full.view(), dx);
  }

  // Weights. A sublayer's unified shard [rows_C, h] is a list of parts (q|k|v groups and proj; in (gate, up) and
  // out); the y-rank shard j packs each part of the x shards (., j) side by side: part p of shard k at row
  // y_start + k * rows. (Without replicated kv heads the y-rank packing is exactly that, kv group by kv group.)
  struct Part {
    std::int64_t c_start = 0, rows = 0, y_start = 0;  // in the unified shard; its length; in the y-rank shard
  };
  static std::vector<Part> attention_pieces(const SublayerContext& ctx, const ShardGeometry& gy) {
    const ShardGeometry& gc = ctx.geometry;
    return {{0, gc.qkv_rows, 0}, {gc.qkv_rows, gc.proj_rows, gy.qkv_rows}};
  }
  static std::vector<Part> mlp_pieces(const SublayerContext& ctx, const ShardGeometry& gy) {
    const ShardGeometry& gc = ctx.geometry;
    if (!gc.swiglu) return {{0, gc.ffn, 0}, {gc.ffn, gc.ffn, gy.ffn}};
    return {{0, gc.ffn, 0}, {gc.ffn, gc.ffn, gy.ffn}, {2 * gc.ffn, gc.ffn, 2 * gy.ffn}};  // gate, up, out
  }
  // block: [rows_y, h / x], block (j, i) of the y-rank shards <- my unified shard packed: [rows_C, h] (all-to-all
  // over tp_x: each of the x ranks (., j) sends column block k of its shard to rank (k, j)).
  template <class G>
  PooledBuffer<float> gather_weights(G& grid, const SublayerContext& ctx, TensorView<const float> packed,
                                     const std::vector<Part>& parts) const {
    const std::int64_t rows = packed.extent(0), hx = ctx.hidden() / grid.x;
    PooledBuffer<float> send = ctx.pool->acquire<float>(Shape{grid.x, rows, hx});
    for (int k = 0; k < grid.x; ++k)
      Backend::copy(packed.slice(1, k * hx, hx), send.view().slice(0, k, 1).reshape(Shape{rows, hx}));
    PooledBuffer<float> pieces = ctx.pool->acquire<float>(Shape{grid.x, rows, hx});  // shard of rank (k, j) at k
    grid.along_x.all_to_all(read_span(send), pieces.span());
    send = PooledBuffer<float>();
    PooledBuffer<float> block = ctx.pool->acquire<float>(Shape{grid.x * rows, hx});
    const TensorView<const float> from = pieces.view();
    for (int k = 0; k < grid.x; ++k)
      for (const Part& p : parts)
        Backend::copy(from.slice(0, k, 1).reshape(Shape{rows, hx}).slice(0, p.c_start, p.rows),
                      block.view().slice(0, p.y_start + k * p.rows, p.rows));
    return block;
  }
  // grad: [rows_C, h] += the gradient of my unified shard, from the blocks' gradients g_block: [rows_y, h / x] of
  // the x ranks (., j) (the inverse all-to-all over tp_x).
  template <class G>
  void scatter_gradient(G& grid, const SublayerContext& ctx, TensorView<const float> g_block,
                        const std::vector<Part>& parts, TensorView<float> grad) const {
    const std::int64_t rows = grad.extent(0), hx = ctx.hidden() / grid.x;
    PooledBuffer<float> send = ctx.pool->acquire<float>(Shape{grid.x, rows, hx});
    for (int k = 0; k < grid.x; ++k)
      for (const Part& p : parts)
        Backend::copy(g_block.slice(0, p.y_start + k * p.rows, p.rows),
                      send.view().slice(0, k, 1).reshape(Shape{rows, hx}).slice(0, p.c_start, p.rows));
    PooledBuffer<float> mine = ctx.pool->acquire<float>(Shape{grid.x, rows, hx});  // column block k at k
    grid.along_x.all_to_all(read_span(send), mine.span());
    for (int k = 0; k < grid.x; ++k)
      Backend::add_into(grad.slice(1, k * hx, hx), TensorView<const float>(mine.view()).slice(0, k, 1).reshape(Shape{rows, hx}));
  }
};

}  // namespace paradyse
