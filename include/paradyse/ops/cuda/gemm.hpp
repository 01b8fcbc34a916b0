// paradyse/ops/cuda/gemm.hpp: GEMM on the device through cuBLAS: gemm, matmul, gemm_batched and gemm_grouped with
// exactly the signatures and row-major contracts of ops::cpu (ops/cpu/gemm.hpp, gemm_batched.hpp, gemm_grouped.hpp)
// over device pointers, and bf16 GEMMs with float accumulation, single and grouped (mixed precision, benchmarks).
//
// Row-major to cuBLAS: a row-major [m, n] matrix with leading dimension ldc is the column-major [n, m] matrix C^T
// with the same leading dimension, and C = op(A) op(B) is C^T = op(B)^T op(A)^T, so each call passes b before a and
// n before m, with each operand's own transpose flag. No data moves.
//
// Host code only (cuBLAS, no kernel). Each thread has its own cuBLAS handle per device (created on first use,
// destroyed when the thread ends); every call sets it to the calling thread's stream (device::current_stream()), so
// a GEMM is ordered with the thread's other device work and runs asynchronously. Math is full fp32 by default
// (CUBLAS_DEFAULT_MATH: the results agree with the CPU's to fp32 rounding); set_gemm_tf32(true) lets fp32 GEMMs use
// TF32 tensor cores (10-bit mantissa products, about 1e-3 relative error) process-wide.
#pragma once

#include "paradyse/core/dtype.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/device/runtime.hpp"
#include "paradyse/ops/cpu/gemm_batched.hpp"
#include "paradyse/ops/cpu/gemm_grouped.hpp"
#include "paradyse/ops/cpu/gemm_kernels.hpp"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <numeric>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

namespace paradyse::ops::cuda {

// fp32 GEMMs may use TF32 tensor cores (process-wide; off by default: full fp32, as the tests compare with the CPU).
inline std::atomic<bool>& gemm_tf32_setting() noexcept {
  static std::atomic<bool> enabled{false};
  return enabled;
}
inline void set_gemm_tf32(bool enabled) noexcept { gemm_tf32_setting().store(enabled); }
inline bool gemm_tf32() noexcept { return gemm_tf32_setting().load(); }

namespace gemm_detail {

// Throws DeviceError naming the cuBLAS call and its status unless `status` is CUBLAS_STATUS_SUCCESS.
inline void check_cublas(cublasStatus_t status, std::string_view what) {
  if (status != CUBLAS_STATUS_SUCCESS)
    throw device::DeviceError(
        fmt::format("cuBLAS error {} ({}) in {}", cublasGetStatusName(status), cublasGetStatusString(status), what));
}

// The calling thread's cuBLAS handles, one per device, destroyed when the thread ends.
struct ThreadHandles {
  std::vector<cublasHandle_t> by_device;
  ThreadHandles() = default;
  ThreadHandles(const ThreadHandles&) = delete;
  ThreadHandles& operator=(const ThreadHandles&) = delete;
  ~ThreadHandles() {
    for (cublasHandle_t handle : by_device)
      if (handle) (void)cublasDestroy(handle);  // at process exit the driver may be gone: nothing to report then
    (void)cudaGetLastError();
  }
};

// The calling thread's handle for the current device, on the thread's current stream, with the math mode set.
inline cublasHandle_t handle() {
  thread_local ThreadHandles handles;
  int device = 0;
  PARADYSE_CUDA_CHECK(cudaGetDevice(&device));
  if (std::size_t(device) >= handles.by_device.size()) handles.by_device.resize(std::size_t(device) + 1, nullptr);
  cublasHandle_t& h = handles.by_device[std::size_t(device)];
  if (!h) check_cublas(cublasCreate(&h), "cublasCreate");
  check_cublas(cublasSetStream(h, device::current_stream()), "cublasSetStream");
  check_cublas(cublasSetMathMode(h, gemm_tf32() ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH),
               "cublasSetMathMode");
  return h;
}

inline cublasOperation_t op(Transpose t) noexcept { return t == Transpose::yes ? CUBLAS_OP_T : CUBLAS_OP_N; }

// cuBLAS's 32-bit sizes: the value, or an Error naming it.
inline int as_int(std::int64_t value, std::string_view name) {
  check(value <= INT_MAX, "gemm: {} = {} exceeds cuBLAS's 32-bit limit {}", name, value, INT_MAX);
  return int(value);
}

inline void check_sizes(std::int64_t m, std::int64_t n, std::int64_t k, std::int64_t lda, std::int64_t ldb,
                        std::int64_t ldc) {
  (void)as_int(m, "m");
  (void)as_int(n, "n");
  (void)as_int(k, "k");
  (void)as_int(lda, "lda");
  (void)as_int(ldb, "ldb");
  (void)as_int(ldc, "ldc");
}

// c = beta * c for a row-major [m, n] matrix (leading dimension ldc); beta = 0 writes zeros whatever c held.
inline void scale_matrix(cublasHandle_t h, std::int64_t m, std::int64_t n, float beta, float* c, std::int64_t ldc) {
  if (beta == 1.0f) return;
  if (beta == 0.0f) {
    PARADYSE_CUDA_CHECK(cudaMemset2DAsync(c, std::size_t(ldc) * sizeof(float), 0, std::size_t(n) * sizeof(float),
                                          std::size_t(m), device::current_stream()));
    return;
  }
  // In place (C = A with lda = ldc, no transpose): c = beta * c + 0 * c.
  const float zero = 0.0f;
  check_cublas(cublasSgeam(h, CUBLAS_OP_N, CUBLAS_OP_N, int(n), int(m), &beta, c, int(ldc), &zero, c, int(ldc), c,
                           int(ldc)),
               "cublasSgeam (c = beta * c)");
}

// Runs call(arrays) with `pointers` (host memory) copied to stream-ordered device scratch, the device pointer arrays a
// batched or grouped cuBLAS call reads (cudaMallocAsync, freed with cudaFreeAsync after the call has read them); the
// call's status, or a DeviceError naming `what` when the copy failed.
template <class Call>
cublasStatus_t with_device_pointers(const std::vector<const void*>& pointers, std::string_view what, Call&& call) {
  const cudaStream_t stream = device::current_stream();
  const std::size_t bytes = pointers.size() * sizeof(void*);
  void* scratch = nullptr;
  PARADYSE_CUDA_CHECK(cudaMallocAsync(&scratch, bytes, stream));
  // The pageable source is staged before cudaMemcpyAsync returns, so `pointers` may go at the end of this call.
  const cudaError_t copied = cudaMemcpyAsync(scratch, pointers.data(), bytes, cudaMemcpyHostToDevice, stream);
  cublasStatus_t status = CUBLAS_STATUS_SUCCESS;
  if (copied == cudaSuccess) status = call(static_cast<const float* const*>(scratch));
  PARADYSE_CUDA_CHECK(cudaFreeAsync(scratch, stream));  // stream-ordered: after the call has read the arrays
  device::check(copied, what);
  return status;
}

}  // namespace gemm_detail

// c: [m, n] = alpha * op(a): [m, k] * op(b): [k, n] + beta * c, device pointers, row-major, leading dimensions in
// elements (ops::cpu::gemm's contract: op(a) = a ([m, k], lda >= k) or a^T (a stored [k, m], lda >= m); beta = 0
// ignores c's old contents, even NaN). Asynchronous on the calling thread's stream.
inline void gemm(Transpose trans_a, Transpose trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
                 const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c,
                 std::int64_t ldc) {
  cpu::detail::check_gemm_arguments(trans_a, trans_b, m, n, k, a, lda, b, ldb, c, ldc);
  gemm_detail::check_sizes(m, n, k, lda, ldb, ldc);
  if (m == 0 || n == 0) return;
  const cublasHandle_t h = gemm_detail::handle();
  if (k == 0 || alpha == 0.0f) return gemm_detail::scale_matrix(h, m, n, beta, c, ldc);
  gemm_detail::check_cublas(cublasSgemm(h, gemm_detail::op(trans_b), gemm_detail::op(trans_a), int(n), int(m), int(k),
                                        &alpha, b, int(ldb), a, int(lda), &beta, c, int(ldc)),
                            "cublasSgemm");
}

// The same over 2-D device views (rows may be strided, columns contiguous): c = alpha * op(a) op(b) + beta * c.
// a: [m, k] (or [k, m] with trans_a), b: [k, n] (or [n, k] with trans_b), c: [m, n].
inline void matmul(TensorView<const float> a, Transpose trans_a, TensorView<const float> b, Transpose trans_b,
                   TensorView<float> c, float alpha = 1.0f, float beta = 0.0f) {
  const cpu::detail::MatmulGemm g = cpu::detail::matmul_gemm(a, trans_a, b, trans_b, c);
  gemm(trans_a, trans_b, g.m, g.n, g.k, alpha, a.data(), g.lda, b.data(), g.ldb, beta, c.data(), g.ldc);
}

// For i = 0, 1, ..., count - 1 in that order: c[i] = alpha * op(a[i]) op(b[i]) + beta * c[i] (ops::cpu's
// gemm_batched contract; the pointer spans are host memory holding device pointers). When no two outputs share an
// element, one cublasSgemmBatched runs every item (its pointer arrays go to stream-ordered device scratch,
// cudaMallocAsync/cudaFreeAsync, alive until the call has read them). When outputs are shared (the key gradient of a
// GQA group summed over its query heads with beta = 1), the items run as single GEMMs in order on the stream, so the
// sum accumulates exactly as the CPU's loop.
inline void gemm_batched(Transpose trans_a, Transpose trans_b, std::int64_t m, std::int64_t n, std::int64_t k,
                         float alpha, std::span<const float* const> a, std::int64_t lda,
                         std::span<const float* const> b, std::int64_t ldb, float beta, std::span<float* const> c,
                         std::int64_t ldc) {
  cpu::check_gemm_batch(a.size(), b.size(), c.size());
  for (std::size_t i = 0; i < a.size(); ++i)
    cpu::detail::check_gemm_arguments(trans_a, trans_b, m, n, k, a[i], lda, b[i], ldb, c[i], ldc);
  gemm_detail::check_sizes(m, n, k, lda, ldb, ldc);
  const int count = gemm_detail::as_int(std::int64_t(a.size()), "the item count");
  if (count == 0 || m == 0 || n == 0) return;
  if (count == 1 || k == 0 || alpha == 0.0f || cpu::gemm_outputs_overlap(m, n, ldc, c)) {
    for (std::size_t i = 0; i < a.size(); ++i)
      gemm(trans_a, trans_b, m, n, k, alpha, a[i], lda, b[i], ldb, beta, c[i], ldc);
    return;
  }
  const cublasHandle_t h = gemm_detail::handle();
  // Device pointer arrays, in cuBLAS's operand order: [b[0..count), a[0..count), c[0..count)].
  std::vector<const void*> pointers;
  pointers.reserve(3 * a.size());
  pointers.insert(pointers.end(), b.begin(), b.end());
  pointers.insert(pointers.end(), a.begin(), a.end());
  pointers.insert(pointers.end(), c.begin(), c.end());
  const cublasStatus_t status = gemm_detail::with_device_pointers(
      pointers, "cudaMemcpyAsync (gemm_batched pointer arrays)", [&](const float* const* arrays) {
        return cublasSgemmBatched(h, gemm_detail::op(trans_b), gemm_detail::op(trans_a), int(n), int(m), int(k), &alpha,
                                  arrays, int(ldb), arrays + count, int(lda), &beta,
                                  const_cast<float* const*>(arrays + 2 * count), int(ldc), count);
      });
  gemm_detail::check_cublas(status, "cublasSgemmBatched");
}

namespace gemm_detail {
// Whether any two of a grouped GEMM's non-empty outputs may share an element: their spans of memory, first element to
// last, intersect (outputs of one allocation side by side, the row blocks of the experts' rows or their separate
// weight gradients, do not).
template <class T>
bool grouped_outputs_overlap(const GroupedGemmOf<T>& items, std::int64_t ldc) {
  std::vector<std::pair<std::uintptr_t, std::uintptr_t>> spans;  // [first byte, past the last)
  for (std::size_t i = 0; i < items.size(); ++i) {
    if (items.m[i] == 0 || items.n[i] == 0) continue;
    const auto first = reinterpret_cast<std::uintptr_t>(items.c[i]);
    spans.emplace_back(first, first + std::uintptr_t((items.m[i] - 1) * ldc + items.n[i]) * sizeof(T));
  }
  std::sort(spans.begin(), spans.end());
  for (std::size_t i = 1; i < spans.size(); ++i)
    if (spans[i].first < spans[i - 1].second) return true;
  return false;
}

// The host arrays of one grouped cuBLAS call over `which` items, one group of one problem per item, in cuBLAS's
// column-major terms (b before a, n before m: see the header): each group's transposes, m, n, k, scalars, leading
// dimensions and size (1), and the device pointers it reads, [b of each item, a of each, c of each].
struct GroupedArrays {
  std::vector<cublasOperation_t> op_b, op_a;
  std::vector<int> rows, cols, inner, ld_b, ld_a, ld_c, sizes;
  std::vector<float> alphas, betas;
  std::vector<const void*> pointers;
  int count() const noexcept { return int(rows.size()); }
};
template <class T>
GroupedArrays grouped_arrays(Transpose trans_a, Transpose trans_b, float alpha, const GroupedGemmOf<T>& items,
                             const std::vector<std::size_t>& which, std::int64_t lda, std::int64_t ldb, float beta,
                             std::int64_t ldc) {
  const std::size_t g = which.size();
  (void)as_int(std::int64_t(g), "the item count");
  GroupedArrays a;
  a.op_b.assign(g, op(trans_b)), a.op_a.assign(g, op(trans_a));
  a.ld_b.assign(g, int(ldb)), a.ld_a.assign(g, int(lda)), a.ld_c.assign(g, int(ldc)), a.sizes.assign(g, 1);
  a.alphas.assign(g, alpha), a.betas.assign(g, beta);
  for (const std::size_t i : which) {
    a.rows.push_back(int(items.n[i])), a.cols.push_back(int(items.m[i])), a.inner.push_back(int(items.k[i]));
    a.pointers.push_back(items.b[i]);
  }
  for (const std::size_t i : which) a.pointers.push_back(items.a[i]);
  for (const std::size_t i : which) a.pointers.push_back(items.c[i]);
  return a;
}

// Checks every item of a grouped GEMM against the single GEMM's contract and cuBLAS's 32-bit sizes.
template <class T>
void check_grouped(Transpose trans_a, Transpose trans_b, const GroupedGemmOf<T>& items, std::int64_t lda,
                   std::int64_t ldb, std::int64_t ldc) {
  cpu::check_gemm_group(items);
  // The shape checks look at pointers only for null: the element type does not matter to them.
  for (std::size_t i = 0; i < items.size(); ++i) {
    cpu::detail::check_gemm_arguments(trans_a, trans_b, items.m[i], items.n[i], items.k[i],
                                      reinterpret_cast<const float*>(items.a[i]), lda,
                                      reinterpret_cast<const float*>(items.b[i]), ldb,
                                      reinterpret_cast<const float*>(items.c[i]), ldc);
    check_sizes(items.m[i], items.n[i], items.k[i], lda, ldb, ldc);
  }
}
}  // namespace gemm_detail

// For i = 0, 1, ..., items.size() - 1 in that order: c_i [m_i, n_i] = alpha * op(a_i) op(b_i) + beta * c_i (ops::cpu's
// gemm_grouped contract; items holds device pointers in host memory). When no two outputs share an element, one
// cublasSgemmGroupedBatched runs every item with m, n and k > 0, each a group of one problem of its own sizes (its
// pointer arrays go to stream-ordered device scratch, as gemm_batched's), and those with k = 0 scale their c alone;
// when outputs are shared, the items run as single GEMMs in order, so the sums accumulate as the CPU's loop.
inline void gemm_grouped(Transpose trans_a, Transpose trans_b, float alpha, const GroupedGemm& items,
                         std::int64_t lda, std::int64_t ldb, float beta, std::int64_t ldc) {
  gemm_detail::check_grouped(trans_a, trans_b, items, lda, ldb, ldc);
  const auto single = [&](std::size_t i) {
    gemm(trans_a, trans_b, items.m[i], items.n[i], items.k[i], alpha, items.a[i], lda, items.b[i], ldb, beta,
         items.c[i], ldc);
  };
  const bool in_order = gemm_detail::grouped_outputs_overlap(items, ldc);
  std::vector<std::size_t> grouped;  // the items of the grouped call
  for (std::size_t i = 0; i < items.size(); ++i) {
    if (in_order || items.k[i] == 0 || alpha == 0.0f)
      single(i);
    else if (items.m[i] > 0 && items.n[i] > 0)
      grouped.push_back(i);
  }
  if (grouped.size() == 1) single(grouped.front());
  if (grouped.size() <= 1) return;
  const gemm_detail::GroupedArrays g =
      gemm_detail::grouped_arrays(trans_a, trans_b, alpha, items, grouped, lda, ldb, beta, ldc);
  const int count = g.count();
  const cublasHandle_t h = gemm_detail::handle();
  const cublasStatus_t status = gemm_detail::with_device_pointers(
      g.pointers, "cudaMemcpyAsync (gemm_grouped pointer arrays)", [&](const float* const* arrays) {
        return cublasSgemmGroupedBatched(h, g.op_b.data(), g.op_a.data(), g.rows.data(), g.cols.data(),
                                         g.inner.data(), g.alphas.data(), arrays, g.ld_b.data(), arrays + count,
                                         g.ld_a.data(), g.betas.data(), const_cast<float* const*>(arrays + 2 * count),
                                         g.ld_c.data(), count, g.sizes.data());
      });
  gemm_detail::check_cublas(status, "cublasSgemmGroupedBatched");
}

// ---- bf16 operands, fp32 accumulation (cublasGemmEx, CUBLAS_COMPUTE_32F) ----------------------------------------

namespace gemm_detail {
inline void gemm_bf16(Transpose trans_a, Transpose trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
                      const bf16* a, std::int64_t lda, const bf16* b, std::int64_t ldb, float beta, void* c,
                      cudaDataType_t c_type, std::int64_t ldc) {
  // The shape checks look at pointers only for null: the element type does not matter to them.
  cpu::detail::check_gemm_arguments(trans_a, trans_b, m, n, k, reinterpret_cast<const float*>(a), lda,
                                    reinterpret_cast<const float*>(b), ldb, static_cast<const float*>(c), ldc);
  check_sizes(m, n, k, lda, ldb, ldc);
  if (m == 0 || n == 0) return;
  // bf16 is bit-compatible with __nv_bfloat16 (CUDA_R_16BF).
  check_cublas(cublasGemmEx(handle(), op(trans_b), op(trans_a), int(n), int(m), int(k), &alpha, b, CUDA_R_16BF,
                            int(ldb), a, CUDA_R_16BF, int(lda), &beta, c, c_type, int(ldc), CUBLAS_COMPUTE_32F,
                            CUBLAS_GEMM_DEFAULT),
               c_type == CUDA_R_32F ? "cublasGemmEx (bf16 x bf16 -> fp32)" : "cublasGemmEx (bf16 x bf16 -> bf16)");
}
}  // namespace gemm_detail

// c (fp32): [m, n] = alpha * op(a) op(b) + beta * c with bf16 a and b, products summed in fp32. Row-major, the
// contract of the fp32 gemm.
inline void gemm(Transpose trans_a, Transpose trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
                 const bf16* a, std::int64_t lda, const bf16* b, std::int64_t ldb, float beta, float* c,
                 std::int64_t ldc) {
  gemm_detail::gemm_bf16(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, CUDA_R_32F, ldc);
}

// c (bf16): the same, the fp32 result rounded to bf16 once at the end.
inline void gemm(Transpose trans_a, Transpose trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
                 const bf16* a, std::int64_t lda, const bf16* b, std::int64_t ldb, float beta, bf16* c,
                 std::int64_t ldc) {
  gemm_detail::gemm_bf16(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, CUDA_R_16BF, ldc);
}

// c_i (bf16) [m_i, n_i] = alpha * op(a_i) op(b_i) + beta * c_i for bf16 items (bf16 device pointers in host memory),
// products summed in fp32 and each result rounded to bf16 once: a bf16 server's experts as one
// cublasGemmGroupedBatchedEx (CUBLAS_COMPUTE_32F), one group of one problem per item, as the fp32 gemm_grouped. Its
// items may not share an output (a bf16 sum over items would round at every item) and each non-empty one needs k > 0;
// an Error names the item otherwise. Asynchronous on the calling thread's stream.
inline void gemm_grouped(Transpose trans_a, Transpose trans_b, float alpha, const GroupedGemmOf<bf16>& items,
                         std::int64_t lda, std::int64_t ldb, float beta, std::int64_t ldc) {
  gemm_detail::check_grouped(trans_a, trans_b, items, lda, ldb, ldc);
  check(!gemm_detail::grouped_outputs_overlap(items, ldc),
        "gemm_grouped (bf16): two items' outputs share memory; the bf16 grouped GEMM needs disjoint outputs");
  std::vector<std::size_t> grouped;
  for (std::size_t i = 0; i < items.size(); ++i) {
    if (items.m[i] == 0 || items.n[i] == 0) continue;
    check(items.k[i] > 0, "gemm_grouped (bf16): item {} ({} x {}) has k = 0; give it k > 0 or leave it out", i,
          items.m[i], items.n[i]);
    grouped.push_back(i);
  }
  if (grouped.empty()) return;
  const gemm_detail::GroupedArrays g =
      gemm_detail::grouped_arrays(trans_a, trans_b, alpha, items, grouped, lda, ldb, beta, ldc);
  const int count = g.count();
  const cublasHandle_t h = gemm_detail::handle();
  const cublasStatus_t status = gemm_detail::with_device_pointers(
      g.pointers, "cudaMemcpyAsync (gemm_grouped bf16 pointer arrays)", [&](const float* const* arrays) {
        const void* const* p = reinterpret_cast<const void* const*>(arrays);
        return cublasGemmGroupedBatchedEx(h, g.op_b.data(), g.op_a.data(), g.rows.data(), g.cols.data(),
                                          g.inner.data(), g.alphas.data(), p, CUDA_R_16BF, g.ld_b.data(), p + count,
                                          CUDA_R_16BF, g.ld_a.data(), g.betas.data(),
                                          const_cast<void* const*>(p + 2 * count), CUDA_R_16BF, g.ld_c.data(), count,
                                          g.sizes.data(), CUBLAS_COMPUTE_32F);
      });
  gemm_detail::check_cublas(status, "cublasGemmGroupedBatchedEx (bf16 x bf16 -> bf16)");
}

}  // namespace paradyse::ops::cuda
