// paradyse/layout/reshard.hpp: reshard(comm, x, global, from, to), the redistribution engine.
//
//   MeshCommunicator mc(mesh, world);   // collective once: one group per mesh axis
//   Tensor<float> y = reshard(mc, x, global_shape, StaticLayout<Shard<1>>{}, StaticLayout<Shard<2>>{});
//
// The plan (reshard_plan.hpp) names one collective per step; each runs on the group of its mesh axis, with the _v
// forms so uneven chunks need no padding. The global shape is an argument because uneven chunking makes it
// unknowable from a local shape (334 local tokens may be 1000 or 1001 over 3 ranks); every rank knows every other
// rank's local shape from it without communicating.
//
// Post-conditions (tested exhaustively over meshes of 1 to 3 axes and 1 to 8 ranks): when x is the `from` shard of a
// global tensor G on every rank, the result is the `to` shard of G on every rank (for a Partial target: the terms
// op-reduce over the Partial axes to the shard of G), and resharding back gives x again.
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/layout/layout.hpp"
#include "paradyse/layout/reshard_plan.hpp"
#include "paradyse/mesh/device_mesh.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

namespace paradyse {

// A world communicator seen through a mesh: the calling rank's coordinate and one group per mesh axis.
template <Communicator C>
class MeshCommunicator {
public:
  // Collective over `world` (every rank calls it): splits one group per axis. `world` must outlive this object.
  MeshCommunicator(DeviceMesh mesh, C& world) : mesh_(std::move(mesh)), world_(&world) {
    mesh_.check_world_size(int(world.size()));
    coordinate_ = mesh_.coordinate(int(world.rank()));
    for (int a = 0; a < mesh_.ndim(); ++a) {
      const int axis[] = {a};
      groups_.push_back(mesh_.group(world, std::span<const int>(axis)));
    }
  }

  const DeviceMesh& mesh() const noexcept { return mesh_; }
  const MeshCoordinate& coordinate() const noexcept { return coordinate_; }
  int rank() const { return int(world_->rank()); }
  C& world() noexcept { return *world_; }
  // The group of mesh axis `a` (my peers that differ from me only along a), ordered by their index on a.
  C& axis(int a) {
    mesh_.axis(a);
    return groups_[std::size_t(a)];
  }
  C& axis(std::string_view name) { return groups_[std::size_t(mesh_.axis_index(name))]; }
  // Bytes this rank sent through the axis groups so far.
  std::uint64_t bytes_sent() const {
    std::uint64_t n = 0;
    for (const C& g : groups_) n += CommStats(g.stats()).bytes_sent;
    return n;
  }

private:
  DeviceMesh mesh_;
  C* world_;
  MeshCoordinate coordinate_;
  std::vector<C> groups_;
};

template <Communicator C>
MeshCommunicator(DeviceMesh, C&) -> MeshCommunicator<C>;

// What a reshard did: its plan and the bytes this rank sent.
struct ReshardReport {
  ReshardPlan plan;
  std::uint64_t bytes_sent = 0;
};

namespace reshard_detail {

// Product of the extents of every dim but `dim`.
inline std::int64_t numel_without(const Shape& shape, int dim) {
  std::int64_t n = 1;
  for (int d = 0; d < shape.rank(); ++d)
    if (d != dim) n *= shape[d];
  return n;
}

// Copies positions [from_start, from_start + length) of dim `dim` of `from` to [to_start, ...) of `to`. Both are
// contiguous and agree on every other dim, so this is `outer` memcpy calls of length * inner elements.
template <class T>
void copy_along(TensorView<const T> from, int dim, std::int64_t from_start, TensorView<T> to, std::int64_t to_start,
                std::int64_t length) {
  std::int64_t outer = 1, inner = 1;
  for (int d = 0; d < dim; ++d) outer *= from.shape()[d];
  for (int d = dim + 1; d < from.rank(); ++d) inner *= from.shape()[d];
  const std::int64_t from_extent = from.shape()[dim], to_extent = to.shape()[dim];
  if (length == 0 || inner == 0) return;
  for (std::int64_t o = 0; o < outer; ++o)
    std::memcpy(to.data() + (o * to_extent + to_start) * inner, from.data() + (o * from_extent + from_start) * inner,
                std::size_t(length * inner) * sizeof(T));
}

// The `ranges` of dim `dim` of x, concatenated in order, written to `out` (shape of x with dim -> total length).
template <class T>
void pack_ranges(TensorView<const T> x, int dim, std::span<const ChunkRange> ranges, TensorView<T> out) {
  std::int64_t offset = 0;
  for (const ChunkRange& r : ranges) {
    copy_along(x, dim, r.start, out, offset, r.length);
    offset += r.length;
  }
}
// The inverse: consecutive positions of `block` along dim go to `ranges` of out.
template <class T>
void unpack_ranges(TensorView<const T> block, int dim, std::span<const ChunkRange> ranges, TensorView<T> out) {
  std::int64_t offset = 0;
  for (const ChunkRange& r : ranges) {
    copy_along(block, dim, offset, out, r.start, r.length);
    offset += r.length;
  }
}

inline std::span<const std::int64_t> as_span(const std::vector<std::int64_t>& v) { return {v.data(), v.size()}; }

// Whether contiguous chunks of `dim` are already consecutive blocks of the buffer (every dim before it has extent
// 1, as for [1, s, h] sharded on s): then packing is the identity and buffers go to the collective as they are.
inline bool chunks_are_blocks(const Shape& shape, int dim, Chunking how) {
  if (how != Chunking::contiguous) return false;
  for (int d = 0; d < dim; ++d)
    if (shape[d] != 1) return false;
  return true;
}

// Partial -> Shard(dim): each rank of the group receives the reduced ranges it will hold.
template <class T, class Group>
Tensor<T> reduce_scatter_step(Group& group, TensorView<const T> x, Placement after, ReduceOp op) {
  const int p = int(group.size()), d = after.dim;
  const std::int64_t extent = x.extent(d), rest = numel_without(x.shape(), d);
  const bool in_place = chunks_are_blocks(x.shape(), d, after.chunking);
  std::vector<std::int64_t> counts(static_cast<std::size_t>(p));
  Tensor<T> packed(Shape{in_place ? 0 : x.numel()});
  std::int64_t offset = 0;
  for (int r = 0; r < p; ++r) {
    const ShardRanges ranges = shard_ranges(extent, p, r, after.chunking);
    const Shape block_shape = x.shape().with(d, ranges.length());
    if (!in_place) pack_ranges(x, d, ranges.span(), TensorView<T>(packed.data() + offset, block_shape));
    counts[std::size_t(r)] = rest * ranges.length();
    offset += counts[std::size_t(r)];
  }
  const ShardRanges mine = shard_ranges(extent, p, int(group.rank()), after.chunking);
  Tensor<T> out(x.shape().with(d, mine.length()));
  group.reduce_scatter_v(in_place ? x.span() : std::span<const T>(packed.span()), out.span(), as_span(counts), op);
  return out;
}

// Shard(dim) -> Replicate: gather every rank's ranges into the `extent` of the dim.
template <class T, class Group>
Tensor<T> all_gather_step(Group& group, TensorView<const T> x, Placement before, std::int64_t extent) {
  const int p = int(group.size()), d = before.dim;
  const std::int64_t rest = numel_without(x.shape(), d);
  std::vector<std::int64_t> counts(static_cast<std::size_t>(p));
  std::int64_t total = 0;
  for (int r = 0; r < p; ++r)
    total += counts[std::size_t(r)] = rest * shard_ranges(extent, p, r, before.chunking).length();
  Tensor<T> out(x.shape().with(d, extent));
  if (chunks_are_blocks(x.shape(), d, before.chunking)) {
    group.all_gather_v(x.span(), out.span(), as_span(counts));
    return out;
  }
  Tensor<T> gathered(Shape{total});
  group.all_gather_v(x.span(), gathered.span(), as_span(counts));
  std::int64_t offset = 0;
  for (int r = 0; r < p; ++r) {
    const ShardRanges ranges = shard_ranges(extent, p, r, before.chunking);
    unpack_ranges(TensorView<const T>(gathered.data() + offset, x.shape().with(d, ranges.length())), d, ranges.span(),
                  out.view());
    offset += counts[std::size_t(r)];
  }
  return out;
}

// Shard(i) -> Shard(j): send rank q my part of its cut of j; place what rank r sends at r's ranges of i.
template <class T, class Group>
Tensor<T> all_to_all_step(Group& group, TensorView<const T> x, Placement before, Placement after,
                          std::int64_t extent_i) {
  const int p = int(group.size()), me = int(group.rank()), i = before.dim, j = after.dim;
  const std::int64_t extent_j = x.extent(j);
  const ShardRanges my_j = shard_ranges(extent_j, p, me, after.chunking);
  const bool send_in_place = chunks_are_blocks(x.shape(), j, after.chunking);
  std::vector<std::int64_t> send_counts(static_cast<std::size_t>(p)), recv_counts(static_cast<std::size_t>(p));
  Tensor<T> send(Shape{send_in_place ? 0 : x.numel()});
  std::int64_t offset = 0;
  for (int q = 0; q < p; ++q) {
    const ShardRanges ranges = shard_ranges(extent_j, p, q, after.chunking);
    const Shape block_shape = x.shape().with(j, ranges.length());
    if (!send_in_place) pack_ranges(x, j, ranges.span(), TensorView<T>(send.data() + offset, block_shape));
    send_counts[std::size_t(q)] = block_shape.numel();
    offset += block_shape.numel();
  }
  const std::span<const T> send_buffer = send_in_place ? x.span() : std::span<const T>(send.span());
  const Shape out_shape = x.shape().with(i, extent_i).with(j, my_j.length());
  std::int64_t total = 0;
  for (int r = 0; r < p; ++r)
    total += recv_counts[std::size_t(r)] =
        out_shape.with(i, shard_ranges(extent_i, p, r, before.chunking).length()).numel();
  Tensor<T> out(out_shape);
  if (chunks_are_blocks(out_shape, i, before.chunking)) {
    group.all_to_all_v(send_buffer, as_span(send_counts), out.span(), as_span(recv_counts));
    return out;
  }
  Tensor<T> received(Shape{total});
  group.all_to_all_v(send_buffer, as_span(send_counts), received.span(), as_span(recv_counts));
  offset = 0;
  for (int r = 0; r < p; ++r) {
    const ShardRanges ranges = shard_ranges(extent_i, p, r, before.chunking);
    unpack_ranges(TensorView<const T>(received.data() + offset, out_shape.with(i, ranges.length())), i, ranges.span(),
                  out.view());
    offset += recv_counts[std::size_t(r)];
  }
  return out;
}

// Shard(d, one chunking) -> Shard(d, the other) over the same `extent`: the pieces whose owner changes move.
template <class T, class Group>
Tensor<T> permute_step(Group& group, TensorView<const T> x, Placement before, Placement after, std::int64_t extent) {
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
  Tensor<T> send(Shape{x.numel()});
  std::int64_t offset = 0;
  for (int q = 0; q < p; ++q) {
    std::int64_t length = 0;
    for (const Piece& piece : pieces_of(q))
      if (piece.owner == me) {
        const Shape block_shape = x.shape().with(d, piece.length);
        copy_along(x, d, piece.owner_offset, TensorView<T>(send.data() + offset, block_shape), 0, piece.length);
        offset += block_shape.numel();
        length += piece.length;
      }
    send_counts[std::size_t(q)] = rest * length;
  }
  const std::vector<Piece> mine = pieces_of(me);
  for (const Piece& piece : mine) recv_counts[std::size_t(piece.owner)] += rest * piece.length;
  std::int64_t total = 0;
  std::vector<std::int64_t> block_start(static_cast<std::size_t>(p), 0);
  for (int r = 0; r < p; ++r) {
    block_start[std::size_t(r)] = total;
    total += recv_counts[std::size_t(r)];
  }
  Tensor<T> received(Shape{total});
  group.all_to_all_v(std::span<const T>(send.span()), as_span(send_counts), received.span(), as_span(recv_counts));
  Tensor<T> out(x.shape().with(d, shard_ranges(extent, p, me, after.chunking).length()));
  std::vector<std::int64_t> cursor = block_start;  // where the next piece from each owner starts
  for (const Piece& piece : mine) {
    const Shape block_shape = x.shape().with(d, piece.length);
    copy_along(TensorView<const T>(received.data() + cursor[std::size_t(piece.owner)], block_shape), d, 0, out.view(),
               piece.receiver_offset, piece.length);
    cursor[std::size_t(piece.owner)] += block_shape.numel();
  }
  return out;
}

}  // namespace reshard_detail

// x (the `from` shard of a tensor of shape `global` on this rank) as the `to` shard, on every rank of the mesh.
// Collective over the mesh: every rank calls it with the same layouts and global shape.
template <Communicator C, CommElement T, Layout From, Layout To>
Tensor<T> reshard(MeshCommunicator<C>& comm, TensorView<const T> x, const Shape& global, const From& from,
                  const To& to, ReshardReport* report = nullptr) {
  using Kind = ReshardStep::Kind;
  using namespace reshard_detail;
  const DeviceMesh& mesh = comm.mesh();
  const MeshCoordinate& coord = comm.coordinate();
  const DynamicLayout from_value = checked_layout(from, mesh, global);
  checked_layout(to, mesh, global);
  const Shape expected = local_shape(from_value, global, mesh, coord);
  if (x.shape() != expected)
    throw Error(fmt::format("reshard: rank {} holds a shard of shape {}, but layout {} of global shape {} gives it {}",
                            comm.rank(), x.shape(), from_value.to_string(), global, expected));
  ReshardPlan plan = plan_reshard(from, to, global.rank());
  const std::uint64_t bytes_before = comm.bytes_sent();

  // Steps read the input in place (a strided view is made contiguous first); each writes a new tensor.
  Tensor<T> current;
  const bool copy_first = !x.is_contiguous() || plan.steps.empty();
  if (copy_first) current = Tensor<T>::copy_of(x);
  bool reading_input = !copy_first;
  DynamicLayout layout = plan.from;
  for (const ReshardStep& s : plan.steps) {
    C& group = comm.axis(s.axis);
    const DynamicLayout next = layout.with(s.axis, s.after);
    const TensorView<const T> view = reading_input ? x : TensorView<const T>(current.view());
    reading_input = false;
    switch (s.kind) {
      case Kind::all_reduce: {
        Tensor<T> out(view.shape());
        group.all_reduce(view.span(), out.span(), s.before.op);
        current = std::move(out);
        break;
      }
      case Kind::reduce_scatter: current = reduce_scatter_step(group, view, s.after, s.before.op); break;
      case Kind::all_gather:
        current = all_gather_step(group, view, s.before, local_shape(next, global, mesh, coord)[s.before.dim]);
        break;
      case Kind::all_to_all:
        current = all_to_all_step(group, view, s.before, s.after, local_shape(next, global, mesh, coord)[s.before.dim]);
        break;
      case Kind::permute: {
        const DynamicLayout parent = layout.with(s.axis, Placement::replicate());
        current = permute_step(group, view, s.before, s.after, local_shape(parent, global, mesh, coord)[s.before.dim]);
        break;
      }
      case Kind::slice: {
        const int d = s.after.dim;
        const ShardRanges ranges =
            shard_ranges(view.extent(d), mesh.axis_size(s.axis), coord[s.axis], s.after.chunking);
        Tensor<T> out(view.shape().with(d, ranges.length()));
        pack_ranges(view, d, ranges.span(), out.view());
        current = std::move(out);
        break;
      }
      case Kind::make_partial: {
        Tensor<T> out(view.shape());  // zeros: the sum's other terms
        if (s.after.op != ReduceOp::sum || coord[s.axis] == 0) copy(view, out.view());
        current = std::move(out);
        break;
      }
    }
    layout = next;
  }
  if (report) *report = {std::move(plan), comm.bytes_sent() - bytes_before};
  return current;
}

template <Communicator C, CommElement T, Layout From, Layout To>
Tensor<T> reshard(MeshCommunicator<C>& comm, const Tensor<T>& x, const Shape& global, const From& from, const To& to,
                  ReshardReport* report = nullptr) {
  return reshard(comm, x.view(), global, from, to, report);
}

}  // namespace paradyse
