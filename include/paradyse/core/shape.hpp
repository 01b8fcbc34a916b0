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
    if (extents.size() > std::size_t(kMaxRank)) throw Error(fmt::format("rank {} exceeds kMaxRank = {}", extents.size(), kMaxRank));
    for (std::int64_t e : extents) {
      check(e >= 0, "extent {} must be non-negative", e);
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
    if (d < 0 || d >= rank_) [[unlikely]]  // to_string() formats: only on the failure path (extent() is hot)
      check(false, "dim {} is out of range for a rank-{} shape {}", dim, rank_, to_string());
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
    return a.rank_ == b.rank_ && std::equal(a.begin(), a.end(), b.begin());
  }

  std::string to_string() const { return fmt::format("[{}]", fmt::join(begin(), end(), ", ")); }

private:
  std::array<std::int64_t, kMaxRank> extents_{};
  int rank_ = 0;
};

}  // namespace paradyse

template <>
struct fmt::formatter<paradyse::Shape> : fmt::formatter<std::string> {
  auto format(const paradyse::Shape& s, format_context& ctx) const { return fmt::formatter<std::string>::format(s.to_string(), ctx); }
};
