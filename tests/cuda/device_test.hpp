// tests/cuda/device_test.hpp: what every CUDA test case starts with. Where there is no device (CI), the case says
// why and passes without running; everything it would run still compiled and linked.
#pragma once

#include "paradyse/device/runtime.hpp"

#include <doctest/doctest.h>

#define PARADYSE_REQUIRE_DEVICE()                                   \
  do {                                                              \
    if (!::paradyse::device::available()) {                         \
      MESSAGE("skipped: " << ::paradyse::device::unavailable_reason()); \
      return;                                                       \
    }                                                               \
  } while (0)
