// The CUDA component compiles and links (nvcc, C++20, fmt, CUB, NCCL) and, where a GPU is present, runs a kernel.
// Without a GPU (CI) the device checks are skipped with a message; the compile-and-link part is the test there.
#include "paradyse/core/error.hpp"
#include "paradyse/core/tensor.hpp"

#include <cub/block/block_reduce.cuh>
#include <cuda_runtime.h>
#include <doctest/doctest.h>
#include <nccl.h>

#include <vector>

namespace {

// out[0] = sum of in[0..n), one block.
template <int kThreads>
__global__ void block_sum(const float* in, int n, float* out) {
  using Reduce = cub::BlockReduce<float, kThreads>;
  __shared__ typename Reduce::TempStorage storage;
  float local = 0;
  for (int i = threadIdx.x; i < n; i += kThreads) local += in[i];
  const float total = Reduce(storage).Sum(local);
  if (threadIdx.x == 0) *out = total;
}

bool have_gpu() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

}  // namespace

TEST_CASE("NCCL links and reports its version") {
  int version = 0;
  CHECK(ncclGetVersion(&version) == ncclSuccess);
  CHECK(version >= 21800);
}

TEST_CASE("a CUB kernel runs on the GPU and matches the host sum") {
  if (!have_gpu()) {
    MESSAGE("no CUDA device: skipped");
    return;
  }
  const int n = 100000;
  std::vector<float> host(n);
  double want = 0;
  for (int i = 0; i < n; ++i) want += host[i] = float((i % 17) - 8) * 0.25f;
  float *in = nullptr, *out = nullptr;
  REQUIRE(cudaMalloc(&in, n * sizeof(float)) == cudaSuccess);
  REQUIRE(cudaMalloc(&out, sizeof(float)) == cudaSuccess);
  cudaMemcpy(in, host.data(), n * sizeof(float), cudaMemcpyHostToDevice);
  block_sum<256><<<1, 256>>>(in, n, out);
  float got = 0;
  REQUIRE(cudaMemcpy(&got, out, sizeof(float), cudaMemcpyDeviceToHost) == cudaSuccess);
  cudaFree(in);
  cudaFree(out);
  CHECK(got == doctest::Approx(want));
}
