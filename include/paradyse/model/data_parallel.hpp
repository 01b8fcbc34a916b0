// paradyse/model/data_parallel.hpp: data parallelism over a dp group: gradient averaging and ZeRO stages 0-2 of the
// optimizer (Rajbhandari et al., SC'20), over a model's parameters seen as one flat vector.
//
//   DataParallelOptimizer optimizer(ZeroStage::two, dp_group.size(), dp_group.rank(), params.size(), adamw);
//   optimizer.step(dp_group, params, grads, step);   // grads: this replica's; params: the same on every replica
//
// Every replica holds the parameters and computes the gradients of its own micro-batch; the step leaves every
// replica with the same parameters, updated by AdamW with the gradient averaged over the group (or summed, with
// set_reduce_op(ReduceOp::sum), when each replica's gradient is already scaled to the whole batch):
//   ZeRO-0  all-reduce (average) the gradients; every replica runs AdamW over every parameter (m and v of all).
//   ZeRO-1  all-reduce (average) the gradients; replica d updates only its chunk d of the flat vector (it holds m and
//           v of that chunk only: 1/dp of the optimizer state), then the chunks are all-gathered.
//   ZeRO-2  reduce-scatter (average) the gradients: replica d receives the reduced gradient of its chunk only, then as
//           ZeRO-1. Half the gradient traffic of an all-reduce before the all-gather.
// Chunks follow the library's chunking rule (layout/chunking.hpp: uneven sizes allowed). Reductions run in rank
// order on the thread communicator, so every stage gives the same parameters on every replica.
// The AdamW step is model/adamw.hpp's (with this optimizer's config as given: a caller without weight decay passes it
// so). ZeRO-3 (parameters sharded too) is what the sequence strategies do inside their group (strategy/zero3_*.hpp).
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/layout/chunking.hpp"
#include "paradyse/model/adamw.hpp"
#include "paradyse/ops/backend.hpp"

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

namespace paradyse {

// three: parameters sharded too; not this optimizer's (model/zero3_shards.hpp with model/mesh_optimizer.hpp).
enum class ZeroStage : std::uint8_t { zero = 0, one = 1, two = 2, three = 3 };

constexpr std::string_view name_of(ZeroStage stage) {
  switch (stage) {
    case ZeroStage::zero: return "ZeRO-0";
    case ZeroStage::one: return "ZeRO-1";
    case ZeroStage::two: return "ZeRO-2";
    case ZeroStage::three: return "ZeRO-3";
  }
  return "?";
}

template <class Backend = ops::Cpu>
class DataParallelOptimizer {
public:
  // The optimizer of replica `rank` of `replicas` for a model of `elements` parameters.
  DataParallelOptimizer(ZeroStage stage, int replicas, int rank, std::int64_t elements, const ops::AdamWConfig& config)
      : stage_(stage), replicas_(replicas), rank_(rank), elements_(elements), config_(config) {
    check(replicas >= 1, "DataParallelOptimizer: replicas = {} must be at least 1", replicas);
    check(rank >= 0 && rank < replicas, "DataParallelOptimizer: rank {} is outside 0..{}", rank, replicas - 1);
    check(elements >= 0, "DataParallelOptimizer: elements = {} must not be negative", elements);
    check(stage != ZeroStage::three, "DataParallelOptimizer: ZeRO stages 0 to 2 (ZeRO-3 shards the parameters: "
          "model/zero3_shards.hpp)");
    chunk_ = stage == ZeroStage::zero ? ChunkRange{0, elements} : chunk_range(elements, replicas, rank);
    m_ = Tensor<float>(Shape{chunk_.length});
    v_ = Tensor<float>(Shape{chunk_.length});
    Backend::fill(m_.view(), 0.0f);
    Backend::fill(v_.view(), 0.0f);
    if (stage == ZeroStage::two) reduced_ = Tensor<float>(Shape{chunk_.length});
    for (int r = 0; r < replicas; ++r) counts_.push_back(chunk_range(elements, replicas, r).length);
  }

  ZeroStage stage() const noexcept { return stage_; }
  // The range of the flat vector this replica updates (all of it under ZeRO-0).
  ChunkRange owned() const noexcept { return chunk_; }
  // AdamW's moments m and v of the owned range (owned().length elements each): for checkpoints
  // (model/mesh_checkpoint.hpp gathers them over dp on save and scatters them on load).
  std::span<float> moment1() noexcept { return m_.span(); }
  std::span<float> moment2() noexcept { return v_.span(); }
  // Bytes of optimizer state (m and v) this replica holds.
  std::int64_t state_bytes() const noexcept { return 2 * chunk_.length * std::int64_t(sizeof(float)); }
  // The AdamW hyper-parameters of the next steps (a learning-rate schedule changes them between steps).
  void set_config(const ops::AdamWConfig& config) noexcept { config_ = config; }
  const ops::AdamWConfig& config() const noexcept { return config_; }
  // How the replicas' gradients combine: ReduceOp::avg (the default: each replica's gradient is the mean over its own
  // micro-batch) or ReduceOp::sum (each is already scaled to the whole batch, as when expert layers folded over dp
  // reduce theirs over every replica's tokens).
  void set_reduce_op(ReduceOp op) {
    check(op == ReduceOp::avg || op == ReduceOp::sum, "DataParallelOptimizer: gradients combine by avg or sum, not "
          "by {}", name_of(op));
    reduce_op_ = op;
  }
  ReduceOp reduce_op() const noexcept { return reduce_op_; }

  // One optimizer step (step >= 1). Collective over `group` (the dp replicas, in rank order). `grads` is consumed:
  // under ZeRO-0 and ZeRO-1 it holds the averaged gradient afterwards, under ZeRO-2 it is left as it was.
  template <Communicator C>
  void step(C& group, std::span<float> params, std::span<float> grads, std::int64_t step) {
    check(int(group.size()) == replicas_ && int(group.rank()) == rank_,
          "DataParallelOptimizer: built for rank {} of {} replicas, called on rank {} of a group of {}", rank_,
          replicas_, group.rank(), group.size());
    check(std::int64_t(params.size()) == elements_ && std::int64_t(grads.size()) == elements_,
          "DataParallelOptimizer: params ({}) and grads ({}) must hold the model's {} elements", params.size(),
          grads.size(), elements_);
    const auto start = std::size_t(chunk_.start), length = std::size_t(chunk_.length);
    TensorView<const float> gradient;
    if (stage_ == ZeroStage::two) {
      group.reduce_scatter_v(std::span<const float>(grads), reduced_.span(), std::span<const std::int64_t>(counts_),
                             reduce_op_);
      gradient = reduced_.view();
    } else {
      group.all_reduce(std::span<const float>(grads), grads, reduce_op_);
      gradient = TensorView<const float>(grads.data() + start, Shape{chunk_.length});
    }
    adamw_update<Backend>({flat_view(params.subspan(start, length)), gradient, m_.view(), v_.view()}, config_, step);
    if (stage_ == ZeroStage::zero) return;
    Tensor<float> mine(Shape{chunk_.length});
    Backend::copy(std::span<const float>(params.subspan(start, length)), mine.span());
    group.all_gather_v(std::span<const float>(mine.span()), params, std::span<const std::int64_t>(counts_));
  }

private:
  ZeroStage stage_;
  int replicas_, rank_;
  std::int64_t elements_;
  ops::AdamWConfig config_;
  ReduceOp reduce_op_ = ReduceOp::avg;
  ChunkRange chunk_;
  Tensor<float> m_, v_, reduced_;
  std::vector<std::int64_t> counts_;
};

}  // namespace paradyse
