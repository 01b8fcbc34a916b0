// paradyse/serve/decoder_weights.hpp: the whole float32 weights of a Hugging Face MoE decoder, loaded and validated.
//
// Names follow each family's convention (serve/hf_config.hpp); every tensor's shape is checked against the config
// and a missing one is named. Layouts (y = x W^T for a [out, in] weight, as Hugging Face stores them):
//   wq [H d, h], wk, wv [KV d, h] (+ biases), wo_t [H d, h] (o_proj transposed: out = attn wo_t),
//   q_norm [H d], k_norm [KV d] (OLMoE) or [d] (Qwen3-MoE: per head), dense SwiGLU as an ExpertBank of one: in [1, 2F, h] (gate rows, then up
//   rows), out [1, F, h] (down_proj transposed), and the MoE sublayer as a one-rank MoeShard (moe/moe_config.hpp).
// MLA (DeepSeek): wq = q_proj or q_b_proj [H (nope + rope), h or q_lora_rank], wq_a [q_lora_rank, h], q_a_norm,
//   wkv_a [kv_lora_rank + rope, h], kv_a_norm [kv_lora_rank], wkv_b [H (nope + v), kv_lora_rank], wo_t [H v, h];
//   DeepSeek-V3's router bias (e_score_correction_bias) [E].
#pragma once

#include "paradyse/core/tensor.hpp"
#include "paradyse/model/hf_names.hpp"
#include "paradyse/moe/moe_config.hpp"
#include "paradyse/serve/hf_checkpoint.hpp"
#include "paradyse/serve/hf_config.hpp"

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace paradyse::serve {

struct DecoderLayerWeights {
  Tensor<float> attn_norm, ffn_norm;  // [h]
  Tensor<float> wq, wk, wv;           // [H d, h], [KV d, h], [KV d, h]
  Tensor<float> bq, bk, bv;           // [H d], [KV d], [KV d] (empty without biases)
  Tensor<float> q_norm, k_norm;       // [H d], [KV d] (OLMoE) or [d], [d] (Qwen3-MoE); empty without q/k norms
  Tensor<float> wo_t;                 // [H d, h] (MLA: [H v, h])
  Tensor<float> wq_a, q_a_norm, wkv_a, kv_a_norm, wkv_b;  // MLA (empty otherwise)
  Tensor<float> router_bias;          // [E]: noaux_tc's e_score_correction_bias (empty otherwise)
  Tensor<float> dense_in, dense_out;  // [1, 2F, h], [1, F, h] (dense layers)
  MoeShard moe;                       // one rank's MoeShard holding every expert (MoE layers)
};

struct DecoderWeights {
  Tensor<float> embed;    // [V, h]
  Tensor<float> norm;     // [h]
  Tensor<float> lm_head;  // [V, h]
  std::vector<DecoderLayerWeights> layers;
};

struct LoadedDecoder {
  DecoderConfig config;
  DecoderWeights weights;
};

namespace weights_detail {

// rows [0, a) of `first` then [0, b) of `second` into one [a + b, cols] (gate then up).
inline void stack_rows(TensorView<const float> first, TensorView<const float> second, TensorView<float> out) {
  copy(first, out.slice(0, 0, first.extent(0)));
  copy(second, out.slice(0, first.extent(0), second.extent(0)));
}
// out [cols, rows] = in [rows, cols]^T.
inline void transpose_into(TensorView<const float> in, TensorView<float> out) {
  for (std::int64_t i = 0; i < in.extent(0); ++i)
    for (std::int64_t j = 0; j < in.extent(1); ++j) out(j, i) = in(i, j);
}
// A SwiGLU of width f from gate/up [f, h] and down [h, f] (named `prefix` + names) into in [2f, h] and out [f, h].
inline void load_swiglu(const HfCheckpoint& ck, const std::string& prefix, const hf_names::Swiglu& names,
                        std::int64_t f, std::int64_t h, TensorView<float> in, TensorView<float> out) {
  const Tensor<float> g = ck.load(prefix + names.gate, Shape{f, h}), u = ck.load(prefix + names.up, Shape{f, h}),
                      d = ck.load(prefix + names.down, Shape{h, f});
  stack_rows(g.view(), u.view(), in);
  transpose_into(d.view(), out);
}

}  // namespace weights_detail

inline DecoderWeights load_decoder_weights(const DecoderConfig& c, const HfCheckpoint& ck) {
  using namespace weights_detail;
  const std::int64_t h = c.hidden, qw = c.q_width(), kw = c.kv_width(), V = c.vocab;
  DecoderWeights w;
  w.embed = ck.load(hf_names::kEmbedding, Shape{V, h});
  w.norm = ck.load(hf_names::kFinalNorm, Shape{h});
  if (c.tied_embeddings) {  // lm_head is the embedding; a file that also holds lm_head must hold the same tensor
    w.lm_head = Tensor<float>::copy_of(w.embed.view());
    if (ck.has(hf_names::kLmHead)) {
      const Tensor<float> stored = ck.load(hf_names::kLmHead, Shape{V, h});
      check(std::equal(stored.span().begin(), stored.span().end(), w.embed.span().begin()),
            "hf checkpoint {}: config.json says tie_word_embeddings = true, but \"{}\" differs from \"{}\"; expected "
            "no {} (tied) or tie_word_embeddings = false (untied)",
            ck.folder(), hf_names::kLmHead, hf_names::kEmbedding, hf_names::kLmHead);
    }
  } else {
    w.lm_head = ck.load(hf_names::kLmHead, Shape{V, h});
  }
  for (std::int64_t l = 0; l < c.layers; ++l) {
    const std::string p = hf_names::layer(l);
    DecoderLayerWeights L;
    L.attn_norm = ck.load(p + hf_names::kInputNorm, Shape{h});
    L.ffn_norm = ck.load(p + hf_names::kPostAttentionNorm, Shape{h});
    if (c.is_mla()) {
      const MlaShape& a = c.mla;
      if (a.q_lora_rank > 0) {
        L.wq_a = ck.load(p + hf_names::kQA, Shape{a.q_lora_rank, h});
        L.q_a_norm = ck.load(p + hf_names::kQANorm, Shape{a.q_lora_rank});
        L.wq = ck.load(p + hf_names::kQB, Shape{qw, a.q_lora_rank});
      } else {
        L.wq = ck.load(p + hf_names::kQ, Shape{qw, h});
      }
      L.wkv_a = ck.load(p + hf_names::kKVA, Shape{a.kv_lora_rank + a.rope, h});
      L.kv_a_norm = ck.load(p + hf_names::kKVANorm, Shape{a.kv_lora_rank});
      L.wkv_b = ck.load(p + hf_names::kKVB, Shape{c.heads * (a.nope + a.v), a.kv_lora_rank});
    } else {
      L.wq = ck.load(p + hf_names::kQ, Shape{qw, h});
      L.wk = ck.load(p + hf_names::kK, Shape{kw, h});
      L.wv = ck.load(p + hf_names::kV, Shape{kw, h});
    }
    {
      const std::int64_t ow = c.heads * c.value_dim();
      const Tensor<float> wo = ck.load(p + hf_names::kO, Shape{h, ow});
      L.wo_t = Tensor<float>(Shape{ow, h});
      transpose_into(wo.view(), L.wo_t.view());
    }
    if (c.qkv_bias) {
      L.bq = ck.load(p + hf_names::kQBias, Shape{qw});
      L.bk = ck.load(p + hf_names::kKBias, Shape{kw});
      L.bv = ck.load(p + hf_names::kVBias, Shape{kw});
    }
    if (c.qk_norm) {
      L.q_norm = ck.load(p + hf_names::kQNorm, Shape{qw});
      L.k_norm = ck.load(p + hf_names::kKNorm, Shape{kw});
    }
    if (c.head_qk_norm) {
      L.q_norm = ck.load(p + hf_names::kQNorm, Shape{c.head_dim});
      L.k_norm = ck.load(p + hf_names::kKNorm, Shape{c.head_dim});
    }
    if (!c.is_moe(l)) {
      const std::int64_t F = c.dense_ffn;
      ck.check_shape(p + hf_names::kDenseMlp + hf_names::swiglu.gate, Shape{F, h});  // before F x h buffers
      L.dense_in = Tensor<float>(Shape{1, 2 * F, h});
      L.dense_out = Tensor<float>(Shape{1, F, h});
      load_swiglu(ck, p + hf_names::kDenseMlp, hf_names::swiglu, F, h,
                  L.dense_in.view().reshape(Shape{2 * F, h}), L.dense_out.view().reshape(Shape{F, h}));
    } else {
      const MoeConfig& m = c.moe;
      const std::int64_t E = m.experts, f = m.expert_ffn;
      const bool mixtral = c.family == Family::mixtral;
      const std::string block = hf_names::moe_block(p, mixtral);
      const bool deepseek = c.is_mla();  // DeepSeek's shared experts: "shared_experts.", Qwen2-MoE's "shared_expert."
      const std::string shared = block + (deepseek ? hf_names::kSharedExperts : hf_names::kSharedExpert);
      // The shapes that size the experts' buffers (E x 3f x h, the shared experts') are checked against the file
      // before they are allocated: a corrupt num_local_experts of 10^6 allocated 4 GB, then failed.
      ck.check_shape(block + hf_names::kRouter, Shape{E, h});
      ck.check_shape(hf_names::expert(block, 0) + hf_names::expert_swiglu(mixtral).gate, Shape{f, h});
      if (m.has_shared())
        ck.check_shape(shared + hf_names::swiglu.gate, Shape{m.shared_width(), h});
      L.moe = MoeShard::zeros(m, 1, 0);
      L.moe.router = ck.load(block + hf_names::kRouter, Shape{E, h});
      if (m.topk_method == TopkMethod::noaux_tc) L.router_bias = ck.load(block + hf_names::kRouterBias, Shape{E});
      for (std::int64_t e = 0; e < E; ++e) {
        const std::string x = hf_names::expert(block, e);
        const TensorView<float> in = L.moe.expert_in.view().slice(0, e, 1).reshape(Shape{2 * f, h});
        const TensorView<float> out = L.moe.expert_out.view().slice(0, e, 1).reshape(Shape{f, h});
        load_swiglu(ck, x, hf_names::expert_swiglu(mixtral), f, h, in, out);
      }
      if (m.has_shared()) {
        const std::int64_t fs = m.shared_width();
        load_swiglu(ck, shared, hf_names::swiglu, fs, h,
                    L.moe.shared_in.view(), L.moe.shared_out.view());
        if (m.shared_gate) L.moe.shared_gate = ck.load(block + hf_names::kSharedExpertGate, Shape{1, h});
      }
    }
    w.layers.push_back(std::move(L));
  }
  // Every tensor of the file must be one this configuration computes with: a config with fewer layers than the file,
  // or without the biases or norms it holds, would serve a different model than the one saved.
  const std::vector<std::string> extra = ck.unused();
  if (!extra.empty()) {
    std::string some;
    for (std::size_t i = 0; i < std::min<std::size_t>(extra.size(), 4); ++i) some += (i ? ", \"" : "\"") + extra[i] + "\"";
    throw Error(fmt::format("hf checkpoint {}: {} tensor(s) that config.json ({} layers, {}) does not use: {}{}; "
                            "expected the config the weights were saved with",
                            ck.folder(), extra.size(), c.layers, name_of(c.family), some,
                            extra.size() > 4 ? ", ..." : ""));
  }
  return w;
}

// config.json and the weights of a Hugging Face model folder.
inline LoadedDecoder load_decoder(const std::string& folder) {
  LoadedDecoder d;
  d.config = read_decoder_config(folder);
  const HfCheckpoint ck(folder);
  d.weights = load_decoder_weights(d.config, ck);
  return d;
}

}  // namespace paradyse::serve
