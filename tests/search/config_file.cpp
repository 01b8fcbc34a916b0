// Tests of paradyse/search/config_file.hpp and the scoring of fixed configurations (issue 26): a configuration
// written as a file reads back to the same configuration and the same prediction (search_parallel --emit, then
// --score), models and clusters round-trip through their JSON, --config text, the published rows scored as files
// (Megatron-LM SC'21 Table 1 within 15% as the paper counts; Llama 3 405B fitting, within 0.6x to 1.15x), and bad
// files refused by name.
#include "paradyse/search/config_file.hpp"
#include "paradyse/search/search.hpp"
#include "paradyse/search/validation.hpp"
#include "support/error_of.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

using paradyse::testing::error_of;

using namespace paradyse;
using namespace paradyse::search;

namespace config_file_test {

TrainingSetup setup_of_size(std::int64_t seq, std::int64_t batch) {
  TrainingSetup s;
  s.seq = seq;
  s.global_batch = batch;
  return s;
}

TrainingModel moe_model() {
  return {.name = "moe-test", .layers = 6, .hidden = 512, .heads = 8, .kv_heads = 2, .head_dim = 64, .ffn = 1024,
          .vocab = 1024, .swiglu = true, .experts = 8, .top_k = 2, .expert_ffn = 512, .shared_experts = 1,
          .shared_ffn = 512, .dense_layers = 1};
}

}  // namespace config_file_test

using namespace config_file_test;

TEST_CASE("config file: a configuration written and read back is the same configuration with the same prediction") {
  const TrainingModel dense = gpt_175b();
  const TrainingModel moe = moe_model();
  struct Case {
    TrainingModel model;
    std::string spec;  // "" = inline
    ParallelConfig config;
  };
  const std::vector<Case> cases{
      {dense, "gpt-175b", {.dp = 2, .pp = 8, .tp_y = 4, .zero = 1, .micro_batch = 1, .virtual_stages = 2}},
      {dense, "", {.dp = 4, .pp = 4, .cp = 1, .tp_y = 4, .zero = 3, .micro_batch = 2, .recompute = Recompute::full,
                   .sequence_parallel = false}},
      {dense, "gpt-175b", {.dp = 1, .pp = 4, .cp = 2, .tp_x = 2, .tp_y = 4, .recompute = Recompute::selective}},
      {dense, "", {.dp = 2, .pp = 2, .cp = 4, .tp_y = 4, .cp_scheme = CpScheme::all_gather}},
      {moe, "", {.dp = 4, .pp = 2, .cp = 2, .tp_y = 4, .ep = 8, .etp = 2, .zero = 2}}};
  for (const Case& k : cases) {
    CAPTURE(to_string(k.config));
    const TrainingSetup s = setup_of_size(4096, 256);
    const ClusterProfile cluster = dgx_a100();
    const json::Value file = config_file_to_json(k.config, k.model, k.spec, cluster, "", s);
    const ConfigFile read = config_file_from_json(json::parse(json::dump(file)));
    CHECK(read.config == k.config);
    REQUIRE(read.model);
    CHECK(describe(*read.model) == describe(k.model));
    REQUIRE(read.cluster);
    REQUIRE(read.devices);
    CHECK(*read.devices == k.config.devices());
    ConfigFile given;
    given.config = k.config;
    const Scored direct = score(given, k.model, cluster, s);
    const Scored through = score(read, {}, {}, {});
    REQUIRE(direct.estimate.valid);
    CHECK(through.estimate.step_s == direct.estimate.step_s);
    CHECK(through.estimate.memory.total() == direct.estimate.memory.total());
    CHECK(through.estimate.mfu == direct.estimate.mfu);
  }
}

TEST_CASE("config file: the search's best, emitted, scores to the search's prediction") {
  const TrainingModel m = moe_model();
  const TrainingSetup s = setup_of_size(2048, 64);
  const PerformanceModel model(m, dgx_a100(), s, 32);
  const SearchResult r = search::search(model, {.top_k = 1});
  REQUIRE(!r.top.empty());
  const json::Value file = config_file_to_json(r.top.front().config, m, "", dgx_a100(), "dgx-a100", s);
  const Scored again = score(config_file_from_json(json::parse(json::dump(file))), {}, {}, {});
  CHECK(again.config == r.top.front().config);
  CHECK(again.estimate.step_s == r.top.front().estimate.step_s);
}

TEST_CASE("config file: models and clusters round-trip through their JSON") {
  for (std::string_view name : kModelPresets) {
    CAPTURE(name);
    const TrainingModel m = model_preset(name);
    const TrainingModel back = model_from_json(json::parse(json::dump(model_to_json(m))), m.name);
    CHECK(describe(back) == describe(m));
    CHECK(back.total_parameters() == m.total_parameters());
    CHECK(back.forward_flops_per_token(4096) == m.forward_flops_per_token(4096));
  }
  for (std::string_view name : kClusterPresets) {
    CAPTURE(name);
    const ClusterProfile c = cluster_preset(name);
    const ClusterProfile back = cluster_from_json(json::parse(json::dump(cluster_to_json(c))));
    for (Collective op : {Collective::all_reduce, Collective::all_to_all, Collective::send_recv})
      for (const GroupSpan g : {GroupSpan{8, 8}, GroupSpan{16, 64}, GroupSpan{64, 512}})
        CHECK(back.collective_time(op, g, 1e8) == c.collective_time(op, g, 1e8));
    CHECK(back.device.usable_memory_bytes() == c.device.usable_memory_bytes());
  }
}

TEST_CASE("config file: --config text names the same keys") {
  const ParallelConfig c =
      config_from_text("dp=2,pp=8,tp=4,zero=1,virtual_stages=3,micro_batch=2,recompute=full,sequence_parallel=false");
  CHECK(c == ParallelConfig{.dp = 2, .pp = 8, .tp_y = 4, .zero = 1, .micro_batch = 2, .virtual_stages = 3,
                            .recompute = Recompute::full, .sequence_parallel = false});
  CHECK(config_from_text("tp_x=2,tp_y=4,cp=2,cp_scheme=all-gather") ==
        ParallelConfig{.cp = 2, .tp_x = 2, .tp_y = 4, .cp_scheme = CpScheme::all_gather});
  CHECK(error_of([] { config_from_text("dp=2,dq=4"); }).find("unknown key \"dq\"") != std::string::npos);
  CHECK(error_of([] { config_from_text("dp=2,dp=4"); }).find("key \"dp\" given twice") != std::string::npos);
  CHECK(error_of([] { config_from_text("tp=2,tp_x=2"); }).find("not both") != std::string::npos);
  CHECK(error_of([] { config_from_text("dp=0"); }).find("dp = 0 must be an integer in [1, 16777216]") !=
        std::string::npos);
  CHECK(error_of([] { config_from_text("zero=4"); }).find("zero = 4") != std::string::npos);
  CHECK(error_of([] { config_from_text("recompute=some"); }).find("recompute = \"some\"") != std::string::npos);
  CHECK(error_of([] { config_from_text("dp"); }).find("\"dp\" is not key=value") != std::string::npos);
}

TEST_CASE("config file: unknown, repeated and inconsistent keys are refused by name") {
  CHECK(error_of([] { config_file_from_json(json::parse(R"({"dp": 2, "pipeline": 4})")); })
            .find("unknown key \"pipeline\"") != std::string::npos);
  CHECK(error_of([] { config_file_from_json(json::parse(R"({"dp": 2, "dp": 4})")); }).find("duplicate key \"dp\"") !=
        std::string::npos);
  CHECK(error_of([] { config_file_from_json(json::parse(R"({"dp": 2, "tp": 4, "devices": 16})")); })
            .find("devices = 16 but dp*pp*cp*tp_x*tp_y = 8") != std::string::npos);
  CHECK(error_of([] { config_file_from_json(json::parse(R"({"model": "gpt-5"})")); }).find("unknown model \"gpt-5\"") !=
        std::string::npos);
  CHECK(error_of([] { config_file_from_json(json::parse(R"({"flops": "half"})")); }).find("flops = \"half\"") !=
        std::string::npos);
  CHECK(error_of([] { config_file_from_json(json::parse(R"({"published": {"tflops": 3}})")); })
            .find("unknown key \"tflops\"") != std::string::npos);
}

TEST_CASE("config file: the published rows scored as files (Megatron-LM SC'21 and Llama 3 405B) within 15%") {
  int megatron = 0, llama = 0;
  for (const PublishedRow& row : published_rows()) {
    CAPTURE(row.name);
    const ConfigFile f = config_file_from_json(json::parse(json::dump(row.file)), row.name);
    REQUIRE(f.published);
    const Scored r = score(f, {}, {}, {});
    REQUIRE(r.estimate.feasible);
    // Each paper's throughput against the prediction counted the way the paper counts (Megatron: eq. 3, the full
    // square; Llama 3: model FLOPs with the causal half).
    const bool is_megatron = f.published->counting == FlopCounting::megatron;
    const double predicted = r.tflops_per_gpu(is_megatron ? FlopConvention::full : FlopConvention::causal);
    // Megatron within 15%; Llama 3 (whose schedule, recomputation and sharding the paper does not give in full)
    // within a factor 0.6 to 1.15 for now (search_parallel --validate prints the errors).
    if (is_megatron) CHECK(std::abs(predicted / f.published->tflops_per_gpu - 1) < 0.15);
    else CHECK((predicted / f.published->tflops_per_gpu > 0.6 && predicted / f.published->tflops_per_gpu < 1.15));
    CHECK(r.tflops_per_gpu(FlopConvention::full) >= r.tflops_per_gpu(FlopConvention::causal));
    (is_megatron ? megatron : llama) += 1;
  }
  CHECK(megatron == 4);
  CHECK(llama == 3);
}
