// Tests of the planners' view of a vocabulary sharded over T ranks (plan/outside_stack.hpp's OutsideStack::vocab_shards,
// plan/gpt_costs.hpp's and plan/moe_plan.hpp's vocab_shards; model/vocab_parallel.hpp runs it): the bytes a rank holds
// outside the stack and the time of the embedding, the head and loss, the replicated reduction and AdamW, against
// hand sums for T = 1, 2, 3 (T = 1: the whole tables, as model/gpt.hpp's Gpt counts them).
#include "paradyse/cost/builtin_profiles.hpp"
#include "paradyse/model/gpt.hpp"
#include "paradyse/plan/gpt_costs.hpp"
#include "paradyse/plan/moe_plan.hpp"

#include "plan/small_gpt.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <tuple>

using namespace paradyse;

namespace {

GptConfig gpt(std::int64_t vocab) { return testing::small_gpt(64, 256, 2, vocab); }

using Costs = plan::GptCosts<Gpt<>>;

std::int64_t bytes(std::int64_t floats) { return (floats * 4 + 63) / 64 * 64; }

// (group p, shards T, tokens s, vocabulary V): T divides p; V not always a multiple of T; N over a chunk or not.
constexpr std::tuple<int, int, std::int64_t, std::int64_t> kCases[] = {
    {2, 1, 1024, 301}, {2, 2, 1024, 301}, {3, 3, 999, 300}, {6, 3, 1500, 257}, {4, 2, 5000, 97}};

}  // namespace

TEST_CASE("vocab-parallel costs: the bytes outside the stack, V / T rows of the embedding and the head") {
  const cost::HardwareProfile hw = cost::a100_sxm4_80gb_x8();
  for (const auto& [p, shards, s, vocab] : kCases) {
    CAPTURE(p);
    CAPTURE(shards);
    const GptConfig config = gpt(vocab);
    Costs costs{config, p, &hw};
    costs.vocab_shards = shards;
    const std::int64_t h = 64, rows = costs.max_local_tokens(s), vr = (vocab + shards - 1) / shards;
    // The embedding's and the head's rows (untied), the final norm's: weights, gradients, two moments.
    const std::int64_t states = 4 * 4 * (2 * vr + 2) * h;
    CHECK(costs.outside().state_bytes(h) == states);
    const std::int64_t tokens_targets = 2 * bytes(rows);
    if (shards == 1) {  // the single group's Gpt
      CHECK(states == Gpt<>::replicated_state_bytes(config));
      CHECK(costs.extra_bytes(s) == states + Gpt<>::activation_bytes(config, 1, rows) + tokens_targets);
    } else {  // y, dy, normed, dnormed, stats, norm gradient, gathered [N, h], a chunk of logits; the kept ids
      const std::int64_t act = bytes(rows * h), n = rows * shards;
      const std::int64_t head = 4 * act + bytes(2 * rows) + bytes(2 * h) + bytes(n * h) +
                                bytes(std::min<std::int64_t>(n, 1024) * vr);
      CHECK(costs.extra_bytes(s) == states + head + bytes(rows) + tokens_targets);
      Costs whole{config, p, &hw};
      CHECK(costs.outside().state_bytes(h) < whole.outside().state_bytes(h));
    }
    const plan::CostTable t = costs.table(s);
    CHECK(t.fixed_bytes == t.model_state_bytes + t.stack_bytes + t.plain_bytes + costs.extra_bytes(s));
  }
}

TEST_CASE("vocab-parallel costs: the time outside the stack, its GEMMs on V / T columns and its collectives") {
  for (const auto& [p, shards, s, vocab] : kCases) {
    CAPTURE(p);
    CAPTURE(shards);
    CAPTURE(s);
    const GptConfig config = gpt(vocab);
    // Only GEMMs and collectives priced.
    cost::HardwareProfile hw = cost::a100_sxm4_80gb_x8();
    hw.elementwise_bytes_per_s = 1e30;
    hw.activation_elements_per_s = 1e30;
    Costs costs{config, p, &hw};
    costs.vocab_shards = shards;
    const plan::CostTable t = costs.table(s);
    const double rows = double((s + p - 1) / p), n = rows * shards, h = 64;
    const double vr = double((vocab + shards - 1) / shards);
    const auto collective = [&](cost::Collective op, int group, double b) { return hw.collective_time(op, group, b); };
    using cost::Collective;
    // The head: per chunk of the N gathered rows its three GEMMs on V_r columns and (sharded) three all-reduces of
    // the chunk's rows; sharded, the targets and the normed rows gathered, dx reduce-scattered, the norm's gradient
    // all-reduced.
    double head_gemms = 0, head_comm = 0;
    for (double start = 0; start < n; start += 1024) {
      const double chunk = std::min(1024.0, n - start);
      head_gemms += hw.gemm.time(chunk, vr, h, 4) + hw.gemm.time(vr, h, chunk, 4) + hw.gemm.time(chunk, h, vr, 4);
      if (shards > 1) head_comm += 3 * collective(Collective::all_reduce, shards, 4 * chunk);
    }
    double embedding = 0;
    if (shards > 1) {
      head_comm += collective(Collective::all_gather, shards, 4 * n) +
                   collective(Collective::all_gather, shards, 4 * n * h) +
                   collective(Collective::reduce_scatter, shards, 4 * n * h) +
                   collective(Collective::all_reduce, shards, 4 * 2 * h);
      // The ids gathered, the partial embedding reduce-scattered, its gradient gathered.
      embedding = collective(Collective::all_gather, shards, 4 * n) +
                  collective(Collective::reduce_scatter, shards, 4 * n * h) +
                  collective(Collective::all_gather, shards, 4 * n * h);
    }
    CHECK(t.outside_time.head_loss_s == doctest::Approx(head_gemms + head_comm).epsilon(1e-9));
    CHECK(t.outside_time.embedding_s == doctest::Approx(embedding).epsilon(1e-9));
    // Of which the collectives (exposed: the search adds them to a stage group's price, search/stage_group.hpp).
    CHECK(t.outside_time.head_loss_comm_s == doctest::Approx(head_comm).epsilon(1e-9));
    CHECK(t.outside_time.embedding_comm_s == doctest::Approx(embedding).epsilon(1e-9));
    // The pack's gradients over the p / T ranks holding the same rows.
    const double replicated = (2 * vr + 2) * h;
    const double reduce = p / shards > 1 ? collective(Collective::all_reduce, p / shards, 4 * replicated) : 0.0;
    CHECK(t.outside_time.reduce_s == doctest::Approx(reduce).epsilon(1e-9));
    // Only elementwise traffic priced: AdamW reads and writes 7 floats per parameter the rank holds.
    hw = cost::a100_sxm4_80gb_x8();
    hw.gemm = {0, 1e30, 0};
    hw.elementwise_bytes_per_s = 1.7e9;
    Costs traffic{config, p, &hw};
    traffic.vocab_shards = shards;
    const plan::CostTable u = traffic.table(s);
    const double parameters = replicated + double(config.layers * cost::parameters_per_rank(cost::shape_of(config.layer, 1, 1, 4), p));
    CHECK(u.outside_time.optimizer_s == doctest::Approx(28 * parameters / 1.7e9).epsilon(1e-9));
  }
}

TEST_CASE("vocab-parallel costs: the MoE planner prices the outside of the stack as the dense one") {
  const cost::HardwareProfile hw = cost::a100_sxm4_80gb_x8();
  for (const auto& [p, shards, s, vocab] : {std::tuple{2, 2, 512, 301}, std::tuple{4, 2, 600, 1000}, std::tuple{4, 4, 700, 1001}}) {
    CAPTURE(p);
    const GptConfig config = testing::with_moe(gpt(vocab));
    plan::MoeGptCosts<Gpt<>> moe{config, p, &hw};
    moe.vocab_shards = shards;
    Costs dense{config, p, &hw};
    dense.vocab_shards = shards;
    const plan::MoeCostTable t = moe.table(s);
    const plan::CostTable d = dense.table(s);
    CHECK(moe.extra_bytes(s) == dense.extra_bytes(s));
    CHECK(t.dense.outside_time.embedding_s == doctest::Approx(d.outside_time.embedding_s).epsilon(1e-12));
    CHECK(t.dense.outside_time.head_loss_s == doctest::Approx(d.outside_time.head_loss_s).epsilon(1e-12));
    CHECK(t.dense.outside_time.reduce_s == doctest::Approx(d.outside_time.reduce_s).epsilon(1e-12));
    plan::MoeGptCosts<Gpt<>> whole{config, p, &hw};
    CHECK(moe.extra_bytes(s) < whole.extra_bytes(s));
    CHECK(t.dense.outside_time.reduce_s < whole.table(s).dense.outside_time.reduce_s);
  }
}
