// paradyse/layout/reshard_plan.hpp: which collectives move a tensor from one layout to another, one mesh axis at
// a time (pure: no communication, so the planner, the cost model and tests can read a plan).
//
// One step changes the placement of one mesh axis, with the collective of that axis's group:
//   Partial -> Replicate         all_reduce
//   Partial -> Shard(d)          reduce_scatter (uneven chunks: reduce_scatter_v)
//   Shard(d) -> Replicate        all_gather (all_gather_v)
//   Shard(i) -> Shard(j)         all_to_all (all_to_all_v)
//   Shard(d) <-> Shard(d, zigzag) permute (an all_to_all_v of the pieces whose owner changes)
//   Replicate -> Shard(d)        slice (local, no communication)
//   Replicate -> Partial(op)     make_partial (local: for sum, index 0 of the axis keeps the tensor, the rest zero)
//
// Order matters when several axes shard one dim (the nesting rule of layout.hpp: mesh-axis order). An axis may
// gather or send away a dim only while it is the innermost axis sharding it, and may cut a dim only as the next
// axis of the target's order. So the plan (1) resolves Partial axes, with reduce_scatter where the cut is already
// legal and all_reduce otherwise, (2) unwinds, innermost first, every dim whose current sharding axes are not a
// prefix of the target's (all_to_all or permute when the axis can go straight to its target, all_gather
// otherwise), (3) cuts outer axes first (slice), (4) makes the Partial axes the target asks for. Each step keeps
// the post-condition that the current layout is valid, and each phase strictly shrinks the work left, so it ends.
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/layout/layout.hpp"
#include "paradyse/layout/placement.hpp"
#include "paradyse/mesh/device_mesh.hpp"

#include <fmt/format.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace paradyse {

struct ReshardStep {
  enum class Kind : std::uint8_t { all_reduce, reduce_scatter, all_gather, all_to_all, permute, slice, make_partial };

  Kind kind;
  int axis;          // the mesh axis whose group runs it
  Placement before;  // that axis's placement before and after
  Placement after;

  bool communicates() const noexcept { return kind != Kind::slice && kind != Kind::make_partial; }
  std::string to_string(const DeviceMesh* mesh = nullptr) const;
  friend bool operator==(const ReshardStep&, const ReshardStep&) = default;
};

constexpr std::string_view name_of(ReshardStep::Kind kind) {
  switch (kind) {
    case ReshardStep::Kind::all_reduce: return "all_reduce";
    case ReshardStep::Kind::reduce_scatter: return "reduce_scatter";
    case ReshardStep::Kind::all_gather: return "all_gather";
    case ReshardStep::Kind::all_to_all: return "all_to_all";
    case ReshardStep::Kind::permute: return "permute";
    case ReshardStep::Kind::slice: return "slice";
    case ReshardStep::Kind::make_partial: return "make_partial";
  }
  return "?";
}

inline std::string ReshardStep::to_string(const DeviceMesh* mesh) const {
  const std::string axis_name = mesh ? fmt::format("'{}'", mesh->axis(axis).name) : fmt::format("{}", axis);
  return fmt::format("{} over axis {}: {} -> {}", name_of(kind), axis_name, before.to_string(), after.to_string());
}

struct ReshardPlan {
  DynamicLayout from, to;  // shard dims resolved
  std::vector<ReshardStep> steps;

  // The layout after each step: layouts()[0] is `from`, layouts().back() is `to`.
  std::vector<DynamicLayout> layouts() const {
    std::vector<DynamicLayout> out{from};
    for (const ReshardStep& s : steps) out.push_back(out.back().with(s.axis, s.after));
    return out;
  }
  std::string to_string(const DeviceMesh* mesh = nullptr) const {
    std::string s = fmt::format("{} -> {}", from.to_string(), to.to_string());
    if (steps.empty()) return s + ": nothing to move";
    for (std::size_t i = 0; i < steps.size(); ++i) s += fmt::format("\n  {}. {}", i + 1, steps[i].to_string(mesh));
    return s;
  }
};

namespace reshard_detail {

// The axes that shard `dim` under `layout`, in mesh order (outer cut first).
inline std::vector<int> shard_axes(const DynamicLayout& layout, int dim) {
  std::vector<int> axes;
  for (int a = 0; a < layout.mesh_ndim(); ++a)
    if (layout[a].is_shard(dim)) axes.push_back(a);
  return axes;
}

// Whether the axes sharding `dim` now are a prefix (same axes, same chunking) of those in the target.
inline bool is_prefix(const DynamicLayout& current, const DynamicLayout& target, int dim) {
  const auto now = shard_axes(current, dim), want = shard_axes(target, dim);
  if (now.size() > want.size()) return false;
  for (std::size_t i = 0; i < now.size(); ++i)
    if (now[i] != want[i] || current[now[i]] != target[want[i]]) return false;
  return true;
}

// Whether axis `axis` may cut `dim` now as the target asks: it is the next axis of the target's order for dim.
inline bool can_append(const DynamicLayout& current, const DynamicLayout& target, int axis, int dim) {
  if (!target[axis].is_shard(dim) || current[axis].is_shard(dim) || !is_prefix(current, target, dim)) return false;
  const auto now = shard_axes(current, dim), want = shard_axes(target, dim);
  return want.size() > now.size() && want[now.size()] == axis;
}

}  // namespace reshard_detail

// The steps that move a tensor of `tensor_rank` dims from `from` to `to` (layouts over the same mesh axes).
template <Layout From, Layout To>
ReshardPlan plan_reshard(const From& from_layout, const To& to_layout, int tensor_rank) {
  using Kind = ReshardStep::Kind;
  using namespace reshard_detail;
  const DynamicLayout from = from_layout.dynamic().normalized(tensor_rank);
  const DynamicLayout to = to_layout.dynamic().normalized(tensor_rank);
  if (!(from.mesh_ndim() == to.mesh_ndim()))
    throw Error(fmt::format("reshard between layouts of different mesh ranks: {} places {} axes, {} places {}",
                            from.to_string(), from.mesh_ndim(), to.to_string(), to.mesh_ndim()));
  ReshardPlan plan{from, to, {}};
  DynamicLayout current = from;
  auto step = [&](Kind kind, int axis, Placement after) {
    plan.steps.push_back({kind, axis, current[axis], after});
    current = current.with(axis, after);
  };
  const int axes = from.mesh_ndim();

  // 1. Partial axes the target does not keep: reduce_scatter straight into the target's cut when legal.
  for (int a = 0; a < axes; ++a) {
    if (!current[a].is_partial() || current[a] == to[a]) continue;
    if (to[a].is_shard() && can_append(current, to, a, to[a].dim))
      step(Kind::reduce_scatter, a, to[a]);
    else
      step(Kind::all_reduce, a, Placement::replicate());
  }

  // 2. Unwind, innermost first, every dim whose sharding axes are not a prefix of the target's.
  while (true) {
    int dim = -1;
    for (int d = 0; d < tensor_rank && dim < 0; ++d)
      if (!is_prefix(current, to, d)) dim = d;
    if (dim < 0) break;
    const int a = shard_axes(current, dim).back();
    const Placement want = to[a];
    if (want.is_shard(dim) && is_prefix(current.with(a, want), to, dim))
      step(Kind::permute, a, want);
    else if (want.is_shard() && want.dim != dim && can_append(current, to, a, want.dim))
      step(Kind::all_to_all, a, want);
    else
      step(Kind::all_gather, a, Placement::replicate());
  }

  // 3. Cut, outer axes first (each is then the next axis of its dim's target order).
  for (int a = 0; a < axes; ++a)
    if (to[a].is_shard() && current[a] != to[a]) {
      if (!(current[a].is_replicate() && can_append(current, to, a, to[a].dim)))
        throw Error(fmt::format("reshard planner: axis {} is {} before its cut to {} (internal error)",
                                a, current[a].to_string(), to[a].to_string()));
      step(Kind::slice, a, to[a]);
    }

  // 4. The target's Partial axes.
  for (int a = 0; a < axes; ++a)
    if (to[a].is_partial() && current[a] != to[a]) {
      if (!current[a].is_replicate())
        throw Error(fmt::format("reshard planner: axis {} is {} before make_partial (internal error)",
                                a, current[a].to_string()));
      step(Kind::make_partial, a, to[a]);
    }

  if (current != to)
    throw Error(fmt::format("reshard planner ended at {} instead of {} (internal error)",
                            current.to_string(), to.to_string()));
  return plan;
}

}  // namespace paradyse
