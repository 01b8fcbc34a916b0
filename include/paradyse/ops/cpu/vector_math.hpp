// paradyse/ops/cpu/vector_math.hpp: element functions written so that loops over them vectorise.
//
// std::exp does not vectorise without -ffast-math, and softmax over attention tiles runs one exp per score, so
// attention needs an exp the compiler can put in SIMD registers. exp_approx: range reduction x = n ln2 + r with
// |r| <= ln2/2 (ln2 split in a high and a low part so n ln2 is exact), a degree-7 Taylor polynomial for e^r
// (truncation error < 6e-9 relative), and 2^n built in the exponent bits. Relative error ~2 ulp over the range.
#pragma once

#include <bit>
#include <cstdint>


namespace paradyse::ops::cpu {

// e^x for float x: 0 below -87 (and for -inf), e^88 at most above 88 (and for +inf; the callers only pass
// x <= ~0), NaN for NaN. The clamp is written so that NaN lands inside the range too (every comparison with NaN is
// false): the float-to-int conversion of n below then never sees a NaN or an out-of-range value (UB in C++), and
// the NaN is put back at the end.
[[gnu::always_inline]] inline float exp_approx(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2High = 0.693145751953125f;        // 13 significant bits: n * kLn2High is exact for |n| < 2^11
  constexpr float kLn2Low = 1.428606765330187045e-06f;  // ln 2 - kLn2High
  constexpr float kRoundMagic = 12582912.0f;            // 1.5 * 2^23: adding it rounds to an integer
  const float clamped = x >= -87.0f ? (x <= 88.0f ? x : 88.0f) : -87.0f;  // NaN: -87
  const float n = (clamped * kLog2e + kRoundMagic) - kRoundMagic;
  const float r = (clamped - n * kLn2High) - n * kLn2Low;
  // e^r = 1 + r + r^2/2! + ... + r^7/7!, Horner form.
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const float two_to_n = std::bit_cast<float>(std::uint32_t(std::int32_t(n) + 127) << 23);
  return x < -87.0f ? 0.0f : (x == x ? p * two_to_n : x);
}

// Reductions with 16 independent partial results: they vectorise without -ffast-math (a plain float reduction
// does not, since reassociating it changes the rounding). The tail runs from an explicit bound so that GCC sees
// both loops' trip counts.
inline constexpr int kReductionLanes = 16;

[[gnu::always_inline]] inline float sum(const float* x, std::int64_t n) {
  const std::int64_t full = n / kReductionLanes * kReductionLanes;
  float lanes[kReductionLanes] = {};
  for (std::int64_t i = 0; i < full; i += kReductionLanes)
    for (int l = 0; l < kReductionLanes; ++l) lanes[l] += x[i + l];
  float total = 0.0f;
  for (int l = 0; l < kReductionLanes; ++l) total += lanes[l];
  for (std::int64_t i = full; i < n; ++i) total += x[i];
  return total;
}

[[gnu::always_inline]] inline float dot(const float* x, const float* y, std::int64_t n) {
  const std::int64_t full = n / kReductionLanes * kReductionLanes;
  float lanes[kReductionLanes] = {};
  for (std::int64_t i = 0; i < full; i += kReductionLanes)
    for (int l = 0; l < kReductionLanes; ++l) lanes[l] += x[i + l] * y[i + l];
  float total = 0.0f;
  for (int l = 0; l < kReductionLanes; ++l) total += lanes[l];
  for (std::int64_t i = full; i < n; ++i) total += x[i] * y[i];
  return total;
}

// sum of (x - shift)^2: the second pass of a two-pass variance.
[[gnu::always_inline]] inline float sum_of_squares(const float* x, std::int64_t n, float shift) {
  const std::int64_t full = n / kReductionLanes * kReductionLanes;
  float lanes[kReductionLanes] = {};
  for (std::int64_t i = 0; i < full; i += kReductionLanes)
    for (int l = 0; l < kReductionLanes; ++l) {
      const float c = x[i + l] - shift;
      lanes[l] += c * c;
    }
  float total = 0.0f;
  for (int l = 0; l < kReductionLanes; ++l) total += lanes[l];
  for (std::int64_t i = full; i < n; ++i) total += (x[i] - shift) * (x[i] - shift);
  return total;
}

// The largest element (-inf for n = 0); NaN elements are skipped.
[[gnu::always_inline]] inline float maximum(const float* x, std::int64_t n) {
  constexpr float kLowest = -__builtin_huge_valf();
  const std::int64_t full = n / kReductionLanes * kReductionLanes;
  float lanes[kReductionLanes];
  for (int l = 0; l < kReductionLanes; ++l) lanes[l] = kLowest;
  for (std::int64_t i = 0; i < full; i += kReductionLanes)
    for (int l = 0; l < kReductionLanes; ++l) lanes[l] = x[i + l] > lanes[l] ? x[i + l] : lanes[l];
  float m = kLowest;
  for (int l = 0; l < kReductionLanes; ++l) m = lanes[l] > m ? lanes[l] : m;
  for (std::int64_t i = full; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

// tanh through exp: 1 - 2 / (e^{2u} + 1), saturating to +-1 (absolute error ~1e-7).
[[gnu::always_inline]] inline float tanh_approx(float u) { return 1.0f - 2.0f / (exp_approx(2.0f * u) + 1.0f); }

// 1 / (1 + e^-x).
[[gnu::always_inline]] inline float sigmoid_approx(float x) { return 1.0f / (1.0f + exp_approx(-x)); }

}  // namespace paradyse::ops::cpu
