// Tests of paradyse/layout/chunking.hpp: the chunking rule's post-conditions over every (n, parts, index).
#include "paradyse/layout/chunking.hpp"

#include <doctest/doctest.h>

#include <vector>

using namespace paradyse;

TEST_CASE("chunk_range: p chunks, consecutive, covering [0, n), sizes n/p or n/p+1, longer ones first") {
  for (std::int64_t n = 0; n <= 40; ++n)
    for (std::int64_t parts = 1; parts <= 9; ++parts) {
      std::int64_t next = 0;
      for (std::int64_t i = 0; i < parts; ++i) {
        const ChunkRange r = chunk_range(n, parts, i);
        CHECK(r.start == next);
        CHECK((r.length == n / parts || r.length == n / parts + 1));
        CHECK(r.length == (i < n % parts ? n / parts + 1 : n / parts));
        CHECK(chunk_length(n, parts, i) == r.length);
        for (std::int64_t e = r.start; e < r.end(); ++e) CHECK(chunk_owner(n, parts, e) == i);
        next = r.end();
      }
      CHECK(next == n);
    }
}

TEST_CASE("chunk_range: 1000 tokens over 3 ranks") {
  CHECK(chunk_range(1000, 3, 0) == ChunkRange{0, 334});
  CHECK(chunk_range(1000, 3, 1) == ChunkRange{334, 333});
  CHECK(chunk_range(1000, 3, 2) == ChunkRange{667, 333});
  static_assert(chunk_range(10, 4, 3).start == 8);  // usable at compile time
}

TEST_CASE("zigzag: part i holds chunks i and 2p-1-i of 2p; every element held by exactly one part") {
  for (std::int64_t n = 0; n <= 40; ++n)
    for (std::int64_t parts = 1; parts <= 8; ++parts) {
      std::vector<int> holders(std::size_t(n), 0);
      std::int64_t total = 0;
      for (std::int64_t i = 0; i < parts; ++i) {
        const auto ranges = zigzag_ranges(n, parts, i);
        CHECK(ranges[0] == chunk_range(n, 2 * parts, i));
        CHECK(ranges[1] == chunk_range(n, 2 * parts, 2 * parts - 1 - i));
        const std::int64_t length = zigzag_length(n, parts, i);
        CHECK(length == ranges[0].length + ranges[1].length);
        total += length;
        for (std::int64_t local = 0; local < length; ++local) {
          const std::int64_t global = zigzag_global_index(n, parts, i, local);
          const std::int64_t want = local < ranges[0].length ? ranges[0].start + local
                                                              : ranges[1].start + local - ranges[0].length;
          CHECK(global == want);
          ++holders[std::size_t(global)];
          CHECK(zigzag_owner(n, parts, global) == i);
        }
      }
      CHECK(total == n);
      for (int h : holders) CHECK(h == 1);
    }
}

TEST_CASE("chunking: bad arguments throw an Error naming the value") {
  CHECK_THROWS_WITH_AS(chunk_range(10, 0, 0), doctest::Contains("part count 0"), Error);
  CHECK_THROWS_WITH_AS(chunk_range(10, 3, 3), doctest::Contains("part index 3 is outside [0, 3)"), Error);
  CHECK_THROWS_WITH_AS(chunk_range(-1, 3, 0), doctest::Contains("element count -1"), Error);
  CHECK_THROWS_WITH_AS(chunk_owner(10, 3, 10), doctest::Contains("element 10 is outside [0, 10)"), Error);
  CHECK_THROWS_AS(zigzag_ranges(10, 2, -1), Error);
  CHECK_THROWS_AS(zigzag_global_index(10, 2, 0, 5), Error);
}
