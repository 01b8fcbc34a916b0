// kernels/attention_forward.cuh: the float32 flash-attention forward and the merge of partial results on the
// GPU (the general path: every shape and mask), and the launchers of ops/cuda/attention.hpp for them. The bf16
// tensor-core kernels are in attention_tensor_core.cuh.
//
// Forward (FlashAttention-2 order): one block per (query tile of 16 rows, query head, batch); each of its 4 warps
// owns 4 query rows. The block walks the key tiles (32 keys) that its queries can see, staged in shared memory; a
// lane computes the score of one key for the warp's 4 rows, the warp reduces max and sum (online softmax), and each
// lane accumulates output columns c = lane, lane + 32, ... in shared memory. Arithmetic is fp32 throughout.
#pragma once

#include "attention_common.cuh"

#include <algorithm>

namespace paradyse::kernels::attention {

namespace f32 {

constexpr int kWarps = 4;
constexpr int kRowsPerWarp = 4;
constexpr int kQueryTile = kWarps * kRowsPerWarp;  // 16
constexpr int kKeyTile = 32;                       // one key per lane
constexpr int kThreads = kWarps * 32;

// Shared memory of the forward block, in floats: q [16][d], acc [16][d], k [32][d+1] (padded: lane = key reads its
// own row without bank conflicts), v [32][d], p [16][32].
inline std::size_t forward_shared_bytes(int d) {
  return sizeof(float) * (std::size_t(2 * kQueryTile) * d + std::size_t(kKeyTile) * (d + 1) +
                          std::size_t(kKeyTile) * d + kQueryTile * kKeyTile);
}

// grid: (query tiles, q heads, batch), block: 128 threads.
__global__ void __launch_bounds__(kThreads)
    forward_kernel(HeadView<const float> q, HeadView<const float> k, HeadView<const float> v, HeadView<float> out,
                   LseView<float> lse, DeviceMask mask, int d, int group, float scale) {
  extern __shared__ float smem[];
  const int ld_k = d + 1;
  float* q_s = smem;
  float* acc = q_s + kQueryTile * d;
  float* k_s = acc + kQueryTile * d;
  float* v_s = k_s + kKeyTile * ld_k;
  float* p_s = v_s + kKeyTile * d;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const Index b = blockIdx.z, h = blockIdx.y, kvh = h / group;
  const Index i0 = Index(blockIdx.x) * kQueryTile;
  const int rows = int(min(Index(kQueryTile), mask.q_len - i0));

  for (int idx = tid; idx < kQueryTile * d; idx += kThreads) {
    const int r = idx / d, c = idx % d;
    q_s[idx] = r < rows ? q.row(b, i0 + r, h)[c] : 0.0f;
    acc[idx] = 0.0f;
  }
  Index first[kRowsPerWarp], last[kRowsPerWarp];
  float m[kRowsPerWarp], l[kRowsPerWarp];
  for (int t = 0; t < kRowsPerWarp; ++t) {
    const int r = warp * kRowsPerWarp + t;
    first[t] = last[t] = 0;
    if (r < rows) mask.key_range(i0 + r, first[t], last[t]);
    m[t] = kNegInf;
    l[t] = 0.0f;
  }
  Index keys_first, keys_last;
  mask.tile_key_range(i0, i0 + rows, keys_first, keys_last);

  for (Index j0 = keys_first / kKeyTile * kKeyTile; j0 < keys_last; j0 += kKeyTile) {
    __syncthreads();  // the previous tile is consumed (and q_s, acc are written before the first)
    for (int idx = tid; idx < kKeyTile * d; idx += kThreads) {
      const int r = idx / d, c = idx % d;
      const Index j = j0 + r;
      const bool valid = j < mask.kv_len;
      k_s[r * ld_k + c] = valid ? k.row(b, j, kvh)[c] : 0.0f;
      v_s[r * d + c] = valid ? v.row(b, j, kvh)[c] : 0.0f;
    }
    __syncthreads();

    // Scores of key j0 + lane for the warp's rows.
    float s[kRowsPerWarp] = {};
    for (int c = 0; c < d; ++c) {
      const float kc = k_s[lane * ld_k + c];
      for (int t = 0; t < kRowsPerWarp; ++t) s[t] += q_s[(warp * kRowsPerWarp + t) * d + c] * kc;
    }
    const Index j = j0 + lane;
    float corr[kRowsPerWarp];
    for (int t = 0; t < kRowsPerWarp; ++t) {
      const bool visible = j >= first[t] && j < last[t];
      const float score = visible ? s[t] * scale : kNegInf;
      const float m_new = fmaxf(m[t], warp_max(score));
      float p = 0.0f;
      corr[t] = 1.0f;
      if (m_new != kNegInf) {
        p = visible ? expf(score - m_new) : 0.0f;
        corr[t] = expf(m[t] - m_new);  // m = -inf: 0 (acc and l are 0 anyway)
      }
      l[t] = l[t] * corr[t] + warp_sum(p);
      m[t] = m_new;
      p_s[(warp * kRowsPerWarp + t) * kKeyTile + lane] = p;
    }
    __syncwarp();
    for (int c = lane; c < d; c += 32) {
      float a[kRowsPerWarp];
      for (int t = 0; t < kRowsPerWarp; ++t) a[t] = acc[(warp * kRowsPerWarp + t) * d + c] * corr[t];
      for (int jj = 0; jj < kKeyTile; ++jj) {
        const float vc = v_s[jj * d + c];
        for (int t = 0; t < kRowsPerWarp; ++t) a[t] += p_s[(warp * kRowsPerWarp + t) * kKeyTile + jj] * vc;
      }
      for (int t = 0; t < kRowsPerWarp; ++t) acc[(warp * kRowsPerWarp + t) * d + c] = a[t];
    }
    __syncwarp();
  }

  for (int t = 0; t < kRowsPerWarp; ++t) {
    const int r = warp * kRowsPerWarp + t;
    if (r >= rows) continue;
    float* out_row = out.row(b, i0 + r, h);
    const float inv = l[t] > 0.0f ? 1.0f / l[t] : 0.0f;
    for (int c = lane; c < d; c += 32) out_row[c] = l[t] > 0.0f ? acc[r * d + c] * inv : 0.0f;
    if (lane == 0) lse.at(b, h, i0 + r) = l[t] > 0.0f ? m[t] + logf(l[t]) : kNegInf;
  }
}

// Element (b, i, h, c) with any strides (merge accepts what the CPU merge accepts).
struct OutView {
  float* data;
  Index sb, ss, sh, sc;
  __device__ float& at(Index b, Index i, Index h, Index c) const { return data[b * sb + i * ss + h * sh + c * sc]; }
};

// One warp per (b, i, h) row: out, lse := merge of (out, lse) and (block_out, block_lse).
__global__ void merge_kernel(OutView out, LseView<float> lse, OutView block_out, LseView<const float> block_lse,
                             Index batch, Index q_len, Index heads, int d) {
  const Index row = (Index(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (row >= batch * q_len * heads) return;
  const Index h = row % heads, i = (row / heads) % q_len, b = row / (heads * q_len);
  const float mine = lse.at(b, h, i), theirs = block_lse.at(b, h, i);
  const float top = fmaxf(mine, theirs);
  if (top == kNegInf) return;  // neither side saw a key: out stays 0, lse -inf
  const float w_mine = expf(mine - top), w_theirs = expf(theirs - top);
  const float total = w_mine + w_theirs;
  const float wa = w_mine / total, wb = w_theirs / total;
  for (int c = lane; c < d; c += 32) {
    float& o = out.at(b, i, h, c);
    // A side with weight 0 may hold anything finite; skip it so that 0 * garbage cannot leak in.
    o = (wa == 0.0f ? 0.0f : wa * o) + (wb == 0.0f ? 0.0f : wb * block_out.at(b, i, h, c));
  }
  __syncwarp();
  if (lane == 0) lse.at(b, h, i) = top + logf(total);
}

}  // namespace f32

}  // namespace paradyse::kernels::attention

namespace paradyse::ops::cuda {

void attention_forward(TensorView<const float> q, TensorView<const float> k, TensorView<const float> v,
                       const AttentionMask& mask, TensorView<float> out, TensorView<float> lse) {
  namespace ka = kernels::attention;
  constexpr const char* op = "attention_forward";
  const cpu::detail::AttentionDims dims = cpu::detail::check_attention_inputs(op, q, k, v, mask);
  cpu::detail::check_same(op, "out", out.shape(), q.shape());
  cpu::detail::check_same(op, "lse", lse.shape(), Shape{dims.batch, dims.q_heads, dims.q_len});
  check(cpu::detail::unit_last_stride(out), "{}: out's head dimension must have unit stride; strides are {}", op,
        out.strides());
  if (dims.batch == 0 || dims.q_len == 0 || dims.q_heads == 0) return;
  ka::check_grid(op, dims.q_heads, dims.batch);
  const int d = int(dims.head_dim);
  const std::size_t shared = ka::f32::forward_shared_bytes(d);
  ka::allow_shared_memory(ka::f32::forward_kernel, shared, "attention_forward (float32)");
  const ka::UploadedMask uploaded(mask, dims.q_len, dims.kv_len);
  const dim3 grid(unsigned((dims.q_len + ka::f32::kQueryTile - 1) / ka::f32::kQueryTile), unsigned(dims.q_heads),
                  unsigned(dims.batch));
  ka::f32::forward_kernel<<<grid, ka::f32::kThreads, shared, device::current_stream()>>>(
      ka::head_view<const float>(q), ka::head_view<const float>(k), ka::head_view<const float>(v),
      ka::head_view<float>(out), ka::lse_view<float>(lse), uploaded.device(), d, int(dims.group()),
      attention_scale(mask, d));
  device::check_launch("attention f32::forward_kernel");
}

void attention_merge(TensorView<float> out, TensorView<float> lse, TensorView<const float> block_out,
                     TensorView<const float> block_lse) {
  namespace ka = kernels::attention;
  constexpr const char* op = "attention_merge";
  check(out.rank() == 4, "{}: out must be [b, sq, hq, d]; got {}", op, out.shape());
  cpu::detail::check_same(op, "block_out", block_out.shape(), out.shape());
  const Shape lse_shape{out.extent(0), out.extent(2), out.extent(1)};
  cpu::detail::check_same(op, "lse", lse.shape(), lse_shape);
  cpu::detail::check_same(op, "block_lse", block_lse.shape(), lse_shape);
  const std::int64_t rows = out.extent(0) * out.extent(1) * out.extent(2);
  if (rows == 0) return;
  const auto view = [](auto x) {
    return ka::f32::OutView{const_cast<float*>(x.data()), x.strides()[0], x.strides()[1], x.strides()[2],
                            x.strides()[3]};
  };
  constexpr int threads = 256;
  const std::int64_t blocks = (rows * 32 + threads - 1) / threads;
  ka::f32::merge_kernel<<<unsigned(blocks), threads, 0, device::current_stream()>>>(
      view(out), ka::lse_view<float>(lse), view(block_out), ka::lse_view<const float>(block_lse), out.extent(0),
      out.extent(1), out.extent(2), int(out.extent(3)));
  device::check_launch("attention f32::merge_kernel");
}

}  // namespace paradyse::ops::cuda
