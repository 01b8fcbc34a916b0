// paradyse/layout/layout.hpp: layouts (one placement per mesh axis) and the geometry of a rank's shard.
//
//   using SeqSharded = StaticLayout<Replicate, Shard<1>>;        // compile time: dp replicates, sp shards dim 1
//   DynamicLayout heads{Placement::replicate(), Placement::shard(2)};  // run time, for the generic engine
//   Shape mine = local_shape(SeqSharded{}, global, mesh, mesh.coordinate(rank));
//
// The Layout concept: a type with mesh_ndim(), placement(axis) and dynamic() (the runtime value). StaticLayout<Ps...>
// models it at compile time (its placements are constants strategies can branch on with if constexpr), and
// DynamicLayout at run time; every function here takes any Layout.
//
// Nesting rule. When several mesh axes shard the same tensor dim, they apply in mesh-axis order: the first such axis
// cuts the global extent, the next cuts the first one's chunk, and so on (for {dp, sp} both sharding dim 1: my chunk
// is chunk sp of chunk dp, i.e. rank-major order, like one axis of dp*sp ranks when both are contiguous). Zigzag
// cuts whatever extent it is given, so a zigzag axis after another axis balances within the outer chunk.
//
// Post-conditions (tested over every coordinate of small meshes): for a layout without Partial axes,
//   - local_ranges(...) lists, in local order, the global index ranges my shard holds along each dim, and the
//     local tensor is exactly global restricted to the product of those index sets;
//   - every global element is held by exactly (product of the sizes of the axes that do not shard) ranks;
//   - local_shape(...)[d] is the total length of local_ranges(..., d).
// A Partial axis leaves the geometry alone: its ranks hold full-size terms whose op over the axis is the tensor.
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/shape.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/layout/chunking.hpp"
#include "paradyse/layout/placement.hpp"
#include "paradyse/mesh/device_mesh.hpp"

#include <fmt/format.h>

#include <array>
#include <concepts>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <vector>

namespace paradyse {

// ---- the runtime layout -------------------------------------------------------------------------------------------
class DynamicLayout {
public:
  DynamicLayout() = default;
  DynamicLayout(std::initializer_list<Placement> placements)
      : DynamicLayout(std::span<const Placement>(placements.begin(), placements.size())) {}
  explicit DynamicLayout(std::span<const Placement> placements) : ndim_(int(placements.size())) {
    check(placements.size() <= std::size_t(kMaxMeshAxes), "a layout has {} placements; at most {} mesh axes exist",
          placements.size(), kMaxMeshAxes);
    std::copy(placements.begin(), placements.end(), placements_.begin());
  }
  // Every axis placed the same way.
  static DynamicLayout uniform(int mesh_ndim, Placement placement) {
    check(mesh_ndim >= 0 && mesh_ndim <= kMaxMeshAxes, "a layout over {} mesh axes; expected 0 to {}", mesh_ndim,
          kMaxMeshAxes);
    DynamicLayout layout;
    layout.ndim_ = mesh_ndim;
    for (int a = 0; a < mesh_ndim; ++a) layout.placements_[std::size_t(a)] = placement;
    return layout;
  }

  int mesh_ndim() const noexcept { return ndim_; }
  Placement placement(int axis) const {
    if (!(axis >= 0 && axis < ndim_))
      throw Error(fmt::format("axis {} is outside the {} axes of layout {}", axis, ndim_, to_string()));
    return placements_[std::size_t(axis)];
  }
  Placement operator[](int axis) const { return placement(axis); }
  // A copy with axis `axis` placed as `p`.
  DynamicLayout with(int axis, Placement p) const {
    placement(axis);
    DynamicLayout copy = *this;
    copy.placements_[std::size_t(axis)] = p;
    return copy;
  }
  DynamicLayout dynamic() const { return *this; }
  const Placement* begin() const noexcept { return placements_.data(); }
  const Placement* end() const noexcept { return placements_.data() + ndim_; }

  bool has_partial() const noexcept {
    for (const Placement& p : *this)
      if (p.is_partial()) return true;
    return false;
  }
  // Negative shard dims resolved against a tensor of `tensor_rank` dims (checked).
  DynamicLayout normalized(int tensor_rank) const {
    DynamicLayout copy = *this;
    for (int a = 0; a < ndim_; ++a)
      copy.placements_[std::size_t(a)] = placements_[std::size_t(a)].normalized(tensor_rank);
    return copy;
  }

  friend bool operator==(const DynamicLayout& a, const DynamicLayout& b) noexcept {
    return a.ndim_ == b.ndim_ && std::equal(a.begin(), a.end(), b.begin());
  }
  std::string to_string() const {
    std::string s = "(";
    for (int a = 0; a < ndim_; ++a) s += (a ? ", " : "") + placements_[std::size_t(a)].to_string();
    return s + ")";
  }

private:
  std::array<Placement, kMaxMeshAxes> placements_{};
  int ndim_ = 0;
};

// ---- compile-time layouts -----------------------------------------------------------------------------------------
template <PlacementType... Ps>
struct StaticLayout {
  static_assert(sizeof...(Ps) >= 1 && sizeof...(Ps) <= kMaxMeshAxes, "a layout places 1 to kMaxMeshAxes mesh axes");
  static constexpr std::array<Placement, sizeof...(Ps)> placements{Ps::value...};

  static constexpr int mesh_ndim() noexcept { return int(sizeof...(Ps)); }
  static constexpr Placement placement(int axis) { return placements[std::size_t(axis)]; }
  static DynamicLayout dynamic() { return DynamicLayout{Ps::value...}; }
  operator DynamicLayout() const { return dynamic(); }

  // Whether some axis shards dim `dim` (as written: negative dims are not resolved here).
  static constexpr bool shards(int dim) noexcept {
    for (const Placement& p : placements)
      if (p.is_shard(dim)) return true;
    return false;
  }
  static constexpr bool has_partial() noexcept {
    for (const Placement& p : placements)
      if (p.is_partial()) return true;
    return false;
  }
};

template <class L>
concept Layout = requires(const L& layout, int axis) {
  { layout.mesh_ndim() } -> std::convertible_to<int>;
  { layout.placement(axis) } -> std::convertible_to<Placement>;
  { layout.dynamic() } -> std::same_as<DynamicLayout>;
};

static_assert(Layout<DynamicLayout>);
static_assert(Layout<StaticLayout<Replicate, Shard<1>>>);

// ---- geometry -----------------------------------------------------------------------------------------------------
// The index ranges one placement gives rank `index` of `parts` out of `extent` elements: one range (contiguous) or
// two (zigzag), in local order.
struct ShardRanges {
  std::array<ChunkRange, 2> ranges{};
  int count = 0;

  std::span<const ChunkRange> span() const noexcept { return {ranges.data(), std::size_t(count)}; }
  std::int64_t length() const noexcept {
    std::int64_t n = 0;
    for (const ChunkRange& r : span()) n += r.length;
    return n;
  }
};
inline ShardRanges shard_ranges(std::int64_t extent, int parts, int index, Chunking how) {
  if (how == Chunking::zigzag) {
    const auto z = zigzag_ranges(extent, parts, index);
    return {{z[0], z[1]}, 2};
  }
  return {{chunk_range(extent, parts, index), ChunkRange{}}, 1};
}

// The global ranges behind `picks`, which are ranges of the concatenation of `segments` (the composition of two
// index maps). Empty pieces are dropped and touching pieces merged, so the result is minimal.
inline std::vector<ChunkRange> compose_ranges(std::span<const ChunkRange> segments, std::span<const ChunkRange> picks) {
  std::vector<ChunkRange> out;
  for (const ChunkRange& pick : picks) {
    std::int64_t offset = 0;  // local start of the current segment
    for (const ChunkRange& segment : segments) {
      const std::int64_t lo = std::max(pick.start, offset), hi = std::min(pick.end(), offset + segment.length);
      if (lo < hi) {
        const ChunkRange piece{segment.start + (lo - offset), hi - lo};
        if (!out.empty() && out.back().end() == piece.start)
          out.back().length += piece.length;
        else
          out.push_back(piece);
      }
      offset += segment.length;
    }
  }
  return out;
}

// Checks that `layout` fits `mesh` and a tensor of shape `global`; returns it with shard dims resolved.
template <Layout L>
DynamicLayout checked_layout(const L& layout, const DeviceMesh& mesh, const Shape& global) {
  const DynamicLayout value = layout.dynamic();
  if (!(value.mesh_ndim() == mesh.ndim()))
    throw Error(fmt::format("layout {} places {} mesh axes but the mesh {} has {}",
                            value.to_string(), value.mesh_ndim(), mesh.to_string(), mesh.ndim()));
  return value.normalized(global.rank());
}

// The global index ranges, in local order, that the rank at `coord` holds along dim `dim` (nesting rule above).
template <Layout L>
std::vector<ChunkRange> local_ranges(const L& layout, const Shape& global, const DeviceMesh& mesh,
                                     const MeshCoordinate& coord, int dim) {
  const DynamicLayout value = checked_layout(layout, mesh, global);
  const int d = global.normalize(dim);
  if (!(coord.ndim() == mesh.ndim()))
    throw Error(fmt::format("coordinate {} has {} axes; the mesh {} has {}",
                            coord.to_string(), coord.ndim(), mesh.to_string(), mesh.ndim()));
  std::vector<ChunkRange> segments{ChunkRange{0, global[d]}};
  for (int a = 0; a < mesh.ndim(); ++a) {
    const Placement p = value[a];
    if (!p.is_shard(d)) continue;
    std::int64_t extent = 0;
    for (const ChunkRange& s : segments) extent += s.length;
    const ShardRanges picks = shard_ranges(extent, mesh.axis_size(a), coord[a], p.chunking);
    segments = compose_ranges(segments, picks.span());
  }
  return segments;
}

// The shape of the local shard of the rank at `coord` (no communication).
template <Layout L>
Shape local_shape(const L& layout, const Shape& global, const DeviceMesh& mesh, const MeshCoordinate& coord) {
  Shape local = global;
  for (int d = 0; d < global.rank(); ++d) {
    std::int64_t n = 0;
    for (const ChunkRange& r : local_ranges(layout, global, mesh, coord, d)) n += r.length;
    local[d] = n;
  }
  return local;
}
template <Layout L>
Shape local_shape(const L& layout, const Shape& global, const DeviceMesh& mesh, int rank) {
  return local_shape(layout, global, mesh, mesh.coordinate(rank));
}

// The global index of local element `local` along `dim` for the rank at `coord`.
template <Layout L>
std::int64_t global_index(const L& layout, const Shape& global, const DeviceMesh& mesh, const MeshCoordinate& coord,
                          int dim, std::int64_t local) {
  std::int64_t offset = 0;
  for (const ChunkRange& r : local_ranges(layout, global, mesh, coord, dim)) {
    if (local < offset + r.length && local >= offset) return r.start + (local - offset);
    offset += r.length;
  }
  throw Error(fmt::format("local index {} is outside the {} elements the rank at {} holds along dim {}", local, offset,
                          coord.to_string(), dim));
}

// The local shard that `layout` gives the rank at `coord` of the global tensor `global` (the slice the layout
// names). On Partial axes the rank at index 0 of the axis holds the tensor and the others hold the op's identity
// share (zeros for sum; a copy for max and avg, whose op over copies is the tensor).
template <Layout L, TensorElement T>
Tensor<std::remove_const_t<T>> distribute(TensorView<T> global, const L& layout, const DeviceMesh& mesh,
                                          const MeshCoordinate& coord) {
  using V = std::remove_const_t<T>;
  const DynamicLayout value = checked_layout(layout, mesh, global.shape());
  for (int a = 0; a < mesh.ndim(); ++a)
    if (value[a].is_partial() && value[a].op == ReduceOp::sum && coord[a] != 0)
      return Tensor<V>(local_shape(value, global.shape(), mesh, coord));
  // Cut dim by dim: each dim's ranges are a few contiguous pieces.
  Tensor<V> current = Tensor<V>::copy_of(TensorView<const V>(global));
  for (int d = 0; d < global.rank(); ++d) {
    const auto ranges = local_ranges(value, global.shape(), mesh, coord, d);
    if (ranges.size() == 1 && ranges[0].start == 0 && ranges[0].length == global.shape()[d]) continue;
    std::int64_t total = 0;
    for (const ChunkRange& r : ranges) total += r.length;
    Tensor<V> next(current.shape().with(d, total));
    std::int64_t offset = 0;
    for (const ChunkRange& r : ranges) {
      copy(current.view().slice(d, r.start, r.length), next.view().slice(d, offset, r.length));
      offset += r.length;
    }
    current = std::move(next);
  }
  return current;
}
template <Layout L, TensorElement T>
Tensor<std::remove_const_t<T>> distribute(const Tensor<T>& global, const L& layout, const DeviceMesh& mesh,
                                          const MeshCoordinate& coord) {
  return distribute(global.view(), layout, mesh, coord);
}

}  // namespace paradyse

template <>
struct fmt::formatter<paradyse::DynamicLayout> : fmt::formatter<std::string> {
  auto format(const paradyse::DynamicLayout& l, format_context& ctx) const {
    return fmt::formatter<std::string>::format(l.to_string(), ctx);
  }
};
