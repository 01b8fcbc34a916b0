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
//
// With the vocabulary sharded over T = vocab_shards ranks of the group (model/vocab_parallel.hpp, train_gpt --mesh
// with tp, --vocab-parallel on) each rank holds V_r = ceil(V / T) rows of the embedding and the head (the most any
// rank holds) and runs them as model/vocab_parallel.hpp does, over the N = T x rows tokens of its T ranks:
//
//   embedding   ids all-gathered [N]; its rows (N / T of them: tokens spread evenly) looked up into a zero
//               partial [N, h], reduce-scattered to [rows, h]; backward: [rows, h] all-gathered to [N, h], its
//               rows picked and scattered into its gradient [V_r, h]
//   head, loss  norm over [rows, h]; normed all-gathered [N, h]; per chunk of N: logits [chunk, V_r], three
//               all-reduces of [chunk] (max, sum of exp, target logit), dW_r, dx; dx reduce-scattered to [rows, h];
//               the final norm's gradient all-reduced over T
//   reduce      the pack [V_r (x2 untied) + 2, h] all-reduced over the p / T ranks holding the same rows
#pragma once

#include "paradyse/cost/dry_run.hpp"
#include "paradyse/cost/profile.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/cost/trace_cost.hpp"
#include "paradyse/model/head_loss.hpp"
#include "paradyse/ops/counting.hpp"

#include <algorithm>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

namespace paradyse::plan {

// The model outside its layer stack, as far as its cost goes. vocab = 0: none (a stack alone is planned).
struct OutsideStack {
  std::int64_t vocab = 0;
  bool tied_head = false;
  int vocab_shards = 1;  // T: the ranks the embedding and the head are sharded over by rows (1: whole on every rank)

  // The most vocabulary rows of the embedding (and of the head) a rank holds: ceil(V / T) (model/vocab_parallel.hpp).
  std::int64_t vocab_rows() const { return (vocab + vocab_shards - 1) / vocab_shards; }
  // Rows of the pack a rank holds: embedding, head (untied only), final norm gamma and beta (model/gpt.hpp).
  std::int64_t replicated_rows() const { return vocab_rows() * (tied_head ? 1 : 2) + 2; }
  // Bytes of the pack's weights, gradients and two AdamW moments (float32; model/gpt.hpp's replicated_state_bytes
  // for T = 1).
  std::int64_t state_bytes(std::int64_t hidden) const { return 4 * replicated_rows() * hidden * 4; }
  // The most bytes the sharded vocabulary's step allocates outside the stack at once on a rank of `rows` token rows
  // (T > 1; model/gpt.hpp's Gpt::activation_bytes is the whole vocabulary's): the larger of the stack's phase (its
  // input and output) and the head's (y, dy, normed, dnormed, norm statistics [2, rows], the final norm's gradient
  // [2, h], the gathered rows [N, h], one chunk of logits [min(N, chunk), V_r]), plus the embedding lookup's ids the
  // step keeps for its backward.
  std::int64_t sharded_activation_bytes(std::int64_t hidden, std::int64_t rows) const {
    const auto bytes = [](std::int64_t floats) { return (floats * 4 + 63) / 64 * 64; };  // the tracker's rounding
    const std::int64_t act = bytes(rows * hidden), gathered = rows * vocab_shards;
    const std::int64_t head_phase = 4 * act + bytes(2 * rows) + bytes(2 * hidden) + bytes(gathered * hidden) +
                                    bytes(std::min(gathered, kHeadChunkRows) * vocab_rows());
    return std::max(2 * act, head_phase) + bytes(rows);
  }
};

// The most token rows a rank holds outside the stack: `samples` sequences of `length` tokens over p ranks.
inline std::int64_t outside_rows(std::int64_t samples, std::int64_t length, int p) {
  return samples * ((length + p - 1) / p);
}

// Seconds of each part on one rank.
struct OutsideStackTime {
  double embedding_s = 0;    // lookup and gradient scatter (sharded: with their collectives)
  double head_loss_s = 0;    // final norm, LM head GEMMs, cross-entropy, forward and backward (sharded: collectives)
  double reduce_s = 0;       // all-reduce of the replicated gradients
  double optimizer_s = 0;    // AdamW over the rank's parameters (the stack's shards and the replicated pack)
  // Of embedding_s and head_loss_s, the sharded vocabulary's collectives (exposed: none overlaps compute).
  double embedding_comm_s = 0, head_loss_comm_s = 0;
  double time_s() const { return embedding_s + head_loss_s + reduce_s + optimizer_s; }
};

// The parts for `rows` token rows on rank 0 of a `p`-rank group whose stack holds `stack_parameters` parameters per
// rank, of a layer like `layer`, priced on `hardware` at float32 (what the model computes the head in). With
// outside.vocab_shards = T > 1, T must divide p (the vocabulary group is T consecutive ranks of the group).
inline OutsideStackTime outside_stack_time(const OutsideStack& outside, const LayerConfig& layer, std::int64_t rows,
                                           std::int64_t stack_parameters, int p,
                                           const cost::HardwareProfile& hardware) {
  OutsideStackTime t;
  if (outside.vocab <= 0 || rows <= 0) return t;
  const int shards = outside.vocab_shards;
  check(shards >= 1 && p % shards == 0, "outside_stack_time: the vocabulary sharded over {} ranks of a group of {} "
        "(want a divisor of the group)", shards, p);
  using ops::Counting;
  const std::int64_t h = layer.hidden, v = outside.vocab_rows(), gathered = rows * shards;
  // Runs `part` in a dry run on a group of `group` ranks and returns its priced time, adding its exposed
  // communication to *comm (where given); `part` makes what lives across steps (weights, their gradients and
  // moments) first, then calls run.record(): what it allocates after is the step's own.
  const auto priced_on = [&](int group, auto&& part, double* comm = nullptr) {
    cost::DryRun run(0, group);
    part(run);
    run.stop();
    run.end_forward();
    run.end_backward();
    const cost::SublayerCost cost = cost::cost_of(run.phases_view(), &hardware, 4, /*keep_events=*/false);
    if (comm) *comm += cost.exposed_comm_s;
    return cost.time_s();
  };
  const auto priced = [&](auto&& part) { return priced_on(p, part); };
  // The counts of a v-collective over the vocabulary group of `width` elements per token row.
  const auto counts = [&](std::int64_t width) { return std::vector<std::int64_t>(std::size_t(shards), rows * width); };
  const auto gather = [&](cost::DryRun& run, const auto& mine, auto& all, std::int64_t width) {
    using Element = std::remove_cvref_t<decltype(*all.data())>;
    run.comm.all_gather_v(std::span<const Element>(mine.data(), std::size_t(mine.numel())), all.span(),
                          std::span<const std::int64_t>(counts(width)));
  };
  const auto scatter = [&](cost::DryRun& run, Tensor<float>& all, Tensor<float>& mine) {
    run.comm.reduce_scatter_v(std::span<const float>(all.span()), mine.span(),
                              std::span<const std::int64_t>(counts(h)), ReduceOp::sum);
  };
  t.embedding_s = priced_on(shards, [&](cost::DryRun& run) {
    Tensor<std::int32_t> tokens(Shape{rows});
    Tensor<float> table(Shape{v, h}), grad(Shape{v, h});
    run.record();
    Tensor<float> out(Shape{rows, h});
    if (shards == 1) {
      Counting::embedding_forward(tokens.view(), table.view(), out.view());
      Counting::embedding_backward(tokens.view(), out.view(), grad.view());
      return;
    }
    Tensor<std::int32_t> all_tokens(Shape{gathered});
    gather(run, tokens, all_tokens, 1);
    const std::vector<std::int64_t> positions(static_cast<std::size_t>(rows));  // this rank's N / T of the group's tokens
    Tensor<float> mine(Shape{rows, h}), partial(Shape{gathered, h});
    Counting::fill(partial.view(), 0.0f);
    Counting::embedding_forward(tokens.view(), table.view(), mine.view());
    Counting::scatter_add_rows(partial.view(), positions, mine.view(), TensorView<const float>());
    scatter(run, partial, out);
    gather(run, out, partial, h);
    Counting::gather_rows(partial.view(), positions, TensorView<const float>(), mine.view());
    Counting::embedding_backward(tokens.view(), mine.view(), grad.view());
  }, &t.embedding_comm_s);
  // The head of a chunk of n (gathered) rows. Every part of it is per row or per chunk of kHeadChunkRows rows, so the
  // rows' head is priced as that of their full chunks and of the rest (a dry run of 10^9 chunks would not end).
  // Unsharded, a chunk's rows are the rank's, with their final norm; sharded, the norm and the gathers around the
  // chunks are priced once below, and each chunk all-reduces its rows' max, sum of exp and target logit over T.
  const auto head_of = [&](std::int64_t n, double* comm) {
    return priced_on(shards, [&](cost::DryRun& run) {
      Tensor<float> y(Shape{n, h}), weights(Shape{v, h}), weights_grad(Shape{v, h});
      Tensor<float> norm(Shape{4, h});  // gamma, beta and their gradients
      Tensor<std::int32_t> targets(Shape{n});
      run.record();
      Tensor<float> dy(Shape{n, h});
      const auto row = [&](std::int64_t i) { return std::span<float>(norm.data() + i * h, std::size_t(h)); };
      const HeadParameters head{row(0), row(1), weights.view(), row(2), row(3), weights_grad.view()};
      if (shards == 1) {
        norm_head_loss<Counting>(layer, y.view(), targets.view(), head, 1.0f, dy.view());
        return;
      }
      head_loss_chunks<Counting>(y.view(), targets.view(), weights.view(), 1.0f, weights_grad.view(), dy.view());
      Tensor<float> statistics(Shape{n});
      for (int k = 0; k < 3; ++k)
        run.comm.all_reduce(std::span<const float>(statistics.span()), statistics.span(), ReduceOp::sum);
    }, comm);
  };
  const std::int64_t head_rows = shards == 1 ? rows : gathered;
  const std::int64_t full = head_rows / kHeadChunkRows, rest = head_rows % kHeadChunkRows;
  double chunk_comm = 0;
  t.head_loss_s = (full > 0 ? double(full) * head_of(kHeadChunkRows, &chunk_comm) : 0.0) +
                  (rest > 0 ? head_of(rest, &t.head_loss_comm_s) : 0.0);
  t.head_loss_comm_s += double(full) * chunk_comm;
  if (shards > 1)
    t.head_loss_s += priced_on(shards, [&](cost::DryRun& run) {
      Tensor<float> y(Shape{rows, h}), norm(Shape{4, h});  // gamma, beta and their gradients
      Tensor<std::int32_t> targets(Shape{rows});
      run.record();
      Tensor<float> dy(Shape{rows, h});
      const auto row = [&](std::int64_t i) { return std::span<float>(norm.data() + i * h, std::size_t(h)); };
      const HeadParameters head{row(0), row(1), TensorView<const float>(), row(2), row(3), TensorView<float>()};
      Tensor<std::int32_t> all_targets(Shape{gathered});
      gather(run, targets, all_targets, 1);
      norm_around<Counting>(layer, y.view(), head, dy.view(), [&](TensorView<const float> normed,
                                                                   TensorView<float> dnormed) {
        Tensor<float> all(Shape{gathered, h});
        gather(run, normed, all, h);
        run.comm.reduce_scatter_v(std::span<const float>(all.span()), std::span(dnormed.data(), std::size_t(dnormed.numel())),
                                  std::span<const std::int64_t>(counts(h)), ReduceOp::sum);
        return 0.0;
      });
      Tensor<float> norm_grad(Shape{2, h});
      run.comm.all_reduce(std::span<const float>(norm_grad.span()), norm_grad.span(), ReduceOp::sum);
    }, &t.head_loss_comm_s);
  const std::int64_t replicated = outside.replicated_rows() * h;
  t.reduce_s = priced_on(p / shards, [&](cost::DryRun& run) {
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
