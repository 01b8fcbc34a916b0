// YaRN rope scaling as DeepSeek uses it (serve/yarn_rope.hpp): the blended inverse frequencies, the attention factor
// and the softmax-scale correction against the values transformers 4.57.6 computes (_compute_yarn_parameters and
// DeepseekV3's yarn_get_mscale, printed by /work/venv-hf for the configs below); the scaled rotation without
// scaling against ops' RoPE in both pairings; config.json parsing of rope_scaling.
#include "paradyse/ops/cpu/rope.hpp"
#include "paradyse/serve/hf_config.hpp"
#include "paradyse/serve/yarn_rope.hpp"

#include "support/fresh_seed.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <random>
#include <vector>

using namespace paradyse;
using namespace paradyse::serve;

namespace {
void check_close(double got, double want) {  // transformers computes the frequencies in float32
  INFO("got ", got, ", transformers ", want);
  CHECK(std::abs(got - want) <= 2e-7 * std::abs(want) + 1e-12);
}
}  // namespace

TEST_CASE("yarn: DeepSeek-V2-Lite's rope_scaling gives transformers' frequencies, attention factor and softmax factor") {
  // DeepSeek-V2-Lite: qk_rope_head_dim 64, rope_theta 10000, factor 40, original 4096, beta 32 / 1, mscale 0.707 both.
  const YarnRope y{.factor = 40, .original_max_position = 4096, .beta_fast = 32, .beta_slow = 1, .mscale = 0.707,
                   .mscale_all_dim = 0.707};
  const std::vector<double> f = rope_inverse_frequencies(10000.0, 64, y);
  REQUIRE(f.size() == 32);
  const std::pair<int, double> want[] = {{0, 1.0},
                                         {10, 0.05623412877321243},
                                         {16, 0.005500000435858965},
                                         {20, 0.0007905694073997438},
                                         {24, 2.499999936844688e-05},
                                         {31, 3.3338035336782923e-06}};
  for (const auto& [j, w] : want) check_close(f[std::size_t(j)], w);
  CHECK(yarn_attention_factor(y) == 1.0);  // mscale == mscale_all_dim
  check_close(yarn_softmax_factor(y), 1.5896261651208736);
}

TEST_CASE("yarn: the fixtures' rope_scaling without truncation, and the attention factor of mscale != mscale_all_dim") {
  const YarnRope y{.factor = 8, .original_max_position = 256, .beta_fast = 32, .beta_slow = 1, .mscale = 1.0,
                   .mscale_all_dim = 0.8, .truncate = false};
  const std::vector<double> f = rope_inverse_frequencies(10000.0, 8, y);
  const double want[] = {1.0, 0.04796507582068443, 0.0012499999720603228, 0.0001250000059371814};
  for (std::size_t j = 0; j < 4; ++j) check_close(f[j], want[j]);
  check_close(yarn_attention_factor(y), 1.0356570849393496);
  check_close(yarn_softmax_factor(y), 1.360384740270462);
  // Truncated (the default), pair 1 sits half-way on the ramp [0, 2]: the mean of 0.1 and 0.1 / 8.
  YarnRope t = y;
  t.truncate = true;
  check_close(rope_inverse_frequencies(10000.0, 8, t)[1], 0.5 * (0.1 + 0.1 / 8));
  // Without mscale_all_dim the softmax scale is untouched and the attention factor is mscale(8, 1).
  t.mscale_all_dim = 0;
  CHECK(yarn_softmax_factor(t) == 1.0);
  check_close(yarn_attention_factor(t), 0.1 * std::log(8.0) + 1.0);
  t.attention_factor = 0.5;  // stated: taken as is
  CHECK(yarn_attention_factor(t) == 0.5);
  CHECK(yarn_attention_factor(YarnRope{}) == 1.0);
  CHECK(yarn_softmax_factor(YarnRope{}) == 1.0);
}

TEST_CASE("yarn: rotate_scaled without scaling equals ops' RoPE in both pairings, and scales by the amplitude") {
  PARADYSE_FRESH_RNG(rng);
  std::normal_distribution<float> normal;
  for (const bool interleaved : {false, true}) {
    Tensor<float> x(Shape{2, 5, 3, 8});
    for (std::int64_t i = 0; i < x.numel(); ++i) x.data()[i] = normal(rng);
    Tensor<float> ops_y(x.shape()), ours(x.shape()), scaled(x.shape());
    const ops::RopeConfig rope{500.0, interleaved ? ops::RopeLayout::interleaved : ops::RopeLayout::halves};
    ops::cpu::rope_forward(x.view(), ops_y.view(), 7, rope);
    copy(x.view(), ours.view());
    copy(x.view(), scaled.view());
    const std::vector<double> f = rope_inverse_frequencies(500.0, 8, YarnRope{});
    rotate_scaled(ours.view(), 7, f, 1.0, interleaved);
    rotate_scaled(scaled.view(), 7, f, 1.25, interleaved);
    for (std::int64_t i = 0; i < x.numel(); ++i) {
      CHECK(ours.data()[i] == doctest::Approx(ops_y.data()[i]).epsilon(1e-6));
      CHECK(scaled.data()[i] == doctest::Approx(1.25 * ops_y.data()[i]).epsilon(1e-6));
    }
  }
}

TEST_CASE("yarn: config.json rope_scaling is read for DeepSeek and refused elsewhere, by type and by key") {
  const auto config = [](const char* family, const char* scaling) {
    json::Value c = json::parse(R"({"architectures": ["DeepseekV2ForCausalLM"], "vocab_size": 16, "hidden_size": 8,
      "num_hidden_layers": 1, "num_attention_heads": 2, "kv_lora_rank": 4, "qk_nope_head_dim": 2, "qk_rope_head_dim": 2,
      "v_head_dim": 2, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 4,
      "intermediate_size": 8, "max_position_embeddings": 1024, "n_group": 1, "topk_group": 1})", "test");
    c["architectures"][0] = family;
    if (std::string(family) == "MixtralForCausalLM")
      c = json::parse(R"({"architectures": ["MixtralForCausalLM"], "vocab_size": 16, "hidden_size": 8,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
        "intermediate_size": 8})", "test");
    c["rope_scaling"] = json::parse(scaling, "rope_scaling");
    return c;
  };
  const DecoderConfig d = decoder_config(
      config("DeepseekV2ForCausalLM", R"({"type": "yarn", "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707})"),
      "c");
  CHECK(d.yarn.enabled());
  CHECK(d.yarn.factor == 40);
  CHECK(d.yarn.original_max_position == 1024);  // absent: max_position_embeddings
  CHECK(d.yarn.beta_fast == 32);
  CHECK(d.yarn.beta_slow == 1);
  CHECK(d.yarn.truncate);
  const DecoderConfig v3 = decoder_config(
      config("DeepseekV3ForCausalLM", R"({"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 64,
               "beta_fast": 16, "beta_slow": 2, "truncate": false})"), "c");
  CHECK(v3.yarn.original_max_position == 64);
  CHECK(v3.yarn.beta_fast == 16);
  CHECK(!v3.yarn.truncate);
  CHECK(model_identity(d) != model_identity(decoder_config(config("DeepseekV2ForCausalLM", "null"), "c")));
  CHECK_THROWS_WITH_AS(decoder_config(config("DeepseekV2ForCausalLM", R"({"type": "linear", "factor": 2})"), "c"),
                       doctest::Contains("hf config c: \"rope_scaling\" type is \"linear\" in rope_scaling "
                                         "{\"type\":\"linear\",\"factor\":2}; supported: \"yarn\" (DeepSeek)"),
                       Error);
  CHECK_THROWS_WITH_AS(decoder_config(config("DeepseekV2ForCausalLM", R"({"type": "yarn", "factor": 2, "low": 1})"),
                                      "c"),
                       doctest::Contains("\"rope_scaling\" has the key \"low\" (value 1); supported:"), Error);
  CHECK_THROWS_WITH_AS(decoder_config(config("DeepseekV2ForCausalLM", R"({"type": "yarn", "factor": 0.5})"), "c"),
                       doctest::Contains("rope_scaling factor is 0.5 in rope_scaling"), Error);
  CHECK_THROWS_WITH_AS(decoder_config(config("DeepseekV2ForCausalLM", R"({"type": "yarn"})"), "c"),
                       doctest::Contains("rope_scaling factor is 0 in"), Error);
  CHECK_THROWS_WITH_AS(decoder_config(config("MixtralForCausalLM", R"({"type": "yarn", "factor": 2})"), "c"),
                       doctest::Contains("\"rope_scaling\" is {\"type\":\"yarn\",\"factor\":2}; rope scaling is "
                                         "supported only as DeepSeek's yarn: expected null"),
                       Error);
}
