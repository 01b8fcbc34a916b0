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
//
// Generic over the backend and the cache, as decoder_step (serve/decoder_step.hpp): the projections, norms, RoPE and
// copies are backend ops, and the absorption is two batched GEMMs of one item per head (q_nope [n, d_n] x W_uk [d_n,
// r_kv], then the latent output [n, r_kv] x W_uv^T [r_kv, d_v]). The attention over the latent cache is a loop on the
// CPU in float64 over every head of a query at once (mla_detail::latent_attention); a dry run (ops::Counting) records
// it as one latent-attention event of the step's visible query-key pairs over the rank's heads, at width r_kv + d_r / 2
// (its 4 d flops a visit are the score's 2 (r_kv + d_r) and the weighted sum's 2 r_kv), priced by the profile's model
// of this loop (serve/paged_attention_calibration.hpp measures it), and the stream that reads each position's latent
// once; each chunk's latent append is a stream of its own. serve/step_cost.hpp prices the same kernels.
#pragma once

#include "paradyse/ops/backend.hpp"
#include "paradyse/serve/paged_attention.hpp"
#include "paradyse/serve/rank_shard.hpp"
#include "paradyse/serve/step_record.hpp"
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

namespace mla_detail {

// RoPE of x [1, len, heads, d_r] in place, at positions start, start + 1, ...: the backend's kernel, or under YaRN
// rotate_scaled (host code, recorded as the backend records its RoPE kernel: the stream, and a cos and a sin per
// token and frequency).
template <class Backend>
void rotate(const DecoderConfig& c, TensorView<float> x, std::int64_t start, std::span<const double> frequencies) {
  const bool interleaved = c.mla.interleaved_rope;
  if (!c.yarn.enabled()) {
    const ops::RopeConfig rope{c.rope_theta, interleaved ? ops::RopeLayout::interleaved : ops::RopeLayout::halves};
    Backend::rope_forward(x, x, start, rope);
    return;
  }
  if constexpr (!step_detail::records<Backend>)
    rotate_scaled(x, start, frequencies, yarn_attention_factor(c.yarn), interleaved);
  step_detail::note_stream(2 * double(x.numel()), ElementwiseFamily::rope);
  step_detail::note({.kind = TraceKind::transcendental, .m = double(x.extent(1)) * double(x.extent(3)),
                     .n = 1});  // 1: cos or sin (cost::ScalarFunction::sincos)
}

// Scratch of latent_attention, kept across a step's chunks.
struct LatentScratch {
  std::vector<double> queries;  // [r_kv + d_r, H_r]: one query's [q_lat | q_pe], position-major
  std::vector<double> dots;     // [H_r]
  std::vector<double> scores;   // [H_r, visible]: the scores, then their softmax
  std::vector<double> sums;     // [H_r, r_kv]
};

// o_lat [len, H_r, r_kv] (the chunk's rows of the step's) = for each query and head, the softmax-weighted sum of the
// latents c_kv of its request's visible positions, scored by q_lat . c_kv_t + q_pe . k_pe_t (times `scale`). Each
// query reads every visible latent twice, for all its heads at once: once for the scores (the heads' dot products
// side by side, which the compiler vectorises), once for the sums. Each head adds its terms in the order it would
// alone (the dot over c_kv then k_pe, the sums over t), so the heads' results do not depend on their count.
template <class Cache>
void latent_attention(const Cache& cache, std::int64_t layer, const AttentionChunk& ch, std::int64_t start,
                      double scale, TensorView<const float> q_lat, TensorView<const float> q_pe,
                      TensorView<float> o_lat, LatentScratch& w) {
  const std::int64_t hq = q_lat.extent(1), rkv = q_lat.extent(2), dr = q_pe.extent(2), latent = rkv + dr;
  w.queries.resize(std::size_t(latent * hq));
  w.dots.resize(std::size_t(hq));
  w.sums.resize(std::size_t(hq * rkv));
  for (std::int64_t i = 0; i < ch.length; ++i) {
    const std::int64_t row = ch.first + i, visible = start + i + 1;
    w.scores.resize(std::size_t(hq * visible));
    const auto score = [&](std::int64_t head, std::int64_t t) -> double& {
      return w.scores[std::size_t(head * visible + t)];
    };
    for (std::int64_t head = 0; head < hq; ++head) {
      for (std::int64_t r = 0; r < rkv; ++r) w.queries[std::size_t(r * hq + head)] = q_lat(row, head, r);
      for (std::int64_t e = 0; e < dr; ++e) w.queries[std::size_t((rkv + e) * hq + head)] = q_pe(row, head, e);
    }
    double* dots = w.dots.data();
    for (std::int64_t t = 0; t < visible; ++t) {
      const float* lt = cache.key(ch.request, layer, t, 0);  // [c_kv | k_pe]
      std::fill(w.dots.begin(), w.dots.end(), 0.0);
      for (std::int64_t x = 0; x < latent; ++x) {
        const double* q = &w.queries[std::size_t(x * hq)];
        const double l = lt[x];
        for (std::int64_t head = 0; head < hq; ++head) dots[head] += q[head] * l;
      }
      for (std::int64_t head = 0; head < hq; ++head) score(head, t) = dots[head] * scale;
    }
    for (std::int64_t head = 0; head < hq; ++head) {  // softmax over each head's visible positions
      double top = -INFINITY, total = 0;
      for (std::int64_t t = 0; t < visible; ++t) top = std::max(top, score(head, t));
      for (std::int64_t t = 0; t < visible; ++t) total += (score(head, t) = std::exp(score(head, t) - top));
      for (std::int64_t t = 0; t < visible; ++t) score(head, t) /= total;
    }
    std::fill(w.sums.begin(), w.sums.end(), 0.0);
    for (std::int64_t t = 0; t < visible; ++t) {
      const float* lt = cache.key(ch.request, layer, t, 0);
      for (std::int64_t head = 0; head < hq; ++head) {
        const double p = score(head, t);
        double* acc = &w.sums[std::size_t(head * rkv)];
        for (std::int64_t r = 0; r < rkv; ++r) acc[r] += p * lt[r];
      }
    }
    for (std::int64_t head = 0; head < hq; ++head) {
      float* out = &o_lat(row, head, 0);
      for (std::int64_t r = 0; r < rkv; ++r) out[r] = float(w.sums[std::size_t(head * rkv + r)]);
    }
  }
}

// The trace event of latent_attention over a batch: `pairs` visible query-key pairs, `heads` query heads, a latent of
// r_kv + d_r floats (recorded at width r_kv + d_r / 2: the score's and the sum's 4 d flops a visit).
inline TraceEvent latent_attention_event(double pairs, std::int64_t heads, std::int64_t rkv, std::int64_t dr) {
  return {.kind = TraceKind::latent_attention, .m = pairs, .n = double(heads), .k = double(rkv + dr / 2)};
}

}  // namespace mla_detail

// y [n, h] = this rank's partial MLA output for the normalised activations xn [n, h]; appends the chunks' latents
// to the cache (layer `layer`) before attending. A dry run (ops::Counting, a cache that knows lengths only) records.
template <class Backend = ops::Cpu, class Cache>
void mla_attention(const DecoderConfig& c, const RankShard& s, const RankLayer& L, Cache& cache, std::int64_t layer,
                   std::span<const AttentionChunk> chunks, TensorView<const float> xn, TensorView<float> y) {
  constexpr bool dry = step_detail::records<Backend>;
  constexpr ops::Transpose no = ops::Transpose::no, yes = ops::Transpose::yes;
  const MlaShape& a = c.mla;
  const std::int64_t n = xn.extent(0), hq = s.q_heads.length, dn = a.nope, dr = a.rope, dv = a.v, qk = dn + dr,
                     rkv = a.kv_lora_rank, latent = rkv + dr;
  if (n == 0) return;
  // q [n, H_r qk]
  Tensor<float> q(Shape{n, hq * qk});
  if (a.q_lora_rank > 0) {
    Tensor<float> qa(Shape{n, a.q_lora_rank}), rstd(Shape{n});
    Backend::matmul(xn, no, L.wq_a.view(), yes, qa.view());
    Backend::rms_norm_forward(qa.view(), L.q_a_norm.view(), kMlaLatentNormEps, qa.view(), rstd.view());
    Backend::matmul(qa.view(), no, L.wq.view(), yes, q.view());
  } else {
    Backend::matmul(xn, no, L.wq.view(), yes, q.view());
  }
  // [c_kv | k_pe] [n, r_kv + d_r]; c_kv normalised (on a contiguous copy).
  Tensor<float> kv(Shape{n, latent});
  Backend::matmul(xn, no, L.wkv_a.view(), yes, kv.view());
  {
    Tensor<float> ckv(Shape{n, rkv}), rstd(Shape{n});
    Backend::copy(kv.view().slice(1, 0, rkv), ckv.view());
    Backend::rms_norm_forward(ckv.view(), L.kv_a_norm.view(), kMlaLatentNormEps, ckv.view(), rstd.view());
    Backend::copy(ckv.view(), kv.view().slice(1, 0, rkv));
  }
  // RoPE of q_pe [n, H_r, d_r] (every head) and k_pe [n, 1, d_r] at each chunk's positions, on contiguous copies;
  // k_pe back into the latent row. Under YaRN (c.yarn): its blended frequencies, cos and sin times its attention
  // factor (serve/yarn_rope.hpp).
  Tensor<float> q_pe(Shape{n, hq, dr}), k_pe(Shape{n, 1, dr});
  Backend::copy(q.view().reshape(Shape{n, hq, qk}).slice(2, dn, dr), q_pe.view());
  Backend::copy(kv.view().slice(1, rkv, dr), k_pe.view().reshape(Shape{n, dr}));
  const std::vector<double> frequencies =
      c.yarn.enabled() ? rope_inverse_frequencies(c.rope_theta, dr, c.yarn) : std::vector<double>{};
  for (const AttentionChunk& ch : chunks) {
    const std::int64_t start = cache.length(ch.request);
    mla_detail::rotate<Backend>(c, q_pe.view().slice(0, ch.first, ch.length).reshape(Shape{1, ch.length, hq, dr}),
                                start, frequencies);
    mla_detail::rotate<Backend>(c, k_pe.view().slice(0, ch.first, ch.length).reshape(Shape{1, ch.length, 1, dr}),
                                start, frequencies);
  }
  Backend::copy(k_pe.view().reshape(Shape{n, dr}), kv.view().slice(1, rkv, dr));
  // Head i's rows of W_kvb [H_r (d_n + d_v), r_kv]: W_uk [d_n, r_kv], then W_uv [d_v, r_kv]. The absorption's two
  // batched GEMMs, one item a head: q_lat [n, H_r, r_kv] = q_nope W_uk; attn [n, H_r d_v] = o_lat W_uv^T.
  Tensor<float> q_lat(Shape{n, hq, rkv}), o_lat(Shape{n, hq, rkv}), attn(Shape{n, hq * dv});
  ops::GemmItems absorb, expand;
  for (std::int64_t head = 0; head < hq; ++head) {
    const float* w = L.wkv_b.data() + head * (dn + dv) * rkv;
    absorb.add(q.data() + head * qk, w, q_lat.data() + head * rkv);
    expand.add(o_lat.data() + head * rkv, w + dn * rkv, attn.data() + head * dv);
  }
  if (dn > 0)
    Backend::gemm_batched(no, no, n, rkv, dn, 1.0f, absorb.a, hq * qk, absorb.b, rkv, 0.0f, absorb.c, hq * rkv);
  else
    Backend::fill(q_lat.view(), 0.0f);
  // Each chunk's latents into the cache, then its queries over their request's latents.
  const double scale = yarn_softmax_factor(c.yarn) / std::sqrt(double(qk));
  double pairs = 0, positions = 0;  // the step's visible query-key pairs; the positions whose latents are read
  mla_detail::LatentScratch scratch;
  for (const AttentionChunk& ch : chunks) {
    const std::int64_t start = cache.length(ch.request);
    pairs += chunk_pairs(ch.length, start);
    positions += double(start + ch.length);
    step_detail::note_stream(2 * double(ch.length * latent));  // the append: read, written into the cache's blocks
    if constexpr (!dry) {
      cache.append(ch.request, layer, kv.view().slice(0, ch.first, ch.length).reshape(Shape{ch.length, 1, latent}),
                   {});
      mla_detail::latent_attention(cache, layer, ch, start, scale, q_lat.view(), q_pe.view(), o_lat.view(), scratch);
    }
  }
  step_detail::note(mla_detail::latent_attention_event(pairs, hq, rkv, dr));
  step_detail::note_stream(positions * double(latent));
  Backend::gemm_batched(no, yes, n, dv, rkv, 1.0f, expand.a, hq * rkv, expand.b, rkv, 0.0f, expand.c, hq * dv);
  Backend::matmul(attn.view(), no, L.wo_t.view(), no, y);
}

}  // namespace paradyse::serve
