// paradyse/ops/attention_mask.hpp: which keys each query of an attention block sees (backend-independent).
//
// Queries and keys carry global token positions, so a block of queries can attend to a block of keys held by
// another rank (ring attention) and the causal mask is still right. For every query the visible keys form one
// interval of positions (its document's start up to itself, or to its document's end when not causal); kernels
// use visible_key_range to mask a tile with two comparisons per row instead of per-element tests.
#pragma once

#include "paradyse/core/error.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>

namespace paradyse::ops {

// Which keys each query sees. Positions are global token positions: query i of the block is at q_offset + i,
// key j at kv_offset + j. With causal, key position <= query position. With document_starts (packed
// variable-length batch: the sorted global start position of every document, first = 0, i.e. cu_seqlens without
// its final end), a query sees only keys of its own document.
struct AttentionMask {
  bool causal = false;
  std::int64_t q_offset = 0;
  std::int64_t kv_offset = 0;
  std::span<const std::int64_t> document_starts = {};
  float scale = 0.0f;  // 0: 1/sqrt(head_dim)
};

// The softmax scale for head dimension d.
inline float attention_scale(const AttentionMask& mask, std::int64_t head_dim) {
  return mask.scale != 0.0f ? mask.scale : float(1.0 / std::sqrt(double(std::max<std::int64_t>(head_dim, 1))));
}

// Throws unless the mask is well formed.
inline void validate(const AttentionMask& mask) {
  check(mask.q_offset >= 0 && mask.kv_offset >= 0,
        "attention mask: q_offset = {} and kv_offset = {} are token positions and must be non-negative", mask.q_offset,
        mask.kv_offset);
  check(std::isfinite(mask.scale), "attention mask: scale = {} must be finite", mask.scale);
  const auto starts = mask.document_starts;
  if (starts.empty()) return;
  check(starts[0] == 0, "attention mask: the first document must start at position 0, not {}", starts[0]);
  for (std::size_t i = 1; i < starts.size(); ++i)
    check(starts[i] >= starts[i - 1], "attention mask: document_starts must be sorted; entry {} = {} < entry {} = {}", i,
          starts[i], i - 1, starts[i - 1]);
}

// Global positions [first, last) of the keys that a query at global position `query_position` sees.
struct KeyInterval {
  std::int64_t first = std::numeric_limits<std::int64_t>::min();
  std::int64_t last = std::numeric_limits<std::int64_t>::max();
};
inline KeyInterval visible_key_positions(const AttentionMask& mask, std::int64_t query_position) {
  KeyInterval interval;
  if (!mask.document_starts.empty()) {
    const auto starts = mask.document_starts;
    // The document is the last one that starts at or before the query (empty documents share a start).
    const auto next = std::upper_bound(starts.begin(), starts.end(), query_position);
    interval.first = *(next - 1);
    if (next != starts.end()) interval.last = *next;
  }
  if (mask.causal) interval.last = std::min(interval.last, query_position + 1);
  return interval;
}

// A global key position as a local key index of a block of `kv_length` keys, clamped to [0, kv_length]. It clamps
// in positions before subtracting the offset (the position may be the most negative or positive int64).
inline std::int64_t local_key(const AttentionMask& mask, std::int64_t position, std::int64_t kv_length) {
  if (position <= mask.kv_offset) return 0;
  return std::min(position - mask.kv_offset, kv_length);
}

// The same as local key indices [first, last) of a block of `kv_length` keys (empty: first == last).
struct KeyRange {
  std::int64_t first = 0;
  std::int64_t last = 0;
};
inline KeyRange visible_key_range(const AttentionMask& mask, std::int64_t query_index, std::int64_t kv_length) {
  const KeyInterval p = visible_key_positions(mask, mask.q_offset + query_index);
  KeyRange range{local_key(mask, p.first, kv_length), local_key(mask, p.last, kv_length)};
  if (range.last < range.first) range.last = range.first;
  return range;
}

// Whether query `query_index` of the block sees key `key_index` of the block (the plain per-element rule).
inline bool key_visible(const AttentionMask& mask, std::int64_t query_index, std::int64_t key_index) {
  const KeyInterval p = visible_key_positions(mask, mask.q_offset + query_index);
  const std::int64_t key_position = mask.kv_offset + key_index;
  return key_position >= p.first && key_position < p.last;
}

}  // namespace paradyse::ops
