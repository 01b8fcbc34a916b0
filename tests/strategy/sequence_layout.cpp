// SequenceLayout: every token held exactly once, positions follow layout/chunking.hpp, and the rank-major <->
// natural permutations are inverse to each other and put every token where the gather puts it.
#include "paradyse/strategy/sequence_layout.hpp"

#include <doctest/doctest.h>

#include <set>
#include <vector>

using namespace paradyse;

TEST_CASE("SequenceLayout: every token exactly once, in the chunking rule's places") {
  for (int p : {1, 2, 3, 4, 8})
    for (bool zigzag : {false, true})
      for (std::int64_t s : {std::int64_t(2 * p), std::int64_t(2 * p + 1), std::int64_t(5 * p + 3), std::int64_t(64)}) {
        CAPTURE(p);
        CAPTURE(zigzag);
        CAPTURE(s);
        const SequenceLayout layout(s, p, zigzag);
        std::multiset<std::int64_t> seen;
        std::int64_t total = 0;
        for (int r = 0; r < p; ++r) {
          const std::int64_t n = layout.local_length(r);
          total += n;
          CHECK(n == (zigzag ? zigzag_length(s, p, r) : chunk_length(s, p, r)));
          for (std::int64_t i = 0; i < n; ++i) {
            const std::int64_t position = layout.position(r, i);
            seen.insert(position);
            if (zigzag) CHECK(position == zigzag_global_index(s, p, r, i));
            else CHECK(position == chunk_range(s, p, r).start + i);
          }
        }
        CHECK(total == s);
        CHECK(std::set<std::int64_t>(seen.begin(), seen.end()).size() == std::size_t(s));
      }
}

TEST_CASE("SequenceLayout: rank-major <-> natural permutations") {
  for (int p : {1, 3, 4})
    for (bool zigzag : {false, true})
      for (std::int64_t batch : {1, 2}) {
        const std::int64_t s = 4 * p + 3, width = 3;
        const SequenceLayout layout(s, p, zigzag);
        // A rank-major buffer as a gather builds it: rank r's block [b][n_r][C], token value = global id.
        std::vector<float> rank_major;
        for (int r = 0; r < p; ++r)
          for (std::int64_t b = 0; b < batch; ++b)
            for (std::int64_t i = 0; i < layout.local_length(r); ++i)
              for (std::int64_t c = 0; c < width; ++c) rank_major.push_back(float((b * s + layout.position(r, i)) * width + c));
        std::vector<float> natural(rank_major.size()), back(rank_major.size());
        rank_major_to_natural(layout, batch, width, rank_major.data(), natural.data());
        for (std::size_t i = 0; i < natural.size(); ++i) CHECK(natural[i] == float(i));
        natural_to_rank_major(layout, batch, width, natural.data(), back.data());
        CHECK(back == rank_major);
        CHECK(layout.natural_is_rank_major(batch) == (batch == 1 && !zigzag));
      }
}

TEST_CASE("SequenceLayout: too few tokens is an error naming the counts") {
  CHECK_THROWS_WITH_AS(SequenceLayout(5, 3, true), doctest::Contains("5 tokens cannot give each of the 6 chunks"), Error);
  CHECK_NOTHROW(SequenceLayout(6, 3, true));
}
