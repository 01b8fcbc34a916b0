// paradyse/layout/placement.hpp: how one mesh axis places a tensor: Replicate, Shard(dim), Shard(dim, zigzag) or
// Partial(op).
//
// Along a mesh axis of size p, with my index i on it:
//   Replicate            every rank of the axis holds the same tensor.
//   Shard(d)             I hold chunk i of dim d, by chunk_range (layout/chunking.hpp): uneven sizes allowed.
//   Shard(d, zigzag)     dim d is cut into 2p chunks and I hold chunks i and 2p-1-i, in that order.
//   Partial(op)          every rank holds a full-size term; the tensor is op over the axis (a pending reduction).
//
// Two forms of each: the runtime value Placement (for the generic engine, plans and printing) and compile-time
// types Replicate, Shard<d>, Shard<d, Chunking::zigzag>, Partial<op> that strategies name in their layout types;
// every placement type has `static constexpr Placement value`.
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/core/shape.hpp"

#include <fmt/format.h>

#include <concepts>
#include <cstdint>
#include <string>

namespace paradyse {

// How Shard cuts a dim: p consecutive chunks, or 2p chunks of which rank i holds i and 2p-1-i.
enum class Chunking : std::uint8_t { contiguous, zigzag };

struct Placement {
  enum class Kind : std::uint8_t { replicate, shard, partial };

  Kind kind = Kind::replicate;
  int dim = 0;                               // shard only (may be negative: counted from the back)
  Chunking chunking = Chunking::contiguous;  // shard only
  ReduceOp op = ReduceOp::sum;               // partial only

  static constexpr Placement replicate() noexcept { return {}; }
  static constexpr Placement shard(int dim, Chunking chunking = Chunking::contiguous) noexcept {
    return {Kind::shard, dim, chunking, ReduceOp::sum};
  }
  static constexpr Placement zigzag(int dim) noexcept { return shard(dim, Chunking::zigzag); }
  static constexpr Placement partial(ReduceOp op = ReduceOp::sum) noexcept { return {Kind::partial, 0, {}, op}; }

  constexpr bool is_replicate() const noexcept { return kind == Kind::replicate; }
  constexpr bool is_shard() const noexcept { return kind == Kind::shard; }
  constexpr bool is_shard(int d) const noexcept { return kind == Kind::shard && dim == d; }
  constexpr bool is_partial() const noexcept { return kind == Kind::partial; }
  constexpr bool is_zigzag() const noexcept { return kind == Kind::shard && chunking == Chunking::zigzag; }

  // The same placement with a negative shard dim resolved against a tensor of `rank` dims (checked).
  Placement normalized(int rank) const {
    if (!is_shard()) return *this;
    if (!(dim >= -rank && dim < rank))
      throw Error(fmt::format("placement {} names dim {} of a rank-{} tensor", to_string(), dim, rank));
    return shard(dim < 0 ? dim + rank : dim, chunking);
  }

  // Equal placements; replicate and partial ignore the fields they do not use.
  friend constexpr bool operator==(const Placement& a, const Placement& b) noexcept {
    if (a.kind != b.kind) return false;
    if (a.kind == Kind::shard) return a.dim == b.dim && a.chunking == b.chunking;
    if (a.kind == Kind::partial) return a.op == b.op;
    return true;
  }

  std::string to_string() const {
    switch (kind) {
      case Kind::replicate: return "Replicate";
      case Kind::shard:
        return chunking == Chunking::zigzag ? fmt::format("Shard({}, zigzag)", dim) : fmt::format("Shard({})", dim);
      case Kind::partial: return fmt::format("Partial({})", name_of(op));
    }
    return "?";
  }
};

// ---- compile-time placement types ---------------------------------------------------------------------------------
struct Replicate {
  static constexpr Placement value = Placement::replicate();
};
template <int Dim, Chunking How = Chunking::contiguous>
struct Shard {
  static constexpr Placement value = Placement::shard(Dim, How);
};
template <int Dim>
using ShardZigzag = Shard<Dim, Chunking::zigzag>;
template <ReduceOp Op = ReduceOp::sum>
struct Partial {
  static constexpr Placement value = Placement::partial(Op);
};

// A compile-time placement: a type that names its runtime value.
template <class P>
concept PlacementType = requires {
  { P::value } -> std::convertible_to<Placement>;
};

}  // namespace paradyse

template <>
struct fmt::formatter<paradyse::Placement> : fmt::formatter<std::string> {
  auto format(const paradyse::Placement& p, format_context& ctx) const {
    return fmt::formatter<std::string>::format(p.to_string(), ctx);
  }
};
