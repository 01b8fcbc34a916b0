// kernels/rope.cuh: the rotary position embedding kernel and the launchers ops/cuda/rope.hpp declares.
//
// One thread per rotated pair (token, head, frequency j), grid-stride. The token's position is its global index
// minus the start of its document (binary search in the uploaded document_starts); the angle position * freq[j] is
// a double (freq[j] = theta^(-2j/d), computed on the host as ops::cpu computes it), its cosine and sine rounded to
// float, then the pair is rotated in float exactly as ops::cpu::detail::rope_apply does.
#pragma once

#include "rows.cuh"
#include "paradyse/ops/cuda/rope.hpp"

#include <cmath>
#include <cstdint>
#include <vector>

namespace paradyse::kernels::dense {

struct RopeGeometry {
  std::int64_t batch, seq, heads, half;
  std::int64_t x_stride[3], y_stride[3];  // strides of [b, s, heads]; the last dimension has unit stride
  std::int64_t pair_stride, partner;      // pair j: elements (j * pair_stride, j * pair_stride + partner)
};

__device__ inline std::int64_t rope_document_position(std::int64_t global, const std::int64_t* starts,
                                                      std::int64_t count) {
  if (count == 0) return global;
  // The last start <= global (starts[0] == 0 <= global).
  std::int64_t lo = 0, hi = count;  // answer in [lo, hi)
  while (hi - lo > 1) {
    const std::int64_t mid = lo + (hi - lo) / 2;
    if (starts[mid] <= global) lo = mid;
    else hi = mid;
  }
  return global - starts[lo];
}

__global__ void rope_kernel(const float* x, float* y, RopeGeometry g, std::int64_t position_offset,
                            const double* frequencies, const std::int64_t* document_starts, std::int64_t documents,
                            bool inverse) {
  const std::int64_t n = g.batch * g.seq * g.heads * g.half;
  for (std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int64_t j = i % g.half;
    std::int64_t rest = i / g.half;
    const std::int64_t head = rest % g.heads;
    rest /= g.heads;
    const std::int64_t token = rest % g.seq, bi = rest / g.seq;
    const double position = double(rope_document_position(position_offset + token, document_starts, documents));
    double sin_angle, cos_angle;
    sincos(position * frequencies[j], &sin_angle, &cos_angle);
    const float cosine = float(cos_angle), sine = float(inverse ? -sin_angle : sin_angle);
    const float* xr = x + bi * g.x_stride[0] + token * g.x_stride[1] + head * g.x_stride[2] + j * g.pair_stride;
    float* yr = y + bi * g.y_stride[0] + token * g.y_stride[1] + head * g.y_stride[2] + j * g.pair_stride;
    const float first = xr[0], second = xr[g.partner];
    const float a = first * cosine - second * sine;
    const float c = first * sine + second * cosine;
    if (inverse) {
      yr[0] += a;
      yr[g.partner] += c;
    } else {  // the same thread read this pair: y may be x
      yr[0] = a;
      yr[g.partner] = c;
    }
  }
}

inline void launch_rope(const TensorView<const float>& x, const TensorView<float>& y, std::int64_t position_offset,
                        const ops::RopeConfig& config, std::span<const std::int64_t> document_starts, bool inverse) {
  RopeGeometry g{};
  g.batch = x.extent(0), g.seq = x.extent(1), g.heads = x.extent(2), g.half = x.extent(3) / 2;
  for (int d = 0; d < 3; ++d) g.x_stride[d] = x.strides()[d], g.y_stride[d] = y.strides()[d];
  const bool halves = config.layout == ops::RopeLayout::halves;
  g.pair_stride = halves ? 1 : 2;
  g.partner = halves ? g.half : 1;
  const std::int64_t pairs = g.batch * g.seq * g.heads * g.half;
  if (pairs == 0) return;
  const double d = double(x.extent(3));
  std::vector<double> frequencies(std::size_t(g.half));
  for (std::int64_t j = 0; j < g.half; ++j) frequencies[std::size_t(j)] = std::pow(config.theta, -2.0 * double(j) / d);
  const cudaStream_t stream = device::current_stream();
  const StreamScratch device_frequencies = upload(std::span<const double>(frequencies), stream);
  const std::int64_t documents = std::int64_t(document_starts.size());
  const StreamScratch device_starts = upload(document_starts, stream);
  constexpr int kThreads = 256;
  const unsigned blocks = std::min<unsigned>(grid_for(pairs, kThreads), 132u * 64u);
  rope_kernel<<<blocks, kThreads, 0, stream>>>(x.data(), y.data(), g, position_offset,
                                                 device_frequencies.as<double>(), device_starts.as<std::int64_t>(),
                                                 documents, inverse);
  device::check_launch(inverse ? "rope_kernel (rope_backward)" : "rope_kernel (rope_forward)");
}

}  // namespace paradyse::kernels::dense

namespace paradyse::ops::cuda {

void rope_forward(TensorView<const float> x, TensorView<float> y, std::int64_t position_offset,
                  const RopeConfig& config, std::span<const std::int64_t> document_starts) {
  ops::cpu::detail::check_rope("rope_forward", x, y, position_offset, config, document_starts);
  kernels::dense::launch_rope(x, y, position_offset, config, document_starts, false);
}

void rope_backward(TensorView<const float> dy, TensorView<float> dx, std::int64_t position_offset,
                   const RopeConfig& config, std::span<const std::int64_t> document_starts) {
  ops::cpu::detail::check_rope("rope_backward", dy, dx, position_offset, config, document_starts);
  check(dy.data() != dx.data() || dy.numel() == 0, "rope_backward: dx accumulates and must not alias dy");
  kernels::dense::launch_rope(dy, dx, position_offset, config, document_starts, true);
}

}  // namespace paradyse::ops::cuda
