// paradyse/model/mesh_checkpoint.hpp: checkpoints of a GPT trained on the mesh (model/mesh_stage.hpp's stages,
// model/mesh_optimizer.hpp's AdamW) in the single group's file format (model/checkpoint_format.hpp, written through
// model/checkpoint_io.hpp): one logical full model, so a checkpoint saved on one mesh shape loads on any other
// (dp, pp, virtual stages, cp or tp, ZeRO 0-3) and into the single group's Gpt (model/checkpoint.hpp's
// load_checkpoint), and the Gpt's checkpoints load into a mesh.
//
//   save_mesh_checkpoint(mesh, world, dp, cp, chunks, optimizers, step, path, {.optimizer_state = true});
//   load_mesh_checkpoint(mesh, world.rank(), chunks, optimizers, path, {.optimizer_state = true});
//
// Saving (collective over the world): every global tensor in the file's data order is put together by the ranks of
// the pp stage that holds it: under ZeRO-3 its dp chunks all-gathered first, a layer's cp (or tp) shards gathered
// into the global matrices (checkpoint_gather.hpp's gather_layer), and AdamW's moments the same way after
// MeshOptimizer::gather_moment has gathered ZeRO-1/2/3's dp chunks of them; an embedding and a head sharded by
// vocabulary rows over tp (MeshGptStage::shard_vocabulary) gathered over tp (whole_vocabulary). The stage's rank of dp replica 0 and
// cp rank 0 sends it to world rank 0, which writes the one file atomically (only one layer's global tensors are
// alive at a time). The metadata says the step, the world size (saved_on_ranks) and the mesh (saved_on_mesh).
//
// Loading (per rank, no communication): the file is validated whole first (open_checkpoint: configuration, names,
// shapes, checksum), then each rank reads the global tensors of its chunks' layers (and the embedding on the first
// stage, the head and final norm on the last) and keeps its pieces: its vocabulary rows, its cp shard (shard_of), under ZeRO-3 only its
// dp chunk of that, and its part of the moments (MeshOptimizer::scatter_moment). The floats are copied, never
// computed, so a save and a load on any two meshes give back the same bits.
//
// MoE layers (with experts: the stage's expert groups given to the save, ep and etp to the load): a layer's attention
// and norms as a dense layer's (no dense MLP), and its router, experts and shared experts (each state: the value, or
// each moment gathered over edp where ZeRO splits it there) put together over the etp group (etp_gather: whole
// experts) and over the ep group (gather_moe: every expert); loading takes the rank's experts (moe_shard_of) and its
// columns of them (etp_columns). So an MoE checkpoint, too, loads on any mesh shape and any ep and etp. Under ZeRO-3
// with edp > 1 the MoE tensors' values are gathered over edp first (and loading keeps the rank's edp chunk).
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/layout/chunking.hpp"
#include "paradyse/mesh/device_mesh.hpp"
#include "paradyse/model/checkpoint_gather.hpp"
#include "paradyse/model/checkpoint_io.hpp"
#include "paradyse/model/expert_groups.hpp"
#include "paradyse/model/mesh_optimizer.hpp"
#include "paradyse/model/mesh_stage.hpp"
#include "paradyse/moe/expert_columns.hpp"
#include "paradyse/moe/moe_weights.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

namespace paradyse {

namespace mesh_checkpoint_detail {

// This rank's place on the mesh (axes dp, pp, cp, tp; the stage's group is cp x tp, one of them 1).
struct Place {
  int replica, stage, cp_rank, dp, pp, cp;
};
inline Place place_of(const DeviceMesh& mesh, int rank) {
  const MeshCoordinate at = mesh.coordinate(rank);
  return {at[0], at[1], mesh.group_index(rank, {"cp", "tp"}), mesh.axis_size("dp"), mesh.axis_size("pp"),
          mesh.axis_size("cp") * mesh.axis_size("tp")};
}
// The world rank of dp replica `replica`, pp stage `stage`, cp (or tp) rank `cp_rank`.
inline int world_rank_of(const DeviceMesh& mesh, int replica, int stage, int cp_rank) {
  const int tp = mesh.axis_size("tp");
  return mesh.rank_of(MeshCoordinate({replica, stage, cp_rank / tp, cp_rank % tp}));
}

// The tensor indices of a stage (in stage.parameters(), or under ZeRO-3 in stage.zero3_shards() and then the MoE
// tensors: MeshOptimizer's indices): per layer attention, MLP, norms; then (not under ZeRO-3) the six MoE tensors of
// each MoE layer (router, expert_in, expert_out, shared_in, shared_out, shared_gate); then the embedding (first
// stage), the head pack (last stage); under ZeRO-3 the MoE tensors after these.
inline std::size_t layer_tensor(std::size_t layer, int part) { return 3 * layer + std::size_t(part); }
template <class Stage>
std::size_t moe_layers_before(Stage& stage, std::size_t layer) {
  std::size_t n = 0;
  for (std::size_t l = 0; l < layer; ++l) n += stage.stack().is_moe_layer(int(l)) ? 1 : 0;
  return n;
}
template <class Stage>
std::size_t dense_tensors(Stage& stage) {  // the layers' and, not under ZeRO-3, the MoE layers' tensors
  const std::size_t layers = std::size_t(stage.layers().length);
  return 3 * layers + (stage.sharded() ? 0 : 6 * moe_layers_before(stage, layers));
}
template <class Stage>
std::size_t embedding_tensor(Stage& stage) { return dense_tensors(stage); }
template <class Stage>
std::size_t head_tensor(Stage& stage) { return dense_tensors(stage) + (stage.first() ? 1 : 0); }
template <class Stage>
std::size_t moe_tensor(Stage& stage, std::size_t layer, int member) {
  const std::size_t first = stage.sharded() ? stage.zero3_shards().size() : 3 * std::size_t(stage.layers().length);
  return first + 6 * moe_layers_before(stage, layer) + std::size_t(member);
}
inline constexpr Tensor<float> MoeShard::*kMoeMembers[6] = {&MoeShard::router,    &MoeShard::expert_in,
                                                            &MoeShard::expert_out, &MoeShard::shared_in,
                                                            &MoeShard::shared_out, &MoeShard::shared_gate};

// MoE layer `layer` (local) of `stage`, state `state` (0 the value, 1 and 2 AdamW's moments) of its router, experts
// and shared experts: the global weights (every expert, whole), on every rank of the stage. Collective over the
// stage's dp, edp, etp and ep groups.
template <class Stage, Communicator C>
GlobalMoeWeights<float> gather_moe_layer(Stage& stage, MeshOptimizer& optimizer, C& dp, ExpertGroups<C>& groups,
                                         int state, std::size_t layer) {
  const MoeConfig& c = stage.config().moe->moe;
  const MoeShard& w = stage.stack().moe_weights()[layer];
  MoeShard held;  // this rank's columns of its experts, in state `state`
  for (int m = 0; m < 6; ++m) {
    const Tensor<float>& t = w.*kMoeMembers[m];
    Zero3Tensor* sharded = stage.expert_zero3_of(&t);  // ZeRO-3 with edp > 1: t is empty, its chunks over edp
    if (state == 0 && sharded == nullptr) {
      held.*kMoeMembers[m] = Tensor<float>::copy_of(t.view());
      continue;
    }
    if (state == 0) {
      sharded->gather(groups.edp);
      held.*kMoeMembers[m] = Tensor<float>::copy_of(t.view());
      sharded->release();
      continue;
    }
    const std::vector<float> flat = optimizer.gather_moment(dp, groups.edp, state, moe_tensor(stage, layer, m),
                                                            sharded ? sharded->elements() : t.numel());
    Tensor<float> moment(sharded ? sharded->shape() : t.shape());
    std::copy(flat.begin(), flat.end(), moment.span().begin());
    held.*kMoeMembers[m] = std::move(moment);
  }
  return checkpoint_detail::gather_moe(groups.ep, c, etp_gather(groups.etp, c, held));
}

// The flat tensor `index` of `stage` as the stage holds it without dp sharding (its cp shard): state 0 the value
// (under ZeRO-3 its dp chunks all-gathered), 1 and 2 AdamW's moments. Collective over dp.
template <class Stage, Communicator C>
std::vector<float> stage_tensor(Stage& stage, MeshOptimizer& optimizer, C& dp, int state, std::size_t index) {
  std::int64_t elements = 0;
  if (stage.sharded()) {
    Zero3Tensor& t = stage.zero3_shards()[index];
    elements = 1;
    for (std::int64_t e : t.shape()) elements *= e;
    if (state == 0) {
      std::vector<std::int64_t> counts;
      for (int r = 0; r < int(dp.size()); ++r) counts.push_back(chunk_range(elements, int(dp.size()), r).length);
      std::vector<float> full(static_cast<std::size_t>(elements));
      dp.all_gather_v(std::span<const float>(t.value().span()), std::span<float>(full),
                      std::span<const std::int64_t>(counts));
      return full;
    }
  } else {
    const Tensor<float>& value = *stage.parameters()[index].value;
    elements = value.numel();
    if (state == 0) return std::vector<float>(value.span().begin(), value.span().end());
  }
  return optimizer.gather_moment(dp, state, index, elements);
}

// Sets this rank's part of the flat tensor `index` of `stage` (state as stage_tensor's) from `full` (the tensor as
// the stage holds it without dp sharding). Copies into the tensors in place: the optimizer's views stay valid.
template <class Stage>
void set_stage_tensor(Stage& stage, MeshOptimizer* optimizer, int state, std::size_t index, std::span<const float> full,
                      const std::string& path) {
  if (state > 0) {
    optimizer->scatter_moment(state, index, full);
    return;
  }
  std::span<float> to;
  std::span<const float> from = full;
  if (stage.sharded()) {
    Zero3Tensor& t = stage.zero3_shards()[index];
    to = t.value().span();
    from = full.subspan(std::size_t(t.chunk().start), std::size_t(t.chunk().length));
  } else {
    to = stage.parameters()[index].value->span();
  }
  check(to.size() == from.size(), "checkpoint {}: tensor {} of the stage holds {} elements, the file gives {}", path,
        index, to.size(), from.size());
  std::copy(from.begin(), from.end(), to.begin());
}

// A stage's embedding (extra = 0) or head pack (extra = 2: the final norm's rows after the head's) as the whole
// model's [(V + extra) h]: `mine` ([(V_r + extra) h], this rank's vocabulary rows and the extra rows) with the rows
// gathered over the stage's vocabulary group where it shards them. Collective over that group.
template <class Stage>
std::vector<float> whole_vocabulary(Stage& stage, std::vector<float> mine, std::int64_t extra) {
  auto* tp = stage.vocabulary_group();
  if (tp == nullptr) return mine;
  const std::int64_t vocab = stage.config().vocab, h = stage.config().layer.hidden;
  const std::int64_t rows = stage.vocabulary_rows().length;
  check(std::int64_t(mine.size()) == (rows + extra) * h, "save_mesh_checkpoint: {} elements of the vocabulary's rows "
        "held, expected ({} + {}) x {}", mine.size(), rows, extra, h);
  std::vector<std::int64_t> counts;
  for (int q = 0; q < int(tp->size()); ++q) counts.push_back(vocab_rows(vocab, int(tp->size()), q).length * h);
  std::vector<float> whole(static_cast<std::size_t>((vocab + extra) * h));
  tp->all_gather_v(std::span<const float>(mine).subspan(0, std::size_t(rows * h)),
                   std::span<float>(whole).subspan(0, std::size_t(vocab * h)), std::span<const std::int64_t>(counts));
  std::copy(mine.begin() + std::ptrdiff_t(rows * h), mine.end(), whole.begin() + std::ptrdiff_t(vocab * h));
  return whole;
}
// The part of the whole model's [(V + extra) h] (as whole_vocabulary gives it) that `stage` holds: its vocabulary
// rows and the extra rows. Per rank.
template <class Stage>
std::vector<float> vocabulary_part(Stage& stage, std::span<const float> whole, std::int64_t extra) {
  const std::int64_t vocab = stage.config().vocab, h = stage.config().layer.hidden;
  const ChunkRange rows = stage.vocabulary_rows();
  std::vector<float> part(whole.begin() + std::ptrdiff_t(rows.start * h), whole.begin() + std::ptrdiff_t(rows.end() * h));
  part.insert(part.end(), whole.begin() + std::ptrdiff_t(vocab * h), whole.begin() + std::ptrdiff_t((vocab + extra) * h));
  return part;
}

// Sends `data` (count elements, on the source rank) to world rank 0 (the writer), which receives it into `out`.
template <Communicator C>
void to_writer(C& world, int source, std::span<const float> data, std::vector<float>& out, std::int64_t count) {
  if (world.rank() == 0) out.resize(static_cast<std::size_t>(count));
  if (source == 0) {
    if (world.rank() == 0) std::copy(data.begin(), data.end(), out.begin());
    return;
  }
  if (world.rank() == source) world.send(data, 0);
  else if (world.rank() == 0) world.recv(std::span<float>(out), source);
}

}  // namespace mesh_checkpoint_detail

// Writes the model trained on `mesh` (every rank's `chunks`, the virtual stages c * pp + its pp index, and their
// `optimizers`, one per chunk) to `path` atomically, with AdamW's moments when options.optimizer_state. `step`: the
// optimizer steps taken. Collective over `world`; `dp` and `cp` are this rank's dp group and stage group (cp or tp).
// World rank 0 writes the file. When it throws (a write error), every rank throws and the file at `path` is unchanged.
// With MoE layers `experts` gives this rank's expert groups (model/expert_groups.hpp).
template <class Strategies, Communicator C>
void save_mesh_checkpoint(const DeviceMesh& mesh, C& world, C& dp, C& cp,
                          std::span<MeshGptStage<Strategies, C>> chunks, std::span<MeshOptimizer> optimizers,
                          std::int64_t step, const std::string& path, const CheckpointSaveOptions& options = {},
                          ExpertGroups<C>* experts = nullptr) {
  using namespace checkpoint_detail;
  using namespace mesh_checkpoint_detail;
  check(!chunks.empty() && chunks.size() == optimizers.size(), "save_mesh_checkpoint: {} chunks and {} optimizers",
        chunks.size(), optimizers.size());
  const GptConfig& config = chunks.front().config();
  check(!config.moe || experts != nullptr, "save_mesh_checkpoint: a mesh with MoE layers needs its expert groups");
  const Place at = place_of(mesh, int(world.rank()));
  const int v = int(chunks.size()), stages = at.pp * v;
  CheckpointWriter out(world.rank() == 0, path, config,
                       {.step = step, .saved_on_ranks = int(world.size()), .compute_dtype = "f32", .saved_on_mesh = mesh.to_string()},
                       options);
  const std::int64_t vocab = config.vocab, h = config.layer.hidden;
  std::vector<float> received;
  // Global tensor `name` of `count` elements, held as `data` by the world rank `source`, to the writer and the file.
  const auto write = [&](int source, const std::string& name, std::span<const float> data, std::int64_t count) {
    to_writer(world, source, data, received, count);
    if (world.rank() == 0) out.write(name, received.data(), count);
  };
  for (int s = 0; s < (options.optimizer_state ? 3 : 1); ++s) {
    const std::string prefix(kStatePrefixes[s]);
    // The embedding (virtual stage 0: pp stage 0, chunk 0), then the head pack of the last virtual stage (pp stage
    // pp - 1, chunk v - 1): head [V, h], final gamma, final beta.
    {
      const int source = world_rank_of(mesh, 0, 0, 0);
      std::vector<float> embedding;
      if (at.stage == 0)
        embedding = whole_vocabulary(chunks[0], stage_tensor(chunks[0], optimizers[0], dp, s,
                                                             embedding_tensor(chunks[0])), 0);
      write(source, prefix + "embedding", embedding, vocab * h);
    }
    {
      const int source = world_rank_of(mesh, 0, at.pp - 1, 0);
      std::vector<float> head;
      auto& last = chunks[std::size_t(v - 1)];
      if (at.stage == at.pp - 1)
        head = whole_vocabulary(last, stage_tensor(last, optimizers[std::size_t(v - 1)], dp, s, head_tensor(last)), 2);
      const std::span<const float> pack(head);
      write(source, prefix + "head", pack.empty() ? pack : pack.subspan(0, std::size_t(vocab * h)), vocab * h);
      write(source, prefix + "final_norm.gamma", pack.empty() ? pack : pack.subspan(std::size_t(vocab * h), std::size_t(h)), h);
      write(source, prefix + "final_norm.beta", pack.empty() ? pack : pack.subspan(std::size_t((vocab + 1) * h), std::size_t(h)), h);
    }
    for (int virtual_stage = 0; virtual_stage < stages; ++virtual_stage) {
      const int stage = virtual_stage % at.pp, c = virtual_stage / at.pp;
      const ChunkRange layers = chunk_range(config.layers, stages, virtual_stage);
      const int source = world_rank_of(mesh, 0, stage, 0);
      for (std::int64_t l = layers.start; l < layers.end(); ++l) {
        const bool moe = config.is_moe_layer(int(l));
        GlobalLayerWeights<float> g(config.layer);
        GlobalMoeWeights<float> e = moe ? GlobalMoeWeights<float>(config.moe->moe) : GlobalMoeWeights<float>();
        if (at.stage == stage) {  // the stage's ranks put the layer together: dp chunks, then the cp shards
          auto& chunk = chunks[std::size_t(c)];
          check(chunk.layers().start == layers.start && chunk.layers().length == layers.length,
                "save_mesh_checkpoint: chunk {} holds layers {}..{}, the mesh's virtual stage {} layers {}..{}", c,
                chunk.layers().start, chunk.layers().end(), virtual_stage, layers.start, layers.end());
          const std::size_t local = std::size_t(l - layers.start);
          LayerWeights shard(ShardGeometry(config.layer, at.cp));
          if (moe) shard.mlp.packed = Tensor<float>(Shape{0, h});  // an MoE layer holds no dense MLP
          Tensor<float>* packs[3] = {&shard.attention.packed, &shard.mlp.packed, &shard.norms.packed};
          for (int part = 0; part < 3; ++part) {
            const std::vector<float> flat = stage_tensor(chunk, optimizers[std::size_t(c)], dp, s, layer_tensor(local, part));
            check(std::int64_t(flat.size()) == packs[part]->numel(), "save_mesh_checkpoint: layer {} part {} holds {} "
                  "elements, expected {}", l, part, flat.size(), packs[part]->numel());
            std::copy(flat.begin(), flat.end(), packs[part]->span().begin());
          }
          g = moe ? gather_attention(cp, config.layer, shard) : gather_layer(cp, config.layer, shard);
          if (moe) e = gather_moe_layer(chunk, optimizers[std::size_t(c)], dp, *experts, s, local);
        }
        for (auto [name, t] : layer_tensors(g)) {
          const std::int64_t count = t->numel();
          if (count > 0 && !(moe && is_mlp_tensor(name)))
            write(source, fmt::format("{}layers.{}.{}", prefix, l, name), t->span(), count);
        }
        if (moe)
          for (auto [name, t] : moe_tensors(e)) {
            const std::int64_t count = t->numel();
            if (count > 0) write(source, fmt::format("{}layers.{}.{}", prefix, l, name), t->span(), count);
          }
      }
    }
  }
  out.finish(world);
}

// Replaces the weights of this rank's `chunks` (world rank `rank` of `mesh`) with those of the checkpoint at `path`
// (saved on any mesh, or by the single group's save_checkpoint), and with options.optimizer_state AdamW's moments of
// its `optimizers` (one per chunk) too. Per rank, no communication. Returns the checkpoint's optimizer step count
// (0 without the optimizer state). Throws, changing nothing, unless the file is a complete, uncorrupted checkpoint of
// the same model. With MoE layers `folding` says the mesh's ep and etp (model/expert_groups.hpp).
template <class Strategies, Communicator C>
std::int64_t load_mesh_checkpoint(const DeviceMesh& mesh, int rank, std::span<MeshGptStage<Strategies, C>> chunks,
                                  std::span<MeshOptimizer> optimizers, const std::string& path,
                                  CheckpointLoadOptions options = {}, ExpertFolding folding = {}) {
  using namespace checkpoint_detail;
  using namespace mesh_checkpoint_detail;
  check(!chunks.empty(), "load_mesh_checkpoint: no model chunk");
  check(!options.optimizer_state || optimizers.size() == chunks.size(), "load_mesh_checkpoint: {} chunks and {} "
        "optimizers", chunks.size(), optimizers.size());
  const GptConfig& config = chunks.front().config();
  const CheckedCheckpoint in = open_checkpoint(path, config, options);  // every check before anything changes
  const Place at = place_of(mesh, rank);
  const ExpertPlace expert = expert_place(mesh, rank, folding);
  const std::int64_t vocab = config.vocab, h = config.layer.hidden;
  for (std::size_t c = 0; c < chunks.size(); ++c) {
    auto& chunk = chunks[c];
    MeshOptimizer* optimizer = options.optimizer_state ? &optimizers[c] : nullptr;
    for (int s = 0; s < (options.optimizer_state ? 3 : 1); ++s) {
      const std::string prefix(kStatePrefixes[s]);
      if (chunk.first()) {
        std::vector<float> embedding(static_cast<std::size_t>(vocab * h));
        in.read(prefix + "embedding", embedding.data());
        set_stage_tensor(chunk, optimizer, s, embedding_tensor(chunk), vocabulary_part(chunk, embedding, 0), path);
      }
      if (chunk.last()) {
        std::vector<float> pack(static_cast<std::size_t>((vocab + 2) * h));
        in.read(prefix + "head", pack.data());
        in.read(prefix + "final_norm.gamma", pack.data() + vocab * h);
        in.read(prefix + "final_norm.beta", pack.data() + (vocab + 1) * h);
        set_stage_tensor(chunk, optimizer, s, head_tensor(chunk), vocabulary_part(chunk, pack, 2), path);
      }
      const ChunkRange layers = chunk.layers();
      for (std::int64_t l = layers.start; l < layers.end(); ++l) {
        const bool moe = config.is_moe_layer(int(l));
        const std::size_t local = std::size_t(l - layers.start);
        GlobalLayerWeights<float> g(config.layer);
        for (auto [name, t] : layer_tensors(g))
          if (t->numel() > 0 && !(moe && is_mlp_tensor(name)))
            in.read(fmt::format("{}layers.{}.{}", prefix, l, name), t->data());
        LayerWeights shard = shard_of(g, config.layer, at.cp, at.cp_rank);
        if (moe) shard.mlp.packed = Tensor<float>(Shape{0, h});  // an MoE layer holds no dense MLP
        const Tensor<float>* packs[3] = {&shard.attention.packed, &shard.mlp.packed, &shard.norms.packed};
        for (int part = 0; part < 3; ++part)
          set_stage_tensor(chunk, optimizer, s, layer_tensor(local, part), packs[part]->span(), path);
        if (!moe) continue;
        // The router, this rank's experts (their columns) and the shared experts (their columns).
        const MoeConfig& mc = config.moe->moe;
        GlobalMoeWeights<float> e(mc);
        for (auto [name, t] : moe_tensors(e))
          if (t->numel() > 0) in.read(fmt::format("{}layers.{}.{}", prefix, l, name), t->data());
        const MoeShard mine = etp_columns(moe_shard_of(e, mc, expert.ep, expert.ep_rank), mc, expert.etp,
                                          expert.etp_rank);
        MoeShard& w = chunk.stack().moe_weights()[local];
        for (int m = 0; m < 6; ++m) {
          std::span<const float> from = (mine.*kMoeMembers[m]).span();
          if (s > 0) {
            optimizer->scatter_moment(s, moe_tensor(chunk, local, m), from);
            continue;
          }
          std::span<float> to = (w.*kMoeMembers[m]).span();
          if (Zero3Tensor* sharded = chunk.expert_zero3_of(&(w.*kMoeMembers[m]))) {  // ZeRO-3: its chunk over edp
            check(std::int64_t(from.size()) == sharded->elements(), "checkpoint {}: layer {} MoE tensor {} of this "
                  "rank holds {} elements, the file gives {} (ep = {}, etp = {})", path, l, m, sharded->elements(),
                  from.size(), expert.ep, expert.etp);
            from = from.subspan(std::size_t(sharded->chunk().start), std::size_t(sharded->chunk().length));
            to = sharded->value().span();
          }
          check(to.size() == from.size(), "checkpoint {}: layer {} MoE tensor {} of this rank holds {} elements, the "
                "file gives {} (ep = {}, etp = {})", path, l, m, to.size(), from.size(), expert.ep, expert.etp);
          std::copy(from.begin(), from.end(), to.begin());
        }
      }
    }
  }
  return in.step;
}

}  // namespace paradyse
