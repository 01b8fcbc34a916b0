// tests/serve/paged_attention.cpp: the attention over the paged KV cache (serve/paged_attention.hpp) against a
// float64 reference; a step's dry run records it as one paged-attention event per layer (the batch's visible pairs,
// the rank's query heads, the head dim); and a simulated step (the dry run's cost, and step_cost's analytic model)
// charges it what the profile's PagedAttentionModel says, per layer, or flash attention's price without one.
#include "paradyse/comm/threads.hpp"
#include "paradyse/core/rng.hpp"
#include "paradyse/cost/builtin_profiles.hpp"
#include "paradyse/serve/paged_attention.hpp"
#include "paradyse/serve/step_dry_run.hpp"
#include "paradyse/serve/synthetic_decoder.hpp"

#include <doctest/doctest.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <vector>

using namespace paradyse;
using namespace paradyse::serve;

namespace paged_attention_test {

// out [len, hq d] in float64: causal attention of q (positions start ..) over keys and values [start + len, hk, d].
std::vector<double> reference(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
                              std::int64_t len, std::int64_t start, std::int64_t hq, std::int64_t hk, std::int64_t d) {
  std::vector<double> out(std::size_t(len * hq * d), 0.0);
  const std::int64_t group = hq / hk;
  for (std::int64_t i = 0; i < len; ++i)
    for (std::int64_t h = 0; h < hq; ++h) {
      const std::int64_t kv = h / group, visible = start + i + 1;
      std::vector<double> s(static_cast<std::size_t>(visible));
      double top = -1e300, total = 0;
      for (std::int64_t t = 0; t < visible; ++t) {
        double dot = 0;
        for (std::int64_t e = 0; e < d; ++e)
          dot += double(q[std::size_t((i * hq + h) * d + e)]) * double(k[std::size_t((t * hk + kv) * d + e)]);
        s[std::size_t(t)] = dot / std::sqrt(double(d));
        top = std::max(top, s[std::size_t(t)]);
      }
      for (double& x : s) total += (x = std::exp(x - top));
      for (std::int64_t t = 0; t < visible; ++t)
        for (std::int64_t e = 0; e < d; ++e)
          out[std::size_t((i * hq + h) * d + e)] += s[std::size_t(t)] / total * double(v[std::size_t((t * hk + kv) * d + e)]);
    }
  return out;
}

// A step's trace: the chunks, TP everywhere, loads spread over the experts.
StepTrace prompt_step(const DecoderConfig& c, int p, const std::vector<ChunkShape>& chunks) {
  StepTrace t;
  t.ranks = p;
  t.chunks = chunks;
  const std::int64_t pairs = t.tokens() * c.moe.top_k;
  for (std::int64_t l = 0; l < c.layers; ++l) {
    std::vector<std::int64_t> loads(std::size_t(c.moe.experts), 0);
    for (std::int64_t j = 0; j < pairs; ++j) ++loads[std::size_t((j * 5 + l) % c.moe.experts)];
    t.routed.push_back(loads);
  }
  t.layout.assign(std::size_t(c.layers), ExpertLayout::tp());
  t.next.assign(std::size_t(c.layers), std::nullopt);
  return t;
}

double batch_pairs(const StepTrace& t) {
  double pairs = 0;
  for (const ChunkShape& ch : t.chunks) pairs += chunk_pairs(ch.tokens, ch.cached);
  return pairs;
}

TEST_CASE("paged attention: each chunk's queries against a float64 reference, GQA, across blocks") {
  Rng rng(20261202);
  for (const auto& [len, start, hq, hk, d, block] : std::vector<std::array<std::int64_t, 6>>{
           {1, 0, 4, 2, 8, 4}, {5, 0, 4, 4, 16, 4}, {3, 17, 6, 2, 8, 16}, {1, 40, 2, 1, 32, 16}, {7, 9, 3, 3, 4, 3}}) {
    INFO("len ", len, " after ", start, ", ", hq, " query heads over ", hk, ", d ", d, ", blocks of ", block);
    const std::int64_t total = start + len;
    PagedKvCache cache({2, 3 * ((total + block - 1) / block), block, hk, d});
    std::vector<float> q(std::size_t(len * hq * d)), k(std::size_t(total * hk * d)), v(k.size());
    for (float& x : q) x = float(rng.normal());
    for (float& x : k) x = float(rng.normal());
    for (float& x : v) x = float(rng.normal());
    // Another request first, so that the chunk's blocks are not the pool's first ones.
    cache.reserve(9, block + 1);
    Tensor<float> other(Shape{block + 1, hk, d});
    cache.append(9, 0, other.view(), other.view());
    cache.append(9, 1, other.view(), other.view());
    cache.reserve(3, total);
    const TensorView<const float> kv_k(k.data(), Shape{total, hk, d}), kv_v(v.data(), Shape{total, hk, d});
    cache.append(3, 0, kv_k, kv_v);  // layer 0: zeros in layer 1 would not match; layer 1 gets the same
    cache.append(3, 1, kv_k, kv_v);
    Tensor<float> out(Shape{len, hq * d});
    std::vector<float> scores;
    paged_attention(cache, 3, 1, start, TensorView<const float>(q.data(), Shape{len, hq * d}), out.view(),
                    {0, hq}, {0, hk}, hq / hk, d, scores);
    const std::vector<double> want = reference(q, k, v, len, start, hq, hk, d);
    for (std::size_t i = 0; i < want.size(); ++i) CHECK(out.data()[i] == doctest::Approx(want[i]).epsilon(1e-5).scale(1));
  }
}

TEST_CASE("paged attention: the dry run records one paged kernel per layer with the batch's pairs and heads") {
  const DecoderConfig c = synthetic_config(96, 3, 6, 3, 4, 2, 64, 128);
  for (const int p : {1, 2, 3, 4}) {  // 6 query heads: 6, 3, 2 per rank, and 2, 2, 1, 1 on four ranks
    const StepTrace t = prompt_step(c, p, {{11, 0, false}, {1, 29, true}, {4, 13, false}});
    for (int r = 0; r < p; ++r) {
      INFO("p = ", p, " rank ", r);
      const RankStepTrace trace = dry_run_step(c, t, r);
      int paged = 0;
      for (const TraceEvent& e : trace.events) {
        CHECK(e.kind != TraceKind::attention_forward);  // the paged kernel is not flash attention
        if (e.kind != TraceKind::paged_attention) continue;
        ++paged;
        CHECK(e.m == batch_pairs(t));
        CHECK(e.n == double(query_heads(c, p, r).length));
        CHECK(e.k == double(c.head_dim));
      }
      CHECK(paged == c.layers);
    }
  }
}

TEST_CASE("paged attention: a simulated step charges the paged kernel at the profile's rates, per layer") {
  const DecoderConfig c = synthetic_config(256, 2, 8, 4, 8, 2, 512, 1024);
  SimulatedCluster before{cost::h100_sxm_80gb_x8(), 4};
  before.profile.attention.overhead_s = 0;  // flash attention's price: a pure rate, so the difference is exact
  SimulatedCluster with = before;
  with.profile.paged_attention = {4.1e7, 3.3e9};
  for (const int p : {1, 2}) {  // ranks alike (even heads): every rank's attention is the step's
    for (const auto& chunks : std::vector<std::vector<ChunkShape>>{{{64, 0, false}},
                                                                 {{40, 0, false}, {1, 48, true}, {1, 17, true}}}) {
      const StepTrace t = prompt_step(c, p, chunks);
      const double hq = double(query_heads(c, p, 0).length), d = double(c.head_dim), pairs = batch_pairs(t);
      const double per_layer = with.profile.paged_attention.time(pairs * hq, d) -
                               before.profile.attention.forward_time(4 * d * hq * pairs);
      INFO("p = ", p, ", ", chunks.size(), " chunks: ", per_layer * 1e3, " ms per layer more");
      CHECK(per_layer > 0);
      CHECK(dry_run_step_cost(c, t, with).total_s() - dry_run_step_cost(c, t, before).total_s() ==
            doctest::Approx(double(c.layers) * per_layer).epsilon(1e-9));
      CHECK(step_cost(c, t, with).total_s() - step_cost(c, t, before).total_s() ==
            doctest::Approx(double(c.layers) * per_layer).epsilon(1e-9));
    }
  }
}

}  // namespace paged_attention_test
