// Tests of TrainingSetup::cp_gathers_weights (search/perf_model.hpp): tp inside cp as train_gpt's MegatronRing runs
// it, each sublayer's weights sharded over cp x tp and all-gathered over cp before use (forward, and again in
// backward, where the gradient is reduce-scattered back over cp). On an idealised cluster the exposed cp time grows by
// exactly those collectives (of P / tp parameters each: (cp - 1) / cp of them over the link, plus a latency per ring
// step), per layer and micro-batch; full recomputation gathers once more; nothing changes without tp or without cp.
#include "ideal_cluster.hpp"
#include "paradyse/search/search.hpp"

#include <doctest/doctest.h>

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
