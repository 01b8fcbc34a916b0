// paradyse/model/adamw.hpp: the one AdamW driver of the models: every optimizer of the library (Gpt::optimizer_step,
// model/data_parallel.hpp's DataParallelOptimizer, model/mesh_optimizer.hpp's MeshOptimizer) steps its tensors here.
//
//   adamw_update<Backend>(tensors, adamw, step);   // each tensor: value, gradient, moments m and v, decays or not
//
// The rule of the models: weight decay on matrices (decays = true), none on norms and other vectors (decays = false:
// the same step with weight_decay 0). Elementwise, so a tensor cut into chunks (ZeRO) takes the same values.
#pragma once

#include "paradyse/core/tensor.hpp"
#include "paradyse/ops/backend.hpp"

#include <cstdint>
#include <span>

namespace paradyse {

// One tensor of an AdamW step: its value, gradient and moments, all of one shape.
struct AdamWTensor {
  TensorView<float> value;
  TensorView<const float> gradient;
  TensorView<float> m, v;
  bool decays = true;  // weight decay (matrices) or none (norms)
};

// `adamw` without weight decay.
inline ops::AdamWConfig without_decay(ops::AdamWConfig adamw) {
  adamw.weight_decay = 0.0f;
  return adamw;
}

// A flat span as a 1-D view (spans of a flat parameter vector, ZeRO chunks).
inline TensorView<float> flat_view(std::span<float> s) { return {s.data(), Shape{std::int64_t(s.size())}}; }

// One AdamW step (step >= 1) of every tensor, in order.
template <class Backend>
void adamw_update(std::span<const AdamWTensor> tensors, const ops::AdamWConfig& adamw, std::int64_t step) {
  const ops::AdamWConfig no_decay = without_decay(adamw);
  for (const AdamWTensor& t : tensors) Backend::adamw_step(t.value, t.gradient, t.m, t.v, t.decays ? adamw : no_decay, step);
}

template <class Backend>
void adamw_update(const AdamWTensor& tensor, const ops::AdamWConfig& adamw, std::int64_t step) {
  adamw_update<Backend>(std::span<const AdamWTensor>(&tensor, 1), adamw, step);
}

}  // namespace paradyse
