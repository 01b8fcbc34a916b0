// tests/moe/moe_layer.cpp: the MoE sublayer on one rank and under ExpertParallel and ExpertTensorParallel, against
// the float64 reference (tests/moe/reference_moe.hpp): output, losses, drops, input gradient and the gradient of
// every weight each rank owns (router, each owned expert, shared experts, shared gate), over p in {1, 2, 3, 4, 8},
// E in {3, 4, 5, 6, 8, 16} with k in {1, 2, 3, 4}, uneven expert counts (E = 6 and 5 on p = 4; E = 3 on p = 4 and
// E = 5, 6 on p = 8 leave ranks without experts), variable experts per token, a per-call k, capacity factors,
// skewed routing (ranks whose experts get no token); a 2-layer stack with mixed strategies; the reference's own gradients against finite differences;
// the two strategies against each other; a dry run over meta tensors with the counting backend.
#include "moe/layer_harness.hpp"
#include "moe/reference_moe.hpp"
#include "support/tolerance.hpp"

#include "paradyse/comm/symbolic.hpp"
#include "paradyse/comm/threads.hpp"
#include "paradyse/core/trace.hpp"
#include "paradyse/moe/moe_layer.hpp"
#include "paradyse/ops/counting.hpp"

#include <doctest/doctest.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

using namespace paradyse;
using namespace paradyse::testing;
using namespace paradyse::testing::moe_harness;

namespace {

using Calls = LayerCalls<ThreadCommunicator, ops::Cpu>;
using Forward = Calls::Forward;
using Backward = Calls::Backward;
using EP = ExpertParallel<>;
using ETP = ExpertTensorParallel<>;

// Runs forward and backward on p thread ranks. The gradients start from the weights themselves (so the test also
// sees that backward accumulates).
std::vector<RankResult> run_layer(const MoeProblem& prob, int p, Forward fwd, Backward bwd) {
  const MoeConfig& c = prob.model.config;
  const std::int64_t h = c.hidden;
  std::vector<RankResult> results(static_cast<std::size_t>(p));
  run_ranks(p, [&](ThreadCommunicator& comm) {
    const int r = comm.rank();
    RankResult& out = results[std::size_t(r)];
    out.ids = rank_tokens(prob, p, r);
    const std::int64_t n_r = std::int64_t(out.ids.size()) / prob.batch;
    const Shape shape{prob.batch, n_r, h};
    const Tensor<float> x = float_rows(prob.x, h, out.ids, shape), dy = float_rows(prob.dy, h, out.ids, shape);
    const RankK k(prob, out.ids);
    BufferPool pool;
    const MoeContext ctx(c, pool, k.top_k());
    const MoeShard w = float_shard(prob.model, p, r);
    out.grad = float_shard(prob.model, p, r);
    out.y = Tensor<float>(shape);
    out.dx = Tensor<float>(shape);
    MoeSaved saved = fwd(comm, ctx, w, x.view(), out.y.view());
    bwd(comm, ctx, w, saved, dy.view(), out.dx.view(), out.grad);
    out.keep(saved);
  });
  return results;
}

void check_cases(int p, const Forward& fwd, const Backward& bwd, std::uint64_t seed) {
  moe_harness::check_cases(p, seed, [&](const MoeProblem& prob, int ranks) { return run_layer(prob, ranks, fwd, bwd); });
}

}  // namespace

TEST_CASE("moe reference: gradients agree with finite differences of its loss") {
  for (int variant = 0; variant < 3; ++variant) {
    MoeConfig c = base_config(5, 2);
    c.hidden = 5;
    c.expert_ffn = 3;
    bool per_token = false;
    if (variant == 0) {
      c.norm_topk_prob = true;
      c.shared_experts = 2;
      c.shared_ffn = 2;
      c.shared_gate = true;
      c.aux_loss_coef = 0.3;
      c.z_loss_coef = 0.1;
    } else if (variant == 1) {
      c.scoring = RouterScoring::sigmoid;
      c.norm_topk_prob = true;
      c.routed_scaling_factor = 1.7;
      c.capacity_factor = 1.0;
      c.aux_loss_coef = 0.2;
      per_token = true;
    } else {
      c.top_k = 3;
      c.shared_experts = 1;
      c.shared_ffn = 3;
      c.z_loss_coef = 0.2;
    }
    CAPTURE(variant);
    MoeProblem prob = random_problem(c, 2, 5, 900 + std::uint64_t(variant), per_token);
    const auto groups = rank_groups(prob, 2);
    const ReferenceResult ref = reference_moe(prob.model, prob.x, prob.dy, prob.k, groups);
    const double step = 1e-6;
    const auto numeric = [&](std::vector<double>& param) {
      std::vector<double> grad(param.size());
      for (std::size_t i = 0; i < param.size(); ++i) {
        const double saved = param[i];
        param[i] = saved + step;
        const double up = reference_loss(prob.model, prob.x, prob.dy, prob.k, groups);
        param[i] = saved - step;
        const double down = reference_loss(prob.model, prob.x, prob.dy, prob.k, groups);
        param[i] = saved;
        grad[i] = (up - down) / (2 * step);
      }
      return grad;
    };
    CHECK_CLOSE(ref.dx, numeric(prob.x), kFiniteDifference);
    CHECK_CLOSE(ref.drouter, numeric(prob.model.router), kFiniteDifference);
    CHECK_CLOSE(ref.dexpert_in, numeric(prob.model.expert_in), kFiniteDifference);
    CHECK_CLOSE(ref.dexpert_out, numeric(prob.model.expert_out), kFiniteDifference);
    CHECK_CLOSE(ref.dshared_in, numeric(prob.model.shared_in), kFiniteDifference);
    CHECK_CLOSE(ref.dshared_out, numeric(prob.model.shared_out), kFiniteDifference);
    CHECK_CLOSE(ref.dshared_gate, numeric(prob.model.shared_gate), kFiniteDifference);
    if (variant == 1) CHECK(ref.dropped > 0);
  }
}

TEST_CASE("moe layer on one rank matches the float64 reference") {
  check_cases(1, Calls::single_forward(), Calls::single_backward(), 100);
}

TEST_CASE("ExpertParallel matches the float64 reference, p in {1, 2, 3, 4, 8}") {
  for (int p : {1, 2, 3, 4, 8}) check_cases(p, Calls::forward_of<EP>(), Calls::backward_of<EP>(), 200 + 20 * p);
}

TEST_CASE("ExpertTensorParallel matches the float64 reference, p in {1, 2, 3, 4, 8}") {
  for (int p : {1, 2, 3, 4, 8})
    check_cases(p, Calls::forward_of<ETP>(), Calls::backward_of<ETP>(), 300 + 20 * p);
}

TEST_CASE("ranks without tokens (s < p) take part in every collective and get their experts' gradients") {
  for (int p : {2, 3, 4}) {
    LayerCase lc{"one short sample", base_config(6, 2), 1, p - 1};
    lc.config.shared_experts = 1;
    lc.config.shared_ffn = 3;
    lc.config.shared_gate = true;
    lc.config.aux_loss_coef = 0.1;
    lc.config.z_loss_coef = 0.1;
    CAPTURE(p);
    const MoeProblem prob = make_problem(lc, 800 + std::uint64_t(p));
    check_against_reference(prob, p, run_layer(prob, p, Calls::forward_of<EP>(), Calls::backward_of<EP>()));
    check_against_reference(
        prob, p, run_layer(prob, p, Calls::forward_of<ETP>(), Calls::backward_of<ETP>()));
  }
}

TEST_CASE("ExpertParallel and ExpertTensorParallel agree on the same shards") {
  for (int p : {2, 3, 4}) {
    for (const LayerCase& lc : layer_cases(p)) {
      CAPTURE(lc.name);
      CAPTURE(p);
      const MoeProblem prob = make_problem(lc, 700 + std::uint64_t(p));
      const auto ep = run_layer(prob, p, Calls::forward_of<EP>(), Calls::backward_of<EP>());
      const auto etp = run_layer(prob, p, Calls::forward_of<ETP>(), Calls::backward_of<ETP>());
      for (int r = 0; r < p; ++r) {
        const RankResult &a = ep[std::size_t(r)], &b = etp[std::size_t(r)];
        CAPTURE(r);
        CHECK_CLOSE(a.y.span(), b.y.span(), kFloat32);
        CHECK_CLOSE(a.dx.span(), b.dx.span(), kFloat32);
        CHECK_CLOSE(a.grad.router.span(), b.grad.router.span(), kFloat32);
        CHECK_CLOSE(a.grad.expert_in.span(), b.grad.expert_in.span(), kFloat32);
        CHECK_CLOSE(a.grad.expert_out.span(), b.grad.expert_out.span(), kFloat32);
        CHECK_CLOSE(a.grad.shared_in.span(), b.grad.shared_in.span(), kFloat32);
        CHECK_CLOSE(a.grad.shared_out.span(), b.grad.shared_out.span(), kFloat32);
        CHECK_CLOSE(a.grad.shared_gate.span(), b.grad.shared_gate.span(), kFloat32);
        CHECK(a.grad.expert_in.shape() == b.grad.expert_in.shape());
        CHECK(a.dropped == b.dropped);
      }
    }
  }
}

TEST_CASE("moe layer: the strategies refuse a shard of the wrong rank's shape, bad calls are errors") {
  MoeConfig c = base_config(6, 2);
  CHECK_THROWS_WITH_AS(run_ranks(4,
                                 [&](ThreadCommunicator& comm) {
                                   BufferPool pool;
                                   const MoeContext ctx(c, pool);
                                   const MoeShard w = MoeShard::zeros(c, 4, (comm.rank() + 1) % 4);
                                   Tensor<float> x(Shape{1, 2, 8}), y(Shape{1, 2, 8});
                                   (void)ExpertParallel<>{}.forward(comm, ctx, w, x.view(), y.view());
                                 }),
                       doctest::Contains("owns"), Error);
  BufferPool pool;
  const MoeContext ctx(c, pool, TopK{7});
  const MoeShard w = MoeShard::zeros(c, 1, 0);
  Tensor<float> x(Shape{1, 2, 8}), y(Shape{1, 2, 8}), bad(Shape{1, 2, 7});
  CHECK_THROWS_WITH_AS((void)moe_forward(ctx, w, x.view(), y.view()), doctest::Contains("k = 7"), Error);
  const MoeContext fine(c, pool);
  CHECK_THROWS_WITH_AS((void)moe_forward(fine, w, bad.view(), y.view()), doctest::Contains("h = 8"), Error);
  std::vector<std::string> messages(2);
  run_ranks(2, [&](ThreadCommunicator& comm) {
    BufferPool own;
    const MoeContext both(c, own);
    const MoeShard mine = MoeShard::zeros(c, 2, comm.rank());
    MoeShard grad = MoeShard::zeros(c, 2, comm.rank());
    Tensor<float> xs(Shape{1, 2, 8}), ys(Shape{1, 2, 8});
    MoeSaved saved = ExpertParallel<>{}.forward(comm, both, mine, xs.view(), ys.view());
    try {  // doctest's assertions are made on the main thread
      ExpertTensorParallel<>{}.backward(comm, both, mine, saved, ys.view(), xs.view(), grad);
    } catch (const Error& e) {
      messages[std::size_t(comm.rank())] = e.what();
    }
  });
  for (const std::string& m : messages)
    CHECK_MESSAGE(m.find("ExpertTensorParallel was given what ExpertParallel forward saved") != std::string::npos, m);
  c.top_k = 0;
  CHECK_THROWS_WITH_AS(MoeContext(c, pool), doctest::Contains("top_k = 0"), Error);
}

TEST_CASE("moe layer: a dry run over meta tensors with the counting backend records the layer's kernels") {
  MoeConfig c = base_config(4, 2);
  c.shared_experts = 1;
  c.shared_ffn = 4;
  c.shared_gate = true;
  MemoryTracker meta(MemorySpace::meta);
  Trace trace;
  {
    ScopedTracker scoped(meta);
    ScopedTrace recording(trace);
    BufferPool pool;
    const MoeContext ctx(c, pool);
    const MoeShard w = MoeShard::zeros(c, 1, 0);
    MoeShard g = MoeShard::zeros(c, 1, 0);
    Tensor<float> x(Shape{2, 8, 8}), y(Shape{2, 8, 8}), dx(Shape{2, 8, 8});
    MoeSaved saved = moe_forward<ops::Counting>(ctx, w, x.view(), y.view());
    // The stand-in routing is balanced: each expert gets 16 tokens x 2 / 4 experts rows.
    for (std::int64_t e = 0; e < 4; ++e) CHECK(saved.dispatch.count(e) == 8);
    moe_backward<ops::Counting>(ctx, w, saved, y.view(), dx.view(), g);
  }
  std::int64_t gemms = 0, grouped = 0;
  for (const TraceEvent& e : trace.events())
    if (e.kind == TraceKind::gemm) (e.grouped ? grouped : gemms) += e.count;
  // Forward: router 1, experts 4 x 2, shared 2 + gate 1; backward: router 2, experts 4 x 4, shared 4 + gate 2. Each
  // expert projection is one grouped call of 4 items: the last 3 ride on the first's launch.
  CHECK(gemms + grouped == 1 + 8 + 3 + 2 + 16 + 6);
  CHECK(grouped == 3 * (2 + 4));
}

TEST_CASE("a 2-layer MoE stack with mixed strategies matches the reference: layers switch with no redistribution") {
  MoeConfig first = base_config(5, 2);
  first.shared_experts = 2;
  first.shared_ffn = 3;
  first.shared_gate = true;
  first.aux_loss_coef = 0.2;
  MoeConfig second = base_config(6, 2);
  second.scoring = RouterScoring::sigmoid;
  second.norm_topk_prob = true;
  second.z_loss_coef = 0.1;
  const std::vector<std::pair<Forward, Backward>> strategies = {
      {Calls::forward_of<EP>(), Calls::backward_of<EP>()},
      {Calls::forward_of<ETP>(), Calls::backward_of<ETP>()}};
  for (int p : {2, 3, 4})
    for (int plan = 0; plan < 4; ++plan) {  // layer 1 and layer 2 each EP (0) or ETP (1)
      const auto& [fwd1, bwd1] = strategies[std::size_t(plan & 1)];
      const auto& [fwd2, bwd2] = strategies[std::size_t(plan >> 1)];
      CAPTURE(p);
      CAPTURE(plan);
      const MoeProblem one = random_problem(first, 2, 3 * p + 1, 1000 + std::uint64_t(p));
      const MoeProblem two = random_problem(second, 2, 3 * p + 1, 2000 + std::uint64_t(p));
      const auto groups = rank_groups(one, p);
      const ReferenceResult ahead = reference_moe(one.model, one.x, {}, one.k, groups);
      const ReferenceResult ref2 = reference_moe(two.model, ahead.y, two.dy, two.k, groups);
      const ReferenceResult ref1 = reference_moe(one.model, one.x, ref2.dx, one.k, groups);
      const std::int64_t h = first.hidden;
      std::vector<RankResult> results(static_cast<std::size_t>(p));
      std::vector<MoeShard> second_grads(static_cast<std::size_t>(p));
      run_ranks(p, [&](ThreadCommunicator& comm) {
        const int r = comm.rank();
        RankResult& out = results[std::size_t(r)];
        out.ids = rank_tokens(one, p, r);
        const Shape shape{2, std::int64_t(out.ids.size()) / 2, h};
        const Tensor<float> x = float_rows(one.x, h, out.ids, shape), dy = float_rows(two.dy, h, out.ids, shape);
        BufferPool pool;
        const MoeContext ctx1(first, pool), ctx2(second, pool);
        const MoeShard w1 = float_shard(one.model, p, r), w2 = float_shard(two.model, p, r);
        out.grad = float_shard(one.model, p, r);
        second_grads[std::size_t(r)] = float_shard(two.model, p, r);
        Tensor<float> y1(shape), dy1(shape);
        out.y = Tensor<float>(shape);
        out.dx = Tensor<float>(shape);
        MoeSaved s1 = fwd1(comm, ctx1, w1, x.view(), y1.view());
        MoeSaved s2 = fwd2(comm, ctx2, w2, y1.view(), out.y.view());
        bwd2(comm, ctx2, w2, s2, dy.view(), dy1.view(), second_grads[std::size_t(r)]);
        bwd1(comm, ctx1, w1, s1, dy1.view(), out.dx.view(), out.grad);
      });
      for (int r = 0; r < p; ++r) {
        CAPTURE(r);
        const RankResult& got = results[std::size_t(r)];
        CHECK_CLOSE(got.y.span(), double_rows(ref2.y, h, got.ids), kFloat32);
        CHECK_CLOSE(got.dx.span(), double_rows(ref1.dx, h, got.ids), kFloat32);
        check_gradients(one.model, ref1, p, r, got.grad);
        check_gradients(two.model, ref2, p, r, second_grads[std::size_t(r)]);
      }
    }
}

namespace {
// Forward and backward of strategy S on rank `rank` of `p` over meta tensors, with the counting backend and a
// symbolic communicator: the trace of a balanced routing (the counting router's stand-in).
template <template <class> class S>
Trace dry_run(const MoeConfig& c, int p, int rank, std::int64_t batch, std::int64_t tokens) {
  Trace trace;
  MemoryTracker meta(MemorySpace::meta);
  ScopedTracker scoped(meta);
  ScopedTrace recording(trace);
  SymbolicCommunicator comm(rank, p, trace);
  BufferPool pool;
  const MoeContext ctx(c, pool);
  const MoeShard w = MoeShard::zeros(c, p, rank);
  MoeShard g = MoeShard::zeros(c, p, rank);
  Tensor<float> x(Shape{batch, tokens, c.hidden}), y(x.shape()), dx(x.shape());
  MoeSaved saved = S<ops::Counting>{}.forward(comm, ctx, w, x.view(), y.view());
  S<ops::Counting>{}.backward(comm, ctx, w, saved, y.view(), dx.view(), g);
  return trace;
}
std::int64_t count(const Trace& t, TraceKind kind, TransferKind transfer = TransferKind::barrier) {
  std::int64_t n = 0;
  for (const TraceEvent& e : t.events()) n += e.kind == kind && (kind != TraceKind::post || e.transfer == transfer);
  return n;
}
}  // namespace

TEST_CASE("both strategies run as a dry run (meta tensors, counting backend, symbolic communicator)") {
  MoeConfig c = base_config(8, 2);
  c.shared_experts = 1;
  c.shared_ffn = 4;
  c.shared_gate = true;
  // Rank 1 of 4 owns experts 2 and 3; 16 local tokens x 2 / 8 experts = 4 rows per expert from every rank.
  const Trace ep = dry_run<ExpertParallel>(c, 4, 1, 2, 8);
  CHECK(count(ep, TraceKind::post, TransferKind::all_to_all) == 3 + 2);  // counts, rows out and back; twice back
  CHECK(count(ep, TraceKind::post, TransferKind::all_reduce) == 2);      // router statistics; replicated gradients
  // GEMMs: router 1 + 2 owned experts x 2 + shared 2 + gate 1; backward: experts 2 x 4 + router 2 + shared 4 + gate 2.
  CHECK(count(ep, TraceKind::gemm) == 8 + 16);
  for (const TraceEvent& e : ep.events()) {
    if (e.kind == TraceKind::gemm && e.n == 2 * c.expert_ffn && e.k == c.hidden) CHECK(e.m == 16);  // 4 ranks x 4 rows
    if (e.kind == TraceKind::post && e.transfer == TransferKind::all_to_all && e.bytes > 100)
      CHECK(e.bytes == 32 * 8 * 4);  // this rank's 32 routed rows of h floats
  }
  const Trace etp = dry_run<ExpertTensorParallel>(c, 4, 1, 2, 8);
  CHECK(count(etp, TraceKind::post, TransferKind::broadcast) == 4 + 4);  // each owner's experts, forward and backward
  CHECK(count(etp, TraceKind::post, TransferKind::reduce) == 4);         // each owner's expert gradients
  CHECK(count(etp, TraceKind::post, TransferKind::all_to_all) == 0);
  CHECK(count(etp, TraceKind::gemm) == (1 + 16 + 3) + (32 + 2 + 6));
  for (const TraceEvent& e : etp.events())
    if (e.kind == TraceKind::post && e.transfer == TransferKind::broadcast) CHECK(e.bytes == 2 * 3 * 6 * 8 * 4);
}

TEST_CASE("moe layer: a NaN in one expert's weight reaches exactly its tokens; a NaN router weight or input is refused") {
  // Issue 27: NaN must never become numbers. Expert 0's first W_in element is NaN: the tokens routed to expert 0 (the
  // clean reference's routing; routing does not read the experts) have non-finite outputs on every rank, the others
  // match the clean reference. A NaN router weight or activation makes a router logit NaN: refused by name.
  for (int p : {2, 3})
    for (const bool tensor_parallel : {false, true}) {
      CAPTURE(p);
      CAPTURE(tensor_parallel);
      const Forward fwd = tensor_parallel ? Calls::forward_of<ETP>() : Calls::forward_of<EP>();
      const Backward bwd = tensor_parallel ? Calls::backward_of<ETP>() : Calls::backward_of<EP>();
      const LayerCase lc = layer_cases(p).front();  // Mixtral-like softmax top-2, no capacity (nothing dropped)
      const MoeProblem clean = make_problem(lc, 4242 + std::uint64_t(p));
      const ReferenceResult ref = reference_moe(clean.model, clean.x, clean.dy, clean.k, rank_groups(clean, p));
      const std::int64_t h = lc.config.hidden;
      MoeProblem poisoned = clean;
      poisoned.model.expert_in[0] = std::numeric_limits<double>::quiet_NaN();
      const std::vector<RankResult> results = run_layer(poisoned, p, fwd, bwd);
      std::int64_t reached = 0, spared = 0;
      for (const RankResult& got : results)
        for (std::size_t j = 0; j < got.ids.size(); ++j) {
          const std::int64_t id = got.ids[j];
          const auto& chosen = ref.chosen[std::size_t(id)];
          const bool routed = std::find(chosen.begin(), chosen.end(), 0) != chosen.end();
          for (std::int64_t c = 0; c < h; ++c) {
            const double y = got.y.span()[j * std::size_t(h) + std::size_t(c)];
            const double want = ref.y[std::size_t(id * h + c)];
            if (routed) CHECK_MESSAGE(!std::isfinite(y), "token ", id, " is routed to the NaN expert but y = ", y);
            else CHECK_MESSAGE(std::abs(y - want) <= kFloat32.atol + kFloat32.rtol * std::abs(want), "token ", id, " y = ", y, ", want ", want);
          }
          (routed ? reached : spared) += 1;
        }
      CHECK(reached > 0);  // the case routes tokens to expert 0, and not every token
      CHECK(spared > 0);
      MoeProblem router_nan = clean;
      router_nan.model.router[1] = std::numeric_limits<double>::quiet_NaN();
      CHECK_THROWS_WITH_AS(run_layer(router_nan, p, fwd, bwd), doctest::Contains("= nan is not finite"), Error);
      MoeProblem input_nan = clean;
      input_nan.x[0] = std::numeric_limits<double>::quiet_NaN();  // token 0's first activation
      CHECK_THROWS_WITH_AS(run_layer(input_nan, p, fwd, bwd), doctest::Contains("= nan is not finite"), Error);
    }
}
