// paradyse/cost/from_config.hpp: the cost models' ModelShape of a model LayerConfig and a batch.
#pragma once

#include "paradyse/cost/model_shape.hpp"
#include "paradyse/contract/layer_config.hpp"

#include <cstdint>
#include <vector>

namespace paradyse::cost {

// `config` for `batch` samples of `seq` tokens (or packed samples of `packed_lengths`), activations of
// `dtype_bytes` bytes (4 on the CPU backend), `layers` layers.
inline ModelShape shape_of(const LayerConfig& config, std::int64_t batch, std::int64_t seq, int dtype_bytes = 4,
                           std::int64_t layers = 1, std::vector<std::int64_t> packed_lengths = {}) {
  config.validate();
  ModelShape m;
  m.batch = batch;
  m.seq = seq;
  m.hidden = config.hidden;
  m.heads = config.heads;
  m.kv_heads = config.kv_heads;
  m.head_dim = config.head_dim;
  m.ffn = config.ffn;
  m.layers = layers;
  m.dtype_bytes = dtype_bytes;
  m.swiglu = config.activation == Activation::swiglu;
  m.causal = config.causal;
  m.zigzag = config.zigzag;
  m.rope = config.rope;
  m.packed_lengths = std::move(packed_lengths);
  return m;
}

}  // namespace paradyse::cost
