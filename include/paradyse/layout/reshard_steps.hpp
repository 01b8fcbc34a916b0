// paradyse/layout/reshard_steps.hpp: the steps of the redistribution engine, one collective of one group each.
//
// Every step writes into an output the caller owns, stages through a Workspace (anything with
// `acquire<T>(Shape)` returning a buffer with view()/span(): the strategies' BufferPool, or FreshTensors below),
// and moves data only through the Backend (float) or the host copy (other element types), so a dry run with
// ops::Counting, meta memory and a symbolic communicator records the same step without touching data.
//
// Fast paths (no staging, no packing): when the chunks of the cut dim are consecutive blocks of the buffer (every
// dim before it has extent 1 and the cut is contiguous, as for [1, s, h] sharded on s), buffers go to the collective
// as they are. So the sequence <-> head all-to-all of Ulysses on [p, b, s, W] (Shard(2) <-> Shard(0)) sends its
// head-group chunks in place, and the sequence all-gather of [1, s, h] lands straight in its output.
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/layout/chunking.hpp"
#include "paradyse/layout/layout.hpp"
#include "paradyse/layout/placement.hpp"
#include "paradyse/ops/backend.hpp"

#include <algorithm>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

namespace paradyse {

// A Workspace that allocates a new tensor per request (through the current tracker).
struct FreshTensors {
  template <class T>
  Tensor<T> acquire(Shape shape) {
    return Tensor<T>(shape);
  }
};

namespace reshard_detail {

// to <- from (equal shapes, any strides): the backend for float, the host copy otherwise.
template <class Backend, class T>
void move(TensorView<const T> from, TensorView<T> to) {
  if constexpr (std::is_same_v<T, float>)
    Backend::copy(from, to);
  else
    copy(from, to);
}

// Product of the extents of every dim but `dim`.
inline std::int64_t numel_without(const Shape& shape, int dim) {
  std::int64_t n = 1;
  for (int d = 0; d < shape.rank(); ++d)
    if (d != dim) n *= shape[d];
  return n;
}

// Whether contiguous chunks of `dim` are already consecutive blocks of the buffer.
inline bool chunks_are_blocks(const Shape& shape, int dim, Chunking how) {
  if (how != Chunking::contiguous) return false;
  for (int d = 0; d < dim; ++d)
    if (shape[d] != 1) return false;
  return true;
}

inline std::span<const std::int64_t> as_span(const std::vector<std::int64_t>& v) { return {v.data(), v.size()}; }

// The `ranges` of dim `dim` of x, concatenated in order, written to `out` (shape of x with dim -> total length).
template <class Backend, class T>
void pack_ranges(TensorView<const T> x, int dim, std::span<const ChunkRange> ranges, TensorView<T> out) {
  std::int64_t offset = 0;
  for (const ChunkRange& r : ranges) {
    if (r.length) move<Backend>(x.slice(dim, r.start, r.length), out.slice(dim, offset, r.length));
    offset += r.length;
  }
}
// The inverse: consecutive positions of `block` along dim go to `ranges` of out.
template <class Backend, class T>
void unpack_ranges(TensorView<const T> block, int dim, std::span<const ChunkRange> ranges, TensorView<T> out) {
  std::int64_t offset = 0;
  for (const ChunkRange& r : ranges) {
    if (r.length) move<Backend>(block.slice(dim, offset, r.length), out.slice(dim, r.start, r.length));
    offset += r.length;
  }
}

template <class T>
TensorView<const T> as_const(TensorView<T> x) { return x; }

// Partial -> Shard(dim): each rank of the group receives the reduced ranges it holds. out: x's shape with the dim
// cut to my ranges.
template <class Backend, class T, class Group, class Workspace>
void reduce_scatter_into(Group& group, TensorView<const T> x, Placement after, ReduceOp op, TensorView<T> out,
                         Workspace& ws) {
  const int p = int(group.size()), d = after.dim;
  const std::int64_t extent = x.extent(d), rest = numel_without(x.shape(), d);
  std::vector<std::int64_t> counts(static_cast<std::size_t>(p));
  for (int r = 0; r < p; ++r) counts[std::size_t(r)] = rest * shard_ranges(extent, p, r, after.chunking).length();
  if (chunks_are_blocks(x.shape(), d, after.chunking)) {
    group.reduce_scatter_v(x.span(), out.span(), as_span(counts), op);
    return;
  }
  auto packed = ws.template acquire<T>(Shape{x.numel()});
  std::int64_t offset = 0;
  for (int r = 0; r < p; ++r) {
    const ShardRanges ranges = shard_ranges(extent, p, r, after.chunking);
    pack_ranges<Backend>(x, d, ranges.span(), TensorView<T>(packed.data() + offset, x.shape().with(d, ranges.length())));
    offset += counts[std::size_t(r)];
  }
  group.reduce_scatter_v(std::span<const T>(packed.span()), out.span(), as_span(counts), op);
}

// Shard(dim) -> Replicate: every rank's ranges gathered into the dim's full extent (out's extent).
template <class Backend, class T, class Group, class Workspace>
void all_gather_into(Group& group, TensorView<const T> x, Placement before, TensorView<T> out, Workspace& ws) {
  const int p = int(group.size()), d = before.dim;
  const std::int64_t extent = out.extent(d), rest = numel_without(x.shape(), d);
  std::vector<std::int64_t> counts(static_cast<std::size_t>(p));
  std::int64_t total = 0;
  for (int r = 0; r < p; ++r)
    total += counts[std::size_t(r)] = rest * shard_ranges(extent, p, r, before.chunking).length();
  if (chunks_are_blocks(x.shape(), d, before.chunking)) {
    group.all_gather_v(x.span(), out.span(), as_span(counts));
    return;
  }
  auto gathered = ws.template acquire<T>(Shape{total});
  group.all_gather_v(x.span(), gathered.span(), as_span(counts));
  std::int64_t offset = 0;
  for (int r = 0; r < p; ++r) {
    const ShardRanges ranges = shard_ranges(extent, p, r, before.chunking);
    unpack_ranges<Backend>(TensorView<const T>(gathered.data() + offset, x.shape().with(d, ranges.length())), d,
                           ranges.span(), out);
    offset += counts[std::size_t(r)];
  }
}

// Shard(i) -> Shard(j): rank q gets my part of its cut of j; what rank r sends lands at r's ranges of i. out: x's
// shape with dim i at its full extent (out's) and dim j cut to my ranges.
template <class Backend, class T, class Group, class Workspace>
void all_to_all_into(Group& group, TensorView<const T> x, Placement before, Placement after, TensorView<T> out,
                     Workspace& ws) {
  const int p = int(group.size()), i = before.dim, j = after.dim;
  const std::int64_t extent_i = out.extent(i), extent_j = x.extent(j);
  std::vector<std::int64_t> send_counts(static_cast<std::size_t>(p)), recv_counts(static_cast<std::size_t>(p));
  for (int q = 0; q < p; ++q)
    send_counts[std::size_t(q)] = x.shape().with(j, shard_ranges(extent_j, p, q, after.chunking).length()).numel();
  std::int64_t total = 0;
  for (int r = 0; r < p; ++r)
    total += recv_counts[std::size_t(r)] =
        out.shape().with(i, shard_ranges(extent_i, p, r, before.chunking).length()).numel();

  const bool send_in_place = chunks_are_blocks(x.shape(), j, after.chunking);
  decltype(ws.template acquire<T>(Shape{})) send;  // staged only when the chunks are not blocks
  if (!send_in_place) {
    send = ws.template acquire<T>(Shape{x.numel()});
    std::int64_t offset = 0;
    for (int q = 0; q < p; ++q) {
      const ShardRanges ranges = shard_ranges(extent_j, p, q, after.chunking);
      pack_ranges<Backend>(x, j, ranges.span(), TensorView<T>(send.data() + offset, x.shape().with(j, ranges.length())));
      offset += send_counts[std::size_t(q)];
    }
  }
  const std::span<const T> send_buffer = send_in_place ? x.span() : std::span<const T>(send.span());
  if (chunks_are_blocks(out.shape(), i, before.chunking)) {
    group.all_to_all_v(send_buffer, as_span(send_counts), out.span(), as_span(recv_counts));
    return;
  }
  auto received = ws.template acquire<T>(Shape{total});
  group.all_to_all_v(send_buffer, as_span(send_counts), received.span(), as_span(recv_counts));
  std::int64_t offset = 0;
  for (int r = 0; r < p; ++r) {
    const ShardRanges ranges = shard_ranges(extent_i, p, r, before.chunking);
    unpack_ranges<Backend>(TensorView<const T>(received.data() + offset, out.shape().with(i, ranges.length())), i,
                           ranges.span(), out);
    offset += recv_counts[std::size_t(r)];
  }
}

// Shard(d, one chunking) -> Shard(d, the other) over the same `extent`: the pieces whose owner changes move.
template <class Backend, class T, class Group, class Workspace>
void permute_into(Group& group, TensorView<const T> x, Placement before, Placement after, std::int64_t extent,
                  TensorView<T> out, Workspace& ws) {
  const int p = int(group.size()), me = int(group.rank()), d = before.dim;
  const std::int64_t rest = numel_without(x.shape(), d);
  struct Piece {
    std::int64_t length, owner_offset, receiver_offset;
    int owner;
  };
  // The pieces rank q receives, in q's local order: its target ranges cut at the owners' source ranges.
  auto pieces_of = [&](int q) {
    std::vector<Piece> pieces;
    std::int64_t receiver_offset = 0;
    const ShardRanges targets = shard_ranges(extent, p, q, after.chunking);
    for (const ChunkRange& t : targets.span()) {
      for (int r = 0; r < p; ++r) {
        std::int64_t owner_offset = 0;
        const ShardRanges sources = shard_ranges(extent, p, r, before.chunking);
        for (const ChunkRange& s : sources.span()) {
          const std::int64_t lo = std::max(t.start, s.start), hi = std::min(t.end(), s.end());
          if (lo < hi) pieces.push_back({hi - lo, owner_offset + (lo - s.start), receiver_offset + (lo - t.start), r});
          owner_offset += s.length;
        }
      }
      receiver_offset += t.length;
    }
    std::sort(pieces.begin(), pieces.end(),
              [](const Piece& a, const Piece& b) { return a.receiver_offset < b.receiver_offset; });
    return pieces;
  };
  std::vector<std::int64_t> send_counts(static_cast<std::size_t>(p), 0), recv_counts(static_cast<std::size_t>(p), 0);
  auto send = ws.template acquire<T>(Shape{x.numel()});
  std::int64_t offset = 0;
  for (int q = 0; q < p; ++q) {
    std::int64_t length = 0;
    for (const Piece& piece : pieces_of(q))
      if (piece.owner == me) {
        const Shape block_shape = x.shape().with(d, piece.length);
        move<Backend>(x.slice(d, piece.owner_offset, piece.length), TensorView<T>(send.data() + offset, block_shape));
        offset += block_shape.numel();
        length += piece.length;
      }
    send_counts[std::size_t(q)] = rest * length;
  }
  const std::vector<Piece> mine = pieces_of(me);
  for (const Piece& piece : mine) recv_counts[std::size_t(piece.owner)] += rest * piece.length;
  std::int64_t total = 0;
  std::vector<std::int64_t> cursor(static_cast<std::size_t>(p), 0);  // where the next piece from each owner starts
  for (int r = 0; r < p; ++r) {
    cursor[std::size_t(r)] = total;
    total += recv_counts[std::size_t(r)];
  }
  auto received = ws.template acquire<T>(Shape{total});
  group.all_to_all_v(std::span<const T>(send.span().first(std::size_t(offset))), as_span(send_counts), received.span(),
                     as_span(recv_counts));
  for (const Piece& piece : mine) {
    const Shape block_shape = x.shape().with(d, piece.length);
    move<Backend>(TensorView<const T>(received.data() + cursor[std::size_t(piece.owner)], block_shape),
                  out.slice(d, piece.receiver_offset, piece.length));
    cursor[std::size_t(piece.owner)] += block_shape.numel();
  }
}

}  // namespace reshard_detail
}  // namespace paradyse
