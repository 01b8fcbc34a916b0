// Tests of paradyse/ops/cpu/normalization.hpp: LayerNorm and RMSNorm forward (y and saved statistics) and every
// gradient (dx, dgamma, dbeta, accumulated) against the float64 reference; reference gradients against finite
// differences; strided rows; bad input.
#include "paradyse/ops/cpu/normalization.hpp"

#include "paradyse/core/rng.hpp"
#include "support/tolerance.hpp"
#include "ops/reference_layers.hpp"

#include <doctest/doctest.h>

using namespace paradyse;
using namespace paradyse::testing;

namespace {

Vec plus(const Vec& a, const Vec& b) {
  Vec r(a);
  for (std::size_t i = 0; i < r.size(); ++i) r[i] += b[i];
  return r;
}

// x: a [b, s, h] view whose rows are strided (the columns [2, 2 + h) of a [b, s, h + 5] tensor) when `strided`.
struct RowInput {
  Tensor<float> store;
  TensorView<float> x;
};
RowInput make_rows(std::int64_t b, std::int64_t s, std::int64_t h, bool strided, Rng& rng, double lo = -2, double hi = 2) {
  RowInput in;
  in.store = random_uniform<float>(Shape{b, s, strided ? h + 5 : h}, rng, lo, hi);
  in.x = strided ? in.store.view().slice(2, 2, h) : in.store.view();
  return in;
}

}  // namespace

TEST_CASE("layer_norm forward and backward match the float64 reference") {
  for (std::int64_t h : {1, 7, 64, 100})
    for (bool strided : {false, true}) {
      CAPTURE(h); CAPTURE(strided);
      Rng rng(100 + h + strided);
      const std::int64_t b = 3, s = 5, rows = b * s;
      RowInput in = make_rows(b, s, h, strided, rng, 1.0, 3.0);  // non-zero mean: the two-pass variance matters
      Tensor<float> gamma = random_uniform<float>(Shape{h}, rng), beta = random_uniform<float>(Shape{h}, rng);
      Tensor<float> y(Shape{b, s, h}), mean(Shape{b, s}), rstd(Shape{b, s});
      const float eps = 1e-5f;
      ops::cpu::layer_norm_forward(in.x, gamma.view(), beta.view(), eps, y.view(), mean.view(), rstd.view());
      const Vec x64 = to_double(in.x), g64 = to_double(gamma);
      const ReferenceNorm want = reference_layer_norm(x64, g64, to_double(beta), eps, rows, h);
      CHECK_CLOSE(to_double(y), want.y, kFloat32);
      CHECK_CLOSE(to_double(mean), want.mean, kFloat32);
      CHECK_CLOSE(to_double(rstd), want.rstd, kFloat32);

      Tensor<float> dy = random_uniform<float>(Shape{b, s, h}, rng);
      Tensor<float> dx = random_uniform<float>(Shape{b, s, h}, rng);  // accumulates onto these
      Tensor<float> dgamma = random_uniform<float>(Shape{h}, rng), dbeta = random_uniform<float>(Shape{h}, rng);
      const Vec dx0 = to_double(dx), dgamma0 = to_double(dgamma), dbeta0 = to_double(dbeta);
      ops::cpu::layer_norm_backward(in.x, gamma.view(), mean.view(), rstd.view(), dy.view(), dx.view(), dgamma.view(),
                                    dbeta.view());
      const ReferenceNormGrads g = reference_layer_norm_backward(x64, g64, to_double(dy), eps, rows, h);
      CHECK_CLOSE(to_double(dx), plus(dx0, g.dx), kFloat32);
      CHECK_CLOSE(to_double(dgamma), plus(dgamma0, g.dgamma), kFloat32);
      CHECK_CLOSE(to_double(dbeta), plus(dbeta0, g.dbeta), kFloat32);
    }
}

TEST_CASE("layer_norm forward may run in place") {
  Rng rng(7);
  Tensor<float> x = random_uniform<float>(Shape{4, 33}, rng), gamma = random_uniform<float>(Shape{33}, rng);
  Tensor<float> beta = random_uniform<float>(Shape{33}, rng), mean(Shape{4}), rstd(Shape{4});
  const ReferenceNorm want = reference_layer_norm(to_double(x), to_double(gamma), to_double(beta), 1e-5, 4, 33);
  ops::cpu::layer_norm_forward(x.view(), gamma.view(), beta.view(), 1e-5f, x.view(), mean.view(), rstd.view());
  CHECK_CLOSE(to_double(x), want.y, kFloat32);
}

TEST_CASE("rms_norm forward and backward match the float64 reference") {
  for (std::int64_t h : {1, 7, 64, 100})
    for (bool strided : {false, true}) {
      CAPTURE(h); CAPTURE(strided);
      Rng rng(200 + h + strided);
      const std::int64_t b = 2, s = 7, rows = b * s;
      RowInput in = make_rows(b, s, h, strided, rng);
      Tensor<float> gamma = random_uniform<float>(Shape{h}, rng);
      Tensor<float> y(Shape{b, s, h}), rstd(Shape{rows});
      const float eps = 1e-6f;
      ops::cpu::rms_norm_forward(in.x, gamma.view(), eps, y.view(), rstd.view());
      const Vec x64 = to_double(in.x), g64 = to_double(gamma);
      const ReferenceNorm want = reference_rms_norm(x64, g64, eps, rows, h);
      CHECK_CLOSE(to_double(y), want.y, kFloat32);
      CHECK_CLOSE(to_double(rstd), want.rstd, kFloat32);

      Tensor<float> dy = random_uniform<float>(Shape{b, s, h}, rng);
      Tensor<float> dx = random_uniform<float>(Shape{b, s, h}, rng), dgamma = random_uniform<float>(Shape{h}, rng);
      const Vec dx0 = to_double(dx), dgamma0 = to_double(dgamma);
      ops::cpu::rms_norm_backward(in.x, gamma.view(), rstd.view(), dy.view(), dx.view(), dgamma.view());
      const ReferenceNormGrads g = reference_rms_norm_backward(x64, g64, to_double(dy), eps, rows, h);
      CHECK_CLOSE(to_double(dx), plus(dx0, g.dx), kFloat32);
      CHECK_CLOSE(to_double(dgamma), plus(dgamma0, g.dgamma), kFloat32);
    }
}

TEST_CASE("norm reference gradients pass finite differences") {
  const std::int64_t rows = 3, h = 5;
  const double eps = 1e-5;
  Rng rng(300);
  Vec x(rows * h), gamma(h), beta(h), dy(rows * h);
  rng.fill_uniform(std::span<double>(x));
  rng.fill_uniform(std::span<double>(gamma));
  rng.fill_uniform(std::span<double>(beta));
  rng.fill_uniform(std::span<double>(dy));
  const auto ln_loss = [&] { return dot(reference_layer_norm(x, gamma, beta, eps, rows, h).y, dy); };
  const ReferenceNormGrads ln = reference_layer_norm_backward(x, gamma, dy, eps, rows, h);
  CHECK_CLOSE(ln.dx, finite_difference(x, ln_loss), kFiniteDifference);
  CHECK_CLOSE(ln.dgamma, finite_difference(gamma, ln_loss), kFiniteDifference);
  CHECK_CLOSE(ln.dbeta, finite_difference(beta, ln_loss), kFiniteDifference);
  const auto rms_loss = [&] { return dot(reference_rms_norm(x, gamma, eps, rows, h).y, dy); };
  const ReferenceNormGrads rms = reference_rms_norm_backward(x, gamma, dy, eps, rows, h);
  CHECK_CLOSE(rms.dx, finite_difference(x, rms_loss), kFiniteDifference);
  CHECK_CLOSE(rms.dgamma, finite_difference(gamma, rms_loss), kFiniteDifference);
}

TEST_CASE("norms reject mismatched shapes") {
  Tensor<float> x(Shape{2, 3, 8}), y(Shape{2, 3, 8}), gamma(Shape{8}), beta(Shape{7}), mean(Shape{6}), rstd(Shape{5});
  Tensor<float> good_rstd(Shape{6});
  CHECK_THROWS_WITH_AS(ops::cpu::layer_norm_forward(x.view(), gamma.view(), beta.view(), 1e-5f, y.view(), mean.view(),
                                                    good_rstd.view()),
                       doctest::Contains("beta"), Error);
  CHECK_THROWS_WITH_AS(ops::cpu::rms_norm_forward(x.view(), gamma.view(), 1e-5f, y.view(), rstd.view()),
                       doctest::Contains("6 elements"), Error);
  Tensor<float> y_bad(Shape{2, 3, 9});
  CHECK_THROWS_AS(ops::cpu::rms_norm_forward(x.view(), gamma.view(), 1e-5f, y_bad.view(), good_rstd.view()), Error);
}
