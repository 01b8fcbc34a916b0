// paradyse/cost/time_model.hpp: per-rank time of a strategy, a sublayer and a whole model for one training step.
//
// Time is FLOPs over the profile's achieved rates (GEMM with its size dependence, flash attention, elementwise
// kernels) plus communication from the profile's alpha-beta terms per collective and group size, with overlap
// where the strategy overlaps: a ring step costs the larger of its block compute and its block transfer (exactly so
// on a device that overlaps fully, profile.overlap = 1). What each strategy does comes from its own dry run
// (cost/dry_run.hpp), shared with the memory model; cost/trace_cost.hpp turns it into seconds.
#pragma once

#include "paradyse/cost/memory_model.hpp"
#include "paradyse/cost/profile.hpp"
#include "paradyse/cost/trace_cost.hpp"

#include <span>

namespace paradyse::cost {

struct SublayerTime {
  double forward_s = 0;
  double backward_s = 0;
  double compute_s = 0;
  double exposed_comm_s = 0;
  double total_s() const { return forward_s + backward_s; }
};

inline SublayerTime sublayer_time(int strategy, Sublayer part, const ModelShape& m, int p,
                                  const HardwareProfile& hardware, const StrategyCatalog& catalog = default_catalog()) {
  const SublayerCost c = evaluate_sublayer(catalog, strategy, part, m, p, &hardware);
  return {c.forward_s, c.backward_s, c.compute_s, c.exposed_comm_s};
}

// Forward + backward seconds of all layers of a model of identical layers with the given per-layer strategies.
inline double model_time(const ModelShape& m, int p, std::span<const LayerStrategies> layers,
                         const HardwareProfile& hardware, const StrategyCatalog& catalog = default_catalog()) {
  check(std::int64_t(layers.size()) == m.layers, "model_time: {} layer strategies for a model of {} layers",
        layers.size(), m.layers);
  double total = 0;
  for (const LayerStrategies& layer : layers)
    total += sublayer_time(layer.attention, Sublayer::attention, m, p, hardware, catalog).total_s() +
             sublayer_time(layer.mlp, Sublayer::mlp, m, p, hardware, catalog).total_s();
  return total;
}

}  // namespace paradyse::cost
