// paradyse/data/corpus.hpp: a corpus of text documents (a folder of .txt files, or the bundled byte-level corpus of
// train_gpt) and how a step draws its window. The steps windows make: data/packing.hpp.
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
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/rng.hpp"

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

namespace paradyse::data {

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
  check(std::filesystem::exists(archive),
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
  check(std::system(command.c_str()) == 0, "corpus: '{}' failed", command);
  check(std::filesystem::is_directory(staging / folder_name), "corpus: {} holds no folder {}",
                  archive.string(), folder_name);
  std::error_code moved;
  std::filesystem::rename(staging / folder_name, folder, moved);  // fails when another process got there first
  std::filesystem::remove_all(staging);
  check(std::filesystem::is_directory(folder), "corpus: could not move the extracted {} to {}: {}",
                  folder_name, folder.string(), moved.message());
  return folder;
}

// Every *.txt file of `folder`, sorted by name (so a seed means the same draws on every machine).
inline std::vector<Document> load(const std::filesystem::path& folder) {
  check(std::filesystem::is_directory(folder), "corpus: {} is not a folder", folder.string());
  std::vector<Document> docs;
  for (const auto& entry : std::filesystem::directory_iterator(folder)) {
    if (!entry.is_regular_file() || entry.path().extension() != ".txt") continue;
    std::ifstream in(entry.path(), std::ios::binary);
    docs.push_back({entry.path().filename().string(), std::string(std::istreambuf_iterator<char>(in), {})});
  }
  check(!docs.empty(), "corpus: no .txt documents in {}", folder.string());
  check(std::any_of(docs.begin(), docs.end(), [](const Document& d) { return d.bytes.size() >= 2; }),
        "corpus: every .txt document in {} is shorter than 2 bytes (nothing to predict)", folder.string());
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
    check(min_len >= 1 && min_len <= max_len, "corpus: lengths must satisfy 1 <= min ({}) <= max ({})",
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
    check(!by_length.empty(), "corpus: every document is shorter than 2 bytes");
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
  Rng rng_;
};

}  // namespace paradyse::data
