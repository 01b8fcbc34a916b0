// paradyse/moe/dispatch.hpp: tokens permuted by expert (a stable counting sort of the (token, expert) assignments),
// ragged blocks per expert, an optional capacity per expert with the dropped assignments counted, and the unpermute
// with the weighted combine.
//
// The permuted buffer holds one row per kept assignment, expert 0's block first; within a block the rows keep the
// order of the assignments (token order), so a capacity keeps each expert's first `capacity` tokens (Switch's rule)
// and the permutation is deterministic. The sort runs on the index metadata (host vectors); moving the rows is the
// Backend's gather_rows / scatter_add_rows.
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/tensor.hpp"

#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

namespace paradyse {

struct Dispatch {
  std::int64_t experts = 0;                 // E
  std::int64_t capacity = -1;               // rows kept per expert; -1: dropless
  std::vector<std::int64_t> offsets;        // [E + 1]: expert e's block is rows [offsets[e], offsets[e+1])
  std::vector<std::int64_t> token;          // [rows]: the token of each permuted row
  std::vector<std::int64_t> slot;           // [rows]: the assignment (index into Routing::expert/gates) of each row
  std::vector<std::int64_t> routed;         // [E]: assignments to each expert before the capacity
  std::int64_t dropped = 0;                 // assignments over capacity (not computed, gate weight lost)

  std::int64_t rows() const noexcept { return std::int64_t(token.size()); }
  std::int64_t count(std::int64_t e) const { return offsets[std::size_t(e + 1)] - offsets[std::size_t(e)]; }
};

// Rows an expert keeps under capacity factor `cf` for `assignments` (token, expert) pairs over E experts:
// ceil(cf * assignments / E); -1 (no limit) when cf is 0.
inline std::int64_t expert_capacity(double capacity_factor, std::int64_t assignments, std::int64_t experts) {
  check(capacity_factor >= 0 && std::isfinite(capacity_factor), "expert_capacity: capacity factor {} must be >= 0",
        capacity_factor);
  if (capacity_factor == 0) return -1;
  return std::int64_t(std::ceil(capacity_factor * double(assignments) / double(experts)));
}

// offsets [n + 1] and expert [M] as in Routing (moe/router.hpp); capacity -1 for dropless.
inline Dispatch dispatch_by_expert(std::span<const std::int64_t> offsets, std::span<const std::int64_t> expert,
                                   std::int64_t experts, std::int64_t capacity = -1) {
  check(experts >= 1, "dispatch_by_expert: experts = {} must be at least 1", experts);
  check(!offsets.empty() && offsets[0] == 0 && offsets.back() == std::int64_t(expert.size()),
        "dispatch_by_expert: offsets must start at 0 and end at the {} assignments", expert.size());
  check(capacity >= -1, "dispatch_by_expert: capacity = {} must be -1 (dropless) or non-negative", capacity);
  Dispatch d;
  d.experts = experts;
  d.capacity = capacity;
  d.routed.assign(std::size_t(experts), 0);
  for (std::size_t a = 0; a < expert.size(); ++a) {
    check(expert[a] >= 0 && expert[a] < experts, "dispatch_by_expert: assignment {} names expert {}, outside [0, {})",
          a, expert[a], experts);
    ++d.routed[std::size_t(expert[a])];
  }
  d.offsets.assign(std::size_t(experts + 1), 0);
  for (std::int64_t e = 0; e < experts; ++e) {
    const std::int64_t routed = d.routed[std::size_t(e)];
    const std::int64_t kept = capacity < 0 ? routed : std::min(routed, capacity);
    d.dropped += routed - kept;
    d.offsets[std::size_t(e + 1)] = d.offsets[std::size_t(e)] + kept;
  }
  const std::int64_t rows = d.offsets.back();
  d.token.assign(std::size_t(rows), 0);
  d.slot.assign(std::size_t(rows), 0);
  std::vector<std::int64_t> next(d.offsets.begin(), d.offsets.end() - 1);
  const std::int64_t tokens = std::int64_t(offsets.size()) - 1;
  for (std::int64_t t = 0; t < tokens; ++t) {
    check(offsets[std::size_t(t + 1)] >= offsets[std::size_t(t)], "dispatch_by_expert: offsets decrease at token {}", t);
    for (std::int64_t a = offsets[std::size_t(t)]; a < offsets[std::size_t(t + 1)]; ++a) {
      const std::size_t e = std::size_t(expert[std::size_t(a)]);
      if (next[e] == d.offsets[e + 1]) continue;  // over capacity: dropped
      d.token[std::size_t(next[e])] = t;
      d.slot[std::size_t(next[e])] = a;
      ++next[e];
    }
  }
  return d;
}

// xp: [rows, h] (overwritten) = the rows of x: [n, h] in dispatch order.
template <class Backend>
void permute_tokens(const Dispatch& d, TensorView<const float> x, TensorView<float> xp) {
  Backend::gather_rows(x, d.token, {}, xp);
}

// The gate weight of each permuted row: wp [rows] (overwritten) from gates [M].
template <class Backend>
void permuted_gates(const Dispatch& d, TensorView<const float> gates, TensorView<float> wp) {
  Backend::gather_rows(gates.reshape(Shape{gates.numel(), 1}), d.slot, {}, wp.reshape(Shape{d.rows(), 1}));
}

// y [n, h] += sum over the rows of each token of wp[row] * hp[row] (hp: [rows, h], the experts' outputs).
template <class Backend>
void combine(const Dispatch& d, TensorView<const float> hp, TensorView<const float> wp, TensorView<float> y) {
  Backend::scatter_add_rows(y, d.token, hp, wp);
}

// Backward of combine: dhp [rows, h] (overwritten) = wp[row] * dy[token]; dgates [M] += dy[token] . hp[row] for each
// kept assignment (dropped ones get nothing). dwp: [rows], a scratch.
template <class Backend>
void combine_backward(const Dispatch& d, TensorView<const float> hp, TensorView<const float> wp,
                      TensorView<const float> dy, TensorView<float> dhp, TensorView<float> dwp,
                      TensorView<float> dgates) {
  Backend::gather_rows(dy, d.token, wp, dhp);
  Backend::gathered_row_dot(dy, d.token, hp, dwp);
  Backend::scatter_add_rows(dgates.reshape(Shape{dgates.numel(), 1}), d.slot,
                            TensorView<const float>(dwp).reshape(Shape{d.rows(), 1}), {});
}

// Backward of permute_tokens: dx [n, h] += the rows of dxp [rows, h] added back to their tokens.
template <class Backend>
void unpermute_add(const Dispatch& d, TensorView<const float> dxp, TensorView<float> dx) {
  Backend::scatter_add_rows(dx, d.token, dxp, {});
}

}  // namespace paradyse
