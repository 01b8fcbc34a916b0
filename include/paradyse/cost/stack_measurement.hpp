// paradyse/cost/stack_measurement.hpp: the cost models against the machine, on the model's layer stack
// (model/stack.hpp) on thread ranks, every sublayer on one strategy: what the stack measures (the peak memory of each
// rank's MemoryTracker above the weights and the stack's inputs; the time of forward and backward, each rank's
// thread CPU time or wall time, the slowest rank counting) beside what the memory model predicts for it and what the
// planner budgets. Used by tests/cost/memory_validation.cpp (to the byte) and bench/cost_validation.cpp.
//
//   const StackMeasurement m = measure_stack(s, config, p, batch, seq, layers);
//   predicted_activation_peak(s, config, p, batch, seq, layers) == m.activation_peak_bytes
#pragma once

#include "paradyse/comm/threads.hpp"
#include "paradyse/cost/calibrate.hpp"
#include "paradyse/cost/from_config.hpp"
#include "paradyse/cost/memory_model.hpp"
#include "paradyse/cost/model_shape.hpp"
#include "paradyse/cost/dry_run.hpp"
#include "paradyse/contract/layer_config.hpp"
#include "paradyse/model/stack.hpp"
#include "paradyse/strategy/buffer_pool.hpp"
#include "paradyse/strategy/strategies.hpp"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace paradyse::cost {

struct StackMeasurement {
  std::int64_t activation_peak_bytes = 0;  // tracker peak minus what was in use before forward (the largest rank)
  double forward_s = 0;                    // slowest rank
  double backward_s = 0;
};

// Runs `steps` training steps of `layers` layers of `config`, every sublayer on strategy `s`, on p thread ranks:
// the memory peak of the first step (from an empty buffer pool), the times of the last.
inline StackMeasurement measure_stack(int s, const LayerConfig& config, int p, std::int64_t batch,
                                      std::int64_t seq, int layers, TimeSource clock = TimeSource::thread_cpu,
                                      int steps = 1) {
  std::vector<StackMeasurement> per_rank(static_cast<std::size_t>(p));
  run_ranks(p, [&](ThreadCommunicator& comm) {
    const int rank = comm.rank();
    TransformerStack<AllStrategies<>> stack(config, layers, p, rank, 4321);
    const StackPlan plan = uniform_plan<AllStrategies<>>(std::size_t(layers), default_catalog().name(s));
    const SequenceLayout sequence(seq, p, config.zigzag);
    const Shape shape{batch, sequence.local_length(rank), config.hidden};
    Tensor<float> x(shape), out(shape), dout(shape), dx(shape);
    for (std::int64_t i = 0; i < x.numel(); ++i) x.data()[i] = float((i * 7919 + rank * 104729) % 2001) / 1000.0f - 1.0f;
    std::fill(dout.data(), dout.data() + dout.numel(), 1e-3f);
    BufferPool pool;
    MemoryTracker& tracker = MemoryTracker::current();
    comm.barrier();
    const std::size_t baseline = tracker.in_use();
    tracker.reset_peak();
    StackMeasurement r;
    // Memory: the first step, from an empty pool. Time: the last step, with the pool warmed as in training.
    for (int step = 0; step < steps; ++step) {
      comm.barrier();
      double start = now_seconds(clock);
      stack.forward(comm, pool, plan, seq, x.view(), out.view());
      r.forward_s = now_seconds(clock) - start;
      start = now_seconds(clock);
      stack.backward(comm, pool, dout.view(), dx.view());
      r.backward_s = now_seconds(clock) - start;
      if (step == 0) r.activation_peak_bytes = std::int64_t(tracker.peak() - baseline);
    }
    per_rank[std::size_t(rank)] = r;
  });
  StackMeasurement worst;
  for (const StackMeasurement& r : per_rank) {
    worst.activation_peak_bytes = std::max(worst.activation_peak_bytes, r.activation_peak_bytes);
    worst.forward_s = std::max(worst.forward_s, r.forward_s);
    worst.backward_s = std::max(worst.backward_s, r.backward_s);
  }
  return worst;
}

// What the memory model predicts for the same stack: the activation peak in execution order.
inline std::int64_t predicted_activation_peak(int s, const LayerConfig& config, int p, std::int64_t batch,
                                              std::int64_t seq, int layers) {
  const ModelShape shape = shape_of(config, batch, seq, 4, layers);
  return estimate_memory(shape, p, std::vector<LayerStrategies>(std::size_t(layers), {s, s})).ordered_activations;
}

// What the planner budgets for it: all saved activations + the largest transient + the stack's buffers.
inline std::int64_t bounded_activation_peak(int s, const LayerConfig& config, int p, std::int64_t batch,
                                            std::int64_t seq, int layers) {
  const ModelShape shape = shape_of(config, batch, seq, 4, layers);
  const MemoryEstimate e = estimate_memory(shape, p, std::vector<LayerStrategies>(std::size_t(layers), {s, s}));
  return e.saved_activations + e.largest_transient + stack_buffer_bytes(stack_buffers(shape, p));
}

}  // namespace paradyse::cost
