// paradyse/kernels/attention_tensor_core.cuh: bf16 flash attention on tensor cores (bf16 products, fp32 accumulation),
// head_dim 64 or 128, every mask; and the bf16 launchers of ops/cuda/attention.hpp.
//
// Tiles of 64 queries x 64 keys; a block has 4 warps and each warp owns 16 rows of the tile (queries in forward and
// dq, keys in dk/dv). Softmax runs in base 2 (scores scaled by scale * log2(e); lse is converted back to natural log);
// probabilities are rounded to bf16 for the next product.
//   forward:  PTX mma.sync m16n8k16 with its documented fragment layout: S = Q K^T, the online softmax and
//             O = O * corr + P V all stay in registers (FlashAttention-2);
//   backward (nvcuda::wmma 16x16x16, score tiles through shared memory): delta = rowsum(dO * O); dk/dv kernel (one
//             block per key tile, walking the GQA group's heads and the queries that see the keys): S^T = K Q^T,
//             dP^T = V dO^T, P^T = exp2(S^T - lse), dS^T = P^T (dP^T - delta), dV += P^T dO, dK += dS^T Q; dq kernel
//             (one block per query tile): dQ += dS K.
#pragma once

#include "paradyse/kernels/attention_backward.cuh"
#include "paradyse/kernels/attention_common.cuh"

#include <cuda_bf16.h>
#include <mma.h>

#include <cstdint>

namespace paradyse::kernels::attention {

namespace tc {

namespace wmma = nvcuda::wmma;
using Bf = __nv_bfloat16;
using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, Bf, wmma::row_major>;
using FragBCol = wmma::fragment<wmma::matrix_b, 16, 16, 16, Bf, wmma::col_major>;
using FragBRow = wmma::fragment<wmma::matrix_b, 16, 16, 16, Bf, wmma::row_major>;
using FragC = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kTile = 64;          // queries and keys per tile
constexpr int kLdS = kTile + 4;    // fp32 score rows (wmma ldm: multiple of 4 floats)
constexpr int kLdP = kTile + 8;    // bf16 probability rows (multiple of 8 elements)
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// bf16 rows of a [64][D] tile, padded by 8 elements (16 bytes) against bank conflicts; every fragment pointer stays
// 32-byte aligned (16 rows * (D + 8) * 2 bytes and 16 columns * 2 bytes are multiples of 32).
template <int D>
constexpr int kLd = D + 8;
template <int D>
constexpr std::size_t kTileBytes = std::size_t(kTile) * kLd<D> * sizeof(Bf);
constexpr std::size_t kScoreBytes = std::size_t(kWarps) * 16 * kLdS * sizeof(float);  // per-warp [16][68] fp32
constexpr std::size_t kProbBytes = std::size_t(kWarps) * 16 * kLdP * sizeof(Bf);      // per-warp [16][72] bf16

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
      const std::uint32_t p_a[4] = {pack_floats(s[2 * kc][0], s[2 * kc][1]), pack_floats(s[2 * kc][2], s[2 * kc][3]),
                                    pack_floats(s[2 * kc + 1][0], s[2 * kc + 1][1]),
                                    pack_floats(s[2 * kc + 1][2], s[2 * kc + 1][3])};
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

// ---- backward: dk, dv ----------------------------------------------------------------------------------------------
template <int D>
struct DkdvLayout {
  static constexpr std::size_t k = 0, v = k + kTileBytes<D>, q = v + kTileBytes<D>, dout = q + kTileBytes<D>,
                               s = dout + kTileBytes<D>, dp = s + kScoreBytes, p = dp + kScoreBytes,
                               ds = p + kProbBytes, lse = ds + kProbBytes, delta = lse + kTile * sizeof(float),
                               first = delta + kTile * sizeof(float), last = first + kTile * sizeof(Index),
                               bytes = last + kTile * sizeof(Index);
  static_assert(std::size_t(kWarps) * 2 * 16 * D * sizeof(float) <= p - q, "dk, dv staging fits in q .. dp");
};

// grid: (key tiles of 64, kv heads, batch), block: 128 threads; warp w owns keys 16w .. 16w + 15 of the tile.
template <int D>
__global__ void __launch_bounds__(kThreads)
    dkdv_kernel(HeadView<const Bf> q, HeadView<const Bf> k, HeadView<const Bf> v, HeadView<const Bf> dout,
                LseView<const float> lse, const float* delta, HeadView<Bf> dk, HeadView<Bf> dv, DeviceMask mask,
                int group, Index q_heads, float scale, float scale_log2) {
  using L = DkdvLayout<D>;
  extern __shared__ __align__(128) unsigned char tc_dkdv_smem[];
  unsigned char* smem = tc_dkdv_smem;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  Bf* k_s = reinterpret_cast<Bf*>(smem + L::k);
  Bf* v_s = reinterpret_cast<Bf*>(smem + L::v);
  Bf* q_s = reinterpret_cast<Bf*>(smem + L::q);
  Bf* do_s = reinterpret_cast<Bf*>(smem + L::dout);
  float* s_w = reinterpret_cast<float*>(smem + L::s) + warp * 16 * kLdS;
  float* dp_w = reinterpret_cast<float*>(smem + L::dp) + warp * 16 * kLdS;
  Bf* p_w = reinterpret_cast<Bf*>(smem + L::p) + warp * 16 * kLdP;
  Bf* ds_w = reinterpret_cast<Bf*>(smem + L::ds) + warp * 16 * kLdP;
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

  FragC dk_acc[D / 16], dv_acc[D / 16];
  for (int n = 0; n < D / 16; ++n) {
    wmma::fill_fragment(dk_acc[n], 0.0f);
    wmma::fill_fragment(dv_acc[n], 0.0f);
  }
  const int r = lane / 2, half = lane % 2;  // elementwise layout: key row r, query columns half*32 .. +32
  const Index j = j0 + warp * 16 + r;

  for (int g = 0; g < group; ++g) {
    const Index h = kvh * group + g;
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
      for (int n = 0; n < kTile / 16; ++n) {  // S^T [16 keys][64 queries] = K_w Q^T, dP^T = V_w dO^T
        FragC s, dp;
        wmma::fill_fragment(s, 0.0f);
        wmma::fill_fragment(dp, 0.0f);
        for (int kk = 0; kk < D / 16; ++kk) {
          FragA ka, va;
          FragBCol qb, dob;
          wmma::load_matrix_sync(ka, k_s + warp * 16 * kLd<D> + kk * 16, kLd<D>);
          wmma::load_matrix_sync(qb, q_s + n * 16 * kLd<D> + kk * 16, kLd<D>);
          wmma::mma_sync(s, ka, qb, s);
          wmma::load_matrix_sync(va, v_s + warp * 16 * kLd<D> + kk * 16, kLd<D>);
          wmma::load_matrix_sync(dob, do_s + n * 16 * kLd<D> + kk * 16, kLd<D>);
          wmma::mma_sync(dp, va, dob, dp);
        }
        wmma::store_matrix_sync(s_w + n * 16, s, kLdS, wmma::mem_row_major);
        wmma::store_matrix_sync(dp_w + n * 16, dp, kLdS, wmma::mem_row_major);
      }
      __syncwarp();
      for (int c = half * 32; c < half * 32 + 32; ++c) {
        const bool visible = j >= first_s[c] && j < last_s[c];
        const float p = visible ? exp2f(s_w[r * kLdS + c] * scale_log2 - lse_s[c]) : 0.0f;
        p_w[r * kLdP + c] = __float2bfloat16(p);
        ds_w[r * kLdP + c] = __float2bfloat16(p * (dp_w[r * kLdS + c] - delta_s[c]));
      }
      __syncwarp();
      for (int kk = 0; kk < kTile / 16; ++kk) {  // dV_w += P^T dO, dK_w += dS^T Q
        FragA pa, dsa;
        wmma::load_matrix_sync(pa, p_w + kk * 16, kLdP);
        wmma::load_matrix_sync(dsa, ds_w + kk * 16, kLdP);
        for (int n = 0; n < D / 16; ++n) {
          FragBRow dob, qb;
          wmma::load_matrix_sync(dob, do_s + kk * 16 * kLd<D> + n * 16, kLd<D>);
          wmma::mma_sync(dv_acc[n], pa, dob, dv_acc[n]);
          wmma::load_matrix_sync(qb, q_s + kk * 16 * kLd<D> + n * 16, kLd<D>);
          wmma::mma_sync(dk_acc[n], dsa, qb, dk_acc[n]);
        }
      }
    }
  }
  __syncthreads();  // q .. dp become the staging area
  float* dk_stage = reinterpret_cast<float*>(smem + L::q) + warp * 2 * 16 * D;
  float* dv_stage = dk_stage + 16 * D;
  for (int n = 0; n < D / 16; ++n) {
    wmma::store_matrix_sync(dk_stage + n * 16, dk_acc[n], D, wmma::mem_row_major);
    wmma::store_matrix_sync(dv_stage + n * 16, dv_acc[n], D, wmma::mem_row_major);
  }
  __syncwarp();
  if (j < mask.kv_len) {
    Bf* dk_row = dk.row(b, j, kvh);
    Bf* dv_row = dv.row(b, j, kvh);
    for (int c = half * (D / 2); c < (half + 1) * (D / 2); ++c) {
      dk_row[c] = __float2bfloat16(__bfloat162float(dk_row[c]) + scale * dk_stage[r * D + c]);
      dv_row[c] = __float2bfloat16(__bfloat162float(dv_row[c]) + dv_stage[r * D + c]);
    }
  }
}

// ---- backward: dq --------------------------------------------------------------------------------------------------
template <int D>
struct DqLayout {
  static constexpr std::size_t q = 0, dout = q + kTileBytes<D>, k = dout + kTileBytes<D>, v = k + kTileBytes<D>,
                               s = v + kTileBytes<D>, dp = s + kScoreBytes, ds = dp + kScoreBytes,
                               bytes = ds + kProbBytes;
  static_assert(std::size_t(kWarps) * 16 * D * sizeof(float) <= 2 * kTileBytes<D>, "dq staging fits in k, v");
};

// grid: (query tiles of 64, q heads, batch), block: 128 threads; warp w owns queries 16w .. 16w + 15 of the tile.
template <int D>
__global__ void __launch_bounds__(kThreads)
    dq_kernel(HeadView<const Bf> q, HeadView<const Bf> k, HeadView<const Bf> v, HeadView<const Bf> dout,
              LseView<const float> lse, const float* delta, HeadView<Bf> dq, DeviceMask mask, int group,
              Index q_heads, float scale, float scale_log2) {
  using L = DqLayout<D>;
  extern __shared__ __align__(128) unsigned char tc_dq_smem[];
  unsigned char* smem = tc_dq_smem;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  Bf* q_s = reinterpret_cast<Bf*>(smem + L::q);
  Bf* do_s = reinterpret_cast<Bf*>(smem + L::dout);
  Bf* k_s = reinterpret_cast<Bf*>(smem + L::k);
  Bf* v_s = reinterpret_cast<Bf*>(smem + L::v);
  float* s_w = reinterpret_cast<float*>(smem + L::s) + warp * 16 * kLdS;
  float* dp_w = reinterpret_cast<float*>(smem + L::dp) + warp * 16 * kLdS;
  Bf* ds_w = reinterpret_cast<Bf*>(smem + L::ds) + warp * 16 * kLdP;

  const Index b = blockIdx.z, h = blockIdx.y, kvh = h / group;
  const Index i0 = Index(blockIdx.x) * kTile;
  load_tile<D>(q_s, q, b, h, i0, mask.q_len);
  load_tile<D>(do_s, dout, b, h, i0, mask.q_len);
  __syncthreads();
  FragA q_frag[D / 16], do_frag[D / 16];
  for (int kk = 0; kk < D / 16; ++kk) {
    wmma::load_matrix_sync(q_frag[kk], q_s + warp * 16 * kLd<D> + kk * 16, kLd<D>);
    wmma::load_matrix_sync(do_frag[kk], do_s + warp * 16 * kLd<D> + kk * 16, kLd<D>);
  }
  FragC dq_acc[D / 16];
  for (int n = 0; n < D / 16; ++n) wmma::fill_fragment(dq_acc[n], 0.0f);

  const int r = lane / 2, half = lane % 2;  // elementwise layout: query row r, key columns half*32 .. +32
  const Index i = i0 + warp * 16 + r;
  Index first = 0, last = 0;
  float row_lse = kNegInf, row_delta = 0.0f;
  if (i < mask.q_len) {
    mask.key_range(i, first, last);
    row_lse = lse.at(b, h, i);
    row_delta = delta[(b * q_heads + h) * mask.q_len + i];
  }
  if (row_lse == kNegInf) last = first;
  const float row_lse2 = row_lse * kLog2e;
  const Index rows = min(Index(kTile), mask.q_len - i0);
  Index keys_first, keys_last;
  mask.tile_key_range(i0, i0 + rows, keys_first, keys_last);

  for (Index j0 = keys_first / kTile * kTile; j0 < keys_last; j0 += kTile) {
    __syncthreads();
    load_tile<D>(k_s, k, b, kvh, j0, mask.kv_len);
    load_tile<D>(v_s, v, b, kvh, j0, mask.kv_len);
    __syncthreads();
    for (int n = 0; n < kTile / 16; ++n) {  // S [16][64] = Q_w K^T, dP = dO_w V^T
      FragC s, dp;
      wmma::fill_fragment(s, 0.0f);
      wmma::fill_fragment(dp, 0.0f);
      for (int kk = 0; kk < D / 16; ++kk) {
        FragBCol kb, vb;
        wmma::load_matrix_sync(kb, k_s + n * 16 * kLd<D> + kk * 16, kLd<D>);
        wmma::mma_sync(s, q_frag[kk], kb, s);
        wmma::load_matrix_sync(vb, v_s + n * 16 * kLd<D> + kk * 16, kLd<D>);
        wmma::mma_sync(dp, do_frag[kk], vb, dp);
      }
      wmma::store_matrix_sync(s_w + n * 16, s, kLdS, wmma::mem_row_major);
      wmma::store_matrix_sync(dp_w + n * 16, dp, kLdS, wmma::mem_row_major);
    }
    __syncwarp();
    for (int c = half * 32; c < half * 32 + 32; ++c) {
      const Index j = j0 + c;
      const bool visible = j >= first && j < last;
      const float p = visible ? exp2f(s_w[r * kLdS + c] * scale_log2 - row_lse2) : 0.0f;
      ds_w[r * kLdP + c] = __float2bfloat16(p * (dp_w[r * kLdS + c] - row_delta));
    }
    __syncwarp();
    for (int kk = 0; kk < kTile / 16; ++kk) {  // dQ_w += dS [16][64] K [64][D]
      FragA dsa;
      wmma::load_matrix_sync(dsa, ds_w + kk * 16, kLdP);
      for (int n = 0; n < D / 16; ++n) {
        FragBRow kb;
        wmma::load_matrix_sync(kb, k_s + kk * 16 * kLd<D> + n * 16, kLd<D>);
        wmma::mma_sync(dq_acc[n], dsa, kb, dq_acc[n]);
      }
    }
  }
  __syncthreads();  // k, v become the staging area
  float* stage = reinterpret_cast<float*>(smem + L::k) + warp * 16 * D;
  for (int n = 0; n < D / 16; ++n) wmma::store_matrix_sync(stage + n * 16, dq_acc[n], D, wmma::mem_row_major);
  __syncwarp();
  if (i < mask.q_len) {
    Bf* dq_row = dq.row(b, i, h);
    for (int c = half * (D / 2); c < (half + 1) * (D / 2); ++c)
      dq_row[c] = __float2bfloat16(__bfloat162float(dq_row[c]) + scale * stage[r * D + c]);
  }
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
