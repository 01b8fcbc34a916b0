// Tests of paradyse/ops/backend.hpp: ops::Cpu forwards every op to ops::cpu (same results, same contracts).
#include "paradyse/ops/backend.hpp"

#include "paradyse/core/rng.hpp"
#include "support/tolerance.hpp"
#include "ops/reference.hpp"

#include <doctest/doctest.h>

using namespace paradyse;
using namespace paradyse::testing;

namespace {
// A strategy-like function written once over the backend policy.
template <class Backend>
void two_matmuls(TensorView<const float> x, TensorView<const float> w1, TensorView<const float> w2,
                 TensorView<float> hidden, TensorView<float> y) {
  Backend::matmul(x, ops::Transpose::no, w1, ops::Transpose::yes, hidden);
  Backend::matmul(hidden, ops::Transpose::no, w2, ops::Transpose::no, y);
}
}  // namespace

TEST_CASE("ops::Cpu is a backend policy over the CPU kernels") {
  static_assert(ops::Cpu::name == "cpu");
  Rng rng(5);
  Tensor<float> x = random_uniform<float>(Shape{7, 5}, rng), w1 = random_uniform<float>(Shape{6, 5}, rng);
  Tensor<float> w2 = random_uniform<float>(Shape{6, 4}, rng), hidden(Shape{7, 6}), y(Shape{7, 4});
  two_matmuls<ops::Cpu>(x.view(), w1.view(), w2.view(), hidden.view(), y.view());
  Vec h64(7 * 6), y64(7 * 4);
  reference_gemm(false, true, 7, 6, 5, 1.0, to_double(x), 5, to_double(w1), 5, 0.0, h64, 6);
  reference_gemm(false, false, 7, 4, 6, 1.0, h64, 6, to_double(w2), 4, 0.0, y64, 4);
  CHECK_CLOSE(to_double(y), y64, kFloat32);

  // Attention through the policy equals the direct call, bit for bit.
  Tensor<float> q = random_uniform<float>(Shape{1, 9, 2, 8}, rng), k = random_uniform<float>(Shape{1, 9, 1, 8}, rng);
  Tensor<float> v = random_uniform<float>(Shape{1, 9, 1, 8}, rng);
  Tensor<float> out1(q.shape()), out2(q.shape()), lse1(Shape{1, 2, 9}), lse2(Shape{1, 2, 9});
  ops::AttentionMask mask;
  mask.causal = true;
  ops::Cpu::attention_forward(q.view(), k.view(), v.view(), mask, out1.view(), lse1.view());
  ops::cpu::attention_forward(q.view(), k.view(), v.view(), mask, out2.view(), lse2.view());
  CHECK(std::equal(out1.span().begin(), out1.span().end(), out2.span().begin()));
  CHECK(std::equal(lse1.span().begin(), lse1.span().end(), lse2.span().begin()));
}

TEST_CASE("ops::Cpu forwards the layer ops bit for bit") {
  Rng rng(6);
  Tensor<float> x = random_uniform<float>(Shape{3, 16}, rng), gamma = random_uniform<float>(Shape{16}, rng);
  Tensor<float> beta = random_uniform<float>(Shape{16}, rng);
  Tensor<float> y1(x.shape()), y2(x.shape()), mean(Shape{3}), rstd(Shape{3});
  const auto same = [](const Tensor<float>& a, const Tensor<float>& b) {
    return std::equal(a.span().begin(), a.span().end(), b.span().begin());
  };
  ops::Cpu::layer_norm_forward(x.view(), gamma.view(), beta.view(), 1e-5f, y1.view(), mean.view(), rstd.view());
  ops::cpu::layer_norm_forward(x.view(), gamma.view(), beta.view(), 1e-5f, y2.view(), mean.view(), rstd.view());
  CHECK(same(y1, y2));
  ops::Cpu::rms_norm_forward(x.view(), gamma.view(), 1e-5f, y1.view(), rstd.view());
  ops::cpu::rms_norm_forward(x.view(), gamma.view(), 1e-5f, y2.view(), rstd.view());
  CHECK(same(y1, y2));
  ops::Cpu::gelu_forward(x.view(), y1.view());
  ops::cpu::gelu_forward(x.view(), y2.view());
  CHECK(same(y1, y2));
  ops::Cpu::swiglu_forward(x.view(), y1.view(), y1.view());  // up = the gelu output, in place
  ops::cpu::swiglu_forward(x.view(), y2.view(), y2.view());
  CHECK(same(y1, y2));
  Tensor<float> q = random_uniform<float>(Shape{1, 3, 2, 8}, rng), r1(q.shape()), r2(q.shape());
  ops::Cpu::rope_forward(q.view(), r1.view(), 5);
  ops::cpu::rope_forward(q.view(), r2.view(), 5);
  CHECK(same(r1, r2));
  Tensor<bf16> b(x.shape());
  ops::Cpu::convert(TensorView<const float>(x.view()), b.view());
  CHECK(b.data()[5].bits == bf16(x.data()[5]).bits);
}

