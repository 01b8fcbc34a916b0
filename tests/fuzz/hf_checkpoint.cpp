// Fuzz targets (tests/fuzz/mutate.hpp) of the Hugging Face checkpoint reader: serve::load_decoder (config.json,
// serve/hf_checkpoint.hpp's folder of safetensors files or shards with model.safetensors.index.json, and
// serve/decoder_weights.hpp's loading of every tensor). Seeds: the tests' tiny Mixtral and Qwen2-MoE folders
// (tests/data/hf/). Mutated: the safetensors header of a single-file folder (the 8-byte length prefix rewritten to
// match, so the mutations reach the tensor entries), the shard index of a sharded folder, and config.json of a folder
// with its weights.
#include "fuzz/mutate.hpp"

#include "paradyse/core/json.hpp"
#include "paradyse/serve/decoder_weights.hpp"

#include <doctest/doctest.h>

#include <cstdint>
#include <filesystem>
#include <string>

namespace {

using namespace paradyse;
namespace fs = std::filesystem;

const std::string kHfData = std::string(PARADYSE_TEST_DATA_DIR) + "/hf";

// A copy of a fixture folder, removed at the end.
struct FolderCopy : fuzz::TempFolder {
  explicit FolderCopy(const std::string& fixture) { fs::copy(fixture, path); }
  // Replaces one of its files; the folder's path.
  std::string with(const std::string& name, const std::string& bytes) const {
    (void)write(name, bytes);
    return path.string();
  }
};

void load(const std::string& folder) {
  const serve::LoadedDecoder d = serve::load_decoder(folder);
  CHECK(d.config.layers >= 1);
}

}  // namespace

TEST_CASE("fuzz Hugging Face checkpoint: serve::load_decoder of mutated headers, shard indexes and config.json") {
  {
    FolderCopy mixtral(kHfData + "/mixtral");
    const std::string file = fuzz::read_file(kHfData + "/mixtral/model.safetensors");
    std::uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(file[std::size_t(i)]);
    const std::string header = file.substr(8, n), data = file.substr(8 + n);
    fuzz::run("hf_safetensors_header", {header}, [&](const std::string& mutated) {
      std::string prefix(8, '\0');
      for (int i = 0; i < 8; ++i) prefix[std::size_t(i)] = char((std::uint64_t(mutated.size()) >> (8 * i)) & 0xff);
      load(mixtral.with("model.safetensors", prefix + mutated + data));
    }, {}, mixtral.path.string());
  }
  {
    FolderCopy mixtral(kHfData + "/mixtral");
    const std::string config = fuzz::read_file(kHfData + "/mixtral/config.json");
    // Found by this target: 10^6 experts (or an expert width of 10^6) allocated the experts' buffers, 4 GB, before
    // the router's shape in the file refused them (an OutOfMemory naming no file under the fuzzer's memory cap).
    std::vector<std::string> regressions;
    for (const char* edit : {"\"num_local_experts\": 1000000", "\"intermediate_size\": 1000000"}) {
      json::Value c = json::parse(config);
      const json::Value e = json::parse(std::string("{") + edit + "}");
      c[e.begin().key()] = e.begin().value();
      regressions.push_back(json::dump(c, 2));
    }
    fuzz::run("hf_config_with_weights", {config},
              [&](const std::string& text) { load(mixtral.with("config.json", text)); }, regressions,
              mixtral.path.string());
  }
  {
    // DeepSeek-V2 (multi-head latent attention, grouped routing): its config mutated, loaded with its weights.
    FolderCopy deepseek(kHfData + "/deepseek_v2");
    const std::string config = fuzz::read_file(kHfData + "/deepseek_v2/config.json");
    fuzz::run("hf_deepseek_config_with_weights", {config},
              [&](const std::string& text) { load(deepseek.with("config.json", text)); }, {},
              deepseek.path.string());
  }
  {
    FolderCopy qwen(kHfData + "/qwen2_moe");
    const std::string index = fuzz::read_file(kHfData + "/qwen2_moe/model.safetensors.index.json");
    // Found by this target: a shard named "\u0000" cut the message at the NUL; "", "." and ".." name no file.
    std::vector<std::string> regressions;
    for (const char* shard : {"\\u0000", "", ".", "..", "a\\u0001b"}) {
      std::string bad = index;
      const std::string from = "\"model-00002-of-00002.safetensors\"";
      bad.replace(bad.find(from), from.size(), std::string("\"") + shard + "\"");
      regressions.push_back(bad);
    }
    fuzz::run("hf_shard_index", {index},
              [&](const std::string& text) { load(qwen.with("model.safetensors.index.json", text)); }, regressions,
              qwen.path.string());
  }
}
