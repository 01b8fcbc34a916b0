// paradyse/moe/moe_strategies.hpp: the MoE FFN's strategies as a run-time choice, by index (what the layer stack's
// plan and the planner name): 0 ExpertParallel, 1 ExpertTensorParallel (moe/moe_layer.hpp).
//
// Both take and return the unified activation layout and leave the gradients of the same expert layout, so the
// choice may change from layer to layer and from step to step with nothing to redistribute. What forward saved
// records which strategy made it (MoeSaved::strategy); backward runs that one.
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/moe/moe_layer.hpp"
#include "paradyse/ops/backend.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <array>
#include <cstddef>
#include <string_view>

namespace paradyse {

template <class Backend = ops::Cpu>
struct MoeStrategies {
  static constexpr std::size_t count = 2;
  static constexpr std::array<std::string_view, count> names{ExpertParallel<Backend>::name,
                                                              ExpertTensorParallel<Backend>::name};

  static std::string_view name(std::size_t index) {
    check(index < count, "MoE strategy index {} is out of range: there are {} ({})", index, count,
          fmt::join(names, ", "));
    return names[index];
  }
  static std::size_t index_of(std::string_view strategy) {
    for (std::size_t i = 0; i < count; ++i)
      if (names[i] == strategy) return i;
    throw Error(fmt::format("no MoE strategy named '{}'; the MoE strategies are {}", strategy, fmt::join(names, ", ")));
  }

  // y: [b, n_r, h] (overwritten) = MoE(x) under strategy `index`.
  template <Communicator C>
  static MoeSaved forward(std::size_t index, C& comm, const MoeContext& ctx, const MoeShard& w,
                          TensorView<const float> x, TensorView<float> y) {
    if (name(index) == ExpertParallel<Backend>::name) return ExpertParallel<Backend>{}.forward(comm, ctx, w, x, y);
    return ExpertTensorParallel<Backend>{}.forward(comm, ctx, w, x, y);
  }

  // dx (overwritten) from dy with the strategy that made `saved`; grad ACCUMULATES.
  template <Communicator C>
  static void backward(C& comm, const MoeContext& ctx, const MoeShard& w, MoeSaved& saved, TensorView<const float> dy,
                       TensorView<float> dx, MoeShard& grad) {
    const std::size_t index = index_of(saved.strategy);
    if (index == 0) ExpertParallel<Backend>{}.backward(comm, ctx, w, saved, dy, dx, grad);
    else ExpertTensorParallel<Backend>{}.backward(comm, ctx, w, saved, dy, dx, grad);
  }
};

}  // namespace paradyse
