// The strategies and the model stack through OpenMPI (one process per rank, run by mpiexec with 2 and 4 processes):
// a subset of the thread-rank tests. Every strategy alone and mixed plans over a 2-layer stack match the float64
// single-rank reference (computed in every process), so the strategies rely only on the Communicator concept. The 2D
// tensor-parallel linear and MLP run on every [tp_x, tp_y] grid the processes form (1x2 and 2x1 on 2; 2x2, 1x4 and
// 4x1 on 4), their groups split from the world communicator.
#include "paradyse/comm/mpi.hpp"
#include "paradyse/core/rng.hpp"
#include "paradyse/mesh/device_mesh.hpp"
#include "paradyse/model/stack.hpp"
#include "paradyse/strategy/strategies.hpp"
#include "paradyse/strategy/tp2d_linear.hpp"

#include "ops/reference.hpp"
#include "strategy/harness.hpp"
#include "strategy/tp2d_reference.hpp"

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

TEST_CASE("mpi tp2d: the 2D tensor-parallel linear (both directions) and MLP on every grid match the float64 reference") {
  MpiCommunicator world = MpiCommunicator::world();
  const int p = world.size(), r = world.rank();
  std::uint64_t seed = 700;
  for (int gx = 1; gx <= p; ++gx) {
    if (p % gx != 0) continue;
    const int gy = p / gx;
    CAPTURE(gx);
    CAPTURE(gy);
    const DeviceMesh mesh({{"tp_x", gx}, {"tp_y", gy}});
    Tp2dGrid<MpiCommunicator> grid = Tp2dGrid<MpiCommunicator>::make(mesh, world);
    const int i = mesh.coordinate(r, "tp_x"), j = mesh.coordinate(r, "tp_y");
    const std::string where = fmt::format("grid {}x{} rank ({}, {})", gx, gy, i, j);
    BufferPool pool;
    Findings findings;
    const std::int64_t T = 12, h = 12, f = 24;  // divisible by every grid side of 1, 2 and 4
    // The linear y = x W, A -> B (gather over tp_y, reduce-scatter over tp_x) and B -> A.
    for (bool a_to_b : {true, false}) {
      Rng rng(seed++);  // the same seed in every process: the same global problem
      const Tensor<double> x = random_uniform<double>(Shape{T, h}, rng), w = random_uniform<double>(Shape{h, f}, rng);
      const Tensor<double> dy = random_uniform<double>(Shape{T, f}, rng);
      const Tensor<double> y = product(x, false, w, false), dx = product(dy, false, w, true);
      const Tensor<double> dw = product(x, true, dy, false);
      const int g = a_to_b ? j : i, G = a_to_b ? gy : gx, s = a_to_b ? i : j, S = a_to_b ? gx : gy;
      MpiCommunicator& gather = a_to_b ? grid.y : grid.x;
      MpiCommunicator& scatter = a_to_b ? grid.x : grid.y;
      const Tensor<float> xl = block(x, g, G, s, S), wl = block(w, s, S, g, G), dyl = block(dy, s, S, g, G);
      Tensor<float> yl(Shape{T / S, f / G}), dxl(xl.shape()), dwl(wl.shape());
      tp2d_linear_forward<ops::Cpu>(gather, scatter, pool, xl.view(), wl.view(), yl.view());
      dwl.fill(1.0f);  // gradients accumulate
      tp2d_linear_backward<ops::Cpu>(gather, scatter, pool, xl.view(), wl.view(), dyl.view(), dxl.view(), dwl.view());
      const std::string linear = fmt::format("{} linear {}", where, a_to_b ? "A->B" : "B->A");
      findings.compare(yl.span(), block64(y, s, S, g, G), linear + " y");
      findings.compare(dxl.span(), block64(dx, g, G, s, S), linear + " dx");
      findings.compare(dwl.span(), block64(dw, s, S, g, G, 1.0), linear + " dW");
    }
    // The MLP out = gelu(x W1) W2, layout A back to layout A.
    Rng rng(seed++);
    const Tensor<double> x = random_uniform<double>(Shape{T, h}, rng), w1 = random_uniform<double>(Shape{h, f}, rng);
    const Tensor<double> w2 = random_uniform<double>(Shape{f, h}, rng), dout = random_uniform<double>(Shape{T, h}, rng);
    const Tensor<double> pre = product(x, false, w1, false);
    Tensor<double> act(pre.shape()), dpre_scale(pre.shape());
    for (std::int64_t e = 0; e < pre.numel(); ++e) {
      act.span()[std::size_t(e)] = ref::gelu(pre.span()[std::size_t(e)]);
      dpre_scale.span()[std::size_t(e)] = ref::gelu_derivative(pre.span()[std::size_t(e)]);
    }
    const Tensor<double> out = product(act, false, w2, false), dw2 = product(act, true, dout, false);
    Tensor<double> dpre = product(dout, false, w2, true);
    for (std::int64_t e = 0; e < pre.numel(); ++e) dpre.span()[std::size_t(e)] *= dpre_scale.span()[std::size_t(e)];
    const Tensor<double> dx = product(dpre, false, w1, true), dw1 = product(x, true, dpre, false);
    const Tensor<float> xl = block(x, j, gy, i, gx), w1l = block(w1, i, gx, j, gy), w2l = block(w2, j, gy, i, gx);
    const Tensor<float> doutl = block(dout, j, gy, i, gx);
    Tensor<float> prel(Shape{T / gx, f / gy}), outl(xl.shape()), dxl(xl.shape()), dw1l(w1l.shape()), dw2l(w2l.shape());
    tp2d_mlp_forward<ops::Cpu>(grid, pool, xl.view(), w1l.view(), w2l.view(), prel.view(), outl.view());
    dw1l.fill(0.0f);
    dw2l.fill(0.0f);
    tp2d_mlp_backward<ops::Cpu>(grid, pool, xl.view(), w1l.view(), w2l.view(), prel.view(), doutl.view(), dxl.view(),
                                dw1l.view(), dw2l.view());
    findings.compare(outl.span(), block64(out, j, gy, i, gx), where + " MLP out");
    findings.compare(dxl.span(), block64(dx, j, gy, i, gx), where + " MLP dx");
    findings.compare(dw1l.span(), block64(dw1, i, gx, j, gy), where + " MLP dW1");
    findings.compare(dw2l.span(), block64(dw2, j, gy, i, gx), where + " MLP dW2");
    findings.check_all(fmt::format("mpi tp2d rank {}", r));
  }
}
