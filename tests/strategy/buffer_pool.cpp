// BufferPool: size classes, reuse across users, the high-water bound after switching working sets, tracking.
#include "paradyse/strategy/buffer_pool.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <vector>

using namespace paradyse;

TEST_CASE("BufferPool: size classes keep at most 12.5% slack") {
  CHECK(BufferPool::size_class(1) == 256);
  CHECK(BufferPool::size_class(256) == 256);
  CHECK(BufferPool::size_class(1000) == 1024);
  CHECK(BufferPool::size_class(1025) == 1152);
  for (std::size_t bytes = 257; bytes < 1'000'000; bytes = bytes * 3 / 2 + 7) {
    const std::size_t c = BufferPool::size_class(bytes);
    CHECK(c >= bytes);
    CHECK(double(c) <= double(bytes) * 1.125 + 1.0);
  }
}

TEST_CASE("BufferPool: a released buffer is reused by a request of the same class, whoever asks") {
  MemoryTracker tracker;
  ScopedTracker scoped(tracker);
  BufferPool pool;
  const float* first = nullptr;
  {
    auto a = pool.acquire<float>(Shape{100, 10});  // "strategy A"
    first = a.data();
    a.span()[0] = 42.0f;
    CHECK(tracker.in_use() >= 4000);
  }
  CHECK(pool.stats().cached_bytes > 0);
  auto b = pool.acquire<float>(Shape{1000});  // "strategy B", same bytes, another shape
  CHECK(b.data() == first);
  CHECK(b.span()[0] == 42.0f);  // contents are not cleared: strategies fill through their backend
  CHECK(pool.stats().hits == 1);
  CHECK(pool.stats().misses == 1);
  auto empty = pool.acquire<float>(Shape{0, 8});
  CHECK(empty.empty());
}

TEST_CASE("BufferPool: after switching working sets the pool holds max(W_A, W_B), not their sum") {
  MemoryTracker tracker;
  ScopedTracker scoped(tracker);
  BufferPool pool;
  auto working_set = [&](std::vector<std::int64_t> sizes) {
    std::vector<PooledBuffer<float>> held;
    for (std::int64_t n : sizes) held.push_back(pool.acquire<float>(Shape{n}));
    return pool.stats().in_use_bytes;
  };
  const std::size_t a = working_set({1 << 16, 1 << 14, 3 << 12});        // strategy A's buffers
  const std::size_t b = working_set({5 << 15, 7 << 13});                 // strategy B's, other sizes
  for (int round = 0; round < 3; ++round) {
    working_set({1 << 16, 1 << 14, 3 << 12});
    working_set({5 << 15, 7 << 13});
  }
  const auto& s = pool.stats();
  CHECK(s.in_use_bytes == 0);
  CHECK(s.cached_bytes <= std::max(a, b));
  CHECK(tracker.in_use() == s.cached_bytes);
  CHECK(s.evictions > 0);
  pool.trim();
  CHECK(tracker.in_use() == 0);
}

TEST_CASE("BufferPool: buffers count on the tracker current where the pool was made, and obey its cap") {
  MemoryTracker capped(1 << 20);
  ScopedTracker scoped(capped);
  BufferPool pool;
  auto ok = pool.acquire<float>(Shape{1 << 17});  // 512 KiB
  CHECK(capped.in_use() == 512 * 1024);
  CHECK_THROWS_AS(pool.acquire<float>(Shape{1 << 18}), OutOfMemory);
}

TEST_CASE("BufferPool: a buffer's contents are unspecified, new or reused: nothing is zeroed for its borrower") {
  MemoryTracker tracker;
  Trace trace;
  tracker.set_trace(&trace);
  const ScopedTracker scoped(tracker);
  BufferPool pool;
  {
    PooledBuffer<float> first = pool.acquire<float>(Shape{1000});
#ifdef PARADYSE_POISON_UNSPECIFIED  // the tests' build: a new buffer holds NaN bytes, not zeros
    CHECK(std::all_of(first.data(), first.data() + 1000, [](float x) { return std::isnan(x); }));
#endif
    first.data()[7] = 3.0f;
  }
  const PooledBuffer<float> again = pool.acquire<float>(Shape{1000});  // a hit: what the last borrower left
  CHECK(pool.stats().hits == 1);
  CHECK(again.data()[7] == 3.0f);
  // The pool's own allocation is not traced (the model replays the pool's rule); the loans are.
  for (const TraceEvent& e : trace.events()) CHECK(e.kind != TraceKind::allocate);
  tracker.set_trace(nullptr);
}
