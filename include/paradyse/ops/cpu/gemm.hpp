// paradyse/ops/cpu/gemm.hpp: single-precision GEMM, row-major, either operand transposed, beta-accumulate.
//
// c = alpha * op(a) * op(b) + beta * c through the engine measured fastest on this machine for the size class of
// the call (gemm_choice.hpp): OpenBLAS when the build found it, or the library's own blocked kernel
// (gemm_kernels.hpp). Results are deterministic for a given engine; the choice is fixed for the life of the process
// (and kept per machine in a cache file), so a program computes the same bits run after run on one machine.
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/ops/cpu/gemm_choice.hpp"
#include "paradyse/ops/cpu/gemm_kernels.hpp"

#include <algorithm>
#include <cstdint>

namespace paradyse::ops::cpu {

// Floats of workspace gemm() allocates for this call (0 through CBLAS, or when alpha = 0).
inline std::size_t gemm_workspace_floats(std::int64_t m, std::int64_t n, std::int64_t k, float alpha) {
  if (gemm_engine_for(m, n, k) == GemmEngine::cblas) return 0;
  return alpha == 0.0f ? 0 : detail::fallback_workspace_floats(m, n, k);
}

// c: [m, n] = alpha * op(a): [m, k] * op(b): [k, n] + beta * c. Row-major; leading dimensions in elements.
// op(a) = a ([m, k], lda >= k) or a^T (a stored [k, m], lda >= m). beta = 0 ignores c's old contents (even NaN).
inline void gemm(Transpose trans_a, Transpose trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
                 const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c,
                 std::int64_t ldc) {
#if defined(PARADYSE_WITH_CBLAS)
  if (gemm_engine_for(m, n, k) == GemmEngine::cblas)
    return gemm_cblas(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
#endif
  gemm_fallback(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

// The same over 2-D views (rows may be strided, columns contiguous): c = alpha * op(a) op(b) + beta * c.
// a: [m, k] (or [k, m] with trans_a), b: [k, n] (or [n, k] with trans_b), c: [m, n].
inline void matmul(TensorView<const float> a, Transpose trans_a, TensorView<const float> b, Transpose trans_b,
                   TensorView<float> c, float alpha = 1.0f, float beta = 0.0f) {
  const detail::MatmulGemm g = detail::matmul_gemm(a, trans_a, b, trans_b, c);
  gemm(trans_a, trans_b, g.m, g.n, g.k, alpha, a.data(), g.lda, b.data(), g.ldb, beta, c.data(), g.ldc);
}

}  // namespace paradyse::ops::cpu
