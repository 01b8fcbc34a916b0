// paradyse/strategy/sequence_layout.hpp: which tokens each rank holds in the unified layout, and the local
// permutations between a gathered ("rank-major") buffer and natural token order.
//
// The sequence of s tokens is cut into c chunks: c = p (contiguous) or c = 2p (zigzag), by the one chunking rule of
// layout/chunking.hpp (uneven lengths: the first s % c chunks hold one token more). Contiguous: rank r holds chunk
// r. Zigzag (balances causal ring attention): rank r holds chunks r and 2p-1-r, in that order. Activations on rank r are [b, n_r, C] with the rank's tokens in that
// order (n_r = its token count).
//
// A gather over the group (all_gather_v of each rank's [b, n_r, C]) yields the rank-major buffer
// [rank][b][n_r][C]. Token-wise work (linears, the MLP) runs on it directly; attention needs natural order
// [b][s][C]; the two permutations below convert. They are the identity (no copy needed) when b == 1 and the
// layout is contiguous.
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/layout/chunking.hpp"
#include "paradyse/ops/backend.hpp"

#include <algorithm>
#include <array>
#include <cstdint>
#include <span>
#include <vector>

namespace paradyse {

// A run of consecutive global token positions held by one rank.
struct TokenSegment {
  std::int64_t begin = 0;   // global position of the first token
  std::int64_t length = 0;
  std::int64_t local = 0;   // index of its first token in the rank's local sequence
};

class SequenceLayout {
public:
  SequenceLayout() = default;
  SequenceLayout(std::int64_t length, int ranks, bool zigzag) : length_(length), ranks_(ranks), zigzag_(zigzag) {
    check(ranks >= 1, "SequenceLayout: ranks = {} must be at least 1", ranks);
    check(length >= chunks(), "SequenceLayout: a sequence of {} tokens cannot give each of the {} chunks ({} ranks{}) a token",
          length, chunks(), ranks, zigzag ? ", zigzag" : "");
  }

  // The layout of `fine`'s ranks taken `group` at a time: rank c holds the tokens of fine ranks c g .. c g + g - 1,
  // which are one run (contiguous: their chunks are consecutive) or two (zigzag: their first chunks, then their
  // second ones), whatever the chunk lengths. MegatronRing's cp ranks hold their tp sub-group's tokens this way.
  static SequenceLayout grouped(const SequenceLayout& fine, int group) {
    check(group >= 1 && fine.ranks_ % group == 0 && fine.group_ == 1,
          "SequenceLayout::grouped: a group of {} must divide the {} ranks of an ungrouped layout", group, fine.ranks_);
    SequenceLayout coarse = fine;
    coarse.ranks_ = fine.ranks_ / group;
    coarse.group_ = group;
    return coarse;
  }

  std::int64_t length() const noexcept { return length_; }
  int ranks() const noexcept { return ranks_; }
  int group() const noexcept { return group_; }  // fine ranks per rank (grouped); 1 otherwise
  bool zigzag() const noexcept { return zigzag_; }
  int chunks() const noexcept { return zigzag_ ? 2 * ranks_ : ranks_; }

  // The one or two segments rank r holds, in local order (the rule of layout/chunking.hpp).
  int segment_count() const noexcept { return zigzag_ ? 2 : 1; }
  TokenSegment segment(int rank, int index) const {
    if (group_ > 1) return grouped_segment(rank, index);
    if (!zigzag_) {
      const ChunkRange c = chunk_range(length_, ranks_, rank);
      return {c.start, c.length, 0};
    }
    const auto c = zigzag_ranges(length_, ranks_, rank);
    return {c[std::size_t(index)].start, c[std::size_t(index)].length, index == 0 ? 0 : c[0].length};
  }
  std::int64_t local_length(int rank) const {
    if (group_ > 1) return grouped_segment(rank, 0).length + (zigzag_ ? grouped_segment(rank, 1).length : 0);
    return zigzag_ ? zigzag_length(length_, ranks_, rank) : chunk_length(length_, ranks_, rank);
  }
  // Global position of local token i of rank r.
  std::int64_t position(int rank, std::int64_t i) const {
    const TokenSegment first = segment(rank, 0);
    if (i < first.length) return first.begin + i;
    return segment(rank, 1).begin + (i - first.length);
  }
  // Tokens of every rank (the counts of a gather), times `per_token` elements.
  std::vector<std::int64_t> counts(std::int64_t per_token) const {
    std::vector<std::int64_t> c(static_cast<std::size_t>(ranks_));
    for (int r = 0; r < ranks_; ++r) c[std::size_t(r)] = local_length(r) * per_token;
    return c;
  }
  // Offset, in tokens, of rank r's block in a rank-major buffer of batch b.
  std::int64_t rank_offset(int rank, std::int64_t batch) const {
    std::int64_t tokens = 0;
    for (int q = 0; q < rank; ++q) tokens += local_length(q);
    return tokens * batch;
  }
  // Rank-major and natural order coincide (no permutation needed).
  bool natural_is_rank_major(std::int64_t batch) const noexcept { return batch == 1 && !zigzag_; }

  friend bool operator==(const SequenceLayout&, const SequenceLayout&) = default;

private:
  // Chunks [first, first + g) of the fine layout's chunks (fine ranks * g, twice that under zigzag), as one run.
  TokenSegment grouped_segment(int rank, int index) const {
    const std::int64_t g = group_, fine_chunks = std::int64_t(chunks()) * g;
    const std::int64_t first = index == 0 ? rank * g : fine_chunks - (rank + 1) * g;
    const ChunkRange a = chunk_range(length_, fine_chunks, first), b = chunk_range(length_, fine_chunks, first + g - 1);
    return {a.start, b.start + b.length - a.start, index == 0 ? 0 : grouped_segment(rank, 0).length};
  }

  std::int64_t length_ = 0;
  int ranks_ = 1;
  bool zigzag_ = false;
  int group_ = 1;
};

namespace sequence_detail {
// Visits (rank-major offset, natural offset, rows) in units of rows of `width` elements.
template <class Fn>
void for_each_run(const SequenceLayout& layout, std::int64_t batch, Fn&& fn) {
  std::int64_t rank_base = 0;
  for (int r = 0; r < layout.ranks(); ++r) {
    const std::int64_t n = layout.local_length(r);
    for (std::int64_t b = 0; b < batch; ++b)
      for (int k = 0; k < layout.segment_count(); ++k) {
        const TokenSegment seg = layout.segment(r, k);
        if (seg.length) fn(rank_base + b * n + seg.local, b * layout.length() + seg.begin, seg.length);
      }
    rank_base += batch * n;
  }
}
}  // namespace sequence_detail

// natural: [b, s, C] <- rank_major: [sum_r b * n_r, C] (both contiguous, C = width). One copy per run of tokens.
template <class Backend = ops::Cpu>
void rank_major_to_natural(const SequenceLayout& layout, std::int64_t batch, std::int64_t width,
                           const float* rank_major, float* natural) {
  sequence_detail::for_each_run(layout, batch, [&](std::int64_t from, std::int64_t to, std::int64_t rows) {
    const auto count = std::size_t(rows * width);
    Backend::copy(std::span<const float>(rank_major + from * width, count), std::span<float>(natural + to * width, count));
  });
}

// rank_major: [sum_r b * n_r, C] <- natural: [b, s, C].
template <class Backend = ops::Cpu>
void natural_to_rank_major(const SequenceLayout& layout, std::int64_t batch, std::int64_t width, const float* natural,
                           float* rank_major) {
  sequence_detail::for_each_run(layout, batch, [&](std::int64_t to, std::int64_t from, std::int64_t rows) {
    const auto count = std::size_t(rows * width);
    Backend::copy(std::span<const float>(natural + from * width, count), std::span<float>(rank_major + to * width, count));
  });
}

}  // namespace paradyse
