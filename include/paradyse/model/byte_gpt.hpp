// paradyse/model/byte_gpt.hpp: the byte-level GPTs train_gpt trains (vocab 256, causal, zigzag tokens, RoPE): the
// dense one (LayerNorm, GELU MLP) and the MoE one (RMSNorm, SwiGLU, experts of width ffn / top-k so that the active
// FFN width is the dense one's, shared experts of the same width behind a sigmoid gate as Qwen2-MoE's, softmax
// routing with renormalised top-k weights).
#pragma once

#include "paradyse/contract/layer_config.hpp"
#include "paradyse/model/gpt.hpp"
#include "paradyse/moe/moe_config.hpp"

#include <algorithm>
#include <cstdint>

namespace paradyse {

// The shape of a byte-level GPT.
struct ByteGptShape {
  int layers = 4;
  std::int64_t hidden = 128;
  std::int64_t heads = 4;
  // The MoE GPT only.
  std::int64_t experts = 0;         // > 0: experts per MoE layer
  std::int64_t top_k = 2;           // experts per token
  std::int64_t shared_experts = 0;  // shared experts behind a sigmoid gate
  int first_dense = 0;              // the first this many layers dense
  double aux_loss_coef = 0.01;      // the router's load-balancing loss coefficient, Switch convention (f_i per
                                    // assignment, MoeConfig::aux_scaling): a Hugging Face value times top-k
  double z_loss_coef = 0.001;       // the router's z-loss coefficient
};

// The dense byte-level GPT: causal, zigzag tokens (causal ring attention balanced over the ranks), RoPE.
inline GptConfig byte_gpt_config(const ByteGptShape& s) {
  GptConfig config;
  config.layer = LayerConfig::make(s.hidden, s.heads);
  config.layer.causal = true;
  config.layer.zigzag = true;
  config.layer.rope = true;
  config.layers = s.layers;
  config.vocab = 256;
  return config;
}

// The MoE byte-level GPT (train_gpt --experts).
inline GptConfig moe_gpt_config(const ByteGptShape& s) {
  GptConfig config = byte_gpt_config(s);
  config.layer.norm = NormKind::rms_norm;
  config.layer.activation = Activation::swiglu;
  MoeConfig m;
  m.hidden = s.hidden;
  m.experts = s.experts;
  m.top_k = s.top_k;
  m.expert_ffn = std::max<std::int64_t>(1, config.layer.ffn / s.top_k);
  m.norm_topk_prob = true;
  m.shared_experts = s.shared_experts;
  m.shared_ffn = s.shared_experts > 0 ? m.expert_ffn : 0;
  m.shared_gate = s.shared_experts > 0;
  m.aux_loss_coef = s.aux_loss_coef;
  m.z_loss_coef = s.z_loss_coef;
  config.moe = MoeLayers{m, s.first_dense};
  return config;
}

}  // namespace paradyse
