// The mesh axes of train_gpt --mesh beyond dp x pp x cp (examples/train_gpt/train_mesh.hpp), as train_mesh runs them
// (model/mesh_stage.hpp: MeshGptStage, mesh_forward_backward, one row per micro-batch with pp; the replicas' gradients
// summed over dp):
//   tp  each stage's group of T consecutive ranks runs Megatron's tensor parallelism with sequence parallelism
//       (MegatronTS) in every sublayer: on tp = 2 and 3, alone, with dp = 2 (rows dealt unevenly), with pp = 2 (uneven
//       stages) and with both (8 ranks);
//   v   interleaved 1F1B: each pp rank holds v model chunks (virtual stage c * P + r of P * v, uneven): pp = 2 x v = 2
//       over 5 layers, with tp = 2 and with dp = 2 (8 ranks), and pp = 3 x v = 2 (6 virtual stages, 7 layers).
// Fresh random rows give the loss and every gradient of every rank (each layer's attention, MLP and norm shards, the
// embedding, the head and the final norm) of the single group (Gpt on T ranks, every row in one batch, MegatronTS
// everywhere) within float rounding.
#include "paradyse/comm/threads.hpp"
#include "paradyse/core/rng.hpp"
#include "paradyse/layout/chunking.hpp"
#include "paradyse/mesh/device_mesh.hpp"
#include "paradyse/model/gpt.hpp"
#include "paradyse/model/mesh_stage.hpp"
#include "paradyse/strategy/sequence_layout.hpp"
#include "paradyse/strategy/strategies.hpp"
#include "mesh_harness.hpp"
#include "support/tolerance.hpp"

#include <doctest/doctest.h>
#include <fmt/format.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

using namespace paradyse;

TEST_CASE("a tp axis in the mesh (MegatronTS in every sublayer) and interleaved pipeline chunks train as the single "
          "group: tp = 2, 3 alone, with dp = 2, with pp = 2 (uneven stages), with both, and v = 2 chunks; the loss and "
          "every gradient of every rank") {
  GptConfig config;
  config.layer = LayerConfig::make(48, 6);  // heads divisible by tp = 2 and 3
  config.layer.causal = config.layer.zigzag = config.layer.rope = true;
  config.vocab = 23;
  const std::int64_t seq = 12;  // divisible by 2T for the zigzag layout
  const std::uint64_t seed = 17;

  struct Mesh {
    int dp, pp, tp, v;
    int layers;        // uneven over the pp * v (virtual) stages
    std::int64_t rows;  // uneven over dp without v; a multiple of dp * pp with v > 1
  };
  for (const Mesh& m : {Mesh{1, 1, 2, 1, 3, 3}, Mesh{2, 1, 2, 1, 3, 3}, Mesh{1, 2, 2, 1, 3, 3}, Mesh{2, 2, 2, 1, 3, 3},
                        Mesh{2, 1, 3, 1, 3, 3}, Mesh{1, 2, 3, 1, 3, 3}, Mesh{1, 2, 1, 2, 5, 4}, Mesh{1, 2, 2, 2, 5, 4},
                        Mesh{2, 2, 2, 2, 5, 4}, Mesh{1, 3, 1, 2, 7, 3}}) {
    CAPTURE(m.dp);
    CAPTURE(m.pp);
    CAPTURE(m.tp);
    CAPTURE(m.v);
    config.layers = m.layers;
    const std::int64_t rows = m.rows;
    const StackPlan plan(std::size_t(config.layers), SublayerChoice{AllStrategies<>::index_of("MegatronTS"),
                                                                    AllStrategies<>::index_of("MegatronTS"), 0});
    // Fresh random rows for every mesh (every target counted).
    Rng rng(1000 + std::uint64_t(m.v * 1000 + m.dp * 100 + m.pp * 10 + m.tp));
    const testing::RandomRows batch = testing::random_rows(rng, rows * seq, config.vocab);
    const double counted = double(rows * seq);
    std::mutex lock;

    // The single tp group: every row in one batch.
    const testing::SingleGroupStep want =
        testing::single_group_step<AllStrategies<>>(config, m.tp, seed, plan, batch, rows, seq);

    // The mesh {dp, pp, tp}, as train_mesh builds it.
    const DeviceMesh mesh({{"dp", m.dp}, {"pp", m.pp}, {"cp", 1}, {"tp", m.tp}});
    std::vector<testing::RankGradients> got(std::size_t(m.dp));  // per replica (equal after the dp sum)
    double loss_sum = 0;
    run_ranks(mesh.size(), [&](ThreadCommunicator& world) {
      testing::MeshRank place = testing::MeshRank::on(mesh, world);
      ThreadCommunicator &dp_group = place.dp_group, &pp_group = place.pp_group, &tp_group = place.stage_group;
      const int replica = place.replica, stage_index = place.stage_index, tp_rank = place.stage_rank;
      // Chunk c holds virtual stage c * pp + stage_index of pp * v (one chunk without interleaving).
      const int stages = m.pp * m.v;
      std::vector<MeshGptStage<AllStrategies<>, ThreadCommunicator>> chunks;
      chunks.reserve(std::size_t(m.v));
      BufferPool pool;
      for (int c = 0; c < m.v; ++c) {
        const ChunkRange layers = chunk_range(config.layers, stages, c * m.pp + stage_index);
        chunks.emplace_back(config, c * m.pp + stage_index, stages, layers, m.tp, tp_rank, m.tp, tp_rank, seed);
        chunks.back().begin_step(tp_group, tp_group, pool,
                                 StackPlan(plan.begin() + layers.start, plan.begin() + layers.end()), seq);
      }
      const ChunkRange mine = chunk_range(rows, m.dp, replica);
      const double loss = mesh_forward_backward(std::span(chunks), pp_group, tp_group, mine, seq, batch.inputs,
                                                batch.targets, float(1.0 / counted));
      for (auto& stage : chunks)
        for (const auto& p : stage.parameters())
          dp_group.all_reduce(std::span<const float>(p.gradient->span()), p.gradient->span(), ReduceOp::sum);
      testing::RankGradients& out = got[std::size_t(replica)];
      for (int c = 0; c < m.v; ++c) {
        testing::add_layer_gradients(out, lock, tp_rank,
                                     int(chunk_range(config.layers, stages, c * m.pp + stage_index).start),
                                     chunks[std::size_t(c)].stack().gradients());
        testing::add_stage_end_gradients(out, lock, tp_rank, chunks[std::size_t(c)]);
      }
      const std::lock_guard guard(lock);
      loss_sum += loss;
    });
    CHECK(loss_sum / counted == doctest::Approx(want.loss).epsilon(1e-5));
    for (int d = 0; d < m.dp; ++d) {
      CAPTURE(d);
      testing::check_same_gradients(got[std::size_t(d)], want.gradients);
    }
  }
}
