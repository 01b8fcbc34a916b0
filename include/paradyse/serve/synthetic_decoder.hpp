// paradyse/serve/synthetic_decoder.hpp: a decoder of any shape with seeded random weights, for benchmarks and for
// serving runs without a checkpoint.
//
// Matrices are N(0, 1/fan_in) (the embedding N(0, 1)), norms 1; the router of an MoE layer may be skewed: expert e's
// router row is scaled by (1 + skew)^(-e), so low-numbered experts win more often (skew 0: about uniform).
#pragma once

#include "paradyse/core/rng.hpp"
#include "paradyse/serve/decoder_weights.hpp"

#include <cmath>
#include <cstdint>
#include <string_view>

#include <unistd.h>

namespace paradyse::serve {

// A Mixtral-style config: every layer MoE, softmax top-k renormalised, GQA.
inline DecoderConfig synthetic_config(std::int64_t hidden, std::int64_t layers, std::int64_t heads,
                                      std::int64_t kv_heads, std::int64_t experts, std::int64_t top_k,
                                      std::int64_t expert_ffn, std::int64_t vocab) {
  DecoderConfig c;
  c.family = Family::mixtral;
  c.vocab = vocab;
  c.hidden = hidden;
  c.layers = layers;
  c.heads = heads;
  c.kv_heads = kv_heads;
  check(heads >= 1 && hidden % heads == 0, "synthetic_config: hidden {} is not a multiple of {} heads", hidden, heads);
  c.head_dim = hidden / heads;
  c.rms_eps = 1e-5;
  c.moe_layer.assign(std::size_t(layers), true);
  c.moe.hidden = hidden;
  c.moe.experts = experts;
  c.moe.top_k = top_k;
  c.moe.expert_ffn = expert_ffn;
  c.moe.norm_topk_prob = true;
  c.validate();
  return c;
}

// Bytes of the float32 weights of a decoder of config `c` (embedding, lm_head, attention, experts, dense MLPs).
inline double decoder_weight_bytes(const DecoderConfig& c) {
  const double h = double(c.hidden), qw = double(c.q_width()), kw = double(c.kv_width());
  double per_layer = 2 * h + qw * h * 2 + kw * h * 2;  // norms, q and o, k and v
  double total = 2 * double(c.vocab) * h + h;
  for (std::int64_t l = 0; l < c.layers; ++l) {
    const MoeConfig& m = c.moe;
    total += per_layer + (c.is_moe(l) ? double(m.experts) * (3 * double(m.expert_ffn) * h + h) +
                                            3 * double(m.shared_width()) * h
                                      : 3 * double(c.dense_ffn) * h);
  }
  return 4 * total;
}

// Throws, before any weight is made, unless `copies` copies of the weights of `c` fit in this machine's memory
// (sysconf): the programs hold the model and its rank shards. `flags` names what sets the size, for the message.
inline void check_fits_host(const DecoderConfig& c, double copies, std::string_view flags) {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGE_SIZE);
  if (pages <= 0 || page <= 0) return;  // unknown: nothing to compare with
  const double have = double(pages) * double(page), need = copies * decoder_weight_bytes(c);
  check(need <= have,
        "the model ({} layers, hidden {}, {} experts of width {}) needs {:.4g} GiB ({:g} copies of {:.4g} GiB of "
        "float32 weights: the model and its rank shards), this machine has {:.4g} GiB; lower {}",
        c.layers, c.hidden, c.moe.experts, c.moe.expert_ffn, need / 1073741824.0, copies,
        decoder_weight_bytes(c) / 1073741824.0, have / 1073741824.0, flags);
}

inline LoadedDecoder synthetic_decoder(const DecoderConfig& c, std::uint64_t seed, double router_skew = 0) {
  Rng rng(seed);
  auto fill = [&](Tensor<float>& t, double scale) {
    for (float& x : t.span()) x = float(scale * rng.normal());
  };
  const std::int64_t h = c.hidden, qw = c.q_width(), kw = c.kv_width();
  LoadedDecoder d;
  d.config = c;
  DecoderWeights& w = d.weights;
  w.embed = Tensor<float>(Shape{c.vocab, h});
  fill(w.embed, 1.0);
  w.norm = Tensor<float>(Shape{h});
  w.norm.fill(1.0f);
  w.lm_head = Tensor<float>(Shape{c.vocab, h});
  fill(w.lm_head, 1.0 / std::sqrt(double(h)));
  for (std::int64_t l = 0; l < c.layers; ++l) {
    DecoderLayerWeights L;
    L.attn_norm = Tensor<float>(Shape{h});
    L.attn_norm.fill(1.0f);
    L.ffn_norm = Tensor<float>(Shape{h});
    L.ffn_norm.fill(1.0f);
    L.wq = Tensor<float>(Shape{qw, h});
    L.wk = Tensor<float>(Shape{kw, h});
    L.wv = Tensor<float>(Shape{kw, h});
    L.wo_t = Tensor<float>(Shape{qw, h});
    for (Tensor<float>* t : {&L.wq, &L.wk, &L.wv}) fill(*t, 1.0 / std::sqrt(double(h)));
    fill(L.wo_t, 1.0 / std::sqrt(double(qw)));
    if (c.is_moe(l)) {
      const MoeConfig& m = c.moe;
      L.moe = MoeShard::zeros(m, 1, 0);
      fill(L.moe.router, 1.0 / std::sqrt(double(h)));
      for (std::int64_t e = 0; e < m.experts; ++e) {
        const float scale = float(std::pow(1.0 + router_skew, -double(e)));
        for (std::int64_t j = 0; j < h; ++j) L.moe.router(e, j) *= scale;
      }
      fill(L.moe.expert_in, 1.0 / std::sqrt(double(h)));
      fill(L.moe.expert_out, 1.0 / std::sqrt(double(m.expert_ffn)));
    } else {
      L.dense_in = Tensor<float>(Shape{1, 2 * c.dense_ffn, h});
      L.dense_out = Tensor<float>(Shape{1, c.dense_ffn, h});
      fill(L.dense_in, 1.0 / std::sqrt(double(h)));
      fill(L.dense_out, 1.0 / std::sqrt(double(c.dense_ffn)));
    }
    w.layers.push_back(std::move(L));
  }
  return d;
}

}  // namespace paradyse::serve
