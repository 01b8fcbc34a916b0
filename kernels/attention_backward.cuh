// kernels/attention_backward.cuh: the float32 flash-attention backward on the GPU (the general path: every
// shape and mask) and its launcher.
//
// Three kernels, each writing only what it owns (no atomics, deterministic):
//   1. delta[b, h, i] = dout_i . out_i (the softmax backward's row term), one warp per row;
//   2. dk, dv: one block per (key tile of 32, kv head, batch); it walks the query heads of its GQA group and the
//      query tiles that see its keys, recomputes p = exp(scale q.k - lse) and ds = p (dout.v - delta), and
//      accumulates dv_j += sum_i p_ij dout_i, dk_j += scale sum_i ds_ij q_i in shared memory (lane = query);
//   3. dq: one block per (query tile of 16, q head, batch) walking its visible key tiles (lane = key, as forward),
//      dq_i += scale sum_j ds_ij k_j.
// Each result is added once to the caller's gradient (+=, the Backend contract).
#pragma once

#include "attention_common.cuh"
#include "attention_forward.cuh"

namespace paradyse::kernels::attention {

namespace f32 {

// delta[(b * heads + h) * q_len + i] = sum_c dout(b, i, h, c) * out(b, i, h, c); one warp per row.
template <class T>
__global__ void delta_kernel(HeadView<const T> out, HeadView<const T> dout, float* delta, Index batch, Index q_len,
                             Index heads, int d) {
  const Index row = (Index(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (row >= batch * q_len * heads) return;
  const Index i = row % q_len, h = (row / q_len) % heads, b = row / (q_len * heads);
  const T* o = out.row(b, i, h);
  const T* g = dout.row(b, i, h);
  float sum = 0.0f;
  for (int c = lane; c < d; c += 32) sum += float(o[c]) * float(g[c]);
  sum = warp_sum(sum);
  if (lane == 0) delta[row] = sum;
}

constexpr int kKeysPerWarp = kKeyTile / kWarps;  // 8
constexpr int kBackwardQueryTile = 32;           // one query per lane in the dk/dv kernel

// Shared memory of the dk/dv block in bytes: k, v, dk, dv [32][d]; q, dout [32][d+1]; p, ds [4][32]; lse, delta
// [32]; key ranges [32][2] (64-bit).
inline std::size_t dkdv_shared_bytes(int d) {
  return sizeof(float) * (std::size_t(4 * kKeyTile) * d + std::size_t(2 * kBackwardQueryTile) * (d + 1) +
                          2 * kWarps * 32 + 2 * kBackwardQueryTile) +
         sizeof(Index) * 2 * kBackwardQueryTile;
}

// grid: (key tiles, kv heads, batch), block: 128 threads.
__global__ void __launch_bounds__(kThreads)
    dkdv_kernel(HeadView<const float> q, HeadView<const float> k, HeadView<const float> v,
                HeadView<const float> dout, LseView<const float> lse, const float* delta, HeadView<float> dk,
                HeadView<float> dv, DeviceMask mask, int d, int group, Index q_heads, float scale) {
  extern __shared__ float smem[];
  const int ld = d + 1;
  Index* first_s = reinterpret_cast<Index*>(smem);
  Index* last_s = first_s + kBackwardQueryTile;
  float* k_s = reinterpret_cast<float*>(last_s + kBackwardQueryTile);
  float* v_s = k_s + kKeyTile * d;
  float* dk_s = v_s + kKeyTile * d;
  float* dv_s = dk_s + kKeyTile * d;
  float* q_s = dv_s + kKeyTile * d;
  float* do_s = q_s + kBackwardQueryTile * ld;
  float* p_s = do_s + kBackwardQueryTile * ld;
  float* ds_s = p_s + kWarps * 32;
  float* lse_s = ds_s + kWarps * 32;
  float* delta_s = lse_s + kBackwardQueryTile;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const Index b = blockIdx.z, kvh = blockIdx.y;
  const Index j0 = Index(blockIdx.x) * kKeyTile;
  const int cols = int(min(Index(kKeyTile), mask.kv_len - j0));
  for (int idx = tid; idx < kKeyTile * d; idx += kThreads) {
    const int r = idx / d, c = idx % d;
    k_s[idx] = r < cols ? k.row(b, j0 + r, kvh)[c] : 0.0f;
    v_s[idx] = r < cols ? v.row(b, j0 + r, kvh)[c] : 0.0f;
    dk_s[idx] = dv_s[idx] = 0.0f;
  }
  Index q_lo, q_hi;
  mask.query_range(j0, j0 + cols, q_lo, q_hi);

  for (int g = 0; g < group; ++g) {
    const Index h = kvh * group + g;
    for (Index i0 = q_lo; i0 < q_hi; i0 += kBackwardQueryTile) {
      __syncthreads();  // the previous query tile is consumed
      const int rows = int(min(Index(kBackwardQueryTile), q_hi - i0));
      for (int idx = tid; idx < kBackwardQueryTile * d; idx += kThreads) {
        const int r = idx / d, c = idx % d;
        q_s[r * ld + c] = r < rows ? q.row(b, i0 + r, h)[c] : 0.0f;
        do_s[r * ld + c] = r < rows ? dout.row(b, i0 + r, h)[c] : 0.0f;
      }
      if (tid < kBackwardQueryTile) {
        Index f = 0, l = 0;
        float row_lse = kNegInf, row_delta = 0.0f;
        if (tid < rows) {
          mask.key_range(i0 + tid, f, l);
          row_lse = lse.at(b, h, i0 + tid);
          row_delta = delta[(b * q_heads + h) * mask.q_len + i0 + tid];
        }
        if (row_lse == kNegInf) l = f;  // no probability mass (cannot happen for a visible key of a final lse)
        first_s[tid] = f;
        last_s[tid] = l;
        lse_s[tid] = row_lse;
        delta_s[tid] = row_delta;
      }
      __syncthreads();
      for (int kk = 0; kk < kKeysPerWarp; ++kk) {
        const int jl = warp * kKeysPerWarp + kk;
        if (jl >= cols) break;  // uniform in the warp
        const Index j = j0 + jl;
        float s = 0.0f, dp = 0.0f;
        for (int c = 0; c < d; ++c) {
          s += q_s[lane * ld + c] * k_s[jl * d + c];
          dp += do_s[lane * ld + c] * v_s[jl * d + c];
        }
        const bool visible = j >= first_s[lane] && j < last_s[lane];
        const float p = visible ? expf(s * scale - lse_s[lane]) : 0.0f;
        p_s[warp * 32 + lane] = p;
        ds_s[warp * 32 + lane] = p * (dp - delta_s[lane]);
        __syncwarp();
        for (int c = lane; c < d; c += 32) {
          float dv_sum = 0.0f, dk_sum = 0.0f;
          for (int r = 0; r < kBackwardQueryTile; ++r) {
            dv_sum += p_s[warp * 32 + r] * do_s[r * ld + c];
            dk_sum += ds_s[warp * 32 + r] * q_s[r * ld + c];
          }
          dv_s[jl * d + c] += dv_sum;
          dk_s[jl * d + c] += scale * dk_sum;
        }
        __syncwarp();
      }
    }
  }
  __syncthreads();
  for (int idx = tid; idx < cols * d; idx += kThreads) {
    const int r = idx / d, c = idx % d;
    dk.row(b, j0 + r, kvh)[c] += dk_s[idx];
    dv.row(b, j0 + r, kvh)[c] += dv_s[idx];
  }
}

// Shared memory of the dq block, in floats: q, dout, dq [16][d]; k, v [32][d+1]; ds [16][32].
inline std::size_t dq_shared_bytes(int d) {
  return sizeof(float) * (std::size_t(3 * kQueryTile) * d + std::size_t(2 * kKeyTile) * (d + 1) +
                          kQueryTile * kKeyTile);
}

// grid: (query tiles, q heads, batch), block: 128 threads; warp w owns rows 4w..4w+3, lane = key of the tile.
__global__ void __launch_bounds__(kThreads)
    dq_kernel(HeadView<const float> q, HeadView<const float> k, HeadView<const float> v, HeadView<const float> dout,
              LseView<const float> lse, const float* delta, HeadView<float> dq, DeviceMask mask, int d, int group,
              Index q_heads, float scale) {
  extern __shared__ float smem[];
  const int ld = d + 1;
  float* q_s = smem;
  float* do_s = q_s + kQueryTile * d;
  float* dq_s = do_s + kQueryTile * d;
  float* k_s = dq_s + kQueryTile * d;
  float* v_s = k_s + kKeyTile * ld;
  float* ds_s = v_s + kKeyTile * ld;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const Index b = blockIdx.z, h = blockIdx.y, kvh = h / group;
  const Index i0 = Index(blockIdx.x) * kQueryTile;
  const int rows = int(min(Index(kQueryTile), mask.q_len - i0));
  for (int idx = tid; idx < kQueryTile * d; idx += kThreads) {
    const int r = idx / d, c = idx % d;
    q_s[idx] = r < rows ? q.row(b, i0 + r, h)[c] : 0.0f;
    do_s[idx] = r < rows ? dout.row(b, i0 + r, h)[c] : 0.0f;
    dq_s[idx] = 0.0f;
  }
  Index first[kRowsPerWarp], last[kRowsPerWarp];
  float row_lse[kRowsPerWarp], row_delta[kRowsPerWarp];
  for (int t = 0; t < kRowsPerWarp; ++t) {
    const int r = warp * kRowsPerWarp + t;
    first[t] = last[t] = 0;
    row_lse[t] = kNegInf;
    row_delta[t] = 0.0f;
    if (r < rows) {
      mask.key_range(i0 + r, first[t], last[t]);
      row_lse[t] = lse.at(b, h, i0 + r);
      row_delta[t] = delta[(b * q_heads + h) * mask.q_len + i0 + r];
    }
    if (row_lse[t] == kNegInf) last[t] = first[t];
  }
  Index keys_first, keys_last;
  mask.tile_key_range(i0, i0 + rows, keys_first, keys_last);

  for (Index j0 = keys_first / kKeyTile * kKeyTile; j0 < keys_last; j0 += kKeyTile) {
    __syncthreads();
    for (int idx = tid; idx < kKeyTile * d; idx += kThreads) {
      const int r = idx / d, c = idx % d;
      const bool valid = j0 + r < mask.kv_len;
      k_s[r * ld + c] = valid ? k.row(b, j0 + r, kvh)[c] : 0.0f;
      v_s[r * ld + c] = valid ? v.row(b, j0 + r, kvh)[c] : 0.0f;
    }
    __syncthreads();
    float s[kRowsPerWarp] = {}, dp[kRowsPerWarp] = {};
    for (int c = 0; c < d; ++c) {
      const float kc = k_s[lane * ld + c], vc = v_s[lane * ld + c];
      for (int t = 0; t < kRowsPerWarp; ++t) {
        s[t] += q_s[(warp * kRowsPerWarp + t) * d + c] * kc;
        dp[t] += do_s[(warp * kRowsPerWarp + t) * d + c] * vc;
      }
    }
    const Index j = j0 + lane;
    for (int t = 0; t < kRowsPerWarp; ++t) {
      const bool visible = j >= first[t] && j < last[t];
      const float p = visible ? expf(s[t] * scale - row_lse[t]) : 0.0f;
      ds_s[(warp * kRowsPerWarp + t) * kKeyTile + lane] = p * (dp[t] - row_delta[t]);
    }
    __syncwarp();
    for (int c = lane; c < d; c += 32) {
      float a[kRowsPerWarp] = {};
      for (int jj = 0; jj < kKeyTile; ++jj) {
        const float kc = k_s[jj * ld + c];
        for (int t = 0; t < kRowsPerWarp; ++t) a[t] += ds_s[(warp * kRowsPerWarp + t) * kKeyTile + jj] * kc;
      }
      for (int t = 0; t < kRowsPerWarp; ++t) dq_s[(warp * kRowsPerWarp + t) * d + c] += a[t];
    }
    __syncwarp();
  }
  for (int t = 0; t < kRowsPerWarp; ++t) {
    const int r = warp * kRowsPerWarp + t;
    if (r >= rows) continue;
    float* dq_row = dq.row(b, i0 + r, h);
    for (int c = lane; c < d; c += 32) dq_row[c] += scale * dq_s[r * d + c];
  }
}

}  // namespace f32

// delta [b, heads, sq] for out/dout in T (float or bf16-as-__nv_bfloat16), on the current stream.
template <class T>
void launch_delta(HeadView<const T> out, HeadView<const T> dout, float* delta, Index batch, Index q_len, Index heads,
                  int d) {
  const Index rows = batch * q_len * heads;
  constexpr int threads = 256;
  f32::delta_kernel<T><<<unsigned((rows * 32 + threads - 1) / threads), threads, 0, device::current_stream()>>>(
      out, dout, delta, batch, q_len, heads, d);
  device::check_launch("attention delta_kernel");
}

// A float scratch on the current stream, freed in stream order.
class StreamScratch {
public:
  explicit StreamScratch(std::size_t floats) {
    if (floats) PARADYSE_CUDA_CHECK(cudaMallocAsync(&data_, floats * sizeof(float), device::current_stream()));
  }
  ~StreamScratch() {
    if (data_) (void)cudaFreeAsync(data_, device::current_stream());
  }
  StreamScratch(const StreamScratch&) = delete;
  StreamScratch& operator=(const StreamScratch&) = delete;
  float* get() const { return static_cast<float*>(data_); }

private:
  void* data_ = nullptr;
};

// The shape checks of backward (the CPU op's messages), on float views of the same shapes and strides.
inline ops::cpu::detail::AttentionDims check_backward(TensorView<const float> q, TensorView<const float> k,
                                                 TensorView<const float> v, TensorView<const float> out,
                                                 TensorView<const float> lse, TensorView<const float> dout,
                                                 const ops::AttentionMask& mask, TensorView<const float> dq,
                                                 TensorView<const float> dk, TensorView<const float> dv) {
  constexpr const char* op = "attention_backward";
  namespace cd = ops::cpu::detail;
  const cd::AttentionDims dims = cd::check_attention_inputs(op, q, k, v, mask);
  cd::check_same(op, "out", out.shape(), q.shape());
  cd::check_same(op, "dout", dout.shape(), q.shape());
  cd::check_same(op, "dq", dq.shape(), q.shape());
  cd::check_same(op, "dk", dk.shape(), k.shape());
  cd::check_same(op, "dv", dv.shape(), v.shape());
  cd::check_same(op, "lse", lse.shape(), Shape{dims.batch, dims.q_heads, dims.q_len});
  check(cd::unit_last_stride(out) && cd::unit_last_stride(dout) && cd::unit_last_stride(dq) &&
            cd::unit_last_stride(dk) && cd::unit_last_stride(dv),
        "{}: the head dimension of out, dout, dq, dk, dv must have unit stride", op);
  return dims;
}

}  // namespace paradyse::kernels::attention

namespace paradyse::ops::cuda {

void attention_backward(TensorView<const float> q, TensorView<const float> k, TensorView<const float> v,
                        TensorView<const float> out, TensorView<const float> lse, TensorView<const float> dout,
                        const AttentionMask& mask, TensorView<float> dq, TensorView<float> dk, TensorView<float> dv) {
  namespace ka = kernels::attention;
  const cpu::detail::AttentionDims dims = ka::check_backward(q, k, v, out, lse, dout, mask, dq, dk, dv);
  if (dims.batch == 0 || dims.q_len == 0 || dims.kv_len == 0 || dims.q_heads == 0) return;
  ka::check_grid("attention_backward", dims.q_heads, dims.batch);
  const int d = int(dims.head_dim);
  const std::size_t dkdv_shared = ka::f32::dkdv_shared_bytes(d), dq_shared = ka::f32::dq_shared_bytes(d);
  ka::allow_shared_memory(ka::f32::dkdv_kernel, dkdv_shared, "attention_backward (float32, dk/dv)");
  ka::allow_shared_memory(ka::f32::dq_kernel, dq_shared, "attention_backward (float32, dq)");
  const float scale = attention_scale(mask, d);
  const ka::UploadedMask uploaded(mask, dims.q_len, dims.kv_len);
  const ka::StreamScratch delta(std::size_t(dims.batch * dims.q_heads * dims.q_len));
  ka::launch_delta<float>(ka::head_view<const float>(out), ka::head_view<const float>(dout), delta.get(), dims.batch,
                          dims.q_len, dims.q_heads, d);
  const dim3 dkdv_grid(unsigned((dims.kv_len + ka::f32::kKeyTile - 1) / ka::f32::kKeyTile), unsigned(dims.kv_heads),
                       unsigned(dims.batch));
  ka::f32::dkdv_kernel<<<dkdv_grid, ka::f32::kThreads, dkdv_shared, device::current_stream()>>>(
      ka::head_view<const float>(q), ka::head_view<const float>(k), ka::head_view<const float>(v),
      ka::head_view<const float>(dout), ka::lse_view<const float>(lse), delta.get(), ka::head_view<float>(dk),
      ka::head_view<float>(dv), uploaded.device(), d, int(dims.group()), dims.q_heads, scale);
  device::check_launch("attention f32::dkdv_kernel");
  const dim3 dq_grid(unsigned((dims.q_len + ka::f32::kQueryTile - 1) / ka::f32::kQueryTile), unsigned(dims.q_heads),
                     unsigned(dims.batch));
  ka::f32::dq_kernel<<<dq_grid, ka::f32::kThreads, dq_shared, device::current_stream()>>>(
      ka::head_view<const float>(q), ka::head_view<const float>(k), ka::head_view<const float>(v),
      ka::head_view<const float>(dout), ka::lse_view<const float>(lse), delta.get(), ka::head_view<float>(dq),
      uploaded.device(), d, int(dims.group()), dims.q_heads, scale);
  device::check_launch("attention f32::dq_kernel");
}

}  // namespace paradyse::ops::cuda
