// paradyse/data/mesh_steps.hpp: the steps of a dp x pp x cp mesh (model/mesh_stage.hpp) from the steps of one cp
// group (data/packing.hpp): a step's rows dealt over the dp replicas, or one packed sequence per replica, the
// sequences of a step grouped by their predicted cost so that the replicas finish together.
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/data/packing.hpp"
#include "paradyse/layout/chunking.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

namespace paradyse::data {

// One step of the mesh: what each dp replica trains.
//   rows (one window per step, or --pack-tokens): ONE Step whose rows are dealt to the D replicas in
//     contiguous chunks (uneven allowed; a replica past the rows trains nothing that step);
//   packed sequences (--pack-documents): up to D Steps, each ONE sequence of packed documents, replica d
//     training the d-th with its own length and document starts (a replica past the last trains nothing).
// The loss and every gradient are those of the whole step: each token's loss gradient is scaled by 1 / real_tokens()
// and the dp reduction sums, so the replicas are weighted by their real tokens.
struct MeshStep {
  std::vector<Step> parts;  // rows: one step; packed: one sequence per replica, at most D
  bool per_replica = false;         // packed: parts[d] is replica d's

  // The part replica `replica` of `dp` trains (nullptr: none) and its rows of that part.
  std::pair<const Step*, ChunkRange> work(int replica, int dp) const {
    if (!per_replica) return {&parts.at(0), chunk_range(parts.at(0).sequences(), dp, replica)};
    if (std::size_t(replica) >= parts.size()) return {nullptr, ChunkRange{0, 0}};
    return {&parts[std::size_t(replica)], ChunkRange{0, 1}};
  }
  // The counted tokens of the whole step (every real token has a target; padding has none).
  std::int64_t real_tokens() const {
    std::int64_t n = 0;
    for (const Step& p : parts) n += p.real_tokens();
    return n;
  }
  std::int64_t documents() const {
    std::int64_t n = 0;
    for (const Step& p : parts) n += std::int64_t(p.rows.size());
    return n;
  }
  std::int64_t longest() const {
    std::int64_t n = 0;
    for (const Step& p : parts) n = std::max(n, p.length);
    return n;
  }
  // Rows of the whole step: sequences over every part.
  std::int64_t sequences() const {
    std::int64_t n = 0;
    for (const Step& p : parts) n += p.sequences();
    return n;
  }
};

// The mesh's steps: each of `steps` alone, its rows dealt over the dp replicas; or, when the steps are packed
// sequences (pack_sequences), dp of them per mesh step, one per replica (the last step may hold fewer). With
// `cost` (one per step, e.g. the planner's predicted time) the sequences are grouped by cost: sorted by it, the most
// expensive first, and cut into groups of dp, so that a step's replicas take about as long as each other (the step
// waits for its slowest); the steps then come in the order of their first sequence in `steps` (the shuffle or the
// curriculum), each step's parts in that order too. Without costs, dp consecutive sequences make a step.
inline std::vector<MeshStep> mesh_steps(const std::vector<Step>& steps, int dp,
                                        std::span<const double> cost = {}) {
  check(dp >= 1, "mesh_steps: dp = {}, expected at least 1", dp);
  check(cost.empty() || cost.size() == steps.size(), "mesh_steps: {} costs for {} steps", cost.size(), steps.size());
  std::vector<MeshStep> out;
  std::vector<std::size_t> packed;  // the packed sequences, by index
  for (std::size_t k = 0; k < steps.size(); ++k) {
    if (steps[k].packed) packed.push_back(k);
    else out.push_back({{steps[k]}, false});
  }
  if (!cost.empty() && dp > 1)
    std::stable_sort(packed.begin(), packed.end(), [&](std::size_t a, std::size_t b) { return cost[a] > cost[b]; });
  std::vector<std::vector<std::size_t>> groups;
  for (std::size_t i = 0; i < packed.size(); i += std::size_t(dp)) {
    groups.emplace_back(packed.begin() + std::ptrdiff_t(i),
                        packed.begin() + std::ptrdiff_t(std::min(packed.size(), i + std::size_t(dp))));
    std::sort(groups.back().begin(), groups.back().end());
  }
  std::sort(groups.begin(), groups.end());  // by their first sequence
  for (const std::vector<std::size_t>& group : groups) {
    out.push_back({{}, true});
    for (const std::size_t k : group) out.back().parts.push_back(steps[k]);
  }
  return out;
}

}  // namespace paradyse::data
