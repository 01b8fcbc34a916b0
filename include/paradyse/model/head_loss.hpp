// paradyse/model/head_loss.hpp: the GPT's last step, stated once for every model that ends in it (model/gpt.hpp's
// Gpt, model/mesh_stage.hpp's last pipeline stage): the final norm, the LM head and the cross-entropy loss.
//
//   y [rows, h] -> norm (gamma, beta) -> normed [rows, h] -> x W^T: logits [chunk, V] -> cross-entropy vs targets
//
// The LM head runs in row chunks of kHeadChunkRows, so the logits never exist for all rows at once: memory
// O(chunk x vocab), not O(rows x vocab). In each chunk the logits' gradient (each token's scaled by grad_scale)
// overwrites the logits, then W's gradient accumulates dlogits^T x and the rows' gradient is dlogits W.
#pragma once

#include "paradyse/contract/layer_config.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/model/layer.hpp"
#include "paradyse/ops/backend.hpp"

#include <algorithm>
#include <cstdint>
#include <span>

namespace paradyse {

// Rows of one chunk of the LM head's logits.
inline constexpr std::int64_t kHeadChunkRows = 1024;

// The LM head and the loss over `normed` rows [rows, h] against targets [rows], with weights [V, h]: returns the
// loss sum. With a gradient (weights_grad [V, h] accumulates, dnormed [rows, h] is overwritten) the backward too,
// each token's loss gradient scaled by grad_scale; with default (null) views the forward only.
template <class Backend>
double head_loss_chunks(TensorView<const float> normed, TensorView<const std::int32_t> targets,
                        TensorView<const float> weights, float grad_scale, TensorView<float> weights_grad,
                        TensorView<float> dnormed) {
  using ops::Transpose;
  const std::int64_t rows = normed.extent(0), vocab = weights.extent(0);
  const bool backward = dnormed.data() != nullptr;
  Tensor<float> logits(Shape{std::min(rows, kHeadChunkRows), vocab});
  double loss = 0.0;
  for (std::int64_t start = 0; start < rows; start += kHeadChunkRows) {
    const std::int64_t count = std::min(kHeadChunkRows, rows - start);
    const TensorView<float> chunk = logits.view().slice(0, 0, count);
    const TensorView<const float> x = normed.slice(0, start, count);
    Backend::matmul(x, Transpose::no, weights, Transpose::yes, chunk);  // [count, V] = x [count, h] * W^T
    // dlogits overwrite the logits (the op allows the alias).
    loss += Backend::cross_entropy_forward_backward(chunk, targets.slice(0, start, count), chunk, grad_scale).loss_sum;
    if (!backward) continue;
    const TensorView<const float> dlogits = chunk;
    Backend::matmul(dlogits, Transpose::yes, x, Transpose::no, weights_grad, 1.0f, 1.0f);  // dW += dlogits^T x
    Backend::matmul(dlogits, Transpose::no, weights, Transpose::no, dnormed.slice(0, start, count));
  }
  return loss;
}

// The final norm's and the head's parameters and their gradients (accumulated).
struct HeadParameters {
  std::span<const float> gamma, beta;  // [h]
  TensorView<const float> weights;     // [V, h]
  std::span<float> gamma_grad, beta_grad;
  TensorView<float> weights_grad;      // [V, h]
};

// Forward and backward of the final norm, the head and the loss over y [b, n, h] with targets [b, n]: returns the
// loss sum; dy [b, n, h] (zeroed by the caller) <- the gradient, each token's loss gradient scaled by grad_scale.
// The final norm around a loss of the normed rows, forward and backward: y [b, n, h] -> normed [rows, h] ->
// loss(normed, dnormed) (returns the loss sum, overwrites dnormed [rows, h]) -> dy [b, n, h] (zeroed by the caller)
// and the norm's gradients (head.gamma_grad, head.beta_grad accumulate; its weights are the loss's business).
template <class Backend, class Loss>
double norm_around(const LayerConfig& c, TensorView<const float> y, const HeadParameters& head, TensorView<float> dy,
                   Loss&& loss_of) {
  const std::int64_t h = c.hidden, rows = y.numel() / h;
  Tensor<float> normed(y.shape()), dnormed(y.shape()), stats(Shape{2, rows});
  const TensorView<float> mean = stats.view().slice(0, 0, 1).reshape(Shape{rows});
  const TensorView<float> rstd = stats.view().slice(0, 1, 1).reshape(Shape{rows});
  norm_forward<Backend>(c, y, head.gamma, head.beta, normed.view(), mean, rstd);
  const double loss = loss_of(TensorView<const float>(normed.view()).reshape(Shape{rows, h}),
                              dnormed.view().reshape(Shape{rows, h}));
  norm_backward<Backend>(c, y, head.gamma, mean, rstd, dnormed.view(), dy, head.gamma_grad, head.beta_grad);
  return loss;
}

template <class Backend>
double norm_head_loss(const LayerConfig& c, TensorView<const float> y, TensorView<const std::int32_t> targets,
                      const HeadParameters& head, float grad_scale, TensorView<float> dy) {
  const std::int64_t rows = y.numel() / c.hidden;
  return norm_around<Backend>(c, y, head, dy, [&](TensorView<const float> normed, TensorView<float> dnormed) {
    return head_loss_chunks<Backend>(normed, targets.reshape(Shape{rows}), head.weights, grad_scale, head.weights_grad,
                                     dnormed);
  });
}

// The loss sum of the final norm and the head over y [b, n, h] with targets [b, n], without any gradient.
template <class Backend>
double norm_head_loss_forward(const LayerConfig& c, TensorView<const float> y, TensorView<const std::int32_t> targets,
                              std::span<const float> gamma, std::span<const float> beta,
                              TensorView<const float> weights) {
  const std::int64_t h = c.hidden, rows = y.numel() / h;
  Tensor<float> normed(y.shape()), stats(Shape{2, rows});
  norm_forward<Backend>(c, y, gamma, beta, normed.view(), stats.view().slice(0, 0, 1).reshape(Shape{rows}),
                        stats.view().slice(0, 1, 1).reshape(Shape{rows}));
  return head_loss_chunks<Backend>(TensorView<const float>(normed.view()).reshape(Shape{rows, h}),
                                   targets.reshape(Shape{rows}), weights, 1.0f, TensorView<float>(),
                                   TensorView<float>());
}

}  // namespace paradyse
