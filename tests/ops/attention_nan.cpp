// Attention never turns NaN inputs into numbers (issue 27): a NaN in q, k or v reaches every output row that reads
// it (forward and the merge of partial results), so a damaged weight shows as NaN, not as a finite first loss.
#include "paradyse/ops/cpu/attention.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <limits>

using namespace paradyse;
using ops::AttentionMask;

namespace {
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

struct Run {
  Tensor<float> out, lse;
};
// Causal attention over 4 positions, one head of 4, inputs 0.1 * (index % 7), one element set to NaN.
Run run_with_nan(char which, std::int64_t position) {
  const Shape shape{1, 4, 1, 4};
  Tensor<float> q(shape), k(shape), v(shape);
  for (Tensor<float>* t : {&q, &k, &v})
    for (std::size_t i = 0; i < t->span().size(); ++i) t->span()[i] = 0.1f * float(i % 7);
  Tensor<float>& target = which == 'q' ? q : which == 'k' ? k : v;
  target.view()(0, position, 0, 1) = kNaN;
  Run r{Tensor<float>(shape), Tensor<float>(Shape{1, 1, 4})};
  AttentionMask mask;
  mask.causal = true;
  ops::cpu::attention_forward(q.view(), k.view(), v.view(), mask, r.out.view(), r.lse.view());
  return r;
}
bool row_is_nan(const Run& r, std::int64_t i) {
  for (std::int64_t c = 0; c < 4; ++c)
    if (!std::isnan(r.out.view()(0, i, 0, c))) return false;
  return true;
}
bool row_is_finite(const Run& r, std::int64_t i) {
  for (std::int64_t c = 0; c < 4; ++c)
    if (!std::isfinite(r.out.view()(0, i, 0, c))) return false;
  return std::isfinite(r.lse.view()(0, 0, i));
}
}  // namespace

TEST_CASE("attention forward: a NaN in q, k or v gives NaN in every row that reads it, finite elsewhere") {
  const Run q = run_with_nan('q', 2);  // only query 2
  CHECK(row_is_finite(q, 0));
  CHECK(row_is_finite(q, 1));
  CHECK(row_is_nan(q, 2));
  CHECK(std::isnan(q.lse.view()(0, 0, 2)));
  CHECK(row_is_finite(q, 3));
  const Run k = run_with_nan('k', 1);  // queries 1.. see key 1 (causal)
  CHECK(row_is_finite(k, 0));
  for (std::int64_t i = 1; i < 4; ++i) CHECK(row_is_nan(k, i));
  const Run v = run_with_nan('v', 0);  // every query sees key 0: column 1 of every row is NaN
  for (std::int64_t i = 0; i < 4; ++i) CHECK(std::isnan(v.out.view()(0, i, 0, 1)));
}

TEST_CASE("attention merge: a NaN side makes the merged row NaN, even against a side that saw no key") {
  const Shape shape{1, 1, 1, 2};
  Tensor<float> out(shape), block_out(shape), lse(Shape{1, 1, 1}), block_lse(Shape{1, 1, 1});
  out.fill(0.0f);
  lse.fill(-std::numeric_limits<float>::infinity());  // this side saw no key
  block_out.fill(kNaN);
  block_lse.fill(kNaN);
  ops::cpu::attention_merge(out.view(), lse.view(), block_out.view(), block_lse.view());
  CHECK(std::isnan(out.view()(0, 0, 0, 0)));
  CHECK(std::isnan(lse.view()(0, 0, 0)));
}
