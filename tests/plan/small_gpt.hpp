// tests/plan/small_gpt.hpp: the small GPT the planner's tests price: `layers` causal zigzag layers of h = hidden in
// 4 heads (LayerConfig::make), `ffn` columns, a vocabulary of `vocab`; each test adds what it varies (RoPE, MoE).
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

}  // namespace paradyse::testing
