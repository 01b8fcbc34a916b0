// tests/moe/router.cpp: route (logits, scores, top-k per call or per token, gates), the group statistics and
// losses, and route_backward against finite differences of a float64 loss written here (gates, load-balancing loss,
// z-loss) with respect to x and the router weight.
#include "moe/reference_moe.hpp"
#include "support/tolerance.hpp"

#include "paradyse/moe/router.hpp"
#include "paradyse/ops/backend.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <vector>

using namespace paradyse;
using namespace paradyse::testing;

namespace {

MoeConfig router_config(RouterScoring scoring, bool normalize, double scale) {
  MoeConfig c;
  c.hidden = 6;
  c.experts = 5;
  c.top_k = 2;
  c.expert_ffn = 4;
  c.scoring = scoring;
  c.norm_topk_prob = normalize;
  c.routed_scaling_factor = scale;
  c.aux_loss_coef = 0.4;
  c.z_loss_coef = 0.1;
  return c;
}

// The router's part of the loss in float64: sum dgates * gates + aux_coef * aux + z_coef * z, the selection (and so
// the load f) held at `chosen`.
double router_loss(const MoeConfig& c, const std::vector<double>& x, const std::vector<double>& w,
                   const std::vector<std::vector<std::int64_t>>& chosen, const std::vector<double>& dgates) {
  const std::int64_t h = c.hidden, e_count = c.experts, n = std::int64_t(chosen.size());
  std::vector<double> mean(static_cast<std::size_t>(e_count), 0.0), routed(static_cast<std::size_t>(e_count), 0.0);
  double assignments = 0, loss = 0, z_sum = 0;
  std::size_t a = 0;
  for (std::int64_t t = 0; t < n; ++t) {
    std::vector<double> l(static_cast<std::size_t>(e_count), 0.0), p(l.size());
    double top = -1e300, sum = 0;
    for (std::int64_t e = 0; e < e_count; ++e) {
      for (std::int64_t col = 0; col < h; ++col) l[std::size_t(e)] += x[std::size_t(t * h + col)] * w[std::size_t(e * h + col)];
      top = std::max(top, l[std::size_t(e)]);
    }
    for (double v : l) sum += std::exp(v - top);
    const double lse = top + std::log(sum);
    z_sum += lse * lse;
    for (std::size_t e = 0; e < l.size(); ++e) {
      p[e] = c.scoring == RouterScoring::softmax ? std::exp(l[e] - lse) : 1 / (1 + std::exp(-l[e]));
      mean[e] += p[e] / double(n);
    }
    double selected = 0;
    for (auto e : chosen[std::size_t(t)]) selected += p[std::size_t(e)], routed[std::size_t(e)] += 1, assignments += 1;
    for (auto e : chosen[std::size_t(t)])
      loss += dgates[a++] * c.routed_scaling_factor * p[std::size_t(e)] / (c.norm_topk_prob ? selected : 1.0);
  }
  double aux = 0;
  for (std::int64_t e = 0; e < e_count; ++e) aux += double(e_count) * routed[std::size_t(e)] / assignments * mean[std::size_t(e)];
  return loss + c.aux_loss_coef * aux + c.z_loss_coef * z_sum / double(n);
}

}  // namespace

TEST_CASE("route: chosen experts and gate weights match the float64 reference; per-call k and per-token counts") {
  std::uint64_t seed = 40;
  for (const RouterScoring scoring : {RouterScoring::softmax, RouterScoring::sigmoid})
    for (const bool normalize : {false, true})
      for (const int mode : {0, 1, 2}) {  // config k, per-call k, per-token counts
        const MoeConfig c = router_config(scoring, normalize, normalize ? 1.0 : 2.5);
        MoeProblem prob = random_problem(c, 1, 9, seed++, mode == 2);
        if (mode == 1) prob.k.assign(prob.k.size(), 4);
        const ReferenceResult ref = reference_moe(prob.model, prob.x, {}, prob.k, {});
        const Tensor<float> w = float_rows(prob.model.router, c.hidden, {0, 1, 2, 3, 4}, Shape{5, c.hidden});
        std::vector<std::int64_t> ids(9);
        for (std::int64_t t = 0; t < 9; ++t) ids[std::size_t(t)] = t;
        const Tensor<float> x = float_rows(prob.x, c.hidden, ids, Shape{9, c.hidden});
        const TopK k = mode == 0 ? TopK{} : mode == 1 ? TopK{4} : TopK{0, prob.k};
        const Routing r = route<ops::Cpu>(c, w.view(), x.view(), k);
        CHECK(r.tokens == 9);
        std::vector<std::int64_t> want_experts;
        for (const auto& chosen : ref.chosen) want_experts.insert(want_experts.end(), chosen.begin(), chosen.end());
        CHECK(r.expert == want_experts);
        for (std::int64_t t = 0; t < 9; ++t) CHECK(r.count(t) == prob.k[std::size_t(t)]);
        // The gates: y of a model whose every expert outputs 1 in column 0 would be their sum; check them directly.
        std::vector<double> want_gates;
        for (std::int64_t t = 0; t < 9; ++t) {
          std::vector<double> l(5, 0.0), p(5);
          double top = -1e300, sum = 0;
          for (std::int64_t e = 0; e < 5; ++e) {
            for (std::int64_t col = 0; col < c.hidden; ++col)
              l[std::size_t(e)] += prob.x[std::size_t(t * c.hidden + col)] * prob.model.router[std::size_t(e * c.hidden + col)];
            top = std::max(top, l[std::size_t(e)]);
          }
          for (double v : l) sum += std::exp(v - top);
          for (std::size_t e = 0; e < 5; ++e)
            p[e] = scoring == RouterScoring::softmax ? std::exp(l[e] - top) / sum : 1 / (1 + std::exp(-l[e]));
          double selected = 0;
          for (auto e : ref.chosen[std::size_t(t)]) selected += p[std::size_t(e)];
          for (auto e : ref.chosen[std::size_t(t)])
            want_gates.push_back(c.routed_scaling_factor * p[std::size_t(e)] / (normalize && selected > 0 ? selected : 1.0));
        }
        CHECK_CLOSE(r.gates.span(), want_gates, kFloat32);
        // Losses from this rank's statistics alone equal the reference's over the same tokens.
        const RouterLosses losses = router_losses(c, router_statistics(r));
        const std::vector<double> got{losses.aux, losses.z}, want{ref.aux, ref.z};
        CHECK_CLOSE(got, want, kFloat32);
        CHECK(losses.routed == ref.routed);
        CHECK(losses.tokens == 9);
      }
}

TEST_CASE("router statistics add over ranks: the losses of the sums are the losses of all tokens") {
  const MoeConfig c = router_config(RouterScoring::softmax, true, 1.0);
  const MoeProblem prob = random_problem(c, 1, 10, 77);
  const Tensor<float> w = float_rows(prob.model.router, c.hidden, {0, 1, 2, 3, 4}, Shape{5, c.hidden});
  const Tensor<float> a = float_rows(prob.x, c.hidden, {0, 1, 2, 3}, Shape{4, c.hidden});
  const Tensor<float> b = float_rows(prob.x, c.hidden, {4, 5, 6, 7, 8, 9}, Shape{6, c.hidden});
  std::vector<double> sums = router_statistics(route<ops::Cpu>(c, w.view(), a.view()));
  const std::vector<double> more = router_statistics(route<ops::Cpu>(c, w.view(), b.view()));
  for (std::size_t i = 0; i < sums.size(); ++i) sums[i] += more[i];
  const RouterLosses losses = router_losses(c, sums);
  const ReferenceResult ref = reference_moe(prob.model, prob.x, {}, prob.k, {});
  const std::vector<double> got{losses.aux, losses.z}, want{ref.aux, ref.z};
  CHECK_CLOSE(got, want, kFloat32);
  CHECK(losses.tokens == 10);
  double load = 0;
  for (double f : losses.load) load += f;
  CHECK(load == doctest::Approx(1.0));
}

TEST_CASE("route_backward: dx and the router gradient agree with finite differences (gates, aux loss, z-loss)") {
  std::uint64_t seed = 60;
  for (const RouterScoring scoring : {RouterScoring::softmax, RouterScoring::sigmoid})
    for (const bool normalize : {false, true})
      for (const bool per_token : {false, true}) {
        CAPTURE(int(scoring));
        CAPTURE(normalize);
        CAPTURE(per_token);
        const MoeConfig c = router_config(scoring, normalize, 1.5);
        MoeProblem prob = random_problem(c, 1, 8, seed++, per_token);
        const std::int64_t h = c.hidden, n = 8;
        std::vector<std::int64_t> ids(8);
        for (std::int64_t t = 0; t < n; ++t) ids[std::size_t(t)] = t;
        const Tensor<float> w = float_rows(prob.model.router, h, {0, 1, 2, 3, 4}, Shape{5, h});
        const Tensor<float> x = float_rows(prob.x, h, ids, Shape{n, h});
        const Routing r = route<ops::Cpu>(c, w.view(), x.view(), per_token ? TopK{0, prob.k} : TopK{});
        const RouterLosses losses = router_losses(c, router_statistics(r));
        Rng rng(seed * 3);
        const Tensor<float> dgates = random_uniform<float>(Shape{r.assignments()}, rng);
        Tensor<float> dx(Shape{n, h}), dw(Shape{5, h});
        BufferPool pool;
        route_backward<ops::Cpu>(c, w.view(), x.view(), r, losses, dgates.view(), dx.view(), dw.view(), pool);

        std::vector<std::vector<std::int64_t>> chosen(static_cast<std::size_t>(n));
        for (std::int64_t t = 0; t < n; ++t)
          for (std::int64_t a = r.offsets[std::size_t(t)]; a < r.offsets[std::size_t(t + 1)]; ++a)
            chosen[std::size_t(t)].push_back(r.expert[std::size_t(a)]);
        const std::vector<double> dg(dgates.span().begin(), dgates.span().end());
        const auto numeric = [&](std::vector<double>& param) {
          std::vector<double> grad(param.size());
          for (std::size_t i = 0; i < param.size(); ++i) {
            const double saved = param[i], step = 1e-6;
            param[i] = saved + step;
            const double up = router_loss(c, prob.x, prob.model.router, chosen, dg);
            param[i] = saved - step;
            const double down = router_loss(c, prob.x, prob.model.router, chosen, dg);
            param[i] = saved;
            grad[i] = (up - down) / (2 * step);
          }
          return grad;
        };
        CHECK_CLOSE(dx.span(), numeric(prob.x), kFloat32);
        CHECK_CLOSE(dw.span(), numeric(prob.model.router), kFloat32);
      }
}

TEST_CASE("route: bad k, per-token counts and shapes are Errors naming the value") {
  const MoeConfig c = router_config(RouterScoring::softmax, false, 1.0);
  const Tensor<float> w(Shape{5, 6}), x(Shape{3, 6}), wrong(Shape{4, 6});
  CHECK_THROWS_WITH_AS((void)route<ops::Cpu>(c, w.view(), x.view(), TopK{6}), doctest::Contains("k = 6 must be in [1, experts = 5]"), Error);
  const std::vector<std::int64_t> counts = {1, 6, 0};
  CHECK_THROWS_WITH_AS((void)route<ops::Cpu>(c, w.view(), x.view(), TopK{0, counts}),
                       doctest::Contains("token 1 asks for 6 experts, expected 0..5"), Error);
  const std::vector<std::int64_t> short_counts = {1, 2};
  CHECK_THROWS_WITH_AS((void)route<ops::Cpu>(c, w.view(), x.view(), TopK{0, short_counts}),
                       doctest::Contains("2 per-token expert counts for 3 tokens"), Error);
  CHECK_THROWS_WITH_AS((void)route<ops::Cpu>(c, wrong.view(), x.view()), doctest::Contains("expected [E, h] = [5, 6]"), Error);
  const std::vector<std::int64_t> none = {0, 0, 0};
  const Routing empty = route<ops::Cpu>(c, w.view(), x.view(), TopK{0, none});
  CHECK(empty.assignments() == 0);
}

TEST_CASE("router losses: the default aux is 1/k of Hugging Face's Mixtral value; per_token_hf gives it (issue 27)") {
  // E = 4, top-2, 3 tokens. Score sums per expert 1.2, 0.9, 0.6, 0.3 (each token's softmax sums to 1); assignments
  // 3, 2, 1, 0 (6 = 3 tokens x 2). Mixtral's load_balancing_loss_func: E * sum_i (count_i / tokens) * P_i
  // = 4 * (1 * 0.4 + 2/3 * 0.3 + 1/3 * 0.2) = 8/3.
  MoeConfig c;
  c.hidden = 8, c.experts = 4, c.top_k = 2, c.expert_ffn = 8, c.aux_loss_coef = 0.5;
  const std::vector<double> sums = {1.2, 0.9, 0.6, 0.3, 3, 2, 1, 0, /*lse^2*/ 0, /*tokens*/ 3, /*assignments*/ 6};
  const RouterLosses switch_form = router_losses(c, sums);
  CHECK(switch_form.aux == doctest::Approx(4.0 / 3.0));
  c.aux_scaling = AuxLossScaling::per_token_hf;
  const RouterLosses hf = router_losses(c, sums);
  CHECK(hf.aux == doctest::Approx(8.0 / 3.0));
  // The gradient follows: d(coef * aux) / d score[t, i] = coef * E * f_i / tokens, f_i = count_i / tokens.
  CHECK(hf.aux_grad.span()[0] == doctest::Approx(0.5 * 4 * (3.0 / 3.0) / 3.0));
  CHECK(switch_form.aux_grad.span()[0] == doctest::Approx(0.5 * 4 * (3.0 / 6.0) / 3.0));
}
