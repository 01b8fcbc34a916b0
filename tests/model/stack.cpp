// The stack with per-layer, per-sublayer strategy plans against the float64 reference stack: every mix over a
// 2-layer stack (or a seeded sample of them when there are many) gives the output, the input gradient and the
// gradient of every shard of every layer that a single rank computes. So mixing strategies needs no
// redistribution, and training with any mix is training the same model.
#include "paradyse/model/stack.hpp"

#include "strategy/harness.hpp"

#include <doctest/doctest.h>

#include <set>

namespace {

using namespace paradyse;
using namespace paradyse::testing;
using Strategies = AllStrategies<>;

struct StackProblem {
  LayerConfig config;
  std::vector<GlobalLayerWeights<double>> weights;
  Tensor<double> x, dz;
};

StackProblem make_stack_problem(const SublayerCase& test, int layers) {
  StackProblem problem{test.config, {}, {}, {}};
  for (int l = 0; l < layers; ++l) {
    Problem one = make_problem(test.config, test.batch, test.length, 100 + std::uint64_t(l));
    if (l == 0) {
      problem.x = std::move(one.x);
      problem.dz = std::move(one.dy);
    }
    problem.weights.push_back(std::move(one.weights));
  }
  return problem;
}

// Runs every plan on p ranks (one stack per rank, reused across plans) and compares each with the reference.
void check_plans(const SublayerCase& test, const std::vector<StackPlan>& plans) {
  const LayerConfig& c = test.config;
  const int layers = int(plans.front().size());
  const StackProblem problem = make_stack_problem(test, layers);
  std::vector<GlobalLayerWeights<double>> dw;
  for (int l = 0; l < layers; ++l) dw.emplace_back(c);
  const Tensor<double> z_ref = ref::stack_forward(c, problem.weights, problem.x);
  const Tensor<double> dx_ref = ref::stack_backward(c, problem.weights, problem.x, problem.dz, dw);
  Findings findings;
  const int p = test.ranks;
  run_ranks(p, [&](ThreadCommunicator& comm) {
    const int r = comm.rank();
    BufferPool pool;
    std::vector<LayerWeights> shards;
    for (int l = 0; l < layers; ++l) shards.push_back(shard_of(problem.weights[std::size_t(l)], c, p, r));
    TransformerStack<Strategies> stack(c, std::move(shards), p);
    const SequenceLayout layout(test.length, p, c.zigzag);
    const Tensor<float> x = local_tokens(problem.x, layout, r), dz = local_tokens(problem.dz, layout, r);
    std::vector<LayerWeights> want;
    for (int l = 0; l < layers; ++l) want.push_back(shard_of(dw[std::size_t(l)], c, p, r));
    for (const StackPlan& plan : plans) {
      std::string name;
      for (const SublayerChoice& choice : plan)
        name += fmt::format("[{} | {}] ", Strategies::name(choice.attention), Strategies::name(choice.mlp));
      const std::string where = fmt::format("plan {}rank {}", name, r);
      Tensor<float> z(x.shape()), dx(x.shape());
      stack.zero_gradients();
      stack.forward(comm, pool, plan, test.length, x.view(), z.view());
      stack.backward(comm, pool, dz.view(), dx.view());
      findings.compare(z, z_ref, layout, r, where + " output");
      findings.compare(dx, dx_ref, layout, r, where + " input gradient");
      for (int l = 0; l < layers; ++l) {
        const LayerWeights& got = stack.gradients()[std::size_t(l)];
        const LayerWeights& expected = want[std::size_t(l)];
        findings.compare(got.attention.packed.span(), expected.attention.packed.span(), fmt::format("{} layer {} attention gradient", where, l));
        findings.compare(got.mlp.packed.span(), expected.mlp.packed.span(), fmt::format("{} layer {} mlp gradient", where, l));
        findings.compare(got.norms.packed.span(), expected.norms.packed.span(), fmt::format("{} layer {} norm gradients", where, l));
      }
    }
  });
  findings.check_all(fmt::format("stack {} ({} plans)", test.name, plans.size()));
}

// Every mix of strategies over `layers` layers x 2 sublayers, or a seeded sample of `limit` of them (always
// including the uniform plans) when there are more.
std::vector<StackPlan> mixes(int layers, std::size_t limit, std::uint64_t seed) {
  const std::size_t n = Strategies::count, slots = 2 * std::size_t(layers);
  std::size_t total = 1;
  for (std::size_t i = 0; i < slots; ++i) total *= n;
  auto decode = [&](std::size_t code) {
    StackPlan plan(static_cast<std::size_t>(layers));
    for (std::size_t i = 0; i < slots; ++i, code /= n) (i % 2 ? plan[i / 2].mlp : plan[i / 2].attention) = code % n;
    return plan;
  };
  std::vector<StackPlan> plans;
  if (total <= limit) {
    for (std::size_t code = 0; code < total; ++code) plans.push_back(decode(code));
    return plans;
  }
  std::set<std::size_t> chosen;
  for (std::size_t s = 0; s < n; ++s) {  // uniform plans
    std::size_t code = 0;
    for (std::size_t i = 0; i < slots; ++i) code = code * n + s;
    chosen.insert(code);
  }
  Rng rng(seed);
  while (chosen.size() < limit) chosen.insert(std::size_t(rng.below(total)));
  for (std::size_t code : chosen) plans.push_back(decode(code));
  return plans;
}

}  // namespace

TEST_CASE("stack: every strategy mix over 2 layers matches the float64 reference (no redistribution needed)") {
  for (int p : {2, 3, 4}) {
    const auto cases = standard_cases(p);
    for (std::size_t i = 0; i < cases.size(); ++i) check_plans(cases[i], mixes(2, 40, 7 + std::uint64_t(i)));
  }
}

TEST_CASE("stack: plans are checked before running") {
  const LayerConfig c = small_config(4, 4, 16);
  run_ranks(2, [&](ThreadCommunicator& comm) {
    BufferPool pool;
    TransformerStack<Strategies> stack(c, 2, 2, comm.rank(), 3);
    Tensor<float> x(Shape{1, 4, c.hidden}), z(x.shape());
    CHECK_THROWS_WITH_AS(stack.forward(comm, pool, StackPlan(3), 8, x.view(), z.view()),
                         doctest::Contains("plan has 3 layers, the stack has 2"), Error);
    CHECK_THROWS_WITH_AS(stack.forward(comm, pool, StackPlan(2, SublayerChoice{0, 9}), 8, x.view(), z.view()),
                         doctest::Contains("strategy index 9 is out of range"), Error);
    CHECK_THROWS_WITH_AS(uniform_plan<Strategies>(2, "Nope"), doctest::Contains("no strategy named 'Nope'"), Error);
    CHECK_THROWS_AS(stack.backward(comm, pool, x.view(), z.view()), Error);
  });
}

TEST_CASE("stack: gradients accumulate over steps and plans may change between steps") {
  // Two steps with different plans accumulate the sum of both steps' gradients (the same model each time).
  const SublayerCase test = standard_cases(3)[2];
  const LayerConfig& c = test.config;
  const StackProblem problem = make_stack_problem(test, 2);
  std::vector<GlobalLayerWeights<double>> dw;
  dw.emplace_back(c);
  dw.emplace_back(c);
  ref::stack_backward(c, problem.weights, problem.x, problem.dz, dw);
  Findings findings;
  run_ranks(3, [&](ThreadCommunicator& comm) {
    const int r = comm.rank();
    BufferPool pool;
    std::vector<LayerWeights> shards;
    for (int l = 0; l < 2; ++l) shards.push_back(shard_of(problem.weights[std::size_t(l)], c, 3, r));
    TransformerStack<Strategies> stack(c, std::move(shards), 3);
    const SequenceLayout layout(test.length, 3, c.zigzag);
    const Tensor<float> x = local_tokens(problem.x, layout, r), dz = local_tokens(problem.dz, layout, r);
    Tensor<float> z(x.shape()), dx(x.shape());
    const std::size_t last = Strategies::count - 1;
    for (const StackPlan& plan : {StackPlan{{0, 0}, {0, 0}}, StackPlan{{last, 0}, {0, last}}}) {
      stack.forward(comm, pool, plan, test.length, x.view(), z.view());
      stack.backward(comm, pool, dz.view(), dx.view());
    }
    for (int l = 0; l < 2; ++l) {
      const LayerWeights want = shard_of(dw[std::size_t(l)], c, 3, r);
      std::vector<float> twice(want.attention.packed.span().begin(), want.attention.packed.span().end());
      for (float& v : twice) v *= 2.0f;
      findings.compare(stack.gradients()[std::size_t(l)].attention.packed.span(), twice, fmt::format("rank {} layer {} twice", r, l));
    }
  });
  findings.check_all("two accumulated steps");
}

TEST_CASE("stack: switching strategies between layers or sublayers moves no extra bytes") {
  // For every pair of strategies (A, B): the bytes each rank sends for the mixed plans [A A | B B] and [A B | B A]
  // equal the mean of the uniform plans [A A | A A] and [B B | B B], exactly: nothing is redistributed.
  const SublayerCase test = standard_cases(4)[1];  // causal, RoPE, zigzag, b = 2
  const LayerConfig& c = test.config;
  const int p = 4;
  std::vector<std::vector<std::uint64_t>> bytes;  // [plan][rank]
  std::vector<StackPlan> plans;
  for (std::size_t a = 0; a < Strategies::count; ++a) plans.push_back(StackPlan{{a, a}, {a, a}});
  for (std::size_t a = 0; a < Strategies::count; ++a)
    for (std::size_t b = a + 1; b < Strategies::count; ++b) {
      plans.push_back(StackPlan{{a, a}, {b, b}});
      plans.push_back(StackPlan{{a, b}, {b, a}});
    }
  bytes.assign(plans.size(), std::vector<std::uint64_t>(static_cast<std::size_t>(p)));
  run_ranks(p, [&](ThreadCommunicator& comm) {
    const int r = comm.rank();
    BufferPool pool;
    TransformerStack<Strategies> stack(c, 2, p, r, 11);
    const SequenceLayout layout(test.length, p, c.zigzag);
    Rng rng{std::uint64_t(r)};
    const Tensor<float> x = random_uniform<float>(Shape{test.batch, layout.local_length(r), c.hidden}, rng);
    Tensor<float> z(x.shape()), dx(x.shape());
    for (std::size_t i = 0; i < plans.size(); ++i) {
      comm.reset_stats();
      stack.forward(comm, pool, plans[i], test.length, x.view(), z.view());
      stack.backward(comm, pool, x.view(), dx.view());
      bytes[i][std::size_t(r)] = comm.stats().bytes_sent;
    }
  });
  std::size_t i = Strategies::count;
  for (std::size_t a = 0; a < Strategies::count; ++a)
    for (std::size_t b = a + 1; b < Strategies::count; ++b, i += 2)
      for (int r = 0; r < p; ++r) {
        CAPTURE(Strategies::name(a));
        CAPTURE(Strategies::name(b));
        CAPTURE(r);
        const std::uint64_t uniform_sum = bytes[a][std::size_t(r)] + bytes[b][std::size_t(r)];
        CHECK(2 * bytes[i][std::size_t(r)] == uniform_sum);
        CHECK(2 * bytes[i + 1][std::size_t(r)] == uniform_sum);
      }
}
