// Checkpoints of the training mesh (model/mesh_checkpoint.hpp) in the single group's format: a mesh run of
// dp = 2 x pp = 2 (ZeRO-1) trains two steps on fresh random rows and saves weights and AdamW moments; the file loads
// into other mesh shapes (pp = 3 uneven with tp = 2; dp = 2 x cp = 2 with ZeRO-3; dp = 3 with ZeRO-2, uneven chunks;
// dp = 2 x pp = 2 x cp = 2 with ZeRO-3 and 2 virtual stages) and into the single group's Gpt on 4 ranks, and:
//   1. saved again from there, every tensor (weights and both moments) and the step are the same bits (loading and
//      saving copy floats, never compute them); a Gpt checkpoint loads into a mesh the same way;
//   2. the loaded model's next two steps give the source run's losses: to the bit on the same mesh (and the same final
//      weights), and on another mesh within the float32 rounding of another reduction order (kCkptLossRtol below).
// With MoE layers (the second test case) the same on meshes of other ep and etp (model/expert_groups.hpp).
// With the vocabulary sharded over tp (the third: MeshGptStage::shard_vocabulary) the same from tp = 2 onto tp = 3 and 4
// (uneven rows), onto dp = 2 (whole rows), cp x tp and ZeRO-3 with pp.
#include "paradyse/comm/threads.hpp"
#include "paradyse/core/rng.hpp"
#include "paradyse/layout/chunking.hpp"
#include "paradyse/mesh/device_mesh.hpp"
#include "paradyse/model/checkpoint.hpp"
#include "paradyse/model/expert_groups.hpp"
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
  int v = 1;         // virtual stages per pp rank
  int ep = 0, etp = 0;  // with MoE layers (model/expert_groups.hpp; 0: all of dp x cp, all of tp)
  bool vocab_parallel = false;  // the embedding and head by vocabulary rows over tp (MeshGptStage::shard_vocabulary)
  std::string name() const {
    return fmt::format("dp={},pp={},cp={},tp={} {}{}{}{}", dp, pp, cp, tp, name_of(zero),
                       v > 1 ? fmt::format(" v={}", v) : std::string(),
                       ep > 0 || etp > 0 ? fmt::format(" ep={} etp={}", ep, etp) : std::string(),
                       vocab_parallel ? " vocab-parallel" : "");
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
  // With MoE layers: the experts over ep ranks of dp x cp, their columns over etp ranks of tp, replicated over edp.
  const bool moe = config.moe.has_value();
  const ExpertFolding folding = moe ? ExpertFolding{m.ep > 0 ? m.ep : m.dp * m.cp, m.etp > 0 ? m.etp : m.tp}
                                    : ExpertFolding{};
  run_ranks(mesh.size(), [&](ThreadCommunicator& world) {
    testing::MeshRank place = testing::MeshRank::on(mesh, world);
    ThreadCommunicator &dp_group = place.dp_group, &pp_group = place.pp_group, &cp_group = place.stage_group;
    const int replica = place.replica, stage_index = place.stage_index, cp_rank = place.stage_rank;
    std::optional<ExpertGroups<ThreadCommunicator>> experts;
    if (moe) experts.emplace(expert_groups(world, mesh, folding));
    const auto chunk_layers = [&](int c) { return chunk_range(config.layers, m.pp * m.v, c * m.pp + stage_index); };
    std::vector<CkptStage> chunks;
    chunks.reserve(std::size_t(m.v));
    for (int c = 0; c < m.v; ++c) {
      chunks.emplace_back(config, c * m.pp + stage_index, m.pp * m.v, chunk_layers(c), group, cp_rank,
                          moe ? folding.ep : group, moe ? experts->ep_rank : cp_rank, 7, moe && m.tp > 1,
                          moe ? folding.etp : 0);
      if (moe) {
        chunks.back().set_expert_replicas(experts->edp);
        chunks.back().set_expert_column_group(experts->etp);
      }
    }
    ThreadCommunicator tp_group = mesh.group(world, {"tp"}), cp_only = mesh.group(world, {"cp"});
    if (m.vocab_parallel)
      for (CkptStage& chunk : chunks) chunk.shard_vocabulary(tp_group, cp_only);
    if (m.zero == ZeroStage::three)
      for (CkptStage& chunk : chunks) chunk.shard_over_dp(dp_group);
    std::vector<MeshOptimizer> optimizers;
    for (CkptStage& chunk : chunks)
      optimizers.emplace_back(chunk, m.zero, m.dp, replica, adamw, moe ? int(experts->edp.size()) : 1,
                              moe ? experts->edp_rank : 0);
    if (!load.empty()) {
      const std::int64_t step = load_mesh_checkpoint(mesh, world.rank(), std::span(chunks), std::span(optimizers), load,
                                                     {.optimizer_state = true}, folding);
      CHECK(step == first);
    }
    BufferPool pool;
    const ChunkRange mine = chunk_range(batches.rows, m.dp, replica);
    for (int k = first; k < end; ++k) {
      for (int c = 0; c < m.v; ++c) {
        const ChunkRange layers = chunk_layers(c);
        chunks[std::size_t(c)].begin_step(cp_group, moe ? experts->ep : cp_group, pool,
                                          StackPlan(plan.begin() + layers.start, plan.begin() + layers.end()),
                                          batches.seq);
      }
      const double loss = mesh_forward_backward(std::span(chunks), pp_group, cp_group, mine, batches.seq,
                                                batches.inputs[std::size_t(k)], batches.targets[std::size_t(k)],
                                                float(1.0 / counted));
      for (MeshOptimizer& optimizer : optimizers)
        optimizer.step(dp_group, moe ? experts->edp : dp_group, adamw.learning_rate, k + 1);
      const std::lock_guard guard(lock);
      losses[std::size_t(k - first)] += loss / counted;
    }
    if (!save.empty())
      save_mesh_checkpoint(mesh, world, dp_group, cp_group, std::span(chunks), std::span(optimizers), end, save,
                           {.optimizer_state = true, .extra = {}}, moe ? &*experts : nullptr);
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

// The checkpoint `step2` (saved after step 2 of the run whose losses are `straight`) loaded on mesh `m`: saved again
// to `again` with no step between, the same bits; with `continues` (the same micro-batches as the source), the next
// two steps give the source run's losses within the float rounding of another reduction order.
void ckpt_check_on(const GptConfig& config, const CkptMesh& m, const CkptBatches& batches,
                   const std::vector<double>& straight, const std::string& step2, const std::string& again,
                   bool continues) {
  CAPTURE(m.name());
  (void)ckpt_mesh_run(config, m, batches, 2, 2, step2, again);
  ckpt_same_tensors(m.name(), step2, again);
  if (!continues) return;
  const std::vector<double> resumed = ckpt_mesh_run(config, m, batches, 2, 4, step2, "");
  for (int k = 0; k < 2; ++k) {
    const double want = straight[std::size_t(k + 2)], got = resumed[std::size_t(k)];
    MESSAGE(m.name(), ": step ", k + 2, " loss ", got, " against ", want, " (relative gap ",
            std::abs(got - want) / want, ")");
    CHECK(std::abs(got - want) <= kCkptLossRtol * want);
  }
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
                               CkptMesh{3, 1, 1, 1, ZeroStage::two}, CkptMesh{2, 2, 2, 1, ZeroStage::three, 2}})
      ckpt_check_on(config, m, batches, straight, file("step2.safetensors"), file("again.safetensors"), true);
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

TEST_CASE("mesh checkpoints with MoE layers: saved on dp = 2 over ep = 1 (the experts replicated over edp = 2, ZeRO-1 "
          "over it), loaded on other shapes and ep / etp (the experts over cp, columns over tp, edp over tp, ZeRO 0 to "
          "3, pp stages) and into the single group's Gpt: the same bits saved again; the runs of one micro-batch per "
          "replica continue with the source run's losses") {
  GptConfig config;
  config.layer = LayerConfig::make(40, 4);
  config.layer.causal = config.layer.zigzag = config.layer.rope = true;
  config.layer.norm = NormKind::rms_norm;
  config.layer.activation = Activation::swiglu;
  config.vocab = 23;
  config.layers = 4;
  MoeConfig moe;
  moe.hidden = 40;
  moe.experts = 5;  // uneven over ep = 2 and 4
  moe.top_k = 2;
  moe.expert_ffn = 10;
  moe.norm_topk_prob = true;
  moe.shared_experts = 1;
  moe.shared_ffn = 6;
  moe.shared_gate = true;
  moe.aux_loss_coef = 0.1;
  moe.z_loss_coef = 0.01;
  config.moe = MoeLayers{moe, 1};
  CkptBatches batches{8, 12, {}, {}};
  Rng rng(2027);
  for (int k = 0; k < 4; ++k) {
    batches.inputs.emplace_back();
    batches.targets.emplace_back();
    for (std::int64_t i = 0; i < batches.rows * batches.seq; ++i) {
      batches.inputs.back().push_back(std::int32_t(rng.next_u64() % std::uint64_t(config.vocab)));
      batches.targets.back().push_back(std::int32_t(rng.next_u64() % std::uint64_t(config.vocab)));
    }
  }
  const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                    fmt::format("paradyse_mesh_checkpoint_moe_{}", ::getpid());
  std::filesystem::create_directories(dir);
  const auto file = [&](const std::string& name) { return (dir / name).string(); };

  const CkptMesh source{2, 1, 1, 1, ZeroStage::one, 1, 1, 0};
  const std::vector<double> straight = ckpt_mesh_run(config, source, batches, 0, 4, "", file("straight.safetensors"));
  (void)ckpt_mesh_run(config, source, batches, 0, 2, "", file("step2.safetensors"));
  // {dp, pp, cp, tp, zero, v, ep, etp}: without pp every replica's rows are one micro-batch, as the source's, so the
  // losses continue; with pp (one row per micro-batch) only the bits are compared. ZeRO-3 with edp > 1 (dp = 2 x
  // pp = 2 over ep = 1; dp = 2 x tp = 2 over ep = 1, etp = 1: edp = 4) shards the MoE tensors over edp.
  for (const CkptMesh& m : {CkptMesh{2, 1, 1, 1, ZeroStage::one, 1, 1, 0}, CkptMesh{1, 1, 2, 1, ZeroStage::three},
                             CkptMesh{2, 1, 1, 2, ZeroStage::two, 1, 1, 1}, CkptMesh{4, 1, 1, 1, ZeroStage::zero, 1, 2, 0},
                             CkptMesh{2, 1, 1, 2, ZeroStage::three, 1, 2, 2}, CkptMesh{2, 2, 1, 1, ZeroStage::three, 1, 1, 0},
                             CkptMesh{1, 2, 1, 2, ZeroStage::zero, 1, 0, 2}, CkptMesh{2, 1, 1, 2, ZeroStage::three, 1, 1, 1}})
    ckpt_check_on(config, m, batches, straight, file("step2.safetensors"), file("again.safetensors"), m.pp == 1);
  // The single group's MoE Gpt on 2 ranks loads the mesh's file and saves the same bits.
  run_ranks(2, [&](ThreadCommunicator& comm) {
    Gpt<AllStrategies<>> model(config, 2, comm.rank(), 99);
    load_checkpoint(model, file("step2.safetensors"), {.optimizer_state = true});
    save_checkpoint(comm, model, file("gpt.safetensors"), {.optimizer_state = true, .extra = {}});
  });
  ckpt_same_tensors("MoE Gpt on 2 ranks", file("step2.safetensors"), file("gpt.safetensors"));
  std::filesystem::remove_all(dir);
}

TEST_CASE("mesh checkpoints with the vocabulary sharded over tp: saved on tp = 2 (12 + 11 rows of V = 23), resumed to "
          "the bit there, loaded on tp = 3 (8 + 8 + 7), on dp = 2 (whole rows), cp x tp and ZeRO-3 with pp, and into "
          "the single group's Gpt: the same bits saved again, the loaded runs continue with the source run's losses") {
  GptConfig config;
  config.layer = LayerConfig::make(48, 12);  // heads divisible by tp = 2, 3, 4
  config.layer.causal = config.layer.zigzag = config.layer.rope = true;
  config.vocab = 23;
  config.layers = 3;
  CkptBatches batches{4, 24, {}, {}};  // 24: a multiple of the zigzag chunks of 2, 3 and 4 ranks
  Rng rng(2028);
  for (int k = 0; k < 4; ++k) {
    const testing::RandomRows step = testing::random_rows(rng, batches.rows * batches.seq, config.vocab);
    batches.inputs.push_back(step.inputs);
    batches.targets.push_back(step.targets);
  }
  const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                    fmt::format("paradyse_mesh_checkpoint_vocab_{}", ::getpid());
  std::filesystem::create_directories(dir);
  const auto file = [&](const std::string& name) { return (dir / name).string(); };
  const auto sharded = [](CkptMesh m) {
    m.vocab_parallel = true;
    return m;
  };

  const CkptMesh source = sharded({1, 1, 1, 2, ZeroStage::zero});
  const std::vector<double> straight = ckpt_mesh_run(config, source, batches, 0, 4, "", file("straight.safetensors"));
  (void)ckpt_mesh_run(config, source, batches, 0, 2, "", file("step2.safetensors"));
  const std::vector<double> resumed = ckpt_mesh_run(config, source, batches, 2, 4, file("step2.safetensors"),
                                                    file("resumed.safetensors"));
  CHECK(resumed[0] == straight[2]);
  CHECK(resumed[1] == straight[3]);
  ckpt_same_tensors("tp=2 resumed against straight", file("straight.safetensors"), file("resumed.safetensors"));
  for (const CkptMesh& m : {sharded({1, 1, 1, 3, ZeroStage::zero}), CkptMesh{2, 1, 1, 1, ZeroStage::one},
                            sharded({1, 1, 2, 2, ZeroStage::two}), sharded({2, 2, 1, 2, ZeroStage::three}),
                            sharded({1, 1, 1, 4, ZeroStage::zero})})
    ckpt_check_on(config, m, batches, straight, file("step2.safetensors"), file("again.safetensors"), true);
  run_ranks(2, [&](ThreadCommunicator& comm) {
    Gpt<AllStrategies<>> model(config, 2, comm.rank(), 99);
    load_checkpoint(model, file("step2.safetensors"), {.optimizer_state = true});
    save_checkpoint(comm, model, file("gpt.safetensors"), {.optimizer_state = true, .extra = {}});
  });
  ckpt_same_tensors("Gpt on 2 ranks", file("step2.safetensors"), file("gpt.safetensors"));
  std::filesystem::remove_all(dir);
}
