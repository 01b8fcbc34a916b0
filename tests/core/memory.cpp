#include "paradyse/core/memory.hpp"
#include "paradyse/core/tensor.hpp"

#include <doctest/doctest.h>

#include <thread>

using namespace paradyse;

TEST_CASE("the cap makes an allocation beyond it throw OutOfMemory naming the sizes") {
  MemoryTracker tracker(1024);
  ScopedTracker scoped(tracker);
  Tensor<float> fits({200});  // 800 bytes -> 832 with alignment
  try {
    Tensor<float> too_big({100});
    FAIL("expected OutOfMemory");
  } catch (const OutOfMemory& e) {
    CHECK(e.requested() == 448);
    CHECK(e.in_use() == 832);
    CHECK(e.cap() == 1024);
    CHECK(std::string(e.what()).find("requested 448 bytes with 832 in use, cap is 1024 bytes") != std::string::npos);
  }
  CHECK(tracker.in_use() == 832);  // the failed allocation left no trace
}

TEST_CASE("peaks are per tracker and per thread, and reset_peak opens a new window") {
  MemoryTracker a, b;
  std::thread other([&] {
    ScopedTracker scoped(b);
    Tensor<double> t({1000});
  });
  {
    ScopedTracker scoped(a);
    Tensor<double> t({10});
  }
  other.join();
  CHECK(a.peak() == 128);
  CHECK(b.peak() == 8000);
  CHECK(b.in_use() == 0);
  b.reset_peak();
  CHECK(b.peak() == 0);
}
