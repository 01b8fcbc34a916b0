// paradyse/model/mesh_optimizer.hpp: AdamW for every parameter of a mesh GPT stage (model/mesh_stage.hpp) over its
// dp group, with ZeRO stage 0, 1 or 2 (model/data_parallel.hpp), or 3: the stage sharded over dp (its
// shard_over_dp, model/zero3_shards.hpp) and only the owned chunks stepped; the AdamW step itself is
// model/adamw.hpp's.
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/layout/chunking.hpp"
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
// Expert data parallelism (the MoE tensors replicated over an edp group of `expert_replicas` ranks, the stage's
// set_expert_replicas): each MoE tensor has a DataParallelOptimizer over edp instead, summing its gradient over
// the edp group, with ZeRO stage --zero (1 or 2) over edp; step then takes the edp group. Under ZeRO-3 the stage
// shards the MoE tensors over edp as the dense ones over dp (parameters, gradients and state: its
// expert_zero3_of), and only their owned chunks are stepped.
//
// Checkpoints (model/mesh_checkpoint.hpp): gather_moment gives a moment of one of the stage's tensors whole (as the
// stage holds the tensor without dp sharding), gathered over dp (or edp) where ZeRO shards it; scatter_moment sets this
// replica's part of it back. The tensors are indexed as stage.parameters() lists them, or under ZeRO-3 as
// stage.zero3_shards() lists them, then the MoE tensors (those parameters() lists not over dp) in their order.
class MeshOptimizer {
public:
  template <class Stage>
  MeshOptimizer(Stage& stage, ZeroStage zero, int replicas, int replica, const ops::AdamWConfig& adamw,
                int expert_replicas = 1, int expert_replica = 0) {
    check(expert_replicas >= 1 && expert_replica >= 0 && expert_replica < expert_replicas, "MeshOptimizer: expert "
          "replica {} of {}", expert_replica, expert_replicas);
    replicas_ = replicas;
    replica_ = replica;
    expert_replicas_ = expert_replicas;
    expert_replica_ = expert_replica;
    const ZeroStage expert_zero = zero == ZeroStage::three ? ZeroStage::two : zero;
    if (zero == ZeroStage::three) {
      check(stage.sharded(), "MeshOptimizer: ZeRO-3 needs the stage sharded over dp first (shard_over_dp)");
      std::size_t index = 0;
      for (Zero3Tensor& t : stage.zero3_shards()) add_zero3_chunk(index++, t, false, adamw);
      // The MoE tensors, indexed after the shards: zero3_shards().size() + their place among the parameters not
      // replicated over dp (stage.parameters() order). With expert data parallelism the stage shards them over edp
      // (its expert_zero3_of): their chunks stepped as the dense ones; without, whole on every rank of their expert
      // group.
      for (const auto& p : stage.parameters()) {
        if (p.over_dp) continue;
        if (Zero3Tensor* t = stage.expert_zero3_of(p.value)) add_zero3_chunk(index++, *t, true, adamw);
        else add_moe_tensor(index++, p, expert_zero, adamw);
      }
      return;
    }
    const auto parameters = stage.parameters();
    for (std::size_t index = 0; index < parameters.size(); ++index) {
      const auto& p = parameters[index];
      const std::int64_t n = p.value->numel();
      if (n == 0) continue;
      if (!p.over_dp) {
        add_moe_tensor(index, p, expert_zero, adamw);
        continue;
      }
      const bool head = stage.last() && p.value == parameters.back().value;
      const std::int64_t decayed = head ? stage.head_matrix_elements() : (p.decays ? n : 0);
      const bool chunked = zero != ZeroStage::zero;  // ZeRO-1/2: each replica holds the state of its chunk
      if (decayed > 0) {
        add(p.value->span().subspan(0, std::size_t(decayed)), p.gradient->span().subspan(0, std::size_t(decayed)), true, zero, replicas, replica, adamw);
        pieces_.push_back({index, 0, decayed, chunked, {entries_.size() - 1}, {}, {}});
      }
      if (n > decayed) {
        add(p.value->span().subspan(std::size_t(decayed)), p.gradient->span().subspan(std::size_t(decayed)), false, zero, replicas, replica, adamw);
        pieces_.push_back({index, decayed, n - decayed, chunked, {entries_.size() - 1}, {}, {}});
      }
    }
  }

  // AdamW's moment `which` (1: m, 2: v) of the stage's tensor `tensor` (its index in stage.parameters(), or under
  // ZeRO-3 in stage.zero3_shards()) as the flat tensor of `elements` elements the stage holds without dp sharding
  // (its cp shard), gathered over dp where ZeRO splits it. Collective over `dp`: every replica makes the same calls
  // in the same order. Elements no optimizer steps (none today) come back 0.
  template <Communicator C>
  std::vector<float> gather_moment(C& dp, int which, std::size_t tensor, std::int64_t elements) {
    for (const Piece& piece : pieces_)
      check(piece.tensor != tensor || !piece.chunked || !piece.expert(), "MeshOptimizer::gather_moment: "
            "tensor {} has its state split over {} expert data parallel ranks: give their group (gather_moment(dp, "
            "edp, ...))", tensor, expert_replicas_);
    return gather_moment(dp, dp, which, tensor, elements);
  }
  // The same with the MoE tensors' state gathered over `edp` where ZeRO splits it there; collective over dp and edp.
  template <Communicator C>
  std::vector<float> gather_moment(C& dp, C& edp, int which, std::size_t tensor, std::int64_t elements) {
    check(which == 1 || which == 2, "MeshOptimizer::gather_moment: moment {}, expected 1 (m) or 2 (v)", which);
    std::vector<float> full(static_cast<std::size_t>(elements), 0.0f);
    for (const Piece& piece : pieces_) {
      if (piece.tensor != tensor) continue;
      check(piece.start + piece.length <= elements, "MeshOptimizer::gather_moment: tensor {} holds {} elements, "
            "the optimizer steps {}", tensor, elements, piece.start + piece.length);
      const std::vector<float> mine = held(piece, which);
      const std::span<float> to = std::span<float>(full).subspan(std::size_t(piece.start), std::size_t(piece.length));
      if (!piece.chunked) {
        std::copy(mine.begin(), mine.end(), to.begin());
        continue;
      }
      const bool expert = piece.expert();
      const int replicas = expert ? expert_replicas_ : replicas_;
      std::vector<std::int64_t> counts;
      for (int r = 0; r < replicas; ++r) counts.push_back(chunk_range(piece.length, replicas, r).length);
      (expert ? edp : dp).all_gather_v(std::span<const float>(mine), to, std::span<const std::int64_t>(counts));
    }
    return full;
  }
  // Sets this replica's part of moment `which` of tensor `tensor` from the whole flat tensor `full` (as
  // gather_moment gives it). Per rank, no communication.
  void scatter_moment(int which, std::size_t tensor, std::span<const float> full) {
    check(which == 1 || which == 2, "MeshOptimizer::scatter_moment: moment {}, expected 1 (m) or 2 (v)", which);
    for (const Piece& piece : pieces_) {
      if (piece.tensor != tensor) continue;
      check(piece.start + piece.length <= std::int64_t(full.size()), "MeshOptimizer::scatter_moment: tensor {} of "
            "{} elements, the optimizer steps {}", tensor, full.size(), piece.start + piece.length);
      const bool expert = piece.expert();
      const ChunkRange own = !piece.chunked ? ChunkRange{0, piece.length}
                             : expert      ? chunk_range(piece.length, expert_replicas_, expert_replica_)
                                           : chunk_range(piece.length, replicas_, replica_);
      std::span<const float> from = full.subspan(std::size_t(piece.start + own.start), std::size_t(own.length));
      for (std::span<float> part : parts(piece, which)) {
        std::copy(from.begin(), from.begin() + std::ptrdiff_t(part.size()), part.begin());
        from = from.subspan(part.size());
      }
      check(from.empty(), "MeshOptimizer::scatter_moment: tensor {}: {} elements of this replica's part left over",
            tensor, from.size());
    }
  }
  // One AdamW step (step >= 1) at learning rate lr; collective over the dp group.
  template <Communicator C>
  void step(C& dp, float learning_rate, std::int64_t step) {
    check(expert_entries_.empty(), "MeshOptimizer::step: the MoE tensors are replicated over {} expert data parallel "
          "ranks: give their group (step(dp, edp, ...))", expert_replicas_);
    this->step(dp, dp, learning_rate, step);
  }
  // The same with the MoE tensors' gradients summed over `edp` (expert data parallelism); collective over both.
  template <Communicator C>
  void step(C& dp, C& edp, float learning_rate, std::int64_t step) {
    check(edp.size() == expert_replicas_ || expert_entries_.empty(), "MeshOptimizer::step: an edp group of {} ranks, "
          "built for {}", edp.size(), expert_replicas_);
    for (Entry& e : expert_entries_) {
      e.config.learning_rate = learning_rate;
      e.optimizer.set_config(e.config);
      e.optimizer.step(edp, e.params, e.grads, step);
    }
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
    for (const Entry& e : expert_entries_) n += e.optimizer.state_bytes();
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
  // ZeRO-3: a plain AdamW step of the chunk of `t` this replica owns (its gradient summed over t's group already:
  // dp, or with `over_edp` the edp group), stage tensor `index`. The chunk's elements below t.decayed() take weight
  // decay, the others none (the head's final norm rows).
  void add_zero3_chunk(std::size_t index, Zero3Tensor& t, bool over_edp, const ops::AdamWConfig& adamw) {
    pieces_.push_back({index, 0, t.elements(), true, {}, {}, {}, over_edp});
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
      pieces_.back().locals.push_back(local_.size() - 1);
    };
    part(0, decayed, true);
    part(decayed, length, false);
  }
  // A plain AdamW step of a whole tensor (its gradient reduced already); false for an empty tensor (nothing added).
  bool add_local(Tensor<float>& value, Tensor<float>& gradient, bool decays, const ops::AdamWConfig& adamw) {
    const std::int64_t n = value.numel();
    if (n == 0) return false;
    local_.push_back({value.span(), gradient.span(), decays ? adamw : without_decay(adamw), Tensor<float>(Shape{n}),
                      Tensor<float>(Shape{n})});
    ops::Cpu::fill(local_.back().m.view(), 0.0f);
    ops::Cpu::fill(local_.back().v.view(), 0.0f);
    return true;
  }
  void add(std::span<float> params, std::span<float> grads, bool decays, ZeroStage zero, int replicas, int replica,
           ops::AdamWConfig adamw) {
    if (!decays) adamw = without_decay(adamw);
    entries_.push_back({params, grads, adamw, DataParallelOptimizer<>(zero, replicas, replica, std::int64_t(params.size()), adamw)});
    entries_.back().optimizer.set_reduce_op(ReduceOp::sum);  // each replica's gradient is scaled to the whole batch
  }
  // A MoE tensor (router, experts, shared experts: their gradients reduced over the expert group already), stage
  // tensor `index`: a plain AdamW step, or over the edp group with ZeRO `zero` (0 to 2) over it.
  template <class Parameter>
  void add_moe_tensor(std::size_t index, const Parameter& p, ZeroStage zero, const ops::AdamWConfig& adamw) {
    const std::int64_t n = p.value->numel();
    if (n == 0) return;
    if (expert_replicas_ == 1) {
      add_local(*p.value, *p.gradient, p.decays, adamw);
      pieces_.push_back({index, 0, n, false, {}, {local_.size() - 1}, {}});
      return;
    }
    add_expert(*p.value, *p.gradient, p.decays, zero, adamw);
    pieces_.push_back({index, 0, n, zero != ZeroStage::zero, {}, {}, {expert_entries_.size() - 1}});
  }
  // A MoE tensor replicated over the edp group: its gradients summed over it, its state split by `zero` (0 to 2).
  void add_expert(Tensor<float>& value, Tensor<float>& gradient, bool decays, ZeroStage zero, ops::AdamWConfig adamw) {
    if (!decays) adamw = without_decay(adamw);
    expert_entries_.push_back({value.span(), gradient.span(), adamw,
                               DataParallelOptimizer<>(zero, expert_replicas_, expert_replica_, value.numel(), adamw)});
    expert_entries_.back().optimizer.set_reduce_op(ReduceOp::sum);  // each group's gradient is scaled to the batch
  }
  // The optimizer state of one range [start, start + length) of a stage's tensor: whole on this replica, or chunked
  // over dp (this replica holds chunk_range(length, dp, replica) of it); held as the moments of the entries, then of
  // the locals, listed (their concatenation is what this replica holds).
  struct Piece {
    std::size_t tensor;
    std::int64_t start, length;
    bool chunked;  // over dp, or for the MoE tensors' expert entries (and ZeRO-3 chunks over_edp) over edp
    std::vector<std::size_t> entries, locals, expert_entries;
    bool over_edp = false;  // ZeRO-3: a chunk of an MoE tensor sharded over edp (its locals)
    bool expert() const noexcept { return over_edp || !expert_entries.empty(); }
  };
  std::vector<std::span<float>> parts(const Piece& piece, int which) {
    std::vector<std::span<float>> out;
    for (std::size_t e : piece.entries)
      out.push_back(which == 1 ? entries_[e].optimizer.moment1() : entries_[e].optimizer.moment2());
    for (std::size_t l : piece.locals) out.push_back(which == 1 ? local_[l].m.span() : local_[l].v.span());
    for (std::size_t e : piece.expert_entries)
      out.push_back(which == 1 ? expert_entries_[e].optimizer.moment1() : expert_entries_[e].optimizer.moment2());
    return out;
  }
  std::vector<float> held(const Piece& piece, int which) {
    std::vector<float> out;
    for (std::span<float> part : parts(piece, which)) out.insert(out.end(), part.begin(), part.end());
    return out;
  }
  std::vector<Entry> entries_;
  std::vector<Entry> expert_entries_;  // expert data parallelism: the MoE tensors over edp
  std::vector<Local> local_;
  std::vector<Piece> pieces_;
  int replicas_ = 1, replica_ = 0;
  int expert_replicas_ = 1, expert_replica_ = 0;
};

}  // namespace paradyse
