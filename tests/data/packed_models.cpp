// Packed sequences (data/packing.hpp) on the MoE GPT and on the mesh. The MoE GPT (train_gpt --experts
// --pack-documents): a packed sequence of documents of 1, 2, 3, 7 and 13 tokens gives the loss and every gradient of
// every rank (attention, dense MLP, norms, router, experts, shared experts, embedding, head) of its documents trained
// alone on the same ranks, on p = 3 and 4, under the MoE planner's plan and fixed mixes. And train_gpt --mesh's step
// (model/mesh_stage.hpp: MeshGptStage, mesh_forward_backward) on pp = 2 x cp = 2 and pp = 2 x cp = 3 (the dense
// GPT, 3 layers over 2 stages) and cp = 2 (the MoE GPT of train_gpt --experts): a packed sequence gives the loss and
// every gradient of every rank of its documents alone on the same mesh. Over dp = 2 (x cp = 2, and x pp = 2 x cp =
// 2) a mesh step of one packed sequence per replica (data/mesh_steps.hpp's mesh_steps, MeshStep::work), each replica
// on a plan of its own, one replica idle in the last step, gives after the dp sum the loss and every gradient of
// every rank of all its documents alone.

#include "packed_documents.hpp"
#include "support/tolerance.hpp"

#include "paradyse/comm/threads.hpp"
#include "paradyse/cost/builtin_profiles.hpp"
#include "paradyse/data/mesh_steps.hpp"
#include "paradyse/data/packing.hpp"
#include "paradyse/mesh/device_mesh.hpp"
#include "paradyse/model/byte_gpt.hpp"
#include "paradyse/model/gpt.hpp"
#include "paradyse/model/mesh_stage.hpp"
#include "paradyse/moe/moe_strategies.hpp"
#include "paradyse/plan/gpt_costs.hpp"
#include "paradyse/plan/moe_plan.hpp"
#include "paradyse/plan/planner.hpp"
#include "paradyse/strategy/strategies.hpp"
#include "paradyse/ops/backend.hpp"

#include <doctest/doctest.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace {

using namespace paradyse;
using testing::documents_of;

}  // namespace

TEST_CASE("an MoE GPT trains a packed sequence as its documents alone: the loss and every gradient of every rank "
          "(attention, dense MLP, norms, router, experts, shared experts, embedding, head), p = 3 and 4") {
  using All = AllStrategies<>;
  using MoeModel = Gpt<All>;
  GptConfig c;
  c.layer = LayerConfig::make(48, 12);  // heads divisible by p = 3, 4
  c.layer.causal = c.layer.zigzag = c.layer.rope = true;
  c.layer.norm = NormKind::rms_norm;
  c.layer.activation = Activation::swiglu;
  c.layers = 2;
  c.vocab = 256;
  MoeConfig m;
  m.hidden = 48;
  m.experts = 5;  // uneven over p = 3 and 4
  m.top_k = 2;
  m.expert_ffn = 8;
  m.norm_topk_prob = true;
  m.shared_experts = 1;
  m.shared_ffn = 8;
  m.shared_gate = true;
  // No router losses here: the load-balancing loss is a statistic of the whole batch (the fraction of ALL its tokens
  // routed to each expert), not a sum over documents, and both it and the z-loss see the padding tokens; the MoE FFN
  // itself is per token (dropless), so packing must not change a document's loss or gradients.
  c.moe = MoeLayers{m, 1};  // layer 0 dense, layer 1 MoE
  const std::vector<data::Document> docs = documents_of({2, 3, 4, 8, 14}, 29);
  const std::vector<data::Window> windows{{0, 0, 1}, {1, 0, 2}, {2, 0, 3}, {3, 0, 7}, {4, 0, 13}};

  // Every gradient every rank holds, named, rank by rank (the expert shards differ per rank).
  struct Gradients {
    double loss = 0;
    std::int64_t counted = 0;
    std::vector<std::string> names;
    std::vector<std::vector<float>> values;
  };
  const auto run = [&](const data::Step& step, int p, const StackPlan& plan) {
    std::vector<std::int32_t> inputs, targets;
    data::step_tokens(step, docs, ops::cpu::kIgnoreIndex, inputs, targets);
    const std::vector<std::int64_t> starts = step.document_starts();
    std::vector<Gradients> per_rank(static_cast<std::size_t>(p));
    run_ranks(p, [&](ThreadCommunicator& comm) {
      const int r = comm.rank();
      BufferPool pool;
      MoeModel model(c, p, r, 31);
      const SequenceLayout layout(step.length, p, c.layer.zigzag);
      const Tensor<std::int32_t> x = shard_tokens(inputs, step.sequences(), layout, r);
      const Tensor<std::int32_t> y = shard_tokens(targets, step.sequences(), layout, r);
      model.zero_gradients();
      const GptStepResult out = model.forward_backward(comm, pool, plan, step.length, x.view(), y.view(), starts);
      Gradients& mine = per_rank[std::size_t(r)];
      mine.loss = out.loss;
      mine.counted = out.counted;
      const auto add = [&](std::string name, const Tensor<float>& t) {
        mine.names.push_back(fmt::format("rank {} {}", r, name));
        mine.values.emplace_back(t.span().begin(), t.span().end());
      };
      for (int l = 0; l < c.layers; ++l) {
        const LayerWeights& g = model.stack().gradients()[std::size_t(l)];
        add(fmt::format("layer {} attention", l), g.attention.packed);
        add(fmt::format("layer {} norms", l), g.norms.packed);
        if (!model.stack().is_moe_layer(l)) {
          add(fmt::format("layer {} dense mlp", l), g.mlp.packed);
          continue;
        }
        const MoeShard& e = model.stack().moe_gradients()[std::size_t(l)];
        add(fmt::format("layer {} router", l), e.router);
        add(fmt::format("layer {} experts in", l), e.expert_in);
        add(fmt::format("layer {} experts out", l), e.expert_out);
        add(fmt::format("layer {} shared in", l), e.shared_in);
        add(fmt::format("layer {} shared out", l), e.shared_out);
        add(fmt::format("layer {} shared gate", l), e.shared_gate);
      }
      add("embedding, head, final norm", model.replicated_gradient());
    });
    Gradients all = per_rank[0];
    for (std::size_t r = 1; r < per_rank.size(); ++r) {
      all.names.insert(all.names.end(), per_rank[r].names.begin(), per_rank[r].names.end());
      all.values.insert(all.values.end(), per_rank[r].values.begin(), per_rank[r].values.end());
    }
    return all;
  };
  const auto choice = [](std::string_view attention, std::string_view mlp, std::string_view moe) {
    return SublayerChoice{All::index_of(attention), All::index_of(mlp), MoeStrategies<>::index_of(moe)};
  };
  const cost::HardwareProfile hardware = cost::a100_sxm4_80gb_x8();
  for (const int p : {3, 4}) {
    CAPTURE(p);
    // Each document alone on the same p ranks (padded at its end to the group's minimum of 2p tokens).
    std::vector<Gradients> alone;
    for (const data::Window& w : windows)
      alone.push_back(run({{w}, std::max<std::int64_t>(w.length, 2 * p)}, p,
                          StackPlan(2, choice("MegatronTS", "MegatronTS", "ExpertParallel"))));
    const std::vector<data::Step> steps = data::pack_sequences(windows, 17, 2 * p);
    REQUIRE(steps.size() >= 2);
    for (const data::Step& step : steps) {
      CAPTURE(fmt::format("{}", fmt::join(step.document_starts(), ",")));
      // The planner's plan for the packed step (the MoE cost table of its documents), and fixed mixes.
      const plan::MoeGptCosts<MoeModel> costs{c, p, &hardware};
      const plan::MoePlan planned = plan::plan_moe_exact(
          plan::build_moe_cost_table(c, hardware, p, plan::Batch::packed(step.document_lengths()), {4, 4, 8},
                                     costs.extra_bytes(step.length)),
          std::int64_t(1) << 40);
      const std::vector<StackPlan> plans{
          planned.stack_plan<All>(),
          StackPlan(2, choice("UlyssesZ", "UlyssesZ", "ExpertTensorParallel")),
          StackPlan(2, choice("METP", "METP", "ExpertParallel")),
          {choice("MegatronCZ", "ColossalZ", "ExpertParallel"), choice("ColossalZ", "MegatronTS", "ExpertTensorParallel")}};
      // The token-weighted mean of the documents alone.
      double loss = 0;
      std::int64_t counted = 0;
      std::vector<std::vector<double>> want;
      for (const std::vector<float>& v : alone[0].values) want.emplace_back(v.size(), 0.0);
      for (const data::Window& w : step.rows) {
        const Gradients& a = alone[w.document];
        loss += a.loss * double(a.counted);
        counted += a.counted;
        for (std::size_t t = 0; t < want.size(); ++t)
          for (std::size_t i = 0; i < want[t].size(); ++i) want[t][i] += double(a.values[t][i]) * double(a.counted);
      }
      for (std::vector<double>& v : want)
        for (double& g : v) g /= double(counted);
      for (std::size_t k = 0; k < plans.size(); ++k) {
        CAPTURE(k);
        const Gradients got = run(step, p, plans[k]);
        CHECK(got.counted == counted);
        CHECK(got.loss == doctest::Approx(loss / double(counted)).epsilon(1e-5));
        REQUIRE(got.names == alone[0].names);
        for (std::size_t t = 0; t < want.size(); ++t) {
          CAPTURE(got.names[t]);
          CHECK(testing::first_mismatch(std::span<const float>(got.values[t]), std::span<const double>(want[t]),
                                        testing::kFloat32) == "");
        }
      }
    }
    // The comparison can fail: the router and the experts do receive gradient.
    for (std::size_t t = 0; t < alone[4].names.size(); ++t)
      if (alone[4].names[t].ends_with("router") || alone[4].names[t].ends_with("experts in")) {
        CAPTURE(alone[4].names[t]);
        CHECK(std::ranges::any_of(alone[4].values[t], [](float g) { return g != 0.0f; }));
      }
  }
}

TEST_CASE("train_gpt --mesh trains a packed sequence as its documents alone: pp = 2 x cp = 2, pp = 2 x cp = 3 "
          "(uneven), and the MoE GPT on cp = 2: the loss and every gradient of every rank") {
  GptConfig dense;
  dense.layer = LayerConfig::make(48, 12);  // heads divisible by cp = 2, 3
  dense.layer.causal = dense.layer.zigzag = dense.layer.rope = true;
  dense.layers = 3;  // uneven over 2 stages
  dense.vocab = 256;
  const GptConfig moe = moe_gpt_config([] {
    ByteGptShape o;
    o.layers = 2;
    o.hidden = 48;
    o.heads = 12;
    o.experts = 5;
    o.top_k = 2;
    o.shared_experts = 1;
    o.first_dense = 1;
    o.aux_loss_coef = o.z_loss_coef = 0;  // no router losses: see the MoE GPT's case above
    return o;
  }());
  const std::vector<data::Document> docs = documents_of({2, 3, 4, 8, 14}, 37);
  const std::vector<data::Window> windows{{0, 0, 1}, {1, 0, 2}, {2, 0, 3}, {3, 0, 7}, {4, 0, 13}};

  struct Mesh {
    const GptConfig* config;
    int pp, cp;
  };
  struct Gradients {
    double loss = 0;
    std::vector<std::vector<float>> values;  // every rank's parameters' gradients, rank by rank
  };
  // One step of `step` on the mesh pp x cp (dp = 1) as train_mesh runs it, all layers on `choice`.
  const auto run = [&](const Mesh& mesh, const data::Step& step, SublayerChoice choice) {
    const GptConfig& c = *mesh.config;
    std::vector<std::int32_t> inputs, targets;
    data::step_tokens(step, docs, ops::cpu::kIgnoreIndex, inputs, targets);
    const std::vector<std::int64_t> starts = step.document_starts();
    const double counted = double(std::count_if(targets.begin(), targets.end(),
                                                [](std::int32_t t) { return t != ops::cpu::kIgnoreIndex; }));
    const DeviceMesh grid({{"pp", mesh.pp}, {"cp", mesh.cp}});
    std::vector<double> losses(std::size_t(grid.size()), 0.0);
    std::vector<std::vector<std::vector<float>>> per_rank(std::size_t(grid.size()));
    run_ranks(grid.size(), [&](ThreadCommunicator& world) {
      ThreadCommunicator pp_group = grid.group(world, {"pp"}), cp_group = grid.group(world, {"cp"});
      const int stage_index = grid.coordinate(world.rank())[0], cp_rank = grid.coordinate(world.rank())[1];
      const ChunkRange layers = chunk_range(c.layers, mesh.pp, stage_index);
      MeshGptStage<AllStrategies<>, ThreadCommunicator> stage(c, stage_index, mesh.pp, layers, mesh.cp,
                                                                        cp_rank, mesh.cp, cp_rank, 41);
      BufferPool pool;
      stage.begin_step(cp_group, cp_group, pool, StackPlan(std::size_t(layers.length), choice), step.length, starts);
      losses[std::size_t(world.rank())] = mesh_forward_backward(
          stage, pp_group, cp_group, {0, 1}, step.length, inputs, targets, float(1.0 / counted));
      for (const auto& parameter : stage.parameters())
        per_rank[std::size_t(world.rank())].emplace_back(parameter.gradient->span().begin(), parameter.gradient->span().end());
    });
    Gradients out;
    for (std::size_t r = 0; r < per_rank.size(); ++r) {
      out.loss += losses[r] / counted;
      out.values.insert(out.values.end(), per_rank[r].begin(), per_rank[r].end());
    }
    return std::pair{out, std::int64_t(counted)};
  };
  const auto choice = [](std::string_view attention, std::string_view mlp, std::string_view experts) {
    return SublayerChoice{AllStrategies<>::index_of(attention), AllStrategies<>::index_of(mlp),
                          MoeStrategies<>::index_of(experts)};
  };
  for (const Mesh& mesh : {Mesh{&dense, 2, 2}, Mesh{&dense, 2, 3}, Mesh{&moe, 1, 2}}) {
    CAPTURE(mesh.pp);
    CAPTURE(mesh.cp);
    CAPTURE(mesh.config->moe.has_value());
    const SublayerChoice reference = choice("MegatronTS", "MegatronTS", "ExpertParallel");
    std::vector<std::pair<Gradients, std::int64_t>> alone;  // each document alone on the same mesh
    for (const data::Window& w : windows)
      alone.push_back(run(mesh, {{w}, std::max<std::int64_t>(w.length, 2 * mesh.cp)}, reference));
    const std::vector<data::Step> steps = data::pack_sequences(windows, 17, 2 * mesh.cp);
    REQUIRE(steps.size() >= 2);
    for (std::size_t j = 0; j < steps.size(); ++j) {
      const data::Step& step = steps[j];
      CAPTURE(fmt::format("{}", fmt::join(step.document_starts(), ",")));
      double loss = 0;
      std::int64_t counted = 0;
      std::vector<std::vector<double>> want;
      for (const std::vector<float>& v : alone[0].first.values) want.emplace_back(v.size(), 0.0);
      for (const data::Window& w : step.rows) {
        const auto& [a, n] = alone[w.document];
        loss += a.loss * double(n);
        counted += n;
        for (std::size_t t = 0; t < want.size(); ++t)
          for (std::size_t i = 0; i < want[t].size(); ++i) want[t][i] += double(a.values[t][i]) * double(n);
      }
      for (std::vector<double>& v : want)
        for (double& g : v) g /= double(counted);
      // MegatronTS, and a ring-attention or all-to-all mix (alternating over the steps).
      for (const SublayerChoice& on : {reference, j % 2 == 0 ? choice("UlyssesZ", "METP", "ExpertTensorParallel")
                                                             : choice("MegatronCZ", "ColossalZ", "ExpertParallel")}) {
        CAPTURE(on.attention);
        const auto [got, got_counted] = run(mesh, step, on);
        CHECK(got_counted == counted);
        CHECK(got.loss == doctest::Approx(loss / double(counted)).epsilon(1e-5));
        REQUIRE(got.values.size() == want.size());
        for (std::size_t t = 0; t < want.size(); ++t) {
          CAPTURE(t);
          CHECK(testing::first_mismatch(std::span<const float>(got.values[t]), std::span<const double>(want[t]),
                                        testing::kFloat32) == "");
        }
      }
    }
  }
}

TEST_CASE("train_gpt --mesh --pack-documents over dp = 2: one packed sequence per replica, each on its own plan; the "
          "loss and every gradient of every rank are those of the documents alone (dp = 2 x cp = 2, dp = 2 x pp = 2 x "
          "cp = 2, a last step with an idle replica)") {
  GptConfig c;
  c.layer = LayerConfig::make(48, 12);
  c.layer.causal = c.layer.zigzag = c.layer.rope = true;
  c.layers = 3;  // uneven over 2 stages
  c.vocab = 256;
  const std::vector<data::Document> docs = documents_of({2, 3, 4, 8, 14}, 43);
  const std::vector<data::Window> windows{{0, 0, 1}, {1, 0, 2}, {2, 0, 3}, {3, 0, 7}, {4, 0, 13}};
  const auto choice = [](std::string_view attention, std::string_view mlp) {
    return SublayerChoice{AllStrategies<>::index_of(attention), AllStrategies<>::index_of(mlp)};
  };
  struct Run {
    double loss = 0;
    std::int64_t counted = 0;
    std::vector<std::vector<std::vector<float>>> per_rank;  // [world rank][parameter] gradients after the dp sum
  };
  // One mesh step as train_mesh runs it: MeshStep::work deals the parts (replica d on choices[d]), every token's
  // loss gradient scaled by 1 / the step's real tokens; then the gradients summed over dp, as the ZeRO-0
  // DataParallelOptimizer with ReduceOp::sum (model/mesh_optimizer.hpp's MeshOptimizer) does before its AdamW step.
  const auto run = [&](int dp, int pp, int cp, const data::MeshStep& step, const std::vector<SublayerChoice>& choices) {
    const DeviceMesh grid({{"dp", dp}, {"pp", pp}, {"cp", cp}});
    const double counted = double(step.real_tokens());
    std::vector<double> losses(std::size_t(grid.size()), 0.0);
    Run out;
    out.counted = step.real_tokens();
    out.per_rank.resize(std::size_t(grid.size()));
    run_ranks(grid.size(), [&](ThreadCommunicator& world) {
      ThreadCommunicator dp_group = grid.group(world, {"dp"}), pp_group = grid.group(world, {"pp"});
      ThreadCommunicator cp_group = grid.group(world, {"cp"});
      const MeshCoordinate at = grid.coordinate(world.rank());
      const int replica = at[0], stage_index = at[1], cp_rank = at[2];
      const ChunkRange layers = chunk_range(c.layers, pp, stage_index);
      MeshGptStage<AllStrategies<>, ThreadCommunicator> stage(c, stage_index, pp, layers, cp, cp_rank, cp,
                                                                        cp_rank, 47);
      const auto [part, mine] = step.work(replica, dp);
      const data::Step& tokens_of = part ? *part : step.parts[0];
      std::vector<std::int32_t> inputs, targets;
      data::step_tokens(tokens_of, docs, ops::cpu::kIgnoreIndex, inputs, targets);
      BufferPool pool;
      stage.begin_step(cp_group, cp_group, pool, StackPlan(std::size_t(layers.length), choices.at(std::size_t(replica))),
                       tokens_of.length, tokens_of.document_starts());
      losses[std::size_t(world.rank())] = mesh_forward_backward(
          stage, pp_group, cp_group, mine, tokens_of.length, inputs, targets, float(1.0 / counted));
      for (const auto& parameter : stage.parameters()) {
        dp_group.all_reduce(std::span<const float>(parameter.gradient->span()), parameter.gradient->span(), ReduceOp::sum);
        out.per_rank[std::size_t(world.rank())].emplace_back(parameter.gradient->span().begin(),
                                                             parameter.gradient->span().end());
      }
    });
    for (const double l : losses) out.loss += l / counted;
    return out;
  };
  struct Mesh {
    int pp, cp;
  };
  for (const Mesh& mesh : {Mesh{1, 2}, Mesh{2, 2}}) {
    CAPTURE(mesh.pp);
    CAPTURE(mesh.cp);
    const SublayerChoice ts = choice("MegatronTS", "MegatronTS");
    std::vector<Run> alone;  // each document alone on the mesh pp x cp of one replica
    for (const data::Window& w : windows)
      alone.push_back(run(1, mesh.pp, mesh.cp, {{{{w}, std::max<std::int64_t>(w.length, 2 * mesh.cp)}}, false}, {ts}));
    // Budget 10: the 13-token document alone, then two more sequences: two mesh steps, the second leaving replica 1
    // idle.
    const std::vector<data::Step> sequences = data::pack_sequences(windows, 10, 2 * mesh.cp);
    const std::vector<data::MeshStep> steps = data::mesh_steps(sequences, 2);
    REQUIRE(sequences.size() == 3);
    REQUIRE(steps.size() == 2);
    CHECK(steps[0].parts.size() == 2);
    CHECK(steps[1].parts.size() == 1);
    CHECK(steps[1].work(1, 2).first == nullptr);
    CHECK(steps[1].work(1, 2).second.length == 0);
    for (const data::MeshStep& step : steps) {
      CAPTURE(step.parts.size());
      // The token-weighted mean of every document of every part alone, rank by rank of one replica.
      double loss = 0;
      std::int64_t counted = 0;
      std::vector<std::vector<std::vector<double>>> want;
      for (const auto& rank : alone[0].per_rank) {
        want.emplace_back();
        for (const std::vector<float>& g : rank) want.back().emplace_back(g.size(), 0.0);
      }
      for (const data::Step& part : step.parts)
        for (const data::Window& w : part.rows) {
          const Run& a = alone[w.document];
          loss += a.loss * double(a.counted);
          counted += a.counted;
          for (std::size_t r = 0; r < want.size(); ++r)
            for (std::size_t t = 0; t < want[r].size(); ++t)
              for (std::size_t i = 0; i < want[r][t].size(); ++i)
                want[r][t][i] += double(a.per_rank[r][t][i]) * double(a.counted);
        }
      for (auto& rank : want)
        for (std::vector<double>& g : rank)
          for (double& x : g) x /= double(counted);
      // Each replica on its own plan: MegatronTS everywhere, or ring attention / all-to-all mixes that differ.
      for (const std::vector<SublayerChoice>& choices :
           {std::vector<SublayerChoice>{ts, ts},
            std::vector<SublayerChoice>{choice("MegatronCZ", "METP"), choice("UlyssesZ", "ColossalZ")}}) {
        const Run got = run(2, mesh.pp, mesh.cp, step, choices);
        CHECK(got.counted == counted);
        CHECK(got.loss == doctest::Approx(loss / double(counted)).epsilon(1e-5));
        REQUIRE(got.per_rank.size() == 2 * want.size());
        for (std::size_t r = 0; r < got.per_rank.size(); ++r) {
          CAPTURE(r);
          const auto& reference = want[r % want.size()];  // replica r / (pp x cp) holds the same shards
          REQUIRE(got.per_rank[r].size() == reference.size());
          for (std::size_t t = 0; t < reference.size(); ++t) {
            CAPTURE(t);
            CHECK(testing::first_mismatch(std::span<const float>(got.per_rank[r][t]),
                                          std::span<const double>(reference[t]), testing::kFloat32) == "");
          }
        }
      }
    }
  }
}

