// Tests of paradyse/search/: the performance model's invariants against hand-computed cases (memory per ZeRO stage
// and recomputation, in-flight micro-batches, FLOP accounting on an ideal device, the bubble, alpha-beta sums over
// link levels), the search against brute force (same top K; the bound never above a configuration it skips), the
// Megatron-LM validation, and bad input.
#include "paradyse/search/search.hpp"
#include "ideal_cluster.hpp"
#include "paradyse/search/mesh_groups.hpp"
#include "paradyse/search/validation.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

using namespace paradyse;
using namespace paradyse::search;
using paradyse::search::testing::ideal_cluster;

namespace {

// 4 layers, h 64, 4 heads of 16, GELU MLP of 256, vocabulary 128 tied: 49,280 parameters per layer, 8,192 in the
// embedding.
TrainingModel tiny_dense() {
  return {.name = "tiny", .layers = 4, .hidden = 64, .heads = 4, .kv_heads = 4, .head_dim = 16, .ffn = 256,
          .vocab = 128, .tied_embeddings = true};
}

TrainingModel small_dense() {
  return {.name = "small", .layers = 8, .hidden = 512, .heads = 8, .kv_heads = 8, .head_dim = 64, .ffn = 2048,
          .vocab = 1024, .tied_embeddings = true};
}

TrainingModel small_moe() {
  return {.name = "small-moe", .layers = 4, .hidden = 512, .heads = 8, .kv_heads = 2, .head_dim = 64, .ffn = 1024,
          .vocab = 1024, .swiglu = true, .experts = 4, .top_k = 2, .expert_ffn = 1024};
}

// Every configuration of the space on every mesh, as the search defines the space, evaluated without pruning.
template <class Visit>
void for_each_configuration(const PerformanceModel& model, const SearchSpace& space, Visit visit) {
  for (const ParallelConfig& mesh : meshes(model, space)) {
    const double bound = mesh_lower_bound(model, space, mesh);
    for (auto [ep, etp] : expert_layouts(model.model(), space, mesh))
      for (int mb : divisors(model.setup().global_batch / mesh.dp)) {
        if (mb > space.max_micro_batch) break;
        for (int v = 1; v <= space.max_virtual_stages; ++v)
          for (int zero = 0; zero <= 3; ++zero)
            for (Recompute r : kAllRecompute) {
              ParallelConfig c = mesh;
              c.ep = ep, c.etp = etp, c.micro_batch = mb, c.virtual_stages = v, c.zero = zero, c.recompute = r;
              if (!structural_problem(model.model(), model.setup(), c, model.devices()).empty()) continue;
              visit(bound, model.evaluate(c));
            }
      }
  }
}

}  // namespace

TEST_CASE("search: parameter counts of the presets match their published sizes") {
  CHECK(gpt_175b().total_parameters() == doctest::Approx(175e9).epsilon(0.01));
  CHECK(llama3_405b().total_parameters() == doctest::Approx(405.8e9).epsilon(0.01));
  CHECK(mixtral_8x22b().total_parameters() == doctest::Approx(140.6e9).epsilon(0.01));
  CHECK(mixtral_8x22b().activated_parameters() == doctest::Approx(39.1e9).epsilon(0.01));
  CHECK(deepseek_v3().total_parameters() == doctest::Approx(671e9).epsilon(0.01));
  CHECK(deepseek_v3().activated_parameters() == doctest::Approx(37e9).epsilon(0.03));
  // Written out: 4 layers x (attention 64*(4+8)*16 + 4*16*64, norms 2*64, MLP 2*64*256) + the tied embedding.
  CHECK(tiny_dense().total_parameters() == 4 * (12288 + 4096 + 128 + 32768) + 128 * 64);
}

TEST_CASE("search: memory per ZeRO stage equals the hand-computed model states") {
  const TrainingModel m = tiny_dense();
  const TrainingSetup s{.seq = 32, .global_batch = 8};
  const double P = 4 * 49280 + 8192;  // everything on one stage, tp = 1, embedding once (tied)
  const double layer = 49280;
  for (int zero = 0; zero <= 3; ++zero) {
    CAPTURE(zero);
    const ParallelConfig c{.dp = 4, .zero = zero, .micro_batch = 2, .recompute = Recompute::full};
    const MemoryEstimate e = estimate_memory(m, s, c);
    CHECK(e.weights == doctest::Approx(2 * P / (zero >= 3 ? 4 : 1)));
    CHECK(e.gradients == doctest::Approx(4 * P / (zero >= 2 ? 4 : 1)));
    CHECK(e.optimizer == doctest::Approx(12 * P / (zero >= 1 ? 4 : 1)));
    // Full recomputation: each layer keeps its bf16 input (2 h bytes per token) for 2 * 32 tokens; one layer is
    // recomputed at a time with all its activations: attention 2 (2h + 3h + h) + h (mask), MLP 2 (2h + 2f) + h.
    CHECK(e.activations == doctest::Approx(4 * 64 * 2 * 64));
    const double working = 64 * (2 * (128 + 192 + 64) + 64 + 2 * (128 + 512) + 64);
    const double logits = 64 * 128 * (2 + 4);
    CHECK(e.transient == doctest::Approx(working + logits + (zero == 3 ? 2 * layer * 2 : 0)));
  }
  // Without recomputation every layer keeps all of it; selective drops the activation output (2 f per token) and the
  // context (2 h per token: train_gpt re-runs the core for it).
  ParallelConfig c{.dp = 4, .micro_batch = 2, .recompute = Recompute::none};
  const double none = estimate_memory(m, s, c).activations;
  CHECK(none == doctest::Approx(4 * 64 * (2 * (128 + 192 + 64) + 64 + 2 * (128 + 512) + 64)));
  c.recompute = Recompute::selective;
  CHECK(estimate_memory(m, s, c).activations == doctest::Approx(none - 4 * 64 * 2 * (256 + 64)));
  // Without flash attention, no recomputation keeps Korthikanti's 5 a s bytes of scores per token.
  TrainingSetup no_flash = s;
  no_flash.flash_attention = false;
  c.recompute = Recompute::none;
  CHECK(estimate_memory(m, no_flash, c).activations == doctest::Approx(none + 4 * 64 * 5.0 * 4 * 32));
}

TEST_CASE("search: in-flight micro-batches of 1F1B and interleaved 1F1B; tp and cp shard the activations") {
  TrainingModel m = tiny_dense();
  m.layers = 8;
  const TrainingSetup s{.seq = 32, .global_batch = 16};
  // 1F1B: the first stage holds min(m, pp); interleaved: pp + (pp - 1) / v (Megatron-LM).
  CHECK(estimate_memory(m, s, {.pp = 4, .micro_batch = 1}).in_flight == 4);
  CHECK(estimate_memory(m, s, {.pp = 4, .micro_batch = 8}).in_flight == 2);  // m = 2
  CHECK(estimate_memory(m, s, {.pp = 2, .micro_batch = 1, .virtual_stages = 2}).in_flight == doctest::Approx(2.5));
  CHECK(estimate_memory(m, s, {.pp = 2, .micro_batch = 1, .virtual_stages = 4}).in_flight == doctest::Approx(2.25));
  const double one = estimate_memory(m, s, {.recompute = Recompute::none}).activations;
  CHECK(estimate_memory(m, s, {.tp_x = 2, .tp_y = 2, .recompute = Recompute::none}).activations ==
        doctest::Approx(one / 4));
  CHECK(estimate_memory(m, s, {.cp = 2, .recompute = Recompute::none}).activations == doctest::Approx(one / 2));
}

TEST_CASE("search: memory never falls as the micro-batch grows (what the memory pruning relies on)") {
  const TrainingModel m = small_moe();
  const TrainingSetup s{.seq = 1024, .global_batch = 64};
  for (int pp : {1, 2, 4})
    for (int v : {1, 2})
      for (Recompute r : kAllRecompute)
        for (int zero = 0; zero <= 3; ++zero) {
          if (v > 1 && pp == 1) continue;
          double previous = 0;
          for (int mb : {1, 2, 4, 8}) {
            const ParallelConfig c{.dp = 2, .pp = pp, .ep = 2, .zero = zero, .micro_batch = mb, .virtual_stages = v,
                                   .recompute = r};
            const double bytes = estimate_memory(m, s, c).total();
            CHECK(bytes >= previous);
            previous = bytes;
          }
        }
}

TEST_CASE("search: on an ideal device the compute is 3x (4x with full recomputation) the forward FLOPs over the rate") {
  const double rate = 1e12;
  const ClusterProfile cluster = ideal_cluster(rate, {{"node", 8, 0, 1e30}, {"net", 0, 0, 1e30}});
  for (const TrainingModel& m : {small_dense(), small_moe()}) {
    CAPTURE(m.name);
    const TrainingSetup s{.seq = 1024, .global_batch = 8};
    const double tokens = 8.0 * 1024;
    const double forward = m.forward_flops_per_token(512) * tokens;  // causal flash: half the keys
    const double logits = 2.0 * m.embedding_parameters() * tokens;
    const PerformanceModel one(m, cluster, s, 1);
    const Estimate e = one.evaluate({.micro_batch = 2});
    REQUIRE(e.problem.empty());
    CHECK(e.compute_s == doctest::Approx(3 * forward / rate).epsilon(1e-9));
    const Estimate full = one.evaluate({.micro_batch = 2, .recompute = Recompute::full});
    CHECK(full.compute_s == doctest::Approx((4 * (forward - logits) + 3 * logits) / rate).epsilon(1e-9));
    CHECK(full.recompute_s == doctest::Approx((forward - logits) / rate).epsilon(1e-9));
    // 2D tensor, context, expert and data parallelism divide the work evenly over 16 devices.
    const PerformanceModel sixteen(m, cluster, s, 16);
    const ParallelConfig c{.dp = 2, .cp = 2, .tp_x = 2, .tp_y = 2, .ep = m.is_moe() ? 4 : 1,
                           .etp = m.is_moe() ? 2 : 1, .micro_batch = 2};
    const Estimate split = sixteen.evaluate(c);
    REQUIRE(split.problem.empty());
    CHECK(split.compute_s == doctest::Approx(3 * forward / rate / 16).epsilon(1e-9));
    CHECK(split.mfu == doctest::Approx(split.model_flops / (split.step_s * 16 * rate)));
  }
}

TEST_CASE("search: the bubble is (pp - 1) / v slowest-stage micro-batch times") {
  TrainingModel m = small_dense();
  const PerformanceModel model(m, dgx_a100(), TrainingSetup{.seq = 2048, .global_batch = 64}, 16);
  for (int v : {1, 2, 4}) {
    CAPTURE(v);
    const ParallelConfig c{.dp = 2, .pp = 2, .tp_y = 4, .micro_batch = 2, .virtual_stages = v};
    const Estimate e = model.evaluate(c);
    REQUIRE(e.problem.empty());
    const double m_count = 64.0 / (2 * 2);
    const double stage = (e.compute_s + e.total_exposed_comm_s() - e.exposed(CommDim::dp)) / m_count;
    CHECK(e.bubble_s == doctest::Approx(1.0 / v * stage).scale(0));
    CHECK(e.step_s == doctest::Approx(e.compute_s + e.total_exposed_comm_s() + e.bubble_s + e.optimizer_s));
  }
  CHECK(model.evaluate({.dp = 4, .tp_y = 4, .micro_batch = 2}).bubble_s == 0);
}

TEST_CASE("search: collective times are alpha-beta sums over the link levels a group spans") {
  ClusterProfile c = ideal_cluster(1e12, {{"node", 4, 1e-6, 100e9}, {"net", 0, 5e-6, 10e9}});
  validate(c);
  const double B = 1e8;
  // Inside a node: the ring formula of nccl-tests.
  CHECK(c.collective_time(Collective::all_reduce, {4, 4}, B) == doctest::Approx(6 * 1e-6 + 1.5 * B / 100e9).scale(0));
  CHECK(c.collective_time(Collective::all_gather, {2, 4}, B) == doctest::Approx(1e-6 + 0.5 * B / 100e9).scale(0));
  // 8 ranks over 2 nodes: 4 rails cross the network at once.
  CHECK(c.collective_time(Collective::all_gather, {8, 8}, B) == doctest::Approx(7 * 5e-6 + 0.875 * B / 40e9).scale(0));
  // One member per node (stride 4): one rail.
  CHECK(c.collective_time(Collective::reduce_scatter, {4, 16}, B) ==
        doctest::Approx(3 * 5e-6 + 0.75 * B / 10e9).scale(0));
  // All-to-all: 3 of 8 parts stay in the node, 4 cross on the device's own link.
  CHECK(c.collective_time(Collective::all_to_all, {8, 8}, B) ==
        doctest::Approx(7 * 5e-6 + B * 3 / 8 / 100e9 + B * 4 / 8 / 10e9).scale(0));
  // Pipeline neighbours 2 apart share a node, 4 apart do not.
  CHECK(c.collective_time(Collective::send_recv, {2, 4}, B) == doctest::Approx(1e-6 + B / 100e9).scale(0));
  CHECK(c.collective_time(Collective::send_recv, {2, 8}, B) == doctest::Approx(5e-6 + B / 10e9).scale(0));
  CHECK(c.collective_time(Collective::all_reduce, {1, 1}, B) == 0);
  // A group whose span does not divide the node runs on the network.
  CHECK(c.level_of({3, 3}) == 1);
  CHECK(c.level_of({2, 2}) == 0);
}

TEST_CASE("search: the pruned search finds the same top K as brute force, and the bound is never above") {
  struct Case {
    TrainingModel model;
    ClusterProfile cluster;
    std::int64_t devices, seq, batch;
  };
  ClusterProfile small_a100 = dgx_a100();
  ClusterProfile three_levels = ascend_supernode();
  three_levels.levels[1].domain_devices = 16;  // supernodes of 16 so that 32 devices cross all three levels
  for (Case k : {Case{small_dense(), small_a100, 16, 2048, 32}, Case{small_moe(), three_levels, 32, 1024, 64},
                 Case{small_moe(), small_a100, 16, 4096, 16}}) {
    CAPTURE(k.model.name);
    CAPTURE(k.devices);
    // A memory limit that the unconstrained best configuration does not meet, so that memory matters.
    TrainingSetup s{.seq = k.seq, .global_batch = k.batch};
    PerformanceModel unconstrained(k.model, k.cluster, s, k.devices);
    const SearchResult free_best = search::search(unconstrained, {.space = space_7d(), .top_k = 1});
    REQUIRE(!free_best.top.empty());
    k.cluster.device.memory_bytes = k.cluster.device.reserved_bytes +
                                    std::int64_t(0.7 * free_best.top.front().estimate.memory.total());
    const PerformanceModel model(k.model, k.cluster, s, k.devices);
    for (const SearchSpace& space : {space_3d(), space_4d(), space_7d()}) {
      CAPTURE(space.name);
      const SearchResult pruned = search::search(model, {.space = space, .top_k = 5});
      const SearchResult brute = search::search(model, {.space = space, .top_k = 5, .prune = false});
      REQUIRE(!brute.top.empty());
      REQUIRE(pruned.top.size() == brute.top.size());
      for (std::size_t i = 0; i < brute.top.size(); ++i) {
        CHECK(pruned.top[i].config == brute.top[i].config);
        CHECK(pruned.top[i].estimate.step_s == brute.top[i].estimate.step_s);
      }
      CHECK(brute.top.front().config != free_best.top.front().config);
      CHECK(pruned.evaluated < brute.evaluated);
      // The brute force of the search itself against an independent enumeration: its best is the least step of
      // every fitting configuration; and no mesh's bound exceeds any configuration on it.
      double least = 1e300;
      std::int64_t count = 0;
      std::int64_t above = 0;
      for_each_configuration(model, space, [&](double bound, const Estimate& e) {
        ++count;
        if (bound > e.step_s) ++above;
        if (e.feasible) least = std::min(least, e.step_s);
      });
      CHECK(above == 0);
      CHECK(count > 100);
      CHECK(brute.top.front().estimate.step_s == least);
    }
  }
}

TEST_CASE("search: Mixtral 8x22B on 2,048 devices, the whole 7-D space, in under 10 s") {
  TrainingSetup s{.seq = 4096, .global_batch = 1024};
  const PerformanceModel model(mixtral_8x22b(), ascend_supernode(), s, 2048);
  const SearchResult r = search::search(model, {.space = space_7d(), .top_k = 5});
  REQUIRE(r.top.size() == 5);
  CHECK(r.seconds < 10);
  CHECK(r.meshes > 500);
  const SearchResult r3 = search::search(model, {.space = space_3d(), .top_k = 1});
  REQUIRE(!r3.top.empty());
  CHECK(r.top.front().estimate.step_s <= r3.top.front().estimate.step_s);  // the 3-D space is inside the 7-D one
  for (const Candidate& c : r.top) CHECK(c.estimate.memory.total() <= c.estimate.capacity_bytes);
}

TEST_CASE("search: Megatron-LM SC'21 Table 1 predicted within 15%") {
  for (const PublishedRun& run : megatron_sc21_runs()) {
    CAPTURE(run.name);
    const Prediction p = predict_published(run);
    CHECK(std::abs(p.error()) < 0.15);
    CHECK(p.config.tp() == run.tp);
    CHECK(p.config.pp == run.pp);
  }
}

TEST_CASE("search: bad input is refused naming the value") {
  auto message = [](auto&& f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  CHECK(message([] { model_preset("gpt-5"); }).find("unknown model \"gpt-5\"") != std::string::npos);
  CHECK(message([] { cluster_preset("tpu-v5"); }).find("unknown cluster \"tpu-v5\"") != std::string::npos);
  CHECK(message([] { space_by_name("9d"); }).find("\"9d\"") != std::string::npos);
  // 13 devices: no factorisation divides a batch of 1024 and 8 heads.
  const PerformanceModel prime(small_dense(), dgx_a100(), TrainingSetup{.seq = 2048, .global_batch = 1024}, 13);
  CHECK(message([&] { search::search(prime, {}); }).find("no factorisation of 13 devices") != std::string::npos);
  CHECK(message([] { PerformanceModel(small_dense(), dgx_a100(), TrainingSetup{.seq = 2048, .global_batch = 8}, 0); })
            .find("devices = 0") != std::string::npos);
  CHECK(message([] { model_from_json(json::parse(R"({"num_hidden_layers": 2})"), "x"); }).find("hidden_size") !=
        std::string::npos);
  CHECK(message([] { model_from_json(json::parse(R"({"num_hidden_layers": 2, "hidden_size": 64,
      "num_attention_heads": 6, "num_key_value_heads": 4, "intermediate_size": 128, "vocab_size": 10})"), "x"); })
            .find("heads = 6 must be a positive multiple of kv_heads = 4") != std::string::npos);
  const TrainingSetup s{.seq = 2048, .global_batch = 64};
  CHECK(structural_problem(small_dense(), s, {.dp = 1, .tp_y = 16}, 16).find("heads = 8 not divisible by tp_y = 16") !=
        std::string::npos);
  CHECK(structural_problem(small_moe(), s, {.dp = 2, .tp_y = 2, .ep = 4}, 4).find("ep = 4 does not divide") !=
        std::string::npos);
  CHECK(structural_problem(small_dense(), s, {.dp = 2}, 4).find("but the cluster has 4") != std::string::npos);
  // A model from config.json keys, as the checkpoints publish them.
  const TrainingModel mixtral = model_from_json(json::parse(R"({"num_hidden_layers": 56, "hidden_size": 6144,
      "num_attention_heads": 48, "num_key_value_heads": 8, "intermediate_size": 16384, "vocab_size": 32768,
      "hidden_act": "silu", "num_local_experts": 8, "num_experts_per_tok": 2})"), "mixtral");
  CHECK(mixtral.total_parameters() == mixtral_8x22b().total_parameters());
}

TEST_CASE("search: a cluster read from JSON equals the preset it was written from; bad levels are refused") {
  const ClusterProfile preset = ascend_supernode();
  auto to_json = [](const ClusterProfile& c) {
    json::Value v = {{"name", c.name}, {"peak_flops_per_s", c.peak_flops_per_s}, {"device", cost::to_json(c.device)}};
    json::Value levels = json::Value::array();
    for (const LinkLevel& l : c.levels)
      levels.push_back(
          {{"name", l.name}, {"domain_devices", l.domain_devices}, {"alpha_s", l.alpha_s}, {"bytes_per_s", l.bytes_per_s}});
    v["levels"] = std::move(levels);
    return v;
  };
  const ClusterProfile read = cluster_from_json(json::parse(json::dump(to_json(preset))));
  REQUIRE(read.levels.size() == 3);
  CHECK(read.device.gemm.flops_per_s == preset.device.gemm.flops_per_s);
  for (const GroupSpan g : {GroupSpan{8, 8}, GroupSpan{64, 512}, GroupSpan{256, 2048}})
    CHECK(read.collective_time(Collective::all_to_all, g, 1e8) == preset.collective_time(Collective::all_to_all, g, 1e8));
  ClusterProfile bad = preset;
  bad.levels[1].domain_devices = 12;  // not a multiple of the node's 8
  try {
    cluster_from_json(to_json(bad));
    FAIL("a supernode of 12 over nodes of 8 was accepted");
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find("level supernode-ub domain 12 must be a multiple of the level below (8)") !=
          std::string::npos);
  }
}

TEST_CASE("search: every group's size and span agree with the ranks DeviceMesh gives it") {
  // Each span is an aligned block holding the whole group; strided groups have equal gaps of span / size.
  auto check_group = [](const DeviceMesh& mesh, std::initializer_list<std::string_view> axes, const GroupSpan& g,
                        bool strided) {
    INFO(mesh.to_string());
    INFO(fmt::format("{}", fmt::join(axes, "x")));
    for (int rank = 0; rank < mesh.size(); ++rank) {
      const std::vector<int> ranks = mesh.group_ranks(rank, axes);
      REQUIRE(int(ranks.size()) == g.size);
      std::vector<int> sorted = ranks;
      std::sort(sorted.begin(), sorted.end());
      CHECK(sorted.front() / g.span == sorted.back() / g.span);
      if (strided)
        for (std::size_t i = 1; i < sorted.size(); ++i) CHECK(sorted[i] - sorted[i - 1] == g.span / g.size);
    }
  };
  const std::vector<ParallelConfig> configs{
      {.dp = 2, .pp = 2, .cp = 2, .tp_x = 2, .tp_y = 2, .ep = 2, .etp = 2},
      {.dp = 4, .pp = 1, .cp = 2, .tp_x = 1, .tp_y = 4, .ep = 8, .etp = 1},
      {.dp = 3, .pp = 2, .cp = 1, .tp_x = 2, .tp_y = 3, .ep = 3, .etp = 3},
      {.dp = 4, .pp = 3, .cp = 2, .tp_x = 1, .tp_y = 2, .ep = 2, .etp = 2},
      {.dp = 2, .pp = 1, .cp = 1, .tp_x = 3, .tp_y = 1, .ep = 1, .etp = 1}};
  for (const ParallelConfig& c : configs) {
    CAPTURE(to_string(c));
    const DeviceMesh a = attention_mesh(c), e = expert_mesh(c);
    REQUIRE(a.size() == c.devices());
    REQUIRE(e.size() == c.devices());
    const MeshGroups g = mesh_groups(c);
    check_group(a, {"tp_x"}, g.tp_x, true);
    check_group(a, {"tp_y"}, g.tp_y, true);
    check_group(a, {"cp"}, g.cp, true);
    check_group(a, {"dp", "cp"}, g.dp_cp, true);
    check_group(a, {"pp"}, g.pp, true);
    check_group(e, {"ep"}, g.ep, true);
    check_group(e, {"etp"}, g.etp, true);
    check_group(e, {"edp_outer", "edp_inner"}, g.edp, c.dp * c.cp == c.ep);
    // The fold: a rank's MoE coordinates name the same device as its attention coordinates (both row-major over
    // the same ranks), so ep x edp_outer covers exactly the dp x cp positions and etp x edp_inner the tp ones.
    for (int rank = 0; rank < a.size(); ++rank) {
      const MeshCoordinate ac = a.coordinate(rank), ec = e.coordinate(rank);
      CHECK(ac[1] * c.cp + ac[2] == ec[1] * c.ep + ec[2]);
      CHECK(ac[3] * c.tp_y + ac[4] == ec[3] * c.etp + ec[4]);
    }
  }
}
