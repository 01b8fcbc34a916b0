// tests/strategy/tp2d_reference.hpp: the float64 pieces the 2D tensor-parallel tests share (thread ranks in
// tests/strategy/tp2d_linear.cpp, processes in tests/mpi/strategy.cpp): a plain matrix product and the blocks of a
// matrix that one rank of a [rows x cols] grid holds.
#pragma once

#include "paradyse/core/tensor.hpp"

#include <cstdint>
#include <vector>

namespace paradyse::testing {

// c = a b (or with a or b transposed), float64.
inline Tensor<double> product(const Tensor<double>& a, bool ta, const Tensor<double>& b, bool tb) {
  const std::int64_t m = ta ? a.extent(1) : a.extent(0), k = ta ? a.extent(0) : a.extent(1);
  const std::int64_t n = tb ? b.extent(0) : b.extent(1);
  Tensor<double> c(Shape{m, n});
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      double sum = 0;
      for (std::int64_t l = 0; l < k; ++l) sum += (ta ? a(l, i) : a(i, l)) * (tb ? b(j, l) : b(l, j));
      c(i, j) = sum;
    }
  return c;
}

// Block (row_block of row_blocks, col_block of col_blocks) of a float64 matrix, as float32.
inline Tensor<float> block(const Tensor<double>& t, int row_block, int row_blocks, int col_block, int col_blocks) {
  const std::int64_t r = t.extent(0) / row_blocks, c = t.extent(1) / col_blocks;
  Tensor<float> b(Shape{r, c});
  for (std::int64_t i = 0; i < r; ++i)
    for (std::int64_t j = 0; j < c; ++j) b(i, j) = float(t(row_block * r + i, col_block * c + j));
  return b;
}
inline std::vector<double> block64(const Tensor<double>& t, int row_block, int row_blocks, int col_block, int col_blocks,
                                    double offset = 0) {
  const std::int64_t r = t.extent(0) / row_blocks, c = t.extent(1) / col_blocks;
  std::vector<double> b;
  for (std::int64_t i = 0; i < r; ++i)
    for (std::int64_t j = 0; j < c; ++j) b.push_back(offset + t(row_block * r + i, col_block * c + j));
  return b;
}

}  // namespace paradyse::testing
