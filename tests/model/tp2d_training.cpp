// 2-D tensor parallelism in the GPT (strategy/tp2d.hpp in MeshStrategies, the stack's tp_x): a group of
// tp_x x tp_y ranks running Tp2d in some sublayers and the other strategies in the rest, switching per layer with no
// redistribution, trains as the same group running MegatronTS everywhere (itself checked against the float64
// reference in tests/strategy): the loss of every step and every gradient of every rank, grids 2x2, 2x3, 3x2 and 4x2,
// causal RoPE zigzag with GQA and SwiGLU, batch 2. A sequence Tp2d cannot split evenly is refused by name.
#include "paradyse/comm/threads.hpp"
#include "paradyse/model/gpt.hpp"
#include "strategy/harness.hpp"
#include "support/tolerance.hpp"

#include <doctest/doctest.h>

#include <cstdint>
#include <span>
#include <vector>

using namespace paradyse;
using namespace paradyse::testing;

namespace tp2d_training_test {

using Strategies = MeshStrategies<>;
using Model = Gpt<Strategies>;

struct Run {
  std::vector<double> losses;                     // per step, rank 0's
  std::vector<std::vector<float>> gradients;      // per rank: every gradient after the last step, concatenated
};

// Trains `steps` steps of `plan` on a group of tp_x x tp_y thread ranks (the grid set on the stack).
Run train(const GptConfig& config, int tp_x, int tp_y, const StackPlan& plan, std::int64_t batch, std::int64_t seq,
          int steps) {
  const int p = tp_x * tp_y;
  Rng rng(11);
  const auto n = static_cast<std::size_t>(steps);
  std::vector<std::vector<std::int32_t>> tokens(n), targets(n);
  for (int k = 0; k < steps; ++k)
    for (std::int64_t i = 0; i < batch * seq; ++i) {
      tokens[std::size_t(k)].push_back(std::int32_t(rng.next_u64() % std::uint64_t(config.vocab)));
      targets[std::size_t(k)].push_back(std::int32_t(rng.next_u64() % std::uint64_t(config.vocab)));
    }
  Run run;
  run.losses.resize(std::size_t(steps));
  run.gradients.resize(std::size_t(p));
  // epsilon 1e-3, not 1e-8: with a tiny epsilon AdamW's first step is lr * sign(g), so a gradient near 0 whose sign
  // two strategies' reduction orders round differently moves its weight by 2 lr, and the next losses differed by
  // 3.6e-5 of their value on a Zen 5 (AVX-512 OpenBLAS). With epsilon above the gradients' rounding the step is
  // Lipschitz in g (lr / epsilon), and the runs stay within the 1e-5 the test asks of them.
  const ops::AdamWConfig adamw{.learning_rate = 0.01f, .epsilon = 1e-3f};
  run_ranks(p, [&](ThreadCommunicator& comm) {
    Model model(config, p, comm.rank(), 42);
    model.stack().set_tp_x(comm, tp_x);
    BufferPool pool;
    const SequenceLayout layout(seq, p, config.layer.zigzag);
    for (int k = 0; k < steps; ++k) {
      const Tensor<std::int32_t> x = shard_tokens(tokens[std::size_t(k)], batch, layout, comm.rank());
      const Tensor<std::int32_t> y = shard_tokens(targets[std::size_t(k)], batch, layout, comm.rank());
      model.zero_gradients();
      const GptStepResult r = model.forward_backward(comm, pool, plan, seq, x.view(), y.view());
      if (k + 1 < steps) model.optimizer_step(adamw);
      if (comm.rank() == 0) run.losses[std::size_t(k)] = r.loss;
    }
    std::vector<float>& mine = run.gradients[std::size_t(comm.rank())];
    for (const LayerWeights& g : model.stack().gradients())
      for (const Tensor<float>* t : {&g.attention.packed, &g.mlp.packed, &g.norms.packed})
        mine.insert(mine.end(), t->span().begin(), t->span().end());
    mine.insert(mine.end(), model.replicated_gradient().span().begin(), model.replicated_gradient().span().end());
  });
  return run;
}

GptConfig tp2d_config(int tp_x, int tp_y) {
  const int p = tp_x * tp_y;
  GptConfig config;
  config.layer = small_config(2 * p, p, 2 * p);  // GQA: 2 query heads per kv head
  config.layer.hidden = 6 * tp_x;
  config.layer.causal = config.layer.rope = config.layer.zigzag = true;
  config.layer.norm = NormKind::rms_norm;
  config.layer.activation = Activation::swiglu;
  config.layers = 3;
  config.vocab = 23;
  return config;
}


TEST_CASE("Tp2d in the GPT: switching per layer with the other strategies trains as all-MegatronTS (2x2, 2x3, 3x2, 4x2)") {
  const std::size_t t2 = Strategies::index_of("Tp2d"), ts = Strategies::index_of("MegatronTS");
  const std::size_t metp = Strategies::index_of("METP"), uz = Strategies::index_of("UlyssesZ");
  const StackPlan mixed{{t2, metp}, {uz, t2}, {t2, t2}};
  const StackPlan megatron{{ts, ts}, {ts, ts}, {ts, ts}};
  for (const auto& [tp_x, tp_y] : std::vector<std::pair<int, int>>{{2, 2}, {2, 3}, {3, 2}, {4, 2}}) {
    CAPTURE(tp_x);
    CAPTURE(tp_y);
    const GptConfig config = tp2d_config(tp_x, tp_y);
    const std::int64_t seq = 4 * tp_x * tp_y, batch = 2;  // a multiple of the 2C zigzag chunks
    const Run want = train(config, tp_x, tp_y, megatron, batch, seq, 3);
    const Run got = train(config, tp_x, tp_y, mixed, batch, seq, 3);
    for (std::size_t k = 0; k < want.losses.size(); ++k) {
      INFO("step ", k, ": MegatronTS ", want.losses[k], ", mixed with Tp2d ", got.losses[k]);
      CHECK(std::abs(got.losses[k] - want.losses[k]) <= 1e-5 * std::abs(want.losses[k]));
    }
    for (std::size_t r = 0; r < want.gradients.size(); ++r) {
      INFO("rank ", r, "'s gradients");
      CHECK(first_mismatch(std::span<const float>(got.gradients[r]), std::span<const float>(want.gradients[r]),
                           kFloat32) == "");
    }
  }
}

TEST_CASE("Tp2d in the GPT: a sequence that does not split evenly over the grid is refused, naming the sizes") {
  const GptConfig config = tp2d_config(2, 2);
  const std::size_t t2 = Strategies::index_of("Tp2d");
  const StackPlan plan{{t2, t2}, {t2, t2}, {t2, t2}};
  CHECK_THROWS_WITH_AS(train(config, 2, 2, plan, 1, 10, 1), doctest::Contains("s = 10 splits unevenly over 4 ranks"),
                       Error);
}

}  // namespace tp2d_training_test
