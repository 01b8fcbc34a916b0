// kernels/moe_ops.cuh: kernels and launchers of ops/cuda/moe_ops.hpp (router scores and top-k, the router's
// backward, row gathers, deterministic scatter-adds, gathered row dots, sigmoid). nvcc only; included once per
// program through kernels/all.cuh.
//
// Arithmetic follows ops::cpu's: the router works in float64 per token (one thread per token in the forward, one
// block per token in the backward), top-k orders by (logit descending, expert index ascending) exactly as the CPU's
// comparator, and the statistics sum tokens in a fixed order, so results do not depend on the launch.
#pragma once

#include "paradyse/device/runtime.hpp"
#include "stream_scratch.cuh"
#include "paradyse/ops/cpu/moe_ops.hpp"
#include "paradyse/ops/cuda/moe_ops.hpp"

#include <cuda_runtime.h>

#include <cstdint>
#include <limits>
#include <span>
#include <vector>

namespace paradyse::kernels::moe_kernels {

constexpr unsigned kThreads = 256;
constexpr long long kStatsChunk = 64;  // tokens per partial sum of the router statistics
constexpr unsigned long long kNoBadLogit = ~0ull;

// One thread per token: probs, lse (and lse^2 in float64 for the statistics), the top-k experts and their gates.
// A non-finite logit records its flat index (the smallest wins: ops::cpu reports the first) and skips the token.
__global__ void router_forward_tokens(const float* logits, long long n, long long e_count, bool sigmoid,
                                      bool normalize, float scale, const std::int64_t* offsets, float* probs,
                                      float* lse, double* lse_squared, std::int64_t* experts, float* gates,
                                      unsigned long long* bad_logit) {
  for (long long t = blockIdx.x * (long long)blockDim.x + threadIdx.x; t < n; t += (long long)gridDim.x * blockDim.x) {
    const float* l = logits + t * e_count;
    float* p = probs + t * e_count;
    float top = -INFINITY;
    bool finite = true;
    for (long long e = 0; e < e_count; ++e) {
      if (!isfinite(l[e])) {
        atomicMin(bad_logit, (unsigned long long)(t * e_count + e));
        finite = false;
        break;
      }
      top = fmaxf(top, l[e]);
    }
    if (!finite) continue;
    double sum = 0;
    for (long long e = 0; e < e_count; ++e) sum += exp(double(l[e]) - top);
    const double log_sum = double(top) + log(sum);
    lse[t] = float(log_sum);
    lse_squared[t] = log_sum * log_sum;
    for (long long e = 0; e < e_count; ++e)
      p[e] = sigmoid ? float(1.0 / (1.0 + exp(-double(l[e])))) : float(exp(double(l[e]) - log_sum));
    // Top-k: the j-th choice is the best expert after the (j-1)-th in the order (logit desc, index asc).
    const long long begin = offsets[t], k = offsets[t + 1] - begin;
    long long previous = -1;
    for (long long j = 0; j < k; ++j) {
      long long best = -1;
      for (long long e = 0; e < e_count; ++e) {
        const bool after_previous =
            previous < 0 || l[e] < l[previous] || (l[e] == l[previous] && e > previous);
        if (after_previous && (best < 0 || l[e] > l[best])) best = e;
      }
      experts[begin + j] = best;
      previous = best;
    }
    double selected = 0;
    for (long long j = 0; j < k; ++j) selected += p[experts[begin + j]];
    const double factor = normalize && selected > 0 ? double(scale) / selected : double(scale);
    for (long long j = 0; j < k; ++j) gates[begin + j] = float(factor * p[experts[begin + j]]);
  }
}

// Partial sums of the statistics: partial[chunk, e] = sum over the chunk's tokens (in order) of probs[t, e] for
// e < E, of lse^2 for e = E.
__global__ void router_stats_partial(const float* probs, const double* lse_squared, long long n, long long e_count,
                                     double* partial) {
  const long long chunk = blockIdx.x, first = chunk * kStatsChunk;
  const long long last = first + kStatsChunk < n ? first + kStatsChunk : n;
  for (long long e = threadIdx.x; e <= e_count; e += blockDim.x) {
    double sum = 0;
    for (long long t = first; t < last; ++t) sum += e < e_count ? double(probs[t * e_count + e]) : lse_squared[t];
    partial[chunk * (e_count + 1) + e] = sum;
  }
}

// stats[e] = the chunks' partial sums in chunk order.
__global__ void router_stats_total(const double* partial, long long chunks, long long e_count, float* stats) {
  for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e <= e_count;
       e += (long long)gridDim.x * blockDim.x) {
    double sum = 0;
    for (long long c = 0; c < chunks; ++c) sum += partial[c * (e_count + 1) + e];
    stats[e] = float(sum);
  }
}

// Sum over the block in float64, every thread gets it (warp shuffles, then the warps in order).
__device__ double block_sum(double v, double* shared) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = (blockDim.x + 31) / 32;
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  double total = shared[0];
  for (unsigned w = 1; w < warps; ++w) total += shared[w];
  return total;
}

// One block per token: dp[e] (dynamic shared, float64) = aux_grad[e] + the gates' terms, then through the scoring
// and the z-loss into dlogits (+=), in ops::cpu's order of float64 operations.
__global__ void router_backward_tokens(const float* logits, const float* probs, const float* lse, long long n,
                                       long long e_count, bool sigmoid, bool normalize, float scale,
                                       const std::int64_t* offsets, const std::int64_t* experts, const float* dgates,
                                       const float* aux_grad, float z_grad, float* dlogits) {
  extern __shared__ double dp[];
  __shared__ double shared[32];
  for (long long t = blockIdx.x; t < n; t += gridDim.x) {
    const float* l = logits + t * e_count;
    const float* p = probs + t * e_count;
    float* dl = dlogits + t * e_count;
    for (long long e = threadIdx.x; e < e_count; e += blockDim.x) dp[e] = aux_grad[e];
    __syncthreads();
    if (threadIdx.x == 0) {
      const long long begin = offsets[t], k = offsets[t + 1] - begin;
      if (normalize && k > 0) {
        double selected = 0, weighted = 0;
        for (long long j = 0; j < k; ++j) selected += p[experts[begin + j]];
        for (long long j = 0; j < k; ++j) weighted += double(dgates[begin + j]) * p[experts[begin + j]];
        if (selected > 0)
          for (long long j = 0; j < k; ++j)
            dp[experts[begin + j]] += double(scale) / selected * (dgates[begin + j] - weighted / selected);
      } else {
        for (long long j = 0; j < k; ++j) dp[experts[begin + j]] += double(scale) * dgates[begin + j];
      }
    }
    __syncthreads();
    if (!sigmoid) {
      double dot = 0;
      for (long long e = threadIdx.x; e < e_count; e += blockDim.x) dot += dp[e] * p[e];
      dot = block_sum(dot, shared);
      for (long long e = threadIdx.x; e < e_count; e += blockDim.x) dl[e] += float(p[e] * (dp[e] - dot));
    } else {
      for (long long e = threadIdx.x; e < e_count; e += blockDim.x) dl[e] += float(dp[e] * p[e] * (1.0 - p[e]));
    }
    if (z_grad != 0) {
      const double z = lse[t];
      for (long long e = threadIdx.x; e < e_count; e += blockDim.x)
        dl[e] += float(2.0 * double(z_grad) * z * exp(double(l[e]) - z));
    }
    __syncthreads();  // dp is rewritten for the next token
  }
}

// to[i, :] = scale[i] * from[rows[i], :] (rows null: identity; scale null: 1), over m x h elements.
__global__ void gather_rows_elements(const float* from, const std::int64_t* rows, const float* scale, float* to,
                                     long long m, long long h) {
  for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < m * h;
       idx += (long long)gridDim.x * blockDim.x) {
    const long long i = idx / h, c = idx % h;
    const float v = from[(rows ? rows[i] : i) * h + c];
    to[idx] = scale ? scale[i] * v : v;
  }
}

// For every destination row d of `destinations` (count of them) and column c: to[dest, c] += scale[i] * from[i, c]
// over its sources i = sources[starts[d] .. starts[d+1]) in that (increasing) order. destinations null: the
// identity (destination d has the one source d). No two threads write one element: deterministic.
__global__ void scatter_add_rows_elements(float* to, const std::int64_t* destinations, const std::int64_t* starts,
                                          const std::int64_t* sources, const float* from, const float* scale,
                                          long long count, long long h) {
  for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < count * h;
       idx += (long long)gridDim.x * blockDim.x) {
    const long long d = idx / h, c = idx % h;
    const long long destination = destinations ? destinations[d] : d;
    const long long first = destinations ? starts[d] : d, last = destinations ? starts[d + 1] : d + 1;
    float* out = to + destination * h + c;
    float acc = *out;
    for (long long s = first; s < last; ++s) {
      const long long i = destinations ? sources[s] : s;
      // separate rounding of the product and the sum, as ops::cpu's dst += s * src (no fused multiply-add)
      acc = __fadd_rn(acc, __fmul_rn(scale ? scale[i] : 1.0f, from[i * h + c]));
    }
    *out = acc;
  }
}

// out[i] = dot(a[rows[i]], b[i]) in float64: one warp per output row.
__global__ void gathered_row_dot_warps(const float* a, const std::int64_t* rows, const float* b, float* out,
                                       long long m, long long h) {
  const long long warps_per_block = blockDim.x / 32, lane = threadIdx.x % 32;
  for (long long i = blockIdx.x * warps_per_block + threadIdx.x / 32; i < m; i += (long long)gridDim.x * warps_per_block) {
    const float* x = a + (rows ? rows[i] : i) * h;
    const float* y = b + i * h;
    double dot = 0;
    for (long long c = lane; c < h; c += 32) dot += double(x[c]) * y[c];
    for (int offset = 16; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
    if (lane == 0) out[i] = float(dot);
  }
}

__global__ void sigmoid_forward_elements(const float* x, float* y, long long count) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < count; i += (long long)gridDim.x * blockDim.x)
    y[i] = float(1.0 / (1.0 + exp(-double(x[i]))));
}

__global__ void sigmoid_backward_elements(const float* y, const float* dy, float* dx, long long count) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < count;
       i += (long long)gridDim.x * blockDim.x) {
    const float s = y[i];
    dx[i] = __fadd_rn(dx[i], __fmul_rn(__fmul_rn(dy[i], s), 1.0f - s));  // dx += dy * s * (1 - s), as ops::cpu
  }
}

}  // namespace paradyse::kernels::moe_kernels

namespace paradyse::ops::cuda {

void router_forward(TensorView<const float> logits, RouterScoring scoring, bool normalize, float scale,
                    std::span<const std::int64_t> offsets, TensorView<float> probs, TensorView<float> lse,
                    std::span<std::int64_t> experts, TensorView<float> gates, TensorView<float> stats) {
  constexpr const char* op = "router_forward";
  cpu::moe_detail::check_matrix(op, "logits", logits);
  cpu::moe_detail::check_matrix(op, "probs", probs);
  check(probs.shape() == logits.shape(), "{}: probs {} must match logits {}", op, probs.shape(), logits.shape());
  const std::int64_t n = logits.extent(0), e_count = logits.extent(1);
  cpu::moe_detail::check_vector(op, "lse", lse, n);
  cpu::moe_detail::check_offsets(op, offsets, n, e_count);
  const std::int64_t assignments = offsets[std::size_t(n)];
  check(std::int64_t(experts.size()) == assignments, "{}: experts holds {} entries, expected {}", op, experts.size(),
        assignments);
  cpu::moe_detail::check_vector(op, "gates", gates, assignments);
  cpu::moe_detail::check_vector(op, "stats", stats, e_count + 1);
  using namespace kernels::moe_kernels;
  const cudaStream_t stream = device::current_stream();
  const kernels::StreamScratch device_offsets = kernels::upload(offsets, stream);
  const kernels::StreamScratch device_experts(std::size_t(assignments) * sizeof(std::int64_t), stream);
  const kernels::StreamScratch lse_squared(std::size_t(n) * sizeof(double), stream);
  const kernels::StreamScratch bad_logit(sizeof(unsigned long long), stream);
  PARADYSE_CUDA_CHECK(cudaMemsetAsync(bad_logit.as<void>(), 0xff, sizeof(unsigned long long), stream));
  if (n > 0) {
    router_forward_tokens<<<kernels::grid_for(n, 128), 128, 0, stream>>>(
        logits.data(), n, e_count, scoring == RouterScoring::sigmoid, normalize, scale,
        device_offsets.as<std::int64_t>(), probs.data(), lse.data(), lse_squared.as<double>(),
        device_experts.as<std::int64_t>(), gates.data(), bad_logit.as<unsigned long long>());
    device::check_launch("router_forward_tokens");
  }
  const long long chunks = (n + kStatsChunk - 1) / kStatsChunk;
  const kernels::StreamScratch partial(std::size_t(chunks * (e_count + 1)) * sizeof(double), stream);
  if (chunks > 0) {
    router_stats_partial<<<unsigned(chunks), 128, 0, stream>>>(probs.data(), lse_squared.as<double>(), n, e_count,
                                                               partial.as<double>());
    device::check_launch("router_stats_partial");
  }
  router_stats_total<<<kernels::grid_for(e_count + 1, 128), 128, 0, stream>>>(partial.as<double>(), chunks, e_count,
                                                                               stats.data());
  device::check_launch("router_stats_total");
  unsigned long long bad = kNoBadLogit;
  PARADYSE_CUDA_CHECK(
      cudaMemcpyAsync(&bad, bad_logit.as<void>(), sizeof bad, cudaMemcpyDeviceToHost, stream));
  device::synchronize();
  if (bad != kNoBadLogit) {
    const std::int64_t t = std::int64_t(bad) / e_count, e = std::int64_t(bad) % e_count;
    float value = 0;
    PARADYSE_CUDA_CHECK(cudaMemcpy(&value, logits.data() + bad, sizeof value, cudaMemcpyDeviceToHost));
    check(false, "{}: logit [{}, {}] = {} is not finite", op, t, e, value);
  }
  if (assignments > 0) {
    PARADYSE_CUDA_CHECK(cudaMemcpyAsync(experts.data(), device_experts.as<void>(), experts.size_bytes(),
                                        cudaMemcpyDeviceToHost, stream));
    device::synchronize();
  }
}

void router_backward(TensorView<const float> logits, TensorView<const float> probs, TensorView<const float> lse,
                     RouterScoring scoring, bool normalize, float scale, std::span<const std::int64_t> offsets,
                     std::span<const std::int64_t> experts, TensorView<const float> dgates,
                     TensorView<const float> aux_grad, float z_grad, TensorView<float> dlogits) {
  constexpr const char* op = "router_backward";
  cpu::moe_detail::check_matrix(op, "logits", logits);
  cpu::moe_detail::check_matrix(op, "probs", probs);
  cpu::moe_detail::check_matrix(op, "dlogits", dlogits);
  check(probs.shape() == logits.shape() && dlogits.shape() == logits.shape(),
        "{}: probs {} and dlogits {} must match logits {}", op, probs.shape(), dlogits.shape(), logits.shape());
  const std::int64_t n = logits.extent(0), e_count = logits.extent(1);
  cpu::moe_detail::check_vector(op, "lse", lse, n);
  cpu::moe_detail::check_offsets(op, offsets, n, e_count);
  const std::int64_t assignments = offsets[std::size_t(n)];
  check(std::int64_t(experts.size()) == assignments, "{}: experts holds {} entries, expected {}", op, experts.size(),
        assignments);
  cpu::moe_detail::check_vector(op, "dgates", dgates, assignments);
  cpu::moe_detail::check_vector(op, "aux_grad", aux_grad, e_count);
  // The device indexes by these experts: out of range they would write outside its shared memory.
  for (std::size_t a = 0; a < experts.size(); ++a)
    check(experts[a] >= 0 && experts[a] < e_count, "{}: expert {} (entry {}) is outside [0, {})", op, experts[a], a,
          e_count);
  constexpr std::int64_t max_experts = 48 * 1024 / sizeof(double) - 32;  // dp[E] in shared memory beside 32 doubles
  check(e_count <= max_experts, "{}: the CUDA router backward supports up to {} experts; got {}", op, max_experts,
        e_count);
  if (n == 0) return;
  using namespace kernels::moe_kernels;
  const cudaStream_t stream = device::current_stream();
  const kernels::StreamScratch device_offsets = kernels::upload(offsets, stream);
  const kernels::StreamScratch device_experts = kernels::upload(experts, stream);
  router_backward_tokens<<<kernels::grid_for(n, 1), 128, std::size_t(e_count) * sizeof(double), stream>>>(
      logits.data(), probs.data(), lse.data(), n, e_count, scoring == RouterScoring::sigmoid, normalize, scale,
      device_offsets.as<std::int64_t>(), device_experts.as<std::int64_t>(), dgates.data(), aux_grad.data(), z_grad,
      dlogits.data());
  device::check_launch("router_backward_tokens");
}

void gather_rows(TensorView<const float> from, std::span<const std::int64_t> rows, TensorView<const float> scale,
                 TensorView<float> to) {
  constexpr const char* op = "gather_rows";
  cpu::moe_detail::check_matrix(op, "from", from);
  cpu::moe_detail::check_matrix(op, "to", to);
  check(from.extent(1) == to.extent(1), "{}: from {} and to {} differ in width", op, from.shape(), to.shape());
  const std::int64_t m = to.extent(0), h = to.extent(1);
  cpu::moe_detail::check_rows_index(op, rows, m, from.extent(0));
  if (scale.rank() > 0) cpu::moe_detail::check_vector(op, "scale", scale, m);
  if (m * h == 0) return;
  using namespace kernels::moe_kernels;
  const cudaStream_t stream = device::current_stream();
  const kernels::StreamScratch device_rows = kernels::upload(rows, stream);
  gather_rows_elements<<<kernels::grid_for(m * h, kThreads), kThreads, 0, stream>>>(
      from.data(), device_rows.as<std::int64_t>(), scale.rank() > 0 ? scale.data() : nullptr, to.data(), m, h);
  device::check_launch("gather_rows_elements");
}

void scatter_add_rows(TensorView<float> to, std::span<const std::int64_t> rows, TensorView<const float> from,
                      TensorView<const float> scale) {
  constexpr const char* op = "scatter_add_rows";
  cpu::moe_detail::check_matrix(op, "to", to);
  cpu::moe_detail::check_matrix(op, "from", from);
  check(from.extent(1) == to.extent(1), "{}: from {} and to {} differ in width", op, from.shape(), to.shape());
  const std::int64_t m = from.extent(0), h = from.extent(1);
  cpu::moe_detail::check_rows_index(op, rows, m, to.extent(0));
  if (scale.rank() > 0) cpu::moe_detail::check_vector(op, "scale", scale, m);
  if (m * h == 0) return;
  using namespace kernels::moe_kernels;
  const cudaStream_t stream = device::current_stream();
  const float* scale_data = scale.rank() > 0 ? scale.data() : nullptr;
  if (rows.empty()) {  // identity: one source per destination
    scatter_add_rows_elements<<<kernels::grid_for(m * h, kThreads), kThreads, 0, stream>>>(
        to.data(), nullptr, nullptr, nullptr, from.data(), scale_data, m, h);
    device::check_launch("scatter_add_rows_elements");
    return;
  }
  // Group the sources by destination row on the host (a stable counting sort: each row keeps its sources in
  // increasing order), as one list [destinations (u) | starts (u + 1) | sources (m)].
  const std::int64_t n = to.extent(0);
  std::vector<std::int64_t> per_row(std::size_t(n) + 1, 0);
  for (const std::int64_t r : rows) ++per_row[std::size_t(r) + 1];
  std::int64_t used = 0;
  for (std::int64_t r = 0; r < n; ++r) used += per_row[std::size_t(r) + 1] > 0;
  std::vector<std::int64_t> lists(std::size_t(used + (used + 1) + m));
  std::int64_t* destinations = lists.data();
  std::int64_t* starts = destinations + used;
  std::int64_t* sources = starts + used + 1;
  std::int64_t u = 0;
  for (std::int64_t r = 0; r < n; ++r) {
    const std::int64_t count = per_row[std::size_t(r) + 1];
    per_row[std::size_t(r) + 1] += per_row[std::size_t(r)];  // now the first source slot of row r + 1
    if (count > 0) {
      destinations[u] = r;
      starts[u] = per_row[std::size_t(r)];
      ++u;
    }
  }
  starts[used] = m;
  for (std::int64_t i = 0; i < m; ++i) sources[per_row[std::size_t(rows[std::size_t(i)])]++] = i;
  const kernels::StreamScratch device_lists = kernels::upload(std::span<const std::int64_t>(lists), stream);
  const std::int64_t* base = device_lists.as<std::int64_t>();
  scatter_add_rows_elements<<<kernels::grid_for(used * h, kThreads), kThreads, 0, stream>>>(
      to.data(), base, base + used, base + 2 * used + 1, from.data(), scale_data, used, h);
  device::check_launch("scatter_add_rows_elements");
}

void gathered_row_dot(TensorView<const float> a, std::span<const std::int64_t> rows, TensorView<const float> b,
                      TensorView<float> out) {
  constexpr const char* op = "gathered_row_dot";
  cpu::moe_detail::check_matrix(op, "a", a);
  cpu::moe_detail::check_matrix(op, "b", b);
  check(a.extent(1) == b.extent(1), "{}: a {} and b {} differ in width", op, a.shape(), b.shape());
  const std::int64_t m = b.extent(0), h = b.extent(1);
  cpu::moe_detail::check_rows_index(op, rows, m, a.extent(0));
  cpu::moe_detail::check_vector(op, "out", out, m);
  if (m == 0) return;
  using namespace kernels::moe_kernels;
  const cudaStream_t stream = device::current_stream();
  const kernels::StreamScratch device_rows = kernels::upload(rows, stream);
  gathered_row_dot_warps<<<kernels::grid_for(m, kThreads / 32), kThreads, 0, stream>>>(
      a.data(), device_rows.as<std::int64_t>(), b.data(), out.data(), m, h);
  device::check_launch("gathered_row_dot_warps");
}

void sigmoid_forward(TensorView<const float> x, TensorView<float> y) {
  check(x.is_contiguous() && y.is_contiguous() && x.numel() == y.numel(),
        "sigmoid_forward: x {} and y {} must be contiguous with equal element counts", x.shape(), y.shape());
  const std::int64_t count = x.numel();
  if (count == 0) return;
  using namespace kernels::moe_kernels;
  const cudaStream_t stream = device::current_stream();
  sigmoid_forward_elements<<<kernels::grid_for(count, kThreads), kThreads, 0, stream>>>(x.data(), y.data(), count);
  device::check_launch("sigmoid_forward_elements");
}

void sigmoid_backward(TensorView<const float> y, TensorView<const float> dy, TensorView<float> dx) {
  check(y.is_contiguous() && dy.is_contiguous() && dx.is_contiguous() && y.numel() == dy.numel() &&
            y.numel() == dx.numel(),
        "sigmoid_backward: y {}, dy {} and dx {} must be contiguous with equal element counts", y.shape(), dy.shape(),
        dx.shape());
  const std::int64_t count = y.numel();
  if (count == 0) return;
  using namespace kernels::moe_kernels;
  const cudaStream_t stream = device::current_stream();
  sigmoid_backward_elements<<<kernels::grid_for(count, kThreads), kThreads, 0, stream>>>(y.data(), dy.data(),
                                                                                         dx.data(), count);
  device::check_launch("sigmoid_backward_elements");
}

}  // namespace paradyse::ops::cuda
