// paradyse/model/hf_names.hpp: the Hugging Face tensor names of a decoder (Mixtral, Qwen2-MoE, Qwen2/3, Llama), stated
// once: model/hf_checkpoint.hpp writes them, serve/decoder_weights.hpp reads them.
//
//   hf_names::kEmbedding                        model.embed_tokens.weight [V, h]
//   hf_names::kFinalNorm, hf_names::kLmHead     model.norm.weight [h], lm_head.weight [V, h]
//   hf_names::layer(l) + kInputNorm ...         model.layers.<l>.input_layernorm.weight [h], ...
//   hf_names::moe_block(layer(l), mixtral)      model.layers.<l>.block_sparse_moe. (Mixtral) | .mlp. (Qwen2-MoE)
//   hf_names::expert(block, e) + expert_swiglu(mixtral).gate ...   <block>experts.<e>.w1.weight | gate_proj.weight
// A SwiGLU's three matrices: gate [f, h], up [f, h], down [h, f].
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <string>

namespace paradyse::hf_names {

inline constexpr const char* kEmbedding = "model.embed_tokens.weight";
inline constexpr const char* kFinalNorm = "model.norm.weight";
inline constexpr const char* kLmHead = "lm_head.weight";

// The prefix of layer l's tensors; the names below are appended to it.
inline std::string layer(std::int64_t l) { return fmt::format("model.layers.{}.", l); }
inline constexpr const char* kInputNorm = "input_layernorm.weight";
inline constexpr const char* kPostAttentionNorm = "post_attention_layernorm.weight";
inline constexpr const char* kQ = "self_attn.q_proj.weight";
inline constexpr const char* kK = "self_attn.k_proj.weight";
inline constexpr const char* kV = "self_attn.v_proj.weight";
inline constexpr const char* kO = "self_attn.o_proj.weight";
inline constexpr const char* kQBias = "self_attn.q_proj.bias";
inline constexpr const char* kKBias = "self_attn.k_proj.bias";
inline constexpr const char* kVBias = "self_attn.v_proj.bias";
inline constexpr const char* kQNorm = "self_attn.q_norm.weight";  // Qwen3
inline constexpr const char* kKNorm = "self_attn.k_norm.weight";
// Multi-head latent attention (DeepSeek-V2/V3).
inline constexpr const char* kQA = "self_attn.q_a_proj.weight";              // [q_lora_rank, h]
inline constexpr const char* kQANorm = "self_attn.q_a_layernorm.weight";     // [q_lora_rank]
inline constexpr const char* kQB = "self_attn.q_b_proj.weight";              // [H (nope + rope), q_lora_rank]
inline constexpr const char* kKVA = "self_attn.kv_a_proj_with_mqa.weight";   // [kv_lora_rank + rope, h]
inline constexpr const char* kKVANorm = "self_attn.kv_a_layernorm.weight";   // [kv_lora_rank]
inline constexpr const char* kKVB = "self_attn.kv_b_proj.weight";            // [H (nope + v), kv_lora_rank]
inline constexpr const char* kDenseMlp = "mlp.";  // + swiglu: a dense layer's MLP

// The names of one SwiGLU's gate, up and down matrices.
struct Swiglu {
  const char* gate;
  const char* up;
  const char* down;
};
inline constexpr Swiglu swiglu{"gate_proj.weight", "up_proj.weight", "down_proj.weight"};  // Qwen, Llama
inline constexpr Swiglu mixtral_swiglu{"w1.weight", "w3.weight", "w2.weight"};

// An MoE layer's block (prefix: layer(l)); its router, experts and shared expert (Qwen2-MoE) are named within it.
inline std::string moe_block(const std::string& prefix, bool mixtral) {
  return prefix + (mixtral ? "block_sparse_moe." : "mlp.");
}
inline constexpr const char* kRouter = "gate.weight";  // [E, h]
inline std::string expert(const std::string& block, std::int64_t e) { return fmt::format("{}experts.{}.", block, e); }
inline constexpr Swiglu expert_swiglu(bool mixtral) { return mixtral ? mixtral_swiglu : swiglu; }
inline constexpr const char* kSharedExpert = "shared_expert.";            // + swiglu
inline constexpr const char* kSharedExpertGate = "shared_expert_gate.weight";  // [1, h]
inline constexpr const char* kSharedExperts = "shared_experts.";          // + swiglu: DeepSeek's fused shared experts
inline constexpr const char* kRouterBias = "gate.e_score_correction_bias";  // [E]: DeepSeek-V3

}  // namespace paradyse::hf_names
