// Tensor parallelism inside a cp group on the training mesh (train_gpt --mesh dp=..,pp=..,cp=C,tp=T): each stage's
// group of C x T consecutive ranks (tp innermost) holds the unified layout over all of them, its stack told the
// factorisation (TransformerStack::set_tp_inner), and runs MegatronRing (strategy/megatron_ring.hpp: Megatron tp over
// the tp sub-groups, ring attention over the cp sub-groups) in every sublayer, or switches per sublayer between it
// and the five strategies over the whole group. Meshes: cp x tp = 2x2, 2x3, 3x2 alone, with dp = 2 (rows dealt
// unevenly), with pp = 2 (uneven stages), with both (8 ranks), 4x2 and 2x4 (8 ranks), and ZeRO-3 over dp = 2; the
// sequence uneven over the group. And a 2-D grid inside the cp group (--mesh ..,cp=C,tp_x=X,tp_y=Y: the stack told
// both factorisations, set_tp_inner(X Y) and set_tp_x(X)) running RingTp2d (strategy/ring_tp2d.hpp) in every
// sublayer, or switching with the other seven: cp 2 x 2x2 (8 ranks), dp = 2 x cp 2 x 2x1, pp = 2 x cp 2 x 2x1,
// cp 3 x 2x1 and ZeRO-3 over dp = 2 x cp 2 x 2x1, on a sequence even over the group (RingTp2d's requirement).
// Fresh random rows give the loss and every gradient of every rank (each layer's attention, MLP and norm shards, the
// embedding, the head and the final norm) of the single group (Gpt on C x T ranks, every row in one batch, the five
// strategies switching) within float rounding.
#include "model/mesh_harness.hpp"

#include "paradyse/comm/threads.hpp"
#include "paradyse/core/rng.hpp"
#include "paradyse/layout/chunking.hpp"
#include "paradyse/mesh/device_mesh.hpp"
#include "paradyse/model/gpt.hpp"
#include "paradyse/model/mesh_stage.hpp"
#include "paradyse/strategy/sequence_layout.hpp"
#include "paradyse/strategy/strategies.hpp"
#include "support/tolerance.hpp"

#include <doctest/doctest.h>
#include <fmt/format.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace {

using namespace paradyse;
using CpTpStrategies = MeshStrategies<>;

// Every gradient of a stage-group rank, by (rank, name): "layer 2 attention", "embedding", "head".

struct CpTpMesh {
  int dp, pp, cp, tp;
  int layers;         // uneven over pp stages where pp > 1
  std::int64_t rows;  // uneven over dp
  bool zero3 = false;
  int tp_x = 0;       // > 0: the tp sub-group is a tp_x x (tp / tp_x) grid running RingTp2d
};

// A plan over the stage group: MegatronRing (with a grid: RingTp2d) everywhere, or switching with the others (layer
// l: attention MegatronRing on even layers, the five in turn on odd ones; with a grid: MegatronRing, Tp2d, then the
// five; the MLP the other way round).
StackPlan cp_tp_plan(int layers, bool switching, bool grid) {
  const std::size_t ring = CpTpStrategies::index_of(grid ? "RingTp2d" : "MegatronRing");
  StackPlan plan;
  for (int l = 0; l < layers; ++l) {
    const std::size_t other = grid ? std::size_t(5 + l) % 7 : std::size_t(l) % 5;
    plan.push_back(switching ? SublayerChoice{l % 2 ? other : ring, l % 2 ? ring : other, 0}
                             : SublayerChoice{ring, ring, 0});
  }
  return plan;
}

}  // namespace

TEST_CASE("tp inside a cp group on the mesh (MegatronRing, alone and switching with the five) trains as the single "
          "group: cp x tp = 2x2, 2x3, 3x2, with dp = 2, pp = 2 (uneven stages), both, 4x2, 2x4 and ZeRO-3; RingTp2d on a "
          "grid inside cp, 2 x 2x2, with dp = 2, pp = 2, 3 x 2x1 and ZeRO-3; the loss and every gradient of every rank") {
  GptConfig config;
  config.layer = LayerConfig::make(48, 24);  // heads divisible by every group size below (4, 6, 8)
  config.layer.ffn = 96;
  config.layer.causal = config.layer.zigzag = config.layer.rope = true;
  config.vocab = 23;
  const std::int64_t uneven_seq = 45, even_seq = 48;  // over the 2 C zigzag chunks of C = 4, 6, 8 ranks
  const std::uint64_t seed = 19;

  for (const CpTpMesh& m : {CpTpMesh{1, 1, 2, 2, 2, 2}, CpTpMesh{1, 1, 2, 3, 2, 2}, CpTpMesh{1, 1, 3, 2, 2, 2},
                            CpTpMesh{2, 1, 2, 2, 2, 3}, CpTpMesh{1, 2, 2, 2, 3, 2}, CpTpMesh{2, 2, 2, 2, 3, 3},
                            CpTpMesh{1, 1, 4, 2, 2, 2}, CpTpMesh{1, 1, 2, 4, 2, 2}, CpTpMesh{2, 1, 2, 2, 2, 2, true},
                            CpTpMesh{1, 1, 2, 4, 2, 2, false, 2}, CpTpMesh{2, 1, 2, 2, 2, 3, false, 2},
                            CpTpMesh{1, 2, 2, 2, 3, 2, false, 2}, CpTpMesh{1, 1, 3, 2, 2, 1, false, 2},
                            CpTpMesh{2, 1, 2, 2, 2, 2, true, 2}}) {
    for (const bool switching : {false, true}) {
      CAPTURE(m.dp);
      CAPTURE(m.pp);
      CAPTURE(m.cp);
      CAPTURE(m.tp);
      CAPTURE(m.zero3);
      CAPTURE(m.tp_x);
      CAPTURE(switching);
      const std::int64_t seq = m.tp_x > 0 ? even_seq : uneven_seq;
      config.layers = m.layers;
      const int C = m.cp * m.tp;
      const std::int64_t rows = m.rows;
      Rng rng(2000 + std::uint64_t(m.dp * 1000 + m.pp * 100 + m.cp * 10 + m.tp) + (switching ? 7 : 0) +
              std::uint64_t(m.tp_x) * 13);
      const testing::RandomRows batch = testing::random_rows(rng, rows * seq, config.vocab);
      const double counted = double(rows * seq);
      std::mutex lock;

      // The single group of C ranks, unfactorised: the five strategies switching (no MegatronRing).
      StackPlan single;
      for (int l = 0; l < config.layers; ++l) single.push_back(SublayerChoice{std::size_t(l) % 5, std::size_t(l + 2) % 5, 0});
      const testing::SingleGroupStep want =
          testing::single_group_step<CpTpStrategies>(config, C, seed, single, batch, rows, seq);

      // The mesh {dp, pp, cp, tp}, as train_mesh builds it.
      const StackPlan plan = cp_tp_plan(config.layers, switching, m.tp_x > 0);
      const DeviceMesh mesh({{"dp", m.dp}, {"pp", m.pp}, {"cp", m.cp}, {"tp", m.tp}});
      std::vector<testing::RankGradients> got(std::size_t(m.dp));  // per replica (equal after the dp sum)
      double loss_sum = 0;
      run_ranks(mesh.size(), [&](ThreadCommunicator& world) {
        testing::MeshRank place = testing::MeshRank::on(mesh, world);
        ThreadCommunicator &dp_group = place.dp_group, &pp_group = place.pp_group, &group = place.stage_group;
        const int replica = place.replica, stage_index = place.stage_index, rank = place.stage_rank;
        const ChunkRange layers = chunk_range(config.layers, m.pp, stage_index);
        std::vector<MeshGptStage<CpTpStrategies, ThreadCommunicator>> chunks;
        chunks.emplace_back(config, stage_index, m.pp, layers, C, rank, C, rank, seed);
        MeshGptStage<CpTpStrategies, ThreadCommunicator>& stage = chunks.back();
        stage.stack().set_tp_inner(group, m.tp);
        if (m.tp_x > 0) stage.stack().set_tp_x(group, m.tp_x);
        if (m.zero3) stage.shard_over_dp(dp_group);
        BufferPool pool;
        stage.begin_step(group, group, pool, StackPlan(plan.begin() + layers.start, plan.begin() + layers.end()), seq);
        const ChunkRange mine = chunk_range(rows, m.dp, replica);
        const double loss = mesh_forward_backward(std::span(chunks), pp_group, group, mine, seq, batch.inputs,
                                                  batch.targets, float(1.0 / counted));
        testing::RankGradients& out = got[std::size_t(replica)];
        if (m.zero3) {  // every tensor's gradient chunks gathered over dp (the sum over dp is in them already)
          const std::vector<std::vector<float>> full = testing::gathered_zero3(stage, dp_group, true);
          const std::lock_guard guard(lock);
          loss_sum += loss;
          std::size_t i = 0;
          for (int l = int(layers.start); l < int(layers.end()); ++l)
            for (const char* part : {"attention", "mlp", "norms"}) out[{rank, fmt::format("layer {} {}", l, part)}] = full[i++];
          if (stage.first()) out[{rank, "embedding"}] = full[i++];
          if (stage.last()) out[{rank, "head"}] = full[i++];
          return;
        }
        for (const auto& p : stage.parameters())
          dp_group.all_reduce(std::span<const float>(p.gradient->span()), p.gradient->span(), ReduceOp::sum);
        testing::add_layer_gradients(out, lock, rank, int(layers.start), stage.stack().gradients());
        testing::add_stage_end_gradients(out, lock, rank, stage);
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
}
