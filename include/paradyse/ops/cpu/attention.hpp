// paradyse/ops/cpu/attention.hpp: flash-style attention on the CPU (forward, backward, merge of partial results).
//
// Tiled over queries (q_block rows) and keys (kv_block columns) with an online softmax: the score tile is a GEMM,
// softmax runs on the tile, and P*V is a GEMM, so memory stays O(s*d) (never an s x s matrix) and the time goes to
// GEMM-shaped work. Backward recomputes the probabilities from the saved log-sum-exp (FlashAttention-2 order: key
// tiles outside, query tiles inside) and accumulates every gradient straight into the caller's tensors.
// The plain float64 reference lives in tests/ops/reference.hpp.
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/ops/attention_mask.hpp"
#include "paradyse/ops/cpu/attention_tiles.hpp"
#include "paradyse/ops/cpu/gemm.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace paradyse::ops::cpu {

namespace detail {

struct AttentionDims {
  std::int64_t batch, q_len, kv_len, q_heads, kv_heads, head_dim;
  std::int64_t group() const { return q_heads / kv_heads; }
};

inline bool unit_last_stride(const TensorView<const float>& x) { return x.extent(3) <= 1 || x.strides()[3] == 1; }

inline AttentionDims check_attention_inputs(const char* op, const TensorView<const float>& q,
                                            const TensorView<const float>& k, const TensorView<const float>& v,
                                            const AttentionMask& mask) {
  check(q.rank() == 4 && k.rank() == 4 && v.rank() == 4,
        "{}: q, k, v must be [b, s, heads, d]; got q {}, k {}, v {}", op, q.shape(), k.shape(), v.shape());
  const AttentionDims dims{q.extent(0), q.extent(1), k.extent(1), q.extent(2), k.extent(2), q.extent(3)};
  check(k.shape() == v.shape(), "{}: k {} and v {} must have the same shape", op, k.shape(), v.shape());
  check(k.extent(0) == dims.batch, "{}: k has batch {}, q has batch {}", op, k.extent(0), dims.batch);
  check(k.extent(3) == dims.head_dim, "{}: k has head_dim {}, q has head_dim {}", op, k.extent(3), dims.head_dim);
  check(dims.head_dim >= 1, "{}: head_dim = {} must be positive", op, dims.head_dim);
  check(dims.kv_heads >= 1 && dims.q_heads % dims.kv_heads == 0,
        "{}: q heads = {} must be a multiple of kv heads = {} (GQA)", op, dims.q_heads, dims.kv_heads);
  check(unit_last_stride(q) && unit_last_stride(k) && unit_last_stride(v),
        "{}: the head dimension must have unit stride; strides are q {}, k {}, v {}", op, q.strides(), k.strides(),
        v.strides());
  validate(mask);
  return dims;
}

inline void check_same(const char* op, const char* name, const Shape& got, const Shape& want) {
  check(got == want, "{}: {} has shape {}, expected {}", op, name, got, want);
}

// A row stride a GEMM accepts even for a one-row view (whose row stride may be anything).
inline std::int64_t row_stride(const TensorView<const float>& x, std::int64_t head_dim) {
  return x.extent(1) <= 1 ? head_dim : x.strides()[1];
}

// Visible local key range of every query of the block: ranges[2i] = first, ranges[2i+1] = last.
inline Tensor<std::int64_t> visible_ranges(const AttentionMask& mask, std::int64_t q_len, std::int64_t kv_len) {
  Tensor<std::int64_t> ranges(Shape{q_len, 2});
  for (std::int64_t i = 0; i < q_len; ++i) {
    const KeyRange r = visible_key_range(mask, i, kv_len);
    ranges(i, 0) = r.first;
    ranges(i, 1) = r.last;
  }
  return ranges;
}

}  // namespace detail

// q: [b, sq, hq, d]; k, v: [b, skv, hkv, d] with hq % hkv == 0 (query head j uses kv head j / (hq/hkv)).
// Any strides, but the last dim (d) has unit stride (q/k/v are usually slices of one packed qkv tensor).
// out: [b, sq, hq, d]; lse: [b, hq, sq], natural-log log-sum-exp of the scaled scores. A query that sees no key
// gets out = 0 and lse = -inf. Both outputs are overwritten.
inline void attention_forward(TensorView<const float> q, TensorView<const float> k, TensorView<const float> v,
                              const AttentionMask& mask, TensorView<float> out, TensorView<float> lse) {
  constexpr const char* op = "attention_forward";
  const detail::AttentionDims dims = detail::check_attention_inputs(op, q, k, v, mask);
  detail::check_same(op, "out", out.shape(), q.shape());
  detail::check_same(op, "lse", lse.shape(), Shape{dims.batch, dims.q_heads, dims.q_len});
  check(detail::unit_last_stride(out), "{}: out's head dimension must have unit stride; strides are {}", op,
        out.strides());
  const std::int64_t d = dims.head_dim;
  const float scale = attention_scale(mask, d);
  const AttentionTiling tiling = attention_tiling(d);
  const Tensor<std::int64_t> ranges = detail::visible_ranges(mask, dims.q_len, dims.kv_len);
  detail::ForwardScratch scratch(tiling, d);
  const detail::TileSteps steps = detail::tile_steps();

  const std::int64_t ld_q = detail::row_stride(q, d), ld_k = detail::row_stride(k, d), ld_v = detail::row_stride(v, d);
  for (std::int64_t bi = 0; bi < dims.batch; ++bi)
    for (std::int64_t h = 0; h < dims.q_heads; ++h) {
      const std::int64_t kvh = h / dims.group();
      const float* q_head = &q(bi, 0, h, 0);
      const float* k_head = &k(bi, 0, kvh, 0);
      const float* v_head = &v(bi, 0, kvh, 0);
      for (std::int64_t i0 = 0; i0 < dims.q_len; i0 += tiling.q_block) {
        const std::int64_t rows = std::min(tiling.q_block, dims.q_len - i0);
        const std::int64_t* tile_ranges = ranges.data() + 2 * i0;
        const KeyRange keys = detail::union_of_ranges(tile_ranges, rows);
        scratch.start_rows(rows);
        // Key tiles on the same grid as backward, so that both compute bitwise the same scores (with scores near
        // float max, one ulp of difference would move exp(s - lse) far from the forward's probabilities).
        for (std::int64_t j0 = keys.first / tiling.kv_block * tiling.kv_block; j0 < keys.last; j0 += tiling.kv_block) {
          const std::int64_t cols = std::min(tiling.kv_block, dims.kv_len - j0);
          const detail::TileVisibility vis = detail::classify_tile(tile_ranges, rows, j0, cols);
          if (vis == detail::TileVisibility::none) continue;
          float* scores = scratch.scores.data();
          const std::int64_t ld_s = tiling.kv_block;
          // scores: [rows, cols] = scale * q_tile k_tile^T
          gemm(Transpose::no, Transpose::yes, rows, cols, d, scale, q_head + i0 * ld_q, ld_q, k_head + j0 * ld_k, ld_k,
               0.0f, scores, ld_s);
          steps.online_softmax(scores, ld_s, rows, cols, j0, tile_ranges, vis == detail::TileVisibility::partial,
                                      scratch.row_max.data(), scratch.row_sum.data(), scratch.acc.data(), d);
          // acc: [rows, d] += p v_tile
          gemm(Transpose::no, Transpose::no, rows, d, cols, 1.0f, scores, ld_s, v_head + j0 * ld_v, ld_v, 1.0f,
               scratch.acc.data(), d);
        }
        for (std::int64_t r = 0; r < rows; ++r) {
          float* out_row = &out(bi, i0 + r, h, 0);
          const float l = scratch.row_sum(r), m = scratch.row_max(r);
          const float* acc_row = scratch.acc.data() + r * d;
          if (l > 0.0f || l != l) {  // a NaN score (NaN in q, k or v) stays NaN: never turned into "no key seen"
            const float inv = 1.0f / l;
            for (std::int64_t c = 0; c < d; ++c) out_row[c] = acc_row[c] * inv;
            lse(bi, h, i0 + r) = m + std::log(l);
          } else {
            for (std::int64_t c = 0; c < d; ++c) out_row[c] = 0.0f;
            lse(bi, h, i0 + r) = -std::numeric_limits<float>::infinity();
          }
        }
      }
    }
}

// Gradients ACCUMULATE (+=) into dq: [b, sq, hq, d], dk, dv: [b, skv, hkv, d]. out and lse are the FINAL output and
// log-sum-exp of these queries over ALL key blocks (so ring attention can run backward block by block);
// dout: [b, sq, hq, d]. Recomputes probabilities from lse; never materialises sq x skv.
inline void attention_backward(TensorView<const float> q, TensorView<const float> k, TensorView<const float> v,
                               TensorView<const float> out, TensorView<const float> lse, TensorView<const float> dout,
                               const AttentionMask& mask, TensorView<float> dq, TensorView<float> dk,
                               TensorView<float> dv) {
  constexpr const char* op = "attention_backward";
  const detail::AttentionDims dims = detail::check_attention_inputs(op, q, k, v, mask);
  detail::check_same(op, "out", out.shape(), q.shape());
  detail::check_same(op, "dout", dout.shape(), q.shape());
  detail::check_same(op, "dq", dq.shape(), q.shape());
  detail::check_same(op, "dk", dk.shape(), k.shape());
  detail::check_same(op, "dv", dv.shape(), v.shape());
  detail::check_same(op, "lse", lse.shape(), Shape{dims.batch, dims.q_heads, dims.q_len});
  check(detail::unit_last_stride(out) && detail::unit_last_stride(dout) && detail::unit_last_stride(dq) &&
            detail::unit_last_stride(dk) && detail::unit_last_stride(dv),
        "{}: the head dimension of out, dout, dq, dk, dv must have unit stride", op);
  const std::int64_t d = dims.head_dim;
  const float scale = attention_scale(mask, d);
  const AttentionTiling tiling = attention_tiling(d);
  const Tensor<std::int64_t> ranges = detail::visible_ranges(mask, dims.q_len, dims.kv_len);
  detail::BackwardScratch scratch(tiling, dims.q_len);
  const detail::TileSteps steps = detail::tile_steps();

  const std::int64_t ld_q = detail::row_stride(q, d), ld_k = detail::row_stride(k, d), ld_v = detail::row_stride(v, d);
  const std::int64_t ld_do = detail::row_stride(dout, d), ld_dq = detail::row_stride(dq, d);
  const std::int64_t ld_dk = detail::row_stride(dk, d), ld_dv = detail::row_stride(dv, d);
  const std::int64_t ld_s = tiling.kv_block;
  for (std::int64_t bi = 0; bi < dims.batch; ++bi)
    for (std::int64_t h = 0; h < dims.q_heads; ++h) {
      const std::int64_t kvh = h / dims.group();
      const float* q_head = &q(bi, 0, h, 0);
      const float* k_head = &k(bi, 0, kvh, 0);
      const float* v_head = &v(bi, 0, kvh, 0);
      const float* do_head = &dout(bi, 0, h, 0);
      float* dq_head = &dq(bi, 0, h, 0);
      float* dk_head = &dk(bi, 0, kvh, 0);
      float* dv_head = &dv(bi, 0, kvh, 0);
      // delta_i = dout_i . out_i (the softmax backward's row term); a query without keys (lse = -inf) gets
      // probabilities exp(s - inf) = 0 everywhere.
      for (std::int64_t i = 0; i < dims.q_len; ++i) {
        const float* o_row = &out(bi, i, h, 0);
        const float* do_row = do_head + i * ld_do;
        float delta = 0.0f;
        for (std::int64_t c = 0; c < d; ++c) delta += o_row[c] * do_row[c];
        scratch.delta(i) = delta;
        const float l = lse(bi, h, i);
        scratch.lse(i) = l == -std::numeric_limits<float>::infinity() ? std::numeric_limits<float>::infinity() : l;
      }
      for (std::int64_t j0 = 0; j0 < dims.kv_len; j0 += tiling.kv_block) {
        const std::int64_t cols = std::min(tiling.kv_block, dims.kv_len - j0);
        for (std::int64_t i0 = 0; i0 < dims.q_len; i0 += tiling.q_block) {
          const std::int64_t rows = std::min(tiling.q_block, dims.q_len - i0);
          const std::int64_t* tile_ranges = ranges.data() + 2 * i0;
          const detail::TileVisibility vis = detail::classify_tile(tile_ranges, rows, j0, cols);
          if (vis == detail::TileVisibility::none) continue;
          float* p = scratch.probabilities.data();
          float* dp = scratch.probability_grads.data();
          // p: [rows, cols] = exp(scale * q_tile k_tile^T - lse)
          gemm(Transpose::no, Transpose::yes, rows, cols, d, scale, q_head + i0 * ld_q, ld_q, k_head + j0 * ld_k, ld_k,
               0.0f, p, ld_s);
          steps.probabilities(p, ld_s, rows, cols, j0, tile_ranges, vis == detail::TileVisibility::partial,
                                         scratch.lse.data() + i0);
          // dv_tile: [cols, d] += p^T dout_tile
          gemm(Transpose::yes, Transpose::no, cols, d, rows, 1.0f, p, ld_s, do_head + i0 * ld_do, ld_do, 1.0f,
               dv_head + j0 * ld_dv, ld_dv);
          // dp: [rows, cols] = dout_tile v_tile^T, then ds = p * (dp - delta) in place
          gemm(Transpose::no, Transpose::yes, rows, cols, d, 1.0f, do_head + i0 * ld_do, ld_do, v_head + j0 * ld_v,
               ld_v, 0.0f, dp, ld_s);
          steps.softmax_grad(p, dp, ld_s, rows, cols, scratch.delta.data() + i0);
          // dq_tile: [rows, d] += scale * ds k_tile;  dk_tile: [cols, d] += scale * ds^T q_tile
          gemm(Transpose::no, Transpose::no, rows, d, cols, scale, dp, ld_s, k_head + j0 * ld_k, ld_k, 1.0f,
               dq_head + i0 * ld_dq, ld_dq);
          gemm(Transpose::yes, Transpose::no, cols, d, rows, scale, dp, ld_s, q_head + i0 * ld_q, ld_q, 1.0f,
               dk_head + j0 * ld_dk, ld_dk);
        }
      }
    }
}

// Merges the partial result (block_out, block_lse) of the same queries over another key block into (out, lse):
// lse' = max + log(exp(lse - max) + exp(block_lse - max)); out' = weights of each side by exp(lse_side - lse').
// Handles -inf on either side. out: [b, sq, hq, d]; lse: [b, hq, sq].
inline void attention_merge(TensorView<float> out, TensorView<float> lse, TensorView<const float> block_out,
                            TensorView<const float> block_lse) {
  constexpr const char* op = "attention_merge";
  check(out.rank() == 4, "{}: out must be [b, sq, hq, d]; got {}", op, out.shape());
  detail::check_same(op, "block_out", block_out.shape(), out.shape());
  const Shape lse_shape{out.extent(0), out.extent(2), out.extent(1)};
  detail::check_same(op, "lse", lse.shape(), lse_shape);
  detail::check_same(op, "block_lse", block_lse.shape(), lse_shape);
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const std::int64_t d = out.extent(3);
  for (std::int64_t bi = 0; bi < out.extent(0); ++bi)
    for (std::int64_t h = 0; h < out.extent(2); ++h)
      for (std::int64_t i = 0; i < out.extent(1); ++i) {
        const float mine = lse(bi, h, i), theirs = block_lse(bi, h, i);
        if (mine != mine || theirs != theirs) {  // a NaN side (NaN inputs) makes the merged row NaN, not the other side
          for (std::int64_t c = 0; c < d; ++c) out(bi, i, h, c) = std::numeric_limits<float>::quiet_NaN();
          lse(bi, h, i) = std::numeric_limits<float>::quiet_NaN();
          continue;
        }
        const float top = std::max(mine, theirs);
        if (top == kNegInf) continue;  // neither side saw a key: out stays 0, lse -inf
        const float w_mine = std::exp(mine - top), w_theirs = std::exp(theirs - top);  // exp(-inf) = 0
        const float total = w_mine + w_theirs;                                        // in [1, 2]
        const float a = w_mine / total, b = w_theirs / total;
        for (std::int64_t c = 0; c < d; ++c) {
          float& o = out(bi, i, h, c);
          // A side with weight 0 may hold anything finite; skip it so that 0 * garbage cannot leak in.
          o = (a == 0.0f ? 0.0f : a * o) + (b == 0.0f ? 0.0f : b * block_out(bi, i, h, c));
        }
        lse(bi, h, i) = top + std::log(total);
      }
}

}  // namespace paradyse::ops::cpu
