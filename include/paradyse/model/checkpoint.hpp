// paradyse/model/checkpoint.hpp: GPT checkpoints in the safetensors format (model/safetensors.hpp).
//
// What is saved: the GLOBAL (unsharded) float32 tensors of the model, so a checkpoint saved on p ranks loads on any
// other group size (and in any safetensors reader): the shards of every rank are gathered layer by layer (one
// all-gather per sublayer; only one layer's full weights are alive at a time) and rank 0 writes the one file,
// atomically (a temporary in the same folder, fsync, rename). Names:
//   embedding [V, h]; head [V, h] (untied only); final_norm.gamma, final_norm.beta [h];
//   layers.<l>.attention.{w_q, w_k, w_v, w_proj}, layers.<l>.mlp.{w_in, w_up (SwiGLU only), w_out},
//   layers.<l>.{norm1, norm2}.{gamma, beta}      (shapes as contract/weight_shards.hpp's GlobalLayerWeights)
// The metadata holds the model configuration, the optimizer step count, the run's compute_dtype (f32, or bf16 for
// a mixed-precision model: the tensors are its fp32 masters), an FNV-1a checksum of the data buffer and one of every
// other metadata entry (format paradyse.gpt.v2; v1 files, whose metadata has no checksum, still load). The file is
// written and opened through model/checkpoint_io.hpp, as the training mesh's are (model/mesh_checkpoint.hpp: the same
// format, saved_on_mesh naming its shape), so either loads into the other.
// MoE GPTs (GptConfig::moe): the MoE configuration is in the metadata ("moe.*"), and an MoE layer holds, instead of
// its dense MLP, layers.<l>.moe.{router [E, h], expert_in [E, 2f, h], expert_out [E, f, h]} and, with shared
// experts, layers.<l>.moe.{shared_in [2 fs, h], shared_out [fs, h]} (+ shared_gate [1, h]): the global expert
// weights (moe/moe_weights.hpp's GlobalMoeWeights), gathered from the expert-parallel shards like the layers'.
//
// Resuming training: with CheckpointSaveOptions{.optimizer_state = true} the AdamW moments are saved too, as global
// tensors of the same shapes named "adamw.m.<name>" and "adamw.v.<name>" (metadata optimizer = adamw), and the
// caller's own metadata (`extra`: for train_gpt its options, the data position) goes beside the configuration.
// load_checkpoint with CheckpointLoadOptions{.optimizer_state = true} restores the weights, both moments and the
// step count, so that training continues exactly as if it had never stopped: the floats are copied, not computed,
// so on the same group size the continued run is bit for bit the uninterrupted one. read_checkpoint_metadata gives
// the extra metadata back.
//
// Loading is per rank (no communication): every rank validates the whole file (format, configuration, names,
// dtypes, shapes, checksum) before it changes anything, then reads the global tensors a layer at a time and keeps
// its shards. Every mismatch is an Error naming the file, the tensor or field, and what was expected; a metadata
// integer outside what a checkpoint can hold is reported with its text and the accepted range.
//
// The checksum: every checkpoint save_checkpoint writes has one, so a file without it was written by another tool
// or edited, and its data cannot be verified. load_checkpoint refuses such a file unless the caller asks for it
// with CheckpointLoadOptions{.allow_missing_checksum = true} (then the data loads unverified).
//
// Saving: check_writable_target(path) tells up front (before a long run) whether a save to `path` can work: the
// folder exists and a file can be created in it. A save also removes temporaries that killed saves of the same
// file left behind (model/safetensors.hpp).
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/contract/layer_config.hpp"
#include "paradyse/model/checkpoint_format.hpp"
#include "paradyse/model/checkpoint_gather.hpp"
#include "paradyse/model/checkpoint_io.hpp"
#include "paradyse/model/gpt.hpp"
#include "paradyse/model/safetensors.hpp"
#include "paradyse/contract/weight_shards.hpp"
#include "paradyse/moe/moe_weights.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace paradyse {

// Throws unless a file can be written at `path`: the folder exists, is a folder, and a file can be created in it (a
// temporary is created and removed), and `path` itself is not a folder. Call it before a long run that saves at
// its end.
inline void check_writable_target(const std::string& path) {
  namespace fs = std::filesystem;
  const fs::path target(path);
  check(!path.empty() && !target.filename().empty(), "cannot save to \"{}\": it names a folder, not a file", path);
  const fs::path folder = target.parent_path().empty() ? fs::path(".") : target.parent_path();
  std::error_code error;
  check(fs::exists(folder, error), "cannot save to \"{}\": the folder \"{}\" does not exist", path, folder.string());
  check(fs::is_directory(folder, error), "cannot save to \"{}\": \"{}\" is not a folder", path, folder.string());
  check(!fs::is_directory(target, error), "cannot save to \"{}\": it is a folder", path);
  std::string probe = (folder / ("." + target.filename().string() + ".probe.XXXXXX")).string();
  const int fd = ::mkstemp(probe.data());
  const int err = errno;
  check(fd >= 0, "cannot save to \"{}\": cannot create a file in \"{}\": {}", path, folder.string(),
        safetensors::detail::errno_text(err));
  ::close(fd);
  ::unlink(probe.c_str());
}

// Writes `model` (every rank's shards, gathered) to `path` atomically. Collective: every rank of the model's group
// calls it; rank 0 writes the file. Beyond the model, it allocates save_checkpoint_bytes(config, ranks) per rank.
// When it throws (out of memory, a write error), the file at `path` is unchanged.
template <class Strategies, class Backend, Communicator C>
void save_checkpoint(C& comm, Gpt<Strategies, Backend>& model, const std::string& path,
                     const CheckpointSaveOptions& options = {}) {
  using namespace checkpoint_detail;
  const GptConfig& config = model.config();
  const bool writer = comm.rank() == 0;
  CheckpointWriter out(writer, path, config,
                       {.step = model.steps_taken(), .saved_on_ranks = int(comm.size()),
                        .compute_dtype = name_of(Gpt<Strategies, Backend>::compute_dtype), .saved_on_mesh = {}},
                       options);
  const auto write = [&](std::string_view name, const float* data, std::int64_t count) { out.write(name, data, count); };
  for (int s = 0; s < (options.optimizer_state ? 3 : 1); ++s) {
    const std::string prefix(kStatePrefixes[s]);
    // The replicated pack [rows, h] of this state: embedding, head (untied), final gamma, final beta.
    const Tensor<float>& pack = s == 0 ? model.replicated() : s == 1 ? model.replicated_moment1() : model.replicated_moment2();
    const std::vector<LayerWeights>& layers = s == 0 ? model.stack().weights() : s == 1 ? model.moment1() : model.moment2();
    const std::vector<MoeShard>& experts =
        s == 0 ? model.stack().moe_weights() : s == 1 ? model.moe_moment1() : model.moe_moment2();
    if (writer) {
      const std::int64_t v = config.vocab, h = config.layer.hidden, final_row = config.replicated_rows() - 2;
      write(prefix + "embedding", pack.data(), v * h);
      if (!config.tied_head) write(prefix + "head", pack.data() + v * h, v * h);
      write(prefix + "final_norm.gamma", pack.data() + final_row * h, h);
      write(prefix + "final_norm.beta", pack.data() + (final_row + 1) * h, h);
    }
    for (int l = 0; l < config.layers; ++l) {
      if (config.is_moe_layer(l)) {  // attention and norms, then the experts (no dense MLP)
        GlobalLayerWeights<float> g = gather_attention(comm, config.layer, layers[std::size_t(l)]);
        GlobalMoeWeights<float> e = gather_moe(comm, config.moe->moe, experts[std::size_t(l)]);
        if (!writer) continue;
        for (auto [name, t] : layer_tensors(g))
          if (t->numel() > 0 && !is_mlp_tensor(name)) write(fmt::format("{}layers.{}.{}", prefix, l, name), t->data(), t->numel());
        for (auto [name, t] : moe_tensors(e))
          if (t->numel() > 0) write(fmt::format("{}layers.{}.{}", prefix, l, name), t->data(), t->numel());
        continue;
      }
      GlobalLayerWeights<float> g = gather_layer(comm, config.layer, layers[std::size_t(l)]);
      if (!writer) continue;
      for (auto [name, t] : layer_tensors(g))
        if (t->numel() > 0) write(fmt::format("{}layers.{}.{}", prefix, l, name), t->data(), t->numel());
    }
  }
  out.finish(comm);  // every rank learns whether the writer failed (and the file exists for every rank after it)
}

// The first tensor of the checkpoint at `path` (weights, then the AdamW moments) that holds a value that is not
// finite, as "'NAME' holds VALUE at element I"; nothing when every value is finite. Reads the whole file.
inline std::optional<std::string> first_nonfinite_tensor(const std::string& path) {
  const safetensors::File file(path, O_RDONLY);
  const safetensors::Header header = safetensors::read_header(file);
  std::vector<float> values;
  for (const safetensors::TensorEntry& e : header.tensors) {
    if (e.dtype != "F32") continue;
    values.resize(std::size_t((e.end - e.begin) / std::int64_t(sizeof(float))));
    file.read_at(values.data(), std::int64_t(values.size() * sizeof(float)), header.data_start + e.begin);
    for (std::size_t i = 0; i < values.size(); ++i)
      if (!std::isfinite(values[i])) return fmt::format("'{}' holds {} at element {}", e.name, values[i], i);
  }
  return std::nullopt;
}

// Replaces `model`'s weights (this rank's shards and the replicated weights) with those of the checkpoint at `path`,
// saved on any group size. Per rank, no communication. Throws, changing nothing, unless the file is a complete,
// uncorrupted checkpoint of a model with the same configuration.
template <class Strategies, class Backend>
void load_checkpoint(Gpt<Strategies, Backend>& model, const std::string& path, CheckpointLoadOptions options = {}) {
  using namespace checkpoint_detail;
  const GptConfig& config = model.config();
  const CheckedCheckpoint in = open_checkpoint(path, config, options);  // every check before anything changes
  const auto read = [&](const std::string& name, float* out) { in.read(name, out); };
  const std::int64_t saved_step = in.step;
  for (int s = 0; s < (options.optimizer_state ? 3 : 1); ++s) {
    const std::string prefix(kStatePrefixes[s]);
    Tensor<float>& pack = s == 0 ? model.replicated() : s == 1 ? model.replicated_moment1() : model.replicated_moment2();
    std::vector<LayerWeights>& layers = s == 0 ? model.stack().weights() : s == 1 ? model.moment1() : model.moment2();
    std::vector<MoeShard>& experts = s == 0 ? model.stack().moe_weights() : s == 1 ? model.moe_moment1() : model.moe_moment2();
    const std::int64_t v = config.vocab, h = config.layer.hidden, final_row = config.replicated_rows() - 2;
    read(prefix + "embedding", pack.data());
    if (!config.tied_head) read(prefix + "head", pack.data() + v * h);
    read(prefix + "final_norm.gamma", pack.data() + final_row * h);
    read(prefix + "final_norm.beta", pack.data() + (final_row + 1) * h);
    for (int l = 0; l < config.layers; ++l) {
      const bool moe = config.is_moe_layer(l);
      GlobalLayerWeights<float> g(config.layer);
      for (auto [name, t] : layer_tensors(g))
        if (t->numel() > 0 && !(moe && is_mlp_tensor(name))) read(fmt::format("{}layers.{}.{}", prefix, l, name), t->data());
      LayerWeights shard = shard_of(g, config.layer, model.ranks(), model.rank());
      if (moe) {  // no dense MLP shard: the experts instead
        shard.mlp = MlpShard();
        shard.mlp.packed = Tensor<float>(Shape{0, h});
        GlobalMoeWeights<float> e(config.moe->moe);
        for (auto [name, t] : moe_tensors(e))
          if (t->numel() > 0) read(fmt::format("{}layers.{}.{}", prefix, l, name), t->data());
        experts[std::size_t(l)] = moe_shard_of(e, config.moe->moe, model.ranks(), model.rank());
      }
      layers[std::size_t(l)] = std::move(shard);
    }
  }
  if (options.optimizer_state) model.set_steps_taken(saved_step);
}

}  // namespace paradyse
