// tests/plan/small_gpt.hpp: the small GPT the planner's tests price: `layers` causal zigzag layers of h = hidden in
// 4 heads (LayerConfig::make), `ffn` columns, a vocabulary of `vocab`; with_moe makes its layers after the first MoE.
// Each test adds what it varies (RoPE, ...).
#pragma once

#include "paradyse/model/gpt.hpp"

#include <cstdint>

namespace paradyse::testing {

inline GptConfig small_gpt(std::int64_t hidden, std::int64_t ffn, int layers, std::int64_t vocab) {
  GptConfig c;
  c.layer = LayerConfig::make(hidden, 4);
  c.layer.ffn = ffn;
  c.layer.causal = c.layer.zigzag = true;
  c.layers = layers;
  c.vocab = vocab;
  return c;
}

// c with every layer after the first an MoE layer of 4 experts of 32 columns, top-2.
inline GptConfig with_moe(GptConfig c) {
  MoeConfig m;
  m.hidden = c.layer.hidden;
  m.experts = 4;
  m.top_k = 2;
  m.expert_ffn = 32;
  c.moe = MoeLayers{m, 1};
  return c;
}

}  // namespace paradyse::testing
