// paradyse/layout/reshard.hpp: reshard, the redistribution engine: a sharded tensor from one layout to another.
//
//   MeshCommunicator mc(mesh, world);   // collective once: one group per mesh axis
//   ShardedTensor<float> y = reshard(mc, x, StaticLayout<Shard<2>>{});   // x: a ShardedView, its layout known
//
//   reshard_into<Backend>(group, x, out, pool);   // over one group (a one-axis mesh), into a buffer the caller owns
//
// The plan (reshard_plan.hpp) names one collective per step; each runs on the group of its mesh axis, with the _v
// forms so uneven chunks need no padding (reshard_steps.hpp). The layouts carry the global shape (tensor_layout.hpp),
// so every rank knows every other rank's local shape without communicating. The strategies move their activations
// with reshard_into between the unified layout and the layouts they compute in: the sequence all-gather and
// reduce-scatter (Shard(1) <-> Replicate / Partial of [b, s, h]) and Ulysses's sequence <-> head all-to-all
// (Shard(2) <-> Shard(0) of [p, b, s, W]) are this engine's steps, with their fast paths.
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
#include "paradyse/layout/reshard_steps.hpp"
#include "paradyse/layout/tensor_layout.hpp"
#include "paradyse/ops/backend.hpp"
#include "paradyse/mesh/device_mesh.hpp"

#include <algorithm>
#include <cstdint>
#include <type_traits>
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

template <class Backend, class T>
void zero(TensorView<T> x) {
  if constexpr (std::is_same_v<T, float>)
    Backend::fill(x, 0.0f);
  else
    std::fill(x.span().begin(), x.span().end(), T{});
}

// One step of a plan on the group of its axis, from `in` (the layout before) into `out` (the layout after). `index`
// and `parts`: my index on the axis and its size; `extent`: the extent of the step's dim in the parent layout (the
// layout with the step's axis replicated), which uneven chunks make unknowable from local shapes.
template <class Backend, class T, class Group, class Workspace>
void run_step(Group& group, const ReshardStep& s, int index, int parts, std::int64_t extent, TensorView<const T> in,
              TensorView<T> out, Workspace& ws) {
  using Kind = ReshardStep::Kind;
  switch (s.kind) {
    case Kind::all_reduce: group.all_reduce(in.span(), out.span(), s.before.op); return;
    case Kind::reduce_scatter: reduce_scatter_into<Backend>(group, in, s.after, s.before.op, out, ws); return;
    case Kind::all_gather: all_gather_into<Backend>(group, in, s.before, out, ws); return;
    case Kind::all_to_all: all_to_all_into<Backend>(group, in, s.before, s.after, out, ws); return;
    case Kind::permute: permute_into<Backend>(group, in, s.before, s.after, extent, out, ws); return;
    case Kind::slice: {
      const ShardRanges ranges = shard_ranges(extent, parts, index, s.after.chunking);
      pack_ranges<Backend>(in, s.after.dim, ranges.span(), out);
      return;
    }
    case Kind::make_partial:  // for sum, index 0 keeps the tensor and the others hold zeros
      if (s.after.op != ReduceOp::sum || index == 0)
        move<Backend>(in, out);
      else
        zero<Backend>(out);
      return;
  }
}

// The extent of dim `dim` that a step of axis `axis` works over: the extent in the layout with that axis replicated.
inline std::int64_t step_extent(const DynamicLayout& layout, int axis, int dim, const Shape& global, const DeviceMesh& mesh,
                                const MeshCoordinate& coord) {
  return local_shape(layout.with(axis, Placement::replicate()), global, mesh, coord)[dim];
}

inline int step_dim(const ReshardStep& s) { return s.after.is_shard() ? s.after.dim : s.before.is_shard() ? s.before.dim : 0; }

}  // namespace reshard_detail

// Over one group, seen as a one-axis mesh: `out` <- `x` moved from x's layout to out's (layouts of the same global
// tensor, one placement each). Collective over the group; x and out are contiguous and disjoint. Staging buffers
// come from `ws` (the strategies pass their BufferPool).
template <class Backend = ops::Cpu, Communicator G, CommElement T, class Workspace>
void reshard_into(G& group, ShardedView<const T> x, ShardedView<T> out, Workspace& ws) {
  using namespace reshard_detail;
  const int parts = int(group.size()), me = int(group.rank());
  check(x.layout.global == out.layout.global, "reshard_into: the source is a shard of {}, the target of {}",
        x.layout.global, out.layout.global);
  const Shape want_in = x.layout.local_shape(parts, me), want_out = out.layout.local_shape(parts, me);
  check(x.local.shape() == want_in && x.local.is_contiguous(),
        "reshard_into: rank {} of {} holds a source shard of shape {}{}, but layout {} gives it contiguous {}", me,
        parts, x.local.shape(), x.local.is_contiguous() ? "" : " (strided)", x.layout, want_in);
  check(out.local.shape() == want_out && out.local.is_contiguous(),
        "reshard_into: rank {} of {} has a target of shape {}{}, but layout {} gives it contiguous {}", me, parts,
        out.local.shape(), out.local.is_contiguous() ? "" : " (strided)", out.layout, want_out);
  const ReshardPlan plan = plan_reshard(x.layout.placements, out.layout.placements, x.layout.global.rank());
  if (plan.steps.empty()) {
    if (x.local.data() != out.local.data()) move<Backend>(x.local, out.local);
    return;
  }
  using Buffer = decltype(ws.template acquire<T>(Shape{}));
  Buffer current;  // the result of the previous step when the plan has more than one
  TensorView<const T> in = x.local;
  DynamicLayout layout = plan.from;
  for (std::size_t k = 0; k < plan.steps.size(); ++k) {
    const ReshardStep& s = plan.steps[k];
    const DynamicLayout next = layout.with(0, s.after);
    const bool last = k + 1 == plan.steps.size();
    Buffer staged;
    if (!last) staged = ws.template acquire<T>(TensorLayout(x.layout.global, next).local_shape(parts, me));
    const TensorView<T> target = last ? out.local : TensorView<T>(staged.view());
    run_step<Backend>(group, s, me, parts, x.layout.global[step_dim(s)], in, target, ws);
    current = std::move(staged);
    in = TensorView<const T>(target);
    layout = next;
  }
}
template <class Backend = ops::Cpu, Communicator G, CommElement T>
void reshard_into(G& group, ShardedView<const T> x, ShardedView<T> out) {
  FreshTensors fresh;
  reshard_into<Backend>(group, x, out, fresh);
}

// x, rank r's shard of its layout, as the `to` shard of the same global tensor, on every rank of the mesh.
// Collective over the mesh: every rank calls it with the same layouts.
template <class Backend = ops::Cpu, Communicator C, CommElement T, Layout To>
ShardedTensor<T> reshard(MeshCommunicator<C>& comm, ShardedView<const T> x, const To& to,
                         ReshardReport* report = nullptr) {
  using namespace reshard_detail;
  const DeviceMesh& mesh = comm.mesh();
  const MeshCoordinate& coord = comm.coordinate();
  const Shape& global = x.layout.global;
  const DynamicLayout from_value = checked_layout(x.layout.placements, mesh, global);
  const DynamicLayout to_value = checked_layout(to, mesh, global);
  const Shape expected = local_shape(from_value, global, mesh, coord);
  if (x.local.shape() != expected)
    throw Error(fmt::format("reshard: rank {} holds a shard of shape {}, but layout {} gives it {}", comm.rank(),
                            x.local.shape(), x.layout, expected));
  ReshardPlan plan = plan_reshard(from_value, to_value, global.rank());
  const std::uint64_t bytes_before = comm.bytes_sent();

  // Steps read the input in place (a strided view is made contiguous first); each writes a new tensor.
  Tensor<T> current;
  const bool copy_first = !x.local.is_contiguous() || plan.steps.empty();
  if (copy_first) current = Tensor<T>::copy_of(x.local);
  TensorView<const T> in = copy_first ? TensorView<const T>(current.view()) : x.local;
  DynamicLayout layout = plan.from;
  FreshTensors fresh;
  for (const ReshardStep& s : plan.steps) {
    const DynamicLayout next = layout.with(s.axis, s.after);
    Tensor<T> out(local_shape(next, global, mesh, coord));
    const std::int64_t extent = step_extent(layout, s.axis, step_dim(s), global, mesh, coord);
    run_step<Backend>(comm.axis(s.axis), s, coord[s.axis], mesh.axis_size(s.axis), extent, in, out.view(), fresh);
    current = std::move(out);
    in = TensorView<const T>(current.view());
    layout = next;
  }
  if (report) *report = {std::move(plan), comm.bytes_sent() - bytes_before};
  return {std::move(current), TensorLayout(global, to_value)};
}
template <class Backend = ops::Cpu, Communicator C, CommElement T, Layout To>
ShardedTensor<T> reshard(MeshCommunicator<C>& comm, const ShardedTensor<T>& x, const To& to,
                         ReshardReport* report = nullptr) {
  return reshard<Backend>(comm, x.view(), to, report);
}

}  // namespace paradyse
