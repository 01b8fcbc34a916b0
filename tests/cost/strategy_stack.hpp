// tests/cost/strategy_stack.hpp: a stack of pre-norm layers over the real strategies, on thread ranks, measuring
// what the cost models predict: the peak memory of each rank (its MemoryTracker) and the time of forward and
// backward (each rank's thread CPU time, the slowest rank counting). Shared by tests/cost/memory_validation.cpp and
// bench/cost_validation.cpp.
//
// Each sublayer runs as the model block will: x_norm = LayerNorm(x) (mean and rstd kept), y = sublayer(x_norm),
// x' = x + y, the residual x kept for backward; backward: d x_norm = sublayer backward(dy), dx = LayerNorm
// backward + dy. The memory model's block terms (cost/schedules.hpp) describe exactly this.
#pragma once

#include "paradyse/comm/threads.hpp"
#include "paradyse/cost/calibrate.hpp"
#include "paradyse/cost/from_config.hpp"
#include "paradyse/cost/memory_model.hpp"
#include "paradyse/cost/model_shape.hpp"
#include "paradyse/cost/schedules.hpp"
#include "paradyse/model/config.hpp"
#include "paradyse/model/weights.hpp"
#include "paradyse/ops/backend.hpp"
#include "paradyse/strategy/buffer_pool.hpp"
#include "paradyse/strategy/megatron_cz.hpp"
#include "paradyse/strategy/megatron_ts.hpp"
#include "paradyse/strategy/policy.hpp"
#include "paradyse/strategy/ulysses_z.hpp"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <variant>
#include <vector>

namespace paradyse::cost::testing {

// The strategies whose code has landed, by the cost models' name.
inline bool strategy_available(Strategy s) {
  return s == Strategy::megatron_ts || s == Strategy::megatron_cz || s == Strategy::ulysses_z;
}

struct StackMeasurement {
  std::int64_t activation_peak_bytes = 0;  // tracker peak minus what was in use before the first forward (max rank)
  double forward_s = 0;                    // slowest rank
  double backward_s = 0;
};

namespace stack_detail {

template <class S, Communicator C>
StackMeasurement run_rank(C& comm, const LayerConfig& config, std::int64_t batch, std::int64_t seq, int layers,
                          TimeSource clock) {
  using Backend = ops::Cpu;
  const int p = comm.size(), rank = comm.rank();
  BufferPool pool;
  const SublayerContext ctx(config, p, batch, seq, pool);
  const S strategy;
  strategy.check_supported(ctx);
  const std::int64_t m = ctx.local_rows(rank), h = config.hidden, tokens = ctx.local_tokens(rank);
  std::vector<LayerWeights> weights, grads;
  for (int l = 0; l < layers; ++l) {
    weights.push_back(init_shard(config, p, rank, 1234 + std::uint64_t(l)));
    grads.push_back(LayerWeights::zeros(config, p));
    std::fill(weights.back().norms.norm1_gamma().begin(), weights.back().norms.norm1_gamma().end(), 1.0f);
    std::fill(weights.back().norms.norm2_gamma().begin(), weights.back().norms.norm2_gamma().end(), 1.0f);
  }
  Tensor<float> x(Shape{batch, tokens, h});
  for (std::int64_t i = 0; i < x.numel(); ++i) x.data()[i] = float((i * 7919 + rank * 104729) % 2001) / 1000.0f - 1.0f;

  struct Saved {
    Tensor<float> residual, mean, rstd;
    std::variant<typename S::AttentionSaved, typename S::MlpSaved> strategy;
  };
  std::vector<Saved> stack;
  MemoryTracker& tracker = MemoryTracker::current();
  comm.barrier();
  const std::size_t baseline = tracker.in_use();
  tracker.reset_peak();
  const auto rows = [&](Tensor<float>& t) { return t.view().reshape(Shape{m, h}); };
  const auto gamma = [&](int l, int part) {
    return TensorView<const float>(weights[std::size_t(l)].norms.row(2 * part).data(), Shape{h});
  };
  const auto beta = [&](int l, int part) {
    return TensorView<const float>(weights[std::size_t(l)].norms.row(2 * part + 1).data(), Shape{h});
  };

  double start = now_seconds(clock);
  for (int l = 0; l < layers; ++l)
    for (int part = 0; part < 2; ++part) {
      Saved saved{std::move(x), Tensor<float>(Shape{m}), Tensor<float>(Shape{m}), {}};
      {
        Tensor<float> normalised(Shape{batch, tokens, h});
        Backend::layer_norm_forward(TensorView<const float>(rows(saved.residual)), gamma(l, part), beta(l, part), 1e-5f,
                                    rows(normalised), saved.mean.view(), saved.rstd.view());
        Tensor<float> y(Shape{batch, tokens, h});
        if (part == 0)
          saved.strategy = strategy.attention_forward(comm, ctx, weights[std::size_t(l)].attention, normalised.view(), y.view());
        else
          saved.strategy = strategy.mlp_forward(comm, ctx, weights[std::size_t(l)].mlp, normalised.view(), y.view());
        x = Tensor<float>(Shape{batch, tokens, h});
        for (std::int64_t i = 0; i < x.numel(); ++i) x.data()[i] = saved.residual.data()[i] + y.data()[i];
      }
      stack.push_back(std::move(saved));
    }
  StackMeasurement result;
  result.forward_s = now_seconds(clock) - start;

  Tensor<float> dy(Shape{batch, tokens, h});
  std::fill(dy.data(), dy.data() + dy.numel(), 1e-3f);
  start = now_seconds(clock);
  for (int l = layers - 1; l >= 0; --l)
    for (int part = 1; part >= 0; --part) {
      Saved& saved = stack.back();
      Tensor<float> dx(Shape{batch, tokens, h});
      {
        Tensor<float> dnormalised(Shape{batch, tokens, h});
        if (part == 0)
          strategy.attention_backward(comm, ctx, weights[std::size_t(l)].attention,
                                      std::get<typename S::AttentionSaved>(saved.strategy), dy.view(),
                                      dnormalised.view(), grads[std::size_t(l)].attention);
        else
          strategy.mlp_backward(comm, ctx, weights[std::size_t(l)].mlp, std::get<typename S::MlpSaved>(saved.strategy),
                                dy.view(), dnormalised.view(), grads[std::size_t(l)].mlp);
        std::copy(dy.data(), dy.data() + dy.numel(), dx.data());  // the residual path; the norm's backward adds
        Tensor<float> dgamma(Shape{h}), dbeta(Shape{h});
        Backend::layer_norm_backward(TensorView<const float>(rows(saved.residual)), gamma(l, part), saved.mean.view(),
                                     saved.rstd.view(), TensorView<const float>(rows(dnormalised)), rows(dx),
                                     dgamma.view(), dbeta.view());
      }
      stack.pop_back();
      dy = std::move(dx);
    }
  result.backward_s = now_seconds(clock) - start;
  result.activation_peak_bytes = std::int64_t(tracker.peak() - baseline);
  return result;
}

}  // namespace stack_detail

// Runs `layers` layers of `config`, every sublayer on strategy `s`, on p thread ranks; the largest peak and the
// slowest rank's times.
inline StackMeasurement measure_stack(Strategy s, const LayerConfig& config, int p, std::int64_t batch,
                                      std::int64_t seq, int layers, TimeSource clock = TimeSource::thread_cpu) {
  std::vector<StackMeasurement> per_rank(static_cast<std::size_t>(p));
  run_ranks(p, [&](ThreadCommunicator& comm) {
    StackMeasurement r;
    switch (s) {
      case Strategy::megatron_ts: r = stack_detail::run_rank<MegatronTS<>>(comm, config, batch, seq, layers, clock); break;
      case Strategy::megatron_cz: r = stack_detail::run_rank<MegatronCZ<>>(comm, config, batch, seq, layers, clock); break;
      case Strategy::ulysses_z: r = stack_detail::run_rank<UlyssesZ<>>(comm, config, batch, seq, layers, clock); break;
      default: throw Error(fmt::format("measure_stack: {} has no implementation yet", name_of(s)));
    }
    per_rank[std::size_t(comm.rank())] = r;
  });
  StackMeasurement worst;
  for (const StackMeasurement& r : per_rank) {
    worst.activation_peak_bytes = std::max(worst.activation_peak_bytes, r.activation_peak_bytes);
    worst.forward_s = std::max(worst.forward_s, r.forward_s);
    worst.backward_s = std::max(worst.backward_s, r.backward_s);
  }
  return worst;
}

// What the memory model predicts for the same stack: the activation peak in execution order above the weights and
// the input, plus the final output and the loss gradient, minus the input (which the model counts as the first
// sublayer's saved residual): one [b, s/p, h] tensor net.
inline std::int64_t predicted_activation_peak(Strategy s, const LayerConfig& config, int p, std::int64_t batch,
                                              std::int64_t seq, int layers) {
  const ModelShape shape = shape_of(config, batch, seq, 4, layers);
  const MemoryEstimate e = estimate_memory(shape, p, std::vector<LayerStrategies>(std::size_t(layers), {s, s}));
  const std::int64_t tokens = (seq + p - 1) / p;
  return e.ordered_activations + round_allocation(double(batch * tokens * config.hidden * 4));
}

// The planner's bound for the same stack (all saved activations + the largest transient, same boundary terms).
inline std::int64_t bounded_activation_peak(Strategy s, const LayerConfig& config, int p, std::int64_t batch,
                                            std::int64_t seq, int layers) {
  const ModelShape shape = shape_of(config, batch, seq, 4, layers);
  const MemoryEstimate e = estimate_memory(shape, p, std::vector<LayerStrategies>(std::size_t(layers), {s, s}));
  const std::int64_t tokens = (seq + p - 1) / p;
  return e.saved_activations + e.largest_transient + round_allocation(double(batch * tokens * config.hidden * 4));
}

}  // namespace paradyse::cost::testing
