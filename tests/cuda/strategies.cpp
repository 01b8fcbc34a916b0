// The very same strategy and model code on device memory: every strategy's sublayers on cuda_local ranks (p ranks as
// threads on one GPU, ops::Cuda) against the float64 single-rank reference, output, input gradient and every rank's
// shard gradient, p in {1, 2, 3, 4}; and a mixed per-layer plan over a 2-layer stack. The cases are the CPU
// strategy tests' own (tests/strategy/harness.hpp: MHA/GQA, causal or not, RoPE, zigzag, GELU/SwiGLU, uneven
// lengths, b = 1 and 2), so a difference between the two paths is a difference of the backend.
#include "cuda/device_test.hpp"
#include "cuda/host_copy.hpp"
#include "strategy/harness.hpp"

#include "paradyse/comm/cuda_local.hpp"
#include "paradyse/model/placement.hpp"
#include "paradyse/model/stack.hpp"
#include "paradyse/ops/cuda_backend.hpp"
#include "paradyse/strategy/strategies.hpp"

#include <doctest/doctest.h>

namespace {

using namespace paradyse;
using namespace paradyse::testing;
using Device = ops::Cuda;

// One sublayer of strategy S (over ops::Cuda) on p cuda_local ranks against the reference.
template <class S>
void check_device_sublayer(const SublayerCase& test, Sublayer which) {
  const LayerConfig& c = test.config;
  const Problem problem = make_problem(c, test.batch, test.length, 7);
  GlobalLayerWeights<double> dw(c);
  Tensor<double> y_ref, dx_ref;
  if (which == Sublayer::attention) {
    y_ref = ref::attention_forward(c, problem.weights, problem.x);
    dx_ref = ref::attention_backward(c, problem.weights, problem.x, problem.dy, dw);
  } else {
    y_ref = ref::mlp_forward(c, problem.weights, problem.x);
    dx_ref = ref::mlp_backward(c, problem.weights, problem.x, problem.dy, dw);
  }
  Findings findings;
  const int p = test.ranks;
  run_cuda_local_ranks(p, [&](CudaLocalCommunicator& comm) {
    const int r = comm.rank();
    MemoryTracker host;  // the rank's host staging; the rank's current tracker is its device tracker
    LayerWeights host_weights, host_want;
    Tensor<float> host_x, host_dy;
    SequenceLayout layout(test.length, p, c.zigzag);
    {
      ScopedTracker scope(host);
      host_weights = shard_of(problem.weights, c, p, r);
      host_want = shard_of(dw, c, p, r);
      host_x = local_tokens(problem.x, layout, r);
      host_dy = local_tokens(problem.dy, layout, r);
    }
    BufferPool pool;
    const SublayerContext ctx(c, p, test.batch, test.length, pool);
    const LayerWeights weights = placed<Device>(std::move(host_weights));
    LayerWeights grads(c, p);
    const Tensor<float> x = placed<Device>(host_x), dy = placed<Device>(host_dy);
    Tensor<float> y(x.shape()), dx(x.shape());
    const S strategy;
    if (!strategy.supports(ctx)) return;
    const std::string where = fmt::format("{} on cuda_local rank {}", S::name, r);
    const Tensor<float>* grad = nullptr;
    const Tensor<float>* want = nullptr;
    if (which == Sublayer::attention) {
      auto saved = strategy.attention_forward(comm, ctx, weights.attention, x.view(), y.view());
      strategy.attention_backward(comm, ctx, weights.attention, saved, dy.view(), dx.view(), grads.attention);
      grad = &grads.attention.packed;
      want = &host_want.attention.packed;
    } else {
      auto saved = strategy.mlp_forward(comm, ctx, weights.mlp, x.view(), y.view());
      strategy.mlp_backward(comm, ctx, weights.mlp, saved, dy.view(), dx.view(), grads.mlp);
      grad = &grads.mlp.packed;
      want = &host_want.mlp.packed;
    }
    findings.compare(on_host(*grad, host).span(), want->span(), where + " weight gradient");
    {
      ScopedTracker scope(host);
      findings.compare(on_host(y, host), y_ref, layout, r, where + " output");
      findings.compare(on_host(dx, host), dx_ref, layout, r, where + " input gradient");
    }
    if (pool.stats().in_use_bytes != 0) findings.fail(fmt::format("{}: {} pool bytes still on loan", where, pool.stats().in_use_bytes));
  });
  findings.check_all(fmt::format("{} {} {}", S::name, which == Sublayer::attention ? "attention" : "mlp", test.name));
}

template <class S>
void check_device_sublayers() {
  for (int p : {1, 2, 3, 4})
    for (const SublayerCase& test : standard_cases(p)) {
      check_device_sublayer<S>(test, Sublayer::attention);
      check_device_sublayer<S>(test, Sublayer::mlp);
    }
}

}  // namespace

TEST_CASE("cuda_local: MegatronTS on device matches the float64 reference, p = 1..4") {
  PARADYSE_REQUIRE_DEVICE();
  check_device_sublayers<MegatronTS<Device>>();
}
TEST_CASE("cuda_local: MegatronCZ on device matches the float64 reference, p = 1..4") {
  PARADYSE_REQUIRE_DEVICE();
  check_device_sublayers<MegatronCZ<Device>>();
}
TEST_CASE("cuda_local: UlyssesZ on device matches the float64 reference, p = 1..4") {
  PARADYSE_REQUIRE_DEVICE();
  check_device_sublayers<UlyssesZ<Device>>();
}
TEST_CASE("cuda_local: ColossalZ on device matches the float64 reference, p = 1..4") {
  PARADYSE_REQUIRE_DEVICE();
  check_device_sublayers<ColossalZ<Device>>();
}
TEST_CASE("cuda_local: METP on device matches the float64 reference, p = 1..4") {
  PARADYSE_REQUIRE_DEVICE();
  check_device_sublayers<METP<Device>>();
}

TEST_CASE("cuda_local: a mixed plan over a 2-layer stack on device matches the float64 reference stack") {
  PARADYSE_REQUIRE_DEVICE();
  using Strategies = AllStrategies<Device>;
  for (int p : {2, 3}) {
    const SublayerCase test = standard_cases(p)[1];  // causal, RoPE, zigzag, RMSNorm, b = 2
    const LayerConfig& c = test.config;
    std::vector<GlobalLayerWeights<double>> weights, dw;
    Tensor<double> x_global, dz_global;
    for (int l = 0; l < 2; ++l) {
      Problem one = make_problem(c, test.batch, test.length, 200 + std::uint64_t(l));
      if (l == 0) {
        x_global = std::move(one.x);
        dz_global = std::move(one.dy);
      }
      weights.push_back(std::move(one.weights));
      dw.emplace_back(c);
    }
    const Tensor<double> z_ref = ref::stack_forward(c, weights, x_global);
    const Tensor<double> dx_ref = ref::stack_backward(c, weights, x_global, dz_global, dw);
    // Layer 0: UlyssesZ attention, METP MLP; layer 1: ColossalZ attention, MegatronTS MLP.
    const StackPlan plan{{Strategies::index_of("UlyssesZ"), Strategies::index_of("METP")},
                         {Strategies::index_of("ColossalZ"), Strategies::index_of("MegatronTS")}};
    Findings findings;
    run_cuda_local_ranks(p, [&](CudaLocalCommunicator& comm) {
      const int r = comm.rank();
      MemoryTracker& device_tracker = MemoryTracker::current();  // the rank's device tracker
      MemoryTracker host;
      const SequenceLayout layout(test.length, p, c.zigzag);
      std::vector<LayerWeights> shards;
      std::vector<LayerWeights> want;
      Tensor<float> host_x, host_dz;
      {
        ScopedTracker scope(host);
        for (int l = 0; l < 2; ++l) {
          LayerWeights w = shard_of(weights[std::size_t(l)], c, p, r);
          want.push_back(shard_of(dw[std::size_t(l)], c, p, r));
          ScopedTracker device_scope(device_tracker);
          shards.push_back(placed<Device>(std::move(w)));
        }
        host_x = local_tokens(x_global, layout, r);
        host_dz = local_tokens(dz_global, layout, r);
      }
      BufferPool pool;
      TransformerStack<Strategies, Device> stack(c, std::move(shards), p);
      const Tensor<float> x = placed<Device>(host_x), dz = placed<Device>(host_dz);
      Tensor<float> z(x.shape()), dx(x.shape());
      stack.zero_gradients();
      stack.forward(comm, pool, plan, test.length, x.view(), z.view());
      stack.backward(comm, pool, dz.view(), dx.view());
      const std::string where = fmt::format("mixed plan, p = {}, rank {}", p, r);
      ScopedTracker scope(host);
      findings.compare(on_host(z, host), z_ref, layout, r, where + " output");
      findings.compare(on_host(dx, host), dx_ref, layout, r, where + " input gradient");
      for (int l = 0; l < 2; ++l) {
        const LayerWeights& got = stack.gradients()[std::size_t(l)];
        const LayerWeights& expected = want[std::size_t(l)];
        findings.compare(on_host(got.attention.packed, host).span(), expected.attention.packed.span(),
                         fmt::format("{} layer {} attention gradient", where, l));
        findings.compare(on_host(got.mlp.packed, host).span(), expected.mlp.packed.span(),
                         fmt::format("{} layer {} mlp gradient", where, l));
        findings.compare(on_host(got.norms.packed, host).span(), expected.norms.packed.span(),
                         fmt::format("{} layer {} norm gradients", where, l));
      }
    });
    findings.check_all(fmt::format("2-layer stack, mixed plan, p = {}", p));
  }
}
