// Tests of the time model's terms for a CPU rank's own work beyond its kernels' streams (cost/profile.hpp's
// FreshMemoryModel and ScalarMathModel): the trace clock prices a fresh allocation and scalar math-library calls at
// the profile's rates (cost/trace_cost.hpp), the dry run records RoPE's and the materialised softmax's calls
// (ops/counting.hpp: the softmax's exp per visible score), the calibration's fits recover known rates from synthetic
// measurements (cost/calibrate.hpp), and profiles written before these terms existed still load, with the terms
// unpriced (cost/profile_json.hpp).
#include "paradyse/cost/builtin_profiles.hpp"
#include "paradyse/cost/calibrate.hpp"
#include "paradyse/cost/profile_json.hpp"
#include "paradyse/cost/trace_cost.hpp"

#include "support/fresh_seed.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <utility>
#include <vector>

using namespace paradyse;
using namespace paradyse::cost;

namespace {

// A profile that prices nothing but the terms under test: every other rate is as fast as a profile allows.
HardwareProfile terms_only() {
  HardwareProfile hw = a100_sxm4_80gb_x8();
  hw.elementwise_bytes_per_s = 1e30;
  hw.activation_elements_per_s = 1e30;
  return hw;
}

double forward_seconds(std::vector<TraceEvent> forward, const HardwareProfile& hw, int dtype_bytes = 4) {
  SublayerTrace trace;
  trace.forward = std::move(forward);
  return cost_of(trace, &hw, dtype_bytes).forward_s;
}

}  // namespace

TEST_CASE("step terms: a fresh allocation costs its bytes at the zeroing or the first-touch rate, by its size") {
  PARADYSE_FRESH_RNG(rng);
  std::uniform_real_distribution<double> rate(5e8, 5e10);
  HardwareProfile hw = terms_only();
  hw.fresh_memory = {rate(rng), rate(rng), std::int64_t(1) << 25};
  const double small = 3 * 1048576.0, large = 48 * 1048576.0;  // multiples of 64: no rounding
  CHECK(forward_seconds({{.kind = TraceKind::allocate, .bytes = small}}, hw) ==
        doctest::Approx(small / hw.fresh_memory.zero_bytes_per_s).epsilon(1e-12));
  CHECK(forward_seconds({{.kind = TraceKind::allocate, .bytes = large}}, hw) ==
        doctest::Approx(large / hw.fresh_memory.fresh_bytes_per_s).epsilon(1e-12));
  // At the threshold: new pages; bf16 halves the recorded float32 bytes (below the threshold again).
  const double at = double(hw.fresh_memory.fresh_min_bytes);
  CHECK(forward_seconds({{.kind = TraceKind::allocate, .bytes = at}}, hw) ==
        doctest::Approx(at / hw.fresh_memory.fresh_bytes_per_s).epsilon(1e-12));
  CHECK(forward_seconds({{.kind = TraceKind::allocate, .bytes = at}}, hw, 2) ==
        doctest::Approx(at / 2 / hw.fresh_memory.zero_bytes_per_s).epsilon(1e-12));
  // A kernel's workspace is allocated too; freeing and the pool's loans cost nothing here (the pool's growth is
  // the planner's, once per step).
  CHECK(forward_seconds({{.kind = TraceKind::scratch, .bytes = small}}, hw) ==
        doctest::Approx(small / hw.fresh_memory.zero_bytes_per_s).epsilon(1e-12));
  // A batched kernel makes its items' workspaces one after another: count times.
  CHECK(forward_seconds({{.kind = TraceKind::scratch, .count = 3, .bytes = small}}, hw) ==
        doctest::Approx(3 * small / hw.fresh_memory.zero_bytes_per_s).epsilon(1e-12));
  CHECK(forward_seconds({{.kind = TraceKind::deallocate, .bytes = large},
                         {.kind = TraceKind::pool_acquire, .bytes = large},
                         {.kind = TraceKind::pool_give_back, .bytes = large}},
                        hw) == 0);
  // Without the rates (a profile of before, a device): unpriced.
  hw.fresh_memory = {};
  CHECK(forward_seconds({{.kind = TraceKind::allocate, .bytes = large}}, hw) == 0);
}

TEST_CASE("step terms: an unzeroed allocation costs only its new pages' faults: nothing below the fresh size") {
  PARADYSE_FRESH_RNG(rng);
  std::uniform_real_distribution<double> rate(5e9, 5e10), slower(2, 30);
  HardwareProfile hw = terms_only();
  const double zero = rate(rng);
  hw.fresh_memory = {zero, zero / slower(rng), std::int64_t(1) << 25};
  const double small = 3 * 1048576.0, large = 48 * 1048576.0;
  CHECK(forward_seconds({{.kind = TraceKind::allocate, .unzeroed = true, .bytes = small}}, hw) == 0);
  const double faults = large / hw.fresh_memory.fresh_bytes_per_s - large / zero;
  CHECK(faults > 0);
  CHECK(forward_seconds({{.kind = TraceKind::allocate, .unzeroed = true, .bytes = large}}, hw) ==
        doctest::Approx(faults).epsilon(1e-12));
  // Beside a zeroed one of the same size: the memset is the difference.
  CHECK(forward_seconds({{.kind = TraceKind::allocate, .bytes = large}}, hw) -
            forward_seconds({{.kind = TraceKind::allocate, .unzeroed = true, .bytes = large}}, hw) ==
        doctest::Approx(large / zero).epsilon(1e-9));
  // A page-fault rate above the memset's (no sense, but a profile may hold it) prices nothing, never less.
  hw.fresh_memory.fresh_bytes_per_s = 2 * zero;
  CHECK(forward_seconds({{.kind = TraceKind::allocate, .unzeroed = true, .bytes = large}}, hw) == 0);
}

TEST_CASE("step terms: scalar math calls cost their count at their function's rate, beside the kernel") {
  HardwareProfile hw = terms_only();
  hw.scalar_math = {3.1e8, 4.7e7};
  const double calls = 123456;
  CHECK(forward_seconds({{.kind = TraceKind::transcendental, .m = calls, .n = 0}}, hw) ==
        doctest::Approx(calls / 3.1e8).epsilon(1e-12));
  CHECK(forward_seconds({{.kind = TraceKind::transcendental, .m = calls, .n = 1}}, hw) ==
        doctest::Approx(calls / 4.7e7).epsilon(1e-12));
  // Repeated calls in a row merge into one event of count 2: twice the time.
  CHECK(forward_seconds({{.kind = TraceKind::transcendental, .count = 2, .m = calls, .n = 1}}, hw) ==
        doctest::Approx(2 * calls / 4.7e7).epsilon(1e-12));
  hw.scalar_math = {};
  CHECK(forward_seconds({{.kind = TraceKind::transcendental, .m = calls, .n = 0}}, hw) == 0);
}

TEST_CASE("step terms: the dry run records RoPE's cos and sin per (token, frequency) of each call") {
  // MegatronTS rotates the q and k of all s tokens (its local heads) once each in forward and again in backward:
  // 4 calls of s x head_dim cos-or-sin each. Without RoPE: none.
  for (const std::int64_t s : {256, 1000}) {
    ModelShape m = ModelShape::mha(256, 8, s);
    m.dtype_bytes = 4;
    m.rope = true;
    for (const bool rope : {true, false}) {
      m.rope = rope;
      double calls = 0;
      default_catalog().visit_trace(default_catalog().index_of("MegatronTS"), Sublayer::attention, m, 2, 0,
                                    [&](const SublayerTraceView& trace) {
                                      for (const auto phase : {trace.forward, trace.backward})
                                        for (const TraceEvent& e : phase)
                                          if (e.kind == TraceKind::transcendental) {
                                            CHECK(e.n == 1);
                                            calls += e.m * e.count;
                                          }
                                    });
      CHECK(calls == (rope ? 4.0 * double(s) * double(m.head_dim) : 0.0));
    }
  }
}

TEST_CASE("step terms: the masked softmax records an exp per visible score, as its kernel calls them") {
  // Against the kernel's own rule, pair by pair, on random runs of positions (a rank's chunks, in any order).
  PARADYSE_FRESH_RNG(rng);
  for (int trial = 0; trial < 40; ++trial) {
    const auto runs = [&rng](std::int64_t total) {  // `total` positions in shuffled runs of 1..total/3 + 1
      std::vector<ops::PositionRun> out;
      std::vector<std::int64_t> order;
      for (std::int64_t at = 0; at < total;) {
        const auto longest = std::uint64_t(total / 3 + 1);
        const std::int64_t length = std::min<std::int64_t>(total - at, 1 + std::int64_t(rng() % longest));
        out.push_back({0, at, length});
        at += length;
      }
      std::shuffle(out.begin(), out.end(), rng);
      std::int64_t index = 0;
      for (ops::PositionRun& r : out) r.index = std::exchange(index, index + r.length);
      return out;
    };
    const std::int64_t n = 1 + std::int64_t(rng() % 70), c = n + std::int64_t(rng() % 90), heads = 1 + trial % 3;
    std::vector<ops::PositionRun> queries = runs(n);
    for (ops::PositionRun& q : queries) q.position += c - n;  // the rows: the last n of the c positions
    const std::vector<ops::PositionRun> keys = runs(c);
    for (const bool causal : {false, true}) {
      double expected = 0;
      for (const ops::PositionRun& q : queries)
        for (std::int64_t i = 0; i < q.length; ++i)
          for (const ops::PositionRun& k : keys)
            for (std::int64_t j = 0; j < k.length; ++j) expected += !causal || k.position + j <= q.position + i;
      Trace trace;
      {
        const ScopedTrace recording(trace);
        Tensor<float> scores(Shape{2, heads, n, c});
        ops::Counting::masked_softmax_forward(scores.view(), queries, keys, causal);
      }
      double exps = 0;
      for (const TraceEvent& e : trace.events())
        if (e.kind == TraceKind::transcendental && e.n == 0) exps += e.m * e.count;
      CHECK(exps == 2 * double(heads) * expected);
    }
  }
}

TEST_CASE("step terms: ColossalZ's materialised softmax records an exp per causally visible score") {
  // Over every rank, each causal pair of the sequence is one rank's score: s (s + 1) / 2 per head and sample.
  for (const int p : {1, 2, 3, 4}) {
    ModelShape m = ModelShape::mha(384, 12, 504);
    m.dtype_bytes = 4;
    m.causal = true;
    double exps = 0, activations = 0;
    for (int rank = 0; rank < p; ++rank)
      default_catalog().visit_trace(default_catalog().index_of("ColossalZ"), Sublayer::attention, m, p, rank,
                                    [&](const SublayerTraceView& trace) {
                                      for (const TraceEvent& e : trace.forward) {
                                        if (e.kind == TraceKind::transcendental && e.n == 0) exps += e.m * e.count;
                                        if (e.kind == TraceKind::activation) activations += e.m * e.count;
                                      }
                                    });
    CHECK(exps == 12.0 * 504 * 505 / 2);
    CHECK(activations == 12.0 * 504 * 504);  // the softmax's other work: every score of the rows
  }
}

TEST_CASE("step terms: the fresh-memory fit recovers known rates and the first-touch size") {
  PARADYSE_FRESH_RNG(rng);
  std::uniform_real_distribution<double> zero_rate(1e10, 4e10), fresh_rate(1e9, 2e9);
  for (int trial = 0; trial < 20; ++trial) {
    const double zero = zero_rate(rng), fresh = fresh_rate(rng);
    const int first_fresh = 2 + trial % 4;  // index of the first size served from new pages
    std::vector<AllocationSample> samples;
    for (int i = 0; i < 7; ++i) {
      const double bytes = std::ldexp(1.0, 18 + 2 * i);  // 256 KiB .. 1 GiB
      samples.push_back({bytes, bytes / (i >= first_fresh ? fresh : zero)});
    }
    const FreshMemoryModel f = fit_fresh_memory(samples);
    CHECK(f.zero_bytes_per_s == doctest::Approx(zero).epsilon(1e-9));
    CHECK(f.fresh_bytes_per_s == doctest::Approx(fresh).epsilon(1e-9));
    CHECK(double(f.fresh_min_bytes) == samples[std::size_t(first_fresh)].bytes);
  }
  // Every size warm: one rate, nothing fresh within the sizes measured.
  const std::vector<AllocationSample> warm{{1e6, 1e6 / 2e10}, {4e6, 4e6 / 2e10}};
  const FreshMemoryModel f = fit_fresh_memory(warm);
  CHECK(f.zero_bytes_per_s == doctest::Approx(2e10));
  CHECK(f.fresh_bytes_per_s == doctest::Approx(2e10));
  CHECK(f.fresh_min_bytes == 4000001);
  const std::vector<AllocationSample> unordered{{4e6, 1e-4}, {1e6, 1e-4}};
  CHECK_THROWS_WITH(fit_fresh_memory(unordered), doctest::Contains("ascending"));
}

TEST_CASE("step terms: the fresh-memory fit takes a known new-page size, however fast that size's first touch ran") {
  PARADYSE_FRESH_RNG(rng);
  std::uniform_real_distribution<double> zero_rate(1e10, 4e10), slower(1.2, 12.0), jitter(0.9, 1.1);
  for (int trial = 0; trial < 50; ++trial) {
    const double zero = zero_rate(rng);
    const std::size_t first_fresh = 1 + std::size_t(trial % 5);  // index of the first size from new pages
    std::vector<AllocationSample> samples;
    std::vector<double> zero_rates;  // the reused samples' rates, whose median is the zero rate
    double fresh_bytes = 0, fresh_seconds = 0;
    for (std::size_t i = 0; i < 7; ++i) {
      const double bytes = std::ldexp(1.0, 16 + 2 * int(i));  // 64 KiB .. 256 MiB
      // Fresh samples from 1.2x to 12x the memset's time per byte: some under the factor rule's 3x.
      const double seconds = bytes / zero * (i >= first_fresh ? slower(rng) : jitter(rng));
      samples.push_back({bytes, seconds});
      if (i >= first_fresh)
        fresh_bytes += bytes, fresh_seconds += seconds;
      else
        zero_rates.push_back(bytes / seconds);
    }
    const double zero_fit = median(zero_rates);
    // The known size sits anywhere from just above the last reused sample to the first fresh one.
    const double low = samples[first_fresh - 1].bytes, high = samples[first_fresh].bytes;
    const auto known = std::int64_t(std::uniform_real_distribution<double>(low + 1, high)(rng));
    const FreshMemoryModel f = fit_fresh_memory(samples, known);
    CHECK(f.fresh_min_bytes == known);
    CHECK(f.zero_bytes_per_s == doctest::Approx(zero_fit).epsilon(1e-12));
    CHECK(f.fresh_bytes_per_s == doctest::Approx(fresh_bytes / fresh_seconds).epsilon(1e-12));
    CHECK(f.time(double(known) - 1) == doctest::Approx((double(known) - 1) / zero_fit).epsilon(1e-12));
    CHECK(f.time(double(known)) == doctest::Approx(double(known) * fresh_seconds / fresh_bytes).epsilon(1e-12));
    // A known size that leaves no sample on one side is not used: the rates alone decide, as without it.
    for (const std::int64_t outside : {std::int64_t(1), std::int64_t(samples.back().bytes) + 1}) {
      const FreshMemoryModel alone = fit_fresh_memory(samples), with = fit_fresh_memory(samples, outside);
      CHECK(with == alone);
    }
  }
}

TEST_CASE("step terms: the zero rate is the reused sizes' typical rate, however slow the largest of them ran") {
  // One calibration here timed its 16 MiB sample, four fifths of the reused bytes, at half the smaller sizes' rate;
  // their bytes over their seconds took that one sample's rate for every size.
  PARADYSE_FRESH_RNG(rng);
  std::uniform_real_distribution<double> zero_rate(1e10, 4e10), slow(0.3, 0.6), fresh_rate(1e9, 3e9);
  const double zero = zero_rate(rng);
  std::vector<AllocationSample> samples;
  for (int i = 0; i < 5; ++i) {
    const double bytes = std::ldexp(1.0, 16 + 2 * i);  // 64 KiB .. 16 MiB, reused
    samples.push_back({bytes, bytes / zero});
  }
  samples.back().seconds /= slow(rng);
  const double fresh = fresh_rate(rng), big = std::ldexp(1.0, 26);  // 64 MiB from new pages
  samples.push_back({big, big / fresh});
  const FreshMemoryModel f = fit_fresh_memory(samples, std::int64_t(1) << 25);
  CHECK(f.zero_bytes_per_s == doctest::Approx(zero).epsilon(1e-12));
  CHECK(f.fresh_bytes_per_s == doctest::Approx(fresh).epsilon(1e-12));
  CHECK(f.time(1e6) == doctest::Approx(1e6 / zero).epsilon(1e-12));
}

TEST_CASE("step terms: the fresh rate is new pages' rate, however much of a fresh sample a heap's free top served") {
  // One calibration's 32 MiB sample came half from a heap's free top (faulted in half its pages) and priced a new
  // page at 1.7x its rate; a training step's 32 MiB score matrices fault in all of theirs.
  PARADYSE_FRESH_RNG(rng);
  std::uniform_real_distribution<double> zero_rate(1e10, 4e10), fresh_rate(1e9, 3e9), share(0.125, 1.0);
  for (int trial = 0; trial < 30; ++trial) {
    const double zero = zero_rate(rng), fresh = fresh_rate(rng);
    std::vector<AllocationSample> samples;
    for (int i = 0; i < 5; ++i) {
      const double bytes = std::ldexp(1.0, 16 + 2 * i);  // 64 KiB .. 16 MiB, reused
      samples.push_back({bytes, bytes / zero});
    }
    for (const double bytes : {std::ldexp(1.0, 25), std::ldexp(1.0, 26)}) {  // 32 and 64 MiB, partly new pages
      const double s = share(rng);
      samples.push_back({bytes, s * bytes / fresh + (1 - s) * bytes / zero, s});
    }
    const FreshMemoryModel f = fit_fresh_memory(samples, std::int64_t(1) << 25);
    CHECK(f.zero_bytes_per_s == doctest::Approx(zero).epsilon(1e-12));
    CHECK(f.fresh_bytes_per_s == doctest::Approx(fresh).epsilon(1e-9));
    // A sample with under an eighth of its bytes on new pages is left out; with all of them so, they are taken as
    // timed (every byte new: huge pages fault once per 2 MiB).
    std::vector<AllocationSample> mostly_reused = samples;
    mostly_reused[5].new_share = 0.05;
    mostly_reused[5].seconds = 0.05 * mostly_reused[5].bytes / (fresh / 4) + 0.95 * mostly_reused[5].bytes / zero;
    CHECK(fit_fresh_memory(mostly_reused, std::int64_t(1) << 25).fresh_bytes_per_s ==
          doctest::Approx(fresh).epsilon(1e-9));
    mostly_reused[6].new_share = 0.05;
    mostly_reused[6].seconds = 0.05 * mostly_reused[6].bytes / (fresh / 4) + 0.95 * mostly_reused[6].bytes / zero;
    CHECK(fit_fresh_memory(mostly_reused, std::int64_t(1) << 25).fresh_bytes_per_s ==
          doctest::Approx((mostly_reused[5].bytes + mostly_reused[6].bytes) /
                          (mostly_reused[5].seconds + mostly_reused[6].seconds)).epsilon(1e-12));
  }
  std::vector<AllocationSample> bad{{1e6, 1e-4}, {4e6, 1e-3, 1.5}};
  CHECK_THROWS_WITH(fit_fresh_memory(bad), doctest::Contains("new_share = 1.5"));
}

TEST_CASE("step terms: the scalar-math fit recovers a known rate beyond the kernel's other work") {
  PARADYSE_FRESH_RNG(rng);
  std::uniform_real_distribution<double> rate(1e7, 1e9), other(0, 1e-3), calls(1e4, 1e7);
  for (int trial = 0; trial < 20; ++trial) {
    const double r = rate(rng);
    std::vector<ScalarSample> samples;
    for (int i = 0; i < 3; ++i) {
      const double c = calls(rng), o = other(rng);
      samples.push_back({c, o + c / r, o});
    }
    CHECK(fit_scalar_rate(samples) == doctest::Approx(r).epsilon(1e-9));
  }
  const std::vector<ScalarSample> no_slower{{1e6, 1e-3, 2e-3}};
  CHECK(fit_scalar_rate(no_slower) == 0);  // not slower than its other work: unpriced
}

TEST_CASE("step terms: the softmax's loop per score and its exp per call are told apart by two visible shares") {
  // One sample gave the loop the activation rate and the exp the rest: a step whose rows see half their keys was then
  // priced 15-20% under its softmax.
  PARADYSE_FRESH_RNG(rng);
  std::uniform_real_distribution<double> per_score(0.5e-9, 3e-9), per_exp(1e-9, 6e-9), other(0, 1e-3),
      noise(0.999, 1.001);
  for (int trial = 0; trial < 20; ++trial) {
    const double a = per_score(rng), b = per_exp(rng), scores = 2097152;
    std::vector<SoftmaxSample> samples;
    for (const double share : {0.25, 0.75, 1.0}) {
      const double o = other(rng);
      samples.push_back({scores, share * scores, o + scores * a + share * scores * b, o});
    }
    const ScalarMathModel exact = fit_softmax_rates(samples);
    CHECK(exact.softmax_scores_per_s == doctest::Approx(1 / a).epsilon(1e-9));
    CHECK(exact.exp_per_s == doctest::Approx(1 / b).epsilon(1e-9));
    for (SoftmaxSample& x : samples) x.seconds *= noise(rng);  // a tenth of a percent of noise moves them little
    const ScalarMathModel noisy = fit_softmax_rates(samples);
    CHECK(noisy.softmax_scores_per_s == doctest::Approx(1 / a).epsilon(0.05));
    CHECK(noisy.exp_per_s == doctest::Approx(1 / b).epsilon(0.05));
    // Priced: the softmax family's activation at the loop's rate, other activations at theirs.
    HardwareProfile hw = terms_only();
    hw.activation_elements_per_s = 1e9;
    hw.scalar_math = exact;
    CHECK(hw.activation_time(scores, 8 * scores, false, ElementwiseFamily::softmax) ==
          doctest::Approx(scores * a).epsilon(1e-9));
    CHECK(hw.activation_time(scores, 8 * scores) == doctest::Approx(scores / 1e9).epsilon(1e-12));
    hw.scalar_math.softmax_scores_per_s = 0;  // a profile without it: the activation rate, as before
    CHECK(hw.activation_time(scores, 8 * scores, false, ElementwiseFamily::softmax) ==
          doctest::Approx(scores / 1e9).epsilon(1e-12));
  }
  const std::vector<SoftmaxSample> one_share{{1e6, 5e5, 1e-2, 0}, {2e6, 1e6, 2e-2, 0}};
  CHECK_THROWS_WITH(fit_softmax_rates(one_share), doctest::Contains("the fit needs two visible shares"));
  const std::vector<SoftmaxSample> alone{{1e6, 5e5, 1e-2, 0}};
  CHECK_THROWS_WITH(fit_softmax_rates(alone), doctest::Contains("1 samples"));
  const std::vector<SoftmaxSample> more_exps{{1e6, 2e6, 1e-2, 0}, {1e6, 5e5, 1e-2, 0}};
  CHECK_THROWS_WITH(fit_softmax_rates(more_exps), doctest::Contains("exps = 2000000"));
}

TEST_CASE("step terms: a profile written before the terms loads with them unpriced; new ones round-trip") {
  HardwareProfile hw = a100_sxm4_80gb_x8();
  json::Value old = to_json(hw);
  CHECK_FALSE(old.contains("fresh_memory"));  // not written while unset: the old format
  CHECK_FALSE(old.contains("scalar_math"));
  const HardwareProfile loaded = profile_from_json(old);
  CHECK(loaded.fresh_memory == FreshMemoryModel{});
  CHECK(loaded.scalar_math == ScalarMathModel{});
  hw.fresh_memory = {2.2e10, 1.56e9, std::int64_t(1) << 25};
  hw.scalar_math = {3.1e8, 4.7e7};
  CHECK_FALSE(to_json(hw)["scalar_math"].contains("softmax_scores_per_s"));  // unset: not written
  hw.scalar_math.softmax_scores_per_s = 5.8e8;
  const HardwareProfile back = profile_from_json(to_json(hw));
  CHECK(back.fresh_memory == hw.fresh_memory);
  CHECK(back.scalar_math == hw.scalar_math);
  json::Value bad = to_json(hw);
  bad["fresh_memory"]["fresh_bytes_per_s"] = -1.0;
  CHECK_THROWS_WITH(profile_from_json(bad), doctest::Contains("fresh_memory.fresh_bytes_per_s"));
  bad = to_json(hw);
  bad["scalar_math"]["tan_per_s"] = 1.0;
  CHECK_THROWS_WITH(profile_from_json(bad), doctest::Contains("unknown key \"tan_per_s\""));
}
