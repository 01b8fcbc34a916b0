// paradyse/search/mesh_groups.hpp: the DeviceMeshes of a parallel configuration and the shape of each of its
// communication groups (size and span) as the cost model uses them.
//
// Attention and dense layers run on the mesh {pp, dp, cp, tp_x, tp_y} (outermost first: tp_y holds consecutive
// ranks). MoE layers fold the same ranks into {pp, edp_outer, ep, edp_inner, etp}: ep takes ep consecutive
// positions of the flattened dp x cp axis (edp_outer = dp * cp / ep), etp the innermost etp positions of tp
// (edp_inner = tp / etp); experts are replicated over edp_outer x edp_inner. A group over axes that are contiguous
// in its mesh is strided: `size` members `span / size` ranks apart inside an aligned block of `span` ranks; the
// expert-data-parallel group is not contiguous, and is given the span of its whole dp x cp x tp block (or tp when
// edp_outer is 1). tests/search checks every span against the ranks DeviceMesh::group_ranks gives.
#pragma once

#include "paradyse/mesh/device_mesh.hpp"
#include "paradyse/search/cluster.hpp"
#include "paradyse/search/parallel_config.hpp"

#include <cstdint>

namespace paradyse::search {

inline DeviceMesh attention_mesh(const ParallelConfig& c) {
  return DeviceMesh({{"pp", c.pp}, {"dp", c.dp}, {"cp", c.cp}, {"tp_x", c.tp_x}, {"tp_y", c.tp_y}});
}
inline DeviceMesh expert_mesh(const ParallelConfig& c) {
  return DeviceMesh({{"pp", c.pp}, {"edp_outer", c.dp * c.cp / c.ep}, {"ep", c.ep},
                     {"edp_inner", c.tp() / c.etp}, {"etp", c.etp}});
}

struct MeshGroups {
  GroupSpan tp_x, tp_y, cp, dp_cp, pp, ep, etp, edp;
};

inline MeshGroups mesh_groups(const ParallelConfig& c) {
  auto strided = [](int size, std::int64_t stride) { return GroupSpan{size, std::int64_t(size) * stride}; };
  const std::int64_t tp = c.tp(), block = std::int64_t(c.dp) * c.cp * tp;
  const int edp = c.expert_dp();
  return {.tp_x = strided(c.tp_x, c.tp_y),
          .tp_y = strided(c.tp_y, 1),
          .cp = strided(c.cp, tp),
          .dp_cp = strided(c.dp * c.cp, tp),
          .pp = strided(c.pp, block),
          .ep = strided(c.ep, tp),
          .etp = strided(c.etp, 1),
          .edp = GroupSpan{edp, edp == 1 ? 1 : (c.dp * c.cp / c.ep > 1 ? block : tp)}};
}

}  // namespace paradyse::search
