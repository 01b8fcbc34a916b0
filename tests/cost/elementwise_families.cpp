// Tests of the elementwise kernel families (core/trace.hpp ElementwiseFamily, cost/profile.hpp ElementwiseFamilyRate):
// the counting backend tags each memory-bound kernel with its family; a profile prices a family at its own rate where
// it has one and at the size classes otherwise (an activation too, where the profile has no activation rate); profile
// JSON keeps the rates and refuses unknown or repeated families; the calibration fits every family when asked.
#include "paradyse/comm/threads.hpp"
#include "paradyse/core/trace.hpp"
#include "paradyse/cost/builtin_profiles.hpp"
#include "paradyse/cost/calibrate.hpp"
#include "paradyse/cost/profile_json.hpp"
#include "paradyse/cost/trace_cost.hpp"
#include "paradyse/ops/counting.hpp"
#include "support/profile_refusal.hpp"

#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <vector>

using namespace paradyse;
using namespace paradyse::cost;

namespace elementwise_families_test {

// The families of the events one call records.
template <class Call>
std::vector<ElementwiseFamily> families_of(Call&& call) {
  Trace trace;
  {
    const ScopedTrace recording(trace);
    call();
  }
  std::vector<ElementwiseFamily> out;
  for (const TraceEvent& e : trace.events())
    if (e.kind == TraceKind::elementwise || e.kind == TraceKind::activation) out.push_back(e.family);
  return out;
}

double priced(const HardwareProfile& hw, TraceEvent e) {
  const std::vector<TraceEvent> one{e};
  return cost_of(SublayerTraceView{.forward = one, .backward = {}, .release = {}, .group_size = 1}, &hw, 4, false)
      .forward_s;
}

}  // namespace elementwise_families_test

TEST_CASE("elementwise families: the counting backend tags each kernel with its family") {
  using elementwise_families_test::families_of;
  using F = ElementwiseFamily;
  MemoryTracker meta(MemorySpace::meta);
  const ScopedTracker on_meta(meta);
  const Tensor<float> x(Shape{16, 8}), g(Shape{8});
  Tensor<float> y(Shape{16, 8}), r(Shape{16}), s(Shape{1, 2, 4, 4});
  CHECK(families_of([&] { ops::Counting::copy(x.view(), y.view()); }) == std::vector{F::copy});
  CHECK(families_of([&] { ops::Counting::fill(y.view(), 0.0f); }) == std::vector{F::fill});
  CHECK(families_of([&] { ops::Counting::add_into(y.view(), x.view()); }) == std::vector{F::add});
  CHECK(families_of([&] { ops::Counting::rms_norm_forward(x.view(), g.view(), 1e-5f, y.view(), r.view()); }) ==
        std::vector{F::norm});
  CHECK(families_of([&] { ops::Counting::gelu_forward(x.view(), y.view()); }) == std::vector{F::activation});
  const std::vector<ops::PositionRun> runs{{0, 0, 4}};
  CHECK(families_of([&] { ops::Counting::masked_softmax_forward(s.view(), runs, runs, true); }) ==
        std::vector{F::softmax});
  CHECK(families_of([&] { ops::Counting::softmax_backward(s.view(), s.view()); }) == std::vector{F::softmax});
  CHECK(families_of([&] { ops::Counting::adamw_step(y.view(), x.view(), y.view(), y.view(), {}, 1); }) ==
        std::vector{F::optimizer});
  const std::vector<std::int64_t> rows{3, 1};
  Tensor<float> two(Shape{2, 8});
  CHECK(families_of([&] { ops::Counting::gather_rows(x.view(), rows, {}, two.view()); }) == std::vector{F::rows});
  CHECK(families_of([&] { ops::Counting::rope_forward(s.view(), s.view(), 0); }) == std::vector{F::rope});
}

TEST_CASE("elementwise families: a family's rate where the profile has one, the classes otherwise") {
  using elementwise_families_test::priced;
  HardwareProfile hw = h100_sxm_80gb_x8();
  hw.elementwise_classes = {{.max_bytes = 1e6, .bytes_per_s = 1e11}, {.max_bytes = 1e9, .bytes_per_s = 5e11}};
  hw.elementwise_families[std::size_t(ElementwiseFamily::softmax)] = {.overhead_s = 2e-6, .bytes_per_s = 2e12};
  const double bytes = 4e7;
  const TraceEvent copy{.kind = TraceKind::elementwise, .family = ElementwiseFamily::copy, .bytes = bytes};
  const TraceEvent backward{.kind = TraceKind::elementwise, .family = ElementwiseFamily::softmax, .bytes = bytes};
  const TraceEvent forward{.kind = TraceKind::activation, .family = ElementwiseFamily::softmax, .bytes = bytes,
                           .m = bytes / 8};
  CHECK(priced(hw, copy) == doctest::Approx(bytes / 5e11).epsilon(1e-12));  // no copy rate: its class
  CHECK(priced(hw, backward) == doctest::Approx(2e-6 + bytes / 2e12).epsilon(1e-12));
  CHECK(hw.activation_elements_per_s == 0);
  CHECK(priced(hw, forward) == doctest::Approx(2e-6 + bytes / 2e12).epsilon(1e-12));  // memory-bound: the family's
  hw.activation_elements_per_s = 1e9;  // a CPU's compute-bound activations keep their own rate
  CHECK(priced(hw, forward) == doctest::Approx((bytes / 8) / 1e9).epsilon(1e-12));
}

TEST_CASE("elementwise families: profile JSON keeps the rates; unknown and repeated families are refused") {
  HardwareProfile hw = h200_sxm_141gb_x8();
  hw.elementwise_families[std::size_t(ElementwiseFamily::norm)] = {.overhead_s = 3e-6, .bytes_per_s = 7e11};
  hw.elementwise_families[std::size_t(ElementwiseFamily::rows)] = {.overhead_s = 0, .bytes_per_s = 1.5e12};
  const std::string text = json::dump(to_json(hw));
  CHECK(profile_from_json(json::parse(text)).elementwise_families == hw.elementwise_families);
  CHECK(json::dump(to_json(h200_sxm_141gb_x8())).find("elementwise_families") == std::string::npos);
  const auto refused = [&](const std::string& from, const std::string& to) {
    return testing::profile_refusal(hw, "elementwise_families", from, to);
  };
  CHECK(refused("\"norm\"", "\"tensor\"").find("unknown elementwise family \"tensor\"") != std::string::npos);
  CHECK(refused("\"rows\"", "\"norm\"").find("\"norm\" appears twice") != std::string::npos);
  CHECK(refused("\"rows\"", "\"other\"").find("unknown elementwise family \"other\"") != std::string::npos);
}

TEST_CASE("elementwise families: the calibration fits every family where asked, none otherwise") {
  CalibrationOptions options;
  options.repetitions = 1;
  options.gemm_shapes = {{64, 64, 64}, {128, 64, 64}, {128, 128, 64}};
  options.attention_lengths = {64, 128};
  options.copy_bytes = {std::int64_t(1) << 16, std::int64_t(1) << 18};
  options.fresh_bytes = {std::int64_t(1) << 16, std::int64_t(1) << 18};
  options.attention_heads = 2;
  options.head_dim = 16;
  HardwareProfile without, with;
  run_ranks(1, [&](ThreadCommunicator& comm) { without = calibrate<ops::Cpu>(comm, options).profile; });
  CHECK(without.elementwise_families == decltype(without.elementwise_families){});
  options.elementwise_family_rows = {256, 2048};
  Calibration c;
  run_ranks(1, [&](ThreadCommunicator& comm) { c = calibrate<ops::Cpu>(comm, options); });
  with = c.profile;
  CHECK(!with.elementwise_families[std::size_t(ElementwiseFamily::other)].calibrated());
  for (int f = 1; f < kElementwiseFamilies; ++f) {
    CAPTURE(name_of(ElementwiseFamily(f)));
    CHECK(with.elementwise_families[std::size_t(f)].calibrated());
    int samples = 0;
    for (const CalibrationSample& s : c.samples)
      if (s.what.starts_with(fmt::format("elementwise {} ", name_of(ElementwiseFamily(f))))) ++samples;
    CHECK(samples == 2);
  }
}

TEST_CASE("elementwise families: the fitted overhead is one kernel's, as the time model charges it per event") {
  using elementwise_families_test::priced;
  // Mixes of 1, 2 and 4 kernels (copy; RoPE forward + backward; the four norm kernels) at two sizes, timed as
  // kernels x 9 us + bytes / 400 GB/s: each fit gives back the kernel's overhead and the rate, and one event of the
  // family is priced at overhead + bytes / rate.
  for (const double kernels : {1.0, 2.0, 4.0}) {
    CAPTURE(kernels);
    std::vector<FamilySample> samples;
    for (const double bytes : {8e7, 6.4e8}) samples.push_back({kernels, bytes, kernels * 9e-6 + bytes / 4e11});
    const ElementwiseFamilyRate rate = fit_elementwise_family(samples);
    CHECK(rate.overhead_s == doctest::Approx(9e-6).epsilon(1e-9));
    CHECK(rate.bytes_per_s == doctest::Approx(4e11).epsilon(1e-9));
    HardwareProfile hw = h200_sxm_141gb_x8();
    hw.elementwise_families[std::size_t(ElementwiseFamily::norm)] = rate;
    const TraceEvent one{.kind = TraceKind::elementwise, .family = ElementwiseFamily::norm, .bytes = 3.2e7};
    CHECK(priced(hw, one) == doctest::Approx(9e-6 + 3.2e7 / 4e11).epsilon(1e-9));
  }
  // No bytes term in the samples: no rate (the classes price the family).
  CHECK(!fit_elementwise_family({{2, 1e6, 2e-5}, {2, 2e6, 2e-5}}).calibrated());
}
