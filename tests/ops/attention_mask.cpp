// Tests of paradyse/ops/attention_mask.hpp: the interval rule (visible_key_range) agrees with the plain
// per-element rule of the reference for every (query, key) pair, over offsets, causal and documents.
#include "paradyse/ops/attention_mask.hpp"

#include "ops/reference.hpp"

#include <doctest/doctest.h>

#include <vector>

using namespace paradyse;
using namespace paradyse::testing;

TEST_CASE("visible_key_range and key_visible agree with the reference rule for every pair") {
  const std::vector<std::vector<std::int64_t>> documents = {{}, {0}, {0, 3, 3, 9, 10}, {0, 1, 2, 3, 4, 5}};
  for (const auto& starts : documents)
    for (bool causal : {false, true})
      for (std::int64_t q_offset : {0, 4, 11})
        for (std::int64_t kv_offset : {0, 2, 7, 30}) {
          ReferenceMask r;
          r.causal = causal;
          r.q_offset = q_offset;
          r.kv_offset = kv_offset;
          r.document_starts = starts;
          ops::AttentionMask mask;
          mask.causal = causal;
          mask.q_offset = q_offset;
          mask.kv_offset = kv_offset;
          mask.document_starts = starts;
          ops::validate(mask);
          const std::int64_t q_len = 9, kv_len = 12;
          for (std::int64_t i = 0; i < q_len; ++i) {
            const ops::KeyRange range = ops::visible_key_range(mask, i, kv_len);
            CHECK(range.first <= range.last);
            for (std::int64_t j = 0; j < kv_len; ++j) {
              const bool want = reference_visible(r, i, j);
              CAPTURE(causal); CAPTURE(q_offset); CAPTURE(kv_offset); CAPTURE(starts.size()); CAPTURE(i); CAPTURE(j);
              CHECK(ops::key_visible(mask, i, j) == want);
              CHECK((j >= range.first && j < range.last) == want);
            }
          }
        }
}

TEST_CASE("attention_scale defaults to 1/sqrt(d) and validate rejects bad masks") {
  ops::AttentionMask mask;
  CHECK(ops::attention_scale(mask, 64) == doctest::Approx(0.125));
  mask.scale = 0.5f;
  CHECK(ops::attention_scale(mask, 64) == 0.5f);
  const std::vector<std::int64_t> unsorted = {0, 5, 4};
  mask.document_starts = unsorted;
  CHECK_THROWS_WITH_AS(ops::validate(mask), doctest::Contains("sorted"), Error);
  mask.document_starts = {};
  mask.q_offset = -1;
  CHECK_THROWS_WITH_AS(ops::validate(mask), doctest::Contains("q_offset = -1"), Error);
}
