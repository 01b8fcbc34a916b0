// tests/model/mesh_harness.hpp: what the training-mesh tests share.
//   MeshRank: a rank's groups and coordinates on the mesh {dp, pp, cp, tp}, made as train_gpt --mesh makes them
//     (examples/train_gpt/train_mesh.hpp): the dp group, the pp group, the stage's group (cp x tp, one of them 1 there)
//     and the rank's replica, stage index and rank in the stage group.
//   gathered_zero3: every ZeRO-3 tensor of a stage in full (its values or its gradients), the dp chunks all-gathered;
//     a collective over the dp group.
//   uneven_zero3_config: the small GPT the ZeRO-3 tests train (chunks uneven over dp = 3).
//   gathered_shard: one ZeRO-3 tensor in full over the group it is sharded over (dp, or edp for the MoE tensors).
//   StepTensors, store_step_tensors: a run's tensors after each step by (rank, step, gradient or weight, index).
//   RankGradients, add_layer_gradients, check_same_gradients: a group's gradients by (rank in the stage group, name),
//     each layer's attention, MLP and norm shards recorded as "layer L attention|mlp|norms", and one replica's set
//     compared with the single group's (float32 rounding; every reference tensor nonzero, so the comparison can fail).
//   add_end_gradients, add_stage_end_gradients: the embedding's and the head's gradients, as "embedding" and "head",
//     of the single group's Gpt and of a mesh stage.
//   RandomRows, random_rows: fresh random input and target tokens for a batch.
//   single_group_step: the reference a mesh run is compared with: one step of the single group's Gpt (every row in one
//     batch under one plan), its loss and every rank's gradients (layers, embedding, head).
#pragma once

#include "paradyse/comm/threads.hpp"
#include "paradyse/core/rng.hpp"
#include "paradyse/layout/chunking.hpp"
#include "paradyse/mesh/device_mesh.hpp"
#include "paradyse/model/gpt.hpp"
#include "paradyse/model/layer.hpp"
#include "paradyse/strategy/sequence_layout.hpp"
#include "support/tolerance.hpp"

#include <doctest/doctest.h>
#include <fmt/format.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace paradyse::testing {

struct MeshRank {
  ThreadCommunicator dp_group, pp_group, stage_group;
  int replica = 0, stage_index = 0, stage_rank = 0;

  // Collective over `world` (every rank calls it).
  static MeshRank on(const DeviceMesh& mesh, ThreadCommunicator& world) {
    ThreadCommunicator dp = mesh.group(world, {"dp"});
    ThreadCommunicator pp = mesh.group(world, {"pp"});
    ThreadCommunicator stage = mesh.group(world, {"cp", "tp"});
    const MeshCoordinate at = mesh.coordinate(world.rank());
    return {std::move(dp), std::move(pp), std::move(stage), at[0], at[1], mesh.group_index(world.rank(), {"cp", "tp"})};
  }
};

// The full tensors of `stage`'s ZeRO-3 shards (Zero3Tensor: model/zero3_shards.hpp), in their order: the gradients or
// the values, each [numel] gathered from the dp ranks' chunk_range chunks.
template <class Stage>
std::vector<std::vector<float>> gathered_zero3(Stage& stage, ThreadCommunicator& dp_group, bool gradients) {
  std::vector<std::vector<float>> tensors;
  const int dp = int(dp_group.size());
  for (auto& t : stage.zero3_shards()) {
    std::int64_t n = 1;
    for (std::int64_t e : t.shape()) n *= e;
    std::vector<std::int64_t> counts;
    for (int r = 0; r < dp; ++r) counts.push_back(chunk_range(n, dp, r).length);
    std::vector<float> full(static_cast<std::size_t>(n));
    auto& part = gradients ? t.gradient() : t.value();
    dp_group.all_gather_v(std::span<const float>(part.span()), std::span<float>(full),
                          std::span<const std::int64_t>(counts));
    tensors.push_back(std::move(full));
  }
  return tensors;
}

// The small causal GPT (zigzag tokens, RoPE) the ZeRO-3 tests train: hidden 40 and 4 heads, so that the 40 * 4 norm
// elements and the matrices split unevenly over dp = 3; a vocabulary of 23. Layers: set by the test.
inline GptConfig uneven_zero3_config() {
  GptConfig config;
  config.layer = LayerConfig::make(40, 4);
  config.layer.causal = config.layer.zigzag = config.layer.rope = true;
  config.vocab = 23;
  return config;
}

// Gradients by (rank in the stage group, name).
using RankGradients = std::map<std::pair<int, std::string>, std::vector<float>>;

// Records the layer gradients of a stack whose first layer is global layer `first_layer`, on stage-group rank `rank`.
inline void add_layer_gradients(RankGradients& out, std::mutex& lock, int rank, int first_layer,
                                const std::vector<LayerWeights>& gradients) {
  const std::lock_guard guard(lock);
  for (std::size_t l = 0; l < gradients.size(); ++l) {
    const LayerWeights& g = gradients[l];
    for (const auto& [part, tensor] : {std::pair{"attention", &g.attention.packed}, std::pair{"mlp", &g.mlp.packed},
                                       std::pair{"norms", &g.norms.packed}})
      out[{rank, fmt::format("layer {} {}", first_layer + int(l), part)}].assign(tensor->span().begin(),
                                                                                 tensor->span().end());
  }
}

// Records the single group's embedding [V, h] and head [V + 2, h] gradients on rank `rank`, as "embedding" and
// "head": `replicated` is Gpt::replicated_gradient(), the two one after the other (the embedding's V * h first).
inline void add_end_gradients(RankGradients& out, std::mutex& lock, int rank, std::int64_t embedding_elements,
                              std::span<const float> replicated) {
  const std::lock_guard guard(lock);
  const auto split = replicated.begin() + std::ptrdiff_t(embedding_elements);
  out[{rank, "embedding"}].assign(replicated.begin(), split);
  out[{rank, "head"}].assign(split, replicated.end());
}

// Records a mesh stage's (model/mesh_stage.hpp's MeshGptStage) embedding (first stage) and head (last stage)
// gradients on stage-group rank `rank`, as "embedding" and "head": the last of its parameters(), in that order.
template <class Stage>
void add_stage_end_gradients(RankGradients& out, std::mutex& lock, int rank, Stage& stage) {
  const auto parameters = stage.parameters();
  std::size_t at = parameters.size();
  const std::lock_guard guard(lock);
  for (const auto& [holds, name] : {std::pair{stage.last(), "head"}, std::pair{stage.first(), "embedding"}}) {
    if (!holds) continue;
    const std::span<const float> g = parameters.at(--at).gradient->span();
    out[{rank, name}].assign(g.begin(), g.end());
  }
}

// One replica's gradients `got` hold the tensors of `want`, each equal within float32 rounding.
inline void check_same_gradients(const RankGradients& got, const RankGradients& want) {
  REQUIRE(got.size() == want.size());
  for (const auto& [key, values] : want) {
    CAPTURE(key.first);
    CAPTURE(key.second);
    REQUIRE(got.count(key) == 1);
    CHECK(first_mismatch(std::span<const float>(got.at(key)), std::span<const float>(values), kFloat32) == "");
    double norm = 0;  // the comparison can fail: every tensor receives gradient
    for (float v : values) norm += double(v) * double(v);
    CHECK(norm > 0);
  }
}

// One ZeRO-3 tensor (Zero3Tensor) in full, its values or its gradient [numel] all-gathered from the chunk_range
// chunks of `group` (the group it is sharded over: dp, or edp for an MoE tensor); a collective over it.
template <class Shard>
std::vector<float> gathered_shard(Shard& t, ThreadCommunicator& group, bool gradients) {
  std::vector<std::int64_t> counts;
  for (int r = 0; r < int(group.size()); ++r) counts.push_back(chunk_range(t.elements(), int(group.size()), r).length);
  std::vector<float> full(static_cast<std::size_t>(t.elements()));
  auto& part = gradients ? t.gradient() : t.value();
  group.all_gather_v(std::span<const float>(part.span()), std::span<float>(full), std::span<const std::int64_t>(counts));
  return full;
}

// A run's tensors after each step, by "rank R step K gradient|weight I" (world rank, step, kind, index in `tensors`).
using StepTensors = std::map<std::string, std::vector<float>>;
inline void store_step_tensors(StepTensors& out, std::mutex& lock, int rank, int step, bool gradients,
                               std::vector<std::vector<float>> tensors) {
  const std::lock_guard guard(lock);
  for (std::size_t i = 0; i < tensors.size(); ++i)
    out[fmt::format("rank {} step {} {} {}", rank, step, gradients ? "gradient" : "weight", i)] = std::move(tensors[i]);
}

// Input and target tokens of a batch of `tokens` tokens (rows x seq), each drawn uniformly from [0, vocab).
struct RandomRows {
  std::vector<std::int32_t> inputs, targets;
};
inline RandomRows random_rows(Rng& rng, std::int64_t tokens, std::int64_t vocab) {
  RandomRows r;
  for (std::int64_t i = 0; i < tokens; ++i) {
    r.inputs.push_back(std::int32_t(rng.next_u64() % std::uint64_t(vocab)));
    r.targets.push_back(std::int32_t(rng.next_u64() % std::uint64_t(vocab)));
  }
  return r;
}

// The single group's step: Gpt<Strategies> on `ranks` thread ranks (seeded `seed`), the batch [rows, seq] in one
// piece under `plan`; rank 0's loss and every rank's gradients by (rank, name).
struct SingleGroupStep {
  RankGradients gradients;
  double loss = 0;
};
template <class Strategies>
SingleGroupStep single_group_step(const GptConfig& config, int ranks, std::uint64_t seed, const StackPlan& plan,
                                  const RandomRows& batch, std::int64_t rows, std::int64_t seq) {
  SingleGroupStep out;
  std::mutex lock;
  const SequenceLayout layout(seq, ranks, config.layer.zigzag);
  run_ranks(ranks, [&](ThreadCommunicator& comm) {
    Gpt<Strategies> model(config, ranks, comm.rank(), seed);
    BufferPool pool;
    const Tensor<std::int32_t> x = shard_tokens(batch.inputs, rows, layout, comm.rank());
    const Tensor<std::int32_t> y = shard_tokens(batch.targets, rows, layout, comm.rank());
    model.zero_gradients();
    const GptStepResult r = model.forward_backward(comm, pool, plan, seq, x.view(), y.view());
    add_layer_gradients(out.gradients, lock, comm.rank(), 0, model.stack().gradients());
    add_end_gradients(out.gradients, lock, comm.rank(), config.vocab * config.layer.hidden,
                      model.replicated_gradient().span());
    const std::lock_guard guard(lock);
    if (comm.rank() == 0) out.loss = r.loss;
  });
  return out;
}

}  // namespace paradyse::testing
