// The MoE sublayer through OpenMPI (one process per rank, run by mpiexec with 2 and 4 processes): ExpertParallel
// and ExpertTensorParallel against the float64 single-rank reference (tests/moe/reference_moe.hpp, computed in every
// process): output, input gradient, router, shared experts and gate, and every expert each rank owns; E = 5 (uneven
// expert counts; on 4 ranks one rank owns two), shared experts with the sigmoid gate, aux and z losses, and skewed
// routing (every token to expert 1, so every other owner receives no token). The same layer twice in a row with
// different strategies (a 2-layer mixed plan) checks that nothing of one call's layout leaks into the next.
#include "paradyse/comm/mpi.hpp"
#include "paradyse/moe/moe_layer.hpp"
#include "paradyse/moe/moe_strategies.hpp"

#include "moe/reference_moe.hpp"
#include "strategy/harness.hpp"

#include <doctest/doctest.h>

namespace {

using namespace paradyse;
using namespace paradyse::testing;

MoeConfig mpi_moe_config(bool skewed) {
  MoeConfig c;
  c.hidden = 8;
  c.experts = 5;
  c.top_k = skewed ? 1 : 2;
  c.expert_ffn = 6;
  c.norm_topk_prob = !skewed;
  if (!skewed) {
    c.shared_experts = 2;
    c.shared_ffn = 3;
    c.shared_gate = true;
    c.aux_loss_coef = 0.2;
    c.z_loss_coef = 0.05;
  }
  return c;
}

}  // namespace

TEST_CASE("mpi moe: ExpertParallel and ExpertTensorParallel match the float64 reference, balanced and skewed") {
  MpiCommunicator comm = MpiCommunicator::world();
  const int p = comm.size(), r = comm.rank();
  for (const bool skewed : {false, true}) {
    const MoeConfig c = mpi_moe_config(skewed);
    MoeProblem prob = random_problem(c, 2, 3 * p + 1, 400 + std::uint64_t(skewed));
    if (skewed) {  // every token's logit for expert 1 dominates
      const std::int64_t h = c.hidden;
      for (std::size_t t = 0; t * std::size_t(h) < prob.x.size(); ++t) prob.x[t * std::size_t(h)] += 2.0;
      for (std::int64_t col = 0; col < h; ++col) prob.model.router[std::size_t(h + col)] = col == 0 ? 6.0 : 0.1;
    }
    const std::vector<std::vector<std::int64_t>> groups = rank_groups(prob, p);
    const ReferenceResult want = reference_moe(prob.model, prob.x, prob.dy, prob.k, groups);
    if (skewed) CHECK(want.routed[1] == 2 * (3 * p + 1));
    const std::vector<std::int64_t>& mine = groups[std::size_t(r)];
    const std::int64_t n = std::int64_t(mine.size()), h = c.hidden, f = c.expert_ffn;
    const Tensor<float> x = float_rows(prob.x, h, mine, Shape{1, n, h}), dy = float_rows(prob.dy, h, mine, Shape{1, n, h});
    const MoeShard w = float_shard(prob.model, p, r);
    Findings findings;
    for (std::size_t strategy = 0; strategy < MoeStrategies<>::count; ++strategy) {
      const std::string where = fmt::format("{} {} rank {}", skewed ? "skewed" : "balanced", MoeStrategies<>::name(strategy), r);
      BufferPool pool;
      const MoeContext ctx(c, pool);
      MoeShard grad = MoeShard::zeros(c, p, r);
      Tensor<float> y(x.shape()), dx(x.shape());
      MoeSaved saved = MoeStrategies<>::forward(strategy, comm, ctx, w, x.view(), y.view());
      // The other strategy runs a whole call in between (as the next layer of a mixed plan would).
      {
        MoeShard other_grad = MoeShard::zeros(c, p, r);
        Tensor<float> y2(x.shape()), dx2(x.shape());
        MoeSaved other = MoeStrategies<>::forward(1 - strategy, comm, ctx, w, x.view(), y2.view());
        MoeStrategies<>::backward(comm, ctx, w, other, dy.view(), dx2.view(), other_grad);
        findings.compare(y2.span(), y.span(), where + " the other strategy's output");
      }
      MoeStrategies<>::backward(comm, ctx, w, saved, dy.view(), dx.view(), grad);
      findings.compare(y.span(), double_rows(want.y, h, mine), where + " output");
      findings.compare(dx.span(), double_rows(want.dx, h, mine), where + " input gradient");
      findings.compare(grad.router.span(), want.drouter, where + " router gradient");
      findings.compare(grad.expert_in.span(), owned_slice(c, want.dexpert_in, 2 * f * h, p, r), where + " expert_in gradient");
      findings.compare(grad.expert_out.span(), owned_slice(c, want.dexpert_out, f * h, p, r), where + " expert_out gradient");
      findings.compare(grad.shared_in.span(), want.dshared_in, where + " shared_in gradient");
      findings.compare(grad.shared_out.span(), want.dshared_out, where + " shared_out gradient");
      findings.compare(grad.shared_gate.span(), want.dshared_gate, where + " shared gate gradient");
      findings.compare(std::vector<double>{saved.losses.aux, saved.losses.z}, std::vector<double>{want.aux, want.z},
                       where + " aux and z losses");
      if (saved.losses.routed != want.routed) findings.fail(where + ": the group's routed counts differ from the reference");
    }
    findings.check_all(fmt::format("p = {}, {}", p, skewed ? "skewed" : "balanced"));
  }
}
