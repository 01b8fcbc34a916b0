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

// The constants of exp_approx and exp_approx_in_place (which must compute lane for lane the same).
namespace exp_approx_constants {
inline constexpr float kLog2e = 1.44269504088896341f;
inline constexpr float kLn2High = 0.693145751953125f;        // 13 significant bits: n * kLn2High is exact for |n| < 2^11
inline constexpr float kLn2Low = 1.428606765330187045e-06f;  // ln 2 - kLn2High
inline constexpr float kRoundMagic = 12582912.0f;            // 1.5 * 2^23: adding it rounds to an integer
}  // namespace exp_approx_constants

// e^x for float x: 0 below -87 (and for -inf), e^88 at most above 88 (and for +inf; the callers only pass
// x <= ~0), NaN for NaN. The clamp is written so that NaN lands inside the range too (every comparison with NaN is
// false): the float-to-int conversion of n below then never sees a NaN or an out-of-range value (UB in C++), and
// the NaN is put back at the end.
[[gnu::always_inline]] inline float exp_approx(float x) {
  using namespace exp_approx_constants;
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

// exp_approx of x[0..n) in place, eight lanes at a time. GCC does not vectorise a loop over the scalar exp_approx: it
// threads the clamps' constants into the polynomial as branches, which if-conversion then cannot undo (the
// operations might trap), so the loops of attention's softmax ran one exp per instruction. Here each block of eight
// goes through GCC vector extensions (one AVX register under the avx2 and avx512 targets of simd.hpp, two SSE
// registers otherwise) with lane for lane the operations of exp_approx, selects instead of branches; 2^n comes from
// the rounded sum's bits (t = x log2e + 1.5 * 2^23 holds n in its low mantissa bits) rather than a float-to-int
// conversion. The tail (n % 8 elements) runs exp_approx. No vector crosses a function boundary (that would change the
// ABI between the targets): the block is read from and written back to memory.
[[gnu::always_inline]] inline void exp_approx_in_place(float* x, std::int64_t n) {
#if defined(__GNUC__)
  using Floats8 = float __attribute__((vector_size(32)));
  using Ints8 = std::int32_t __attribute__((vector_size(32)));
  using namespace exp_approx_constants;
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    Floats8 v;
    __builtin_memcpy(&v, x + i, sizeof v);
    const Floats8 low = Floats8{} - 87.0f, high = Floats8{} + 88.0f, zero = {};
    Floats8 clamped = v >= low ? v : low;  // NaN: -87
    clamped = clamped <= high ? clamped : high;
    const Floats8 t = clamped * kLog2e + kRoundMagic;
    const Floats8 rounded = t - kRoundMagic;
    const Floats8 r = (clamped - rounded * kLn2High) - rounded * kLn2Low;
    Floats8 p = Floats8{} + 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const Ints8 exponent = (Ints8)t - (Ints8)(Floats8{} + kRoundMagic);  // n, in [-126, 127]
    const Floats8 e = p * (Floats8)((exponent + 127) << 23);
    const Floats8 result = v < low ? zero : e;
    v = v == v ? result : v;  // NaN stays NaN
    __builtin_memcpy(x + i, &v, sizeof v);
  }
  for (; i < n; ++i) x[i] = exp_approx(x[i]);
#else
  for (std::int64_t i = 0; i < n; ++i) x[i] = exp_approx(x[i]);
#endif
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
