// Tests of paradyse/plan/exact_solver.hpp against exhaustive search on fresh random problems.
#include "paradyse/core/rng.hpp"
#include "paradyse/cost/dry_run.hpp"
#include "paradyse/plan/exact_solver.hpp"

#include "plan/brute_force.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <string_view>

using namespace paradyse;
using namespace paradyse::plan;

namespace {

Strategy id(std::string_view name) { return cost::default_catalog().index_of(name); }

Problem random_problem(Rng& rng, int max_groups, int max_count, int max_options) {
  Problem p;
  const int groups = 1 + int(rng.next_u64() % std::uint64_t(max_groups));
  for (int g = 0; g < groups; ++g) {
    SlotGroup group;
    group.name = fmt::format("g{}", g);
    group.count = int(rng.next_u64() % std::uint64_t(max_count + 1));  // empty groups too
    const int options = 1 + int(rng.next_u64() % std::uint64_t(max_options));
    for (int i = 0; i < options; ++i) {
      Option o;
      o.strategy = i % cost::default_catalog().count();
      o.time_s = 1 + rng.uniform() * 9;
      o.saved_bytes = std::int64_t(rng.next_u64() % 1000);
      o.transient_bytes = std::int64_t(rng.next_u64() % 400);
      if (rng.uniform() < 0.2 && i > 0) o.saved_bytes = group.options[0].saved_bytes;  // ties in memory
      group.options.push_back(o);
    }
    p.groups.push_back(group);
  }
  p.fixed_bytes = std::int64_t(rng.next_u64() % 100);
  return p;
}

void check_against_brute_force(Problem p, Rng& rng) {
  // Budgets from "nothing fits" to "everything fits".
  p.budget_bytes = 0;
  const auto everything = testing::brute_force(Problem{p.groups, p.fixed_bytes, std::int64_t(1) << 60});
  for (int trial = 0; trial < 6; ++trial) {
    p.budget_bytes = everything.least_peak - 50 + std::int64_t(rng.next_u64() % 3000);
    const auto want = testing::brute_force(p);
    const auto got = solve_exact(p);
    REQUIRE(got.has_value() == want.feasible);
    if (!got) continue;
    CHECK(got->time_s == doctest::Approx(want.best_time).epsilon(1e-12));
    CHECK(got->peak_bytes() <= p.budget_bytes);
    for (std::size_t g = 0; g < p.groups.size(); ++g) {
      int total = 0;
      for (int c : got->counts[g]) total += c;
      CHECK(total == p.groups[g].count);
    }
    // assignment_of agrees with the solver's own accounting.
    const Assignment again = assignment_of(p, got->counts);
    CHECK(again.peak_bytes() == got->peak_bytes());
  }
  CHECK(least_memory(p).peak_bytes() == everything.least_peak);
}

}  // namespace

TEST_CASE("exact_solver: matches exhaustive search on random small problems") {
  Rng rng(20260101);
  for (int i = 0; i < 300; ++i) check_against_brute_force(random_problem(rng, 3, 4, 4), rng);
}

TEST_CASE("exact_solver: matches exhaustive search with many identical slots") {
  Rng rng(77);
  for (int i = 0; i < 25; ++i) check_against_brute_force(random_problem(rng, 2, 24, 3), rng);
  for (int i = 0; i < 10; ++i) check_against_brute_force(random_problem(rng, 1, 96, 3), rng);
}

TEST_CASE("exact_solver: finds an optimum that needs three strategies in one group") {
  // Two strategies (any prefix/suffix split) cannot reach the optimum here: one slot on each option is best.
  SlotGroup g{"attention", 3, {}};
  g.options.push_back({id("METP"), 10.0, 0, 0});
  g.options.push_back({id("UlyssesZ"), 5.1, 4, 0});
  g.options.push_back({id("MegatronTS"), 0.0, 10, 0});
  Problem p{{g}, 0, 14};
  const auto a = solve_exact(p);
  REQUIRE(a);
  CHECK(a->counts[0] == std::vector<int>{1, 1, 1});
  CHECK(a->time_s == doctest::Approx(15.1));
  CHECK(testing::brute_force(p).best_time == doctest::Approx(15.1));
}

TEST_CASE("exact_solver: the largest transient counts once, not per slot") {
  // A: fast, little saved, a big transient; B: slow, no transient. Budget admits A's transient once.
  SlotGroup g{"mlp", 4, {}};
  g.options.push_back({id("MegatronTS"), 1.0, 10, 100});
  g.options.push_back({id("METP"), 2.0, 10, 0});
  Problem p{{g}, 0, 4 * 10 + 100};
  const auto a = solve_exact(p);
  REQUIRE(a);
  CHECK(a->time_s == doctest::Approx(4.0));
  p.budget_bytes = 4 * 10 + 99;
  const auto b = solve_exact(p);
  REQUIRE(b);
  CHECK(b->time_s == doctest::Approx(8.0));
  p.budget_bytes = 39;
  CHECK_FALSE(solve_exact(p));
}

TEST_CASE("exact_solver: bad problems are rejected with a message") {
  Problem p{{SlotGroup{"g", -1, {}}}, 0, 10};
  CHECK_THROWS_WITH_AS(solve_exact(p), doctest::Contains("count -1"), Error);
  p.groups[0] = SlotGroup{"g", 1, {Option{id("METP"), -1.0, 0, 0}}};
  CHECK_THROWS_WITH_AS(solve_exact(p), doctest::Contains("negative cost"), Error);
  p.groups[0] = SlotGroup{"empty", 2, {}};
  CHECK_FALSE(solve_exact(p));
  CHECK_THROWS_WITH_AS(least_memory(p), doctest::Contains("\"empty\" has no allowed strategy"), Error);
}
