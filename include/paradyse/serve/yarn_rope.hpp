// paradyse/serve/yarn_rope.hpp: YaRN rotary scaling (rope_scaling type "yarn") as DeepSeek-V2/V3 use it, computed as
// transformers 4.57.6 does (modeling_rope_utils._compute_yarn_parameters) and as DeepSeek's attention corrects it.
//
// For a RoPE width d (DeepSeek: qk_rope_head_dim) and base theta, pair j of d/2 (s = factor, L = original_max_position_
// embeddings, or max_position_embeddings when absent):
//   extrapolated_j = theta^(-2j/d), interpolated_j = extrapolated_j / s;
//   correction dim(r) = d ln(L / (2 pi r)) / (2 ln theta); low = floor(dim(beta_fast)), high = ceil(dim(beta_slow))
//   (no floor/ceil when truncate is false), clamped to [0, d - 1]; high += 0.001 when low == high;
//   ramp_j = clamp((j - low) / (high - low), 0, 1);
//   inverse frequency_j = interpolated_j ramp_j + extrapolated_j (1 - ramp_j).
// The rotation's cos and sin are multiplied by attention_factor (so q_pe . k_pe by its square):
//   attention_factor stated, else mscale(s, mscale) / mscale(s, mscale_all_dim) when both are non-zero, else
//   mscale(s, 1); mscale(s, m) = 0.1 m ln(s) + 1 for s > 1, else 1.
// DeepSeek's softmax scale (d_n + d_r)^-1/2 is multiplied by mscale(s, mscale_all_dim)^2 when mscale_all_dim is
// non-zero (the original DeepSeek-V2/V3 code, vLLM and transformers' DeepseekV3; transformers 4.57.6's DeepseekV2
// omits it, scripts/make_hf_fixtures.py says how its fixture adds it back).
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/tensor.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numbers>
#include <span>
#include <vector>

namespace paradyse::serve {

// rope_scaling {"type": "yarn", ...}; factor = 0: no scaling (plain RoPE).
struct YarnRope {
  double factor = 0.0;
  double original_max_position = 0.0;  // original_max_position_embeddings (or max_position_embeddings)
  double beta_fast = 32.0, beta_slow = 1.0;
  double mscale = 0.0, mscale_all_dim = 0.0;  // 0: absent
  double attention_factor = 0.0;              // 0: derived from factor, mscale, mscale_all_dim
  bool truncate = true;

  bool enabled() const { return factor != 0.0; }
};

inline double yarn_mscale(double scale, double m) { return scale <= 1.0 ? 1.0 : 0.1 * m * std::log(scale) + 1.0; }

// The factor on cos and sin (1 without scaling).
inline double yarn_attention_factor(const YarnRope& y) {
  if (!y.enabled()) return 1.0;
  if (y.attention_factor != 0.0) return y.attention_factor;
  if (y.mscale != 0.0 && y.mscale_all_dim != 0.0)
    return yarn_mscale(y.factor, y.mscale) / yarn_mscale(y.factor, y.mscale_all_dim);
  return yarn_mscale(y.factor, 1.0);
}

// The factor on DeepSeek's softmax scale (1 without scaling or without mscale_all_dim).
inline double yarn_softmax_factor(const YarnRope& y) {
  if (!y.enabled() || y.mscale_all_dim == 0.0) return 1.0;
  const double m = yarn_mscale(y.factor, y.mscale_all_dim);
  return m * m;
}

// Inverse frequency of each of the d/2 pairs: theta^(-2j/d), blended with theta^(-2j/d) / factor under YaRN.
inline std::vector<double> rope_inverse_frequencies(double theta, std::int64_t d, const YarnRope& y) {
  check(d >= 2 && d % 2 == 0 && theta > 0.0, "rope_inverse_frequencies: width {} must be even and positive, theta {} "
        "positive", d, theta);
  std::vector<double> f(std::size_t(d / 2));
  for (std::int64_t j = 0; j < d / 2; ++j) f[std::size_t(j)] = std::pow(theta, -2.0 * double(j) / double(d));
  if (!y.enabled()) return f;
  const auto correction_dim = [&](double rotations) {
    return double(d) * std::log(y.original_max_position / (rotations * 2.0 * std::numbers::pi)) /
           (2.0 * std::log(theta));
  };
  double low = correction_dim(y.beta_fast), high = correction_dim(y.beta_slow);
  if (y.truncate) low = std::floor(low), high = std::ceil(high);
  low = std::max(low, 0.0);
  high = std::min(high, double(d - 1));
  if (low == high) high += 0.001;
  for (std::int64_t j = 0; j < d / 2; ++j) {
    const double ramp = std::clamp((double(j) - low) / (high - low), 0.0, 1.0);
    double& e = f[std::size_t(j)];
    e = e / y.factor * ramp + e * (1.0 - ramp);
  }
  return f;
}

// Rotates x [b, s, heads, d] in place, token i at position `start + i`: pair j (halves: (x[j], x[j + d/2]);
// interleaved: (x[2j], x[2j + 1])) by angle position * frequencies[j], with cos and sin times `amplitude`.
inline void rotate_scaled(TensorView<float> x, std::int64_t start, std::span<const double> frequencies,
                          double amplitude, bool interleaved) {
  const std::int64_t b = x.extent(0), s = x.extent(1), heads = x.extent(2), d = x.extent(3), half = d / 2;
  check(std::int64_t(frequencies.size()) == half, "rotate_scaled: {} frequencies for width {}", frequencies.size(), d);
  const std::int64_t stride = interleaved ? 2 : 1, partner = interleaved ? 1 : half;
  std::vector<float> cosine(static_cast<std::size_t>(half)), sine(static_cast<std::size_t>(half));
  for (std::int64_t i = 0; i < s; ++i) {
    for (std::int64_t j = 0; j < half; ++j) {
      const double angle = double(start + i) * frequencies[std::size_t(j)];
      cosine[std::size_t(j)] = float(std::cos(angle) * amplitude);
      sine[std::size_t(j)] = float(std::sin(angle) * amplitude);
    }
    for (std::int64_t bi = 0; bi < b; ++bi)
      for (std::int64_t h = 0; h < heads; ++h) {
        float* r = &x(bi, i, h, 0);
        for (std::int64_t j = 0; j < half; ++j) {
          const float first = r[j * stride], second = r[j * stride + partner];
          r[j * stride] = first * cosine[std::size_t(j)] - second * sine[std::size_t(j)];
          r[j * stride + partner] = first * sine[std::size_t(j)] + second * cosine[std::size_t(j)];
        }
      }
  }
}

}  // namespace paradyse::serve
