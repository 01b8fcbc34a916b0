#include "paradyse/core/host_malloc.hpp"
#include "paradyse/core/memory.hpp"
#include "paradyse/core/tensor.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
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

TEST_CASE("a tensor keeps its tracker's counts alive: destroying the tracker first is safe (issue 15)") {
  std::optional<Tensor<float>> outlives;
  MemoryTracker::Handle handle;
  {
    MemoryTracker tracker;
    ScopedTracker scoped(tracker);
    outlives.emplace(Shape{100});
    handle = tracker.handle();
    CHECK(handle.in_use() == 448);
    CHECK(outlives->tracker() == handle);
  }
  CHECK(handle.in_use() == 448);
  outlives.reset();  // after its tracker: returns the bytes to the counts the handle shares
  CHECK(handle.in_use() == 0);
}

TEST_CASE("sizes beyond 2^60 bytes, or beyond 64 bits, throw OutOfMemory naming the shape; nothing wraps (issue 15)") {
  MemoryTracker meta(MemorySpace::meta);
  ScopedTracker scoped(meta);
  const Tensor<float> big(Shape{std::int64_t(1) << 40, 1 << 16});  // 2^58 bytes: counted, not stored
  CHECK(meta.in_use() == std::size_t(1) << 58);
  auto message = [](auto&& f) -> std::string {
    try {
      f();
    } catch (const OutOfMemory& e) {
      return e.what();
    }
    return "no error";
  };
  // A shape whose bytes overflow 64 bits (the element count alone is 2^80).
  CHECK(message([] { Tensor<float> t(Shape{std::int64_t(1) << 40, std::int64_t(1) << 40}); })
            .find("a tensor of shape [1099511627776, 1099511627776] (4 bytes per element) needs 4.836e+24 bytes, "
                  "beyond the 2^60 bytes (1 EiB)") != std::string::npos);
  // Fits in 64 bits, but would take the tracker past 2^60 bytes.
  CHECK(message([] { Tensor<float> t(Shape{std::int64_t(1) << 58}); })
            .find("requested 1152921504606846976 bytes with 288230376151711744 in use, beyond the 2^60 bytes (1 EiB) "
                  "that any memory tracker counts") != std::string::npos);
  CHECK(meta.in_use() == std::size_t(1) << 58);  // the failed allocations left no trace
}

TEST_CASE("a host allocation the system refuses names its real size and reason, not the 2^60-byte limit (issue 27)") {
  MemoryTracker tracker;  // no cap
  ScopedTracker scoped(tracker);
  try {
    Tensor<float> huge({std::int64_t(1) << 55});  // 2^57 bytes: below the tracked limit, beyond any host
    FAIL("expected OutOfMemory");
  } catch (const OutOfMemory& e) {
    const std::string what = e.what();
    CHECK(what.find("out of host memory: requested 144115188075855872 bytes (1.342e+08 GiB)") != std::string::npos);
    CHECK(what.find("no cap; the system's allocator refused it: Cannot allocate memory") != std::string::npos);
    CHECK(what.find("2^60") == std::string::npos);
  }
  CHECK(tracker.in_use() == 0);
}

TEST_CASE("host malloc: the new-page size is known once freed memory is kept, and only then") {
  // Nothing in this test binary has set the C library's threshold before: its default moves with what is freed.
  CHECK(paradyse::host_new_pages_from() == 0);
  const bool set = paradyse::retain_freed_host_memory();
#if defined(__GLIBC__)
  CHECK(set);
  CHECK(paradyse::host_new_pages_from() == paradyse::kHostMmapThreshold);
#else
  CHECK_FALSE(set);
  CHECK(paradyse::host_new_pages_from() == 0);
#endif
}

TEST_CASE("Tensor::uninitialized skips the zero fill: counted as any tensor, traced unzeroed, poisoned in tests") {
  MemoryTracker tracker;
  Trace trace;
  tracker.set_trace(&trace);
  {
    const ScopedTracker scoped(tracker);
    const Tensor<float> zeros(Shape{3, 5});
    const Tensor<double> raw = Tensor<double>::uninitialized(Shape{3, 5});
    CHECK(tracker.in_use() == 64 + 128);  // 60 and 120 bytes, each rounded to the 64-byte alignment
    CHECK(std::all_of(zeros.span().begin(), zeros.span().end(), [](float x) { return x == 0; }));
#ifdef PARADYSE_POISON_UNSPECIFIED  // the tests' build (tests/CMakeLists.txt): every unspecified byte is 0xFF, a NaN
    CHECK(std::all_of(raw.span().begin(), raw.span().end(), [](double x) { return std::isnan(x); }));
#endif
  }
  tracker.set_trace(nullptr);
  const auto events = trace.events();
  REQUIRE(events.size() == 4);
  CHECK((events[0].kind == TraceKind::allocate && events[0].bytes == 60 && !events[0].unzeroed));
  CHECK((events[1].kind == TraceKind::allocate && events[1].bytes == 120 && events[1].unzeroed));
  CHECK((events[2].kind == TraceKind::deallocate && events[3].kind == TraceKind::deallocate));
  // On meta memory nothing is filled either way; the trace still tells them apart.
  MemoryTracker meta(MemorySpace::meta);
  Trace meta_trace;
  meta.set_trace(&meta_trace);
  {
    const Tensor<float> a = Tensor<float>::uninitialized(Shape{4}, meta.handle());
    const Tensor<float> b(Shape{4}, meta.handle());
  }
  meta.set_trace(nullptr);
  REQUIRE(meta_trace.events().size() == 4);
  CHECK(meta_trace.events()[0].unzeroed);
  CHECK_FALSE(meta_trace.events()[1].unzeroed);
}
