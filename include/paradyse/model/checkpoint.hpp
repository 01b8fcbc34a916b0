// paradyse/model/checkpoint.hpp: GPT checkpoints in the safetensors format (model/safetensors.hpp).
//
// What is saved: the GLOBAL (unsharded) float32 tensors of the model, so a checkpoint saved on p ranks loads on any
// other group size (and in any safetensors reader): the shards of every rank are gathered layer by layer (one
// all-gather per sublayer; only one layer's full weights are alive at a time) and rank 0 writes the one file,
// atomically (a temporary in the same folder, fsync, rename). Names:
//   embedding [V, h]; head [V, h] (untied only); final_norm.gamma, final_norm.beta [h];
//   layers.<l>.attention.{w_q, w_k, w_v, w_proj}, layers.<l>.mlp.{w_in, w_up (SwiGLU only), w_out},
//   layers.<l>.{norm1, norm2}.{gamma, beta}      (shapes as contract/weight_shards.hpp's GlobalLayerWeights)
// The metadata holds the model configuration, the optimizer step count and an FNV-1a checksum of the data buffer.
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
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace paradyse {

namespace checkpoint_detail {

inline constexpr std::string_view kFormat = "paradyse.gpt.v1";
inline constexpr std::string_view kChecksumKey = "data_fnv1a64";
inline constexpr std::string_view kOptimizerKey = "optimizer";  // "adamw" when the moments are in the file
// The states a checkpoint can hold, by name prefix: the weights, then AdamW's first and second moments.
inline constexpr std::string_view kStatePrefixes[3] = {"", "adamw.m.", "adamw.v."};

using Metadata = std::vector<std::pair<std::string, std::string>>;

// The configuration as metadata strings (doubles with 17 digits: exact round trips).
inline Metadata config_metadata(const GptConfig& g) {
  const LayerConfig& c = g.layer;
  return {{"format", std::string(kFormat)},
          {"hidden", fmt::format("{}", c.hidden)},
          {"heads", fmt::format("{}", c.heads)},
          {"kv_heads", fmt::format("{}", c.kv_heads)},
          {"head_dim", fmt::format("{}", c.head_dim)},
          {"ffn", fmt::format("{}", c.ffn)},
          {"activation", std::string(name_of(c.activation))},
          {"norm", std::string(name_of(c.norm))},
          {"norm_eps", fmt::format("{:.17g}", c.norm_eps)},
          {"rope", c.rope ? "true" : "false"},
          {"rope_base", fmt::format("{:.17g}", c.rope_base)},
          {"causal", c.causal ? "true" : "false"},
          {"zigzag", c.zigzag ? "true" : "false"},
          {"layers", fmt::format("{}", g.layers)},
          {"vocab", fmt::format("{}", g.vocab)},
          {"tied_head", g.tied_head ? "true" : "false"}};
}
// The MoE layers' configuration (none for a dense GPT).
inline Metadata moe_metadata(const GptConfig& g) {
  if (!g.moe) return {};
  const MoeConfig& m = g.moe->moe;
  return {{"moe.first_k_dense", fmt::format("{}", g.moe->first_k_dense)},
          {"moe.experts", fmt::format("{}", m.experts)},
          {"moe.top_k", fmt::format("{}", m.top_k)},
          {"moe.expert_ffn", fmt::format("{}", m.expert_ffn)},
          {"moe.scoring", m.scoring == RouterScoring::softmax ? "softmax" : "sigmoid"},
          {"moe.norm_topk_prob", m.norm_topk_prob ? "true" : "false"},
          {"moe.routed_scaling_factor", fmt::format("{:.17g}", m.routed_scaling_factor)},
          {"moe.shared_experts", fmt::format("{}", m.shared_experts)},
          {"moe.shared_ffn", fmt::format("{}", m.shared_ffn)},
          {"moe.shared_gate", m.shared_gate ? "true" : "false"},
          {"moe.capacity_factor", fmt::format("{:.17g}", m.capacity_factor)},
          {"moe.aux_loss_coef", fmt::format("{:.17g}", m.aux_loss_coef)},
          {"moe.z_loss_coef", fmt::format("{:.17g}", m.z_loss_coef)}};
}
// Everything of the configuration: the dense model's fields, then the MoE layers' (if any).
inline Metadata full_config_metadata(const GptConfig& g) {
  Metadata all = config_metadata(g);
  for (auto& entry : moe_metadata(g)) all.push_back(std::move(entry));
  return all;
}

inline const std::string& required(const safetensors::Header& h, std::string_view key, const std::string& path) {
  const std::string* v = h.meta(key);
  check(v != nullptr, "checkpoint {}: the metadata has no '{}' (not a paradyse GPT checkpoint?)", path, key);
  return *v;
}
// The largest value a checkpoint's size fields may hold (far beyond any model that fits in memory; it keeps
// every product of them inside 64 bits).
inline constexpr std::int64_t kMaxExtent = std::int64_t(1) << 24;
inline constexpr std::int64_t kMaxLayers = std::int64_t(1) << 16;

// A decimal integer in [min, max]; anything else (not a number, trailing text, out of range) names the text.
inline std::int64_t to_integer(const std::string& text, std::string_view key, const std::string& path,
                               std::int64_t min = 1, std::int64_t max = kMaxExtent) {
  std::int64_t v = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), v, 10);
  check(!text.empty() && end == text.data() + text.size() && error != std::errc::invalid_argument,
        "checkpoint {}: metadata '{}' = \"{}\" is not an integer", path, key, printable(text));
  check(error == std::errc() && v >= min && v <= max,
        "checkpoint {}: metadata '{}' = \"{}\" is out of range [{}, {}]", path, key, text, min, max);
  return v;
}
inline double to_double(const std::string& text, std::string_view key, const std::string& path) {
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  check(!text.empty() && *end == '\0' && std::isfinite(v), "checkpoint {}: metadata '{}' = \"{}\" is not a finite number",
        path, key, printable(text));
  return v;
}
inline bool to_bool(const std::string& text, std::string_view key, const std::string& path) {
  check(text == "true" || text == "false", "checkpoint {}: metadata '{}' = \"{}\" is not true or false", path, key,
        printable(text));
  return text == "true";
}

inline GptConfig config_of(const safetensors::Header& h, const std::string& path) {
  const auto get = [&](std::string_view key) -> const std::string& { return required(h, key, path); };
  check(get("format") == kFormat, "checkpoint {}: format '{}', expected '{}'", path,
        printable(get("format")), kFormat);
  GptConfig g;
  LayerConfig& c = g.layer;
  c.hidden = to_integer(get("hidden"), "hidden", path);
  c.heads = to_integer(get("heads"), "heads", path);
  c.kv_heads = to_integer(get("kv_heads"), "kv_heads", path);
  c.head_dim = to_integer(get("head_dim"), "head_dim", path);
  c.ffn = to_integer(get("ffn"), "ffn", path);
  const std::string& activation = get("activation");
  check(activation == "gelu" || activation == "swiglu", "checkpoint {}: activation '{}' is not gelu or swiglu", path,
        printable(activation));
  c.activation = activation == "gelu" ? Activation::gelu : Activation::swiglu;
  const std::string& norm = get("norm");
  check(norm == "layer_norm" || norm == "rms_norm", "checkpoint {}: norm '{}' is not layer_norm or rms_norm", path,
        printable(norm));
  c.norm = norm == "layer_norm" ? NormKind::layer_norm : NormKind::rms_norm;
  c.norm_eps = to_double(get("norm_eps"), "norm_eps", path);
  c.rope = to_bool(get("rope"), "rope", path);
  c.rope_base = to_double(get("rope_base"), "rope_base", path);
  c.causal = to_bool(get("causal"), "causal", path);
  c.zigzag = to_bool(get("zigzag"), "zigzag", path);
  g.layers = int(to_integer(get("layers"), "layers", path, 1, kMaxLayers));
  g.vocab = to_integer(get("vocab"), "vocab", path);
  g.tied_head = to_bool(get("tied_head"), "tied_head", path);
  if (h.meta("moe.experts") != nullptr) {  // an MoE GPT
    MoeConfig m;
    m.hidden = c.hidden;
    m.experts = to_integer(get("moe.experts"), "moe.experts", path);
    m.top_k = to_integer(get("moe.top_k"), "moe.top_k", path);
    m.expert_ffn = to_integer(get("moe.expert_ffn"), "moe.expert_ffn", path);
    const std::string& scoring = get("moe.scoring");
    check(scoring == "softmax" || scoring == "sigmoid", "checkpoint {}: moe.scoring '{}' is not softmax or sigmoid",
          path, printable(scoring));
    m.scoring = scoring == "softmax" ? RouterScoring::softmax : RouterScoring::sigmoid;
    m.norm_topk_prob = to_bool(get("moe.norm_topk_prob"), "moe.norm_topk_prob", path);
    m.routed_scaling_factor = to_double(get("moe.routed_scaling_factor"), "moe.routed_scaling_factor", path);
    m.shared_experts = to_integer(get("moe.shared_experts"), "moe.shared_experts", path, 0);
    m.shared_ffn = to_integer(get("moe.shared_ffn"), "moe.shared_ffn", path, 0);
    m.shared_gate = to_bool(get("moe.shared_gate"), "moe.shared_gate", path);
    m.capacity_factor = to_double(get("moe.capacity_factor"), "moe.capacity_factor", path);
    m.aux_loss_coef = to_double(get("moe.aux_loss_coef"), "moe.aux_loss_coef", path);
    m.z_loss_coef = to_double(get("moe.z_loss_coef"), "moe.z_loss_coef", path);
    g.moe = MoeLayers{m, int(to_integer(get("moe.first_k_dense"), "moe.first_k_dense", path, 0, kMaxLayers))};
  }
  try {
    g.validate();
  } catch (const Error& e) {
    throw Error(fmt::format("checkpoint {}: its configuration is invalid: {}", path, e.what()));
  }
  return g;
}

// The tensors of one global layer with their names in the checkpoint, in data order (w_up is empty under GELU).
inline std::vector<std::pair<std::string_view, Tensor<float>*>> layer_tensors(GlobalLayerWeights<float>& g) {
  return {{"attention.w_q", &g.w_q},   {"attention.w_k", &g.w_k}, {"attention.w_v", &g.w_v},
          {"attention.w_proj", &g.w_proj}, {"mlp.w_in", &g.w_in},  {"mlp.w_up", &g.w_up},
          {"mlp.w_out", &g.w_out},     {"norm1.gamma", &g.norm1_gamma}, {"norm1.beta", &g.norm1_beta},
          {"norm2.gamma", &g.norm2_gamma}, {"norm2.beta", &g.norm2_beta}};
}

// The tensors of one layer's global MoE weights with their names in the checkpoint, in data order (the shared
// experts' are empty without them; entries_of lists the same names and shapes).
inline std::vector<std::pair<std::string_view, Tensor<float>*>> moe_tensors(GlobalMoeWeights<float>& g) {
  return {{"moe.router", &g.router},       {"moe.expert_in", &g.expert_in},   {"moe.expert_out", &g.expert_out},
          {"moe.shared_in", &g.shared_in}, {"moe.shared_out", &g.shared_out}, {"moe.shared_gate", &g.shared_gate}};
}

// The entries a checkpoint of config `c` holds, in data order (a model with empty tensors: shapes only): the weights,
// then with `optimizer_state` the same entries again for each AdamW moment.
inline std::vector<safetensors::TensorEntry> entries_of(const GptConfig& c, bool optimizer_state = false) {
  std::vector<safetensors::TensorEntry> entries;
  const LayerConfig& l = c.layer;
  std::string_view state;  // the name prefix of the state being listed
  auto add = [&](std::string name, std::vector<std::int64_t> shape) {
    entries.push_back({std::string(state) + name, "F32", std::move(shape), 0, 0});
  };
  for (int s = 0; s < (optimizer_state ? 3 : 1); ++s) {
  state = kStatePrefixes[s];
  add("embedding", {c.vocab, l.hidden});
  if (!c.tied_head) add("head", {c.vocab, l.hidden});
  add("final_norm.gamma", {l.hidden});
  add("final_norm.beta", {l.hidden});
  for (int i = 0; i < c.layers; ++i) {
    const std::string p = fmt::format("layers.{}.", i);
    add(p + "attention.w_q", {l.q_width(), l.hidden});
    add(p + "attention.w_k", {l.kv_width(), l.hidden});
    add(p + "attention.w_v", {l.kv_width(), l.hidden});
    add(p + "attention.w_proj", {l.q_width(), l.hidden});
    if (!c.is_moe_layer(i)) {
      add(p + "mlp.w_in", {l.ffn, l.hidden});
      if (l.activation == Activation::swiglu) add(p + "mlp.w_up", {l.ffn, l.hidden});
      add(p + "mlp.w_out", {l.ffn, l.hidden});
    }
    for (const char* n : {"norm1.gamma", "norm1.beta", "norm2.gamma", "norm2.beta"}) add(p + n, {l.hidden});
    if (c.is_moe_layer(i)) {
      const MoeConfig& m = c.moe->moe;
      add(p + "moe.router", {m.experts, l.hidden});
      add(p + "moe.expert_in", {m.experts, 2 * m.expert_ffn, l.hidden});
      add(p + "moe.expert_out", {m.experts, m.expert_ffn, l.hidden});
      if (m.has_shared()) {
        add(p + "moe.shared_in", {2 * m.shared_width(), l.hidden});
        add(p + "moe.shared_out", {m.shared_width(), l.hidden});
      }
      if (m.shared_gate) add(p + "moe.shared_gate", {1, l.hidden});
    }
  }
  }
  return entries;
}

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

inline bool is_mlp_tensor(std::string_view name) { return name.substr(0, 4) == "mlp."; }

}  // namespace checkpoint_detail

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

// The metadata of a checkpoint (reads the header only): the configuration, step, and the caller's extra entries.
inline std::vector<std::pair<std::string, std::string>> read_checkpoint_metadata(const std::string& path) {
  const safetensors::File file(path, O_RDONLY);
  return safetensors::read_header(file).metadata;
}

// The configuration a checkpoint holds (reads the header only).
inline GptConfig read_checkpoint_config(const std::string& path) {
  const safetensors::File file(path, O_RDONLY);
  return checkpoint_detail::config_of(safetensors::read_header(file), path);
}

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
  if (options.optimizer_state) metadata.emplace_back(std::string(kOptimizerKey), "adamw");
  for (const auto& [key, value] : options.extra) {
    for (const auto& [taken, ignored] : metadata)
      check(key != taken, "save_checkpoint: the extra metadata key '{}' is one the checkpoint uses itself", key);
    check(key != kChecksumKey, "save_checkpoint: the extra metadata key '{}' is the checksum's", key);
    metadata.emplace_back(key, value);
  }
  metadata.emplace_back(std::string(kChecksumKey), std::string(16, '0'));  // fixed width: rewritten at the end
  std::optional<safetensors::AtomicFile> out;
  std::int64_t data_start = 0;
  if (writer) {
    const std::string header = safetensors::encode_header(entries, metadata);
    data_start = std::int64_t(header.size());
    out.emplace(path);
    out->file().write_at(header.data(), data_start, 0);
  }
  std::uint64_t checksum = safetensors::fnv1a(nullptr, 0);
  std::size_t next = 0;  // the next entry to write, in data order
  auto write = [&](std::string_view name, const float* data, std::int64_t count) {
    const safetensors::TensorEntry& e = entries[next++];
    check(e.name == name && e.numel() == count, "save_checkpoint: tensor '{}' of {} elements comes where the header has '{}' of {}",
          name, count, e.name, e.numel());
    out->file().write_at(data, count * std::int64_t(sizeof(float)), data_start + e.begin);
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
    out->file().write_at(header.data(), data_start, 0);
    out->commit();
  }
  comm.barrier();  // the file exists for every rank once this returns
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
