// paradyse/data/trace_input.hpp: plan_trace's input files, read strictly: a sequence-length distribution (CSV) and a
// list of sequence lengths. Every bad input is a paradyse::Error naming the file, the line, the field and the
// accepted range; nothing is clamped or wraps, and no exception other than paradyse::Error escapes.
//
// Distribution CSV: lines "dataset,lo,hi,prob" for buckets lo < length <= hi holding a share prob of a dataset's
// sequences ('#' comments, blank lines and a "dataset,..." header line are skipped). 0 <= lo < hi <= max_length,
// prob finite in [0, 1], a dataset's buckets ascending without overlap (lo >= the previous bucket's hi), and each
// dataset's shares adding up to more than 0.
//
// Lengths: integers separated by white space or commas ('#' starts a comment to the end of the line), each in
// [min_length, max_length] (plan_trace passes min_length = 1 and the planner's longest length: a sequence shorter
// than p, which no strategy can run, is reported per sequence, not refused with the whole file).
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/printable.hpp"

#include <fmt/format.h>

#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

namespace paradyse::data {

struct LengthBucket {
  std::int64_t lo = 0, hi = 0;  // lo < length <= hi
  double probability = 0;
};

namespace trace_detail {

inline std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t' || s.front() == '\r')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) s.remove_suffix(1);
  return s;
}

// All of `text` as a decimal integer in [min, max], else an Error naming where, the field and the range.
inline std::int64_t integer(std::string_view text, std::int64_t min, std::int64_t max, std::string_view where,
                            std::string_view field) {
  std::int64_t v = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), v, 10);
  check(!text.empty() && error == std::errc() && end == text.data() + text.size() && v >= min && v <= max,
        "{}: {} \"{}\" is not an integer in [{}, {}]", where, field, printable(text), min, max);
  return v;
}

inline double number(std::string_view text, double min, double max, std::string_view where, std::string_view field) {
  const std::string s(text);
  char* end = nullptr;
  const double v = s.empty() ? 0 : std::strtod(s.c_str(), &end);
  check(!s.empty() && end == s.c_str() + s.size() && std::isfinite(v) && v >= min && v <= max,
        "{}: {} \"{}\" is not a finite number in [{}, {}]", where, field, printable(text), min, max);
  return v;
}

inline std::string read_file(const std::string& path) {
  std::error_code error;
  check(!std::filesystem::is_directory(path, error), "\"{}\" is a folder, not a file", printable(path));
  std::ifstream in(path, std::ios::binary);
  check(bool(in), "cannot open \"{}\"", printable(path));
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace trace_detail

// The buckets of every dataset in a distribution CSV's `text` (`source` names it in messages).
inline std::map<std::string, std::vector<LengthBucket>> parse_distribution(std::string_view text, std::string_view source,
                                                                           std::int64_t max_length) {
  using namespace trace_detail;
  std::map<std::string, std::vector<LengthBucket>> out;
  int number_of_line = 0;
  while (!text.empty()) {
    const std::size_t newline = text.find('\n');
    const std::string_view line = trim(text.substr(0, newline));
    text.remove_prefix(newline == std::string_view::npos ? text.size() : newline + 1);
    ++number_of_line;
    if (line.empty() || line[0] == '#' || line.rfind("dataset,", 0) == 0) continue;
    const std::string where = fmt::format("{}:{}", printable(source), number_of_line);
    std::vector<std::string_view> fields;
    for (std::string_view rest = line;;) {
      const std::size_t comma = rest.find(',');
      fields.push_back(trim(rest.substr(0, comma)));
      if (comma == std::string_view::npos) break;
      rest.remove_prefix(comma + 1);
    }
    check(fields.size() == 4, "{}: expected dataset,lo,hi,prob, found {} field{}", where, fields.size(),
          fields.size() == 1 ? "" : "s");
    check(!fields[0].empty(), "{}: the dataset name is empty", where);
    LengthBucket b;
    b.lo = integer(fields[1], 0, max_length - 1, where, "lo");
    b.hi = integer(fields[2], b.lo + 1, max_length, where, "hi (above lo)");
    b.probability = number(fields[3], 0, 1, where, "prob");
    std::vector<LengthBucket>& buckets = out[std::string(fields[0])];
    check(buckets.empty() || b.lo >= buckets.back().hi,
          "{}: bucket ({}, {}] of {} overlaps or precedes the previous one ({}, {}] (buckets ascend without overlap)",
          where, b.lo, b.hi, printable(fields[0]), buckets.empty() ? 0 : buckets.back().lo,
          buckets.empty() ? 0 : buckets.back().hi);
    buckets.push_back(b);
  }
  check(!out.empty(), "{} holds no buckets", printable(source));
  for (const auto& [name, buckets] : out) {
    double total = 0;
    for (const LengthBucket& b : buckets) total += b.probability;
    check(total > 0, "{}: the shares of dataset {} add up to 0", printable(source), printable(name));
  }
  return out;
}

inline std::map<std::string, std::vector<LengthBucket>> read_distribution(const std::string& path,
                                                                          std::int64_t max_length) {
  return parse_distribution(trace_detail::read_file(path), path, max_length);
}

// The lengths in `text` (`source` names it in messages), each in [min_length, max_length].
inline std::vector<std::int64_t> parse_lengths(std::string_view text, std::string_view source, std::int64_t min_length,
                                               std::int64_t max_length) {
  using namespace trace_detail;
  std::vector<std::int64_t> lengths;
  int number_of_line = 0;
  while (!text.empty()) {
    const std::size_t newline = text.find('\n');
    std::string_view line = text.substr(0, newline);
    text.remove_prefix(newline == std::string_view::npos ? text.size() : newline + 1);
    ++number_of_line;
    if (const std::size_t hash = line.find('#'); hash != std::string_view::npos) line = line.substr(0, hash);
    const std::string where = fmt::format("{}:{}", printable(source), number_of_line);
    std::size_t at = 0;
    while (at < line.size()) {
      const auto separator = [](char c) { return c == ' ' || c == '\t' || c == '\r' || c == ','; };
      while (at < line.size() && separator(line[at])) ++at;
      std::size_t end = at;
      while (end < line.size() && !separator(line[end])) ++end;
      if (end > at) lengths.push_back(integer(line.substr(at, end - at), min_length, max_length, where, "length"));
      at = end;
    }
  }
  check(!lengths.empty(), "{} holds no lengths", printable(source));
  return lengths;
}

inline std::vector<std::int64_t> read_lengths(const std::string& path, std::int64_t min_length, std::int64_t max_length) {
  return parse_lengths(trace_detail::read_file(path), path, min_length, max_length);
}

}  // namespace paradyse::data
