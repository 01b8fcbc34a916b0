// paradyse/strategy/mlp_activation.hpp: the MLP activation applied to one shard's block of the pre-activation,
// following the MLP shard packing (contract/weight_shards.hpp): GELU's block is [m, f/p]; SwiGLU's is [m, 2f/p] = the gate
// columns, then the up columns, of the same f/p ffn columns. Blocks may be column slices of a wider matrix.
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/contract/layer_config.hpp"

#include <algorithm>
#include <cstdint>

namespace paradyse {

// act: [m, f/p] (overwritten) = activation(pre: [m, ffn_in_rows]).
template <class Backend>
void shard_activation_forward(const ShardGeometry& g, TensorView<const float> pre, TensorView<float> act) {
  check(pre.rank() == 2 && pre.extent(1) == g.ffn_in_rows && act.shape() == Shape{pre.extent(0), g.ffn},
        "shard_activation_forward: pre {} must be [m, {}] and act {} [m, {}]", pre.shape(), g.ffn_in_rows, act.shape(), g.ffn);
  if (!g.swiglu) {
    Backend::gelu_forward(pre, act);
    return;
  }
  Backend::swiglu_forward(pre.slice(1, 0, g.ffn), pre.slice(1, g.ffn, g.ffn), act);
}

// dpre: [m, ffn_in_rows] (overwritten) = the activation's backward of dact: [m, f/p] at pre.
template <class Backend>
void shard_activation_backward(const ShardGeometry& g, TensorView<const float> pre, TensorView<const float> dact,
                               TensorView<float> dpre) {
  check(dpre.shape() == pre.shape() && dact.shape() == Shape{pre.extent(0), g.ffn},
        "shard_activation_backward: dpre {} must match pre {}, dact {} must be [m, {}]", dpre.shape(), pre.shape(),
        dact.shape(), g.ffn);
  Backend::fill(dpre, 0.0f);  // the ops accumulate
  if (!g.swiglu) {
    Backend::gelu_backward(pre, dact, dpre);
    return;
  }
  Backend::swiglu_backward(pre.slice(1, 0, g.ffn), pre.slice(1, g.ffn, g.ffn), dact, dpre.slice(1, 0, g.ffn),
                           dpre.slice(1, g.ffn, g.ffn));
}

}  // namespace paradyse
