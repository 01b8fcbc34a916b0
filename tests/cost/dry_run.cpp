// The dry run (cost/dry_run.hpp): a strategy's real code on meta tensors, a counting backend and a symbolic
// communicator. At the paper's scale it allocates no activation memory; its trace is exactly what a real run does.
#include "paradyse/comm/symbolic.hpp"
#include "paradyse/cost/dry_run.hpp"
#include "paradyse/cost/trace_cost.hpp"
#include "paradyse/ops/counting.hpp"

#include <doctest/doctest.h>

#include <sys/resource.h>

#include <algorithm>

using namespace paradyse;
using namespace paradyse::cost;

namespace {
std::int64_t resident_peak_bytes() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return std::int64_t(usage.ru_maxrss) * 1024;
}
}  // namespace

TEST_CASE("dry run: the paper's scale (h = 12288, 96 heads, s = 624K, p = 8) on shapes alone") {
  ModelShape m = ModelShape::mha(12288, 96, 624 * 1024);
  m.causal = true;
  m.zigzag = true;
  m.dtype_bytes = 2;
  const int p = 8;
  const StrategyCatalog& catalog = default_catalog();
  const std::int64_t resident_before = resident_peak_bytes();
  for (int s : catalog.all()) {
    CAPTURE(catalog.name(s));
    for (Sublayer part : kAllSublayers) {
      CAPTURE(name_of(part));
      const SublayerTrace trace = catalog.trace(s, part, m, p);
      CHECK(!trace.forward.empty());
      CHECK(!trace.backward.empty());
      const SublayerCost c = cost_of(trace, nullptr, m.dtype_bytes);
      // Attention keeps the layer's input and residual and the strategy's copy of its input: 3 x [s/p, h] in bf16;
      // the MLP at least the strategy's copy of its input.
      CHECK(c.saved_bytes >= (part == Sublayer::attention ? 3 : 1) * (m.seq / p) * m.hidden * 2);
    }
  }
  // Terabytes were "allocated" on the meta tracker; the process grew by far less than one activation (1.9 GB).
  CHECK(resident_peak_bytes() - resident_before < (std::int64_t(1) << 30));
}

TEST_CASE("dry run: the symbolic communicator records posts and waits; the counting backend counts pairs") {
  Trace trace;
  SymbolicCommunicator comm(1, 4, trace);
  std::vector<float> in(8), out(32);
  Request r = comm.all_gather_async(std::span<const float>(in), std::span<float>(out));
  REQUIRE(trace.size() == 1);
  CHECK(trace.events()[0].kind == TraceKind::post);
  CHECK(trace.events()[0].bytes == 32 * 4);
  r.wait();
  CHECK(trace.events()[1].kind == TraceKind::wait);
  CHECK(trace.events()[1].request == trace.events()[0].request);
  CHECK_THROWS_AS(comm.all_gather(std::span<const float>(in), std::span<float>(in)), Error);
  // Visible pairs: brute force over offsets, causal and not.
  for (bool causal : {false, true})
    for (std::int64_t q_offset : {0, 3, 10})
      for (std::int64_t kv_offset : {0, 5, 12}) {
        const ops::AttentionMask mask{causal, q_offset, kv_offset};
        double brute = 0;
        for (std::int64_t i = 0; i < 7; ++i)
          for (std::int64_t j = 0; j < 9; ++j) brute += ops::key_visible(mask, i, j) ? 1 : 0;
        CHECK(ops::visible_pairs(mask, 7, 9) == brute);
      }
}

TEST_CASE("meta tensors: shapes and bytes, no storage behind the bytes") {
  MemoryTracker meta(MemorySpace::meta);
  const ScopedTracker scoped(meta);
  Tensor<float> big(Shape{1 << 20, 1 << 12});  // 16 GiB, none of it real
  CHECK(big.space() == MemorySpace::meta);
  CHECK(meta.in_use() == std::size_t(1) << 34);
  big.fill(1.0f);  // a no-op on meta
}
