// Tests of paradyse/ops/cpu/activation.hpp: GELU (tanh form) and SwiGLU forward and gradients against the float64
// reference over a wide input range (saturation included), accumulation, strided halves of a packed tensor, and
// finite differences of the reference derivatives.
#include "paradyse/ops/cpu/activation.hpp"

#include "paradyse/core/rng.hpp"
#include "support/tolerance.hpp"
#include "ops/reference_layers.hpp"

#include <doctest/doctest.h>

using namespace paradyse;
using namespace paradyse::testing;

TEST_CASE("gelu forward and backward match the float64 reference") {
  Rng rng(400);
  Tensor<float> x = random_uniform<float>(Shape{3, 7, 37}, rng, -8.0, 8.0);
  x(0, 0, 0) = 0.0f, x(0, 0, 1) = 30.0f, x(0, 0, 2) = -30.0f, x(0, 0, 3) = 1e-6f;  // saturation and tiny inputs
  Tensor<float> y(x.shape());
  ops::cpu::gelu_forward(x.view(), y.view());
  const Vec x64 = to_double(x);
  Vec want(x64.size());
  for (std::size_t i = 0; i < x64.size(); ++i) want[i] = reference_gelu(x64[i]);
  CHECK_CLOSE(to_double(y), want, kFloat32);

  Tensor<float> dy = random_uniform<float>(x.shape(), rng), dx = random_uniform<float>(x.shape(), rng);
  Vec want_dx = to_double(dx);
  const Vec dy64 = to_double(dy);
  for (std::size_t i = 0; i < x64.size(); ++i) want_dx[i] += dy64[i] * reference_gelu_derivative(x64[i]);
  ops::cpu::gelu_backward(x.view(), dy.view(), dx.view());
  CHECK_CLOSE(to_double(dx), want_dx, kFloat32);
}

TEST_CASE("gelu may run in place") {
  Rng rng(401);
  Tensor<float> x = random_uniform<float>(Shape{50}, rng, -4.0, 4.0);
  const Vec x64 = to_double(x);
  ops::cpu::gelu_forward(x.view(), x.view());
  Vec want(x64.size());
  for (std::size_t i = 0; i < x64.size(); ++i) want[i] = reference_gelu(x64[i]);
  CHECK_CLOSE(to_double(x), want, kFloat32);
}

TEST_CASE("swiglu over the two halves of a packed [.., 2f] tensor matches the reference") {
  Rng rng(402);
  const std::int64_t f = 45;
  Tensor<float> packed = random_uniform<float>(Shape{4, 6, 2 * f}, rng, -9.0, 9.0);
  const TensorView<const float> gate = packed.view().slice(2, 0, f), up = packed.view().slice(2, f, f);
  Tensor<float> y(Shape{4, 6, f});
  ops::cpu::swiglu_forward(gate, up, y.view());
  const Vec g64 = to_double(gate), u64 = to_double(up);
  Vec want(g64.size());
  for (std::size_t i = 0; i < g64.size(); ++i) want[i] = reference_swiglu(g64[i], u64[i]);
  CHECK_CLOSE(to_double(y), want, kFloat32);

  Tensor<float> dy = random_uniform<float>(y.shape(), rng);
  Tensor<float> dpacked = random_uniform<float>(packed.shape(), rng);
  const TensorView<float> dgate = dpacked.view().slice(2, 0, f), dup = dpacked.view().slice(2, f, f);
  Vec want_dgate = to_double(dgate), want_dup = to_double(dup);
  const Vec dy64 = to_double(dy);
  for (std::size_t i = 0; i < g64.size(); ++i) {
    want_dgate[i] += dy64[i] * reference_swiglu_dgate(g64[i], u64[i]);
    want_dup[i] += dy64[i] * reference_swiglu_dup(g64[i]);
  }
  ops::cpu::swiglu_backward(gate, up, dy.view(), dgate, dup);
  CHECK_CLOSE(to_double(dgate), want_dgate, kFloat32);
  CHECK_CLOSE(to_double(dup), want_dup, kFloat32);
}

TEST_CASE("activation reference derivatives pass finite differences") {
  Rng rng(403);
  Vec x(40), up(40), dy(40);
  rng.fill_uniform(std::span<double>(x), -5, 5);
  rng.fill_uniform(std::span<double>(up), -2, 2);
  rng.fill_uniform(std::span<double>(dy));
  const auto gelu_loss = [&] {
    double s = 0;
    for (std::size_t i = 0; i < x.size(); ++i) s += dy[i] * reference_gelu(x[i]);
    return s;
  };
  Vec analytic(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) analytic[i] = dy[i] * reference_gelu_derivative(x[i]);
  CHECK_CLOSE(analytic, finite_difference(x, gelu_loss), kFiniteDifference);
  const auto swiglu_loss = [&] {
    double s = 0;
    for (std::size_t i = 0; i < x.size(); ++i) s += dy[i] * reference_swiglu(x[i], up[i]);
    return s;
  };
  Vec dgate(x.size()), dup(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    dgate[i] = dy[i] * reference_swiglu_dgate(x[i], up[i]);
    dup[i] = dy[i] * reference_swiglu_dup(x[i]);
  }
  CHECK_CLOSE(dgate, finite_difference(x, swiglu_loss), kFiniteDifference);
  CHECK_CLOSE(dup, finite_difference(up, swiglu_loss), kFiniteDifference);
}

TEST_CASE("activations reject mismatched shapes") {
  Tensor<float> a(Shape{3, 4}), b(Shape{3, 5}), c(Shape{3, 4});
  CHECK_THROWS_AS(ops::cpu::gelu_forward(a.view(), b.view()), Error);
  CHECK_THROWS_AS(ops::cpu::swiglu_forward(a.view(), b.view(), c.view()), Error);
  CHECK_THROWS_AS(ops::cpu::gelu_backward(a.view(), c.view(), b.view()), Error);
}
