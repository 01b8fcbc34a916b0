// tests/support/tolerance.hpp: the project's tolerances, stated once.
//
// A float32 computation is compared with a float64 reference by a mixed test: |got - want| <= atol + rtol * |want|.
// The float32 bounds cover reassociation over reductions of up to ~10^5 terms (the block sizes the tests use).
#pragma once

#include <cmath>
#include <cstddef>
#include <span>
#include <string>

#include <doctest/doctest.h>
#include <fmt/format.h>

namespace paradyse::testing {

struct Tolerance {
  double atol;
  double rtol;
};

inline constexpr Tolerance kFloat32{2e-4, 2e-3};     // float32 kernels against the float64 reference
inline constexpr Tolerance kFloat64{1e-10, 1e-9};    // float64 kernels against the float64 reference
inline constexpr Tolerance kBfloat16{1e-2, 1.6e-2};  // bf16 storage (8 mantissa bits)
// Finite differences (central, step 1e-6 in float64) against analytic gradients.
inline constexpr Tolerance kFiniteDifference{1e-6, 1e-5};

// The first element that violates the tolerance, described; empty when all agree.
template <class Got, class Want>
std::string first_mismatch(std::span<const Got> got, std::span<const Want> want, Tolerance tol) {
  if (got.size() != want.size()) return fmt::format("sizes differ: got {} elements, want {}", got.size(), want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double g = double(got[i]), w = double(want[i]);
    if (!(std::abs(g - w) <= tol.atol + tol.rtol * std::abs(w)))
      return fmt::format("element {}: got {:.9g}, want {:.9g} (|diff| {:.3g} > {:.3g})", i, g, w, std::abs(g - w),
                         tol.atol + tol.rtol * std::abs(w));
  }
  return {};
}

}  // namespace paradyse::testing

// CHECK_CLOSE(got, want, tol): every element of two spans within the tolerance; the message names the first miss.
#define CHECK_CLOSE(got, want, tol)                                                                  \
  do {                                                                                               \
    const std::string paradyse_mismatch_ = ::paradyse::testing::first_mismatch(                      \
        std::span<const std::remove_cvref_t<decltype(*std::data(got))>>(std::data(got), std::size(got)), \
        std::span<const std::remove_cvref_t<decltype(*std::data(want))>>(std::data(want), std::size(want)), (tol)); \
    CHECK_MESSAGE(paradyse_mismatch_.empty(), paradyse_mismatch_);                                   \
  } while (0)
