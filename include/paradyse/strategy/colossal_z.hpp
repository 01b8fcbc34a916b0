// paradyse/strategy/colossal_z.hpp: ColossalZ, Colossal-AI's ring self-attention (RSA, Li et al. 2021) with ZeRO-3
// weights.
//
// Attention: q|k|v of every head for the rank's own tokens, as in MegatronCZ (the ring column linear, then heads
// with RoPE). RSA then works the way attention reads on paper, with no flash-style tiling: the K blocks go around
// the ring and fill the rank's score rows S = q K^T / sqrt(d) against every key of the sequence
// ([b, hq, n_r, s] per rank), the rows are soft-maxed (causal mask at global positions; packed documents: the scores
// across documents set to -inf first), and the V blocks go
// around the ring a second time for out = P V. Backward: the V blocks travel again with their dV sums (dP = dout V^T,
// dV_j = P_j^T dout), dS = P (dP - rowsum(P dP)), and the K blocks with their dK sums (dq += dS K, dK_j = dS_j^T q);
// each sum returns to its owner after its last hop (strategy/ring_schedule.hpp). Projections and MLP: ZeRO-3, as
// MegatronCZ.
//
// This is the memory-hungry member of the strategy set, on purpose: it saves the probabilities P (b hq n_r s floats
// per rank, quadratic in s) and its backward holds dP beside them. ParaDySe excludes it for that reason; it is here
// so the set is complete and the planner can weigh it. Communication: K and V each circulate once forward
// (2 b s hkv d (p-1)/p per rank, as ring attention), twice with their gradient sums backward. Exact: the same
// float64 reference as every strategy. Requirements: those of the unified layout only.
// The projections, checks, requirement and MLP are strategy/unified_ring.hpp's Zero3Ring; this file holds RSA.
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/ops/backend.hpp"
#include "paradyse/strategy/policy.hpp"
#include "paradyse/strategy/ring_heads.hpp"
#include "paradyse/strategy/ring_schedule.hpp"
#include "paradyse/strategy/unified_ring.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <span>
#include <string_view>
#include <vector>

namespace paradyse {

template <class Backend = ops::Cpu>
struct ColossalZ : Zero3Ring<ColossalZ<Backend>, Backend> {
  static constexpr std::string_view name = "ColossalZ";

  struct AttentionSaved {
    Tensor<float> x;      // [b, n_r, h]
    Tensor<float> heads;  // [b, n_r, hq + 2 hkv, d]: q, k, v of every head group (RoPE applied)
    Tensor<float> probs;  // [b, hq, n_r, s]: softmax rows against every key, columns rank-major (owner 0's first)
    Tensor<float> out;    // [b, n_r, hq, d]
  };

private:
  friend struct Zero3Ring<ColossalZ, Backend>;

  // The core's own tensors: the probabilities (unzeroed: every key block's GEMM writes its columns whole) and out
  // (zeroed: P V accumulates into it).
  static void make_core(const SublayerContext& ctx, const QkvPacking& packing, const RingCall& call,
                        AttentionSaved& saved) {
    const std::int64_t b = call.b, n = call.n, d = ctx.geometry.head_dim;
    saved.probs = Tensor<float>::uninitialized(Shape{b, packing.q_heads(), n, ctx.length()});
    saved.out = Tensor<float>(Shape{b, n, packing.q_heads(), d});
  }
  static void drop_core(AttentionSaved& saved) {
    saved.probs = Tensor<float>();
    saved.out = Tensor<float>();
  }

  template <Communicator C>
  void core_forward(C& comm, const SublayerContext& ctx, const QkvPacking& packing, const RingCall& call,
                    AttentionSaved& saved) const {
    const std::int64_t n = call.n, s = ctx.length(), d = ctx.geometry.head_dim;
    const Rsa rsa(ctx, packing, call.rank, saved);
    ops::GemmItems gemms;  // one GEMM per (batch, query head), issued as one batched call per block
    // S: every key block fills its columns of the score rows; then the softmax over whole rows.
    rotate_blocks(comm, *ctx.pool, rsa.block_size(), rsa.pack(rsa.k), [&](int owner, std::span<const float> k_block) {
      gemms.clear();
      rsa.for_each_head(owner, k_block.data(), [&](std::int64_t, std::int64_t, const float* q, float* probs,
                                                    const float* key, float*) { gemms.add(q, key, probs); });
      // probs[:, block] = scale * q k_block^T, per head
      Backend::gemm_batched(ops::Transpose::no, ops::Transpose::yes, n, rsa.keys(owner), d, rsa.scale, gemms.a,
                            rsa.head_stride, gemms.b, rsa.kv_stride, 0.0f, gemms.c, s);
    });
    rsa.mask_documents(saved.probs.view());
    rsa.softmax(saved.probs.view());
    // out = P V: every value block adds its columns' share.
    rotate_blocks(comm, *ctx.pool, rsa.block_size(), rsa.pack(rsa.v), [&](int owner, std::span<const float> v_block) {
      gemms.clear();
      rsa.for_each_head(owner, v_block.data(), [&](std::int64_t, std::int64_t, const float*, float* probs,
                                                    const float* value, float* out) { gemms.add(probs, value, out); });
      Backend::gemm_batched(ops::Transpose::no, ops::Transpose::no, n, d, rsa.keys(owner), 1.0f, gemms.a, s, gemms.b,
                            rsa.kv_stride, 1.0f, gemms.c, rsa.out_stride);
    });
  }

  template <Communicator C>
  void core_backward(C& comm, const SublayerContext& ctx, const QkvPacking& packing, const RingCall& call,
                     AttentionSaved& saved, TensorView<const float> dout_heads, const HeadViews<float>& dqkv) const {
    const std::int64_t n = call.n, s = ctx.length(), d = ctx.geometry.head_dim;
    const Rsa rsa(ctx, packing, call.rank, saved);
    PooledBuffer<float> dprobs = ctx.pool->acquire<float>(saved.probs.shape());
    // The per-head GEMMs of a block, two kinds, each issued as one batched call. Within a kind the items run in
    // head order, so the heads of a GQA group add into their shared K/V gradient rows in the order of the loop
    // they replace; the two kinds touch disjoint outputs, so issuing one kind after the other changes no bits.
    ops::GemmItems first, second;
    // dP[:, block] = dout v_block^T; dV_block += P[:, block]^T dout
    rotate_blocks_with_sums<Backend>(
        comm, *ctx.pool, rsa.block_size(), rsa.block_size(), rsa.pack(rsa.v),
        [&](int owner, std::span<const float> v_block, std::span<float> dv_block) {
          first.clear();
          second.clear();
          rsa.for_each_head(owner, v_block.data(), [&](std::int64_t batch, std::int64_t head, const float*,
                                                        float* probs, const float* value, float*) {
            const float* dout_head = &dout_heads(batch, 0, head, 0);
            first.add(dout_head, value, dprobs.data() + (probs - saved.probs.data()));
            second.add(probs, dout_head, dv_block.data() + (value - v_block.data()));
          });
          const std::int64_t keys = rsa.keys(owner);
          Backend::gemm_batched(ops::Transpose::no, ops::Transpose::yes, n, keys, d, 1.0f, first.a, rsa.out_stride,
                                first.b, rsa.kv_stride, 0.0f, first.c, s);
          Backend::gemm_batched(ops::Transpose::yes, ops::Transpose::no, keys, d, n, 1.0f, second.a, s, second.b,
                                rsa.out_stride, 1.0f, second.c, rsa.kv_stride);
        },
        [&](std::span<const float> total) { rsa.add_home(total, dqkv.v); });
    rsa.softmax_backward(saved.probs.view(), dprobs.view());  // dP -> dS, in place
    // dq += scale dS[:, block] k_block; dK_block += scale dS[:, block]^T q
    rotate_blocks_with_sums<Backend>(
        comm, *ctx.pool, rsa.block_size(), rsa.block_size(), rsa.pack(rsa.k),
        [&](int owner, std::span<const float> k_block, std::span<float> dk_block) {
          first.clear();
          second.clear();
          rsa.for_each_head(owner, k_block.data(), [&](std::int64_t batch, std::int64_t head, const float* q,
                                                        float* probs, const float* key, float*) {
            const float* dscores = dprobs.data() + (probs - saved.probs.data());
            first.add(dscores, key, &dqkv.q(batch, 0, head, 0));
            second.add(dscores, q, dk_block.data() + (key - k_block.data()));
          });
          const std::int64_t keys = rsa.keys(owner);
          Backend::gemm_batched(ops::Transpose::no, ops::Transpose::no, n, d, keys, rsa.scale, first.a, s, first.b,
                                rsa.kv_stride, 1.0f, first.c, rsa.head_stride);
          Backend::gemm_batched(ops::Transpose::yes, ops::Transpose::no, keys, d, n, rsa.scale, second.a, s,
                                second.b, rsa.head_stride, 1.0f, second.c, rsa.kv_stride);
        },
        [&](std::span<const float> total) { rsa.add_home(total, dqkv.k); });
  }

  // The bookkeeping of RSA on one rank: where every head's rows, score columns and K/V block rows live.
  struct Rsa {
    const SublayerContext& ctx;
    QkvPacking packing;
    int rank;
    AttentionSaved& saved;
    std::int64_t batch, tokens, length, d, q_heads, kv_heads;
    std::int64_t head_stride, kv_stride, out_stride;  // row strides of the heads buffer, a K/V block, out
    float scale;
    TensorView<const float> q, k, v;              // views into saved.heads
    std::vector<std::int64_t> column_of_owner;    // first score column of each owner's keys (rank-major)
    std::vector<ops::PositionRun> key_runs;        // global positions of the score columns (rank-major)
    std::vector<ops::PositionRun> query_runs;      // global positions of the local tokens (score rows)

    Rsa(const SublayerContext& c, const QkvPacking& pk, int r, AttentionSaved& s)
        : ctx(c), packing(pk), rank(r), saved(s), batch(c.batch), tokens(c.local_tokens(r)), length(c.length()),
          d(pk.head_dim), q_heads(pk.q_heads()), kv_heads(pk.kv_heads()), head_stride(pk.heads() * pk.head_dim),
          kv_stride(pk.kv_heads() * pk.head_dim), out_stride(pk.q_heads() * pk.head_dim),
          scale(float(1.0 / std::sqrt(double(pk.head_dim)))) {
      const HeadViews<const float> views = head_views(TensorView<const float>(s.heads.view()), pk);
      q = views.q;
      k = views.k;
      v = views.v;
      std::int64_t column = 0;
      for (int owner = 0; owner < c.ranks(); ++owner) {
        column_of_owner.push_back(column);
        for (int i = 0; i < c.sequence.segment_count(); ++i) {
          const TokenSegment seg = c.sequence.segment(owner, i);
          if (seg.length) key_runs.push_back({column + seg.local, seg.begin, seg.length});
          if (seg.length && owner == r) query_runs.push_back({seg.local, seg.begin, seg.length});
        }
        column += c.local_tokens(owner);
      }
    }

    // Keys in owner's K (or V) block: its token count.
    std::int64_t keys(int owner) const { return ctx.local_tokens(owner); }
    // Elements of owner's K (or V) block [b, n_owner, hkv, d].
    auto block_size() const {
      return [this](int owner) { return batch * ctx.local_tokens(owner) * kv_heads * d; };
    }
    // Writes this rank's K (or V) into a contiguous block.
    auto pack(TensorView<const float> part) const {
      return [part](std::span<float> own) { Backend::copy(part, TensorView<float>(own.data(), part.shape())); };
    }
    // Calls fn(batch, head, q rows, score rows of the owner's columns, the owner's key rows of the head's kv head,
    // out rows) for every (batch, query head), in that order.
    template <class Fn>
    void for_each_head(int owner, const float* block, Fn&& fn) const {
      const std::int64_t keys = ctx.local_tokens(owner), column = column_of_owner[std::size_t(owner)];
      for (std::int64_t bi = 0; bi < batch; ++bi)
        for (std::int64_t head = 0; head < q_heads; ++head) {
          const std::int64_t kv_head = head / packing.group_size;
          fn(bi, head, &q(bi, 0, head, 0), &saved.probs(bi, head, 0, column), block + (bi * keys * kv_heads + kv_head) * d,
             &saved.out(bi, 0, head, 0));
        }
    }
    // Packed documents: the scores of keys outside their query's document set to -inf, so the softmax gives them 0
    // (and its backward a zero gradient). Per run of query rows within one document, the columns of every key run
    // before and after that document: a few rectangles per document, whatever the chunking.
    void mask_documents(TensorView<float> probs) const {
      const std::span<const std::int64_t> starts = ctx.document_starts;
      if (starts.empty()) return;
      const float hidden = -std::numeric_limits<float>::infinity();
      for (const ops::PositionRun& rows : query_runs)
        for (std::int64_t i = 0; i < rows.length;) {
          const std::int64_t position = rows.position + i;
          const auto next = std::upper_bound(starts.begin(), starts.end(), position);
          const std::int64_t first = *(next - 1), last = next == starts.end() ? length : *next;
          const std::int64_t count = std::min(rows.length - i, last - position);
          const TensorView<float> block = probs.slice(2, rows.index + i, count);  // [b, hq, count, s]
          for (const ops::PositionRun& keys : key_runs) {
            const std::int64_t before = std::clamp<std::int64_t>(first - keys.position, 0, keys.length);
            const std::int64_t after = std::clamp<std::int64_t>(last - keys.position, 0, keys.length);
            if (before > 0) Backend::fill(block.slice(3, keys.index, before), hidden);
            if (after < keys.length) Backend::fill(block.slice(3, keys.index + after, keys.length - after), hidden);
          }
          i += count;
        }
    }
    // Each score row -> its softmax over the visible keys (masked columns 0).
    void softmax(TensorView<float> probs) const {
      Backend::masked_softmax_forward(probs, query_runs, key_runs, ctx.layer().causal);
    }
    // dP -> dS = P (dP - sum_c P dP), row by row.
    void softmax_backward(TensorView<const float> probs, TensorView<float> grads) const {
      Backend::softmax_backward(probs, grads);
    }
    // part: [b, n_r, hkv, d] (a view into the heads gradient) += this rank's complete block sum.
    void add_home(std::span<const float> total, TensorView<float> part) const {
      Backend::add_into(part, TensorView<const float>(total.data(), part.shape()));
    }
  };
};

}  // namespace paradyse
