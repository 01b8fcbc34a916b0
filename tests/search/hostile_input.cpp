// Tests of issue 27's search cases: pipeline and ring hops priced on the links they cross (hand-computed cases
// for every axis, groups that straddle nodes), a head_dim that is not an integer, profile rates and times outside
// their range, unknown and repeated keys in profile, cluster and model JSON, and shapes that would make the search
// run without end.
#include "paradyse/cost/profile_json.hpp"
#include "paradyse/search/mesh_groups.hpp"
#include "paradyse/search/search.hpp"
#include "support/error_of.hpp"

#include <doctest/doctest.h>

#include <chrono>
#include <string>

using paradyse::testing::error_of;

using namespace paradyse;
using namespace paradyse::search;

TEST_CASE("hostile: a pipeline whose stages straddle nodes is priced on the network") {
  // gpt-175b over dgx-a100 x 64: dp = 1 pp = 16 tp = 4 has stage neighbours 4 ranks apart, half of its hops between
  // nodes; it was priced at NVLink (an aligned pair of span 8) and got less pipeline time than dp = 2 pp = 8 tp = 4.
  const PerformanceModel model(gpt_175b(), dgx_a100(), TrainingSetup{.seq = 2048, .global_batch = 512}, 64);
  const Estimate deep = model.evaluate({.dp = 1, .pp = 16, .tp_y = 4, .zero = 1, .recompute = Recompute::full});
  const Estimate wide = model.evaluate({.dp = 2, .pp = 8, .tp_y = 4, .zero = 1, .recompute = Recompute::full});
  REQUIRE(deep.valid);
  REQUIRE(wide.valid);
  CHECK(deep.exposed(CommDim::pp) >= wide.exposed(CommDim::pp));
  // Hand-computed: one send of the stage's output [s / tp tokens, h] bf16 over one device's network link, each
  // direction, for each of m = 512 micro-batches.
  const double send = 10e-6 + 2048.0 / 4 * 12288 * 2 / (0.9 * 25e9);
  CHECK(deep.exposed(CommDim::pp) == doctest::Approx(512 * 2 * send));

  // With the network at 1 B/s every configuration crossing it is priced so; pp = 16 must not rank first.
  ClusterProfile slow = dgx_a100();
  slow.levels[1].bytes_per_s = 1;
  const PerformanceModel on_slow(gpt_175b(), slow, TrainingSetup{.seq = 2048, .global_batch = 512}, 64);
  const SearchResult r = search::search(on_slow, {.space = space_3d(), .top_k = 3});
  REQUIRE(!r.top.empty());
  CHECK(r.top.front().config.pp != 16);
}

TEST_CASE("hostile: every axis's group priced against a hand-computed case that straddles nodes") {
  // Nodes of 4 (100 GB/s, 1 us), network 10 GB/s per device, 5 us.
  ClusterProfile c;
  c.name = "hand";
  c.device.memory_bytes = std::int64_t(1) << 40;
  c.peak_flops_per_s = 1e12;
  c.levels = {{"node", 4, 1e-6, 100e9}, {"net", 0, 5e-6, 10e9}};
  validate(c);
  const double B = 1e8, nvl = 100e9, net = 10e9;
  // 16 ranks: pp = 2, dp = 2, cp = 2, tp_y = 2.
  const ParallelConfig k{.dp = 2, .pp = 2, .cp = 2, .tp_y = 2};
  const MeshGroups g = mesh_groups(k);
  // tp_y: ranks {0, 1}, inside a node.
  CHECK(c.collective_time(Collective::all_gather, g.tp_y, B) == doctest::Approx(1e-6 + 0.5 * B / nvl).scale(0));
  // cp: ranks {0, 2}, inside a node; a ring step on NVLink.
  CHECK(c.collective_time(Collective::send_recv, g.cp, B) == doctest::Approx(1e-6 + B / nvl).scale(0));
  // dp x cp: ranks {0, 2, 4, 6}, two nodes, 2 members in each: 2 rails cross at once.
  CHECK(c.collective_time(Collective::all_reduce, g.dp_cp, B) ==
        doctest::Approx(6 * 5e-6 + 1.5 * B / (2 * net)).scale(0));
  // pp: ranks {0, 8}, one hop across the network.
  CHECK(c.collective_time(Collective::send_recv, g.pp, B) == doctest::Approx(5e-6 + B / net).scale(0));
  // A pipeline of 4 stages 2 ranks apart over 8 ranks: hops 2 -> 4 and 6 -> 0 straddle nodes (formerly priced at
  // NVLink, as an aligned pair of span 4).
  CHECK(c.collective_time(Collective::send_recv, {4, 8}, B) == doctest::Approx(5e-6 + B / net).scale(0));
  // A cp ring of 8 consecutive ranks over two nodes: its wrap-around and middle hops cross the network.
  CHECK(c.collective_time(Collective::send_recv, {8, 8}, B) == doctest::Approx(5e-6 + B / net).scale(0));
  // ep (all-to-all) over 8 consecutive ranks: 3 of 8 parts stay in the node, 4 cross.
  const ParallelConfig moe{.dp = 8, .ep = 8};
  CHECK(c.collective_time(Collective::all_to_all, mesh_groups(moe).ep, B) ==
        doctest::Approx(7 * 5e-6 + B * 3 / 8 / nvl + B * 4 / 8 / net).scale(0));
  // tp_x over 8 ranks with tp_y = 1: a 2D-tp ring across two nodes, 4 rails.
  const ParallelConfig wide{.tp_x = 8};
  CHECK(c.collective_time(Collective::reduce_scatter, mesh_groups(wide).tp_x, B) ==
        doctest::Approx(7 * 5e-6 + 0.875 * B / (4 * net)).scale(0));
}

TEST_CASE("hostile: a hidden size that heads do not divide is refused, naming head_dim") {
  const std::string e = error_of([] {
    model_from_json(json::parse(R"({"num_hidden_layers": 2, "hidden_size": 4097, "num_attention_heads": 32,
        "intermediate_size": 128, "vocab_size": 10})"), "odd");
  });
  CHECK(e.find("hidden_size = 4097 is not divisible by num_attention_heads = 32") != std::string::npos);
  CHECK(e.find("head_dim") != std::string::npos);
  // An explicit head_dim is a choice the model makes (hidden need not be heads x head_dim).
  CHECK(model_from_json(json::parse(R"({"num_hidden_layers": 2, "hidden_size": 4097, "num_attention_heads": 32,
        "head_dim": 128, "intermediate_size": 128, "vocab_size": 10})"), "odd").head_dim == 128);
}

TEST_CASE("hostile: profile rates and times outside their range are refused with the key, value and range") {
  const json::Value good = cost::to_json(cost::a100_sxm4_80gb_x8());
  auto with = [&](std::string_view object, std::string_view key, json::Value value) {
    json::Value v = good;
    if (object.empty()) v[std::string(key)] = std::move(value);
    else v[std::string(object)][std::string(key)] = std::move(value);
    return error_of([&] { cost::profile_from_json(v); });
  };
  CHECK(with("gemm", "flops_per_s", 1e-300).find("\"flops_per_s\" = 1e-300 is outside the accepted range [1, 1e+30] "
                                                  "per second (gemm.flops_per_s)") != std::string::npos);
  CHECK(with("gemm", "flops_per_s", 1e300).find("= 1e+300 is outside the accepted range") != std::string::npos);
  CHECK(with("attention", "backward_flops_per_s", -3.0).find("must be positive") != std::string::npos);
  CHECK(with("gemm", "overhead_s", 1e300).find("\"overhead_s\" = 1e+300 is outside the accepted range [0, 1] seconds "
                                                "(gemm.overhead_s)") != std::string::npos);
  CHECK(with("", "elementwise_bytes_per_s", 1e-300).find("(elementwise_bytes_per_s)") != std::string::npos);
  CHECK(with("intra_node", "launch_s", 5.0).find("(intra_node.launch_s)") != std::string::npos);
  CHECK(with("gemm", "bytes_per_s", 0.0) == "accepted");  // 0: no operand term
  CHECK(with("gemm", "bytes_per_s", 1e-300).find("(gemm.bytes_per_s)") != std::string::npos);
  // A cluster's own figures too.
  json::Value cluster = {{"name", "x"}, {"peak_flops_per_s", 1e300}, {"device", good},
                         {"levels", json::Value::array({{{"name", "all"}, {"domain_devices", 0}, {"alpha_s", 0},
                                                         {"bytes_per_s", 1e9}}})}};
  CHECK(error_of([&] { cluster_from_json(cluster); }).find("(peak_flops_per_s)") != std::string::npos);
  cluster["peak_flops_per_s"] = 1e12;
  CHECK(error_of([&] { cluster_from_json(cluster); }) == "accepted");
  cluster["levels"][0]["alpha_s"] = 1e300;
  CHECK(error_of([&] { cluster_from_json(cluster); }).find("(levels[0].alpha_s)") != std::string::npos);
}

TEST_CASE("hostile: unknown and repeated keys in profile, cluster and model JSON are refused by name") {
  json::Value profile = cost::to_json(cost::a100_sxm4_80gb_x8());
  profile["gemm"]["flops_per_sec"] = 1e12;
  CHECK(error_of([&] { cost::profile_from_json(profile); }).find("unknown key \"flops_per_sec\" (gemm.flops_per_sec)") !=
        std::string::npos);
  profile = cost::to_json(cost::a100_sxm4_80gb_x8());
  profile["overlapp"] = 1;
  CHECK(error_of([&] { cost::profile_from_json(profile); }).find("unknown key \"overlapp\"") != std::string::npos);
  // A repeated key: the parser keeps both, readers saw only the first.
  std::string text = json::dump(cost::to_json(cost::a100_sxm4_80gb_x8()));
  text.insert(text.rfind('}'), ", \"overlap\": 0.5");
  CHECK(error_of([&] { cost::profile_from_json(json::parse(text)); }).find("duplicate key \"overlap\"") !=
        std::string::npos);
  const json::Value cluster = {{"name", "c"},
                               {"peak_flops_per_s", 1e12},
                               {"device", cost::to_json(cost::a100_sxm4_80gb_x8())},
                               {"levels", json::Value::array({{{"name", "all"}, {"domain_devices", 0},
                                                                {"alpha_s", 0}, {"bytes_per_s", 1e9}}})}};
  json::Value misspelt = cluster;
  misspelt["levle"] = 1;
  CHECK(error_of([&] { cluster_from_json(misspelt); }).find("unknown key \"levle\"") != std::string::npos);
  std::string repeated = json::dump(cluster, 0);
  repeated.insert(repeated.find("\"bytes_per_s\":1000000000.0") + 1, "bytes_per_s\":1,\"");
  CHECK(error_of([&] { cluster_from_json(json::parse(repeated)); }).find("duplicate key \"bytes_per_s\"") !=
        std::string::npos);
  CHECK(error_of([] {
          model_from_json(json::parse(R"({"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
              "intermediate_size": 128, "vocab_size": 10, "num_hiden_layers": 4})"), "m");
        }).find("unknown key \"num_hiden_layers\"") != std::string::npos);
  CHECK(error_of([] {
          model_from_json(json::parse(R"({"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
              "intermediate_size": 128, "vocab_size": 10, "num_hidden_layers": 4})"), "m");
        }).find("duplicate key \"num_hidden_layers\"") != std::string::npos);
  // The keys of real config.json files that do not change the shape are accepted.
  CHECK(model_from_json(json::parse(R"({"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
        "intermediate_size": 128, "vocab_size": 10, "architectures": ["LlamaForCausalLM"], "rope_theta": 500000,
        "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16"})"), "m").layers == 2);
}

TEST_CASE("hostile: shapes that would make the search run without end are refused or end in bounded time") {
  CHECK(error_of([] {
          model_from_json(json::parse(R"({"num_hidden_layers": 999999999999, "hidden_size": 64,
              "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 10})"), "deep");
        }).find("layers = 999999999999 must be in [1, 100000]") != std::string::npos);
  // seq and global batch of 2^24 on 2,048 devices: the search ends (nothing fits, or a best) within seconds.
  const auto start = std::chrono::steady_clock::now();
  const std::int64_t huge = std::int64_t(1) << 24;
  const PerformanceModel model(gpt_175b(), dgx_h100(), TrainingSetup{.seq = huge, .global_batch = huge}, 2048);
  const std::string outcome = error_of([&] { search::search(model, {.top_k = 1}); });
  CHECK(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < 60);
  CHECK(divisors(std::int64_t(1) << 24).size() == 25);
  CHECK(divisors(36) == std::vector<int>{1, 2, 3, 4, 6, 9, 12, 18, 36});
}
