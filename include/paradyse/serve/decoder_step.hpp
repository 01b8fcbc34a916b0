// paradyse/serve/decoder_step.hpp: one forward step of the decoder over a batch of sequence chunks, on rank r of p.
//
// A batch holds chunks of several requests (continuous batching): a prompt chunk (prefill, possibly one of several
// for a long prompt) or one decode token. Each chunk's tokens follow what the request's cache already holds
// (positions cache.length .. + len). The activations [n, h] of all chunks are replicated on every rank; per layer:
//   attention: RMSNorm; q, k, v for this rank's heads (+ biases; OLMoE: RMSNorm of the whole q and k, its sum of
//   squares all-reduced; Qwen3-MoE: RMSNorm of each head of q and k); RoPE at each token's position; k, v appended
//   to this rank's paged cache (sharded by heads); causal attention of each chunk over its request's cache; the o projection of this rank's heads; the
//   partial outputs summed by an all-reduce; residual. DeepSeek's multi-head latent attention instead (the cache
//   holds the compressed latent): serve/mla_attention.hpp.
//   FFN: RMSNorm; dense SwiGLU sliced by columns, or the MoE sublayer: the router (replicated, so every rank routes
//   alike), the tokens permuted by expert (moe/dispatch.hpp), the routed experts in the layer's mode (tp: every
//   expert's column slice over its whole block; ep: whole experts over the rows the ExpertTasks assign the rank), the shared expert sliced by columns times its sigmoid gate; the partial outputs all-reduced; residual.
// The rows each rank computed in EP (statistics: MoeLayerLoad::rank_rows) travel at the tail of the layer's partial
// outputs' all-reduce: EP runs no collective that TP does not (on a latency-bound link each would cost a launch).
// Logits (replicated lm_head) for the last token of each chunk, or for every token when the chunk asks.
// budget (serve/routing_budget.hpp), when active, routes MoE layer l with its K_l, pooled per chunk under Alloc-T.
// after_layer(l), when given, runs after layer l (the engine posts layer l's weight redistribution there, so that it
// travels while the next layers compute).
//
// Generic over the backend and the cache: with ops::Cpu and a PagedKvCache it computes; with ops::Counting, meta
// weights (core/memory.hpp), the symbolic communicator and a cache that only knows each request's length
// (serve/step_dry_run.hpp's DryKvCache) it is the step's dry run: every kernel, with its shape, and every collective
// are recorded in the thread's Trace (core/trace.hpp), and nothing is computed. The few element loops that are not
// backend ops (the bias adds, OLMoE's q/k norm sums, the KV append and the attention over the paged cache) compute
// on the CPU only and record what they do (serve/step_record.hpp; also on the CPU when a Trace is installed, so a
// CPU step's kernel list can be read off and compared with the dry run's). DeepSeek's latent attention
// (serve/mla_attention.hpp) is generic over the backend and the cache in the same way. The attention over the cache
// (serve/paged_attention.hpp) is one paged-attention kernel for the whole batch: its visible query-key pairs
// (TraceKind::paged_attention, priced per visit by the profile's PagedAttentionModel), then a stream that reads
// every position's keys and values. In a dry run the router sees no data: `loads` ([layers][E]) gives each MoE
// layer's expert loads (the routing source's counts), realised as an assignment of the step's n k rows.
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/trace.hpp"
#include "paradyse/moe/dispatch.hpp"
#include "paradyse/moe/grouped_routing.hpp"
#include "paradyse/moe/experts.hpp"
#include "paradyse/moe/router.hpp"
#include "paradyse/ops/backend.hpp"
#include "paradyse/serve/mla_attention.hpp"
#include "paradyse/serve/paged_attention.hpp"
#include "paradyse/serve/paged_kv_cache.hpp"
#include "paradyse/serve/rank_shard.hpp"
#include "paradyse/serve/routing_budget.hpp"
#include "paradyse/serve/step_record.hpp"
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
  std::vector<std::int64_t> rank_rows;   // [p]: rows each rank computed (moe_partial in EP: this rank's only;
                                         // decoder_step sums them with the partial outputs)
};

struct StepResult {
  std::vector<Tensor<float>> logits;       // per chunk: [rows, V]
  std::vector<MoeLayerLoad> moe_load;      // per layer (empty for dense layers)
};

// EP mode: what a rank computes. A task runs expert `expert` over the permuted rows [begin, end) of its block with
// the given weights (in [1, 2f, h], out [1, f, h]): a slot the rank holds, or an expert it fetched (token sorting with
// on-demand loading, serve/expert_balance.hpp). Over all ranks the tasks must cover every row exactly once.
// `ready`, when set, is called before the task computes (on-demand loading waits there for the fetched weights).
struct ExpertTask {
  std::int64_t expert = 0, begin = 0, end = 0;
  TensorView<const float> in, out;
  std::function<void()> ready = {};
};
// A rank's EP work in one layer: its tasks in the order they compute, then `finish` (when set) after the last one
// (on-demand loading completes the weights it sent to other ranks there).
struct ExpertWork {
  std::vector<ExpertTask> tasks;
  std::function<void()> finish = {};
};
using ExpertWorkFn = std::function<ExpertWork(const RankShard&, std::int64_t layer, const Dispatch&)>;

// The weights of slot `slot` of a rank's EP layer as a bank of one.
inline ExpertTask slot_task(const RankLayer& L, std::int64_t slot, std::int64_t begin, std::int64_t end) {
  return {L.slot_expert[std::size_t(slot)], begin, end, L.expert_in.view().slice(0, slot, 1),
          L.expert_out.view().slice(0, slot, 1)};
}

// The default EP work: each held slot computes its expert's rows; replicas of an expert split its block evenly
// (holder i of m, in rank then slot order, takes part i).
inline std::vector<ExpertTask> split_over_replicas(const RankLayer& L, int rank, const Dispatch& d) {
  std::vector<ExpertTask> tasks;
  const std::vector<std::vector<std::int64_t>>& placement = L.placement;
  const std::vector<std::int64_t>& mine = placement[std::size_t(rank)];
  for (std::size_t s = 0; s < mine.size(); ++s) {
    const std::int64_t e = mine[s];
    std::int64_t holders = 0, index = 0;
    for (int q = 0; q < int(placement.size()); ++q)
      for (std::size_t t = 0; t < placement[std::size_t(q)].size(); ++t)
        if (placement[std::size_t(q)][t] == e) {
          if (q < rank || (q == rank && t < s)) ++index;
          ++holders;
        }
    const ChunkRange part = chunk_range(d.count(e), holders, index);
    tasks.push_back(slot_task(L, std::int64_t(s), d.offsets[std::size_t(e)] + part.start,
                              d.offsets[std::size_t(e)] + part.end()));
  }
  return tasks;
}

namespace step_detail {

// Layer l's expert loads out of a dry run's `loads` (empty when none are given).
inline std::span<const std::int64_t> layer_loads(std::span<const std::vector<std::int64_t>> loads, std::int64_t l) {
  if (loads.empty()) return {};
  check(std::int64_t(loads.size()) > l, "decoder_step: the dry run's expert loads list {} layers; layer {} is asked",
        loads.size(), l);
  return loads[std::size_t(l)];
}

template <Communicator C>
void sum_over_ranks(C& comm, TensorView<float> x) {
  if (comm.size() > 1 && x.numel() > 0) comm.all_reduce(std::span<const float>(x.span()), x.span(), ReduceOp::sum);
}

// y [n, h] = SwiGLU bank of one expert over every row of x (a dense FFN or a shared expert slice).
template <class Backend>
void dense_swiglu(TensorView<const float> in, TensorView<const float> out, TensorView<const float> x,
                  TensorView<float> y, BufferPool& pool) {
  const std::int64_t n = x.extent(0), width = out.extent(1);
  Backend::fill(y, 0.0f);
  if (n == 0 || width == 0) return;
  const std::int64_t offsets[] = {0, n};
  PooledBuffer<float> pre = pool.acquire<float>(Shape{n, 2 * width});
  experts_forward<Backend>({in, out}, offsets, x, pre.view(), y, pool);
}

// out [rows, cols] = x W^T (+ bias).
template <class Backend>
void linear(TensorView<const float> x, const Tensor<float>& w, const Tensor<float>& bias, TensorView<float> out) {
  if (x.extent(0) == 0 || w.numel() == 0) return;
  Backend::matmul(x, ops::Transpose::no, w.view(), ops::Transpose::yes, out);
  if (bias.numel() == 0) return;
  if constexpr (!records<Backend>)
    for (std::int64_t i = 0; i < out.extent(0); ++i)
      for (std::int64_t j = 0; j < out.extent(1); ++j) out(i, j) += bias.data()[j];
  note_stream(2 * double(out.numel()) + double(bias.numel()));
}

// Scales each row of x [n, w] by rstd[i] * gamma (an RMSNorm whose statistics were summed elsewhere).
template <class Backend>
void scale_rows(TensorView<float> x, std::span<const float> rstd, const Tensor<float>& gamma) {
  if constexpr (!records<Backend>)
    for (std::int64_t i = 0; i < x.extent(0); ++i)
      for (std::int64_t j = 0; j < x.extent(1); ++j) x(i, j) *= rstd[std::size_t(i)] * gamma.data()[j];
  note_stream(2 * double(x.numel()) + double(gamma.numel()));
}

// A dry run's routing: `loads` [E] (summing to the M assignments of r) realised as expert ids, assignment j to the
// expert whose block of the loads holds j (the shapes are the real routing's; which token goes where is not).
inline void realise_loads(Routing& r, std::span<const std::int64_t> loads) {
  std::int64_t total = 0;
  for (const std::int64_t x : loads) total += x;
  check(std::int64_t(loads.size()) == r.experts && total == r.assignments(),
        "decoder_step: the dry run's expert loads count {} experts and {} (token, expert) pairs; the step routes {} "
        "tokens to {} experts in {} pairs", loads.size(), total, r.tokens, r.experts, r.assignments());
  std::size_t j = 0;
  for (std::size_t e = 0; e < loads.size(); ++e)
    for (std::int64_t i = 0; i < loads[e]; ++i) r.expert[j++] = std::int64_t(e);
}

}  // namespace step_detail

// The MoE sublayer's partial output y [n, h] on this rank (summed over ranks by the caller). `loads` [E]: a dry run's
// expert loads (see decoder_step).
template <class Backend = ops::Cpu, Communicator C>
MoeLayerLoad moe_partial(C& comm, const DecoderConfig& c, const RankShard& s, std::int64_t layer_index,
                         TensorView<const float> x, TensorView<float> y, BufferPool& pool, const ExpertWorkFn& work,
                         TopK k = {}, std::span<const std::int64_t> loads = {}) {
  const RankLayer& L = s.layers[std::size_t(layer_index)];
  const MoeConfig& m = c.moe;
  const std::int64_t n = x.extent(0), h = c.hidden;
  MoeLayerLoad load;
  load.rank_rows.assign(std::size_t(s.ranks), 0);
  Backend::fill(y, 0.0f);
  Routing r = m.topk_method == TopkMethod::greedy
                  ? route<Backend>(m, L.router.view(), x, k)
                  : route_grouped<Backend>(m, L.router.view(), std::span<const float>(L.router_bias.data(),
                                           std::size_t(L.router_bias.numel())), x, k);
  if constexpr (step_detail::records<Backend>) {
    check(!loads.empty(), "decoder_step: a dry run needs the expert loads of MoE layer {} (its router sees no data)",
          layer_index);
    step_detail::realise_loads(r, loads);
  }
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
    const ExpertWork assigned = work ? work(s, layer_index, d) : ExpertWork{split_over_replicas(L, s.rank, d)};
    // A batch of tasks: their rows gathered [rows, h] in task order, each task's expert over its block (one grouped
    // GEMM per projection: experts_forward), the outputs scatter-added into y weighted by their gates.
    std::vector<std::int64_t> tokens, tokens_at, offsets{0};  // token ids, their dispatch rows, block offsets
    std::vector<ExpertWeights<const float>> experts;
    const auto run_batch = [&] {
      const std::int64_t batch = offsets.back();
      if (batch > 0) {
        Tensor<float> xs(Shape{batch, h}), hs(Shape{batch, h}), ws(Shape{batch}), pre(Shape{batch, 2 * m.expert_ffn});
        if constexpr (!step_detail::records<Backend>)
          for (std::int64_t i = 0; i < batch; ++i)
            ws.data()[i] = r.gates.data()[d.slot[std::size_t(tokens_at[std::size_t(i)])]];
        step_detail::note_stream(2 * double(batch));
        Backend::gather_rows(x, tokens, {}, xs.view());
        experts_forward<Backend>(experts, offsets, xs.view(), pre.view(), hs.view(), pool);
        Backend::scatter_add_rows(y, tokens, hs.view(), ws.view());
      }
      tokens.clear(), tokens_at.clear(), experts.clear(), offsets.assign(1, 0);
    };
    std::int64_t rows = 0;
    for (const ExpertTask& t : assigned.tasks) {
      check(t.expert >= 0 && t.expert < m.experts && t.begin >= d.offsets[std::size_t(t.expert)] &&
                t.end <= d.offsets[std::size_t(t.expert + 1)] && t.begin <= t.end,
            "moe_partial: a task of expert {} is given rows [{}, {}), outside its block [{}, {})", t.expert, t.begin,
            t.end, d.offsets[std::size_t(std::clamp<std::int64_t>(t.expert, 0, m.experts - 1))],
            d.offsets[std::size_t(std::clamp<std::int64_t>(t.expert, 0, m.experts - 1) + 1)]);
      check(t.in.shape() == Shape{1, 2 * m.expert_ffn, h} && t.out.shape() == Shape{1, m.expert_ffn, h},
            "moe_partial: a task of expert {} has weights in {} out {}, expected [1, {}, {}] and [1, {}, {}]", t.expert,
            t.in.shape(), t.out.shape(), 2 * m.expert_ffn, h, m.expert_ffn, h);
      const std::int64_t count = t.end - t.begin;
      if (count == 0) continue;
      // A task that must wait for its weights (on-demand loading) starts a batch of its own after the wait: the
      // tasks before it compute while they travel.
      if (t.ready) {
        run_batch();
        t.ready();
      }
      rows += count;
      for (std::int64_t i = t.begin; i < t.end; ++i) tokens.push_back(d.token[std::size_t(i)]), tokens_at.push_back(i);
      offsets.push_back(offsets.back() + count);
      experts.push_back({t.in.reshape(Shape{2 * m.expert_ffn, h}), t.out.reshape(Shape{m.expert_ffn, h})});
    }
    run_batch();
    if (assigned.finish) assigned.finish();
    load.rank_rows[std::size_t(s.rank)] = rows;  // the other ranks' rows: summed by decoder_step, once per step
  }
  if (m.has_shared() && L.shared_out.extent(1) > 0) {
    Tensor<float> sy(Shape{n, h});
    step_detail::dense_swiglu<Backend>(L.shared_in.view(), L.shared_out.view(), x, sy.view(), pool);
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
// A dry run (Backend = ops::Counting): `loads` [layers][E], each MoE layer's expert loads (empty for dense layers).
template <class Backend = ops::Cpu, Communicator C, class Cache>
StepResult decoder_step(C& comm, const DecoderConfig& c, const RankShard& s, Cache& cache,
                        std::span<const SequenceChunk> batch, BufferPool& pool, const ExpertWorkFn& work = {},
                        const std::function<void(std::int64_t layer)>& after_layer = {},
                        const RoutingBudget& budget = {}, std::span<const std::vector<std::int64_t>> loads = {}) {
  using namespace step_detail;
  constexpr bool dry = records<Backend>;
  const std::int64_t h = c.hidden, d = c.head_dim, hq = s.q_heads.length, hk = s.kv_heads.length,
                     group = c.heads / c.kv_heads;
  std::int64_t n = 0;
  std::vector<std::int64_t> first;  // first row of each chunk
  for (const SequenceChunk& ch : batch) {
    check(!ch.tokens.empty(), "decoder_step: request {} has an empty chunk", ch.request);
    first.push_back(n);
    n += std::int64_t(ch.tokens.size());
  }
  budget.validate(c);
  std::vector<std::int64_t> chunk_rows;  // Alloc-T's pools: one per chunk
  for (const SequenceChunk& ch : batch) chunk_rows.push_back(std::int64_t(ch.tokens.size()));
  StepResult result;
  result.moe_load.resize(std::size_t(c.layers));
  const std::int64_t gqa_rows = c.is_mla() ? 0 : n;  // MLA computes its own (serve/mla_attention.hpp)
  Tensor<float> x(Shape{n, h}), xn(Shape{n, h}), rstd(Shape{n}), q(Shape{gqa_rows, hq * d}), k(Shape{gqa_rows, hk * d}),
      v(Shape{gqa_rows, hk * d}), attn(Shape{gqa_rows, hq * d}), y(Shape{n, h});
  {
    Tensor<std::int32_t> ids(Shape{n});  // the batch's tokens [n] (a dry run's: shapes only)
    for (std::size_t b = 0; b < batch.size(); ++b)
      for (std::size_t i = 0; i < batch[b].tokens.size(); ++i) {
        const std::int32_t t = batch[b].tokens[i];
        check(t >= 0 && t < c.vocab, "decoder_step: request {} has token {}, outside the vocabulary [0, {})",
              batch[b].request, t, c.vocab);
        if constexpr (!dry) ids.data()[first[b] + std::int64_t(i)] = t;
      }
    if (n > 0) Backend::embedding_forward(ids.view(), s.whole->embed.view(), x.view());
  }
  // How many ranks hold each of this rank's key/value heads (their k-norm statistics are counted once).
  std::vector<float> kv_share(static_cast<std::size_t>(hk), 0.0f);
  for (int r = 0; r < s.ranks; ++r) {
    const ChunkRange other = kv_heads_of(c, s.ranks, r);
    for (std::int64_t j = 0; j < hk; ++j)
      if (other.contains(s.kv_heads.start + j)) kv_share[std::size_t(j)] += 1.0f;
  }
  std::vector<float> scores;  // the paged attention's, reused
  Tensor<float> y_ep(Shape{n * h + s.ranks});  // an EP MoE layer's partial output [n, h], then the rows per rank [p]
  check(n * c.moe.top_k < (std::int64_t(1) << 24), "decoder_step: {} tokens x top-{} rows exceed float's exact "
        "integers (the EP row counts)", n, c.moe.top_k);
  std::vector<AttentionChunk> chunks;  // MLA's view of the batch
  for (std::size_t b = 0; b < batch.size(); ++b)
    chunks.push_back({batch[b].request, first[b], std::int64_t(batch[b].tokens.size())});
  for (std::int64_t l = 0; l < c.layers; ++l) {
    const RankLayer& L = s.layers[std::size_t(l)];
    // ---- attention ----
    const auto attention = [&] {
      Backend::rms_norm_forward(x.view(), L.attn_norm.view(), float(c.rms_eps), xn.view(), rstd.view());
      if (c.is_mla()) {
        mla_attention<Backend>(c, s, L, cache, l, chunks, xn.view(), y.view());
      } else {
        linear<Backend>(xn.view(), L.wq, L.bq, q.view());
        linear<Backend>(xn.view(), L.wk, L.bk, k.view());
        linear<Backend>(xn.view(), L.wv, L.bv, v.view());
        if (c.qk_norm) {  // RMSNorm over the whole projections: sums of squares over every rank's heads
          std::vector<float> sums(static_cast<std::size_t>(2 * n), 0.0f);
          if constexpr (!dry)
            for (std::int64_t i = 0; i < n; ++i) {
              double sq = 0, sk = 0;
              for (std::int64_t j = 0; j < hq * d; ++j) sq += double(q(i, j)) * q(i, j);
              for (std::int64_t j = 0; j < hk * d; ++j) sk += double(k(i, j)) * k(i, j) / kv_share[std::size_t(j / d)];
              sums[std::size_t(i)] = float(sq);
              sums[std::size_t(n + i)] = float(sk);
            }
          note_stream(double(n) * double((hq + hk) * d));
          if (s.ranks > 1) comm.all_reduce(std::span<const float>(sums), std::span<float>(sums), ReduceOp::sum);
          std::vector<float> rq(static_cast<std::size_t>(n)), rk(static_cast<std::size_t>(n));
          for (std::int64_t i = 0; i < n; ++i) {
            rq[std::size_t(i)] = 1.0f / std::sqrt(sums[std::size_t(i)] / float(c.q_width()) + float(c.rms_eps));
            rk[std::size_t(i)] = 1.0f / std::sqrt(sums[std::size_t(n + i)] / float(c.kv_width()) + float(c.rms_eps));
          }
          scale_rows<Backend>(q.view(), rq, L.q_norm);
          scale_rows<Backend>(k.view(), rk, L.k_norm);
        }
        if (c.head_qk_norm && n > 0) {  // Qwen3-MoE: RMSNorm of each head's d values (rank-local: heads are whole)
          Tensor<float> head_rstd(Shape{n * std::max(hq, hk)});
          const TensorView<float> qh = q.view().reshape(Shape{n * hq, d}), kh = k.view().reshape(Shape{n * hk, d});
          Backend::rms_norm_forward(qh, L.q_norm.view(), float(c.rms_eps), qh, head_rstd.view().slice(0, 0, n * hq));
          Backend::rms_norm_forward(kh, L.k_norm.view(), float(c.rms_eps), kh, head_rstd.view().slice(0, 0, n * hk));
        }
        const ops::RopeConfig rope{c.rope_theta, ops::RopeLayout::halves};
        double pairs = 0, positions = 0;  // the batch's visible query-key pairs; the positions whose k, v are read
        for (std::size_t b = 0; b < batch.size(); ++b) {
          const std::int64_t len = std::int64_t(batch[b].tokens.size()), start = cache.length(batch[b].request);
          const TensorView<float> qb = q.view().slice(0, first[b], len).reshape(Shape{1, len, hq, d});
          const TensorView<float> kb = k.view().slice(0, first[b], len).reshape(Shape{1, len, hk, d});
          Backend::rope_forward(qb, qb, start, rope);
          Backend::rope_forward(kb, kb, start, rope);
          pairs += chunk_pairs(len, start);
          positions += double(start + len);
          note_stream(4 * double(len * hk * d));  // the KV append: k and v read, written into the cache's blocks
          if constexpr (!dry) {
            cache.append(batch[b].request, l, kb.reshape(Shape{len, hk, d}),
                         v.view().slice(0, first[b], len).reshape(Shape{len, hk, d}));
            paged_attention(cache, batch[b].request, l, start, q.view().slice(0, first[b], len),
                            attn.view().slice(0, first[b], len), s.q_heads, s.kv_heads, group, d, scores);
          }
        }
        // The attention as one paged kernel over the batch (serve/paged_attention.hpp): its pairs, and the keys and
        // values it reads.
        if (n > 0) {
          note(paged_attention_event(pairs, hq, d));
          note_stream(2 * positions * double(hk * d));
        }
        if (n > 0) Backend::matmul(attn.view(), ops::Transpose::no, L.wo_t.view(), ops::Transpose::no, y.view());
      }  // GQA attention
    };
    if constexpr (dry) {  // every layer's attention has the step's shapes: recorded once, replayed (core/trace.hpp)
      check(Trace::current() != nullptr, "decoder_step: a dry run records into the thread's Trace; none is installed");
      record_or_replay(*Trace::current(), {n, hq, hk, d, std::int64_t(batch.size()), s.ranks}, attention);
    } else {
      attention();
    }
    sum_over_ranks(comm, y.view());
    Backend::add_into(x.view(), y.view());
    // ---- FFN ----
    Backend::rms_norm_forward(x.view(), L.ffn_norm.view(), float(c.rms_eps), xn.view(), rstd.view());
    if (c.is_moe(l) && L.mode == MoeMode::ep) {
      // EP: each rank's row count (statistics) rides at the tail of the partial outputs' all-reduce, exact in float
      // (rows <= n k < 2^24), so EP runs no collective of its own (on a latency-bound link each costs a launch).
      const TensorView<float> partial = y_ep.view().slice(0, 0, n * h).reshape(Shape{n, h});
      MoeLayerLoad& load = result.moe_load[std::size_t(l)];
      load = moe_partial<Backend>(comm, c, s, l, xn.view(), partial, pool, work, budget.top_k(l, chunk_rows),
                                  layer_loads(loads, l));
      float* tail = y_ep.data() + n * h;
      if constexpr (!dry)
        for (int q = 0; q < s.ranks; ++q) tail[q] = float(load.rank_rows[std::size_t(q)]);
      sum_over_ranks(comm, y_ep.view());
      if constexpr (!dry)
        for (int q = 0; q < s.ranks; ++q) load.rank_rows[std::size_t(q)] = std::int64_t(std::llround(tail[q]));
      Backend::add_into(x.view(), partial);
    } else {
      if (c.is_moe(l))
        result.moe_load[std::size_t(l)] = moe_partial<Backend>(comm, c, s, l, xn.view(), y.view(), pool, work,
                                                              budget.top_k(l, chunk_rows), layer_loads(loads, l));
      else
        dense_swiglu<Backend>(L.dense_in.view(), L.dense_out.view(), xn.view(), y.view(), pool);
      sum_over_ranks(comm, y.view());
      Backend::add_into(x.view(), y.view());
    }
    if (after_layer) after_layer(l);
  }
  // ---- final norm and logits ----
  Backend::rms_norm_forward(x.view(), s.whole->norm.view(), float(c.rms_eps), xn.view(), rstd.view());
  // One lm_head GEMM over every chunk's logit rows (the batch reads the [V, h] weights once), then each chunk's.
  std::vector<std::int64_t> rows_of;  // the activations' rows that get logits, chunk after chunk
  for (std::size_t b = 0; b < batch.size(); ++b) {
    const std::int64_t len = std::int64_t(batch[b].tokens.size()), rows = batch[b].all_logits ? len : 1;
    for (std::int64_t i = first[b] + len - rows; i < first[b] + len; ++i) rows_of.push_back(i);
  }
  const std::int64_t all_rows = std::int64_t(rows_of.size());
  Tensor<float> picked(Shape{all_rows, h}), logits(Shape{all_rows, c.vocab});
  if (all_rows > 0) {
    Backend::gather_rows(xn.view(), rows_of, {}, picked.view());
    Backend::matmul(picked.view(), ops::Transpose::no, s.whole->lm_head.view(), ops::Transpose::yes, logits.view());
  }
  std::int64_t at = 0;
  for (std::size_t b = 0; b < batch.size(); ++b) {
    const std::int64_t rows = batch[b].all_logits ? std::int64_t(batch[b].tokens.size()) : 1;
    Tensor<float> mine(Shape{rows, c.vocab});
    Backend::copy(logits.view().slice(0, at, rows), mine.view());
    result.logits.push_back(std::move(mine));
    at += rows;
  }
  return result;
}

}  // namespace paradyse::serve
