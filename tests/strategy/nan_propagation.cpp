// A NaN in one weight or one input activation reaches every output it feeds, on every strategy (issue 27: NaN in a
// loaded weight gave a finite first loss). Each strategy's attention and MLP sublayer on 2 and 3 thread ranks, over
// the standard and the packed-document cases of tests/strategy/harness.hpp:
//   - a NaN in one element of w_q, w_k or w_v (attention) or w_in / w_up (MLP) feeds every token's output through
//     one head or hidden unit: every output element on every rank is non-finite, and so are the input gradient and
//     a weight gradient;
//   - a NaN in one activation x[0, t, 1] feeds, in attention, the rows that see key t (causal order and documents:
//     the float64 reference's visibility) and in the MLP row t alone: those rows are non-finite on every strategy
//     (softmax's max subtraction, masked blocks and the online rescaling of partial results never turn NaN into a
//     number); every other row, where finite, matches the float64 reference of the clean input (it may turn NaN: a
//     GEMM multiplies a masked key's 0 probability by its NaN value, as the reference itself does).
#include "paradyse/strategy/strategies.hpp"

#include "strategy/harness.hpp"

#include <doctest/doctest.h>
#include <fmt/format.h>

#include <cmath>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

namespace paradyse::testing {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// One run's outputs gathered into global order: y, dx: [b, s, h]; whether any rank's weight gradient is non-finite.
struct GatheredRun {
  Tensor<float> y, dx;
  bool weight_gradient_nonfinite = false;
};

template <class Span>
bool any_nonfinite(const Span& values) {
  for (const auto v : values)
    if (!std::isfinite(double(v))) return true;
  return false;
}

template <class S>
GatheredRun run_sublayer(const SublayerCase& test, Sublayer which, const Problem& problem) {
  const LayerConfig& c = test.config;
  const int p = test.ranks;
  GatheredRun out{Tensor<float>(problem.x.shape()), Tensor<float>(problem.x.shape())};
  std::mutex mutex;
  run_ranks(p, [&](ThreadCommunicator& comm) {
    const int r = comm.rank();
    BufferPool pool;
    SublayerContext ctx(c, p, test.batch, test.length, pool);
    ctx.set_documents(test.documents);
    const LayerWeights weights = shard_of(problem.weights, c, p, r);
    LayerWeights grads(c, p);
    const Tensor<float> x = local_tokens(problem.x, ctx.sequence, r), dy = local_tokens(problem.dy, ctx.sequence, r);
    Tensor<float> y(x.shape()), dx(x.shape());
    const S strategy;
    require(strategy.supports(ctx));
    bool nonfinite = false;
    if (which == Sublayer::attention) {
      auto saved = strategy.attention_forward(comm, ctx, weights.attention, x.view(), y.view());
      strategy.attention_backward(comm, ctx, weights.attention, saved, dy.view(), dx.view(), grads.attention);
      nonfinite = any_nonfinite(grads.attention.packed.span());
    } else {
      auto saved = strategy.mlp_forward(comm, ctx, weights.mlp, x.view(), y.view());
      strategy.mlp_backward(comm, ctx, weights.mlp, saved, dy.view(), dx.view(), grads.mlp);
      nonfinite = any_nonfinite(grads.mlp.packed.span());
    }
    std::lock_guard lock(mutex);
    out.weight_gradient_nonfinite = out.weight_gradient_nonfinite || nonfinite;
    for (std::int64_t b = 0; b < test.batch; ++b)
      for (std::int64_t t = 0; t < ctx.sequence.local_length(r); ++t) {
        const std::int64_t position = ctx.sequence.position(r, t);
        for (std::int64_t h = 0; h < c.hidden; ++h) {
          out.y(b, position, h) = y(b, t, h);
          out.dx(b, position, h) = dx(b, t, h);
        }
      }
  });
  return out;
}

// Every standard and packed-document case on 2 and 3 ranks.
std::vector<SublayerCase> nan_cases() {
  std::vector<SublayerCase> cases;
  for (int p : {2, 3}) {
    for (SublayerCase& c : standard_cases(p)) cases.push_back(std::move(c));
    for (SublayerCase& c : packed_cases(p)) cases.push_back(std::move(c));
  }
  return cases;
}

// A NaN in one element (row 1, column 2) of each matrix in turn: everything downstream is non-finite.
template <class S>
void check_weight_nan(const SublayerCase& test, Sublayer which) {
  const LayerConfig& c = test.config;
  struct Target {
    const char* name;
    Tensor<double> GlobalLayerWeights<double>::*matrix;
  };
  std::vector<Target> targets;
  if (which == Sublayer::attention)
    targets = {{"w_q", &GlobalLayerWeights<double>::w_q}, {"w_k", &GlobalLayerWeights<double>::w_k},
               {"w_v", &GlobalLayerWeights<double>::w_v}};
  else {
    targets = {{"w_in", &GlobalLayerWeights<double>::w_in}};
    if (c.activation == Activation::swiglu) targets.push_back({"w_up", &GlobalLayerWeights<double>::w_up});
  }
  for (const Target& target : targets) {
    Problem problem = make_problem(c, test.batch, test.length, 7);
    (problem.weights.*target.matrix)(1, 2) = kNaN;
    const GatheredRun run = run_sublayer<S>(test, which, problem);
    INFO(S::name, " ", which == Sublayer::attention ? "attention" : "mlp", " ", test.name, ": NaN in ", target.name);
    std::int64_t finite = 0;
    for (const float v : run.y.span()) finite += std::isfinite(v) ? 1 : 0;
    CHECK_MESSAGE(finite == 0, finite, " of ", run.y.span().size(), " output elements are finite");
    CHECK(any_nonfinite(run.dx.span()));
    CHECK(run.weight_gradient_nonfinite);
  }
}

// A NaN in x[0, t, 1]: the rows that read it are non-finite, the others match the clean input's reference.
template <class S>
void check_activation_nan(const SublayerCase& test, Sublayer which) {
  const LayerConfig& c = test.config;
  const std::int64_t t = test.length / 2;
  Problem problem = make_problem(c, test.batch, test.length, 11);
  const Tensor<double> clean = which == Sublayer::attention
                                   ? ref::attention_forward(c, problem.weights, problem.x, test.documents)
                                   : ref::mlp_forward(c, problem.weights, problem.x);
  problem.x(0, t, 1) = kNaN;
  const GatheredRun run = run_sublayer<S>(test, which, problem);
  const ref::AttentionCore visibility{test.batch, test.length, c.heads, c.kv_heads, c.head_dim, c.causal,
                                      test.documents};
  INFO(S::name, " ", which == Sublayer::attention ? "attention" : "mlp", " ", test.name, ": NaN in x[0, ", t, ", 1]");
  for (std::int64_t b = 0; b < test.batch; ++b)
    for (std::int64_t i = 0; i < test.length; ++i) {
      const bool reads = b == 0 && (which == Sublayer::attention ? visibility.visible(i, t) : i == t);
      for (std::int64_t h = 0; h < c.hidden; ++h) {
        const double got = run.y(b, i, h), want = clean(b, i, h);
        if (reads) {
          if (std::isfinite(got)) {
            FAIL_CHECK(fmt::format("row [{}, {}] reads the NaN but y[{}, {}, {}] = {}", b, i, b, i, h, got));
            return;
          }
        } else if (std::isfinite(got) && !(std::abs(got - want) <= kFloat32.atol + kFloat32.rtol * std::abs(want))) {
          // A row that cannot read the NaN may still turn NaN (a GEMM multiplies the masked key's 0 probability by
          // its NaN value: 0 * NaN, as the reference does); when it is finite it is the clean input's value.
          FAIL_CHECK(fmt::format("row [{}, {}] cannot read the NaN but y[{}, {}, {}] = {}, want {}", b, i, b, i, h, got,
                                 want));
          return;
        }
      }
    }
  bool dx_row_t = false;  // the gradient of the NaN input itself
  for (std::int64_t h = 0; h < c.hidden; ++h) dx_row_t = dx_row_t || !std::isfinite(run.dx(0, t, h));
  CHECK(dx_row_t);
  CHECK(run.weight_gradient_nonfinite);
}

template <class S>
void check_nan_propagation() {
  for (const SublayerCase& test : nan_cases())
    for (const Sublayer which : {Sublayer::attention, Sublayer::mlp}) {
      check_weight_nan<S>(test, which);
      check_activation_nan<S>(test, which);
    }
}

}  // namespace
}  // namespace paradyse::testing

TEST_CASE("NaN propagation: MegatronTS, a NaN weight or activation reaches every output it feeds on 2 and 3 ranks") {
  paradyse::testing::check_nan_propagation<paradyse::MegatronTS<>>();
}
TEST_CASE("NaN propagation: UlyssesZ, a NaN weight or activation reaches every output it feeds on 2 and 3 ranks") {
  paradyse::testing::check_nan_propagation<paradyse::UlyssesZ<>>();
}
TEST_CASE("NaN propagation: MegatronCZ, a NaN weight or activation reaches every output it feeds on 2 and 3 ranks") {
  paradyse::testing::check_nan_propagation<paradyse::MegatronCZ<>>();
}
TEST_CASE("NaN propagation: METP, a NaN weight or activation reaches every output it feeds on 2 and 3 ranks") {
  paradyse::testing::check_nan_propagation<paradyse::METP<>>();
}
TEST_CASE("NaN propagation: ColossalZ, a NaN weight or activation reaches every output it feeds on 2 and 3 ranks") {
  paradyse::testing::check_nan_propagation<paradyse::ColossalZ<>>();
}
