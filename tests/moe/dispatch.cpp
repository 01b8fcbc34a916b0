// tests/moe/dispatch.cpp: the counting sort's post-conditions (a permutation of the kept assignments, grouped by
// expert, stable, counts right), the capacity (each expert keeps its first tokens, drops counted), and permute /
// combine / their backward against loops written here.
#include "support/tolerance.hpp"

#include "paradyse/core/rng.hpp"
#include "paradyse/moe/dispatch.hpp"
#include "paradyse/ops/backend.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <vector>

using namespace paradyse;
using namespace paradyse::testing;

namespace {
struct Assignments {
  std::vector<std::int64_t> offsets, expert;
};
// Random routing of n tokens over E experts, 0..k_max distinct experts per token.
Assignments random_assignments(std::int64_t n, std::int64_t experts, std::int64_t k_max, Rng& rng) {
  Assignments a;
  a.offsets.push_back(0);
  for (std::int64_t t = 0; t < n; ++t) {
    std::vector<std::int64_t> all(static_cast<std::size_t>(experts));
    for (std::int64_t e = 0; e < experts; ++e) all[std::size_t(e)] = e;
    for (std::int64_t i = experts - 1; i > 0; --i) std::swap(all[std::size_t(i)], all[rng.below(std::uint64_t(i + 1))]);
    const std::int64_t k = std::int64_t(rng.below(std::uint64_t(k_max + 1)));
    a.expert.insert(a.expert.end(), all.begin(), all.begin() + k);
    a.offsets.push_back(a.offsets.back() + k);
  }
  return a;
}
}  // namespace

TEST_CASE("dispatch_by_expert: grouped by expert, stable, counts right; dropless keeps everything") {
  Rng rng(3);
  for (const std::int64_t experts : {1, 3, 8}) {
    const Assignments a = random_assignments(40, experts, std::min<std::int64_t>(experts, 3), rng);
    const Dispatch d = dispatch_by_expert(a.offsets, a.expert, experts);
    CHECK(d.rows() == std::int64_t(a.expert.size()));
    CHECK(d.dropped == 0);
    CHECK(d.capacity == -1);
    std::vector<bool> seen(a.expert.size(), false);
    for (std::int64_t e = 0; e < experts; ++e) {
      CHECK(d.count(e) == std::count(a.expert.begin(), a.expert.end(), e));
      CHECK(d.routed[std::size_t(e)] == d.count(e));
      for (std::int64_t row = d.offsets[std::size_t(e)]; row < d.offsets[std::size_t(e + 1)]; ++row) {
        const std::int64_t slot = d.slot[std::size_t(row)];
        CHECK(a.expert[std::size_t(slot)] == e);
        CHECK(slot >= a.offsets[std::size_t(d.token[std::size_t(row)])]);
        CHECK(slot < a.offsets[std::size_t(d.token[std::size_t(row)] + 1)]);
        if (row > d.offsets[std::size_t(e)]) CHECK(d.slot[std::size_t(row - 1)] < slot);  // stable
        CHECK_FALSE(seen[std::size_t(slot)]);
        seen[std::size_t(slot)] = true;
      }
    }
    CHECK(std::all_of(seen.begin(), seen.end(), [](bool s) { return s; }));
  }
}

TEST_CASE("dispatch_by_expert: a capacity keeps each expert's first tokens and counts the drops") {
  // 6 tokens, top-2; expert 0 is wanted by every token.
  const std::vector<std::int64_t> offsets = {0, 2, 4, 6, 8, 10, 12};
  const std::vector<std::int64_t> expert = {0, 1, 0, 2, 1, 0, 0, 3, 0, 1, 2, 0};
  CHECK(expert_capacity(0, 12, 4) == -1);
  CHECK(expert_capacity(1.0, 12, 4) == 3);
  CHECK(expert_capacity(1.25, 12, 4) == 4);  // ceil(3.75)
  const Dispatch d = dispatch_by_expert(offsets, expert, 4, expert_capacity(1.0, 12, 4));
  CHECK(d.routed == std::vector<std::int64_t>{6, 3, 2, 1});
  CHECK(d.count(0) == 3);
  CHECK(d.count(1) == 3);
  CHECK(d.count(2) == 2);
  CHECK(d.count(3) == 1);
  CHECK(d.dropped == 3);
  // Expert 0 keeps tokens 0, 1, 2 (its first three), in token order.
  CHECK(std::vector<std::int64_t>(d.token.begin(), d.token.begin() + 3) == std::vector<std::int64_t>{0, 1, 2});
  const Dispatch none = dispatch_by_expert(offsets, expert, 4, 0);
  CHECK(none.rows() == 0);
  CHECK(none.dropped == 12);
  CHECK_THROWS_WITH_AS((void)dispatch_by_expert(offsets, expert, 3), doctest::Contains("names expert 3, outside [0, 3)"), Error);
  CHECK_THROWS_WITH_AS((void)expert_capacity(-1, 12, 4), doctest::Contains("capacity factor -1"), Error);
}

TEST_CASE("permute, combine and their backward match loops over the assignments") {
  Rng rng(21);
  const std::int64_t n = 9, h = 7, experts = 4;
  const Assignments a = random_assignments(n, experts, 3, rng);
  for (const std::int64_t capacity : {std::int64_t(-1), std::int64_t(2)}) {
    CAPTURE(capacity);
    const Dispatch d = dispatch_by_expert(a.offsets, a.expert, experts, capacity);
    const std::int64_t rows = d.rows(), m = std::int64_t(a.expert.size());
    const Tensor<float> x = random_uniform<float>(Shape{n, h}, rng), gates = random_uniform<float>(Shape{m}, rng);
    const Tensor<float> hp = random_uniform<float>(Shape{rows, h}, rng), dy = random_uniform<float>(Shape{n, h}, rng);
    Tensor<float> xp(Shape{rows, h}), wp(Shape{rows}), y(Shape{n, h});
    permute_tokens<ops::Cpu>(d, x.view(), xp.view());
    permuted_gates<ops::Cpu>(d, gates.view(), wp.view());
    combine<ops::Cpu>(d, hp.view(), wp.view(), y.view());
    std::vector<double> want_xp, want_y(static_cast<std::size_t>(n * h), 0.0), want_dgates(static_cast<std::size_t>(m), 0.0),
        want_dhp, want_dx(static_cast<std::size_t>(n * h), 0.0);
    for (std::int64_t row = 0; row < rows; ++row) {
      const std::int64_t t = d.token[std::size_t(row)], slot = d.slot[std::size_t(row)];
      for (std::int64_t c = 0; c < h; ++c) {
        want_xp.push_back(x(t, c));
        want_y[std::size_t(t * h + c)] += double(gates(slot)) * hp(row, c);
        want_dgates[std::size_t(slot)] += double(dy(t, c)) * hp(row, c);
        want_dhp.push_back(double(gates(slot)) * dy(t, c));
        want_dx[std::size_t(t * h + c)] += hp(row, c);  // unpermute_add of hp as if it were dxp
      }
    }
    CHECK_CLOSE(xp.span(), want_xp, kFloat32);
    CHECK_CLOSE(y.span(), want_y, kFloat32);
    Tensor<float> dhp(Shape{rows, h}), dwp(Shape{rows}), dgates(Shape{m}), dx(Shape{n, h});
    combine_backward<ops::Cpu>(d, hp.view(), wp.view(), dy.view(), dhp.view(), dwp.view(), dgates.view());
    unpermute_add<ops::Cpu>(d, hp.view(), dx.view());
    CHECK_CLOSE(dhp.span(), want_dhp, kFloat32);
    CHECK_CLOSE(dgates.span(), want_dgates, kFloat32);
    CHECK_CLOSE(dx.span(), want_dx, kFloat32);
    if (capacity >= 0) {
      for (std::int64_t e = 0; e < experts; ++e) CHECK(d.count(e) <= capacity);
      std::int64_t over = 0;
      for (std::int64_t e = 0; e < experts; ++e) over += std::max<std::int64_t>(0, d.routed[std::size_t(e)] - capacity);
      CHECK(d.dropped == over);
    }
  }
}
