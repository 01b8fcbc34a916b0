// MoE layers inside the training mesh's pipeline stages (model/mesh_stage.hpp), as train_gpt --mesh dp=..,pp=..,cp=..
// --experts runs them: each pp stage's MoE layers over its own expert group, the dp x cp ranks of that stage (ep = dp x
// cp, the stage's all-to-alls inside it), the attention in each cp group, one row per micro-batch through 1F1B (or the
// interleaved schedule with v = 2 chunks), every replica running as many micro-batches. The router losses (aux, z)
// enter as their mean over the step's micro-batches.
//
// The reference is the single cp group (Gpt on C ranks, the experts over those C ranks) running the same
// micro-batches, micro-batch i being the i-th row of every replica, each as one forward_backward, its gradients
// accumulated and then divided by the micro-batch count (the mean over micro-batches of each one's loss: cross-entropy
// plus router losses). On fresh random rows: the step's loss and every gradient of every rank of the mesh (each
// layer's attention, dense MLP and norm shards summed over dp; each MoE layer's router, shared experts and gate, and
// each expert's two matrices by global expert index, whichever rank owns it; the embedding, the head and the final
// norm) equal the reference's within float rounding. Meshes: dp = 2 x pp = 2 (uneven stages, a dense first layer),
// pp = 2 x cp = 2, dp = 2 x pp = 2 x cp = 2 (8 ranks, 7 experts uneven over ep = 4), dp = 2 x pp = 3 (a first stage of
// dense layers only), dp = 2 x pp = 2 x v = 2 (interleaved, 5 layers), and dp = 2 x cp = 2 without stages (uneven
// rows over dp: the one micro-batch of each replica). Expert data parallelism (model/expert_groups.hpp): ep < dp x cp
// (ep = 1 and 2 of dp x cp = 4, with pp, interleaving and uneven rows) and etp < tp (etp = 1 of tp = 2, etp = 1 and 2
// of tp = 4, alone and with ep < dp), against the same single group; tp inside cp (cp = 2 x tp = 2: MegatronRing in
// the mesh, the five in the single group); 2-D tp (a tp_x x tp_y grid: Tp2d in the mesh, etp a factor of the grid);
// and ZeRO 1, 2 and 3 against ZeRO-0 with ep < dp x cp.
#include "paradyse/comm/threads.hpp"
#include "paradyse/core/rng.hpp"
#include "paradyse/layout/chunking.hpp"
#include "paradyse/mesh/device_mesh.hpp"
#include "paradyse/model/expert_groups.hpp"
#include "paradyse/model/gpt.hpp"
#include "paradyse/model/mesh_optimizer.hpp"
#include "paradyse/model/mesh_stage.hpp"
#include "paradyse/moe/expert_columns.hpp"
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

namespace mesh_experts_test {

using namespace paradyse;
using Strategies = MeshStrategies<>;  // the five, and MegatronRing for tp inside cp

// Every copy of every gradient, by name: a tensor replicated over ranks is recorded once per rank that holds it, and
// every copy must match the reference.
using Copies = std::map<std::string, std::vector<std::vector<float>>>;

void record(Copies& out, const std::string& name, std::span<const float> values) {
  out[name].emplace_back(values.begin(), values.end());
}

// The gradients of a stack whose first layer is global layer `first_layer`, on cp (or tp) rank `cp_rank` and expert
// rank `ep_rank` of `ep_size`; each expert and the shared experts by their columns over `etp` ranks: the stack holds
// etp rank `etp_rank`'s columns, or (etp_rank = -1) whole experts, recorded as every etp rank's columns.
void record_stack(Copies& out, TransformerStack<Strategies>& stack, const MoeConfig& moe, int first_layer, int cp_rank,
                  int ep_size, int ep_rank, int etp = 1, int etp_rank = -1) {
  for (std::size_t l = 0; l < stack.gradients().size(); ++l) {
    const int layer = first_layer + int(l);
    const LayerWeights& g = stack.gradients()[l];
    record(out, fmt::format("cp {} layer {} attention", cp_rank, layer), g.attention.packed.span());
    record(out, fmt::format("cp {} layer {} norms", cp_rank, layer), g.norms.packed.span());
    if (!stack.is_moe_layer(int(l))) {
      record(out, fmt::format("cp {} layer {} mlp", cp_rank, layer), g.mlp.packed.span());
      continue;
    }
    const MoeShard& m = stack.moe_gradients()[l];
    record(out, fmt::format("layer {} router", layer), m.router.span());
    record(out, fmt::format("layer {} shared_gate", layer), m.shared_gate.span());
    const ChunkRange owned = owned_experts(moe, ep_size, ep_rank);
    for (int t = 0; t < etp; ++t) {
      if (etp_rank >= 0 && t != etp_rank) continue;
      const MoeShard columns = etp_rank >= 0 ? MoeShard{Tensor<float>::copy_of(m.router.view()),
                                                        Tensor<float>::copy_of(m.expert_in.view()),
                                                        Tensor<float>::copy_of(m.expert_out.view()),
                                                        Tensor<float>::copy_of(m.shared_in.view()),
                                                        Tensor<float>::copy_of(m.shared_out.view()),
                                                        Tensor<float>::copy_of(m.shared_gate.view())}
                                             : etp_columns(m, moe, etp, t);
      record(out, fmt::format("layer {} shared_in tp {}", layer, t), columns.shared_in.span());
      record(out, fmt::format("layer {} shared_out tp {}", layer, t), columns.shared_out.span());
      const std::int64_t f_t = columns.expert_out.extent(1);
      const std::size_t in = std::size_t(2 * f_t * moe.hidden), out_size = std::size_t(f_t * moe.hidden);
      for (std::int64_t e = 0; e < owned.length; ++e) {
        record(out, fmt::format("layer {} expert {} in tp {}", layer, owned.start + e, t),
               columns.expert_in.span().subspan(std::size_t(e) * in, in));
        record(out, fmt::format("layer {} expert {} out tp {}", layer, owned.start + e, t),
               columns.expert_out.span().subspan(std::size_t(e) * out_size, out_size));
      }
    }
  }
}

void scale_all(TransformerStack<Strategies>& stack, Tensor<float>& replicated, float scale) {
  const auto times = [&](Tensor<float>& t) {
    for (float& x : t.span()) x *= scale;
  };
  for (LayerWeights& g : stack.gradients()) {
    times(g.attention.packed);
    times(g.mlp.packed);
    times(g.norms.packed);
  }
  for (MoeShard& m : stack.moe_gradients())
    for (Tensor<float>* t : {&m.router, &m.expert_in, &m.expert_out, &m.shared_in, &m.shared_out, &m.shared_gate}) times(*t);
  times(replicated);
}

struct Mesh {
  int dp, pp, cp, v;
  int layers, first_dense;
  std::int64_t experts;
  std::int64_t rows;  // a multiple of dp with pp > 1 (every replica runs as many micro-batches)
  int ep = 0;         // the expert group: ep consecutive ranks of dp x cp (0: all of dp x cp; edp = dp x cp / ep)
  int etp = 0;        // each expert's columns over etp consecutive ranks of tp (0: all of tp)
  int tp_x = 0;       // > 1: the tp group is a tp_x x (tp / tp_x) grid running Tp2d (2-D tensor parallelism)
};


}  // namespace mesh_experts_test

namespace mesh_experts_test {

// The mesh {dp, pp, cp, tp} (cp or tp 1) against the single group of cp x tp ranks, as the first test case says. With
// tp > 1 the group runs MegatronTS everywhere and each expert is split by columns over it (etp = tp, ep = dp).
void check_experts_in_mesh(const Mesh& m, int tp) {
  CAPTURE(m.dp);
  CAPTURE(m.pp);
  CAPTURE(m.cp);
  CAPTURE(tp);
  CAPTURE(m.v);
  CAPTURE(m.layers);
  const int group = m.cp * tp, etp = m.etp > 0 ? m.etp : tp;
  const bool ring = m.cp > 1 && tp > 1;  // tp inside cp: the mesh's stage group runs MegatronRing
  const bool grid = m.tp_x > 1;          // 2-D tp: the mesh's stage group runs Tp2d
  REQUIRE((!grid || (m.cp == 1 && tp % m.tp_x == 0)));
  CAPTURE(etp);
  CAPTURE(m.tp_x);
  const std::int64_t seq = group == 4 ? 16 : 12;  // divisible by 2 x the group for the zigzag layout
  const std::uint64_t seed = 41;
  GptConfig config;
  config.layer = LayerConfig::make(48, group == 4 ? 8 : 6);  // heads divisible by the group
  config.layer.causal = config.layer.zigzag = config.layer.rope = true;
  config.layer.norm = NormKind::rms_norm;
  config.layer.activation = Activation::swiglu;
  config.vocab = 23;
  config.layers = m.layers;
  MoeConfig moe;
  moe.hidden = 48;
  moe.experts = m.experts;
  moe.top_k = 2;
  moe.expert_ffn = 13;  // uneven columns over tp = 2 and 3
  moe.norm_topk_prob = true;
  moe.shared_experts = 1;
  moe.shared_ffn = 5;
  moe.shared_gate = true;
  moe.aux_loss_coef = 0.3;  // large enough that a wrong weighting of the router losses shows
  moe.z_loss_coef = 0.05;
  config.moe = MoeLayers{moe, m.first_dense};
  const int ep = m.ep > 0 ? m.ep : m.dp * m.cp, edp = m.dp * m.cp / ep;
  CAPTURE(ep);
  REQUIRE(ep * edp == m.dp * m.cp);
  // Per layer: the attention strategies alternate (MegatronTS everywhere with tp), the MoE layers alternate
  // ExpertParallel / ExpertTensorParallel.
  StackPlan plan;
  for (int l = 0; l < m.layers; ++l) {
    const std::size_t attention = Strategies::index_of(tp > 1 && !ring ? "MegatronTS" : l % 2 == 0 ? "UlyssesZ" : "MegatronCZ");
    plan.push_back({attention, Strategies::index_of(tp > 1 && !ring ? "MegatronTS" : "METP"), std::size_t(l % 2)});
  }
  // The mesh's plan: the same, or with tp inside cp MegatronRing (with a 2-D grid Tp2d) in every attention and dense
  // MLP (the single group keeps the five).
  StackPlan mesh_plan = plan;
  if (ring || grid)
    for (SublayerChoice& choice : mesh_plan)
      choice.attention = choice.mlp = Strategies::index_of(ring ? "MegatronRing" : "Tp2d");
  Rng rng(700 + std::uint64_t(m.v * 10000 + tp * 1000 + m.dp * 100 + m.pp * 10 + m.cp));
  std::vector<std::int32_t> inputs, targets;
  for (std::int64_t i = 0; i < m.rows * seq; ++i) {
    inputs.push_back(std::int32_t(rng.next_u64() % std::uint64_t(config.vocab)));
    targets.push_back(std::int32_t(rng.next_u64() % std::uint64_t(config.vocab)));
  }
  const double counted = double(m.rows * seq);
  const SequenceLayout layout(seq, group, config.layer.zigzag);
  // The micro-batches: with stages, micro-batch i is row i of every replica; without, all rows at once.
  std::vector<std::vector<std::int64_t>> micro;
  if (m.pp > 1) {
    REQUIRE(m.rows % m.dp == 0);
    for (std::int64_t i = 0; i < m.rows / m.dp; ++i) {
      micro.emplace_back();
      for (int d = 0; d < m.dp; ++d) micro.back().push_back(chunk_range(m.rows, m.dp, d).start + i);
    }
  } else {
    micro.emplace_back();
    for (std::int64_t r = 0; r < m.rows; ++r) micro.back().push_back(r);
  }
  const int M = int(micro.size());
  std::mutex lock;

  // The single group, micro-batch by micro-batch.
  Copies want;
  double want_loss = 0;
  run_ranks(group, [&](ThreadCommunicator& comm) {
    const int r = comm.rank();
    Gpt<Strategies> model(config, group, r, seed);
    BufferPool pool;
    model.zero_gradients();
    double loss = 0;
    for (const std::vector<std::int64_t>& rows : micro) {
      std::vector<std::int32_t> x, y;
      for (const std::int64_t row : rows) {
        x.insert(x.end(), inputs.begin() + row * seq, inputs.begin() + (row + 1) * seq);
        y.insert(y.end(), targets.begin() + row * seq, targets.begin() + (row + 1) * seq);
      }
      const std::int64_t b = std::int64_t(rows.size());
      const Tensor<std::int32_t> xs = shard_tokens(x, b, layout, r), ys = shard_tokens(y, b, layout, r);
      loss += model.forward_backward(comm, pool, plan, seq, xs.view(), ys.view()).loss / M;
    }
    scale_all(model.stack(), model.replicated_gradient(), 1.0f / float(M));
    const std::lock_guard guard(lock);
    record_stack(want, model.stack(), moe, 0, r, group, r, etp, -1);
    const std::span<const float> g = model.replicated_gradient().span();  // embedding [V, h], head [V + 2, h]
    const std::size_t embedding = std::size_t(config.vocab * config.layer.hidden);
    record(want, "embedding", g.first(embedding));
    record(want, "head", g.subspan(embedding));
    if (r == 0) want_loss = loss;
  });

  // The mesh {dp, pp, cp, tp}, as train_mesh builds it.
  const DeviceMesh mesh({{"dp", m.dp}, {"pp", m.pp}, {"cp", m.cp}, {"tp", tp}});
  Copies got;
  double loss_sum = 0;
  run_ranks(mesh.size(), [&](ThreadCommunicator& world) {
    testing::MeshRank place = testing::MeshRank::on(mesh, world);
    ThreadCommunicator &dp_group = place.dp_group, &pp_group = place.pp_group, &stage_group = place.stage_group;
    const int replica = place.replica, stage_index = place.stage_index, group_rank = place.stage_rank;
    // The expert groups (model/expert_groups.hpp): ep consecutive ranks of dp x cp, the columns over etp consecutive
    // ranks of tp, the rest expert data parallel.
    ExpertGroups<ThreadCommunicator> experts = expert_groups(world, mesh, ep, etp);
    REQUIRE(int(experts.edp.size()) == edp * (tp / etp));
    ThreadCommunicator& ep_group = experts.ep;
    const int ep_rank = experts.ep_rank;
    const int stages = m.pp * m.v;
    std::vector<MeshGptStage<Strategies, ThreadCommunicator>> chunks;
    chunks.reserve(std::size_t(m.v));
    BufferPool pool;
    for (int c = 0; c < m.v; ++c) {
      const ChunkRange layers = chunk_range(config.layers, stages, c * m.pp + stage_index);
      chunks.emplace_back(config, c * m.pp + stage_index, stages, layers, group, group_rank, ep, ep_rank, seed, tp > 1,
                          etp);
      chunks.back().set_expert_replicas(experts.edp);
      chunks.back().set_expert_column_group(experts.etp);
      if (ring) chunks.back().stack().set_tp_inner(stage_group, tp);  // the stage group as cp x tp, tp innermost
      if (grid) chunks.back().stack().set_tp_x(stage_group, m.tp_x);  // the stage group as a tp_x x tp_y grid
      chunks.back().begin_step(stage_group, ep_group, pool,
                               StackPlan(mesh_plan.begin() + layers.start, mesh_plan.begin() + layers.end()), seq);
    }
    const ChunkRange mine = chunk_range(m.rows, m.dp, replica);
    const double loss = mesh_forward_backward(std::span(chunks), pp_group, stage_group, mine, seq, inputs, targets,
                                              float(1.0 / counted));
    // ZeRO-0's step leaves every gradient summed: the dense tensors' over dp, the MoE tensors' over edp (they are
    // reduced over the expert group already).
    for (auto& chunk : chunks) {
      MeshOptimizer optimizer(chunk, ZeroStage::zero, m.dp, replica, ops::AdamWConfig{}, int(experts.edp.size()),
                              experts.edp_rank);
      optimizer.step(dp_group, experts.edp, 1e-3f, 1);
    }
    const std::lock_guard guard(lock);
    loss_sum += loss;
    for (int c = 0; c < m.v; ++c) {
      auto& chunk = chunks[std::size_t(c)];
      record_stack(got, chunk.stack(), moe, int(chunk_range(config.layers, stages, c * m.pp + stage_index).start),
                   group_rank, ep, ep_rank, etp, tp > 1 ? group_rank % etp : -1);
      for (const auto& p : chunk.parameters()) {
        if (chunk.first() && p.gradient->shape() == Shape{config.vocab, config.layer.hidden})
          record(got, "embedding", p.gradient->span());
        if (chunk.last() && p.gradient->shape() == Shape{config.vocab + 2, config.layer.hidden})
          record(got, "head", p.gradient->span());
      }
    }
  });
  CHECK(loss_sum / counted == doctest::Approx(want_loss).epsilon(1e-5));
  REQUIRE(got.size() == want.size());
  for (const auto& [name, copies] : want) {
    CAPTURE(name);
    REQUIRE(got.count(name) == 1);
    const std::vector<float>& reference = copies.front();
    for (const std::vector<float>& copy : copies)  // the reference's own copies agree
      CHECK(testing::first_mismatch(std::span<const float>(copy), std::span<const float>(reference),
                                    testing::kFloat32) == "");
    for (const std::vector<float>& copy : got.at(name))
      CHECK(testing::first_mismatch(std::span<const float>(copy), std::span<const float>(reference),
                                    testing::kFloat32) == "");
    double norm = 0;  // the comparison can fail: every tensor receives gradient
    for (float x : reference) norm += double(x) * double(x);
    CHECK(norm > 0);
  }
}

}  // namespace mesh_experts_test

TEST_CASE("experts inside pipeline stages (ep = dp x cp per stage; 1F1B and interleaved) train as the single cp "
          "group on the same micro-batches: the loss and every gradient of every rank, router and experts included") {
  using namespace mesh_experts_test;
  for (const Mesh& m : {Mesh{2, 2, 1, 1, 3, 1, 5, 4}, Mesh{1, 2, 2, 1, 3, 1, 5, 3}, Mesh{2, 2, 2, 1, 4, 1, 7, 4},
                        Mesh{2, 3, 1, 1, 4, 2, 3, 6}, Mesh{2, 2, 1, 2, 5, 1, 5, 4}, Mesh{2, 1, 2, 1, 2, 1, 5, 3}})
    check_experts_in_mesh(m, 1);
}

TEST_CASE("etp folded over tp: each expert split by columns over the tp group (uneven), ep = dp, with pp stages and "
          "interleaving, trains as the single tp group (MegatronTS, experts whole over its ranks): the loss and every "
          "gradient of every rank") {
  using namespace mesh_experts_test;
  // {dp, pp, cp = 1, v, layers, first dense, experts, rows} on tp = 2 (and 3).
  for (const Mesh& m : {Mesh{1, 1, 1, 1, 2, 1, 5, 2}, Mesh{2, 1, 1, 1, 2, 0, 5, 3}, Mesh{2, 2, 1, 1, 3, 1, 5, 4},
                        Mesh{1, 2, 1, 2, 5, 1, 3, 4}})
    check_experts_in_mesh(m, 2);
  check_experts_in_mesh(Mesh{1, 2, 1, 1, 3, 1, 4, 2}, 3);
}

TEST_CASE("etp < tp: each expert split by columns over etp consecutive ranks of the tp group and replicated over the "
          "tp / etp column groups (their router statistics and MoE gradients summed over edp), alone and with "
          "ep < dp, with pp stages, trains as the single tp group: the loss and every gradient of every rank") {
  using namespace mesh_experts_test;
  // {dp, pp, cp = 1, v, layers, first dense, experts, rows, ep, etp} on tp = 2 and 4.
  check_experts_in_mesh(Mesh{2, 1, 1, 1, 2, 1, 5, 3, 0, 1}, 2);
  check_experts_in_mesh(Mesh{2, 2, 1, 1, 3, 1, 5, 4, 1, 1}, 2);
  check_experts_in_mesh(Mesh{1, 1, 1, 1, 2, 1, 5, 2, 0, 2}, 4);
  check_experts_in_mesh(Mesh{2, 1, 1, 1, 2, 0, 5, 2, 1, 2}, 4);
  check_experts_in_mesh(Mesh{1, 2, 1, 1, 3, 1, 5, 2, 0, 1}, 4);
}

TEST_CASE("tp inside cp with experts (MegatronRing in attention and the dense MLPs over the cp x tp stage group; the "
          "MoE layers over ep ranks of dp x cp, each expert's columns over etp ranks of tp, replicated over edp) trains "
          "as the single group: the loss and every gradient of every rank, with dp, pp stages, ep < dp x cp, etp < tp") {
  using namespace mesh_experts_test;
  // {dp, pp, cp, v, layers, first dense, experts, rows, ep, etp} on tp = 2.
  check_experts_in_mesh(Mesh{1, 1, 2, 1, 2, 1, 5, 2}, 2);              // ep = cp = 2, etp = tp
  check_experts_in_mesh(Mesh{2, 1, 2, 1, 2, 0, 5, 3, 0, 1}, 2);        // ep = dp x cp = 4, etp = 1: edp = 2
  check_experts_in_mesh(Mesh{1, 2, 2, 1, 3, 1, 5, 2, 1, 2}, 2);        // pp = 2, ep = 1: edp = 2
}

TEST_CASE("2-D tp with experts (Tp2d in attention and the dense MLPs over the tp_x x tp_y stage group; the MoE "
          "layers over ep ranks of dp, each expert's columns over etp consecutive ranks of the grid, replicated over "
          "edp) trains as the single group: the loss and every gradient of every rank, with dp, pp stages, ep < dp, "
          "etp < tp, experts uneven over ep and columns uneven over etp") {
  using namespace mesh_experts_test;
  // {dp, pp, cp = 1, v, layers, first dense, experts, rows, ep, etp, tp_x} on tp = tp_x x tp_y.
  check_experts_in_mesh(Mesh{2, 1, 1, 1, 2, 1, 5, 2, 0, 0, 2}, 4);  // 2 x 2 grid, ep = dp = 2, etp = 4: edp = 1
  check_experts_in_mesh(Mesh{2, 1, 1, 1, 2, 0, 7, 3, 0, 2, 2}, 4);  // etp = 2 (a grid row): edp = 2, uneven rows
  check_experts_in_mesh(Mesh{2, 1, 1, 1, 2, 1, 5, 2, 1, 1, 2}, 4);  // ep = 1, etp = 1: edp = 8
  check_experts_in_mesh(Mesh{1, 2, 1, 1, 3, 1, 5, 2, 0, 2, 2}, 4);  // pp = 2 stages of a 2 x 2 grid, etp = 2
  check_experts_in_mesh(Mesh{4, 1, 1, 1, 2, 1, 7, 4, 0, 0, 2}, 2);  // a 2 x 1 grid, ep = dp = 4 (7 experts)
}

TEST_CASE("expert data parallelism (ep < dp x cp: the experts replicated over edp = dp x cp / ep expert groups, the "
          "all-to-alls inside each, the router statistics and the MoE gradients summed over edp) trains as the single "
          "group: the loss and every gradient of every rank, with pp stages, interleaving and uneven rows") {
  using namespace mesh_experts_test;
  // {dp, pp, cp, v, layers, first dense, experts, rows, ep}; dp x cp = 4 over ep = 1, 2 (and 4, the folded case above).
  for (const Mesh& m : {Mesh{4, 1, 1, 1, 2, 1, 5, 6, 2}, Mesh{4, 1, 1, 1, 2, 0, 5, 4, 1}, Mesh{2, 1, 2, 1, 2, 1, 7, 3, 2},
                        Mesh{2, 2, 2, 1, 3, 1, 7, 4, 2}, Mesh{4, 2, 1, 1, 3, 1, 5, 8, 1}, Mesh{2, 2, 1, 2, 5, 1, 5, 4, 1},
                        Mesh{4, 1, 1, 1, 2, 1, 5, 4, 4}})
    check_experts_in_mesh(m, 1);
}

namespace mesh_experts_test {

// Two steps of the MoE GPT on mesh `m` (dp x pp x cp x tp, the experts' columns over etp of tp) with `zero`; returns
// each step's loss and records, after each step, every tensor of every rank in full (ZeRO-3's chunks gathered over
// dp, the MoE tensors' over edp), gradients (those ZeRO stage `compared` leaves summed) and weights, by (rank, step,
// index).
std::vector<double> zero_run(const GptConfig& config, const Mesh& m, int tp, ZeroStage zero, std::int64_t seq,
                             const StackPlan& plan, const std::vector<std::vector<std::int32_t>>& inputs,
                             const std::vector<std::vector<std::int32_t>>& targets, testing::StepTensors& out,
                             ZeroStage compared) {
  const DeviceMesh mesh({{"dp", m.dp}, {"pp", m.pp}, {"cp", m.cp}, {"tp", tp}});
  const int steps = int(inputs.size()), ep = m.ep > 0 ? m.ep : m.dp * m.cp, etp = m.etp > 0 ? m.etp : tp;
  std::vector<double> losses(std::size_t(steps), 0.0);
  std::mutex lock;
  const double counted = double(m.rows * seq);
  const ops::AdamWConfig adamw{.learning_rate = 0.02f, .weight_decay = 0.1f};
  run_ranks(mesh.size(), [&](ThreadCommunicator& world) {
    testing::MeshRank place = testing::MeshRank::on(mesh, world);
    ThreadCommunicator &dp_group = place.dp_group, &pp_group = place.pp_group, &stage_group = place.stage_group;
    const int replica = place.replica, stage_index = place.stage_index, group_rank = place.stage_rank;
    ExpertGroups<ThreadCommunicator> experts = expert_groups(world, mesh, ep, etp);
    const int edp = int(experts.edp.size());
    const ChunkRange layers = chunk_range(config.layers, m.pp, stage_index);
    MeshGptStage<Strategies, ThreadCommunicator> stage(config, stage_index, m.pp, layers, m.cp * tp, group_rank, ep,
                                                       experts.ep_rank, 7, tp > 1, etp);
    stage.set_expert_replicas(experts.edp);
    stage.set_expert_column_group(experts.etp);
    if (zero == ZeroStage::three) stage.shard_over_dp(dp_group);
    // ZeRO-3 with edp > 1 keeps only an edp chunk of each MoE tensor, none of it whole between uses.
    if (zero == ZeroStage::three && edp > 1)
      for (const auto& p : stage.parameters())
        if (!p.over_dp) CHECK((p.value->numel() == 0 && stage.expert_zero3_of(p.value) != nullptr));
    MeshOptimizer optimizer(stage, zero, m.dp, replica, adamw, edp, experts.edp_rank);
    BufferPool pool;
    const ChunkRange mine = chunk_range(m.rows, m.dp, replica);
    const auto record_all = [&](int k, bool gradients) {
      std::vector<std::vector<float>> tensors;
      if (zero == ZeroStage::three) tensors = testing::gathered_zero3(stage, dp_group, gradients);
      for (bool over_dp : {true, false}) {  // ZeRO-0's dense tensors, then (both) the MoE tensors, in the same order
        if (over_dp && zero == ZeroStage::three) continue;
        for (const auto& p : stage.parameters()) {
          if (p.over_dp != over_dp) continue;
          // The gradients `compared` leaves unsummed are not recorded: ZeRO-2's over dp, and over edp the MoE
          // tensors' under ZeRO-2 (ZeRO-3 reduce-scatters them over edp, summed).
          if (gradients && over_dp && compared == ZeroStage::two) continue;
          if (gradients && !over_dp && edp > 1 && compared == ZeroStage::two) continue;
          if (auto* shard = stage.expert_zero3_of(p.value)) {  // ZeRO-3 with edp > 1: gathered over edp
            tensors.push_back(testing::gathered_shard(*shard, experts.edp, gradients));
            continue;
          }
          const Tensor<float>* t = gradients ? p.gradient : p.value;
          tensors.emplace_back(t->span().begin(), t->span().end());
        }
      }
      testing::store_step_tensors(out, lock, world.rank(), k, gradients, std::move(tensors));
    };
    for (int k = 0; k < steps; ++k) {
      stage.begin_step(stage_group, experts.ep, pool,
                       StackPlan(plan.begin() + layers.start, plan.begin() + layers.end()), seq);
      const double loss = mesh_forward_backward(stage, pp_group, stage_group, mine, seq, inputs[std::size_t(k)],
                                                targets[std::size_t(k)], float(1.0 / counted));
      optimizer.step(dp_group, experts.edp, adamw.learning_rate, k + 1);  // ZeRO-0 leaves the gradients summed
      record_all(k, true);
      record_all(k, false);
      const std::lock_guard guard(lock);
      losses[std::size_t(k)] += loss / counted;
    }
  });
  return losses;
}

}  // namespace mesh_experts_test

TEST_CASE("ZeRO-3 with experts on the mesh (attention, norms, dense MLPs, embedding and head sharded over dp; with "
          "expert data parallelism the router, routed and shared experts sharded over edp, gathered around each use) "
          "trains as ZeRO-0: dp = 2 x cp = 2, dp = 2 x pp = 2 (uneven stages), dp = 3 x pp = 2, ep < dp x cp, etp < "
          "tp; the losses, every gradient and every weight after each of two steps") {
  using namespace mesh_experts_test;
  const std::int64_t seq = 8;
  // With expert data parallelism (ep < dp x cp, or etp < tp): dp = 2 x cp = 2 over ep = 2 (edp = 2) and 1 (edp = 4),
  // dp = 4 x pp = 2 over ep = 2, dp = 2 x tp = 2 with etp = 1 (edp = 2 over the tp column groups) and with ep = 1,
  // etp = 2 (edp = 2 over dp); each ZeRO stage against ZeRO-0 (the MoE tensors over edp: ZeRO-1, ZeRO-2, ZeRO-3).
  const std::pair<Mesh, int> meshes[] = {
      {Mesh{2, 1, 2, 1, 2, 1, 5, 2}, 1},          {Mesh{2, 2, 1, 1, 3, 1, 5, 4}, 1},
      {Mesh{3, 2, 1, 1, 3, 1, 7, 6}, 1},          {Mesh{2, 1, 2, 1, 2, 1, 5, 2, 2}, 1},
      {Mesh{2, 1, 2, 1, 2, 0, 3, 2, 1}, 1},       {Mesh{4, 2, 1, 1, 3, 1, 5, 8, 2}, 1},
      {Mesh{2, 1, 1, 1, 2, 1, 5, 2, 0, 1}, 2},    {Mesh{2, 1, 1, 1, 2, 0, 5, 3, 1, 2}, 2}};
  for (const auto& [m, tp] : meshes)
   for (const ZeroStage zero : m.ep > 0 || m.etp > 0 ? std::vector{ZeroStage::one, ZeroStage::two, ZeroStage::three}
                                        : std::vector{ZeroStage::three}) {
    CAPTURE(m.dp);
    CAPTURE(m.pp);
    CAPTURE(m.cp);
    CAPTURE(tp);
    CAPTURE(m.ep);
    CAPTURE(m.etp);
    CAPTURE(name_of(zero));
    GptConfig config;
    config.layer = LayerConfig::make(40, 4);  // 40-wide norms and matrices: uneven chunks over dp = 3
    config.layer.causal = config.layer.zigzag = config.layer.rope = true;
    config.layer.norm = NormKind::rms_norm;
    config.layer.activation = Activation::swiglu;
    config.vocab = 23;
    config.layers = m.layers;
    MoeConfig moe;
    moe.hidden = 40;
    moe.experts = m.experts;
    moe.top_k = 2;
    moe.expert_ffn = 10;
    moe.norm_topk_prob = true;
    moe.shared_experts = 1;
    moe.shared_ffn = 6;
    moe.shared_gate = true;
    moe.aux_loss_coef = 0.1;
    moe.z_loss_coef = 0.01;
    config.moe = MoeLayers{moe, m.first_dense};
    StackPlan plan;
    for (int l = 0; l < m.layers; ++l)
      plan.push_back({Strategies::index_of(m.cp == 1 ? "MegatronTS" : "UlyssesZ"), Strategies::index_of("MegatronTS"),
                      std::size_t(l % 2)});
    Rng rng(900 + std::uint64_t(tp * 1000 + m.dp * 100 + m.pp * 10 + m.cp));
    const int steps = 2;
    std::vector<std::vector<std::int32_t>> inputs(steps), targets(steps);
    for (int k = 0; k < steps; ++k)
      for (std::int64_t i = 0; i < m.rows * seq; ++i) {
        inputs[std::size_t(k)].push_back(std::int32_t(rng.next_u64() % std::uint64_t(config.vocab)));
        targets[std::size_t(k)].push_back(std::int32_t(rng.next_u64() % std::uint64_t(config.vocab)));
      }
    testing::StepTensors want, got;
    const std::vector<double> zero0 = zero_run(config, m, tp, ZeroStage::zero, seq, plan, inputs, targets, want, zero);
    const std::vector<double> zero3 = zero_run(config, m, tp, zero, seq, plan, inputs, targets, got, zero);
    for (int k = 0; k < steps; ++k) CHECK(zero3[std::size_t(k)] == doctest::Approx(zero0[std::size_t(k)]).epsilon(1e-6));
    CHECK(zero0[1] != zero0[0]);  // the second step runs on updated weights
    REQUIRE(got.size() == want.size());
    for (const auto& [name, values] : want) {
      CAPTURE(name);
      REQUIRE(got.count(name) == 1);
      CHECK(testing::first_mismatch(std::span<const float>(got.at(name)), std::span<const float>(values),
                                    testing::kFloat32) == "");
      if (values.empty()) continue;  // an MoE layer's dense MLP shard ([0, h])
      double norm = 0;  // the comparison can fail: every other tensor is non-zero
      for (float x : values) norm += double(x) * double(x);
      CHECK(norm > 0);
    }
  }
}
