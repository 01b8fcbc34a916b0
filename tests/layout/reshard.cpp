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
      const ShardedTensor<double> y = reshard(comm, ShardedView<const double>{x.view(), TensorLayout(shape, from)}, to);
      const Tensor<double> z = reshard(comm, y, from).local;
      inputs[k][r].assign(x.data(), x.data() + x.numel());
      there[k][r].assign(y.local.data(), y.local.data() + y.local.numel());
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

using Pairs = std::vector<std::pair<DynamicLayout, DynamicLayout>>;

Pairs all_pairs(const std::vector<DynamicLayout>& layouts) {
  Pairs pairs;
  for (const auto& a : layouts)
    for (const auto& b : layouts) pairs.push_back({a, b});
  return pairs;
}

// `extra` random pairs (seeded: the same every run); with `every_source`, first every layout once as the source.
Pairs sampled_pairs(const std::vector<DynamicLayout>& layouts, std::size_t extra, std::uint64_t seed,
                    bool every_source = true) {
  Rng rng(seed);
  Pairs pairs;
  if (every_source)
    for (const auto& a : layouts) pairs.push_back({a, layouts[rng.below(layouts.size())]});
  for (std::size_t k = 0; k < extra; ++k)
    pairs.push_back({layouts[rng.below(layouts.size())], layouts[rng.below(layouts.size())]});
  return pairs;
}

bool has_trivial_axis(const DeviceMesh& mesh) {
  for (const MeshAxis& axis : mesh.axes())
    if (axis.size == 1) return true;
  return false;
}

}  // namespace

// Thread ranks rendezvous for every collective and the machine has few cores, so the sweeps below are exhaustive
// where a mesh has something new to show (every pair on 1-axis meshes and on 2-axis meshes without a size-1 axis)
// and sampled elsewhere (every layout at least once as the source).
TEST_CASE("reshard: every pair of layouts on every 1-axis mesh of 1-8 ranks, 2-D and 3-D uneven shapes") {
  for (const DeviceMesh& mesh : small_meshes(8, 1)) {
    for (const Shape& shape : {Shape{5, 7}, Shape{3, 4, 5}}) {
      const auto layouts = all_layouts(mesh.ndim(), all_placements(shape.rank()));
      sweep(mesh, shape, all_pairs(layouts), 100 + std::uint64_t(mesh.size()));
    }
  }
}

TEST_CASE("reshard: every pair of layouts on the 2-axis meshes 2x2, 2x3, 3x2, 2x4, 4x2") {
  const Shape shape{5, 7};
  for (const DeviceMesh& mesh : small_meshes(8, 2)) {
    if (mesh.ndim() != 2 || has_trivial_axis(mesh)) continue;
    const auto layouts = all_layouts(mesh.ndim(), all_placements(shape.rank()));
    sweep(mesh, shape, all_pairs(layouts), 200 + std::uint64_t(mesh.size()));
  }
}

TEST_CASE("reshard: sampled pairs on every other mesh of 2 and 3 axes with 1-8 ranks (every source on 2x2x2)") {
  const Shape shape{5, 7};
  for (const DeviceMesh& mesh : small_meshes(8, 3)) {
    if (mesh.ndim() == 1 || (mesh.ndim() == 2 && !has_trivial_axis(mesh))) continue;
    const auto layouts = all_layouts(mesh.ndim(), all_placements(shape.rank()));
    // Size-1 axes change nothing but the bookkeeping: fewer pairs there.
    const bool trivial = has_trivial_axis(mesh);
    const Pairs pairs = sampled_pairs(layouts, trivial ? 50 : 400, 300 + std::uint64_t(mesh.size()), !trivial);
    sweep(mesh, shape, pairs, 400 + std::uint64_t(mesh.size()));
  }
  // A 3-D tensor on the 2x2x2 mesh: a few hundred pairs of its 512 x 512.
  const DeviceMesh cube({{"dp", 2}, {"sp", 2}, {"tp", 2}});
  const auto layouts = all_layouts(3, all_placements(3));
  sweep(cube, Shape{3, 5, 2}, sampled_pairs(layouts, 200, 77), 78);
}

TEST_CASE("reshard: the issue's examples on [b, s, h] activations, with compile-time layouts and byte reports") {
  // 1000 tokens on 3 ranks: sequence shards -> head shards (Ulysses) -> zigzag sequence shards -> replicated.
  const DeviceMesh mesh({{"sp", 3}});
  const Shape global{2, 1000, 6};
  Rng rng(5);
  const Tensor<float> x = random_uniform<float>(global, rng);
  using Sequence = StaticLayout<Shard<1>>;
  using Heads = StaticLayout<Shard<2>>;
  using Zigzag = StaticLayout<ShardZigzag<1>>;
  using Full = StaticLayout<Replicate>;
  std::vector<std::string> failures(3);
  run_ranks(3, [&](ThreadCommunicator& world) {
    MeshCommunicator comm(mesh, world);
    const MeshCoordinate me = comm.coordinate();
    std::string& failure = failures[std::size_t(world.rank())];
    auto expect = [&](const Tensor<float>& got, auto layout, const char* what) {
      const Tensor<float> want = distribute(x, layout, mesh, me);
      if (got.shape() != want.shape() || !std::equal(want.span().begin(), want.span().end(), got.span().begin()))
        failure += fmt::format("{} differs; ", what);
    };
    const ShardedTensor<float> seq{distribute(x, Sequence{}, mesh, me), TensorLayout(global, Sequence{})};
    ReshardReport report;
    const ShardedTensor<float> heads = reshard(comm, seq, Heads{}, &report);  // the layout travels with the shard
    expect(heads.local, Heads{}, "heads");
    if (!(heads.layout == TensorLayout(global, Heads{}))) failure += "the result's layout is not the target; ";
    if (report.plan.steps.size() != 1 || report.plan.steps[0].kind != ReshardStep::Kind::all_to_all)
      failure += "sequence -> heads is not one all_to_all; ";
    // All-to-all sends everything but the block a rank keeps.
    const std::uint64_t kept = std::uint64_t(seq.local.shape().with(2, 2).numel()) * sizeof(float);
    if (report.bytes_sent != seq.local.bytes() - kept)
      failure += fmt::format("all_to_all sent {} bytes; ", report.bytes_sent);
    const ShardedTensor<float> zigzag = reshard(comm, heads, Zigzag{});
    expect(zigzag.local, Zigzag{}, "zigzag");
    const ShardedTensor<float> full = reshard(comm, zigzag, Full{});
    expect(full.local, Full{}, "replicated");
    const ShardedTensor<float> back = reshard(comm, full, Sequence{}, &report);
    expect(back.local, Sequence{}, "sequence again");
    if (report.bytes_sent != 0) failure += "Replicate -> Shard communicated; ";
  });
  for (const std::string& f : failures) CHECK_MESSAGE(f.empty(), f);
}

TEST_CASE("reshard: float and bf16 elements; Partial reductions within the float32 tolerance") {
  const DeviceMesh mesh({{"dp", 2}, {"sp", 3}});
  const Shape global{4, 7};
  Rng rng(9);
  const Tensor<double> x64 = random_uniform<double>(global, rng);
  Tensor<float> x32(global);
  Tensor<bf16> x16(global);
  for (std::int64_t i = 0; i < x64.numel(); ++i) {
    x32.data()[i] = float(x64.data()[i]);
    x16.data()[i] = bf16(float(x64.data()[i]));
  }
  const DynamicLayout partial_rows{Placement::partial(), Placement::shard(0)};
  const DynamicLayout zigzag_cols{Placement::zigzag(1), Placement::replicate()};
  std::vector<std::string> failures(6);
  run_ranks(6, [&](ThreadCommunicator& world) {
    MeshCommunicator comm(mesh, world);
    const MeshCoordinate me = comm.coordinate();
    std::string& failure = failures[std::size_t(world.rank())];
    // float: the dp-partial terms are half the value each; reduce-scatter them into zigzag columns.
    Tensor<float> terms = distribute(x32, without_partials(partial_rows), mesh, me);
    for (float& v : terms.span()) v *= 0.5f;
    const Tensor<float> y = reshard(comm, ShardedView<const float>{terms.view(), TensorLayout(global, partial_rows)}, zigzag_cols).local;
    const Tensor<double> want = distribute(x64, zigzag_cols, mesh, me);
    const std::string miss = first_mismatch(std::span<const float>(y.span()), std::span<const double>(want.span()), kFloat32);
    if (!miss.empty()) failure += "float: " + miss + "; ";
    // bf16 moves data only: bitwise.
    const DynamicLayout a{Placement::shard(1), Placement::zigzag(0)}, b{Placement::zigzag(0), Placement::shard(1)};
    const Tensor<bf16> z = reshard(comm, ShardedTensor<bf16>{distribute(x16, a, mesh, me), TensorLayout(global, a)}, b).local;
    const Tensor<bf16> z_want = distribute(x16, b, mesh, me);
    if (z.shape() != z_want.shape() ||
        !std::equal(z.span().begin(), z.span().end(), z_want.span().begin(),
                    [](bf16 p, bf16 q) { return p.bits == q.bits; }))
      failure += "bf16 differs; ";
  });
  for (const std::string& f : failures) CHECK_MESSAGE(f.empty(), f);
}

TEST_CASE("reshard: Partial(max) and Partial(avg) reduce with their op") {
  const DeviceMesh mesh({{"tp", 4}});
  const Shape global{3, 5};
  Rng rng(21);
  const Tensor<double> x = random_uniform<double>(global, rng);
  std::vector<std::string> failures(4);
  run_ranks(4, [&](ThreadCommunicator& world) {
    MeshCommunicator comm(mesh, world);
    std::string& failure = failures[std::size_t(world.rank())];
    // max: rank 0 holds the value, the others something smaller.
    Tensor<double> terms = Tensor<double>::copy_of(x.view());
    if (world.rank() != 0)
      for (double& v : terms.span()) v -= 0.25 + 0.125 * world.rank();
    const TensorLayout maxes(global, StaticLayout<Partial<ReduceOp::max>>{});
    const Tensor<double> maxed = reshard(comm, ShardedView<const double>{terms.view(), maxes}, StaticLayout<Shard<1>>{}).local;
    const Tensor<double> want = distribute(x, StaticLayout<Shard<1>>{}, mesh, comm.coordinate());
    if (!first_mismatch(std::span<const double>(maxed.span()), std::span<const double>(want.span()), kFloat64).empty())
      failure += "max; ";
    // avg: terms x + (r - 1.5) average to x.
    for (std::int64_t i = 0; i < terms.numel(); ++i) terms.data()[i] = x.data()[i] + (world.rank() - 1.5);
    const TensorLayout sums(global, StaticLayout<Partial<ReduceOp::avg>>{});
    const Tensor<double> averaged = reshard(comm, ShardedView<const double>{terms.view(), sums}, StaticLayout<Replicate>{}).local;
    if (!first_mismatch(std::span<const double>(averaged.span()), std::span<const double>(x.span()), kFloat64).empty())
      failure += "avg; ";
  });
  for (const std::string& f : failures) CHECK_MESSAGE(f.empty(), f);
}

TEST_CASE("reshard: a shard of the wrong shape is a clear error") {
  const DeviceMesh mesh({{"sp", 2}});
  CHECK_THROWS_WITH_AS(run_ranks(2,
                                 [&](ThreadCommunicator& world) {
                                   MeshCommunicator comm(mesh, world);
                                   const Tensor<float> x(Shape{2, 3});  // the Shard(1) shard of [2, 7] is [2, 4] / [2, 3]
                                   const TensorLayout wrong(Shape{2, 7}, StaticLayout<Shard<1>>{});
                                   (void)reshard(comm, ShardedView<const float>{x.view(), wrong}, StaticLayout<Replicate>{});
                                 }),
                       doctest::Contains("holds a shard of shape [2, 3], but layout (Shard(1)) of [2, 7] gives it [2, 4]"),
                       Error);
  CHECK_THROWS_WITH_AS(run_ranks(2,
                                 [&](ThreadCommunicator& world) {
                                   MeshCommunicator comm(DeviceMesh({{"dp", 1}, {"sp", 3}}), world);
                                 }),
                       doctest::Contains("holds 3 ranks but the world has 2"), Error);
}
