// The Hugging Face loader refuses what it would otherwise compute wrongly (issue 27): configuration keys it does not
// implement (hidden_act, attention_bias), a key of the wrong type (a string rms_norm_eps), tie_word_embeddings
// contradicted by the file, tensors the config does not use (fewer layers than the file), non-finite weights (named).
// Each case edits a copy of the committed Mixtral fixture in a temporary folder.
#include "paradyse/core/json.hpp"
#include "paradyse/serve/decoder_weights.hpp"

#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>

using namespace paradyse;
using namespace paradyse::serve;
namespace fs = std::filesystem;

namespace {

fs::path fixture_folder() {  // beside this file, or found from the working directory (a build folder, the source tree)
  const fs::path here = fs::path(__FILE__).parent_path().parent_path() / "data" / "hf" / "mixtral";
  if (fs::exists(here / "config.json")) return here;
  for (fs::path up = fs::current_path(); !up.empty(); up = up.parent_path()) {
    if (fs::exists(up / "tests/data/hf/mixtral/config.json")) return up / "tests/data/hf/mixtral";
    if (up == up.parent_path()) break;
  }
  FAIL("tests/data/hf/mixtral not found");
  return {};
}

// A copy of the Mixtral fixture with config.json edited by `edit`; returns the folder.
fs::path edited_copy(const std::string& name, const std::function<void(json::Value&)>& edit) {
  const fs::path dir = fs::temp_directory_path() / fmt::format("paradyse_hf_{}_{}", name, ::getpid());
  fs::remove_all(dir);
  fs::create_directories(dir);
  for (const char* f : {"config.json", "model.safetensors"}) fs::copy_file(fixture_folder() / f, dir / f);
  json::Value config = json::load_file((dir / "config.json").string());
  edit(config);
  json::save_file(config, (dir / "config.json").string());
  return dir;
}

// Overwrites every element of tensor `name` (stored BF16) with the 16-bit pattern `bits`.
void poison(const fs::path& dir, const std::string& name, std::uint16_t bits) {
  const std::string path = (dir / "model.safetensors").string();
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  std::uint64_t n = 0;
  f.read(reinterpret_cast<char*>(&n), 8);
  std::string header(n, '\0');
  f.read(header.data(), std::streamsize(n));
  const json::Value h = json::parse(header, path);
  REQUIRE(h[name]["dtype"].get<std::string>() == "BF16");
  const std::uint64_t begin = h[name]["data_offsets"][0].get<std::uint64_t>(),
                      end = h[name]["data_offsets"][1].get<std::uint64_t>();
  f.seekp(std::streamoff(8 + n + begin));
  for (std::uint64_t i = begin; i < end; i += 2) f.write(reinterpret_cast<const char*>(&bits), 2);
}

std::string refusal(const fs::path& dir) {
  std::string what = "(loaded)";
  try {
    load_decoder(dir.string());
  } catch (const Error& e) {
    what = e.what();
  }
  fs::remove_all(dir);
  return what;
}

}  // namespace

TEST_CASE("hf loader: the unedited copy loads (the edits below are what is refused)") {
  CHECK(refusal(edited_copy("plain", [](json::Value&) {})) == "(loaded)");
}

TEST_CASE("hf loader: keys that change the mathematics and are not implemented are refused by name") {
  CHECK_MESSAGE(refusal(edited_copy("act", [](json::Value& c) { c["hidden_act"] = "gelu"; }))
                        .find("\"hidden_act\" is \"gelu\"; supported: \"silu\"") != std::string::npos, "hidden_act");
  CHECK(refusal(edited_copy("bias", [](json::Value& c) { c["attention_bias"] = true; }))
            .find("\"attention_bias\" is set: q/k/v/o projection biases are supported only as Qwen2-MoE's") !=
        std::string::npos);
  CHECK(refusal(edited_copy("eps", [](json::Value& c) { c["rms_norm_eps"] = "1e-6"; }))
            .find("\"rms_norm_eps\" is \"1e-6\" (string); expected a finite number") != std::string::npos);
  CHECK(refusal(edited_copy("tie", [](json::Value& c) { c["tie_word_embeddings"] = "yes"; }))
            .find("\"tie_word_embeddings\" is \"yes\" (string); expected true or false") != std::string::npos);
}

TEST_CASE("hf loader: tie_word_embeddings contradicted by a different lm_head in the file is refused") {
  CHECK(refusal(edited_copy("tied", [](json::Value& c) { c["tie_word_embeddings"] = true; }))
            .find("tie_word_embeddings = true, but \"lm_head.weight\" differs from \"model.embed_tokens.weight\"") !=
        std::string::npos);
}

TEST_CASE("hf loader: a config with fewer layers than the file is refused, naming the unused tensors") {
  const std::string what = refusal(edited_copy("layers", [](json::Value& c) {
    c["num_hidden_layers"] = c["num_hidden_layers"].get<std::int64_t>() - 1;
  }));
  CHECK(what.find("tensor(s) that config.json") != std::string::npos);
  CHECK(what.find("does not use: \"model.layers.") != std::string::npos);
}

namespace {
// The refusal of the DeepSeek fixture's config.json (family folder under tests/data/hf) edited by `edit`.
std::string deepseek_refusal(const std::string& family, const std::function<void(json::Value&)>& edit) {
  const fs::path folder = fixture_folder().parent_path() / family;
  json::Value config = json::load_file((folder / "config.json").string());
  edit(config);
  try {
    (void)decoder_config(config, family + "/config.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "(read)";
}
}  // namespace

TEST_CASE("hf loader: DeepSeek keys that transformers computes otherwise, or not at all, are refused by name") {
  CHECK(deepseek_refusal("deepseek_v2_lite", [](json::Value&) {}) == "(read)");
  CHECK(deepseek_refusal("deepseek_v3", [](json::Value&) {}) == "(read)");
  const auto says = [](const std::string& what, const std::string& part) {
    INFO(what);
    CHECK(what.find(part) != std::string::npos);
  };
  // yarn (every real DeepSeek config carries it) is read (serve/yarn_rope.hpp); any other type is refused by name.
  CHECK(deepseek_refusal("deepseek_v2_lite", [](json::Value& c) {
          c["rope_scaling"] = json::parse(R"({"type": "yarn", "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707})",
                                          "rope_scaling");
        }) == "(read)");
  says(deepseek_refusal("deepseek_v2_lite", [](json::Value& c) {
         c["rope_scaling"] = json::parse(R"({"type": "dynamic", "factor": 4})", "rope_scaling");
       }),
       "\"rope_scaling\" type is \"dynamic\" in rope_scaling {\"type\":\"dynamic\",\"factor\":4}; supported: \"yarn\"");
  says(deepseek_refusal("deepseek_v2_lite", [](json::Value& c) { c["moe_layer_freq"] = 2; }),
       "\"moe_layer_freq\" is 2; supported: 1");
  says(deepseek_refusal("deepseek_v2_lite", [](json::Value& c) { c["norm_topk_prob"] = true; }),
       "\"norm_topk_prob\" is true; transformers' DeepseekV2 never renormalises");
  says(deepseek_refusal("deepseek_v2", [](json::Value& c) { c["topk_method"] = "noaux_tc"; }),
       "\"topk_method\" is \"noaux_tc\"; supported for DeepseekV2: \"greedy\", \"group_limited_greedy\"");
  says(deepseek_refusal("deepseek_v3", [](json::Value& c) { c["topk_method"] = "greedy"; }),
       "\"topk_method\" is \"greedy\"; DeepseekV3 routes by \"noaux_tc\"");
  says(deepseek_refusal("deepseek_v3", [](json::Value& c) { c["scoring_func"] = "softmax"; }),
       "\"scoring_func\" is \"softmax\"; DeepseekV3 scores by sigmoid");
  says(deepseek_refusal("deepseek_v2", [](json::Value& c) { c["n_group"] = 3; }), "n_group = 3 must divide experts = 8");
  says(deepseek_refusal("deepseek_v2_lite", [](json::Value& c) { c["num_key_value_heads"] = 2; }),
       "multi-head latent attention has one key and value per query head");
  says(deepseek_refusal("deepseek_v2_lite", [](json::Value& c) { c["attention_bias"] = true; }),
       "\"attention_bias\" is set");
  says(deepseek_refusal("deepseek_v3", [](json::Value& c) { c["head_dim"] = 12; }), "\"head_dim\" is 12; expected 4");
  says(deepseek_refusal("deepseek_v3", [](json::Value& c) { c["qk_head_dim"] = 16; }), "\"qk_head_dim\" is 16; expected 12");
}

TEST_CASE("hf loader: non-finite weights are refused, naming the tensor (not a NaN logit later)") {
  fs::path dir = edited_copy("inf", [](json::Value&) {});
  poison(dir, "lm_head.weight", 0x7F80);  // +inf in bf16
  CHECK(refusal(dir).find("tensor \"lm_head.weight\" holds inf at element 0") != std::string::npos);
  dir = edited_copy("nan", [](json::Value&) {});
  poison(dir, "model.layers.0.block_sparse_moe.gate.weight", 0x7FC0);  // NaN in bf16
  CHECK(refusal(dir).find("tensor \"model.layers.0.block_sparse_moe.gate.weight\" holds nan") != std::string::npos);
}
