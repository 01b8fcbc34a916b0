// paradyse/ops/cpu/attention_tiles.hpp: the tiling policy and the per-tile softmax steps of CPU flash attention.
//
// Kept apart from the loops in attention.hpp (CUB's split: tuning, then algorithm). Tile loops are written with
// fixed-width partial reductions so that they vectorise without -ffast-math.
#pragma once

#include "paradyse/core/tensor.hpp"
#include "paradyse/ops/attention_mask.hpp"
#include "paradyse/ops/cpu/gemm.hpp"
#include "paradyse/ops/cpu/simd.hpp"
#include "paradyse/ops/cpu/vector_math.hpp"

#include <algorithm>
#include <cstdint>
#include <limits>

namespace paradyse::ops::cpu {

// Rows of queries and columns of keys per tile. The score tile (q_block x kv_block floats) and the q, k, v tiles
// stay in L2 (1 MiB per core on the reference machine).
struct AttentionTiling {
  std::int64_t q_block = 128;
  std::int64_t kv_block = 256;
  friend bool operator==(const AttentionTiling&, const AttentionTiling&) = default;
};

// Measured on Zen 4 (bench/ops_bench, s = 4K): 128 x 256 beat 64 x 128 by ~25% at d = 64 and 128. Larger heads
// take smaller tiles to keep q, k, v and score tiles within L2. Forward and backward use the same grid, so they
// compute bitwise the same scores.
inline AttentionTiling attention_tiling(std::int64_t head_dim) {
  if (head_dim <= 128) return {128, 256};
  return {64, 128};
}

namespace detail {

inline constexpr float kNegativeInfinity = -std::numeric_limits<float>::infinity();

enum class TileVisibility { none, all, partial };

// The smallest key range covering the visible ranges of `rows` queries (ranges: [first, last) pairs).
inline KeyRange union_of_ranges(const std::int64_t* ranges, std::int64_t rows) {
  KeyRange all{std::numeric_limits<std::int64_t>::max(), 0};
  for (std::int64_t r = 0; r < rows; ++r) {
    if (ranges[2 * r] >= ranges[2 * r + 1]) continue;
    all.first = std::min(all.first, ranges[2 * r]);
    all.last = std::max(all.last, ranges[2 * r + 1]);
  }
  if (all.first >= all.last) return {0, 0};
  return all;
}

// Whether the keys [j0, j0 + cols) are seen by none, all or some of the (query, key) pairs of the tile.
inline TileVisibility classify_tile(const std::int64_t* ranges, std::int64_t rows, std::int64_t j0, std::int64_t cols) {
  bool any = false, every = true;
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t first = ranges[2 * r], last = ranges[2 * r + 1];
    if (first < last && first < j0 + cols && last > j0) any = true;
    if (!(first <= j0 && last >= j0 + cols)) every = false;
  }
  if (!any) return TileVisibility::none;
  return every ? TileVisibility::all : TileVisibility::partial;
}

// Columns [lo, hi) of the tile that row r sees.
inline KeyRange tile_columns(const std::int64_t* ranges, std::int64_t r, std::int64_t j0, std::int64_t cols) {
  const std::int64_t first = ranges[2 * r], last = ranges[2 * r + 1];
  if (first >= last) return {0, 0};
  const std::int64_t lo = std::clamp<std::int64_t>(first - j0, 0, cols);
  const std::int64_t hi = std::clamp<std::int64_t>(last - j0, 0, cols);
  return {lo, std::max(lo, hi)};
}

// Sets the masked columns of a score row to -inf.
inline void mask_row(float* row, std::int64_t cols, KeyRange visible) {
  for (std::int64_t c = 0; c < visible.first; ++c) row[c] = kNegativeInfinity;
  for (std::int64_t c = visible.last; c < cols; ++c) row[c] = kNegativeInfinity;
}

// Online softmax over one score tile (scores: [rows, cols], leading dimension ld): masks it (when partial), turns
// it into exp(s - running max) in place, and rescales the running sums and the output accumulator
// (acc: [rows, head_dim]) to the new maxima. row_max starts at -inf and row_sum at 0.
[[gnu::always_inline]] inline void online_softmax_body(float* scores, std::int64_t ld, std::int64_t rows,
                                                       std::int64_t cols, std::int64_t j0, const std::int64_t* ranges,
                                                       bool partial, float* row_max, float* row_sum, float* acc,
                                                       std::int64_t head_dim) {
  for (std::int64_t r = 0; r < rows; ++r) {
    float* row = scores + r * ld;
    if (partial) mask_row(row, cols, tile_columns(ranges, r, j0, cols));
    const float old_max = row_max[r];
    const float new_max = std::max(old_max, maximum(row, cols));
    // A row that has seen no key yet keeps max -inf; shift by 0 so that exp(-inf - shift) = 0, never NaN.
    const float shift = new_max == kNegativeInfinity ? 0.0f : new_max;
    for (std::int64_t c = 0; c < cols; ++c) row[c] -= shift;
    exp_approx_in_place(row, cols);
    const float correction = exp_approx(old_max - shift);  // 0 when old_max = -inf
    row_sum[r] = row_sum[r] * correction + sum(row, cols);
    row_max[r] = new_max;
    if (correction != 1.0f) {
      float* acc_row = acc + r * head_dim;
      for (std::int64_t c = 0; c < head_dim; ++c) acc_row[c] *= correction;
    }
  }
}

// p = exp(s - lse) in place (s: [rows, cols], leading dimension ld), masked columns 0. lse_rows holds +inf for a
// query that sees no key at all, which makes its row 0.
[[gnu::always_inline]] inline void probabilities_body(float* scores, std::int64_t ld, std::int64_t rows,
                                                      std::int64_t cols, std::int64_t j0, const std::int64_t* ranges,
                                                      bool partial, const float* lse_rows) {
  for (std::int64_t r = 0; r < rows; ++r) {
    float* row = scores + r * ld;
    if (partial) mask_row(row, cols, tile_columns(ranges, r, j0, cols));
    const float l = lse_rows[r];
    // s <= lse holds in exact arithmetic; the clamp keeps rounding from ever giving p > 1.
    for (std::int64_t c = 0; c < cols; ++c) {
      const float x = row[c] - l;
      row[c] = x > 0.0f ? 0.0f : x;  // NaN stays NaN
    }
    exp_approx_in_place(row, cols);
  }
}

// ds = p * (dp - delta) in place of dp (both [rows, cols], leading dimension ld).
[[gnu::always_inline]] inline void softmax_grad_body(const float* p, float* dp, std::int64_t ld, std::int64_t rows,
                                                     std::int64_t cols, const float* delta) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* p_row = p + r * ld;
    float* dp_row = dp + r * ld;
    const float dr = delta[r];
    for (std::int64_t c = 0; c < cols; ++c) dp_row[c] = p_row[c] * (dp_row[c] - dr);
  }
}

// The tile steps compiled for each instruction set (see simd.hpp).
#define PARADYSE_ATTENTION_TILE_STEPS(suffix, target)                                                              \
  target inline void online_softmax_##suffix(float* s, std::int64_t ld, std::int64_t rows, std::int64_t cols,      \
                                             std::int64_t j0, const std::int64_t* ranges, bool partial, float* mx, \
                                             float* sm, float* acc, std::int64_t d) {                              \
    online_softmax_body(s, ld, rows, cols, j0, ranges, partial, mx, sm, acc, d);                                   \
  }                                                                                                                \
  target inline void probabilities_##suffix(float* s, std::int64_t ld, std::int64_t rows, std::int64_t cols,       \
                                            std::int64_t j0, const std::int64_t* ranges, bool partial,             \
                                            const float* lse) {                                                    \
    probabilities_body(s, ld, rows, cols, j0, ranges, partial, lse);                                               \
  }                                                                                                                \
  target inline void softmax_grad_##suffix(const float* p, float* dp, std::int64_t ld, std::int64_t rows,          \
                                           std::int64_t cols, const float* delta) {                                \
    softmax_grad_body(p, dp, ld, rows, cols, delta);                                                               \
  }
PARADYSE_ATTENTION_TILE_STEPS(base, )
#if defined(PARADYSE_X86_DISPATCH)
PARADYSE_ATTENTION_TILE_STEPS(avx2, PARADYSE_TARGET_AVX2)
PARADYSE_ATTENTION_TILE_STEPS(avx512, PARADYSE_TARGET_AVX512)
#endif
#undef PARADYSE_ATTENTION_TILE_STEPS

// The three steps for the current simd_level().
struct TileSteps {
  void (*online_softmax)(float*, std::int64_t, std::int64_t, std::int64_t, std::int64_t, const std::int64_t*, bool,
                         float*, float*, float*, std::int64_t);
  void (*probabilities)(float*, std::int64_t, std::int64_t, std::int64_t, std::int64_t, const std::int64_t*, bool,
                        const float*);
  void (*softmax_grad)(const float*, float*, std::int64_t, std::int64_t, std::int64_t, const float*);
};
inline TileSteps tile_steps() {
  switch (simd_level()) {
#if defined(PARADYSE_X86_DISPATCH)
    case SimdLevel::avx512: return {online_softmax_avx512, probabilities_avx512, softmax_grad_avx512};
    case SimdLevel::avx2: return {online_softmax_avx2, probabilities_avx2, softmax_grad_avx2};
#endif
    default: return {online_softmax_base, probabilities_base, softmax_grad_base};
  }
}

// Workspace of one attention_forward call: O(tile) floats, tracked.
struct ForwardScratch {
  Tensor<float> scores, acc, row_max, row_sum;
  ForwardScratch(const AttentionTiling& tiling, std::int64_t head_dim)
      : scores(Shape{tiling.q_block, tiling.kv_block}), acc(Shape{tiling.q_block, head_dim}),
        row_max(Shape{tiling.q_block}), row_sum(Shape{tiling.q_block}) {}
  void start_rows(std::int64_t rows) {
    std::fill(row_max.data(), row_max.data() + rows, kNegativeInfinity);
    std::fill(row_sum.data(), row_sum.data() + rows, 0.0f);
    std::fill(acc.data(), acc.data() + rows * acc.extent(1), 0.0f);
  }
};

// Tracker bytes of one attention_forward / attention_backward call's workspace, each allocation rounded as the tracker
// rounds it (the dry run reports this; the memory validation test holds it equal to what the kernel allocates): the
// per-query visible ranges [sq, 2] int64, the call's scratch (ForwardScratch or BackwardScratch), and on top of them
// the largest packing workspace of a tile GEMM (the built-in GEMM packs its panels into a workspace that comes and goes
// within each product; none where every tile product runs through CBLAS: gemm.hpp's choice per size class).
inline std::size_t tracked(std::size_t bytes) { return (bytes + kAlignment - 1) / kAlignment * kAlignment; }
// A tile is [rows, cols]: rows a full q_block or the sequence's last rows, cols a full kv_block or the last keys.
// Forward: scores [rows, cols] = q k^T (k = d), acc [rows, d] += p v (k = cols). Backward adds dp [rows, cols] =
// do v^T, dq [rows, d] += dp k, and dk, dv [cols, d] += dp^T q, p^T do (k = rows).
inline std::size_t tile_gemm_workspace_bytes(const AttentionTiling& t, std::int64_t q_len, std::int64_t kv_len,
                                             std::int64_t head_dim, bool backward) {
  std::size_t most = 0;
  const auto product = [&](std::int64_t m, std::int64_t n, std::int64_t k) {
    most = std::max(most, tracked(gemm_workspace_floats(m, n, k, 1.0f) * sizeof(float)));
  };
  for (const std::int64_t rows : {std::min(t.q_block, q_len), q_len % t.q_block})
    for (const std::int64_t cols : {std::min(t.kv_block, kv_len), kv_len % t.kv_block}) {
      if (rows == 0 || cols == 0) continue;
      product(rows, cols, head_dim);
      product(rows, head_dim, cols);
      if (backward) product(cols, head_dim, rows);
    }
  return most;
}
inline std::size_t forward_workspace_bytes(const AttentionTiling& t, std::int64_t q_len, std::int64_t kv_len,
                                           std::int64_t head_dim) {
  const auto f = [](std::int64_t n) { return tracked(std::size_t(n) * sizeof(float)); };
  return tracked(std::size_t(q_len) * 2 * sizeof(std::int64_t)) + f(t.q_block * t.kv_block) + f(t.q_block * head_dim) +
         2 * f(t.q_block) + tile_gemm_workspace_bytes(t, q_len, kv_len, head_dim, false);
}
inline std::size_t backward_workspace_bytes(const AttentionTiling& t, std::int64_t q_len, std::int64_t kv_len,
                                            std::int64_t head_dim) {
  const auto f = [](std::int64_t n) { return tracked(std::size_t(n) * sizeof(float)); };
  return tracked(std::size_t(q_len) * 2 * sizeof(std::int64_t)) + 2 * f(t.q_block * t.kv_block) + 2 * f(q_len) +
         tile_gemm_workspace_bytes(t, q_len, kv_len, head_dim, true);
}

// Workspace of one attention_backward call: two tiles plus O(sq) per-query terms, tracked.
struct BackwardScratch {
  Tensor<float> probabilities, probability_grads, delta, lse;
  BackwardScratch(const AttentionTiling& tiling, std::int64_t q_len)
      : probabilities(Shape{tiling.q_block, tiling.kv_block}), probability_grads(Shape{tiling.q_block, tiling.kv_block}),
        delta(Shape{q_len}), lse(Shape{q_len}) {}
};

}  // namespace detail
}  // namespace paradyse::ops::cpu
