// paradyse/serve/hf_config.hpp: the shape of a Hugging Face MoE decoder (DecoderConfig) read from its config.json.
//
// Families (config.json "architectures"[0], or "model_type"):
//   - MixtralForCausalLM (mixtral): every layer MoE, softmax top-k, always renormalised, no shared expert;
//   - Qwen2MoeForCausalLM (qwen2_moe): q/k/v biases; MoE layers every decoder_sparse_step except mlp_only_layers
//     (those are dense SwiGLU of intermediate_size); a shared expert behind a sigmoid gate; norm_topk_prob;
//   - OlmoeForCausalLM (olmoe): RMSNorm of q and of k over the whole projection (all heads together), norm_topk_prob;
//   - Qwen3MoeForCausalLM (qwen3_moe): RMSNorm of each head of q and of k (q_norm, k_norm [head_dim]) before RoPE,
//     head_dim may differ from hidden / heads; MoE layers as Qwen2-MoE's (decoder_sparse_step, mlp_only_layers,
//     norm_topk_prob), no shared expert;
//   - DeepseekV2ForCausalLM (deepseek_v2: V2 and V2-Lite) and DeepseekV3ForCausalLM (deepseek_v3): multi-head latent
//     attention (MlaShape: q_lora_rank (null: none), kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim;
//     serve/mla_attention.hpp), the first first_k_dense_replace layers dense (intermediate_size), the others MoE with
//     n_shared_experts always-on experts of moe_intermediate_size, routed_scaling_factor; V2 routes by softmax,
//     topk_method greedy or group_limited_greedy (n_group, topk_group); V3 by sigmoid with e_score_correction_bias,
//     topk_method noaux_tc, norm_topk_prob. What transformers computes differently from the original code, or not
//     at all, is refused by name: moe_layer_freq other than 1 (transformers makes every layer from
//     first_k_dense_replace on MoE), norm_topk_prob in V2 (transformers' DeepseekV2 never renormalises), a
//     scoring_func or topk_method other than the one the architecture computes. DeepSeek's rope_scaling of type
//     "yarn" is computed (serve/yarn_rope.hpp); any other type, or an unknown key in it, is refused.
// Attention is GQA with RoPE (the Hugging Face "halves" pairing), pre-norm RMSNorm layers, a final RMSNorm and an
// untied (or tied, tie_word_embeddings) lm_head. Anything else (an unknown architecture, sliding windows, clip_qkv,
// rope scaling outside DeepSeek, hidden_act other than silu, attention_bias outside Qwen2-MoE, mlp_bias, partial rotary, a key of the
// wrong type) is refused with the key and value named.
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/json.hpp"
#include "paradyse/core/printable.hpp"
#include "paradyse/moe/moe_config.hpp"
#include "paradyse/serve/yarn_rope.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <vector>
#include <utility>

namespace paradyse::serve {

enum class Family { mixtral, qwen2_moe, olmoe, qwen3_moe, deepseek_v2, deepseek_v3 };

constexpr std::string_view name_of(Family f) {
  switch (f) {
    case Family::mixtral: return "mixtral";
    case Family::qwen2_moe: return "qwen2_moe";
    case Family::olmoe: return "olmoe";
    case Family::qwen3_moe: return "qwen3_moe";
    case Family::deepseek_v2: return "deepseek_v2";
    case Family::deepseek_v3: return "deepseek_v3";
  }
  return "?";
}

// Multi-head latent attention (DeepSeek-V2/V3); kv_lora_rank = 0: none (grouped-query attention).
struct MlaShape {
  std::int64_t q_lora_rank = 0;   // 0: q = x W_q; else q = RMSNorm(x W_qa) W_qb
  std::int64_t kv_lora_rank = 0;  // width of the compressed c_kv (with k_pe, what the cache keeps per token)
  std::int64_t nope = 0;          // qk_nope_head_dim
  std::int64_t rope = 0;          // qk_rope_head_dim
  std::int64_t v = 0;             // v_head_dim
  bool interleaved_rope = true;   // RoPE pairs (x[2j], x[2j+1]) (else halves; DeepSeek-V3's rope_interleave)
};

struct DecoderConfig {
  Family family = Family::mixtral;
  std::int64_t vocab = 0;
  std::int64_t hidden = 0;
  std::int64_t layers = 0;
  std::int64_t heads = 0;       // query heads
  std::int64_t kv_heads = 0;    // key/value heads (GQA: heads % kv_heads == 0)
  std::int64_t head_dim = 0;
  double rms_eps = 1e-6;
  double rope_theta = 10000.0;
  bool qkv_bias = false;        // Qwen2-MoE
  bool qk_norm = false;         // OLMoE: RMSNorm over the whole q and k projections
  bool head_qk_norm = false;    // Qwen3-MoE: RMSNorm of each head of q and k (weights [head_dim])
  bool tied_embeddings = false; // lm_head = embed_tokens
  std::int64_t dense_ffn = 0;   // width of the dense SwiGLU layers (0: none)
  std::vector<bool> moe_layer;  // [layers]: MoE FFN (else dense)
  MoeConfig moe;                // the routed (and shared) experts of every MoE layer
  MlaShape mla;                 // DeepSeek: head_dim = nope + rope (q and k), mla.v (values)
  YarnRope yarn;                // DeepSeek's rope_scaling (yarn; factor 0: none), serve/yarn_rope.hpp

  bool is_moe(std::int64_t layer) const { return moe_layer[std::size_t(layer)]; }
  bool any_moe() const { return std::find(moe_layer.begin(), moe_layer.end(), true) != moe_layer.end(); }
  std::int64_t q_width() const { return heads * head_dim; }
  std::int64_t kv_width() const { return kv_heads * head_dim; }
  bool is_mla() const { return mla.kv_lora_rank > 0; }
  // Width of one head's attention output (v_head_dim under MLA).
  std::int64_t value_dim() const { return is_mla() ? mla.v : head_dim; }
  // Floats the KV cache keeps per token and layer for `kv_heads_held` key/value heads: MLA's latent (c_kv and the
  // shared k_pe, whatever the heads), else K and V of each held head.
  std::int64_t kv_cache_floats(std::int64_t kv_heads_held) const {
    return is_mla() ? mla.kv_lora_rank + mla.rope : 2 * kv_heads_held * head_dim;
  }

  void validate() const {
    check(vocab >= 1 && hidden >= 1 && layers >= 1, "DecoderConfig: vocab {}, hidden {}, layers {} must be positive",
          vocab, hidden, layers);
    check(heads >= 1 && kv_heads >= 1 && heads % kv_heads == 0,
          "DecoderConfig: num_attention_heads = {} must be a positive multiple of num_key_value_heads = {}", heads,
          kv_heads);
    check(head_dim >= 2 && head_dim % 2 == 0, "DecoderConfig: head_dim = {} must be even and positive (RoPE pairs)",
          head_dim);
    if (is_mla())
      check(mla.rope >= 2 && mla.rope % 2 == 0 && mla.nope >= 0 && mla.v >= 1 && mla.q_lora_rank >= 0 &&
                head_dim == mla.nope + mla.rope && kv_heads == heads,
            "DecoderConfig: MLA needs an even qk_rope_head_dim >= 2 (got {}), qk_nope_head_dim >= 0 ({}), v_head_dim "
            ">= 1 ({}), q_lora_rank >= 0 ({}) and num_key_value_heads = num_attention_heads ({} and {})",
            mla.rope, mla.nope, mla.v, mla.q_lora_rank, kv_heads, heads);
    check(std::int64_t(moe_layer.size()) == layers, "DecoderConfig: {} MoE flags for {} layers", moe_layer.size(),
          layers);
    bool any_moe = false, any_dense = false;
    for (bool m : moe_layer) (m ? any_moe : any_dense) = true;
    if (any_moe) moe.validate();
    check(!any_dense || dense_ffn >= 1, "DecoderConfig: dense layers need intermediate_size >= 1, got {}", dense_ffn);
  }
};

namespace hf_detail {

// The largest value an integer of config.json may hold (far beyond any model's width, vocabulary or expert count),
// and the most layers: a corrupt "num_hidden_layers": 4294967297 must be refused, not looped over (it hung).
inline constexpr std::int64_t kMaxExtent = std::int64_t(1) << 24;
inline constexpr std::int64_t kMaxLayers = std::int64_t(1) << 16;

// Members of config.json through json::Field: errors read "hf config <file>: <key> is string, expected an integer".
inline json::Field field(const json::Value& c, const std::string& source) { return {c, "hf config " + source}; }
// An integer in [0, max] (a negative one is refused where the shape is validated, naming what it must be).
inline std::int64_t integer(const json::Value& c, std::string_view key, const std::string& source,
                            std::int64_t max = kMaxExtent) {
  const std::optional<json::Field> v = field(c, source).find(key);
  check(v.has_value(), "hf config {}: \"{}\" is missing", source, key);
  return v->integer(std::numeric_limits<std::int64_t>::min(), max);
}
// A key that is absent or null takes `fallback`; one of another type is refused (a string "1e-6" must not become
// the default quietly), naming the file, the key, what it holds and what was expected.
inline void expect_type(const json::Value& v, std::string_view key, bool ok, std::string_view expected,
                        const std::string& source) {
  check(ok, "hf config {}: \"{}\" is {} ({}); expected {}", source, key, v.dump(), v.type_name(), expected);
}
inline std::int64_t integer_or(const json::Value& c, std::string_view key, std::int64_t fallback,
                               const std::string& source) {
  const auto v = c.find(key);
  if (v == c.end() || v->is_null()) return fallback;
  expect_type(*v, key, v->is_number(), "an integer", source);
  return json::Field(*v, "hf config " + source, std::string(key))
      .integer(std::numeric_limits<std::int64_t>::min(), kMaxExtent);
}
inline double number_or(const json::Value& c, std::string_view key, double fallback, const std::string& source) {
  const auto v = c.find(key);
  if (v == c.end() || v->is_null()) return fallback;
  expect_type(*v, key, v->is_number() && std::isfinite(v->get<double>()), "a finite number", source);
  return v->get<double>();
}
inline bool flag_or(const json::Value& c, std::string_view key, bool fallback, const std::string& source) {
  const auto v = c.find(key);
  if (v == c.end() || v->is_null()) return fallback;
  expect_type(*v, key, v->is_boolean(), "true or false", source);
  return v->get<bool>();
}
inline std::string text_or(const json::Value& c, std::string_view key, const std::string& fallback,
                           const std::string& source) {
  const auto v = c.find(key);
  if (v == c.end() || v->is_null()) return fallback;
  expect_type(*v, key, v->is_string(), "a string", source);
  return v->get<std::string>();
}
inline void refuse_if_set(const json::Value& c, std::string_view key, const std::string& source, std::string_view why) {
  const auto v = c.find(key);
  check(v == c.end() || v->is_null() || (v->is_boolean() && !v->get<bool>()), "hf config {}: \"{}\" is set: {}",
        source, key, why);
}

// d.validate() with the file named: "hf config F: its shape is invalid: MoeConfig: top_k = 2 must be in [1, 1]".
inline void validate(const DecoderConfig& d, const std::string& source) {
  try {
    d.validate();
  } catch (const Error& e) {
    throw Error(fmt::format("hf config {}: its shape is invalid: {}", source, error_reason(e)));
  }
}

inline Family family_of(const json::Value& c, const std::string& source) {
  std::string name;
  if (const auto a = c.find("architectures"); a != c.end() && a->is_array() && !a->empty() && (*a)[0].is_string())
    name = (*a)[0].get<std::string>();
  else if (const auto t = c.find("model_type"); t != c.end() && t->is_string())
    name = t->get<std::string>();
  if (name == "MixtralForCausalLM" || name == "mixtral") return Family::mixtral;
  if (name == "Qwen2MoeForCausalLM" || name == "qwen2_moe") return Family::qwen2_moe;
  if (name == "OlmoeForCausalLM" || name == "olmoe") return Family::olmoe;
  if (name == "Qwen3MoeForCausalLM" || name == "qwen3_moe") return Family::qwen3_moe;
  if (name == "DeepseekV2ForCausalLM" || name == "deepseek_v2") return Family::deepseek_v2;
  if (name == "DeepseekV3ForCausalLM" || name == "deepseek_v3") return Family::deepseek_v3;
  throw Error(fmt::format("hf config {}: unknown architecture \"{}\"; expected MixtralForCausalLM, "
                          "Qwen2MoeForCausalLM, OlmoeForCausalLM, Qwen3MoeForCausalLM, DeepseekV2ForCausalLM or "
                          "DeepseekV3ForCausalLM",
                          source, name.empty() ? "(none: no architectures or model_type)" : printable(name)));
}

// DeepSeek's rope_scaling {"type" (or "rope_type"): "yarn", "factor", "original_max_position_embeddings",
// "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate"}; transformers' defaults for
// the absent ones (max_position_embeddings, or the family's default_max, for the original length).
inline YarnRope read_yarn(const json::Value& c, const json::Value& r, std::int64_t default_max,
                          const std::string& source) {
  const std::string what = fmt::format("rope_scaling {}", printable(r.dump()));
  check(r.is_object(), "hf config {}: \"rope_scaling\" is {} ({}); expected an object or null", source,
        printable(r.dump()), r.type_name());
  static constexpr std::string_view kKeys[] = {"type", "rope_type", "factor", "original_max_position_embeddings",
                                               "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                                               "attention_factor", "truncate"};
  for (const auto& [key, value] : r.items())
    check(std::find(std::begin(kKeys), std::end(kKeys), key) != std::end(kKeys), "hf config {}: \"rope_scaling\" has "
          "the key \"{}\" (value {}); supported: type/rope_type, factor, original_max_position_embeddings, beta_fast, "
          "beta_slow, mscale, mscale_all_dim, attention_factor, truncate", source, printable(key),
          printable(value.dump()));
  const std::string type = text_or(r, "rope_type", text_or(r, "type", "", source), source);
  check(type == "yarn", "hf config {}: \"rope_scaling\" type is \"{}\" in {}; supported: \"yarn\" (DeepSeek)", source,
        printable(type), what);
  YarnRope y;
  y.factor = number_or(r, "factor", 0.0, source);
  check(y.factor >= 1.0, "hf config {}: rope_scaling factor is {} in {}; expected a number >= 1", source, y.factor,
        what);
  const double max_position = double(integer_or(c, "max_position_embeddings", default_max, source));
  y.original_max_position = number_or(r, "original_max_position_embeddings", 0.0, source);
  if (y.original_max_position == 0.0) y.original_max_position = max_position;  // transformers: `or`
  y.beta_fast = number_or(r, "beta_fast", 0.0, source);
  y.beta_slow = number_or(r, "beta_slow", 0.0, source);
  if (y.beta_fast == 0.0) y.beta_fast = 32.0;
  if (y.beta_slow == 0.0) y.beta_slow = 1.0;
  y.mscale = number_or(r, "mscale", 0.0, source);
  y.mscale_all_dim = number_or(r, "mscale_all_dim", 0.0, source);
  y.attention_factor = number_or(r, "attention_factor", 0.0, source);
  y.truncate = flag_or(r, "truncate", true, source);
  check(y.original_max_position >= 1.0 && y.beta_fast > 0.0 && y.beta_slow > 0.0 && y.attention_factor >= 0.0,
        "hf config {}: {}: original_max_position_embeddings = {} must be at least 1, beta_fast = {} and beta_slow = {} "
        "positive, attention_factor = {} positive or absent", source, what, y.original_max_position, y.beta_fast,
        y.beta_slow, y.attention_factor);
  return y;
}

// DeepSeek-V2/V3: attention (MLA) and the MoE layers, into d (whose common fields are read).
inline void read_deepseek(const json::Value& c, const std::string& source, DecoderConfig& d) {
  const bool v3 = d.family == Family::deepseek_v3;
  MlaShape& a = d.mla;
  a.q_lora_rank = integer_or(c, "q_lora_rank", 0, source);
  a.kv_lora_rank = integer(c, "kv_lora_rank", source);
  a.nope = integer(c, "qk_nope_head_dim", source);
  a.rope = integer(c, "qk_rope_head_dim", source);
  a.v = integer(c, "v_head_dim", source);
  check(a.kv_lora_rank >= 1 && a.q_lora_rank >= 0, "hf config {}: kv_lora_rank = {} must be at least 1 and q_lora_rank "
        "= {} null or at least 1", source, a.kv_lora_rank, a.q_lora_rank);
  a.interleaved_rope = v3 ? flag_or(c, "rope_interleave", true, source) : true;
  d.head_dim = a.nope + a.rope;
  // transformers writes head_dim = qk_rope_head_dim (its RoPE width) and qk_head_dim = nope + rope; a config.json
  // whose values differ would override them in transformers (another RoPE width, another query split).
  using Stated = std::pair<const char*, std::int64_t>;
  for (const auto& [key, want] : {Stated{"head_dim", a.rope}, Stated{"qk_head_dim", a.nope + a.rope}}) {
    const std::int64_t stated = integer_or(c, key, want, source);
    check(stated == want, "hf config {}: \"{}\" is {}; expected {} (qk_rope_head_dim = {}, qk_nope_head_dim = {})",
          source, key, stated, want, a.rope, a.nope);
  }
  check(d.kv_heads == d.heads, "hf config {}: num_key_value_heads = {} with num_attention_heads = {}; multi-head latent "
        "attention has one key and value per query head (expected them equal)", source, d.kv_heads, d.heads);
  MoeConfig& m = d.moe;
  m.experts = integer(c, "n_routed_experts", source);
  m.top_k = integer(c, "num_experts_per_tok", source);
  m.expert_ffn = integer(c, "moe_intermediate_size", source);
  m.routed_scaling_factor = number_or(c, "routed_scaling_factor", 1.0, source);
  m.norm_topk_prob = flag_or(c, "norm_topk_prob", false, source);
  check(v3 || !m.norm_topk_prob, "hf config {}: \"norm_topk_prob\" is true; transformers' DeepseekV2 never "
        "renormalises the top-k weights (the original code does): supported: false", source);
  m.shared_experts = integer_or(c, "n_shared_experts", 0, source);
  m.shared_ffn = m.shared_experts > 0 ? m.expert_ffn : 0;
  d.dense_ffn = integer(c, "intermediate_size", source);
  const std::int64_t first_dense = integer_or(c, "first_k_dense_replace", 0, source),
                     freq = integer_or(c, "moe_layer_freq", 1, source);
  check(first_dense >= 0, "hf config {}: first_k_dense_replace = {} must be non-negative", source, first_dense);
  check(freq == 1, "hf config {}: \"moe_layer_freq\" is {}; supported: 1 (transformers makes every layer from "
        "first_k_dense_replace on an MoE layer)", source, freq);
  for (std::int64_t l = 0; l < d.layers; ++l) d.moe_layer[std::size_t(l)] = l >= first_dense;
  const std::string scoring = text_or(c, "scoring_func", v3 ? "sigmoid" : "softmax", source);
  check(scoring == (v3 ? "sigmoid" : "softmax"), "hf config {}: \"scoring_func\" is \"{}\"; {} scores by {}", source,
        printable(scoring), v3 ? "DeepseekV3" : "DeepseekV2", v3 ? "sigmoid" : "softmax");
  m.scoring = v3 ? RouterScoring::sigmoid : RouterScoring::softmax;
  const std::string method = text_or(c, "topk_method", v3 ? "noaux_tc" : "greedy", source);
  if (v3) {
    check(method == "noaux_tc", "hf config {}: \"topk_method\" is \"{}\"; DeepseekV3 routes by \"noaux_tc\"", source,
          printable(method));
    m.topk_method = TopkMethod::noaux_tc;
  } else {
    check(method == "greedy" || method == "group_limited_greedy", "hf config {}: \"topk_method\" is \"{}\"; supported "
          "for DeepseekV2: \"greedy\", \"group_limited_greedy\"", source, printable(method));
    m.topk_method = method == "greedy" ? TopkMethod::greedy : TopkMethod::group_limited_greedy;
  }
  if (m.topk_method != TopkMethod::greedy) {
    m.n_group = integer(c, "n_group", source);
    m.topk_group = integer(c, "topk_group", source);
  }
}

}  // namespace hf_detail

// The config of a parsed config.json; `source` names it in errors.
inline DecoderConfig decoder_config(const json::Value& c, const std::string& source) {
  using namespace hf_detail;
  check(c.is_object(), "hf config {}: expected a JSON object, found {}", source, c.type_name());
  DecoderConfig d;
  d.family = family_of(c, source);
  d.vocab = integer(c, "vocab_size", source);
  d.hidden = integer(c, "hidden_size", source);
  d.layers = integer(c, "num_hidden_layers", source, kMaxLayers);
  d.heads = integer(c, "num_attention_heads", source);
  d.kv_heads = integer_or(c, "num_key_value_heads", d.heads, source);
  // Qwen3-MoE states head_dim (it may differ from hidden / heads); the other families derive it.
  const auto stated = c.find("head_dim");
  const bool deepseek = d.family == Family::deepseek_v2 || d.family == Family::deepseek_v3;
  const bool explicit_head_dim = deepseek || (d.family == Family::qwen3_moe && stated != c.end() && !stated->is_null());
  check(d.heads >= 1 && (explicit_head_dim || d.hidden % d.heads == 0),
        "hf config {}: hidden_size {} is not a multiple of {} heads", source, d.hidden, d.heads);
  d.head_dim = deepseek ? 0 : integer_or(c, "head_dim", d.hidden / d.heads, source);  // DeepSeek: from MLA
  d.rms_eps = number_or(c, "rms_norm_eps", 1e-6, source);
  d.rope_theta = number_or(c, "rope_theta", 10000.0, source);
  d.tied_embeddings = flag_or(c, "tie_word_embeddings", false, source);
  // Keys that change the mathematics and that the decoder does not implement: refused by name, never computed wrongly.
  for (const char* key : {"hidden_act", "hidden_activation"}) {
    const std::string act = text_or(c, key, "silu", source);
    check(act == "silu", "hf config {}: \"{}\" is \"{}\"; supported: \"silu\" (SwiGLU experts and MLPs)", source, key,
          printable(act));
  }
  if (d.family != Family::qwen2_moe)  // Qwen2-MoE's q/k/v biases are fixed by the architecture, not this key
    refuse_if_set(c, "attention_bias", source, "q/k/v/o projection biases are supported only as Qwen2-MoE's q/k/v biases");
  refuse_if_set(c, "mlp_bias", source, "MLP biases are not supported");
  const double rotary = number_or(c, "partial_rotary_factor", 1.0, source);
  check(rotary == 1.0, "hf config {}: \"partial_rotary_factor\" is {}; supported: 1 (rotary embedding on every head "
        "dimension)", source, rotary);
  if (const auto v = c.find("rope_scaling"); v != c.end() && !v->is_null()) {
    check(deepseek, "hf config {}: \"rope_scaling\" is {}; rope scaling is supported only as DeepSeek's yarn: expected "
          "null", source, printable(v->dump()));
    d.yarn = read_yarn(c, *v, d.family == Family::deepseek_v3 ? 4096 : 2048, source);
  }
  refuse_if_set(c, "clip_qkv", source, "clipping q/k/v is not supported");
  refuse_if_set(c, "use_sliding_window", source, "sliding-window attention is not supported");
  if (d.family == Family::mixtral) refuse_if_set(c, "sliding_window", source, "sliding-window attention is not supported");
  d.moe_layer.assign(std::size_t(std::max<std::int64_t>(d.layers, 0)), true);
  MoeConfig& m = d.moe;
  m.hidden = d.hidden;
  m.scoring = RouterScoring::softmax;
  switch (d.family) {
    case Family::mixtral:
      m.experts = integer(c, "num_local_experts", source);
      m.top_k = integer(c, "num_experts_per_tok", source);
      m.expert_ffn = integer(c, "intermediate_size", source);
      m.norm_topk_prob = true;
      break;
    case Family::qwen2_moe:
    case Family::qwen3_moe: {
      const bool qwen3 = d.family == Family::qwen3_moe;
      d.qkv_bias = !qwen3;
      d.head_qk_norm = qwen3;
      m.experts = integer(c, "num_experts", source);
      m.top_k = integer(c, "num_experts_per_tok", source);
      m.expert_ffn = integer(c, "moe_intermediate_size", source);
      m.norm_topk_prob = flag_or(c, "norm_topk_prob", false, source);
      if (qwen3) refuse_if_set(c, "shared_expert_intermediate_size", source, "Qwen3-MoE has no shared expert");
      const std::int64_t shared = qwen3 ? 0 : integer_or(c, "shared_expert_intermediate_size", 0, source);
      m.shared_experts = shared > 0 ? 1 : 0;
      m.shared_ffn = shared;
      m.shared_gate = shared > 0;
      d.dense_ffn = integer_or(c, "intermediate_size", 0, source);
      const std::int64_t step = integer_or(c, "decoder_sparse_step", 1, source);
      check(step >= 1, "hf config {}: decoder_sparse_step = {} must be at least 1", source, step);
      std::vector<bool> dense_only(d.moe_layer.size(), false);  // marks, not a search per layer (L x list: a hang)
      if (const auto list = c.find("mlp_only_layers"); list != c.end() && list->is_array())
        for (const json::Field& v : field(c, source)["mlp_only_layers"].elements()) {
          const std::int64_t l = v.integer(0, kMaxLayers);
          if (l < d.layers) dense_only[std::size_t(l)] = true;
        }
      for (std::int64_t l = 0; l < d.layers; ++l)
        d.moe_layer[std::size_t(l)] = !dense_only[std::size_t(l)] && m.experts > 0 && (l + 1) % step == 0;
      break;
    }
    case Family::deepseek_v2:
    case Family::deepseek_v3:
      read_deepseek(c, source, d);
      break;
    case Family::olmoe:
      d.qk_norm = true;
      m.experts = integer(c, "num_experts", source);
      m.top_k = integer(c, "num_experts_per_tok", source);
      m.expert_ffn = integer(c, "intermediate_size", source);
      m.norm_topk_prob = flag_or(c, "norm_topk_prob", false, source);
      break;
  }
  validate(d, source);
  return d;
}

// The model's identity as sensitivity tables record it (moe/sensitivity.hpp): the shape a reader can check at a
// glance, and a 64-bit FNV-1a hash of every field of the config (so two configs that differ anywhere differ here).
inline std::string model_identity(const DecoderConfig& c) {
  std::uint64_t hash = 14695981039346656037ull;
  const auto mix = [&hash](const std::string& text) {
    for (const unsigned char ch : text) hash = (hash ^ ch) * 1099511628211ull;
  };
  const MoeConfig& m = c.moe;
  std::int64_t moe_layers = 0;
  std::string flags;
  for (const bool b : c.moe_layer) flags += b ? 'M' : 'D', moe_layers += b;
  mix(fmt::format("{}|{}|{}|{}|{}|{}|{}|{:.17g}|{:.17g}|{}|{}|{}|{}|{}", name_of(c.family), c.vocab, c.hidden, c.layers,
                  c.heads, c.kv_heads, c.head_dim, c.rms_eps, c.rope_theta, c.qkv_bias, c.qk_norm, c.tied_embeddings,
                  c.dense_ffn, flags));
  if (c.head_qk_norm) mix("|head_qk_norm");
  if (c.is_mla())
    mix(fmt::format("|mla {} {} {} {} {} {}", c.mla.q_lora_rank, c.mla.kv_lora_rank, c.mla.nope, c.mla.rope, c.mla.v,
                    c.mla.interleaved_rope));
  if (c.yarn.enabled())
    mix(fmt::format("|yarn {:.17g} {:.17g} {:.17g} {:.17g} {:.17g} {:.17g} {:.17g} {}", c.yarn.factor,
                    c.yarn.original_max_position, c.yarn.beta_fast, c.yarn.beta_slow, c.yarn.mscale,
                    c.yarn.mscale_all_dim, c.yarn.attention_factor, c.yarn.truncate));
  if (m.topk_method != TopkMethod::greedy)
    mix(fmt::format("|{} {} {}", name_of(m.topk_method), m.n_group, m.topk_group));
  mix(fmt::format("|{}|{}|{}|{}|{}|{:.17g}|{}|{}|{}", m.experts, m.top_k, m.expert_ffn, int(m.scoring), m.norm_topk_prob,
                  m.routed_scaling_factor, m.shared_experts, m.shared_ffn, m.shared_gate));
  return fmt::format("{} layers {} ({} MoE) hidden {} experts {} top-k {} config {:016x}", name_of(c.family), c.layers,
                     moe_layers, c.hidden, m.experts, m.top_k, hash);
}

// config.json of a model folder.
inline DecoderConfig read_decoder_config(const std::string& folder) {
  const std::string path = folder + "/config.json";
  return decoder_config(json::load_file(path), path);
}

}  // namespace paradyse::serve
