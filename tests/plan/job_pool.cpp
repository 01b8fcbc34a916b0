// Tests of paradyse/plan/job_pool.hpp (every job once, the lowest index's exception, nested and concurrent calls,
// Serial) and of the parallel cost table: build_cost_table on the pool gives the table of a serial build, every field,
// over shapes, lengths and group sizes (uneven ones included).
#include "paradyse/cost/builtin_profiles.hpp"
#include "paradyse/plan/cost_table.hpp"
#include "paradyse/plan/job_pool.hpp"

#include <doctest/doctest.h>

#include <atomic>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

using namespace paradyse;
using namespace paradyse::plan;

namespace {

// Runs count jobs on `pool`; each writes its index times 3 into its slot and counts its calls.
void check_every_job_once(JobPool& pool, std::size_t count) {
  std::vector<std::int64_t> out(count, -1);
  std::vector<std::atomic<int>> calls(count);
  pool.run(count, [&](std::size_t i) {
    calls[i].fetch_add(1);
    out[i] = std::int64_t(i) * 3;
  });
  for (std::size_t i = 0; i < count; ++i) {
    CHECK(calls[i].load() == 1);
    CHECK(out[i] == std::int64_t(i) * 3);
  }
}

void check_same_table(const CostTable& a, const CostTable& b) {
  CHECK(a.fixed_bytes == b.fixed_bytes);
  CHECK(a.model_state_bytes == b.model_state_bytes);
  CHECK(a.stack_bytes == b.stack_bytes);
  CHECK(a.plain_bytes == b.plain_bytes);
  REQUIRE(a.entries.size() == b.entries.size());
  for (std::size_t k = 0; k < a.entries.size(); ++k)
    for (Sublayer part : cost::kAllSublayers)
      for (Strategy s = 0; s < a.strategy_count(); ++s) {
        const CostTable::Entry& x = a.entry(int(k), part, s);
        const CostTable::Entry& y = b.entry(int(k), part, s);
        CAPTURE(k);
        CAPTURE(s);
        CHECK(x.forbidden_reason == y.forbidden_reason);
        REQUIRE(x.option.has_value() == y.option.has_value());
        if (!x.option) continue;
        CHECK(x.option->time_s == y.option->time_s);  // bitwise: the same dry run, whichever thread ran it
        CHECK(x.option->saved_bytes == y.option->saved_bytes);
        CHECK(x.option->transient_bytes == y.option->transient_bytes);
      }
}

}  // namespace

TEST_CASE("job pool: every job runs once, with 0, 1, 2 or 3 workers and any count") {
  for (int workers : {0, 1, 2, 3}) {
    JobPool pool(workers);
    CHECK(pool.workers() == workers);
    for (std::size_t count : {0, 1, 2, 3, 10, 257}) check_every_job_once(pool, count);
  }
  check_every_job_once(JobPool::shared(), 40);
}

TEST_CASE("job pool: the lowest index's exception is rethrown after every job ran") {
  JobPool pool(2);
  std::atomic<int> ran{0};
  try {
    pool.run(50, [&](std::size_t i) {
      ran.fetch_add(1);
      if (i == 17 || i == 31 || i == 44) throw std::runtime_error("job " + std::to_string(i));
    });
    FAIL("no exception");
  } catch (const std::runtime_error& e) {
    CHECK(std::string(e.what()) == "job 17");
  }
  CHECK(ran.load() == 50);
  check_every_job_once(pool, 20);  // the pool works after a failed call
}

TEST_CASE("job pool: a call from inside a job, or from another thread meanwhile, runs all its jobs") {
  JobPool pool(1);
  std::vector<std::int64_t> sums(8, 0);
  pool.run(sums.size(), [&](std::size_t i) {
    std::vector<std::int64_t> inner(5, 0);
    pool.run(inner.size(), [&](std::size_t j) { inner[j] = std::int64_t(i * 10 + j); });  // serial: the pool is busy
    for (std::int64_t v : inner) sums[i] += v;
  });
  for (std::size_t i = 0; i < sums.size(); ++i) CHECK(sums[i] == std::int64_t(50 * i + 10));
  std::vector<std::thread> callers;
  std::atomic<int> wrong{0};
  for (int t = 0; t < 3; ++t)
    callers.emplace_back([&] {
      for (int round = 0; round < 50; ++round) {
        std::vector<int> out(7, 0);
        pool.run(out.size(), [&](std::size_t i) { out[i] = int(i) + 1; });
        for (std::size_t i = 0; i < out.size(); ++i) wrong += out[i] != int(i) + 1;
      }
    });
  for (std::thread& c : callers) c.join();
  CHECK(wrong.load() == 0);
}

TEST_CASE("job pool: under Serial every job runs on the calling thread, in index order") {
  JobPool pool(2);
  const JobPool::Serial serial(pool);
  std::vector<std::size_t> order;
  std::atomic<int> elsewhere{0};
  const std::thread::id caller = std::this_thread::get_id();
  pool.run(30, [&](std::size_t i) {
    elsewhere += std::this_thread::get_id() != caller;
    order.push_back(i);
  });
  CHECK(elsewhere.load() == 0);
  REQUIRE(order.size() == 30);
  for (std::size_t i = 0; i < order.size(); ++i) CHECK(order[i] == i);
}

TEST_CASE("cost table: the dry runs on the pool give the serial table, every field") {
  const cost::HardwareProfile hw = cost::a100_sxm4_80gb_x8();
  cost::ModelShape gqa = cost::ModelShape::mha(96, 6);
  gqa.kv_heads = 3;
  gqa.swiglu = true;
  gqa.ffn = 160;
  gqa.causal = true;
  cost::ModelShape zigzag = cost::ModelShape::mha(64, 4);
  zigzag.causal = zigzag.zigzag = zigzag.rope = true;
  ModelConfig two_kinds = ModelConfig::uniform(cost::ModelShape::mha(64, 4), 3);
  two_kinds.kinds.push_back({"gqa", gqa});
  two_kinds.layer_kinds = {0, 1, 1, 0, 1};
  const std::vector<ModelConfig> models = {ModelConfig::uniform(gqa, 4), ModelConfig::uniform(zigzag, 2), two_kinds};
  for (const ModelConfig& model : models)
    for (int p : {1, 2, 3, 4})
      for (std::int64_t s : {7, 64, 333}) {
        CAPTURE(p);
        CAPTURE(s);
        std::optional<CostTable> parallel, serial;
        std::string parallel_error, serial_error;
        try {
          parallel = build_cost_table(model, hw, p, Batch::single(s));
        } catch (const Error& e) {
          parallel_error = e.what();
        }
        {
          const JobPool::Serial one_thread(JobPool::shared());
          try {
            serial = build_cost_table(model, hw, p, Batch::single(s));
          } catch (const Error& e) {
            serial_error = e.what();
          }
        }
        CHECK(parallel_error == serial_error);
        REQUIRE(parallel.has_value() == serial.has_value());
        if (parallel) check_same_table(*parallel, *serial);
      }
}
