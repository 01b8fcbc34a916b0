// Tests of paradyse/ops/cpu/rope.hpp: both pair layouts, position offsets (a rank's chunk mid-sequence), positions
// restarting per document, strided q/k views, in-place forward, accumulating backward = the inverse rotation,
// against the float64 reference; backward is also the adjoint of forward (<R x, y> = <x, R^T y>).
#include "paradyse/ops/cpu/rope.hpp"

#include "paradyse/core/rng.hpp"
#include "support/tolerance.hpp"
#include "ops/reference_layers.hpp"

#include <doctest/doctest.h>

using namespace paradyse;
using namespace paradyse::testing;

TEST_CASE("rope forward and backward match the float64 reference") {
  const std::int64_t b = 2, s = 9, heads = 3, d = 16;
  const std::vector<std::vector<std::int64_t>> document_sets = {{}, {0, 4, 10, 13}};
  for (bool interleaved : {false, true})
    for (std::int64_t offset : {0, 7, 5000})
      for (const auto& docs : document_sets) {
        CAPTURE(interleaved); CAPTURE(offset); CAPTURE(docs.size());
        Rng rng(500 + offset + interleaved);
        // x is the k part of a packed [b, s, 3 * heads, d] qkv tensor: strided rows.
        Tensor<float> packed = random_uniform<float>(Shape{b, s, 3 * heads, d}, rng);
        const TensorView<float> x = packed.view().slice(2, heads, heads);
        ops::RopeConfig config;
        config.layout = interleaved ? ops::RopeLayout::interleaved : ops::RopeLayout::halves;
        config.theta = 500000.0;
        const Vec x64 = to_double(x);
        Tensor<float> y(Shape{b, s, heads, d});
        ops::cpu::rope_forward(x, y.view(), offset, config, docs);
        const Vec want = reference_rope(x64, b, s, heads, d, offset, config.theta, interleaved, docs, false);
        CHECK_CLOSE(to_double(y), want, kFloat32);

        Tensor<float> dy = random_uniform<float>(y.shape(), rng);
        Tensor<float> dx = random_uniform<float>(y.shape(), rng);
        Vec want_dx = to_double(dx);
        const Vec back = reference_rope(to_double(dy), b, s, heads, d, offset, config.theta, interleaved, docs, true);
        for (std::size_t i = 0; i < want_dx.size(); ++i) want_dx[i] += back[i];
        ops::cpu::rope_backward(dy.view(), dx.view(), offset, config, docs);
        CHECK_CLOSE(to_double(dx), want_dx, kFloat32);

        // In place on the packed tensor's slice.
        ops::cpu::rope_forward(x, x, offset, config, docs);
        CHECK_CLOSE(to_double(x), want, kFloat32);
      }
}

TEST_CASE("rope reference backward is the adjoint of forward (finite differences of <R x, dy>)") {
  const std::int64_t b = 1, s = 3, heads = 2, d = 4;
  Rng rng(510);
  Vec x(b * s * heads * d), dy(x.size());
  rng.fill_uniform(std::span<double>(x));
  rng.fill_uniform(std::span<double>(dy));
  const std::vector<std::int64_t> docs = {0, 2};
  for (bool interleaved : {false, true}) {
    const auto loss = [&] { return dot(reference_rope(x, b, s, heads, d, 3, 10000.0, interleaved, docs, false), dy); };
    const Vec analytic = reference_rope(dy, b, s, heads, d, 3, 10000.0, interleaved, docs, true);
    CHECK_CLOSE(analytic, finite_difference(x, loss), kFiniteDifference);
  }
}

TEST_CASE("rope rejects bad input") {
  Tensor<float> odd(Shape{1, 2, 1, 5}), x(Shape{1, 2, 1, 4}), y(Shape{1, 2, 1, 4});
  CHECK_THROWS_WITH_AS(ops::cpu::rope_forward(odd.view(), odd.view(), 0), doctest::Contains("even"), Error);
  CHECK_THROWS_AS(ops::cpu::rope_forward(x.view(), y.view(), -1), Error);
  CHECK_THROWS_WITH_AS(ops::cpu::rope_backward(x.view(), x.view(), 0), doctest::Contains("alias"), Error);
  Tensor<float> three_d(Shape{2, 4, 4});
  CHECK_THROWS_AS(ops::cpu::rope_forward(three_d.view(), three_d.view(), 0), Error);
}
