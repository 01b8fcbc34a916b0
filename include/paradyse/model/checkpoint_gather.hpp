// paradyse/model/checkpoint_gather.hpp: the global (unsharded) weights of one layer gathered from every rank's
// shards, for saving a checkpoint (model/checkpoint.hpp) or a Hugging Face folder (model/hf_checkpoint.hpp): one
// all-gather per sublayer, so only one layer's full weights are alive at a time; and the bytes such a gather
// allocates (save_checkpoint_bytes), for budgeting a save under a memory cap.
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/memory.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/contract/layer_config.hpp"
#include "paradyse/contract/weight_shards.hpp"
#include "paradyse/model/gpt.hpp"
#include "paradyse/moe/moe_weights.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>
#include <utility>
#include <vector>

namespace paradyse {

namespace checkpoint_detail {

// The global weights of one layer from every rank's shards (every rank gets them).
template <Communicator C>
GlobalLayerWeights<float> gather_layer(C& comm, const LayerConfig& c, const LayerWeights& shard) {
  const int p = comm.size();
  const ShardGeometry geometry(c, p);
  const std::int64_t h = c.hidden;
  Tensor<float> attention(Shape{p, geometry.attention_rows(), h}), mlp(Shape{p, geometry.mlp_rows(), h});
  comm.all_gather(shard.attention.packed.span(), attention.span());
  comm.all_gather(shard.mlp.packed.span(), mlp.span());
  GlobalLayerWeights<float> global(c);
  LayerWeights rank_shard(geometry);
  for (int q = 0; q < p; ++q) {
    std::memcpy(rank_shard.attention.packed.data(), attention.data() + q * rank_shard.attention.packed.numel(),
                rank_shard.attention.packed.bytes());
    std::memcpy(rank_shard.mlp.packed.data(), mlp.data() + q * rank_shard.mlp.packed.numel(), rank_shard.mlp.packed.bytes());
    std::memcpy(rank_shard.norms.packed.data(), shard.norms.packed.data(), shard.norms.packed.bytes());  // replicated
    // Every row rank q holds, to its place in the global matrices (replicated kv rows land twice, identical).
    using weights_detail::Matrix;
    weights_detail::for_each_shard_row(c, p, q, rank_shard, [&](Matrix m, std::int64_t row, std::span<float> from) {
      Tensor<float>* to = nullptr;
      switch (m) {
        case Matrix::q: to = &global.w_q; break;
        case Matrix::k: to = &global.w_k; break;
        case Matrix::v: to = &global.w_v; break;
        case Matrix::proj: to = &global.w_proj; break;
        case Matrix::in: to = &global.w_in; break;
        case Matrix::up: to = &global.w_up; break;
        case Matrix::out: to = &global.w_out; break;
        case Matrix::norm1_gamma: to = &global.norm1_gamma; break;
        case Matrix::norm1_beta: to = &global.norm1_beta; break;
        case Matrix::norm2_gamma: to = &global.norm2_gamma; break;
        case Matrix::norm2_beta: to = &global.norm2_beta; break;
      }
      std::memcpy(to->data() + row * h, from.data(), from.size() * sizeof(float));
    });
  }
  return global;
}

// The global MoE weights of one layer from every rank's shard (every rank gets them): experts gathered (padded to
// the most any rank owns), the replicated router and shared experts taken from this rank.
template <Communicator C>
GlobalMoeWeights<float> gather_moe(C& comm, const MoeConfig& c, const MoeShard& shard) {
  const int p = comm.size();
  const std::int64_t per_expert = 3 * c.expert_ffn * c.hidden, in_size = 2 * c.expert_ffn * c.hidden;
  std::int64_t most = 0;
  for (int q = 0; q < p; ++q) most = std::max(most, owned_experts(c, p, q).length);
  const std::int64_t mine = owned_experts(c, p, comm.rank()).length;
  std::vector<float> send(static_cast<std::size_t>(most * per_expert), 0.0f), all(static_cast<std::size_t>(p * most * per_expert));
  std::copy(shard.expert_in.span().begin(), shard.expert_in.span().end(), send.begin());
  std::copy(shard.expert_out.span().begin(), shard.expert_out.span().end(), send.begin() + mine * in_size);
  comm.all_gather(std::span<const float>(send), std::span<float>(all));
  std::vector<MoeShard> shards;
  for (int q = 0; q < p; ++q) {
    MoeShard s = MoeShard::zeros(c, p, q);
    const std::int64_t owned = owned_experts(c, p, q).length;
    const float* at = all.data() + q * most * per_expert;
    std::copy(at, at + owned * in_size, s.expert_in.data());
    std::copy(at + owned * in_size, at + owned * per_expert, s.expert_out.data());
    if (q == 0) {  // the replicated weights (identical on every rank)
      s.router = Tensor<float>::copy_of(shard.router.view());
      s.shared_in = Tensor<float>::copy_of(shard.shared_in.view());
      s.shared_out = Tensor<float>::copy_of(shard.shared_out.view());
      s.shared_gate = Tensor<float>::copy_of(shard.shared_gate.view());
    }
    shards.push_back(std::move(s));
  }
  return global_moe_of<float>(shards, c);
}

// The attention and norms of one layer, gathered (gather_layer over a full-geometry copy, since an MoE layer holds no
// dense MLP shard; its global MLP comes back zero).
template <Communicator C>
GlobalLayerWeights<float> gather_attention(C& comm, const LayerConfig& c, const LayerWeights& shard) {
  const ShardGeometry geometry(c, comm.size());
  LayerWeights full(geometry);
  full.attention.packed = Tensor<float>::copy_of(shard.attention.packed.view());
  full.norms.packed = Tensor<float>::copy_of(shard.norms.packed.view());
  if (shard.mlp.packed.numel() == full.mlp.packed.numel()) full.mlp.packed = Tensor<float>::copy_of(shard.mlp.packed.view());
  return gather_layer(comm, c, full);
}

}  // namespace checkpoint_detail

// The most bytes save_checkpoint allocates on one rank at a time, beyond the model itself (gather_layer's tensors:
// one layer gathered from every rank and its global matrices), counted on a meta tracker. A run under a memory cap
// budgets a save with it: the model's bytes + this must fit the cap.
inline std::int64_t save_checkpoint_bytes(const GptConfig& config, int ranks) {
  config.validate_for(ranks);
  MemoryTracker meta(MemorySpace::meta);
  {
    const ScopedTracker scoped(meta);
    const ShardGeometry geometry(config.layer, ranks);
    const std::int64_t h = config.layer.hidden;
    const Tensor<float> attention(Shape{ranks, geometry.attention_rows(), h}), mlp(Shape{ranks, geometry.mlp_rows(), h});
    const GlobalLayerWeights<float> global(config.layer);
    const LayerWeights rank_shard(geometry);
    if (config.moe) {  // an MoE layer's gather: the global experts and every rank's shard of them
      const MoeConfig& m = config.moe->moe;
      const GlobalMoeWeights<float> experts(m);
      std::vector<MoeShard> shards;
      for (int q = 0; q < ranks; ++q) shards.push_back(MoeShard::zeros(m, ranks, q));
    }
  }
  return std::int64_t(meta.peak());
}

}  // namespace paradyse
