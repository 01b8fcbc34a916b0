// tests/moe/grouped_routing.cpp: DeepSeek's grouped top-k (moe/grouped_routing.hpp) on hand-made logits where the
// grouped choice differs from plain top-k: DeepSeek-V2's group_limited_greedy (groups by their best softmax score,
// weights not renormalised, times routed_scaling_factor) and DeepSeek-V3's noaux_tc (the correction bias chooses,
// groups by the sum of their best two, the plain sigmoid weights renormalised); a per-call k; refusals.
#include "paradyse/moe/grouped_routing.hpp"
#include "paradyse/ops/backend.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <vector>

using namespace paradyse;

namespace {

// One token whose router logits are `logits` (router = identity, x = the logits).
Routing route_one(const MoeConfig& c, const std::vector<float>& logits, const std::vector<float>& bias, TopK k = {}) {
  const std::int64_t E = c.experts;
  Tensor<float> router(Shape{E, E}), x(Shape{1, E});
  for (std::int64_t e = 0; e < E; ++e) {
    router.data()[e * E + e] = 1.0f;
    x.data()[e] = logits[std::size_t(e)];
  }
  return route_grouped<ops::Cpu>(c, router.view(), bias, x.view(), k);
}

std::set<std::int64_t> chosen(const Routing& r) { return {r.expert.begin(), r.expert.end()}; }

MoeConfig grouped(TopkMethod method) {
  MoeConfig c;
  c.hidden = 8;
  c.experts = 8;
  c.top_k = 3;
  c.expert_ffn = 4;
  c.topk_method = method;
  c.n_group = 4;  // groups {0,1} {2,3} {4,5} {6,7}
  c.topk_group = 2;
  return c;
}

}  // namespace

TEST_CASE("grouped routing: group_limited_greedy keeps the topk_group groups with the best score, then plain top-k") {
  MoeConfig c = grouped(TopkMethod::group_limited_greedy);
  c.routed_scaling_factor = 1.5;
  c.validate();
  // Group bests: 3 (expert 0), 2.5 (expert 2), 2.45 (expert 4), 0: groups 0 and 1 stay. Plain top-3 would take
  // expert 4 (2.45) over expert 3 (2.4).
  const std::vector<float> logits = {3.0f, -1.0f, 2.5f, 2.4f, 2.45f, 0.0f, 0.0f, 0.0f};
  const Routing r = route_one(c, logits, {});
  CHECK(chosen(r) == std::set<std::int64_t>{0, 2, 3});
  double total = 0;
  for (const float l : logits) total += std::exp(double(l));
  for (std::int64_t j = 0; j < 3; ++j) {  // softmax over all 8 experts, times the scaling, not renormalised
    const std::int64_t e = r.expert[std::size_t(j)];
    CHECK(r.gates.data()[j] == doctest::Approx(1.5 * std::exp(double(logits[std::size_t(e)])) / total).epsilon(1e-6));
  }
}

TEST_CASE("grouped routing: noaux_tc chooses by sigmoid + bias, groups by their best two, weights by the sigmoid") {
  MoeConfig c = grouped(TopkMethod::noaux_tc);
  c.scoring = RouterScoring::sigmoid;
  c.norm_topk_prob = true;
  c.routed_scaling_factor = 2.0;
  c.validate();
  const std::vector<float> logits = {2.0f, 1.9f, -3.0f, -3.0f, 0.5f, 0.4f, 0.0f, -0.1f};
  const std::vector<float> bias = {0, 0, 0, 0, 0, 0, 1.0f, 1.0f};
  const auto sigmoid = [](double l) { return 1.0 / (1.0 + std::exp(-l)); };
  // Choice values: 0.881 0.870 0.047 0.047 0.622 0.599 1.5 1.475; group sums 1.751 0.095 1.221 2.975: groups 3 and 0
  // stay; the top 3 choice values there: experts 6, 7, 0. Without the bias: 0, 1, 4.
  const Routing r = route_one(c, logits, bias);
  CHECK(chosen(r) == std::set<std::int64_t>{6, 7, 0});
  double sum = 0;
  for (const std::int64_t e : {6, 7, 0}) sum += sigmoid(logits[std::size_t(e)]);
  for (std::int64_t j = 0; j < 3; ++j) {
    const std::int64_t e = r.expert[std::size_t(j)];
    CHECK(r.gates.data()[j] == doctest::Approx(2.0 * sigmoid(logits[std::size_t(e)]) / sum).epsilon(1e-6));
  }
  CHECK(chosen(route_one(c, logits, std::vector<float>(8, 0.0f))) == std::set<std::int64_t>{0, 1, 4});
  // Without renormalisation the weights are the plain sigmoid scores times the scaling.
  c.norm_topk_prob = false;
  const Routing plain = route_one(c, logits, bias);
  for (std::int64_t j = 0; j < 3; ++j)
    CHECK(plain.gates.data()[j] ==
          doctest::Approx(2.0 * sigmoid(logits[std::size_t(plain.expert[std::size_t(j)])])).epsilon(1e-6));
}

TEST_CASE("grouped routing: a per-call k within the kept groups; per-token counts and a bad shape are refused") {
  MoeConfig c = grouped(TopkMethod::group_limited_greedy);
  const std::vector<float> logits = {3.0f, -1.0f, 2.5f, 2.4f, 2.45f, 0.0f, 0.0f, 0.0f};
  CHECK(chosen(route_one(c, logits, {}, TopK{1})) == std::set<std::int64_t>{0});
  CHECK(chosen(route_one(c, logits, {}, TopK{4})) == std::set<std::int64_t>{0, 1, 2, 3});
  CHECK_THROWS_WITH_AS(route_one(c, logits, {}, TopK{5}), doctest::Contains("k = 5 must be in [1, topk_group x experts "
                                                                             "per group = 4]"), Error);
  const std::int64_t counts[] = {2};
  CHECK_THROWS_WITH_AS(route_one(c, logits, {}, TopK{0, counts}), doctest::Contains("per-token counts"), Error);
  MoeConfig v3 = grouped(TopkMethod::noaux_tc);
  CHECK_THROWS_WITH_AS(route_one(v3, logits, {}), doctest::Contains("noaux_tc needs e_score_correction_bias [8]"), Error);
  c.n_group = 3;
  CHECK_THROWS_WITH_AS(c.validate(), doctest::Contains("n_group = 3 must divide experts = 8"), Error);
}
