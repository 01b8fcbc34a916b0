// tests/moe/experts.cpp: SwiGLU experts over ragged blocks (empty blocks included) against the float64 expert of
// tests/moe/reference_moe.hpp: output, input gradient and each expert's weight gradients (accumulated).
#include "moe/reference_moe.hpp"
#include "support/tolerance.hpp"

#include "paradyse/core/rng.hpp"
#include "paradyse/moe/experts.hpp"
#include "paradyse/ops/backend.hpp"

#include <doctest/doctest.h>

#include <vector>

using namespace paradyse;
using namespace paradyse::testing;

TEST_CASE("experts_forward / experts_backward: one SwiGLU per ragged block, against the float64 expert") {
  const std::int64_t h = 6, f = 5;
  std::uint64_t seed = 31;
  for (const std::vector<std::int64_t>& blocks :
       {std::vector<std::int64_t>{3, 0, 5, 1}, std::vector<std::int64_t>{0, 0, 7}, std::vector<std::int64_t>{4},
        std::vector<std::int64_t>{0, 0}}) {
    Rng rng(seed++);
    const std::int64_t e_count = std::int64_t(blocks.size());
    std::vector<std::int64_t> offsets = {0};
    for (const std::int64_t b : blocks) offsets.push_back(offsets.back() + b);
    const std::int64_t rows = offsets.back();
    const Tensor<float> in = random_uniform<float>(Shape{e_count, 2 * f, h}, rng, -0.6, 0.6);
    const Tensor<float> out = random_uniform<float>(Shape{e_count, f, h}, rng, -0.6, 0.6);
    const Tensor<float> x = random_uniform<float>(Shape{rows, h}, rng), dy = random_uniform<float>(Shape{rows, h}, rng);
    Tensor<float> pre(Shape{rows, 2 * f}), y(Shape{rows, h}), dx(Shape{rows, h});
    Tensor<float> gin = random_uniform<float>(Shape{e_count, 2 * f, h}, rng);  // backward accumulates onto these
    Tensor<float> gout = random_uniform<float>(Shape{e_count, f, h}, rng);
    std::vector<double> want_gin(gin.span().begin(), gin.span().end()), want_gout(gout.span().begin(), gout.span().end());
    BufferPool pool;
    const ExpertBank<const float> bank{in.view(), out.view()};
    experts_forward<ops::Cpu>(bank, offsets, x.view(), pre.view(), y.view(), pool);
    experts_backward<ops::Cpu>(bank, offsets, x.view(), pre.view(), dy.view(), dx.view(), {gin.view(), gout.view()}, pool);

    const std::vector<double> din(in.span().begin(), in.span().end()), dout_w(out.span().begin(), out.span().end());
    std::vector<double> want_y(static_cast<std::size_t>(rows * h)), want_dx(static_cast<std::size_t>(rows * h), 0.0);
    for (std::int64_t e = 0; e < e_count; ++e)
      for (std::int64_t row = offsets[std::size_t(e)]; row < offsets[std::size_t(e + 1)]; ++row) {
        std::vector<double> xr(x.data() + row * h, x.data() + (row + 1) * h), dyr(dy.data() + row * h, dy.data() + (row + 1) * h);
        reference_detail::swiglu_expert(&din[std::size_t(e * 2 * f * h)], &dout_w[std::size_t(e * f * h)], f, h, xr.data(),
                                        &want_y[std::size_t(row * h)]);
        reference_detail::swiglu_expert_backward(&din[std::size_t(e * 2 * f * h)], &dout_w[std::size_t(e * f * h)], f, h,
                                                 xr.data(), dyr.data(), &want_gin[std::size_t(e * 2 * f * h)],
                                                 &want_gout[std::size_t(e * f * h)], &want_dx[std::size_t(row * h)]);
      }
    CHECK_CLOSE(y.span(), want_y, kFloat32);
    CHECK_CLOSE(dx.span(), want_dx, kFloat32);
    CHECK_CLOSE(gin.span(), want_gin, kFloat32);
    CHECK_CLOSE(gout.span(), want_gout, kFloat32);
  }
}

TEST_CASE("experts: mismatched bank, offsets and rows are Errors") {
  BufferPool pool;
  const Tensor<float> in(Shape{2, 8, 3}), out(Shape{2, 4, 3}), bad_out(Shape{2, 5, 3}), x(Shape{5, 3});
  Tensor<float> pre(Shape{5, 8}), y(Shape{5, 3});
  const std::vector<std::int64_t> offsets = {0, 2, 5}, short_offsets = {0, 5}, wrong_total = {0, 2, 4};
  CHECK_NOTHROW(experts_forward<ops::Cpu>({in.view(), out.view()}, offsets, x.view(), pre.view(), y.view(), pool));
  CHECK_THROWS_WITH_AS(experts_forward<ops::Cpu>({in.view(), bad_out.view()}, offsets, x.view(), pre.view(), y.view(), pool),
                       doctest::Contains("the bank must be"), Error);
  CHECK_THROWS_WITH_AS(experts_forward<ops::Cpu>({in.view(), out.view()}, short_offsets, x.view(), pre.view(), y.view(), pool),
                       doctest::Contains("2 block offsets for 2 experts"), Error);
  CHECK_THROWS_WITH_AS(experts_forward<ops::Cpu>({in.view(), out.view()}, wrong_total, x.view(), pre.view(), y.view(), pool),
                       doctest::Contains("[rows = 4, h = 3]"), Error);
}
