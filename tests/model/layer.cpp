// The pre-norm layer on thread ranks against the float64 reference layer: output, input gradient, every shard
// gradient and the (all-reduced) norm gradients, for every (attention, MLP) strategy pair of the list.
#include "paradyse/model/layer.hpp"

#include "paradyse/strategy/strategies.hpp"
#include "strategy/harness.hpp"

#include <doctest/doctest.h>

namespace {

using namespace paradyse;
using namespace paradyse::testing;
using Strategies = AllStrategies<>;

void check_layer(const SublayerCase& test, SublayerChoice choice) {
  const LayerConfig& c = test.config;
  const Problem problem = make_problem(c, test.batch, test.length, 21);
  GlobalLayerWeights<double> dw(c);
  const Tensor<double> z_ref = ref::layer_forward(c, problem.weights, problem.x);
  const Tensor<double> dx_ref = ref::layer_backward(c, problem.weights, problem.x, problem.dy, dw);
  Findings findings;
  const int p = test.ranks;
  run_ranks(p, [&](ThreadCommunicator& comm) {
    const int r = comm.rank();
    BufferPool pool;
    const SublayerContext ctx(c, p, test.batch, test.length, pool);
    const LayerWeights weights = shard_of(problem.weights, c, p, r);
    LayerWeights grads(c, p);
    const Tensor<float> x = local_tokens(problem.x, ctx.sequence, r), dz = local_tokens(problem.dy, ctx.sequence, r);
    Tensor<float> z(x.shape()), dx(x.shape());
    const Strategies strategies;
    auto saved = layer_forward(strategies, choice, comm, ctx, weights, x.view(), z.view());
    Tensor<float> norm_partial(Shape{1, 4, c.hidden});
    layer_backward(strategies, comm, ctx, weights, saved, dz.view(), dx.view(), grads, norm_partial.view().reshape(Shape{4, c.hidden}));
    NormWeights* norms[] = {&grads.norms};
    reduce_norm_gradients(comm, norm_partial.view(), std::span<NormWeights*>(norms));
    const LayerWeights want = shard_of(dw, c, p, r);
    const std::string where = fmt::format("rank {}", r);
    findings.compare(z, z_ref, ctx.sequence, r, where + " output");
    findings.compare(dx, dx_ref, ctx.sequence, r, where + " input gradient");
    findings.compare(grads.attention.packed.span(), want.attention.packed.span(), where + " attention shard gradient");
    findings.compare(grads.mlp.packed.span(), want.mlp.packed.span(), where + " mlp shard gradient");
    findings.compare(grads.norms.packed.span(), want.norms.packed.span(), where + " norm gradients");
  });
  findings.check_all(fmt::format("layer [{} | {}] {}", Strategies::name(choice.attention), Strategies::name(choice.mlp), test.name));
}

}  // namespace

TEST_CASE("layer: every (attention, MLP) strategy pair matches the float64 reference layer") {
  for (int p : {1, 2, 3, 4, 8}) {
    const auto cases = standard_cases(p);
    for (std::size_t a = 0; a < Strategies::count; ++a)
      for (std::size_t m = 0; m < Strategies::count; ++m)
        for (std::size_t i = 0; i < cases.size(); ++i)
          if ((i + a + m) % 2 == 0 || p == 3) check_layer(cases[i], SublayerChoice{a, m});  // a sample on most p
  }
}
