// Tests of paradyse/ops/cpu/convert.hpp: f32 <-> bf16 / f16 buffers equal the element conversions of
// core/dtype.hpp, round trips stay within the bf16 tolerance, strided views work.
#include "paradyse/ops/cpu/convert.hpp"

#include "paradyse/core/rng.hpp"
#include "support/tolerance.hpp"
#include "ops/reference.hpp"

#include <doctest/doctest.h>

using namespace paradyse;
using namespace paradyse::testing;

TEST_CASE("convert f32 -> bf16 -> f32 and f32 -> f16 -> f32") {
  Rng rng(900);
  Tensor<float> x = random_uniform<float>(Shape{7, 33}, rng, -100.0, 100.0);
  Tensor<bf16> b(x.shape());
  Tensor<f16> h(x.shape());
  ops::cpu::convert(x.view(), b.view());
  ops::cpu::convert(x.view(), h.view());
  for (std::int64_t i = 0; i < x.numel(); ++i) {
    CHECK(b.data()[i].bits == bf16(x.data()[i]).bits);
    CHECK(h.data()[i].bits == f16(x.data()[i]).bits);
  }
  Tensor<float> back(x.shape());
  ops::cpu::convert(b.view(), back.view());
  CHECK_CLOSE(to_double(back), to_double(x), kBfloat16);
  ops::cpu::convert(h.view(), back.view());
  CHECK_CLOSE(to_double(back), to_double(x), kBfloat16);
  Tensor<bf16> b2(x.shape());
  ops::cpu::convert(h.view(), b2.view());  // f16 -> bf16 through float
  for (std::int64_t i = 0; i < x.numel(); ++i) CHECK(b2.data()[i].bits == bf16(float(h.data()[i])).bits);
}

TEST_CASE("convert over strided views and shape mismatch") {
  Rng rng(901);
  Tensor<float> wide = random_uniform<float>(Shape{5, 10}, rng);
  const TensorView<const float> part = wide.view().slice(1, 3, 4);
  Tensor<bf16> store(Shape{5, 8});
  const TensorView<bf16> dst = store.view().slice(1, 2, 4);
  ops::cpu::convert(part, dst);
  for (std::int64_t i = 0; i < 5; ++i)
    for (std::int64_t j = 0; j < 4; ++j) CHECK(dst(i, j).bits == bf16(part(i, j)).bits);
  CHECK(store(0, 0).bits == 0);  // outside the slice: untouched
  Tensor<float> wrong(Shape{5, 3});
  CHECK_THROWS_AS(ops::cpu::convert(wrong.view(), dst), Error);
}
