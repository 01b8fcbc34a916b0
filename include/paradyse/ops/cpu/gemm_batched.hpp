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
// (a per-head loop's pointers: ColossalZ's attention blocks, MLA's absorption).
struct GemmItems {
  std::vector<const float*> a, b;
  std::vector<float*> c;
  void clear() noexcept {
    a.clear();
    b.clear();
    c.clear();
  }
  void add(const float* x, const float* y, float* z) {
    a.push_back(x);
    b.push_back(y);
    c.push_back(z);
  }
};

}  // namespace paradyse::ops
