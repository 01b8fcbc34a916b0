// The strategies and the model stack through OpenMPI (one process per rank, run by mpiexec with 2 and 4 processes):
// a subset of the thread-rank tests. Every strategy alone and mixed plans over a 2-layer stack match the float64
// single-rank reference (computed in every process), so the strategies rely only on the Communicator concept.
#include "paradyse/comm/mpi.hpp"
#include "paradyse/model/stack.hpp"
#include "paradyse/strategy/strategies.hpp"

#include "strategy/harness.hpp"

#include <doctest/doctest.h>

namespace {

using namespace paradyse;
using namespace paradyse::testing;
using Strategies = AllStrategies<>;

}  // namespace

TEST_CASE("mpi strategies: uniform and mixed plans over a 2-layer stack match the float64 reference") {
  MpiCommunicator comm = MpiCommunicator::world();
  const int p = comm.size(), r = comm.rank();
  for (const SublayerCase& test : standard_cases(p)) {
    CAPTURE(test.name);
    const LayerConfig& c = test.config;
    std::vector<GlobalLayerWeights<double>> weights, dw;
    for (int l = 0; l < 2; ++l) {
      weights.push_back(make_problem(c, test.batch, test.length, 300 + std::uint64_t(l)).weights);
      dw.emplace_back(c);
    }
    const Problem inputs = make_problem(c, test.batch, test.length, 299);
    const Tensor<double> z_ref = ref::stack_forward(c, weights, inputs.x);
    const Tensor<double> dx_ref = ref::stack_backward(c, weights, inputs.x, inputs.dy, dw);
    std::vector<StackPlan> plans;
    for (std::size_t k = 0; k < Strategies::count; ++k) plans.push_back(StackPlan{{k, k}, {k, k}});
    for (std::size_t k = 0; k < Strategies::count; ++k)  // each strategy beside the next one, both orders
      plans.push_back(StackPlan{{k, (k + 1) % Strategies::count}, {(k + 2) % Strategies::count, (k + 3) % Strategies::count}});
    BufferPool pool;
    std::vector<LayerWeights> shards;
    for (int l = 0; l < 2; ++l) shards.push_back(shard_of(weights[std::size_t(l)], c, p, r));
    TransformerStack<Strategies> stack(c, std::move(shards), p);
    const SequenceLayout layout(test.length, p, c.zigzag);
    const Tensor<float> x = local_tokens(inputs.x, layout, r), dz = local_tokens(inputs.dy, layout, r);
    Findings findings;
    for (const StackPlan& plan : plans) {
      const std::string where = fmt::format("plan [{} {} | {} {}] rank {}", Strategies::name(plan[0].attention),
                                            Strategies::name(plan[0].mlp), Strategies::name(plan[1].attention),
                                            Strategies::name(plan[1].mlp), r);
      Tensor<float> z(x.shape()), dx(x.shape());
      stack.zero_gradients();
      stack.forward(comm, pool, plan, test.length, x.view(), z.view());
      stack.backward(comm, pool, dz.view(), dx.view());
      findings.compare(z, z_ref, layout, r, where + " output");
      findings.compare(dx, dx_ref, layout, r, where + " input gradient");
      for (int l = 0; l < 2; ++l) {
        const LayerWeights want = shard_of(dw[std::size_t(l)], c, p, r);
        findings.compare(stack.gradients()[std::size_t(l)].attention.packed.span(), want.attention.packed.span(), fmt::format("{} layer {} attention gradient", where, l));
        findings.compare(stack.gradients()[std::size_t(l)].mlp.packed.span(), want.mlp.packed.span(), fmt::format("{} layer {} mlp gradient", where, l));
        findings.compare(stack.gradients()[std::size_t(l)].norms.packed.span(), want.norms.packed.span(), fmt::format("{} layer {} norm gradients", where, l));
      }
    }
    findings.check_all(fmt::format("mpi rank {}", r));
  }
}
