// Tests of TrainingSetup::cp_gathers_weights (search/perf_model.hpp): tp inside cp as train_gpt's MegatronRing runs
// it, each sublayer's weights sharded over cp x tp and all-gathered over cp before use (forward, and again in
// backward, where the gradient is reduce-scattered back over cp). On an idealised cluster the exposed cp time grows by
// exactly those collectives (of P / tp parameters each: (cp - 1) / cp of them over the link, plus a latency per ring
// step), per layer and micro-batch; full recomputation gathers once more; nothing changes without tp or without cp.
// Memory: those weights held 1 / cp (their ZeRO group dp alone), the running sublayer's gathered weights and
// gradient transient; the flag read from a configuration file and written back.
#include "ideal_cluster.hpp"
#include "paradyse/search/config_file.hpp"
#include "paradyse/search/search.hpp"
#include "paradyse/search/validation.hpp"

#include <doctest/doctest.h>

#include <algorithm>

using namespace paradyse;
using namespace paradyse::search;
using paradyse::search::testing::ideal_cluster;

namespace {

TrainingModel cp_weights_model() {
  return {.name = "small", .layers = 4, .hidden = 512, .heads = 8, .kv_heads = 8, .head_dim = 64, .ffn = 2048,
          .vocab = 1024, .tied_embeddings = true};
}

constexpr double kAlpha = 3e-6, kBandwidth = 5e9;

// One level, the whole cluster: a ring collective over g ranks of `bytes` takes alpha (g - 1) + (g - 1) / g bytes / B.
double ring(int g, double bytes) { return kAlpha * (g - 1) + double(g - 1) / g * bytes / kBandwidth; }

}  // namespace

TEST_CASE("tp inside cp (MegatronRing): each sublayer's weight all-gathers over cp and gradient reduce-scatter, exact") {
  const TrainingModel model = cp_weights_model();
  const ClusterProfile cluster = ideal_cluster(1e11, {{"node", 0, kAlpha, kBandwidth}}, 2e10);
  TrainingSetup megatron{.seq = 512, .global_batch = 8};
  TrainingSetup ring_setup = megatron;
  ring_setup.cp_gathers_weights = true;
  const PerformanceModel replicated(model, cluster, megatron, 8), gathered(model, cluster, ring_setup, 8);
  const double w = megatron.activation_bytes;
  struct Case {
    ParallelConfig config;
    double gathers;  // all-gathers of each sublayer's weights per micro-batch (each with one reduce-scatter)
  };
  for (const Case& test : {Case{{.dp = 2, .cp = 2, .tp_y = 2, .micro_batch = 2}, 2},
                           Case{{.dp = 1, .cp = 4, .tp_y = 2, .micro_batch = 4}, 2},
                           Case{{.dp = 1, .cp = 2, .tp_y = 4, .micro_batch = 1, .recompute = Recompute::full}, 3}}) {
    const ParallelConfig& c = test.config;
    CAPTURE(to_string(c));
    const Estimate off = replicated.evaluate(c), on = gathered.evaluate(c);
    REQUIRE(off.valid);
    REQUIRE(on.valid);
    const double batches = double(micro_batches(megatron, c)), t = c.tp();
    double per_layer = 0;
    for (double parameters : {model.attention_parameters(), model.dense_mlp_parameters()}) {
      const double bytes = parameters / t * w;
      per_layer += test.gathers * ring(c.cp, bytes) + ring(c.cp, bytes);
    }
    const double expected = batches * double(model.layers) * per_layer;
    CHECK(expected > 0);
    CHECK(on.exposed(CommDim::cp) - off.exposed(CommDim::cp) == doctest::Approx(expected).epsilon(1e-9));
    CHECK(on.exposed(CommDim::tp) == off.exposed(CommDim::tp));
    CHECK(on.compute_s == off.compute_s);
  }
  // Without tp, or without cp, there is nothing to gather.
  for (const ParallelConfig& c : {ParallelConfig{.dp = 4, .cp = 2, .micro_batch = 1},
                                  ParallelConfig{.dp = 4, .tp_y = 2, .micro_batch = 1}}) {
    CAPTURE(to_string(c));
    CHECK(gathered.evaluate(c).step_s == replicated.evaluate(c).step_s);
  }
}

TEST_CASE("tp inside cp (MegatronRing): memory and the dp reduction hold what the trainer holds, exact") {
  const TrainingModel model = cp_weights_model();
  const ClusterProfile cluster = ideal_cluster(1e11, {{"node", 0, kAlpha, kBandwidth}}, 2e10);
  TrainingSetup megatron{.seq = 512, .global_batch = 8};
  megatron.overlap_grad_reduce = false;  // the reduction exposed, to compare it whole
  TrainingSetup ring_setup = megatron;
  ring_setup.cp_gathers_weights = true;
  const PerformanceModel replicated(model, cluster, megatron, 8), gathered(model, cluster, ring_setup, 8);
  const cost::TrainingPrecision& b = megatron.precision;
  for (int zero : {0, 1, 2}) {
    const ParallelConfig c{.dp = 2, .cp = 2, .tp_y = 2, .zero = zero, .micro_batch = 2};
    CAPTURE(to_string(c));
    const Estimate off = replicated.evaluate(c), on = gathered.evaluate(c);
    REQUIRE(on.valid);
    const double t = c.tp(), L = double(model.layers);
    // The layers' attention and MLP weights: P / tp each replicated over cp (off), P / (cp tp) each (on).
    const double ring = L * (model.attention_parameters() + model.dense_mlp_parameters()) / t;
    const double held = ring * (1 - 1.0 / c.cp);  // what each device no longer holds
    CHECK(off.memory.weights - on.memory.weights == doctest::Approx(held * b.parameter_bytes).epsilon(1e-12));
    CHECK(off.memory.gradients - on.memory.gradients ==
          doctest::Approx(zero >= 2 ? 0.0 : held * b.gradient_bytes).epsilon(1e-9));
    CHECK(off.memory.optimizer - on.memory.optimizer ==
          doctest::Approx(zero >= 1 ? 0.0 : held * b.optimizer_bytes).epsilon(1e-9));
    // Transient: the largest sublayer's cp sub-group shards gathered, and their gradient before its reduce-scatter.
    const double sublayer = std::max(model.attention_parameters(), model.dense_mlp_parameters()) / t;
    CHECK(on.memory.transient - off.memory.transient ==
          doctest::Approx(sublayer * (b.parameter_bytes + b.gradient_bytes)).epsilon(1e-12));
    // dp: the rest of the stage over dp x cp, the ring's 1 / cp over dp alone, one collective per layer each.
    if (zero == 0) {
      const double dense = stage_parameters(model, c, 0, model.layers, true, true).dense - ring;
      const double g = megatron.gradient_reduce_bytes;
      auto all_reduce = [](int n, double bytes) { return kAlpha * 2 * (n - 1) + 2.0 * (n - 1) / n * bytes / kBandwidth; };
      CHECK(on.exposed(CommDim::dp) ==
            doctest::Approx(L * (all_reduce(4, dense * g / L) + all_reduce(2, ring / c.cp * g / L))).epsilon(1e-12));
    }
  }
}

TEST_CASE("cp_gathers_weights from a configuration file and --config's setup: the score moves by the gathers") {
  const TrainingModel model = cp_weights_model();
  const ClusterProfile cluster = ideal_cluster(1e11, {{"node", 0, kAlpha, kBandwidth}}, 2e10);
  const TrainingSetup base{.seq = 512, .global_batch = 8};
  json::Value file = {{"dp", 2}, {"cp", 2}, {"tp", 2}, {"micro_batch", 2}};
  const Scored off = score(config_file_from_json(file), model, cluster, base);
  file["cp_gathers_weights"] = true;
  const ConfigFile on_file = config_file_from_json(file);
  const Scored on = score(on_file, model, cluster, base);
  CHECK(on.setup.cp_gathers_weights);
  CHECK_FALSE(off.setup.cp_gathers_weights);
  // Written back by --emit.
  CHECK(config_file_to_json(on.config, model, "", cluster, "", on.setup)["cp_gathers_weights"] == true);
  const double batches = double(micro_batches(base, on.config)), w = base.activation_bytes;
  double per_layer = 0;
  for (double parameters : {model.attention_parameters(), model.dense_mlp_parameters()})
    per_layer += 3 * ring(2, parameters / 2 * w);  // forward gather; backward gather and reduce-scatter
  CHECK(on.estimate.exposed(CommDim::cp) - off.estimate.exposed(CommDim::cp) ==
        doctest::Approx(batches * double(model.layers) * per_layer).epsilon(1e-9));
  file["cp_gathers_weights"] = "yes";
  CHECK_THROWS_WITH_AS(config_file_from_json(file), doctest::Contains("cp_gathers_weights"), Error);
  file["cp_gathers_weights"] = false;
  file["trainer"] = "deepspeed";
  CHECK_THROWS_WITH_AS(config_file_from_json(file), doctest::Contains("trainer = \"deepspeed\"; expected megatron or train_gpt"), Error);
}
