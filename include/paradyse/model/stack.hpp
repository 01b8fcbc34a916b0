// paradyse/model/stack.hpp: a stack of Transformer layers run with a per-layer, per-sublayer strategy plan.
//
// Rank r holds, for every layer, its unified shards (contract/weight_shards.hpp) and their gradients. forward() runs the
// layers with the plan's strategies and keeps what backward needs; backward() runs them in reverse, accumulates
// every shard gradient (fully reduced, whichever strategy ran) and all-reduces the replicated norm gradients of
// all layers in one collective. Changing the plan from one step to the next, or from one layer to the next,
// moves no data: there is nothing to redistribute. The plan is checked against every strategy's requirements
// before any rank communicates, and every rank must pass the same plan.
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/contract/layer_config.hpp"
#include "paradyse/model/layer.hpp"
#include "paradyse/contract/weight_shards.hpp"
#include "paradyse/ops/backend.hpp"
#include "paradyse/strategy/buffer_pool.hpp"
#include "paradyse/strategy/policy.hpp"
#include "paradyse/strategy/strategies.hpp"
#include "paradyse/strategy/switchable.hpp"

#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>
#include <utility>
#include <vector>

namespace paradyse {

// One SublayerChoice per layer.
using StackPlan = std::vector<SublayerChoice>;

// The same strategy for every sublayer of every layer.
template <class Strategies>
StackPlan uniform_plan(std::size_t layers, std::string_view strategy) {
  const std::size_t index = Strategies::index_of(strategy);
  return StackPlan(layers, SublayerChoice{index, index});
}

template <class Strategies = AllStrategies<>, class Backend = ops::Cpu>
class TransformerStack {
public:
  // `layers` layers of `config` sharded over `ranks` ranks; this rank's shards drawn from seed + layer.
  TransformerStack(const LayerConfig& config, int layers, int ranks, int rank, std::uint64_t seed,
                   Strategies strategies = {})
      : config_(config), ranks_(ranks), strategies_(std::move(strategies)) {
    check(layers >= 1, "TransformerStack: layers = {} must be at least 1", layers);
    for (int l = 0; l < layers; ++l) weights_.push_back(init_shard(config, ranks, rank, seed + std::uint64_t(l)));
    allocate_gradients();
  }
  // From given shards (for example built by shard_of from global weights).
  TransformerStack(const LayerConfig& config, std::vector<LayerWeights> weights, int ranks, Strategies strategies = {})
      : config_(config), ranks_(ranks), strategies_(std::move(strategies)), weights_(std::move(weights)) {
    check(!weights_.empty(), "TransformerStack: no layers given");
    config.validate_for(ranks);
    allocate_gradients();
  }

  const LayerConfig& config() const noexcept { return config_; }
  int layers() const noexcept { return int(weights_.size()); }
  const Strategies& strategies() const noexcept { return strategies_; }
  std::vector<LayerWeights>& weights() noexcept { return weights_; }
  std::vector<LayerWeights>& gradients() noexcept { return gradients_; }
  void zero_gradients() {
    for (LayerWeights& g : gradients_) g.fill_zero();
  }
  // Drops what a step kept (the saved activations of the layers its forward ran, its context) and allocates
  // nothing: after a failed step the stack holds its weights and gradients only, as before the step.
  void discard_step() noexcept {
    saved_.clear();
    ctx_.reset();
  }

  // Throws unless every layer's choices exist and their strategies support this layer on this group and length.
  void check_plan(const StackPlan& plan, const SublayerContext& ctx) const {
    check(plan.size() == weights_.size(), "plan has {} layers, the stack has {}", plan.size(), weights_.size());
    for (std::size_t l = 0; l < plan.size(); ++l) {
      try {
        strategies_.check_supported(plan[l].attention, ctx);
        strategies_.check_supported(plan[l].mlp, ctx);
      } catch (const Error& e) {
        throw Error(fmt::format("layer {} of the plan: {}", l, e.what()));
      }
    }
  }

  // out: [b, n_r, h] = the stack applied to x: [b, n_r, h] (rank r's tokens of a sequence of seq_len tokens).
  template <Communicator C>
  void forward(C& comm, BufferPool& pool, const StackPlan& plan, std::int64_t seq_len, TensorView<const float> x,
               TensorView<float> out) {
    check(comm.size() == ranks_, "TransformerStack: built for {} ranks, run on a group of {}", ranks_, comm.size());
    check(x.rank() == 3, "TransformerStack: x {} must be [b, n_r, h]", x.shape());
    ctx_.emplace(config_, ranks_, x.extent(0), seq_len, pool);
    check_plan(plan, *ctx_);
    saved_.clear();
    saved_.reserve(weights_.size());
    PooledBuffer<float> buffers[2];
    TensorView<const float> input = x;
    for (std::size_t l = 0; l < weights_.size(); ++l) {
      const bool last = l + 1 == weights_.size();
      TensorView<float> output = out;
      if (!last) {
        PooledBuffer<float>& next = buffers[l % 2];
        if (next.empty()) next = pool.acquire<float>(x.shape());
        output = next.view();
      }
      saved_.push_back(layer_forward<Backend>(strategies_, plan[l], comm, *ctx_, weights_[l], input, output));
      input = output;
    }
  }

  // dx: [b, n_r, h] (overwritten) from dout: [b, n_r, h]; gradients accumulate into gradients().
  template <Communicator C>
  void backward(C& comm, BufferPool& pool, TensorView<const float> dout, TensorView<float> dx) {
    check(ctx_.has_value() && saved_.size() == weights_.size(), "TransformerStack: backward without a forward");
    check(&pool == ctx_->pool, "TransformerStack: backward must use the buffer pool its forward used");
    const std::int64_t h = config_.hidden;
    PooledBuffer<float> norm_partial = pool.acquire<float>(Shape{layers(), 4, h});
    Backend::fill(norm_partial.view(), 0.0f);
    PooledBuffer<float> buffers[2];
    TensorView<const float> grad_in = dout;
    for (std::size_t l = weights_.size(); l-- > 0;) {
      TensorView<float> grad_out = dx;
      if (l > 0) {
        PooledBuffer<float>& next = buffers[l % 2];
        if (next.empty()) next = pool.acquire<float>(dout.shape());
        grad_out = next.view();
      }
      layer_backward<Backend>(strategies_, comm, *ctx_, weights_[l], saved_[l], grad_in, grad_out, gradients_[l],
                              norm_partial.view().slice(0, std::int64_t(l), 1).reshape(Shape{4, h}));
      saved_[l] = LayerSaved<Strategies>();  // free as we go
      grad_in = grad_out;
    }
    std::vector<NormWeights*> norms;
    for (LayerWeights& g : gradients_) norms.push_back(&g.norms);
    reduce_norm_gradients<Backend>(comm, norm_partial.view(), std::span<NormWeights*>(norms));
    saved_.clear();
  }

private:
  void allocate_gradients() {
    gradients_.clear();
    for (std::size_t l = 0; l < weights_.size(); ++l) gradients_.emplace_back(config_, ranks_);
  }

  LayerConfig config_;
  int ranks_;
  Strategies strategies_;
  std::vector<LayerWeights> weights_, gradients_;
  std::vector<LayerSaved<Strategies>> saved_;
  std::optional<SublayerContext> ctx_;
};

}  // namespace paradyse
