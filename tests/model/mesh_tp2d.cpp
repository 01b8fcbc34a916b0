// 2-D tensor parallelism on the mesh of train_gpt --mesh dp=..,pp=..,tp_x=X,tp_y=Y (examples/train_gpt/train_mesh.hpp),
// as train_mesh runs it (model/mesh_stage.hpp: MeshGptStage, mesh_forward_backward, one row per micro-batch with pp;
// the replicas' gradients summed over dp): each stage's group of X x Y consecutive ranks is a grid running Tp2d
// (strategy/tp2d.hpp) in every sublayer. Grids 2x2 alone, with dp = 2 (rows dealt unevenly), with pp = 2 (uneven
// stages), and 3x2 alone. Fresh random rows give the loss and every gradient of every rank (each layer's attention,
// MLP and norm shards, the embedding, the head and the final norm) of the single group (Gpt on X x Y ranks, every row
// in one batch, MegatronTS everywhere) within float rounding. Causal, RoPE, zigzag, SwiGLU, rms norm.
#include "paradyse/comm/threads.hpp"
#include "paradyse/core/rng.hpp"
#include "paradyse/layout/chunking.hpp"
#include "paradyse/mesh/device_mesh.hpp"
#include "paradyse/model/gpt.hpp"
#include "paradyse/model/mesh_stage.hpp"
#include "paradyse/strategy/sequence_layout.hpp"
#include "paradyse/strategy/strategies.hpp"
#include "model/mesh_harness.hpp"
#include "support/tolerance.hpp"

#include <doctest/doctest.h>
#include <fmt/format.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace mesh_tp2d_test {

using namespace paradyse;
using Strategies = MeshStrategies<>;

// Every gradient of a group rank, by (rank, name): "layer 2 attention", "embedding", "head".

TEST_CASE("a 2-D tp grid in the mesh (Tp2d in every sublayer) trains as the single group: 2x2 alone, with dp = 2, "
          "with pp = 2, and 3x2; the loss and every gradient of every rank") {
  GptConfig config;
  config.layer = LayerConfig::make(48, 12);  // h % tp_x, heads % (tp_x tp_y) for 2x2 and 3x2
  config.layer.causal = config.layer.zigzag = config.layer.rope = true;
  config.layer.activation = Activation::swiglu;
  config.layer.norm = NormKind::rms_norm;
  config.layers = 3;
  config.vocab = 23;
  const std::int64_t seq = 24;  // a multiple of the 2C zigzag chunks for C = 4 and 6
  const std::uint64_t seed = 29;
  const std::size_t ts = Strategies::index_of("MegatronTS"), t2 = Strategies::index_of("Tp2d");

  struct Mesh {
    int dp, pp, tp_x, tp_y;
    std::int64_t rows;  // uneven over dp
  };
  for (const Mesh& m : {Mesh{1, 1, 2, 2, 2}, Mesh{2, 1, 2, 2, 3}, Mesh{1, 2, 2, 2, 2}, Mesh{1, 1, 3, 2, 1}}) {
    CAPTURE(m.dp);
    CAPTURE(m.pp);
    CAPTURE(m.tp_x);
    CAPTURE(m.tp_y);
    const int group = m.tp_x * m.tp_y;
    Rng rng(2000 + std::uint64_t(m.dp * 1000 + m.pp * 100 + m.tp_x * 10 + m.tp_y));
    const testing::RandomRows batch = testing::random_rows(rng, m.rows * seq, config.vocab);
    const double counted = double(m.rows * seq);
    std::mutex lock;

    // The single group: every row in one batch, MegatronTS everywhere, no grid.
    const StackPlan single(std::size_t(config.layers), SublayerChoice{ts, ts, 0});
    const testing::SingleGroupStep want =
        testing::single_group_step<Strategies>(config, group, seed, single, batch, m.rows, seq);

    // The mesh {dp, pp, tp = X x Y}, as train_mesh builds it, the grid set on every stage's stack.
    const DeviceMesh mesh({{"dp", m.dp}, {"pp", m.pp}, {"cp", 1}, {"tp", group}});
    std::vector<testing::RankGradients> got(std::size_t(m.dp));  // per replica (equal after the dp sum)
    double loss_sum = 0;
    run_ranks(mesh.size(), [&](ThreadCommunicator& world) {
      testing::MeshRank on = testing::MeshRank::on(mesh, world);
      const int replica = on.replica, stage_index = on.stage_index, tp_rank = on.stage_rank;
      const ChunkRange layers = chunk_range(config.layers, m.pp, stage_index);
      std::vector<MeshGptStage<Strategies, ThreadCommunicator>> chunks;
      chunks.emplace_back(config, stage_index, m.pp, layers, group, tp_rank, group, tp_rank, seed);
      chunks.back().stack().set_tp_x(on.stage_group, m.tp_x);
      BufferPool pool;
      chunks.back().begin_step(on.stage_group, on.stage_group, pool,
                               StackPlan(std::size_t(layers.length), SublayerChoice{t2, t2, 0}), seq);
      const ChunkRange mine = chunk_range(m.rows, m.dp, replica);
      const double loss = mesh_forward_backward(std::span(chunks), on.pp_group, on.stage_group, mine, seq, batch.inputs,
                                                batch.targets, float(1.0 / counted));
      MeshGptStage<Strategies, ThreadCommunicator>& stage = chunks.back();
      for (const auto& p : stage.parameters())
        on.dp_group.all_reduce(std::span<const float>(p.gradient->span()), p.gradient->span(), ReduceOp::sum);
      testing::RankGradients& out = got[std::size_t(replica)];
      testing::add_layer_gradients(out, lock, tp_rank, int(layers.start), stage.stack().gradients());
      testing::add_stage_end_gradients(out, lock, tp_rank, stage);
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

}  // namespace mesh_tp2d_test
