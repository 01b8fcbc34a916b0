// The GPT (embedding, stack with a per-layer strategy plan, final norm, LM head, cross-entropy) on thread ranks
// against a plain float64 single-rank reference GPT: the loss and the gradient of every weight (embedding, each
// layer's shards, final norm, head) for p in {1, 2, 3, 4} and mixed plans; and training with changing plans gives
// the weights that training with one plan gives.
#include "paradyse/model/gpt.hpp"

#include "model/reference_transformer.hpp"
#include "strategy/harness.hpp"
#include "support/tolerance.hpp"

#include "paradyse/comm/threads.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

namespace {

using namespace paradyse;
using namespace paradyse::testing;
using Strategies = AllStrategies<>;
using Model = Gpt<Strategies>;
constexpr std::int32_t kIgnore = ops::cpu::kIgnoreIndex;

// ---- the float64 reference GPT -------------------------------------------------------------------------------------
// Returns the mean loss over counted targets; every gradient accumulates into `grad`. tokens, targets: [b * s].
double reference_gpt(const GptConfig& c, const GlobalGptWeights<double>& w, const std::vector<std::int32_t>& tokens,
                     const std::vector<std::int32_t>& targets, std::int64_t batch, std::int64_t seq,
                     GlobalGptWeights<double>& grad) {
  const std::int64_t h = c.layer.hidden, rows = batch * seq, vocab = c.vocab;
  const Tensor<double>& head = c.tied_head ? w.embedding : w.head;
  Tensor<double>& dhead = c.tied_head ? grad.embedding : grad.head;
  Tensor<double> x(Shape{batch, seq, h});
  for (std::int64_t i = 0; i < rows; ++i)
    for (std::int64_t k = 0; k < h; ++k) x.data()[i * h + k] = w.embedding(tokens[std::size_t(i)], k);
  const Tensor<double> hidden = ref::stack_forward(c.layer, w.layers, x);
  const Tensor<double> normed = ref::norm_forward(c.layer, hidden, w.final_gamma, w.final_beta);
  const Tensor<double> normed_rows = ref::as_tokens(normed);
  const Tensor<double> logits = ref::linear(normed_rows, head);  // [rows, V]
  std::int64_t counted = 0;
  for (std::int32_t t : targets) counted += t != kIgnore;
  double loss = 0.0;
  Tensor<double> dlogits(logits.shape());
  for (std::int64_t i = 0; i < rows; ++i) {
    const std::int32_t t = targets[std::size_t(i)];
    if (t == kIgnore) continue;
    double top = -std::numeric_limits<double>::infinity();
    for (std::int64_t v = 0; v < vocab; ++v) top = std::max(top, logits(i, v));
    double sum = 0.0;
    for (std::int64_t v = 0; v < vocab; ++v) sum += std::exp(logits(i, v) - top);
    const double lse = top + std::log(sum);
    loss += lse - logits(i, t);
    for (std::int64_t v = 0; v < vocab; ++v) dlogits(i, v) = std::exp(logits(i, v) - lse) / double(counted);
    dlogits(i, t) -= 1.0 / double(counted);
  }
  Tensor<double> dnormed(normed_rows.shape());
  ref::linear_backward(normed_rows, head, dlogits, dnormed, dhead);
  dnormed.reshape(normed.shape());
  const Tensor<double> dhidden = ref::norm_backward(c.layer, hidden, w.final_gamma, dnormed, grad.final_gamma, grad.final_beta);
  const Tensor<double> dx = ref::stack_backward(c.layer, w.layers, x, dhidden, grad.layers);
  for (std::int64_t i = 0; i < rows; ++i)
    for (std::int64_t k = 0; k < h; ++k) grad.embedding(tokens[std::size_t(i)], k) += dx.data()[i * h + k];
  return loss / double(counted);
}

// ---- cases ---------------------------------------------------------------------------------------------------------
struct GptCase {
  std::string name;
  GptConfig config;
  std::int64_t batch = 1, seq = 8;
  bool some_ignored = false;
};

// heads = 12 and ffn = 24 divide by every p in {1, 2, 3, 4}; one kv head (GQA, replicated) works for all of them.
std::vector<GptCase> gpt_cases() {
  std::vector<GptCase> cases;
  GptConfig causal;
  causal.layer = small_config(12, 12, 24);
  causal.layer.causal = causal.layer.zigzag = causal.layer.rope = true;
  causal.layers = 3;
  causal.vocab = 23;
  cases.push_back({"causal zigzag RoPE LayerNorm GELU untied head", causal, 1, 29, false});
  GptConfig other;
  other.layer = small_config(12, 1, 24);
  other.layer.norm = NormKind::rms_norm;
  other.layer.activation = Activation::swiglu;
  other.layers = 3;
  other.vocab = 17;
  other.tied_head = true;
  cases.push_back({"non-causal GQA(kv=1) RMSNorm SwiGLU tied head, ignored targets", other, 2, 19, true});
  return cases;
}

// Random global weights (norms away from 1 and 0, so their gradients matter) and a batch.
struct GptProblem {
  GlobalGptWeights<double> weights;
  std::vector<std::int32_t> tokens, targets;
};

GptProblem make_gpt_problem(const GptCase& test, std::uint64_t seed) {
  Rng rng(seed);
  GptProblem problem{init_global_gpt<double>(test.config, seed), {}, {}};
  rng.fill_uniform(problem.weights.final_gamma.span(), 0.5, 1.5);
  rng.fill_uniform(problem.weights.final_beta.span(), -0.5, 0.5);
  for (GlobalLayerWeights<double>& l : problem.weights.layers) {
    for (Tensor<double>* m : {&l.norm1_gamma, &l.norm2_gamma}) rng.fill_uniform(m->span(), 0.5, 1.5);
    for (Tensor<double>* m : {&l.norm1_beta, &l.norm2_beta}) rng.fill_uniform(m->span(), -0.5, 0.5);
  }
  const std::int64_t n = test.batch * test.seq;
  for (std::int64_t i = 0; i < n; ++i) {
    problem.tokens.push_back(std::int32_t(rng.below(std::uint64_t(test.config.vocab))));
    const bool ignored = test.some_ignored && rng.below(4) == 0;
    problem.targets.push_back(ignored ? kIgnore : std::int32_t(rng.below(std::uint64_t(test.config.vocab))));
  }
  return problem;
}

StackPlan plan_of(std::initializer_list<std::pair<const char*, const char*>> layers) {
  StackPlan plan;
  for (const auto& [attention, mlp] : layers) plan.push_back({Strategies::index_of(attention), Strategies::index_of(mlp)});
  return plan;
}

std::vector<StackPlan> mixed_plans() {
  return {plan_of({{"MegatronTS", "METP"}, {"UlyssesZ", "MegatronCZ"}, {"ColossalZ", "MegatronTS"}}),
          plan_of({{"METP", "UlyssesZ"}, {"MegatronCZ", "ColossalZ"}, {"MegatronTS", "METP"}})};
}

template <class T>
std::span<const T> span_of(TensorView<T> v) {
  return {v.data(), std::size_t(v.numel())};
}

}  // namespace

TEST_CASE("gpt: loss and every gradient match the float64 reference GPT for mixed plans, p = 1..4") {
  for (const GptCase& test : gpt_cases()) {
    const GptConfig& c = test.config;
    const GptProblem problem = make_gpt_problem(test, 11);
    GlobalGptWeights<double> grad(c);
    const double loss_ref = reference_gpt(c, problem.weights, problem.tokens, problem.targets, test.batch, test.seq, grad);
    const Tensor<double>& dhead_ref = c.tied_head ? grad.embedding : grad.head;
    for (int p : {1, 2, 3, 4}) {
      Findings findings;
      std::vector<double> losses(std::size_t(p), 0.0);
      run_ranks(p, [&](ThreadCommunicator& comm) {
        const int r = comm.rank();
        BufferPool pool;
        Model model(c, problem.weights, p, r);
        const SequenceLayout layout(test.seq, p, c.layer.zigzag);
        const Tensor<std::int32_t> tokens = shard_tokens(problem.tokens, test.batch, layout, r);
        const Tensor<std::int32_t> targets = shard_tokens(problem.targets, test.batch, layout, r);
        const std::vector<StackPlan> plans = mixed_plans();
        for (std::size_t k = 0; k < plans.size(); ++k) {
          const StackPlan& plan = plans[k];
          const std::string where = fmt::format("{} p={} rank {} plan {}", test.name, p, r, k);
          model.zero_gradients();
          const GptStepResult result = model.forward_backward(comm, pool, plan, test.seq, tokens.view(), targets.view());
          const double diff = std::abs(result.loss - loss_ref);
          if (!(diff <= kFloat32.atol + kFloat32.rtol * std::abs(loss_ref)))
            findings.fail(fmt::format("{}: loss {:.9g}, want {:.9g}", where, result.loss, loss_ref));
          losses[std::size_t(r)] = result.loss;
          findings.compare(span_of(model.embedding_gradient()), grad.embedding.span(), where + " embedding gradient");
          if (!c.tied_head) findings.compare(span_of(model.head_gradient()), dhead_ref.span(), where + " head gradient");
          findings.compare(model.final_gamma_gradient(), grad.final_gamma.span(), where + " final norm gamma gradient");
          if (c.layer.norm == NormKind::layer_norm)
            findings.compare(model.final_beta_gradient(), grad.final_beta.span(), where + " final norm beta gradient");
          for (int l = 0; l < c.layers; ++l) {
            const LayerWeights want = shard_of(grad.layers[std::size_t(l)], c.layer, p, r);
            const LayerWeights& got = model.stack().gradients()[std::size_t(l)];
            findings.compare(got.attention.packed.span(), want.attention.packed.span(), fmt::format("{} layer {} attention", where, l));
            findings.compare(got.mlp.packed.span(), want.mlp.packed.span(), fmt::format("{} layer {} mlp", where, l));
            findings.compare(got.norms.packed.span(), want.norms.packed.span(), fmt::format("{} layer {} norms", where, l));
          }
          if (pool.stats().in_use_bytes != 0) findings.fail(where + ": pool buffers still on loan");
        }
      });
      findings.check_all(fmt::format("{} p={}", test.name, p));
      for (double l : losses) CHECK(l == losses[0]);  // every rank returns the same loss
    }
  }
}

TEST_CASE("gpt: the model drawn from a seed is the same global model for every p") {
  GptConfig c = gpt_cases()[0].config;
  const GlobalGptWeights<float> global = init_global_gpt<float>(c, 5);
  for (int p : {1, 3}) {
    Findings findings;
    run_ranks(p, [&](ThreadCommunicator& comm) {
      Model drawn(c, p, comm.rank(), 5);
      Model given(c, global, p, comm.rank());
      findings.compare(drawn.replicated().span(), given.replicated().span(), "replicated weights", kFloat64);
      for (int l = 0; l < c.layers; ++l) {
        findings.compare(drawn.stack().weights()[std::size_t(l)].attention.packed.span(),
                         given.stack().weights()[std::size_t(l)].attention.packed.span(), "attention shard", kFloat64);
        findings.compare(drawn.stack().weights()[std::size_t(l)].mlp.packed.span(),
                         given.stack().weights()[std::size_t(l)].mlp.packed.span(), "mlp shard", kFloat64);
      }
    });
    findings.check_all(fmt::format("p={}", p));
  }
}

TEST_CASE("gpt: 3 AdamW steps with a different plan each step give the weights of 3 steps with one plan") {
  const GptCase test = gpt_cases()[0];
  const GptConfig& c = test.config;
  const int steps = 3;
  std::vector<GptProblem> batches;
  for (int s = 0; s < steps; ++s) batches.push_back(make_gpt_problem(test, 100 + std::uint64_t(s)));
  ops::AdamWConfig adamw;
  adamw.learning_rate = 1e-2f;
  for (int p : {2, 3}) {
    // weights[run][rank]: every layer's packed shards then the replicated pack, flattened.
    std::vector<std::vector<std::vector<float>>> weights(2, std::vector<std::vector<float>>(std::size_t(p)));
    std::vector<std::vector<double>> losses(2);
    for (int run = 0; run < 2; ++run) {
      run_ranks(p, [&](ThreadCommunicator& comm) {
        const int r = comm.rank();
        BufferPool pool;
        Model model(c, batches[0].weights, p, r);
        const SequenceLayout layout(test.seq, p, c.layer.zigzag);
        for (int s = 0; s < steps; ++s) {
          const StackPlan plan = run == 0 ? uniform_plan<Strategies>(std::size_t(c.layers), "MegatronTS")
                                          : mixed_plans()[std::size_t(s) % 2];
          const Tensor<std::int32_t> tokens = shard_tokens(batches[std::size_t(s)].tokens, test.batch, layout, r);
          const Tensor<std::int32_t> targets = shard_tokens(batches[std::size_t(s)].targets, test.batch, layout, r);
          model.zero_gradients();
          const double loss = model.forward_backward(comm, pool, plan, test.seq, tokens.view(), targets.view()).loss;
          model.optimizer_step(adamw);
          if (r == 0) losses[std::size_t(run)].push_back(loss);
        }
        std::vector<float>& out = weights[std::size_t(run)][std::size_t(r)];
        for (LayerWeights& w : model.stack().weights())
          for (Tensor<float>* t : {&w.attention.packed, &w.mlp.packed, &w.norms.packed}) out.insert(out.end(), t->span().begin(), t->span().end());
        out.insert(out.end(), model.replicated().span().begin(), model.replicated().span().end());
      });
    }
    INFO("p = " << p);
    CHECK_CLOSE(losses[1], losses[0], kFloat32);
    for (int r = 0; r < p; ++r) CHECK_CLOSE(weights[1][std::size_t(r)], weights[0][std::size_t(r)], kFloat32);
    // The weights moved: the comparison is not of two untouched models.
    const GptProblem& start = batches[0];
    CHECK(std::abs(weights[0][0].back() - float(start.weights.final_beta.data()[c.layer.hidden - 1])) > 1e-4);
  }
}

TEST_CASE("gpt: bad input is rejected with a message naming it") {
  GptConfig c = gpt_cases()[0].config;
  GptConfig bad = c;
  bad.vocab = 1;
  CHECK_THROWS_WITH_AS(bad.validate(), doctest::Contains("vocab = 1 must be at least 2"), Error);
  bad = c;
  bad.layers = 0;
  CHECK_THROWS_WITH_AS(bad.validate(), doctest::Contains("layers = 0"), Error);
  CHECK_THROWS_WITH_AS(Model(c, 5, 0, 1), doctest::Contains("divisible by the group size p = 5"), Error);
  Findings findings;  // doctest assertions stay on the main thread
  auto expect_error = [&](auto&& call, const std::string& want, int rank) {
    try {
      call();
      findings.fail(fmt::format("rank {}: no error, expected one containing \"{}\"", rank, want));
    } catch (const Error& e) {
      if (std::string(e.what()).find(want) == std::string::npos)
        findings.fail(fmt::format("rank {}: error \"{}\" does not contain \"{}\"", rank, e.what(), want));
    }
  };
  run_ranks(2, [&](ThreadCommunicator& comm) {
    const int r = comm.rank();
    BufferPool pool;
    Model model(c, 2, r, 1);
    const StackPlan plan = uniform_plan<Strategies>(3, "MegatronTS");
    Tensor<std::int32_t> tokens(Shape{1, 5}), targets(Shape{1, 5});
    // 12 tokens over 2 ranks (zigzag): 6 per rank, not 5.
    expect_error([&] { model.forward_backward(comm, pool, plan, 12, tokens.view(), targets.view()); },
                 "must be [b, n_r] with n_r = 6", r);
    Tensor<std::int32_t> tokens6(Shape{1, 6}), targets6(Shape{1, 6});
    targets6(0, 2) = 99;
    expect_error([&] { model.forward_backward(comm, pool, plan, 12, tokens6.view(), targets6.view()); },
                 "target 99 at local index 2 is outside [0, 23)", r);
    targets6.fill(kIgnore);
    expect_error([&] { model.forward_backward(comm, pool, plan, 12, tokens6.view(), targets6.view()); },
                 "no token of the batch has a target", r);
  });
  findings.check_all("bad input");
  CHECK_THROWS_WITH_AS(shard_tokens(std::vector<std::int32_t>(7), 1, SequenceLayout(8, 2, false), 0),
                       doctest::Contains("7 tokens given, expected b x s = 1 x 8"), Error);
}

namespace {

// Ranks whose state outlives run_ranks, as in a training loop: per rank a tracker (first, so it outlives what is
// charged to it), a model and a buffer pool; every call installs the rank's tracker.
class Trainer {
public:
  Trainer(const GptCase& test, const GlobalGptWeights<double>& start, int p) : test_(test), p_(p) {
    for (int r = 0; r < p; ++r) trackers_.push_back(std::make_unique<MemoryTracker>());
    models_.resize(std::size_t(p));
    pools_.resize(std::size_t(p));
    run([&](ThreadCommunicator&, int r) {
      models_[std::size_t(r)] = std::make_unique<Model>(test.config, start, p, r);
      pools_[std::size_t(r)] = std::make_unique<BufferPool>();
    });
  }
  ~Trainer() {
    run([&](ThreadCommunicator&, int r) {  // free on the rank's tracker
      models_[std::size_t(r)].reset();
      pools_[std::size_t(r)].reset();
    });
  }
  template <class Fn>
  void run(Fn&& fn) {
    run_ranks(p_, [&](ThreadCommunicator& comm) {
      ScopedTracker scoped(*trackers_[std::size_t(comm.rank())]);
      fn(comm, comm.rank());
    });
  }
  // One training step on `batch` of `seq` tokens; the pool is emptied after it.
  void step(const GptProblem& batch, std::int64_t seq) {
    run([&](ThreadCommunicator& comm, int r) {
      const SequenceLayout layout(seq, p_, test_.config.layer.zigzag);
      const Tensor<std::int32_t> x = shard_tokens(batch.tokens, 1, layout, r), y = shard_tokens(batch.targets, 1, layout, r);
      Model& model = *models_[std::size_t(r)];
      model.zero_gradients();
      model.forward_backward(comm, *pools_[std::size_t(r)], mixed_plans()[0], seq, x.view(), y.view());
      model.optimizer_step({});
      pools_[std::size_t(r)]->trim();
    });
  }
  MemoryTracker& tracker(int r) { return *trackers_[std::size_t(r)]; }
  Model& model(int r) { return *models_[std::size_t(r)]; }
  BufferPool& pool(int r) { return *pools_[std::size_t(r)]; }
  // Every weight of rank r, flattened.
  std::vector<float> weights(int r) {
    Model& m = model(r);
    std::vector<float> out(m.replicated().span().begin(), m.replicated().span().end());
    for (LayerWeights& w : m.stack().weights())
      for (Tensor<float>* t : {&w.attention.packed, &w.mlp.packed, &w.norms.packed}) out.insert(out.end(), t->span().begin(), t->span().end());
    return out;
  }

private:
  GptCase test_;
  int p_;
  std::vector<std::unique_ptr<MemoryTracker>> trackers_;
  std::vector<std::unique_ptr<Model>> models_;
  std::vector<std::unique_ptr<BufferPool>> pools_;
};

}  // namespace

TEST_CASE("gpt: a step that runs out of memory part way leaves the model as it was (recover_from_failed_step)") {
  const GptCase test = gpt_cases()[0];
  const int p = 2;
  GptCase long_case = test;
  long_case.seq = 4 * test.seq;
  const GptProblem first = make_gpt_problem(test, 21), last = make_gpt_problem(test, 22);
  const GptProblem too_long = make_gpt_problem(long_case, 23);
  // Two steps, and the memory the long step would need after the first.
  Trainer reference(test, first.weights, p), probe(test, first.weights, p);
  reference.step(first, test.seq);
  reference.step(last, test.seq);
  probe.step(first, test.seq);
  std::vector<std::size_t> before(p), needed(p);
  for (int r = 0; r < p; ++r) {
    before[std::size_t(r)] = probe.tracker(r).in_use();
    probe.tracker(r).reset_peak();
  }
  probe.step(too_long, long_case.seq);
  for (int r = 0; r < p; ++r) needed[std::size_t(r)] = probe.tracker(r).peak() - before[std::size_t(r)];
  // The same, with the long step between them under a cap that gives it half of what it needs.
  Trainer trainer(test, first.weights, p);
  trainer.step(first, test.seq);
  for (int r = 0; r < p; ++r) {
    REQUIRE(trainer.tracker(r).in_use() == before[std::size_t(r)]);
    trainer.tracker(r).set_cap(before[std::size_t(r)] + needed[std::size_t(r)] / 2);
  }
  CHECK_THROWS_AS(trainer.step(too_long, long_case.seq), OutOfMemory);
  // The recovery runs under the cap the step ran out of and allocates nothing (it built a second stack, gradients
  // included, while the first was alive, and ran out of memory itself: issue 15).
  std::vector<std::size_t> at_failure(p);
  for (int r = 0; r < p; ++r) {
    at_failure[std::size_t(r)] = trainer.tracker(r).in_use();
    trainer.tracker(r).reset_peak();
  }
  trainer.run([&](ThreadCommunicator&, int r) {
    trainer.model(r).recover_from_failed_step();
    trainer.pool(r).trim();
  });
  for (int r = 0; r < p; ++r) CHECK(trainer.tracker(r).peak() == at_failure[std::size_t(r)]);
  for (int r = 0; r < p; ++r) trainer.tracker(r).set_cap(MemoryTracker::kNoCap);
  for (int r = 0; r < p; ++r) CHECK(trainer.tracker(r).in_use() == before[std::size_t(r)]);  // the failed step kept nothing
  trainer.step(last, test.seq);
  const Tolerance exact{0, 0};
  for (int r = 0; r < p; ++r) CHECK_CLOSE(trainer.weights(r), reference.weights(r), exact);
}
