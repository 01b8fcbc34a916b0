// paradyse/cost/memory_model.hpp: per-rank memory of a strategy, a sublayer and a whole model.
//
// Per sublayer (cost/schedules.hpp tallies what the strategy allocates): the activations saved for backward and
// the largest transient workspace above them in forward and in backward (communication buffers included). Per
// rank and model: the model states, identical for every strategy thanks to the unified layout (each rank holds
// 1/p of every weight, its gradient and optimizer state), plus the sum of all layers' saved activations, plus the
// largest transient of any layer. That is the peak, not an average: backward of the last layer runs with every
// layer's activations still saved, and order the layers so that the largest transient comes last and it is reached
// exactly (otherwise it is a bound).
#pragma once

#include "paradyse/cost/model_shape.hpp"
#include "paradyse/cost/schedules.hpp"

#include <algorithm>
#include <cstdint>
#include <span>

namespace paradyse::cost {

struct SublayerMemory {
  std::int64_t saved_bytes = 0;
  std::int64_t forward_transient_bytes = 0;
  std::int64_t backward_transient_bytes = 0;
  std::int64_t transient_bytes() const { return std::max(forward_transient_bytes, backward_transient_bytes); }
};

inline SublayerMemory sublayer_memory(Strategy s, Sublayer part, const ModelShape& m, int p) {
  const SublayerCost c = evaluate_sublayer(s, part, m, p, nullptr);
  return {c.saved_bytes, c.forward_transient_bytes, c.backward_transient_bytes};
}

// Parameters of one layer that one rank holds: its shards of the attention and MLP weights (kv heads replicated
// when there are fewer than p) and the replicated norm parameters.
inline std::int64_t parameters_per_rank(const ModelShape& m, int p) {
  const ScheduleDims x(m, p);
  return std::int64_t((x.qkv_loc + x.q_loc) * x.h + (x.g + 1) * x.f_loc * x.h) + m.norm_parameters();
}

// Weights, gradients and optimizer states of all `m.layers` layers on one rank.
inline std::int64_t model_state_bytes(const ModelShape& m, int p, TrainingPrecision precision = {}) {
  return m.layers * parameters_per_rank(m, p) * precision.bytes_per_parameter();
}

// The strategies of one layer.
struct LayerStrategies {
  Strategy attention = Strategy::megatron_ts;
  Strategy mlp = Strategy::megatron_ts;
  friend bool operator==(const LayerStrategies&, const LayerStrategies&) = default;
};

struct MemoryEstimate {
  std::int64_t model_states = 0;
  std::int64_t saved_activations = 0;   // sum over layers and sublayers
  std::int64_t largest_transient = 0;   // max over layers and sublayers
  std::int64_t peak() const { return model_states + saved_activations + largest_transient; }
};

// Peak memory per rank of a model of identical layers (m.layers of them) with the given per-layer strategies.
inline MemoryEstimate estimate_memory(const ModelShape& m, int p, std::span<const LayerStrategies> layers,
                                      TrainingPrecision precision = {}) {
  check(std::int64_t(layers.size()) == m.layers, "estimate_memory: {} layer strategies for a model of {} layers",
        layers.size(), m.layers);
  MemoryEstimate e;
  e.model_states = model_state_bytes(m, p, precision);
  for (const LayerStrategies& layer : layers) {
    for (Sublayer part : kAllSublayers) {
      const SublayerMemory s = sublayer_memory(part == Sublayer::attention ? layer.attention : layer.mlp, part, m, p);
      e.saved_activations += s.saved_bytes;
      e.largest_transient = std::max(e.largest_transient, s.transient_bytes());
    }
  }
  return e;
}

}  // namespace paradyse::cost
