// paradyse/strategy/tp2d_linear.hpp: 2D tensor parallelism (Hypertron's "data-layout-friendly" 2D TP, after
// MindSpore's high-dimension tensor parallelism): a linear layer and a GELU MLP on an x * y grid of ranks whose
// activations and weights are both sharded on two axes.
//
// The grid is a DeviceMesh {tp_x: x, tp_y: y} (tp_y innermost). Two activation layouts of a token matrix [T, k]:
//   layout A: rank (i, j) holds rows block j of y and columns block i of x:  [T / y, k / x]
//   layout B: rank (i, j) holds rows block i of x and columns block j of y:  [T / x, k / y]
// A linear y = x W (W: [k, n]) from layout A to layout B, with W's block (i, j) [k / x, n / y] on rank (i, j):
//   all-gather x over tp_y (rows)          -> [T, k / x]
//   local GEMM with W_ij                   -> [T, n / y], a partial sum over i
//   reduce-scatter over tp_x (rows)        -> [T / x, n / y] = layout B.
// From layout B to layout A the axes swap (gather over tp_x, scatter over tp_y; W's block is [k / y, n / x]), so an
// MLP (A -> B, activation, B -> A) returns to its input's layout with no re-layout. Per rank and linear the traffic
// is T k (y - 1) / (x y) + T n (x - 1) / (x y) elements instead of 1D tensor parallelism's ~T (k or n).
// Backward: all-gather dy over the scatter group (the transpose of the reduce-scatter), dW = x_gathered^T dy
// (x is gathered again rather than kept), dx = reduce-scatter over the gather group of dy W^T.
// Token counts and widths must divide by the group sizes (checked, naming the sizes).
//
// Attention (tp2d_attention_forward/backward) on the same grid, from layout A back to layout A: the packed q, k, v
// projection is one A -> B linear, so rank (i, j) holds the q, k and v of token block i for head block j (heads
// split over tp_y); keys and values of every token are all-gathered over tp_x (rows), attention runs for the rank's
// queries (causal: at their global positions), and the output projection is a B -> A linear. Backward: the key and
// value gradients of every token are reduce-scattered over tp_x back to their token blocks.
//
// These are the scheme's building blocks on one sequence in tp2d's own layouts. The trainer's model runs the scheme as
// the Tp2d strategy (strategy/tp2d.hpp): from and to the unified layout, with batches, the packed weight shards,
// RoPE at global positions, GQA, SwiGLU and packed documents.
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/mesh/device_mesh.hpp"
#include "paradyse/ops/attention_mask.hpp"
#include "paradyse/ops/backend.hpp"
#include "paradyse/strategy/buffer_pool.hpp"

#include <cstdint>
#include <string_view>

namespace paradyse {

// My groups of a 2D tensor-parallel grid: along tp_x (the ranks sharing my tp_y coordinate) and along tp_y.
template <Communicator Comm>
struct Tp2dGrid {
  Comm x;  // size x, my index = my tp_x coordinate
  Comm y;  // size y, my index = my tp_y coordinate

  // Collective over `world` (every rank calls it): the mesh must have the two axes and world's size.
  static Tp2dGrid make(const DeviceMesh& mesh, Comm& world, std::string_view x_axis = "tp_x",
                       std::string_view y_axis = "tp_y") {
    const int xa = mesh.axis_index(x_axis), ya = mesh.axis_index(y_axis);
    return {mesh.group(world, std::span<const int>(&xa, 1)), mesh.group(world, std::span<const int>(&ya, 1))};
  }
};

// y: [T / s, n_l] (overwritten) = reduce_scatter over `scatter` of (all_gather over `gather` of x: [T / g, k_l])
// times w: [k_l, n_l]; rows split into g and s equal blocks. Layout A -> B: gather = tp_y, scatter = tp_x.
template <class Backend, Communicator Comm>
void tp2d_linear_forward(Comm& gather, Comm& scatter, BufferPool& pool, TensorView<const float> x,
                         TensorView<const float> w, TensorView<float> y) {
  const std::int64_t g = gather.size(), s = scatter.size();
  const std::int64_t rows = x.extent(0) * g, k = w.extent(0), n = w.extent(1);
  check(x.rank() == 2 && w.rank() == 2 && x.extent(1) == k, "tp2d_linear_forward: x {} must be [T / {}, k = {}]",
        x.shape(), g, k);
  check(rows % s == 0, "tp2d_linear_forward: {} tokens do not split over the scatter group of {}", rows, s);
  check(y.shape() == Shape{rows / s, n}, "tp2d_linear_forward: y {} must be [T / {} = {}, n = {}]", y.shape(), s,
        rows / s, n);
  PooledBuffer<float> gathered = pool.acquire<float>(Shape{rows, k});
  gather.all_gather(x.span(), gathered.span());
  if (s == 1) {
    Backend::matmul(gathered.view(), ops::Transpose::no, w, ops::Transpose::no, y);
    return;
  }
  PooledBuffer<float> partial = pool.acquire<float>(Shape{rows, n});
  Backend::matmul(gathered.view(), ops::Transpose::no, w, ops::Transpose::no, partial.view());
  gathered = PooledBuffer<float>();
  scatter.reduce_scatter(std::span<const float>(partial.span()), y.span(), ReduceOp::sum);
}

// dx: [T / g, k_l] (overwritten) and dw: [k_l, n_l] (accumulated) from dy: [T / s, n_l], for the forward above.
template <class Backend, Communicator Comm>
void tp2d_linear_backward(Comm& gather, Comm& scatter, BufferPool& pool, TensorView<const float> x,
                          TensorView<const float> w, TensorView<const float> dy, TensorView<float> dx,
                          TensorView<float> dw) {
  const std::int64_t g = gather.size(), s = scatter.size();
  const std::int64_t rows = x.extent(0) * g, k = w.extent(0), n = w.extent(1);
  check(x.rank() == 2 && x.extent(1) == k && dx.shape() == x.shape(),
        "tp2d_linear_backward: x {} and dx {} must be [T / {}, k = {}]", x.shape(), dx.shape(), g, k);
  check(dy.shape() == Shape{rows / s, n} && rows % s == 0, "tp2d_linear_backward: dy {} must be [T / {} = {}, n = {}]",
        dy.shape(), s, rows / s, n);
  check(dw.shape() == w.shape(), "tp2d_linear_backward: dw {} must match w {}", dw.shape(), w.shape());
  PooledBuffer<float> dy_full = pool.acquire<float>(Shape{rows, n});
  scatter.all_gather(dy.span(), dy_full.span());
  {
    PooledBuffer<float> x_full = pool.acquire<float>(Shape{rows, k});
    gather.all_gather(x.span(), x_full.span());
    Backend::matmul(x_full.view(), ops::Transpose::yes, dy_full.view(), ops::Transpose::no, dw, 1.0f, 1.0f);
  }
  if (g == 1) {
    Backend::matmul(dy_full.view(), ops::Transpose::no, w, ops::Transpose::yes, dx);
    return;
  }
  PooledBuffer<float> dx_partial = pool.acquire<float>(Shape{rows, k});
  Backend::matmul(dy_full.view(), ops::Transpose::no, w, ops::Transpose::yes, dx_partial.view());
  dy_full = PooledBuffer<float>();
  gather.reduce_scatter(std::span<const float>(dx_partial.span()), dx.span(), ReduceOp::sum);
}

// The GELU MLP out = gelu(x W1) W2 on the grid, from layout A back to layout A.
//   x, out: [T / y, h / x]; w1: block (i, j) of W1 [h, f]: [h / x, f / y]; w2: block (j, i) of W2 [f, h]:
//   [f / y, h / x]; pre: [T / x, f / y] (overwritten) keeps x W1 for the backward.
template <class Backend, Communicator Comm>
void tp2d_mlp_forward(Tp2dGrid<Comm>& grid, BufferPool& pool, TensorView<const float> x, TensorView<const float> w1,
                      TensorView<const float> w2, TensorView<float> pre, TensorView<float> out) {
  check(pre.rank() == 2 && pre.extent(1) == w1.extent(1) && w2.extent(0) == w1.extent(1),
        "tp2d_mlp_forward: pre {}, w1 {} and w2 {} disagree on f / y", pre.shape(), w1.shape(), w2.shape());
  tp2d_linear_forward<Backend>(grid.y, grid.x, pool, x, w1, pre);
  PooledBuffer<float> act = pool.acquire<float>(pre.shape());
  Backend::gelu_forward(TensorView<const float>(pre), act.view());
  tp2d_linear_forward<Backend>(grid.x, grid.y, pool, act.view(), w2, out);
}

// dx: [T / y, h / x] (overwritten); dw1, dw2 accumulated; from dout: [T / y, h / x].
template <class Backend, Communicator Comm>
void tp2d_mlp_backward(Tp2dGrid<Comm>& grid, BufferPool& pool, TensorView<const float> x, TensorView<const float> w1,
                       TensorView<const float> w2, TensorView<const float> pre, TensorView<const float> dout,
                       TensorView<float> dx, TensorView<float> dw1, TensorView<float> dw2) {
  PooledBuffer<float> act = pool.acquire<float>(pre.shape());
  Backend::gelu_forward(pre, act.view());  // recomputed rather than kept
  PooledBuffer<float> dact = pool.acquire<float>(pre.shape());
  tp2d_linear_backward<Backend>(grid.x, grid.y, pool, act.view(), w2, dout, dact.view(), dw2);
  act = PooledBuffer<float>();
  PooledBuffer<float> dpre = pool.acquire<float>(pre.shape());
  Backend::fill(dpre.view(), 0.0f);  // gelu_backward accumulates
  Backend::gelu_backward(pre, dact.view(), dpre.view());
  dact = PooledBuffer<float>();
  tp2d_linear_backward<Backend>(grid.y, grid.x, pool, x, w1, dpre.view(), dx, dw1);
}

// The heads of a 2D tensor-parallel attention: q_heads and kv_heads (both multiples of the tp_y size; q_heads a
// multiple of kv_heads) of head_dim each, causal or not, over one sequence of T tokens in natural order.
struct Tp2dAttentionHeads {
  std::int64_t q_heads = 1, kv_heads = 1, head_dim = 1;
  bool causal = false;

  // Rank (i, j)'s heads: those of block j of tp_y.
  std::int64_t local_q(std::int64_t y) const { return q_heads / y; }
  std::int64_t local_kv(std::int64_t y) const { return kv_heads / y; }
  // Columns of the rank's packed projection: its q heads, then its k heads, then its v heads, head_dim each.
  std::int64_t local_qkv_width(std::int64_t y) const { return (local_q(y) + 2 * local_kv(y)) * head_dim; }

  void check_for(std::int64_t y) const {
    check(q_heads >= 1 && kv_heads >= 1 && head_dim >= 1 && q_heads % kv_heads == 0,
          "tp2d attention: q_heads = {} must be a positive multiple of kv_heads = {} (head_dim {})", q_heads,
          kv_heads, head_dim);
    check(q_heads % y == 0 && kv_heads % y == 0,
          "tp2d attention: q_heads = {} and kv_heads = {} must split over tp_y of {}", q_heads, kv_heads, y);
  }
};

namespace tp2d_detail {

// A [rows, (hq + 2 hkv) d] packed projection as [1, rows, hq + 2 hkv, d], and its q, k or v heads.
inline TensorView<float> heads_view(TensorView<float> packed, std::int64_t first, std::int64_t count,
                                    std::int64_t head_dim) {
  return packed.reshape(Shape{1, packed.extent(0), packed.extent(1) / head_dim, head_dim}).slice(2, first, count);
}
inline TensorView<const float> heads_view(TensorView<const float> packed, std::int64_t first, std::int64_t count,
                                          std::int64_t head_dim) {
  return packed.reshape(Shape{1, packed.extent(0), packed.extent(1) / head_dim, head_dim}).slice(2, first, count);
}

}  // namespace tp2d_detail

// out: [T / y, h / x] (overwritten) = softmax(q k^T) v W_o of x: [T / y, h / x], layout A to layout A.
//   w_qkv: [h / x, (hq + 2 hkv) d / y]: rows block i of W_q, W_k, W_v [h, heads d] and, side by side, their
//          columns of head block j (q heads, k heads, v heads);
//   w_out: [hq d / y, h / x]: block (j, i) of W_o [hq d, h];
//   qkv:   [T / x, (hq + 2 hkv) d / y] (overwritten): token block i's q, k, v of head block j, kept for the backward;
//   attn:  [T / x, hq d / y] (overwritten): the attention output before W_o, kept;
//   lse:   [1, hq / y, T / x] (overwritten): the softmax statistics, kept.
template <class Backend, Communicator Comm>
void tp2d_attention_forward(Tp2dGrid<Comm>& grid, BufferPool& pool, const Tp2dAttentionHeads& heads,
                            TensorView<const float> x, TensorView<const float> w_qkv, TensorView<const float> w_out,
                            TensorView<float> qkv, TensorView<float> attn, TensorView<float> lse,
                            TensorView<float> out) {
  const std::int64_t gx = grid.x.size(), gy = grid.y.size(), d = heads.head_dim;
  heads.check_for(gy);
  const std::int64_t hq = heads.local_q(gy), hkv = heads.local_kv(gy), width = heads.local_qkv_width(gy);
  check(w_qkv.rank() == 2 && w_qkv.extent(1) == width, "tp2d_attention_forward: w_qkv {} must be [h / {}, {}] "
        "(this rank's {} q and {} kv heads of {})", w_qkv.shape(), gx, width, hq, hkv, d);
  const std::int64_t tokens = x.extent(0) * gy, block = tokens / gx;
  check(tokens % gx == 0 && qkv.shape() == Shape{block, width} && attn.shape() == Shape{block, hq * d} &&
        lse.shape() == Shape{1, hq, block},
        "tp2d_attention_forward: qkv {}, attn {} and lse {} must be [{}, {}], [{}, {}] and [1, {}, {}] ({} tokens "
        "over tp_x of {})", qkv.shape(), attn.shape(), lse.shape(), block, width, block, hq * d, hq, block, tokens, gx);
  tp2d_linear_forward<Backend>(grid.y, grid.x, pool, x, w_qkv, qkv);
  PooledBuffer<float> all = pool.acquire<float>(Shape{tokens, width});  // every token's k and v (and q)
  grid.x.all_gather(std::span<const float>(qkv.span()), all.span());
  const TensorView<const float> all_view = all.view(), local = qkv;
  using tp2d_detail::heads_view;
  const ops::AttentionMask mask{.causal = heads.causal, .q_offset = grid.x.rank() * block, .kv_offset = 0};
  Backend::attention_forward(heads_view(local, 0, hq, d), heads_view(all_view, hq, hkv, d),
                             heads_view(all_view, hq + hkv, hkv, d), mask, attn.reshape(Shape{1, block, hq, d}), lse);
  all = PooledBuffer<float>();
  tp2d_linear_forward<Backend>(grid.x, grid.y, pool, TensorView<const float>(attn), w_out, out);
}

// dx: [T / y, h / x] (overwritten); dw_qkv, dw_out accumulated; from dout: [T / y, h / x] and what the forward kept.
template <class Backend, Communicator Comm>
void tp2d_attention_backward(Tp2dGrid<Comm>& grid, BufferPool& pool, const Tp2dAttentionHeads& heads,
                             TensorView<const float> x, TensorView<const float> w_qkv, TensorView<const float> w_out,
                             TensorView<const float> qkv, TensorView<const float> attn, TensorView<const float> lse,
                             TensorView<const float> dout, TensorView<float> dx, TensorView<float> dw_qkv,
                             TensorView<float> dw_out) {
  const std::int64_t gx = grid.x.size(), gy = grid.y.size(), d = heads.head_dim;
  heads.check_for(gy);
  const std::int64_t hq = heads.local_q(gy), hkv = heads.local_kv(gy), width = heads.local_qkv_width(gy);
  const std::int64_t block = qkv.extent(0), tokens = block * gx;
  check(qkv.shape() == Shape{block, width} && attn.shape() == Shape{block, hq * d},
        "tp2d_attention_backward: qkv {} and attn {} must be [T / {}, {}] and [T / {}, {}]", qkv.shape(), attn.shape(),
        gx, width, gx, hq * d);
  PooledBuffer<float> dattn = pool.acquire<float>(attn.shape());
  tp2d_linear_backward<Backend>(grid.x, grid.y, pool, attn, w_out, dout, dattn.view(), dw_out);
  PooledBuffer<float> dqkv = pool.acquire<float>(qkv.shape());
  {
    PooledBuffer<float> all = pool.acquire<float>(Shape{tokens, width});
    grid.x.all_gather(qkv.span(), all.span());
    PooledBuffer<float> dall = pool.acquire<float>(Shape{tokens, width});  // dq of my tokens, dk and dv of all
    Backend::fill(dall.view(), 0.0f);  // attention_backward accumulates
    using tp2d_detail::heads_view;
    const TensorView<const float> all_view = all.view();
    const TensorView<float> dall_view = dall.view(), dmine = dall_view.slice(0, grid.x.rank() * block, block);
    const ops::AttentionMask mask{.causal = heads.causal, .q_offset = grid.x.rank() * block, .kv_offset = 0};
    Backend::attention_backward(heads_view(qkv, 0, hq, d), heads_view(all_view, hq, hkv, d),
                                heads_view(all_view, hq + hkv, hkv, d), attn.reshape(Shape{1, block, hq, d}), lse,
                                TensorView<const float>(dattn.view()).reshape(Shape{1, block, hq, d}), mask,
                                heads_view(dmine, 0, hq, d), heads_view(dall_view, hq, hkv, d),
                                heads_view(dall_view, hq + hkv, hkv, d));
    dattn = PooledBuffer<float>();
    grid.x.reduce_scatter(std::span<const float>(dall.span()), dqkv.span(), ReduceOp::sum);
  }
  tp2d_linear_backward<Backend>(grid.y, grid.x, pool, x, w_qkv, TensorView<const float>(dqkv.view()), dx, dw_qkv);
}

}  // namespace paradyse
