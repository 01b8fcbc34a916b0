// examples/corpus.hpp: the bundled byte-level corpus of the train_gpt example and how a step draws its window.
//
// The corpus is the State of the Union addresses (public domain), one speech per file, 234 documents of about 0.3 to
// 217 KB: very different lengths, which is ParaDySe's setting. It ships compressed (data/corpus/sotu.tar.xz) and is
// extracted with `tar xJf` into the build folder on first use.
//
// A step's window: a document's length scaled by max_len / (longest document) and clamped to [min_len, max_len]
// gives the sequence length s (so the step lengths follow the corpus's length distribution, the longest speech giving
// max_len), and s + 1 consecutive bytes at a random offset of that document give the inputs (the first s) and the
// next-token targets (the last s). The documents of a run are drawn stratified by length (seeded): with N steps, the
// documents sorted by length are cut into N strata and step i draws one document of stratum i, so even a short run
// covers the whole distribution, from the shortest speeches to the longest.
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
// documents by layout/document_balance.hpp's balanced_document_order (the padding, if any, stays last); as packed
// keeps first-fit decreasing's order (longest first). Positions restart at each document and attention never
// crosses one, so the order changes no document's loss or gradient.
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/rng.hpp"
#include "paradyse/layout/document_balance.hpp"

#include <fmt/core.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include <unistd.h>  // getpid

namespace corpus {

struct Document {
  std::string name;
  std::string bytes;
};

// Extracts `archive` (a .tar.xz holding folder `folder_name`) into `into` unless `into`/`folder_name` exists;
// returns the folder.
inline std::filesystem::path ensure_extracted(const std::filesystem::path& archive, const std::filesystem::path& into,
                                              const std::string& folder_name) {
  const std::filesystem::path folder = into / folder_name;
  if (std::filesystem::is_directory(folder)) return folder;
  paradyse::check(std::filesystem::exists(archive),
                  "corpus: neither the folder {} nor the archive {} exists (run from the repository root, or pass "
                  "--corpus DIR)",
                  folder.string(), archive.string());
  // Extracted into a folder of this process's own, then renamed into place: the rename is atomic, so a process that
  // finds `folder` finds it whole even while another one (a test running in parallel) is still extracting.
  const std::filesystem::path staging = into / fmt::format(".{}.extracting.{}", folder_name, ::getpid());
  std::filesystem::remove_all(staging);
  std::filesystem::create_directories(staging);
  fmt::print("extracting {} into {}\n", archive.string(), into.string());
  const std::string command = fmt::format("tar xJf '{}' -C '{}'", archive.string(), staging.string());
  paradyse::check(std::system(command.c_str()) == 0, "corpus: '{}' failed", command);
  paradyse::check(std::filesystem::is_directory(staging / folder_name), "corpus: {} holds no folder {}",
                  archive.string(), folder_name);
  std::error_code moved;
  std::filesystem::rename(staging / folder_name, folder, moved);  // fails when another process got there first
  std::filesystem::remove_all(staging);
  paradyse::check(std::filesystem::is_directory(folder), "corpus: could not move the extracted {} to {}: {}",
                  folder_name, folder.string(), moved.message());
  return folder;
}

// Every *.txt file of `folder`, sorted by name (so a seed means the same draws on every machine).
inline std::vector<Document> load(const std::filesystem::path& folder) {
  paradyse::check(std::filesystem::is_directory(folder), "corpus: {} is not a folder", folder.string());
  std::vector<Document> docs;
  for (const auto& entry : std::filesystem::directory_iterator(folder)) {
    if (!entry.is_regular_file() || entry.path().extension() != ".txt") continue;
    std::ifstream in(entry.path(), std::ios::binary);
    docs.push_back({entry.path().filename().string(), std::string(std::istreambuf_iterator<char>(in), {})});
  }
  paradyse::check(!docs.empty(), "corpus: no .txt documents in {}", folder.string());
  std::sort(docs.begin(), docs.end(), [](const Document& a, const Document& b) { return a.name < b.name; });
  return docs;
}

struct Window {
  std::size_t document = 0;
  std::int64_t offset = 0;
  std::int64_t length = 0;  // s: inputs are bytes [offset, offset + s), targets [offset + 1, offset + s + 1)
};

class WindowSampler {
public:
  WindowSampler(const std::vector<Document>& docs, std::int64_t min_len, std::int64_t max_len, std::uint64_t seed)
      : docs_(docs), min_len_(min_len), max_len_(max_len), rng_(seed) {
    paradyse::check(min_len >= 1 && min_len <= max_len, "corpus: lengths must satisfy 1 <= min ({}) <= max ({})",
                    min_len, max_len);
    for (const Document& d : docs) longest_ = std::max(longest_, std::int64_t(d.bytes.size()));
  }

  // The sequence length document `i` gives.
  std::int64_t length_of(std::size_t i) const {
    const std::int64_t size = std::int64_t(docs_[i].bytes.size());
    const std::int64_t scaled = std::int64_t(double(size) * double(max_len_) / double(longest_));
    return std::min(std::clamp(scaled, min_len_, max_len_), size - 1);
  }
  std::int64_t longest_document() const noexcept { return longest_; }

  // One window per step, document i drawn from length stratum i (shortest first).
  std::vector<Window> stratified(int steps) {
    std::vector<std::size_t> by_length;
    for (std::size_t i = 0; i < docs_.size(); ++i)
      if (length_of(i) >= 1) by_length.push_back(i);  // not an empty or one-byte document (nothing to predict)
    paradyse::check(!by_length.empty(), "corpus: every document is shorter than 2 bytes");
    std::stable_sort(by_length.begin(), by_length.end(),
                     [&](std::size_t a, std::size_t b) { return docs_[a].bytes.size() < docs_[b].bytes.size(); });
    const std::size_t n = by_length.size();
    std::vector<Window> windows;
    for (int step = 0; step < steps; ++step) {
      const std::size_t lo = std::size_t(step) * n / std::size_t(steps);
      const std::size_t hi = std::max(lo + 1, std::size_t(step + 1) * n / std::size_t(steps));
      windows.push_back(window_of(by_length[lo + std::size_t(rng_.below(hi - lo))]));
    }
    return windows;
  }
  // A window of document i at a random offset.
  Window window_of(std::size_t i) {
    const std::int64_t s = length_of(i);
    const std::int64_t room = std::int64_t(docs_[i].bytes.size()) - (s + 1);
    return {i, std::int64_t(rng_.below(std::uint64_t(room + 1))), s};
  }
  // Shuffles (Fisher-Yates, seeded).
  template <class T>
  void shuffle(std::vector<T>& items) {
    for (std::size_t i = items.size(); i > 1; --i) std::swap(items[i - 1], items[std::size_t(rng_.below(i))]);
  }

private:
  const std::vector<Document>& docs_;
  std::int64_t min_len_, max_len_, longest_ = 0;
  paradyse::Rng rng_;
};

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
  paradyse::check(token_budget >= 0 && min_length >= 1, "pack_steps: token budget {} and minimum length {}",
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
  paradyse::SequenceSplit split;  // the group that holds the sequence (1 rank: nothing to balance)
  bool balanced = true;           // false: as packed (first-fit decreasing: longest first)
};

// Each rank's causal query-key pairs for packed step `step` held by `split` (the padding is a document of its own).
inline std::vector<std::int64_t> rank_causal_pairs(const Step& step, paradyse::SequenceSplit split) {
  paradyse::check(step.packed, "rank_causal_pairs: the step is not a packed sequence (its documents are rows)");
  return paradyse::rank_causal_pairs(step.document_lengths(), split);
}

// Reorders packed step `step`'s documents so that `split`'s ranks get a small maximum of causal pairs (never a larger
// one than the order given); the padding stays at the end.
inline void balance_documents(Step& step, paradyse::SequenceSplit split) {
  paradyse::check(step.packed, "balance_documents: the step is not a packed sequence (its documents are rows)");
  std::vector<std::int64_t> lengths;
  for (const Window& w : step.rows) lengths.push_back(w.length);
  const std::vector<std::size_t> order =
      paradyse::balanced_document_order(lengths, split, step.length - step.real_tokens());
  std::vector<Window> rows;
  for (std::size_t i : order) rows.push_back(step.rows[i]);
  step.rows = std::move(rows);
}

// Packed sequences (see the top): windows into steps of one sequence of at most token_budget tokens (> 0), first-fit
// decreasing; a step shorter than min_length is padded to it; each step's documents in `order` (by default as
// packed: no group given). The steps come in order of their longest window; the caller may shuffle them.
inline std::vector<Step> pack_sequences(const std::vector<Window>& windows, std::int64_t token_budget,
                                        std::int64_t min_length, const PackedOrder& order = {}) {
  paradyse::check(token_budget >= 1 && min_length >= 1, "pack_sequences: token budget {} and minimum length {}",
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

}  // namespace corpus
