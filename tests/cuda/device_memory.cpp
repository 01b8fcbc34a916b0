// Device memory: the caching allocator under a MemoryTracker (reuse without cudaMalloc, counts, cap and driver
// exhaustion as OutOfMemory, zero-initialised tensors), host <-> device transfers of strided views, pinned buffers,
// streams and events.
#include "cuda/device_test.hpp"

#include "paradyse/core/memory.hpp"
#include "paradyse/core/rng.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/device/caching_allocator.hpp"
#include "paradyse/device/pinned.hpp"
#include "paradyse/device/runtime.hpp"
#include "paradyse/device/stream.hpp"
#include "paradyse/device/transfer.hpp"
#include "paradyse/ops/cuda/tensor_ops.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <string>
#include <thread>
#include <vector>

namespace pd = paradyse;
namespace dev = paradyse::device;

namespace {

pd::Tensor<float> random_host(pd::Shape shape, std::uint64_t seed) {
  pd::Tensor<float> t(shape, pd::MemoryTracker::process_default().handle());
  pd::Rng rng(seed);
  rng.fill_uniform(t.span());
  return t;
}

// The elements of a host view in row-major order (any strides).
std::vector<float> elements(pd::TensorView<const float> x) {
  pd::Tensor<float> flat(x.shape(), pd::MemoryTracker::process_default().handle());
  pd::copy(x, flat.view());
  return {flat.span().begin(), flat.span().end()};
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("caching allocator: size classes of 512 B, and 2 MiB above 1 MiB") {
  PARADYSE_REQUIRE_DEVICE();
  using A = dev::CachingAllocator;
  CHECK(A::block_size(1) == 512);
  CHECK(A::block_size(512) == 512);
  CHECK(A::block_size(513) == 1024);
  CHECK(A::block_size(std::size_t(1) << 20) == (std::size_t(1) << 20));
  CHECK(A::block_size((std::size_t(1) << 20) + 1) == (std::size_t(2) << 20));
  CHECK(A::block_size((std::size_t(5) << 20) + 64) == (std::size_t(6) << 20));
}

TEST_CASE("caching allocator: a freed block comes back without cudaMalloc; the tracker counts in use and peak") {
  PARADYSE_REQUIRE_DEVICE();
  pd::MemoryTracker tracker = dev::make_tracker();
  CHECK(tracker.space() == pd::MemorySpace::device);
  dev::CachingAllocator* allocator = dev::caching_allocator(tracker);
  REQUIRE(allocator != nullptr);

  const float* first = nullptr;
  {
    pd::Tensor<float> a(pd::Shape{1000}, tracker.handle());  // 4000 bytes -> 4032 counted, a 4096-byte block
    first = a.data();
    CHECK(a.space() == pd::MemorySpace::device);
    CHECK(tracker.in_use() == 4032);
    CHECK(tracker.peak() == 4032);
    const auto stats = allocator->stats();
    CHECK(stats.malloc_calls == 1);
    CHECK(stats.reserved_bytes == 4096);
    CHECK(stats.cached_bytes == 0);
  }
  CHECK(tracker.in_use() == 0);
  CHECK(tracker.peak() == 4032);
  CHECK(allocator->stats().cached_bytes == 4096);
  {
    pd::Tensor<float> again(pd::Shape{1000}, tracker.handle());  // the same class: the cached block
    CHECK(again.data() == first);
    const auto stats = allocator->stats();
    INFO("malloc calls " << stats.malloc_calls << ", reuses " << stats.reuses);
    CHECK(stats.malloc_calls == 1);
    CHECK(stats.reuses == 1);
    CHECK(stats.cached_bytes == 0);
    pd::Tensor<float> large(pd::Shape{3 << 18}, tracker.handle());  // 3 MiB: a new 4 MiB block
    CHECK(tracker.in_use() == 4032 + (std::size_t(3) << 20));
    CHECK(tracker.peak() == 4032 + (std::size_t(3) << 20));
    CHECK(allocator->stats().malloc_calls == 2);
    CHECK(allocator->stats().reserved_bytes == 4096 + (std::size_t(4) << 20));
  }
  // Steady state: the same allocations again make no cudaMalloc.
  for (int step = 0; step < 3; ++step) {
    pd::Tensor<float> a(pd::Shape{1000}, tracker.handle());
    pd::Tensor<float> b(pd::Shape{3 << 18}, tracker.handle());
  }
  CHECK(allocator->stats().malloc_calls == 2);
  allocator->release_cache();
  const auto released = allocator->stats();
  CHECK(released.cached_bytes == 0);
  CHECK(released.reserved_bytes == 0);
  CHECK(released.free_calls == 2);
  CHECK(cudaGetLastError() == cudaSuccess);
}

TEST_CASE("device tracker: beyond the cap is OutOfMemory naming the requested bytes, the bytes in use and the cap") {
  PARADYSE_REQUIRE_DEVICE();
  pd::MemoryTracker tracker = dev::make_tracker(std::size_t(1) << 20);
  pd::Tensor<float> held(pd::Shape{200000}, tracker.handle());  // 800000 bytes
  try {
    pd::Tensor<float> more(pd::Shape{100000}, tracker.handle());  // 400000 more: beyond 1048576
    FAIL("an allocation beyond the cap succeeded");
  } catch (const pd::OutOfMemory& e) {
    const std::string what = e.what();
    INFO(what);
    CHECK(e.requested() == 400000);
    CHECK(e.in_use() == 800000);
    CHECK(e.cap() == 1048576);
    CHECK(contains(what, "400000"));
    CHECK(contains(what, "800000"));
    CHECK(contains(what, "1048576"));
  }
  CHECK(tracker.in_use() == 800000);
  CHECK(tracker.peak() == 800000);
}

TEST_CASE("device tracker: a request the device cannot hold is OutOfMemory with the allocator's numbers") {
  PARADYSE_REQUIRE_DEVICE();
  pd::MemoryTracker tracker = dev::make_tracker();
  { pd::Tensor<float> cached(pd::Shape{4096}, tracker.handle()); }  // something in the cache to release
  const std::int64_t huge = std::int64_t(1) << 46;                   // 256 TiB of floats
  try {
    pd::Tensor<float> t(pd::Shape{huge}, tracker.handle());
    FAIL("a 256 TiB device allocation succeeded");
  } catch (const pd::OutOfMemory& e) {
    const std::string what = e.what();
    INFO(what);
    CHECK(e.requested() == std::size_t(huge) * 4);
    CHECK(contains(what, "out of device memory"));
    CHECK(contains(what, std::to_string(std::size_t(huge) * 4)));
    CHECK(contains(what, "cudaMalloc calls"));
  }
  CHECK(cudaGetLastError() == cudaSuccess);  // the failed cudaMalloc does not surface in later checks
  CHECK(tracker.in_use() == 0);
  CHECK(dev::caching_allocator(tracker)->stats().releases == 1);
  pd::Tensor<float> after(pd::Shape{16}, tracker.handle());  // the tracker still works
  CHECK(tracker.in_use() == 64);
}

TEST_CASE("device tensors are zero-initialised, also in a reused block") {
  PARADYSE_REQUIRE_DEVICE();
  pd::MemoryTracker tracker = dev::make_tracker();
  const float* first = nullptr;
  {
    pd::Tensor<float> t(pd::Shape{37, 41}, tracker.handle());
    pd::ops::cuda::fill(t.view(), 7.5f);
    first = t.data();
    const auto host = dev::to_host(t);
    CHECK(host(36, 40) == 7.5f);
  }
  pd::Tensor<float> t(pd::Shape{37, 41}, tracker.handle());
  CHECK(t.data() == first);  // the block that held 7.5
  const auto host = dev::to_host(t);
  int nonzero = 0;
  for (const float x : host.span()) nonzero += x != 0.0f;
  CHECK_MESSAGE(nonzero == 0, nonzero << " of " << host.numel() << " elements are not zero");
}

TEST_CASE("transfers: to_device and to_host round trips, contiguous and strided, and copies into existing views") {
  PARADYSE_REQUIRE_DEVICE();
  pd::MemoryTracker tracker = dev::make_tracker();
  const auto x = random_host(pd::Shape{5, 7, 3}, 11);

  SUBCASE("contiguous") {
    const auto d = dev::to_device(x, tracker);
    CHECK(d.space() == pd::MemorySpace::device);
    CHECK(d.shape() == x.shape());
    const auto back = dev::to_host(d);
    CHECK(back.space() == pd::MemorySpace::host);
    CHECK(elements(back.view()) == elements(x.view()));
  }
  SUBCASE("strided host source (a slice of the middle dimension)") {
    const auto slice = x.view().slice(1, 2, 4);  // [5, 4, 3], row stride 21
    const auto d = dev::to_device(slice, tracker);
    CHECK(d.shape() == pd::Shape{5, 4, 3});
    CHECK(elements(dev::to_host(d).view()) == elements(slice));
  }
  SUBCASE("strided device sources: a column slice and a transposed view (element stride != 1)") {
    const auto d = dev::to_device(x, tracker);
    const auto cols = d.view().slice(2, 1, 2);  // [5, 7, 2]: rows of 2 of 3
    CHECK(elements(dev::to_host(cols).view()) == elements(x.view().slice(2, 1, 2)));
    // [3, 7, 5] view of the [5, 7, 3] storage: every dimension reversed.
    const pd::TensorView<const float> transposed(d.data(), pd::Shape{3, 7, 5}, pd::Shape{1, 3, 21});
    const pd::TensorView<const float> host_transposed(x.data(), pd::Shape{3, 7, 5}, pd::Shape{1, 3, 21});
    CHECK(elements(dev::to_host(transposed).view()) == elements(host_transposed));
  }
  SUBCASE("copy_to_device into a strided device view, copy_to_host into a strided host view") {
    pd::Tensor<float> d(pd::Shape{5, 7, 6}, tracker.handle());  // zeros
    const auto target = d.view().slice(2, 2, 3);                 // [5, 7, 3] inside [5, 7, 6]
    dev::copy_to_device(x.view(), target);
    const auto whole = dev::to_host(d);
    CHECK(elements(whole.view().slice(2, 2, 3)) == elements(x.view()));
    for (const std::int64_t c : {0, 1, 5}) {
      const auto untouched = elements(whole.view().slice(2, c, 1));
      CHECK(std::count(untouched.begin(), untouched.end(), 0.0f) == std::ptrdiff_t(untouched.size()));
    }
    pd::Tensor<float> host(pd::Shape{5, 9, 3}, pd::MemoryTracker::process_default().handle());
    dev::copy_to_host(pd::TensorView<const float>(target), host.view().slice(1, 1, 7));
    CHECK(elements(host.view().slice(1, 1, 7)) == elements(x.view()));
    CHECK(host(4, 0, 2) == 0.0f);
    CHECK(host(4, 8, 2) == 0.0f);
  }
  SUBCASE("a host pointer where device memory is expected is an error naming both") {
    try {
      (void)dev::to_host(x.view());
      FAIL("to_host of host memory succeeded");
    } catch (const pd::Error& e) {
      INFO(e.what());
      CHECK(contains(e.what(), "is host memory, expected device memory"));
    }
    pd::MemoryTracker host_tracker;
    CHECK_THROWS_AS((void)dev::to_device(x.view(), host_tracker), pd::Error);
  }
}

TEST_CASE("pinned buffers stage copies to and from the device") {
  PARADYSE_REQUIRE_DEVICE();
  pd::MemoryTracker tracker = dev::make_tracker();
  dev::PinnedBuffer<float> pinned(1000);
  REQUIRE(pinned.size() == 1000);
  for (std::size_t i = 0; i < pinned.size(); ++i) pinned[i] = float(i) * 0.5f;
  pd::Tensor<float> d(pd::Shape{1000}, tracker.handle());
  dev::copy_to_device(pd::TensorView<const float>(pinned.data(), pd::Shape{1000}), d.view());
  dev::PinnedBuffer<float> back(1000);
  dev::copy_to_host(pd::TensorView<const float>(d.view()), pd::TensorView<float>(back.data(), pd::Shape{1000}));
  CHECK(back[0] == 0.0f);
  CHECK(back[999] == 499.5f);
  dev::PinnedBuffer<float> moved(std::move(back));
  CHECK(back.data() == nullptr);
  CHECK(moved[1] == 0.5f);
}

TEST_CASE("streams and events: timing a kernel, and one stream waiting for another") {
  PARADYSE_REQUIRE_DEVICE();
  pd::MemoryTracker tracker = dev::make_tracker();
  dev::Stream first, second;
  CHECK(first.get() != nullptr);
  CHECK(first.get() != second.get());

  pd::Tensor<float> x, y;
  dev::Event start, stop, filled(false);
  {
    dev::ScopedStream on(first.get());
    x = pd::Tensor<float>(pd::Shape{1 << 24}, tracker.handle());  // 64 MiB
    y = pd::Tensor<float>(pd::Shape{1 << 24}, tracker.handle());
    start.record();
    for (int i = 1; i <= 4; ++i) pd::ops::cuda::fill(x.view(), float(i));
    stop.record();
    filled.record();
  }
  const float ms = dev::elapsed_ms(start, stop);
  INFO("four fills of 64 MiB took " << ms << " ms");
  CHECK(ms > 0.0f);
  {
    dev::ScopedStream on(second.get());
    filled.wait();  // the copy on `second` starts after the fills on `first`
    pd::ops::cuda::copy(x.view(), y.view());
    dev::synchronize();
  }
  const auto host = dev::to_host(y.view().slice(0, (1 << 24) - 4, 4));
  CHECK(host(0) == 4.0f);
  CHECK(host(3) == 4.0f);
  CHECK(filled.done());

  dev::Stream moved(std::move(first));
  CHECK(first.get() == nullptr);
  CHECK(moved.get() != nullptr);
}

TEST_CASE("caching allocator: rank threads allocate and free through one tracker concurrently") {
  PARADYSE_REQUIRE_DEVICE();
  pd::MemoryTracker tracker = dev::make_tracker();
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      dev::Stream stream;
      dev::ScopedStream on(stream.get());
      for (int i = 0; i < 50; ++i) {
        pd::Tensor<float> a(pd::Shape{std::int64_t(128 * (1 + (i + t) % 5))}, tracker.handle());
        pd::Tensor<float> b(pd::Shape{std::int64_t(1000 + 10 * t)}, tracker.handle());
      }
      dev::synchronize();
    });
  for (auto& thread : threads) thread.join();
  CHECK(tracker.in_use() == 0);
  const auto stats = dev::caching_allocator(tracker)->stats();
  CHECK(stats.reserved_bytes == stats.cached_bytes);
  INFO("cudaMalloc calls " << stats.malloc_calls << ", reuses " << stats.reuses);
  CHECK(stats.malloc_calls + stats.reuses == 400);
  CHECK(stats.malloc_calls <= 4 * 10);  // at most the distinct sizes per thread, each held twice at once
}
