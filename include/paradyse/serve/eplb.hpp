// paradyse/serve/eplb.hpp: the expert-parallel load balancer of DeepSeek (EPLB): replicate the heavy experts, then
// pack the replicas onto ranks so that every rank carries about the same load; hierarchical by node.
//
// Input: the load of each logical expert (tokens routed to it, gathered while serving), per layer. Output, per
// layer: phy2log [replicas], the logical expert of each physical slot, slots of rank g being [g s, (g + 1) s) with
// s = replicas / ranks. The rules (written here from the algorithm's public description):
//   - balanced packing: items heaviest first, each to the least-loaded pack that still has a free place (every pack
//     takes the same number of items);
//   - replication: each extra replica goes to the logical expert with the largest load per replica;
//   - hierarchical (groups % nodes == 0): the expert groups (E / groups consecutive experts each) are packed onto
//     nodes by their total load; within each node its experts are replicated to replicas / nodes slots, and those
//     replicas (load / replica count each) are packed onto the node's ranks. Otherwise the same with one node and
//     one group per expert (global).
// The balance of a placement is max over ranks of the rank's load / mean rank load, where a replica carries its
// expert's load divided by the expert's replica count (a router that spreads an expert's tokens evenly over its
// replicas, as serve/decoder_step.hpp's split_over_replicas does).
#pragma once

#include "paradyse/core/error.hpp"

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

namespace paradyse::serve {

struct EplbShape {
  std::int64_t replicas = 0;  // physical expert slots in all
  std::int64_t groups = 1;    // expert groups (hierarchical: groups are packed onto nodes whole)
  std::int64_t nodes = 1;
  std::int64_t ranks = 1;     // GPUs / ranks in all
};

namespace eplb_detail {

// pack[i] for each item: `packs` packs of items.size() / packs items each, heaviest item first onto the least-loaded
// pack with room (ties: the lower pack).
inline std::vector<std::int64_t> balanced_packing(const std::vector<double>& weight, std::int64_t packs) {
  const std::int64_t n = std::int64_t(weight.size());
  check(packs >= 1 && n % packs == 0, "eplb: {} items do not split evenly over {} packs", n, packs);
  const std::int64_t per = n / packs;
  std::vector<std::int64_t> order(static_cast<std::size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) { return weight[std::size_t(a)] > weight[std::size_t(b)]; });
  std::vector<double> load(static_cast<std::size_t>(packs), 0.0);
  std::vector<std::int64_t> count(static_cast<std::size_t>(packs), 0), pack(std::size_t(n), -1);
  for (const std::int64_t item : order) {
    std::int64_t best = -1;
    for (std::int64_t p = 0; p < packs; ++p)
      if (count[std::size_t(p)] < per && (best < 0 || load[std::size_t(p)] < load[std::size_t(best)])) best = p;
    pack[std::size_t(item)] = best;
    load[std::size_t(best)] += weight[std::size_t(item)];
    ++count[std::size_t(best)];
  }
  return pack;
}

// The logical expert of each of `slots` replicas (every expert once, then the extra ones to the largest load per
// replica), and each expert's replica count.
inline std::vector<std::int64_t> replicate(const std::vector<double>& weight, std::int64_t slots,
                                           std::vector<std::int64_t>& replicas_of) {
  const std::int64_t n = std::int64_t(weight.size());
  check(slots >= n, "eplb: {} slots cannot hold {} experts once each", slots, n);
  std::vector<std::int64_t> phy(static_cast<std::size_t>(n));
  std::iota(phy.begin(), phy.end(), 0);
  replicas_of.assign(std::size_t(n), 1);
  for (std::int64_t s = n; s < slots; ++s) {
    std::int64_t best = 0;
    for (std::int64_t e = 1; e < n; ++e)
      if (weight[std::size_t(e)] / double(replicas_of[std::size_t(e)]) >
          weight[std::size_t(best)] / double(replicas_of[std::size_t(best)]))
        best = e;
    phy.push_back(best);
    ++replicas_of[std::size_t(best)];
  }
  return phy;
}

}  // namespace eplb_detail

// phy2log of one layer for `load` [E].
inline std::vector<std::int64_t> eplb_place(const std::vector<double>& load, const EplbShape& s) {
  using namespace eplb_detail;
  const std::int64_t E = std::int64_t(load.size());
  const bool hierarchical = s.groups >= 1 && s.nodes >= 1 && s.groups % s.nodes == 0 && E % s.groups == 0;
  const std::int64_t groups = hierarchical ? s.groups : E, nodes = hierarchical ? s.nodes : 1;
  check(E >= 1 && s.ranks >= 1 && s.replicas % s.ranks == 0 && s.ranks % nodes == 0 && s.replicas % nodes == 0,
        "eplb: {} replicas, {} ranks, {} nodes, {} experts: replicas must split evenly over ranks and ranks over nodes",
        s.replicas, s.ranks, nodes, E);
  const std::int64_t group_size = E / groups, per_node_slots = s.replicas / nodes, ranks_per_node = s.ranks / nodes,
                     slots_per_rank = s.replicas / s.ranks;
  // 1. groups onto nodes.
  std::vector<double> group_load(static_cast<std::size_t>(groups), 0.0);
  for (std::int64_t e = 0; e < E; ++e) group_load[std::size_t(e / group_size)] += load[std::size_t(e)];
  const std::vector<std::int64_t> node_of_group = balanced_packing(group_load, nodes);
  std::vector<std::int64_t> phy2log(static_cast<std::size_t>(s.replicas), -1);
  for (std::int64_t node = 0; node < nodes; ++node) {
    std::vector<std::int64_t> experts;  // this node's logical experts
    for (std::int64_t g = 0; g < groups; ++g)
      if (node_of_group[std::size_t(g)] == node)
        for (std::int64_t e = g * group_size; e < (g + 1) * group_size; ++e) experts.push_back(e);
    std::vector<double> w;
    for (const std::int64_t e : experts) w.push_back(load[std::size_t(e)]);
    // 2. replicate within the node.
    std::vector<std::int64_t> count;
    const std::vector<std::int64_t> phy = replicate(w, per_node_slots, count);
    // 3. replicas onto the node's ranks.
    std::vector<double> replica_load;
    for (const std::int64_t local : phy) replica_load.push_back(w[std::size_t(local)] / double(count[std::size_t(local)]));
    const std::vector<std::int64_t> rank_of = balanced_packing(replica_load, ranks_per_node);
    std::vector<std::int64_t> filled(static_cast<std::size_t>(ranks_per_node), 0);
    for (std::size_t i = 0; i < phy.size(); ++i) {
      const std::int64_t rank = node * ranks_per_node + rank_of[i];
      phy2log[std::size_t(rank * slots_per_rank + filled[std::size_t(rank_of[i])]++)] = experts[std::size_t(phy[i])];
    }
  }
  return phy2log;
}

// max / mean of the rank loads of `phy2log` under `load` (each expert's load split evenly over its replicas).
inline double eplb_imbalance(const std::vector<double>& load, const std::vector<std::int64_t>& phy2log,
                             std::int64_t ranks) {
  const std::int64_t E = std::int64_t(load.size()), slots = std::int64_t(phy2log.size());
  check(ranks >= 1 && slots % ranks == 0, "eplb_imbalance: {} slots over {} ranks", slots, ranks);
  std::vector<std::int64_t> replicas(static_cast<std::size_t>(E), 0);
  for (const std::int64_t e : phy2log) {
    check(e >= 0 && e < E, "eplb_imbalance: slot names expert {}, outside [0, {})", e, E);
    ++replicas[std::size_t(e)];
  }
  for (std::int64_t e = 0; e < E; ++e)
    check(replicas[std::size_t(e)] > 0 || load[std::size_t(e)] == 0, "eplb_imbalance: expert {} (load {}) has no slot",
          e, load[std::size_t(e)]);
  std::vector<double> rank_load(static_cast<std::size_t>(ranks), 0.0);
  for (std::int64_t i = 0; i < slots; ++i) {
    const std::int64_t e = phy2log[std::size_t(i)];
    rank_load[std::size_t(i / (slots / ranks))] += load[std::size_t(e)] / double(replicas[std::size_t(e)]);
  }
  const double total = std::accumulate(rank_load.begin(), rank_load.end(), 0.0);
  return total > 0 ? *std::max_element(rank_load.begin(), rank_load.end()) / (total / double(ranks)) : 1.0;
}

}  // namespace paradyse::serve
