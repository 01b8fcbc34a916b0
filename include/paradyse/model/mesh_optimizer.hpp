// paradyse/model/mesh_optimizer.hpp: AdamW for every parameter of a mesh GPT stage (model/mesh_stage.hpp) over its
// dp group, with ZeRO stage 0, 1 or 2 (model/data_parallel.hpp), or 3: the stage sharded over dp (its
// shard_over_dp, model/zero3_shards.hpp) and only the owned chunks stepped; the AdamW step itself is
// model/adamw.hpp's.
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/model/adamw.hpp"
#include "paradyse/model/data_parallel.hpp"
#include "paradyse/model/zero3_shards.hpp"
#include "paradyse/ops/backend.hpp"

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

namespace paradyse {

// AdamW for every parameter of a stage, the single-group model's rule: one DataParallelOptimizer over dp per tensor
// replicated over dp (the gradients summed over the replicas; the last stage's head pack in two: the head matrix
// with weight decay, the final norm without), a plain AdamW step for the MoE tensors (reduced over the expert group);
// under ZeRO-3 a plain AdamW step of each owned chunk (its gradient already summed over dp), and of the MoE tensors
// as without.
class MeshOptimizer {
public:
  template <class Stage>
  MeshOptimizer(Stage& stage, ZeroStage zero, int replicas, int replica, const ops::AdamWConfig& adamw) {
    if (zero == ZeroStage::three) {
      check(stage.sharded(), "MeshOptimizer: ZeRO-3 needs the stage sharded over dp first (shard_over_dp)");
      for (Zero3Tensor& t : stage.zero3_shards()) {
        // The chunk's elements below t.decayed() take weight decay, the others none (the head's final norm rows).
        const std::int64_t start = t.chunk().start, length = t.chunk().length;
        const std::int64_t decayed = std::clamp<std::int64_t>(t.decayed() - start, 0, length);
        const auto part = [&](std::int64_t from, std::int64_t to, bool decays) {
          if (to <= from) return;
          local_.push_back({t.value().span().subspan(std::size_t(from), std::size_t(to - from)),
                            t.gradient().span().subspan(std::size_t(from), std::size_t(to - from)),
                            decays ? adamw : without_decay(adamw), Tensor<float>(Shape{to - from}),
                            Tensor<float>(Shape{to - from})});
          ops::Cpu::fill(local_.back().m.view(), 0.0f);
          ops::Cpu::fill(local_.back().v.view(), 0.0f);
        };
        part(0, decayed, true);
        part(decayed, length, false);
      }
      for (const auto& p : stage.parameters())  // the MoE tensors, whole on every rank of their expert group
        if (!p.over_dp) add_local(*p.value, *p.gradient, p.decays, adamw);
      (void)replicas;
      (void)replica;
      return;
    }
    const auto parameters = stage.parameters();
    for (const auto& p : parameters) {
      const std::int64_t n = p.value->numel();
      if (n == 0) continue;
      if (!p.over_dp) {
        add_local(*p.value, *p.gradient, p.decays, adamw);
        continue;
      }
      const bool head = stage.last() && p.value == parameters.back().value;
      const std::int64_t decayed = head ? stage.head_matrix_elements() : (p.decays ? n : 0);
      if (decayed > 0) add(p.value->span().subspan(0, std::size_t(decayed)), p.gradient->span().subspan(0, std::size_t(decayed)), true, zero, replicas, replica, adamw);
      if (n > decayed) add(p.value->span().subspan(std::size_t(decayed)), p.gradient->span().subspan(std::size_t(decayed)), false, zero, replicas, replica, adamw);
    }
  }
  // One AdamW step (step >= 1) at learning rate lr; collective over the dp group.
  template <Communicator C>
  void step(C& dp, float learning_rate, std::int64_t step) {
    for (Entry& e : entries_) {
      e.config.learning_rate = learning_rate;
      e.optimizer.set_config(e.config);
      e.optimizer.step(dp, e.params, e.grads, step);
    }
    for (Local& e : local_) {
      e.config.learning_rate = learning_rate;
      adamw_update<ops::Cpu>({flat_view(e.params), flat_view(e.grads), e.m.view(), e.v.view()}, e.config, step);
    }
  }
  // Bytes of AdamW state this rank holds.
  std::int64_t state_bytes() const {
    std::int64_t n = 0;
    for (const Entry& e : entries_) n += e.optimizer.state_bytes();
    for (const Local& e : local_) n += 2 * e.m.numel() * std::int64_t(sizeof(float));
    return n;
  }

private:
  struct Entry {
    std::span<float> params, grads;
    ops::AdamWConfig config;
    DataParallelOptimizer<> optimizer;
  };
  struct Local {
    std::span<float> params, grads;
    ops::AdamWConfig config;
    Tensor<float> m, v;
  };
  // A plain AdamW step of a whole tensor (its gradient reduced already).
  void add_local(Tensor<float>& value, Tensor<float>& gradient, bool decays, const ops::AdamWConfig& adamw) {
    const std::int64_t n = value.numel();
    if (n == 0) return;
    local_.push_back({value.span(), gradient.span(), decays ? adamw : without_decay(adamw), Tensor<float>(Shape{n}),
                      Tensor<float>(Shape{n})});
    ops::Cpu::fill(local_.back().m.view(), 0.0f);
    ops::Cpu::fill(local_.back().v.view(), 0.0f);
  }
  void add(std::span<float> params, std::span<float> grads, bool decays, ZeroStage zero, int replicas, int replica,
           ops::AdamWConfig adamw) {
    if (!decays) adamw = without_decay(adamw);
    entries_.push_back({params, grads, adamw, DataParallelOptimizer<>(zero, replicas, replica, std::int64_t(params.size()), adamw)});
    entries_.back().optimizer.set_reduce_op(ReduceOp::sum);  // each replica's gradient is scaled to the whole batch
  }
  std::vector<Entry> entries_;
  std::vector<Local> local_;
};

}  // namespace paradyse
