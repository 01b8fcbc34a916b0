// The float64 reference layer checked against central finite differences: every input and weight gradient of the
// attention and MLP sublayers, the norms and the whole layer, over MHA/GQA, causal or not, RoPE, GELU/SwiGLU,
// LayerNorm/RMSNorm.
#include "model/reference_transformer.hpp"
#include "support/tolerance.hpp"

#include "paradyse/core/rng.hpp"

#include <doctest/doctest.h>

#include <functional>
#include <vector>

namespace {

using namespace paradyse;
using testing::ref::Matrix;

// loss = sum(y * g) for a fixed random g, so dL/dy = g.
double weighted_sum(const Matrix& y, const Matrix& g) {
  double sum = 0.0;
  for (std::int64_t i = 0; i < y.numel(); ++i) sum += y.span()[std::size_t(i)] * g.span()[std::size_t(i)];
  return sum;
}

// Central differences of `loss` over every element of `param` against `analytic`.
void check_by_finite_differences(Matrix& param, const Matrix& analytic, const std::function<double()>& loss,
                                 const char* name) {
  INFO("parameter ", name);
  REQUIRE(param.numel() == analytic.numel());
  const double step = 1e-6;
  std::vector<double> numeric(std::size_t(param.numel()));
  for (std::int64_t i = 0; i < param.numel(); ++i) {
    double& p = param.span()[std::size_t(i)];
    const double saved = p;
    p = saved + step;
    const double up = loss();
    p = saved - step;
    const double down = loss();
    p = saved;
    numeric[std::size_t(i)] = (up - down) / (2.0 * step);
  }
  CHECK_CLOSE(analytic.span(), numeric, testing::kFiniteDifference);
}

LayerConfig tiny(std::int64_t heads, std::int64_t kv_heads) {
  LayerConfig c;
  c.hidden = 6;
  c.heads = heads;
  c.kv_heads = kv_heads;
  c.head_dim = 4;
  c.ffn = 5;
  return c;
}

// Random global weights with non-trivial norm parameters.
GlobalLayerWeights<double> random_weights(const LayerConfig& c, Rng& rng) {
  GlobalLayerWeights<double> w(c);
  for (Matrix* m : {&w.w_q, &w.w_k, &w.w_v, &w.w_proj, &w.w_in, &w.w_up, &w.w_out}) rng.fill_uniform(m->span(), -0.5, 0.5);
  for (Matrix* m : {&w.norm1_gamma, &w.norm2_gamma}) rng.fill_uniform(m->span(), 0.5, 1.5);
  for (Matrix* m : {&w.norm1_beta, &w.norm2_beta}) rng.fill_uniform(m->span(), -0.5, 0.5);
  return w;
}

struct Case {
  const char* name;
  LayerConfig config;
};

std::vector<Case> cases() {
  std::vector<Case> all;
  LayerConfig mha = tiny(2, 2);
  all.push_back({"MHA", mha});
  LayerConfig causal_rope = tiny(2, 2);
  causal_rope.causal = true;
  causal_rope.rope = true;
  causal_rope.activation = Activation::swiglu;
  causal_rope.norm = NormKind::rms_norm;
  all.push_back({"MHA causal RoPE SwiGLU RMSNorm", causal_rope});
  LayerConfig gqa = tiny(4, 2);
  gqa.head_dim = 2;
  gqa.causal = true;
  all.push_back({"GQA causal", gqa});
  LayerConfig mqa = tiny(3, 1);
  mqa.head_dim = 2;
  mqa.rope = true;
  mqa.activation = Activation::swiglu;
  all.push_back({"MQA RoPE SwiGLU", mqa});
  return all;
}

}  // namespace

TEST_CASE("reference attention sublayer: gradients match finite differences") {
  for (const Case& test : cases()) {
    CAPTURE(test.name);
    const LayerConfig& c = test.config;
    Rng rng(11);
    GlobalLayerWeights<double> w = random_weights(c, rng);
    Matrix x = random_uniform<double>(Shape{2, 3, c.hidden}, rng);
    const Matrix g = random_uniform<double>(x.shape(), rng);
    GlobalLayerWeights<double> dw(c);
    const Matrix dx = testing::ref::attention_backward(c, w, x, g, dw);
    auto loss = [&] { return weighted_sum(testing::ref::attention_forward(c, w, x), g); };
    check_by_finite_differences(x, dx, loss, "x");
    check_by_finite_differences(w.w_q, dw.w_q, loss, "w_q");
    check_by_finite_differences(w.w_k, dw.w_k, loss, "w_k");
    check_by_finite_differences(w.w_v, dw.w_v, loss, "w_v");
    check_by_finite_differences(w.w_proj, dw.w_proj, loss, "w_proj");
  }
}

TEST_CASE("reference MLP sublayer: gradients match finite differences") {
  for (const Case& test : cases()) {
    CAPTURE(test.name);
    const LayerConfig& c = test.config;
    Rng rng(12);
    GlobalLayerWeights<double> w = random_weights(c, rng);
    Matrix x = random_uniform<double>(Shape{2, 3, c.hidden}, rng);
    const Matrix g = random_uniform<double>(x.shape(), rng);
    GlobalLayerWeights<double> dw(c);
    const Matrix dx = testing::ref::mlp_backward(c, w, x, g, dw);
    auto loss = [&] { return weighted_sum(testing::ref::mlp_forward(c, w, x), g); };
    check_by_finite_differences(x, dx, loss, "x");
    check_by_finite_differences(w.w_in, dw.w_in, loss, "w_in");
    if (c.activation == Activation::swiglu) check_by_finite_differences(w.w_up, dw.w_up, loss, "w_up");
    check_by_finite_differences(w.w_out, dw.w_out, loss, "w_out");
  }
}

TEST_CASE("reference layer and stack: every gradient matches finite differences") {
  for (const Case& test : cases()) {
    CAPTURE(test.name);
    const LayerConfig& c = test.config;
    Rng rng(13);
    std::vector<GlobalLayerWeights<double>> w;
    w.push_back(random_weights(c, rng));
    w.push_back(random_weights(c, rng));
    Matrix x = random_uniform<double>(Shape{1, 4, c.hidden}, rng);
    const Matrix g = random_uniform<double>(x.shape(), rng);
    std::vector<GlobalLayerWeights<double>> dw;
    dw.emplace_back(c);
    dw.emplace_back(c);
    const Matrix dx = testing::ref::stack_backward(c, w, x, g, dw);
    auto loss = [&] { return weighted_sum(testing::ref::stack_forward(c, w, x), g); };
    check_by_finite_differences(x, dx, loss, "x");
    for (std::size_t l = 0; l < w.size(); ++l) {
      CAPTURE(l);
      check_by_finite_differences(w[l].w_q, dw[l].w_q, loss, "w_q");
      check_by_finite_differences(w[l].w_k, dw[l].w_k, loss, "w_k");
      check_by_finite_differences(w[l].w_v, dw[l].w_v, loss, "w_v");
      check_by_finite_differences(w[l].w_proj, dw[l].w_proj, loss, "w_proj");
      check_by_finite_differences(w[l].w_in, dw[l].w_in, loss, "w_in");
      if (c.activation == Activation::swiglu) check_by_finite_differences(w[l].w_up, dw[l].w_up, loss, "w_up");
      check_by_finite_differences(w[l].w_out, dw[l].w_out, loss, "w_out");
      check_by_finite_differences(w[l].norm1_gamma, dw[l].norm1_gamma, loss, "norm1_gamma");
      check_by_finite_differences(w[l].norm2_gamma, dw[l].norm2_gamma, loss, "norm2_gamma");
      if (c.norm == NormKind::layer_norm) {
        check_by_finite_differences(w[l].norm1_beta, dw[l].norm1_beta, loss, "norm1_beta");
        check_by_finite_differences(w[l].norm2_beta, dw[l].norm2_beta, loss, "norm2_beta");
      }
    }
  }
}

TEST_CASE("reference attention: causal masking hides the future, GQA shares kv heads") {
  // Changing the last token changes no earlier output under a causal mask, and does change them without it.
  LayerConfig c = tiny(4, 2);
  c.head_dim = 2;
  Rng rng(14);
  const GlobalLayerWeights<double> w = random_weights(c, rng);
  Matrix x = random_uniform<double>(Shape{1, 4, c.hidden}, rng);
  for (bool causal : {true, false}) {
    c.causal = causal;
    const Matrix before = testing::ref::attention_forward(c, w, x);
    Matrix changed = Matrix::copy_of(x.view());
    for (std::int64_t i = 0; i < c.hidden; ++i) changed(0, 3, i) += 1.0;
    const Matrix after = testing::ref::attention_forward(c, w, changed);
    double earlier_change = 0.0;
    for (std::int64_t t = 0; t < 3; ++t)
      for (std::int64_t i = 0; i < c.hidden; ++i) earlier_change = std::max(earlier_change, std::abs(after(0, t, i) - before(0, t, i)));
    if (causal) CHECK(earlier_change == 0.0);
    else CHECK(earlier_change > 1e-6);
  }
}
