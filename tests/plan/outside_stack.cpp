// Tests of paradyse/plan/outside_stack.hpp and the step time of plan/cost_table.hpp's evaluate: a GPT's step
// prediction holds the work outside its layer stack (the LM head's GEMMs and the loss, the replicated gradients'
// all-reduce, AdamW over every parameter of the rank, the embedding), each part as the profile prices it, and the
// first touch of the pool's working set, or where the profile prices the pool's misses, the step's loans replayed
// in order; a stack alone (no vocabulary) is priced as before.
#include "paradyse/cost/builtin_profiles.hpp"
#include "paradyse/cost/memory_model.hpp"
#include "paradyse/model/gpt.hpp"
#include "paradyse/ops/backend.hpp"
#include "paradyse/plan/gpt_costs.hpp"

#include "plan/small_gpt.hpp"

#include <doctest/doctest.h>

#include <cstdint>
#include <tuple>
#include <vector>

using namespace paradyse;

namespace {

GptConfig gpt(std::int64_t vocab) {
  GptConfig c = testing::small_gpt(128, 512, 3, vocab);
  c.layer.rope = true;
  return c;
}

using Costs = plan::GptCosts<Gpt<ops::Cpu>>;

// The stack's own time under a uniform plan: every sublayer's option.
double stack_time(const plan::CostTable& t, int strategy) {
  double sum = 0;
  for (int l = 0; l < t.layer_count(); ++l)
    for (cost::Sublayer part : cost::kAllSublayers) sum += t.option(t.layer_kinds[std::size_t(l)], part, strategy)->time_s;
  return sum;
}

// The fresh memory both pool cases give the profile: zeroed at 20 GB/s, new pages from 4 MiB at 1.5 GB/s.
const cost::FreshMemoryModel kFresh{2e10, 1.5e9, std::int64_t(1) << 22};

// A pool buffer's first touch under kFresh, written out: the pool does not zero, so nothing below 4 MiB, and from it
// the new pages' faults (the fresh price less a memset's).
double unzeroed_touch_s(double bytes) {
  return bytes >= double(std::int64_t(1) << 22) ? bytes / 1.5e9 - bytes / 2e10 : 0.0;
}

}  // namespace

TEST_CASE("outside stack: the head's GEMMs, the all-reduce and AdamW, each at the profile's rates") {
  for (const auto& [p, s, vocab] : {std::tuple{2, 1024, 256}, std::tuple{3, 999, 300}, std::tuple{1, 3000, 97}}) {
    CAPTURE(p);
    CAPTURE(s);
    const GptConfig config = gpt(vocab);
    const double rows = double((s + p - 1) / p), v = double(vocab), h = 128;
    const double replicated = (2 * v + 2) * h;  // untied: embedding and head, final gamma and beta
    // Only GEMMs and collectives priced: the head is its three GEMMs per chunk (rows <= 1024 here or in 3 chunks).
    cost::HardwareProfile hw = cost::a100_sxm4_80gb_x8();
    hw.elementwise_bytes_per_s = 1e30;
    hw.activation_elements_per_s = 1e30;
    const Costs costs{config, p, &hw};
    const plan::CostTable t = costs.table(s);
    double head = 0;
    for (double start = 0; start < rows; start += 1024) {
      const double chunk = std::min(1024.0, rows - start);
      head += hw.gemm.time(chunk, v, h, 4) + hw.gemm.time(v, h, chunk, 4) + hw.gemm.time(chunk, h, v, 4);
    }
    CHECK(t.outside_time.head_loss_s == doctest::Approx(head).epsilon(1e-9));
    CHECK(t.outside_time.reduce_s ==
          doctest::Approx(hw.collective_time(cost::Collective::all_reduce, p, 4 * replicated)).epsilon(1e-9));
    CHECK(t.outside_time.embedding_s == doctest::Approx(0).epsilon(1e-12));
    // Only elementwise traffic priced: AdamW reads and writes 7 floats per parameter of the rank.
    hw = cost::a100_sxm4_80gb_x8();
    hw.gemm = {0, 1e30, 0};
    hw.elementwise_bytes_per_s = 1.7e9;
    const Costs traffic{config, p, &hw};
    const plan::CostTable u = traffic.table(s);
    cost::ModelShape shape = cost::shape_of(config.layer, 1, 1, 4);
    const double parameters = replicated + double(config.layers * cost::parameters_per_rank(shape, p));
    CHECK(u.outside_time.optimizer_s == doctest::Approx(28 * parameters / 1.7e9).epsilon(1e-9));
    // The embedding: a lookup writing and reading rows x h, its gradient's scatter reading two and writing one.
    CHECK(u.outside_time.embedding_s == doctest::Approx(4 * 5 * rows * h / 1.7e9).epsilon(1e-9));
    CHECK(u.outside_time.head_loss_s > 0);  // norm and cross-entropy traffic
  }
}

TEST_CASE("outside stack: a step prediction is the stack's time plus the head's, loss's and AdamW's") {
  const cost::HardwareProfile hw = cost::a100_sxm4_80gb_x8();
  const GptConfig config = gpt(256);
  const Costs costs{config, 2, &hw};
  const plan::CostTable with = costs.table(2048);
  plan::ModelConfig stack_only = plan::model_config_of(config.layer, config.layers, 4, {4, 4, 8});
  const plan::CostTable without = plan::build_cost_table(stack_only, hw, 2, plan::Batch::single(2048));
  CHECK(without.outside_time.time_s() == 0);
  CHECK(with.outside_time.head_loss_s > 0);
  CHECK(with.outside_time.optimizer_s > 0);
  CHECK(with.outside_time.reduce_s > 0);
  for (int s : cost::default_catalog().all()) {
    if (!with.option(0, cost::Sublayer::attention, s) || !with.option(0, cost::Sublayer::mlp, s)) continue;
    const plan::Evaluation a = plan::evaluate(with, plan::uniform_layers(with, s));
    const plan::Evaluation b = plan::evaluate(without, plan::uniform_layers(without, s));
    const plan::OutsideStackTime& o = with.outside_time;  // each part named: the step holds all four
    CHECK(a.time_s == doctest::Approx(stack_time(with, s) + o.embedding_s + o.head_loss_s + o.reduce_s + o.optimizer_s)
                          .epsilon(1e-12));
    CHECK(b.time_s == doctest::Approx(stack_time(without, s)).epsilon(1e-12));
    CHECK(a.time_s - b.time_s == doctest::Approx(with.outside_time.time_s()).epsilon(1e-9));
    const plan::Plan planned = plan::plan_of(with, plan::uniform_layers(with, s), 0);
    CHECK(planned.time_s == a.time_s);
  }
}

TEST_CASE("outside stack: the pool's working set is touched afresh once per step") {
  cost::HardwareProfile hw = cost::a100_sxm4_80gb_x8();
  hw.fresh_memory = kFresh;
  const GptConfig config = gpt(256);
  const plan::CostTable t = Costs{config, 2, &hw}.table(4096);
  for (int s : cost::default_catalog().all()) {
    if (!t.option(0, cost::Sublayer::attention, s) || !t.option(0, cost::Sublayer::mlp, s)) continue;
    const plan::Evaluation e = plan::evaluate(t, plan::uniform_layers(t, s));
    const double touch = unzeroed_touch_s(double(e.memory.largest_transient));
    CHECK(e.time_s == doctest::Approx(stack_time(t, s) + t.outside_time.time_s() + touch).epsilon(1e-12));
  }
}

TEST_CASE("outside stack: with a pool-miss rate, the step's pool misses in order replace the first touch") {
  // Each miss priced as an unzeroed fresh allocation of its size (unzeroed_touch_s), or, without fresh-memory rates,
  // its bytes at the pool's rate.
  for (const bool fresh_rates : {true, false}) {
    CAPTURE(fresh_rates);
    cost::HardwareProfile hw = cost::a100_sxm4_80gb_x8();
    hw.fresh_memory = fresh_rates ? kFresh : cost::FreshMemoryModel{};
    hw.pool_miss_bytes_per_s = 1.2e9;
    const GptConfig config = gpt(256);
    for (const auto& [p, s] : {std::tuple{2, 4096}, std::tuple{4, 2000}}) {
      CAPTURE(p);
      CAPTURE(s);
      const plan::CostTable t = Costs{config, p, &hw}.table(s);
      cost::ModelShape shape = cost::shape_of(config.layer, 1, s, 4);
      int checked = 0;
      for (int strategy : cost::default_catalog().all()) {
        if (!t.option(0, cost::Sublayer::attention, strategy) || !t.option(0, cost::Sublayer::mlp, strategy)) continue;
        std::vector<cost::SublayerMemory> order;
        for (int l = 0; l < config.layers; ++l)
          for (cost::Sublayer part : cost::kAllSublayers)
            order.push_back(cost::sublayer_memory(strategy, part, shape, p));
        shape.layers = config.layers;
        const cost::OrderedReplay replay = cost::ordered_replay(order, cost::stack_buffers(shape, p));
        shape.layers = 1;
        const plan::Evaluation e = plan::evaluate(t, plan::uniform_layers(t, strategy));
        CHECK(replay.pool_missed_bytes > 0);
        double misses_s = 0, missed = 0;
        for (const std::int64_t bytes : replay.pool_misses) {
          missed += double(bytes);
          misses_s += fresh_rates ? unzeroed_touch_s(double(bytes)) : double(bytes) / 1.2e9;
        }
        CHECK(missed == double(replay.pool_missed_bytes));
        CHECK(e.time_s == doctest::Approx(stack_time(t, strategy) + t.outside_time.time_s() + misses_s).epsilon(1e-12));
        ++checked;
      }
      CHECK(checked >= 4);
    }
  }
}
