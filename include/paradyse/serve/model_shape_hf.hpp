// paradyse/serve/model_shape_hf.hpp: the shape of a model (hidden, layers, heads, key/value heads, head width,
// experts, top-k, shared experts, expert width, dense layers, vocabulary) from a Hugging Face config.json alone, for
// models whose weights do not fit here: the simulated clock costs them (serve/step_cost.hpp) and the shape-only
// stepper serves them (serve/shape_step.hpp).
//
// Mixtral, Qwen2-MoE and OLMoE configs read as the loader reads them (serve/hf_config.hpp). DeepSeek-V2
// (DeepseekV2ForCausalLM) reads here: n_routed_experts, num_experts_per_tok, moe_intermediate_size, n_shared_experts
// (each moe_intermediate_size wide, ungated), the first first_k_dense_replace layers and every layer off
// moe_layer_freq dense (intermediate_size). Its attention is multi-head latent attention (MLA); the shape takes it
// as multi-head attention of v_head_dim-wide heads (num_key_value_heads of them), so its KV cache and attention cost
// are MHA's, not MLA's compressed cache: stated in `note`.
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

  // Parameters (embedding, attention, FFN, router, lm_head) and routed-expert parameters.
  double parameters() const {
    const DecoderConfig& c = config;
    const double h = double(c.hidden);
    double total = double(c.vocab) * h * (c.tied_embeddings ? 1 : 2);
    for (std::int64_t l = 0; l < c.layers; ++l) {
      total += h * double(c.q_width() + 2 * c.kv_width()) + double(c.q_width()) * h;
      total += c.is_moe(l) ? double(c.moe.experts) * 3 * h * double(c.moe.expert_ffn) +
                                 3 * h * double(c.moe.shared_width()) + h * double(c.moe.experts)
                           : 3 * h * double(c.dense_ffn);
    }
    return total;
  }
};

namespace shape_detail {

inline bool is_deepseek_v2(const json::Value& c) {
  if (const auto a = c.find("architectures"); a != c.end() && a->is_array() && !a->empty() && (*a)[0].is_string())
    return (*a)[0].get<std::string>() == "DeepseekV2ForCausalLM";
  const auto t = c.find("model_type");
  return t != c.end() && t->is_string() && t->get<std::string>() == "deepseek_v2";
}

inline std::string architecture_of(const json::Value& c) {
  if (const auto a = c.find("architectures"); a != c.end() && a->is_array() && !a->empty() && (*a)[0].is_string())
    return (*a)[0].get<std::string>();
  if (const auto t = c.find("model_type"); t != c.end() && t->is_string()) return t->get<std::string>();
  return "?";
}

inline DecoderConfig deepseek_v2_config(const json::Value& c, const std::string& source) {
  using namespace hf_detail;
  DecoderConfig d;
  d.family = Family::qwen2_moe;  // the family only selects a weight loader; a shape has no weights
  d.vocab = integer(c, "vocab_size", source);
  d.hidden = integer(c, "hidden_size", source);
  d.layers = integer(c, "num_hidden_layers", source, kMaxLayers);
  d.heads = integer(c, "num_attention_heads", source);
  d.kv_heads = integer_or(c, "num_key_value_heads", d.heads, source);
  d.head_dim = integer_or(c, "v_head_dim", d.hidden / std::max<std::int64_t>(1, d.heads), source);
  d.rms_eps = number_or(c, "rms_norm_eps", 1e-6, source);
  d.rope_theta = number_or(c, "rope_theta", 10000.0, source);
  d.tied_embeddings = flag_or(c, "tie_word_embeddings", false, source);
  d.dense_ffn = integer(c, "intermediate_size", source);
  MoeConfig& m = d.moe;
  m.hidden = d.hidden;
  m.experts = integer(c, "n_routed_experts", source);
  m.top_k = integer(c, "num_experts_per_tok", source);
  m.expert_ffn = integer(c, "moe_intermediate_size", source);
  m.norm_topk_prob = flag_or(c, "norm_topk_prob", false, source);
  m.routed_scaling_factor = number_or(c, "routed_scaling_factor", 1.0, source);
  m.shared_experts = integer_or(c, "n_shared_experts", 0, source);
  m.shared_ffn = m.shared_experts > 0 ? m.expert_ffn : 0;
  const std::int64_t first_dense = integer_or(c, "first_k_dense_replace", 0, source),
                     freq = integer_or(c, "moe_layer_freq", 1, source);
  check(freq >= 1 && first_dense >= 0, "hf config {}: moe_layer_freq = {} must be >= 1 and first_k_dense_replace = {} "
        ">= 0", source, freq, first_dense);
  d.moe_layer.assign(std::size_t(std::max<std::int64_t>(0, d.layers)), false);
  for (std::int64_t l = 0; l < d.layers; ++l) d.moe_layer[std::size_t(l)] = l >= first_dense && l % freq == 0;
  validate(d, source);
  return d;
}

}  // namespace shape_detail

// The shape of a parsed config.json; `source` names it in errors.
inline ModelShape model_shape(const json::Value& c, const std::string& source) {
  check(c.is_object(), "hf config {}: expected a JSON object, found {}", source, c.type_name());
  ModelShape s;
  s.architecture = shape_detail::architecture_of(c);
  if (shape_detail::is_deepseek_v2(c)) {
    s.config = shape_detail::deepseek_v2_config(c, source);
    s.note = "MLA attention taken as multi-head attention of v_head_dim-wide heads (MHA's KV cache, not MLA's)";
  } else {
    s.config = decoder_config(c, source);
  }
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
