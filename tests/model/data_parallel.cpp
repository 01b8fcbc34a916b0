// Data parallelism on thread ranks: ZeRO-0, -1 and -2 over dp replicas in {1, 2, 3, 4} and an uneven flat vector
// leave every replica with the parameters of a float64 AdamW run on the averaged gradient (or the summed one, with
// set_reduce_op(ReduceOp::sum)), the stages agree with each other, and ZeRO-1/2 hold 1/dp of the optimizer state.
#include "paradyse/model/data_parallel.hpp"

#include "paradyse/comm/threads.hpp"
#include "paradyse/core/rng.hpp"
#include "support/tolerance.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <vector>

using namespace paradyse;
using namespace paradyse::testing;

namespace {

constexpr std::int64_t kElements = 37;  // not divisible by 2, 3 or 4
constexpr int kSteps = 3;

// Float64 AdamW, the update of ops/cpu/adamw.hpp.
void reference_adamw(std::vector<double>& p, const std::vector<double>& g, std::vector<double>& m, std::vector<double>& v,
                     const ops::AdamWConfig& c, int step) {
  const double c1 = 1.0 - std::pow(double(c.beta1), step), c2 = 1.0 - std::pow(double(c.beta2), step);
  for (std::size_t i = 0; i < p.size(); ++i) {
    m[i] = c.beta1 * m[i] + (1.0 - c.beta1) * g[i];
    v[i] = c.beta2 * v[i] + (1.0 - c.beta2) * g[i] * g[i];
    p[i] -= c.learning_rate * ((m[i] / c1) / (std::sqrt(v[i] / c2) + c.epsilon) + c.weight_decay * p[i]);
  }
}

}  // namespace

TEST_CASE("DataParallelOptimizer: ZeRO-0/1/2 give every replica the float64 AdamW result on the averaged gradient") {
  const ops::AdamWConfig config{.learning_rate = 0.05f, .weight_decay = 0.1f};
  for (ReduceOp op : {ReduceOp::avg, ReduceOp::sum})
  for (int dp : {1, 2, 3, 4}) {
    Rng rng(std::uint64_t(7 + dp));
    const Tensor<double> initial = random_uniform<double>(Shape{kElements}, rng);
    std::vector<Tensor<double>> grads;  // [step][replica] flattened
    for (int k = 0; k < kSteps * dp; ++k) grads.push_back(random_uniform<double>(Shape{kElements}, rng));

    // The reference: the mean (or the sum) of the replicas' gradients, float64.
    std::vector<double> p(initial.data(), initial.data() + kElements), m(static_cast<std::size_t>(kElements)),
        v(static_cast<std::size_t>(kElements));
    for (int step = 1; step <= kSteps; ++step) {
      std::vector<double> mean(static_cast<std::size_t>(kElements), 0.0);
      for (int r = 0; r < dp; ++r)
        for (std::int64_t i = 0; i < kElements; ++i)
          mean[std::size_t(i)] += double(float(grads[std::size_t((step - 1) * dp + r)].data()[i])) / (op == ReduceOp::avg ? dp : 1);
      reference_adamw(p, mean, m, v, config, step);
    }

    std::vector<std::vector<std::vector<float>>> results(3, std::vector<std::vector<float>>(static_cast<std::size_t>(dp)));
    for (ZeroStage stage : {ZeroStage::zero, ZeroStage::one, ZeroStage::two}) {
      INFO("dp=", dp, " ", name_of(stage), " ", name_of(op));
      std::vector<std::int64_t> state_bytes(static_cast<std::size_t>(dp));
      run_ranks(dp, [&](ThreadCommunicator& comm) {
        const int r = comm.rank();
        DataParallelOptimizer<> optimizer(stage, dp, r, kElements, config);
        optimizer.set_reduce_op(op);
        std::vector<float> params(initial.data(), initial.data() + kElements);
        for (int step = 1; step <= kSteps; ++step) {
          const Tensor<double>& g = grads[std::size_t((step - 1) * dp + r)];
          std::vector<float> local(g.data(), g.data() + kElements);
          optimizer.step(comm, std::span<float>(params), std::span<float>(local), step);
        }
        results[std::size_t(stage)][std::size_t(r)] = params;
        state_bytes[std::size_t(r)] = optimizer.state_bytes();
      });
      for (int r = 0; r < dp; ++r) {
        CHECK_CLOSE(results[std::size_t(stage)][std::size_t(r)], p, kFloat32);
        CHECK(results[std::size_t(stage)][std::size_t(r)] == results[std::size_t(stage)][0]);  // replicas agree bitwise
        const std::int64_t owned = stage == ZeroStage::zero ? kElements : chunk_range(kElements, dp, r).length;
        CHECK(state_bytes[std::size_t(r)] == 2 * owned * 4);
      }
    }
    CHECK(results[1][0] == results[0][0]);  // the same reductions, the same update per element
    CHECK(results[2][0] == results[0][0]);
  }
}

TEST_CASE("DataParallelOptimizer: bad arguments are clear errors") {
  CHECK_THROWS_WITH_AS(DataParallelOptimizer<>(ZeroStage::one, 2, 2, 10, {}), doctest::Contains("rank 2 is outside 0..1"), Error);
  CHECK_THROWS_WITH_AS(DataParallelOptimizer<>(ZeroStage::one, 0, 0, 10, {}), doctest::Contains("replicas = 0"), Error);
  CHECK_THROWS_WITH_AS(DataParallelOptimizer<>(ZeroStage::one, 1, 0, 10, {}).set_reduce_op(ReduceOp::max),
                       doctest::Contains("gradients combine by avg or sum"), Error);
  run_ranks(1, [&](ThreadCommunicator& comm) {
    DataParallelOptimizer<> optimizer(ZeroStage::two, 1, 0, 10, {});
    std::vector<float> params(9), grads(10);
    CHECK_THROWS_WITH_AS(optimizer.step(comm, std::span<float>(params), std::span<float>(grads), 1),
                         doctest::Contains("params (9) and grads (10) must hold the model's 10 elements"), Error);
  });
}
