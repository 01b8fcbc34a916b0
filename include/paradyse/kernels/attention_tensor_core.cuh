// paradyse/kernels/attention_tensor_core.cuh: bf16 flash attention on tensor cores (nvcuda::wmma, bf16 16x16x16 with
// fp32 accumulation), head_dim 64 or 128, every mask; and the bf16 launchers of ops/cuda/attention.hpp.
//
// Tiles of 64 queries x 64 keys; a block has 4 warps and each warp owns 16 rows of the tile (queries in forward and
// dq, keys in dk/dv). Score tiles go through shared memory (fp32) for the softmax, whose probabilities are rounded
// to bf16 for the next product; the output / gradient accumulators stay in wmma fragments for the whole loop.
// Softmax runs in base 2 (scores scaled by scale * log2(e); lse is converted back to natural log).
//   forward:  S = Q K^T, online softmax, O = O * corr + P V (corr is applied to the accumulator fragment through a
//             map from fragment element to row, read once by loading a matrix of row numbers into a fragment);
//   backward: delta = rowsum(dO * O); dk/dv kernel (one block per key tile, walking the GQA group's heads and the
//             queries that see the keys): S^T = K Q^T, dP^T = V dO^T, P^T = exp2(S^T - lse), dS^T = P^T (dP^T -
//             delta), dV += P^T dO, dK += dS^T Q; dq kernel (one block per query tile): dQ += dS K.
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

// ---- forward -----------------------------------------------------------------------------------------------------
template <int D>
struct ForwardLayout {
  static constexpr std::size_t q = 0, k = q + kTileBytes<D>, v = k + kTileBytes<D>, s = v + kTileBytes<D>,
                               p = s + kScoreBytes, corr = p + kProbBytes, bytes = corr + kWarps * 16 * sizeof(float);
  static_assert(std::size_t(kWarps) * 16 * D * sizeof(float) <= 2 * kTileBytes<D>, "output staging fits in k, v");
};

// grid: (query tiles of 64, q heads, batch), block: 128 threads.
template <int D>
__global__ void __launch_bounds__(kThreads)
    forward_kernel(HeadView<const Bf> q, HeadView<const Bf> k, HeadView<const Bf> v, HeadView<Bf> out,
                   LseView<float> lse, DeviceMask mask, int group, float scale_log2) {
  using L = ForwardLayout<D>;
  extern __shared__ __align__(128) unsigned char tc_forward_smem[];
  unsigned char* smem = tc_forward_smem;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  Bf* q_s = reinterpret_cast<Bf*>(smem + L::q);
  Bf* k_s = reinterpret_cast<Bf*>(smem + L::k);
  Bf* v_s = reinterpret_cast<Bf*>(smem + L::v);
  float* s_w = reinterpret_cast<float*>(smem + L::s) + warp * 16 * kLdS;
  Bf* p_w = reinterpret_cast<Bf*>(smem + L::p) + warp * 16 * kLdP;
  float* corr_w = reinterpret_cast<float*>(smem + L::corr) + warp * 16;

  const Index b = blockIdx.z, h = blockIdx.y, kvh = h / group;
  const Index i0 = Index(blockIdx.x) * kTile;
  load_tile<D>(q_s, q, b, h, i0, mask.q_len);

  // Which row of the 16 x 16 tile each accumulator element of this lane holds.
  for (int idx = lane; idx < 256; idx += 32) s_w[(idx / 16) * kLdS + idx % 16] = float(idx / 16);
  __syncwarp();
  FragC map;
  wmma::load_matrix_sync(map, s_w, kLdS, wmma::mem_row_major);
  int row_of[FragC::num_elements];
  for (int t = 0; t < FragC::num_elements; ++t) row_of[t] = int(map.x[t]);
  __syncthreads();

  FragA q_frag[D / 16];
  for (int kk = 0; kk < D / 16; ++kk) wmma::load_matrix_sync(q_frag[kk], q_s + warp * 16 * kLd<D> + kk * 16, kLd<D>);
  FragC o[D / 16];
  for (int n = 0; n < D / 16; ++n) wmma::fill_fragment(o[n], 0.0f);

  // Softmax layout: two lanes per row, 32 columns each.
  const int r = lane / 2, half = lane % 2;
  const Index i = i0 + warp * 16 + r;
  Index first = 0, last = 0;
  if (i < mask.q_len) mask.key_range(i, first, last);
  float m = kNegInf, l = 0.0f;
  const Index rows = min(Index(kTile), mask.q_len - i0);
  Index keys_first, keys_last;
  mask.tile_key_range(i0, i0 + rows, keys_first, keys_last);

  for (Index j0 = keys_first / kTile * kTile; j0 < keys_last; j0 += kTile) {
    __syncthreads();  // the previous k, v tiles are consumed
    load_tile<D>(k_s, k, b, kvh, j0, mask.kv_len);
    load_tile<D>(v_s, v, b, kvh, j0, mask.kv_len);
    __syncthreads();
    for (int n = 0; n < kTile / 16; ++n) {  // S [16][64] = Q_w K^T
      FragC s;
      wmma::fill_fragment(s, 0.0f);
      for (int kk = 0; kk < D / 16; ++kk) {
        FragBCol kb;
        wmma::load_matrix_sync(kb, k_s + n * 16 * kLd<D> + kk * 16, kLd<D>);
        wmma::mma_sync(s, q_frag[kk], kb, s);
      }
      wmma::store_matrix_sync(s_w + n * 16, s, kLdS, wmma::mem_row_major);
    }
    __syncwarp();
    float* s_row = s_w + r * kLdS + half * 32;
    Bf* p_row = p_w + r * kLdP + half * 32;
    float top = kNegInf;
    for (int c = 0; c < 32; ++c) {
      const Index j = j0 + half * 32 + c;
      const float x = (j >= first && j < last) ? s_row[c] * scale_log2 : kNegInf;
      s_row[c] = x;
      top = fmaxf(top, x);
    }
    top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 1));
    const float m_new = fmaxf(m, top);
    float corr = 1.0f, sum = 0.0f;
    if (m_new == kNegInf) {
      for (int c = 0; c < 32; ++c) p_row[c] = __float2bfloat16(0.0f);
    } else {
      corr = exp2f(m - m_new);  // m = -inf: 0
      for (int c = 0; c < 32; ++c) {
        const float p = exp2f(s_row[c] - m_new);  // masked: exp2(-inf) = 0
        p_row[c] = __float2bfloat16(p);
        sum += p;
      }
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    l = l * corr + sum;
    m = m_new;
    if (half == 0) corr_w[r] = corr;
    __syncwarp();
    for (int n = 0; n < D / 16; ++n)
      for (int t = 0; t < FragC::num_elements; ++t) o[n].x[t] *= corr_w[row_of[t]];
    for (int kk = 0; kk < kTile / 16; ++kk) {  // O [16][D] += P [16][64] V [64][D]
      FragA pa;
      wmma::load_matrix_sync(pa, p_w + kk * 16, kLdP);
      for (int n = 0; n < D / 16; ++n) {
        FragBRow vb;
        wmma::load_matrix_sync(vb, v_s + kk * 16 * kLd<D> + n * 16, kLd<D>);
        wmma::mma_sync(o[n], pa, vb, o[n]);
      }
    }
  }
  __syncthreads();  // k, v become the output staging area
  float* stage = reinterpret_cast<float*>(smem + L::k) + warp * 16 * D;
  for (int n = 0; n < D / 16; ++n) wmma::store_matrix_sync(stage + n * 16, o[n], D, wmma::mem_row_major);
  __syncwarp();
  if (i < mask.q_len) {
    Bf* out_row = out.row(b, i, h);
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    for (int c = half * (D / 2); c < (half + 1) * (D / 2); ++c) out_row[c] = __float2bfloat16(stage[r * D + c] * inv);
    if (half == 0) lse.at(b, h, i) = l > 0.0f ? (m + log2f(l)) * kLn2 : kNegInf;
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
