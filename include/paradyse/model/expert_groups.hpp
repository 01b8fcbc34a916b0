// paradyse/model/expert_groups.hpp: the groups of the MoE layers on the training mesh {dp, pp, cp, tp} (the axes of
// model/mesh_stage.hpp, tp innermost), folded as Megatron-Core folds them and as search/mesh_groups.hpp prices them.
// On each pp stage, with q = replica x cp + cp index the flattened dp x cp position and t the tp index:
//
//   ep   the expert group: the ep consecutive positions of q with the same t (rank q % ep); the all-to-alls of the
//        MoE layers run inside it and it holds every expert once (ep = dp x cp: one expert group per t);
//   etp  the column group: the etp consecutive tp ranks holding this rank (rank t % etp; etp = tp: the whole tp
//        group), over which each expert's columns are split (moe/expert_columns.hpp);
//   edp  the expert data parallel group: every rank of the stage with the same expert rank and column rank, other
//        tokens (rank (q / ep) x (tp / etp) + t / etp; edp = dp x cp / ep x tp / etp ranks). Its ranks hold the same
//        expert shards: their router statistics and gradients are summed over it.
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/mesh/device_mesh.hpp"

#include <utility>

namespace paradyse {

// The MoE layers' folding: ep and etp (1 and 1 without experts).
struct ExpertFolding {
  int ep = 1, etp = 1;
};

// A rank's place in its expert groups, and the groups' sizes.
struct ExpertPlace {
  int ep, ep_rank, etp, etp_rank, edp, edp_rank;
};

// World rank `rank`'s place on `mesh` (axes dp, pp, cp, tp) for `folding`. Refused, by name: an ep that does not
// divide dp x cp, an etp that does not divide tp.
inline ExpertPlace expert_place(const DeviceMesh& mesh, int rank, ExpertFolding folding) {
  const int dp = mesh.axis_size("dp"), cp = mesh.axis_size("cp"), tp = mesh.axis_size("tp");
  const int ep = folding.ep, etp = folding.etp;
  check(ep >= 1 && (dp * cp) % ep == 0, "expert groups: ep = {} must divide dp x cp = {} x {} (the expert groups "
        "are consecutive ranks of dp x cp)", ep, dp, cp);
  check(etp >= 1 && tp % etp == 0, "expert groups: etp = {} must divide tp = {}", etp, tp);
  const MeshCoordinate at = mesh.coordinate(rank);
  const int t = at[mesh.axis_index("tp")], q = at[mesh.axis_index("dp")] * cp + at[mesh.axis_index("cp")];
  return {ep, q % ep, etp, t % etp, dp * cp / ep * (tp / etp), (q / ep) * (tp / etp) + t / etp};
}

template <Communicator C>
struct ExpertGroups {
  C ep, edp, etp;
  int ep_rank = 0, edp_rank = 0;
};

// This rank's expert groups on `mesh` for `folding` (collective over `world`), refused as expert_place refuses.
template <Communicator C>
ExpertGroups<C> expert_groups(C& world, const DeviceMesh& mesh, ExpertFolding folding) {
  const ExpertPlace place = expert_place(mesh, int(world.rank()), folding);
  const int ep = folding.ep, etp = folding.etp, tp = mesh.axis_size("tp");
  const MeshCoordinate at = mesh.coordinate(int(world.rank()));
  const int tp_axis = mesh.axis_index("tp"), stage = at[mesh.axis_index("pp")], t = at[tp_axis];
  const int q = at[mesh.axis_index("dp")] * mesh.axis_size("cp") + at[mesh.axis_index("cp")];
  MeshCoordinate first_column = at;  // the etp group's first rank names the group
  first_column[tp_axis] = t - t % etp;
  C ep_group = world.split((stage * tp + t) * mesh.size() + q / ep, place.ep_rank);
  C edp_group = world.split((stage * etp + place.etp_rank) * ep + place.ep_rank, place.edp_rank);
  C etp_group = world.split(mesh.rank_of(first_column), place.etp_rank);
  return {std::move(ep_group), std::move(edp_group), std::move(etp_group), place.ep_rank, place.edp_rank};
}
template <Communicator C>
ExpertGroups<C> expert_groups(C& world, const DeviceMesh& mesh, int ep, int etp) {
  return expert_groups(world, mesh, ExpertFolding{ep, etp});
}

}  // namespace paradyse
