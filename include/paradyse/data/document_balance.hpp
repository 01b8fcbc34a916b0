// paradyse/data/document_balance.hpp: how much causal attention each rank computes for a packed sequence of
// documents, and an order of the documents that evens it out.
//
// A packed sequence holds documents back to back (attention stays within each document and is causal: the query at
// position i of a document sees its document's keys 0..i, i + 1 pairs). The group cuts the sequence into chunks by
// layout/chunking.hpp's rule (contiguous: p chunks, rank r holds chunk r; zigzag: 2p chunks, rank r holds chunks r
// and 2p-1-r). Sequence-parallel attention (a ring) computes, on each rank, the pairs of the queries it holds, so a
// rank's work is the sum over its queries of their visible keys, and the ring runs at the slowest rank's pace.
// Zigzag balances ONE causal sequence exactly; a packed one is balanced only if the documents fall right: with one
// long document first and short ones after it, the ranks holding the long document's end get almost all the work
// (3,072 + 4 x 256 tokens on p = 4: 0.20 M, 0.46 M, 2.10 M, 2.10 M pairs on ranks 0..3).
//
// Documents can be put in any order: positions restart at each document and attention never crosses one, so the
// order changes no loss and no gradient, only which rank computes what. rank_causal_pairs counts each rank's pairs
// exactly (closed form per piece of a document in a chunk: the queries x..y-1 of a document starting at d see
// T(y-d) - T(x-d) keys, T(n) = n(n+1)/2); balanced_document_order searches orders for the smallest maximum over the
// ranks: a few shapes (the given order, longest first, longest last, longest in the middle, long and short
// alternating), then swaps of two documents while a swap lowers the maximum (or keeps it and lowers the sum of
// squares, which moves work off the other ranks at the maximum), with a bounded number of evaluations. Deterministic;
// never worse than the given order.
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/layout/chunking.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <span>
#include <vector>

namespace paradyse::data {

// How the group holds a sequence: `ranks` ranks, zigzag (2p chunks) or contiguous (p chunks).
struct SequenceSplit {
  int ranks = 1;
  bool zigzag = true;
};

// The shortest sequence `split` runs: one token per chunk (2p chunks zigzag, p contiguous). The one rule for short
// sequences, used by the trainer and the planners alike: a window shorter than this runs padded at its end with
// masked tokens (data/packing.hpp's steps), and is costed and planned at the padded length (plan/gpt_costs.hpp,
// plan/moe_plan.hpp, plan_trace).
inline std::int64_t min_sequence_length(SequenceSplit split) {
  check(split.ranks >= 1, "min_sequence_length: ranks = {} must be at least 1", split.ranks);
  return split.zigzag ? 2 * std::int64_t(split.ranks) : std::int64_t(split.ranks);
}
// The length a sequence of `length` tokens runs at on `split`: padded up to min_sequence_length(split).
inline std::int64_t padded_length(std::int64_t length, SequenceSplit split) {
  check(length >= 1, "padded_length: a sequence of {} tokens (at least 1)", length);
  return std::max(length, min_sequence_length(split));
}

// Causal query-key pairs per rank [ranks] of documents of `lengths` tokens back to back (the sequence is their sum;
// zero-length documents allowed) under `split`. Every token of the sequence belongs to a document: padding at the
// end is a document of its own (it is computed like one).
inline std::vector<std::int64_t> rank_causal_pairs(std::span<const std::int64_t> lengths, SequenceSplit split) {
  check(split.ranks >= 1, "rank_causal_pairs: ranks = {} must be at least 1", split.ranks);
  std::vector<std::int64_t> starts(lengths.size() + 1, 0);  // document d is [starts[d], starts[d + 1])
  for (std::size_t d = 0; d < lengths.size(); ++d) {
    check(lengths[d] >= 0, "rank_causal_pairs: document {} has length {}; lengths must be non-negative", d, lengths[d]);
    starts[d + 1] = starts[d] + lengths[d];
  }
  const std::int64_t n = starts.back();
  const auto triangle = [](std::int64_t k) { return k * (k + 1) / 2; };
  // The pairs of the queries in [begin, end): the documents it overlaps, each piece in closed form.
  const auto pairs_in = [&](std::int64_t begin, std::int64_t end) {
    std::int64_t pairs = 0;
    // The first document that ends after `begin` (empty documents are skipped: they end where they start).
    auto d = std::size_t(std::upper_bound(starts.begin() + 1, starts.end(), begin) - starts.begin()) - 1;
    for (; d < lengths.size() && starts[d] < end; ++d) {
      const std::int64_t x = std::max(begin, starts[d]), y = std::min(end, starts[d + 1]);
      if (y > x) pairs += triangle(y - starts[d]) - triangle(x - starts[d]);
    }
    return pairs;
  };
  std::vector<std::int64_t> pairs(std::size_t(split.ranks), 0);
  for (int r = 0; r < split.ranks; ++r) {
    if (split.zigzag) {
      for (const ChunkRange& c : zigzag_ranges(n, split.ranks, r)) pairs[std::size_t(r)] += pairs_in(c.start, c.end());
    } else {
      const ChunkRange c = chunk_range(n, split.ranks, r);
      pairs[std::size_t(r)] = pairs_in(c.start, c.end());
    }
  }
  return pairs;
}

// The largest entry of rank_causal_pairs (what the ring waits for).
inline std::int64_t max_rank_causal_pairs(std::span<const std::int64_t> lengths, SequenceSplit split) {
  const std::vector<std::int64_t> pairs = rank_causal_pairs(lengths, split);
  return *std::max_element(pairs.begin(), pairs.end());
}

// An order of the documents `lengths` (a permutation of 0..n-1: the document placed first, second, ...) whose packed
// sequence, followed by `trailing` tokens of padding (a document of its own, always last), gives the ranks of
// `split` a small maximum of causal pairs (see the top). Its maximum is never larger than that of the given order.
// `max_evaluations` bounds the search: orders evaluated, the given one included (each costs O(n + p)).
inline std::vector<std::size_t> balanced_document_order(std::span<const std::int64_t> lengths, SequenceSplit split,
                                                        std::int64_t trailing = 0,
                                                        std::int64_t max_evaluations = 20'000) {
  check(trailing >= 0, "balanced_document_order: trailing padding {} must be non-negative", trailing);
  check(max_evaluations >= 1, "balanced_document_order: max_evaluations = {} must be at least 1", max_evaluations);
  const std::size_t n = lengths.size();
  std::vector<std::size_t> given(n);
  std::iota(given.begin(), given.end(), std::size_t{0});
  if (n < 2 || split.ranks < 2) return given;

  // The cost of an order: (max over ranks, sum of squares over ranks in units of the total, to break ties).
  struct Cost {
    std::int64_t max = 0;
    double spread = 0;
    bool operator<(const Cost& o) const { return max != o.max ? max < o.max : spread < o.spread; }
  };
  std::vector<std::int64_t> ordered(n + (trailing > 0 ? 1 : 0));
  if (trailing > 0) ordered.back() = trailing;
  std::int64_t evaluations = 0;
  const auto cost_of = [&](const std::vector<std::size_t>& order) {
    ++evaluations;
    for (std::size_t i = 0; i < n; ++i) ordered[i] = lengths[order[i]];
    const std::vector<std::int64_t> pairs = rank_causal_pairs(ordered, split);
    double total = 0, squares = 0;
    for (std::int64_t q : pairs) total += double(q);
    for (std::int64_t q : pairs) squares += total > 0 ? (double(q) / total) * (double(q) / total) : 0.0;
    return Cost{*std::max_element(pairs.begin(), pairs.end()), squares};
  };

  // Shapes: the given order, longest first, longest last, longest in the middle, long and short alternating.
  std::vector<std::size_t> longest_first = given;
  std::stable_sort(longest_first.begin(), longest_first.end(),
                   [&](std::size_t a, std::size_t b) { return lengths[a] > lengths[b]; });
  std::vector<std::size_t> longest_last(longest_first.rbegin(), longest_first.rend());
  std::vector<std::size_t> middle(n), alternating;
  for (std::size_t i = 0, front = 0, back = n; i < n; ++i)  // the shortest at both ends, the longest inward
    middle[i % 2 == 0 ? --back : front++] = longest_last[i];
  for (std::size_t lo = 0, hi = n; lo < hi;) {  // longest, shortest, second longest, second shortest, ...
    alternating.push_back(longest_first[lo++]);
    if (lo < hi) alternating.push_back(longest_first[--hi]);
  }
  std::vector<std::size_t> best = given;
  Cost best_cost = cost_of(given);
  for (const std::vector<std::size_t>* shape : {&longest_first, &longest_last, &middle, &alternating}) {
    if (evaluations >= max_evaluations) break;
    const Cost c = cost_of(*shape);
    if (c < best_cost) best = *shape, best_cost = c;
  }

  // Swaps of two documents of different lengths while one improves the cost (first improvement, in a fixed order).
  for (bool improved = true; improved && evaluations < max_evaluations;) {
    improved = false;
    for (std::size_t i = 0; i + 1 < n && evaluations < max_evaluations; ++i)
      for (std::size_t j = i + 1; j < n && evaluations < max_evaluations; ++j) {
        if (lengths[best[i]] == lengths[best[j]]) continue;  // the same sequence
        std::swap(best[i], best[j]);
        const Cost c = cost_of(best);
        if (c < best_cost) {
          best_cost = c;
          improved = true;
        } else {
          std::swap(best[i], best[j]);
        }
      }
  }
  return best;
}

}  // namespace paradyse::data
