// The train_gpt data path (data/packing.hpp): steps of one or several documents, one per row, padded with masked
// tokens. pack_steps keeps every window once within the token budget; step_tokens pads with ignored targets; and a
// padded or packed step trains the model exactly as its documents alone would: its loss is their token-weighted
// mean and its gradients the token-weighted mean of theirs (causal attention never reaches the padding after a
// document, rows never see each other, positions restart in every row), on group sizes where short documents need
// padding (p = 2, 3) against one rank without padding. Packed sequences (pack_sequences: the documents back to back
// in one sequence, document-masked attention, RoPE restarting per document) train the same way on every strategy
// and on the planner's plan, with documents of 1 and p - 1 tokens on p = 3 and 4. And mesh_steps
// (data/mesh_steps.hpp) deals rows, consecutive sequences, or sequences grouped by cost. The MoE GPT and the mesh
// stage on packed sequences: tests/data/packed_models.cpp.

#include "packed_documents.hpp"
#include "support/tolerance.hpp"

#include "paradyse/comm/threads.hpp"
#include "paradyse/cost/builtin_profiles.hpp"
#include "paradyse/data/mesh_steps.hpp"
#include "paradyse/data/packing.hpp"
#include "paradyse/mesh/device_mesh.hpp"
#include "paradyse/model/gpt.hpp"
#include "paradyse/moe/moe_strategies.hpp"
#include "paradyse/plan/gpt_costs.hpp"
#include "paradyse/plan/moe_plan.hpp"
#include "paradyse/plan/planner.hpp"
#include "paradyse/strategy/strategies.hpp"
#include "paradyse/ops/backend.hpp"
#include "paradyse/strategy/megatron_ts.hpp"
#include "paradyse/strategy/switchable.hpp"
#include "paradyse/strategy/ulysses_z.hpp"

#include <doctest/doctest.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace {

using namespace paradyse;
using Strategies = Switchable<MegatronTS<>, UlyssesZ<>>;
using Model = Gpt<Strategies>;

using testing::documents_mean;
using testing::documents_of;
using testing::DocumentsMean;
using testing::RunResult;

}  // namespace

TEST_CASE("pack_steps: every window once, within the token budget, rows padded to the step's length") {
  Rng rng(5);
  std::vector<data::Window> windows;
  for (std::size_t i = 0; i < 50; ++i) windows.push_back({i, 0, 1 + std::int64_t(rng.below(90))});
  for (const std::int64_t budget : {0, 1, 64, 100, 333}) {
    const std::int64_t min_length = 6;
    const std::vector<data::Step> steps = data::pack_steps(windows, budget, min_length);
    std::vector<std::size_t> seen;
    std::int64_t real = 0, padding = 0;
    for (const data::Step& step : steps) {
      REQUIRE(!step.rows.empty());
      CHECK(step.length >= min_length);
      std::int64_t longest = 0;
      for (const data::Window& w : step.rows) {
        seen.push_back(w.document);
        longest = std::max(longest, w.length);
      }
      CHECK(step.length == std::max(longest, min_length));  // padded to its longest row, no further
      if (budget > 0 && step.rows.size() > 1) CHECK(std::int64_t(step.rows.size()) * step.length <= budget);
      real += step.real_tokens();
      padding += step.padded_tokens();
      CHECK(step.padded_tokens() == std::int64_t(step.rows.size()) * step.length - step.real_tokens());
    }
    std::sort(seen.begin(), seen.end());
    for (std::size_t i = 0; i < windows.size(); ++i) CHECK(seen[i] == i);
    std::int64_t want = 0;
    for (const data::Window& w : windows) want += w.length;
    CHECK(real == want);
    if (budget == 0) {
      CHECK(steps.size() == windows.size());
      for (std::size_t i = 0; i < steps.size(); ++i) CHECK(steps[i].rows[0].document == windows[i].document);  // order kept
    }
    if (budget == 333) CHECK(steps.size() < windows.size() / 2);  // packed
    CAPTURE(budget);
    CAPTURE(padding);
  }
  CHECK_THROWS_AS(data::pack_steps(windows, -1, 6), Error);
}

TEST_CASE("step_tokens: row i holds window i's bytes and next bytes, then padding with ignored targets") {
  const std::vector<data::Document> docs = documents_of({5, 12, 2}, 3);
  const data::Step step{{{0, 1, 3}, {1, 4, 7}, {2, 0, 1}}, 8};
  std::vector<std::int32_t> inputs, targets;
  data::step_tokens(step, docs, -100, inputs, targets);
  REQUIRE(inputs.size() == 24);
  for (std::size_t row = 0; row < 3; ++row) {
    const data::Window& w = step.rows[row];
    for (std::int64_t i = 0; i < 8; ++i) {
      const std::size_t at = row * 8 + std::size_t(i);
      if (i < w.length) {
        CHECK(inputs[at] == std::int32_t(std::uint8_t(docs[w.document].bytes[std::size_t(w.offset + i)])));
        CHECK(targets[at] == std::int32_t(std::uint8_t(docs[w.document].bytes[std::size_t(w.offset + i + 1)])));
      } else {
        CHECK(inputs[at] == 0);
        CHECK(targets[at] == -100);
      }
    }
  }
}

TEST_CASE("a padded, packed step trains as its documents alone: loss and gradients are their token-weighted means") {
  GptConfig c;
  c.layer = LayerConfig::make(24, 6);  // heads divisible by p = 1, 2, 3
  c.layer.causal = c.layer.zigzag = c.layer.rope = true;
  c.layers = 2;
  c.vocab = 256;
  // Documents shorter than the group's minimum (2p tokens) and longer ones; one of a single token.
  const std::vector<data::Document> docs = documents_of({2, 4, 9, 14}, 11);
  const std::vector<data::Window> windows{{0, 0, 1}, {1, 0, 3}, {2, 1, 7}, {3, 0, 13}};

  // One document alone on one rank, unpadded (zigzag needs 2 tokens: the 1-token one gets one padded token).
  const auto run = [&](const data::Step& step, int p, const char* strategy) {
    RunResult result;
    std::vector<std::int32_t> inputs, targets;
    data::step_tokens(step, docs, ops::cpu::kIgnoreIndex, inputs, targets);
    const std::int64_t rows = std::int64_t(step.rows.size()), s = step.length;
    run_ranks(p, [&](ThreadCommunicator& comm) {
      const int r = comm.rank();
      BufferPool pool;
      Model model(c, p, r, 21);
      const SequenceLayout layout(s, p, c.layer.zigzag);
      const Tensor<std::int32_t> x = shard_tokens(inputs, rows, layout, r), y = shard_tokens(targets, rows, layout, r);
      model.zero_gradients();
      const GptStepResult out =
          model.forward_backward(comm, pool, uniform_plan<Strategies>(2, strategy), s, x.view(), y.view());
      if (r != 0) return;
      result.loss = out.loss;
      result.counted = out.counted;
      result.replicated_grad.assign(model.replicated_gradient().span().begin(), model.replicated_gradient().span().end());
      if (p == 1) {  // the one-rank shards are the global weights
        const LayerWeights& g = model.stack().gradients()[0];
        result.layer_grad.assign(g.attention.packed.span().begin(), g.attention.packed.span().end());
        result.layer_grad.insert(result.layer_grad.end(), g.mlp.packed.span().begin(), g.mlp.packed.span().end());
      }
    });
    return result;
  };
  std::vector<RunResult> alone;
  for (const data::Window& w : windows) alone.push_back(run({{w}, std::max<std::int64_t>(w.length, 2)}, 1, "MegatronTS"));

  for (const int p : {2, 3})
    for (const std::int64_t budget : {std::int64_t(0), std::int64_t(40)})
      for (const char* strategy : {"MegatronTS", "UlyssesZ"}) {
        const std::vector<data::Step> steps = data::pack_steps(windows, budget, 2 * p);
        for (const data::Step& step : steps) {
          CAPTURE(p);
          CAPTURE(budget);
          CAPTURE(strategy);
          CAPTURE(step.rows.size());
          CAPTURE(step.length);
          const RunResult got = run(step, p, strategy);
          const DocumentsMean want = documents_mean(alone, step);
          CHECK(got.counted == want.counted);  // the padding is not counted
          CHECK(got.loss == doctest::Approx(want.loss).epsilon(1e-5));
          CHECK(testing::first_mismatch(std::span<const float>(got.replicated_grad), std::span<const double>(want.grad),
                                        testing::kFloat32) == "");
        }
      }
  // The layer gradients too, on one rank: a packed step of all four against the documents alone.
  const data::Step all = data::pack_steps(windows, 1000, 2)[0];
  REQUIRE(all.rows.size() == windows.size());
  const RunResult packed = run(all, 1, "MegatronTS");
  const DocumentsMean want = documents_mean(alone, all, &RunResult::layer_grad);
  CHECK(packed.counted == want.counted);
  CHECK(testing::first_mismatch(std::span<const float>(packed.layer_grad), std::span<const double>(want.grad),
                                testing::kFloat32) == "");
}

TEST_CASE("pack_sequences: every window once, one sequence per step within the budget, documents back to back") {
  Rng rng(9);
  std::vector<data::Window> windows;
  for (std::size_t i = 0; i < 60; ++i) windows.push_back({i, 0, 1 + std::int64_t(rng.below(90))});
  for (const std::int64_t budget : {1, 50, 128, 400}) {
    CAPTURE(budget);
    const std::int64_t min_length = 8;
    const std::vector<data::Step> steps = data::pack_sequences(windows, budget, min_length);
    std::vector<std::size_t> seen;
    std::int64_t real = 0;
    for (const data::Step& step : steps) {
      REQUIRE(!step.rows.empty());
      CHECK(step.packed);
      CHECK(step.sequences() == 1);
      CHECK(step.length == std::max(step.real_tokens(), min_length));  // padded only up to the group's minimum
      if (step.rows.size() > 1) CHECK(step.real_tokens() <= budget);  // one window longer than B is a step alone
      const std::vector<std::int64_t> starts = step.document_starts(), lengths = step.document_lengths();
      REQUIRE(starts.size() == lengths.size());
      CHECK(starts.size() == step.rows.size() + (step.padded_tokens() > 0 ? 1 : 0));  // the padding: a document
      std::int64_t at = 0;
      for (std::size_t d = 0; d < starts.size(); ++d) {
        CHECK(starts[d] == at);
        CHECK(lengths[d] >= 1);
        at += lengths[d];
      }
      CHECK(at == step.length);
      for (const data::Window& w : step.rows) seen.push_back(w.document);
      real += step.real_tokens();
    }
    std::sort(seen.begin(), seen.end());
    REQUIRE(seen.size() == windows.size());
    for (std::size_t i = 0; i < windows.size(); ++i) CHECK(seen[i] == i);
    std::int64_t want = 0;
    for (const data::Window& w : windows) want += w.length;
    CHECK(real == want);
    if (budget == 1) CHECK(steps.size() == windows.size());
    if (budget == 400) CHECK(std::int64_t(steps.size()) <= want / 400 + 2);  // first-fit decreasing fills the steps
  }
  CHECK_THROWS_WITH_AS(data::pack_sequences(windows, 0, 8), doctest::Contains("token budget 0"), Error);
}

TEST_CASE("step_tokens, packed: one row, the windows back to back with their own next bytes, padding at the end") {
  const std::vector<data::Document> docs = documents_of({5, 12, 2}, 3);
  const data::Step step{{{0, 1, 3}, {1, 4, 7}, {2, 0, 1}}, 13, true};
  std::vector<std::int32_t> inputs, targets;
  data::step_tokens(step, docs, -100, inputs, targets);
  REQUIRE(inputs.size() == 13);
  CHECK(step.document_starts() == std::vector<std::int64_t>{0, 3, 10, 11});
  std::size_t at = 0;
  for (const data::Window& w : step.rows)
    for (std::int64_t i = 0; i < w.length; ++i, ++at) {
      CHECK(inputs[at] == std::int32_t(std::uint8_t(docs[w.document].bytes[std::size_t(w.offset + i)])));
      CHECK(targets[at] == std::int32_t(std::uint8_t(docs[w.document].bytes[std::size_t(w.offset + i + 1)])));
    }
  for (; at < 13; ++at) {
    CHECK(inputs[at] == 0);
    CHECK(targets[at] == -100);
  }
}

TEST_CASE("a packed sequence trains as its documents alone on every strategy, planned, with documents of 1 and p-1 "
          "tokens (p = 3, 4)") {
  using All = AllStrategies<>;
  using Packed = Gpt<All>;
  GptConfig c;
  c.layer = LayerConfig::make(48, 12);  // heads divisible by p = 1, 3, 4
  c.layer.causal = c.layer.zigzag = c.layer.rope = true;
  c.layers = 2;
  c.vocab = 256;
  const std::vector<data::Document> docs = documents_of({2, 3, 4, 9, 14}, 17);
  // 1 token, 2 and 3 tokens (p - 1 for p = 3, 4), and two longer ones that span chunk boundaries.
  const std::vector<data::Window> windows{{0, 0, 1}, {1, 0, 2}, {2, 0, 3}, {3, 1, 7}, {4, 0, 13}};
  const auto run = [&](const data::Step& step, int p, const StackPlan& plan) {
    RunResult result;
    std::vector<std::int32_t> inputs, targets;
    data::step_tokens(step, docs, ops::cpu::kIgnoreIndex, inputs, targets);
    const std::vector<std::int64_t> starts = step.document_starts();
    run_ranks(p, [&](ThreadCommunicator& comm) {
      const int r = comm.rank();
      BufferPool pool;
      Packed model(c, p, r, 23);
      const SequenceLayout layout(step.length, p, c.layer.zigzag);
      const Tensor<std::int32_t> x = shard_tokens(inputs, step.sequences(), layout, r);
      const Tensor<std::int32_t> y = shard_tokens(targets, step.sequences(), layout, r);
      model.zero_gradients();
      const GptStepResult out = model.forward_backward(comm, pool, plan, step.length, x.view(), y.view(), starts);
      if (r != 0) return;
      result.loss = out.loss;
      result.counted = out.counted;
      result.replicated_grad.assign(model.replicated_gradient().span().begin(), model.replicated_gradient().span().end());
    });
    return result;
  };
  const StackPlan ts = uniform_plan<All>(2, "MegatronTS");
  std::vector<RunResult> alone;  // each document alone on one rank (zigzag: at least 2 tokens, a 1-token one padded)
  for (const data::Window& w : windows) alone.push_back(run({{w}, std::max<std::int64_t>(w.length, 2)}, 1, ts));

  const cost::HardwareProfile hardware = cost::a100_sxm4_80gb_x8();
  for (const int p : {3, 4}) {
    const std::vector<data::Step> steps = data::pack_sequences(windows, 17, 2 * p);
    REQUIRE(steps.size() >= 2);
    for (const data::Step& step : steps) {
      // The planner plans the packed step from its documents (dry runs with the document mask).
      const plan::GptCosts<Packed> costs{c, p, &hardware};
      const plan::Plan planned = plan::plan_exact(costs.packed_table(step.document_lengths()), std::int64_t(1) << 40);
      std::vector<StackPlan> plans{plan::stack_plan<All>(planned), {{0, 2}, {3, 4}}};  // the plan, and a mix
      for (const std::string_view name : {"MegatronTS", "MegatronCZ", "UlyssesZ", "ColossalZ", "METP"})
        plans.push_back(uniform_plan<All>(2, name));
      const DocumentsMean want = documents_mean(alone, step);
      for (std::size_t k = 0; k < plans.size(); ++k) {
        CAPTURE(p);
        CAPTURE(k);
        CAPTURE(step.length);
        CAPTURE(fmt::format("{}", fmt::join(step.document_starts(), ",")));
        const RunResult got = run(step, p, plans[k]);
        CHECK(got.counted == want.counted);
        CHECK(got.loss == doctest::Approx(want.loss).epsilon(1e-5));
        CHECK(testing::first_mismatch(std::span<const float>(got.replicated_grad), std::span<const double>(want.grad),
                                      testing::kFloat32) == "");
      }
    }
  }
}

TEST_CASE("mesh_steps: rows one step each; packed sequences dp per step, consecutive or grouped by cost") {
  std::vector<data::Step> rows, packed;
  for (std::size_t i = 0; i < 5; ++i) {
    rows.push_back({{{i, 0, 3}, {i, 1, 2}}, 4});
    packed.push_back({{{i, 0, 3}, {i, 1, 2}}, 5, true});
  }
  const std::vector<double> cost{1, 5, 2, 4, 3};
  const auto documents = [](const data::MeshStep& step) {
    std::vector<std::size_t> out;
    for (const data::Step& part : step.parts) out.push_back(part.rows.at(0).document);
    return out;
  };
  // Rows: each step alone (its rows dealt over dp), costs or not.
  for (const std::vector<data::MeshStep>& steps : {data::mesh_steps(rows, 2), data::mesh_steps(rows, 2, cost)}) {
    REQUIRE(steps.size() == 5);
    for (std::size_t k = 0; k < 5; ++k) {
      CHECK(documents(steps[k]) == std::vector<std::size_t>{k});
      CHECK_FALSE(steps[k].per_replica);
      CHECK(steps[k].work(0, 2).second == ChunkRange{0, 1});
      CHECK(steps[k].work(1, 2).second == ChunkRange{1, 1});
      CHECK(steps[k].real_tokens() == 5);
    }
  }
  // Packed, no costs: dp consecutive sequences per step, the last short.
  const std::vector<data::MeshStep> consecutive = data::mesh_steps(packed, 2);
  REQUIRE(consecutive.size() == 3);
  CHECK(documents(consecutive[0]) == std::vector<std::size_t>{0, 1});
  CHECK(documents(consecutive[1]) == std::vector<std::size_t>{2, 3});
  CHECK(documents(consecutive[2]) == std::vector<std::size_t>{4});
  CHECK(consecutive[0].real_tokens() == 10);
  // Packed with costs 1, 5, 2, 4, 3: groups {5, 4}, {3, 2}, {1} of sequences {1, 3}, {4, 2}, {0}, in the order of
  // their first sequence, each group's parts in their order.
  const std::vector<data::MeshStep> by_cost = data::mesh_steps(packed, 2, cost);
  REQUIRE(by_cost.size() == 3);
  CHECK(documents(by_cost[0]) == std::vector<std::size_t>{0});
  CHECK(documents(by_cost[1]) == std::vector<std::size_t>{1, 3});
  CHECK(documents(by_cost[2]) == std::vector<std::size_t>{2, 4});
  CHECK(by_cost[0].work(1, 2).first == nullptr);
  CHECK(by_cost[1].work(1, 2).first->rows[0].document == 3);
  // dp = 1: one sequence per step in the given order, whatever the costs.
  const std::vector<data::MeshStep> one = data::mesh_steps(packed, 1, cost);
  REQUIRE(one.size() == 5);
  for (std::size_t k = 0; k < 5; ++k) CHECK(documents(one[k]) == std::vector<std::size_t>{k});
  CHECK_THROWS_AS(data::mesh_steps(packed, 2, std::vector<double>{1, 2}), Error);
}
