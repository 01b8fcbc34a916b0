// paradyse/ops/cpu/cross_entropy.hpp: softmax cross-entropy fused with its gradient.
//
// One pass per row computes the log-sum-exp (max subtracted, so any finite logits are safe), the loss
// lse - logit[target], and the gradient grad_scale * (softmax - onehot(target)). Rows whose target is ignore_index
// contribute no loss and a zero gradient. This fused op OVERWRITES dlogits (it is the start of the backward pass,
// not an accumulation into one), and dlogits may alias logits to save the memory of a second [rows, vocab] buffer.
#pragma once

#include "paradyse/core/tensor.hpp"
#include "paradyse/ops/cpu/rows.hpp"
#include "paradyse/ops/cpu/vector_math.hpp"

#include <cmath>
#include <cstdint>

namespace paradyse::ops::cpu {

struct CrossEntropyResult {
  double loss_sum = 0.0;     // sum of the per-token losses (natural log) over the counted rows
  std::int64_t counted = 0;  // rows whose target is not ignore_index
};

inline constexpr std::int32_t kIgnoreIndex = -100;

// logits: [..., vocab]; targets: [...] int32 (contiguous); dlogits: [..., vocab] (overwritten; may alias logits).
// grad_scale is d(total loss)/d(token loss), e.g. 1 / (number of counted tokens over all ranks) for a mean.
inline CrossEntropyResult cross_entropy_forward_backward(TensorView<const float> logits,
                                                         TensorView<const std::int32_t> targets,
                                                         TensorView<float> dlogits, float grad_scale,
                                                         std::int32_t ignore_index = kIgnoreIndex) {
  constexpr const char* op = "cross_entropy_forward_backward";
  detail::check_rows(op, "logits", logits);
  detail::check_rows(op, "dlogits", dlogits);
  detail::check_same_shape(op, "logits", logits, "dlogits", dlogits);
  const std::int64_t vocab = logits.extent(-1), rows = detail::row_count(logits);
  detail::check_per_row(op, "targets", targets, rows);
  check(vocab > 0, "{}: the vocabulary is empty (logits {})", op, logits.shape());
  CrossEntropyResult result;
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* lr = detail::row_pointer(logits, r);
    float* dr = detail::row_pointer(dlogits, r);
    const std::int32_t target = targets.data()[r];
    if (target == ignore_index) {
      for (std::int64_t c = 0; c < vocab; ++c) dr[c] = 0.0f;
      continue;
    }
    check(target >= 0 && target < vocab, "{}: target {} of row {} is outside [0, {}) and not ignore_index = {}", op,
          target, r, vocab, ignore_index);
    const float target_logit = lr[target];  // read before dr (maybe lr) is overwritten
    const float top = maximum(lr, vocab);
    float lanes[kReductionLanes] = {};
    std::int64_t c = 0;
    for (; c + kReductionLanes <= vocab; c += kReductionLanes)
      for (int l = 0; l < kReductionLanes; ++l) lanes[l] += exp_approx(lr[c + l] - top);
    float total = 0.0f;
    for (int l = 0; l < kReductionLanes; ++l) total += lanes[l];
    for (; c < vocab; ++c) total += exp_approx(lr[c] - top);
    const float lse = top + std::log(total);
    result.loss_sum += double(lse) - double(target_logit);
    ++result.counted;
    for (c = 0; c < vocab; ++c) dr[c] = grad_scale * exp_approx(lr[c] - lse);
    dr[target] -= grad_scale;
  }
  return result;
}

}  // namespace paradyse::ops::cpu
