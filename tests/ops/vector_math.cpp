// Tests of paradyse/ops/cpu/vector_math.hpp: exp_approx's accuracy over the range attention uses, and its
// non-finite inputs (NaN gives NaN, infinities clamp), which must not reach the float-to-int conversion inside
// (undefined behaviour, reported by UBSan's float-cast-overflow check); exp_approx_in_place (eight lanes at a time)
// against it on every length up to 40.
#include "paradyse/ops/cpu/vector_math.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

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

TEST_CASE("vector_math: exp_approx_in_place is exp_approx on every element, blocks of eight and the tail alike") {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  // Every length from 0 to 40 (whole blocks, tails, both), values over the whole range and the special ones placed
  // in blocks and in tails: e^x against float64, and the special values exactly as exp_approx gives them.
  for (int n = 0; n <= 40; ++n) {
    CAPTURE(n);
    std::vector<float> x(std::size_t(n) + 1);
    for (int i = 0; i < n; ++i) x[std::size_t(i)] = -90.0f + 180.0f * float((i * 37) % 41) / 40.0f;
    const float specials[] = {nan, -nan, -inf, inf, -100.0f, 0.0f, -87.0f, 88.0f};
    for (int i = 0; i < n; i += 5) x[std::size_t(i)] = specials[(i / 5) % 8];
    x[std::size_t(n)] = 12345.0f;  // one past the end: must stay as it is
    std::vector<float> y = x;
    paradyse::ops::cpu::exp_approx_in_place(y.data(), n);
    CHECK(y[std::size_t(n)] == 12345.0f);
    for (int i = 0; i < n; ++i) {
      const float in = x[std::size_t(i)], out = y[std::size_t(i)];
      CAPTURE(in);
      if (std::isnan(in)) {
        CHECK(std::isnan(out));
      } else if (in < -87.0f) {
        CHECK(out == 0.0f);
      } else {
        const double want = std::exp(double(std::min(in, 88.0f)));
        CHECK(std::abs(double(out) - want) <= 1e-6 * want);
        CHECK(std::abs(double(out) - double(exp_approx(in))) <= 1e-6 * want);
      }
    }
  }
}
