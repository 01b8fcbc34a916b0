// Checkpoints of the training mesh (model/mesh_checkpoint.hpp) in the single group's format: a mesh run of
// dp = 2 x pp = 2 (ZeRO-1) trains two steps on fresh random rows and saves weights and AdamW moments; the file loads
// into other mesh shapes (pp = 3 uneven with tp = 2; dp = 2 x cp = 2 with ZeRO-3; dp = 3 with ZeRO-2, uneven chunks;
// dp = 2 x pp = 2 x cp = 2 with ZeRO-3 and 2 virtual stages) and into the single group's Gpt on 4 ranks, and:
//   1. saved again from there, every tensor (weights and both moments) and the step are the same bits (loading and
//      saving copy floats, never compute them); a Gpt checkpoint loads into a mesh the same way;
//   2. the loaded model's next two steps give the source run's losses: to the bit on the same mesh (and the same final
//      weights), and on another mesh within the float32 rounding of another reduction order (kCkptLossRtol below).
#include "paradyse/comm/threads.hpp"
#include "paradyse/core/rng.hpp"
#include "paradyse/layout/chunking.hpp"
#include "paradyse/mesh/device_mesh.hpp"
#include "paradyse/model/checkpoint.hpp"
#include "paradyse/model/mesh_checkpoint.hpp"
#include "paradyse/model/mesh_optimizer.hpp"
#include "paradyse/model/mesh_stage.hpp"
#include "paradyse/model/safetensors.hpp"
#include "paradyse/strategy/strategies.hpp"
#include "mesh_harness.hpp"

#include <doctest/doctest.h>
#include <fmt/format.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <unistd.h>

namespace {

using namespace paradyse;
using CkptStage = MeshGptStage<AllStrategies<>, ThreadCommunicator>;

// The loss of the same weights on the same rows, summed in another order (cp/tp shards of each GEMM and of the
// attention, other pipeline cuts): every activation is a float32 sum of at most h = 40 products per layer, so each
// reassociation moves it by at most ~40 ulp-sized steps of 2^-24 relative (2.4e-6); through 4 layers and the
// log-softmax that stays below 1e-5 of the loss. Two training steps later the weights themselves differ by AdamW's
// response to those rounded gradients; we allow the same bound (the worst gap measured is printed).
constexpr double kCkptLossRtol = 1e-5;

struct CkptMesh {
  int dp, pp, cp, tp;
  ZeroStage zero;
  int v = 1;  // virtual stages per pp rank
  std::string name() const {
    return fmt::format("dp={},pp={},cp={},tp={} {}{}", dp, pp, cp, tp, name_of(zero),
                       v > 1 ? fmt::format(" v={}", v) : std::string());
  }
};

struct CkptBatches {
  std::int64_t rows, seq;
  std::vector<std::vector<std::int32_t>> inputs, targets;  // per step: [rows, seq]
};

// Runs steps [first, end) of `batches` on the mesh `m` (from the seed's weights, or loaded from `load` with the
// optimizer state), then saves to `save` (when given). Returns each step's loss.
std::vector<double> ckpt_mesh_run(const GptConfig& config, const CkptMesh& m, const CkptBatches& batches, int first, int end,
                             const std::string& load, const std::string& save) {
  const DeviceMesh mesh({{"dp", m.dp}, {"pp", m.pp}, {"cp", m.cp}, {"tp", m.tp}});
  const int group = m.cp * m.tp;
  const std::size_t strategy = AllStrategies<>::index_of(m.tp > 1 || group == 1 ? "MegatronTS" : "UlyssesZ");
  const StackPlan plan(std::size_t(config.layers), SublayerChoice{strategy, strategy, 0});
  std::vector<double> losses(std::size_t(end - first), 0.0);
  std::mutex lock;
  const double counted = double(batches.rows * batches.seq);
  const ops::AdamWConfig adamw{.learning_rate = 0.02f, .weight_decay = 0.1f};
  run_ranks(mesh.size(), [&](ThreadCommunicator& world) {
    testing::MeshRank place = testing::MeshRank::on(mesh, world);
    ThreadCommunicator &dp_group = place.dp_group, &pp_group = place.pp_group, &cp_group = place.stage_group;
    const int replica = place.replica, stage_index = place.stage_index, cp_rank = place.stage_rank;
    const auto chunk_layers = [&](int c) { return chunk_range(config.layers, m.pp * m.v, c * m.pp + stage_index); };
    std::vector<CkptStage> chunks;
    chunks.reserve(std::size_t(m.v));
    for (int c = 0; c < m.v; ++c)
      chunks.emplace_back(config, c * m.pp + stage_index, m.pp * m.v, chunk_layers(c), group, cp_rank, group, cp_rank, 7);
    if (m.zero == ZeroStage::three)
      for (CkptStage& chunk : chunks) chunk.shard_over_dp(dp_group);
    std::vector<MeshOptimizer> optimizers;
    for (CkptStage& chunk : chunks) optimizers.emplace_back(chunk, m.zero, m.dp, replica, adamw);
    if (!load.empty()) {
      const std::int64_t step = load_mesh_checkpoint(mesh, world.rank(), std::span(chunks), std::span(optimizers), load,
                                                     {.optimizer_state = true});
      CHECK(step == first);
    }
    BufferPool pool;
    const ChunkRange mine = chunk_range(batches.rows, m.dp, replica);
    for (int k = first; k < end; ++k) {
      for (int c = 0; c < m.v; ++c) {
        const ChunkRange layers = chunk_layers(c);
        chunks[std::size_t(c)].begin_step(cp_group, cp_group, pool,
                                          StackPlan(plan.begin() + layers.start, plan.begin() + layers.end()),
                                          batches.seq);
      }
      const double loss = mesh_forward_backward(std::span(chunks), pp_group, cp_group, mine, batches.seq,
                                                batches.inputs[std::size_t(k)], batches.targets[std::size_t(k)],
                                                float(1.0 / counted));
      for (MeshOptimizer& optimizer : optimizers) optimizer.step(dp_group, adamw.learning_rate, k + 1);
      const std::lock_guard guard(lock);
      losses[std::size_t(k - first)] += loss / counted;
    }
    if (!save.empty())
      save_mesh_checkpoint(mesh, world, dp_group, cp_group, std::span(chunks), std::span(optimizers), end, save,
                           {.optimizer_state = true, .extra = {}});
  });
  return losses;
}

// Every tensor of a checkpoint by name, and its step.
struct CkptFileTensors {
  std::map<std::string, std::vector<float>> tensors;
  std::string step;
};
CkptFileTensors ckpt_read_all(const std::string& path) {
  const safetensors::File file(path, O_RDONLY);
  const safetensors::Header header = safetensors::read_header(file);
  CkptFileTensors out;
  for (const safetensors::TensorEntry& e : header.tensors) {
    std::vector<float> values(std::size_t(e.numel()));
    file.read_at(values.data(), e.end - e.begin, header.data_start + e.begin);
    out.tensors[e.name] = std::move(values);
  }
  out.step = *header.meta("step");
  return out;
}

// Fails unless the two files hold the same tensors, bit for bit, and the same step.
void ckpt_same_tensors(const std::string& label, const std::string& want_path, const std::string& got_path) {
  CAPTURE(label);
  const CkptFileTensors want = ckpt_read_all(want_path), got = ckpt_read_all(got_path);
  CHECK(got.step == want.step);
  REQUIRE(got.tensors.size() == want.tensors.size());
  bool moments_nonzero = false;
  for (const auto& [name, values] : want.tensors) {
    CAPTURE(name);
    REQUIRE(got.tensors.count(name) == 1);
    const std::vector<float>& other = got.tensors.at(name);
    REQUIRE(other.size() == values.size());
    CHECK(std::memcmp(other.data(), values.data(), values.size() * sizeof(float)) == 0);
    if (name.rfind("adamw.v.", 0) == 0)
      for (float x : values) moments_nonzero = moments_nonzero || x != 0.0f;
  }
  CHECK(moments_nonzero);  // the comparison covers trained moments, not zeros
}

}  // namespace

TEST_CASE("mesh checkpoints: saved on one mesh shape, loaded on others and into the single group's Gpt, the same "
          "bits saved again; the loaded run continues with the source run's losses") {
  GptConfig config;
  config.layer = LayerConfig::make(40, 4);  // uneven chunks over dp = 3; pp = 3 cuts 4 layers 2 + 1 + 1
  config.layer.causal = config.layer.zigzag = config.layer.rope = true;
  config.vocab = 23;
  config.layers = 4;
  CkptBatches batches{12, 12, {}, {}};
  Rng rng(2026);
  for (int k = 0; k < 4; ++k) {
    batches.inputs.emplace_back();
    batches.targets.emplace_back();
    for (std::int64_t i = 0; i < batches.rows * batches.seq; ++i) {
      batches.inputs.back().push_back(std::int32_t(rng.next_u64() % std::uint64_t(config.vocab)));
      batches.targets.back().push_back(std::int32_t(rng.next_u64() % std::uint64_t(config.vocab)));
    }
  }
  const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                    fmt::format("paradyse_mesh_checkpoint_{}", ::getpid());
  std::filesystem::create_directories(dir);
  const auto file = [&](const std::string& name) { return (dir / name).string(); };

  const CkptMesh source{2, 2, 1, 1, ZeroStage::one};
  const std::vector<double> straight = ckpt_mesh_run(config, source, batches, 0, 4, "", file("straight.safetensors"));
  const std::vector<double> first_two = ckpt_mesh_run(config, source, batches, 0, 2, "", file("step2.safetensors"));
  CHECK(first_two[0] == straight[0]);
  CHECK(first_two[1] == straight[1]);

  SUBCASE("the same mesh resumes to the bit: losses and final weights and moments") {
    const std::vector<double> resumed = ckpt_mesh_run(config, source, batches, 2, 4, file("step2.safetensors"),
                                                 file("resumed.safetensors"));
    CHECK(resumed[0] == straight[2]);
    CHECK(resumed[1] == straight[3]);
    ckpt_same_tensors("resumed against straight", file("straight.safetensors"), file("resumed.safetensors"));
  }
  SUBCASE("other mesh shapes and the single group's Gpt") {
    for (const CkptMesh& m : {CkptMesh{1, 3, 1, 2, ZeroStage::zero}, CkptMesh{2, 1, 2, 1, ZeroStage::three},
                               CkptMesh{3, 1, 1, 1, ZeroStage::two}, CkptMesh{2, 2, 2, 1, ZeroStage::three, 2}}) {
      CAPTURE(m.name());
      // 1. loaded and saved again (no step between): the same bits.
      (void)ckpt_mesh_run(config, m, batches, 2, 2, file("step2.safetensors"), file("again.safetensors"));
      ckpt_same_tensors(m.name(), file("step2.safetensors"), file("again.safetensors"));
      // 2. the next two steps: the source run's losses within float rounding.
      const std::vector<double> resumed = ckpt_mesh_run(config, m, batches, 2, 4, file("step2.safetensors"), "");
      for (int k = 0; k < 2; ++k) {
        const double want = straight[std::size_t(k + 2)], got = resumed[std::size_t(k)];
        MESSAGE(m.name(), ": step ", k + 2, " loss ", got, " against ", want, " (relative gap ",
                std::abs(got - want) / want, ")");
        CHECK(std::abs(got - want) <= kCkptLossRtol * want);
      }
    }
    // The single group's Gpt on 4 ranks: loads the mesh's file, saves the same bits; and its file loads into a mesh.
    run_ranks(4, [&](ThreadCommunicator& comm) {
      Gpt<AllStrategies<>> model(config, 4, comm.rank(), 99);
      load_checkpoint(model, file("step2.safetensors"), {.optimizer_state = true});
      save_checkpoint(comm, model, file("gpt.safetensors"), {.optimizer_state = true, .extra = {}});
    });
    ckpt_same_tensors("Gpt on 4 ranks", file("step2.safetensors"), file("gpt.safetensors"));
    (void)ckpt_mesh_run(config, CkptMesh{1, 2, 2, 1, ZeroStage::zero}, batches, 2, 2, file("gpt.safetensors"),
                   file("from_gpt.safetensors"));
    ckpt_same_tensors("Gpt's file into dp=1,pp=2,cp=2", file("gpt.safetensors"), file("from_gpt.safetensors"));
  }
  std::filesystem::remove_all(dir);
}
