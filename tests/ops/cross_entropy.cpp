// Tests of paradyse/ops/cpu/cross_entropy.hpp: loss and gradient against the float64 reference, ignore_index,
// in-place (dlogits aliasing logits), extreme logits, and the reference gradient against finite differences.
#include "paradyse/ops/cpu/cross_entropy.hpp"

#include "paradyse/core/rng.hpp"
#include "support/tolerance.hpp"
#include "ops/reference_layers.hpp"

#include <doctest/doctest.h>

#include <cmath>

using namespace paradyse;
using namespace paradyse::testing;

namespace {
void check_cross_entropy(std::int64_t rows, std::int64_t vocab, double magnitude, bool in_place, std::uint64_t seed) {
  CAPTURE(rows); CAPTURE(vocab); CAPTURE(magnitude); CAPTURE(in_place);
  Rng rng(seed);
  Tensor<float> logits = random_uniform<float>(Shape{rows, vocab}, rng, -magnitude, magnitude);
  Tensor<std::int32_t> targets(Shape{rows});
  std::vector<std::int32_t> target_list;
  for (std::int64_t i = 0; i < rows; ++i) {
    targets(i) = i % 5 == 3 ? ops::cpu::kIgnoreIndex : std::int32_t(rng.below(std::uint64_t(vocab)));
    target_list.push_back(targets(i));
  }
  const Vec logits64 = to_double(logits);
  const double grad_scale = 1.0 / 7.0;
  const ReferenceCrossEntropy want =
      reference_cross_entropy(logits64, target_list, rows, vocab, grad_scale, ops::cpu::kIgnoreIndex);
  Tensor<float> separate(Shape{rows, vocab});
  separate.fill(std::nanf(""));  // overwritten
  const TensorView<float> dlogits = in_place ? logits.view() : separate.view();
  const ops::cpu::CrossEntropyResult got =
      ops::cpu::cross_entropy_forward_backward(logits.view(), targets.view(), dlogits, float(grad_scale));
  CHECK(got.counted == want.counted);
  CHECK(got.loss_sum == doctest::Approx(want.loss_sum).epsilon(kFloat32.rtol));
  CHECK_CLOSE(to_double(dlogits), want.dlogits, kFloat32);
}
}  // namespace

TEST_CASE("cross-entropy loss and gradient match the float64 reference") {
  check_cross_entropy(13, 50, 3.0, false, 700);
  check_cross_entropy(10, 1000, 10.0, true, 701);
  check_cross_entropy(4, 1, 1.0, false, 702);
  check_cross_entropy(6, 33, 1e30, false, 703);  // extreme logits: the max is subtracted, nothing overflows
}

TEST_CASE("cross-entropy: a custom ignore_index and all rows ignored") {
  Tensor<float> logits(Shape{2, 3}), dlogits(Shape{2, 3});
  dlogits.fill(5.0f);
  Tensor<std::int32_t> targets(Shape{2});
  targets(0) = -1;
  targets(1) = -1;
  const auto r = ops::cpu::cross_entropy_forward_backward(logits.view(), targets.view(), dlogits.view(), 1.0f, -1);
  CHECK(r.counted == 0);
  CHECK(r.loss_sum == 0.0);
  for (float g : dlogits.span()) CHECK(g == 0.0f);
  targets(0) = 3;
  CHECK_THROWS_WITH_AS(ops::cpu::cross_entropy_forward_backward(logits.view(), targets.view(), dlogits.view(), 1.0f),
                       doctest::Contains("target 3"), Error);
}

TEST_CASE("cross-entropy reference gradient passes finite differences") {
  const std::int64_t rows = 4, vocab = 6;
  Rng rng(710);
  Vec logits(rows * vocab);
  rng.fill_uniform(std::span<double>(logits), -3, 3);
  const std::vector<std::int32_t> targets = {2, -100, 0, 5};
  const auto loss = [&] { return reference_cross_entropy(logits, targets, rows, vocab, 1.0, -100).loss_sum; };
  const Vec analytic = reference_cross_entropy(logits, targets, rows, vocab, 1.0, -100).dlogits;
  CHECK_CLOSE(analytic, finite_difference(logits, loss), kFiniteDifference);
}
