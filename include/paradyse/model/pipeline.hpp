// paradyse/model/pipeline.hpp: pipeline parallelism: the 1F1B schedule and its executor over the pp stages of a
// model, with micro-batches.
//
//   const auto ops = one_f_one_b(stages, stage, micro_batches);   // what this stage runs, in order
//   run_pipeline(pp_group, my_stage, micro_batches, boundary, io);  // runs them, moving activations between stages
//
// Schedule (PipeDream-Flush, Megatron-LM's non-interleaved 1F1B): stage s of p runs w = min(p - 1 - s, m) warm-up
// forwards, then m - w pairs (forward i + w, backward i), then w cool-down backwards. Stage s keeps at most
// min(p - s, m) micro-batches' saved activations, against m for GPipe's all-forwards-then-all-backwards; the
// bubble is the same, (p - 1) / (m + p - 1) of the step per stage.
//
// A stage (the PipelineStage concept) owns its layers' weights and gradients:
//   using Saved = ...;                                                    // what forward keeps (movable)
//   Saved forward(int micro_batch, TensorView<const float> x, TensorView<float> y);
//   void backward(int micro_batch, Saved&, TensorView<const float> dy, TensorView<float> dx);  // accumulates grads
// Activations crossing a stage boundary have micro-batch i's shape, boundary(i) (the residual stream of a micro-batch,
// [b_i, s, h]: micro-batches of several rows, the last one possibly fewer; one Shape for all: the same for every i). The two ends belong to the caller (PipelineIo): input(i) is micro-batch i's input on the first
// stage, loss_gradient(i, y, dy) turns the last stage's output into its gradient (and records the loss).
//
// Interleaved 1F1B (Narayanan et al., SC'21, section 2.2.2): each of the p ranks holds v model chunks ("virtual
// stages"); chunk c of rank r is virtual stage c * p + r, so a micro-batch passes the ranks v times (rank p - 1 hands
// it to rank 0's next chunk). The bubble shrinks v times, to (p - 1) / (v * m + p - 1) of the step, for v times the
// point-to-point messages. Rank r runs min((p - 1 - r) * 2 + (v - 1) * p, v * m) warm-up forwards, then 1F1B pairs,
// then cool-down backwards; forward unit k runs chunk (k / p) mod v on micro-batch (k / (p v)) p + k mod p, the
// backward unit k the same micro-batch on chunk v - 1 - (k / p) mod v (Megatron-LM's order). m must be a multiple
// of p when v > 1.
//
// Transfers are point-to-point on the pp group: sends are posted asynchronously (so no stage ever blocks in a send
// and the schedule cannot deadlock), receives block. Messages between two stages in one direction are matched in
// posting order, which both sides follow (micro-batches in increasing order). Each stage's weight gradients
// accumulate over micro-batches 0..m-1 in order: the same order as an unpipelined run that runs every micro-batch
// forward and then backward in order, so the two agree bitwise.
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/core/tensor.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <concepts>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace paradyse {

enum class PipelinePass : std::uint8_t { forward, backward };

struct PipelineOp {
  PipelinePass pass;
  int micro_batch;
  int chunk = 0;  // the model chunk (virtual stage chunk * p + rank) of an interleaved schedule

  friend bool operator==(const PipelineOp&, const PipelineOp&) = default;
  // "F3" (micro-batch 3 forward), or "F3c1" on chunk 1 of an interleaved schedule.
  std::string to_string() const {
    return fmt::format("{}{}{}", pass == PipelinePass::forward ? 'F' : 'B', micro_batch,
                       chunk > 0 ? fmt::format("c{}", chunk) : std::string());
  }
};

// The 1F1B order of stage `stage` of `stages` over `micro_batches` micro-batches.
inline std::vector<PipelineOp> one_f_one_b(int stages, int stage, int micro_batches) {
  check(stages >= 1, "one_f_one_b: stages = {} must be at least 1", stages);
  check(stage >= 0 && stage < stages, "one_f_one_b: stage {} is outside 0..{}", stage, stages - 1);
  check(micro_batches >= 1, "one_f_one_b: micro_batches = {} must be at least 1", micro_batches);
  const int warmup = std::min(stages - 1 - stage, micro_batches);
  std::vector<PipelineOp> ops;
  ops.reserve(std::size_t(2 * micro_batches));
  for (int i = 0; i < warmup; ++i) ops.push_back({PipelinePass::forward, i});
  for (int i = 0; i + warmup < micro_batches; ++i) {
    ops.push_back({PipelinePass::forward, i + warmup});
    ops.push_back({PipelinePass::backward, i});
  }
  for (int i = micro_batches - warmup; i < micro_batches; ++i) ops.push_back({PipelinePass::backward, i});
  return ops;
}

// The interleaved 1F1B order of rank `stage` of `stages` holding `chunks` model chunks, over `micro_batches`
// micro-batches (a multiple of `stages` when chunks > 1). With one chunk it is one_f_one_b.
inline std::vector<PipelineOp> interleaved_one_f_one_b(int stages, int stage, int chunks, int micro_batches) {
  check(chunks >= 1, "interleaved_one_f_one_b: chunks = {} must be at least 1", chunks);
  if (chunks == 1) return one_f_one_b(stages, stage, micro_batches);
  check(stages >= 1, "interleaved_one_f_one_b: stages = {} must be at least 1", stages);
  check(stage >= 0 && stage < stages, "interleaved_one_f_one_b: stage {} is outside 0..{}", stage, stages - 1);
  check(micro_batches >= 1 && micro_batches % stages == 0,
        "interleaved_one_f_one_b: micro_batches = {} must be a positive multiple of the {} stages", micro_batches,
        stages);
  const int total = chunks * micro_batches, group = stages * chunks;
  const int warmup = std::min((stages - 1 - stage) * 2 + (chunks - 1) * stages, total);
  const auto unit = [&](int k, PipelinePass pass) {
    const int chunk = (k % group) / stages;
    return PipelineOp{pass, (k / group) * stages + k % stages,
                      pass == PipelinePass::forward ? chunk : chunks - 1 - chunk};
  };
  std::vector<PipelineOp> ops;
  ops.reserve(std::size_t(2 * total));
  for (int k = 0; k < warmup; ++k) ops.push_back(unit(k, PipelinePass::forward));
  for (int k = 0; k + warmup < total; ++k) {
    ops.push_back(unit(k + warmup, PipelinePass::forward));
    ops.push_back(unit(k, PipelinePass::backward));
  }
  for (int k = total - warmup; k < total; ++k) ops.push_back(unit(k, PipelinePass::backward));
  return ops;
}

// What a pipeline stage keeps of an in-flight micro-batch for its backward: every activation (none recomputed), every
// activation but attention's core tensors (selective: each layer's core re-run from its kept q, k, v just before the
// layer's backward, TransformerStack::set_selective_recompute), or its input only (full: the stage's forward re-run
// before the micro-batch's backward, every micro-batch, as Megatron-LM and the search's perf model do).
enum class PipelineRecompute : std::uint8_t { none, selective, full };

// The most layers' activations rank `stage` of `stages` holds at once when it keeps every in-flight micro-batch's (no
// recomputation) under the (interleaved, `chunks` > 1) 1F1B schedule: the largest sum, over the (chunk, micro-batch)
// pairs forwarded and not yet backwarded, of layers_of(chunk) (the layers of virtual stage chunk * stages + stage).
inline std::int64_t peak_stashed_layers(int stages, int stage, int chunks, int micro_batches,
                                        const std::function<std::int64_t(int chunk)>& layers_of) {
  std::int64_t held = 0, peak = 0;
  for (const PipelineOp& op : interleaved_one_f_one_b(stages, stage, chunks, micro_batches)) {
    held += op.pass == PipelinePass::forward ? layers_of(op.chunk) : -layers_of(op.chunk);
    peak = std::max(peak, held);
  }
  return peak;
}

template <class S>
concept PipelineStage = std::movable<typename S::Saved> &&
    requires(S& stage, int i, TensorView<const float> in, TensorView<float> out, typename S::Saved& saved) {
      { stage.forward(i, in, out) } -> std::same_as<typename S::Saved>;
      stage.backward(i, saved, in, out);
    };

// The shape of micro-batch i's activations at a stage boundary (the same function on every stage).
using PipelineBoundary = std::function<Shape(int micro_batch)>;

// The ends of the pipeline, the caller's.
struct PipelineIo {
  std::function<TensorView<const float>(int micro_batch)> input;  // first stage: micro-batch i's input
  // last stage: dy <- the loss gradient of output y of micro-batch i
  std::function<void(int micro_batch, TensorView<const float> y, TensorView<float> dy)> loss_gradient;
  // first stage, optional: the gradient of micro-batch i's input
  std::function<void(int micro_batch, TensorView<const float> dx)> input_gradient;
};

// Runs one training step's forwards and backwards of this rank's stage (rank s of `group` is stage s) in 1F1B
// order. Collective over the group: every stage calls it with the same micro_batches and boundary.
template <Communicator C, PipelineStage S>
void run_pipeline(C& group, S& stage, int micro_batches, const PipelineBoundary& boundary, const PipelineIo& io) {
  const int stages = int(group.size()), me = int(group.rank());
  const bool first = me == 0, last = me == stages - 1;
  check(!first || bool(io.input), "run_pipeline: the first stage needs PipelineIo::input");
  check(!last || bool(io.loss_gradient), "run_pipeline: the last stage needs PipelineIo::loss_gradient");
  std::vector<std::optional<typename S::Saved>> saved(static_cast<std::size_t>(std::max(micro_batches, 0)));
  std::vector<Tensor<float>> sent_outputs(saved.size());  // kept alive until their send completes
  std::vector<Request> output_sends(saved.size());
  std::vector<Tensor<float>> loss_gradients(last ? saved.size() : 0);
  Tensor<float> sent_gradient;  // the previous backward's dx, in flight to the stage before
  Request gradient_send;

  for (const PipelineOp& op : one_f_one_b(stages, me, micro_batches)) {
    const int i = op.micro_batch;
    const auto slot = std::size_t(i);
    if (op.pass == PipelinePass::forward) {
      Tensor<float> received;
      TensorView<const float> x;
      if (first) {
        x = io.input(i);
        check(x.shape() == boundary(i), "run_pipeline: input({}) has shape {}, expected the boundary shape {}", i,
              x.shape(), boundary(i));
      } else {
        received = Tensor<float>(boundary(i));
        group.recv(received.span(), me - 1);
        x = received.view();
      }
      Tensor<float> y(boundary(i));
      saved[slot].emplace(stage.forward(i, x, y.view()));
      if (last) {
        loss_gradients[slot] = Tensor<float>(boundary(i));
        io.loss_gradient(i, y.view(), loss_gradients[slot].view());
      } else {
        sent_outputs[slot] = std::move(y);
        output_sends[slot] = group.send_async(std::span<const float>(sent_outputs[slot].span()), me + 1);
      }
    } else {
      Tensor<float> dy_received;
      TensorView<const float> dy;
      if (last) {
        dy = loss_gradients[slot].view();
      } else {
        // The next stage consumed output i before it could send its gradient: that send is complete.
        dy_received = Tensor<float>(boundary(i));
        group.recv(dy_received.span(), me + 1);
        dy = dy_received.view();
        output_sends[slot].wait();
        sent_outputs[slot] = Tensor<float>();
      }
      Tensor<float> dx(boundary(i));
      stage.backward(i, *saved[slot], dy, dx.view());
      saved[slot].reset();
      if (last) loss_gradients[slot] = Tensor<float>();
      if (first) {
        if (io.input_gradient) io.input_gradient(i, dx.view());
      } else {
        gradient_send.wait();  // the previous one: its receiver needs nothing from this stage to post it
        sent_gradient = std::move(dx);
        gradient_send = group.send_async(std::span<const float>(sent_gradient.span()), me - 1);
      }
    }
  }
  gradient_send.wait();
}
// Every micro-batch of one shape.
template <Communicator C, PipelineStage S>
void run_pipeline(C& group, S& stage, int micro_batches, const Shape& boundary, const PipelineIo& io) {
  run_pipeline(group, stage, micro_batches, PipelineBoundary([&](int) { return boundary; }), io);
}

// Runs one training step of this rank's `chunks` (chunk c is virtual stage c * p + rank of the pp group's p ranks)
// in interleaved 1F1B order. Virtual stage 0 takes io.input, the last one (chunk v - 1 of rank p - 1) calls
// io.loss_gradient. Activations go to rank (r + 1) mod p, gradients to rank (r - 1) mod p, each message tagged by
// its micro-batch and the boundary it crosses, so no two are confused. Collective over the group: every rank calls
// it with the same number of chunks, micro_batches and boundary. Each chunk's gradients accumulate over the
// micro-batches in increasing order, as in an unpipelined run.
template <Communicator C, PipelineStage S>
void run_interleaved_pipeline(C& group, std::span<S> chunks, int micro_batches, const PipelineBoundary& boundary,
                              const PipelineIo& io) {
  const int p = int(group.size()), me = int(group.rank()), v = int(chunks.size());
  check(v >= 1, "run_interleaved_pipeline: no model chunk given");
  const int last_stage = p * v - 1;
  const auto virtual_stage = [&](int chunk) { return chunk * p + me; };
  check(virtual_stage(0) != 0 || bool(io.input), "run_interleaved_pipeline: virtual stage 0 needs PipelineIo::input");
  check(me != p - 1 || bool(io.loss_gradient), "run_interleaved_pipeline: the last stage needs PipelineIo::loss_gradient");
  const std::vector<PipelineOp> ops = interleaved_one_f_one_b(p, me, v, micro_batches);
  const auto slot = [&](int chunk, int micro_batch) { return std::size_t(chunk) * std::size_t(micro_batches) + std::size_t(micro_batch); };
  // The tag of the message crossing from virtual stage `from` to from + 1 (either way) for a micro-batch.
  const auto tag = [&](int from, int micro_batch) { return from * micro_batches + micro_batch; };
  const std::size_t slots = std::size_t(v) * std::size_t(micro_batches);
  std::vector<std::optional<typename S::Saved>> saved(slots);
  std::vector<Tensor<float>> sent(slots), loss_gradients(slots), sent_gradients(slots);
  std::vector<Request> sends(slots), gradient_sends(slots);
  const int next = (me + 1) % p, previous = (me + p - 1) % p;

  for (const PipelineOp& op : ops) {
    const int i = op.micro_batch, vs = virtual_stage(op.chunk);
    const std::size_t at = slot(op.chunk, i);
    S& stage = chunks[std::size_t(op.chunk)];
    if (op.pass == PipelinePass::forward) {
      Tensor<float> received;
      TensorView<const float> x;
      if (vs == 0) {
        x = io.input(i);
        check(x.shape() == boundary(i), "run_interleaved_pipeline: input({}) has shape {}, expected the boundary shape "
              "{}", i, x.shape(), boundary(i));
      } else {
        received = Tensor<float>(boundary(i));
        group.recv(received.span(), previous, tag(vs - 1, i));
        x = received.view();
      }
      Tensor<float> y(boundary(i));
      saved[at].emplace(stage.forward(i, x, y.view()));
      if (vs == last_stage) {
        loss_gradients[at] = Tensor<float>(boundary(i));
        io.loss_gradient(i, y.view(), loss_gradients[at].view());
      } else {
        sent[at] = std::move(y);
        sends[at] = group.send_async(std::span<const float>(sent[at].span()), next, tag(vs, i));
      }
    } else {
      Tensor<float> dy_received;
      TensorView<const float> dy;
      if (vs == last_stage) {
        dy = loss_gradients[at].view();
      } else {
        dy_received = Tensor<float>(boundary(i));
        group.recv(dy_received.span(), next, tag(vs, i));
        dy = dy_received.view();
        sends[at].wait();  // the next stage consumed the output before it sent this gradient
        sent[at] = Tensor<float>();
      }
      Tensor<float> dx(boundary(i));
      stage.backward(i, *saved[at], dy, dx.view());
      saved[at].reset();
      loss_gradients[at] = Tensor<float>();
      if (vs == 0) {
        if (io.input_gradient) io.input_gradient(i, dx.view());
      } else {
        sent_gradients[at] = std::move(dx);
        gradient_sends[at] = group.send_async(std::span<const float>(sent_gradients[at].span()), previous, tag(vs - 1, i));
      }
    }
  }
  for (Request& r : gradient_sends) r.wait();
}
// Every micro-batch of one shape.
template <Communicator C, PipelineStage S>
void run_interleaved_pipeline(C& group, std::span<S> chunks, int micro_batches, const Shape& boundary,
                              const PipelineIo& io) {
  run_interleaved_pipeline(group, chunks, micro_batches, PipelineBoundary([&](int) { return boundary; }), io);
}

}  // namespace paradyse
