// Tests of the performance model's closeness to what trainers do (issue 26): the FLOP convention of MFU, uneven
// pipeline stages, tensor parallelism without sequence parallelism, ZeRO-3's gathers overlapped only as far as the
// schedule allows, and context parallelism as a ring or as Llama 3's all-gather; each against a hand-computed case.
#include "paradyse/search/mesh_groups.hpp"
#include "paradyse/search/search.hpp"
#include "ideal_cluster.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

using namespace paradyse;
using namespace paradyse::search;
using paradyse::search::testing::ideal_cluster;

namespace model_fidelity_test {

// 8 layers, h 512, 8 heads of 64, GELU MLP of 2048, vocabulary 1024 tied.
TrainingModel eight_layers() {
  return {.name = "eight", .layers = 8, .hidden = 512, .heads = 8, .kv_heads = 8, .head_dim = 64, .ffn = 2048,
          .vocab = 1024, .tied_embeddings = true};
}

}  // namespace model_fidelity_test

using namespace model_fidelity_test;

TEST_CASE("model: MFU counts causal attention as the half square by default, the full square on request") {
  const TrainingModel m = llama3_405b();
  TrainingSetup s{.seq = 131072, .global_batch = 128};
  const PerformanceModel causal(m, dgx_h100(), s, 16384);
  s.flops = FlopConvention::full;
  const PerformanceModel full(m, dgx_h100(), s, 16384);
  const double tokens = 131072.0 * 128;
  CHECK(causal.model_flops_per_step() == doctest::Approx(3 * m.forward_flops_per_token(65536) * tokens));
  CHECK(full.model_flops_per_step() == doctest::Approx(3 * m.forward_flops_per_token(131072) * tokens));
  // At 131K tokens the convention alone moves Llama 3 405B's FLOPs by about 1.4x.
  CHECK(full.model_flops_per_step() / causal.model_flops_per_step() == doctest::Approx(1.4).epsilon(0.05).scale(0));
  const ParallelConfig c{.dp = 8, .pp = 16, .cp = 16, .tp_y = 8, .zero = 1};
  const Estimate a = causal.evaluate(c), b = full.evaluate(c);
  REQUIRE(a.valid);
  CHECK(a.step_s == b.step_s);  // the time is the kernels'; only the count differs
  CHECK(b.mfu / a.mfu == doctest::Approx(full.model_flops_per_step() / causal.model_flops_per_step()));
  // A model that is not causal counts the full square under either convention.
  TrainingSetup bidirectional{.seq = 4096, .global_batch = 8};
  bidirectional.causal = false;
  CHECK(bidirectional.flop_context() == 4096);
}

TEST_CASE("model: uneven pipeline stages, the first and last one layer fewer; only what cannot be cut is refused") {
  const StageLayout llama = stage_layout(126, 16);
  CHECK(llama.layers_of(0) == 7);
  CHECK(llama.layers_of(15) == 7);
  std::int64_t total = 0;
  for (int s = 0; s < 16; ++s) {
    if (s > 0 && s < 15) CHECK(llama.layers_of(s) == 8);
    CHECK(llama.first_of(s) == total);
    total += llama.layers_of(s);
  }
  CHECK(total == 126);
  const StageLayout odd = stage_layout(10, 4);  // 3 x 4 - 10 = 2 short: 2, 3, 3, 2
  CHECK(std::vector<std::int64_t>{odd.layers_of(0), odd.layers_of(1), odd.layers_of(2), odd.layers_of(3)} ==
        std::vector<std::int64_t>{2, 3, 3, 2});
  const StageLayout three = stage_layout(10, 3);  // 4 x 3 - 10 = 2 short: 3, 4, 3
  CHECK(std::vector<std::int64_t>{three.layers_of(0), three.layers_of(1), three.layers_of(2)} ==
        std::vector<std::int64_t>{3, 4, 3});

  const TrainingSetup s{.seq = 8192, .global_batch = 2048};
  CHECK(structural_problem(llama3_405b(), s, {.dp = 64, .pp = 16, .tp_y = 8}, 8192).empty());
  CHECK(structural_problem(llama3_405b(), s, {.dp = 64, .pp = 16, .tp_y = 8, .virtual_stages = 7}, 8192).empty());
  CHECK(structural_problem(llama3_405b(), s, {.dp = 64, .pp = 16, .tp_y = 8, .virtual_stages = 8}, 8192)
            .find("layers = 126 cannot be cut into pp = 16 stages of v = 8 chunks") != std::string::npos);
  TrainingModel shallow = eight_layers();
  CHECK(structural_problem(shallow, TrainingSetup{.seq = 2048, .global_batch = 16}, {.pp = 16}, 16)
            .find("the shortest stage would hold 0") != std::string::npos);

  // Hand-computed: 8 layers on 3 stages hold 2, 3, 3; the last (3 layers and the logits) is the slowest. On a device
  // of one rate, the compute is m x 3 x (3 layers' forward + the logits' forward) FLOPs.
  const double rate = 1e12;
  const ClusterProfile cluster = ideal_cluster(rate, {{"node", 8, 0, 1e30}, {"net", 0, 0, 1e30}});
  const TrainingSetup small{.seq = 1024, .global_batch = 6};
  const PerformanceModel model(shallow, cluster, small, 3);
  const Estimate e = model.evaluate({.pp = 3, .micro_batch = 1});
  REQUIRE(e.valid);
  const double tokens = 1024;
  const double logits = 2.0 * shallow.embedding_parameters() * tokens;
  const double layer = (shallow.forward_flops_per_token(512) * tokens - logits) / 8;
  CHECK(e.compute_s == doctest::Approx(6 * 3 * (3 * layer + logits) / rate).epsilon(1e-9));
  CHECK(e.bubble_s == doctest::Approx(2 * 3 * (3 * layer + logits) / rate).epsilon(1e-9));
  // Memory: stage 1 holds 3 layers' weights (no embedding); stage 0 holds 2 and the embedding.
  const MemoryEstimate memory = estimate_memory(shallow, small, {.pp = 3});
  CHECK(memory.total() > 0);
}

TEST_CASE("model: tensor parallelism without sequence parallelism all-reduces and keeps norms whole on every rank") {
  const TrainingModel m = eight_layers();
  const TrainingSetup s{.seq = 2048, .global_batch = 8};
  const ClusterProfile cluster = ideal_cluster(1e12, {{"node", 8, 1e-6, 100e9}, {"net", 0, 5e-6, 10e9}}, 1e12);
  const PerformanceModel model(m, cluster, s, 4);
  const ParallelConfig sp{.tp_y = 4, .micro_batch = 1, .recompute = Recompute::full};
  ParallelConfig no_sp = sp;
  no_sp.sequence_parallel = false;
  const Estimate a = model.evaluate(sp), b = model.evaluate(no_sp);
  REQUIRE(a.valid);
  REQUIRE(b.valid);
  // An all-reduce moves what an all-gather and a reduce-scatter move (ring: 2 (n - 1) steps, 2 (n - 1) / n bytes).
  CHECK(b.exposed(CommDim::tp) == doctest::Approx(a.exposed(CommDim::tp)));
  // Norms, residuals and dropout over all T tokens instead of T / 4: 26 h bytes a token, 3 passes (forward,
  // backward twice) and the recomputed forward, per layer.
  const double tokens = 2048;
  const double extra = 8 * (1 + 2 + 1) * 26.0 * 512 * (tokens - tokens / 4) / 1e12;
  CHECK(b.compute_s - a.compute_s == doctest::Approx(8 * extra).epsilon(1e-6));
  // With full recomputation only each layer's input is stored: whole on every rank without sequence parallelism.
  CHECK(b.memory.activations == doctest::Approx(4 * a.memory.activations));
  CHECK(to_string(no_sp).find("sp=off") != std::string::npos);
  CHECK(structural_problem(m, s, {.tp_x = 2, .tp_y = 2, .sequence_parallel = false}, 4).find("tp_x = 1") !=
        std::string::npos);
}

TEST_CASE("model: ZeRO-3 gathers hide under one layer's compute at most; the first gather and last scatter show") {
  const TrainingModel m = eight_layers();
  const TrainingSetup s{.seq = 2048, .global_batch = 8};
  // Slow compute: every gather is shorter than a layer, so only the first gather of each pass and the last
  // reduce-scatter are exposed (the old model hid them all).
  const ClusterProfile cluster = ideal_cluster(1e9, {{"node", 8, 1e-6, 100e9}, {"net", 0, 5e-6, 10e9}});
  const PerformanceModel model(m, cluster, s, 2);
  const ParallelConfig c{.dp = 2, .zero = 3, .micro_batch = 1};
  const Estimate e = model.evaluate(c);
  REQUIRE(e.valid);
  const StageParameters p = stage_parameters(m, c, 0, 8, true, true);
  const GroupSpan dp = mesh_groups(c).dp_cp;
  const double gather = cluster.collective_time(Collective::all_gather, dp, p.dense * 2 / 8);
  const double scatter = cluster.collective_time(Collective::reduce_scatter, dp, p.dense * 4 / 8);
  const double micro_batches = 4;
  CHECK(e.exposed(CommDim::dp) == doctest::Approx(micro_batches * (2 * gather + scatter)).scale(0));
  // Without overlap, everything: per layer two gathers and a reduce-scatter.
  TrainingSetup serial = s;
  serial.overlap_grad_reduce = false;
  const Estimate f = PerformanceModel(m, cluster, serial, 2).evaluate(c);
  CHECK(f.exposed(CommDim::dp) == doctest::Approx(micro_batches * 8 * (2 * gather + scatter)).scale(0));
}

TEST_CASE("model: context parallelism as a ring over nodes is priced on the network; as an all-gather, exposed") {
  const TrainingModel m = eight_layers();
  const TrainingSetup s{.seq = 16384, .global_batch = 4};
  const ClusterProfile cluster = ideal_cluster(1e15, {{"node", 8, 1e-6, 100e9}, {"net", 0, 5e-6, 10e9}});
  const PerformanceModel model(m, cluster, s, 16);
  // cp = 16 over two nodes: every ring step lasts as long as its hop across the network.
  const ParallelConfig ring{.cp = 16, .micro_batch = 1};
  const double T = 16384.0 / 16, kv = 2.0 * 8 * 64;
  const double step = 5e-6 + T * kv * 2 / 10e9;
  CHECK(cluster.collective_time(Collective::send_recv, mesh_groups(ring).cp, T * kv * 2) ==
        doctest::Approx(step).scale(0));
  const Estimate e = model.evaluate(ring);
  REQUIRE(e.valid);
  // Compute is tiny at 1e15 FLOP/s, so the ring is exposed: 15 steps forward, 30 backward, 8 layers, 4 micro-batches.
  CHECK(e.exposed(CommDim::cp) <= 4 * 8 * 45 * step);
  CHECK(e.exposed(CommDim::cp) > 0.9 * 4 * 8 * 45 * step);
  // Llama 3's scheme: all-gather K and V [16 T, kv] forward, again in backward with a reduce-scatter of the grads.
  ParallelConfig gathered = ring;
  gathered.cp_scheme = CpScheme::all_gather;
  const GroupSpan cp = mesh_groups(gathered).cp;
  const double ag = cluster.collective_time(Collective::all_gather, cp, 16 * T * kv * 2);
  const double rs = cluster.collective_time(Collective::reduce_scatter, cp, 16 * T * kv * 2);
  CHECK(model.evaluate(gathered).exposed(CommDim::cp) == doctest::Approx(4 * 8 * (2 * ag + rs)));
  // The search tries the all-gather scheme when the space asks for it.
  SearchSpace both = space_7d();
  both.cp_schemes = {CpScheme::ring, CpScheme::all_gather};
  const SearchResult r = search::search(model, {.space = both, .top_k = 3});
  CHECK(!r.top.empty());
}
