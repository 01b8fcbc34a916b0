// paradyse/comm/grid_groups.hpp: a group of p ranks seen as an outer x inner grid, its two sub-groups, and their
// holder (split once, kept by the layer stack).
//
// Rank r of the group is (o, i) = (r / inner, r % inner), inner innermost. Its inner sub-group is its row (ranks
// o inner .. o inner + inner - 1, ordered by i), its outer sub-group its column (ranks i, i + inner, ..., ordered by
// o). MegatronRing's tp and cp sub-groups (inner = tp_inner) and Tp2d's tp_x and tp_y groups (inner = tp_x) are such
// a pair.
//
// A split is a collective (MPI_Comm_split, ncclCommSplit: a round of communication and set-up), and the sub-groups
// depend only on the group and its factorisation, so a model keeps them: the layer stack splits its group's grid
// when the factorisation is set (AnyGridGroups; model/stack.hpp's set_tp_inner / set_tp_x) and SublayerContext
// points to it for every call. A call with none held splits for itself (GridGroupsOfCall).
//
// split_by(comm, rule) is split() with the rule every rank applies to its own rank: rule(rank) = (color, key). A
// real communicator evaluates it for its rank and splits; the symbolic communicator of a dry run (comm/symbolic.hpp),
// one rank that cannot ask its peers, evaluates it for every rank of its group to know the sub-group's members.
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/error.hpp"

#include <fmt/format.h>

#include <concepts>
#include <memory>
#include <optional>
#include <string>
#include <typeinfo>
#include <utility>

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

// A group's grid sub-groups, split once and held without naming the communicator type in the holder's type:
// the layer stack keeps them (model/stack.hpp's set_tp_inner / set_tp_x, made when the factorisation is set, with
// the group in hand) and SublayerContext, which names no communicator type, points to them. Copies share the
// sub-groups (MegatronRing's and Tp2d's grid are one when tp_inner = tp_x).
class AnyGridGroups {
public:
  AnyGridGroups() = default;  // no grid
  // Splits `group`'s outer x inner grid (collective over `group`: split_grid).
  template <Communicator C>
  AnyGridGroups(C& group, int inner)
      : groups_(std::make_shared<GridGroups<C>>(split_grid(group, inner))), type_(&typeid(C)), inner_(inner),
        size_(int(group.size())) {}

  bool empty() const noexcept { return groups_ == nullptr; }
  int inner() const noexcept { return inner_; }
  // Whether these are `group`'s sub-groups for this inner size: split from a group of its type, size and inner
  // size, this rank at (rank / inner, rank % inner) of the grid.
  template <Communicator C>
  bool fits(const C& group, int inner) const noexcept {
    if (empty() || *type_ != typeid(C) || size_ != int(group.size()) || inner_ != inner) return false;
    const GridGroups<C>& g = *static_cast<const GridGroups<C>*>(groups_.get());
    return int(g.outer.rank()) * inner + int(g.inner.rank()) == int(group.rank());
  }
  // The sub-groups of `group` (refused unless they fit it).
  template <Communicator C>
  GridGroups<C>& of(const C& group, int inner) const {
    check(fits(group, inner), "grid sub-groups: held {}, asked for rank {} of a group of {} with inner = {} (a layer "
          "stack's grid is split from the group it runs on: set_tp_inner / set_tp_x with that group)",
          empty() ? std::string("none") : fmt::format("a grid of {} ranks with inner = {}", size_, inner_),
          group.rank(), group.size(), inner);
    return *static_cast<GridGroups<C>*>(groups_.get());
  }

private:
  std::shared_ptr<void> groups_;  // GridGroups<*type_>
  const std::type_info* type_ = nullptr;
  int inner_ = 0, size_ = 0;
};

// The grid sub-groups one call uses: the held ones (split once) or, with none held, split for this call and freed
// with it. Not copyable or movable: it may point into itself.
template <Communicator C>
class GridGroupsOfCall {
public:
  GridGroupsOfCall(const AnyGridGroups* held, C& comm, int inner)
      : groups_(held && !held->empty() ? &held->of(comm, inner) : &own_.emplace(split_grid(comm, inner))) {}
  GridGroupsOfCall(const GridGroupsOfCall&) = delete;
  GridGroupsOfCall& operator=(const GridGroupsOfCall&) = delete;

  C& inner() const noexcept { return groups_->inner; }
  C& outer() const noexcept { return groups_->outer; }

private:
  std::optional<GridGroups<C>> own_;
  GridGroups<C>* groups_;
};

}  // namespace paradyse
