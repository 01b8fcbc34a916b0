// paradyse/comm/grid_groups.hpp: a group of p ranks seen as an outer x inner grid, its two sub-groups, and a cache
// that splits them once.
//
// Rank r of the group is (o, i) = (r / inner, r % inner), inner innermost. Its inner sub-group is its row (ranks
// o inner .. o inner + inner - 1, ordered by i), its outer sub-group its column (ranks i, i + inner, ..., ordered by
// o). MegatronRing's tp and cp sub-groups (inner = tp_inner) and Tp2d's tp_x and tp_y groups (inner = tp_x) are such
// a pair.
//
// A split is a collective (MPI_Comm_split, ncclCommSplit: a round of communication and set-up), and the sub-groups
// depend only on the group and its factorisation, so a model keeps them: GridGroupCache splits a group's grid on
// its first use and hands the same sub-groups to every later call (model/stack.hpp owns one; SublayerContext points
// to it). A call without a cache splits for itself (GridGroupsOfCall).
//
// split_by(comm, rule) is split() with the rule every rank applies to its own rank: rule(rank) = (color, key). A
// real communicator evaluates it for its rank and splits; the symbolic communicator of a dry run (comm/symbolic.hpp),
// one rank that cannot ask its peers, evaluates it for every rank of its group to know the sub-group's members.
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/error.hpp"

#include <concepts>
#include <memory>
#include <optional>
#include <typeindex>
#include <typeinfo>
#include <utility>
#include <vector>

namespace paradyse {

// The sub-group of `comm` that rule(rank) = (color, key) gives this rank: the ranks of its color, ordered by key and
// then rank. Collective over `comm`.
template <Communicator C, class Rule>
C split_by(C& comm, Rule rule) {
  if constexpr (requires { { comm.split_by(rule) } -> std::same_as<C>; }) {
    return comm.split_by(rule);
  } else {
    const auto [color, key] = rule(comm.rank());
    return comm.split(color, key);
  }
}

// Rank (o, i)'s two sub-groups of the outer x inner grid.
template <Communicator C>
struct GridGroups {
  C inner;  // the row: ranks o inner + 0 .. inner - 1, this rank at index i
  C outer;  // the column: ranks i + inner * (0 .. outer - 1), this rank at index o
};

// Splits `comm` (p ranks, inner dividing p) into its grid's two sub-groups. Collective over `comm` (two splits).
template <Communicator C>
GridGroups<C> split_grid(C& comm, int inner) {
  check(inner >= 1 && comm.size() % inner == 0, "split_grid: inner = {} must divide the group size {}", inner,
        comm.size());
  C row = split_by(comm, [inner](int r) { return std::pair{r / inner, r % inner}; });
  C column = split_by(comm, [inner](int r) { return std::pair{r % inner, r / inner}; });
  return {std::move(row), std::move(column)};
}

// One rank's grid sub-groups, split on first use and kept: one entry per (communicator, its type, inner). Every rank
// of a group must ask for the same grids in the same order (the first ask is the collective split). The communicator
// is told by its address, so a cache serves the communicators it was first asked about for as long as they live;
// clear() drops every sub-group (every rank together: freeing a sub-group can be a collective of its own).
class GridGroupCache {
public:
  template <Communicator C>
  GridGroups<C>& of(C& comm, int inner) {
    for (Entry& e : entries_)
      if (e.parent == &comm && e.type == std::type_index(typeid(C)) && e.inner == inner) {
        check(e.size == comm.size() && e.rank == comm.rank(), "GridGroupCache: the communicator at this address was "
              "rank {} of {} when its grid was split, now rank {} of {} (clear() the cache when the group changes)",
              e.rank, e.size, comm.rank(), comm.size());
        return *static_cast<GridGroups<C>*>(e.groups.get());
      }
    auto groups = std::make_shared<GridGroups<C>>(split_grid(comm, inner));
    entries_.push_back({&comm, std::type_index(typeid(C)), inner, comm.size(), comm.rank(), groups});
    ++grids_split_;
    return *groups;
  }
  // Grids split by this cache since it was made (each two split() calls).
  int grids_split() const noexcept { return grids_split_; }
  void clear() noexcept { entries_.clear(); }

private:
  struct Entry {
    const void* parent;
    std::type_index type;
    int inner, size, rank;
    std::shared_ptr<void> groups;  // GridGroups<type>
  };
  std::vector<Entry> entries_;
  int grids_split_ = 0;
};

// The grid sub-groups one call uses: the cache's (split once) or, without a cache, split for this call and freed
// with it. Not copyable or movable: it may point into itself.
template <Communicator C>
class GridGroupsOfCall {
public:
  GridGroupsOfCall(GridGroupCache* cache, C& comm, int inner)
      : groups_(cache ? &cache->of(comm, inner) : &own_.emplace(split_grid(comm, inner))) {}
  GridGroupsOfCall(const GridGroupsOfCall&) = delete;
  GridGroupsOfCall& operator=(const GridGroupsOfCall&) = delete;

  C& inner() const noexcept { return groups_->inner; }
  C& outer() const noexcept { return groups_->outer; }

private:
  std::optional<GridGroups<C>> own_;
  GridGroups<C>* groups_;
};

}  // namespace paradyse
