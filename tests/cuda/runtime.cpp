#include "cuda/device_test.hpp"

#include "paradyse/device/runtime.hpp"

namespace pd = paradyse;

TEST_CASE("device runtime: a failed call throws DeviceError naming the call and the error") {
  PARADYSE_REQUIRE_DEVICE();
  void* p = nullptr;
  try {
    PARADYSE_CUDA_CHECK(cudaMalloc(&p, std::size_t(1) << 62));  // 4 EiB: no device has it
    FAIL("cudaMalloc of 4 EiB succeeded");
  } catch (const pd::device::DeviceError& e) {
    const std::string what = e.what();
    CHECK(what.find("cudaMalloc") != std::string::npos);
    CHECK(what.find("cudaErrorMemoryAllocation") != std::string::npos);
  }
}

TEST_CASE("device runtime: ScopedStream sets and restores the calling thread's stream") {
  const cudaStream_t before = pd::device::current_stream();
  CHECK(before == cudaStreamPerThread);
  {
    pd::device::ScopedStream scoped(cudaStreamLegacy);
    CHECK(pd::device::current_stream() == cudaStreamLegacy);
  }
  CHECK(pd::device::current_stream() == before);
}
