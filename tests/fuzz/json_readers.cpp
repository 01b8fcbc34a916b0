// Fuzz targets (tests/fuzz/mutate.hpp) of the JSON readers of user files: hardware profiles (cost/profile_json.hpp)
// and the serving cluster spec that loads them (serve/cluster_spec.hpp), cluster and model JSON of the search
// (search/cluster.hpp, search/training_model.hpp), search configuration files and --config text
// (search/config_file.hpp), sensitivity tables (moe/sensitivity.hpp), Hugging Face config.json (serve/hf_config.hpp,
// serve/model_shape_hf.hpp) and published routing statistics (serve/routing_source.hpp). Seeds: the built-in
// profiles, clusters and models written out by the library, the repository's data/model_shapes/ and the test
// fixtures' config.json files, a configuration file and a sensitivity table written by the library.
#include "fuzz/mutate.hpp"

#include "paradyse/core/json.hpp"
#include "paradyse/cost/builtin_profiles.hpp"
#include "paradyse/cost/profile_json.hpp"
#include "paradyse/moe/sensitivity.hpp"
#include "paradyse/search/cluster.hpp"
#include "paradyse/search/config_file.hpp"
#include "paradyse/search/training_model.hpp"
#include "paradyse/serve/cluster_spec.hpp"
#include "paradyse/serve/hf_config.hpp"
#include "paradyse/serve/model_shape_hf.hpp"
#include "paradyse/serve/routing_source.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace {

using namespace paradyse;
namespace fs = std::filesystem;
using namespace std::string_literals;

const std::string kTestData = PARADYSE_TEST_DATA_DIR;                 // tests/data
const std::string kRepositoryData = kTestData + "/../../data";        // data/

std::vector<std::string> profile_seeds() {
  std::vector<std::string> seeds;
  for (std::string_view name : cost::kBuiltinProfileNames) {
    cost::HardwareProfile p = cost::builtin_profile(name);
    seeds.push_back(json::dump(cost::to_json(p), 2));
    p.set_collective(cost::Collective::all_gather, cost::LinkLevel::intra_node, 4, {2e-6, 1e-11}, 4096);
    p.gemm_engines.push_back({"small", "fallback", 0, 2e9});
    seeds.push_back(json::dump(cost::to_json(p), 0));
  }
  return seeds;
}

std::vector<std::string> model_config_seeds() {
  std::vector<std::string> seeds;
  for (const char* family : {"mixtral", "qwen2_moe", "olmoe", "qwen3_moe", "deepseek_v2_lite", "deepseek_v2", "deepseek_v3"})
    seeds.push_back(fuzz::read_file(kTestData + "/hf/" + family + "/config.json"));
  return seeds;
}



}  // namespace

TEST_CASE("fuzz hardware profile: cost::profile_from_json") {
  fuzz::run("profile", profile_seeds(), [](const std::string& text) {
    const cost::HardwareProfile p = cost::profile_from_json(json::parse(text, "fuzz.json"));
    // What loads is usable: finite positive rates, memory left after the reserve.
    CHECK((std::isfinite(p.gemm.flops_per_s) && p.gemm.flops_per_s > 0));
    CHECK(p.usable_memory_bytes() > 0);
  });
}

TEST_CASE("fuzz serving cluster spec: serve::simulated_cluster of a profile file") {
  fuzz::TempFolder dir;
  fuzz::run("cluster_spec", profile_seeds(), [&](const std::string& text) {
    const serve::SimulatedCluster c = serve::simulated_cluster(dir.write("cluster.json", text), 2);
    CHECK((std::isfinite(c.profile.gemm.flops_per_s) && c.profile.gemm.flops_per_s > 0));
    CHECK(c.dtype_bytes > 0);
  }, {}, (dir.path / "cluster.json").string());
}

TEST_CASE("fuzz search cluster JSON: search::cluster_from_json") {
  std::vector<std::string> seeds;
  for (std::string_view name : search::kClusterPresets)
    seeds.push_back(json::dump(search::cluster_to_json(search::cluster_preset(name)), 2));
  fuzz::run("search_cluster", seeds, [](const std::string& text) {
    const search::ClusterProfile c = search::cluster_from_json(json::parse(text, "cluster.json"));
    CHECK(!c.levels.empty());
  });
}

TEST_CASE("fuzz search model JSON: search::model_from_json") {
  // Not the tests' fixture config.json files: full transformers dumps whose generic keys (add_cross_attention, ...)
  // the search refuses as unknown.
  std::vector<std::string> seeds;
  for (std::string_view name : search::kModelPresets)
    seeds.push_back(json::dump(search::model_to_json(search::model_preset(name)), 2));
  for (const char* shape : {"mixtral-8x7b", "mixtral-8x22b", "qwen2-57b-a14b"})
    seeds.push_back(fuzz::read_file(kRepositoryData + "/model_shapes/" + shape + ".json"));
  fuzz::run("search_model", seeds, [](const std::string& text) {
    const search::TrainingModel m = search::model_from_json(json::parse(text, "model.json"), "fuzz");
    CHECK((m.layers >= 1 && m.hidden >= 1 && m.heads >= 1));
  });
}

TEST_CASE("fuzz search configuration file: search::config_file_from_json and --config text") {
  const search::TrainingSetup setup;
  search::ParallelConfig c;
  c.dp = 2, c.pp = 4, c.tp_y = 8, c.micro_batch = 2, c.zero = 1, c.recompute = search::Recompute::selective;
  const search::TrainingModel gpt = search::model_preset("gpt-175b");
  const search::ClusterProfile a100 = search::cluster_preset("dgx-a100");
  const std::vector<std::string> seeds = {
      json::dump(search::config_file_to_json(c, gpt, "gpt-175b", a100, "dgx-a100", setup,
                                             search::PublishedThroughput{.tflops_per_gpu = 138, .source = "paper"}),
                 2),
      json::dump(search::config_file_to_json(c, gpt, "", a100, "", setup), 2)};
  // Found by this target: degrees of 2^24 each multiplied past 64 bits (devices() wrapped; "devices" was then
  // compared with the wrapped product).
  // A NUL in an inline model's _name_or_path (the model's name in every message) cut the messages.
  json::Value nul_name = json::parse(seeds[1]);
  nul_name["model"]["_name_or_path"] = "gpt\0175b"s;
  nul_name["model"]["vocab_size"] = -1;
  const std::vector<std::string> regressions = {
      R"({"dp": 16777216, "pp": 16777216, "cp": 16777216, "tp": 16777216, "devices": 1})",
      R"({"dp": 4096, "pp": 8192})", json::dump(nul_name, 2)};
  const auto devices_in_range = [](const search::ParallelConfig& config) {
    CHECK((config.devices() >= 1 && config.devices() <= (std::int64_t(1) << 24)));
  };
  fuzz::run("config_file", seeds, [&](const std::string& text) {
    const search::ConfigFile f = search::config_file_from_json(json::parse(text, "config.json"), "config fuzz.json");
    devices_in_range(f.config);
  }, regressions);
  fuzz::run("config_text", {"dp=2,pp=8,tp=4,recompute=full", "dp=1,tp_x=2,tp_y=2,cp=2,cp_scheme=ring,zero=3"},
            [&](const std::string& text) { devices_in_range(search::config_from_text(text)); },
            {"dp=16777216,pp=16777216,cp=16777216,tp=16777216", "dp=65536,tp_x=65536,tp_y=65536"});
}

TEST_CASE("fuzz sensitivity table: moe::sensitivity_from_json") {
  SensitivityTable t;
  t.top_k = {2, 2, 1};
  t.delta = {{0.41, 0, -0.002, 0.0001}, {0.3, 0}, {0, 1e-9, 2.5}};
  t.base = 3.21;
  t.calibration_tokens = 4096;
  SensitivityTable untagged = t;
  t.model = "mixtral layers 3 (3 MoE) hidden 32 experts 4 top-k 2 config 0123456789abcdef";
  untagged.metric = SensitivityMetric::output_distortion;
  const std::vector<std::string> seeds = {json::dump(sensitivity_to_json(t), 2), json::dump(sensitivity_to_json(untagged), 0)};
  fuzz::run("sensitivity", seeds, [](const std::string& text) {
    const SensitivityTable s = sensitivity_from_json(json::parse(text, "table.json"));
    CHECK(s.layers() >= 1);
  });
  // From a file, every error names it (sensitivity_from_json's said only "sensitivity: ...").
  fuzz::TempFolder dir;
  const std::string path = (dir.path / "table.json").string();
  fuzz::run("sensitivity_file", seeds, [&](const std::string& text) {
    const SensitivityTable s = load_sensitivity(dir.write("table.json", text));
    CHECK(s.layers() >= 1);
  }, {R"({"format": "paradyse.alloc_moe.sensitivity", "version": 1, "metric": "loss_increase", "base": 0,
          "calibration_tokens": 1, "layers": [{"top_k": 3, "delta": [1, 0]}]})"}, path);
}

TEST_CASE("fuzz Hugging Face config.json: serve::decoder_config and serve::model_shape") {
  // Found by this target: 4294967297 layers hung (a loop over them, 512 MiB of layer flags); a NUL byte in the
  // architecture or hidden_act cut the message; a negative mlp_only_layers entry was accepted.
  std::vector<std::string> regressions;
  const json::Value qwen = json::parse(fuzz::read_file(kTestData + "/hf/qwen2_moe/config.json"));
  auto edited = [&](const char* key, json::Value value) {
    json::Value c = qwen;
    c[key] = std::move(value);
    return json::dump(c, 2);
  };
  regressions.push_back(edited("num_hidden_layers", 4294967297));
  regressions.push_back(edited("num_hidden_layers", 1 << 20));
  regressions.push_back(edited("vocab_size", 99999999999));
  regressions.push_back(edited("architectures", json::Value::array({"Mixtral\0ForCausalLM"s})));
  regressions.push_back(edited("hidden_act", "si\0lu"s));
  regressions.push_back(edited("mlp_only_layers", json::Value::array({-1})));
  fuzz::run("hf_config", model_config_seeds(), [](const std::string& text) {
    const serve::DecoderConfig c = serve::decoder_config(json::parse(text, "config.json"), "config.json");
    CHECK(c.layers >= 1);
  }, regressions);
  std::vector<std::string> shapes = model_config_seeds();
  for (const char* shape : {"deepseek-v2-lite", "mixtral-8x7b", "mixtral-8x22b", "qwen2-57b-a14b"})
    shapes.push_back(fuzz::read_file(kRepositoryData + "/model_shapes/" + shape + ".json"));
  fuzz::run("model_shape", shapes, [](const std::string& text) {
    const serve::ModelShape s = serve::model_shape(json::parse(text, "config.json"), "config.json");
    CHECK(std::isfinite(s.parameters()));
  });
}

TEST_CASE("fuzz published routing statistics: serve::published_routing") {
  fuzz::TempFolder dir;
  fuzz::run("published_routing", {fuzz::read_file(kTestData + "/hf/eplb_example.json")}, [&](const std::string& text) {
    serve::WeightedRouting w = serve::published_routing(dir.write("eplb.json", text), 1);
    std::int64_t pairs = 0;
    for (std::int64_t c : w.counts(0, 0, 16, 8, 2)) pairs += c;
    CHECK(pairs == 32);
  }, {}, "eplb.json");
}
