// tests/cuda/moe_ops.cpp: the CUDA materialised softmax (ops/cuda/softmax.hpp) and MoE data ops (ops/cuda/moe_ops.hpp)
// against ops::cpu on the same seeded inputs: every forward and every gradient (gradients accumulate onto nonzero
// values), softmax and sigmoid router scoring, normalisation on and off, per-token expert counts, k = 1, 2, 4,
// E = 8 and 16, tied logits choosing the very experts the CPU chooses, scatter-adds into repeated destination rows,
// and the CPU's error messages for bad input. Float32 tolerances from tests/support/tolerance.hpp.
#include "cuda/device_test.hpp"
#include "support/tolerance.hpp"

#include "paradyse/core/rng.hpp"
#include "paradyse/device/runtime.hpp"
#include "paradyse/ops/cpu/moe_ops.hpp"
#include "paradyse/ops/cpu/softmax.hpp"
#include "paradyse/ops/cuda/moe_ops.hpp"
#include "paradyse/ops/cuda/softmax.hpp"

#include <cuda_runtime_api.h>
#include <doctest/doctest.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace pd = paradyse;
using pd::Shape;
using pd::TensorView;
using pd::ops::PositionRun;
using pd::ops::RouterScoring;
using pd::testing::kFloat32;

namespace {

// Device memory for a test: `count` elements, optionally copied from the host; host() synchronizes the calling
// thread's stream (where the ops run) and copies back.
template <class T>
class DeviceBuffer {
public:
  explicit DeviceBuffer(std::size_t count) : count_(count) {
    if (count_) PARADYSE_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&data_), count_ * sizeof(T)));
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) {
    if (count_) PARADYSE_CUDA_CHECK(cudaMemcpy(data_, host.data(), count_ * sizeof(T), cudaMemcpyHostToDevice));
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (data_) (void)cudaFree(data_);
  }

  TensorView<T> view(Shape shape) const {
    REQUIRE(static_cast<std::size_t>(shape.numel()) == count_);
    return TensorView<T>(data_, shape);
  }
  std::vector<T> host() const {
    pd::device::synchronize();
    std::vector<T> out(count_);
    if (count_) PARADYSE_CUDA_CHECK(cudaMemcpy(out.data(), data_, count_ * sizeof(T), cudaMemcpyDeviceToHost));
    return out;
  }

private:
  T* data_ = nullptr;
  std::size_t count_ = 0;
};

std::vector<float> uniform(std::size_t count, pd::Rng& rng, double lo = -1.0, double hi = 1.0) {
  std::vector<float> v(count);
  rng.fill_uniform(std::span<float>(v), lo, hi);
  return v;
}

template <class T>
TensorView<T> host_view(std::vector<std::remove_const_t<T>>& v, Shape shape) {
  REQUIRE(static_cast<std::size_t>(shape.numel()) == v.size());
  return TensorView<T>(v.data(), shape);
}

std::vector<std::int64_t> offsets_of(const std::vector<std::int64_t>& counts) {
  std::vector<std::int64_t> offsets(counts.size() + 1, 0);
  for (std::size_t t = 0; t < counts.size(); ++t) offsets[t + 1] = offsets[t] + counts[t];
  return offsets;
}

// The outputs of one router_forward call, on the host.
struct RouterOutputs {
  std::vector<float> probs, lse, gates, stats;
  std::vector<std::int64_t> experts;
};

RouterOutputs router_cpu(std::vector<float> logits, std::int64_t n, std::int64_t e_count, RouterScoring scoring,
                         bool normalize, float scale, const std::vector<std::int64_t>& offsets) {
  const std::size_t assignments = static_cast<std::size_t>(offsets.back());
  RouterOutputs r{std::vector<float>(static_cast<std::size_t>(n * e_count)), std::vector<float>(static_cast<std::size_t>(n)),
                  std::vector<float>(assignments), std::vector<float>(static_cast<std::size_t>(e_count + 1)),
                  std::vector<std::int64_t>(assignments)};
  pd::ops::cpu::router_forward(host_view<const float>(logits, Shape{n, e_count}), scoring, normalize, scale, offsets,
                               host_view<float>(r.probs, Shape{n, e_count}), host_view<float>(r.lse, Shape{n}),
                               r.experts, host_view<float>(r.gates, Shape{std::int64_t(assignments)}),
                               host_view<float>(r.stats, Shape{e_count + 1}));
  return r;
}

RouterOutputs router_cuda(const std::vector<float>& logits, std::int64_t n, std::int64_t e_count,
                          RouterScoring scoring, bool normalize, float scale, const std::vector<std::int64_t>& offsets) {
  const std::int64_t assignments = offsets.back();
  const DeviceBuffer<float> d_logits(logits), probs(static_cast<std::size_t>(n * e_count)), lse(static_cast<std::size_t>(n)),
      gates(static_cast<std::size_t>(assignments)), stats(static_cast<std::size_t>(e_count + 1));
  RouterOutputs r;
  r.experts.assign(static_cast<std::size_t>(assignments), -7);  // overwritten by the op
  pd::ops::cuda::router_forward(d_logits.view(Shape{n, e_count}), scoring, normalize, scale, offsets,
                                probs.view(Shape{n, e_count}), lse.view(Shape{n}), r.experts,
                                gates.view(Shape{assignments}), stats.view(Shape{e_count + 1}));
  r.probs = probs.host();
  r.lse = lse.host();
  r.gates = gates.host();
  r.stats = stats.host();
  return r;
}

// Logits: uniform in [-3, 3), or (ties) drawn from three values so that most rows hold equal logits.
std::vector<float> router_logits(std::size_t count, pd::Rng& rng, bool ties) {
  if (!ties) return uniform(count, rng, -3, 3);
  std::vector<float> v(count);
  for (float& x : v) x = 0.75f * float(rng.below(3)) - 1.0f;
  return v;
}

}  // namespace

TEST_CASE("cuda masked_softmax_forward and softmax_backward equal ops::cpu (causal zigzag runs, wide rows)") {
  PARADYSE_REQUIRE_DEVICE();
  pd::Rng rng(901);
  for (const std::int64_t c : {std::int64_t(37), std::int64_t(300)}) {
    for (const bool causal : {false, true}) {
      const std::int64_t n = 8;
      // Queries in two zigzag chunks; keys in two runs, the later positions first. Key positions cover [0, c), the
      // query positions lie in [0, c), so every query sees key position 0 under the causal mask.
      const std::vector<PositionRun> query_runs = {{0, 0, 4}, {4, c - 4, 4}};
      const std::vector<PositionRun> key_runs = {{0, c / 2, c - c / 2}, {c - c / 2, 0, c / 2}};
      const Shape shape{2, 3, n, c};
      const std::size_t count = static_cast<std::size_t>(shape.numel());
      INFO("c = ", c, ", causal = ", causal);

      std::vector<float> scores = uniform(count, rng, -4, 4);
      const DeviceBuffer<float> d_scores(scores);
      pd::ops::cpu::masked_softmax_forward(host_view<float>(scores, shape), query_runs, key_runs, causal);
      pd::ops::cuda::masked_softmax_forward(d_scores.view(shape), query_runs, key_runs, causal);
      const std::vector<float> probs = d_scores.host();
      CHECK_CLOSE(probs, scores, kFloat32);

      // Backward in place (dP -> dS) from the CPU's probabilities.
      std::vector<float> grads = uniform(count, rng);
      const DeviceBuffer<float> d_probs(scores), d_grads(grads);
      pd::ops::cpu::softmax_backward(host_view<const float>(scores, shape), host_view<float>(grads, shape));
      pd::ops::cuda::softmax_backward(d_probs.view(shape), d_grads.view(shape));
      CHECK_CLOSE(d_grads.host(), grads, kFloat32);
    }
  }
}

TEST_CASE("cuda masked_softmax_forward and softmax_backward: ops::cpu's errors for bad runs and shapes") {
  PARADYSE_REQUIRE_DEVICE();
  const std::int64_t n = 4, c = 6;
  const DeviceBuffer<float> scores(static_cast<std::size_t>(n * c));
  const std::vector<PositionRun> queries = {{0, 0, n}};
  const std::vector<PositionRun> late_keys = {{0, 5, c}};
  CHECK_THROWS_WITH_AS(pd::ops::cuda::masked_softmax_forward(scores.view(Shape{n, c}), queries, late_keys, true),
                       doctest::Contains("the query at position 0 sees no key"), pd::Error);
  const std::vector<PositionRun> too_long = {{0, 0, c + 1}};
  CHECK_THROWS_WITH_AS(pd::ops::cuda::masked_softmax_forward(scores.view(Shape{n, c}), queries, too_long, false),
                       doctest::Contains("key run [0, 7) is outside [0, 6)"), pd::Error);
  const std::vector<PositionRun> gap = {{0, 0, c - 1}};
  CHECK_THROWS_WITH_AS(pd::ops::cuda::masked_softmax_forward(scores.view(Shape{n, c}), queries, gap, false),
                       doctest::Contains("key 5 has no position"), pd::Error);
  const DeviceBuffer<float> other(static_cast<std::size_t>(n * c));
  CHECK_THROWS_WITH_AS(pd::ops::cuda::softmax_backward(scores.view(Shape{n, c}), other.view(Shape{c, n})),
                       doctest::Contains("must be contiguous and of one shape"), pd::Error);
}

TEST_CASE("cuda router_forward equals ops::cpu: scores, lse, top-k experts (ties included), gates, statistics") {
  PARADYSE_REQUIRE_DEVICE();
  const std::int64_t n = 150;  // more than two chunks of the statistics' partial sums
  std::uint64_t seed = 910;
  for (const RouterScoring scoring : {RouterScoring::softmax, RouterScoring::sigmoid})
    for (const bool normalize : {false, true})
      for (const std::int64_t e_count : {std::int64_t(8), std::int64_t(16)})
        for (const std::int64_t k : {std::int64_t(1), std::int64_t(2), std::int64_t(4), std::int64_t(-1)})
          for (const bool ties : {false, true}) {
            pd::Rng rng(seed++);
            const float scale = scoring == RouterScoring::softmax ? 1.0f : 2.5f;
            // k = -1: per-token counts in [0, E] (segments of every size, empty and full ones included).
            std::vector<std::int64_t> counts(static_cast<std::size_t>(n), k);
            if (k < 0)
              for (auto& v : counts) v = std::int64_t(rng.below(std::uint64_t(e_count + 1)));
            const std::vector<std::int64_t> offsets = offsets_of(counts);
            const std::vector<float> logits = router_logits(static_cast<std::size_t>(n * e_count), rng, ties);
            INFO("scoring = ", std::string(pd::ops::name_of(scoring)), ", normalize = ", normalize, ", E = ", e_count,
                 ", k = ", k, ", ties = ", ties);
            const RouterOutputs want = router_cpu(logits, n, e_count, scoring, normalize, scale, offsets);
            const RouterOutputs got = router_cuda(logits, n, e_count, scoring, normalize, scale, offsets);
            CHECK_MESSAGE(got.experts == want.experts,
                          fmt::format("experts differ:\n cuda {}\n cpu  {}", got.experts, want.experts));
            CHECK_CLOSE(got.probs, want.probs, kFloat32);
            CHECK_CLOSE(got.lse, want.lse, kFloat32);
            CHECK_CLOSE(got.gates, want.gates, kFloat32);
            CHECK_CLOSE(got.stats, want.stats, kFloat32);
          }
}

TEST_CASE("cuda router_forward: one row of equal logits picks the lower indices first, as ops::cpu") {
  PARADYSE_REQUIRE_DEVICE();
  const std::vector<float> row = {1, 3, 3, 2, 3, 3, 2, 1};
  for (std::int64_t k = 0; k <= 8; ++k) {
    const std::vector<std::int64_t> offsets = {0, k};
    const RouterOutputs want = router_cpu(row, 1, 8, RouterScoring::softmax, true, 1.0f, offsets);
    const RouterOutputs got = router_cuda(row, 1, 8, RouterScoring::softmax, true, 1.0f, offsets);
    CHECK_MESSAGE(got.experts == want.experts,
                  fmt::format("k = {}: cuda {} cpu {}", k, got.experts, want.experts));
  }
}

TEST_CASE("cuda router_backward equals ops::cpu and accumulates (gates, load-balancing and z terms)") {
  PARADYSE_REQUIRE_DEVICE();
  const std::int64_t n = 70;
  std::uint64_t seed = 950;
  for (const RouterScoring scoring : {RouterScoring::softmax, RouterScoring::sigmoid})
    for (const bool normalize : {false, true})
      for (const std::int64_t e_count : {std::int64_t(8), std::int64_t(16)})
        for (const std::int64_t k : {std::int64_t(1), std::int64_t(2), std::int64_t(4), std::int64_t(-1)})
          for (const float z_grad : {0.0f, 0.3f}) {
            pd::Rng rng(seed++);
            const float scale = normalize ? 1.3f : 2.0f;
            std::vector<std::int64_t> counts(static_cast<std::size_t>(n), k);
            if (k < 0)
              for (auto& v : counts) v = std::int64_t(rng.below(std::uint64_t(e_count + 1)));
            const std::vector<std::int64_t> offsets = offsets_of(counts);
            const std::int64_t m = offsets.back();
            const std::vector<float> logits = router_logits(static_cast<std::size_t>(n * e_count), rng, false);
            const RouterOutputs fwd = router_cpu(logits, n, e_count, scoring, normalize, scale, offsets);
            const std::vector<float> dgates = uniform(static_cast<std::size_t>(m), rng), aux = uniform(static_cast<std::size_t>(e_count), rng);
            std::vector<float> dlogits = uniform(static_cast<std::size_t>(n * e_count), rng);  // nonzero: the op accumulates
            INFO("scoring = ", std::string(pd::ops::name_of(scoring)), ", normalize = ", normalize, ", E = ", e_count,
                 ", k = ", k, ", z_grad = ", z_grad);

            const DeviceBuffer<float> d_logits(logits), d_probs(fwd.probs), d_lse(fwd.lse), d_dgates(dgates),
                d_aux(aux), d_dlogits(dlogits);
            pd::ops::cuda::router_backward(d_logits.view(Shape{n, e_count}), d_probs.view(Shape{n, e_count}),
                                           d_lse.view(Shape{n}), scoring, normalize, scale, offsets, fwd.experts,
                                           d_dgates.view(Shape{m}), d_aux.view(Shape{e_count}), z_grad,
                                           d_dlogits.view(Shape{n, e_count}));
            std::vector<float> probs = fwd.probs, lse = fwd.lse, dg = dgates, ax = aux, lg = logits;
            pd::ops::cpu::router_backward(host_view<const float>(lg, Shape{n, e_count}),
                                          host_view<const float>(probs, Shape{n, e_count}),
                                          host_view<const float>(lse, Shape{n}), scoring, normalize, scale, offsets,
                                          fwd.experts, host_view<const float>(dg, Shape{m}),
                                          host_view<const float>(ax, Shape{e_count}), z_grad,
                                          host_view<float>(dlogits, Shape{n, e_count}));
            CHECK_CLOSE(d_dlogits.host(), dlogits, kFloat32);
          }
}

TEST_CASE("cuda router_forward and router_backward: ops::cpu's errors for bad input") {
  PARADYSE_REQUIRE_DEVICE();
  const std::int64_t n = 2, e_count = 6;
  std::vector<float> logits(static_cast<std::size_t>(n * e_count), 0.5f);
  logits[static_cast<std::size_t>(e_count + 3)] = std::nanf("");
  const DeviceBuffer<float> d_logits(logits), probs(static_cast<std::size_t>(n * e_count)), lse(static_cast<std::size_t>(n)), gates(2),
      stats(static_cast<std::size_t>(e_count + 1)), aux(static_cast<std::size_t>(e_count)), dlogits(static_cast<std::size_t>(n * e_count));
  const std::vector<std::int64_t> offsets = {0, 1, 2};
  std::vector<std::int64_t> experts(2);
  CHECK_THROWS_WITH_AS(pd::ops::cuda::router_forward(d_logits.view(Shape{n, e_count}), RouterScoring::softmax, false,
                                                     1.0f, offsets, probs.view(Shape{n, e_count}), lse.view(Shape{n}),
                                                     experts, gates.view(Shape{2}), stats.view(Shape{e_count + 1})),
                       doctest::Contains("logit [1, 3] = nan is not finite"), pd::Error);
  const std::vector<std::int64_t> too_many = {0, 7, 8};
  std::vector<std::int64_t> experts8(8);
  const DeviceBuffer<float> gates8(8);
  CHECK_THROWS_WITH_AS(pd::ops::cuda::router_forward(d_logits.view(Shape{n, e_count}), RouterScoring::softmax, false,
                                                     1.0f, too_many, probs.view(Shape{n, e_count}), lse.view(Shape{n}),
                                                     experts8, gates8.view(Shape{8}), stats.view(Shape{e_count + 1})),
                       doctest::Contains("token 0 selects 7 experts, expected 0..6"), pd::Error);
  std::vector<std::int64_t> experts3(3);
  CHECK_THROWS_WITH_AS(pd::ops::cuda::router_forward(d_logits.view(Shape{n, e_count}), RouterScoring::softmax, false,
                                                     1.0f, offsets, probs.view(Shape{n, e_count}), lse.view(Shape{n}),
                                                     experts3, gates.view(Shape{2}), stats.view(Shape{e_count + 1})),
                       doctest::Contains("experts holds 3 entries, expected 2"), pd::Error);
  const std::vector<std::int64_t> bad_expert = {0, 6};
  CHECK_THROWS_WITH_AS(pd::ops::cuda::router_backward(d_logits.view(Shape{n, e_count}), probs.view(Shape{n, e_count}),
                                                      lse.view(Shape{n}), RouterScoring::softmax, false, 1.0f, offsets,
                                                      bad_expert, gates.view(Shape{2}), aux.view(Shape{e_count}), 0.0f,
                                                      dlogits.view(Shape{n, e_count})),
                       doctest::Contains("expert 6 (entry 1) is outside [0, 6)"), pd::Error);
  CHECK_THROWS_WITH_AS(pd::ops::cuda::router_backward(d_logits.view(Shape{n, e_count}), probs.view(Shape{n, e_count}),
                                                      lse.view(Shape{n}), RouterScoring::softmax, false, 1.0f, offsets,
                                                      experts, gates.view(Shape{2}), aux.view(Shape{2, 3}), 0.0f,
                                                      dlogits.view(Shape{e_count, n})),
                       doctest::Contains("must match logits"), pd::Error);
}

TEST_CASE("cuda gather_rows, scatter_add_rows, gathered_row_dot equal ops::cpu (repeats, identity, scales)") {
  PARADYSE_REQUIRE_DEVICE();
  pd::Rng rng(970);
  const std::int64_t n = 7, h = 33, m = 200;
  std::vector<std::int64_t> rows(static_cast<std::size_t>(m));
  for (auto& r : rows) r = std::int64_t(rng.below(std::uint64_t(n - 1)));  // row n - 1 never named: untouched
  std::vector<float> from = uniform(static_cast<std::size_t>(n * h), rng), scale = uniform(static_cast<std::size_t>(m), rng);
  const DeviceBuffer<float> d_from(from), d_scale(scale);
  const std::vector<std::int64_t> identity;
  const std::vector<std::int64_t> some = {4, 0, 4, 5, 2, 2, 1};
  const std::int64_t ms = std::int64_t(some.size());

  SUBCASE("gather_rows") {
    for (const bool scaled : {false, true}) {
      INFO("scaled = ", scaled);
      std::vector<float> want(static_cast<std::size_t>(m * h), 9.0f);
      const DeviceBuffer<float> got(want);  // overwritten
      const TensorView<const float> cpu_scale = scaled ? host_view<const float>(scale, Shape{m}) : TensorView<const float>();
      const TensorView<const float> cuda_scale = scaled ? TensorView<const float>(d_scale.view(Shape{m})) : TensorView<const float>();
      pd::ops::cpu::gather_rows(host_view<const float>(from, Shape{n, h}), rows, cpu_scale,
                                host_view<float>(want, Shape{m, h}));
      pd::ops::cuda::gather_rows(d_from.view(Shape{n, h}), rows, cuda_scale, got.view(Shape{m, h}));
      CHECK_CLOSE(got.host(), want, kFloat32);
    }
    std::vector<float> want(static_cast<std::size_t>(n * h));
    const DeviceBuffer<float> got(want);
    pd::ops::cpu::gather_rows(host_view<const float>(from, Shape{n, h}), identity, {}, host_view<float>(want, Shape{n, h}));
    pd::ops::cuda::gather_rows(d_from.view(Shape{n, h}), identity, {}, got.view(Shape{n, h}));
    CHECK_CLOSE(got.host(), want, kFloat32);
  }

  SUBCASE("scatter_add_rows into repeated destination rows accumulates onto nonzero values") {
    std::vector<float> sources = uniform(static_cast<std::size_t>(m * h), rng);
    const DeviceBuffer<float> d_sources(sources);
    for (const bool scaled : {false, true}) {
      INFO("scaled = ", scaled);
      std::vector<float> want = uniform(static_cast<std::size_t>(n * h), rng);
      const DeviceBuffer<float> got(want);
      const TensorView<const float> cpu_scale = scaled ? host_view<const float>(scale, Shape{m}) : TensorView<const float>();
      const TensorView<const float> cuda_scale = scaled ? TensorView<const float>(d_scale.view(Shape{m})) : TensorView<const float>();
      pd::ops::cpu::scatter_add_rows(host_view<float>(want, Shape{n, h}), rows,
                                     host_view<const float>(sources, Shape{m, h}), cpu_scale);
      pd::ops::cuda::scatter_add_rows(got.view(Shape{n, h}), rows, d_sources.view(Shape{m, h}), cuda_scale);
      CHECK_CLOSE(got.host(), want, kFloat32);
    }
    // Identity and a short list with repeats, scaled.
    std::vector<float> want = uniform(static_cast<std::size_t>(n * h), rng);
    const DeviceBuffer<float> got(want);
    std::vector<float> seven = uniform(static_cast<std::size_t>(ms * h), rng);
    const DeviceBuffer<float> d_seven(seven);
    pd::ops::cpu::scatter_add_rows(host_view<float>(want, Shape{n, h}), identity, host_view<const float>(from, Shape{n, h}), {});
    pd::ops::cuda::scatter_add_rows(got.view(Shape{n, h}), identity, d_from.view(Shape{n, h}), {});
    pd::ops::cpu::scatter_add_rows(host_view<float>(want, Shape{n, h}), some, host_view<const float>(seven, Shape{ms, h}),
                                   host_view<const float>(scale, Shape{m}).slice(0, 0, ms));
    pd::ops::cuda::scatter_add_rows(got.view(Shape{n, h}), some, d_seven.view(Shape{ms, h}),
                                    TensorView<const float>(d_scale.view(Shape{m})).slice(0, 0, ms));
    CHECK_CLOSE(got.host(), want, kFloat32);
  }

  SUBCASE("gathered_row_dot") {
    std::vector<float> b = uniform(static_cast<std::size_t>(m * h), rng);
    const DeviceBuffer<float> d_b(b);
    std::vector<float> want(static_cast<std::size_t>(m), 5.0f);
    const DeviceBuffer<float> got(want);
    pd::ops::cpu::gathered_row_dot(host_view<const float>(from, Shape{n, h}), rows, host_view<const float>(b, Shape{m, h}),
                                   host_view<float>(want, Shape{m}));
    pd::ops::cuda::gathered_row_dot(d_from.view(Shape{n, h}), rows, d_b.view(Shape{m, h}), got.view(Shape{m}));
    CHECK_CLOSE(got.host(), want, kFloat32);
    std::vector<float> want_id(static_cast<std::size_t>(n));
    const DeviceBuffer<float> got_id(want_id);
    pd::ops::cpu::gathered_row_dot(host_view<const float>(from, Shape{n, h}), identity,
                                   host_view<const float>(b, Shape{m, h}).slice(0, 0, n), host_view<float>(want_id, Shape{n}));
    pd::ops::cuda::gathered_row_dot(d_from.view(Shape{n, h}), identity, TensorView<const float>(d_b.view(Shape{m, h})).slice(0, 0, n),
                                    got_id.view(Shape{n}));
    CHECK_CLOSE(got_id.host(), want_id, kFloat32);
  }

  SUBCASE("bad row lists and shapes: ops::cpu's errors") {
    const DeviceBuffer<float> to(static_cast<std::size_t>(ms * h)), wide(static_cast<std::size_t>(ms * (h + 1))), out(static_cast<std::size_t>(ms));
    const std::vector<std::int64_t> outside = {4, 0, 4, 7, 2, 2, 1};
    CHECK_THROWS_WITH_AS(pd::ops::cuda::gather_rows(d_from.view(Shape{n, h}), outside, {}, to.view(Shape{ms, h})),
                         doctest::Contains("row index 7 (entry 3) is outside [0, 7)"), pd::Error);
    CHECK_THROWS_WITH_AS(pd::ops::cuda::scatter_add_rows(d_from.view(Shape{n, h}), some, wide.view(Shape{ms, h + 1}), {}),
                         doctest::Contains("differ in width"), pd::Error);
    const DeviceBuffer<float> three(static_cast<std::size_t>(3 * h));
    CHECK_THROWS_WITH_AS(pd::ops::cuda::scatter_add_rows(d_from.view(Shape{n, h}), identity, three.view(Shape{3, h}), {}),
                         doctest::Contains("an empty row list means the identity, which needs 3 rows to equal 7"),
                         pd::Error);
    CHECK_THROWS_WITH_AS(pd::ops::cuda::gathered_row_dot(d_from.view(Shape{n, h}), some, to.view(Shape{ms, h}),
                                                         d_scale.view(Shape{m})),
                         doctest::Contains("out must hold 7 contiguous elements"), pd::Error);
    CHECK_THROWS_WITH_AS(pd::ops::cuda::gather_rows(d_from.view(Shape{n, h}), some, d_scale.view(Shape{m}), to.view(Shape{ms, h})),
                         doctest::Contains("scale must hold 7 contiguous elements"), pd::Error);
  }
}

TEST_CASE("cuda sigmoid_forward and sigmoid_backward equal ops::cpu; the backward accumulates") {
  PARADYSE_REQUIRE_DEVICE();
  pd::Rng rng(990);
  const Shape shape{37, 29};
  const std::size_t count = static_cast<std::size_t>(shape.numel());
  std::vector<float> x = uniform(count, rng, -6, 6), y(count);
  const DeviceBuffer<float> d_x(x), d_y(count);
  pd::ops::cpu::sigmoid_forward(host_view<const float>(x, shape), host_view<float>(y, shape));
  pd::ops::cuda::sigmoid_forward(d_x.view(shape), d_y.view(shape));
  CHECK_CLOSE(d_y.host(), y, kFloat32);

  std::vector<float> dy = uniform(count, rng), dx = uniform(count, rng);  // dx nonzero: accumulated onto
  const DeviceBuffer<float> d_y_cpu(y), d_dy(dy), d_dx(dx);
  pd::ops::cpu::sigmoid_backward(host_view<const float>(y, shape), host_view<const float>(dy, shape),
                                 host_view<float>(dx, shape));
  pd::ops::cuda::sigmoid_backward(d_y_cpu.view(shape), d_dy.view(shape), d_dx.view(shape));
  CHECK_CLOSE(d_dx.host(), dx, kFloat32);

  const DeviceBuffer<float> shorter(count - 1);
  CHECK_THROWS_WITH_AS(pd::ops::cuda::sigmoid_forward(d_x.view(shape), shorter.view(Shape{std::int64_t(count) - 1})),
                       doctest::Contains("must be contiguous with equal element counts"), pd::Error);
  CHECK_THROWS_WITH_AS(pd::ops::cuda::sigmoid_backward(d_y.view(shape), d_dy.view(shape),
                                                       shorter.view(Shape{std::int64_t(count) - 1})),
                       doctest::Contains("must be contiguous with equal element counts"), pd::Error);
}
