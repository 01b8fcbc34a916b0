// Tests of paradyse/ops/cpu/vector_math.hpp: exp_approx's accuracy over the range attention uses, and its
// non-finite inputs (NaN gives NaN, infinities clamp), which must not reach the float-to-int conversion inside
// (undefined behaviour, reported by UBSan's float-cast-overflow check).
#include "paradyse/ops/cpu/vector_math.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <limits>

using paradyse::ops::cpu::exp_approx;

TEST_CASE("vector_math: exp_approx is accurate over [-87, 88]") {
  for (float x = -87.0f; x <= 88.0f; x += 0.37f) {
    CAPTURE(x);
    const double want = std::exp(double(x));
    CHECK(std::abs(double(exp_approx(x)) - want) <= 1e-6 * want);
  }
  CHECK(exp_approx(-100.0f) == 0.0f);
}

TEST_CASE("vector_math: exp_approx of NaN is NaN and of infinities is clamped, with no NaN-to-int conversion") {
  const float inf = std::numeric_limits<float>::infinity();
  volatile float nan = std::numeric_limits<float>::quiet_NaN();  // volatile: evaluated at run time, where UBSan looks
  CHECK(std::isnan(exp_approx(nan)));
  CHECK(std::isnan(exp_approx(-nan)));
  CHECK(exp_approx(-inf) == 0.0f);
  CHECK(exp_approx(inf) == doctest::Approx(std::exp(88.0)).epsilon(1e-5));
}
