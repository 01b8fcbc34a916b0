// tests/layout/small_cases.hpp: the small meshes and layouts the layout tests sweep exhaustively.
#pragma once

#include "paradyse/layout/layout.hpp"
#include "paradyse/mesh/device_mesh.hpp"

#include <vector>

namespace paradyse::testing {

// Every mesh of 1 to 3 axes whose world size is between 1 and `max_world`: every ordered factorisation (axes of
// size 1 included).
inline std::vector<DeviceMesh> small_meshes(int max_world = 8, int max_axes = 3) {
  std::vector<DeviceMesh> meshes;
  for (int world = 1; world <= max_world; ++world) {
    meshes.push_back(DeviceMesh({{"dp", world}}));
    for (int a = 1; a <= world && max_axes >= 2; ++a) {
      if (world % a) continue;
      meshes.push_back(DeviceMesh({{"dp", a}, {"sp", world / a}}));
      for (int b = 1; b <= world / a && max_axes >= 3; ++b)
        if ((world / a) % b == 0) meshes.push_back(DeviceMesh({{"dp", a}, {"sp", b}, {"tp", world / a / b}}));
    }
  }
  return meshes;
}

// Every placement of one mesh axis for a tensor of `tensor_rank` dims.
inline std::vector<Placement> all_placements(int tensor_rank, bool with_partial = true) {
  std::vector<Placement> out{Placement::replicate()};
  for (int d = 0; d < tensor_rank; ++d) {
    out.push_back(Placement::shard(d));
    out.push_back(Placement::zigzag(d));
  }
  if (with_partial) out.push_back(Placement::partial());
  return out;
}

// Every layout over `mesh_ndim` axes built from `placements`.
inline std::vector<DynamicLayout> all_layouts(int mesh_ndim, const std::vector<Placement>& placements) {
  std::vector<DynamicLayout> out;
  std::vector<std::size_t> pick(std::size_t(mesh_ndim), 0);
  while (true) {
    std::vector<Placement> ps;
    for (std::size_t i : pick) ps.push_back(placements[i]);
    out.push_back(DynamicLayout(std::span<const Placement>(ps)));
    int a = mesh_ndim - 1;
    for (; a >= 0; --a) {
      if (++pick[std::size_t(a)] < placements.size()) break;
      pick[std::size_t(a)] = 0;
    }
    if (a < 0) break;
  }
  return out;
}

}  // namespace paradyse::testing
