// paradyse/ops/cpu/gemm_grouped.hpp: GEMMs of different sizes in one call (an expert loop as one backend op).
//
// gemm_grouped(ta, tb, alpha, items, lda, ldb, beta, ldc) computes, for i = 0, 1, ..., items.size() - 1 in that
// order, c_i [m_i, n_i] = alpha * op(a_i) [m_i, k_i] op(b_i) [k_i, n_i] + beta * c_i (ops/cpu/gemm.hpp's contract per
// item), every item of its own m, n, k and operands, the transposes, scalars and leading dimensions shared. It is
// what an MoE layer's experts need: expert e's rows [m_e, h] against its own weight, m_e set by the routing (and, for
// a weight gradient, k_e). Items run in order, so outputs that items share accumulate as the loop of single GEMMs
// it replaces. One call lets a device backend launch one grouped kernel for every expert (cuBLAS's
// gemmGroupedBatched) where the loop launched one per expert, and lets the dry run (ops/counting.hpp) mark the items
// that ride on the first one's launch.
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/ops/cpu/gemm.hpp"
#include "paradyse/ops/cpu/gemm_batched.hpp"

#include <cstddef>
#include <cstdint>
#include <vector>

namespace paradyse::ops {

// The items of a grouped GEMM, item i: c[i] [m[i], n[i]] = op(a[i]) op(b[i]) (k[i] the inner size): a batched
// GEMM's operands (ops::GemmItemsOf) with each item's sizes beside them.
template <class T>
struct GroupedGemmOf : GemmItemsOf<T> {
  std::vector<std::int64_t> m, n, k;

  std::size_t size() const noexcept { return this->a.size(); }
  bool empty() const noexcept { return this->a.empty(); }
  void clear() noexcept {
    GemmItemsOf<T>::clear();
    m.clear(), n.clear(), k.clear();
  }
  void add(std::int64_t rows, std::int64_t cols, std::int64_t inner, const T* x, const T* y, T* z) {
    GemmItemsOf<T>::add(x, y, z);
    m.push_back(rows), n.push_back(cols), k.push_back(inner);
  }
};
using GroupedGemm = GroupedGemmOf<float>;

}  // namespace paradyse::ops

namespace paradyse::ops::cpu {

// Checks that every list of a grouped GEMM holds one entry per item.
template <class T>
void check_gemm_group(const GroupedGemmOf<T>& items) {
  const std::size_t count = items.a.size();
  check(items.m.size() == count && items.n.size() == count && items.k.size() == count && items.b.size() == count &&
            items.c.size() == count,
        "gemm_grouped: m, n, k, a, b and c must hold one entry per item; got {} m, {} n, {} k, {} a, {} b and {} c",
        items.m.size(), items.n.size(), items.k.size(), count, items.b.size(), items.c.size());
}

inline void gemm_grouped(Transpose trans_a, Transpose trans_b, float alpha, const GroupedGemm& items,
                         std::int64_t lda, std::int64_t ldb, float beta, std::int64_t ldc) {
  check_gemm_group(items);
  for (std::size_t i = 0; i < items.size(); ++i)
    gemm(trans_a, trans_b, items.m[i], items.n[i], items.k[i], alpha, items.a[i], lda, items.b[i], ldb, beta,
         items.c[i], ldc);
}

}  // namespace paradyse::ops::cpu
