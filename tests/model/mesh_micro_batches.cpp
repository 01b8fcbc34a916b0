// Micro-batches of several rows and what a pipeline keeps for its backward, as train_gpt --mesh runs them
// (model/mesh_stage.hpp: mesh_forward_backward with rows_per_micro_batch, MeshGptStage::set_recompute; the 1F1B and
// interleaved schedules of model/pipeline.hpp):
//   micro_batch m in {1, 2, 3}: a replica's rows in micro-batches of m rows, the last one the rest (uneven);
//   recompute none (every in-flight micro-batch's activations kept: TransformerStack::Activations) and full (the
//   stage's input kept, its forward recomputed before the backward);
//   pp in {1 (gradient accumulation over the micro-batches), 2, 3 (uneven stages)}, with dp = 2 (rows dealt
//   unevenly), cp = 2 (the five strategies switching per sublayer), interleaved chunks (v = 2).
// Fresh random rows give the loss and every gradient of every rank (each layer's attention, MLP and norm shards, the
// embedding, the head and the final norm) of the single group (Gpt on C ranks, every row in one batch) within float
// rounding.
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

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace mesh_micro_batches_test {

using namespace paradyse;

struct Mesh {
  int dp, pp, cp, v;
  int layers;               // uneven over the pp * v (virtual) stages
  std::int64_t rows;        // dealt unevenly over dp
  std::int64_t micro_batch;  // rows per micro-batch (the last one the rest)
  PipelineRecompute recompute;
};

TEST_CASE("micro-batches of several rows (the last one the rest) through the pipeline, with every activation kept "
          "(recompute none) or the stages recomputed (full): pp = 1, 2, 3 (uneven), with dp, cp and interleaved "
          "chunks; the loss and every gradient of every rank equal the single group's") {
  GptConfig config;
  config.layer = LayerConfig::make(48, 6);
  config.layer.causal = config.layer.zigzag = config.layer.rope = true;
  config.vocab = 23;
  const std::int64_t seq = 12;  // divisible by 2C for the zigzag layout
  const std::uint64_t seed = 29;
  constexpr PipelineRecompute none = PipelineRecompute::none, full = PipelineRecompute::full;

  for (const Mesh& m : {Mesh{1, 2, 1, 1, 3, 4, 2, none}, Mesh{1, 2, 1, 1, 3, 4, 2, full},
                        Mesh{1, 3, 1, 1, 4, 5, 2, none}, Mesh{1, 3, 2, 1, 5, 5, 3, full},
                        Mesh{1, 2, 2, 1, 3, 7, 3, none}, Mesh{1, 2, 1, 1, 3, 3, 1, none},
                        Mesh{2, 1, 2, 1, 3, 7, 2, none}, Mesh{2, 1, 1, 1, 3, 7, 3, full},
                        Mesh{2, 2, 1, 1, 3, 8, 2, none}, Mesh{2, 2, 2, 1, 3, 9, 2, none},
                        Mesh{1, 2, 1, 2, 5, 8, 2, none}, Mesh{1, 2, 2, 2, 5, 7, 2, full},
                        Mesh{2, 2, 1, 2, 5, 8, 2, none}, Mesh{1, 3, 1, 2, 7, 6, 2, none}}) {
    CAPTURE(m.dp);
    CAPTURE(m.pp);
    CAPTURE(m.cp);
    CAPTURE(m.v);
    CAPTURE(m.rows);
    CAPTURE(m.micro_batch);
    CAPTURE(m.recompute == none ? "none" : "full");
    config.layers = m.layers;
    StackPlan plan;  // the five strategies switching per sublayer
    for (int l = 0; l < config.layers; ++l)
      plan.push_back(SublayerChoice{std::size_t(l) % 5, std::size_t(l + 2) % 5, 0});
    Rng rng(5000 + std::uint64_t(m.dp * 10000 + m.pp * 1000 + m.cp * 100 + m.v * 10 + m.micro_batch) + m.rows);
    const testing::RandomRows batch = testing::random_rows(rng, m.rows * seq, config.vocab);
    const double counted = double(m.rows * seq);
    std::mutex lock;

    // The single cp group: every row in one batch.
    const testing::SingleGroupStep want =
        testing::single_group_step<AllStrategies<>>(config, m.cp, seed, plan, batch, m.rows, seq);

    // The mesh {dp, pp, cp}, as train_mesh builds it.
    const DeviceMesh mesh({{"dp", m.dp}, {"pp", m.pp}, {"cp", m.cp}, {"tp", 1}});
    std::vector<testing::RankGradients> got(std::size_t(m.dp));  // per replica (equal after the dp sum)
    double loss_sum = 0;
    run_ranks(mesh.size(), [&](ThreadCommunicator& world) {
      testing::MeshRank on = testing::MeshRank::on(mesh, world);
      const int stages = m.pp * m.v;
      std::vector<MeshGptStage<AllStrategies<>, ThreadCommunicator>> chunks;
      chunks.reserve(std::size_t(m.v));
      BufferPool pool;
      for (int c = 0; c < m.v; ++c) {
        const ChunkRange layers = chunk_range(config.layers, stages, c * m.pp + on.stage_index);
        chunks.emplace_back(config, c * m.pp + on.stage_index, stages, layers, m.cp, on.stage_rank, m.cp,
                            on.stage_rank, seed);
        chunks.back().set_recompute(m.recompute);
        chunks.back().begin_step(on.stage_group, on.stage_group, pool,
                                 StackPlan(plan.begin() + layers.start, plan.begin() + layers.end()), seq);
      }
      const ChunkRange mine = chunk_range(m.rows, m.dp, on.replica);
      const double loss = mesh_forward_backward(std::span(chunks), on.pp_group, on.stage_group, mine, seq, batch.inputs,
                                                batch.targets, float(1.0 / counted), m.micro_batch);
      testing::RankGradients& out = got[std::size_t(on.replica)];
      for (int c = 0; c < m.v; ++c) {
        auto& chunk = chunks[std::size_t(c)];
        for (const auto& p : chunk.parameters())
          on.dp_group.all_reduce(std::span<const float>(p.gradient->span()), p.gradient->span(), ReduceOp::sum);
        testing::add_layer_gradients(out, lock, on.stage_rank, int(chunk.layers().start), chunk.stack().gradients());
        testing::add_stage_end_gradients(out, lock, on.stage_rank, chunk);
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

TEST_CASE("interleaved micro-batches must come in whole rounds of the pipeline stages: refused by name") {
  GptConfig config;
  config.layer = LayerConfig::make(48, 6);
  config.layer.causal = config.layer.zigzag = config.layer.rope = true;
  config.vocab = 23;
  config.layers = 4;
  const std::int64_t seq = 12, rows = 6;  // 3 micro-batches of 2 rows over 2 stages
  const std::vector<std::int32_t> tokens(std::size_t(rows * seq), 1);
  const StackPlan plan(2, SublayerChoice{0, 0, 0});
  run_ranks(2, [&](ThreadCommunicator& pp) {
    ThreadCommunicator one = pp.split(int(pp.rank()), 0);
    std::vector<MeshGptStage<AllStrategies<>, ThreadCommunicator>> chunks;
    chunks.reserve(2);
    BufferPool pool;
    for (int c = 0; c < 2; ++c) {
      chunks.emplace_back(config, c * 2 + int(pp.rank()), 4, chunk_range(4, 4, c * 2 + int(pp.rank())), 1, 0, 1, 0, 3);
      chunks.back().begin_step(one, one, pool, StackPlan(1, SublayerChoice{0, 0, 0}), seq);
    }
    CHECK_THROWS_WITH(mesh_forward_backward(std::span(chunks), pp, one, ChunkRange{0, rows}, seq, tokens, tokens,
                                            1.0f, 2),
                      doctest::Contains("must be a positive multiple of the 2 stages"));
  });
}

}  // namespace mesh_micro_batches_test
