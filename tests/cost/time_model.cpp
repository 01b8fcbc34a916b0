// Tests of paradyse/cost/time_model.hpp: properties of the time model, one schedule written out by hand, and a packed
// sample timed on its slowest rank.
// (The model is checked against measured times of the CPU strategies by bench/cost_validation.cpp.)
#include "paradyse/cost/builtin_profiles.hpp"
#include "paradyse/cost/time_model.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <string_view>
#include <vector>

using namespace paradyse;
using namespace paradyse::cost;

namespace {
ModelShape shape(std::int64_t s) { return ModelShape::mha(4096, 32, s, 2); }
int id(std::string_view name) { return default_catalog().index_of(name); }
}  // namespace

TEST_CASE("time_model: time grows with the sequence; attention grows faster than linearly") {
  const HardwareProfile hw = a100_sxm4_80gb_x8();
  for (int s : default_catalog().all()) {
    const double t1 = sublayer_time(s, Sublayer::attention, shape(16384), 8, hw).total_s();
    const double t2 = sublayer_time(s, Sublayer::attention, shape(32768), 8, hw).total_s();
    const double t4 = sublayer_time(s, Sublayer::attention, shape(65536), 8, hw).total_s();
    CHECK(t1 < t2);
    CHECK(t4 - t2 > 2 * (t2 - t1));  // the s^2 term shows
    const double m1 = sublayer_time(s, Sublayer::mlp, shape(16384), 8, hw).total_s();
    const double m2 = sublayer_time(s, Sublayer::mlp, shape(32768), 8, hw).total_s();
    CHECK(m1 < m2);
    CHECK(m2 < 2.2 * m1);  // linear in s, up to fixed weight traffic
  }
}

TEST_CASE("time_model: on one rank nothing is communicated") {
  const HardwareProfile hw = a100_sxm4_80gb_x8();
  for (int s : default_catalog().all())
    for (Sublayer part : kAllSublayers) CHECK(sublayer_time(s, part, shape(4096), 1, hw).exposed_comm_s == 0);
}

TEST_CASE("time_model: communication-parallelization cancellation on short sequences") {
  // ZeRO-3 strategies move 12 h^2 weights per layer whatever the length: on short sequences MegatronTS wins, on long
  // ones the weight traffic hides under compute and the ZeRO strategies catch up.
  const HardwareProfile hw = a100_sxm4_80gb_x8();
  const auto layer = [&](int s, std::int64_t len) {
    return sublayer_time(s, Sublayer::attention, shape(len), 8, hw).total_s() +
           sublayer_time(s, Sublayer::mlp, shape(len), 8, hw).total_s();
  };
  CHECK(layer(id("MegatronTS"), 2048) < 0.7 * layer(id("MegatronCZ"), 2048));
  CHECK(layer(id("MegatronCZ"), 131072) < 1.05 * layer(id("MegatronTS"), 131072));
}

TEST_CASE("time_model: MegatronTS MLP forward, written out") {
  HardwareProfile hw = a100_sxm4_80gb_x8();
  ModelShape m = shape(8192);
  m.dtype_bytes = 4;
  const int p = 4;
  const double e = m.dtype_bytes, n = double(m.seq) / p, N = double(m.seq), h = double(m.hidden);
  const double f = double(m.ffn) / p;
  const double expected = hw.elementwise_time(2 * n * h * e)                           // the layer's norm
                          + hw.elementwise_time(2 * n * h * e)                         // the strategy's copy of x
                          + hw.collective_time(Collective::all_gather, p, N * h * e)    // gather x
                          + hw.gemm.time(N, f, h, 4)                                   // x W_in
                          + hw.elementwise_time(2 * N * f * e)                         // GELU: read f, write f
                          + hw.gemm.time(N, h, f, 4)                                   // act W_out
                          + hw.collective_time(Collective::reduce_scatter, p, N * h * e)
                          + hw.elementwise_time(3 * n * h * e);                        // residual add
  CHECK(sublayer_time(id("MegatronTS"), Sublayer::mlp, m, p, hw).forward_s == doctest::Approx(expected).scale(0));
}

TEST_CASE("time_model: model_time sums the layers") {
  const HardwareProfile hw = h100_sxm_80gb_x8();
  const ModelShape m = shape(4096);
  const std::vector<LayerStrategies> layers{{id("METP"), id("MegatronTS")},
                                            {id("UlyssesZ"), id("MegatronCZ")}};
  CHECK(model_time(m, 8, layers, hw) ==
        doctest::Approx(sublayer_time(id("METP"), Sublayer::attention, m, 8, hw).total_s() +
                        sublayer_time(id("MegatronTS"), Sublayer::mlp, m, 8, hw).total_s() +
                        sublayer_time(id("UlyssesZ"), Sublayer::attention, m, 8, hw).total_s() +
                        sublayer_time(id("MegatronCZ"), Sublayer::mlp, m, 8, hw).total_s())
            .scale(0));
}

TEST_CASE("time_model: a packed sample is timed on its slowest rank (ring attention's work differs by rank)") {
  const HardwareProfile hw = a100_sxm4_80gb_x8();
  const StrategyCatalog& catalog = default_catalog();
  // 4,096 tokens as one long document then four short ones, on p = 4 contiguous chunks: rank 0's chunk lies in the
  // long document's causal start, rank 3's at its end, and the short documents' ranks skip most key blocks.
  ModelShape m = ModelShape::mha(256, 8, 4096, 1);
  m.causal = true;
  const int p = 4;
  for (const std::vector<std::int64_t>& docs : {std::vector<std::int64_t>{3072, 256, 256, 256, 256},
                                                std::vector<std::int64_t>{256, 256, 256, 256, 3072}})
    for (int s : catalog.all())
      for (Sublayer part : kAllSublayers) {
        m.packed_lengths = docs;
        CAPTURE(catalog.name(s));
        CAPTURE(docs.front());
        CAPTURE(int(part));
        if (!catalog.supports(s, m, p).ok()) continue;
        // Each rank's own cost, from its own trace.
        std::vector<SublayerCost> per_rank;
        for (int rank = 0; rank < p; ++rank)
          catalog.visit_trace(s, part, m, p, rank, [&](const SublayerTraceView& trace) {
            per_rank.push_back(cost_of(trace, &hw, m.dtype_bytes, false));
          });
        double slowest = 0;
        for (const SublayerCost& c : per_rank) slowest = std::max(slowest, c.time_s());
        const SublayerCost group = evaluate_sublayer(catalog, s, part, m, p, &hw);
        CHECK(group.time_s() == slowest);
        CHECK(group.saved_bytes == per_rank[0].saved_bytes);  // memory: rank 0, which holds the most tokens
        CHECK(group.transient_bytes() == per_rank[0].transient_bytes());
      }
  // The case that made this necessary: MegatronCZ's ring attention over a long sample whose long document comes
  // first. Rank 0's chunk is that document's causal start (a quarter of the pairs of the chunk after it); the
  // short documents' chunks skip most key blocks. On the A100 profile: 89, 173, 257 and 57 ms on ranks 0..3.
  ModelShape big = ModelShape::mha(4096, 32, 65536, 1);
  big.causal = true;
  big.packed_lengths = {49152, 4096, 4096, 4096, 4096};
  const int cz = id("MegatronCZ");
  std::vector<double> times;
  for (int rank = 0; rank < p; ++rank)
    catalog.visit_trace(cz, Sublayer::attention, big, p, rank, [&](const SublayerTraceView& trace) {
      times.push_back(cost_of(trace, &hw, big.dtype_bytes, false).time_s());
    });
  CHECK(evaluate_sublayer(catalog, cz, Sublayer::attention, big, p, &hw).time_s() > 2 * times[0]);
}
