// paradyse/layout/tensor_layout.hpp: a layout that knows the tensor it places, and the sharded tensors that carry it.
//
//   TensorLayout unified{Shape{b, s, h}, {Placement::shard(1)}};      // the activations of a group of p ranks
//   ShardedView<const float> x{local, unified};                        // rank r's [b, n_r, h] and where it lies
//   reshard_into<Backend>(group, x, {full, unified.with_placements({Placement::replicate()})}, pool);
//
// A local shard alone cannot say which global tensor it belongs to (334 local tokens may be 1000 or 1001 over 3
// ranks), so the layout carries the global shape: every rank knows every other rank's local shape from it without
// communicating, and reshard needs nothing but the two layouts.
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/shape.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/layout/layout.hpp"
#include "paradyse/mesh/device_mesh.hpp"

#include <fmt/format.h>

#include <string>
#include <utility>

namespace paradyse {

// A global tensor of shape `global`, placed over a mesh by `placements` (one per mesh axis).
struct TensorLayout {
  Shape global;
  DynamicLayout placements;

  TensorLayout() = default;
  template <Layout L>
  TensorLayout(Shape global_, const L& placements_) : global(global_), placements(placements_.dynamic().normalized(global_.rank())) {}

  int mesh_ndim() const noexcept { return placements.mesh_ndim(); }
  Placement placement(int axis) const { return placements[axis]; }
  // The same global tensor placed differently.
  TensorLayout with_placements(const DynamicLayout& other) const { return {global, other}; }

  // The shape of the shard the rank at `coord` of `mesh` holds.
  Shape local_shape(const DeviceMesh& mesh, const MeshCoordinate& coord) const {
    return paradyse::local_shape(placements, global, mesh, coord);
  }
  // One-axis layouts over a group of `parts` ranks: the shape of rank `index`'s shard.
  Shape local_shape(int parts, int index) const {
    check(mesh_ndim() == 1, "layout {} places {} mesh axes; a group is one axis", placements, mesh_ndim());
    const Placement p = placements[0];
    if (!p.is_shard()) return global;
    return global.with(p.dim, shard_ranges(global[p.dim], parts, index, p.chunking).length());
  }

  friend bool operator==(const TensorLayout& a, const TensorLayout& b) noexcept {
    return a.global == b.global && a.placements == b.placements;
  }
  std::string to_string() const { return fmt::format("{} of {}", placements.to_string(), global); }
};

// A rank's shard (a view) with the layout it belongs to.
template <class T>
struct ShardedView {
  TensorView<T> local;
  TensorLayout layout;

  operator ShardedView<const T>() const { return {local, layout}; }
};

// A rank's shard (owned) with the layout it belongs to.
template <class T>
struct ShardedTensor {
  Tensor<T> local;
  TensorLayout layout;

  ShardedView<T> view() { return {local.view(), layout}; }
  ShardedView<const T> view() const { return {TensorView<const T>(local.view()), layout}; }
};

}  // namespace paradyse

template <>
struct fmt::formatter<paradyse::TensorLayout> : fmt::formatter<std::string> {
  auto format(const paradyse::TensorLayout& l, format_context& ctx) const {
    return fmt::formatter<std::string>::format(l.to_string(), ctx);
  }
};
