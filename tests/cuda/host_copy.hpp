// tests/cuda/host_copy.hpp: a device tensor's copy on a given host tracker, for checking a rank's results on the host
// (the way to the host is the tests'; the way to the device is the model's own, model/placement.hpp).
#pragma once

#include "paradyse/core/memory.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/device/runtime.hpp"
#include "paradyse/ops/cuda_backend.hpp"

namespace paradyse::testing {

// A copy of `device_tensor` in host memory charged to `host` (the rank's current tracker is its device tracker).
inline Tensor<float> on_host(const Tensor<float>& device_tensor, MemoryTracker& host) {
  ScopedTracker scope(host);
  Tensor<float> h(device_tensor.shape());
  ops::Cuda::copy(device_tensor.view(), h.view());
  device::synchronize();
  return h;
}

}  // namespace paradyse::testing
