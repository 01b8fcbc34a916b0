// paradyse/plan/outside_stack.hpp: the time of a training step's work outside the layer stack, on one rank.
//
// A GPT step (model/gpt.hpp) does, besides its layers: the embedding lookup and its gradient's scatter, the final
// norm, the LM head and the cross-entropy (model/head_loss.hpp: in chunks of kHeadChunkRows rows), the all-reduce of
// the replicated weights' gradients and an AdamW step over every parameter the rank holds. That work is the same
// for every plan (the planner never chooses it), so it changes no plan, only the predicted step time. It is read,
// as the stack's is, off a dry run of the same code (model/head_loss.hpp's norm_head_loss run on meta tensors with
// the counting backend, cost/dry_run.hpp) and priced by cost/trace_cost.hpp on the profile: GEMMs, elementwise
// traffic, fresh allocations, the collective.
//
//   rows = batch x local tokens:   tokens [rows] -> embedding [rows, h] ... stack ... y [rows, h]
//   -> norm -> logits [chunk, V] per chunk -> cross-entropy -> dlogits -> dW [V, h], dnormed [rows, h] -> norm'
//   -> embedding gradient [V, h];  all-reduce of the replicated pack [V (x2 untied) + 2, h];  AdamW over all.
#pragma once

#include "paradyse/cost/dry_run.hpp"
#include "paradyse/cost/profile.hpp"
#include "paradyse/cost/trace_cost.hpp"
#include "paradyse/model/head_loss.hpp"
#include "paradyse/ops/counting.hpp"

#include <cstdint>
#include <span>

namespace paradyse::plan {

// The model outside its layer stack, as far as its cost goes. vocab = 0: none (a stack alone is planned).
struct OutsideStack {
  std::int64_t vocab = 0;
  bool tied_head = false;
  // Rows of the replicated pack: embedding, head (untied only), final norm gamma and beta (model/gpt.hpp).
  std::int64_t replicated_rows() const { return vocab * (tied_head ? 1 : 2) + 2; }
};

// The most token rows a rank holds outside the stack: `samples` sequences of `length` tokens over p ranks.
inline std::int64_t outside_rows(std::int64_t samples, std::int64_t length, int p) {
  return samples * ((length + p - 1) / p);
}

// Seconds of each part on one rank.
struct OutsideStackTime {
  double embedding_s = 0;    // lookup and gradient scatter
  double head_loss_s = 0;    // final norm, LM head GEMMs, cross-entropy, forward and backward
  double reduce_s = 0;       // all-reduce of the replicated gradients
  double optimizer_s = 0;    // AdamW over the rank's parameters (the stack's shards and the replicated pack)
  double time_s() const { return embedding_s + head_loss_s + reduce_s + optimizer_s; }
};

// The parts for `rows` token rows on rank 0 of a `p`-rank group whose stack holds `stack_parameters` parameters per
// rank, of a layer like `layer`, priced on `hardware` at float32 (what the model computes the head in).
inline OutsideStackTime outside_stack_time(const OutsideStack& outside, const LayerConfig& layer, std::int64_t rows,
                                           std::int64_t stack_parameters, int p,
                                           const cost::HardwareProfile& hardware) {
  OutsideStackTime t;
  if (outside.vocab <= 0 || rows <= 0) return t;
  using ops::Counting;
  const std::int64_t h = layer.hidden, v = outside.vocab;
  // Runs `part` in a dry run of its own and returns its priced time; `part` makes what lives across steps (weights,
  // their gradients and moments) first, then calls run.record(): what it allocates after is the step's own.
  const auto priced = [&](auto&& part) {
    cost::DryRun run(0, p);
    part(run);
    run.stop();
    run.end_forward();
    run.end_backward();
    return cost::cost_of(run.phases_view(), &hardware, 4, /*keep_events=*/false).time_s();
  };
  t.embedding_s = priced([&](cost::DryRun& run) {
    Tensor<std::int32_t> tokens(Shape{rows});
    Tensor<float> table(Shape{v, h}), grad(Shape{v, h});
    run.record();
    Tensor<float> out(Shape{rows, h});
    Counting::embedding_forward(tokens.view(), table.view(), out.view());
    Counting::embedding_backward(tokens.view(), out.view(), grad.view());
  });
  // The head of n rows. Every part of it is per row or per chunk of kHeadChunkRows rows, so the rows' head is priced
  // as that of their full chunks and of the rest (a dry run of 10^9 chunks would not end).
  const auto head_of = [&](std::int64_t n) {
    return priced([&](cost::DryRun& run) {
      Tensor<float> y(Shape{n, h}), weights(Shape{v, h}), weights_grad(Shape{v, h});
      Tensor<float> norm(Shape{4, h});  // gamma, beta and their gradients
      Tensor<std::int32_t> targets(Shape{n});
      run.record();
      Tensor<float> dy(Shape{n, h});
      const auto row = [&](std::int64_t i) { return std::span<float>(norm.data() + i * h, std::size_t(h)); };
      const HeadParameters head{row(0), row(1), weights.view(), row(2), row(3), weights_grad.view()};
      norm_head_loss<Counting>(layer, y.view(), targets.view(), head, 1.0f, dy.view());
    });
  };
  const std::int64_t full = rows / kHeadChunkRows, rest = rows % kHeadChunkRows;
  t.head_loss_s = (full > 0 ? double(full) * head_of(kHeadChunkRows) : 0.0) + (rest > 0 ? head_of(rest) : 0.0);
  const std::int64_t replicated = outside.replicated_rows() * h;
  t.reduce_s = priced([&](cost::DryRun& run) {
    run.record();
    Tensor<float> partial(Shape{replicated});
    run.comm.all_reduce(std::span<const float>(partial.data(), std::size_t(replicated)),
                        std::span<float>(partial.data(), std::size_t(replicated)), ReduceOp::sum);
  });
  t.optimizer_s = priced([&](cost::DryRun& run) {
    const std::int64_t n = replicated + stack_parameters;
    Tensor<float> params(Shape{n}), grads(Shape{n}), m(Shape{n}), second(Shape{n});
    run.record();
    Counting::adamw_step(params.view(), grads.view(), m.view(), second.view(), ops::AdamWConfig{}, 1);
  });
  return t;
}

}  // namespace paradyse::plan
