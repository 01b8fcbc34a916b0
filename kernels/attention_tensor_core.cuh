// kernels/attention_tensor_core.cuh: bf16 flash attention on tensor cores (bf16 products, fp32 accumulation),
// head_dim 64 or 128, every mask; and the bf16 launchers of ops/cuda/attention.hpp.
//
// Tiles of 64 queries x 64 keys; a block has 4 warps and each warp owns 16 rows of the tile (queries in forward and
// dq, keys in dk/dv). Softmax runs in base 2 (scores scaled by scale * log2(e); lse is converted back to natural log);
// probabilities are rounded to bf16 for the next product.
//   forward:  PTX mma.sync m16n8k16 with its documented fragment layout: S = Q K^T, the online softmax and
//             O = O * corr + P V all stay in registers (FlashAttention-2);
//   backward (the same fragments): delta = rowsum(dO * O); dk/dv kernel (one block per key tile, walking the GQA
//             group's heads and the queries that see the keys): S^T = K Q^T, dP^T = V dO^T, P^T = exp2(S^T - lse),
//             dS^T = P^T (dP^T - delta), dV += P^T dO, dK += dS^T Q; dq kernel (one block per query tile, as forward):
//             dQ += dS K. Two kernels instead of atomics: deterministic, at the cost of computing S and dP twice.
#pragma once

#include "attention_backward.cuh"
#include "attention_common.cuh"

#include <cuda_bf16.h>

#include <cstdint>

namespace paradyse::kernels::attention {

namespace tc {

using Bf = __nv_bfloat16;

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kTile = 64;          // queries and keys per tile
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// bf16 rows of a [64][D] tile, padded by 8 elements (16 bytes): rows stay 16-byte aligned for the tile loads, and the
// eight rows g of a fragment load fall on different banks.
template <int D>
constexpr int kLd = D + 8;
template <int D>
constexpr std::size_t kTileBytes = std::size_t(kTile) * kLd<D> * sizeof(Bf);

// Rows [r0, r0 + 64) of head h of `src` into `dst` ([64][D + 8]); rows at or beyond `limit` are zero. 16-byte loads.
template <int D>
__device__ void load_tile(Bf* dst, HeadView<const Bf> src, Index b, Index h, Index r0, Index limit) {
  constexpr int chunks = D / 8;
  for (int idx = threadIdx.x; idx < kTile * chunks; idx += kThreads) {
    const int r = idx / chunks, c = idx % chunks;
    uint4 value = make_uint4(0, 0, 0, 0);
    if (r0 + r < limit) value = *reinterpret_cast<const uint4*>(src.row(b, r0 + r, h) + c * 8);
    *reinterpret_cast<uint4*>(dst + r * kLd<D> + c * 8) = value;
  }
}

// ---- forward (mma.sync m16n8k16, register-resident softmax) ------------------------------------------------------
// The forward keeps scores, probabilities and the output accumulator in registers, in the documented fragment layout
// of PTX mma.m16n8k16 (g = lane / 4, t = lane % 4):
//   A (16 x 16, row major): reg 0 = row g, cols 2t, 2t+1; reg 1 = row g+8, same cols; regs 2, 3 = the same at +8 cols
//   B (16 x 8, "col"):      reg 0 = rows (k) 2t, 2t+1 of col g; reg 1 = rows 2t+8, 2t+9
//   C (16 x 8, fp32):       c0, c1 = row g, cols 2t, 2t+1; c2, c3 = row g+8, cols 2t, 2t+1
// so each lane holds two rows (g and g + 8) of the score tile and the row reductions are shuffles among the four
// lanes of a group; the probabilities of two adjacent 8-key score tiles are exactly the A operand of P V.
__device__ inline void mma_16816(float (&c)[4], const std::uint32_t (&a)[4], std::uint32_t b0, std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ inline std::uint32_t load_pair(const Bf* p) { return *reinterpret_cast<const std::uint32_t*>(p); }
__device__ inline std::uint32_t pack_pair(Bf lo, Bf hi) {
  return std::uint32_t(__bfloat16_as_ushort(lo)) | (std::uint32_t(__bfloat16_as_ushort(hi)) << 16);
}
__device__ inline std::uint32_t pack_floats(float lo, float hi) {
  return pack_pair(__float2bfloat16(lo), __float2bfloat16(hi));
}

// The A fragment (16 x 16, row major) of rows [row0, row0 + 16) and columns [col0, col0 + 16) of a [64][ld] tile.
__device__ inline void load_a(std::uint32_t (&a)[4], const Bf* tile, int ld, int row0, int col0) {
  const int g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
  const Bf* base = tile + (row0 + g) * ld + col0 + 2 * t;
  a[0] = load_pair(base);
  a[1] = load_pair(base + 8 * ld);
  a[2] = load_pair(base + 8);
  a[3] = load_pair(base + 8 * ld + 8);
}

// The probabilities (or their gradients) of two adjacent 16 x 8 score tiles as one A fragment (16 x 16).
__device__ inline void pack_a(std::uint32_t (&a)[4], const float (&lo)[4], const float (&hi)[4]) {
  a[0] = pack_floats(lo[0], lo[1]);
  a[1] = pack_floats(lo[2], lo[3]);
  a[2] = pack_floats(hi[0], hi[1]);
  a[3] = pack_floats(hi[2], hi[3]);
}

// Four 8 x 8 bf16 matrices from shared memory, transposed: lanes 8i .. 8i + 7 give the row addresses of matrix i;
// register i of lane (g, t) gets rows 2t, 2t + 1 of column g of matrix i, the B fragment of a row-major [k][n] tile.
__device__ inline void ldmatrix_x4_trans(std::uint32_t (&r)[4], const Bf* p) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

// acc [16][D] += a [16][16] x [16][D], x rows [row0, row0 + 16) of a row-major [64][ld] tile (V, dO, Q or K). Each
// ldmatrix.x4.trans yields the B fragments of two 8-column tiles: matrices 0, 1 = rows +0..7, +8..15 of columns
// n..n+7; matrices 2, 3 = the same rows of columns n+8..n+15.
template <int D>
__device__ inline void mma_rows(float (&acc)[D / 8][4], const std::uint32_t (&a)[4], const Bf* x, int ld, int row0) {
  const int lane = threadIdx.x % 32;
  const Bf* base = x + (row0 + lane % 8 + 8 * ((lane / 8) % 2)) * ld + 8 * (lane / 16);
  for (int n = 0; n < D / 8; n += 2) {
    std::uint32_t r[4];
    ldmatrix_x4_trans(r, base + n * 8);
    mma_16816(acc[n], a, r[0], r[1]);
    mma_16816(acc[n + 1], a, r[2], r[3]);
  }
}

template <int D>
struct ForwardLayout {
  static constexpr std::size_t q = 0, k = q + kTileBytes<D>, v = k + kTileBytes<D>, bytes = v + kTileBytes<D>;
};

// grid: (query tiles of 64, q heads, batch), block: 128 threads; warp w owns queries 16w .. 16w + 15 of the tile.
template <int D>
__global__ void __launch_bounds__(kThreads)
    forward_kernel(HeadView<const Bf> q, HeadView<const Bf> k, HeadView<const Bf> v, HeadView<Bf> out,
                   LseView<float> lse, DeviceMask mask, int group, float scale_log2) {
  using L = ForwardLayout<D>;
  constexpr int ld = kLd<D>;
  extern __shared__ __align__(128) unsigned char tc_forward_smem[];
  unsigned char* smem = tc_forward_smem;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  Bf* q_s = reinterpret_cast<Bf*>(smem + L::q);
  Bf* k_s = reinterpret_cast<Bf*>(smem + L::k);
  Bf* v_s = reinterpret_cast<Bf*>(smem + L::v);

  const Index b = blockIdx.z, h = blockIdx.y, kvh = h / group;
  const Index i0 = Index(blockIdx.x) * kTile;
  load_tile<D>(q_s, q, b, h, i0, mask.q_len);
  __syncthreads();
  std::uint32_t q_a[D / 16][4];
  for (int kk = 0; kk < D / 16; ++kk) {
    const Bf* base = q_s + (warp * 16 + g) * ld + kk * 16 + 2 * t;
    q_a[kk][0] = load_pair(base);
    q_a[kk][1] = load_pair(base + 8 * ld);
    q_a[kk][2] = load_pair(base + 8);
    q_a[kk][3] = load_pair(base + 8 * ld + 8);
  }
  float o[D / 8][4];
  for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;

  // This lane's two rows: g (index 0) and g + 8 (index 1).
  Index first[2] = {0, 0}, last[2] = {0, 0};
  float m[2] = {kNegInf, kNegInf}, l[2] = {0.0f, 0.0f};  // l: this lane's partial sums (reduced at the end)
  for (int x = 0; x < 2; ++x) {
    const Index i = i0 + warp * 16 + g + 8 * x;
    if (i < mask.q_len) mask.key_range(i, first[x], last[x]);
  }
  const Index rows = min(Index(kTile), mask.q_len - i0);
  Index keys_first, keys_last;
  mask.tile_key_range(i0, i0 + rows, keys_first, keys_last);

  for (Index j0 = keys_first / kTile * kTile; j0 < keys_last; j0 += kTile) {
    __syncthreads();  // the previous k, v tiles are consumed
    load_tile<D>(k_s, k, b, kvh, j0, mask.kv_len);
    load_tile<D>(v_s, v, b, kvh, j0, mask.kv_len);
    __syncthreads();
    float s[kTile / 8][4];  // S [16][64] as 8 tiles of 16 x 8
    for (int n = 0; n < kTile / 8; ++n) {
      s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
      const Bf* base = k_s + (n * 8 + g) * ld + 2 * t;
      for (int kk = 0; kk < D / 16; ++kk) mma_16816(s[n], q_a[kk], load_pair(base + kk * 16), load_pair(base + kk * 16 + 8));
    }
    float top[2] = {kNegInf, kNegInf};
    for (int n = 0; n < kTile / 8; ++n)
      for (int e = 0; e < 4; ++e) {
        const int x = e / 2;
        const Index j = j0 + n * 8 + 2 * t + (e & 1);
        const float value = (j >= first[x] && j < last[x]) ? s[n][e] * scale_log2 : kNegInf;
        s[n][e] = value;
        top[x] = fmaxf(top[x], value);
      }
    float corr[2];
    for (int x = 0; x < 2; ++x) {
      top[x] = fmaxf(top[x], __shfl_xor_sync(0xffffffffu, top[x], 1));
      top[x] = fmaxf(top[x], __shfl_xor_sync(0xffffffffu, top[x], 2));
      const float m_new = fmaxf(m[x], top[x]);
      corr[x] = m_new == kNegInf ? 1.0f : exp2f(m[x] - m_new);  // m = -inf: 0
      top[x] = m_new;  // the exponent's offset below (-inf: every probability of the row is 0)
      m[x] = m_new;
    }
    float sum[2] = {0.0f, 0.0f};
    for (int n = 0; n < kTile / 8; ++n)
      for (int e = 0; e < 4; ++e) {
        const int x = e / 2;
        const float p = top[x] == kNegInf ? 0.0f : exp2f(s[n][e] - top[x]);
        s[n][e] = p;
        sum[x] += p;
      }
    for (int x = 0; x < 2; ++x) l[x] = l[x] * corr[x] + sum[x];
    for (int n = 0; n < D / 8; ++n) {
      o[n][0] *= corr[0];
      o[n][1] *= corr[0];
      o[n][2] *= corr[1];
      o[n][3] *= corr[1];
    }
    for (int kc = 0; kc < kTile / 16; ++kc) {  // O [16][D] += P [16][16 keys] V [16 keys][D]
      // V's B fragments as pairs of scalar loads: measured faster here than ldmatrix.trans (146 vs 124 TFLOP/s at
      // s = 2K, d = 128 on an H200), which the backward kernels use.
      std::uint32_t p_a[4];
      pack_a(p_a, s[2 * kc], s[2 * kc + 1]);
      const Bf* base = v_s + (kc * 16 + 2 * t) * ld + g;
      for (int n = 0; n < D / 8; ++n) {
        const Bf* col = base + n * 8;
        mma_16816(o[n], p_a, pack_pair(col[0], col[ld]), pack_pair(col[8 * ld], col[9 * ld]));
      }
    }
  }
  for (int x = 0; x < 2; ++x) {
    l[x] += __shfl_xor_sync(0xffffffffu, l[x], 1);
    l[x] += __shfl_xor_sync(0xffffffffu, l[x], 2);
  }
  for (int x = 0; x < 2; ++x) {
    const Index i = i0 + warp * 16 + g + 8 * x;
    if (i >= mask.q_len) continue;
    const float inv = l[x] > 0.0f ? 1.0f / l[x] : 0.0f;
    Bf* out_row = out.row(b, i, h);
    for (int n = 0; n < D / 8; ++n)
      *reinterpret_cast<std::uint32_t*>(out_row + n * 8 + 2 * t) = pack_floats(o[n][2 * x] * inv, o[n][2 * x + 1] * inv);
    if (t == 0) lse.at(b, h, i) = l[x] > 0.0f ? (m[x] + log2f(l[x])) * kLn2 : kNegInf;
  }
}

// ---- backward: dk, dv (mma.sync, fragments as in forward) ----------------------------------------------------------
template <int D>
struct DkdvLayout {
  static constexpr std::size_t k = 0, v = k + kTileBytes<D>, q = v + kTileBytes<D>, dout = q + kTileBytes<D>,
                               lse = dout + kTileBytes<D>, delta = lse + kTile * sizeof(float),
                               first = delta + kTile * sizeof(float), last = first + kTile * sizeof(Index),
                               bytes = last + kTile * sizeof(Index);
};

// dst [2 rows of this lane][D] += factor * acc, bf16 read-modify-write (rows beyond `limit` skipped).
template <int D>
__device__ inline void add_rows(const float (&acc)[D / 8][4], HeadView<Bf> dst, Index b, Index row0, Index h,
                                Index limit, float factor) {
  const int g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
  for (int x = 0; x < 2; ++x) {
    const Index r = row0 + g + 8 * x;
    if (r >= limit) continue;
    Bf* row = dst.row(b, r, h);
    for (int n = 0; n < D / 8; ++n) {
      Bf* p = row + n * 8 + 2 * t;
      p[0] = __float2bfloat16(__bfloat162float(p[0]) + factor * acc[n][2 * x]);
      p[1] = __float2bfloat16(__bfloat162float(p[1]) + factor * acc[n][2 * x + 1]);
    }
  }
}

// grid: (key tiles of 64, kv heads, batch), block: 128 threads; warp w owns keys 16w .. 16w + 15 of the tile.
template <int D>
__global__ void __launch_bounds__(kThreads)
    dkdv_kernel(HeadView<const Bf> q, HeadView<const Bf> k, HeadView<const Bf> v, HeadView<const Bf> dout,
                LseView<const float> lse, const float* delta, HeadView<Bf> dk, HeadView<Bf> dv, DeviceMask mask,
                int group, Index q_heads, float scale, float scale_log2) {
  using L = DkdvLayout<D>;
  constexpr int ld = kLd<D>;
  extern __shared__ __align__(128) unsigned char tc_dkdv_smem[];
  unsigned char* smem = tc_dkdv_smem;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  Bf* k_s = reinterpret_cast<Bf*>(smem + L::k);
  Bf* v_s = reinterpret_cast<Bf*>(smem + L::v);
  Bf* q_s = reinterpret_cast<Bf*>(smem + L::q);
  Bf* do_s = reinterpret_cast<Bf*>(smem + L::dout);
  float* lse_s = reinterpret_cast<float*>(smem + L::lse);
  float* delta_s = reinterpret_cast<float*>(smem + L::delta);
  Index* first_s = reinterpret_cast<Index*>(smem + L::first);
  Index* last_s = reinterpret_cast<Index*>(smem + L::last);

  const Index b = blockIdx.z, kvh = blockIdx.y;
  const Index j0 = Index(blockIdx.x) * kTile;
  load_tile<D>(k_s, k, b, kvh, j0, mask.kv_len);
  load_tile<D>(v_s, v, b, kvh, j0, mask.kv_len);
  const Index cols = min(Index(kTile), mask.kv_len - j0);
  Index q_lo, q_hi;
  mask.query_range(j0, j0 + cols, q_lo, q_hi);

  float dk_acc[D / 8][4], dv_acc[D / 8][4];
  for (int n = 0; n < D / 8; ++n)
    for (int e = 0; e < 4; ++e) dk_acc[n][e] = dv_acc[n][e] = 0.0f;
  const Index key[2] = {j0 + warp * 16 + g, j0 + warp * 16 + g + 8};  // this lane's two key rows

  for (int gi = 0; gi < group; ++gi) {
    const Index h = kvh * group + gi;
    for (Index i0 = q_lo; i0 < q_hi; i0 += kTile) {
      __syncthreads();  // the previous query tile is consumed
      load_tile<D>(q_s, q, b, h, i0, q_hi);
      load_tile<D>(do_s, dout, b, h, i0, q_hi);
      if (tid < kTile) {
        const Index i = i0 + tid;
        Index f = 0, e = 0;
        float row_lse = kNegInf, row_delta = 0.0f;
        if (i < q_hi) {
          mask.key_range(i, f, e);
          row_lse = lse.at(b, h, i);
          row_delta = delta[(b * q_heads + h) * mask.q_len + i];
        }
        if (row_lse == kNegInf) e = f;  // no probability mass
        first_s[tid] = f;
        last_s[tid] = e;
        lse_s[tid] = row_lse * kLog2e;
        delta_s[tid] = row_delta;
      }
      __syncthreads();
      float s[kTile / 8][4], dp[kTile / 8][4];  // S^T, dP^T [16 keys][64 queries] as 8 tiles of 16 x 8
      for (int n = 0; n < kTile / 8; ++n)
        for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.0f;
      for (int kk = 0; kk < D / 16; ++kk) {
        std::uint32_t k_a[4], v_a[4];
        load_a(k_a, k_s, ld, warp * 16, kk * 16);
        load_a(v_a, v_s, ld, warp * 16, kk * 16);
        for (int n = 0; n < kTile / 8; ++n) {
          const Bf* qb = q_s + (n * 8 + g) * ld + kk * 16 + 2 * t;
          const Bf* dob = do_s + (n * 8 + g) * ld + kk * 16 + 2 * t;
          mma_16816(s[n], k_a, load_pair(qb), load_pair(qb + 8));
          mma_16816(dp[n], v_a, load_pair(dob), load_pair(dob + 8));
        }
      }
      for (int n = 0; n < kTile / 8; ++n)
        for (int e = 0; e < 4; ++e) {
          const Index j = key[e / 2];
          const int c = n * 8 + 2 * t + (e & 1);  // query of the tile
          const bool visible = j >= first_s[c] && j < last_s[c];
          const float p = visible ? exp2f(s[n][e] * scale_log2 - lse_s[c]) : 0.0f;
          s[n][e] = p;
          dp[n][e] = p * (dp[n][e] - delta_s[c]);  // dS^T
        }
      for (int kc = 0; kc < kTile / 16; ++kc) {  // dV_w += P^T dO, dK_w += dS^T Q (16 queries at a time)
        std::uint32_t p_a[4], ds_a[4];
        pack_a(p_a, s[2 * kc], s[2 * kc + 1]);
        pack_a(ds_a, dp[2 * kc], dp[2 * kc + 1]);
        mma_rows<D>(dv_acc, p_a, do_s, ld, kc * 16);
        mma_rows<D>(dk_acc, ds_a, q_s, ld, kc * 16);
      }
    }
  }
  add_rows<D>(dk_acc, dk, b, j0 + warp * 16, kvh, mask.kv_len, scale);
  add_rows<D>(dv_acc, dv, b, j0 + warp * 16, kvh, mask.kv_len, 1.0f);
}

// ---- backward: dq (mma.sync) ----------------------------------------------------------------------------------------
template <int D>
struct DqLayout {
  static constexpr std::size_t q = 0, dout = q + kTileBytes<D>, k = dout + kTileBytes<D>, v = k + kTileBytes<D>,
                               bytes = v + kTileBytes<D>;
};

// grid: (query tiles of 64, q heads, batch), block: 128 threads; warp w owns queries 16w .. 16w + 15 of the tile.
template <int D>
__global__ void __launch_bounds__(kThreads)
    dq_kernel(HeadView<const Bf> q, HeadView<const Bf> k, HeadView<const Bf> v, HeadView<const Bf> dout,
              LseView<const float> lse, const float* delta, HeadView<Bf> dq, DeviceMask mask, int group,
              Index q_heads, float scale, float scale_log2) {
  using L = DqLayout<D>;
  constexpr int ld = kLd<D>;
  extern __shared__ __align__(128) unsigned char tc_dq_smem[];
  unsigned char* smem = tc_dq_smem;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  Bf* q_s = reinterpret_cast<Bf*>(smem + L::q);
  Bf* do_s = reinterpret_cast<Bf*>(smem + L::dout);
  Bf* k_s = reinterpret_cast<Bf*>(smem + L::k);
  Bf* v_s = reinterpret_cast<Bf*>(smem + L::v);

  const Index b = blockIdx.z, h = blockIdx.y, kvh = h / group;
  const Index i0 = Index(blockIdx.x) * kTile;
  load_tile<D>(q_s, q, b, h, i0, mask.q_len);
  load_tile<D>(do_s, dout, b, h, i0, mask.q_len);

  float dq_acc[D / 8][4];
  for (int n = 0; n < D / 8; ++n)
    for (int e = 0; e < 4; ++e) dq_acc[n][e] = 0.0f;
  // This lane's two query rows: g (index 0) and g + 8 (index 1).
  Index first[2] = {0, 0}, last[2] = {0, 0};
  float row_lse2[2] = {kNegInf, kNegInf}, row_delta[2] = {0.0f, 0.0f};
  for (int x = 0; x < 2; ++x) {
    const Index i = i0 + warp * 16 + g + 8 * x;
    if (i < mask.q_len) {
      mask.key_range(i, first[x], last[x]);
      row_lse2[x] = lse.at(b, h, i) * kLog2e;
      row_delta[x] = delta[(b * q_heads + h) * mask.q_len + i];
    }
    if (row_lse2[x] == kNegInf) last[x] = first[x];
  }
  const Index rows = min(Index(kTile), mask.q_len - i0);
  Index keys_first, keys_last;
  mask.tile_key_range(i0, i0 + rows, keys_first, keys_last);

  for (Index j0 = keys_first / kTile * kTile; j0 < keys_last; j0 += kTile) {
    __syncthreads();  // the previous k, v tiles are consumed (and q, dout are loaded before the first)
    load_tile<D>(k_s, k, b, kvh, j0, mask.kv_len);
    load_tile<D>(v_s, v, b, kvh, j0, mask.kv_len);
    __syncthreads();
    float s[kTile / 8][4], dp[kTile / 8][4];  // S, dP [16 queries][64 keys]
    for (int n = 0; n < kTile / 8; ++n)
      for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.0f;
    for (int kk = 0; kk < D / 16; ++kk) {
      std::uint32_t q_a[4], do_a[4];
      load_a(q_a, q_s, ld, warp * 16, kk * 16);
      load_a(do_a, do_s, ld, warp * 16, kk * 16);
      for (int n = 0; n < kTile / 8; ++n) {
        const Bf* kb = k_s + (n * 8 + g) * ld + kk * 16 + 2 * t;
        const Bf* vb = v_s + (n * 8 + g) * ld + kk * 16 + 2 * t;
        mma_16816(s[n], q_a, load_pair(kb), load_pair(kb + 8));
        mma_16816(dp[n], do_a, load_pair(vb), load_pair(vb + 8));
      }
    }
    for (int n = 0; n < kTile / 8; ++n)
      for (int e = 0; e < 4; ++e) {
        const int x = e / 2;
        const Index j = j0 + n * 8 + 2 * t + (e & 1);
        const bool visible = j >= first[x] && j < last[x];
        const float p = visible ? exp2f(s[n][e] * scale_log2 - row_lse2[x]) : 0.0f;
        s[n][e] = p * (dp[n][e] - row_delta[x]);  // dS
      }
    for (int kc = 0; kc < kTile / 16; ++kc) {  // dQ_w += dS [16][16 keys] K [16 keys][D]
      std::uint32_t ds_a[4];
      pack_a(ds_a, s[2 * kc], s[2 * kc + 1]);
      mma_rows<D>(dq_acc, ds_a, k_s, ld, kc * 16);
    }
  }
  add_rows<D>(dq_acc, dq, b, i0 + warp * 16, h, mask.q_len, scale);
}

// ---- launch helpers --------------------------------------------------------------------------------------------------
// The bf16 kernels read rows with 16-byte loads: every row of a view must start on a 16-byte boundary.
template <class T>
void check_rows_aligned(const char* op, const char* name, TensorView<T> x) {
  const bool aligned = reinterpret_cast<std::uintptr_t>(x.data()) % 16 == 0 &&
                       (x.extent(0) <= 1 || x.strides()[0] % 8 == 0) && (x.extent(1) <= 1 || x.strides()[1] % 8 == 0) &&
                       (x.extent(2) <= 1 || x.strides()[2] % 8 == 0);
  check(aligned,
        "{}: the bf16 tensor-core kernels need 16-byte aligned rows; {} has strides {} (must be multiples of 8 "
        "elements) at address {}",
        op, name, x.strides(), fmt::ptr(x.data()));
}

inline void check_head_dim(const char* op, std::int64_t d) {
  check(d == 64 || d == 128,
        "{}: the bf16 tensor-core kernels support head_dim 64 and 128, not {} (use the float32 overload)", op, d);
}

}  // namespace tc

}  // namespace paradyse::kernels::attention

namespace paradyse::ops::cuda {

namespace attention_bf16_detail {

template <int D>
void forward(const cpu::detail::AttentionDims& dims, TensorView<const bf16> q, TensorView<const bf16> k,
             TensorView<const bf16> v, const AttentionMask& mask, TensorView<bf16> out, TensorView<float> lse) {
  namespace ka = kernels::attention;
  using Bf = ka::tc::Bf;
  const std::size_t shared = ka::tc::ForwardLayout<D>::bytes;
  ka::allow_shared_memory(ka::tc::forward_kernel<D>, shared, "attention_forward (bf16)");
  const ka::UploadedMask uploaded(mask, dims.q_len, dims.kv_len);
  const dim3 grid(unsigned((dims.q_len + ka::tc::kTile - 1) / ka::tc::kTile), unsigned(dims.q_heads),
                  unsigned(dims.batch));
  ka::tc::forward_kernel<D><<<grid, ka::tc::kThreads, shared, device::current_stream()>>>(
      ka::head_view<const Bf>(q), ka::head_view<const Bf>(k), ka::head_view<const Bf>(v), ka::head_view<Bf>(out),
      ka::lse_view<float>(lse), uploaded.device(), int(dims.group()),
      attention_scale(mask, dims.head_dim) * ka::tc::kLog2e);
  device::check_launch("attention tc::forward_kernel");
}

template <int D>
void backward(const cpu::detail::AttentionDims& dims, TensorView<const bf16> q, TensorView<const bf16> k,
              TensorView<const bf16> v, TensorView<const bf16> out, TensorView<const float> lse,
              TensorView<const bf16> dout, const AttentionMask& mask, TensorView<bf16> dq, TensorView<bf16> dk,
              TensorView<bf16> dv) {
  namespace ka = kernels::attention;
  using Bf = ka::tc::Bf;
  const std::size_t dkdv_shared = ka::tc::DkdvLayout<D>::bytes, dq_shared = ka::tc::DqLayout<D>::bytes;
  ka::allow_shared_memory(ka::tc::dkdv_kernel<D>, dkdv_shared, "attention_backward (bf16, dk/dv)");
  ka::allow_shared_memory(ka::tc::dq_kernel<D>, dq_shared, "attention_backward (bf16, dq)");
  const float scale = attention_scale(mask, D);
  const ka::UploadedMask uploaded(mask, dims.q_len, dims.kv_len);
  const ka::StreamScratch delta(std::size_t(dims.batch * dims.q_heads * dims.q_len));
  ka::launch_delta<Bf>(ka::head_view<const Bf>(out), ka::head_view<const Bf>(dout), delta.get(), dims.batch,
                       dims.q_len, dims.q_heads, D);
  const dim3 dkdv_grid(unsigned((dims.kv_len + ka::tc::kTile - 1) / ka::tc::kTile), unsigned(dims.kv_heads),
                       unsigned(dims.batch));
  ka::tc::dkdv_kernel<D><<<dkdv_grid, ka::tc::kThreads, dkdv_shared, device::current_stream()>>>(
      ka::head_view<const Bf>(q), ka::head_view<const Bf>(k), ka::head_view<const Bf>(v),
      ka::head_view<const Bf>(dout), ka::lse_view<const float>(lse), delta.get(), ka::head_view<Bf>(dk),
      ka::head_view<Bf>(dv), uploaded.device(), int(dims.group()), dims.q_heads, scale, scale * ka::tc::kLog2e);
  device::check_launch("attention tc::dkdv_kernel");
  const dim3 dq_grid(unsigned((dims.q_len + ka::tc::kTile - 1) / ka::tc::kTile), unsigned(dims.q_heads),
                     unsigned(dims.batch));
  ka::tc::dq_kernel<D><<<dq_grid, ka::tc::kThreads, dq_shared, device::current_stream()>>>(
      ka::head_view<const Bf>(q), ka::head_view<const Bf>(k), ka::head_view<const Bf>(v),
      ka::head_view<const Bf>(dout), ka::lse_view<const float>(lse), delta.get(), ka::head_view<Bf>(dq),
      uploaded.device(), int(dims.group()), dims.q_heads, scale, scale * ka::tc::kLog2e);
  device::check_launch("attention tc::dq_kernel");
}

}  // namespace attention_bf16_detail

void attention_forward(TensorView<const bf16> q, TensorView<const bf16> k, TensorView<const bf16> v,
                       const AttentionMask& mask, TensorView<bf16> out, TensorView<float> lse) {
  namespace ka = kernels::attention;
  constexpr const char* op = "attention_forward (bf16)";
  const cpu::detail::AttentionDims dims =
      cpu::detail::check_attention_inputs(op, ka::shape_only(q), ka::shape_only(k), ka::shape_only(v), mask);
  cpu::detail::check_same(op, "out", out.shape(), q.shape());
  cpu::detail::check_same(op, "lse", lse.shape(), Shape{dims.batch, dims.q_heads, dims.q_len});
  ka::tc::check_head_dim(op, dims.head_dim);
  ka::tc::check_rows_aligned(op, "q", q);
  ka::tc::check_rows_aligned(op, "k", k);
  ka::tc::check_rows_aligned(op, "v", v);
  ka::tc::check_rows_aligned(op, "out", out);
  if (dims.batch == 0 || dims.q_len == 0 || dims.q_heads == 0) return;
  ka::check_grid(op, dims.q_heads, dims.batch);
  if (dims.head_dim == 64)
    attention_bf16_detail::forward<64>(dims, q, k, v, mask, out, lse);
  else
    attention_bf16_detail::forward<128>(dims, q, k, v, mask, out, lse);
}

void attention_backward(TensorView<const bf16> q, TensorView<const bf16> k, TensorView<const bf16> v,
                        TensorView<const bf16> out, TensorView<const float> lse, TensorView<const bf16> dout,
                        const AttentionMask& mask, TensorView<bf16> dq, TensorView<bf16> dk, TensorView<bf16> dv) {
  namespace ka = kernels::attention;
  constexpr const char* op = "attention_backward (bf16)";
  const cpu::detail::AttentionDims dims =
      ka::check_backward(ka::shape_only(q), ka::shape_only(k), ka::shape_only(v), ka::shape_only(out), lse,
                         ka::shape_only(dout), mask, ka::shape_only(dq), ka::shape_only(dk), ka::shape_only(dv));
  ka::tc::check_head_dim(op, dims.head_dim);
  ka::tc::check_rows_aligned(op, "q", q);
  ka::tc::check_rows_aligned(op, "k", k);
  ka::tc::check_rows_aligned(op, "v", v);
  ka::tc::check_rows_aligned(op, "out", out);
  ka::tc::check_rows_aligned(op, "dout", dout);
  if (dims.batch == 0 || dims.q_len == 0 || dims.kv_len == 0 || dims.q_heads == 0) return;
  ka::check_grid(op, dims.q_heads, dims.batch);
  if (dims.head_dim == 64)
    attention_bf16_detail::backward<64>(dims, q, k, v, out, lse, dout, mask, dq, dk, dv);
  else
    attention_bf16_detail::backward<128>(dims, q, k, v, out, lse, dout, mask, dq, dk, dv);
}

}  // namespace paradyse::ops::cuda
