// Tests of how search/perf_model.hpp prices expert tensor parallelism (etp, over tp) against hand-computed cases on
// the idealised cluster: each expert's GEMMs split over etp (etp times the tokens at 1 / etp of the width: the same
// compute), the dispatched tokens all-gathered and reduce-scattered over the etp group, forward and backward, and
// the experts' parameters split over ep x etp.
#include "paradyse/search/search.hpp"
#include "ideal_cluster.hpp"

#include <doctest/doctest.h>

using namespace paradyse;
using namespace paradyse::search;
using paradyse::search::testing::ideal_cluster;

namespace expert_tensor_test {

// 4 MoE layers of 4 experts (top-2, width 1024) over h = 512.
TrainingModel etp_moe_model() {
  return {.name = "etp-moe", .layers = 4, .hidden = 512, .heads = 8, .kv_heads = 8, .head_dim = 64, .ffn = 1024,
          .vocab = 1024, .swiglu = true, .experts = 4, .top_k = 2, .expert_ffn = 1024};
}

}  // namespace expert_tensor_test

TEST_CASE("search: etp is priced: the expert GEMMs split over etp (the same compute), the dispatched tokens "
          "all-gathered and reduce-scattered over the etp group, the experts' parameters split over ep x etp") {
  using namespace expert_tensor_test;
  const double bandwidth = 100e9;
  const ClusterProfile cluster = ideal_cluster(1e12, {{"node", 8, 0, bandwidth}, {"net", 0, 0, bandwidth}});
  const TrainingModel m = etp_moe_model();
  const TrainingSetup s{.seq = 1024, .global_batch = 4};
  for (const int tp : {2, 4}) {
    CAPTURE(tp);
    const PerformanceModel model(m, cluster, s, tp);
    const ParallelConfig whole{.tp_y = tp, .ep = 1, .etp = 1, .micro_batch = 4};
    const Estimate e1 = model.evaluate(whole);
    REQUIRE(e1.problem.empty());
    CHECK(e1.exposed(CommDim::ep) == 0);  // ep = etp = 1: nothing leaves the device in the expert path
    for (const int etp : {2, tp}) {
      CAPTURE(etp);
      ParallelConfig split = whole;
      split.etp = etp;
      const Estimate e = model.evaluate(split);
      REQUIRE(e.problem.empty());
      // etp x the tokens at 1 / etp of the width: the same FLOPs on the ideal device.
      CHECK(e.compute_s == doctest::Approx(e1.compute_s).epsilon(1e-12));
      // Per MoE layer and micro-batch (one here), forward and backward: an all-gather and a reduce-scatter over the
      // etp group of the etp ranks' dispatched tokens (k copies of the T / tp tokens of each, h wide), each
      // (etp - 1) / etp of those bytes over the link (the ring formula).
      const double tokens = 4.0 * 1024 / tp, bytes = tokens * 2 * 512 * s.activation_bytes * etp;
      const double collective = double(etp - 1) / etp * bytes / bandwidth;
      CHECK(e.exposed(CommDim::ep) == doctest::Approx(4 * 2 * 2 * collective).epsilon(1e-9));
      // The experts' parameters: 1 / etp of each on every device (the rest of the model the same).
      const double expert_weights = 4.0 * 4 * m.expert_parameters() * s.precision.parameter_bytes;
      CHECK(e1.memory.weights - e.memory.weights ==
            doctest::Approx(expert_weights * (1.0 - 1.0 / etp)).epsilon(1e-9));
    }
  }
}
