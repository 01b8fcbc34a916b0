// paradyse/serve/mla_attention.hpp: multi-head latent attention (MLA, DeepSeek-V2/V3) of one decoder layer on rank
// r of p, over a batch of sequence chunks, with the compressed latent as the paged cache.
//
// Per token (h hidden, H heads, r_kv = kv_lora_rank, d_n = qk_nope_head_dim, d_r = qk_rope_head_dim, d_v =
// v_head_dim; the rank computes its heads, chunk_range(H, p, r)):
//   q [H, d_n + d_r] = x W_q^T, or RMSNorm(x W_qa^T) W_qb^T with q_lora_rank (q_a_layernorm);
//   [c_kv | k_pe] [r_kv + d_r] = x W_kva^T (kv_a_proj_with_mqa); c_kv = RMSNorm(c_kv) (kv_a_layernorm);
//   RoPE on q's last d_r values of every head and on k_pe (one k_pe shared by every head), at the token's position,
//   in the config's pairing: transformers' DeepseekV2 rotates interleaved pairs (x[2j], x[2j+1]) as complex numbers,
//   DeepseekV3 permutes interleaved to halves and then rotates halves (rope_interleave); both rotate the same pairs
//   and permute q and k alike, so the scores equal interleaved RoPE on the stored order (halves when
//   rope_interleave is false);
//   the cache stores [c_kv | k_pe] (r_kv + d_r floats per token and layer, replicated on every rank: the latent is
//   every head's), not the H (d_n + d_r + d_v) of the decompressed keys and values.
// At use the up-projection W_kvb [H (d_n + d_v), r_kv] is absorbed: for head i, with W_uk = its first d_n rows and
// W_uv its last d_v rows,
//   score_t = (q_nope W_uk) . c_kv_t + q_pe . k_pe_t, times softmax_scale = (d_n + d_r)^-1/2 (under YaRN also times
//   mscale(factor, mscale_all_dim)^2, and RoPE with YaRN's frequencies and attention factor: serve/yarn_rope.hpp),
//   out_i = W_uv (sum_t softmax(score)_t c_kv_t)      (equal to attention over k_nope = W_uk c_kv, v = W_uv c_kv).
// The heads' outputs [n, H_r d_v] times this rank's rows of W_o^T give the rank's partial output (all-reduced by
// the caller). RMSNorms of the latents use epsilon 1e-6 (transformers builds them with its default, not rms_norm_eps).
#pragma once

#include "paradyse/ops/backend.hpp"
#include "paradyse/serve/paged_kv_cache.hpp"
#include "paradyse/serve/rank_shard.hpp"
#include "paradyse/serve/yarn_rope.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

namespace paradyse::serve {

// One chunk of the batch: its request, first row in the step's activations and token count.
struct AttentionChunk {
  std::int64_t request = 0, first = 0, length = 0;
};

inline constexpr float kMlaLatentNormEps = 1e-6f;  // q_a_layernorm, kv_a_layernorm (transformers' default)

// y [n, h] = this rank's partial MLA output for the normalised activations xn [n, h]; appends the chunks' latents
// to the cache (layer `layer`) before attending.
inline void mla_attention(const DecoderConfig& c, const RankShard& s, const RankLayer& L, PagedKvCache& cache,
                          std::int64_t layer, std::span<const AttentionChunk> chunks, TensorView<const float> xn,
                          TensorView<float> y) {
  using Backend = ops::Cpu;
  const MlaShape& a = c.mla;
  const std::int64_t n = xn.extent(0), h = c.hidden, hq = s.q_heads.length, dn = a.nope, dr = a.rope, dv = a.v,
                     qk = dn + dr, rkv = a.kv_lora_rank, latent = rkv + dr;
  Backend::fill(y, 0.0f);
  if (n == 0) return;
  // q [n, hq qk]
  Tensor<float> q(Shape{n, hq * qk});
  if (a.q_lora_rank > 0) {
    Tensor<float> qa(Shape{n, a.q_lora_rank}), rstd(Shape{n});
    Backend::matmul(xn, ops::Transpose::no, L.wq_a.view(), ops::Transpose::yes, qa.view());
    Backend::rms_norm_forward(qa.view(), L.q_a_norm.view(), kMlaLatentNormEps, qa.view(), rstd.view());
    Backend::matmul(qa.view(), ops::Transpose::no, L.wq.view(), ops::Transpose::yes, q.view());
  } else {
    Backend::matmul(xn, ops::Transpose::no, L.wq.view(), ops::Transpose::yes, q.view());
  }
  // [c_kv | k_pe] [n, r_kv + d_r]; c_kv normalised in place.
  Tensor<float> kv(Shape{n, latent}), rstd(Shape{n});
  Backend::matmul(xn, ops::Transpose::no, L.wkv_a.view(), ops::Transpose::yes, kv.view());
  {
    Tensor<float> ckv(Shape{n, rkv});
    copy(kv.view().slice(1, 0, rkv), ckv.view());
    Backend::rms_norm_forward(ckv.view(), L.kv_a_norm.view(), kMlaLatentNormEps, ckv.view(), rstd.view());
    copy(ckv.view(), kv.view().slice(1, 0, rkv));
  }
  // RoPE of q_pe (every head) and k_pe, on contiguous copies.
  const ops::RopeConfig rope{c.rope_theta, a.interleaved_rope ? ops::RopeLayout::interleaved : ops::RopeLayout::halves};
  // Under YaRN (c.yarn): its blended frequencies, cos and sin times its attention factor (serve/yarn_rope.hpp).
  const std::vector<double> frequencies =
      c.yarn.enabled() ? rope_inverse_frequencies(c.rope_theta, dr, c.yarn) : std::vector<double>{};
  const double amplitude = yarn_attention_factor(c.yarn);
  Tensor<float> q_pe(Shape{n, hq, dr}), k_pe(Shape{n, 1, dr});
  copy(q.view().reshape(Shape{n, hq, qk}).slice(2, dn, dr), q_pe.view());
  copy(kv.view().slice(1, rkv, dr), k_pe.view().reshape(Shape{n, dr}));
  for (const AttentionChunk& ch : chunks) {
    const std::int64_t start = cache.length(ch.request);
    const TensorView<float> qb = q_pe.view().slice(0, ch.first, ch.length).reshape(Shape{1, ch.length, hq, dr});
    const TensorView<float> kb = k_pe.view().slice(0, ch.first, ch.length).reshape(Shape{1, ch.length, 1, dr});
    if (c.yarn.enabled()) {
      rotate_scaled(qb, start, frequencies, amplitude, a.interleaved_rope);
      rotate_scaled(kb, start, frequencies, amplitude, a.interleaved_rope);
    } else {
      Backend::rope_forward(qb, qb, start, rope);
      Backend::rope_forward(kb, kb, start, rope);
    }
  }
  copy(k_pe.view().reshape(Shape{n, dr}), kv.view().slice(1, rkv, dr));
  Tensor<float> attn(Shape{n, hq * dv});
  std::vector<double> q_lat(static_cast<std::size_t>(rkv)), o_lat(static_cast<std::size_t>(rkv));
  std::vector<double> scores;
  const double scale = yarn_softmax_factor(c.yarn) / std::sqrt(double(qk));
  const std::int64_t rows_per_head = dn + dv;
  const float* wkvb = L.wkv_b.data();  // [hq (d_n + d_v), r_kv]: this rank's heads
  for (const AttentionChunk& ch : chunks) {
    const std::int64_t start = cache.length(ch.request);
    cache.append(ch.request, layer, kv.view().slice(0, ch.first, ch.length).reshape(Shape{ch.length, 1, latent}), {});
    for (std::int64_t i = 0; i < ch.length; ++i) {
      const std::int64_t row = ch.first + i, visible = start + i + 1;
      scores.resize(std::size_t(visible));
      for (std::int64_t head = 0; head < hq; ++head) {
        const float* qn = &q(row, head * qk);
        const float* qp = &q_pe(row, head, 0);
        const float* uk = wkvb + head * rows_per_head * rkv;
        std::fill(q_lat.begin(), q_lat.end(), 0.0);
        for (std::int64_t j = 0; j < dn; ++j)
          for (std::int64_t r = 0; r < rkv; ++r) q_lat[std::size_t(r)] += double(qn[j]) * uk[j * rkv + r];
        double top = -INFINITY;
        for (std::int64_t t = 0; t < visible; ++t) {
          const float* lt = cache.key(ch.request, layer, t, 0);
          double dot = 0;
          for (std::int64_t r = 0; r < rkv; ++r) dot += q_lat[std::size_t(r)] * lt[r];
          for (std::int64_t e = 0; e < dr; ++e) dot += double(qp[e]) * lt[rkv + e];
          scores[std::size_t(t)] = dot * scale;
          top = std::max(top, scores[std::size_t(t)]);
        }
        double total = 0;
        for (std::int64_t t = 0; t < visible; ++t) total += (scores[std::size_t(t)] = std::exp(scores[std::size_t(t)] - top));
        std::fill(o_lat.begin(), o_lat.end(), 0.0);
        for (std::int64_t t = 0; t < visible; ++t) {
          const float* lt = cache.key(ch.request, layer, t, 0);
          const double p = scores[std::size_t(t)] / total;
          for (std::int64_t r = 0; r < rkv; ++r) o_lat[std::size_t(r)] += p * lt[r];
        }
        const float* uv = uk + dn * rkv;
        float* out = &attn(row, head * dv);
        for (std::int64_t e = 0; e < dv; ++e) {
          double v = 0;
          for (std::int64_t r = 0; r < rkv; ++r) v += double(uv[e * rkv + r]) * o_lat[std::size_t(r)];
          out[e] = float(v);
        }
      }
    }
  }
  if (hq > 0) Backend::matmul(attn.view(), ops::Transpose::no, L.wo_t.view(), ops::Transpose::no, y);
  (void)h;
}

}  // namespace paradyse::serve
