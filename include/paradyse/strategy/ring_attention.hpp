// paradyse/strategy/ring_attention.hpp: ring attention (context parallelism) over a sequence-sharded group.
//
// Each rank holds the queries, keys and values of its own tokens (the unified layout: one contiguous chunk, or two
// under zigzag). Queries stay put; the K/V block of every rank travels once around the ring (p - 1 hops of
// shift_async, double-buffered: the next hop is posted before the current block is computed on, so the transfer
// overlaps the block's attention). Each (query segment, key segment) pair is one call of Backend::attention_forward
// with global token positions in the mask, and the partial results are folded together with the stable
// log-sum-exp merge (Backend::attention_merge). Pairs that the causal or document mask hides entirely are skipped,
// which under zigzag gives every rank the same work at every step.
//
// Backward runs the same ring with the FINAL out and lse (so every block's probabilities are exact). The gradients
// dK/dV of a block travel with it: each rank adds its contribution and passes the running sum on, and after one last
// hop the sum arrives back at the block's owner. Forward moves 2·b·(s - n_r)·hkv·d floats into rank r, backward
// twice that (K/V, then dK/dV).
//
// Both rings are the schedules of strategy/ring_schedule.hpp (rotate_blocks, rotate_blocks_with_sums); blocks of
// different owners may differ in length (s % p != 0, zigzag), since every receive is sized by its sender's layout.
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/core/memory.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/core/trace.hpp"
#include "paradyse/ops/attention_mask.hpp"
#include "paradyse/ops/backend.hpp"
#include "paradyse/strategy/buffer_pool.hpp"
#include "paradyse/strategy/ring_schedule.hpp"
#include "paradyse/strategy/sequence_layout.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <cstdint>
#include <limits>
#include <span>
#include <utility>

namespace paradyse {

// What ring attention needs besides the tensors: whose tokens are where, and the mask.
struct RingAttentionSpec {
  SequenceLayout layout;                                // global length s, ranks p, contiguous or zigzag
  bool causal = false;
  float scale = 0.0f;                                   // 0: 1/sqrt(d)
  std::span<const std::int64_t> document_starts = {};   // packed documents (global starts, first = 0); empty: one
};

// The output of ring attention on one rank.
struct RingAttentionOutput {
  Tensor<float> out;  // [b, n_r, hq, d]
  Tensor<float> lse;  // [b, hq, n_r]
};

namespace ring_detail {

// The shape of the K/V data of one rank: k and v are [b, n, hkv, d] each.
struct KvGeometry {
  std::int64_t batch = 0, kv_heads = 0, head_dim = 0;

  // A packed block [2, b, n, hkv, d]: keys, then values (or their gradients). One contiguous message.
  std::int64_t block_elements(std::int64_t tokens) const { return 2 * batch * tokens * kv_heads * head_dim; }
  template <class T>  // float or const float
  TensorView<T> part(T* block, std::int64_t tokens, int which) const {
    return TensorView<T>(block + which * batch * tokens * kv_heads * head_dim, Shape{batch, tokens, kv_heads, head_dim});
  }
};

// The one or two token segments of a rank, in local order.
inline std::array<TokenSegment, 2> segments(const SequenceLayout& layout, int rank, int& count) {
  count = layout.segment_count();
  std::array<TokenSegment, 2> s{};
  for (int i = 0; i < count; ++i) s[std::size_t(i)] = layout.segment(rank, i);
  return s;
}

// Whether any query of segment `q` sees any key of segment `kv`. The visible key positions of a query form one
// interval whose ends never decrease with the query position, so the union over the segment is
// [first(first query), last(last query)).
inline bool block_visible(const RingAttentionSpec& spec, const TokenSegment& q, const TokenSegment& kv) {
  if (q.length == 0 || kv.length == 0) return false;
  ops::AttentionMask mask{spec.causal, 0, 0, spec.document_starts, spec.scale};
  const ops::KeyInterval first = ops::visible_key_positions(mask, q.begin);
  const ops::KeyInterval last = ops::visible_key_positions(mask, q.begin + q.length - 1);
  return kv.begin < last.last && kv.begin + kv.length > first.first;
}

inline ops::AttentionMask block_mask(const RingAttentionSpec& spec, const TokenSegment& q, const TokenSegment& kv) {
  return ops::AttentionMask{spec.causal, q.begin, kv.begin, spec.document_starts, spec.scale};
}

inline std::int64_t max_segment_length(const SequenceLayout& layout) {
  std::int64_t longest = 0;
  for (int r = 0; r < layout.ranks(); ++r)
    for (int i = 0; i < layout.segment_count(); ++i) longest = std::max(longest, layout.segment(r, i).length);
  return longest;
}

// Writes k and v (any strides) into a packed block.
template <class Backend>
void pack_kv(const KvGeometry& g, TensorView<const float> k, TensorView<const float> v, float* block) {
  const std::int64_t n = k.extent(1);
  Backend::copy(k, g.part(block, n, 0));
  Backend::copy(v, g.part(block, n, 1));
}

template <class C>
void check_ring_inputs(const char* op, const C& comm, const RingAttentionSpec& spec, const TensorView<const float>& q,
                       const TensorView<const float>& k, const TensorView<const float>& v) {
  check(spec.layout.ranks() == comm.size(), "{}: the sequence layout is over {} ranks, the group has {}", op,
        spec.layout.ranks(), comm.size());
  check(q.rank() == 4 && k.rank() == 4 && v.rank() == 4, "{}: q, k, v must be [b, n, heads, d]; got {}, {}, {}", op,
        q.shape(), k.shape(), v.shape());
  const std::int64_t n = spec.layout.local_length(comm.rank());
  check(q.extent(1) == n && k.extent(1) == n && v.extent(1) == n,
        "{}: rank {} holds {} tokens of {} (layout), but q, k, v have {}, {}, {}", op, comm.rank(), n,
        spec.layout.length(), q.extent(1), k.extent(1), v.extent(1));
  check(k.shape() == v.shape(), "{}: k {} and v {} must have the same shape", op, k.shape(), v.shape());
  check(q.extent(0) == k.extent(0) && q.extent(3) == k.extent(3),
        "{}: q {} and k {} must agree on batch and head_dim", op, q.shape(), k.shape());
  check(k.extent(2) >= 1 && q.extent(2) % k.extent(2) == 0, "{}: q heads = {} must be a multiple of kv heads = {}",
        op, q.extent(2), k.extent(2));
}

// A dry run (the counting backend, recording into the trace of the current tracker): the trace, else nullptr.
template <class Backend>
Trace* dry_run_trace() {
  if constexpr (requires { requires Backend::records_trace; }) {  // ops::Counting
    Trace* trace = Trace::current();
    return trace && trace == MemoryTracker::current().trace() ? trace : nullptr;
  }
  return nullptr;
}

// Everything a ring's events depend on besides the backend: the direction, the rank in its group, the layout, the
// mask and the shapes of the tensors (a dry run replays a repeated call from it: core/trace.hpp).
template <class C, class... Views>
Trace::SegmentKey segment_key(int direction, const C& comm, const RingAttentionSpec& spec, const Views&... views) {
  Trace::SegmentKey key{direction, comm.rank(), comm.size(), spec.layout.length(), spec.layout.ranks(),
                        spec.layout.zigzag(), spec.causal, std::int64_t(std::bit_cast<std::uint32_t>(spec.scale))};
  key.insert(key.end(), spec.document_starts.begin(), spec.document_starts.end());
  key.push_back(std::int64_t(spec.document_starts.size()));
  (key.insert(key.end(), views.shape().begin(), views.shape().end()), ...);
  return key;
}

}  // namespace ring_detail

// Forward. q: [b, n_r, hq, d]; k, v: [b, n_r, hkv, d] (this rank's tokens in layout order; any strides, unit stride
// on d). out: [b, n_r, hq, d] and lse: [b, hq, n_r] are overwritten (lse: natural log-sum-exp of the scaled scores
// over every visible key of the whole sequence). Transients (two K/V blocks, one partial output) come from `pool`.
template <class Backend = ops::Cpu, Communicator C>
void ring_attention_forward(C& comm, const RingAttentionSpec& spec, BufferPool& pool, TensorView<const float> q,
                            TensorView<const float> k, TensorView<const float> v, TensorView<float> out,
                            TensorView<float> lse) {
  using namespace ring_detail;
  check_ring_inputs("ring_attention_forward", comm, spec, q, k, v);
  if (Trace* trace = dry_run_trace<Backend>(); trace && trace->replays_now())  // a repeat records what the first did
    return record_or_replay(*trace, segment_key(0, comm, spec, q, k, v, out, lse),
                            [&] { ring_attention_forward<Backend>(comm, spec, pool, q, k, v, out, lse); },
                            comm.size() > 1 ? 1 : 0);  // a ring of p > 1 shifts: its posts must be in this trace
  const int rank = comm.rank();
  const std::int64_t batch = q.extent(0), q_heads = q.extent(2), d = q.extent(3), n = q.extent(1);
  check(out.shape() == q.shape(), "ring_attention_forward: out {} must have the shape of q {}", out.shape(), q.shape());
  check(lse.shape() == Shape{batch, q_heads, n}, "ring_attention_forward: lse {} must be [b, hq, n] = [{}, {}, {}]",
        lse.shape(), batch, q_heads, n);
  const KvGeometry geometry{batch, k.extent(2), d};
  const SequenceLayout& layout = spec.layout;

  // The partial result of one (query segment, key segment) pair before it is merged.
  const std::int64_t segment_capacity = max_segment_length(layout);
  PooledBuffer<float> block_out = pool.acquire<float>(Shape{batch * segment_capacity * q_heads * d});
  PooledBuffer<float> block_lse = pool.acquire<float>(Shape{batch * q_heads * segment_capacity});

  int q_count = 0;
  const auto q_segments = segments(layout, rank, q_count);
  std::array<bool, 2> written{false, false};
  auto visit = [&](int source, std::span<const float> block) {
    const std::int64_t source_tokens = layout.local_length(source);
    const TensorView<const float> block_k = geometry.part(block.data(), source_tokens, 0);
    const TensorView<const float> block_v = geometry.part(block.data(), source_tokens, 1);
    int kv_count = 0;
    const auto kv_segments = segments(layout, source, kv_count);
    for (int qi = 0; qi < q_count; ++qi) {
      const TokenSegment& qs = q_segments[std::size_t(qi)];
      const auto q_part = q.slice(1, qs.local, qs.length);
      const auto out_part = out.slice(1, qs.local, qs.length);
      const auto lse_part = lse.slice(2, qs.local, qs.length);
      for (int ki = 0; ki < kv_count; ++ki) {
        const TokenSegment& ks = kv_segments[std::size_t(ki)];
        if (!block_visible(spec, qs, ks)) continue;
        const ops::AttentionMask mask = block_mask(spec, qs, ks);
        const auto k_part = block_k.slice(1, ks.local, ks.length), v_part = block_v.slice(1, ks.local, ks.length);
        if (!written[std::size_t(qi)]) {
          Backend::attention_forward(q_part, k_part, v_part, mask, out_part, lse_part);
          written[std::size_t(qi)] = true;
          continue;
        }
        const TensorView<float> partial_out(block_out.data(), Shape{batch, qs.length, q_heads, d});
        const TensorView<float> partial_lse(block_lse.data(), Shape{batch, q_heads, qs.length});
        Backend::attention_forward(q_part, k_part, v_part, mask, partial_out, partial_lse);
        Backend::attention_merge(out_part, lse_part, partial_out, partial_lse);
      }
    }
  };
  rotate_blocks(
      comm, pool, [&](int owner) { return geometry.block_elements(layout.local_length(owner)); },
      [&](std::span<float> own) { pack_kv<Backend>(geometry, k, v, own.data()); }, visit);
  // A segment no key was visible to (possible only with unusual document masks): out = 0, lse = -inf, as the op.
  for (int qi = 0; qi < q_count; ++qi) {
    if (written[std::size_t(qi)]) continue;
    const TokenSegment& qs = q_segments[std::size_t(qi)];
    Backend::fill(out.slice(1, qs.local, qs.length), 0.0f);
    Backend::fill(lse.slice(2, qs.local, qs.length), -std::numeric_limits<float>::infinity());
  }
}

// Forward, returning fresh out and lse tensors.
template <class Backend = ops::Cpu, Communicator C>
RingAttentionOutput ring_attention_forward(C& comm, const RingAttentionSpec& spec, BufferPool& pool,
                                           TensorView<const float> q, TensorView<const float> k,
                                           TensorView<const float> v) {
  RingAttentionOutput result{Tensor<float>(q.shape()), Tensor<float>(Shape{q.extent(0), q.extent(2), q.extent(1)})};
  ring_attention_forward<Backend>(comm, spec, pool, q, k, v, result.out.view(), result.lse.view());
  return result;
}

// Backward. q, k, v as in forward; out, lse: the FINAL forward results; dout: [b, n_r, hq, d]. ACCUMULATES (+=) into
// dq: [b, n_r, hq, d] and dk, dv: [b, n_r, hkv, d] (this rank's tokens; the sums over every rank's queries).
template <class Backend = ops::Cpu, Communicator C>
void ring_attention_backward(C& comm, const RingAttentionSpec& spec, BufferPool& pool, TensorView<const float> q,
                             TensorView<const float> k, TensorView<const float> v, TensorView<const float> out,
                             TensorView<const float> lse, TensorView<const float> dout, TensorView<float> dq,
                             TensorView<float> dk, TensorView<float> dv) {
  using namespace ring_detail;
  check_ring_inputs("ring_attention_backward", comm, spec, q, k, v);
  if (Trace* trace = dry_run_trace<Backend>(); trace && trace->replays_now())  // a repeat records what the first did
    return record_or_replay(*trace, segment_key(1, comm, spec, q, k, v, out, lse, dout, dq, dk, dv), [&] {
      ring_attention_backward<Backend>(comm, spec, pool, q, k, v, out, lse, dout, dq, dk, dv);
    }, comm.size() > 1 ? 1 : 0);
  const int rank = comm.rank();
  const std::int64_t batch = q.extent(0), q_heads = q.extent(2), d = q.extent(3), n = q.extent(1);
  check(out.shape() == q.shape() && dout.shape() == q.shape() && dq.shape() == q.shape(),
        "ring_attention_backward: out {}, dout {} and dq {} must have the shape of q {}", out.shape(), dout.shape(),
        dq.shape(), q.shape());
  check(dk.shape() == k.shape() && dv.shape() == k.shape(),
        "ring_attention_backward: dk {} and dv {} must have the shape of k {}", dk.shape(), dv.shape(), k.shape());
  check(lse.shape() == Shape{batch, q_heads, n}, "ring_attention_backward: lse {} must be [b, hq, n] = [{}, {}, {}]",
        lse.shape(), batch, q_heads, n);
  const KvGeometry geometry{batch, k.extent(2), d};
  const SequenceLayout& layout = spec.layout;
  auto block_size = [&](int owner) { return geometry.block_elements(layout.local_length(owner)); };

  int q_count = 0;
  const auto q_segments = segments(layout, rank, q_count);
  // The block is K/V of `source`; the sum travelling with it is that block's dK/dV (the same packing).
  auto visit = [&](int source, std::span<const float> block, std::span<float> sum) {
    const std::int64_t source_tokens = layout.local_length(source);
    const float* kv = block.data();
    const TensorView<const float> block_k = geometry.part(kv, source_tokens, 0);
    const TensorView<const float> block_v = geometry.part(kv, source_tokens, 1);
    const TensorView<float> block_dk = geometry.part(sum.data(), source_tokens, 0);
    const TensorView<float> block_dv = geometry.part(sum.data(), source_tokens, 1);
    int kv_count = 0;
    const auto kv_segments = segments(layout, source, kv_count);
    for (int qi = 0; qi < q_count; ++qi) {
      const TokenSegment& qs = q_segments[std::size_t(qi)];
      for (int ki = 0; ki < kv_count; ++ki) {
        const TokenSegment& ks = kv_segments[std::size_t(ki)];
        if (!block_visible(spec, qs, ks)) continue;
        Backend::attention_backward(q.slice(1, qs.local, qs.length), block_k.slice(1, ks.local, ks.length),
                                    block_v.slice(1, ks.local, ks.length), out.slice(1, qs.local, qs.length),
                                    lse.slice(2, qs.local, qs.length), dout.slice(1, qs.local, qs.length),
                                    block_mask(spec, qs, ks), dq.slice(1, qs.local, qs.length),
                                    block_dk.slice(1, ks.local, ks.length), block_dv.slice(1, ks.local, ks.length));
      }
    }
  };
  // The complete dK/dV of this rank's own block, after its last hop home.
  auto home = [&](std::span<const float> total) {
    Backend::add_into(dk, geometry.part(total.data(), n, 0));
    Backend::add_into(dv, geometry.part(total.data(), n, 1));
  };
  rotate_blocks_with_sums<Backend>(
      comm, pool, block_size, block_size, [&](std::span<float> own) { pack_kv<Backend>(geometry, k, v, own.data()); }, visit,
      home);
}

}  // namespace paradyse
