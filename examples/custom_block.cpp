// examples/custom_block.cpp: a user's own model composed from paradyse's strategies (docs/CONTRACT.md).
//
// The model alternates a block the library does not ship, the parallel attention + MLP block of GPT-J and PaLM
// (examples/parallel_block.hpp: z = x + Attention(Norm(x)) + Mlp(Norm(x))), with the library's pre-norm layer
// (model/layer.hpp), between a byte embedding and a head tied to it:
//
//   tokens [1, n_r] -> embedding -> parallel, standard, parallel, standard, ... -> final norm -> logits [1, n_r, 256]
//
// Every block's attention and MLP branch runs one of the library's strategies (AllStrategies: a Switchable of the
// five), chosen for each step's input by the exact planner from the cost model (a built-in hardware profile), per
// layer and per sublayer. The steps are windows of the bundled corpus (data/corpus/) drawn stratified by length, on
// thread ranks; each step prints the loss and the plan. The replicated embedding and norms reduce their gradients
// once per step; the strategies hand back their shards' gradients already reduced; AdamW updates every tensor.
#include "parallel_block.hpp"

#include "paradyse/cli/flags.hpp"
#include "paradyse/cli/model_flags.hpp"
#include "paradyse/comm/threads.hpp"
#include "paradyse/cost/builtin_profiles.hpp"
#include "paradyse/cost/from_config.hpp"
#include "paradyse/data/corpus.hpp"
#include "paradyse/data/packing.hpp"
#include "paradyse/model/gpt.hpp"  // shard_tokens
#include "paradyse/model/layer.hpp"
#include "paradyse/plan/planner.hpp"
#include "paradyse/strategy/strategies.hpp"

#include <fmt/format.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <string>
#include <variant>
#include <vector>

namespace pd = paradyse;
using Strategies = pd::AllStrategies<>;
using Cpu = pd::ops::Cpu;

namespace {

struct Options {
  int steps = 6, ranks = 3, layers = 4;
  std::int64_t hidden = 48, heads = 6, min_len = 32, max_len = 384;
  double budget_mib = 0, lr = 3e-3;
  std::string profile = "A100-SXM4-80GB-x8";
};

// One rank's model: every block's shards, the replicated embedding (= head) and final norm; gradients and AdamW
// moments of the same shapes.
struct Model {
  std::vector<pd::LayerWeights> blocks;
  pd::Tensor<float> embedding;   // [256, h], replicated
  pd::Tensor<float> final_norm;  // [2, h]: gamma, beta, replicated
  static bool parallel(std::size_t layer) { return layer % 2 == 0; }
  // Every tensor, for the optimizer.
  std::vector<pd::Tensor<float>*> tensors() {
    std::vector<pd::Tensor<float>*> all{&embedding, &final_norm};
    for (pd::LayerWeights& b : blocks)
      for (pd::Tensor<float>* t : {&b.attention.packed, &b.mlp.packed, &b.norms.packed}) all.push_back(t);
    return all;
  }
};

Model init_model(const pd::LayerConfig& c, int layers, int ranks, int rank, std::uint64_t seed) {
  Model m;
  for (int l = 0; l < layers; ++l) m.blocks.push_back(pd::init_shard(c, ranks, rank, seed + std::uint64_t(l)));
  m.embedding = pd::Tensor<float>(pd::Shape{256, c.hidden});
  pd::Rng rng(seed ^ 0xe5b);  // the same on every rank
  rng.fill_normal(m.embedding.span(), 0.02);
  m.final_norm = pd::Tensor<float>(pd::Shape{2, c.hidden});
  m.final_norm.fill(0.0f);
  for (std::int64_t i = 0; i < c.hidden; ++i) m.final_norm(0, i) = 1.0f;
  return m;
}

// Zeros of the model's shapes: gradients and AdamW moments.
Model zeros_like(const Model& m, const pd::LayerConfig& c, int ranks) {
  Model z;
  for (std::size_t l = 0; l < m.blocks.size(); ++l) z.blocks.push_back(pd::LayerWeights::zeros(c, ranks));
  z.embedding = pd::Tensor<float>(m.embedding.shape());
  z.final_norm = pd::Tensor<float>(m.final_norm.shape());
  for (pd::Tensor<float>* t : z.tensors()) t->fill(0.0f);
  return z;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  pd::cli::Flags flags("custom_block",
                            "Trains a model of the user's own blocks (parallel attention + MLP, alternating with the "
                            "library's pre-norm layer) on the bundled corpus, every sublayer's strategy planned per step.");
  flags.integer("--steps", o.steps, 1, 100000, "training steps (one corpus window each)");
  flags.integer("--ranks", o.ranks, 1, 64, "thread ranks");
  flags.integer("--layers", o.layers, 1, 64, "blocks (even: parallel, odd: standard)");
  flags.integer("--hidden", o.hidden, std::int64_t(8), std::int64_t(4096), "hidden width h");
  flags.integer("--heads", o.heads, std::int64_t(1), std::int64_t(256), "attention heads (a multiple of --ranks)");
  flags.integer("--min-len", o.min_len, std::int64_t(2), std::int64_t(1) << 20, "shortest window in tokens");
  flags.integer("--max-len", o.max_len, std::int64_t(2), std::int64_t(1) << 20, "longest window in tokens");
  flags.number("--budget-mib", o.budget_mib, {.min = 0, .max = 1 << 30}, "memory budget per rank for the planner (0: the profile's)");
  flags.number("--lr", o.lr, {.min = 0, .max = 1, .min_open = true}, "AdamW learning rate");
  flags.choice("--profile", o.profile, {"A100-SXM4-80GB-x8", "H100-SXM-80GB-x8", "H200-SXM-141GB-x8"}, "cost model's hardware");
  flags.parse(argc, argv);
  try {
    pd::cli::head_dim_of(o.hidden, o.heads);
  } catch (const std::invalid_argument& e) {
    flags.fail(e.what());
  }
  if (o.heads % o.ranks != 0)
    flags.fail(fmt::format("--heads {} is not a multiple of --ranks {}: each rank takes whole heads", o.heads, o.ranks));
  if (o.min_len > o.max_len) flags.fail("--min-len must be at most --max-len");

  pd::LayerConfig layer = pd::LayerConfig::make(o.hidden, o.heads);
  layer.causal = layer.rope = layer.zigzag = true;
  layer.validate_for(o.ranks);

  // The planner's view: two kinds of layer, alternating, each with an attention and an MLP sublayer.
  pd::plan::ModelConfig model;
  model.kinds = {{"parallel", pd::cost::shape_of(layer, 1, 1)}, {"standard", pd::cost::shape_of(layer, 1, 1)}};
  for (int l = 0; l < o.layers; ++l) model.layer_kinds.push_back(Model::parallel(std::size_t(l)) ? 0 : 1);
  model.precision = {4, 4, 8};  // float32 weights and gradients, two AdamW moments
  const pd::cost::HardwareProfile hardware = pd::cost::builtin_profile(o.profile);
  const std::int64_t budget = o.budget_mib > 0 ? std::int64_t(o.budget_mib * 1024 * 1024) : hardware.usable_memory_bytes();

  const std::vector<pd::data::Document> docs =
      pd::data::load(pd::data::ensure_extracted("data/corpus/sotu.tar.xz", "build", "sotu"));
  pd::data::WindowSampler sampler(docs, o.min_len, o.max_len, 7);
  std::vector<pd::data::Window> windows = sampler.stratified(o.steps);
  sampler.shuffle(windows);
  const std::vector<pd::data::Step> steps = pd::data::pack_steps(windows, 0, 2 * o.ranks);  // one window a step

  // Every step's plan, from the cost model: per layer, an attention and an MLP strategy of the list.
  std::vector<pd::plan::Plan> plans;
  std::vector<std::vector<pd::SublayerChoice>> plan_choices;
  for (const pd::data::Step& step : steps) {
    const pd::plan::CostTable table = pd::plan::build_cost_table(model, hardware, o.ranks, pd::plan::Batch::single(step.length));
    plans.push_back(pd::plan::plan_exact(table, budget));
    plan_choices.emplace_back();
    for (const pd::plan::LayerPlan& l : plans.back().layers)
      plan_choices.back().push_back({Strategies::index_of(plans.back().strategy_name(l.strategies.attention)),
                                     Strategies::index_of(plans.back().strategy_name(l.strategies.mlp))});
  }

  pd::run_ranks(o.ranks, [&](pd::ThreadCommunicator& comm) {
    const int p = comm.size(), r = comm.rank();
    Model m = init_model(layer, o.layers, p, r, 1234), grad = zeros_like(m, layer, p),
          adam_m = zeros_like(m, layer, p), adam_v = zeros_like(m, layer, p);
    pd::BufferPool pool;
    const Strategies strategies;
    for (int step = 0; step < o.steps; ++step) {
      // The input, its plan, and this rank's tokens.
      const pd::data::Step& batch = steps[std::size_t(step)];
      std::vector<std::int32_t> inputs, targets;
      pd::data::step_tokens(batch, docs, pd::ops::cpu::kIgnoreIndex, inputs, targets);
      const std::int64_t s = batch.length, h = layer.hidden;
      const pd::plan::Plan& plan = plans[std::size_t(step)];
      const std::vector<pd::SublayerChoice>& choices = plan_choices[std::size_t(step)];
      const pd::SublayerContext ctx(layer, p, 1, s, pool);
      const pd::Tensor<std::int32_t> tokens = pd::shard_tokens(inputs, 1, ctx.sequence, r);
      const pd::Tensor<std::int32_t> labels = pd::shard_tokens(targets, 1, ctx.sequence, r);
      const std::int64_t n = ctx.local_rows(r);

      // Forward: embedding, the blocks (each keeps what its backward needs), final norm, tied head, loss.
      std::vector<pd::Tensor<float>> acts;  // the input of every block, then the stack's output
      acts.emplace_back(pd::Shape{1, ctx.local_tokens(r), h});
      Cpu::embedding_forward(tokens.view(), m.embedding.view(), acts.back().view());
      std::vector<std::variant<custom::ParallelBlockSaved<Strategies>, pd::LayerSaved<Strategies>>> saved;
      for (std::size_t l = 0; l < m.blocks.size(); ++l) {
        pd::Tensor<float> out(acts.back().shape());
        if (Model::parallel(l))
          saved.emplace_back(custom::parallel_block_forward(strategies, choices[l], comm, ctx, m.blocks[l], acts.back().view(), out.view()));
        else
          saved.emplace_back(pd::layer_forward(strategies, choices[l], comm, ctx, m.blocks[l], acts.back().view(), out.view()));
        acts.push_back(std::move(out));
      }
      pd::Tensor<float> normed(pd::Shape{n, h}), mean(pd::Shape{n}), rstd(pd::Shape{n}), logits(pd::Shape{n, 256});
      const pd::TensorView<const float> last = pd::TensorView<const float>(acts.back().view()).reshape(pd::Shape{n, h});
      pd::norm_forward<Cpu>(layer, last, m.final_norm.span().first(std::size_t(h)), m.final_norm.span().last(std::size_t(h)),
                            normed.view(), mean.view(), rstd.view());
      Cpu::matmul(normed.view(), pd::ops::Transpose::no, m.embedding.view(), pd::ops::Transpose::yes, logits.view());
      std::array<std::int64_t, 1> counted{0};
      for (std::int32_t t : labels.span()) counted[0] += t != pd::ops::cpu::kIgnoreIndex;
      comm.all_reduce(std::span<const std::int64_t>(counted), std::span<std::int64_t>(counted), pd::ReduceOp::sum);
      const pd::ops::cpu::CrossEntropyResult ce = Cpu::cross_entropy_forward_backward(
          logits.view(), labels.view().reshape(pd::Shape{n}), logits.view(), 1.0f / float(counted[0]));
      std::array<double, 1> loss{ce.loss_sum};
      comm.all_reduce(std::span<const double>(loss), std::span<double>(loss), pd::ReduceOp::sum);

      // Backward: head and final norm, the blocks in reverse, the embedding; then one reduction of the replicated
      // weights' gradients and one of the blocks' norms (the strategies' shard gradients are already reduced).
      pd::Tensor<float> dnormed(pd::Shape{n, h}), dx(acts.back().shape());
      Cpu::matmul(logits.view(), pd::ops::Transpose::no, m.embedding.view(), pd::ops::Transpose::no, dnormed.view());
      Cpu::matmul(logits.view(), pd::ops::Transpose::yes, normed.view(), pd::ops::Transpose::no, grad.embedding.view(), 1.0f, 1.0f);
      dx.fill(0.0f);
      pd::norm_backward<Cpu>(layer, last, m.final_norm.span().first(std::size_t(h)), mean.view(), rstd.view(), dnormed.view(),
                             dx.view().reshape(pd::Shape{n, h}), grad.final_norm.span().first(std::size_t(h)),
                             grad.final_norm.span().last(std::size_t(h)));
      pd::Tensor<float> norm_partial(pd::Shape{std::int64_t(m.blocks.size()), 4, h});
      norm_partial.fill(0.0f);
      for (std::size_t l = m.blocks.size(); l-- > 0;) {
        pd::Tensor<float> dinput(dx.shape());
        const pd::TensorView<float> partial = norm_partial.view().slice(0, std::int64_t(l), 1).reshape(pd::Shape{4, h});
        if (auto* block = std::get_if<custom::ParallelBlockSaved<Strategies>>(&saved[l]))
          custom::parallel_block_backward(strategies, comm, ctx, m.blocks[l], *block, dx.view(), dinput.view(), grad.blocks[l], partial);
        else
          pd::layer_backward(strategies, comm, ctx, m.blocks[l], std::get<pd::LayerSaved<Strategies>>(saved[l]), dx.view(),
                             dinput.view(), grad.blocks[l], partial);
        dx = std::move(dinput);
      }
      Cpu::embedding_backward(tokens.view(), dx.view(), grad.embedding.view());
      std::vector<pd::NormWeights*> norms;
      for (pd::LayerWeights& g : grad.blocks) norms.push_back(&g.norms);
      pd::reduce_norm_gradients(comm, norm_partial.view(), std::span<pd::NormWeights*>(norms));
      for (pd::Tensor<float>* t : {&grad.embedding, &grad.final_norm}) comm.all_reduce(t->span(), t->span(), pd::ReduceOp::sum);

      // AdamW on every tensor, then the gradients back to zero.
      const std::vector<pd::Tensor<float>*> params = m.tensors(), grads = grad.tensors(), ms = adam_m.tensors(), vs = adam_v.tensors();
      for (std::size_t i = 0; i < params.size(); ++i) {
        Cpu::adamw_step(params[i]->view(), grads[i]->view(), ms[i]->view(), vs[i]->view(), {.learning_rate = float(o.lr)}, step + 1);
        grads[i]->fill(0.0f);
      }
      pd::check(std::isfinite(loss[0]), "step {}: the loss is not finite", step + 1);
      if (r == 0) {
        std::string layers;
        for (std::size_t l = 0; l < choices.size(); ++l)
          layers += fmt::format("{}{} {}/{}", l ? ", " : "", Model::parallel(l) ? "P" : "S", Strategies::name(choices[l].attention),
                                Strategies::name(choices[l].mlp));
        fmt::print("step {:3}  s {:5}  loss {:.4f}  plan [{}]  predicted {:.3f} ms\n", step + 1, s,
                   loss[0] / double(counted[0]), layers, plan.time_s * 1e3);
      }
    }
  });
  return 0;
}
