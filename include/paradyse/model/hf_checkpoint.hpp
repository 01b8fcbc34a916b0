// paradyse/model/hf_checkpoint.hpp: an MoE GPT (model/gpt.hpp with GptConfig::moe) saved as a Hugging Face model
// folder: model.safetensors (float32) and config.json, named as Mixtral's, or as Qwen2-MoE's when the model has
// shared experts or dense layers before its MoE layers, so that the inference engine (serve/) and other tools load it.
//
// Tensor names (l: layer, e: expert; [rows, columns] as stored, y = x W^T):
//   model.embed_tokens.weight [V, h], model.norm.weight [h], lm_head.weight [V, h] (absent when tied)
//   model.layers.l.input_layernorm.weight [h], model.layers.l.post_attention_layernorm.weight [h]
//   model.layers.l.self_attn.{q,k,v}_proj.weight [heads d | kv d, h], o_proj.weight [h, heads d]
//   Qwen2-MoE only: model.layers.l.self_attn.{q,k,v}_proj.bias (zeros: this model has no attention biases)
//   Mixtral MoE:    model.layers.l.block_sparse_moe.gate.weight [E, h],
//                   ...block_sparse_moe.experts.e.w1.weight [f, h] (gate), w3 [f, h] (up), w2 [h, f] (down)
//   Qwen2-MoE MoE:  model.layers.l.mlp.gate.weight [E, h], mlp.experts.e.{gate,up}_proj.weight [f, h],
//                   down_proj [h, f]; mlp.shared_expert.{gate,up,down}_proj (the shared experts fused, width
//                   shared_experts x shared_ffn), mlp.shared_expert_gate.weight [1, h]
//   Qwen2-MoE dense (the first_k_dense layers, listed in mlp_only_layers): mlp.{gate,up,down}_proj.
// What the formats cannot express is refused with the value named: LayerNorm (they are RMSNorm), no RoPE, a GELU
// MLP, a non-causal model, sigmoid scoring, a routed scaling factor, Mixtral without renormalised top-k, shared
// experts without the sigmoid gate (Qwen2-MoE gates them always).
//
// Both files are written atomically (a temporary renamed over the destination): an interrupted save leaves the
// previous files. Collective: every rank of the model's group calls it; rank 0 writes.
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/core/json.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/contract/layer_config.hpp"
#include "paradyse/contract/weight_shards.hpp"
#include "paradyse/model/checkpoint.hpp"
#include "paradyse/model/gpt.hpp"
#include "paradyse/model/hf_names.hpp"
#include "paradyse/model/safetensors.hpp"
#include "paradyse/moe/moe_config.hpp"
#include "paradyse/moe/moe_weights.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

namespace paradyse {

enum class HfMoeFamily { mixtral, qwen2_moe };

// Mixtral unless the model has shared experts or dense layers (then Qwen2-MoE).
inline HfMoeFamily hf_family_of(const GptConfig& c) {
  check(c.moe.has_value(), "hf checkpoint: the model has no MoE layers (GptConfig::moe is empty)");
  return c.moe->moe.has_shared() || c.moe->first_k_dense > 0 ? HfMoeFamily::qwen2_moe : HfMoeFamily::mixtral;
}

// Throws unless the Hugging Face formats can express `c`, naming what they cannot.
inline void check_hf_exportable(const GptConfig& c) {
  c.validate();
  const HfMoeFamily family = hf_family_of(c);
  const LayerConfig& l = c.layer;
  const MoeConfig& m = c.moe->moe;
  check(l.norm == NormKind::rms_norm, "hf checkpoint: the model uses LayerNorm; Mixtral and Qwen2-MoE use RMSNorm");
  check(l.rope, "hf checkpoint: the model has no RoPE; Mixtral and Qwen2-MoE use rotary positions");
  check(l.activation == Activation::swiglu, "hf checkpoint: the dense MLP is GELU; Qwen2-MoE's is SwiGLU");
  check(l.causal, "hf checkpoint: the model is not causal; Mixtral and Qwen2-MoE are decoders");
  check(m.scoring == RouterScoring::softmax, "hf checkpoint: the router scores by sigmoid; Mixtral and Qwen2-MoE by softmax");
  check(m.routed_scaling_factor == 1.0, "hf checkpoint: routed_scaling_factor = {}; the formats have none",
        m.routed_scaling_factor);
  check(family != HfMoeFamily::mixtral || m.norm_topk_prob,
        "hf checkpoint: Mixtral renormalises the top-k weights; the model has norm_topk_prob = false");
  check(!m.has_shared() || m.shared_gate,
        "hf checkpoint: {} shared experts without the sigmoid gate; Qwen2-MoE gates its shared expert", m.shared_experts);
}

// config.json for `c` (max_positions: the longest sequence it is meant for).
inline std::string hf_config_json(const GptConfig& c, std::int64_t max_positions) {
  check_hf_exportable(c);
  const LayerConfig& l = c.layer;
  const MoeConfig& m = c.moe->moe;
  const bool mixtral = hf_family_of(c) == HfMoeFamily::mixtral;
  json::Value v = {{"architectures", json::Value::array({mixtral ? "MixtralForCausalLM" : "Qwen2MoeForCausalLM"})},
                   {"model_type", mixtral ? "mixtral" : "qwen2_moe"},
                   {"vocab_size", c.vocab},
                   {"hidden_size", l.hidden},
                   {"num_hidden_layers", c.layers},
                   {"num_attention_heads", l.heads},
                   {"num_key_value_heads", l.kv_heads},
                   {"head_dim", l.head_dim},
                   {"hidden_act", "silu"},
                   {"max_position_embeddings", max_positions},
                   {"rms_norm_eps", l.norm_eps},
                   {"rope_theta", l.rope_base},
                   {"tie_word_embeddings", c.tied_head},
                   {"attention_dropout", 0.0},
                   {"initializer_range", 0.02},
                   {"torch_dtype", "float32"},
                   {"num_experts_per_tok", m.top_k},
                   // In Hugging Face's convention (its aux is top-k times this library's default one, see
                   // MoeConfig::aux_scaling), so that training it in transformers weighs the loss the same.
                   {"router_aux_loss_coef", m.aux_scaling == AuxLossScaling::per_token_hf
                                                ? m.aux_loss_coef
                                                : m.aux_loss_coef / double(m.top_k)},
                   {"output_router_logits", false}};
  if (mixtral) {
    v["num_local_experts"] = m.experts;
    v["intermediate_size"] = m.expert_ffn;
    v["sliding_window"] = nullptr;
  } else {
    v["num_experts"] = m.experts;
    v["moe_intermediate_size"] = m.expert_ffn;
    v["intermediate_size"] = l.ffn;
    v["shared_expert_intermediate_size"] = m.shared_width();
    v["norm_topk_prob"] = m.norm_topk_prob;
    v["decoder_sparse_step"] = 1;
    std::vector<int> dense;
    for (int i = 0; i < c.moe->first_k_dense; ++i) dense.push_back(i);
    v["mlp_only_layers"] = dense;
    v["use_sliding_window"] = false;
    v["qkv_bias"] = true;
  }
  return json::dump(v) + "\n";
}

namespace hf_detail {

// One named tensor to write: [rows, cols] float32.
struct Named {
  std::string name;
  std::vector<std::int64_t> shape;
  std::vector<float> data;
};

inline std::vector<float> rows_of(const float* from, std::int64_t count) { return {from, from + count}; }
// [cols, rows] of a row-major [rows, cols] block.
inline std::vector<float> transposed(const float* from, std::int64_t rows, std::int64_t cols) {
  std::vector<float> out(static_cast<std::size_t>(rows * cols));
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) out[std::size_t(c * rows + r)] = from[r * cols + c];
  return out;
}

// One layer's global MoE weights, and its attention and norms, gathered from every rank's shards (the gathers
// model/checkpoint.hpp's training checkpoints use too).
using checkpoint_detail::gather_attention;
using checkpoint_detail::gather_moe;

// Writes `content` to `path` atomically.
inline void write_text_atomically(const std::string& path, const std::string& content) {
  safetensors::AtomicFile out(path);
  out.file().write_at(content.data(), std::int64_t(content.size()), 0);
  out.commit();
}

}  // namespace hf_detail

// Writes `model` to the folder `folder` (created if missing) as model.safetensors and config.json. Collective.
template <class Strategies, class Backend, Communicator C>
void save_hf_checkpoint(C& comm, Gpt<Strategies, Backend>& model, const std::string& folder,
                        std::int64_t max_positions) {
  using hf_detail::Named;
  const GptConfig& c = model.config();
  check_hf_exportable(c);
  check(max_positions >= 1, "hf checkpoint: max_positions = {} must be positive", max_positions);
  const bool writer = comm.rank() == 0, mixtral = hf_family_of(c) == HfMoeFamily::mixtral;
  const LayerConfig& l = c.layer;
  const MoeConfig& m = c.moe->moe;
  const std::int64_t h = l.hidden, v = c.vocab, qw = l.q_width(), kw = l.kv_width();
  std::vector<Named> tensors;
  auto add = [&](std::string name, std::vector<std::int64_t> shape, std::vector<float> data) {
    if (writer) tensors.push_back({std::move(name), std::move(shape), std::move(data)});
  };
  const Tensor<float>& pack = model.replicated();
  add(hf_names::kEmbedding, {v, h}, hf_detail::rows_of(pack.data(), v * h));
  for (int layer = 0; layer < c.layers; ++layer) {
    const std::string p = hf_names::layer(layer);
    const GlobalLayerWeights<float> g = hf_detail::gather_attention(comm, l, model.stack().weights()[std::size_t(layer)]);
    add(p + hf_names::kInputNorm, {h}, hf_detail::rows_of(g.norm1_gamma.data(), h));
    add(p + hf_names::kPostAttentionNorm, {h}, hf_detail::rows_of(g.norm2_gamma.data(), h));
    add(p + hf_names::kQ, {qw, h}, hf_detail::rows_of(g.w_q.data(), qw * h));
    add(p + hf_names::kK, {kw, h}, hf_detail::rows_of(g.w_k.data(), kw * h));
    add(p + hf_names::kV, {kw, h}, hf_detail::rows_of(g.w_v.data(), kw * h));
    add(p + hf_names::kO, {h, qw}, hf_detail::transposed(g.w_proj.data(), qw, h));
    if (!mixtral) {
      add(p + hf_names::kQBias, {qw}, std::vector<float>(static_cast<std::size_t>(qw), 0.0f));
      add(p + hf_names::kKBias, {kw}, std::vector<float>(static_cast<std::size_t>(kw), 0.0f));
      add(p + hf_names::kVBias, {kw}, std::vector<float>(static_cast<std::size_t>(kw), 0.0f));
    }
    if (!c.is_moe_layer(layer)) {
      const std::int64_t f = l.ffn;
      const std::string mlp = p + hf_names::kDenseMlp;
      add(mlp + hf_names::swiglu.gate, {f, h}, hf_detail::rows_of(g.w_in.data(), f * h));
      add(mlp + hf_names::swiglu.up, {f, h}, hf_detail::rows_of(g.w_up.data(), f * h));
      add(mlp + hf_names::swiglu.down, {h, f}, hf_detail::transposed(g.w_out.data(), f, h));
      continue;
    }
    const GlobalMoeWeights<float> e = hf_detail::gather_moe(comm, m, model.stack().moe_weights()[std::size_t(layer)]);
    const std::string block = hf_names::moe_block(p, mixtral);
    const std::int64_t f = m.expert_ffn;
    add(block + hf_names::kRouter, {m.experts, h}, hf_detail::rows_of(e.router.data(), m.experts * h));
    for (std::int64_t x = 0; x < m.experts; ++x) {
      const std::string at = hf_names::expert(block, x);
      const hf_names::Swiglu names = hf_names::expert_swiglu(mixtral);
      const float* in = e.expert_in.data() + x * 2 * f * h;
      const float* out = e.expert_out.data() + x * f * h;
      add(at + names.gate, {f, h}, hf_detail::rows_of(in, f * h));
      add(at + names.up, {f, h}, hf_detail::rows_of(in + f * h, f * h));
      add(at + names.down, {h, f}, hf_detail::transposed(out, f, h));
    }
    if (m.has_shared()) {
      const std::int64_t fs = m.shared_width();
      const std::string s = block + hf_names::kSharedExpert;
      add(s + hf_names::swiglu.gate, {fs, h}, hf_detail::rows_of(e.shared_in.data(), fs * h));
      add(s + hf_names::swiglu.up, {fs, h}, hf_detail::rows_of(e.shared_in.data() + fs * h, fs * h));
      add(s + hf_names::swiglu.down, {h, fs}, hf_detail::transposed(e.shared_out.data(), fs, h));
      add(block + hf_names::kSharedExpertGate, {1, h}, hf_detail::rows_of(e.shared_gate.data(), h));
    }
  }
  const std::int64_t final_row = c.replicated_rows() - 2;
  add(hf_names::kFinalNorm, {h}, hf_detail::rows_of(pack.data() + final_row * h, h));
  if (!c.tied_head) add(hf_names::kLmHead, {v, h}, hf_detail::rows_of(pack.data() + v * h, v * h));
  if (writer) {
    std::filesystem::create_directories(folder);
    std::vector<safetensors::TensorEntry> entries;
    for (const Named& t : tensors) entries.push_back({t.name, "F32", t.shape, 0, 0});
    const std::string header = safetensors::encode_header(entries, {{"format", "pt"}});
    safetensors::AtomicFile out((std::filesystem::path(folder) / "model.safetensors").string());
    out.file().write_at(header.data(), std::int64_t(header.size()), 0);
    for (std::size_t i = 0; i < tensors.size(); ++i)
      out.file().write_at(tensors[i].data.data(), std::int64_t(tensors[i].data.size() * sizeof(float)),
                          std::int64_t(header.size()) + entries[i].begin);
    out.commit();
    hf_detail::write_text_atomically((std::filesystem::path(folder) / "config.json").string(), hf_config_json(c, max_positions));
  }
  comm.barrier();  // the files exist for every rank once this returns
}

}  // namespace paradyse
