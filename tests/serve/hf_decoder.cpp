// tests/serve/hf_decoder.cpp: the Hugging Face loader and the decoder step against the transformers fixtures of
// tests/data/hf/ (made by scripts/make_hf_fixtures.py: Mixtral stored in bf16, Qwen2-MoE in f32 over two shards with
// an index, OLMoE in f16; Qwen3-MoE in bf16, DeepSeek-V2-Lite in f16, DeepSeek-V2 in bf16, DeepSeek-V3 in f32 over
// two shards and with rope_interleave false in bf16): prefill logits of every prompt position and 8 greedy decode
// steps with the paged KV cache (MLA: the compressed latent),
// for p in {1, 2, 3, 4} thread ranks with the experts tensor-parallel (TP) and whole (EP); chunked prefill; the
// loader's errors (missing tensor, wrong shape, unknown architecture, bad index).
#include "support/tolerance.hpp"

#include "paradyse/comm/threads.hpp"
#include "paradyse/core/json.hpp"
#include "paradyse/serve/decoder_step.hpp"
#include "paradyse/serve/decoder_weights.hpp"

#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

using namespace paradyse;
using namespace paradyse::serve;

namespace {

std::filesystem::path fixtures() { return std::filesystem::path(PARADYSE_TEST_DATA_DIR) / "hf"; }

struct FixtureCase {
  std::vector<std::int32_t> prompt;
  std::vector<std::vector<float>> prefill;  // [len][V]
  std::vector<std::int32_t> decode_tokens;  // token fed at each decode step
  std::vector<std::vector<float>> decode;   // [8][V]
};

std::vector<std::vector<float>> matrix(const json::Value& v) {
  std::vector<std::vector<float>> out;
  for (const json::Value& row : v) {
    out.emplace_back();
    for (const json::Value& x : row) out.back().push_back(x.get<float>());
  }
  return out;
}

std::vector<FixtureCase> read_expected(const std::string& family) {
  const json::Value doc = json::load_file((fixtures() / family / "expected.json").string());
  std::vector<FixtureCase> cases;
  for (const json::Value& c : doc.at("cases")) {
    FixtureCase f;
    for (const json::Value& t : c.at("prompt")) f.prompt.push_back(t.get<std::int32_t>());
    for (const json::Value& t : c.at("decode_tokens")) f.decode_tokens.push_back(t.get<std::int32_t>());
    f.prefill = matrix(c.at("prefill_logits"));
    f.decode = matrix(c.at("decode_logits"));
    cases.push_back(std::move(f));
  }
  return cases;
}

std::int32_t argmax(std::span<const float> x) {
  return std::int32_t(std::max_element(x.begin(), x.end()) - x.begin());
}

// What one run saw: the largest |ours - reference| / (1 + |reference|) and the greedy tokens.
struct FixtureRun {
  double max_error = 0;
  std::vector<std::int32_t> greedy;  // argmax after the prefill and after each decode step, every case
  std::string failure;
};

void compare(FixtureRun& r, std::span<const float> ours, const std::vector<float>& want, const std::string& where) {
  if (ours.size() != want.size()) {
    r.failure = fmt::format("{}: {} logits, expected {}", where, ours.size(), want.size());
    return;
  }
  for (std::size_t i = 0; i < want.size(); ++i)
    r.max_error = std::max(r.max_error, double(std::abs(ours[i] - want[i])) / (1.0 + std::abs(want[i])));
}

// Runs every case of `family` on p ranks in `mode`: prefill (in chunks of `chunk` tokens; 0: whole) then the 8
// decode steps, each rank with its own paged cache (blocks of 4 positions).
std::vector<FixtureRun> run_fixture(const LoadedDecoder& m, const std::vector<FixtureCase>& cases, int p, MoeMode mode,
                                   std::int64_t chunk = 0) {
  std::vector<FixtureRun> reports(static_cast<std::size_t>(p));
  run_ranks(p, [&](ThreadCommunicator& comm) {
    const DecoderConfig& c = m.config;
    FixtureRun& rep = reports[std::size_t(comm.rank())];
    const RankShard s = make_rank_shard(c, m.weights, p, comm.rank(), mode);
    PagedKvCache cache(kv_cache_shape(c, s, 32, 4));
    BufferPool pool;
    for (std::size_t i = 0; i < cases.size(); ++i) {
      const FixtureCase& fc = cases[i];
      const std::int64_t id = std::int64_t(i), len = std::int64_t(fc.prompt.size()), step = chunk ? chunk : len;
      cache.reserve(id, len);
      for (std::int64_t at = 0; at < len; at += step) {
        SequenceChunk ch{id, {fc.prompt.begin() + at, fc.prompt.begin() + std::min(len, at + step)}, true};
        const StepResult out = decoder_step(comm, c, s, cache, std::span<const SequenceChunk>(&ch, 1), pool);
        const Tensor<float>& logits = out.logits[0];
        for (std::int64_t row = 0; row < logits.extent(0); ++row)
          compare(rep, logits.view().slice(0, row, 1).span(), fc.prefill[std::size_t(at + row)],
                  fmt::format("prefill position {}", at + row));
        if (at + step >= len) rep.greedy.push_back(argmax(logits.view().slice(0, logits.extent(0) - 1, 1).span()));
      }
      for (std::size_t t = 0; t < fc.decode_tokens.size(); ++t) {
        cache.reserve(id, 1);
        const SequenceChunk ch{id, {fc.decode_tokens[t]}, false};
        const StepResult out = decoder_step(comm, c, s, cache, std::span<const SequenceChunk>(&ch, 1), pool);
        compare(rep, out.logits[0].span(), fc.decode[t], fmt::format("decode step {}", t));
        rep.greedy.push_back(argmax(out.logits[0].span()));
      }
      cache.release(id);
    }
  });
  return reports;
}

// The reference's greedy tokens: each decode token, then the argmax of the last step.
std::vector<std::int32_t> reference_greedy(const std::vector<FixtureCase>& cases) {
  std::vector<std::int32_t> g;
  for (const FixtureCase& fc : cases) {
    for (std::int32_t t : fc.decode_tokens) g.push_back(t);
    g.push_back(argmax(fc.decode.back()));
  }
  return g;
}

// Every family with a fixture (scripts/make_hf_fixtures.py: the first three by transformers 4.46.3, the rest by 4.57).
const std::vector<std::string> kFamilies = {"mixtral",          "qwen2_moe",   "olmoe",      "qwen3_moe",
                                            "deepseek_v2_lite", "deepseek_v2", "deepseek_v3",
                                            "deepseek_v3_rope_halves", "deepseek_v2_lite_yarn", "deepseek_v3_yarn"};

constexpr double kLogitTolerance = 2e-5;  // float32 reassociation over 2 layers of width 32

}  // namespace

TEST_CASE("hf fixtures: prefill and 8 cached decode steps match transformers for p in {1, 2, 3, 4}, TP and EP experts") {
  for (const std::string& family : kFamilies) {
    const LoadedDecoder m = load_decoder((fixtures() / family).string());
    const std::vector<FixtureCase> cases = read_expected(family);
    const std::vector<std::int32_t> want = reference_greedy(cases);
    for (const int p : {1, 2, 3, 4})
      for (const MoeMode mode : {MoeMode::tp, MoeMode::ep}) {
        const std::vector<FixtureRun> reports = run_fixture(m, cases, p, mode);
        for (int r = 0; r < p; ++r) {
          const FixtureRun& rep = reports[std::size_t(r)];
          INFO(family, " p=", p, " ", name_of(mode), " rank ", r);
          CHECK(rep.failure == "");
          CHECK(rep.max_error < kLogitTolerance);
          CHECK(rep.greedy == want);
          if (r == 0 && mode == MoeMode::tp)
            MESSAGE(fmt::format("{} p={}: max |logit error| / (1 + |logit|) = {:.3g}", family, p, rep.max_error));
        }
      }
  }
}

TEST_CASE("hf fixtures: chunked prefill (chunks of 2 and 4 positions over blocks of 4) gives the same logits") {
  for (const std::string& family : kFamilies) {
    const LoadedDecoder m = load_decoder((fixtures() / family).string());
    const std::vector<FixtureCase> cases = read_expected(family);
    for (const std::int64_t chunk : {2, 4}) {
      const FixtureRun rep = run_fixture(m, cases, 2, MoeMode::ep, chunk)[0];
      INFO(family, " chunk ", chunk);
      CHECK(rep.failure == "");
      CHECK(rep.max_error < kLogitTolerance);
      CHECK(rep.greedy == reference_greedy(cases));
    }
  }
}

TEST_CASE("hf loader: the configs of the families") {
  const DecoderConfig mixtral = read_decoder_config((fixtures() / "mixtral").string());
  CHECK(mixtral.family == Family::mixtral);
  CHECK(mixtral.moe.norm_topk_prob);
  CHECK(mixtral.kv_heads == 2);
  CHECK(!mixtral.qkv_bias);
  const DecoderConfig qwen = read_decoder_config((fixtures() / "qwen2_moe").string());
  CHECK(qwen.family == Family::qwen2_moe);
  CHECK(qwen.qkv_bias);
  CHECK(qwen.moe.shared_gate);
  CHECK(qwen.moe.shared_ffn == 20);
  CHECK(qwen.moe_layer == std::vector<bool>{false, true});  // mlp_only_layers = [0]
  const DecoderConfig olmoe = read_decoder_config((fixtures() / "olmoe").string());
  CHECK(olmoe.family == Family::olmoe);
  CHECK(olmoe.qk_norm);
  CHECK(!olmoe.moe.norm_topk_prob);
  const DecoderConfig qwen3 = read_decoder_config((fixtures() / "qwen3_moe").string());
  CHECK(qwen3.family == Family::qwen3_moe);
  CHECK(qwen3.head_qk_norm);
  CHECK(!qwen3.qk_norm);
  CHECK(!qwen3.qkv_bias);
  CHECK(qwen3.head_dim == 12);  // not hidden / heads = 8
  CHECK(qwen3.moe.norm_topk_prob);
  CHECK(!qwen3.moe.has_shared());
  CHECK(qwen3.moe_layer == std::vector<bool>{true, false});  // mlp_only_layers = [1]
  const DecoderConfig lite = read_decoder_config((fixtures() / "deepseek_v2_lite").string());
  CHECK(lite.family == Family::deepseek_v2);
  CHECK(lite.is_mla());
  CHECK(lite.mla.q_lora_rank == 0);  // null: q_proj
  CHECK(lite.mla.kv_lora_rank == 16);
  CHECK(lite.head_dim == 8 + 4);     // qk_nope_head_dim + qk_rope_head_dim
  CHECK(lite.value_dim() == 6);
  CHECK(lite.kv_cache_floats(lite.kv_heads) == 16 + 4);  // the latent, not 2 x 4 heads x 12
  CHECK(lite.moe_layer == std::vector<bool>{false, true, true});  // first_k_dense_replace = 1
  CHECK(lite.moe.shared_width() == 2 * 12);
  CHECK(!lite.moe.shared_gate);
  CHECK(lite.moe.topk_method == TopkMethod::greedy);
  CHECK(lite.moe.routed_scaling_factor == 1.5);
  CHECK(lite.moe.scoring == RouterScoring::softmax);
  const DecoderConfig v2 = read_decoder_config((fixtures() / "deepseek_v2").string());
  CHECK(v2.mla.q_lora_rank == 24);
  CHECK(v2.moe.topk_method == TopkMethod::group_limited_greedy);
  CHECK(v2.moe.n_group == 4);
  CHECK(v2.moe.topk_group == 2);
  const DecoderConfig v3 = read_decoder_config((fixtures() / "deepseek_v3").string());
  CHECK(v3.family == Family::deepseek_v3);
  CHECK(v3.moe.topk_method == TopkMethod::noaux_tc);
  CHECK(v3.moe.scoring == RouterScoring::sigmoid);
  CHECK(v3.moe.norm_topk_prob);
  CHECK(v3.moe.routed_scaling_factor == 2.5);
  CHECK(v3.mla.interleaved_rope);
  const DecoderConfig halves = read_decoder_config((fixtures() / "deepseek_v3_rope_halves").string());
  CHECK(!halves.mla.interleaved_rope);  // rope_interleave: false
  CHECK(halves.mla.q_lora_rank == 0);
  CHECK(!halves.moe.norm_topk_prob);
}

TEST_CASE("hf fixtures: MLA's paged cache holds the compressed latent (kv_lora_rank + qk_rope_head_dim per token)") {
  const LoadedDecoder m = load_decoder((fixtures() / "deepseek_v2_lite").string());
  const DecoderConfig& c = m.config;
  const RankShard s = make_rank_shard(c, m.weights, 2, 0, MoeMode::tp);
  const KvCacheShape shape = kv_cache_shape(c, s, 8, 4);
  CHECK(shape.keys_only);
  CHECK(shape.kv_heads == 1);
  CHECK(shape.head_dim == c.mla.kv_lora_rank + c.mla.rope);
  const PagedKvCache cache(shape);
  // 3 layers x 8 blocks x 4 positions x 20 floats; GQA over the same heads would keep K and V of 2 heads x 12.
  CHECK(cache.bytes() == std::size_t(3 * 8 * 4 * 20 * 4));
  CHECK_THROWS_WITH_AS(cache.value(0, 0, 0, 0), doctest::Contains("keys-only"), Error);
}

namespace {
// A copy of a fixture folder in a fresh temporary folder.
std::filesystem::path copy_fixture(const std::string& family, const std::string& tag) {
  const std::filesystem::path to = std::filesystem::temp_directory_path() / fmt::format("paradyse_serve_{}_{}", tag, ::getpid());
  std::filesystem::remove_all(to);
  std::filesystem::copy(fixtures() / family, to);
  return to;
}
void write_text(const std::filesystem::path& path, const std::string& text) { std::ofstream(path) << text; }
std::string read_text(const std::filesystem::path& path) {
  std::ifstream in(path);
  return {std::istreambuf_iterator<char>(in), {}};
}
void replace_in(const std::filesystem::path& path, const std::string& from, const std::string& to) {
  std::string text = read_text(path);
  const std::size_t at = text.find(from);
  REQUIRE(at != std::string::npos);
  text.replace(at, from.size(), to);
  write_text(path, text);
}
}  // namespace

TEST_CASE("hf loader: errors name the missing tensor, the wrong shape, the unknown architecture") {
  // Unknown architecture.
  {
    const auto dir = copy_fixture("mixtral", "arch");
    replace_in(dir / "config.json", "MixtralForCausalLM", "GPT2LMHeadModel");
    CHECK_THROWS_WITH_AS(read_decoder_config(dir.string()), doctest::Contains("unknown architecture \"GPT2LMHeadModel\""),
                         Error);
    std::filesystem::remove_all(dir);
  }
  // A config whose expert width disagrees with the stored tensors: the shape error names the tensor.
  {
    const auto dir = copy_fixture("olmoe", "shape");
    replace_in(dir / "config.json", "\"intermediate_size\": 12", "\"intermediate_size\": 13");
    CHECK_THROWS_WITH_AS(load_decoder(dir.string()),
                         doctest::Contains("\"model.layers.0.mlp.experts.0.gate_proj.weight\" has shape [12, 32], "
                                           "expected [13, 32]"),
                         Error);
    std::filesystem::remove_all(dir);
  }
  // More layers than stored: the first missing tensor is named.
  {
    const auto dir = copy_fixture("mixtral", "missing");
    replace_in(dir / "config.json", "\"num_hidden_layers\": 2", "\"num_hidden_layers\": 3");
    CHECK_THROWS_WITH_AS(load_decoder(dir.string()),
                         doctest::Contains("tensor \"model.layers.2.input_layernorm.weight\" is missing"), Error);
    std::filesystem::remove_all(dir);
  }
  // A sharded index that points a tensor at the wrong shard.
  {
    const auto dir = copy_fixture("qwen2_moe", "index");
    replace_in(dir / "model.safetensors.index.json",
               "\"model.embed_tokens.weight\": \"model-00001-of-00002.safetensors\"",
               "\"model.embed_tokens.weight\": \"model-00002-of-00002.safetensors\"");
    CHECK_THROWS_WITH_AS(HfCheckpoint(dir.string()), doctest::Contains("which does not hold it"), Error);
    std::filesystem::remove_all(dir);
  }
  // Neither a single file nor an index.
  {
    const auto dir = copy_fixture("olmoe", "nofile");
    std::filesystem::remove(dir / "model.safetensors");
    CHECK_THROWS_WITH_AS(HfCheckpoint(dir.string()), doctest::Contains("has neither model.safetensors"), Error);
    std::filesystem::remove_all(dir);
  }
}
