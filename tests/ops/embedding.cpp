// Tests of paradyse/ops/cpu/embedding.hpp: lookup and accumulating scatter-add backward (repeated tokens) against
// the float64 reference, out-of-vocabulary tokens rejected.
#include "paradyse/ops/cpu/embedding.hpp"

#include "paradyse/core/rng.hpp"
#include "support/tolerance.hpp"
#include "ops/reference.hpp"

#include <doctest/doctest.h>

using namespace paradyse;
using namespace paradyse::testing;

TEST_CASE("embedding forward gathers rows and backward scatter-adds them") {
  Rng rng(600);
  const std::int64_t vocab = 11, h = 19, b = 3, s = 8;
  Tensor<float> table = random_uniform<float>(Shape{vocab, h}, rng);
  Tensor<std::int32_t> tokens(Shape{b, s});
  for (auto& t : tokens.span()) t = std::int32_t(rng.below(4));  // few distinct ids: many repeats
  tokens(2, 7) = std::int32_t(vocab - 1);
  Tensor<float> out(Shape{b, s, h});
  ops::cpu::embedding_forward(tokens.view(), table.view(), out.view());
  const Vec table64 = to_double(table);
  Vec want(std::size_t(b * s * h));
  for (std::int64_t i = 0; i < b * s; ++i)
    for (std::int64_t c = 0; c < h; ++c) want[i * h + c] = table64[tokens.data()[i] * h + c];
  CHECK_CLOSE(to_double(out), want, kFloat32);

  Tensor<float> dout = random_uniform<float>(out.shape(), rng), dtable = random_uniform<float>(table.shape(), rng);
  Vec want_dtable = to_double(dtable);
  const Vec dout64 = to_double(dout);
  for (std::int64_t i = 0; i < b * s; ++i)
    for (std::int64_t c = 0; c < h; ++c) want_dtable[tokens.data()[i] * h + c] += dout64[i * h + c];
  ops::cpu::embedding_backward(tokens.view(), dout.view(), dtable.view());
  CHECK_CLOSE(to_double(dtable), want_dtable, kFloat32);
}

TEST_CASE("embedding rejects tokens outside the vocabulary and bad shapes") {
  Tensor<float> table(Shape{5, 4}), out(Shape{2, 4});
  Tensor<std::int32_t> tokens(Shape{2});
  tokens(1) = 5;
  CHECK_THROWS_WITH_AS(ops::cpu::embedding_forward(tokens.view(), table.view(), out.view()),
                       doctest::Contains("token 5"), Error);
  tokens(1) = -1;
  CHECK_THROWS_AS(ops::cpu::embedding_backward(tokens.view(), out.view(), table.view()), Error);
  tokens(1) = 0;
  Tensor<float> wrong(Shape{2, 3});
  CHECK_THROWS_AS(ops::cpu::embedding_forward(tokens.view(), table.view(), wrong.view()), Error);
}
