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
// other metadata entry (format paradyse.gpt.v2; v1 files, whose metadata has no checksum, still load).
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

// What load_checkpoint accepts beyond a complete checkpoint written by save_checkpoint, and what it restores.
struct CheckpointLoadOptions {
  // Load a file that has no data checksum (written by another tool), unverified. Off: such a file is refused.
  bool allow_missing_checksum = false;
  // Also restore the AdamW moments and the step count (the file must hold them): to resume training.
  bool optimizer_state = false;
};

// What save_checkpoint writes beyond the weights.
struct CheckpointSaveOptions {
  bool optimizer_state = false;  // the AdamW moments too (to resume training)
  // The caller's metadata (string keys and values), saved beside the configuration; its keys must not be ones the
  // checkpoint uses itself (format, the configuration's fields, step, saved_on_ranks, optimizer, the checksum).
  std::vector<std::pair<std::string, std::string>> extra;
};

// Writes `model` (every rank's shards, gathered) to `path` atomically. Collective: every rank of the model's group
// calls it; rank 0 writes the file. Beyond the model, it allocates save_checkpoint_bytes(config, ranks) per rank.
// When it throws (out of memory, a write error), the file at `path` is unchanged.
template <class Strategies, class Backend, Communicator C>
void save_checkpoint(C& comm, Gpt<Strategies, Backend>& model, const std::string& path,
                     const CheckpointSaveOptions& options = {}) {
  using namespace checkpoint_detail;
  const GptConfig& config = model.config();
  const bool writer = comm.rank() == 0;
  std::vector<safetensors::TensorEntry> entries = entries_of(config, options.optimizer_state);
  Metadata metadata = full_config_metadata(config);
  metadata.emplace_back("step", fmt::format("{}", model.steps_taken()));
  metadata.emplace_back("saved_on_ranks", fmt::format("{}", comm.size()));
  // The run's compute type (f32, or bf16 mixed precision); the tensors are its fp32 master weights either way.
  metadata.emplace_back("compute_dtype", std::string(name_of(Gpt<Strategies, Backend>::compute_dtype)));
  if (options.optimizer_state) metadata.emplace_back(std::string(kOptimizerKey), "adamw");
  for (const auto& [key, value] : options.extra) {
    for (const auto& [taken, ignored] : metadata)
      check(key != taken, "save_checkpoint: the extra metadata key '{}' is one the checkpoint uses itself", key);
    check(key != kChecksumKey && key != kMetadataChecksumKey,
          "save_checkpoint: the extra metadata key '{}' is a checksum's", key);
    metadata.emplace_back(key, value);
  }
  metadata.emplace_back(std::string(kMetadataChecksumKey), metadata_checksum(metadata));
  metadata.emplace_back(std::string(kChecksumKey), std::string(16, '0'));  // fixed width: rewritten at the end
  // The writer's file errors (a full disk, an unwritable folder) do not leave the collective: the writer stops
  // writing, every rank goes on gathering, and at the end every rank throws (the writer its error, the others one
  // naming it), so that no rank waits for a gather the writer left.
  std::optional<safetensors::AtomicFile> out;
  std::string write_error;
  const auto writing = [&](auto&& io) {
    if (!write_error.empty()) return;
    try {
      io();
    } catch (const std::exception& e) {
      write_error = e.what();
      out.reset();  // the temporary is removed; the file at `path` is unchanged
    }
  };
  std::int64_t data_start = 0;
  if (writer) {
    const std::string header = safetensors::encode_header(entries, metadata);
    data_start = std::int64_t(header.size());
    writing([&] {
      out.emplace(path);
      out->file().write_at(header.data(), data_start, 0);
    });
  }
  std::uint64_t checksum = safetensors::fnv1a(nullptr, 0);
  std::size_t next = 0;  // the next entry to write, in data order
  auto write = [&](std::string_view name, const float* data, std::int64_t count) {
    const safetensors::TensorEntry& e = entries[next++];
    check(e.name == name && e.numel() == count, "save_checkpoint: tensor '{}' of {} elements comes where the header has '{}' of {}",
          name, count, e.name, e.numel());
    writing([&] { out->file().write_at(data, count * std::int64_t(sizeof(float)), data_start + e.begin); });
    checksum = safetensors::fnv1a(data, std::size_t(count) * sizeof(float), checksum);
  };
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
  if (writer) {
    metadata.back().second = fmt::format("{:016x}", checksum);
    const std::string header = safetensors::encode_header(entries, metadata);
    check(std::int64_t(header.size()) == data_start, "save_checkpoint: the header changed size");
    writing([&] {
      out->file().write_at(header.data(), data_start, 0);
      out->commit();
    });
  }
  // Every rank learns whether the writer failed (and the file exists for every rank once this returns).
  const int failed_here = write_error.empty() ? 0 : 1;
  int failed = 0;
  comm.all_reduce(std::span<const int>(&failed_here, 1), std::span<int>(&failed, 1), ReduceOp::max);
  if (failed != 0) {  // every rank throws the writer's error (its text shared, so that any rank's report says why)
    constexpr std::size_t kChars = 1024;
    std::vector<int> mine(kChars, 0), shared(kChars, 0);
    for (std::size_t i = 0; i < std::min(write_error.size(), kChars - 1); ++i) mine[i] = static_cast<unsigned char>(write_error[i]);
    comm.all_reduce(std::span<const int>(mine), std::span<int>(shared), ReduceOp::max);
    std::string why;
    for (std::size_t i = 0; i < kChars && shared[i] != 0; ++i) why += char(shared[i]);
    if (why.rfind("paradyse: ", 0) == 0) why.erase(0, 10);
    throw Error(fmt::format("saving the checkpoint {} failed: {}", path, why));
  }
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
  const safetensors::File file(path, O_RDONLY);
  const safetensors::Header header = safetensors::read_header(file);
  const GptConfig saved = config_of(header, path);
  const GptConfig& config = model.config();
  if (!(saved == config)) {
    const Metadata a = full_config_metadata(saved), b = full_config_metadata(config);
    const auto value = [](const Metadata& m, const std::string& key) {
      for (const auto& [k, v] : m)
        if (k == key) return v;
      return std::string("none (a dense GPT)");  // only MoE keys can be absent
    };
    std::vector<std::string> keys;  // of either, in order
    for (const Metadata* m : {&a, &b})
      for (const auto& [key, ignored] : *m)
        if (std::find(keys.begin(), keys.end(), key) == keys.end()) keys.push_back(key);
    std::string diff;
    for (const std::string& key : keys)
      if (value(a, key) != value(b, key))
        diff += fmt::format("{}{}: checkpoint {}, model {}", diff.empty() ? "" : "; ", key, value(a, key), value(b, key));
    throw Error(fmt::format("checkpoint {}: it holds a different model ({})", path, diff));
  }
  // Names, dtypes and shapes (the moments too when the file has them).
  const std::string* optimizer = header.meta(kOptimizerKey);
  check(optimizer == nullptr || *optimizer == "adamw", "checkpoint {}: optimizer state '{}', expected adamw", path,
        printable(optimizer ? *optimizer : std::string()));
  check(!options.optimizer_state || optimizer != nullptr,
        "checkpoint {}: it holds the weights only, not the optimizer state needed to resume training (saved without "
        "CheckpointSaveOptions::optimizer_state)", path);
  const std::int64_t saved_step = options.optimizer_state ? to_integer(required(header, "step", path), "step", path, 0,
                                                                      std::numeric_limits<std::int64_t>::max())
                                                         : 0;
  const std::vector<safetensors::TensorEntry> expected = entries_of(config, optimizer != nullptr);
  for (const safetensors::TensorEntry& want : expected) {
    const safetensors::TensorEntry* got = header.find(want.name);
    check(got != nullptr, "checkpoint {}: tensor '{}' is missing", path, want.name);
    check(got->dtype == "F32", "checkpoint {}: tensor '{}' has dtype {}, expected F32", path, want.name, got->dtype);
    check(got->shape == want.shape, "checkpoint {}: tensor '{}' has shape [{}], expected [{}]", path, want.name,
          fmt::join(got->shape, ", "), fmt::join(want.shape, ", "));
  }
  for (const safetensors::TensorEntry& got : header.tensors) {
    bool known = false;
    for (const safetensors::TensorEntry& want : expected) known = known || want.name == got.name;
    check(known, "checkpoint {}: unexpected tensor '{}' (the model has no such weight)", path, got.name);
  }
  // The checksum over the whole data buffer, in blocks.
  const std::string* stored = header.meta(kChecksumKey);
  check(stored != nullptr || options.allow_missing_checksum,
        "checkpoint {}: the metadata has no '{}' checksum, so its data cannot be verified (not written by "
        "save_checkpoint?); pass CheckpointLoadOptions{{.allow_missing_checksum = true}} to load it unverified",
        path, kChecksumKey);
  if (stored) {
    Tensor<std::byte> block(Shape{std::min<std::int64_t>(std::int64_t(1) << 20, std::max<std::int64_t>(header.data_bytes, 1))});
    std::uint64_t checksum = safetensors::fnv1a(nullptr, 0);
    for (std::int64_t at = 0; at < header.data_bytes; at += block.numel()) {
      const std::int64_t n = std::min(block.numel(), header.data_bytes - at);
      file.read_at(block.data(), n, header.data_start + at);
      checksum = safetensors::fnv1a(block.data(), std::size_t(n), checksum);
    }
    check(fmt::format("{:016x}", checksum) == *stored,
          "checkpoint {}: the data is corrupted (checksum {:016x}, the header says {})", path, checksum,
          printable(*stored));
  }
  // Everything checks: read, a layer at a time (the weights, then the moments when asked for).
  auto read = [&](const std::string& name, float* out) {
    const safetensors::TensorEntry& e = *header.find(name);
    file.read_at(out, e.end - e.begin, header.data_start + e.begin);
  };
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
