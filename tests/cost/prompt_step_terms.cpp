// Tests of the time model's two terms for a serving step's prompt chunk (issue 25; cost/profile.hpp's
// PagedAttentionModel and swiglu_forward_elements_per_s): the trace clock prices a paged-attention event per (query-key
// pair, head) visit (MLA's latent attention at its own model, a per-pair term besides) and SwiGLU forward's activation
// event at its rate (cost/trace_cost.hpp), the dry run records SwiGLU forward as such (ops/counting.hpp), the
// calibrations' fits recover known rates from synthetic measurements (cost/calibration_fits.hpp fit_paged_attention and
// fit_latent_attention), and profiles without the terms still load and price as before (cost/profile_json.hpp).
#include "paradyse/cost/builtin_profiles.hpp"
#include "paradyse/cost/calibrate.hpp"
#include "paradyse/cost/profile_json.hpp"
#include "paradyse/cost/trace_cost.hpp"
#include "paradyse/ops/counting.hpp"

#include "support/fresh_seed.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <random>
#include <utility>
#include <vector>

using namespace paradyse;
using namespace paradyse::cost;

namespace {

// A profile that prices nothing but the terms under test: every other rate is as fast as a profile allows.
HardwareProfile prompt_terms_only() {
  HardwareProfile hw = a100_sxm4_80gb_x8();
  hw.elementwise_bytes_per_s = 1e30;
  hw.attention = {0, 1e30, 1e30};
  return hw;
}

double seconds_of(std::vector<TraceEvent> forward, const HardwareProfile& hw) {
  SublayerTrace trace;
  trace.forward = std::move(forward);
  return cost_of(trace, &hw, 4).forward_s;
}

}  // namespace

TEST_CASE("prompt step terms: a paged attention event costs its visits at the profile's rates") {
  PARADYSE_FRESH_RNG(rng);
  std::uniform_real_distribution<double> visits_rate(1e7, 1e9), flops_rate(1e9, 1e11), pairs_of(1e3, 1e6);
  for (int trial = 0; trial < 8; ++trial) {
    HardwareProfile hw = prompt_terms_only();
    hw.paged_attention = {visits_rate(rng), flops_rate(rng)};
    const double pairs = std::floor(pairs_of(rng)), heads = double(1 + trial % 4), d = trial % 2 ? 128 : 32;
    const double expected = pairs * heads / hw.paged_attention.visits_per_s +
                            4 * d * pairs * heads / hw.paged_attention.flops_per_s;
    const TraceEvent paged{.kind = TraceKind::paged_attention, .m = pairs, .n = heads, .k = d};
    CHECK(seconds_of({paged}, hw) == doctest::Approx(expected).epsilon(1e-12));
    TraceEvent twice = paged;  // two identical calls in a row
    twice.count = 2;
    CHECK(seconds_of({twice}, hw) == doctest::Approx(2 * expected).epsilon(1e-12));
    // A rate of 0 leaves its term out.
    HardwareProfile visits_only = hw;
    visits_only.paged_attention.flops_per_s = 0;
    CHECK(seconds_of({paged}, visits_only) ==
          doctest::Approx(pairs * heads / hw.paged_attention.visits_per_s).epsilon(1e-12));
    // Flash attention forward is not the paged kernel: the profile's attention rates price it.
    CHECK(seconds_of({{.kind = TraceKind::attention_forward, .m = pairs, .n = heads, .k = d}}, hw) ==
          doctest::Approx(0).epsilon(1e-12));
  }
}

TEST_CASE("prompt step terms: without a calibrated model the paged kernel is priced as flash attention (before)") {
  HardwareProfile hw = a100_sxm4_80gb_x8();
  REQUIRE_FALSE(hw.paged_attention.calibrated());
  const double pairs = 2080, heads = 4, d = 32;
  const TraceEvent paged{.kind = TraceKind::paged_attention, .m = pairs, .n = heads, .k = d};
  const TraceEvent flash{.kind = TraceKind::attention_forward, .m = pairs, .n = heads, .k = d};
  CHECK(seconds_of({paged}, hw) == doctest::Approx(seconds_of({flash}, hw)).epsilon(1e-12));
  CHECK(seconds_of({paged}, hw) == doctest::Approx(hw.attention.forward_time(4 * d * heads * pairs)).epsilon(1e-12));
  CHECK(hw.paged_attention_time(pairs, heads, d) == hw.attention.forward_time(4 * d * heads * pairs));
  CHECK(hw.paged_attention_time(0, heads, d) == 0);
}

TEST_CASE("prompt step terms: MLA's latent attention costs its visits at its own model, else as the paged kernel") {
  PARADYSE_FRESH_RNG(rng);
  std::uniform_real_distribution<double> visits_rate(1e7, 1e9), flops_rate(1e9, 1e11), pairs_of(1e3, 1e6);
  for (int trial = 0; trial < 8; ++trial) {
    HardwareProfile hw = prompt_terms_only();
    hw.paged_attention = {visits_rate(rng), flops_rate(rng)};
    const double pairs = std::floor(pairs_of(rng)), heads = double(1 + trial % 16), width = trial % 2 ? 544 : 160;
    const TraceEvent latent{.kind = TraceKind::latent_attention, .m = pairs, .n = heads, .k = width};
    const TraceEvent paged{.kind = TraceKind::paged_attention, .m = pairs, .n = heads, .k = width};
    // Not calibrated: the paged kernel's price, bit for bit (what profiles written before the model gave it).
    CHECK(seconds_of({latent}, hw) == seconds_of({paged}, hw));
    CHECK(hw.latent_attention_time(pairs, heads, width) == hw.paged_attention_time(pairs, heads, width));
    // Calibrated: its own rates, the paged kernel's unchanged.
    const double paged_s = seconds_of({paged}, hw);
    hw.latent_attention = {visits_rate(rng), flops_rate(rng), flops_rate(rng)};
    const LatentAttentionModel& m = hw.latent_attention;
    const double expected = pairs * heads / m.visits_per_s + 4 * width * pairs * heads / m.flops_per_s +
                            width * pairs / m.shared_per_s;
    CHECK(seconds_of({latent}, hw) == doctest::Approx(expected).epsilon(1e-12));
    CHECK(seconds_of({paged}, hw) == paged_s);
    CHECK(hw.latent_attention_time(0, heads, width) == 0);
  }
  // With neither model, as flash attention (the paged kernel's fallback).
  const HardwareProfile a100 = a100_sxm4_80gb_x8();
  CHECK(a100.latent_attention_time(2080, 8, 544) == a100.attention.forward_time(4 * 544 * 8 * 2080.0));
}

TEST_CASE("prompt step terms: the latent attention's fit recovers known rates from synthetic timings") {
  PARADYSE_FRESH_RNG(rng);
  std::uniform_real_distribution<double> visits_rate(2e7, 5e8), flops_rate(2e9, 5e10);
  for (int trial = 0; trial < 6; ++trial) {
    const LatentAttentionModel truth{visits_rate(rng), flops_rate(rng), flops_rate(rng) / 4};
    std::vector<LatentAttentionSample> samples;  // the calibration's widths, head counts and chunks' pairs
    for (const double width : {160.0, 544.0})
      for (const double heads : {4.0, 16.0})
        for (const double pairs : {2080.0, 8720.0, 513.0, 2049.0})
          samples.push_back({pairs, heads, width, truth.time(pairs, heads, width)});
    LatentAttentionModel fitted;
    const Fit fit = fit_latent_attention(samples, fitted);
    CHECK(fitted.visits_per_s == doctest::Approx(truth.visits_per_s).epsilon(1e-6));
    CHECK(fitted.flops_per_s == doctest::Approx(truth.flops_per_s).epsilon(1e-6));
    CHECK(fitted.shared_per_s == doctest::Approx(truth.shared_per_s).epsilon(1e-6));
    CHECK(fit.worst_relative_error < 1e-9);
  }
  LatentAttentionModel fitted;
  CHECK_THROWS_WITH_AS(fit_latent_attention(std::vector<LatentAttentionSample>{{10, 0, 160, 1e-3}}, fitted),
                       doctest::Contains("fit_latent_attention: a sample of 10 pairs, 0 heads"), Error);
}

TEST_CASE("prompt step terms: SwiGLU forward's activation events cost their elements at its rate, others at GELU's") {
  HardwareProfile hw = prompt_terms_only();
  hw.activation_elements_per_s = 2e9;
  hw.swiglu_forward_elements_per_s = 3e8;
  // What the dry run records for a SwiGLU forward of [128, 256] and a GELU forward of the same size.
  Trace trace;
  Trace* const saved = std::exchange(Trace::current(), &trace);
  ops::counting::swiglu_forward(TensorView<const float>(nullptr, Shape{128, 256}),
                                TensorView<const float>(nullptr, Shape{128, 256}), TensorView<float>(nullptr, Shape{128, 256}));
  ops::counting::swiglu_backward(TensorView<const float>(nullptr, Shape{128, 256}), {}, {}, {}, {});
  ops::counting::gelu_forward(TensorView<const float>(nullptr, Shape{128, 256}), {});
  Trace::current() = saved;
  REQUIRE(trace.events().size() == 3);
  const double elements = 128 * 256;
  CHECK(seconds_of({trace.events()[0]}, hw) == doctest::Approx(elements / 3e8).epsilon(1e-12));
  CHECK(seconds_of({trace.events()[1]}, hw) == doctest::Approx(2 * elements / 2e9).epsilon(1e-12));  // backward: GELU's
  CHECK(seconds_of({trace.events()[2]}, hw) == doctest::Approx(elements / 2e9).epsilon(1e-12));
  // Without SwiGLU's rate (older profiles): GELU's, as before.
  hw.swiglu_forward_elements_per_s = 0;
  CHECK(seconds_of({trace.events()[0]}, hw) == doctest::Approx(elements / 2e9).epsilon(1e-12));
}

TEST_CASE("prompt step terms: the calibration's fit recovers known paged-attention rates from synthetic timings") {
  PARADYSE_FRESH_RNG(rng);
  std::uniform_real_distribution<double> visits_rate(2e7, 5e8), flops_rate(2e9, 5e10);
  for (int trial = 0; trial < 6; ++trial) {
    const PagedAttentionModel truth{visits_rate(rng), flops_rate(rng)};
    std::vector<PagedAttentionSample> samples;
    for (const double d : {32.0, 64.0, 128.0})
      for (const double visits : {4 * 2080.0, 4 * 8256.0, 4 * 513.0, 4 * 2049.0})
        samples.push_back({visits, d, truth.time(visits, d)});
    PagedAttentionModel fitted;
    const Fit fit = fit_paged_attention(samples, fitted);
    CHECK(fitted.visits_per_s == doctest::Approx(truth.visits_per_s).epsilon(1e-6));
    CHECK(fitted.flops_per_s == doctest::Approx(truth.flops_per_s).epsilon(1e-6));
    CHECK(fit.worst_relative_error < 1e-9);
  }
  // Timings that do not grow with the head dim: the FLOP term fits to 0 and stays unpriced.
  std::vector<PagedAttentionSample> flat;
  for (const double d : {32.0, 128.0})
    for (const double visits : {1e4, 1e5}) flat.push_back({visits, d, visits / 1e8});
  PagedAttentionModel fitted;
  fit_paged_attention(flat, fitted);
  CHECK(fitted.visits_per_s == doctest::Approx(1e8).epsilon(1e-6));
  CHECK(fitted.flops_per_s == 0);
  CHECK(fitted.calibrated());
  CHECK_THROWS_WITH_AS(fit_paged_attention(std::vector<PagedAttentionSample>{{0, 32, 1e-3}}, fitted),
                       doctest::Contains("fit_paged_attention: a sample of 0 visits"), Error);
}

TEST_CASE("prompt step terms: profiles keep the terms through JSON; without them they load as before") {
  HardwareProfile hw = a100_sxm4_80gb_x8();
  hw.paged_attention = {1.5e8, 3e9};
  hw.latent_attention = {4.5e8, 0, 2.5e9};
  hw.swiglu_forward_elements_per_s = 4e8;
  const HardwareProfile back = profile_from_json(to_json(hw));
  CHECK(back.paged_attention == hw.paged_attention);
  CHECK(back.latent_attention == hw.latent_attention);
  CHECK(back.swiglu_forward_elements_per_s == hw.swiglu_forward_elements_per_s);
  // A profile written before the terms (neither field): not calibrated, priced as before.
  const json::Value old_json = to_json(a100_sxm4_80gb_x8());
  CHECK_FALSE(old_json.contains("paged_attention"));  // not written while unset: the old format
  CHECK_FALSE(old_json.contains("latent_attention"));
  CHECK_FALSE(old_json.contains("swiglu_forward_elements_per_s"));
  const HardwareProfile old = profile_from_json(old_json);
  CHECK_FALSE(old.paged_attention.calibrated());
  CHECK_FALSE(old.latent_attention.calibrated());
  CHECK(old.swiglu_forward_elements_per_s == 0);
  // A bad field names itself.
  json::Value bad = to_json(hw);
  bad["paged_attention"]["visits_per_s"] = -1.0;
  CHECK_THROWS_WITH_AS(profile_from_json(bad), doctest::Contains("paged_attention.visits_per_s"), Error);
  json::Value bad_latent = to_json(hw);
  bad_latent["latent_attention"]["flops_per_s"] = -2.0;
  CHECK_THROWS_WITH_AS(profile_from_json(bad_latent), doctest::Contains("latent_attention.flops_per_s"), Error);
  json::Value unknown = to_json(hw);
  unknown["paged_attention"]["visits"] = 1.0;
  CHECK_THROWS_WITH_AS(profile_from_json(unknown), doctest::Contains("unknown key \"visits\""), Error);
}
