// tests/model/mesh_harness.hpp: what the training-mesh tests share.
//   MeshRank: a rank's groups and coordinates on the mesh {dp, pp, cp, tp}, made as train_gpt --mesh makes them
//     (examples/train_gpt/train_mesh.hpp): the dp group, the pp group, the stage's group (cp x tp, one of them 1 there)
//     and the rank's replica, stage index and rank in the stage group.
//   gathered_zero3: every ZeRO-3 tensor of a stage in full (its values or its gradients), the dp chunks all-gathered;
//     a collective over the dp group.
#pragma once

#include "paradyse/comm/threads.hpp"
#include "paradyse/layout/chunking.hpp"
#include "paradyse/mesh/device_mesh.hpp"

#include <cstdint>
#include <span>
#include <vector>

namespace paradyse::testing {

struct MeshRank {
  ThreadCommunicator dp_group, pp_group, stage_group;
  int replica = 0, stage_index = 0, stage_rank = 0;

  // Collective over `world` (every rank calls it).
  static MeshRank on(const DeviceMesh& mesh, ThreadCommunicator& world) {
    ThreadCommunicator dp = mesh.group(world, {"dp"});
    ThreadCommunicator pp = mesh.group(world, {"pp"});
    ThreadCommunicator stage = mesh.group(world, {"cp", "tp"});
    const MeshCoordinate at = mesh.coordinate(world.rank());
    return {std::move(dp), std::move(pp), std::move(stage), at[0], at[1], mesh.group_index(world.rank(), {"cp", "tp"})};
  }
};

// The full tensors of `stage`'s ZeRO-3 shards (Zero3Tensor: model/zero3_shards.hpp), in their order: the gradients or
// the values, each [numel] gathered from the dp ranks' chunk_range chunks.
template <class Stage>
std::vector<std::vector<float>> gathered_zero3(Stage& stage, ThreadCommunicator& dp_group, bool gradients) {
  std::vector<std::vector<float>> tensors;
  const int dp = int(dp_group.size());
  for (auto& t : stage.zero3_shards()) {
    std::int64_t n = 1;
    for (std::int64_t e : t.shape()) n *= e;
    std::vector<std::int64_t> counts;
    for (int r = 0; r < dp; ++r) counts.push_back(chunk_range(n, dp, r).length);
    std::vector<float> full(static_cast<std::size_t>(n));
    auto& part = gradients ? t.gradient() : t.value();
    dp_group.all_gather_v(std::span<const float>(part.span()), std::span<float>(full),
                          std::span<const std::int64_t>(counts));
    tensors.push_back(std::move(full));
  }
  return tensors;
}

}  // namespace paradyse::testing
