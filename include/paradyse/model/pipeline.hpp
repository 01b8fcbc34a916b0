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
// Activations crossing a stage boundary have one shape, `boundary` (the residual stream of a micro-batch,
// [b_micro, s, h]). The two ends belong to the caller (PipelineIo): input(i) is micro-batch i's input on the first
// stage, loss_gradient(i, y, dy) turns the last stage's output into its gradient (and records the loss).
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
#include <string>
#include <utility>
#include <vector>

namespace paradyse {

enum class PipelinePass : std::uint8_t { forward, backward };

struct PipelineOp {
  PipelinePass pass;
  int micro_batch;

  friend bool operator==(const PipelineOp&, const PipelineOp&) = default;
  std::string to_string() const { return fmt::format("{}{}", pass == PipelinePass::forward ? 'F' : 'B', micro_batch); }
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

template <class S>
concept PipelineStage = std::movable<typename S::Saved> &&
    requires(S& stage, int i, TensorView<const float> in, TensorView<float> out, typename S::Saved& saved) {
      { stage.forward(i, in, out) } -> std::same_as<typename S::Saved>;
      stage.backward(i, saved, in, out);
    };

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
void run_pipeline(C& group, S& stage, int micro_batches, const Shape& boundary, const PipelineIo& io) {
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
        check(x.shape() == boundary, "run_pipeline: input({}) has shape {}, expected the boundary shape {}", i,
              x.shape(), boundary);
      } else {
        received = Tensor<float>(boundary);
        group.recv(received.span(), me - 1);
        x = received.view();
      }
      Tensor<float> y(boundary);
      saved[slot].emplace(stage.forward(i, x, y.view()));
      if (last) {
        loss_gradients[slot] = Tensor<float>(boundary);
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
        dy_received = Tensor<float>(boundary);
        group.recv(dy_received.span(), me + 1);
        dy = dy_received.view();
        output_sends[slot].wait();
        sent_outputs[slot] = Tensor<float>();
      }
      Tensor<float> dx(boundary);
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

}  // namespace paradyse
