// paradyse/search/training_model.hpp: the shape of a whole model to train (dense GPT/Llama or MoE), as the
// parallelism search sees it: parameter counts per part and FLOPs per token.
//
// cost/model_shape.hpp describes one layer and one batch for the per-layer strategy planner; the search needs the
// whole model (layers, vocabulary, experts, a first few dense layers) and counts by part, since each part is
// sharded over a different group of the mesh (attention and dense MLPs over tp, experts over ep x etp, the
// embedding over tp on the first and last pipeline stage). Presets carry the public shapes of their checkpoints'
// config.json files; a JSON file with the same keys describes any other model.
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/printable.hpp"
#include "paradyse/core/json.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace paradyse::search {

struct TrainingModel {
  std::string name;
  std::int64_t layers = 0;        // L
  std::int64_t hidden = 0;        // h
  std::int64_t heads = 0;         // a: query heads
  std::int64_t kv_heads = 0;      // a_kv (GQA when < heads)
  std::int64_t head_dim = 0;      // d (query/key; also value unless v_head_dim is set)
  std::int64_t ffn = 0;           // f: dense MLP width
  std::int64_t vocab = 0;         // V
  bool swiglu = false;            // gated MLP (3 matrices) instead of GELU (2)
  bool tied_embeddings = false;   // the output layer shares the input embedding (GPT-2/3, Megatron's GPT)
  // Multi-head latent attention (DeepSeek-V2/V3); 0 = ordinary attention.
  std::int64_t q_lora_rank = 0, kv_lora_rank = 0, rope_head_dim = 0, v_head_dim = 0;
  // Mixture of experts: 0 experts = dense.
  std::int64_t experts = 0;       // E routed experts per MoE layer
  std::int64_t top_k = 0;         // k experts per token
  std::int64_t expert_ffn = 0;    // f_e: width of one (SwiGLU) expert
  std::int64_t shared_experts = 0;
  std::int64_t shared_ffn = 0;    // width of one shared expert
  std::int64_t dense_layers = 0;  // the first layers keep a dense MLP (DeepSeek's first_k_dense_replace)

  bool is_moe() const { return experts > 0; }
  std::int64_t moe_layers() const { return is_moe() ? layers - dense_layers : 0; }
  std::int64_t dense_mlp_layers() const { return layers - moe_layers(); }
  bool is_mla() const { return kv_lora_rank > 0; }
  std::int64_t value_dim() const { return v_head_dim > 0 ? v_head_dim : head_dim; }
  std::int64_t key_dim() const { return head_dim + (is_mla() ? rope_head_dim : 0); }

  // ---- parameters of one layer, by part ----------------------------------------------------------------------
  // Attention projections (q, k, v, o; MLA: the low-rank down and up projections).
  double attention_parameters() const {
    const double h = double(hidden), a = double(heads);
    if (is_mla()) {
      const double q = q_lora_rank > 0 ? h * double(q_lora_rank) + double(q_lora_rank) * a * double(key_dim())
                                       : h * a * double(key_dim());
      const double kv = h * double(kv_lora_rank + rope_head_dim) +
                        double(kv_lora_rank) * a * double(head_dim + value_dim());
      return q + kv + a * double(value_dim()) * h;
    }
    return h * double(heads + 2 * kv_heads) * double(head_dim) + double(heads) * double(head_dim) * h;
  }
  // The output width of the q, k, v projections (the input of attention), per token.
  double qkv_width() const {
    return is_mla() ? double(heads) * double(key_dim() * 2 + value_dim()) : double(heads + 2 * kv_heads) * double(head_dim);
  }
  double context_width() const { return double(heads) * double(value_dim()); }  // attention output, per token
  int mlp_matrices() const { return swiglu ? 3 : 2; }
  double dense_mlp_parameters() const { return double(mlp_matrices()) * double(hidden) * double(ffn); }
  double expert_parameters() const { return 3.0 * double(hidden) * double(expert_ffn); }  // one SwiGLU expert
  double shared_expert_parameters() const { return double(shared_experts) * 3.0 * double(hidden) * double(shared_ffn); }
  double router_parameters() const { return double(hidden) * double(experts); }
  double norm_parameters() const { return 2.0 * double(hidden); }
  double embedding_parameters() const { return double(vocab) * double(hidden); }

  // Whole model.
  double total_parameters() const {
    return double(layers) * (attention_parameters() + norm_parameters()) +
           double(dense_mlp_layers()) * dense_mlp_parameters() +
           double(moe_layers()) * (double(experts) * expert_parameters() + shared_expert_parameters() +
                                   router_parameters()) +
           embedding_parameters() * (tied_embeddings ? 1 : 2);
  }
  double activated_parameters() const {
    return total_parameters() -
           double(moe_layers()) * double(experts - top_k) * expert_parameters();
  }

  // ---- FLOPs of one token's forward pass (multiply-add = 2) --------------------------------------------------
  // Attention core (scores and weighted values) for a token that attends to `context` keys.
  double attention_core_flops(double context) const {
    return 2.0 * context * double(heads) * double(key_dim() + value_dim());
  }
  // Every layer and the logits, attention over `context` keys per token: the model FLOPs of MFU (forward only).
  double forward_flops_per_token(double context) const {
    const double moe_mlp =
        2.0 * (double(top_k) * expert_parameters() + shared_expert_parameters() + router_parameters());
    return double(layers) * (2.0 * attention_parameters() + attention_core_flops(context)) +
           double(dense_mlp_layers()) * 2.0 * dense_mlp_parameters() + double(moe_layers()) * moe_mlp +
           2.0 * embedding_parameters();
  }
};

inline std::string describe(const TrainingModel& m) {
  std::string s = fmt::format("{}: L={} h={} heads={} kv_heads={} d={} ffn={} vocab={}{}", m.name, m.layers, m.hidden,
                              m.heads, m.kv_heads, m.head_dim, m.ffn, m.vocab, m.swiglu ? " swiglu" : " gelu");
  if (m.is_mla()) s += fmt::format(" mla(q_lora={} kv_lora={})", m.q_lora_rank, m.kv_lora_rank);
  if (m.is_moe())
    s += fmt::format(" experts={} top_k={} expert_ffn={} shared={}x{} dense_layers={}", m.experts, m.top_k,
                     m.expert_ffn, m.shared_experts, m.shared_ffn, m.dense_layers);
  return s + fmt::format(" ({:.1f}B parameters, {:.1f}B activated)", m.total_parameters() / 1e9,
                         m.activated_parameters() / 1e9);
}

// Throws naming the field that makes the model unusable.
inline void validate(const TrainingModel& m) {
  // Limits far above any model trained (10^2 layers, widths of 10^4 to 10^5): beyond them a search would only
  // spend time on a shape no device holds.
  constexpr std::int64_t kMaxLayers = 100'000, kMaxWidth = std::int64_t(1) << 24, kMaxCount = std::int64_t(1) << 20;
  check(m.layers >= 1 && m.layers <= kMaxLayers, "model {}: layers = {} must be in [1, {}]", m.name, m.layers,
        kMaxLayers);
  check(m.hidden <= kMaxWidth && m.head_dim <= kMaxWidth && m.ffn <= kMaxWidth && m.expert_ffn <= kMaxWidth &&
            m.shared_ffn <= kMaxWidth && m.vocab <= kMaxWidth * 64 && m.q_lora_rank <= kMaxWidth &&
            m.kv_lora_rank <= kMaxWidth && m.rope_head_dim <= kMaxWidth && m.v_head_dim <= kMaxWidth,
        "model {}: a width above the limit (hidden = {}, head_dim = {}, ffn = {}, expert_ffn = {}, vocab = {}; each "
        "at most {}, vocab at most {})", m.name, m.hidden, m.head_dim, m.ffn, m.expert_ffn, m.vocab, kMaxWidth,
        kMaxWidth * 64);
  check(m.heads <= kMaxCount && m.experts <= kMaxCount && m.shared_experts <= kMaxCount,
        "model {}: heads = {}, experts = {}, shared_experts = {} must each be at most {}", m.name, m.heads, m.experts,
        m.shared_experts, kMaxCount);
  check(m.hidden >= 1 && m.head_dim >= 1 && m.vocab >= 1, "model {}: hidden = {}, head_dim = {}, vocab = {} must be "
        "positive", m.name, m.hidden, m.head_dim, m.vocab);
  check(m.heads >= 1 && m.kv_heads >= 1 && m.heads % m.kv_heads == 0,
        "model {}: heads = {} must be a positive multiple of kv_heads = {}", m.name, m.heads, m.kv_heads);
  check(m.dense_layers >= 0 && m.dense_layers <= m.layers, "model {}: dense_layers = {} must be in [0, layers = {}]",
        m.name, m.dense_layers, m.layers);
  check(m.dense_mlp_layers() == 0 || m.ffn >= 1, "model {}: ffn = {} must be positive for its dense MLPs", m.name,
        m.ffn);
  check(m.experts >= 0 && m.shared_experts >= 0, "model {}: experts = {} and shared_experts = {} must not be negative",
        m.name, m.experts, m.shared_experts);
  if (m.is_moe())
    check(m.top_k >= 1 && m.top_k <= m.experts && m.expert_ffn >= 1,
          "model {}: top_k = {} must be in [1, experts = {}] and expert_ffn = {} positive", m.name, m.top_k, m.experts,
          m.expert_ffn);
}

// ---- presets (config.json of the public checkpoints) --------------------------------------------------------------

// GPT-3 175B (Brown et al. 2020, Table 2.1): 96 layers, d_model 12288, 96 heads of 128, ffn 4 d_model, BPE 50257
// padded to 51200 as Megatron-LM does.
inline TrainingModel gpt_175b() {
  return {.name = "gpt-175b", .layers = 96, .hidden = 12288, .heads = 96, .kv_heads = 96, .head_dim = 128,
          .ffn = 49152, .vocab = 51200, .tied_embeddings = true};
}
// Megatron-LM's GPT family (Narayanan et al. SC'21, Table 1): h = heads * head_dim, ffn 4h, vocabulary 51,200.
inline TrainingModel megatron_gpt(std::string name, std::int64_t heads, std::int64_t hidden, std::int64_t layers) {
  return {.name = std::move(name), .layers = layers, .hidden = hidden, .heads = heads, .kv_heads = heads,
          .head_dim = hidden / heads, .ffn = 4 * hidden, .vocab = 51200, .tied_embeddings = true};
}
// meta-llama/Llama-3.1-405B config.json: 126 layers, hidden 16384, 128 heads, 8 kv heads, intermediate 53248,
// vocab 128256, SwiGLU, untied.
inline TrainingModel llama3_405b() {
  return {.name = "llama3-405b", .layers = 126, .hidden = 16384, .heads = 128, .kv_heads = 8, .head_dim = 128,
          .ffn = 53248, .vocab = 128256, .swiglu = true};
}
// mistralai/Mixtral-8x22B-v0.1 config.json: 56 layers, hidden 6144, 48 heads, 8 kv heads, 8 experts of
// intermediate 16384, top-2, vocab 32768 (141B parameters, 39B activated).
inline TrainingModel mixtral_8x22b() {
  return {.name = "mixtral-8x22b", .layers = 56, .hidden = 6144, .heads = 48, .kv_heads = 8, .head_dim = 128,
          .ffn = 16384, .vocab = 32768, .swiglu = true, .experts = 8, .top_k = 2, .expert_ffn = 16384};
}
// deepseek-ai/DeepSeek-V3 config.json: 61 layers (first 3 dense, intermediate 18432), hidden 7168, 128 heads,
// MLA (q_lora_rank 1536, kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128),
// 256 routed experts of 2048, top-8, 1 shared expert, vocab 129280 (671B parameters, 37B activated).
inline TrainingModel deepseek_v3() {
  return {.name = "deepseek-v3", .layers = 61, .hidden = 7168, .heads = 128, .kv_heads = 128, .head_dim = 128,
          .ffn = 18432, .vocab = 129280, .swiglu = true, .q_lora_rank = 1536, .kv_lora_rank = 512,
          .rope_head_dim = 64, .v_head_dim = 128, .experts = 256, .top_k = 8, .expert_ffn = 2048,
          .shared_experts = 1, .shared_ffn = 2048, .dense_layers = 3};
}

inline constexpr std::array<std::string_view, 4> kModelPresets{"gpt-175b", "llama3-405b", "mixtral-8x22b",
                                                               "deepseek-v3"};

inline TrainingModel model_preset(std::string_view name) {
  if (name == "gpt-175b") return gpt_175b();
  if (name == "llama3-405b") return llama3_405b();
  if (name == "mixtral-8x22b") return mixtral_8x22b();
  if (name == "deepseek-v3") return deepseek_v3();
  throw Error(fmt::format("unknown model \"{}\"; expected one of {}, {}, {}, {} or a .json file", printable(name),
                          kModelPresets[0], kModelPresets[1], kModelPresets[2], kModelPresets[3]));
}

// A model from JSON with the config.json keys of Hugging Face checkpoints: num_hidden_layers, hidden_size,
// num_attention_heads, [num_key_value_heads], [head_dim], intermediate_size, vocab_size, [hidden_act "silu" =
// SwiGLU], [tie_word_embeddings], [num_local_experts | n_routed_experts, num_experts_per_tok, moe_intermediate_size,
// n_shared_experts, first_k_dense_replace], [q_lora_rank, kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim,
// v_head_dim]. Throws naming a missing or bad key.
// Keys of config.json files that do not change the shape the search prices (accepted and ignored); any other key
// is refused by name, so that a misspelt or unsupported shape key is never silently dropped.
inline constexpr std::array<std::string_view, 52> kModelKeysIgnored{
    "_name_or_path", "architectures", "model_type", "torch_dtype", "dtype", "transformers_version", "bos_token_id",
    "eos_token_id", "pad_token_id", "max_position_embeddings", "rope_theta", "rope_scaling", "rms_norm_eps",
    "layer_norm_eps", "layer_norm_epsilon", "initializer_range", "use_cache", "attention_dropout", "attention_bias",
    "mlp_bias", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "sliding_window", "use_sliding_window",
    "max_window_layers", "output_router_logits", "router_aux_loss_coef", "router_jitter_noise", "norm_topk_prob",
    "routed_scaling_factor", "topk_method", "n_group", "topk_group", "scoring_func", "aux_loss_alpha", "seq_aux",
    "moe_layer_freq", "ep_size", "num_nextn_predict_layers", "pretraining_tp", "quantization_config",
    "decoder_sparse_step", "mlp_only_layers", "qkv_bias", "rope_interleave", "partial_rotary_factor",
    "tie_encoder_decoder", "n_positions", "n_ctx", "use_qk_norm"};
inline constexpr std::array<std::string_view, 21> kModelKeysRead{
    "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "vocab_size", "hidden_act", "tie_word_embeddings", "num_local_experts", "n_routed_experts",
    "num_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts",
    "shared_expert_intermediate_size", "first_k_dense_replace", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim",
    "qk_nope_head_dim"};

inline TrainingModel model_from_json(const json::Value& v, std::string name) {
  // The name labels messages and output: control bytes (a "_name_or_path" of "\u0000" cut every message) escaped.
  if (std::any_of(name.begin(), name.end(), [](char ch) { return static_cast<unsigned char>(ch) < 0x20 || ch == 0x7f; }))
    name = printable(name);
  const json::Field doc(v, fmt::format("model {}", name));
  doc.expect(doc.is_object(), "a JSON object");
  {  // unknown and repeated keys, by name
    std::vector<std::string_view> seen;
    for (const auto& [key, member] : v.items()) {
      (void)member;
      const std::string_view k = key;
      if (std::find(seen.begin(), seen.end(), k) != seen.end())
        doc.fail(fmt::format("duplicate key \"{}\": each key may appear once", printable(k)));
      seen.push_back(k);
      const bool known = k == "v_head_dim" ||
                         std::find(kModelKeysRead.begin(), kModelKeysRead.end(), k) != kModelKeysRead.end() ||
                         std::find(kModelKeysIgnored.begin(), kModelKeysIgnored.end(), k) != kModelKeysIgnored.end();
      if (!known) {
        std::string expected;
        for (std::string_view x : kModelKeysRead) expected += fmt::format("{}{}", expected.empty() ? "" : ", ", x);
        doc.fail(fmt::format("unknown key \"{}\" (a key that may change the shape is not read silently); the keys "
                             "read are {}, v_head_dim", printable(k), expected));
      }
    }
  }
  auto integer = [&](std::string_view key, std::int64_t fallback, bool required) -> std::int64_t {
    const std::optional<json::Field> x = doc.find(key);
    if (!x) {
      check(!required, "{}: missing key \"{}\"", doc.context(), key);
      return fallback;
    }
    x->expect(x->value().is_number(), "an integer");
    const double d = x->value().get<double>();
    check(d >= 0 && d < 1e12 && double(std::int64_t(d)) == d, "{}: \"{}\" = {} must be a non-negative integer",
          doc.context(), key, d);
    return std::int64_t(d);
  };
  TrainingModel m;
  m.name = std::move(name);
  m.layers = integer("num_hidden_layers", 0, true);
  m.hidden = integer("hidden_size", 0, true);
  m.heads = integer("num_attention_heads", 0, true);
  m.kv_heads = integer("num_key_value_heads", m.heads, false);
  m.q_lora_rank = integer("q_lora_rank", 0, false);
  m.kv_lora_rank = integer("kv_lora_rank", 0, false);
  m.rope_head_dim = m.kv_lora_rank > 0 ? integer("qk_rope_head_dim", 0, true) : 0;
  m.v_head_dim = integer("v_head_dim", 0, false);
  m.head_dim = m.kv_lora_rank > 0 ? integer("qk_nope_head_dim", 0, true)
                                  : integer("head_dim", m.heads > 0 ? m.hidden / m.heads : 0, false);
  m.vocab = integer("vocab_size", 0, true);
  if (const auto act = doc.find("hidden_act"); act && act->value().is_string())
    m.swiglu = act->string() == "silu" || act->string() == "swiglu";
  if (const auto tie = doc.find("tie_word_embeddings"); tie && tie->value().is_boolean()) m.tied_embeddings = tie->boolean();
  m.experts = integer("num_local_experts", integer("n_routed_experts", integer("num_experts", 0, false), false), false);
  m.ffn = integer("intermediate_size", 0, m.experts == 0);
  if (m.experts > 0) {
    m.swiglu = true;
    m.top_k = integer("num_experts_per_tok", 0, true);
    m.expert_ffn = integer("moe_intermediate_size", m.ffn, m.ffn == 0);
    m.shared_experts = integer("n_shared_experts", 0, false);
    m.shared_ffn = m.shared_experts > 0 ? m.expert_ffn : 0;
    const std::int64_t shared = integer("shared_expert_intermediate_size", 0, false);
    if (shared > 0 && m.shared_experts == 0) m.shared_experts = 1, m.shared_ffn = shared;  // Qwen2-MoE: its own width
    m.dense_layers = integer("first_k_dense_replace", 0, false);
  }
  validate(m);
  // head_dim defaults to hidden / heads: refused when that is not an integer (it was truncated).
  if (m.kv_lora_rank == 0 && !doc.find("head_dim"))
    check(m.hidden % m.heads == 0, "{}: hidden_size = {} is not divisible by num_attention_heads = {} (head_dim "
          "would be {:.6g}, not an integer); give head_dim", doc.context(), m.hidden, m.heads,
          double(m.hidden) / double(m.heads));
  return m;
}

// The config.json keys of a model (what model_from_json reads back to the same shape).
inline json::Value model_to_json(const TrainingModel& m) {
  json::Value v = {{"_name_or_path", m.name},
                   {"num_hidden_layers", m.layers},
                   {"hidden_size", m.hidden},
                   {"num_attention_heads", m.heads},
                   {"num_key_value_heads", m.kv_heads},
                   {"vocab_size", m.vocab},
                   {"hidden_act", m.swiglu ? "silu" : "gelu"},
                   {"tie_word_embeddings", m.tied_embeddings}};
  if (m.is_mla()) {
    v["q_lora_rank"] = m.q_lora_rank;
    v["kv_lora_rank"] = m.kv_lora_rank;
    v["qk_rope_head_dim"] = m.rope_head_dim;
    v["qk_nope_head_dim"] = m.head_dim;
  } else {
    v["head_dim"] = m.head_dim;
  }
  if (m.v_head_dim > 0) v["v_head_dim"] = m.v_head_dim;
  if (m.ffn > 0) v["intermediate_size"] = m.ffn;
  if (m.is_moe()) {
    v["n_routed_experts"] = m.experts;
    v["num_experts_per_tok"] = m.top_k;
    v["moe_intermediate_size"] = m.expert_ffn;
    if (m.shared_experts > 0) {
      if (m.shared_ffn == m.expert_ffn) v["n_shared_experts"] = m.shared_experts;
      else v["shared_expert_intermediate_size"] = m.shared_experts * m.shared_ffn;
    }
    if (m.dense_layers > 0) v["first_k_dense_replace"] = m.dense_layers;
  }
  return v;
}

}  // namespace paradyse::search
