// Tests of paradyse/layout/reshard.hpp on thread ranks: for pairs of layouts over every mesh of 1 to 3 axes and 1 to
// 8 ranks, with uneven shapes, every rank's result is the slice of the global tensor the target layout names (for a
// Partial target: its terms sum to that slice), and resharding back gives the input again.
#include "paradyse/layout/reshard.hpp"

#include "layout/small_cases.hpp"
#include "paradyse/comm/threads.hpp"
#include "paradyse/core/rng.hpp"
#include "support/tolerance.hpp"

#include <doctest/doctest.h>

#include <chrono>
#include <vector>

using namespace paradyse;
using namespace paradyse::testing;

namespace {

DynamicLayout without_partials(const DynamicLayout& layout) {
  DynamicLayout out = layout;
  for (int a = 0; a < layout.mesh_ndim(); ++a)
    if (layout[a].is_partial()) out = out.with(a, Placement::replicate());
  return out;
}

std::vector<int> partial_axes(const DynamicLayout& layout) {
  std::vector<int> axes;
  for (int a = 0; a < layout.mesh_ndim(); ++a)
    if (layout[a].is_partial()) axes.push_back(a);
  return axes;
}

// The `layout` shard of `global` on `rank`, with random terms on the Partial (sum) axes: every member of a Partial
// group but the first holds noise, and the first holds the slice minus the others' noise.
Tensor<double> make_shard(const Tensor<double>& global, const DynamicLayout& layout, const DeviceMesh& mesh, int rank,
                          std::uint64_t seed) {
  Tensor<double> base = distribute(global, without_partials(layout), mesh, mesh.coordinate(rank));
  const auto axes = partial_axes(layout);
  if (axes.empty()) return base;
  const int members = mesh.group_size(axes), me = mesh.group_index(rank, axes), color = mesh.group_color(rank, axes);
  auto noise = [&](int member) {
    Rng rng(seed * 1000003u + std::uint64_t(color) * 131u + std::uint64_t(member));
    return random_uniform<double>(base.shape(), rng);
  };
  if (me != 0) return noise(me);
  for (int m = 1; m < members; ++m) {
    const Tensor<double> n = noise(m);
    for (std::int64_t i = 0; i < base.numel(); ++i) base.data()[i] -= n.data()[i];
  }
  return base;
}

// Checks that `locals` (one per rank) hold `global` in `layout`: bitwise when `exact`, else within kFloat64; on
// Partial axes the terms of each group must sum to the slice.
void check_holds(const Tensor<double>& global, const DynamicLayout& layout, const DeviceMesh& mesh,
                 const std::vector<std::vector<double>>& locals, bool exact, const std::string& what) {
  const auto axes = partial_axes(layout);
  for (int r = 0; r < mesh.size(); ++r) {
    const Tensor<double> want = distribute(global, without_partials(layout), mesh, mesh.coordinate(r));
    std::vector<double> got = locals[std::size_t(r)];
    if (!axes.empty()) {
      std::fill(got.begin(), got.end(), 0.0);
      for (int q : mesh.group_ranks(r, axes)) {
        const auto& term = locals[std::size_t(q)];
        if (term.size() != got.size()) {
          FAIL_CHECK(what, ": rank ", q, " holds ", term.size(), " elements, rank ", r, " holds ", got.size());
          return;
        }
        for (std::size_t i = 0; i < got.size(); ++i) got[i] += term[i];
      }
    }
    INFO(what, " on rank ", r);
    if (exact) {
      const bool same = got.size() == std::size_t(want.numel()) && std::equal(got.begin(), got.end(), want.data());
      if (!same) FAIL_CHECK("rank ", r, " does not hold its slice exactly");
    } else {
      CHECK_CLOSE(got, want.span(), kFloat64);
    }
  }
}

// Reshards x from -> to -> from for every pair on `mesh` (one run of thread ranks) and checks both directions.
void sweep(const DeviceMesh& mesh, const Shape& shape, const std::vector<std::pair<DynamicLayout, DynamicLayout>>& pairs,
           std::uint64_t seed) {
  Rng rng(seed);
  const Tensor<double> global = random_uniform<double>(shape, rng);
  const std::size_t n = pairs.size(), ranks = std::size_t(mesh.size());
  std::vector<std::vector<std::vector<double>>> inputs(n), there(n), back(n);
  for (std::size_t k = 0; k < n; ++k) {
    inputs[k].resize(ranks);
    there[k].resize(ranks);
    back[k].resize(ranks);
  }
  run_ranks(mesh.size(), [&](ThreadCommunicator& world) {
    MeshCommunicator comm(mesh, world);
    const auto r = std::size_t(world.rank());
    for (std::size_t k = 0; k < n; ++k) {
      const auto& [from, to] = pairs[k];
      const Tensor<double> x = make_shard(global, from, mesh, world.rank(), seed + k);
      const Tensor<double> y = reshard(comm, x, shape, from, to);
      const Tensor<double> z = reshard(comm, y, shape, to, from);
      inputs[k][r].assign(x.data(), x.data() + x.numel());
      there[k][r].assign(y.data(), y.data() + y.numel());
      back[k][r].assign(z.data(), z.data() + z.numel());
    }
  });
  for (std::size_t k = 0; k < n; ++k) {
    const auto& [from, to] = pairs[k];
    const std::string what = fmt::format("mesh {} shape {}: {} -> {}", mesh.to_string(), shape, from, to);
    const bool data_only = !from.has_partial();  // no arithmetic: results must be bitwise
    check_holds(global, to, mesh, there[k], data_only, what);
    if (data_only) {
      if (back[k] != inputs[k]) FAIL_CHECK(what, ": resharding back does not give the input");
    } else {
      check_holds(global, from, mesh, back[k], false, what + " and back");
    }
  }
}

std::vector<std::pair<DynamicLayout, DynamicLayout>> all_pairs(const std::vector<DynamicLayout>& layouts) {
  std::vector<std::pair<DynamicLayout, DynamicLayout>> pairs;
  for (const auto& a : layouts)
    for (const auto& b : layouts) pairs.push_back({a, b});
  return pairs;
}

}  // namespace

TEST_CASE("reshard: every pair of layouts on every mesh of 1 and 2 axes with 1-8 ranks (uneven shapes)") {
  const Shape shape{5, 7};
  for (const DeviceMesh& mesh : small_meshes(8, 2)) {
    const auto layouts = all_layouts(mesh.ndim(), all_placements(shape.rank()));
    const auto t0 = std::chrono::steady_clock::now();
    sweep(mesh, shape, all_pairs(layouts), 1000 + std::uint64_t(mesh.size()));
    MESSAGE(mesh.to_string(), " ", std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
}
