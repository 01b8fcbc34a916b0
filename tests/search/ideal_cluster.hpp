// tests/search/ideal_cluster.hpp: the search tests' idealised cluster, whose step times can be computed by hand.
#pragma once

#include "paradyse/search/search.hpp"

#include <cstdint>
#include <utility>
#include <vector>

namespace paradyse::search::testing {

// A device whose compute is FLOPs over one rate (no overheads, no operand traffic; no elementwise traffic unless
// `elementwise` bytes/s is finite), whose attention backward does its 2.5x FLOPs at 1.25x the rate (so 2x the
// forward time), and links of the given levels.
inline ClusterProfile ideal_cluster(double rate, std::vector<LinkLevel> levels, double elementwise = 1e30) {
  ClusterProfile c;
  c.name = "ideal";
  c.device.memory_bytes = std::int64_t(1) << 40;
  c.device.gemm = {.overhead_s = 0, .flops_per_s = rate, .bytes_per_s = 0};
  c.device.attention = {.overhead_s = 0, .forward_flops_per_s = rate, .backward_flops_per_s = 1.25 * rate};
  c.device.elementwise_bytes_per_s = elementwise;
  c.peak_flops_per_s = rate;
  c.levels = std::move(levels);
  return c;
}

}  // namespace paradyse::search::testing
