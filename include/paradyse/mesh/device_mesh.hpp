// paradyse/mesh/device_mesh.hpp: DeviceMesh, a grid of ranks with named axes, and the groups over its axes.
//
//   DeviceMesh mesh({{"dp", 2}, {"sp", 4}});          // 8 ranks; rank = dp * 4 + sp (the last axis is innermost)
//   auto sp_group = mesh.group(world, {"sp"});         // my 4 ranks that share my dp coordinate
//   auto ep_group = mesh.group(world, {"dp", "sp"});   // "dimension fusion": one group over both axes
//
// Rank <-> coordinate is row-major over the axes in the order given, so the last axis holds consecutive ranks:
// put the bandwidth-hungry axis last. A group over a subset of axes holds the ranks that agree on every other axis,
// ordered by their row-major index over the chosen axes in the order the caller lists them ({"dp", "sp"}: dp
// outer). group() builds it with comm.split(color = index over the other axes, key = index over the chosen axes),
// so it works for every Communicator backend; group_ranks() says the same without communicating (for tests and
// the planner). The mesh sits below comm/ in the layering, so group() only asks of its communicator what it uses.
#pragma once

#include "paradyse/core/error.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace paradyse {

inline constexpr int kMaxMeshAxes = 8;  // Hypertron's 7D space plus one

struct MeshAxis {
  std::string name;
  int size = 1;
};

// One index per mesh axis (fixed capacity, no allocation).
class MeshCoordinate {
public:
  MeshCoordinate() = default;
  explicit MeshCoordinate(int ndim) : ndim_(ndim) {
    check(ndim >= 0 && ndim <= kMaxMeshAxes, "a mesh coordinate has {} axes; expected 0 to {}", ndim, kMaxMeshAxes);
  }
  MeshCoordinate(std::initializer_list<int> indices) : MeshCoordinate(int(indices.size())) {
    std::copy(indices.begin(), indices.end(), index_.begin());
  }

  int ndim() const noexcept { return ndim_; }
  int operator[](int axis) const noexcept { return index_[std::size_t(axis)]; }
  int& operator[](int axis) noexcept { return index_[std::size_t(axis)]; }
  const int* begin() const noexcept { return index_.data(); }
  const int* end() const noexcept { return index_.data() + ndim_; }

  friend bool operator==(const MeshCoordinate& a, const MeshCoordinate& b) noexcept {
    return a.ndim_ == b.ndim_ && std::equal(a.begin(), a.end(), b.begin());
  }
  std::string to_string() const { return fmt::format("({})", fmt::join(begin(), end(), ", ")); }

private:
  std::array<int, kMaxMeshAxes> index_{};
  int ndim_ = 0;
};

class DeviceMesh {
public:
  // A mesh of axes {name, size}, outermost first. Names are unique and non-empty, sizes at least 1.
  DeviceMesh(std::vector<MeshAxis> axes) : axes_(std::move(axes)) {
    check(!axes_.empty() && int(axes_.size()) <= kMaxMeshAxes, "a device mesh has {} axes; expected 1 to {}",
          axes_.size(), kMaxMeshAxes);
    for (std::size_t a = 0; a < axes_.size(); ++a) {
      check(!axes_[a].name.empty(), "mesh axis {} has an empty name", a);
      check(axes_[a].size >= 1, "mesh axis '{}' has size {}; expected at least 1", axes_[a].name, axes_[a].size);
      for (std::size_t b = 0; b < a; ++b)
        check(axes_[b].name != axes_[a].name, "mesh axis name '{}' appears twice in {}", axes_[a].name, names());
      check(size_ <= (1 << 30) / axes_[a].size, "the mesh {} has too many ranks", names());
      size_ *= axes_[a].size;
    }
  }
  DeviceMesh(std::initializer_list<MeshAxis> axes) : DeviceMesh(std::vector<MeshAxis>(axes)) {}
  // The same, checked against the world it runs on: the product of the sizes must equal `world_size`.
  DeviceMesh(std::vector<MeshAxis> axes, int world_size) : DeviceMesh(std::move(axes)) { check_world_size(world_size); }

  int ndim() const noexcept { return int(axes_.size()); }
  int size() const noexcept { return size_; }  // the world size: product of the axis sizes
  const std::vector<MeshAxis>& axes() const noexcept { return axes_; }
  const MeshAxis& axis(int index) const {
    if (!(index >= 0 && index < ndim()))
      throw Error(fmt::format("mesh axis index {} is outside [0, {}) of mesh {}", index, ndim(), to_string()));
    return axes_[std::size_t(index)];
  }
  int axis_size(int index) const { return axis(index).size; }
  int axis_size(std::string_view name) const { return axes_[std::size_t(axis_index(name))].size; }
  bool has_axis(std::string_view name) const noexcept {
    return std::any_of(axes_.begin(), axes_.end(), [&](const MeshAxis& a) { return a.name == name; });
  }
  // The position of axis `name`; an unknown name is an error that lists the known ones.
  int axis_index(std::string_view name) const {
    for (std::size_t a = 0; a < axes_.size(); ++a)
      if (axes_[a].name == name) return int(a);
    throw Error(fmt::format("unknown mesh axis '{}'; the mesh {} has axes {}", name, to_string(), names()));
  }

  void check_world_size(int world_size) const {
    if (!(world_size == size_))
      throw Error(fmt::format("the mesh {} holds {} ranks but the world has {}", to_string(), size_, world_size));
  }

  // ---- rank <-> coordinate (row-major, last axis innermost) ------------------------------------------------------
  MeshCoordinate coordinate(int rank) const {
    check_rank(rank);
    MeshCoordinate c(ndim());
    for (int a = ndim() - 1; a >= 0; --a) {
      c[a] = rank % axes_[std::size_t(a)].size;
      rank /= axes_[std::size_t(a)].size;
    }
    return c;
  }
  int coordinate(int rank, std::string_view axis_name) const { return coordinate(rank)[axis_index(axis_name)]; }
  int rank_of(const MeshCoordinate& c) const {
    if (!(c.ndim() == ndim()))
      throw Error(fmt::format("coordinate {} has {} axes; the mesh {} has {}",
                              c.to_string(), c.ndim(), to_string(), ndim()));
    int rank = 0;
    for (int a = 0; a < ndim(); ++a) {
      if (!(c[a] >= 0 && c[a] < axes_[std::size_t(a)].size))
        throw Error(fmt::format("coordinate {} is outside axis '{}' of size {}",
                                c.to_string(), axes_[std::size_t(a)].name, axes_[std::size_t(a)].size));
      rank = rank * axes_[std::size_t(a)].size + c[a];
    }
    return rank;
  }

  // ---- groups over subsets of axes -------------------------------------------------------------------------------
  // Axis positions of `names`, checked: known, no repeats, at least one.
  std::vector<int> axis_indices(std::span<const std::string_view> names) const {
    if (names.empty())
      throw Error(fmt::format("a mesh group needs at least one axis; the mesh {} has {}", to_string(), this->names()));
    std::vector<int> indices;
    for (std::string_view name : names) {
      const int a = axis_index(name);
      check(std::find(indices.begin(), indices.end(), a) == indices.end(), "mesh axis '{}' is listed twice", name);
      indices.push_back(a);
    }
    return indices;
  }
  std::vector<int> axis_indices(std::initializer_list<std::string_view> names) const {
    return axis_indices(std::span<const std::string_view>(names.begin(), names.size()));
  }

  // Ranks in a group over `axes`: the product of their sizes.
  int group_size(std::span<const int> axes) const {
    int n = 1;
    for (int a : axes) n *= axis_size(a);
    return n;
  }
  // My position in my group over `axes`: row-major over the chosen axes, in the order listed (the split key).
  int group_index(int rank, std::span<const int> axes) const {
    const MeshCoordinate c = coordinate(rank);
    int index = 0;
    for (int a : axes) index = index * axis_size(a) + c[a];
    return index;
  }
  // Which group over `axes` I am in: row-major over the other axes, in mesh order (the split color).
  int group_color(int rank, std::span<const int> axes) const {
    const MeshCoordinate c = coordinate(rank);
    int color = 0;
    for (int a = 0; a < ndim(); ++a)
      if (std::find(axes.begin(), axes.end(), a) == axes.end()) color = color * axis_size(a) + c[a];
    return color;
  }
  // The world ranks of my group over `axes`, in group order: element i is the rank with group_index i.
  std::vector<int> group_ranks(int rank, std::span<const int> axes) const {
    for (int a : axes) axis(a);  // validates
    MeshCoordinate c = coordinate(rank);
    std::vector<int> ranks;
    ranks.reserve(std::size_t(group_size(axes)));
    // Odometer over the chosen axes in the listed order (last listed fastest).
    for (int a : axes) c[a] = 0;
    for (int i = 0, n = group_size(axes); i < n; ++i) {
      ranks.push_back(rank_of(c));
      for (int k = int(axes.size()) - 1; k >= 0; --k) {
        const int a = axes[std::size_t(k)];
        if (++c[a] < axis_size(a)) break;
        c[a] = 0;
      }
    }
    return ranks;
  }

  // The same by axis names.
  int group_size(std::initializer_list<std::string_view> names) const { return group_size(axis_indices(names)); }
  int group_index(int rank, std::initializer_list<std::string_view> names) const {
    return group_index(rank, axis_indices(names));
  }
  int group_color(int rank, std::initializer_list<std::string_view> names) const {
    return group_color(rank, axis_indices(names));
  }
  std::vector<int> group_ranks(int rank, std::initializer_list<std::string_view> names) const {
    return group_ranks(rank, axis_indices(names));
  }

  // The calling rank's communicator over `axes`, split from `world` (whose size must be the mesh size).
  // Collective over `world`: every rank calls it with the same axes.
  template <class Comm>
    requires requires(Comm& c) {
      { c.size() } -> std::convertible_to<int>;
      { c.rank() } -> std::convertible_to<int>;
      { c.split(0, 0) } -> std::same_as<Comm>;
    }
  Comm group(Comm& world, std::span<const int> axes) const {
    check_world_size(int(world.size()));
    for (int a : axes) axis(a);
    const int rank = int(world.rank());
    return world.split(group_color(rank, axes), group_index(rank, axes));
  }
  template <class Comm>
  Comm group(Comm& world, std::initializer_list<std::string_view> names) const {
    return group(world, std::span<const int>(axis_indices(names)));
  }
  template <class Comm>
  Comm group(Comm& world, std::span<const std::string_view> names) const {
    return group(world, std::span<const int>(axis_indices(names)));
  }

  std::string names() const {
    std::string s = "[";
    for (std::size_t a = 0; a < axes_.size(); ++a) s += fmt::format("{}'{}'", a ? ", " : "", axes_[a].name);
    return s + "]";
  }
  std::string to_string() const {
    std::string s = "{";
    for (std::size_t a = 0; a < axes_.size(); ++a)
      s += fmt::format("{}{}: {}", a ? ", " : "", axes_[a].name, axes_[a].size);
    return s + "}";
  }

  friend bool operator==(const DeviceMesh& a, const DeviceMesh& b) {
    if (a.ndim() != b.ndim()) return false;
    for (int i = 0; i < a.ndim(); ++i)
      if (a.axes_[std::size_t(i)].name != b.axes_[std::size_t(i)].name ||
          a.axes_[std::size_t(i)].size != b.axes_[std::size_t(i)].size)
        return false;
    return true;
  }

private:
  void check_rank(int rank) const {
    if (!(rank >= 0 && rank < size_))
      throw Error(fmt::format("rank {} is outside [0, {}) of mesh {}", rank, size_, to_string()));
  }

  std::vector<MeshAxis> axes_;
  int size_ = 1;
};

}  // namespace paradyse

template <>
struct fmt::formatter<paradyse::DeviceMesh> : fmt::formatter<std::string> {
  auto format(const paradyse::DeviceMesh& m, format_context& ctx) const {
    return fmt::formatter<std::string>::format(m.to_string(), ctx);
  }
};
template <>
struct fmt::formatter<paradyse::MeshCoordinate> : fmt::formatter<std::string> {
  auto format(const paradyse::MeshCoordinate& c, format_context& ctx) const {
    return fmt::formatter<std::string>::format(c.to_string(), ctx);
  }
};
