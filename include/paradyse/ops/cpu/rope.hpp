// paradyse/ops/cpu/rope.hpp: rotary position embedding with position offsets, forward and backward.
//
// Token i of a rank's chunk is at global position position_offset + i (a sequence-parallel rank's chunk starts
// mid-sequence). With document_starts (a packed variable-length batch, as in AttentionMask) positions restart at
// every document. Frequency j of d/2 rotates by angle position * theta^(-2j/d). Which elements form a pair:
//   RopeLayout::halves      (x[j], x[j + d/2])  (GPT-NeoX / Hugging Face Llama), the default;
//   RopeLayout::interleaved (x[2j], x[2j + 1])  (GPT-J / the original Llama code).
// The rotation is orthogonal, so backward applies the inverse rotation to the gradient.
#pragma once

#include "paradyse/core/tensor.hpp"
#include "paradyse/ops/cpu/rows.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>

namespace paradyse::ops {

enum class RopeLayout { halves, interleaved };

struct RopeConfig {
  double theta = 10000.0;
  RopeLayout layout = RopeLayout::halves;
};

}  // namespace paradyse::ops

namespace paradyse::ops::cpu {

namespace detail {

inline void check_rope(const char* op, const TensorView<const float>& x, const TensorView<const float>& y,
                       std::int64_t position_offset, const RopeConfig& config,
                       std::span<const std::int64_t> document_starts) {
  check(x.rank() == 4, "{}: x must be [b, s, heads, d]; got {}", op, x.shape());
  check_rows(op, "x", x);
  check_rows(op, "y", y);
  check_same_shape(op, "x", x, "y", y);
  check(x.extent(3) % 2 == 0, "{}: head_dim = {} must be even", op, x.extent(3));
  check(position_offset >= 0, "{}: position_offset = {} must be non-negative", op, position_offset);
  check(config.theta > 0.0, "{}: theta = {} must be positive", op, config.theta);
  check(document_starts.empty() || document_starts[0] == 0, "{}: the first document must start at 0, not {}", op,
        document_starts.empty() ? 0 : document_starts[0]);
  check(std::is_sorted(document_starts.begin(), document_starts.end()), "{}: document_starts must be sorted", op);
}

// Position of token `global` inside its document.
inline std::int64_t rope_position(std::int64_t global, std::span<const std::int64_t> document_starts) {
  if (document_starts.empty()) return global;
  return global - *(std::upper_bound(document_starts.begin(), document_starts.end(), global) - 1);
}

// Rotates every head of every token by its angles; `inverse` rotates the other way and accumulates (backward).
inline void rope_apply(TensorView<const float> x, TensorView<float> y, std::int64_t position_offset,
                       const RopeConfig& config, std::span<const std::int64_t> document_starts, bool inverse) {
  const std::int64_t b = x.extent(0), s = x.extent(1), heads = x.extent(2), d = x.extent(3), half = d / 2;
  Tensor<float> angles(Shape{2, half});  // cos, sin of the current token
  float* cosine = angles.data();
  float* sine = angles.data() + half;
  // Pair j: elements (first + j * step_pair, first + j * step_pair + partner).
  const bool halves = config.layout == RopeLayout::halves;
  const std::int64_t pair_stride = halves ? 1 : 2, partner = halves ? half : 1;
  // theta^(-2j/d) per pair, once per call instead of once per token (the same values): on the stack for heads up to
  // 2 x kStackPairs wide, else computed per token as before.
  constexpr std::int64_t kStackPairs = 256;
  double frequencies[kStackPairs];
  const bool tabled = half <= kStackPairs;
  if (tabled)
    for (std::int64_t j = 0; j < half; ++j) frequencies[j] = std::pow(config.theta, -2.0 * double(j) / double(d));
  for (std::int64_t i = 0; i < s; ++i) {
    const double position = double(rope_position(position_offset + i, document_starts));
    for (std::int64_t j = 0; j < half; ++j) {
      const double angle =
          position * (tabled ? frequencies[j] : std::pow(config.theta, -2.0 * double(j) / double(d)));
      cosine[j] = float(std::cos(angle));
      sine[j] = float(inverse ? -std::sin(angle) : std::sin(angle));
    }
    for (std::int64_t bi = 0; bi < b; ++bi)
      for (std::int64_t h = 0; h < heads; ++h) {
        const float* xr = &x(bi, i, h, 0);
        float* yr = &y(bi, i, h, 0);
        for (std::int64_t j = 0; j < half; ++j) {
          const float first = xr[j * pair_stride], second = xr[j * pair_stride + partner];
          const float a = first * cosine[j] - second * sine[j];
          const float c = first * sine[j] + second * cosine[j];
          if (inverse) {
            yr[j * pair_stride] += a;
            yr[j * pair_stride + partner] += c;
          } else {
            yr[j * pair_stride] = a;
            yr[j * pair_stride + partner] = c;
          }
        }
      }
  }
}

}  // namespace detail

// x, y: [b, s, heads, d] (y overwritten; may be x itself for in-place). Rotates pairs by position * theta^(-2j/d),
// token i at position position_offset + i (relative to its document when document_starts is given).
inline void rope_forward(TensorView<const float> x, TensorView<float> y, std::int64_t position_offset,
                         const RopeConfig& config = {}, std::span<const std::int64_t> document_starts = {}) {
  detail::check_rope("rope_forward", x, y, position_offset, config, document_starts);
  detail::rope_apply(x, y, position_offset, config, document_starts, false);
}

// dy, dx: [b, s, heads, d]. dx += rotation^T dy (the same positions as forward). dx must not alias dy.
inline void rope_backward(TensorView<const float> dy, TensorView<float> dx, std::int64_t position_offset,
                          const RopeConfig& config = {}, std::span<const std::int64_t> document_starts = {}) {
  detail::check_rope("rope_backward", dy, dx, position_offset, config, document_starts);
  check(dy.data() != dx.data() || dy.numel() == 0, "rope_backward: dx accumulates and must not alias dy");
  detail::rope_apply(dy, dx, position_offset, config, document_starts, true);
}

}  // namespace paradyse::ops::cpu
