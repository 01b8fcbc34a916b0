// paradyse/cost/memory_model.hpp: per-rank memory of a strategy, a sublayer and a whole model.
//
// Per sublayer (from the strategy's own dry run, cost/dry_run.hpp and cost/trace_cost.hpp): the activations saved for backward and
// the largest transient workspace above them in forward and in backward (communication buffers included). Per
// rank and model: the model states, identical for every strategy thanks to the unified layout (each rank holds
// 1/p of every weight, its gradient and optimizer state), plus the sum of all layers' saved activations, plus the
// largest transient of any layer: the peak, not an average. Transients are pooled (the per-rank buffer pool keeps
// the largest working set it has lent, so the largest pooled working set of any sublayer counts once) or plain
// (the attention kernels' small workspaces; the largest counts once). That sum, with the layer stack's own buffers,
// is what the planner budgets: a bound, reached when the largest transient comes with every activation still saved.
// `ordered_activation_peak` walks the sublayers in execution order (forward, then backward in reverse, each pooled
// buffer through the pool's own rule) and gives the peak itself, which matches the memory tracker of the model's
// layer stack to the byte (tests/cost/memory_validation.cpp).
#pragma once

#include "paradyse/cost/model_shape.hpp"
#include "paradyse/cost/trace_cost.hpp"
#include "paradyse/strategy/buffer_pool.hpp"

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <set>
#include <span>
#include <vector>

namespace paradyse::cost {

struct SublayerMemory {
  std::int64_t saved_bytes = 0;
  std::int64_t forward_transient_bytes = 0;
  std::int64_t backward_transient_bytes = 0;
  std::int64_t forward_plain_bytes = 0, forward_pool_bytes = 0;    // the two parts of each transient
  std::int64_t backward_plain_bytes = 0, backward_pool_bytes = 0;
  std::int64_t forward_joint_bytes = 0, backward_joint_bytes = 0;  // both at once (see cost/tally.hpp)
  std::vector<MemoryEvent> forward_events, backward_events;        // in order, for ordered replays
  std::int64_t transient_bytes() const { return std::max(forward_transient_bytes, backward_transient_bytes); }
  std::int64_t pool_bytes() const { return std::max(forward_pool_bytes, backward_pool_bytes); }
  std::int64_t plain_bytes() const { return std::max(forward_plain_bytes, backward_plain_bytes); }
};

inline SublayerMemory sublayer_memory(int strategy, Sublayer part, const ModelShape& m, int p,
                                      const StrategyCatalog& catalog = default_catalog()) {
  SublayerCost c = evaluate_sublayer(catalog, strategy, part, m, p, nullptr, /*keep_events=*/true);
  return {c.saved_bytes,          c.forward_transient_bytes, c.backward_transient_bytes,   c.forward_plain_bytes,
          c.forward_pool_bytes,   c.backward_plain_bytes,    c.backward_pool_bytes,        c.forward_joint_bytes,
          c.backward_joint_bytes, std::move(c.forward_events), std::move(c.backward_events)};
}

// detail::PoolReplay, the buffer pool's rule on size classes: cost/trace_cost.hpp.

// The buffers a layer stack (model/stack.hpp) holds besides its layers': two pooled layer outputs in forward (the
// layers ping-pong between them), two pooled input gradients and the norm gradients' partial sums in backward.
struct StackBuffers {
  std::int64_t activation_bytes = 0;    // one [b, s/p, h] activation
  std::int64_t norm_partial_bytes = 0;  // [layers, 4, h] float32
};

inline StackBuffers stack_buffers(const ModelShape& m, int p) {
  const std::int64_t tokens = (m.seq + p - 1) / p;  // the rank holding the most
  return {m.batch * tokens * m.hidden * m.dtype_bytes, m.layers * 4 * m.hidden * 4};
}
// What the planner budgets for them: the larger of the forward's and the backward's (a bound).
inline std::int64_t stack_buffer_bytes(const StackBuffers& b) {
  const auto pooled = [](std::int64_t bytes) {
    return bytes > 0 ? round_allocation(double(BufferPool::size_class(std::size_t(bytes)))) : 0;
  };
  return 2 * pooled(b.activation_bytes) + pooled(b.norm_partial_bytes);
}

// The activation peak of a layer stack in execution order: `sublayers` holds each layer's attention then MLP. Every
// recorded memory event is replayed, plain bytes as they are allocated and freed, pooled buffers through the pool's
// own rule (it keeps buffers up to its high-water mark and evicts other size classes to stay under it); forward
// runs the layers in order, backward in reverse (MLP, then attention), and a layer's saved tensors are freed when
// its whole backward is done, as model/stack.hpp does. The same walk gives the bytes the pool allocates on its
// misses over the step (its first fill and its churn: a class evicted to stay under the high-water mark and asked for
// again), each of which plan/cost_table.hpp prices as a fresh allocation of its size.
struct OrderedReplay {
  std::int64_t peak = 0;                   // the activation peak
  std::int64_t pool_missed_bytes = 0;      // bytes the pool's misses allocated
  std::vector<std::int64_t> pool_misses;   // each miss's bytes, in order (they sum to pool_missed_bytes)
};
inline OrderedReplay ordered_replay(std::span<const SublayerMemory> sublayers, const StackBuffers& stack = {}) {
  check(sublayers.size() % 2 == 0, "ordered_replay: {} sublayers, expected attention and MLP per layer",
        sublayers.size());
  const std::size_t layers = sublayers.size() / 2;
  detail::PoolReplay pool;
  std::int64_t plain = 0, peak = 0;
  const auto account = [&] { peak = std::max(peak, plain + pool.held()); };
  const auto replay = [&](const std::vector<MemoryEvent>& events, std::int64_t* deferred) {
    for (const MemoryEvent& e : events) {
      if (e.kind == MemoryEvent::release && deferred) *deferred += e.bytes;
      else if (e.kind == MemoryEvent::plain || e.kind == MemoryEvent::release) plain += e.bytes;
      else if (e.kind == MemoryEvent::acquire) pool.acquire(e.bytes);
      else pool.give_back(e.bytes);
      account();
    }
  };
  const std::int64_t activation = stack.activation_bytes > 0 ? std::int64_t(BufferPool::size_class(std::size_t(stack.activation_bytes))) : 0;
  int outputs = 0;
  for (std::size_t l = 0; l < layers; ++l) {
    if (l + 1 < layers && outputs < 2 && activation > 0) pool.acquire(activation), ++outputs, account();
    replay(sublayers[2 * l].forward_events, nullptr);
    replay(sublayers[2 * l + 1].forward_events, nullptr);
  }
  for (int i = 0; i < outputs; ++i) pool.give_back(activation);
  if (stack.norm_partial_bytes > 0) pool.acquire(std::int64_t(BufferPool::size_class(std::size_t(stack.norm_partial_bytes)))), account();
  int gradients = 0;
  for (std::size_t l = layers; l-- > 0;) {
    if (l > 0 && gradients < 2 && activation > 0) pool.acquire(activation), ++gradients, account();
    std::int64_t deferred = 0;
    replay(sublayers[2 * l + 1].backward_events, &deferred);
    replay(sublayers[2 * l].backward_events, &deferred);
    plain += deferred;  // the layer's saved tensors, freed together
  }
  return {peak, pool.missed(), pool.misses()};
}
inline std::int64_t ordered_activation_peak(std::span<const SublayerMemory> sublayers, const StackBuffers& stack = {}) {
  return ordered_replay(sublayers, stack).peak;
}

// Parameters of one layer that one rank holds: its shards of the attention and MLP weights (kv heads replicated
// when there are fewer than p) and the replicated norm parameters.
inline std::int64_t parameters_per_rank(const ModelShape& m, int p) {
  const std::int64_t q_heads = (m.heads + p - 1) / p, kv_heads = m.kv_heads % p == 0 ? m.kv_heads / p : 1;
  const std::int64_t ffn = (m.ffn + p - 1) / p, inputs = m.swiglu ? 2 : 1;
  return ((2 * q_heads + 2 * kv_heads) * m.head_dim + (inputs + 1) * ffn) * m.hidden + m.norm_parameters();
}

// Weights, gradients and optimizer states of all `m.layers` layers on one rank.
inline std::int64_t model_state_bytes(const ModelShape& m, int p, TrainingPrecision precision = {}) {
  return m.layers * parameters_per_rank(m, p) * precision.bytes_per_parameter();
}

// The strategies of one layer.
struct LayerStrategies {
  int attention = 0;  // indices into the strategy list (StrategyCatalog)
  int mlp = 0;
  friend bool operator==(const LayerStrategies&, const LayerStrategies&) = default;
};

struct MemoryEstimate {
  std::int64_t model_states = 0;        // with everything else every plan needs (the stack's buffers, ...)
  std::int64_t saved_activations = 0;   // sum over layers and sublayers
  std::int64_t largest_transient = 0;   // the largest pooled working set + the largest plain workspace
  std::int64_t ordered_activations = 0; // the activation peak in execution order, stack buffers included (0: not computed)
  // What the planner budgets, a bound on the peak: states + all saved activations + the largest transient.
  std::int64_t peak() const { return model_states + saved_activations + largest_transient; }
  // The peak in execution order (<= peak()).
  std::int64_t ordered_peak() const { return model_states + ordered_activations; }
};

// Peak memory per rank of a model of identical layers (m.layers of them) with the given per-layer strategies.
inline MemoryEstimate estimate_memory(const ModelShape& m, int p, std::span<const LayerStrategies> layers,
                                      TrainingPrecision precision = {},
                                      const StrategyCatalog& catalog = default_catalog()) {
  check(std::int64_t(layers.size()) == m.layers, "estimate_memory: {} layer strategies for a model of {} layers",
        layers.size(), m.layers);
  MemoryEstimate e;
  e.model_states = model_state_bytes(m, p, precision) + stack_buffer_bytes(stack_buffers(m, p));
  std::vector<SublayerMemory> order;
  std::int64_t pool = 0, plain = 0;
  for (const LayerStrategies& layer : layers) {
    for (Sublayer part : kAllSublayers) {
      const SublayerMemory s =
          sublayer_memory(part == Sublayer::attention ? layer.attention : layer.mlp, part, m, p, catalog);
      e.saved_activations += s.saved_bytes;
      pool = std::max(pool, s.pool_bytes());
      plain = std::max(plain, s.plain_bytes());
      order.push_back(s);
    }
  }
  e.largest_transient = pool + plain;
  e.ordered_activations = ordered_activation_peak(order, stack_buffers(m, p));
  return e;
}

}  // namespace paradyse::cost
