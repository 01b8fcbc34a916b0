#include "paradyse/core/rng.hpp"
#include "paradyse/core/tensor.hpp"

#include <doctest/doctest.h>

#include <cstdint>

using namespace paradyse;

TEST_CASE("shape: extents, strides and errors") {
  const Shape s{2, 3, 4};
  CHECK(s.rank() == 3);
  CHECK(s.numel() == 24);
  CHECK(s.row_major_strides() == Shape{12, 4, 1});
  CHECK(s.extent(-1) == 4);
  CHECK_THROWS_WITH_AS(s.extent(3), doctest::Contains("dim 3 is out of range"), Error);
  CHECK_THROWS_AS((Shape{2, -1}), Error);
  CHECK(s.to_string() == "[2, 3, 4]");
}

TEST_CASE("tensor storage is aligned, zeroed, tracked and returned") {
  MemoryTracker tracker;
  ScopedTracker scoped(tracker);
  {
    Tensor<float> t({3, 5});
    CHECK(reinterpret_cast<std::uintptr_t>(t.data()) % kAlignment == 0);
    for (float x : t.span()) CHECK(x == 0.0f);
    CHECK(tracker.in_use() == 64);  // 60 bytes rounded up to one cache line
    Tensor<double> moved = Tensor<double>({100});
    CHECK(tracker.in_use() == 64 + 832);
  }
  CHECK(tracker.in_use() == 0);
  CHECK(tracker.peak() == 64 + 832);
}

TEST_CASE("views: indexing, slices, reshape and strided copy") {
  Rng rng(7);
  Tensor<float> t = random_uniform<float>({4, 6, 5}, rng);
  auto v = t.view();
  CHECK(&v(2, 3, 1) == t.data() + 2 * 30 + 3 * 5 + 1);
  auto inner = v.slice(1, 2, 3);  // [4, 3, 5], not contiguous
  CHECK_FALSE(inner.is_contiguous());
  Tensor<float> copied({4, 3, 5});
  copy(TensorView<const float>(inner), copied.view());
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 3; ++j)
      for (int k = 0; k < 5; ++k) CHECK(copied(i, j, k) == t(i, j + 2, k));
  auto outer = v.slice(0, 1, 2);
  CHECK(outer.is_contiguous());
  CHECK(outer.reshape({2, 30})(1, 29) == t(2, 5, 4));
  CHECK_THROWS_WITH_AS(inner.reshape({60}), doctest::Contains("contiguous"), Error);
  CHECK_THROWS_WITH_AS(v.slice(1, 4, 3), doctest::Contains("slice [4, 7) of dim 1 is outside extent 6"), Error);
  CHECK_THROWS_AS(copy(TensorView<const float>(inner), t.view()), Error);
}

TEST_CASE("the generator is deterministic and roughly uniform") {
  Rng a(42), b(42), c(43);
  for (int i = 0; i < 10; ++i) CHECK(a.next_u64() == b.next_u64());
  CHECK(a.next_u64() != c.next_u64());
  Rng r(1);
  double sum = 0, sum_sq = 0;
  const int n = 100000;
  for (int i = 0; i < n; ++i) {
    const double x = r.normal();
    sum += x;
    sum_sq += x * x;
  }
  CHECK(std::abs(sum / n) < 0.02);
  CHECK(std::abs(sum_sq / n - 1.0) < 0.02);
}
