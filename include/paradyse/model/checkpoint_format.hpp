// paradyse/model/checkpoint_format.hpp: the layout of a GPT checkpoint file (model/checkpoint.hpp saves and loads
// it): the format and metadata keys, the configuration as metadata strings and back (with the accepted ranges),
// the tensors' names, shapes and data order, and the reads of the header alone (read_checkpoint_metadata,
// read_checkpoint_config). Names and shapes:
//   embedding [V, h]; head [V, h] (untied only); final_norm.gamma, final_norm.beta [h];
//   layers.<l>.attention.{w_q, w_k, w_v, w_proj}, layers.<l>.mlp.{w_in, w_up (SwiGLU only), w_out},
//   layers.<l>.{norm1, norm2}.{gamma, beta}, layers.<l>.moe.{router, expert_in, expert_out, shared_*} (MoE layers);
//   with the optimizer state, the same again prefixed "adamw.m." and "adamw.v.".
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/contract/layer_config.hpp"
#include "paradyse/contract/weight_shards.hpp"
#include "paradyse/model/gpt.hpp"
#include "paradyse/model/safetensors.hpp"
#include "paradyse/moe/moe_weights.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace paradyse {

namespace checkpoint_detail {

// v2: the metadata is under a checksum too (metadata_fnv1a64); v1 files (data checksum only) still load, their
// metadata unverified but parsed as strictly.
inline constexpr std::string_view kFormat = "paradyse.gpt.v2";
inline constexpr std::string_view kFormatV1 = "paradyse.gpt.v1";
inline constexpr std::string_view kChecksumKey = "data_fnv1a64";
inline constexpr std::string_view kMetadataChecksumKey = "metadata_fnv1a64";
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

// The checksum of a checkpoint's metadata: FNV-1a over every entry but the two checksums, sorted by key, each as
// key NUL value NUL (so that no other split of the same bytes gives the same checksum), as 16 hex digits.
inline std::string metadata_checksum(const Metadata& metadata) {
  std::vector<const std::pair<std::string, std::string>*> entries;
  for (const auto& entry : metadata)
    if (entry.first != kChecksumKey && entry.first != kMetadataChecksumKey) entries.push_back(&entry);
  std::sort(entries.begin(), entries.end(), [](auto* a, auto* b) { return *a < *b; });
  std::uint64_t checksum = safetensors::fnv1a(nullptr, 0);
  const char nul = '\0';
  for (const auto* entry : entries) {
    checksum = safetensors::fnv1a(entry->first.data(), entry->first.size(), checksum);
    checksum = safetensors::fnv1a(&nul, 1, checksum);
    checksum = safetensors::fnv1a(entry->second.data(), entry->second.size(), checksum);
    checksum = safetensors::fnv1a(&nul, 1, checksum);
  }
  return fmt::format("{:016x}", checksum);
}

// Throws unless the metadata of the checkpoint at `path` is what was saved: a v2 file save_checkpoint wrote (it has
// the data checksum) must carry the metadata checksum, and a metadata checksum present must match. A v1 file (and a
// hand-made one without checksums) passes unverified; its fields are parsed strictly all the same.
inline void verify_metadata(const Metadata& metadata, const std::string& path) {
  const auto find = [&](std::string_view key) -> const std::string* {
    for (const auto& [k, v] : metadata)
      if (k == key) return &v;
    return nullptr;
  };
  const std::string* stored = find(kMetadataChecksumKey);
  const std::string* format = find("format");
  if (stored == nullptr) {
    check(format == nullptr || *format != kFormat || find(kChecksumKey) == nullptr,
          "checkpoint {}: the metadata has no '{}' checksum, although the file is {} with a data checksum (edited by "
          "hand or by another tool?)", path, kMetadataChecksumKey, kFormat);
    return;
  }
  const std::string actual = metadata_checksum(metadata);
  check(actual == *stored, "checkpoint {}: the metadata is corrupted or was edited (checksum {}, the header says {})",
        path, actual, printable(*stored));
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
  check(get("format") == kFormat || get("format") == kFormatV1, "checkpoint {}: format '{}', expected '{}' (or the "
        "older '{}')", path, printable(get("format")), kFormat, kFormatV1);
  verify_metadata(h.metadata, path);
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
    throw Error(fmt::format("checkpoint {}: its configuration is invalid: {}", path, error_reason(e)));
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

// Whether `name` (within a layer) is one of the dense MLP's tensors.
inline bool is_mlp_tensor(std::string_view name) { return name.substr(0, 4) == "mlp."; }

}  // namespace checkpoint_detail

// The metadata of a checkpoint (reads the header only): the configuration, step, and the caller's extra entries,
// verified against the metadata checksum (checkpoint_detail::verify_metadata).
inline std::vector<std::pair<std::string, std::string>> read_checkpoint_metadata(const std::string& path) {
  const safetensors::File file(path, O_RDONLY);
  std::vector<std::pair<std::string, std::string>> metadata = safetensors::read_header(file).metadata;
  checkpoint_detail::verify_metadata(metadata, path);
  return metadata;
}

// The configuration a checkpoint holds (reads the header only).
inline GptConfig read_checkpoint_config(const std::string& path) {
  const safetensors::File file(path, O_RDONLY);
  return checkpoint_detail::config_of(safetensors::read_header(file), path);
}

}  // namespace paradyse
