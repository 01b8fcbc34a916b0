// ZeRO-3 on the training mesh (model/zero3_shards.hpp, MeshGptStage::shard_over_dp, MeshOptimizer with
// ZeroStage::three), as train_gpt --mesh ... --zero 3 runs it: each dp replica keeps 1/dp of every parameter, AdamW
// state and gradient, each layer gathered around its forward and its backward. Two steps on fresh random rows of
// the same mesh with ZeRO-0 and with ZeRO-3: the loss of each step, and after each step every gradient (summed over
// dp) and every weight of every rank (the ZeRO-3 chunks gathered) equal ZeRO-0's within float rounding. Meshes:
// dp = 2; dp = 3 (uneven chunks: hidden 40) with pp = 2 (uneven stages); dp = 2 x pp = 2 x cp = 2 (8 ranks).
#include "paradyse/comm/threads.hpp"
#include "paradyse/core/rng.hpp"
#include "paradyse/layout/chunking.hpp"
#include "paradyse/mesh/device_mesh.hpp"
#include "paradyse/model/mesh_optimizer.hpp"
#include "paradyse/model/mesh_stage.hpp"
#include "paradyse/strategy/strategies.hpp"
#include "mesh_harness.hpp"
#include "support/tolerance.hpp"

#include <doctest/doctest.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace {

using namespace paradyse;
using Zero3Stage = MeshGptStage<AllStrategies<>, ThreadCommunicator>;

// Every tensor of a run after each step, by (world rank, step, "gradient"/"weight", index).
using Zero3Tensors = testing::StepTensors;

struct Zero3Mesh {
  int dp, pp, cp, layers;
  std::int64_t rows;  // a multiple of dp with pp (one row per micro-batch), at least dp without
};

// Runs `steps` steps of the mesh with `zero`; returns each step's loss (mean over the counted tokens).
std::vector<double> zero3_run(const GptConfig& config, const Zero3Mesh& m, ZeroStage zero, int steps, std::int64_t seq,
                        const StackPlan& plan, const std::vector<std::vector<std::int32_t>>& inputs,
                        const std::vector<std::vector<std::int32_t>>& targets, Zero3Tensors& out) {
  const DeviceMesh mesh({{"dp", m.dp}, {"pp", m.pp}, {"cp", m.cp}, {"tp", 1}});
  std::vector<double> losses(std::size_t(steps), 0.0);
  std::mutex lock;
  const double counted = double(m.rows * seq);
  const ops::AdamWConfig adamw{.learning_rate = 0.02f, .weight_decay = 0.1f};
  run_ranks(mesh.size(), [&](ThreadCommunicator& world) {
    testing::MeshRank place = testing::MeshRank::on(mesh, world);
    ThreadCommunicator &dp_group = place.dp_group, &pp_group = place.pp_group, &cp_group = place.stage_group;
    const int replica = place.replica, stage_index = place.stage_index, cp_rank = place.stage_rank;
    const ChunkRange layers = chunk_range(config.layers, m.pp, stage_index);
    Zero3Stage stage(config, stage_index, m.pp, layers, m.cp, cp_rank, m.cp, cp_rank, 7);
    if (zero == ZeroStage::three) stage.shard_over_dp(dp_group);
    MeshOptimizer optimizer(stage, zero, m.dp, replica, adamw);
    BufferPool pool;
    const ChunkRange mine = chunk_range(m.rows, m.dp, replica);
    // The full tensors of this rank: ZeRO-3's chunks gathered over dp, ZeRO-0's as they are.
    const auto record = [&](int k, bool gradients) {
      std::vector<std::vector<float>> tensors;
      if (zero == ZeroStage::three) {
        tensors = testing::gathered_zero3(stage, dp_group, gradients);
      } else {
        for (const auto& p : stage.parameters()) {
          const Tensor<float>* t = gradients ? p.gradient : p.value;
          tensors.emplace_back(t->span().begin(), t->span().end());
        }
      }
      testing::store_step_tensors(out, lock, world.rank(), k, gradients, std::move(tensors));
    };
    for (int k = 0; k < steps; ++k) {
      stage.begin_step(cp_group, cp_group, pool, StackPlan(plan.begin() + layers.start, plan.begin() + layers.end()), seq);
      const double loss = mesh_forward_backward(stage, pp_group, cp_group, mine, seq, inputs[std::size_t(k)],
                                                targets[std::size_t(k)], float(1.0 / counted));
      optimizer.step(dp_group, adamw.learning_rate, k + 1);  // ZeRO-0 leaves the gradients summed over dp
      record(k, true);
      record(k, false);
      const std::lock_guard guard(lock);
      losses[std::size_t(k)] += loss / counted;
    }
  });
  return losses;
}

}  // namespace

TEST_CASE("ZeRO-3 on the mesh (each layer gathered over dp around its use, gradients reduce-scattered, AdamW on the "
          "owned chunks) trains as ZeRO-0: dp = 2, dp = 3 (uneven chunks) x pp = 2, dp = 2 x pp = 2 x cp = 2; the "
          "losses, every gradient and every weight after each of two steps") {
  GptConfig config = testing::uneven_zero3_config();
  const std::int64_t seq = 12;
  const int steps = 2;
  for (const Zero3Mesh& m : {Zero3Mesh{2, 1, 1, 2, 3}, Zero3Mesh{3, 2, 1, 3, 6}, Zero3Mesh{2, 2, 2, 3, 4}}) {
    CAPTURE(m.dp);
    CAPTURE(m.pp);
    CAPTURE(m.cp);
    config.layers = m.layers;
    const std::size_t strategy = m.cp == 1 ? AllStrategies<>::index_of("MegatronTS") : AllStrategies<>::index_of("UlyssesZ");
    const StackPlan plan(std::size_t(config.layers), SublayerChoice{strategy, strategy, 0});
    Rng rng(300 + std::uint64_t(m.dp * 100 + m.pp * 10 + m.cp));
    std::vector<std::vector<std::int32_t>> inputs(steps), targets(steps);
    for (int k = 0; k < steps; ++k)
      for (std::int64_t i = 0; i < m.rows * seq; ++i) {
        inputs[std::size_t(k)].push_back(std::int32_t(rng.next_u64() % std::uint64_t(config.vocab)));
        targets[std::size_t(k)].push_back(std::int32_t(rng.next_u64() % std::uint64_t(config.vocab)));
      }
    Zero3Tensors want, got;
    const std::vector<double> zero0 = zero3_run(config, m, ZeroStage::zero, steps, seq, plan, inputs, targets, want);
    const std::vector<double> zero3 = zero3_run(config, m, ZeroStage::three, steps, seq, plan, inputs, targets, got);
    for (int k = 0; k < steps; ++k) CHECK(zero3[std::size_t(k)] == doctest::Approx(zero0[std::size_t(k)]).epsilon(1e-6));
    CHECK(zero0[1] != zero0[0]);  // the second step runs on updated weights
    REQUIRE(got.size() == want.size());
    for (const auto& [name, values] : want) {
      CAPTURE(name);
      REQUIRE(got.count(name) == 1);
      CHECK(testing::first_mismatch(std::span<const float>(got.at(name)), std::span<const float>(values),
                                    testing::kFloat32) == "");
      double norm = 0;  // the comparison can fail: every tensor is non-zero
      for (float v : values) norm += double(v) * double(v);
      CHECK(norm > 0);
    }
  }
}

