// A user's own block composed from the library's strategies (examples/parallel_block.hpp: the GPT-J/PaLM parallel
// block z = x + Attention(Norm(x)) + Mlp(Norm(x))) on thread ranks, p = 1, 2, 3 with uneven sequence lengths,
// against a float64 single-rank reference of the same block written here from the plain reference sublayers
// (tests/model/reference_transformer.hpp): the output, the loss L = sum(z * t) (t random, so dL/dz = t), the input
// gradient and EVERY shard gradient of every rank (attention, MLP, the shared norm's gamma and beta, the unused
// norm2 rows zero), for each strategy on each branch (every strategy of the list runs the attention branch once and
// the MLP branch once, paired with another strategy on the other branch), on fresh random weights and inputs.
#include "../../examples/parallel_block.hpp"

#include "paradyse/strategy/strategies.hpp"
#include "strategy/harness.hpp"

#include <doctest/doctest.h>

#include <array>

namespace custom_block_test {

using namespace paradyse;
using namespace paradyse::testing;
using Strategies = AllStrategies<>;
using Matrix = ref::Matrix;

// The parallel block in float64, natural token order: z = x + Attention(n) + Mlp(n), n = Norm1(x).
Matrix reference_forward(const LayerConfig& c, const GlobalLayerWeights<double>& w, const Matrix& x) {
  const Matrix n = ref::norm_forward(c, x, w.norm1_gamma, w.norm1_beta);
  return ref::add(ref::add(x, ref::attention_forward(c, w, n)), ref::mlp_forward(c, w, n));
}
// dx (returned) = dz + Norm1'(Attention'(dz) + Mlp'(dz)); every weight gradient accumulates into dw.
Matrix reference_backward(const LayerConfig& c, const GlobalLayerWeights<double>& w, const Matrix& x, const Matrix& dz,
                          GlobalLayerWeights<double>& dw) {
  const Matrix n = ref::norm_forward(c, x, w.norm1_gamma, w.norm1_beta);
  const Matrix dn = ref::add(ref::attention_backward(c, w, n, dz, dw), ref::mlp_backward(c, w, n, dz, dw));
  return ref::add(dz, ref::norm_backward(c, x, w.norm1_gamma, dn, dw.norm1_gamma, dw.norm1_beta));
}

// Runs the block with `choice` on the case's ranks and compares everything with the reference; false when the
// strategies do not support the case (nothing run).
bool check_block(const SublayerCase& test, SublayerChoice choice, std::uint64_t seed) {
  const LayerConfig& c = test.config;
  const int p = test.ranks;
  {
    BufferPool pool;
    const SublayerContext ctx(c, p, test.batch, test.length, pool);
    const Strategies strategies;
    if (!strategies.supports(choice.attention, ctx) || !strategies.supports(choice.mlp, ctx)) return false;
  }
  const Problem problem = make_problem(c, test.batch, test.length, seed);
  GlobalLayerWeights<double> dw(c);
  const Matrix z_ref = reference_forward(c, problem.weights, problem.x);
  const Matrix dx_ref = reference_backward(c, problem.weights, problem.x, problem.dy, dw);
  double loss_ref = 0.0;
  for (std::int64_t i = 0; i < z_ref.numel(); ++i) loss_ref += z_ref.span()[std::size_t(i)] * problem.dy.span()[std::size_t(i)];
  Findings findings;
  run_ranks(p, [&](ThreadCommunicator& comm) {
    const int r = comm.rank();
    BufferPool pool;
    const SublayerContext ctx(c, p, test.batch, test.length, pool);
    const LayerWeights weights = shard_of(problem.weights, c, p, r);
    LayerWeights grads(c, p);
    const Tensor<float> x = local_tokens(problem.x, ctx.sequence, r), t = local_tokens(problem.dy, ctx.sequence, r);
    Tensor<float> z(x.shape()), dx(x.shape());
    const Strategies strategies;
    auto saved = custom::parallel_block_forward(strategies, choice, comm, ctx, weights, x.view(), z.view());
    std::array<double, 1> loss{0.0};
    for (std::int64_t i = 0; i < z.numel(); ++i) loss[0] += double(z.span()[std::size_t(i)]) * double(t.span()[std::size_t(i)]);
    comm.all_reduce(std::span<const double>(loss), std::span<double>(loss), ReduceOp::sum);
    Tensor<float> norm_partial(Shape{1, 4, c.hidden});
    norm_partial.fill(0.0f);
    custom::parallel_block_backward(strategies, comm, ctx, weights, saved, t.view(), dx.view(), grads,
                                    norm_partial.view().reshape(Shape{4, c.hidden}));
    NormWeights* norms[] = {&grads.norms};
    reduce_norm_gradients(comm, norm_partial.view(), std::span<NormWeights*>(norms));
    const LayerWeights want = shard_of(dw, c, p, r);
    const std::string where = fmt::format("rank {}", r);
    findings.compare(z, z_ref, ctx.sequence, r, where + " output");
    findings.compare(loss, std::array<double, 1>{loss_ref}, where + " loss");
    findings.compare(dx, dx_ref, ctx.sequence, r, where + " input gradient");
    findings.compare(grads.attention.packed.span(), want.attention.packed.span(), where + " attention shard gradient");
    findings.compare(grads.mlp.packed.span(), want.mlp.packed.span(), where + " mlp shard gradient");
    findings.compare(grads.norms.packed.span(), want.norms.packed.span(), where + " norm gradients");
  });
  findings.check_all(fmt::format("parallel block [{} | {}] {}", Strategies::name(choice.attention),
                                 Strategies::name(choice.mlp), test.name));
  return true;
}

}  // namespace custom_block_test

TEST_CASE("a user's parallel attention + MLP block built from the strategies matches its float64 reference") {
  using custom_block_test::Strategies;
  for (int p : {1, 2, 3}) {
    // MHA causal RoPE zigzag RMSNorm b = 2, and GQA causal SwiGLU LayerNorm b = 2: lengths 4p + 3 and 3p + 1,
    // uneven over p = 2 and 3.
    const auto cases = paradyse::testing::standard_cases(p);
    std::array<int, Strategies::count> attention_runs{}, mlp_runs{};
    for (std::size_t i : {std::size_t(1), std::size_t(2)})
      for (std::size_t a = 0; a < Strategies::count; ++a) {
        const paradyse::SublayerChoice choice{a, (a + 2) % Strategies::count};
        if (!custom_block_test::check_block(cases[i], choice, 2300 + 10 * std::uint64_t(p) + i)) continue;
        ++attention_runs[a];
        ++mlp_runs[choice.mlp];
      }
    int attention_strategies = 0, mlp_strategies = 0;
    for (std::size_t s = 0; s < Strategies::count; ++s) {
      attention_strategies += attention_runs[s] > 0;
      mlp_strategies += mlp_runs[s] > 0;
    }
    INFO("p = " << p);
    CHECK(attention_strategies >= 2);
    CHECK(mlp_strategies >= 2);
  }
}
