// examples/train_gpt/rank_model.hpp: what a rank's model runs on: its strategies and backend (StrategiesOf), and a
// step's token ids for it (RankTokens), the same for the dense and the MoE GPT, on the host and on the GPU.
#pragma once

#include "paradyse/core/memory.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/model/gpt.hpp"
#include "paradyse/ops/backend.hpp"
#include "paradyse/strategy/sequence_layout.hpp"

#include <cstdint>
#include <optional>
#include <span>

namespace paradyse::examples {

// Gpt<S, B>'s strategy set S, its backend B, and whether B computes in device memory.
template <class M>
struct StrategiesOf;
template <class S, class B>
struct StrategiesOf<Gpt<S, B>> {
  using type = S;
  using backend = B;
  static constexpr bool on_device = ops::on_device<B>;
};

// Rank r's token ids [rows, s_r] of a step's inputs and targets [rows, s]. Host memory on every backend (a device
// model copies them where it computes); on the GPU the rank's current tracker is its device tracker, so they are
// made under a host tracker of their own, held here (declared first: it outlives them).
template <bool on_device>
struct RankTokens {
  std::optional<MemoryTracker> host;
  Tensor<std::int32_t> inputs, targets;

  RankTokens(std::span<const std::int32_t> all_inputs, std::span<const std::int32_t> all_targets, std::int64_t rows,
             const SequenceLayout& layout, int rank) {
    std::optional<ScopedTracker> on_host;
    if constexpr (on_device) on_host.emplace(host.emplace());
    inputs = shard_tokens(all_inputs, rows, layout, rank);
    targets = shard_tokens(all_targets, rows, layout, rank);
  }
};

}  // namespace paradyse::examples
