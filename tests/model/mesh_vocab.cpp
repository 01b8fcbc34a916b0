// The vocabulary sharded over tp on the training mesh (model/mesh_stage.hpp's shard_vocabulary, as train_gpt --mesh
// with tp runs it by default): the first stage holds V/T rows of the embedding, the last V/T rows of the head (the
// final norm whole), over the stage's tp ranks (the whole group for a tp group or a 2-D grid, the tp sub-group of a
// cp x tp group, replicated over its cp ranks). Meshes: tp = 2, tp = 3 (V = 23: 8/8/7 rows), with dp = 2 (rows dealt
// unevenly), pp = 2 (uneven stages) and pp = 3 with tp = 3, interleaved pp = 2 x v = 2, cp x tp = 2x2 (MegatronRing) and
// with dp = 2 (8 ranks), a 2x2 grid (Tp2d), a 2x1 grid inside cp = 2 and 3 (RingTp2d; also with ZeRO-3 over dp = 2),
// and ZeRO-3 over dp = 2 with tp = 2 and with pp = 2.
// Fresh random rows give the loss and every gradient of every rank (each layer's attention, MLP and norm shards; the
// embedding's and the head's rows this rank holds and the final norm) of the single group (Gpt on the stage group's
// ranks, every row in one batch, MegatronTS everywhere) within float rounding; each rank holds only its rows.
#include "model/mesh_harness.hpp"

#include "paradyse/comm/threads.hpp"
#include "paradyse/core/rng.hpp"
#include "paradyse/layout/chunking.hpp"
#include "paradyse/mesh/device_mesh.hpp"
#include "paradyse/model/gpt.hpp"
#include "paradyse/model/mesh_stage.hpp"
#include "paradyse/model/vocab_parallel.hpp"
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

namespace mesh_vocab_test {

using namespace paradyse;
using Strategies = MeshStrategies<>;
using Stage = MeshGptStage<Strategies, ThreadCommunicator>;

struct VocabMesh {
  int dp, pp, cp, tp;
  int tp_x = 0;       // > 0: the tp group is a tp_x x (tp / tp_x) grid running Tp2d (with cp: RingTp2d)
  int v = 1;          // virtual stages per pp rank
  bool zero3 = false;
  int layers = 3;     // uneven over pp (x v) stages
  std::int64_t rows = 3;  // uneven over dp; a multiple of pp with v > 1
  std::string name() const {
    return fmt::format("dp={},pp={},cp={},tp={}{}{}{}", dp, pp, cp, tp, tp_x ? fmt::format(" grid {}x{}", tp_x,
                       tp / tp_x) : "", v > 1 ? fmt::format(" v={}", v) : "", zero3 ? " ZeRO-3" : "");
  }
};

// The single group's whole embedding [V h] and head pack [(V + 2) h] gradients cut to the rows `rows` (and the final
// norm's two rows), as a rank sharding the vocabulary holds them.
testing::RankGradients vocab_rows_of(const testing::RankGradients& whole, const std::vector<ChunkRange>& rank_rows,
                                     std::int64_t vocab, std::int64_t h) {
  testing::RankGradients out = whole;
  for (auto& [key, values] : out) {
    const ChunkRange rows = rank_rows[std::size_t(key.first)];
    if (key.second != "embedding" && key.second != "head") continue;
    std::vector<float> part(values.begin() + std::ptrdiff_t(rows.start * h), values.begin() + std::ptrdiff_t(rows.end() * h));
    if (key.second == "head") part.insert(part.end(), values.begin() + std::ptrdiff_t(vocab * h), values.end());
    values = std::move(part);
  }
  return out;
}

void check_vocab_mesh(const GptConfig& base, const VocabMesh& m) {
  CAPTURE(m.name());
  GptConfig config = base;
  config.layers = m.layers;
  const std::int64_t seq = 24, h = config.layer.hidden;  // a multiple of the 2C zigzag chunks for C = 2, 3, 4
  const std::uint64_t seed = 31;
  const int group = m.cp * m.tp;
  const std::size_t ts = Strategies::index_of("MegatronTS");
  const std::size_t strategy = m.tp_x > 0 ? Strategies::index_of(m.cp > 1 ? "RingTp2d" : "Tp2d")
                               : m.cp > 1  ? Strategies::index_of("MegatronRing")
                                           : ts;
  Rng rng(5000 + std::uint64_t(m.dp * 1000 + m.pp * 100 + m.cp * 10 + m.tp) + (m.zero3 ? 7 : 0) + std::uint64_t(m.v));
  const testing::RandomRows batch = testing::random_rows(rng, m.rows * seq, config.vocab);
  const double counted = double(m.rows * seq);

  // The single group: the stage group's ranks, every row in one batch, MegatronTS everywhere.
  const StackPlan single(std::size_t(config.layers), SublayerChoice{ts, ts, 0});
  const testing::SingleGroupStep want =
      testing::single_group_step<Strategies>(config, group, seed, single, batch, m.rows, seq);
  std::vector<ChunkRange> rank_rows;  // by stage-group rank (tp innermost)
  for (int r = 0; r < group; ++r) rank_rows.push_back(vocab_rows(config.vocab, m.tp, r % m.tp));
  const testing::RankGradients want_rows = vocab_rows_of(want.gradients, rank_rows, config.vocab, h);

  const DeviceMesh mesh({{"dp", m.dp}, {"pp", m.pp}, {"cp", m.cp}, {"tp", m.tp}});
  std::vector<testing::RankGradients> got(std::size_t(m.dp));  // per replica (equal after the dp sum)
  std::mutex lock;
  double loss_sum = 0;
  const int stages = m.pp * m.v;
  run_ranks(mesh.size(), [&](ThreadCommunicator& world) {
    testing::MeshRank on = testing::MeshRank::on(mesh, world);
    ThreadCommunicator tp_group = mesh.group(world, {"tp"}), cp_group = mesh.group(world, {"cp"});
    const int rank = on.stage_rank;
    const auto chunk_layers = [&](int c) { return chunk_range(config.layers, stages, c * m.pp + on.stage_index); };
    std::vector<Stage> chunks;
    chunks.reserve(std::size_t(m.v));
    BufferPool pool;
    for (int c = 0; c < m.v; ++c) {
      chunks.emplace_back(config, c * m.pp + on.stage_index, stages, chunk_layers(c), group, rank, group, rank, seed);
      Stage& chunk = chunks.back();
      if (m.tp_x > 0) chunk.stack().set_tp_x(on.stage_group, m.tp_x);
      if (m.cp > 1) chunk.stack().set_tp_inner(on.stage_group, m.tp);
      chunk.shard_vocabulary(tp_group, cp_group);
      if (m.zero3) chunk.shard_over_dp(on.dp_group);
      const ChunkRange layers = chunk_layers(c);
      chunk.begin_step(on.stage_group, on.stage_group, pool,
                       StackPlan(std::size_t(layers.length), SublayerChoice{strategy, strategy, 0}), seq);
    }
    const ChunkRange mine = chunk_range(m.rows, m.dp, on.replica);
    const double loss = mesh_forward_backward(std::span(chunks), on.pp_group, on.stage_group, mine, seq, batch.inputs,
                                              batch.targets, float(1.0 / counted));
    testing::RankGradients& out = got[std::size_t(on.replica)];
    for (int c = 0; c < m.v; ++c) {
      Stage& chunk = chunks[std::size_t(c)];
      const ChunkRange rows = chunk.vocabulary_rows();
      CHECK(rows.start == rank_rows[std::size_t(rank)].start);
      CHECK(rows.length == rank_rows[std::size_t(rank)].length);
      const int first_layer = int(chunk_layers(c).start);
      if (m.zero3) {  // every tensor's gradient chunks gathered over dp (the sum over dp is in them already)
        const std::vector<std::vector<float>> full = testing::gathered_zero3(chunk, on.dp_group, true);
        const std::lock_guard guard(lock);
        std::size_t i = 0;
        for (int l = first_layer; l < first_layer + int(chunk.layers().length); ++l)
          for (const char* part : {"attention", "mlp", "norms"}) out[{rank, fmt::format("layer {} {}", l, part)}] = full[i++];
        if (chunk.first()) out[{rank, "embedding"}] = full[i++];
        if (chunk.last()) out[{rank, "head"}] = full[i++];
        continue;
      }
      for (const auto& p : chunk.parameters()) {
        on.dp_group.all_reduce(std::span<const float>(p.gradient->span()), p.gradient->span(), ReduceOp::sum);
        // Only this rank's vocabulary rows are held.
        if (chunk.first() && p.value == chunk.parameters().back().value && !chunk.last())
          CHECK(p.value->numel() == rows.length * h);
      }
      testing::add_layer_gradients(out, lock, rank, first_layer, chunk.stack().gradients());
      testing::add_stage_end_gradients(out, lock, rank, chunk);
    }
    const std::lock_guard guard(lock);
    loss_sum += loss;
  });
  CHECK(loss_sum / counted == doctest::Approx(want.loss).epsilon(1e-5));
  for (int d = 0; d < m.dp; ++d) {
    CAPTURE(d);
    testing::check_same_gradients(got[std::size_t(d)], want_rows);
  }
}

}  // namespace mesh_vocab_test

TEST_CASE("the vocabulary sharded over tp on the mesh (embedding and head rows V/tp per rank, uneven V) trains as the "
          "single group: tp = 2, 3, with dp, pp (and pp = 3, interleaved v = 2), cp x tp, a 2x2 grid, a 2x1 grid inside "
          "cp = 2 and 3 (RingTp2d, also with ZeRO-3) and ZeRO-3; the "
          "loss and every gradient of every rank") {
  using namespace mesh_vocab_test;
  GptConfig config;
  config.layer = LayerConfig::make(48, 12);  // heads divisible by every group (2, 3, 4), h by tp_x = 2
  config.layer.ffn = 96;
  config.layer.causal = config.layer.zigzag = config.layer.rope = true;
  config.vocab = 23;  // uneven over tp = 2 (12/11), 3 (8/8/7), 4 (6/6/6/5)
  for (const VocabMesh& m : {VocabMesh{1, 1, 1, 2}, VocabMesh{1, 1, 1, 3}, VocabMesh{2, 1, 1, 2},
                             VocabMesh{1, 2, 1, 2}, VocabMesh{1, 3, 1, 3, 0, 1, false, 4},
                             VocabMesh{1, 2, 1, 2, 0, 2, false, 5, 4}, VocabMesh{1, 1, 2, 2}, VocabMesh{2, 1, 2, 2},
                             VocabMesh{1, 1, 1, 4, 2}, VocabMesh{1, 1, 2, 2, 2}, VocabMesh{1, 1, 3, 2, 2},
                             VocabMesh{2, 1, 2, 2, 2, 1, true}, VocabMesh{2, 1, 1, 2, 0, 1, true},
                             VocabMesh{2, 2, 1, 2, 0, 1, true, 3, 4}})
    check_vocab_mesh(config, m);
}
