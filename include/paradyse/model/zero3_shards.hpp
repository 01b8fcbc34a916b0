// paradyse/model/zero3_shards.hpp: ZeRO-3 over a dp group for a model's tensors (Rajbhandari et al., SC'20): each
// replica keeps only its chunk of every tensor's value and gradient (layout/chunking.hpp's rule: uneven allowed);
// the full tensor is all-gathered just before it is used and freed after, and the full gradient is allocated for
// one use, reduce-scattered (summed) into the owned chunk, and freed. The group is the tensor's data parallel group:
// dp for the dense tensors, edp for an MoE layer's experts, router and shared experts (model/mesh_stage.hpp).
//
//   Zero3Tensor t(&w.packed, &g.packed, decayed, dp.size(), dp.rank());  // keeps its chunk, frees w and g
//   t.gather(dp);  ... use w ...  t.release();
//   t.begin_gradient();  ... accumulate into g ...  t.reduce_gradient(dp);
//   Request r = t.post_gather(dp);  ... compute ...  r.wait();          (posted forms: model/zero3_prefetch.hpp)
//   Request q = t.post_reduce_gradient(dp);  ... compute ...  t.finish_reduce_gradient(q);
//
// The AdamW step of the chunk is model/mesh_optimizer.hpp's (ZeroStage::three). The sequence strategies' own ZeRO-3
// inside their group is another matter (strategy/zero3_*.hpp).
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/layout/chunking.hpp"
#include "paradyse/ops/backend.hpp"

#include <cstdint>
#include <span>
#include <vector>

namespace paradyse {

// One tensor of the model sharded over dp. `full` and `full_gradient` are the model's tensors (of any shape), empty
// ([0]) between uses; they must stay where they are (the owner is not moved once sharded); the first `decayed` elements of the flat tensor take weight decay, the rest none.
class Zero3Tensor {
public:
  Zero3Tensor(Tensor<float>* full, Tensor<float>* full_gradient, std::int64_t decayed, int replicas, int replica)
      : full_(full), full_gradient_(full_gradient), shape_(full->shape()), decayed_(decayed),
        chunk_(chunk_range(full->numel(), replicas, replica)), value_(Shape{chunk_.length}),
        gradient_(Shape{chunk_.length}) {
    check(full_gradient->numel() == full->numel(), "Zero3Tensor: gradient of {} elements for a tensor of {}",
          full_gradient->numel(), full->numel());
    for (int r = 0; r < replicas; ++r) counts_.push_back(chunk_range(full->numel(), replicas, r).length);
    ops::Cpu::copy(std::span<const float>(full->span().subspan(std::size_t(chunk_.start), std::size_t(chunk_.length))),
                   value_.span());
    release();
    *full_gradient_ = Tensor<float>(Shape{0});
  }

  // full <- the tensor, gathered from every replica's chunk. Collective over dp.
  template <Communicator C>
  void gather(C& dp) { post_gather(dp).wait(); }
  // The same posted (model/zero3_prefetch.hpp): full is allocated now and holds the tensor once the Request is
  // waited for; this tensor's chunk must not change until then.
  template <Communicator C>
  Request post_gather(C& dp) {
    *full_ = Tensor<float>(shape_);
    return dp.all_gather_v_async(std::span<const float>(value_.span()), full_->span(),
                                 std::span<const std::int64_t>(counts_));
  }
  void release() { *full_ = Tensor<float>(Shape{0}); }  // empty (a default Tensor is a scalar)
  // full_gradient <- zeros of the tensor's shape, to accumulate one use's gradient into.
  void begin_gradient() { *full_gradient_ = Tensor<float>(shape_); }
  // The owned chunk of the gradient += the full gradient summed over dp; then the full gradient is freed.
  template <Communicator C>
  void reduce_gradient(C& dp) {
    Request posted = post_reduce_gradient(dp);
    finish_reduce_gradient(posted);
  }
  // The same in two halves: the reduce-scatter posted (the full gradient must stay untouched), then finished (waited
  // for, added to the owned chunk, the full gradient freed). One at a time per tensor.
  template <Communicator C>
  Request post_reduce_gradient(C& dp) {
    check(pending_.numel() == 0, "Zero3Tensor: a reduce-scatter posted while another is pending");
    pending_ = Tensor<float>(Shape{chunk_.length});
    return dp.reduce_scatter_v_async(std::span<const float>(full_gradient_->span()), pending_.span(),
                                     std::span<const std::int64_t>(counts_), ReduceOp::sum);
  }
  void finish_reduce_gradient(Request& posted) {
    posted.wait();
    ops::Cpu::add_into(gradient_.span(), std::span<const float>(pending_.span()));
    pending_ = Tensor<float>(Shape{0});
    *full_gradient_ = Tensor<float>(Shape{0});
  }
  void zero_gradient() { ops::Cpu::fill(gradient_.view(), 0.0f); }

  ChunkRange chunk() const noexcept { return chunk_; }
  std::int64_t decayed() const noexcept { return decayed_; }
  Tensor<float>& value() noexcept { return value_; }        // [chunk.length]: the owned elements
  Tensor<float>& gradient() noexcept { return gradient_; }  // [chunk.length]: their gradient summed over dp
  const Shape& shape() const noexcept { return shape_; }
  std::int64_t elements() const noexcept { return shape_elements(shape_); }  // of the full tensor
  const Tensor<float>* full() const noexcept { return full_; }               // the model's tensor it shards

private:
  static std::int64_t shape_elements(const Shape& shape) {
    std::int64_t n = 1;
    for (std::int64_t e : shape) n *= e;
    return n;
  }
  Tensor<float>* full_;
  Tensor<float>* full_gradient_;
  Shape shape_;
  std::int64_t decayed_;
  ChunkRange chunk_;
  Tensor<float> value_, gradient_;
  Tensor<float> pending_{Shape{0}};  // [chunk.length] while a posted reduce-scatter is in flight
  std::vector<std::int64_t> counts_;
};

}  // namespace paradyse
