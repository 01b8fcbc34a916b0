// paradyse/ops/cpu/gemm_batched.hpp: many GEMMs of one size in one call (a per-head loop as one backend op).
//
// gemm_batched(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc) computes, for i = 0, 1, ..., count - 1 in
// that order, c[i] = alpha * op(a[i]) op(b[i]) + beta * c[i], every item of the same m, n, k and leading dimensions
// (ops/cpu/gemm.hpp's contract per item). a, b, c hold one pointer per item. Items run in order, so an output that
// several items share with beta = 1 (the key gradient of a GQA group, summed over its query heads) accumulates
// exactly as the loop of single GEMMs it replaces. One call instead of `count` lets a backend launch one batched
// kernel (cuBLAS's gemmBatched) and lets the dry run (ops/counting.hpp) record one event with a count.
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/ops/cpu/gemm.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace paradyse::ops::cpu {

// Checks the item count of a batched GEMM: a, b and c must name the same number of items.
inline void check_gemm_batch(std::size_t a_items, std::size_t b_items, std::size_t c_items) {
  check(a_items == b_items && a_items == c_items,
        "gemm_batched: a, b and c must hold one pointer per item; got {} a, {} b and {} c pointers", a_items, b_items,
        c_items);
}

// Whether the row-major [m, n] outputs at c[i] (leading dimension ldc) of a batched GEMM share an element (then a
// device runs the items one by one, in order: ops/cuda/gemm.hpp). Exact for matrices in one allocation (equal pointers,
// column blocks of one wider matrix: the per-head outputs of attention are disjoint); says "shared" when the test would
// take too long (then the caller takes the ordered path, also correct).
inline bool gemm_outputs_overlap(std::int64_t m, std::int64_t n, std::int64_t ldc, std::span<float* const> c) {
  std::vector<std::uintptr_t> starts(c.size());
  for (std::size_t i = 0; i < c.size(); ++i) starts[i] = reinterpret_cast<std::uintptr_t>(c[i]);
  std::sort(starts.begin(), starts.end());
  const std::uintptr_t extent = (std::uintptr_t((m - 1) * ldc + n)) * sizeof(float);  // bytes from first to last
  const std::int64_t kMaxPairs = 1 << 20;
  std::int64_t pairs = 0;
  for (std::size_t i = 0; i < starts.size(); ++i) {
    for (std::size_t j = i + 1; j < starts.size() && starts[j] < starts[i] + extent; ++j) {
      if (++pairs > kMaxPairs) return true;
      const std::uintptr_t bytes = starts[j] - starts[i];
      if (bytes % sizeof(float) != 0) return true;  // not on a float boundary of the other: assume shared
      // Element (r2, c2) of j is element (r1, c1) of i when delta = (r1 - r2) * ldc + (c1 - c2), |r1 - r2| < m,
      // |c1 - c2| < n: the multiples of ldc nearest to delta decide.
      const std::int64_t delta = std::int64_t(bytes / sizeof(float));
      const std::int64_t q = delta / ldc, rem = delta % ldc;
      if ((rem < n && q < m) || (ldc - rem < n && q + 1 < m)) return true;
    }
  }
  return false;
}

inline void gemm_batched(Transpose trans_a, Transpose trans_b, std::int64_t m, std::int64_t n, std::int64_t k,
                         float alpha, std::span<const float* const> a, std::int64_t lda,
                         std::span<const float* const> b, std::int64_t ldb, float beta, std::span<float* const> c,
                         std::int64_t ldc) {
  check_gemm_batch(a.size(), b.size(), c.size());
  for (std::size_t i = 0; i < a.size(); ++i) gemm(trans_a, trans_b, m, n, k, alpha, a[i], lda, b[i], ldb, beta, c[i], ldc);
}

}  // namespace paradyse::ops::cpu

namespace paradyse::ops {

// The operands of a batched GEMM's items (item i: c[i] = op(a[i]) op(b[i])), gathered for one Backend::gemm_batched
// (a per-head loop's pointers: ColossalZ's attention blocks, MLA's absorption), of element type T (float; bf16 for the
// device's mixed-precision grouped GEMM, ops/cuda/gemm.hpp).
template <class T>
struct GemmItemsOf {
  std::vector<const T*> a, b;
  std::vector<T*> c;
  void clear() noexcept {
    a.clear();
    b.clear();
    c.clear();
  }
  void add(const T* x, const T* y, T* z) {
    a.push_back(x);
    b.push_back(y);
    c.push_back(z);
  }
};
using GemmItems = GemmItemsOf<float>;

}  // namespace paradyse::ops
