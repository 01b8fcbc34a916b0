// tests/package/cuda_consumer.cpp: a program of the installed package's CUDA component. It links paradyse::cuda and
// paradyse::cuda_kernels (the kernels compiled once into this program) and takes the address of an ops::Cuda op, so
// the link needs that op's launcher from the installed kernels. Without a device it says why and succeeds.
#include "paradyse/device/runtime.hpp"
#include "paradyse/ops/cuda_backend.hpp"

#include <fmt/core.h>

int main() {
  auto* volatile merge = &paradyse::ops::Cuda::attention_merge;  // its launcher is defined in the installed kernels
  fmt::print("package cuda consumer: {} kernels linked ({}); ", paradyse::ops::Cuda::name, merge != nullptr);
  if (!paradyse::device::available()) {
    fmt::print("no device: {}\n", paradyse::device::unavailable_reason());
    return 0;
  }
  fmt::print("a device is present\n");
  return 0;
}
