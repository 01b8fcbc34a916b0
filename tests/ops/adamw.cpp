// Tests of paradyse/ops/cpu/adamw.hpp: several steps against the float64 reference (bias correction at small
// step counts, decoupled decay), and bad configurations rejected.
#include "paradyse/ops/cpu/adamw.hpp"

#include "paradyse/core/rng.hpp"
#include "support/tolerance.hpp"
#include "ops/reference_layers.hpp"

#include <doctest/doctest.h>

using namespace paradyse;
using namespace paradyse::testing;

TEST_CASE("adamw steps match the float64 reference") {
  Rng rng(800);
  const std::int64_t n = 1003;
  Tensor<float> p = random_uniform<float>(Shape{n}, rng), m(Shape{n}), v(Shape{n});
  Vec p64 = to_double(p), m64(n, 0.0), v64(n, 0.0);
  ops::AdamWConfig config;
  config.learning_rate = 0.01f;
  config.weight_decay = 0.1f;
  for (std::int64_t step = 1; step <= 5; ++step) {
    CAPTURE(step);
    Tensor<float> g = random_uniform<float>(Shape{n}, rng, -step, step);
    ops::cpu::adamw_step(p.view(), g.view(), m.view(), v.view(), config, step);
    reference_adamw(p64, to_double(g), m64, v64, config.learning_rate, config.beta1, config.beta2, config.epsilon,
                    config.weight_decay, step);
    CHECK_CLOSE(to_double(p), p64, kFloat32);
    CHECK_CLOSE(to_double(m), m64, kFloat32);
    CHECK_CLOSE(to_double(v), v64, kFloat32);
  }
}

TEST_CASE("adamw: zero gradient with decay only shrinks the parameters") {
  Tensor<float> p(Shape{4}), g(Shape{4}), m(Shape{4}), v(Shape{4});
  p.fill(2.0f);
  ops::AdamWConfig config;
  config.learning_rate = 0.5f;
  config.weight_decay = 0.1f;
  ops::cpu::adamw_step(p.view(), g.view(), m.view(), v.view(), config, 1);
  for (float x : p.span()) CHECK(x == doctest::Approx(2.0 * (1 - 0.05)));
}

TEST_CASE("adamw rejects bad input") {
  Tensor<float> p(Shape{4}), g(Shape{3}), m(Shape{4}), v(Shape{4}), g4(Shape{4});
  CHECK_THROWS_AS(ops::cpu::adamw_step(p.view(), g.view(), m.view(), v.view(), {}, 1), Error);
  CHECK_THROWS_WITH_AS(ops::cpu::adamw_step(p.view(), g4.view(), m.view(), v.view(), {}, 0),
                       doctest::Contains("step = 0"), Error);
  ops::AdamWConfig bad;
  bad.beta1 = 1.0f;
  CHECK_THROWS_AS(ops::cpu::adamw_step(p.view(), g4.view(), m.view(), v.view(), bad, 1), Error);
}
