#include "paradyse/core/dtype.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>

using namespace paradyse;

namespace {
// The float nearest to x among all values of a 16-bit format, ties to the even bit pattern: a brute-force reference.
template <class Half>
std::uint16_t nearest_by_search(float x) {
  std::uint16_t best = 0;
  double best_distance = std::numeric_limits<double>::infinity();
  for (std::uint32_t bits = 0; bits < 65536; ++bits) {
    const float v = float(Half::from_bits(std::uint16_t(bits)));
    if (std::isnan(v) || std::isinf(v) || std::signbit(v) != std::signbit(x)) continue;
    const double d = std::abs(double(v) - double(x));
    if (d < best_distance || (d == best_distance && (bits & 1u) == 0)) {
      best_distance = d;
      best = std::uint16_t(bits);
    }
  }
  return best;
}
}  // namespace

TEST_CASE("bf16 and f16 round-trip every finite bit pattern exactly") {
  for (std::uint32_t bits = 0; bits < 65536; ++bits) {
    const float b = float(bf16::from_bits(std::uint16_t(bits)));
    if (!std::isnan(b)) CHECK(bf16(b).bits == bits);
    const float h = float(f16::from_bits(std::uint16_t(bits)));
    if (!std::isnan(h)) CHECK(f16(h).bits == bits);
  }
}

TEST_CASE("conversions round to nearest, ties to even") {
  // Halfway between bf16 1.0 (0x3f80) and the next value (0x3f81): rounds to the even one, 0x3f80.
  CHECK(bf16(std::bit_cast<float>(0x3f808000u)).bits == 0x3f80);
  CHECK(bf16(std::bit_cast<float>(0x3f818000u)).bits == 0x3f82);  // halfway, odd below: up to even
  CHECK(bf16(std::bit_cast<float>(0x3f808001u)).bits == 0x3f81);  // just above halfway: up
  // f16: 1 + 2^-11 is halfway between 1 and 1 + 2^-10.
  CHECK(f16(1.0f + 0x1p-11f).bits == 0x3c00);
  CHECK(f16(1.0f + 3 * 0x1p-11f).bits == 0x3c02);
  // Random floats against a brute-force nearest search (normal and subnormal f16 ranges).
  std::uint64_t state = 12345;
  for (int i = 0; i < 300; ++i) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    const double magnitude = std::ldexp(double(state >> 11) * 0x1p-53, int(state % 40) - 26);
    const float x = float((state & 2) ? magnitude : -magnitude);
    CHECK(f16(x).bits == nearest_by_search<f16>(x));
    CHECK(bf16(x).bits == nearest_by_search<bf16>(x));
  }
}

TEST_CASE("special values keep their meaning") {
  const float inf = std::numeric_limits<float>::infinity();
  CHECK(std::isinf(float(bf16(inf))));
  CHECK(std::isinf(float(f16(inf))));
  CHECK(std::isinf(float(f16(70000.0f))));  // beyond f16's largest finite value 65504
  CHECK(float(f16(65504.0f)) == 65504.0f);
  CHECK(std::isnan(float(bf16(std::nanf("")))));
  CHECK(std::isnan(float(f16(std::nanf("")))));
  CHECK(std::signbit(float(f16(-0.0f))));
  CHECK(float(f16(0x1p-24f)) == 0x1p-24f);  // the smallest f16 subnormal
  CHECK(float(f16(0x1p-26f)) == 0.0f);      // below half of it: zero
}

TEST_CASE("dtype metadata") {
  CHECK(size_of(dtype_of<float>()) == 4);
  CHECK(size_of(dtype_of<bf16>()) == 2);
  CHECK(size_of(dtype_of<std::int64_t>()) == 8);
  CHECK(name_of(dtype_of<f16>()) == "f16");
}
