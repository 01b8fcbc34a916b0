// paradyse/serve/model_shape_hf.hpp: the shape of a model (hidden, layers, heads, key/value heads, head width,
// experts, top-k, shared experts, expert width, dense layers, vocabulary) from a Hugging Face config.json alone, for
// models whose weights do not fit here: the simulated clock costs them (serve/step_cost.hpp) and the shape-only
// stepper serves them (serve/shape_step.hpp).
//
// Every family the loader reads (serve/hf_config.hpp: Mixtral, Qwen2-MoE, OLMoE, Qwen3-MoE, DeepSeek-V2/V2-Lite/V3)
// reads here the same way: DeepSeek's shared experts, dense first layers and multi-head latent attention (its KV
// cache is the compressed latent: DecoderConfig::kv_cache_floats) included.
#pragma once

#include "paradyse/core/json.hpp"
#include "paradyse/serve/hf_config.hpp"

#include <fmt/format.h>

#include <filesystem>
#include <string>

namespace paradyse::serve {

struct ModelShape {
  std::string architecture;  // as config.json names it
  DecoderConfig config;
  std::string note;          // what the shape leaves out (empty: nothing)

  // Bytes the KV cache keeps per token (all layers, whole model) at `dtype_bytes` per value: MLA's compressed latent.
  double kv_bytes_per_token(int dtype_bytes) const {
    return double(config.layers) * double(config.kv_cache_floats(config.kv_heads)) * dtype_bytes;
  }

  // Parameters (embedding, attention, FFN, router, lm_head) and routed-expert parameters.
  double parameters() const {
    const DecoderConfig& c = config;
    const double h = double(c.hidden);
    double total = double(c.vocab) * h * (c.tied_embeddings ? 1 : 2);
    for (std::int64_t l = 0; l < c.layers; ++l) {
      if (c.is_mla()) {
        const MlaShape& a = c.mla;
        const double H = double(c.heads), qk = double(a.nope + a.rope);
        total += a.q_lora_rank > 0 ? h * double(a.q_lora_rank) + double(a.q_lora_rank) * (1 + H * qk) : h * H * qk;
        total += h * double(a.kv_lora_rank + a.rope) + double(a.kv_lora_rank) * (1 + H * double(a.nope + a.v)) +
                 H * double(a.v) * h;
      } else {
        total += h * double(c.q_width() + 2 * c.kv_width()) + double(c.q_width()) * h;
      }
      total += c.is_moe(l) ? double(c.moe.experts) * 3 * h * double(c.moe.expert_ffn) +
                                 3 * h * double(c.moe.shared_width()) + h * double(c.moe.experts)
                           : 3 * h * double(c.dense_ffn);
    }
    return total;
  }
};

namespace shape_detail {

inline std::string architecture_of(const json::Value& c) {
  if (const auto a = c.find("architectures"); a != c.end() && a->is_array() && !a->empty() && (*a)[0].is_string())
    return (*a)[0].get<std::string>();
  if (const auto t = c.find("model_type"); t != c.end() && t->is_string()) return t->get<std::string>();
  return "?";
}

}  // namespace shape_detail

// The shape of a parsed config.json; `source` names it in errors.
inline ModelShape model_shape(const json::Value& c, const std::string& source) {
  check(c.is_object(), "hf config {}: expected a JSON object, found {}", source, c.type_name());
  ModelShape s;
  s.architecture = shape_detail::architecture_of(c);
  s.config = decoder_config(c, source);
  return s;
}

// A config.json file, or a folder holding one.
inline ModelShape read_model_shape(const std::string& path) {
  const std::string file = std::filesystem::is_directory(path) ? path + "/config.json" : path;
  check(std::filesystem::exists(file), "model shape: {} does not exist (a Hugging Face config.json or its folder)",
        file);
  return model_shape(json::load_file(file), file);
}

}  // namespace paradyse::serve
