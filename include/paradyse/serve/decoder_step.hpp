// paradyse/serve/decoder_step.hpp: one forward step of the decoder over a batch of sequence chunks, on rank r of p.
//
// A batch holds chunks of several requests (continuous batching): a prompt chunk (prefill, possibly one of several
// for a long prompt) or one decode token. Each chunk's tokens follow what the request's cache already holds
// (positions cache.length .. + len). The activations [n, h] of all chunks are replicated on every rank; per layer:
//   attention: RMSNorm; q, k, v for this rank's heads (+ biases; OLMoE: RMSNorm of the whole q and k, its sum of
//   squares all-reduced); RoPE at each token's position; k, v appended to this rank's paged cache (sharded by
//   heads); causal attention of each chunk over its request's cache; the o projection of this rank's heads; the
//   partial outputs summed by an all-reduce; residual.
//   FFN: RMSNorm; dense SwiGLU sliced by columns, or the MoE sublayer: the router (replicated, so every rank routes
//   alike), the tokens permuted by expert (moe/dispatch.hpp), the routed experts in the layer's mode (tp: every
//   expert's column slice over its whole block; ep: this rank's whole experts over the rows an ExpertWork assigns
//   it), the shared expert sliced by columns times its sigmoid gate; the partial outputs all-reduced; residual.
// Logits (replicated lm_head) for the last token of each chunk, or for every token when the chunk asks.
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/moe/dispatch.hpp"
#include "paradyse/moe/experts.hpp"
#include "paradyse/moe/router.hpp"
#include "paradyse/ops/backend.hpp"
#include "paradyse/serve/paged_kv_cache.hpp"
#include "paradyse/serve/rank_shard.hpp"
#include "paradyse/strategy/buffer_pool.hpp"

#include <cmath>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

namespace paradyse::serve {

struct SequenceChunk {
  std::int64_t request = 0;
  std::vector<std::int32_t> tokens;  // appended after what the request's cache holds
  bool all_logits = false;           // logits of every token (else the last one only)
};

// What one MoE layer saw in a step (for the cost model, EPLB's statistics and the reports).
struct MoeLayerLoad {
  std::vector<std::int64_t> routed;      // [E]: (token, expert) pairs per expert
  std::vector<std::int64_t> rank_rows;   // [p]: rows each rank computed
};

struct StepResult {
  std::vector<Tensor<float>> logits;       // per chunk: [rows, V]
  std::vector<MoeLayerLoad> moe_load;      // per layer (empty for dense layers)
};

// Which rows of each expert block a rank computes in EP mode, given the dispatch. The default splits an expert's
// block evenly over the ranks that hold it (replicas). `work(rank, dispatch)` returns, per slot of the rank, the
// [begin, end) range of permuted rows (a slot may take rows of its expert only).
struct ExpertWork {
  std::vector<std::int64_t> begin, end;  // per slot
};
using ExpertWorkFn = std::function<ExpertWork(const RankShard&, std::int64_t layer, const Dispatch&)>;

// Replicas split their expert's block evenly (holder i of m takes part i).
inline ExpertWork split_over_replicas(const std::vector<std::vector<std::int64_t>>& experts_of_rank, int rank,
                                      const Dispatch& d) {
  ExpertWork w;
  const std::vector<std::int64_t>& mine = experts_of_rank[std::size_t(rank)];
  for (std::size_t s = 0; s < mine.size(); ++s) {
    const std::int64_t e = mine[s];
    std::int64_t holders = 0, index = 0;
    for (int q = 0; q < int(experts_of_rank.size()); ++q)
      for (std::size_t t = 0; t < experts_of_rank[std::size_t(q)].size(); ++t)
        if (experts_of_rank[std::size_t(q)][t] == e) {
          if (q < rank || (q == rank && t < s)) ++index;
          ++holders;
        }
    const ChunkRange part = chunk_range(d.count(e), holders, index);
    w.begin.push_back(d.offsets[std::size_t(e)] + part.start);
    w.end.push_back(d.offsets[std::size_t(e)] + part.end());
  }
  return w;
}

namespace step_detail {

using Backend = ops::Cpu;

template <Communicator C>
void sum_over_ranks(C& comm, TensorView<float> x) {
  if (comm.size() > 1 && x.numel() > 0) comm.all_reduce(std::span<const float>(x.span()), x.span(), ReduceOp::sum);
}

// y [n, h] = SwiGLU bank of one expert over every row of x (a dense FFN or a shared expert slice).
inline void dense_swiglu(TensorView<const float> in, TensorView<const float> out, TensorView<const float> x,
                         TensorView<float> y, BufferPool& pool) {
  const std::int64_t n = x.extent(0), width = out.extent(1);
  Backend::fill(y, 0.0f);
  if (n == 0 || width == 0) return;
  const std::int64_t offsets[] = {0, n};
  PooledBuffer<float> pre = pool.acquire<float>(Shape{n, 2 * width});
  experts_forward<Backend>({in, out}, offsets, x, pre.view(), y, pool);
}

// out [rows, cols] = x W^T (+ bias).
inline void linear(TensorView<const float> x, const Tensor<float>& w, const Tensor<float>& bias, TensorView<float> out) {
  if (x.extent(0) == 0 || w.numel() == 0) return;
  Backend::matmul(x, ops::Transpose::no, w.view(), ops::Transpose::yes, out);
  if (bias.numel() == 0) return;
  for (std::int64_t i = 0; i < out.extent(0); ++i)
    for (std::int64_t j = 0; j < out.extent(1); ++j) out(i, j) += bias.data()[j];
}

// Scales each row of x [n, w] by rstd[i] * gamma (an RMSNorm whose statistics were summed elsewhere).
inline void scale_rows(TensorView<float> x, std::span<const float> rstd, const Tensor<float>& gamma) {
  for (std::int64_t i = 0; i < x.extent(0); ++i)
    for (std::int64_t j = 0; j < x.extent(1); ++j) x(i, j) *= rstd[std::size_t(i)] * gamma.data()[j];
}

}  // namespace step_detail

// The MoE sublayer's partial output y [n, h] on this rank (summed over ranks by the caller).
template <Communicator C>
MoeLayerLoad moe_partial(C& comm, const DecoderConfig& c, const RankShard& s, std::int64_t layer_index,
                         TensorView<const float> x, TensorView<float> y, BufferPool& pool, const ExpertWorkFn& work) {
  using Backend = ops::Cpu;
  const RankLayer& L = s.layers[std::size_t(layer_index)];
  const MoeConfig& m = c.moe;
  const std::int64_t n = x.extent(0), h = c.hidden;
  MoeLayerLoad load;
  load.rank_rows.assign(std::size_t(s.ranks), 0);
  Backend::fill(y, 0.0f);
  const Routing r = route<Backend>(m, L.router.view(), x);
  const Dispatch d = dispatch_by_expert(r.offsets, r.expert, m.experts);
  load.routed = d.routed;
  if (L.mode == MoeMode::tp) {
    const std::int64_t rows = d.rows();
    Tensor<float> xp(Shape{rows, h}), hp(Shape{rows, h}), wp(Shape{rows}), pre(Shape{rows, 2 * L.expert_out.extent(1)});
    permute_tokens<Backend>(d, x, xp.view());
    if (L.expert_out.extent(1) > 0)
      experts_forward<Backend>({L.expert_in.view(), L.expert_out.view()}, d.offsets, xp.view(), pre.view(), hp.view(),
                               pool);
    permuted_gates<Backend>(d, r.gates.view(), wp.view());
    combine<Backend>(d, hp.view(), wp.view(), y);
    for (int q = 0; q < s.ranks; ++q) load.rank_rows[std::size_t(q)] = rows;
  } else {
    const ExpertWork w = work ? work(s, layer_index, d) : split_over_replicas(L.placement, s.rank, d);
    const std::int64_t slots = std::int64_t(L.slot_expert.size());
    check(std::int64_t(w.begin.size()) == slots && std::int64_t(w.end.size()) == slots,
          "moe_partial: the expert work lists {} slots, rank {} holds {}", w.begin.size(), s.rank, slots);
    std::vector<std::int64_t> offsets{0}, tokens, assignment;
    for (std::int64_t k = 0; k < slots; ++k) {
      const std::int64_t e = L.slot_expert[std::size_t(k)];
      check(w.begin[std::size_t(k)] >= d.offsets[std::size_t(e)] && w.end[std::size_t(k)] <= d.offsets[std::size_t(e + 1)] &&
                w.begin[std::size_t(k)] <= w.end[std::size_t(k)],
            "moe_partial: slot {} (expert {}) is given rows [{}, {}) outside its block [{}, {})", k, e,
            w.begin[std::size_t(k)], w.end[std::size_t(k)], d.offsets[std::size_t(e)], d.offsets[std::size_t(e + 1)]);
      for (std::int64_t row = w.begin[std::size_t(k)]; row < w.end[std::size_t(k)]; ++row) {
        tokens.push_back(d.token[std::size_t(row)]);
        assignment.push_back(d.slot[std::size_t(row)]);
      }
      offsets.push_back(std::int64_t(tokens.size()));
    }
    const std::int64_t rows = std::int64_t(tokens.size());
    Tensor<float> xs(Shape{rows, h}), hs(Shape{rows, h}), ws(Shape{rows}), pre(Shape{rows, 2 * m.expert_ffn});
    for (std::int64_t i = 0; i < rows; ++i) ws.data()[i] = r.gates.data()[assignment[std::size_t(i)]];
    if (rows > 0) {
      Backend::gather_rows(x, tokens, {}, xs.view());
      experts_forward<Backend>({L.expert_in.view(), L.expert_out.view()}, offsets, xs.view(), pre.view(), hs.view(), pool);
      Backend::scatter_add_rows(y, tokens, hs.view(), ws.view());
    }
    std::vector<std::int64_t> counts(std::size_t(s.ranks), 0);
    counts[std::size_t(s.rank)] = rows;
    if (s.ranks > 1) comm.all_reduce(std::span<const std::int64_t>(counts), std::span<std::int64_t>(counts), ReduceOp::sum);
    load.rank_rows = counts;
  }
  if (m.has_shared() && L.shared_out.extent(1) > 0) {
    Tensor<float> sy(Shape{n, h});
    step_detail::dense_swiglu(L.shared_in.view(), L.shared_out.view(), x, sy.view(), pool);
    if (m.shared_gate) {
      Tensor<float> z(Shape{n, 1}), sig(Shape{n});
      if (n > 0) Backend::matmul(x, ops::Transpose::no, L.shared_gate.view(), ops::Transpose::yes, z.view());
      Backend::sigmoid_forward(z.view().reshape(Shape{n}), sig.view());
      Backend::scatter_add_rows(y, {}, sy.view(), sig.view());
    } else {
      Backend::add_into(y, sy.view());
    }
  }
  return load;
}

// One step over `batch` on this rank. The cache must have room (PagedKvCache::reserve) for every chunk's tokens.
template <Communicator C>
StepResult decoder_step(C& comm, const DecoderConfig& c, const RankShard& s, PagedKvCache& cache,
                        std::span<const SequenceChunk> batch, BufferPool& pool, const ExpertWorkFn& work = {}) {
  using Backend = ops::Cpu;
  using namespace step_detail;
  const std::int64_t h = c.hidden, d = c.head_dim, hq = s.q_heads.length, hk = s.kv_heads.length,
                     group = c.heads / c.kv_heads;
  std::int64_t n = 0;
  std::vector<std::int64_t> first;  // first row of each chunk
  for (const SequenceChunk& ch : batch) {
    check(!ch.tokens.empty(), "decoder_step: request {} has an empty chunk", ch.request);
    first.push_back(n);
    n += std::int64_t(ch.tokens.size());
  }
  StepResult result;
  result.moe_load.resize(std::size_t(c.layers));
  Tensor<float> x(Shape{n, h}), xn(Shape{n, h}), rstd(Shape{n}), q(Shape{n, hq * d}), k(Shape{n, hk * d}),
      v(Shape{n, hk * d}), attn(Shape{n, hq * d}), y(Shape{n, h});
  for (std::size_t b = 0; b < batch.size(); ++b)
    for (std::size_t i = 0; i < batch[b].tokens.size(); ++i) {
      const std::int32_t t = batch[b].tokens[i];
      check(t >= 0 && t < c.vocab, "decoder_step: request {} has token {}, outside the vocabulary [0, {})",
            batch[b].request, t, c.vocab);
      copy(s.whole->embed.view().slice(0, t, 1), x.view().slice(0, first[b] + std::int64_t(i), 1));
    }
  // How many ranks hold each of this rank's key/value heads (their k-norm statistics are counted once).
  std::vector<float> kv_share(std::size_t(hk), 0.0f);
  for (int r = 0; r < s.ranks; ++r) {
    const ChunkRange other = kv_heads_of(c, s.ranks, r);
    for (std::int64_t j = 0; j < hk; ++j)
      if (other.contains(s.kv_heads.start + j)) kv_share[std::size_t(j)] += 1.0f;
  }
  const float scale = 1.0f / std::sqrt(float(d));
  std::vector<float> scores;
  for (std::int64_t l = 0; l < c.layers; ++l) {
    const RankLayer& L = s.layers[std::size_t(l)];
    // ---- attention ----
    Backend::rms_norm_forward(x.view(), L.attn_norm.view(), float(c.rms_eps), xn.view(), rstd.view());
    linear(xn.view(), L.wq, L.bq, q.view());
    linear(xn.view(), L.wk, L.bk, k.view());
    linear(xn.view(), L.wv, L.bv, v.view());
    if (c.qk_norm) {  // RMSNorm over the whole projections: sums of squares over every rank's heads
      std::vector<float> sums(std::size_t(2 * n), 0.0f);
      for (std::int64_t i = 0; i < n; ++i) {
        double sq = 0, sk = 0;
        for (std::int64_t j = 0; j < hq * d; ++j) sq += double(q(i, j)) * q(i, j);
        for (std::int64_t j = 0; j < hk * d; ++j) sk += double(k(i, j)) * k(i, j) / kv_share[std::size_t(j / d)];
        sums[std::size_t(i)] = float(sq);
        sums[std::size_t(n + i)] = float(sk);
      }
      if (s.ranks > 1) comm.all_reduce(std::span<const float>(sums), std::span<float>(sums), ReduceOp::sum);
      std::vector<float> rq(static_cast<std::size_t>(n)), rk(static_cast<std::size_t>(n));
      for (std::int64_t i = 0; i < n; ++i) {
        rq[std::size_t(i)] = 1.0f / std::sqrt(sums[std::size_t(i)] / float(c.q_width()) + float(c.rms_eps));
        rk[std::size_t(i)] = 1.0f / std::sqrt(sums[std::size_t(n + i)] / float(c.kv_width()) + float(c.rms_eps));
      }
      scale_rows(q.view(), rq, L.q_norm);
      scale_rows(k.view(), rk, L.k_norm);
    }
    const ops::RopeConfig rope{c.rope_theta, ops::RopeLayout::halves};
    for (std::size_t b = 0; b < batch.size(); ++b) {
      const std::int64_t len = std::int64_t(batch[b].tokens.size()), start = cache.length(batch[b].request);
      const TensorView<float> qb = q.view().slice(0, first[b], len).reshape(Shape{1, len, hq, d});
      const TensorView<float> kb = k.view().slice(0, first[b], len).reshape(Shape{1, len, hk, d});
      Backend::rope_forward(qb, qb, start, rope);
      Backend::rope_forward(kb, kb, start, rope);
      cache.append(batch[b].request, l, kb.reshape(Shape{len, hk, d}),
                   v.view().slice(0, first[b], len).reshape(Shape{len, hk, d}));
      // Causal attention of the chunk's queries over positions [0, start + i].
      for (std::int64_t i = 0; i < len; ++i) {
        const std::int64_t visible = start + i + 1;
        scores.resize(std::size_t(visible));
        for (std::int64_t head = 0; head < hq; ++head) {
          const std::int64_t kv = (s.q_heads.start + head) / group - s.kv_heads.start;
          const float* qi = &q(first[b] + i, head * d);
          float top = -INFINITY;
          for (std::int64_t t = 0; t < visible; ++t) {
            const float* kt = cache.key(batch[b].request, l, t, kv);
            float dot = 0;
            for (std::int64_t e = 0; e < d; ++e) dot += qi[e] * kt[e];
            scores[std::size_t(t)] = dot * scale;
            top = std::max(top, scores[std::size_t(t)]);
          }
          float total = 0;
          for (std::int64_t t = 0; t < visible; ++t) total += (scores[std::size_t(t)] = std::exp(scores[std::size_t(t)] - top));
          float* out = &attn(first[b] + i, head * d);
          for (std::int64_t e = 0; e < d; ++e) out[e] = 0;
          for (std::int64_t t = 0; t < visible; ++t) {
            const float* vt = cache.value(batch[b].request, l, t, kv);
            const float p = scores[std::size_t(t)] / total;
            for (std::int64_t e = 0; e < d; ++e) out[e] += p * vt[e];
          }
        }
      }
    }
    if (n > 0) Backend::matmul(attn.view(), ops::Transpose::no, L.wo_t.view(), ops::Transpose::no, y.view());
    sum_over_ranks(comm, y.view());
    Backend::add_into(x.view(), y.view());
    // ---- FFN ----
    Backend::rms_norm_forward(x.view(), L.ffn_norm.view(), float(c.rms_eps), xn.view(), rstd.view());
    if (c.is_moe(l))
      result.moe_load[std::size_t(l)] = moe_partial(comm, c, s, l, xn.view(), y.view(), pool, work);
    else
      dense_swiglu(L.dense_in.view(), L.dense_out.view(), xn.view(), y.view(), pool);
    sum_over_ranks(comm, y.view());
    Backend::add_into(x.view(), y.view());
  }
  // ---- final norm and logits ----
  Backend::rms_norm_forward(x.view(), s.whole->norm.view(), float(c.rms_eps), xn.view(), rstd.view());
  for (std::size_t b = 0; b < batch.size(); ++b) {
    const std::int64_t len = std::int64_t(batch[b].tokens.size());
    const std::int64_t rows = batch[b].all_logits ? len : 1, from = first[b] + len - rows;
    Tensor<float> logits(Shape{rows, c.vocab});
    Backend::matmul(xn.view().slice(0, from, rows), ops::Transpose::no, s.whole->lm_head.view(), ops::Transpose::yes,
                    logits.view());
    result.logits.push_back(std::move(logits));
  }
  return result;
}

}  // namespace paradyse::serve
