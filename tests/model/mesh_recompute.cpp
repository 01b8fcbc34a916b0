// Selective recomputation (TransformerStack::set_selective_recompute, PipelineRecompute::selective) and what each
// recomputation policy holds, as train_gpt --mesh --recompute none|selective|full runs them:
//   - every strategy's attention core (MegatronTS, UlyssesZ, MegatronCZ, METP, ColossalZ, and MegatronRing on a cp x tp
//     group, Tp2d on a tp_x x tp_y grid) dropped after forward and re-run before backward gives bit for bit the
//     output, input gradient and every shard gradient of the stack that kept it;
//   - on the mesh (pp 1, 2, 3 uneven; micro-batches of 1..3 rows, the last one the rest; cp = 2 switching the five per
//     sublayer; dp = 2; interleaved chunks; cp x tp MegatronRing) the loss and every gradient of every rank equal the
//     single group's;
//   - the peak bytes a pp = 2 mesh's ranks measure (MemoryTracker) order none > selective > full.
#include "paradyse/comm/threads.hpp"
#include "paradyse/core/memory.hpp"
#include "paradyse/core/rng.hpp"
#include "paradyse/layout/chunking.hpp"
#include "paradyse/mesh/device_mesh.hpp"
#include "paradyse/model/gpt.hpp"
#include "paradyse/model/mesh_stage.hpp"
#include "paradyse/model/stack.hpp"
#include "paradyse/strategy/sequence_layout.hpp"
#include "paradyse/strategy/strategies.hpp"
#include "mesh_harness.hpp"
#include "support/tolerance.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace mesh_recompute_test {

using namespace paradyse;
using Strategies = MeshStrategies<>;

// One forward and backward of a 2-layer stack on this rank, its core kept or dropped: the output, dx and every
// shard gradient, concatenated.
std::vector<float> stack_step(ThreadCommunicator& comm, const LayerConfig& config, const StackPlan& plan, int tp_inner,
                              int tp_x, bool selective, std::int64_t seq) {
  const int p = int(comm.size()), rank = int(comm.rank());
  TransformerStack<Strategies> stack(config, int(plan.size()), p, rank, 77);
  if (tp_inner > 0) stack.set_tp_inner(comm, tp_inner);
  if (tp_x > 1) stack.set_tp_x(comm, tp_x);
  stack.set_selective_recompute(selective);
  BufferPool pool;
  const std::int64_t b = 2, n = SequenceLayout(seq, p, config.zigzag).local_length(rank), h = config.hidden;
  Rng rng(900 + std::uint64_t(rank));
  Tensor<float> x(Shape{b, n, h}), dy(Shape{b, n, h}), y(Shape{b, n, h}), dx(Shape{b, n, h});
  for (float& v : x.span()) v = float(rng.uniform(-1.0, 1.0));
  for (float& v : dy.span()) v = float(rng.uniform(-1.0, 1.0));
  stack.forward(comm, pool, plan, seq, TensorView<const float>(x.view()), y.view());
  stack.backward(comm, pool, TensorView<const float>(dy.view()), dx.view());
  std::vector<float> out(y.span().begin(), y.span().end());
  out.insert(out.end(), dx.span().begin(), dx.span().end());
  for (const LayerWeights& g : stack.gradients())
    for (const Tensor<float>* t : {&g.attention.packed, &g.mlp.packed, &g.norms.packed})
      out.insert(out.end(), t->span().begin(), t->span().end());
  return out;
}

TEST_CASE("selective recomputation re-runs every strategy's attention core: bit for bit the stack that kept it (the "
          "five, MegatronRing on cp 2 x tp 2, Tp2d on a 2 x 2 grid)") {
  LayerConfig config = LayerConfig::make(64, 8);
  config.causal = config.rope = true;
  const std::int64_t seq = 16;
  struct Case {
    std::string strategy;
    int tp_inner, tp_x;
  };
  for (const Case& c : {Case{"MegatronTS", 0, 1}, Case{"UlyssesZ", 0, 1}, Case{"MegatronCZ", 0, 1}, Case{"METP", 0, 1},
                        Case{"ColossalZ", 0, 1}, Case{"MegatronRing", 2, 1}, Case{"Tp2d", 0, 2}}) {
    CAPTURE(c.strategy);
    const std::size_t i = Strategies::index_of(c.strategy);
    const StackPlan plan(2, SublayerChoice{i, i, 0});
    std::vector<std::vector<float>> kept(4), dropped(4);
    run_ranks(4, [&](ThreadCommunicator& comm) {
      kept[comm.rank()] = stack_step(comm, config, plan, c.tp_inner, c.tp_x, false, seq);
      dropped[comm.rank()] = stack_step(comm, config, plan, c.tp_inner, c.tp_x, true, seq);
    });
    for (int r = 0; r < 4; ++r) {
      CAPTURE(r);
      REQUIRE(kept[r].size() == dropped[r].size());
      std::size_t differ = 0;
      for (std::size_t k = 0; k < kept[r].size(); ++k) differ += kept[r][k] != dropped[r][k];
      CHECK(differ == 0);
      CHECK(std::any_of(kept[r].begin(), kept[r].end(), [](float v) { return v != 0.0f; }));
    }
  }
}

struct Mesh {
  int dp, pp, cp, tp, v;
  int layers;                // uneven over the pp * v (virtual) stages
  std::int64_t rows;         // dealt unevenly over dp
  std::int64_t micro_batch;  // rows per micro-batch (the last one the rest)
};

// One step of `m` under `recompute`; returns the loss sum, the replicas' gradients and the largest peak bytes a rank
// measured (its own MemoryTracker over the step).
struct MeshRun {
  double loss_sum = 0;
  std::vector<testing::RankGradients> gradients;
  std::size_t peak = 0;
};
MeshRun run_mesh(const GptConfig& config, const Mesh& m, const StackPlan& plan, PipelineRecompute recompute,
                 const testing::RandomRows& batch, std::int64_t seq, std::uint64_t seed) {
  const DeviceMesh mesh({{"dp", m.dp}, {"pp", m.pp}, {"cp", m.cp}, {"tp", m.tp}});
  const int C = m.cp * m.tp;
  MeshRun run;
  run.gradients.resize(std::size_t(m.dp));
  std::mutex lock;
  std::atomic<std::size_t> peak{0};
  const double counted = double(m.rows * seq);
  run_ranks(mesh.size(), [&](ThreadCommunicator& world) {
    MemoryTracker tracker;
    const ScopedTracker scope(tracker);
    testing::MeshRank on = testing::MeshRank::on(mesh, world);
    const int stages = m.pp * m.v;
    std::vector<MeshGptStage<Strategies, ThreadCommunicator>> chunks;
    chunks.reserve(std::size_t(m.v));
    BufferPool pool;
    for (int c = 0; c < m.v; ++c) {
      const ChunkRange layers = chunk_range(config.layers, stages, c * m.pp + on.stage_index);
      chunks.emplace_back(config, c * m.pp + on.stage_index, stages, layers, C, on.stage_rank, C, on.stage_rank, seed);
      if (m.tp > 1) chunks.back().stack().set_tp_inner(on.stage_group, m.tp);
      chunks.back().set_recompute(recompute);
      chunks.back().begin_step(on.stage_group, on.stage_group, pool,
                               StackPlan(plan.begin() + layers.start, plan.begin() + layers.end()), seq);
    }
    const ChunkRange mine = chunk_range(m.rows, m.dp, on.replica);
    tracker.reset_peak();
    const double loss = mesh_forward_backward(std::span(chunks), on.pp_group, on.stage_group, mine, seq, batch.inputs,
                                              batch.targets, float(1.0 / counted), m.micro_batch);
    std::size_t seen = peak.load();
    while (tracker.peak() > seen && !peak.compare_exchange_weak(seen, tracker.peak())) {
    }
    testing::RankGradients& out = run.gradients[std::size_t(on.replica)];
    for (int c = 0; c < m.v; ++c) {
      auto& chunk = chunks[std::size_t(c)];
      for (const auto& p : chunk.parameters())
        on.dp_group.all_reduce(std::span<const float>(p.gradient->span()), p.gradient->span(), ReduceOp::sum);
      testing::add_layer_gradients(out, lock, on.stage_rank, int(chunk.layers().start), chunk.stack().gradients());
      testing::add_stage_end_gradients(out, lock, on.stage_rank, chunk);
    }
    const std::lock_guard guard(lock);
    run.loss_sum += loss;
  });
  run.peak = peak.load();
  return run;
}

TEST_CASE("selective recomputation on the mesh: pp = 1, 2, 3 (uneven), micro-batches of 1..3 rows, with dp, cp "
          "switching the five, interleaved chunks and cp x tp MegatronRing; the loss and every gradient of every rank "
          "equal the single group's") {
  GptConfig config;
  config.layer = LayerConfig::make(48, 12);
  config.layer.causal = config.layer.zigzag = config.layer.rope = true;
  config.vocab = 23;
  const std::int64_t seq = 16;  // divisible by 2C for the zigzag layout
  const std::uint64_t seed = 31;

  for (const Mesh& m : {Mesh{2, 1, 2, 1, 1, 3, 7, 2}, Mesh{1, 2, 2, 1, 1, 3, 7, 3}, Mesh{1, 3, 2, 1, 1, 5, 5, 1},
                        Mesh{2, 2, 2, 1, 1, 3, 9, 2}, Mesh{1, 2, 2, 1, 2, 5, 8, 2}, Mesh{1, 2, 2, 2, 1, 3, 4, 1}}) {
    CAPTURE(m.dp);
    CAPTURE(m.pp);
    CAPTURE(m.cp);
    CAPTURE(m.tp);
    CAPTURE(m.v);
    CAPTURE(m.rows);
    CAPTURE(m.micro_batch);
    config.layers = m.layers;
    StackPlan single, plan;  // the five switching per sublayer; with tp, MegatronRing on every other sublayer
    const std::size_t ring = Strategies::index_of("MegatronRing");
    for (int l = 0; l < config.layers; ++l) {
      single.push_back(SublayerChoice{std::size_t(l) % 5, std::size_t(l + 2) % 5, 0});
      plan.push_back(m.tp > 1 ? SublayerChoice{l % 2 ? std::size_t(l) % 5 : ring, l % 2 ? ring : std::size_t(l + 2) % 5, 0}
                              : single.back());
    }
    Rng rng(7000 + std::uint64_t(m.dp * 10000 + m.pp * 1000 + m.cp * 100 + m.v * 10 + m.micro_batch) + m.rows);
    const testing::RandomRows batch = testing::random_rows(rng, m.rows * seq, config.vocab);
    const testing::SingleGroupStep want =
        testing::single_group_step<Strategies>(config, m.cp * m.tp, seed, single, batch, m.rows, seq);
    const MeshRun got = run_mesh(config, m, plan, PipelineRecompute::selective, batch, seq, seed);
    CHECK(got.loss_sum / double(m.rows * seq) == doctest::Approx(want.loss).epsilon(1e-5));
    for (int d = 0; d < m.dp; ++d) {
      CAPTURE(d);
      testing::check_same_gradients(got.gradients[std::size_t(d)], want.gradients);
    }
  }
}

TEST_CASE("the peak a pp = 2 mesh measures orders none > selective > full (several micro-batches in flight)") {
  GptConfig config;
  config.layer = LayerConfig::make(48, 12);
  config.layer.causal = config.layer.zigzag = config.layer.rope = true;
  config.vocab = 23;
  config.layers = 4;
  const std::int64_t seq = 32;
  const Mesh m{1, 2, 2, 1, 1, 4, 6, 1};
  StackPlan plan;
  for (int l = 0; l < config.layers; ++l) plan.push_back(SublayerChoice{std::size_t(l) % 5, std::size_t(l + 2) % 5, 0});
  Rng rng(4242);
  const testing::RandomRows batch = testing::random_rows(rng, m.rows * seq, config.vocab);
  const MeshRun none = run_mesh(config, m, plan, PipelineRecompute::none, batch, seq, 5);
  const MeshRun selective = run_mesh(config, m, plan, PipelineRecompute::selective, batch, seq, 5);
  const MeshRun full = run_mesh(config, m, plan, PipelineRecompute::full, batch, seq, 5);
  MESSAGE("peak bytes per rank: none ", none.peak, ", selective ", selective.peak, ", full ", full.peak);
  CHECK(none.peak > selective.peak);
  CHECK(selective.peak > full.peak);
  CHECK(none.loss_sum == selective.loss_sum);  // the same computation, bit for bit
  CHECK(none.loss_sum == full.loss_sum);
}

TEST_CASE("a pipeline rank's in-flight stashes (what train_gpt's planner counts under none and selective)") {
  const auto layers = [](std::int64_t n) { return [n](int) { return n; }; };
  // 1F1B: stage s of p holds min(m, p - s) micro-batches of its layers.
  CHECK(peak_stashed_layers(2, 0, 1, 8, layers(3)) == 2 * 3);
  CHECK(peak_stashed_layers(2, 1, 1, 8, layers(2)) == 1 * 2);
  CHECK(peak_stashed_layers(4, 0, 1, 3, layers(1)) == 3);  // m < p: all of them
  CHECK(peak_stashed_layers(4, 1, 1, 8, layers(1)) == 3);
  // Interleaved, p = 2, v = 2, m = 4, chunk 0 of 3 layers, chunk 1 of one: rank 0 runs F0c0 F1c0 F0c1 F1c1 F2c0 B0c1
  // F3c0 B1c1 ..., holding 3 + 3 + 1 + 1 + 3 - 1 + 3 = 13 layers after F3c0.
  CHECK(peak_stashed_layers(2, 0, 2, 4, [](int c) { return c == 0 ? std::int64_t(3) : std::int64_t(1); }) == 13);
}

}  // namespace mesh_recompute_test
