// tests/moe/alloc.cpp: Alloc-MoE (issue 12): the budget's parsing and resolution, Alloc-L's DP against brute force
// on random small instances (optimal value and the tie rule), Alloc-T's properties (conservation, floor, true top
// set, deterministic ties, T = 1 is plain top-K, pools are independent), the sensitivity table's JSON round trip and
// its profilers, and the MoE layer routed with a per-layer k and with pooled per-token counts against the float64
// reference of the same selection (output, input gradient, every weight gradient), on one rank and under
// ExpertParallel and ExpertTensorParallel over p in {1, 2, 3}.
#include "moe/layer_harness.hpp"
#include "moe/reference_moe.hpp"
#include "support/tolerance.hpp"

#include "paradyse/comm/threads.hpp"
#include "paradyse/moe/alloc_layers.hpp"
#include "paradyse/moe/alloc_tokens.hpp"
#include "paradyse/moe/budget.hpp"
#include "paradyse/moe/moe_layer.hpp"
#include "paradyse/moe/sensitivity.hpp"

#include <doctest/doctest.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <limits>
#include <numeric>
#include <vector>

#include <unistd.h>

using namespace paradyse;
using namespace paradyse::testing;

namespace {

// ---- brute force for Alloc-L ----

struct BruteForce {
  double best = std::numeric_limits<double>::infinity();
  std::vector<std::int64_t> k;  // the lexicographically smallest optimal allocation
  int feasible = 0;
};

BruteForce brute_force(const std::vector<std::vector<double>>& delta, std::int64_t budget) {
  BruteForce out;
  std::vector<std::int64_t> k(delta.size(), 1);
  const std::function<void(std::size_t)> walk = [&](std::size_t l) {
    if (l == delta.size()) {
      if (std::accumulate(k.begin(), k.end(), std::int64_t(0)) != budget) return;
      ++out.feasible;
      const double loss = allocation_loss(delta, k);
      if (loss < out.best) {  // enumeration is lexicographic: the first optimum found is the smallest
        out.best = loss;
        out.k = k;
      }
      return;
    }
    for (std::int64_t j = 1; j <= std::int64_t(delta[l].size()); ++j) {
      k[l] = j;
      walk(l + 1);
    }
  };
  walk(0);
  return out;
}

// ---- an independent float64 Alloc-T on the reference's scores ----

// Selected (token, expert) pairs of a pool by a full sort (score, then logit, then the lower token, lower expert):
// the floor first, then the best of the rest. Returns k_t per token of the pool.
std::vector<std::int64_t> pooled_counts_by_sort(const std::vector<double>& probs, const std::vector<double>& logits,
                                                std::int64_t tokens, std::int64_t experts, std::int64_t k) {
  std::vector<std::int64_t> order(static_cast<std::size_t>(tokens * experts));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) {
    if (probs[std::size_t(a)] != probs[std::size_t(b)]) return probs[std::size_t(a)] > probs[std::size_t(b)];
    return logits[std::size_t(a)] > logits[std::size_t(b)];
  });
  std::vector<std::int64_t> counts(static_cast<std::size_t>(tokens), 0);
  std::vector<bool> taken(order.size(), false);
  for (const std::int64_t a : order)  // the floor: each token's first entry in the order
    if (counts[std::size_t(a / experts)] == 0) counts[std::size_t(a / experts)] = 1, taken[std::size_t(a)] = true;
  std::int64_t left = (k - 1) * tokens;
  for (const std::int64_t a : order)
    if (left > 0 && !taken[std::size_t(a)]) ++counts[std::size_t(a / experts)], --left;
  return counts;
}

// The reference router's scores and logits of the given tokens (float64).
void reference_scores(const MoeProblem& prob, const std::vector<std::int64_t>& ids, std::vector<double>& probs,
                      std::vector<double>& logits) {
  const MoeConfig& c = prob.model.config;
  const std::int64_t h = c.hidden, e_count = c.experts;
  probs.clear();
  logits.clear();
  for (const std::int64_t t : ids) {
    std::vector<double> l(static_cast<std::size_t>(e_count), 0.0);
    double top = -1e300;
    for (std::int64_t e = 0; e < e_count; ++e) {
      for (std::int64_t col = 0; col < h; ++col)
        l[std::size_t(e)] += prob.x[std::size_t(t * h + col)] * prob.model.router[std::size_t(e * h + col)];
      top = std::max(top, l[std::size_t(e)]);
    }
    double sum = 0;
    for (const double v : l) sum += std::exp(v - top);
    for (const double v : l) {
      logits.push_back(v);
      probs.push_back(c.scoring == RouterScoring::softmax ? std::exp(v - top) / sum : 1.0 / (1.0 + std::exp(-v)));
    }
  }
}

// h 8, expert ffn 6 (the layer tests' small experts).
MoeConfig small_config(std::int64_t experts, std::int64_t top_k) { return moe_harness::base_config(experts, top_k); }

}  // namespace

// ================================================================ budget

TEST_CASE("alloc budget: parsing shares and counts") {
  CHECK(parse_budget("50%").kind == BudgetSpec::Kind::share);
  CHECK(parse_budget("50%").share == doctest::Approx(0.5));
  CHECK(parse_budget(" 0.25 ").share == doctest::Approx(0.25));
  CHECK(parse_budget("1.0").share == doctest::Approx(1.0));
  CHECK(parse_budget("78").kind == BudgetSpec::Kind::count);
  CHECK(parse_budget("78").count == 78);
  CHECK_THROWS_WITH_AS((void)parse_budget(""), doctest::Contains("empty budget"), Error);
  CHECK_THROWS_WITH_AS((void)parse_budget("half"), doctest::Contains("\"half\" is not a number"), Error);
  CHECK_THROWS_WITH_AS((void)parse_budget("12a"), doctest::Contains("\"12a\" is not a number"), Error);
  CHECK_THROWS_WITH_AS((void)parse_budget("5x%"), doctest::Contains("is not a number"), Error);
  CHECK_THROWS_WITH_AS((void)parse_budget("-5%"), doctest::Contains("expected a share above 0"), Error);
  CHECK_THROWS_WITH_AS((void)parse_budget("0.0"), doctest::Contains("expected a share above 0"), Error);
  CHECK_THROWS_WITH_AS((void)parse_budget("0"), doctest::Contains("expected a count of at least 1"), Error);
}

TEST_CASE("alloc budget: resolution against the model and its bounds") {
  // DeepSeek-V2-Lite's shape: 26 MoE layers of top-6.
  const std::vector<std::int64_t> top6(26, 6);
  CHECK(full_budget(top6) == 156);
  CHECK(resolve_budget(parse_budget("50%"), top6) == 78);
  CHECK(resolve_budget(parse_budget("0.25"), top6) == 39);
  CHECK(resolve_budget(parse_budget("100"), top6) == 100);
  CHECK(resolve_budget(parse_budget("26"), top6) == 26);
  CHECK_THROWS_WITH_AS((void)resolve_budget(parse_budget("10%"), top6),
                       doctest::Contains("is 16 activations per token; expected 26 (one expert in each of the 26"),
                       Error);
  CHECK_THROWS_WITH_AS((void)resolve_budget(parse_budget("157"), top6),
                       doctest::Contains("157 activations per token; expected 26"), Error);
  CHECK_THROWS_WITH_AS((void)resolve_budget(parse_budget("120%"), top6), doctest::Contains("to 156 (K_max"), Error);
  // Above the top-k when K_max allows it.
  const std::vector<std::int64_t> kmax8(26, 8);
  CHECK(resolve_budget(parse_budget("120%"), top6, kmax8) == 187);
  const std::vector<std::int64_t> bad{2, 0, 2};
  CHECK_THROWS_WITH_AS((void)full_budget(bad), doctest::Contains("MoE layer 1 has top-k = 0"), Error);
  CHECK_THROWS_WITH_AS((void)full_budget(std::vector<std::int64_t>{}), doctest::Contains("no MoE layer"), Error);
  const std::vector<std::int64_t> low{6, 5};
  CHECK_THROWS_WITH_AS((void)resolve_budget(parse_budget("50%"), std::vector<std::int64_t>{6, 6}, low),
                       doctest::Contains("layer 1 has K_max = 5 below its top-k = 6"), Error);
}

TEST_CASE("alloc budget: uniform reduction sums to the budget within [1, k_l]") {
  const std::vector<std::int64_t> top6(26, 6);
  for (std::int64_t b = 26; b <= 156; ++b) {
    const std::vector<std::int64_t> k = uniform_allocation(top6, b);
    CHECK(std::accumulate(k.begin(), k.end(), std::int64_t(0)) == b);
    CHECK(*std::min_element(k.begin(), k.end()) >= b / 26);
    CHECK(*std::max_element(k.begin(), k.end()) <= (b + 25) / 26);
  }
  const std::vector<std::int64_t> mixed{1, 4, 2, 8};
  for (std::int64_t b = 4; b <= 15; ++b) {
    const std::vector<std::int64_t> k = uniform_allocation(mixed, b);
    CHECK(std::accumulate(k.begin(), k.end(), std::int64_t(0)) == b);
    for (std::size_t l = 0; l < k.size(); ++l) CHECK((k[l] >= 1 && k[l] <= mixed[l]));
  }
  CHECK(uniform_allocation(std::vector<std::int64_t>{2, 2, 2, 2}, 6) == std::vector<std::int64_t>{2, 2, 1, 1});
  CHECK_THROWS_WITH_AS((void)uniform_allocation(mixed, 3), doctest::Contains("budget 3 outside [4"), Error);
}

// ================================================================ Alloc-L

TEST_CASE("alloc layers: the DP is optimal against brute force on random small instances") {
  Rng rng(1201);
  int instances = 0, with_ties = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const std::size_t layers = 1 + std::size_t(rng.below(5));
    const bool integer = trial % 2 == 1;  // small integers: many exact ties
    std::vector<std::vector<double>> delta(layers);
    std::int64_t most = 0;
    for (auto& row : delta) {
      row.resize(1 + std::size_t(rng.below(4)));
      for (double& d : row) d = integer ? double(rng.below(4)) : rng.uniform(-0.2, 3.0);
      most += std::int64_t(row.size());
    }
    for (std::int64_t b = std::int64_t(layers); b <= most; ++b) {
      CAPTURE(trial);
      CAPTURE(b);
      const BruteForce want = brute_force(delta, b);
      const LayerAllocation got = allocate_layers(delta, b);
      REQUIRE(want.feasible > 0);
      CHECK(std::accumulate(got.k.begin(), got.k.end(), std::int64_t(0)) == b);
      for (std::size_t l = 0; l < layers; ++l) CHECK((got.k[l] >= 1 && got.k[l] <= std::int64_t(delta[l].size())));
      CHECK(got.predicted == want.best);  // exact: min commutes with a rounded addition
      CHECK(allocation_loss(delta, got.k) == want.best);
      CHECK(got.k == want.k);  // the tie rule: the lexicographically smallest optimum
      if (want.feasible > 1) ++instances;
      if (integer) ++with_ties;
    }
  }
  CHECK(instances > 200);
  CHECK(with_ties > 100);
}

TEST_CASE("alloc layers: ties, a sensitive layer, and refusals") {
  // All zero: every allocation ties; the smallest k go to the lowest layers.
  const std::vector<std::vector<double>> flat(3, std::vector<double>(4, 0.0));
  CHECK(allocate_layers(flat, 6).k == std::vector<std::int64_t>{1, 1, 4});
  // Layer 1 loses much below its top-k: it keeps its experts; the others give them up.
  const std::vector<std::vector<double>> one_sensitive{{0.1, 0.05, 0.0}, {5.0, 2.0, 0.0}, {0.2, 0.1, 0.0}};
  const LayerAllocation a = allocate_layers(one_sensitive, 5);
  CHECK(a.k == std::vector<std::int64_t>{1, 3, 1});
  CHECK(a.predicted == doctest::Approx(0.3));
  CHECK_THROWS_WITH_AS((void)allocate_layers(one_sensitive, 2), doctest::Contains("budget 2 outside [3"), Error);
  CHECK_THROWS_WITH_AS((void)allocate_layers(one_sensitive, 10), doctest::Contains("9 (K_max in every layer)"), Error);
  const std::vector<std::vector<double>> with_nan{{0.0, std::nan("")}};
  CHECK_THROWS_WITH_AS((void)allocate_layers(with_nan, 1), doctest::Contains("Delta_0(2) = nan is not finite"), Error);
  const std::vector<std::vector<double>> empty_row{{0.0}, {}};
  CHECK_THROWS_WITH_AS((void)allocate_layers(empty_row, 2), doctest::Contains("layer 1 has no entry"), Error);
  CHECK_THROWS_WITH_AS((void)allocate_layers(std::vector<std::vector<double>>{}, 1), doctest::Contains("empty"), Error);
}

// ================================================================ Alloc-T

TEST_CASE("alloc tokens: conservation, floor, true top set on random score matrices") {
  Rng rng(1202);
  for (int trial = 0; trial < 200; ++trial) {
    const std::int64_t tokens = 1 + std::int64_t(rng.below(20)), experts = 2 + std::int64_t(rng.below(8));
    const std::int64_t k = 1 + std::int64_t(rng.below(std::uint64_t(experts)));
    const bool coarse = trial % 3 == 0;  // scores on a grid of 4 values: many exact ties
    std::vector<float> scores(static_cast<std::size_t>(tokens * experts)), logits(scores.size());
    for (std::size_t i = 0; i < scores.size(); ++i) {
      logits[i] = float(rng.uniform(-2, 2));
      scores[i] = coarse ? float(rng.below(4)) / 4.0f : float(rng.uniform());
    }
    CAPTURE(trial);
    const TokenAllocation got = allocate_tokens(scores, {}, tokens, experts, k);
    CHECK(std::accumulate(got.counts.begin(), got.counts.end(), std::int64_t(0)) == k * tokens);
    // The total order: score, then the lower flat index.
    const auto before = [&](std::int64_t a, std::int64_t b) {
      return scores[std::size_t(a)] != scores[std::size_t(b)] ? scores[std::size_t(a)] > scores[std::size_t(b)] : a < b;
    };
    std::vector<std::int64_t> floor_of(static_cast<std::size_t>(tokens));
    for (std::int64_t t = 0; t < tokens; ++t) {
      CHECK(got.counts[std::size_t(t)] >= 1);
      std::int64_t best = t * experts, selected = 0;
      for (std::int64_t e = 0; e < experts; ++e) {
        if (before(t * experts + e, best)) best = t * experts + e;
        selected += got.chosen[std::size_t(t * experts + e)];
      }
      CHECK(selected == got.counts[std::size_t(t)]);
      CHECK(got.chosen[std::size_t(best)] == 1);  // the floor is each token's own best expert
      floor_of[std::size_t(t)] = best;
    }
    // The true top set: every selected entry beyond the floors ranks before every entry left out.
    std::int64_t worst_selected = -1, best_left = -1;
    for (std::int64_t a = 0; a < tokens * experts; ++a) {
      if (floor_of[std::size_t(a / experts)] == a) continue;
      if (got.chosen[std::size_t(a)]) {
        if (worst_selected < 0 || before(worst_selected, a)) worst_selected = a;
      } else if (best_left < 0 || before(a, best_left)) {
        best_left = a;
      }
    }
    if (worst_selected >= 0 && best_left >= 0) CHECK(before(worst_selected, best_left));
    // When the plain top-(K T) of the flattened matrix already covers every token, it is exactly the selection.
    std::vector<std::int64_t> order(static_cast<std::size_t>(tokens * experts));
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), before);
    std::vector<std::uint8_t> plain(order.size(), 0);
    std::vector<bool> covered(static_cast<std::size_t>(tokens), false);
    for (std::int64_t i = 0; i < k * tokens; ++i)
      plain[std::size_t(order[std::size_t(i)])] = 1, covered[std::size_t(order[std::size_t(i)] / experts)] = true;
    if (std::all_of(covered.begin(), covered.end(), [](bool b) { return b; })) CHECK(got.chosen == plain);
    // Deterministic: the same call gives the same selection.
    CHECK(allocate_tokens(scores, {}, tokens, experts, k).chosen == got.chosen);
  }
}

TEST_CASE("alloc tokens: T = 1 is plain top-K; ties go to the lower token, then the lower expert; pools") {
  Rng rng(1203);
  for (int trial = 0; trial < 50; ++trial) {
    const std::int64_t experts = 2 + std::int64_t(rng.below(10)), k = 1 + std::int64_t(rng.below(std::uint64_t(experts)));
    std::vector<float> scores(static_cast<std::size_t>(experts)), logits(static_cast<std::size_t>(experts));
    for (std::int64_t e = 0; e < experts; ++e) scores[std::size_t(e)] = float(rng.below(5)), logits[std::size_t(e)] = float(rng.below(3));
    std::vector<std::int64_t> order(static_cast<std::size_t>(experts));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) {
      return scores[std::size_t(a)] != scores[std::size_t(b)] ? scores[std::size_t(a)] > scores[std::size_t(b)]
                                                              : logits[std::size_t(a)] > logits[std::size_t(b)];
    });
    std::vector<std::uint8_t> want(static_cast<std::size_t>(experts), 0);
    for (std::int64_t j = 0; j < k; ++j) want[std::size_t(order[std::size_t(j)])] = 1;
    const TokenAllocation got = allocate_tokens(scores, logits, 1, experts, k);
    CHECK(got.counts == std::vector<std::int64_t>{k});
    CHECK(got.chosen == want);
  }
  // Every score equal: the floor takes expert 0 of each token, the rest go to token 0 first, in expert order.
  const std::vector<float> equal(12, 0.25f);
  const TokenAllocation tied = allocate_tokens(equal, {}, 3, 4, 2);
  CHECK(tied.counts == std::vector<std::int64_t>{4, 1, 1});
  // The logit breaks an exact tie of scores.
  const std::vector<float> two{0.5f, 0.5f}, logit{0.0f, 1.0f};
  CHECK(allocate_tokens(two, logit, 1, 2, 1).chosen == std::vector<std::uint8_t>{0, 1});
  CHECK(allocate_tokens(two, {}, 1, 2, 1).chosen == std::vector<std::uint8_t>{1, 0});
  // Pools: the same as separate calls; a confident token gives its activations to an ambiguous one in its pool only.
  std::vector<float> s(static_cast<std::size_t>(5 * 4));
  for (float& v : s) v = float(rng.uniform());
  const std::int64_t pools[] = {2, 3};
  const TokenAllocation pooled = allocate_tokens(s, {}, 5, 4, 2, pools);
  const TokenAllocation first = allocate_tokens(std::span<const float>(s).first(8), {}, 2, 4, 2);
  const TokenAllocation second = allocate_tokens(std::span<const float>(s).subspan(8), {}, 3, 4, 2);
  std::vector<std::int64_t> joined = first.counts;
  joined.insert(joined.end(), second.counts.begin(), second.counts.end());
  CHECK(pooled.counts == joined);
  CHECK(std::accumulate(pooled.counts.begin(), pooled.counts.begin() + 2, std::int64_t(0)) == 4);
  const std::vector<float> sharp{0.97f, 0.01f, 0.01f, 0.01f, 0.3f, 0.3f, 0.2f, 0.2f};
  CHECK(allocate_tokens(sharp, {}, 2, 4, 2).counts == std::vector<std::int64_t>{1, 3});
  // Refusals.
  CHECK_THROWS_WITH_AS((void)allocate_tokens(equal, {}, 3, 4, 5), doctest::Contains("K_l = 5 must be in [1, experts = 4]"),
                       Error);
  CHECK_THROWS_WITH_AS((void)allocate_tokens(equal, {}, 3, 5, 1), doctest::Contains("12 scores for [T, E] = [3, 5]"),
                       Error);
  std::vector<float> with_nan(equal);
  with_nan[6] = std::nanf("");
  CHECK_THROWS_WITH_AS((void)allocate_tokens(with_nan, {}, 3, 4, 1), doctest::Contains("score [1, 2] = nan"), Error);
  const std::int64_t short_pools[] = {1, 1};
  CHECK_THROWS_WITH_AS((void)allocate_tokens(equal, {}, 3, 4, 1, short_pools),
                       doctest::Contains("the pools hold 2 tokens, expected T = 3"), Error);
}

// ================================================================ sensitivity

TEST_CASE("alloc sensitivity: the table round-trips through JSON bit for bit, and bad tables are refused") {
  Rng rng(1204);
  SensitivityTable t;
  t.metric = SensitivityMetric::output_distortion;
  t.base = rng.uniform(1, 5);
  t.calibration_tokens = 4096;
  for (int l = 0; l < 5; ++l) {
    t.top_k.push_back(2 + l % 2);
    std::vector<double> row;
    for (int k = 0; k < 4; ++k) row.push_back(k + 1 == t.top_k.back() ? 0.0 : rng.uniform(-1e-3, 10.0) / 3.0);
    t.delta.push_back(row);
  }
  const SensitivityTable back = sensitivity_from_json(json::parse(json::dump(sensitivity_to_json(t))));
  CHECK(back.metric == t.metric);
  CHECK(back.top_k == t.top_k);
  CHECK(back.delta == t.delta);  // exact: 17 significant digits
  CHECK(back.base == t.base);
  CHECK(back.calibration_tokens == t.calibration_tokens);
  CHECK(back.k_max() == std::vector<std::int64_t>(5, 4));
  const std::string path = (std::filesystem::temp_directory_path() / fmt::format("alloc_sensitivity_{}.json", ::getpid())).string();
  save_sensitivity(t, path);
  CHECK(load_sensitivity(path).delta == t.delta);
  std::filesystem::remove(path);

  CHECK_THROWS_WITH_AS((void)sensitivity_from_json(json::parse(R"({"format": "other"})")),
                       doctest::Contains("\"format\" must be \"paradyse.alloc_moe.sensitivity\""), Error);
  CHECK_THROWS_WITH_AS((void)sensitivity_from_json(json::parse(
                           R"({"format": "paradyse.alloc_moe.sensitivity", "version": 2})")),
                       doctest::Contains("version 2"), Error);
  CHECK_THROWS_WITH_AS(
      (void)sensitivity_from_json(json::parse(R"({"format": "paradyse.alloc_moe.sensitivity", "version": 1,
        "metric": "perplexity", "base": 0, "calibration_tokens": 1, "layers": []})")),
      doctest::Contains("metric \"perplexity\""), Error);
  CHECK_THROWS_WITH_AS(
      (void)sensitivity_from_json(json::parse(R"({"format": "paradyse.alloc_moe.sensitivity", "version": 1,
        "metric": "loss_increase", "base": 0, "calibration_tokens": 1, "layers": [{"top_k": 3, "delta": [1, 0]}]})")),
      doctest::Contains("layer 0 has top-k = 3 and 2 entries"), Error);
}

TEST_CASE("alloc sensitivity: the loss profiler measures one layer at a time and feeds the DP") {
  // A synthetic separable loss: layer l loses w_l / k per missing expert; plus a coupling the profiler must not see
  // (it only ever changes one layer).
  const std::vector<std::int64_t> top_k{4, 4, 4}, k_max{4, 5, 4};
  const std::vector<double> weight{0.1, 2.0, 0.5};
  std::vector<std::vector<std::int64_t>> calls;
  const auto loss = [&](std::span<const std::int64_t> k) {
    calls.emplace_back(k.begin(), k.end());
    double v = 3.0;
    int changed = 0;
    for (std::size_t l = 0; l < k.size(); ++l) {
      v += weight[l] * (1.0 / double(k[l]) - 1.0 / double(top_k[l]));
      changed += k[l] != top_k[l];
    }
    return v + (changed > 1 ? 100.0 : 0.0);
  };
  const SensitivityTable t = profile_loss_sensitivity(top_k, k_max, 999, loss);
  CHECK(calls.size() == 1 + 3 + 4 + 3);  // the full model, then K_max - 1 per layer
  CHECK(t.base == 3.0);
  CHECK(t.calibration_tokens == 999);
  for (std::size_t l = 0; l < 3; ++l) {
    REQUIRE(t.delta[l].size() == std::size_t(k_max[l]));
    for (std::int64_t k = 1; k <= k_max[l]; ++k)
      CHECK(t.delta[l][std::size_t(k - 1)] == doctest::Approx(weight[l] * (1.0 / double(k) - 0.25)).epsilon(1e-12));
  }
  // Half the budget: the most sensitive layer (1) keeps the most experts.
  const LayerAllocation a = allocate_layers(t.delta, 6);
  CHECK(a.k[1] >= a.k[0]);
  CHECK(a.k[1] >= a.k[2]);
  CHECK(a.k == brute_force(t.delta, 6).k);
}

TEST_CASE("alloc sensitivity: output distortion of an MoE block against the float64 reference") {
  MoeConfig c = small_config(6, 3);
  c.norm_topk_prob = true;
  c.shared_experts = 1;
  c.shared_ffn = 4;
  const MoeProblem prob = random_problem(c, 1, 12, 1205);
  const std::int64_t tokens = 12, h = c.hidden;
  std::vector<std::int64_t> ids(static_cast<std::size_t>(tokens));
  std::iota(ids.begin(), ids.end(), 0);
  const Tensor<float> x = float_rows(prob.x, h, ids, Shape{tokens, h});
  const MoeShard w = float_shard(prob.model, 1, 0);
  BufferPool pool;
  const std::vector<std::int64_t> k_max{5};
  const MoeShard* shards[] = {&w};
  const TensorView<const float> inputs[] = {x.view()};
  const SensitivityTable t = profile_distortion_sensitivity(std::span<const MoeConfig>(&c, 1), shards, inputs, k_max, pool);
  CHECK(t.metric == SensitivityMetric::output_distortion);
  CHECK(t.calibration_tokens == tokens);
  REQUIRE(t.delta.size() == 1);
  REQUIRE(t.delta[0].size() == 5);
  CHECK(t.delta[0][2] == 0.0);
  const ReferenceResult base = reference_moe(prob.model, prob.x, {}, std::vector<std::int64_t>(ids.size(), 3), {ids});
  double den = 0;
  for (const double v : base.y) den += v * v;
  for (std::int64_t k = 1; k <= 5; ++k) {
    const ReferenceResult cut = reference_moe(prob.model, prob.x, {}, std::vector<std::int64_t>(ids.size(), k), {ids});
    double num = 0;
    for (std::size_t i = 0; i < cut.y.size(); ++i) num += (cut.y[i] - base.y[i]) * (cut.y[i] - base.y[i]);
    CAPTURE(k);
    // Relative: the distortions are 0.02 to 0.1 here; 0 at k = 3 (the base), hence the small absolute floor.
    CHECK(t.delta[0][std::size_t(k - 1)] == doctest::Approx(num / den).epsilon(1e-4).scale(1e-2));
    if (k != 3) CHECK(t.delta[0][std::size_t(k - 1)] > 0);
  }
  CHECK_THROWS_WITH_AS((void)profile_distortion_sensitivity(std::span<const MoeConfig>(&c, 1), shards, inputs,
                                                            std::vector<std::int64_t>{7}, pool),
                       doctest::Contains("K_max = 7; expected top-k = 3 to E = 6"), Error);
}

// ================================================================ routing with an allocation

namespace {

using Runner = std::function<void(ThreadCommunicator&, const MoeContext&, const MoeShard&, TensorView<const float>,
                                  TensorView<float>, TensorView<const float>, TensorView<float>, MoeShard&)>;

template <class S>
Runner runner_of() {
  return [](ThreadCommunicator& comm, const MoeContext& ctx, const MoeShard& w, TensorView<const float> x,
            TensorView<float> y, TensorView<const float> dy, TensorView<float> dx, MoeShard& g) {
    S strategy;
    MoeSaved s = strategy.forward(comm, ctx, w, x, y);
    strategy.backward(comm, ctx, w, s, dy, dx, g);
  };
}
const Runner single_runner = [](ThreadCommunicator&, const MoeContext& ctx, const MoeShard& w, TensorView<const float> x,
                                TensorView<float> y, TensorView<const float> dy, TensorView<float> dx, MoeShard& g) {
  MoeSaved s = moe_forward(ctx, w, x, y);
  moe_backward(ctx, w, s, dy, dx, g);
};

// Routes prob's tokens with K = `k` per token, pooled over each rank's own tokens when `pooled`; checks output,
// input gradient and every gradient against the float64 reference run with the counts an independent float64
// Alloc-T gives (or K everywhere).
void check_routed(const MoeProblem& prob, int p, std::int64_t k, bool pooled, const Runner& run) {
  const MoeConfig& c = prob.model.config;
  const std::int64_t h = c.hidden, f = c.expert_ffn;
  const auto groups = rank_groups(prob, p);
  std::vector<std::int64_t> counts(prob.k.size(), k);
  int varied = 0;
  if (pooled)
    for (const auto& ids : groups) {
      std::vector<double> probs, logits;
      reference_scores(prob, ids, probs, logits);
      const std::vector<std::int64_t> mine = pooled_counts_by_sort(probs, logits, std::int64_t(ids.size()), c.experts, k);
      for (std::size_t i = 0; i < ids.size(); ++i) {
        counts[std::size_t(ids[i])] = mine[i];
        varied += mine[i] != k;
      }
    }
  if (pooled && k > 1 && k < c.experts) CHECK(varied > 0);  // Alloc-T moved activations between tokens (k = 1: the floor is all)
  const ReferenceResult ref = reference_moe(prob.model, prob.x, prob.dy, counts, groups);
  std::vector<Tensor<float>> ys(static_cast<std::size_t>(p)), dxs(static_cast<std::size_t>(p));
  std::vector<MoeShard> grads(static_cast<std::size_t>(p));
  std::vector<std::vector<std::int64_t>> rank_ids(static_cast<std::size_t>(p));
  run_ranks(p, [&](ThreadCommunicator& comm) {
    const int r = comm.rank();
    const std::vector<std::int64_t> ids = rank_tokens(prob, p, r);
    const Shape shape{prob.batch, std::int64_t(ids.size()) / prob.batch, h};
    const Tensor<float> x = float_rows(prob.x, h, ids, shape), dy = float_rows(prob.dy, h, ids, shape);
    BufferPool pool;
    TopK choice{k};
    choice.pool_tokens = pooled;
    const MoeContext ctx(c, pool, choice);
    const MoeShard w = float_shard(prob.model, p, r);
    MoeShard g = MoeShard::zeros(c, p, r);
    Tensor<float> y(shape), dx(shape);
    run(comm, ctx, w, x.view(), y.view(), dy.view(), dx.view(), g);
    ys[std::size_t(r)] = std::move(y);
    dxs[std::size_t(r)] = std::move(dx);
    grads[std::size_t(r)] = std::move(g);
    rank_ids[std::size_t(r)] = ids;
  });
  for (int r = 0; r < p; ++r) {
    INFO("rank " << r << " of " << p);
    CHECK_CLOSE(ys[std::size_t(r)].span(), double_rows(ref.y, h, rank_ids[std::size_t(r)]), kFloat32);
    CHECK_CLOSE(dxs[std::size_t(r)].span(), double_rows(ref.dx, h, rank_ids[std::size_t(r)]), kFloat32);
    const MoeShard& g = grads[std::size_t(r)];
    CHECK_CLOSE(g.router.span(), ref.drouter, kFloat32);
    CHECK_CLOSE(g.expert_in.span(), owned_slice(c, ref.dexpert_in, 2 * f * h, p, r), kFloat32);
    CHECK_CLOSE(g.expert_out.span(), owned_slice(c, ref.dexpert_out, f * h, p, r), kFloat32);
    CHECK_CLOSE(g.shared_in.span(), ref.dshared_in, kFloat32);
    CHECK_CLOSE(g.shared_out.span(), ref.dshared_out, kFloat32);
  }
}

}  // namespace

TEST_CASE("alloc routing: the router's pooled counts are Alloc-T's on the router's own scores") {
  for (const RouterScoring scoring : {RouterScoring::softmax, RouterScoring::sigmoid}) {
    MoeConfig c = small_config(8, 3);
    c.scoring = scoring;
    c.norm_topk_prob = true;
    const MoeProblem prob = random_problem(c, 1, 17, 1206 + int(scoring));
    std::vector<std::int64_t> ids(17);
    std::iota(ids.begin(), ids.end(), 0);
    const Tensor<float> x = float_rows(prob.x, c.hidden, ids, Shape{17, c.hidden});
    const MoeShard w = float_shard(prob.model, 1, 0);
    for (const std::int64_t k : {1, 2, 3, 5}) {
      CAPTURE(k);
      TopK choice{k};
      choice.pool_tokens = true;
      const Routing r = route<ops::Cpu>(c, w.router.view(), x.view(), choice);
      const TokenAllocation want = allocate_tokens(r.probs.span(), r.logits.span(), 17, 8, k);
      CHECK(r.assignments() == 17 * k);
      double selected = 0;
      for (std::int64_t t = 0; t < 17; ++t) {
        CHECK(r.count(t) == want.counts[std::size_t(t)]);
        for (std::int64_t a = r.offsets[std::size_t(t)]; a < r.offsets[std::size_t(t + 1)]; ++a) {
          CHECK(want.chosen[std::size_t(t * 8 + r.expert[std::size_t(a)])] == 1);
          selected += r.gates.span()[std::size_t(a)];
        }
      }
      CHECK(selected == doctest::Approx(17.0));  // norm_topk_prob: each token's gates sum to 1
    }
    // Pools of one row (batch-1 decode, or one pool per token): plain top-k, the same routing as TopK{k}.
    for (const std::int64_t k : {1, 3, 6}) {
      CAPTURE(k);
      const std::vector<std::int64_t> singles(17, 1);
      TopK one_row{k};
      one_row.pool_tokens = true;
      one_row.pools = singles;
      const Routing pooled = route<ops::Cpu>(c, w.router.view(), x.view(), one_row);
      const Routing plain = route<ops::Cpu>(c, w.router.view(), x.view(), TopK{k});
      CHECK(pooled.offsets == plain.offsets);
      CHECK(pooled.expert == plain.expert);
      CHECK(std::equal(pooled.gates.span().begin(), pooled.gates.span().end(), plain.gates.span().begin()));
      TopK first{k};
      first.pool_tokens = true;
      const Routing lone = route<ops::Cpu>(c, w.router.view(), x.view().slice(0, 0, 1), first);
      const TokenAllocation want = allocate_tokens(plain.probs.span().first(8), plain.logits.span().first(8), 1, 8, k);
      CHECK(lone.count(0) == k);
      for (std::int64_t a = 0; a < k; ++a) CHECK(want.chosen[std::size_t(lone.expert[std::size_t(a)])] == 1);
    }
    TopK both{2, ids};
    both.pool_tokens = true;
    CHECK_THROWS_WITH_AS((void)route<ops::Cpu>(c, w.router.view(), x.view(), both),
                         doctest::Contains("pool_tokens and per-token counts exclude each other"), Error);
  }
}

TEST_CASE("alloc routing: a per-layer k and pooled counts match the float64 reference, one rank, EP, ETP") {
  struct Case {
    const char* name;
    MoeConfig config;
  };
  std::vector<Case> cases;
  {
    MoeConfig c = small_config(6, 2);
    c.norm_topk_prob = true;
    cases.push_back({"Mixtral-like softmax norm E=6", c});
  }
  {
    MoeConfig c = small_config(5, 3);
    c.scoring = RouterScoring::sigmoid;
    c.norm_topk_prob = true;
    c.routed_scaling_factor = 2.0;
    c.shared_experts = 1;
    c.shared_ffn = 4;
    cases.push_back({"DeepSeek-like sigmoid shared E=5", c});
  }
  std::uint64_t seed = 1300;
  for (const Case& cs : cases) {
    CAPTURE(cs.name);
    for (const std::int64_t k : {std::int64_t(1), cs.config.top_k - 1, cs.config.top_k + 1}) {
      for (const bool pooled : {false, true}) {
        CAPTURE(k);
        CAPTURE(pooled);
        const MoeProblem prob = random_problem(cs.config, 2, 7, seed++);
        check_routed(prob, 1, k, pooled, single_runner);
        for (const int p : {2, 3}) {
          CAPTURE(p);
          check_routed(prob, p, k, pooled, runner_of<ExpertParallel<>>());
          check_routed(prob, p, k, pooled, runner_of<ExpertTensorParallel<>>());
        }
      }
    }
  }
}
