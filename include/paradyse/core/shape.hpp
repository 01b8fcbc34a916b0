// paradyse/core/shape.hpp: Shape, a small fixed-capacity list of extents (row-major by default).
#pragma once

#include "paradyse/core/error.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace paradyse {

inline constexpr int kMaxRank = 6;

class Shape {
public:
  constexpr Shape() = default;
  constexpr Shape(std::initializer_list<std::int64_t> extents) {
    if (extents.size() > std::size_t(kMaxRank)) [[unlikely]]
      rank_too_large(extents.size());
    for (std::int64_t e : extents) {
      if (e < 0) [[unlikely]]
        negative_extent(e);
      extents_[rank_++] = e;
    }
  }

  constexpr int rank() const noexcept { return rank_; }
  constexpr std::int64_t operator[](int dim) const noexcept { return extents_[dim]; }
  constexpr std::int64_t& operator[](int dim) noexcept { return extents_[dim]; }
  constexpr const std::int64_t* begin() const noexcept { return extents_.data(); }
  constexpr const std::int64_t* end() const noexcept { return extents_.data() + rank_; }

  constexpr std::int64_t numel() const noexcept {
    std::int64_t n = 1;
    for (int d = 0; d < rank_; ++d) n *= extents_[d];
    return n;
  }

  // Extent of `dim`, with negative dims counted from the back (-1 is the last).
  std::int64_t extent(int dim) const { return extents_[normalize(dim)]; }
  int normalize(int dim) const {
    const int d = dim < 0 ? dim + rank_ : dim;
    if (d < 0 || d >= rank_) [[unlikely]]  // out of line: extent() and slicing are hot, and inline this
      dim_out_of_range(dim);
    return d;
  }

  // Row-major strides (the last dimension is contiguous).
  constexpr Shape row_major_strides() const noexcept {
    Shape strides;
    strides.rank_ = rank_;
    std::int64_t s = 1;
    for (int d = rank_ - 1; d >= 0; --d) {
      strides.extents_[d] = s;
      s *= extents_[d];
    }
    return strides;
  }

  Shape with(int dim, std::int64_t extent) const {
    Shape s = *this;
    s.extents_[normalize(dim)] = extent;
    return s;
  }

  friend constexpr bool operator==(const Shape& a, const Shape& b) noexcept {
    if (a.rank_ != b.rank_) return false;
    for (int d = 0; d < a.rank_; ++d)  // a plain loop: std::equal becomes a memcmp call, slow for <= 6 extents
      if (a.extents_[d] != b.extents_[d]) return false;
    return true;
  }

  std::string to_string() const { return fmt::format("[{}]", fmt::join(begin(), end(), ", ")); }

private:
  // The failure paths, out of line: shapes are built and indexed on every kernel call of a dry run.
  [[noreturn, gnu::cold, gnu::noinline]] static void rank_too_large(std::size_t rank) {
    throw Error(fmt::format("rank {} exceeds kMaxRank = {}", rank, kMaxRank));
  }
  [[noreturn, gnu::cold, gnu::noinline]] static void negative_extent(std::int64_t e) {
    check(false, "extent {} must be non-negative", e);
    __builtin_unreachable();
  }
  [[noreturn, gnu::cold, gnu::noinline]] void dim_out_of_range(int dim) const {
    check(false, "dim {} is out of range for a rank-{} shape {}", dim, rank_, to_string());
    __builtin_unreachable();
  }

  std::array<std::int64_t, kMaxRank> extents_{};
  int rank_ = 0;
};

}  // namespace paradyse

template <>
struct fmt::formatter<paradyse::Shape> : fmt::formatter<std::string> {
  auto format(const paradyse::Shape& s, format_context& ctx) const { return fmt::formatter<std::string>::format(s.to_string(), ctx); }
};
