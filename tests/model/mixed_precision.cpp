// bf16 mixed precision of the GPT (ops::CpuBf16, ops/cpu/bf16_backend.hpp) on thread ranks, against the fp32 GPT:
// the working weights are the masters' bf16 rounding (masters moved inside their rounding interval change nothing,
// bit for bit); loss and every gradient follow the fp32 model within the derived tolerance, for p = 1..3 and mixed
// plans; one AdamW step updates fp32 masters from fp32 gradients (the masters after one step differ from the fp32
// step's by what AdamW's update makes of the two gradients, nothing more); a checkpoint of a bf16 run holds its
// masters bit for bit and says compute_dtype bf16, and training continues from it bit for bit.
//
// The model-level tolerance (loss and each gradient tensor, relative in the 2-norm). Every bf16 rounding perturbs
// one value by a relative <= u = 2^-8 (8 significant bits, round to nearest). On the longest path from the
// embedding to a gradient, a value is rounded K times: forward 1 (embedding) + 12 per layer (norm input, gamma,
// beta, the q/k/v weights, q, k, v, attention output, the projection weight, the residual store, and the MLP's
// norm input, w_in, activation input, w_out: counted as 12 with the residual stores of both halves) + 2 in the
// head (normed rows, head weight), and as many again backward: K = 2 (3 + 12 L). With these well-conditioned,
// normalised layers (amplification ~1), independent roundings add in quadrature: Higham & Mary (2019)'s
// probabilistic bound gives a relative error <= lambda sqrt(K) u with probability >= 1 - 2K exp(-lambda^2 / 2);
// lambda = 5 (failure probability < 4e-4 for K = 90) gives the tolerance lambda sqrt(K) u. The loss (a mean over
// tokens of -log softmax, whose gradient in the logits sums to at most 2 in absolute value per token) moves by at
// most 2 max|dlogit|, and |dlogit| <= (the logits' relative error) max|logit|: the test bounds |dloss| by
// 2 lambda sqrt(K_fwd) u max|logit| with K_fwd = 3 + 12 L, and max|logit| <= ||normed row||_2 max_v ||head_v||_2
// <= sqrt(h) max_v ||head_v||_2 (a normalised row with gamma = 1, beta = 0, as drawn, has 2-norm <= sqrt(h)), computed
// from the drawn head. (A loose bound: the loss is a mean whose errors largely cancel; the gradients carry the test.)
#include "paradyse/model/checkpoint.hpp"
#include "paradyse/model/gpt.hpp"
#include "paradyse/ops/cpu/bf16_backend.hpp"

#include "strategy/harness.hpp"
#include "support/tolerance.hpp"

#include "paradyse/comm/threads.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <string>
#include <vector>

// Everything in its own namespace: the file joins a unity batch of tests/model (tests/CMakeLists.txt).
namespace bf16_gpt_test {

using namespace paradyse;
using namespace paradyse::testing;
using Fp32Model = Gpt<AllStrategies<>>;
using Bf16Model = Gpt<AllStrategies<ops::CpuBf16>, ops::CpuBf16>;
constexpr double kU = 1.0 / 256.0;  // bf16's unit roundoff, 2^-8
constexpr double kLambda = 5.0;

static_assert(Bf16Model::compute_dtype == DType::bf16 && Fp32Model::compute_dtype == DType::f32);

GptConfig small_gpt(bool variant) {
  GptConfig c;
  c.layer = small_config(12, variant ? 1 : 12, 24);
  c.layers = 2;
  if (!variant) {
    c.layer.causal = c.layer.zigzag = c.layer.rope = true;
    c.vocab = 23;
  } else {
    c.layer.norm = NormKind::rms_norm;
    c.layer.activation = Activation::swiglu;
    c.vocab = 17;
    c.tied_head = true;
  }
  return c;
}

struct Batch {
  std::vector<std::int32_t> tokens, targets;
  std::int64_t batch = 2, seq = 13;
};

Batch make_batch(const GptConfig& c, std::uint64_t seed) {
  Batch b;
  Rng rng(seed);
  for (std::int64_t i = 0; i < b.batch * b.seq; ++i) {
    b.tokens.push_back(std::int32_t(rng.below(std::uint64_t(c.vocab))));
    b.targets.push_back(std::int32_t(rng.below(std::uint64_t(c.vocab))));
  }
  return b;
}

StackPlan mixed_plan(int layers, int variant) {
  using S = AllStrategies<>;
  const char* attention[] = {"MegatronTS", "UlyssesZ", "ColossalZ", "METP", "MegatronCZ"};
  const char* mlp[] = {"METP", "MegatronCZ", "MegatronTS", "UlyssesZ", "ColossalZ"};
  StackPlan plan;
  for (int l = 0; l < layers; ++l) plan.push_back({S::index_of(attention[(l + variant) % 5]), S::index_of(mlp[(l + 2 * variant) % 5])});
  return plan;
}

// Every float a model holds for one role (weights, gradients), in a fixed order: the replicated pack, then each
// layer's attention, MLP and norm shards.
template <class M>
std::vector<std::span<float>> parts(M& m, bool gradients) {
  std::vector<std::span<float>> out{gradients ? m.replicated_gradient().span() : m.replicated().span()};
  for (int l = 0; l < m.stack().layers(); ++l) {
    LayerWeights& w = gradients ? m.stack().gradients()[std::size_t(l)] : m.stack().weights()[std::size_t(l)];
    for (Tensor<float>* t : {&w.attention.packed, &w.mlp.packed, &w.norms.packed}) out.push_back(t->span());
  }
  return out;
}

double relative_difference(std::span<const float> a, std::span<const float> b) {
  double diff = 0, norm = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff += (double(a[i]) - double(b[i])) * (double(a[i]) - double(b[i]));
    norm += double(b[i]) * double(b[i]);
  }
  return std::sqrt(diff) / std::max(std::sqrt(norm), 1e-30);
}

// The bf16 value a float rounds to (core/dtype.hpp).
float bf16_of(float x) { return float(bf16(x)); }

TEST_CASE("mixed precision: the working weights are the masters' bf16 rounding (masters moved inside it change nothing)") {
  for (bool variant : {false, true}) {
    const GptConfig c = small_gpt(variant);
    const Batch b = make_batch(c, 3);
    // Masters on bf16 values w0, and masters moved by |d| <= |w0| 2^-10 < a quarter of w0's bf16 spacing (also below
    // a power of two, where the spacing halves): both round to w0.
    GlobalGptWeights<float> on_grid = init_global_gpt<float>(c, 7), moved = init_global_gpt<float>(c, 7);
    Rng rng(5);
    const auto perturb = [&](Tensor<float>& grid, Tensor<float>& off) {
      for (std::int64_t i = 0; i < grid.numel(); ++i) {
        grid.data()[i] = bf16_of(grid.data()[i]);
        off.data()[i] = grid.data()[i] * float(1.0 + (rng.uniform() * 2 - 1) * 0x1p-10);
        REQUIRE(bf16_of(off.data()[i]) == grid.data()[i]);
      }
    };
    perturb(on_grid.embedding, moved.embedding);
    perturb(on_grid.head, moved.head);
    perturb(on_grid.final_gamma, moved.final_gamma);
    perturb(on_grid.final_beta, moved.final_beta);
    for (std::size_t l = 0; l < on_grid.layers.size(); ++l)
      for (auto member : {&GlobalLayerWeights<float>::w_q, &GlobalLayerWeights<float>::w_k, &GlobalLayerWeights<float>::w_v,
                          &GlobalLayerWeights<float>::w_proj, &GlobalLayerWeights<float>::w_in, &GlobalLayerWeights<float>::w_up,
                          &GlobalLayerWeights<float>::w_out, &GlobalLayerWeights<float>::norm1_gamma,
                          &GlobalLayerWeights<float>::norm1_beta, &GlobalLayerWeights<float>::norm2_gamma,
                          &GlobalLayerWeights<float>::norm2_beta})
        perturb(on_grid.layers[l].*member, moved.layers[l].*member);
    for (int p : {1, 2}) {
      run_ranks(p, [&](ThreadCommunicator& comm) {
        const int r = comm.rank();
        BufferPool pool;
        const SequenceLayout layout(b.seq, p, c.layer.zigzag);
        const Tensor<std::int32_t> tokens = shard_tokens(b.tokens, b.batch, layout, r);
        const Tensor<std::int32_t> targets = shard_tokens(b.targets, b.batch, layout, r);
        const auto run = [&](auto& model) {
          model.zero_gradients();
          return model.forward_backward(comm, pool, mixed_plan(c.layers, 1), b.seq, tokens.view(), targets.view()).loss;
        };
        Bf16Model grid_model(c, on_grid, p, r), moved_model(c, moved, p, r);
        CHECK(run(grid_model) == run(moved_model));  // bit for bit
        const auto g1 = parts(grid_model, true), g2 = parts(moved_model, true);
        for (std::size_t i = 0; i < g1.size(); ++i)
          CHECK(std::equal(g1[i].begin(), g1[i].end(), g2[i].begin()));
        // The same perturbation moves the fp32 model's loss: the check above can fail.
        Fp32Model grid32(c, on_grid, p, r), moved32(c, moved, p, r);
        CHECK(run(grid32) != run(moved32));
      });
    }
  }
}

TEST_CASE("mixed precision: loss and every gradient follow the fp32 GPT within the derived tolerance, p = 1..3") {
  for (bool variant : {false, true}) {
    const GptConfig c = small_gpt(variant);
    const Batch b = make_batch(c, 11);
    const GlobalGptWeights<float> global = init_global_gpt<float>(c, 13);
    const double k_forward = 3 + 12.0 * c.layers, k_total = 2 * k_forward;
    const double grad_tol = kLambda * std::sqrt(k_total) * kU;
    for (int p : {1, 2, 3}) {
      std::vector<double> worst(1, 0.0);
      std::mutex mutex;
      run_ranks(p, [&](ThreadCommunicator& comm) {
        const int r = comm.rank();
        BufferPool pool;
        const SequenceLayout layout(b.seq, p, c.layer.zigzag);
        const Tensor<std::int32_t> tokens = shard_tokens(b.tokens, b.batch, layout, r);
        const Tensor<std::int32_t> targets = shard_tokens(b.targets, b.batch, layout, r);
        const StackPlan plan = mixed_plan(c.layers, p);
        Fp32Model fp32(c, global, p, r);
        Bf16Model mixed(c, global, p, r);
        fp32.zero_gradients();
        mixed.zero_gradients();
        const double loss32 = fp32.forward_backward(comm, pool, plan, b.seq, tokens.view(), targets.view()).loss;
        const double loss16 = mixed.forward_backward(comm, pool, plan, b.seq, tokens.view(), targets.view()).loss;
        const Tensor<float>& head = c.tied_head ? global.embedding : global.head;
        double longest_row = 0;
        for (std::int64_t v = 0; v < c.vocab; ++v) {
          double sq = 0;
          for (std::int64_t k = 0; k < c.layer.hidden; ++k) sq += double(head(v, k)) * double(head(v, k));
          longest_row = std::max(longest_row, std::sqrt(sq));
        }
        const double max_logit = std::sqrt(double(c.layer.hidden)) * longest_row;
        const double loss_tol = 2 * kLambda * std::sqrt(k_forward) * kU * max_logit;
        CHECK_MESSAGE(std::abs(loss16 - loss32) <= loss_tol,
                      fmt::format("p={} loss bf16 {:.6f} fp32 {:.6f} tol {:.4f}", p, loss16, loss32, loss_tol));
        CHECK(loss16 != loss32);  // bf16 rounding happened
        if (r == 0) MESSAGE(fmt::format("p={}: loss bf16 {:.6f} fp32 {:.6f} (tolerance {:.4f})", p, loss16, loss32, loss_tol));
        const auto g16 = parts(mixed, true), g32 = parts(fp32, true);
        std::lock_guard lock(mutex);
        for (std::size_t i = 0; i < g16.size(); ++i) {
          const double rel = relative_difference(g16[i], g32[i]);
          worst[0] = std::max(worst[0], rel);
          CHECK_MESSAGE(rel <= grad_tol, fmt::format("p={} rank {} gradient part {}: relative difference {:.4g} > {:.4g}",
                                                     p, r, i, rel, grad_tol));
        }
      });
      MESSAGE(fmt::format("variant {} p={}: worst gradient relative difference {:.4g} (tolerance {:.4g})", variant, p,
                          worst[0], grad_tol));
    }
  }
}

TEST_CASE("mixed precision: one AdamW step updates fp32 masters from fp32 gradients") {
  const GptConfig c = small_gpt(false);
  const Batch b = make_batch(c, 17);
  const GlobalGptWeights<float> global = init_global_gpt<float>(c, 19);
  ops::AdamWConfig adamw;
  adamw.learning_rate = 1e-2f;
  for (int p : {1, 2}) {
    run_ranks(p, [&](ThreadCommunicator& comm) {
      const int r = comm.rank();
      BufferPool pool;
      const SequenceLayout layout(b.seq, p, c.layer.zigzag);
      const Tensor<std::int32_t> tokens = shard_tokens(b.tokens, b.batch, layout, r);
      const Tensor<std::int32_t> targets = shard_tokens(b.targets, b.batch, layout, r);
      const StackPlan plan = mixed_plan(c.layers, 0);
      Fp32Model fp32(c, global, p, r);
      Bf16Model mixed(c, global, p, r);
      for (auto* m : {&fp32}) m->zero_gradients();
      mixed.zero_gradients();
      fp32.forward_backward(comm, pool, plan, b.seq, tokens.view(), targets.view());
      mixed.forward_backward(comm, pool, plan, b.seq, tokens.view(), targets.view());
      // The gradients are fp32 accumulators: most are not bf16 values.
      std::int64_t off_grid = 0, total = 0;
      for (std::span<float> g : parts(mixed, true))
        for (float x : g) off_grid += x != bf16_of(x), ++total;
      CHECK(off_grid > total / 2);
      const auto g16 = parts(mixed, true), g32 = parts(fp32, true);
      std::vector<std::vector<float>> before;
      for (std::span<float> w : parts(mixed, false)) before.emplace_back(w.begin(), w.end());
      fp32.optimizer_step(adamw);
      mixed.optimizer_step(adamw);
      // AdamW's first step moves w by -lr (g / (|g| + eps) + wd w) (m^ = g, v^ = g^2): from the same w, the two
      // updates differ by lr |g/(|g|+eps) - g'/(|g'|+eps)| plus each run's fp32 rounding: the update
      // u = m^ / (sqrt(v^) + eps) takes 8 roundings (m, v, the corrections, sqrt, +eps, the division; |u| <= 1),
      // lr (u + wd w) two more, w - (...) one of |w'| <= |w| + lr (1 + wd |w|): per run
      // <= 2^-24 (|w'| + 10 lr (1 + wd |w|)). The masters must not be rounded to bf16: that would move them by up
      // to 2^-9 |w|, far beyond this bound.
      const auto w16 = parts(mixed, false), w32 = parts(fp32, false);
      const double eps = adamw.epsilon, lr = adamw.learning_rate, wd = adamw.weight_decay;
      std::int64_t moved_off_grid = 0;
      for (std::size_t t = 0; t < w16.size(); ++t)
        for (std::size_t i = 0; i < w16[t].size(); ++i) {
          const double g = g16[t][i], h = g32[t][i], w0 = before[t][i];
          const double decay = (t == 0 ? (i >= w16[0].size() - 2 * std::size_t(c.layer.hidden) ? 0.0 : wd)
                                       : (t % 3 == 0 ? 0.0 : wd));  // the norms (last replicated rows, every third part) do not decay
          const double bound = lr * std::abs(g / (std::abs(g) + eps) - h / (std::abs(h) + eps)) +
                               2 * 0x1p-24 * (std::abs(w0) + 11 * lr * (1 + decay * std::abs(w0))) + 1e-30;
          const double diff = std::abs(double(w16[t][i]) - double(w32[t][i]));
          if (!(diff <= bound)) {
            FAIL_CHECK(fmt::format("rank {} part {} element {}: masters differ by {:.3g} > {:.3g}", r, t, i, diff, bound));
            return;
          }
          moved_off_grid += w16[t][i] != bf16_of(w16[t][i]);
        }
      CHECK(moved_off_grid > 0);  // fp32 masters: not on the bf16 grid
    });
  }
}

TEST_CASE("mixed precision: a checkpoint of a bf16 run holds its fp32 masters bit for bit and says compute_dtype bf16") {
  const GptConfig c = small_gpt(true);
  const Batch b = make_batch(c, 23);
  std::string folder = (std::filesystem::temp_directory_path() / "paradyse_bf16_XXXXXX").string();
  REQUIRE(::mkdtemp(folder.data()) != nullptr);
  const std::string path = folder + "/bf16.safetensors";
  ops::AdamWConfig adamw;
  const int p = 2;
  std::vector<double> continued(p), resumed(p);
  run_ranks(p, [&](ThreadCommunicator& comm) {
    const int r = comm.rank();
    BufferPool pool;
    const SequenceLayout layout(b.seq, p, c.layer.zigzag);
    const Tensor<std::int32_t> tokens = shard_tokens(b.tokens, b.batch, layout, r);
    const Tensor<std::int32_t> targets = shard_tokens(b.targets, b.batch, layout, r);
    const StackPlan plan = mixed_plan(c.layers, 2);
    const auto step = [&](Bf16Model& m) {
      m.zero_gradients();
      const double loss = m.forward_backward(comm, pool, plan, b.seq, tokens.view(), targets.view()).loss;
      m.optimizer_step(adamw);
      return loss;
    };
    Bf16Model trained(c, p, r, 29);
    step(trained);
    step(trained);
    save_checkpoint(comm, trained, path, {.optimizer_state = true, .extra = {}});
    Bf16Model loaded(c, p, r, 31);
    load_checkpoint(loaded, path, {.optimizer_state = true});
    const auto a = parts(trained, false), l = parts(loaded, false);
    for (std::size_t i = 0; i < a.size(); ++i) CHECK(std::equal(a[i].begin(), a[i].end(), l[i].begin()));
    CHECK(loaded.steps_taken() == trained.steps_taken());
    continued[std::size_t(r)] = step(trained);
    resumed[std::size_t(r)] = step(loaded);
  });
  CHECK(continued == resumed);
  std::string dtype;
  for (const auto& [key, value] : read_checkpoint_metadata(path))
    if (key == "compute_dtype") dtype = value;
  CHECK(dtype == "bf16");
  std::filesystem::remove_all(folder);
}

}  // namespace bf16_gpt_test
