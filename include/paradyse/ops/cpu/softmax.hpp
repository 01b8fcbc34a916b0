// paradyse/ops/cpu/softmax.hpp: row softmax over a materialised score matrix, with a causal mask at global
// positions, and its backward (ColossalZ's ring self-attention keeps whole score rows).
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/tensor.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

namespace paradyse::ops {

// `length` consecutive rows (or columns) starting at index `index` hold consecutive global positions from
// `position` on: a few runs describe the positions of a whole sharded sequence (contiguous or zigzag chunks).
struct PositionRun {
  std::int64_t index = 0;
  std::int64_t position = 0;
  std::int64_t length = 0;
};

}  // namespace paradyse::ops

namespace paradyse::ops::cpu {

namespace softmax_detail {
inline std::vector<std::int64_t> expand(std::span<const PositionRun> runs, std::int64_t count, const char* what) {
  std::vector<std::int64_t> positions(std::size_t(count), -1);
  for (const PositionRun& run : runs) {
    check(run.index >= 0 && run.length >= 0 && run.index + run.length <= count,
          "masked_softmax_forward: {} run [{}, {}) is outside [0, {})", what, run.index, run.index + run.length, count);
    for (std::int64_t i = 0; i < run.length; ++i) positions[std::size_t(run.index + i)] = run.position + i;
  }
  for (std::int64_t i = 0; i < count; ++i)
    check(positions[std::size_t(i)] >= 0, "masked_softmax_forward: {} {} has no position", what, i);
  return positions;
}
}  // namespace softmax_detail

// scores: [..., n, c] (last dimension contiguous), in place -> the softmax of every row over its visible columns
// (masked columns become 0). Row i of every [n, c] block is the query at the position `query_runs` give it; column
// j the key at the position `key_runs` give it; with causal a key is visible when its position <= the query's.
// Every row must see a key.
inline void masked_softmax_forward(TensorView<float> scores, std::span<const PositionRun> query_runs,
                                   std::span<const PositionRun> key_runs, bool causal) {
  const int rank = scores.rank();
  check(rank >= 2 && scores.is_contiguous(), "masked_softmax_forward: scores {} must be contiguous [..., n, c]",
        scores.shape());
  const std::int64_t n = scores.extent(rank - 2), c = scores.extent(rank - 1);
  const std::vector<std::int64_t> query_positions = softmax_detail::expand(query_runs, n, "query");
  const std::vector<std::int64_t> key_positions = softmax_detail::expand(key_runs, c, "key");
  const std::int64_t rows = c ? scores.numel() / c : 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    float* row = scores.data() + r * c;
    const std::int64_t position = query_positions[std::size_t(r % n)];
    const auto visible = [&](std::int64_t j) { return !causal || key_positions[std::size_t(j)] <= position; };
    // Whether the row sees a key is a matter of positions, not of scores: a row whose visible scores are all NaN
    // (a NaN input) keeps top = -inf (std::max skips NaN) and becomes NaN below, never "sees no key" (issue 27).
    float top = -std::numeric_limits<float>::infinity();
    bool sees = false;
    for (std::int64_t j = 0; j < c; ++j)
      if (visible(j)) {
        sees = true;
        top = std::max(top, row[j]);
      }
    check(sees, "masked_softmax_forward: the query at position {} sees no key", position);
    float sum = 0.0f;
    for (std::int64_t j = 0; j < c; ++j) {
      row[j] = visible(j) ? std::exp(row[j] - top) : 0.0f;
      sum += row[j];
    }
    for (std::int64_t j = 0; j < c; ++j) row[j] /= sum;
  }
}

// grads: [..., c] (in place, dP -> dS) = probs * (grads - rowsum(probs * grads)); probs: the forward's output.
inline void softmax_backward(TensorView<const float> probs, TensorView<float> grads) {
  check(probs.shape() == grads.shape() && probs.is_contiguous() && grads.is_contiguous() && probs.rank() >= 1,
        "softmax_backward: probs {} and grads {} must be contiguous and of one shape", probs.shape(), grads.shape());
  const std::int64_t c = probs.extent(-1), rows = c ? probs.numel() / c : 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* p = probs.data() + r * c;
    float* g = grads.data() + r * c;
    float dot = 0.0f;
    for (std::int64_t j = 0; j < c; ++j) dot += p[j] * g[j];
    for (std::int64_t j = 0; j < c; ++j) g[j] = p[j] * (g[j] - dot);
  }
}

}  // namespace paradyse::ops::cpu
