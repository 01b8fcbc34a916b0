// The 1F1B pipeline: the schedule's properties (every micro-batch once each way, bounded in-flight activations, no
// deadlock when stages wait for each other), and the executor on thread ranks: p stages of residual GELU layers over
// m micro-batches give the weight gradients of a float64 single-rank reference, and bitwise those of the same float
// stages run unpipelined.
#include "paradyse/model/pipeline.hpp"

#include "paradyse/comm/threads.hpp"
#include "paradyse/core/rng.hpp"
#include "paradyse/ops/backend.hpp"
#include "ops/reference_layers.hpp"
#include "support/tolerance.hpp"

#include <doctest/doctest.h>

#include <mutex>
#include <vector>

using namespace paradyse;
using namespace paradyse::testing;

TEST_CASE("one_f_one_b: each micro-batch forward then backward once, at most p - s in flight, no deadlock") {
  for (int p = 1; p <= 5; ++p)
    for (int m = 1; m <= 8; ++m) {
      std::vector<std::vector<PipelineOp>> ops;
      for (int s = 0; s < p; ++s) {
        ops.push_back(one_f_one_b(p, s, m));
        const auto& mine = ops.back();
        REQUIRE(mine.size() == std::size_t(2 * m));
        std::vector<int> forward_at(std::size_t(m), -1), backward_at(std::size_t(m), -1);
        int in_flight = 0, most = 0, next_forward = 0, next_backward = 0;
        for (int k = 0; k < int(mine.size()); ++k) {
          const PipelineOp op = mine[std::size_t(k)];
          if (op.pass == PipelinePass::forward) {
            CHECK(op.micro_batch == next_forward++);  // in order
            forward_at[std::size_t(op.micro_batch)] = k;
            most = std::max(most, ++in_flight);
          } else {
            CHECK(op.micro_batch == next_backward++);
            backward_at[std::size_t(op.micro_batch)] = k;
            --in_flight;
          }
        }
        for (int i = 0; i < m; ++i) CHECK(forward_at[std::size_t(i)] < backward_at[std::size_t(i)]);
        CHECK(most == std::min(p - s, m));
      }
      // Stages wait for each other: F_i on s needs F_i on s-1, B_i on s needs B_i on s+1 (or F_i when last).
      std::vector<std::size_t> next(static_cast<std::size_t>(p), 0);
      std::vector<std::vector<bool>> done_f(static_cast<std::size_t>(p), std::vector<bool>(static_cast<std::size_t>(m))), done_b = done_f;
      for (bool progress = true; progress;) {
        progress = false;
        for (int s = 0; s < p; ++s) {
          auto& k = next[std::size_t(s)];
          if (k == ops[std::size_t(s)].size()) continue;
          const PipelineOp op = ops[std::size_t(s)][k];
          const auto i = std::size_t(op.micro_batch);
          const bool ready = op.pass == PipelinePass::forward ? (s == 0 || done_f[std::size_t(s - 1)][i])
                                                              : (s == p - 1 ? done_f[std::size_t(s)][i] : done_b[std::size_t(s + 1)][i]);
          if (!ready) continue;
          (op.pass == PipelinePass::forward ? done_f : done_b)[std::size_t(s)][i] = true;
          ++k;
          progress = true;
        }
      }
      for (int s = 0; s < p; ++s) CHECK_MESSAGE(next[std::size_t(s)] == ops[std::size_t(s)].size(), "p=", p, " m=", m, " stage ", s, " stuck");
    }
  CHECK(one_f_one_b(3, 0, 4)[0].to_string() == "F0");
  CHECK_THROWS_WITH_AS(one_f_one_b(2, 2, 4), doctest::Contains("stage 2 is outside 0..1"), Error);
  CHECK_THROWS_WITH_AS(one_f_one_b(2, 0, 0), doctest::Contains("micro_batches = 0"), Error);
}

namespace {

constexpr std::int64_t kRows = 6, kWidth = 8;  // a micro-batch: [b = 2, s = 3, h = 8], as [6, 8]

// Residual GELU layers: x <- x + gelu(x W^T), W: [h, h]. Gradients accumulate.
struct GeluStage {
  std::vector<Tensor<float>> weights, gradients;
  struct Saved {
    std::vector<Tensor<float>> inputs, pre;  // per layer: its input and x W^T
  };

  Saved forward(int, TensorView<const float> x, TensorView<float> y) {
    Saved saved;
    Tensor<float> current(Shape{kRows, kWidth});
    ops::Cpu::copy(x.reshape(Shape{kRows, kWidth}), current.view());
    for (const Tensor<float>& w : weights) {
      Tensor<float> pre(Shape{kRows, kWidth}), act(Shape{kRows, kWidth}), next(Shape{kRows, kWidth});
      ops::Cpu::matmul(current.view(), ops::Transpose::no, w.view(), ops::Transpose::yes, pre.view());
      ops::Cpu::gelu_forward(pre.view(), act.view());
      ops::Cpu::copy(current.view(), next.view());
      ops::Cpu::add_into(next.view(), act.view());
      saved.inputs.push_back(std::move(current));
      saved.pre.push_back(std::move(pre));
      current = std::move(next);
    }
    ops::Cpu::copy(current.view(), y.reshape(Shape{kRows, kWidth}));
    return saved;
  }
  void backward(int, Saved& saved, TensorView<const float> dy, TensorView<float> dx) {
    Tensor<float> g(Shape{kRows, kWidth});
    ops::Cpu::copy(dy.reshape(Shape{kRows, kWidth}), g.view());
    for (std::size_t l = weights.size(); l-- > 0;) {
      Tensor<float> dpre(Shape{kRows, kWidth});
      ops::Cpu::fill(dpre.view(), 0.0f);
      ops::Cpu::gelu_backward(saved.pre[l].view(), g.view(), dpre.view());
      ops::Cpu::matmul(dpre.view(), ops::Transpose::yes, saved.inputs[l].view(), ops::Transpose::no,
                       gradients[l].view(), 1.0f, 1.0f);
      ops::Cpu::matmul(dpre.view(), ops::Transpose::no, weights[l].view(), ops::Transpose::no, g.view(), 1.0f, 1.0f);
    }
    ops::Cpu::copy(g.view(), dx.reshape(Shape{kRows, kWidth}));
  }
};

struct Problem {
  std::vector<std::vector<double>> weights;           // every layer, [h, h] row-major
  std::vector<std::vector<double>> inputs, targets;   // every micro-batch, [rows, h]
};

// Float64: loss = sum over micro-batches of 0.5 |y - target|^2; the gradient of every layer's W.
std::vector<std::vector<double>> reference_gradients(const Problem& problem) {
  const std::size_t layers = problem.weights.size(), h = std::size_t(kWidth), rows = std::size_t(kRows);
  std::vector<std::vector<double>> grads(layers, std::vector<double>(h * h, 0.0));
  for (std::size_t i = 0; i < problem.inputs.size(); ++i) {
    std::vector<std::vector<double>> xs{problem.inputs[i]}, pres;
    for (std::size_t l = 0; l < layers; ++l) {
      const auto& x = xs.back();
      std::vector<double> pre(rows * h, 0.0), next = x;
      for (std::size_t r = 0; r < rows; ++r)
        for (std::size_t o = 0; o < h; ++o) {
          for (std::size_t c = 0; c < h; ++c) pre[r * h + o] += x[r * h + c] * problem.weights[l][o * h + c];
          next[r * h + o] += reference_gelu(pre[r * h + o]);
        }
      pres.push_back(pre);
      xs.push_back(next);
    }
    std::vector<double> g(rows * h);
    for (std::size_t k = 0; k < g.size(); ++k) g[k] = xs.back()[k] - problem.targets[i][k];
    for (std::size_t l = layers; l-- > 0;) {
      std::vector<double> dpre(rows * h), dx = g;
      for (std::size_t k = 0; k < dpre.size(); ++k) dpre[k] = g[k] * reference_gelu_derivative(pres[l][k]);
      for (std::size_t r = 0; r < rows; ++r)
        for (std::size_t o = 0; o < h; ++o)
          for (std::size_t c = 0; c < h; ++c) {
            grads[l][o * h + c] += dpre[r * h + o] * xs[l][r * h + c];
            dx[r * h + c] += dpre[r * h + o] * problem.weights[l][o * h + c];
          }
      g = dx;
    }
  }
  return grads;
}

std::vector<double> random_values(std::size_t n, Rng& rng, double scale) {
  const Tensor<double> t = random_uniform<double>(Shape{std::int64_t(n)}, rng, -scale, scale);
  return {t.data(), t.data() + n};
}

std::vector<GeluStage> make_stages(const Problem& problem, int stages, int layers_per_stage) {
  std::vector<GeluStage> out(static_cast<std::size_t>(stages));
  for (int s = 0; s < stages; ++s)
    for (int l = 0; l < layers_per_stage; ++l) {
      const auto& w = problem.weights[std::size_t(s * layers_per_stage + l)];
      Tensor<float> weight(Shape{kWidth, kWidth}), gradient(Shape{kWidth, kWidth});
      for (std::size_t k = 0; k < w.size(); ++k) weight.data()[k] = float(w[k]);
      ops::Cpu::fill(gradient.view(), 0.0f);
      out[std::size_t(s)].weights.push_back(std::move(weight));
      out[std::size_t(s)].gradients.push_back(std::move(gradient));
    }
  return out;
}

// A problem of `layers` [h, h] weights and m micro-batches, drawn from rng, with its float copies of the inputs and
// targets and the loss gradient dy = y - target.
struct Batches {
  Problem problem;
  std::vector<Tensor<float>> inputs, targets;

  Batches(int layers, int m, Rng& rng) {
    for (int l = 0; l < layers; ++l) problem.weights.push_back(random_values(std::size_t(kWidth * kWidth), rng, 0.4));
    for (int i = 0; i < m; ++i) {
      problem.inputs.push_back(random_values(std::size_t(kRows * kWidth), rng, 1.0));
      problem.targets.push_back(random_values(std::size_t(kRows * kWidth), rng, 1.0));
      Tensor<float> x(Shape{2, 3, kWidth}), t(Shape{2, 3, kWidth});
      for (std::int64_t k = 0; k < x.numel(); ++k) {
        x.data()[k] = float(problem.inputs.back()[std::size_t(k)]);
        t.data()[k] = float(problem.targets.back()[std::size_t(k)]);
      }
      inputs.push_back(std::move(x));
      targets.push_back(std::move(t));
    }
  }
  void loss_gradient(int i, TensorView<const float> y, TensorView<float> dy) const {
    for (std::int64_t k = 0; k < y.numel(); ++k) dy.data()[k] = y.data()[k] - targets[std::size_t(i)].data()[k];
  }
  // The PipelineIo of these batches; each micro-batch's input gradient lands in input_gradients.
  PipelineIo io(std::vector<std::vector<float>>& input_gradients) const {
    PipelineIo io;
    io.input = [this](int i) { return TensorView<const float>(inputs[std::size_t(i)].view()); };
    io.loss_gradient = [this](int i, TensorView<const float> y, TensorView<float> dy) { loss_gradient(i, y, dy); };
    io.input_gradient = [&input_gradients](int i, TensorView<const float> dx) {
      input_gradients[std::size_t(i)].assign(dx.data(), dx.data() + dx.numel());
    };
    return io;
  }
};

// Unpipelined, on one thread: every micro-batch forward through all stages in order, then backward; checks that
// each micro-batch's input gradient equals the pipelined run's bitwise. Returns the stages with their gradients.
std::vector<GeluStage> run_unpipelined(const Batches& batches, int stages, int layers_per_stage,
                                       const std::vector<std::vector<float>>& pipelined_input_gradients) {
  std::vector<GeluStage> plain = make_stages(batches.problem, stages, layers_per_stage);
  const int m = int(batches.inputs.size());
  std::vector<std::vector<GeluStage::Saved>> saved(static_cast<std::size_t>(m));
  std::vector<Tensor<float>> outputs;
  for (int i = 0; i < m; ++i) {
    Tensor<float> current = Tensor<float>::copy_of(batches.inputs[std::size_t(i)].view());
    for (GeluStage& stage : plain) {
      Tensor<float> y(current.shape());
      saved[std::size_t(i)].push_back(stage.forward(i, current.view(), y.view()));
      current = std::move(y);
    }
    outputs.push_back(std::move(current));
  }
  for (int i = 0; i < m; ++i) {
    Tensor<float> g(outputs[std::size_t(i)].shape());
    batches.loss_gradient(i, outputs[std::size_t(i)].view(), g.view());
    for (int s = stages; s-- > 0;) {
      Tensor<float> dx(g.shape());
      plain[std::size_t(s)].backward(i, saved[std::size_t(i)][std::size_t(s)], g.view(), dx.view());
      g = std::move(dx);
    }
    const auto& piped = pipelined_input_gradients[std::size_t(i)];
    CHECK(std::equal(piped.begin(), piped.end(), g.data()));
  }
  return plain;
}

}  // namespace

TEST_CASE("run_pipeline: p stages x m micro-batches give the float64 reference's gradients, and bitwise the unpipelined run's") {
  const int layers_per_stage = 2;
  for (int p : {1, 2, 3, 4})
    for (int m : {1, 3, 5}) {
      Rng rng(std::uint64_t(100 * p + m));
      const Batches batches(p * layers_per_stage, m, rng);

      // Pipelined: rank s of p threads is stage s.
      std::vector<GeluStage> pipelined = make_stages(batches.problem, p, layers_per_stage);
      std::vector<std::vector<float>> input_gradients(static_cast<std::size_t>(m));
      run_ranks(p, [&](ThreadCommunicator& comm) {
        run_pipeline(comm, pipelined[std::size_t(comm.rank())], m, Shape{2, 3, kWidth}, batches.io(input_gradients));
      });
      const std::vector<GeluStage> plain = run_unpipelined(batches, p, layers_per_stage, input_gradients);

      const auto want = reference_gradients(batches.problem);
      for (int s = 0; s < p; ++s)
        for (int l = 0; l < layers_per_stage; ++l) {
          INFO("p=", p, " m=", m, " stage ", s, " layer ", l);
          const Tensor<float>& got = pipelined[std::size_t(s)].gradients[std::size_t(l)];
          const Tensor<float>& unpipelined = plain[std::size_t(s)].gradients[std::size_t(l)];
          CHECK_CLOSE(got.span(), want[std::size_t(s * layers_per_stage + l)], kFloat32);
          CHECK(std::equal(got.span().begin(), got.span().end(), unpipelined.span().begin()));
        }
    }
}

TEST_CASE("run_pipeline: a first stage without an input, or an input of the wrong shape, is a clear error") {
  GeluStage stage;
  Tensor<float> x(Shape{2, 4, kWidth});
  run_ranks(1, [&](ThreadCommunicator& comm) {
    PipelineIo io;
    io.loss_gradient = [](int, TensorView<const float>, TensorView<float>) {};
    CHECK_THROWS_WITH_AS(run_pipeline(comm, stage, 2, Shape{2, 3, kWidth}, io), doctest::Contains("needs PipelineIo::input"), Error);
    io.input = [&](int) { return TensorView<const float>(x.view()); };
    CHECK_THROWS_WITH_AS(run_pipeline(comm, stage, 2, Shape{2, 3, kWidth}, io),
                         doctest::Contains("input(0) has shape [2, 4, 8], expected the boundary shape [2, 3, 8]"), Error);
  });
}

TEST_CASE("interleaved_one_f_one_b: every (chunk, micro-batch) forward then backward once, in order per chunk, no deadlock") {
  for (int p = 1; p <= 4; ++p)
    for (int v = 1; v <= 3; ++v)
      for (int m = p; m <= 3 * p; m += p) {
        INFO("p=", p, " v=", v, " m=", m);
        // Virtual stage c * p + s: its ops in the order rank s runs them.
        std::vector<std::vector<PipelineOp>> ops;
        for (int s = 0; s < p; ++s) {
          ops.push_back(interleaved_one_f_one_b(p, s, v, m));
          REQUIRE(ops.back().size() == std::size_t(2 * v * m));
          std::vector<int> next_forward(static_cast<std::size_t>(v), 0), next_backward(static_cast<std::size_t>(v), 0);
          for (const PipelineOp& op : ops.back()) {
            REQUIRE((op.chunk >= 0 && op.chunk < v));
            auto& next = (op.pass == PipelinePass::forward ? next_forward : next_backward)[std::size_t(op.chunk)];
            CHECK(op.micro_batch == next++);  // each chunk's micro-batches in increasing order, each once
            if (op.pass == PipelinePass::backward) CHECK(next_forward[std::size_t(op.chunk)] > op.micro_batch);
          }
          if (v == 1) CHECK(ops.back() == one_f_one_b(p, s, m));
        }
        // Dependencies across virtual stages: F(vs, i) needs F(vs - 1, i); B(vs, i) needs B(vs + 1, i), or F(vs, i)
        // on the last virtual stage.
        const int stages = p * v;
        std::vector<std::vector<bool>> done_f(static_cast<std::size_t>(stages), std::vector<bool>(static_cast<std::size_t>(m))),
            done_b = done_f;
        std::vector<std::size_t> at(static_cast<std::size_t>(p), 0);
        for (bool progress = true; progress;) {
          progress = false;
          for (int s = 0; s < p; ++s) {
            auto& k = at[std::size_t(s)];
            if (k == ops[std::size_t(s)].size()) continue;
            const PipelineOp op = ops[std::size_t(s)][k];
            const int vs = op.chunk * p + s;
            const auto i = std::size_t(op.micro_batch);
            const bool ready = op.pass == PipelinePass::forward
                                   ? (vs == 0 || done_f[std::size_t(vs - 1)][i])
                                   : (vs == stages - 1 ? done_f[std::size_t(vs)][i] : done_b[std::size_t(vs + 1)][i]);
            if (!ready) continue;
            (op.pass == PipelinePass::forward ? done_f : done_b)[std::size_t(vs)][i] = true;
            ++k;
            progress = true;
          }
        }
        for (int s = 0; s < p; ++s) CHECK_MESSAGE(at[std::size_t(s)] == ops[std::size_t(s)].size(), "rank ", s, " stuck");
      }
  CHECK(interleaved_one_f_one_b(2, 0, 2, 2)[2].to_string() == "F0c1");
  CHECK_THROWS_WITH_AS(interleaved_one_f_one_b(2, 0, 2, 3), doctest::Contains("multiple of the 2 stages"), Error);
  CHECK_THROWS_WITH_AS(interleaved_one_f_one_b(2, 0, 0, 2), doctest::Contains("chunks = 0"), Error);
}

TEST_CASE("run_interleaved_pipeline: p ranks x v chunks x m micro-batches give the float64 reference's gradients, and bitwise the unpipelined run's") {
  const int layers_per_stage = 1;
  for (int p : {1, 2, 3})
    for (int v : {2, 3})
      for (int m : {p, 2 * p}) {
        const int stages = p * v;
        Rng rng(std::uint64_t(1000 + 100 * p + 10 * v + m));
        const Batches batches(stages * layers_per_stage, m, rng);

        // Virtual stage vs (all stages in order); rank r holds chunks vs = c * p + r.
        std::vector<GeluStage> pipelined = make_stages(batches.problem, stages, layers_per_stage);
        std::vector<std::vector<float>> input_gradients(static_cast<std::size_t>(m));
        std::vector<std::vector<GeluStage>> per_rank(static_cast<std::size_t>(p));
        for (int r = 0; r < p; ++r)
          for (int c = 0; c < v; ++c) per_rank[std::size_t(r)].push_back(std::move(pipelined[std::size_t(c * p + r)]));
        run_ranks(p, [&](ThreadCommunicator& comm) {
          run_interleaved_pipeline(comm, std::span<GeluStage>(per_rank[std::size_t(comm.rank())]), m,
                                   Shape{2, 3, kWidth}, batches.io(input_gradients));
        });
        const std::vector<GeluStage> plain = run_unpipelined(batches, stages, layers_per_stage, input_gradients);

        const auto want = reference_gradients(batches.problem);
        for (int vs = 0; vs < stages; ++vs)
          for (int l = 0; l < layers_per_stage; ++l) {
            INFO("p=", p, " v=", v, " m=", m, " virtual stage ", vs, " layer ", l);
            const Tensor<float>& got = per_rank[std::size_t(vs % p)][std::size_t(vs / p)].gradients[std::size_t(l)];
            const Tensor<float>& unpipelined = plain[std::size_t(vs)].gradients[std::size_t(l)];
            CHECK_CLOSE(got.span(), want[std::size_t(vs * layers_per_stage + l)], kFloat32);
            CHECK(std::equal(got.span().begin(), got.span().end(), unpipelined.span().begin()));
          }
      }
}
