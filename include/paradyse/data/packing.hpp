// paradyse/data/packing.hpp: the steps a corpus's windows (data/corpus.hpp) make: rows padded to a common length,
// rows packed up to a token budget, or packed sequences of documents in an order balanced for the group.
//
// Steps (pack_steps): a step is one or more windows, each a row of its own (attention never crosses rows, and
// positions restart at 0 in every row: each document is masked from the others), padded to the step's length s with
// masked tokens (input 0, target ignored). s is at least the group's minimum (zigzag: two tokens per rank), so a
// window of any length from 1 token up runs: shorter ones are padded. With a token budget B the loader packs the
// windows, sorted by length, into steps of b rows x s tokens with b x s <= B (at least one row), so rows of similar
// length share a step and little is padded; without one (B = 0) each window is a step of its own.
//
// Packed sequences (pack_sequences): a step is ONE sequence holding several windows back to back, each a document
// of its own (Step::document_starts: the model's attention stays within a document and RoPE positions restart at
// each start; every target is the next byte of the same document, so the loss never crosses documents), filled up
// to the token budget B first-fit decreasing (windows longest first, each into the first step with room; a window
// longer than B is a step alone). Only a step shorter than the group's minimum is padded, at its end, with masked
// tokens that form a document of their own.
//
// The order of a packed sequence's documents (PackedOrder): under the group's layout (zigzag: rank r holds chunks r
// and 2p-1-r of 2p) the order decides how many causal query-key pairs each rank's ring attention computes, and the
// ring runs at the slowest rank's pace. Balanced (the default when the group is given) reorders each step's
// documents by data/document_balance.hpp's balanced_document_order (the padding, if any, stays last); as packed
// keeps first-fit decreasing's order (longest first). Positions restart at each document and attention never
// crosses one, so the order changes no document's loss or gradient.
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/data/corpus.hpp"
#include "paradyse/data/document_balance.hpp"

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace paradyse::data {

// One training step: rows of windows padded to a common length, or (packed) one sequence of the windows back to back.
struct Step {
  std::vector<Window> rows;  // packed: the documents of the one sequence, in order
  std::int64_t length = 0;   // s: every row's length after padding (packed: the sequence's)
  bool packed = false;       // the windows are documents of one sequence (pack_sequences)
  std::int64_t real_tokens() const {
    std::int64_t n = 0;
    for (const Window& w : rows) n += w.length;
    return n;
  }
  // Rows of the step's [b, s] token array.
  std::int64_t sequences() const { return packed ? 1 : std::int64_t(rows.size()); }
  std::int64_t padded_tokens() const { return sequences() * length - real_tokens(); }
  // Packed: the start of every document in the sequence (the padding at the end, if any, is a document of its
  // own), first 0; empty for rows (each row is one document).
  std::vector<std::int64_t> document_starts() const {
    std::vector<std::int64_t> starts;
    if (!packed) return starts;
    std::int64_t at = 0;
    for (const Window& w : rows) {
      starts.push_back(at);
      at += w.length;
    }
    if (at < length) starts.push_back(at);
    return starts;
  }
  // The lengths of the documents of document_starts() (packed), or of the rows' windows.
  std::vector<std::int64_t> document_lengths() const {
    std::vector<std::int64_t> lengths;
    for (const Window& w : rows) lengths.push_back(w.length);
    if (packed && real_tokens() < length) lengths.push_back(length - real_tokens());
    return lengths;
  }
};

// The steps of `windows` (see the top): one per window (token_budget 0, in the given order), or packed up to
// token_budget tokens per step from the windows sorted by length (shortest first; the caller may shuffle the steps).
// Every step's length is at least min_length.
inline std::vector<Step> pack_steps(const std::vector<Window>& windows, std::int64_t token_budget,
                                    std::int64_t min_length) {
  check(token_budget >= 0 && min_length >= 1, "pack_steps: token budget {} and minimum length {}",
                  token_budget, min_length);
  std::vector<Step> steps;
  const auto padded = [&](std::int64_t length) { return std::max(length, min_length); };
  if (token_budget == 0) {
    for (const Window& w : windows) steps.push_back({{w}, padded(w.length)});
    return steps;
  }
  std::vector<Window> sorted = windows;
  std::stable_sort(sorted.begin(), sorted.end(), [](const Window& a, const Window& b) { return a.length < b.length; });
  for (const Window& w : sorted) {
    const std::int64_t s = padded(w.length);  // the longest so far: sorted
    if (!steps.empty() && std::int64_t(steps.back().rows.size() + 1) * s <= token_budget) {
      steps.back().rows.push_back(w);
      steps.back().length = s;
    } else {
      steps.push_back({{w}, s});
    }
  }
  return steps;
}

// The order of the documents within a packed sequence (see the top).
struct PackedOrder {
  SequenceSplit split;  // the group that holds the sequence (1 rank: nothing to balance)
  bool balanced = true;           // false: as packed (first-fit decreasing: longest first)
};

// Each rank's causal query-key pairs for packed step `step` held by `split` (the padding is a document of its own).
inline std::vector<std::int64_t> rank_causal_pairs(const Step& step, SequenceSplit split) {
  check(step.packed, "rank_causal_pairs: the step is not a packed sequence (its documents are rows)");
  return data::rank_causal_pairs(step.document_lengths(), split);
}

// Reorders packed step `step`'s documents so that `split`'s ranks get a small maximum of causal pairs (never a larger
// one than the order given); the padding stays at the end.
inline void balance_documents(Step& step, SequenceSplit split) {
  check(step.packed, "balance_documents: the step is not a packed sequence (its documents are rows)");
  std::vector<std::int64_t> lengths;
  for (const Window& w : step.rows) lengths.push_back(w.length);
  const std::vector<std::size_t> order =
      balanced_document_order(lengths, split, step.length - step.real_tokens());
  std::vector<Window> rows;
  for (std::size_t i : order) rows.push_back(step.rows[i]);
  step.rows = std::move(rows);
}

// Packed sequences (see the top): windows into steps of one sequence of at most token_budget tokens (> 0), first-fit
// decreasing; a step shorter than min_length is padded to it; each step's documents in `order` (by default as
// packed: no group given). The steps come in order of their longest window; the caller may shuffle them.
inline std::vector<Step> pack_sequences(const std::vector<Window>& windows, std::int64_t token_budget,
                                        std::int64_t min_length, const PackedOrder& order = {}) {
  check(token_budget >= 1 && min_length >= 1, "pack_sequences: token budget {} and minimum length {}",
                  token_budget, min_length);
  std::vector<Window> sorted = windows;
  std::stable_sort(sorted.begin(), sorted.end(), [](const Window& a, const Window& b) { return a.length > b.length; });
  std::vector<Step> steps;
  for (const Window& w : sorted) {
    const auto room = std::find_if(steps.begin(), steps.end(),
                                   [&](const Step& s) { return s.real_tokens() + w.length <= token_budget; });
    if (room != steps.end()) room->rows.push_back(w);
    else steps.push_back({{w}, 0, true});
  }
  for (Step& s : steps) {
    s.length = std::max(s.real_tokens(), min_length);
    if (order.balanced) balance_documents(s, order.split);
  }
  return steps;
}

// The inputs and next-token targets of a step, [rows, s] row-major: row i holds window i's bytes, then padding
// (input 0, target ignore_index). Packed: one row, the windows back to back, then padding.
inline void step_tokens(const Step& step, const std::vector<Document>& docs, std::int32_t ignore_index,
                        std::vector<std::int32_t>& inputs, std::vector<std::int32_t>& targets) {
  const std::size_t s = std::size_t(step.length);
  inputs.assign(std::size_t(step.sequences()) * s, 0);
  targets.assign(std::size_t(step.sequences()) * s, ignore_index);
  std::size_t at = 0;  // where the next window starts
  for (std::size_t row = 0; row < step.rows.size(); ++row) {
    const Window& w = step.rows[row];
    if (!step.packed) at = row * s;
    const std::string& text = docs[w.document].bytes;
    for (std::int64_t i = 0; i < w.length; ++i) {
      inputs[at + std::size_t(i)] = std::int32_t(static_cast<unsigned char>(text[std::size_t(w.offset + i)]));
      targets[at + std::size_t(i)] = std::int32_t(static_cast<unsigned char>(text[std::size_t(w.offset + i + 1)]));
    }
    at += std::size_t(w.length);
  }
}

}  // namespace paradyse::data
