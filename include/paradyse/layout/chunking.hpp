// paradyse/layout/chunking.hpp: the one rule that splits n elements into parts (uneven sizes allowed).
//
// Rule: chunk i of n elements over p parts has n/p or n/p + 1 elements, the first n % p chunks one longer, and the
// chunks are consecutive in order. So 1000 tokens over 3 ranks are [0, 334) [334, 667) [667, 1000).
// Why not torch.chunk: it cuts ceil(n/p)-sized pieces, which can leave ranks empty (5 over 4 gives 2, 2, 1 and a
// missing fourth chunk) and unbalances the work by up to p - 1 elements; this rule (numpy.array_split's) always
// gives p chunks whose sizes differ by at most one, and every chunk's start is computable in O(1).
//
// Zigzag: n elements are cut into 2p chunks by the same rule and part i holds chunks i and 2p-1-i, in that order.
// Under a causal mask chunk c costs about c units of work, so every part gets the same total (balanced ring
// attention). Every strategy that needs the token range of a rank calls these functions, nothing else.
#pragma once

#include "paradyse/core/error.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstdint>

namespace paradyse {

// A half-open range [start, start + length) of element indices.
struct ChunkRange {
  std::int64_t start = 0;
  std::int64_t length = 0;

  constexpr std::int64_t end() const noexcept { return start + length; }
  constexpr bool contains(std::int64_t index) const noexcept { return index >= start && index < end(); }
  friend constexpr bool operator==(const ChunkRange&, const ChunkRange&) = default;
};

namespace detail {
// The checks throw only on failure, so the functions below stay usable in constant expressions.
[[noreturn]] inline void throw_chunk_error(std::int64_t n, std::int64_t parts, std::int64_t index) {
  if (n < 0) throw Error(fmt::format("chunking: element count {} must be non-negative", n));
  if (parts < 1) throw Error(fmt::format("chunking: part count {} must be at least 1", parts));
  throw Error(fmt::format("chunking: part index {} is outside [0, {})", index, parts));
}
constexpr void check_chunk_arguments(std::int64_t n, std::int64_t parts, std::int64_t index) {
  if (n < 0 || parts < 1 || index < 0 || index >= parts) throw_chunk_error(n, parts, index);
}
[[noreturn]] inline void throw_index_error(const char* what, std::int64_t index, std::int64_t extent) {
  throw Error(fmt::format("{}: element {} is outside [0, {})", what, index, extent));
}
}  // namespace detail

// Elements of chunk `index` of `n` elements split into `parts` chunks.
constexpr std::int64_t chunk_length(std::int64_t n, std::int64_t parts, std::int64_t index) {
  detail::check_chunk_arguments(n, parts, index);
  return n / parts + (index < n % parts ? 1 : 0);
}

// Chunk `index` of `n` elements split into `parts` chunks: the first n % parts chunks are one longer.
constexpr ChunkRange chunk_range(std::int64_t n, std::int64_t parts, std::int64_t index) {
  detail::check_chunk_arguments(n, parts, index);
  const std::int64_t base = n / parts, longer = n % parts;
  return {index * base + std::min(index, longer), base + (index < longer ? 1 : 0)};
}

// The chunk that holds element `element` (the inverse of chunk_range).
constexpr std::int64_t chunk_owner(std::int64_t n, std::int64_t parts, std::int64_t element) {
  detail::check_chunk_arguments(n, parts, 0);
  if (element < 0 || element >= n) detail::throw_index_error("chunk_owner", element, n);
  const std::int64_t base = n / parts, longer = n % parts;
  const std::int64_t in_longer = longer * (base + 1);  // elements covered by the longer chunks
  return element < in_longer ? element / (base + 1) : longer + (element - in_longer) / base;
}

// The two chunks part `index` holds under zigzag: chunks index and 2*parts-1-index of 2*parts, in that order.
constexpr std::array<ChunkRange, 2> zigzag_ranges(std::int64_t n, std::int64_t parts, std::int64_t index) {
  detail::check_chunk_arguments(n, parts, index);
  return {chunk_range(n, 2 * parts, index), chunk_range(n, 2 * parts, 2 * parts - 1 - index)};
}

// Elements part `index` holds under zigzag.
constexpr std::int64_t zigzag_length(std::int64_t n, std::int64_t parts, std::int64_t index) {
  const auto ranges = zigzag_ranges(n, parts, index);
  return ranges[0].length + ranges[1].length;
}

// The global index of local element `local` of part `index` under zigzag (for causal masks with global positions).
constexpr std::int64_t zigzag_global_index(std::int64_t n, std::int64_t parts, std::int64_t index, std::int64_t local) {
  const auto ranges = zigzag_ranges(n, parts, index);
  if (local < 0 || local >= ranges[0].length + ranges[1].length)
    detail::throw_index_error("zigzag_global_index (local element of the part)", local,
                              ranges[0].length + ranges[1].length);
  return local < ranges[0].length ? ranges[0].start + local : ranges[1].start + (local - ranges[0].length);
}

// The part that holds element `element` under zigzag.
constexpr std::int64_t zigzag_owner(std::int64_t n, std::int64_t parts, std::int64_t element) {
  const std::int64_t chunk = chunk_owner(n, 2 * parts, element);
  return chunk < parts ? chunk : 2 * parts - 1 - chunk;
}

}  // namespace paradyse
