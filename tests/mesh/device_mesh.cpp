// Tests of paradyse/mesh/device_mesh.hpp: rank <-> coordinate and groups, exhaustively over every mesh of 1 to 3
// axes with world sizes 1 to 8 (axes of size 1 included), against plain brute-force definitions.
#include "paradyse/comm/threads.hpp"
#include "paradyse/mesh/device_mesh.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <numeric>
#include <vector>

using namespace paradyse;

namespace {

// Every mesh of 1 to 3 axes whose world size is 1 to 8: every ordered factorisation.
std::vector<DeviceMesh> all_small_meshes() {
  std::vector<DeviceMesh> meshes;
  for (int world = 1; world <= 8; ++world) {
    meshes.push_back(DeviceMesh({{"dp", world}}));
    for (int a = 1; a <= world; ++a) {
      if (world % a) continue;
      meshes.push_back(DeviceMesh({{"dp", a}, {"sp", world / a}}));
      for (int b = 1; b <= world / a; ++b)
        if ((world / a) % b == 0) meshes.push_back(DeviceMesh({{"dp", a}, {"sp", b}, {"tp", world / a / b}}));
    }
  }
  return meshes;
}

// Every ordered, non-empty list of distinct axes of an n-axis mesh.
std::vector<std::vector<int>> all_axis_lists(int ndim) {
  std::vector<std::vector<int>> lists;
  for (int mask = 1; mask < (1 << ndim); ++mask) {
    std::vector<int> axes;
    for (int a = 0; a < ndim; ++a)
      if (mask & (1 << a)) axes.push_back(a);
    do lists.push_back(axes);
    while (std::next_permutation(axes.begin(), axes.end()));
  }
  return lists;
}

// The reference: coordinates listed by a plain odometer whose last axis turns fastest.
std::vector<std::vector<int>> odometer(const DeviceMesh& mesh) {
  std::vector<std::vector<int>> coords;
  std::vector<int> c(std::size_t(mesh.ndim()), 0);
  for (int r = 0; r < mesh.size(); ++r) {
    coords.push_back(c);
    for (int a = mesh.ndim() - 1; a >= 0; --a) {
      if (++c[std::size_t(a)] < mesh.axis_size(a)) break;
      c[std::size_t(a)] = 0;
    }
  }
  return coords;
}

}  // namespace

TEST_CASE("DeviceMesh: rank <-> coordinate, last axis innermost, over every mesh of 1-3 axes and 1-8 ranks") {
  const auto meshes = all_small_meshes();
  CHECK(meshes.size() == 8 + 20 + 38);
  for (const DeviceMesh& mesh : meshes) {
    CAPTURE(mesh.to_string());
    const auto coords = odometer(mesh);
    CHECK(int(coords.size()) == mesh.size());
    for (int r = 0; r < mesh.size(); ++r) {
      const MeshCoordinate c = mesh.coordinate(r);
      CHECK(c.ndim() == mesh.ndim());
      CHECK(std::vector<int>(c.begin(), c.end()) == coords[std::size_t(r)]);
      CHECK(mesh.rank_of(c) == r);
      for (int a = 0; a < mesh.ndim(); ++a) CHECK(mesh.coordinate(r, mesh.axis(a).name) == c[a]);
    }
  }
}

TEST_CASE("DeviceMesh: groups over every ordered subset of axes match the brute-force definition") {
  for (const DeviceMesh& mesh : all_small_meshes()) {
    for (const auto& axes : all_axis_lists(mesh.ndim())) {
      CAPTURE(mesh.to_string());
      CAPTURE(fmt::format("{}", fmt::join(axes, ",")));
      int expected_size = 1;
      for (int a : axes) expected_size *= mesh.axis_size(a);
      CHECK(mesh.group_size(axes) == expected_size);
      std::vector<int> colors_seen;
      for (int r = 0; r < mesh.size(); ++r) {
        const MeshCoordinate mine = mesh.coordinate(r);
        // Brute force: the ranks that agree with me on every axis not chosen, ordered by their row-major index
        // over the chosen axes in the listed order.
        std::vector<std::pair<int, int>> members;  // (index, rank)
        for (int q = 0; q < mesh.size(); ++q) {
          const MeshCoordinate other = mesh.coordinate(q);
          bool same_group = true;
          for (int a = 0; a < mesh.ndim(); ++a)
            if (std::find(axes.begin(), axes.end(), a) == axes.end() && other[a] != mine[a]) same_group = false;
          if (!same_group) continue;
          int index = 0;
          for (int a : axes) index = index * mesh.axis_size(a) + other[a];
          members.push_back({index, q});
        }
        std::sort(members.begin(), members.end());
        std::vector<int> want;
        for (std::size_t i = 0; i < members.size(); ++i) {
          CHECK(members[i].first == int(i));  // indices are 0..n-1 without gaps
          want.push_back(members[i].second);
        }
        const std::vector<int> got = mesh.group_ranks(r, axes);
        CHECK(got == want);
        CHECK(got[std::size_t(mesh.group_index(r, axes))] == r);
        // Same color exactly within a group.
        for (int q : got) CHECK(mesh.group_color(q, axes) == mesh.group_color(r, axes));
        for (int q = 0; q < mesh.size(); ++q)
          if (std::find(got.begin(), got.end(), q) == got.end()) CHECK(mesh.group_color(q, axes) != mesh.group_color(r, axes));
        colors_seen.push_back(mesh.group_color(r, axes));
      }
      std::sort(colors_seen.begin(), colors_seen.end());
      colors_seen.erase(std::unique(colors_seen.begin(), colors_seen.end()), colors_seen.end());
      CHECK(int(colors_seen.size()) == mesh.size() / expected_size);
    }
  }
}

TEST_CASE("DeviceMesh: group() splits a thread world into the groups group_ranks() names") {
  for (const DeviceMesh& mesh : all_small_meshes()) {
    CAPTURE(mesh.to_string());
    const auto lists = all_axis_lists(mesh.ndim());
    run_ranks(mesh.size(), [&](ThreadCommunicator& world) {
      for (const auto& axes : lists) {
        ThreadCommunicator group = mesh.group(world, std::span<const int>(axes));
        const std::vector<int> want = mesh.group_ranks(world.rank(), axes);
        check(group.size() == int(want.size()), "group size {} != {}", group.size(), want.size());
        check(group.rank() == mesh.group_index(world.rank(), axes), "group rank {} is not the group index", group.rank());
        // Every member reports its world rank: the gathered list is the group, in group order.
        const std::int32_t me = world.rank();
        std::vector<std::int32_t> members(want.size());
        group.all_gather(std::span<const std::int32_t>(&me, 1), std::span<std::int32_t>(members));
        check(std::equal(members.begin(), members.end(), want.begin()), "group members differ from group_ranks");
      }
    });
  }
  // By name, with the fused EP-style group over {dp, sp} of a 3-axis mesh.
  const DeviceMesh mesh({{"dp", 2}, {"sp", 2}, {"tp", 2}});
  run_ranks(8, [&](ThreadCommunicator& world) {
    ThreadCommunicator ep = mesh.group(world, {"dp", "sp"});
    check(ep.size() == 4, "ep group size {}", ep.size());
    check(ep.rank() == world.rank() / 2, "ep rank {} for world rank {}", ep.rank(), world.rank());
  });
}

TEST_CASE("DeviceMesh: wrong sizes and unknown names are clear errors") {
  CHECK_THROWS_WITH_AS(DeviceMesh({{"dp", 2}, {"sp", 4}}, 6), doctest::Contains("holds 8 ranks but the world has 6"),
                       Error);
  const DeviceMesh mesh({{"dp", 2}, {"sp", 4}});
  CHECK_THROWS_WITH_AS(mesh.axis_index("ep"), doctest::Contains("unknown mesh axis 'ep'"), Error);
  CHECK_THROWS_WITH_AS(mesh.group_ranks(0, {"dp", "xp"}), doctest::Contains("unknown mesh axis 'xp'"), Error);
  CHECK_THROWS_WITH_AS(mesh.group_ranks(0, {"dp", "dp"}), doctest::Contains("listed twice"), Error);
  CHECK_THROWS_WITH_AS(DeviceMesh({{"dp", 2}, {"dp", 2}}), doctest::Contains("'dp' appears twice"), Error);
  CHECK_THROWS_WITH_AS(DeviceMesh({{"dp", 0}}), doctest::Contains("has size 0"), Error);
  CHECK_THROWS_WITH_AS(DeviceMesh({{"", 2}}), doctest::Contains("empty name"), Error);
  CHECK_THROWS_WITH_AS(mesh.coordinate(8), doctest::Contains("rank 8 is outside [0, 8)"), Error);
  CHECK_THROWS_WITH_AS(mesh.rank_of(MeshCoordinate{1, 4}), doctest::Contains("outside axis 'sp' of size 4"), Error);
  CHECK_THROWS_AS(mesh.rank_of(MeshCoordinate{1}), Error);
  // A world whose size is not the mesh's: group() refuses on every rank.
  CHECK_THROWS_WITH_AS(run_ranks(4, [&](ThreadCommunicator& world) { (void)mesh.group(world, {"sp"}); }),
                       doctest::Contains("holds 8 ranks but the world has 4"), Error);
  CHECK(mesh.to_string() == "{dp: 2, sp: 4}");
}
