// The MoE sublayer on device memory: the single-rank layer, ExpertParallel and ExpertTensorParallel over ops::Cuda on
// cuda_local ranks against the float64 reference, on the host tests' own cases (tests/moe/layer_harness.hpp: softmax
// and sigmoid routers, shared experts gated or not, per-token and per-call k, capacity drops, skewed routing): output,
// router losses (aux and z, whose statistics come back from the device), drops, routed counts, input gradient and
// every owned gradient, p in {1, 2, 3, 4}. The gradients start from the weights, so accumulation is checked too.
#include "cuda/device_test.hpp"
#include "cuda/host_copy.hpp"
#include "moe/layer_harness.hpp"

#include "paradyse/comm/cuda_local.hpp"
#include "paradyse/model/placement.hpp"
#include "paradyse/moe/moe_layer.hpp"
#include "paradyse/ops/cuda_backend.hpp"

#include <doctest/doctest.h>

#include <cstdint>
#include <functional>
#include <vector>

namespace {

using namespace paradyse;
using namespace paradyse::testing;
using namespace paradyse::testing::moe_harness;
using Device = ops::Cuda;

// A device shard's copy on the host tracker `host` (beside a tensor's, tests/cuda/host_copy.hpp).
using testing::on_host;
MoeShard on_host(const MoeShard& d, MemoryTracker& host) {
  MoeShard h;
  h.router = on_host(d.router, host);
  h.expert_in = on_host(d.expert_in, host);
  h.expert_out = on_host(d.expert_out, host);
  h.shared_in = on_host(d.shared_in, host);
  h.shared_out = on_host(d.shared_out, host);
  h.shared_gate = on_host(d.shared_gate, host);
  return h;
}

using Calls = LayerCalls<CudaLocalCommunicator, Device>;
using Forward = Calls::Forward;
using Backward = Calls::Backward;
using EP = ExpertParallel<Device>;
using ETP = ExpertTensorParallel<Device>;

// Forward and backward on p cuda_local ranks; each rank's results come back to host tensors.
std::vector<RankResult> run_device_layer(const MoeProblem& prob, int p, const Forward& fwd, const Backward& bwd) {
  const MoeConfig& c = prob.model.config;
  const std::int64_t h = c.hidden;
  std::vector<RankResult> results(static_cast<std::size_t>(p));
  std::vector<MemoryTracker> hosts(static_cast<std::size_t>(p));  // each rank's host tensors
  run_cuda_local_ranks(p, [&](CudaLocalCommunicator& comm) {
    const int r = comm.rank();
    MemoryTracker& host = hosts[std::size_t(r)];
    RankResult& out = results[std::size_t(r)];
    out.ids = rank_tokens(prob, p, r);
    const std::int64_t n_r = std::int64_t(out.ids.size()) / prob.batch;
    const Shape shape{prob.batch, n_r, h};
    Tensor<float> host_x, host_dy;
    MoeShard host_w, host_grad;
    {
      ScopedTracker scope(host);
      host_x = float_rows(prob.x, h, out.ids, shape);
      host_dy = float_rows(prob.dy, h, out.ids, shape);
      host_w = float_shard(prob.model, p, r);
      host_grad = float_shard(prob.model, p, r);
    }
    const RankK k(prob, out.ids);
    BufferPool pool;
    const MoeContext ctx(c, pool, k.top_k());
    const Tensor<float> x = placed<Device>(host_x), dy = placed<Device>(host_dy);
    const MoeShard w = placed<Device>(std::move(host_w));
    MoeShard grad = placed<Device>(std::move(host_grad));
    Tensor<float> y(shape), dx(shape);
    MoeSaved saved = fwd(comm, ctx, w, x.view(), y.view());
    bwd(comm, ctx, w, saved, dy.view(), dx.view(), grad);
    out.y = on_host(y, host);
    out.dx = on_host(dx, host);
    out.grad = on_host(grad, host);
    out.keep(saved);
  });
  return results;
}

void check_device_cases(int p, const Forward& fwd, const Backward& bwd, std::uint64_t seed) {
  check_cases(p, seed, [&](const MoeProblem& prob, int ranks) { return run_device_layer(prob, ranks, fwd, bwd); });
}

}  // namespace

TEST_CASE("cuda: the moe layer on one rank matches the float64 reference") {
  PARADYSE_REQUIRE_DEVICE();
  check_device_cases(1, Calls::single_forward(), Calls::single_backward(), 100);
}

TEST_CASE("cuda_local: ExpertParallel on device matches the float64 reference, p = 1..4") {
  PARADYSE_REQUIRE_DEVICE();
  for (int p : {1, 2, 3, 4}) check_device_cases(p, Calls::forward_of<EP>(), Calls::backward_of<EP>(), 200);
}

TEST_CASE("cuda_local: ExpertTensorParallel on device matches the float64 reference, p = 1..4") {
  PARADYSE_REQUIRE_DEVICE();
  for (int p : {1, 2, 3, 4})
    check_device_cases(p, Calls::forward_of<ETP>(), Calls::backward_of<ETP>(), 300);
}
