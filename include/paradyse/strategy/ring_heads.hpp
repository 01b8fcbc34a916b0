// paradyse/strategy/ring_heads.hpp: the ring strategies' view of q|k|v: from the packed shard order to heads.
//
// A W_qkv^T product comes out packed in shard order (contract/weight_shards.hpp): per kv group, its G query heads, then k,
// then v, d wide each; a run of consecutive shards is the same packing with more groups (all p shards: every head of
// the layer, in global order). Ring attention wants q: [b, n, hq, d] and k, v: [b, n, hkv, d] whose K/V it can send
// as one block, so the ring strategies keep the projection in a heads buffer [b, n, hq + 2 hkv, d]: the query heads,
// then the k heads, then the v heads, each in group order (= global head order). The copy between the two orders
// is where RoPE is applied (forward) and undone (backward), at the rank's global token positions, so it costs no
// extra pass.
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/contract/layer_config.hpp"
#include "paradyse/ops/backend.hpp"  // ops::RopeConfig
#include "paradyse/strategy/sequence_layout.hpp"

#include <cstdint>
#include <span>

namespace paradyse {

// The kv groups of a packed q|k|v buffer [b, n, groups * (G + 2) * d].
struct QkvPacking {
  std::int64_t groups = 0;      // kv heads held (one shard: ShardGeometry::kv_heads; p shards: p times that)
  std::int64_t group_size = 0;  // G: query heads per kv head
  std::int64_t head_dim = 0;

  // The groups of `shards` consecutive shards.
  static QkvPacking of(const ShardGeometry& g, std::int64_t shards) {
    return {shards * g.kv_heads, g.group_size, g.head_dim};
  }
  std::int64_t q_heads() const noexcept { return groups * group_size; }
  std::int64_t kv_heads() const noexcept { return groups; }
  std::int64_t heads() const noexcept { return q_heads() + 2 * kv_heads(); }  // of the heads buffer
  std::int64_t width() const noexcept { return heads() * head_dim; }          // of the packed buffer
};

// Views of q, k, v in a heads buffer [b, n, hq + 2 hkv, d].
template <class T>
struct HeadViews {
  TensorView<T> q;  // [b, n, hq, d]
  TensorView<T> k;  // [b, n, hkv, d]
  TensorView<T> v;  // [b, n, hkv, d]
};

template <class T>
HeadViews<T> head_views(TensorView<T> heads, const QkvPacking& packing) {
  check(heads.rank() == 4 && heads.extent(2) == packing.heads() && heads.extent(3) == packing.head_dim,
        "head_views: the heads buffer {} must be [b, n, {} + 2 * {}, {}]", heads.shape(), packing.q_heads(),
        packing.kv_heads(), packing.head_dim);
  const std::int64_t hq = packing.q_heads(), hkv = packing.kv_heads();
  return {heads.slice(2, 0, hq), heads.slice(2, hq, hkv), heads.slice(2, hq + hkv, hkv)};
}

// Where RoPE puts a rank's tokens: the layer's RoPE settings and the rank's segments of the sequence.
struct TokenPositions {
  const LayerConfig* config = nullptr;
  const SequenceLayout* layout = nullptr;
  int rank = 0;
  std::span<const std::int64_t> document_starts = {};  // packed documents (global starts): positions restart at each
};

namespace ring_heads_detail {

// The packed buffer's parts of groups [first, first + count): q [b, n, count G, d], k and v [b, n, count, d]. One
// strided view covers several groups only when their query heads are evenly spaced: G == 1 (q|k|v per head, every
// part at stride 3d) or a single group.
template <class T>
HeadViews<T> packed_groups(TensorView<T> packed, const QkvPacking& packing, std::int64_t first, std::int64_t count) {
  const std::int64_t b = packed.extent(0), n = packed.extent(1), width = packing.width(), d = packing.head_dim;
  const std::int64_t G = packing.group_size, at = first * (G + 2) * d, group_stride = (G + 2) * d;
  const Shape q_strides{n * width, width, G == 1 ? group_stride : d, 1}, kv_strides{n * width, width, group_stride, 1};
  return {TensorView<T>(packed.data() + at, Shape{b, n, count * G, d}, q_strides),
          TensorView<T>(packed.data() + at + G * d, Shape{b, n, count, d}, kv_strides),
          TensorView<T>(packed.data() + at + (G + 1) * d, Shape{b, n, count, d}, kv_strides)};
}

// The same groups' parts in the heads buffer.
template <class T>
HeadViews<T> heads_groups(TensorView<T> heads, const QkvPacking& packing, std::int64_t first, std::int64_t count) {
  const HeadViews<T> all = head_views(heads, packing);
  const std::int64_t G = packing.group_size;
  return {all.q.slice(2, first * G, count * G), all.k.slice(2, first, count), all.v.slice(2, first, count)};
}

// Calls run(first, count) over runs of groups that one strided view covers (all of them, or one at a time), so a
// RoPE call computes its angles once for as many heads as possible.
template <class Run>
void for_each_group_run(const QkvPacking& packing, Run&& run) {
  if (packing.group_size == 1 || packing.groups == 1) {
    run(std::int64_t{0}, packing.groups);
    return;
  }
  for (std::int64_t group = 0; group < packing.groups; ++group) run(group, std::int64_t{1});
}

inline void check_buffers(const char* op, const Shape& packed, const Shape& heads, const QkvPacking& packing) {
  check(packed.rank() == 3 && packed[2] == packing.width() && heads.rank() == 4 && heads[0] == packed[0] &&
            heads[1] == packed[1] && heads[2] == packing.heads() && heads[3] == packing.head_dim,
        "{}: packed {} must be [b, n, {}] and heads {} [b, n, {}, {}]", op, packed, packing.width(), heads,
        packing.heads(), packing.head_dim);
}

// Calls run(local, length, position) for each run of consecutive positions of the rank's tokens.
template <class Run>
void for_each_run(const TokenPositions& where, Run&& run) {
  for (int i = 0; i < where.layout->segment_count(); ++i) {
    const TokenSegment s = where.layout->segment(where.rank, i);
    if (s.length) run(s.local, s.length, s.begin);
  }
}

}  // namespace ring_heads_detail

// heads: [b, n, hq + 2 hkv, d] (overwritten) <- packed: [b, n, W] in shard order, with RoPE on q and k.
template <class Backend>
void unpack_heads(const QkvPacking& packing, const TokenPositions& where, TensorView<const float> packed,
                  TensorView<float> heads) {
  using namespace ring_heads_detail;
  check_buffers("unpack_heads", packed.shape(), heads.shape(), packing);
  const ops::RopeConfig rope{.theta = where.config->rope_base};
  for_each_group_run(packing, [&](std::int64_t first, std::int64_t count) {
    const HeadViews<const float> from = packed_groups(packed, packing, first, count);
    const HeadViews<float> to = heads_groups(heads, packing, first, count);
    Backend::copy(from.v, to.v);
    if (!where.config->rope) {
      Backend::copy(from.q, to.q);
      Backend::copy(from.k, to.k);
      return;
    }
    for_each_run(where, [&](std::int64_t local, std::int64_t length, std::int64_t position) {
      Backend::rope_forward(from.q.slice(1, local, length), to.q.slice(1, local, length), position, rope, where.document_starts);
      Backend::rope_forward(from.k.slice(1, local, length), to.k.slice(1, local, length), position, rope, where.document_starts);
    });
  });
}

// packed: [b, n, W] (overwritten) <- the gradients in heads: [b, n, hq + 2 hkv, d], RoPE undone on q and k.
template <class Backend>
void pack_head_gradients(const QkvPacking& packing, const TokenPositions& where, TensorView<const float> heads,
                         TensorView<float> packed) {
  using namespace ring_heads_detail;
  check_buffers("pack_head_gradients", packed.shape(), heads.shape(), packing);
  const ops::RopeConfig rope{.theta = where.config->rope_base};
  if (where.config->rope) Backend::fill(packed, 0.0f);  // rope_backward accumulates
  for_each_group_run(packing, [&](std::int64_t first, std::int64_t count) {
    const HeadViews<const float> from = heads_groups(heads, packing, first, count);
    const HeadViews<float> to = packed_groups(packed, packing, first, count);
    Backend::copy(from.v, to.v);
    if (!where.config->rope) {
      Backend::copy(from.q, to.q);
      Backend::copy(from.k, to.k);
      return;
    }
    for_each_run(where, [&](std::int64_t local, std::int64_t length, std::int64_t position) {
      Backend::rope_backward(from.q.slice(1, local, length), to.q.slice(1, local, length), position, rope, where.document_starts);
      Backend::rope_backward(from.k.slice(1, local, length), to.k.slice(1, local, length), position, rope, where.document_starts);
    });
  });
}

}  // namespace paradyse
