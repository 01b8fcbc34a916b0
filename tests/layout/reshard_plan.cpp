// Tests of paradyse/layout/reshard_plan.hpp: the collective each transition uses (the table), and, for every
// pair of layouts over meshes of 1 to 3 axes, that each step is legal under the nesting rule and the plan ends at
// the target.
#include "paradyse/layout/reshard_plan.hpp"

#include "layout/small_cases.hpp"

#include <doctest/doctest.h>

using namespace paradyse;
using namespace paradyse::testing;
using Kind = ReshardStep::Kind;

namespace {

std::vector<Kind> kinds(const ReshardPlan& plan) {
  std::vector<Kind> out;
  for (const ReshardStep& s : plan.steps) out.push_back(s.kind);
  return out;
}

// The kind a step must have, from the placements it changes (the table).
bool kind_matches(const ReshardStep& s) {
  const Placement b = s.before, a = s.after;
  switch (s.kind) {
    case Kind::all_reduce: return b.is_partial() && a.is_replicate();
    case Kind::reduce_scatter: return b.is_partial() && a.is_shard();
    case Kind::all_gather: return b.is_shard() && a.is_replicate();
    case Kind::all_to_all: return b.is_shard() && a.is_shard() && b.dim != a.dim;
    case Kind::permute: return b.is_shard() && a.is_shard() && b.dim == a.dim && b.chunking != a.chunking;
    case Kind::slice: return b.is_replicate() && a.is_shard();
    case Kind::make_partial: return b.is_replicate() && a.is_partial();
  }
  return false;
}

}  // namespace

TEST_CASE("plan_reshard: each single-axis transition uses the collective the issue names") {
  using L = DynamicLayout;
  const auto P = Placement::partial(), R = Placement::replicate();
  const auto S0 = Placement::shard(0), S1 = Placement::shard(1), Z1 = Placement::zigzag(1);
  CHECK(kinds(plan_reshard(L{S1}, L{R}, 3)) == std::vector{Kind::all_gather});
  CHECK(kinds(plan_reshard(L{P}, L{R}, 3)) == std::vector{Kind::all_reduce});
  CHECK(kinds(plan_reshard(L{P}, L{S1}, 3)) == std::vector{Kind::reduce_scatter});
  CHECK(kinds(plan_reshard(L{P}, L{Z1}, 3)) == std::vector{Kind::reduce_scatter});
  CHECK(kinds(plan_reshard(L{S1}, L{S0}, 3)) == std::vector{Kind::all_to_all});
  CHECK(kinds(plan_reshard(L{Z1}, L{S0}, 3)) == std::vector{Kind::all_to_all});
  CHECK(kinds(plan_reshard(L{R}, L{S1}, 3)) == std::vector{Kind::slice});
  CHECK(kinds(plan_reshard(L{S1}, L{Z1}, 3)) == std::vector{Kind::permute});
  CHECK(kinds(plan_reshard(L{Z1}, L{S1}, 3)) == std::vector{Kind::permute});
  CHECK(kinds(plan_reshard(L{R}, L{P}, 3)) == std::vector{Kind::make_partial});
  CHECK(plan_reshard(L{S1}, L{S1}, 3).steps.empty());
  // Negative dims resolve: Shard(-2) of a rank-3 tensor is Shard(1).
  CHECK(plan_reshard(L{Placement::shard(-2)}, L{S1}, 3).steps.empty());
  // Two axes: Ulysses-style sequence -> heads on the inner axis only; the outer axis is untouched.
  const auto plan = plan_reshard(StaticLayout<Shard<0>, Shard<1>>{}, StaticLayout<Shard<0>, Shard<2>>{}, 3);
  REQUIRE(plan.steps.size() == 1);
  CHECK(plan.steps[0] == ReshardStep{Kind::all_to_all, 1, S1, Placement::shard(2)});
  // Both axes on one dim, to replicated: innermost axis first.
  const auto gather = plan_reshard(L{S1, S1}, L{R, R}, 3);
  CHECK(kinds(gather) == std::vector{Kind::all_gather, Kind::all_gather});
  CHECK(gather.steps[0].axis == 1);
  // Partial over two axes into a nested shard: two reduce-scatters, outer first.
  CHECK(kinds(plan_reshard(L{P, P}, L{S1, S1}, 3)) == std::vector{Kind::reduce_scatter, Kind::reduce_scatter});
  CHECK(plan.to_string().find("all_to_all over axis 1: Shard(1) -> Shard(2)") != std::string::npos);
}

TEST_CASE("plan_reshard: every pair of layouts over 1-3 mesh axes: legal steps that end at the target") {
  const int tensor_rank = 2;
  const auto placements = all_placements(tensor_rank);
  int pairs = 0;
  for (int ndim = 1; ndim <= 3; ++ndim) {
    const auto layouts = all_layouts(ndim, placements);
    for (const DynamicLayout& from : layouts)
      for (const DynamicLayout& to : layouts) {
        ++pairs;
        const ReshardPlan plan = plan_reshard(from, to, tensor_rank);
        const auto seen = plan.layouts();
        bool legal = seen.front() == from && seen.back() == to && plan.steps.size() <= std::size_t(3 * ndim);
        int communicating = 0;
        for (std::size_t i = 0; i < plan.steps.size(); ++i) {
          const ReshardStep& s = plan.steps[i];
          const DynamicLayout& before = seen[i];
          communicating += s.communicates();
          legal = legal && kind_matches(s) && before[s.axis] == s.before && s.before != s.after;
          // Gathering or sending away a dim: no later axis may shard it (this axis is its innermost cut).
          if (s.before.is_shard())
            for (int b = s.axis + 1; b < ndim; ++b) legal = legal && !before[b].is_shard(s.before.dim);
          // Cutting a dim: no later axis may shard it already (the cut nests inside the earlier axes' cuts).
          if (s.after.is_shard())
            for (int b = s.axis + 1; b < ndim; ++b) legal = legal && !before[b].is_shard(s.after.dim);
          // Moving a Partial's terms around before reducing them would be wrong only for reductions over other
          // axes; a Partial axis itself only changes by all_reduce or reduce_scatter.
          if (s.before.is_partial()) legal = legal && (s.kind == Kind::all_reduce || s.kind == Kind::reduce_scatter);
        }
        legal = legal && communicating <= 2 * ndim;
        if (!legal) FAIL_CHECK(plan.to_string());
      }
  }
  CHECK(pairs == 36 + 36 * 36 + 216 * 216);
}

TEST_CASE("plan_reshard: mismatched layouts are an error") {
  CHECK_THROWS_WITH_AS(plan_reshard(DynamicLayout{Placement::shard(0)},
                                    DynamicLayout{Placement::shard(0), Placement::replicate()}, 2),
                       doctest::Contains("different mesh ranks"), Error);
  CHECK_THROWS_WITH_AS(plan_reshard(DynamicLayout{Placement::shard(3)}, DynamicLayout{Placement::replicate()}, 2),
                       doctest::Contains("names dim 3 of a rank-2 tensor"), Error);
}
