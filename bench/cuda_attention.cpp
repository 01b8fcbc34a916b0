// bench/cuda_attention.cpp: the CUDA flash-attention kernels (ops/cuda/attention.hpp) against the cuBLAS bf16 GEMM
// rate measured in the same run (issue 9's goal: forward >= 50%, backward >= 35% of it).
//
// bf16 tensor-core kernels at head_dim 128, s in {1K .. 32K}, causal and not, forward and backward; batch * heads
// chosen so that every size does the same work (2^29 / s^2 sequences of 128-wide heads, at least 1). Each time is
// the median of >= 10 runs timed with CUDA events after warm-ups. FLOPs follow the FlashAttention convention:
// forward 4 s^2 d per head (two GEMMs), halved when causal; backward 2.5x forward (five GEMMs of the same size).
// The fp32 general kernel is timed at one size for reference. --quick: s in {1K, 4K} only.
#include "paradyse/cli/flags.hpp"

#include "paradyse/core/dtype.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/device/runtime.hpp"
#include "paradyse/ops/attention_mask.hpp"
#include "paradyse/ops/cuda/attention.hpp"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <fmt/core.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string_view>
#include <vector>

namespace pd = paradyse;

namespace {


void check_cublas(cublasStatus_t status, const char* what) {
  pd::check(status == CUBLAS_STATUS_SUCCESS, "cuBLAS error {} in {}", int(status), what);
}

// Device memory of `count` elements of T, freed on destruction.
template <class T>
class DeviceArray {
public:
  explicit DeviceArray(std::size_t count) : count_(count) {
    PARADYSE_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&data_), count * sizeof(T)));
  }
  ~DeviceArray() { cudaFree(data_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  T* get() const { return data_; }
  // Uniform values in [-1, 1] (a fixed LCG), uploaded once.
  void fill_random(std::uint64_t seed) {
    std::vector<T> host(count_);
    std::uint64_t x = seed * 6364136223846793005ull + 1442695040888963407ull;
    for (auto& e : host) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      e = T(float(double(x >> 11) / double(1ull << 53) * 2.0 - 1.0));
    }
    PARADYSE_CUDA_CHECK(cudaMemcpy(data_, host.data(), count_ * sizeof(T), cudaMemcpyHostToDevice));
  }

private:
  T* data_ = nullptr;
  std::size_t count_;
};

// Median milliseconds of `runs` timed calls of `f` after `warmups` untimed ones.
double median_ms(const std::function<void()>& f, int warmups = 2, int runs = 10) {
  for (int i = 0; i < warmups; ++i) f();
  cudaEvent_t start, stop;
  PARADYSE_CUDA_CHECK(cudaEventCreate(&start));
  PARADYSE_CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<double> times;
  for (int i = 0; i < runs; ++i) {
    PARADYSE_CUDA_CHECK(cudaEventRecord(start, pd::device::current_stream()));
    f();
    PARADYSE_CUDA_CHECK(cudaEventRecord(stop, pd::device::current_stream()));
    PARADYSE_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0.0f;
    PARADYSE_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms);
  }
  PARADYSE_CUDA_CHECK(cudaEventDestroy(start));
  PARADYSE_CUDA_CHECK(cudaEventDestroy(stop));
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// TFLOP/s of a cuBLAS bf16 GEMM, n x n x n, fp32 accumulation.
double cublas_bf16_tflops(int n) {
  DeviceArray<pd::bf16> a(std::size_t(n) * n), b(std::size_t(n) * n), c(std::size_t(n) * n);
  a.fill_random(1);
  b.fill_random(2);
  cublasHandle_t handle;
  check_cublas(cublasCreate(&handle), "cublasCreate");
  check_cublas(cublasSetStream(handle, pd::device::current_stream()), "cublasSetStream");
  const float alpha = 1.0f, beta = 0.0f;
  const double ms = median_ms([&] {
    check_cublas(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, a.get(), CUDA_R_16BF, n, b.get(),
                              CUDA_R_16BF, n, &beta, c.get(), CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                 "cublasGemmEx");
  });
  cublasDestroy(handle);
  return 2.0 * n * double(n) * n / (ms * 1e-3) / 1e12;
}

struct Row {
  std::string kernel, pass;
  std::int64_t s, bh;
  bool causal;
  double ms, tflops;
};

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  pd::cli::Flags flags("cuda_attention",
                         "CUDA flash attention (bf16 tensor cores, head_dim 128; fp32 general kernel at one size) "
                         "against the cuBLAS bf16 GEMM rate (8192^3, fp32 accumulation) of the same run; prints a "
                         "markdown table.");
  flags.flag("--quick", quick, "s in {1K, 4K} only (a few seconds)");
  flags.parse(argc, argv);
  if (!pd::device::available()) {
    fmt::print("cuda_attention: {}; nothing to measure\n", pd::device::unavailable_reason());
    return 0;
  }
  try {
    const double gemm = cublas_bf16_tflops(8192);
    fmt::print("cuBLAS bf16 GEMM 8192^3 (fp32 accumulation): {:.1f} TFLOP/s\n\n", gemm);

    constexpr std::int64_t d = 128;
    const std::vector<std::int64_t> lengths =
        quick ? std::vector<std::int64_t>{1024, 4096} : std::vector<std::int64_t>{1024, 2048, 4096, 8192, 16384, 32768};
    const auto heads_for = [](std::int64_t s) { return std::max<std::int64_t>(1, (std::int64_t(1) << 29) / (s * s)); };
    std::size_t most = 0;
    for (std::int64_t s : lengths) most = std::max(most, std::size_t(s * heads_for(s) * d));
    DeviceArray<pd::bf16> q(most), k(most), v(most), out(most), dout(most), dq(most), dk(most), dv(most);
    q.fill_random(3);
    k.fill_random(4);
    v.fill_random(5);
    dout.fill_random(6);
    PARADYSE_CUDA_CHECK(cudaMemset(dq.get(), 0, most * sizeof(pd::bf16)));
    PARADYSE_CUDA_CHECK(cudaMemset(dk.get(), 0, most * sizeof(pd::bf16)));
    PARADYSE_CUDA_CHECK(cudaMemset(dv.get(), 0, most * sizeof(pd::bf16)));

    std::vector<Row> rows;
    for (std::int64_t s : lengths) {
      const std::int64_t bh = heads_for(s);
      const pd::Shape shape{1, s, bh, d}, lse_shape{1, bh, s};
      DeviceArray<float> lse(std::size_t(bh * s));
      const pd::TensorView<const pd::bf16> qv(q.get(), shape), kv(k.get(), shape), vv(v.get(), shape),
          dov(dout.get(), shape);
      const pd::TensorView<pd::bf16> ov(out.get(), shape), dqv(dq.get(), shape), dkv(dk.get(), shape),
          dvv(dv.get(), shape);
      const pd::TensorView<float> lv(lse.get(), lse_shape);
      for (bool causal : {false, true}) {
        pd::ops::AttentionMask mask;
        mask.causal = causal;
        const double fwd_flops = 4.0 * double(s) * double(s) * double(d) * double(bh) * (causal ? 0.5 : 1.0);
        const double f_ms = median_ms([&] { pd::ops::cuda::attention_forward(qv, kv, vv, mask, ov, lv); });
        rows.push_back({"bf16 tensor cores", "forward", s, bh, causal, f_ms, fwd_flops / (f_ms * 1e-3) / 1e12});
        const double b_ms = median_ms([&] {
          pd::ops::cuda::attention_backward(qv, kv, vv, ov, lv, dov, mask, dqv, dkv, dvv);
        });
        rows.push_back({"bf16 tensor cores", "backward", s, bh, causal, b_ms, 2.5 * fwd_flops / (b_ms * 1e-3) / 1e12});
      }
    }
    {  // the fp32 general kernels at one size
      const std::int64_t s = 2048, bh = 8;
      const std::size_t n = std::size_t(s * bh * d);
      DeviceArray<float> fq(n), fk(n), fv(n), fo(n), fdo(n), fdq(n), fdk(n), fdv(n), flse(std::size_t(s * bh));
      fq.fill_random(7);
      fk.fill_random(8);
      fv.fill_random(9);
      fdo.fill_random(10);
      PARADYSE_CUDA_CHECK(cudaMemset(fdq.get(), 0, n * sizeof(float)));
      PARADYSE_CUDA_CHECK(cudaMemset(fdk.get(), 0, n * sizeof(float)));
      PARADYSE_CUDA_CHECK(cudaMemset(fdv.get(), 0, n * sizeof(float)));
      const pd::Shape shape{1, s, bh, d}, lse_shape{1, bh, s};
      const pd::TensorView<const float> qv(fq.get(), shape), kv(fk.get(), shape), vv(fv.get(), shape),
          dov(fdo.get(), shape);
      const pd::TensorView<float> ov(fo.get(), shape), dqv(fdq.get(), shape), dkv(fdk.get(), shape),
          dvv(fdv.get(), shape), lv(flse.get(), lse_shape);
      const pd::ops::AttentionMask mask;
      const double fwd_flops = 4.0 * double(s) * double(s) * double(d) * double(bh);
      const double f_ms = median_ms([&] { pd::ops::cuda::attention_forward(qv, kv, vv, mask, ov, lv); }, 1, 10);
      rows.push_back({"fp32 general", "forward", s, bh, false, f_ms, fwd_flops / (f_ms * 1e-3) / 1e12});
      const double b_ms = median_ms([&] {
        pd::ops::cuda::attention_backward(qv, kv, vv, ov, lv, dov, mask, dqv, dkv, dvv);
      }, 1, 10);
      rows.push_back({"fp32 general", "backward", s, bh, false, b_ms, 2.5 * fwd_flops / (b_ms * 1e-3) / 1e12});
    }
    pd::device::synchronize();

    fmt::print("| kernel | pass | s | b*h | causal | median ms | TFLOP/s | of cuBLAS bf16 GEMM |\n");
    fmt::print("|---|---|---:|---:|---|---:|---:|---:|\n");
    for (const Row& r : rows)
      fmt::print("| {} | {} | {} | {} | {} | {:.3f} | {:.1f} | {:.0f}% |\n", r.kernel, r.pass, r.s, r.bh,
                 r.causal ? "yes" : "no", r.ms, r.tflops, 100.0 * r.tflops / gemm);
    fmt::print("\nFLOPs: forward 4 s^2 d per head (halved when causal), backward 2.5x forward (FlashAttention "
               "convention); goal: forward >= 50%, backward >= 35% of the GEMM rate.\n");
  } catch (const std::exception& e) {
    fmt::print(stderr, "cuda_attention: {}\n", e.what());
    return 1;
  }
  return 0;
}
