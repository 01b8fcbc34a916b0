// Tests of paradyse/cost/profile.hpp and builtin_profiles.hpp: collective costs, JSON round trips, validation, the
// recorded GEMM engine choice (applied through cost/calibrate.hpp).
#include "paradyse/cost/builtin_profiles.hpp"
#include "paradyse/cost/calibrate.hpp"
#include "paradyse/cost/profile.hpp"
#include "paradyse/cost/profile_json.hpp"
#include "support/fresh_seed.hpp"
#include "support/profile_refusal.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <random>
#include <string>

using namespace paradyse;
using namespace paradyse::cost;

TEST_CASE("profile: a collective without entries follows the ring formula of its link level") {
  HardwareProfile p;
  p.devices_per_node = 4;
  p.intra_node = {.launch_s = 2e-6, .step_latency_s = 1e-6, .bus_bytes_per_s = 100e9, .p2p_bytes_per_s = 50e9};
  p.inter_node = {.launch_s = 5e-6, .step_latency_s = 3e-6, .bus_bytes_per_s = 10e9, .p2p_bytes_per_s = 5e9};
  const double bytes = 1e8;
  // Written out plainly from nccl-tests' PERFORMANCE.md.
  CHECK(p.collective_time(Collective::all_gather, 4, bytes) ==
        doctest::Approx(2e-6 + 3 * 1e-6 + 0.75 * bytes / 100e9).scale(0));
  CHECK(p.collective_time(Collective::all_reduce, 4, bytes) ==
        doctest::Approx(2e-6 + 6 * 1e-6 + 1.5 * bytes / 100e9).scale(0));
  CHECK(p.collective_time(Collective::send_recv, 2, bytes) == doctest::Approx(2e-6 + 1e-6 + bytes / 50e9).scale(0));
  CHECK(p.collective_time(Collective::all_to_all, 8, bytes) ==
        doctest::Approx(5e-6 + 7 * 3e-6 + 0.875 * bytes / 10e9).scale(0));
  CHECK(p.collective_time(Collective::all_gather, 1, bytes) == 0);
  CHECK(p.collective_time(Collective::all_gather, 4, 0) == 0);
}

TEST_CASE("profile: an exact entry wins, and the nearest entry carries over to other group sizes") {
  HardwareProfile p;
  p.devices_per_node = 8;
  p.intra_node = {.launch_s = 1, .step_latency_s = 1, .bus_bytes_per_s = 1, .p2p_bytes_per_s = 1};  // never used
  p.set_collective(Collective::all_gather, LinkLevel::intra_node, 4, {.alpha_s = 3e-6, .beta_s_per_byte = 1e-11});
  CHECK(p.collective_time(Collective::all_gather, 4, 1e6) == doctest::Approx(3e-6 + 1e-5).scale(0));
  // Group 8 from the entry for 4: alpha per step = 3e-6 / 3, bus beta = 1e-11 / (3/4).
  CHECK(p.collective_time(Collective::all_gather, 8, 1e6) ==
        doctest::Approx(7 * 1e-6 + (1e-11 / 0.75) * 0.875 * 1e6).scale(0));
  p.set_collective(Collective::all_gather, LinkLevel::intra_node, 4, {.alpha_s = 1e-6, .beta_s_per_byte = 0});
  CHECK(p.collectives.size() == 1);
  CHECK(p.collective_time(Collective::all_gather, 4, 1e9) == doctest::Approx(1e-6).scale(0));
}

TEST_CASE("profile: GEMM time rises with size toward the peak rate") {
  const HardwareProfile p = a100_sxm4_80gb_x8();
  const double small = p.gemm.achieved_flops_per_s(128, 128, 128, 2);
  const double large = p.gemm.achieved_flops_per_s(8192, 8192, 8192, 2);
  CHECK(small < large);
  CHECK(large < p.gemm.flops_per_s);
  CHECK(large > 0.9 * p.gemm.flops_per_s);
  CHECK(p.gemm.time(0, 10, 10, 2) == 0);
}

TEST_CASE("profile: head-width GEMMs (short side up to max_side) are priced by their own class, in JSON too") {
  HardwareProfile p = a100_sxm4_80gb_x8();
  const GemmModel single = p.gemm;
  p.gemm.thin = {.max_side = 32, .overhead_s = 2e-6, .flops_per_s = 5e13, .bytes_per_s = 4e11};
  PARADYSE_FRESH_RNG(rng);
  std::uniform_int_distribution<int> side(1, 4096);
  for (int i = 0; i < 200; ++i) {
    const double m = side(rng), n = side(rng) % 64 + 1, k = side(rng);
    for (const auto& [a, b] : {std::pair{n, k}, std::pair{k, n}}) {  // the short side as n, then as k
      CAPTURE(m);
      CAPTURE(a);
      CAPTURE(b);
      const double bytes = (m * b + b * a + m * a) * 2;
      const double thin = 2e-6 + 2 * m * a * b / 5e13 + bytes / 4e11;
      CHECK(p.gemm.time(m, a, b, 2) == doctest::Approx(std::min(a, b) <= 32 ? thin : single.time(m, a, b, 2)).scale(0));
    }
  }
  // Without the class (max_side 0): the single fit, as every built-in profile.
  CHECK(a100_sxm4_80gb_x8().gemm.time(1024, 32, 1024, 2) == single.time(1024, 32, 1024, 2));
  // JSON: written and read back; absent in profiles written before (none); a bad field named.
  const HardwareProfile back = profile_from_json(to_json(p));
  CHECK(back.gemm.thin == p.gemm.thin);
  CHECK(back.gemm.time(1024, 1024, 32, 2) == p.gemm.time(1024, 1024, 32, 2));
  CHECK(profile_from_json(to_json(a100_sxm4_80gb_x8())).gemm.thin.max_side == 0);
  json::Value v = to_json(p);
  v["gemm"]["thin"]["max_side"] = 0;
  CHECK_THROWS_WITH_AS(profile_from_json(v), doctest::Contains("max_side"), Error);
  v = to_json(p);
  v["gemm"]["thin"]["bytes_per_s"] = -4;
  CHECK_THROWS_WITH_AS(profile_from_json(v), doctest::Contains("bytes_per_s"), Error);
  v = to_json(p);
  v["gemm"]["thin"]["rows"] = 3;
  CHECK_THROWS_WITH_AS(profile_from_json(v), doctest::Contains("rows"), Error);
}

TEST_CASE("profile: attention's backward calls at their own overhead where given, else the forward's; in JSON too") {
  HardwareProfile p = a100_sxm4_80gb_x8();
  p.attention = {.overhead_s = 2e-4, .forward_flops_per_s = 9e12, .backward_flops_per_s = 5e12};
  const double flops = 3e9;
  CHECK(p.attention.forward_time(flops) == doctest::Approx(2e-4 + flops / 9e12).epsilon(1e-12));
  CHECK(p.attention.backward_time(flops) == doctest::Approx(2e-4 + 2.5 * flops / 5e12).epsilon(1e-12));
  CHECK(!to_json(p)["attention"].contains("backward_overhead_s"));  // written only when given
  CHECK(!profile_from_json(to_json(p)).attention.backward_overhead_s);
  p.attention.backward_overhead_s = 1.1e-3;
  CHECK(p.attention.forward_time(flops) == doctest::Approx(2e-4 + flops / 9e12).epsilon(1e-12));
  CHECK(p.attention.backward_time(flops) == doctest::Approx(1.1e-3 + 2.5 * flops / 5e12).epsilon(1e-12));
  const HardwareProfile back = profile_from_json(to_json(p));
  CHECK(back.attention.backward_overhead_s == p.attention.backward_overhead_s);
  CHECK(back.attention.backward_time(flops) == p.attention.backward_time(flops));
  json::Value v = to_json(p);
  v["attention"]["backward_overhead_s"] = -1;
  CHECK_THROWS_WITH_AS(profile_from_json(v), doctest::Contains("attention.backward_overhead_s"), Error);
  v["attention"]["backward_overhead_s"] = "1ms";
  CHECK_THROWS_WITH_AS(profile_from_json(v), doctest::Contains("attention.backward_overhead_s"), Error);
}

TEST_CASE("profile: built-in profiles are consistent with their datasheets") {
  for (std::string_view name : kBuiltinProfileNames) {
    const HardwareProfile p = builtin_profile(name);
    CHECK(p.name == name);
    CHECK(p.devices_per_node == 8);
    CHECK(p.usable_memory_bytes() > 0);
    CHECK(!p.source.empty());
    CHECK(p.intra_node.bus_bytes_per_s > p.inter_node.p2p_bytes_per_s);
  }
  CHECK(a100_sxm4_80gb_x8().gemm.flops_per_s < 312e12);   // achieved < dense peak
  CHECK(h100_sxm_80gb_x8().gemm.flops_per_s < 989e12);
  CHECK(h200_sxm_141gb_x8().memory_bytes > h100_sxm_80gb_x8().memory_bytes);
  CHECK(builtin_profile("h200").name == "H200-SXM-141GB-x8");
  CHECK_THROWS_WITH_AS(builtin_profile("tpu"), doctest::Contains("no built-in profile \"tpu\""), Error);
}

TEST_CASE("profile: JSON round trip through a file keeps every field") {
  HardwareProfile p = h100_sxm_80gb_x8();
  p.overlap = 0.25;
  p.memory_copy_bytes_per_s = 1.25e12;
  p.set_collective(Collective::reduce, LinkLevel::intra_node, 3, {.alpha_s = 1.5e-5, .beta_s_per_byte = 3.3e-12});
  const std::string path = "test_cost_profile_roundtrip.json";
  save_profile(p, path);
  const HardwareProfile q = load_profile(path);
  std::remove(path.c_str());
  CHECK(q.name == p.name);
  CHECK(q.source == p.source);
  CHECK(q.memory_bytes == p.memory_bytes);
  CHECK(q.reserved_bytes == p.reserved_bytes);
  CHECK(q.gemm.flops_per_s == p.gemm.flops_per_s);
  CHECK(q.gemm.bytes_per_s == p.gemm.bytes_per_s);
  CHECK(q.attention.backward_flops_per_s == p.attention.backward_flops_per_s);
  CHECK(q.overlap == p.overlap);
  CHECK(q.memory_copy_bytes_per_s == p.memory_copy_bytes_per_s);
  CHECK(q.memory_copy_time(1e9) == doctest::Approx(1e9 / 1.25e12).epsilon(1e-15).scale(0));
  CHECK(q.inter_node.p2p_bytes_per_s == p.inter_node.p2p_bytes_per_s);
  REQUIRE(q.collectives.size() == p.collectives.size());
  for (Collective op : kAllCollectives)
    for (int g : {2, 3, 8, 16})
      CHECK(q.collective_time(op, g, 12345678) == p.collective_time(op, g, 12345678));
}

TEST_CASE("profile: loading rejects bad values with a message naming them") {
  json::Value v = to_json(a100_sxm4_80gb_x8());
  v["overlap"] = 1.5;
  CHECK_THROWS_WITH_AS(profile_from_json(v), doctest::Contains("overlap = 1.5"), Error);
  v = to_json(a100_sxm4_80gb_x8());
  v["gemm"]["flops_per_s"] = -1;
  CHECK_THROWS_WITH_AS(profile_from_json(v), doctest::Contains("\"flops_per_s\" = -1 must be positive"), Error);
  v = to_json(a100_sxm4_80gb_x8());
  v.erase("name");
  CHECK_THROWS_WITH_AS(profile_from_json(v), doctest::Contains("missing key \"name\""), Error);
  v = to_json(a100_sxm4_80gb_x8());
  json::Value entry = v.at("collectives").at(0);
  entry["op"] = "gather_all";
  v["collectives"] = json::Value::array({entry});
  CHECK_THROWS_WITH_AS(profile_from_json(v), doctest::Contains("unknown collective \"gather_all\""), Error);
}

TEST_CASE("profile: infinite, nan, negative and out-of-range values are rejected naming the field") {
  const json::Value good = to_json(a100_sxm4_80gb_x8());
  auto with = [&](std::string_view object, std::string_view key, json::Value value) {
    json::Value v = good;
    if (object.empty()) v[std::string(key)] = std::move(value);
    else v[std::string(object)][std::string(key)] = std::move(value);
    try {
      profile_from_json(v);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("loaded");
  };
  const double inf = std::numeric_limits<double>::infinity();
  CHECK(with("gemm", "flops_per_s", inf).find("\"flops_per_s\" = inf must be a finite number (gemm.flops_per_s)") != std::string::npos);
  CHECK(with("attention", "forward_flops_per_s", std::nan("")).find("(attention.forward_flops_per_s)") != std::string::npos);
  CHECK(with("intra_node", "bus_bytes_per_s", -5.0).find("\"bus_bytes_per_s\" = -5 must be positive (intra_node.bus_bytes_per_s)") != std::string::npos);
  CHECK(with("", "elementwise_bytes_per_s", inf).find("elementwise_bytes_per_s") != std::string::npos);
  CHECK(with("", "overlap", std::nan("")).find("overlap") != std::string::npos);
  CHECK(with("", "memory_copy_bytes_per_s", -2e10).find("must not be negative (memory_copy_bytes_per_s)") !=
        std::string::npos);
  CHECK(with("", "memory_copy_bytes_per_s", 0.0) == "loaded");  // 0: the elementwise rate
  CHECK(with("", "devices_per_node", 4294967297.0).find("\"devices_per_node\" = 4294967297 must be an integer in [1, 1048576]") != std::string::npos);
  CHECK(with("", "memory_bytes", 1e300).find("memory_bytes") != std::string::npos);
  CHECK(with("", "name", 5).find("profile: name is number, expected a string") != std::string::npos);
  CHECK(with("gemm", "flops_per_s", "fast").find("profile: gemm.flops_per_s is string, expected a number") != std::string::npos);
  json::Value v = good;
  json::Value entry = v.at("collectives").at(0);
  entry["alpha_s"] = -1e-6;
  v["collectives"] = json::Value::array({good.at("collectives").at(0), entry});
  CHECK_THROWS_WITH_AS(profile_from_json(v), doctest::Contains("(collectives[1].alpha_s)"), Error);
}

TEST_CASE("profile: a file with 1e999 flops or binary bytes gives a message naming the field or the byte") {
  const std::string path = "test_cost_profile_bad.json";
  std::string text = json::dump(to_json(a100_sxm4_80gb_x8()));
  const std::size_t at = text.find("\"flops_per_s\": ") + 15;
  text.replace(at, text.find(',', at) - at, "1e999");
  {
    std::ofstream out(path, std::ios::binary);
    out << text;
  }
  CHECK_THROWS_WITH_AS(load_profile(path), doctest::Contains("(in gemm.flops_per_s): expected a number within the range"), Error);
  {
    std::ofstream out(path, std::ios::binary);
    out << std::string("{\"name\": \"x\0y\", \0\0\0", 19);
  }
  std::string message;
  try {
    load_profile(path);
  } catch (const Error& e) {
    message = e.what();
  }
  CHECK(message.find("(in name): syntax error while parsing value - invalid string: control character U+0000") !=
        std::string::npos);
  CHECK(message.find("found byte 0x00") != std::string::npos);
  CHECK(message.find("[json.hpp:") != std::string::npos);
  json::Value without = to_json(a100_sxm4_80gb_x8());
  without.erase("collectives");
  json::save_file(without, path);
  CHECK_THROWS_WITH_AS(load_profile(path),
                       doctest::Contains("profile \"test_cost_profile_bad.json\": missing key \"collectives\""), Error);
  std::remove(path.c_str());
  CHECK_THROWS_WITH_AS(load_profile("."), doctest::Contains("is a folder, not a JSON file"), Error);
}

TEST_CASE("profile: the GEMM engine choice round-trips, gives the MFU rate, is validated and applied to gemm()") {
  HardwareProfile p = h100_sxm_80gb_x8();
  CHECK(p.gemm_peak_flops_per_s() == p.gemm.flops_per_s);  // no choice recorded: the fitted rate
  p.gemm_engines = {{"small", "cblas", 2e10, 1e10}, {"medium", "fallback", 2e10, 3e10}, {"large", "fallback", 3e10, 9e10}};
  CHECK(p.gemm_peak_flops_per_s() == 9e10);
  const std::string path = "test_cost_profile_gemm_engines.json";
  save_profile(p, path);
  const HardwareProfile q = load_profile(path);
  std::remove(path.c_str());
  CHECK(q.gemm_engines == p.gemm_engines);

  // One field of the second entry changed in the JSON text.
  const auto rejected = [&](const std::string& from, const std::string& to) {
    return testing::profile_refusal(p, "gemm_engines", from, to);
  };
  CHECK(rejected("\"fallback\"", "\"turbo\"").find("gemm_engines[1].engine = \"turbo\", expected cblas or fallback") !=
        std::string::npos);
  CHECK(rejected("\"medium\"", "\"huge\"").find("gemm_engines[1].size_class = \"huge\"") != std::string::npos);

  // Applying a choice: gemm() follows it per size class; the process's measured choice is restored after.
  const ops::cpu::GemmMeasurement before = ops::cpu::gemm_measurement();
  HardwareProfile cpu = p;
  cpu.gemm_engines = gemm_engine_choices(before);
  cpu.gemm_engines[0].engine = "fallback";
  cpu.gemm_engines[0].fallback_flops_per_s = 1e9;
  use_gemm_engines(cpu);
  CHECK(ops::cpu::gemm_engine_for(16, 16, 16) == ops::cpu::GemmEngine::fallback);
  CHECK(ops::cpu::gemm_measurement().fallback_flops_per_s[0] == 1e9);
  if (!ops::cpu::kGemmUsesCblas) {
    cpu.gemm_engines[2].engine = "cblas";
    cpu.gemm_engines[2].cblas_flops_per_s = 1e9;
    CHECK_THROWS_WITH_AS(use_gemm_engines(cpu), doctest::Contains("chose cblas for large GEMMs"), Error);
  }
  ops::cpu::set_gemm_measurement(before);
  CHECK(ops::cpu::gemm_measurement() == before);
}

TEST_CASE("profile JSON: the serving engine's host work is optional (0: uncharged), round-trips, and a bad one is named") {
  HardwareProfile p = h100_sxm_80gb_x8();
  CHECK_FALSE(to_json(p).contains("planning_events_per_s"));
  CHECK_FALSE(to_json(p).contains("serving_host"));
  CHECK(profile_from_json(to_json(p)).planning_events_per_s == 0);
  CHECK(profile_from_json(to_json(p)).serving_host == ServingHostModel{});
  p.planning_events_per_s = 3.25e7;
  p.serving_host = {21.5e-6, 1.25e-6};
  const HardwareProfile back = profile_from_json(json::parse(json::dump(to_json(p))));
  CHECK(back.planning_events_per_s == 3.25e7);
  CHECK(back.serving_host == ServingHostModel{21.5e-6, 1.25e-6});
  json::Value bad = to_json(p);
  bad["planning_events_per_s"] = -4;
  CHECK_THROWS_WITH_AS(profile_from_json(bad), doctest::Contains("\"planning_events_per_s\" = -4"), Error);
  bad = to_json(p);
  bad["serving_host"]["chunk_s"] = -1e-6;
  CHECK_THROWS_WITH_AS(profile_from_json(bad), doctest::Contains("serving_host.chunk_s"), Error);
  bad = to_json(p);
  bad["serving_host"]["per_token_s"] = 1e-6;
  CHECK_THROWS_WITH_AS(profile_from_json(bad), doctest::Contains("per_token_s"), Error);
  // The steps' spread: ascending positive factors.
  CHECK_FALSE(to_json(p).contains("step_jitter"));
  p.step_jitter = {0.8, 0.95, 1.0, 1.1, 1.9};
  CHECK(profile_from_json(json::parse(json::dump(to_json(p)))).step_jitter == p.step_jitter);
  bad = to_json(p);
  bad["step_jitter"][3] = 0.9;
  CHECK_THROWS_WITH_AS(profile_from_json(bad), doctest::Contains("step_jitter[3] = 0.9"), Error);
  bad["step_jitter"][3] = -1;
  CHECK_THROWS_WITH_AS(profile_from_json(bad), doctest::Contains("step_jitter[3] = -1"), Error);
  // The ranks' spread: a relative sigma in [0, 1); the wait for the slowest of p is sigma E[max of p] x the kernels.
  CHECK_FALSE(to_json(p).contains("rank_jitter"));
  CHECK(p.straggle_s(1e-3, 8) == 0);
  p.rank_jitter = 0.04;
  CHECK(profile_from_json(json::parse(json::dump(to_json(p)))).rank_jitter == 0.04);
  CHECK(p.straggle_s(2e-3, 1) == 0);
  CHECK(p.straggle_s(2e-3, 2) == doctest::Approx(0.04 * 2e-3 / std::sqrt(std::acos(-1.0))).epsilon(1e-9));
  CHECK(p.straggle_s(2e-3, 8) > p.straggle_s(2e-3, 2));
  for (const double sigma : {1.0, -0.01}) {
    bad = to_json(p);
    bad["rank_jitter"] = sigma;
    CHECK_THROWS_WITH_AS(profile_from_json(bad), doctest::Contains(fmt::format("\"rank_jitter\" = {}", sigma).c_str()), Error);
  }
  bad["rank_jitter"] = "wide";
  CHECK_THROWS_WITH_AS(profile_from_json(bad), doctest::Contains("rank_jitter"), Error);
  // The speed probe's baseline: a positive factor, also under its older name; not under both.
  CHECK_FALSE(to_json(p).contains("probe_baseline"));
  p.probe_baseline = 1.125;
  CHECK(profile_from_json(json::parse(json::dump(to_json(p)))).probe_baseline == 1.125);
  json::Value older = to_json(p);
  older.erase("probe_baseline");
  older["serving_probe_baseline"] = 1.25;
  CHECK(profile_from_json(older).probe_baseline == 1.25);
  older["probe_baseline"] = 1.25;
  CHECK_THROWS_WITH_AS(profile_from_json(older), doctest::Contains("both given"), Error);
  for (const char* key : {"probe_baseline", "serving_probe_baseline"})
    for (const double reading : {0.0, -1.0, 101.0}) {
      bad = to_json(p);
      bad.erase("probe_baseline");
      bad[key] = reading;
      CHECK_THROWS_WITH_AS(profile_from_json(bad),
                           doctest::Contains(fmt::format("\"{}\" = {}", key, reading).c_str()), Error);
    }
}
