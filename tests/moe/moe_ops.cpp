// tests/moe/moe_ops.cpp: the MoE data ops (ops/cpu/moe_ops.hpp) through ops::Cpu against float64 computations
// written here, the router's backward against finite differences, top-k tie-breaking, bad indices; and the same
// members of ops::Counting (what they record, the stand-in routing).
#include "support/tolerance.hpp"

#include "paradyse/core/rng.hpp"
#include "paradyse/core/trace.hpp"
#include "paradyse/ops/backend.hpp"
#include "paradyse/ops/counting.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

using namespace paradyse;
using namespace paradyse::testing;
using ops::Cpu;
using ops::RouterScoring;

namespace {

struct RouterCase {
  RouterScoring scoring;
  bool normalize;
  float scale;
  bool per_token;
};

std::vector<std::int64_t> offsets_of(const std::vector<std::int64_t>& k) {
  std::vector<std::int64_t> o(k.size() + 1, 0);
  for (std::size_t t = 0; t < k.size(); ++t) o[t + 1] = o[t] + k[t];
  return o;
}

// Scores of one row in float64.
std::vector<double> scores(const float* l, std::int64_t e_count, RouterScoring scoring, double* lse_out = nullptr) {
  double top = -1e300, sum = 0;
  for (std::int64_t e = 0; e < e_count; ++e) top = std::max(top, double(l[e]));
  for (std::int64_t e = 0; e < e_count; ++e) sum += std::exp(double(l[e]) - top);
  const double lse = top + std::log(sum);
  if (lse_out) *lse_out = lse;
  std::vector<double> p(static_cast<std::size_t>(e_count));
  for (std::int64_t e = 0; e < e_count; ++e)
    p[std::size_t(e)] = scoring == RouterScoring::softmax ? std::exp(double(l[e]) - lse) : 1 / (1 + std::exp(-double(l[e])));
  return p;
}

}  // namespace

TEST_CASE("router_forward: scores, logsumexp, top-k with per-token counts, gate weights, statistics") {
  const std::int64_t n = 13, e_count = 6;
  std::uint64_t seed = 1;
  for (const RouterCase rc : {RouterCase{RouterScoring::softmax, false, 1.0f, false},
                              RouterCase{RouterScoring::softmax, true, 1.0f, true},
                              RouterCase{RouterScoring::sigmoid, true, 2.5f, false},
                              RouterCase{RouterScoring::sigmoid, false, 0.5f, true}}) {
    Rng rng(seed++);
    const Tensor<float> logits = random_uniform<float>(Shape{n, e_count}, rng, -3, 3);
    std::vector<std::int64_t> k(static_cast<std::size_t>(n), 2);
    if (rc.per_token)
      for (auto& v : k) v = std::int64_t(rng.below(e_count + 1));
    const std::vector<std::int64_t> offsets = offsets_of(k);
    Tensor<float> probs(Shape{n, e_count}), lse(Shape{n}), gates(Shape{offsets.back()}), stats(Shape{e_count + 1});
    std::vector<std::int64_t> experts(static_cast<std::size_t>(offsets.back()));
    Cpu::router_forward(logits.view(), rc.scoring, rc.normalize, rc.scale, offsets, probs.view(), lse.view(), experts,
                        gates.view(), stats.view());
    std::vector<double> want_probs, want_lse, want_gates, want_stats(static_cast<std::size_t>(e_count + 1), 0.0);
    std::vector<std::int64_t> want_experts;
    for (std::int64_t t = 0; t < n; ++t) {
      const float* l = logits.data() + t * e_count;
      double z = 0;
      const std::vector<double> p = scores(l, e_count, rc.scoring, &z);
      want_probs.insert(want_probs.end(), p.begin(), p.end());
      want_lse.push_back(z);
      want_stats[std::size_t(e_count)] += z * z;
      for (std::int64_t e = 0; e < e_count; ++e) want_stats[std::size_t(e)] += p[std::size_t(e)];
      std::vector<std::int64_t> order(static_cast<std::size_t>(e_count));
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](auto a, auto b) { return l[a] > l[b]; });
      order.resize(std::size_t(k[std::size_t(t)]));
      double sum = 0;
      for (auto e : order) sum += p[std::size_t(e)];
      for (auto e : order) {
        want_experts.push_back(e);
        want_gates.push_back(rc.scale * p[std::size_t(e)] / (rc.normalize && sum > 0 ? sum : 1.0));
      }
    }
    CHECK(experts == want_experts);
    CHECK_CLOSE(probs.span(), want_probs, kFloat32);
    CHECK_CLOSE(lse.span(), want_lse, kFloat32);
    CHECK_CLOSE(gates.span(), want_gates, kFloat32);
    CHECK_CLOSE(stats.span(), want_stats, kFloat32);
  }
}

TEST_CASE("router_forward: ties go to the lower expert index; a non-finite logit is an Error") {
  const std::vector<float> row = {1, 3, 3, 2, 3, 3};
  Tensor<float> logits(Shape{1, 6});
  std::copy(row.begin(), row.end(), logits.data());
  Tensor<float> probs(Shape{1, 6}), lse(Shape{1}), stats(Shape{7});
  const std::vector<std::vector<std::int64_t>> want = {{}, {1}, {1, 2}, {1, 2, 4}, {1, 2, 4, 5}, {1, 2, 4, 5, 3},
                                                        {1, 2, 4, 5, 3, 0}};
  for (std::int64_t k = 0; k <= 6; ++k) {
    const std::vector<std::int64_t> offsets = {0, k};
    std::vector<std::int64_t> experts(static_cast<std::size_t>(k));
    Tensor<float> gates(Shape{k});
    Cpu::router_forward(logits.view(), RouterScoring::softmax, true, 1.0f, offsets, probs.view(), lse.view(), experts,
                        gates.view(), stats.view());
    CHECK(experts == want[std::size_t(k)]);
  }
  logits.data()[3] = std::nanf("");
  const std::vector<std::int64_t> offsets = {0, 1};
  std::vector<std::int64_t> experts(1);
  Tensor<float> gates(Shape{1});
  CHECK_THROWS_WITH_AS(Cpu::router_forward(logits.view(), RouterScoring::softmax, false, 1.0f, offsets, probs.view(),
                                           lse.view(), experts, gates.view(), stats.view()),
                       doctest::Contains("logit [0, 3] = nan is not finite"), Error);
  const std::vector<std::int64_t> too_many = {0, 7};
  experts.resize(7);
  Tensor<float> gates7(Shape{7});
  logits.data()[3] = 0;
  CHECK_THROWS_WITH_AS(Cpu::router_forward(logits.view(), RouterScoring::softmax, false, 1.0f, too_many, probs.view(),
                                           lse.view(), experts, gates7.view(), stats.view()),
                       doctest::Contains("token 0 selects 7 experts, expected 0..6"), Error);
}

TEST_CASE("router_backward: the gradient of gates, load-balancing and z terms agrees with finite differences") {
  const std::int64_t n = 7, e_count = 5;
  std::uint64_t seed = 11;
  for (const RouterCase rc : {RouterCase{RouterScoring::softmax, false, 1.0f, false},
                              RouterCase{RouterScoring::softmax, true, 1.3f, true},
                              RouterCase{RouterScoring::sigmoid, true, 2.5f, true},
                              RouterCase{RouterScoring::sigmoid, false, 1.0f, false}}) {
    Rng rng(seed++);
    Tensor<float> logits = random_uniform<float>(Shape{n, e_count}, rng, -2, 2);
    std::vector<std::int64_t> k(static_cast<std::size_t>(n), 2);
    if (rc.per_token)
      for (auto& v : k) v = std::int64_t(rng.below(e_count + 1));
    const std::vector<std::int64_t> offsets = offsets_of(k);
    const std::int64_t m = offsets.back();
    Tensor<float> probs(Shape{n, e_count}), lse(Shape{n}), gates(Shape{m}), stats(Shape{e_count + 1});
    std::vector<std::int64_t> experts(static_cast<std::size_t>(m));
    Cpu::router_forward(logits.view(), rc.scoring, rc.normalize, rc.scale, offsets, probs.view(), lse.view(), experts,
                        gates.view(), stats.view());
    const Tensor<float> dgates = random_uniform<float>(Shape{m}, rng), aux = random_uniform<float>(Shape{e_count}, rng);
    const float z_grad = 0.3f;
    Tensor<float> dlogits = random_uniform<float>(Shape{n, e_count}, rng);  // accumulates onto this
    std::vector<double> want(dlogits.span().begin(), dlogits.span().end());
    Cpu::router_backward(logits.view(), probs.view(), lse.view(), rc.scoring, rc.normalize, rc.scale, offsets, experts,
                         dgates.view(), aux.view(), z_grad, dlogits.view());
    // L(logits) = sum dgates * gates + sum_t,e aux_e p_te + z_grad sum_t lse_t^2, the selection held fixed.
    std::vector<double> l(logits.span().begin(), logits.span().end());
    const auto loss = [&](const std::vector<double>& lv) {
      double total = 0;
      for (std::int64_t t = 0; t < n; ++t) {
        std::vector<float> row(lv.begin() + t * e_count, lv.begin() + (t + 1) * e_count);
        double top = -1e300, sum = 0;
        for (std::int64_t e = 0; e < e_count; ++e) top = std::max(top, lv[std::size_t(t * e_count + e)]);
        for (std::int64_t e = 0; e < e_count; ++e) sum += std::exp(lv[std::size_t(t * e_count + e)] - top);
        const double z = top + std::log(sum);
        std::vector<double> p(static_cast<std::size_t>(e_count));
        for (std::int64_t e = 0; e < e_count; ++e) {
          const double v = lv[std::size_t(t * e_count + e)];
          p[std::size_t(e)] = rc.scoring == RouterScoring::softmax ? std::exp(v - z) : 1 / (1 + std::exp(-v));
          total += aux.data()[e] * p[std::size_t(e)];
        }
        total += z_grad * z * z;
        double selected = 0;
        for (std::int64_t a = offsets[std::size_t(t)]; a < offsets[std::size_t(t + 1)]; ++a) selected += p[std::size_t(experts[std::size_t(a)])];
        for (std::int64_t a = offsets[std::size_t(t)]; a < offsets[std::size_t(t + 1)]; ++a)
          total += dgates.data()[a] * rc.scale * p[std::size_t(experts[std::size_t(a)])] / (rc.normalize ? selected : 1.0);
      }
      return total;
    };
    for (std::size_t i = 0; i < l.size(); ++i) {
      const double saved = l[i], step = 1e-6;
      l[i] = saved + step;
      const double up = loss(l);
      l[i] = saved - step;
      const double down = loss(l);
      l[i] = saved;
      want[i] += (up - down) / (2 * step);
    }
    CHECK_CLOSE(dlogits.span(), want, kFloat32);
  }
}

TEST_CASE("gather_rows, scatter_add_rows, gathered_row_dot: index lists with repeats, identity, scales") {
  Rng rng(5);
  const std::int64_t n = 6, h = 5;
  const Tensor<float> from = random_uniform<float>(Shape{n, h}, rng);
  const std::vector<std::int64_t> rows = {4, 0, 4, 5, 2, 2, 1};
  const std::int64_t m = std::int64_t(rows.size());
  const Tensor<float> scale = random_uniform<float>(Shape{m}, rng);
  Tensor<float> gathered(Shape{m, h}), scaled(Shape{m, h});
  Cpu::gather_rows(from.view(), rows, {}, gathered.view());
  Cpu::gather_rows(from.view(), rows, scale.view(), scaled.view());
  std::vector<double> want_gathered, want_scaled;
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t c = 0; c < h; ++c) {
      want_gathered.push_back(from(rows[std::size_t(i)], c));
      want_scaled.push_back(double(scale(i)) * from(rows[std::size_t(i)], c));
    }
  CHECK_CLOSE(gathered.span(), want_gathered, kFloat32);
  CHECK_CLOSE(scaled.span(), want_scaled, kFloat32);
  Tensor<float> same(Shape{n, h});
  Cpu::gather_rows(from.view(), {}, {}, same.view());
  CHECK_CLOSE(same.span(), from.span(), kFloat32);

  Tensor<float> to = random_uniform<float>(Shape{n, h}, rng);
  std::vector<double> want_to(to.span().begin(), to.span().end());
  const Tensor<float> src = random_uniform<float>(Shape{m, h}, rng);
  Cpu::scatter_add_rows(to.view(), rows, src.view(), scale.view());
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t c = 0; c < h; ++c) want_to[std::size_t(rows[std::size_t(i)] * h + c)] += double(scale(i)) * src(i, c);
  CHECK_CLOSE(to.span(), want_to, kFloat32);

  Tensor<float> dots(Shape{m});
  Cpu::gathered_row_dot(from.view(), rows, src.view(), dots.view());
  std::vector<double> want_dots;
  for (std::int64_t i = 0; i < m; ++i) {
    double d = 0;
    for (std::int64_t c = 0; c < h; ++c) d += double(from(rows[std::size_t(i)], c)) * src(i, c);
    want_dots.push_back(d);
  }
  CHECK_CLOSE(dots.span(), want_dots, kFloat32);

  const std::vector<std::int64_t> bad = {0, 6};
  Tensor<float> two(Shape{2, h});
  CHECK_THROWS_WITH_AS(Cpu::gather_rows(from.view(), bad, {}, two.view()),
                       doctest::Contains("row index 6 (entry 1) is outside [0, 6)"), Error);
  CHECK_THROWS_WITH_AS(Cpu::scatter_add_rows(to.view(), {}, two.view(), {}),
                       doctest::Contains("the identity, which needs 2 rows to equal 6"), Error);
}

TEST_CASE("sigmoid_forward and sigmoid_backward (accumulating)") {
  Rng rng(9);
  const Tensor<float> x = random_uniform<float>(Shape{11}, rng, -6, 6), dy = random_uniform<float>(Shape{11}, rng);
  Tensor<float> y(Shape{11}), dx = random_uniform<float>(Shape{11}, rng);
  std::vector<double> want_y, want_dx;
  for (std::int64_t i = 0; i < 11; ++i) {
    const double s = 1 / (1 + std::exp(-double(x(i))));
    want_y.push_back(s);
    want_dx.push_back(dx(i) + dy(i) * s * (1 - s));
  }
  Cpu::sigmoid_forward(x.view(), y.view());
  Cpu::sigmoid_backward(y.view(), dy.view(), dx.view());
  CHECK_CLOSE(y.span(), want_y, kFloat32);
  CHECK_CLOSE(dx.span(), want_dx, kFloat32);
}

TEST_CASE("ops::Counting: the MoE members record the bytes they would move; its router writes a balanced routing") {
  Trace trace;
  MemoryTracker meta(MemorySpace::meta);
  ScopedTracker scoped(meta);
  ScopedTrace recording(trace);
  const std::int64_t n = 8, e_count = 4, h = 16;
  const std::vector<std::int64_t> offsets = offsets_of(std::vector<std::int64_t>(static_cast<std::size_t>(n), 2));
  Tensor<float> logits(Shape{n, e_count}), probs(Shape{n, e_count}), lse(Shape{n}), gates(Shape{16}),
      stats(Shape{e_count + 1}), x(Shape{n, h}), rows(Shape{16, h}), w(Shape{16});
  std::vector<std::int64_t> experts(16);
  ops::Counting::router_forward(logits.view(), RouterScoring::softmax, false, 1.0f, offsets, probs.view(), lse.view(),
                                experts, gates.view(), stats.view());
  std::vector<std::int64_t> per_expert(static_cast<std::size_t>(e_count), 0);
  for (std::int64_t t = 0; t < n; ++t) {
    CHECK(experts[std::size_t(2 * t)] != experts[std::size_t(2 * t + 1)]);
    ++per_expert[std::size_t(experts[std::size_t(2 * t)])];
    ++per_expert[std::size_t(experts[std::size_t(2 * t + 1)])];
  }
  CHECK(per_expert == std::vector<std::int64_t>{4, 4, 4, 4});
  ops::Counting::router_backward(logits.view(), probs.view(), lse.view(), RouterScoring::softmax, false, 1.0f, offsets,
                                 experts, gates.view(), stats.view().slice(0, 0, e_count), 0.0f, probs.view());
  std::vector<std::int64_t> index(16, 0);
  ops::Counting::gather_rows(x.view(), index, w.view(), rows.view());
  ops::Counting::scatter_add_rows(x.view(), index, rows.view(), {});
  ops::Counting::gathered_row_dot(x.view(), index, rows.view(), w.view());
  ops::Counting::sigmoid_forward(w.view(), w.view());
  ops::Counting::sigmoid_backward(w.view(), w.view(), w.view());
  REQUIRE(trace.events().size() == 7);
  CHECK(trace.events()[2].bytes == 4.0 * (2 * 16 * h + 16));  // gather: rows read and written, the scales read
  CHECK(trace.events()[3].bytes == 4.0 * (3 * 16 * h));       // scatter-add: read both, write one
  for (const TraceEvent& e : trace.events()) CHECK(e.bytes > 0);
}
