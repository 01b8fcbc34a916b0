// Tests of paradyse/layout/layout.hpp (and placement.hpp): the geometry's post-conditions over every coordinate of
// every small mesh, against a plain per-element reference of the nesting rule.
#include "paradyse/layout/layout.hpp"

#include "layout/small_cases.hpp"
#include "paradyse/core/rng.hpp"

#include <doctest/doctest.h>

#include <map>
#include <optional>
#include <vector>

using namespace paradyse;
using namespace paradyse::testing;

namespace {

// Reference, element by element: where global index g of dim d sits locally on the rank at `coord`, or nothing.
// The axes that shard d apply in mesh order; each cuts the extent the previous ones left (chunk_range or zigzag).
std::optional<std::int64_t> reference_local_position(const DynamicLayout& layout, const DeviceMesh& mesh,
                                                     const MeshCoordinate& coord, int d, std::int64_t extent,
                                                     std::int64_t g) {
  std::int64_t position = g;  // position within the extent the previous axes left
  for (int a = 0; a < mesh.ndim(); ++a) {
    const Placement p = layout[a];
    if (!p.is_shard(d)) continue;
    const int parts = mesh.axis_size(a), me = coord[a];
    std::int64_t next_extent = 0, next_position = -1;
    if (p.chunking == Chunking::contiguous) {
      const std::int64_t owner = chunk_owner(extent, parts, position);
      if (owner != me) return std::nullopt;
      next_position = position - chunk_range(extent, parts, me).start;
      next_extent = chunk_length(extent, parts, me);
    } else {
      if (zigzag_owner(extent, parts, position) != me) return std::nullopt;
      const auto first = chunk_range(extent, 2 * parts, me), second = chunk_range(extent, 2 * parts, 2 * parts - 1 - me);
      next_position = first.contains(position) ? position - first.start : first.length + position - second.start;
      next_extent = first.length + second.length;
    }
    position = next_position;
    extent = next_extent;
  }
  return position;
}

}  // namespace

TEST_CASE("layout geometry: post-conditions over every coordinate, mesh (1-3 axes, 1-8 ranks) and layout") {
  const Shape global{5, 7};  // uneven over every rank count above 1
  const auto placements = all_placements(global.rank());
  int layouts_checked = 0;
  for (const DeviceMesh& mesh : small_meshes()) {
    for (const DynamicLayout& layout : all_layouts(mesh.ndim(), placements)) {
      CAPTURE(mesh.to_string());
      CAPTURE(layout.to_string());
      ++layouts_checked;
      for (int d = 0; d < global.rank(); ++d) {
        std::vector<int> holders(std::size_t(global[d]), 0);
        // Ranks that agree on every axis sharding d hold the same indices; the axes sharding d partition them.
        for (int r = 0; r < mesh.size(); ++r) {
          const MeshCoordinate c = mesh.coordinate(r);
          const auto ranges = local_ranges(layout, global, mesh, c, d);
          std::int64_t local = 0;
          bool positions_match = true;
          for (const ChunkRange& range : ranges)
            for (std::int64_t g = range.start; g < range.end(); ++g, ++local) {
              ++holders[std::size_t(g)];
              const auto want = reference_local_position(layout, mesh, c, d, global[d], g);
              positions_match = positions_match && want.has_value() && *want == local;
            }
          CHECK(positions_match);
          CHECK(local_shape(layout, global, mesh, c)[d] == local);
          // And nothing outside the ranges is mine.
          bool only_mine = true;
          for (std::int64_t g = 0; g < global[d]; ++g) {
            bool in = false;
            for (const ChunkRange& range : ranges) in = in || range.contains(g);
            only_mine = only_mine && in == reference_local_position(layout, mesh, c, d, global[d], g).has_value();
          }
          CHECK(only_mine);
        }
        int ranks_not_sharding_d = 1;
        for (int a = 0; a < mesh.ndim(); ++a)
          if (!layout[a].is_shard(d)) ranks_not_sharding_d *= mesh.axis_size(a);
        for (int h : holders) CHECK(h == ranks_not_sharding_d);
      }
    }
  }
  CHECK(layouts_checked > 5000);
}

TEST_CASE("distribute: every rank's shard is the global tensor at the indices the layout names") {
  const Shape global{4, 5, 3};
  const auto placements = all_placements(global.rank());
  Rng rng(17);
  const Tensor<double> x = random_uniform<double>(global, rng);
  for (const DeviceMesh& mesh : small_meshes(6)) {
    for (const DynamicLayout& layout : all_layouts(mesh.ndim(), placements)) {
      CAPTURE(mesh.to_string());
      CAPTURE(layout.to_string());
      for (int r = 0; r < mesh.size(); ++r) {
        const MeshCoordinate c = mesh.coordinate(r);
        const Tensor<double> local = distribute(x, layout, mesh, c);
        REQUIRE(local.shape() == local_shape(layout, global, mesh, c));
        bool zero_share = false;  // a sum-Partial axis at a nonzero index holds zeros
        for (int a = 0; a < mesh.ndim(); ++a) zero_share = zero_share || (layout[a].is_partial() && c[a] != 0);
        const Shape& s = local.shape();
        std::vector<std::int64_t> index_map[3];  // local -> global index per dim
        for (int d = 0; d < 3; ++d)
          for (std::int64_t i = 0; i < s[d]; ++i) index_map[d].push_back(global_index(layout, global, mesh, c, d, i));
        bool all_match = true;
        for (std::int64_t i = 0; i < s[0]; ++i)
          for (std::int64_t j = 0; j < s[1]; ++j)
            for (std::int64_t k = 0; k < s[2]; ++k) {
              const double want = zero_share ? 0.0 : x(index_map[0][std::size_t(i)], index_map[1][std::size_t(j)],
                                                       index_map[2][std::size_t(k)]);
              all_match = all_match && local(i, j, k) == want;
            }
        CHECK(all_match);
      }
    }
  }
}

TEST_CASE("layout: the issue's examples") {
  // 1000 tokens on 3 ranks: [b, s, h] sharded on s.
  const DeviceMesh mesh({{"sp", 3}});
  const Shape global{2, 1000, 8};
  const StaticLayout<Shard<1>> seq;
  for (int r = 0; r < 3; ++r) {
    CHECK(local_shape(seq, global, mesh, r) == Shape{2, chunk_length(1000, 3, r), 8});
    CHECK(local_ranges(seq, global, mesh, mesh.coordinate(r), 1) ==
          std::vector<ChunkRange>{chunk_range(1000, 3, r)});
  }
  // Zigzag over 2 ranks: rank 0 holds chunks 0 and 3 of 4, rank 1 chunks 1 and 2 (merged: one range).
  const DeviceMesh two({{"sp", 2}});
  const StaticLayout<ShardZigzag<1>> zz;
  CHECK(local_ranges(zz, Shape{1, 8, 1}, two, MeshCoordinate{0}, 1) == std::vector<ChunkRange>{{0, 2}, {6, 2}});
  CHECK(local_ranges(zz, Shape{1, 8, 1}, two, MeshCoordinate{1}, 1) == std::vector<ChunkRange>{{2, 4}});
  // Nesting in mesh-axis order: {dp: 2, sp: 2} both sharding dim 0 of 8 is rank-major (like one axis of 4).
  const DeviceMesh grid({{"dp", 2}, {"sp", 2}});
  const DynamicLayout both{Placement::shard(0), Placement::shard(0)};
  for (int r = 0; r < 4; ++r)
    CHECK(local_ranges(both, Shape{8}, grid, grid.coordinate(r), 0) == std::vector<ChunkRange>{chunk_range(8, 4, r)});
}

TEST_CASE("StaticLayout models the Layout concept and converts to the runtime value") {
  using L = StaticLayout<Replicate, Shard<1>, Partial<>>;
  static_assert(Layout<L>);
  static_assert(L::mesh_ndim() == 3);
  static_assert(L::placement(1) == Placement::shard(1));
  static_assert(L::shards(1) && !L::shards(0) && L::has_partial());
  static_assert(StaticLayout<ShardZigzag<2>>::placement(0).is_zigzag());
  static_assert(PlacementType<Partial<ReduceOp::max>> && !PlacementType<int>);
  const DynamicLayout value = L{};
  CHECK(value == DynamicLayout{Placement::replicate(), Placement::shard(1), Placement::partial()});
  CHECK(value.to_string() == "(Replicate, Shard(1), Partial(sum))");
  CHECK(fmt::format("{}", StaticLayout<ShardZigzag<-1>>::dynamic()) == "(Shard(-1, zigzag))");
  CHECK(DynamicLayout{Placement::shard(-1)}.normalized(3) == DynamicLayout{Placement::shard(2)});
  CHECK(value.with(0, Placement::zigzag(0))[0] == Placement::zigzag(0));
}

TEST_CASE("layout: bad input is a clear error") {
  const DeviceMesh mesh({{"dp", 2}, {"sp", 2}});
  const DynamicLayout one_axis{Placement::shard(0)};
  CHECK_THROWS_WITH_AS(local_shape(one_axis, Shape{4, 4}, mesh, 0), doctest::Contains("places 1 mesh axes but the mesh"),
                       Error);
  const DynamicLayout bad_dim{Placement::replicate(), Placement::shard(2)};
  CHECK_THROWS_WITH_AS(local_shape(bad_dim, Shape{4, 4}, mesh, 0), doctest::Contains("names dim 2 of a rank-2 tensor"),
                       Error);
  CHECK_THROWS_AS(local_shape(DynamicLayout{Placement::replicate(), Placement::replicate()}, Shape{4}, mesh, 4), Error);
  CHECK_THROWS_AS(global_index(DynamicLayout{Placement::shard(0), Placement::replicate()}, Shape{4}, mesh,
                               MeshCoordinate{0, 0}, 0, 2),
                  Error);
}
