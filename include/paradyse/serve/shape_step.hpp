// paradyse/serve/shape_step.hpp: the engine's stepper for a model shape without weights (serve/model_shape_hf.hpp):
// the scheduler (serve/engine.hpp's serve_loop) admits, batches, accounts KV blocks, decides layouts and rebalances
// exactly as for a loaded model, while each step only accounts: the expert loads of every MoE layer come from a
// routing source (serve/routing_source.hpp), the rows each of the p modelled ranks computes follow the layer's
// layout (rows_per_rank), a layout change is installed as the step ends, and every sampled token is 0 (outputs
// have no content; their count is the trace's). Run it on one rank (the stepper models p) with the simulated clock
// (serve/clock.hpp), which costs each step for the shape on the cluster.
//
// The KV accounting is the engine's PagedKvCache over blocks of one float per position (the pool's block count is
// what the cluster's memory holds; serve/step_cost.hpp's callers size it).
#pragma once

#include "paradyse/serve/engine.hpp"
#include "paradyse/serve/routing_source.hpp"

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

namespace paradyse::serve {

class ShapeStepper {
public:
  ShapeStepper(const DecoderConfig& shape, int ranks, const EngineOptions& opt, MoeMode start, RoutingSource& routing)
      : shape_(shape), ranks_(ranks), routing_(routing), cache_({1, opt.kv_blocks, opt.block_size, 1, 1}) {
    check(ranks >= 1, "ShapeStepper: {} ranks", ranks);
    shape.validate();
    const ExpertLayout first = start == MoeMode::tp
                                   ? ExpertLayout::tp()
                                   : ExpertLayout::ep(ExpertPlacement::chunked(shape.moe.experts, ranks).experts_of_rank);
    layout_.assign(std::size_t(shape.layers), ExpertLayout::tp());
    for (std::int64_t l = 0; l < shape.layers; ++l)
      if (shape.is_moe(l)) layout_[std::size_t(l)] = first;
  }

  const DecoderConfig& config() const noexcept { return shape_; }
  int ranks() const noexcept { return ranks_; }
  PagedKvCache& cache() noexcept { return cache_; }
  ExpertLayout layout(std::int64_t l) const { return layout_[std::size_t(l)]; }
  FetchStats fetch_stats() const { return {}; }

  StepOutput run(std::span<const SequenceChunk> batch, MoeMode /*ran*/, const std::vector<std::optional<ExpertLayout>>& next,
                 bool pipelined) {
    std::int64_t n = 0;
    for (const SequenceChunk& ch : batch) n += std::int64_t(ch.tokens.size());
    StepOutput out;
    out.moe_load.resize(std::size_t(shape_.layers));
    std::int64_t moe_index = 0;
    for (std::int64_t l = 0; l < shape_.layers; ++l) {
      if (!shape_.is_moe(l)) continue;
      const std::size_t li = std::size_t(l);
      if (next[li] && !pipelined) layout_[li] = *next[li];
      MoeLayerLoad& load = out.moe_load[li];
      load.routed = routing_.counts(step_, moe_index++, n, shape_.moe.experts, shape_.moe.top_k);
      check(std::int64_t(load.routed.size()) == shape_.moe.experts, "ShapeStepper: the routing source gave {} counts "
            "for {} experts", load.routed.size(), shape_.moe.experts);
      load.rank_rows = rows_per_rank(layout_[li], load.routed, ranks_);
      if (next[li] && pipelined) layout_[li] = *next[li];
    }
    for (const SequenceChunk& ch : batch) {  // the positions the requests' caches hold
      const std::int64_t len = std::int64_t(ch.tokens.size());
      Tensor<float> kv(Shape{len, 1, 1});
      cache_.append(ch.request, 0, kv.view(), kv.view());
    }
    ++step_;
    return out;
  }
  std::int32_t sample(std::size_t, const SamplingParams&, Rng&) const { return 0; }

private:
  DecoderConfig shape_;
  int ranks_;
  RoutingSource& routing_;
  PagedKvCache cache_;
  std::vector<ExpertLayout> layout_;
  std::int64_t step_ = 0;
};

}  // namespace paradyse::serve
