// paradyse/ops/cpu/gemm_kernels.hpp: the two single-precision GEMM engines gemm() chooses between.
//
// c = alpha * op(a) * op(b) + beta * c, row-major, either operand transposed. gemm_cblas goes through CBLAS
// (OpenBLAS) when the build found it (PARADYSE_WITH_CBLAS); gemm_fallback is a blocked, register-tiled kernel of our
// own, compiled for the base instruction set, AVX2 and AVX-512 and picked at run time (the build does not pass
// -march). Which one gemm() runs is measured per machine (gemm_choice.hpp).
//
// Threads: each rank is already a thread, so a GEMM uses one thread by default. set_gemm_threads(n) lets OpenBLAS
// use n threads (a process-wide setting of OpenBLAS); the fallback is always single-threaded.
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/ops/cpu/simd.hpp"
#include "paradyse/ops/cpu/workspace.hpp"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

#if defined(PARADYSE_WITH_CBLAS)
#include <cblas.h>
// Not every cblas.h declares them (reference CBLAS does not); weak, so a non-OpenBLAS CBLAS still links.
extern "C" void openblas_set_num_threads(int) __attribute__((weak));
extern "C" char* openblas_get_config(void) __attribute__((weak));
#endif

namespace paradyse::ops {
enum class Transpose : bool { no, yes };
}

namespace paradyse::ops::cpu {

namespace detail {
inline std::atomic<int>& gemm_thread_setting() {
  static std::atomic<int> threads{0};  // 0: not yet applied
  return threads;
}
// Applies the thread count to OpenBLAS the first time a GEMM runs (one thread unless set_gemm_threads said more).
inline void apply_default_gemm_threads() {
#if defined(PARADYSE_WITH_CBLAS)
  static const bool applied = [] {
    int expected = 0;
    if (gemm_thread_setting().compare_exchange_strong(expected, 1) && openblas_set_num_threads)
      openblas_set_num_threads(1);
    return true;
  }();
  (void)applied;
#endif
}
}  // namespace detail

// Lets OpenBLAS use `threads` threads per GEMM (process-wide). The default is 1.
inline void set_gemm_threads(int threads) {
  check(threads >= 1, "set_gemm_threads: threads = {} must be at least 1", threads);
  detail::apply_default_gemm_threads();
  detail::gemm_thread_setting().store(threads);
#if defined(PARADYSE_WITH_CBLAS)
  if (openblas_set_num_threads) openblas_set_num_threads(threads);
#endif
}
inline int gemm_threads() {
  const int t = detail::gemm_thread_setting().load();
  return t == 0 ? 1 : t;
}

namespace detail {

inline void check_gemm_arguments(Transpose trans_a, Transpose trans_b, std::int64_t m, std::int64_t n, std::int64_t k,
                                 const float* a, std::int64_t lda, const float* b, std::int64_t ldb, const float* c,
                                 std::int64_t ldc) {
  check(m >= 0 && n >= 0 && k >= 0, "gemm: sizes m = {}, n = {}, k = {} must be non-negative", m, n, k);
  const std::int64_t a_columns = trans_a == Transpose::yes ? m : k;  // a is stored [k, m] when transposed
  const std::int64_t b_columns = trans_b == Transpose::yes ? k : n;
  check(lda >= std::max<std::int64_t>(1, a_columns), "gemm: lda = {} must be at least {} (columns of stored a)", lda,
        std::max<std::int64_t>(1, a_columns));
  check(ldb >= std::max<std::int64_t>(1, b_columns), "gemm: ldb = {} must be at least {} (columns of stored b)", ldb,
        std::max<std::int64_t>(1, b_columns));
  check(ldc >= std::max<std::int64_t>(1, n), "gemm: ldc = {} must be at least n = {}", ldc, std::max<std::int64_t>(1, n));
  check(m == 0 || n == 0 || c != nullptr, "gemm: c is null for a {} x {} result", m, n);
  check(m == 0 || n == 0 || k == 0 || (a != nullptr && b != nullptr), "gemm: a or b is null with m = {}, n = {}, k = {}",
        m, n, k);
}

// The GEMM that matmul over 2-D views stands for (the host's and the device's matmul share its contract): the views
// checked (2-D, contiguous columns, matching dimensions; the message names what differs) and read as sizes and
// leading dimensions. a: [m, k] (or [k, m] with trans_a), b: [k, n] (or [n, k] with trans_b), c: [m, n].
struct MatmulGemm {
  std::int64_t m, n, k, lda, ldb, ldc;
};
inline MatmulGemm matmul_gemm(TensorView<const float> a, Transpose trans_a, TensorView<const float> b,
                              Transpose trans_b, TensorView<const float> c) {
  check(a.rank() == 2 && b.rank() == 2 && c.rank() == 2, "matmul: views must be 2-D; got a {}, b {}, c {}", a.shape(),
        b.shape(), c.shape());
  const auto unit_columns = [](const TensorView<const float>& x) { return x.extent(1) <= 1 || x.strides()[1] == 1; };
  check(unit_columns(a) && unit_columns(b) && unit_columns(c),
        "matmul: columns must be contiguous; strides are a {}, b {}, c {}", a.strides(), b.strides(), c.strides());
  const std::int64_t m = trans_a == Transpose::yes ? a.extent(1) : a.extent(0);
  const std::int64_t k = trans_a == Transpose::yes ? a.extent(0) : a.extent(1);
  const std::int64_t kb = trans_b == Transpose::yes ? b.extent(1) : b.extent(0);
  const std::int64_t n = trans_b == Transpose::yes ? b.extent(0) : b.extent(1);
  check(k == kb, "matmul: inner dimensions differ: op(a) is [{}, {}], op(b) is [{}, {}]", m, k, kb, n);
  check(c.extent(0) == m && c.extent(1) == n, "matmul: c is {}, expected [{}, {}]", c.shape(), m, n);
  // A one-row (or empty) view's row stride is arbitrary; give BLAS a valid leading dimension.
  const auto leading = [](const TensorView<const float>& x) {
    return x.extent(0) <= 1 ? std::max<std::int64_t>(1, x.extent(1)) : x.strides()[0];
  };
  return {m, n, k, leading(a), leading(b), leading(c)};
}

// c = beta * c, where beta = 0 writes zeros whatever c held (even NaN).
inline void scale_matrix(std::int64_t m, std::int64_t n, float beta, float* c, std::int64_t ldc) {
  if (beta == 1.0f) return;
  for (std::int64_t i = 0; i < m; ++i) {
    float* row = c + i * ldc;
    if (beta == 0.0f)
      std::fill(row, row + n, 0.0f);
    else
      for (std::int64_t j = 0; j < n; ++j) row[j] *= beta;
  }
}

// ---- the fallback: packed panels and an mr x nr register tile ----------------------------------------------------
// Blocking (kc x nc panel of op(b), mc x kc block of op(a)) sized for a 1 MiB L2; mr x nr is chosen per instruction
// set so that the accumulators fit the vector registers.
inline constexpr std::int64_t kFallbackKc = 256, kFallbackMc = 96, kFallbackNc = 1024;

// Stores op(a)(i0 .. i0+mc, p0 .. p0+kc) in micro-panels of mr rows: panel[p * mr + r], zero-padded rows.
template <int Mr>
[[gnu::always_inline]] inline void pack_a(Transpose trans, const float* a, std::int64_t lda, std::int64_t i0,
                                          std::int64_t mc, std::int64_t p0, std::int64_t kc, float* packed) {
  for (std::int64_t ir = 0; ir < mc; ir += Mr) {
    const std::int64_t rows = std::min<std::int64_t>(Mr, mc - ir);
    float* panel = packed + ir * kc;
    for (std::int64_t p = 0; p < kc; ++p)
      for (int r = 0; r < Mr; ++r) {
        const std::int64_t i = i0 + ir + r, pp = p0 + p;
        panel[p * Mr + r] = r < rows ? (trans == Transpose::no ? a[i * lda + pp] : a[pp * lda + i]) : 0.0f;
      }
  }
}

// Stores alpha * op(b)(p0 .. p0+kc, j0 .. j0+nc) in micro-panels of nr columns: panel[p * nr + j], zero-padded.
template <int Nr>
[[gnu::always_inline]] inline void pack_b(Transpose trans, float alpha, const float* b, std::int64_t ldb,
                                          std::int64_t p0, std::int64_t kc, std::int64_t j0, std::int64_t nc,
                                          float* packed) {
  for (std::int64_t jr = 0; jr < nc; jr += Nr) {
    const std::int64_t cols = std::min<std::int64_t>(Nr, nc - jr);
    float* panel = packed + jr * kc;
    for (std::int64_t p = 0; p < kc; ++p) {
      const std::int64_t pp = p0 + p;
      if (trans == Transpose::no) {
        const float* row = b + pp * ldb + j0 + jr;
        for (int j = 0; j < Nr; ++j) panel[p * Nr + j] = j < cols ? alpha * row[j] : 0.0f;
      } else {
        for (int j = 0; j < Nr; ++j) panel[p * Nr + j] = j < cols ? alpha * b[(j0 + jr + j) * ldb + pp] : 0.0f;
      }
    }
  }
}

// c[0..rows, 0..cols] += a_panel (mr x kc) * b_panel (kc x nr). Written with GCC vector types of nr / 2 floats (two
// vectors per tile row, one register each), so the accumulators stay in registers at every optimisation level: the
// plain-array form vectorised well at -O2 but GCC 12 at -O3 turned it into spills (1.5 GFLOP/s under AVX2 on a Zen 2,
// against 11 at -O2). The sum runs over p in order for every element, so results do not depend on the width.
template <int Mr, int Nr>
[[gnu::always_inline]] inline void micro_kernel(std::int64_t kc, const float* __restrict a_panel,
                                                const float* __restrict b_panel, float* __restrict c, std::int64_t ldc,
                                                std::int64_t rows, std::int64_t cols) {
  constexpr int W = Nr / 2;
  typedef float Vec __attribute__((vector_size(W * sizeof(float))));
  Vec acc[Mr][2] = {};
  for (std::int64_t p = 0; p < kc; ++p) {
    const float* a = a_panel + p * Mr;
    Vec b0, b1;  // unaligned loads (no lambda: it would not inherit the caller's target and would break the ABI)
    __builtin_memcpy(&b0, b_panel + p * Nr, sizeof(Vec));
    __builtin_memcpy(&b1, b_panel + p * Nr + W, sizeof(Vec));
    for (int r = 0; r < Mr; ++r) {
      acc[r][0] += a[r] * b0;
      acc[r][1] += a[r] * b1;
    }
  }
  if (rows == Mr && cols == Nr) {
    for (int r = 0; r < Mr; ++r)
      for (int h = 0; h < 2; ++h) {
        Vec sum;
        __builtin_memcpy(&sum, c + r * ldc + h * W, sizeof(Vec));
        sum += acc[r][h];
        __builtin_memcpy(c + r * ldc + h * W, &sum, sizeof(Vec));
      }
  } else {
    float tile[Mr][Nr];
    __builtin_memcpy(tile, acc, sizeof(tile));
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t j = 0; j < cols; ++j) c[r * ldc + j] += tile[r][j];
  }
}

// c += alpha * op(a) op(b) (c already scaled by beta). Scratch holds the packed panels.
template <int Mr, int Nr>
[[gnu::always_inline]] inline void blocked_gemm(Transpose trans_a, Transpose trans_b, std::int64_t m, std::int64_t n,
                                                std::int64_t k, float alpha, const float* a, std::int64_t lda,
                                                const float* b, std::int64_t ldb, float* c, std::int64_t ldc,
                                                float* a_packed, float* b_packed) {
  for (std::int64_t j0 = 0; j0 < n; j0 += kFallbackNc) {
    const std::int64_t nc = std::min(kFallbackNc, n - j0);
    for (std::int64_t p0 = 0; p0 < k; p0 += kFallbackKc) {
      const std::int64_t kc = std::min(kFallbackKc, k - p0);
      pack_b<Nr>(trans_b, alpha, b, ldb, p0, kc, j0, nc, b_packed);
      for (std::int64_t i0 = 0; i0 < m; i0 += kFallbackMc) {
        const std::int64_t mc = std::min(kFallbackMc, m - i0);
        pack_a<Mr>(trans_a, a, lda, i0, mc, p0, kc, a_packed);
        for (std::int64_t jr = 0; jr < nc; jr += Nr)
          for (std::int64_t ir = 0; ir < mc; ir += Mr)
            micro_kernel<Mr, Nr>(kc, a_packed + ir * kc, b_packed + jr * kc, c + (i0 + ir) * ldc + j0 + jr, ldc,
                                 std::min<std::int64_t>(Mr, mc - ir), std::min<std::int64_t>(Nr, nc - jr));
      }
    }
  }
}

// Register tiles per instruction set: 16 xmm (4 floats), 16 ymm (8), 32 zmm (16).
inline constexpr int kMrBase = 4, kNrBase = 8;
inline constexpr int kMrAvx2 = 6, kNrAvx2 = 16;
inline constexpr int kMrAvx512 = 8, kNrAvx512 = 32;
inline constexpr int kMrMax = 8, kNrMax = 32;

inline void blocked_gemm_base(Transpose ta, Transpose tb, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
                              const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float* c,
                              std::int64_t ldc, float* ap, float* bp) {
  blocked_gemm<kMrBase, kNrBase>(ta, tb, m, n, k, alpha, a, lda, b, ldb, c, ldc, ap, bp);
}
#if defined(PARADYSE_X86_DISPATCH)
PARADYSE_TARGET_AVX2 inline void blocked_gemm_avx2(Transpose ta, Transpose tb, std::int64_t m,
                                                                   std::int64_t n, std::int64_t k, float alpha,
                                                                   const float* a, std::int64_t lda, const float* b,
                                                                   std::int64_t ldb, float* c, std::int64_t ldc,
                                                                   float* ap, float* bp) {
  blocked_gemm<kMrAvx2, kNrAvx2>(ta, tb, m, n, k, alpha, a, lda, b, ldb, c, ldc, ap, bp);
}
PARADYSE_TARGET_AVX512 inline void blocked_gemm_avx512(
    Transpose ta, Transpose tb, std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const float* a,
    std::int64_t lda, const float* b, std::int64_t ldb, float* c, std::int64_t ldc, float* ap, float* bp) {
  blocked_gemm<kMrAvx512, kNrAvx512>(ta, tb, m, n, k, alpha, a, lda, b, ldb, c, ldc, ap, bp);
}
#endif

// Floats of packing workspace one fallback GEMM call allocates (the dry run reports the same allocation).
inline std::size_t fallback_workspace_floats(std::int64_t m, std::int64_t n, std::int64_t k) {
  if (m == 0 || n == 0 || k == 0) return 0;
  const std::size_t depth = std::size_t(std::min(k, kFallbackKc));
  return std::size_t(std::min(m, kFallbackMc) + kMrMax) * depth + std::size_t(std::min(n, kFallbackNc) + kNrMax) * depth;
}

}  // namespace detail

// The built-in blocked GEMM (also what gemm() uses without CBLAS). Same contract as gemm().
inline void gemm_fallback(Transpose trans_a, Transpose trans_b, std::int64_t m, std::int64_t n, std::int64_t k,
                          float alpha, const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float beta,
                          float* c, std::int64_t ldc) {
  detail::check_gemm_arguments(trans_a, trans_b, m, n, k, a, lda, b, ldb, c, ldc);
  if (m == 0 || n == 0) return;
  detail::scale_matrix(m, n, beta, c, ldc);
  if (k == 0 || alpha == 0.0f) return;
  // Packed panels sized to the problem (at most ~1.2 MiB), zero-padded by the packing itself.
  const std::size_t depth = std::size_t(std::min(k, detail::kFallbackKc));
  const std::size_t a_floats = std::size_t(std::min(m, detail::kFallbackMc) + detail::kMrMax) * depth;
  const detail::Workspace<float> workspace(detail::fallback_workspace_floats(m, n, k));
  float* a_packed = workspace.data();
  float* b_packed = a_packed + a_floats;
  switch (simd_level()) {
#if defined(PARADYSE_X86_DISPATCH)
    case SimdLevel::avx512:
      detail::blocked_gemm_avx512(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, c, ldc, a_packed, b_packed);
      return;
    case SimdLevel::avx2:
      detail::blocked_gemm_avx2(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, c, ldc, a_packed, b_packed);
      return;
#endif
    default:
      detail::blocked_gemm_base(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, c, ldc, a_packed, b_packed);
  }
}

#if defined(PARADYSE_WITH_CBLAS)
// The same through CBLAS sgemm.
inline void gemm_cblas(Transpose trans_a, Transpose trans_b, std::int64_t m, std::int64_t n, std::int64_t k,
                       float alpha, const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float beta,
                       float* c, std::int64_t ldc) {
  detail::check_gemm_arguments(trans_a, trans_b, m, n, k, a, lda, b, ldb, c, ldc);
  if (m == 0 || n == 0) return;
  if (k == 0 || alpha == 0.0f) return detail::scale_matrix(m, n, beta, c, ldc);
  detail::apply_default_gemm_threads();
  // beta = 0 means "overwrite", but some BLAS read c then (0 * NaN): clear c here and let the BLAS add to it (beta 1).
  // One pass over c, not two: OpenBLAS's own beta = 0 writes the zeros again in a pass of its own before the product.
  if (beta == 0.0f) {
    detail::scale_matrix(m, n, 0.0f, c, ldc);
    beta = 1.0f;
  }
  cblas_sgemm(CblasRowMajor, trans_a == Transpose::yes ? CblasTrans : CblasNoTrans,
              trans_b == Transpose::yes ? CblasTrans : CblasNoTrans, int(m), int(n), int(k), alpha, a, int(lda), b,
              int(ldb), beta, c, int(ldc));
}
#endif

}  // namespace paradyse::ops::cpu
