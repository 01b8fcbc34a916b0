// Tests of ops/cpu/gemm_grouped.hpp (through ops::Cpu and ops::CpuBf16) and its ops::Counting record: every item of
// its own m, n, k against the float64 reference on fresh random inputs, every transpose combination, alpha/beta,
// padded leading dimensions, empty items, items that share an output with beta = 1 (summed in order); mismatched
// lists are refused; the dry run records one GEMM event per item, its weight and the CPU op's workspace, the items
// after the first marked grouped, and the time model prices them as one launch where the profile says so.
#include "paradyse/cost/builtin_profiles.hpp"
#include "paradyse/cost/profile_json.hpp"
#include "paradyse/cost/trace_cost.hpp"
#include "paradyse/ops/backend.hpp"
#include "paradyse/ops/cpu/bf16_backend.hpp"
#include "paradyse/ops/counting.hpp"

#include "ops/reference.hpp"
#include "support/fresh_seed.hpp"
#include "support/tolerance.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

using namespace paradyse;
using namespace paradyse::testing;
using ops::Transpose;

namespace {

struct GroupedItemSize {
  std::int64_t m, n, k;
};

// Items i live at their own offsets in one buffer per operand (padded leading dimensions shared by all items, gaps
// between them); `share_c` items in a row write one output (with beta = 1 they sum into it, in order).
void check_grouped(const std::vector<GroupedItemSize>& sizes, bool ta, bool tb, float alpha, float beta,
                   std::int64_t pad, int share_c, std::mt19937_64& rng) {
  CAPTURE(ta); CAPTURE(tb); CAPTURE(alpha); CAPTURE(beta); CAPTURE(pad); CAPTURE(share_c);
  std::int64_t max_a_cols = 1, max_b_cols = 1, max_n = 1;
  for (const GroupedItemSize& s : sizes) {
    max_a_cols = std::max(max_a_cols, ta ? s.m : s.k);
    max_b_cols = std::max(max_b_cols, tb ? s.k : s.n);
    max_n = std::max(max_n, s.n);
  }
  const std::int64_t lda = max_a_cols + pad, ldb = max_b_cols + pad, ldc = max_n + pad;
  std::vector<std::int64_t> a_at, b_at, c_at;
  std::int64_t a_size = 0, b_size = 0, c_size = 0;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    const GroupedItemSize& s = sizes[i];
    a_at.push_back(a_size), a_size += (ta ? s.k : s.m) * lda + 3;
    b_at.push_back(b_size), b_size += (tb ? s.n : s.k) * ldb + 5;
    if (i % std::size_t(share_c) == 0) {
      std::int64_t rows = 0;  // the largest m of the items sharing this output
      for (std::size_t j = i; j < std::min(sizes.size(), i + std::size_t(share_c)); ++j)
        rows = std::max(rows, sizes[j].m);
      c_at.push_back(c_size), c_size += rows * ldc + 7;
    } else {
      c_at.push_back(c_at.back());
    }
  }
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> a(static_cast<std::size_t>(a_size)), b(static_cast<std::size_t>(b_size)),
      c(static_cast<std::size_t>(c_size));
  for (std::vector<float>* v : {&a, &b, &c})
    for (float& x : *v) x = uniform(rng);
  // The reference: the items one after another in float64, on the whole buffers.
  Vec want(c.begin(), c.end());
  const Vec a64(a.begin(), a.end()), b64(b.begin(), b.end());
  ops::GroupedGemm items;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    const GroupedItemSize& s = sizes[i];
    const Vec ai(a64.begin() + a_at[i], a64.end()), bi(b64.begin() + b_at[i], b64.end());
    Vec ci(want.begin() + c_at[i], want.end());
    reference_gemm(ta, tb, s.m, s.n, s.k, alpha, ai, lda, bi, ldb, beta, ci, ldc);
    std::copy(ci.begin(), ci.end(), want.begin() + c_at[i]);
    items.add(s.m, s.n, s.k, a.data() + a_at[i], b.data() + b_at[i], c.data() + c_at[i]);
  }
  ops::Cpu::gemm_grouped(ta ? Transpose::yes : Transpose::no, tb ? Transpose::yes : Transpose::no, alpha, items, lda,
                         ldb, beta, ldc);
  // The whole buffer: padding columns and the gaps between items stay untouched.
  CHECK_CLOSE(c, want, kFloat32);
}

// n GEMM sizes of an expert bank: m drawn in [0, max_m] (some empty), n and k as given.
std::vector<GroupedItemSize> ragged(std::mt19937_64& rng, int count, std::int64_t max_m, std::int64_t n,
                                    std::int64_t k) {
  std::uniform_int_distribution<std::int64_t> rows(0, max_m);
  std::vector<GroupedItemSize> sizes;
  for (int i = 0; i < count; ++i) sizes.push_back({rows(rng), n, k});
  return sizes;
}

}  // namespace

TEST_CASE("gemm_grouped: every item of its own size matches the float64 reference, in order") {
  PARADYSE_FRESH_RNG(rng);
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      // Experts' rows against their weights: ragged m, some blocks empty.
      check_grouped(ragged(rng, 6, 19, 24, 16), ta, tb, 1.0f, 0.0f, 0, 1, rng);
      // Weight gradients: ragged k (the rows), beta = 1, padded.
      std::vector<GroupedItemSize> grads = ragged(rng, 5, 13, 9, 7);
      for (GroupedItemSize& s : grads) std::swap(s.m, s.k);
      check_grouped(grads, ta, tb, 1.0f, 1.0f, 2, 1, rng);
      // Every size different, alpha and beta, padded.
      check_grouped({{5, 7, 3}, {17, 9, 33}, {1, 1, 1}, {31, 40, 7}}, ta, tb, -1.5f, 0.5f, 3, 1, rng);
      // Three items sum into each output with beta = 0.5: only the in-order result matches.
      check_grouped({{4, 6, 5}, {4, 6, 2}, {3, 6, 9}, {6, 5, 4}, {6, 5, 1}, {2, 5, 3}}, ta, tb, 1.0f, 0.5f, 1, 3, rng);
      // k = 0: c scaled by beta.
      check_grouped({{3, 4, 0}, {2, 4, 5}}, ta, tb, 1.0f, 0.25f, 0, 1, rng);
    }
}

TEST_CASE("gemm_grouped: the bf16 backend rounds each item's operands as its gemm does") {
  PARADYSE_FRESH_RNG(rng);
  const std::vector<GroupedItemSize> sizes = ragged(rng, 4, 9, 12, 8);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> a(std::size_t(4 * 9 * 8)), b(std::size_t(4 * 12 * 8)), grouped(std::size_t(4 * 9 * 12)),
      looped(grouped.size());
  for (float& x : a) x = uniform(rng);
  for (float& x : b) x = uniform(rng);
  ops::GroupedGemm items;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    items.add(sizes[i].m, 12, 8, a.data() + i * 72, b.data() + i * 96, grouped.data() + i * 108);
    ops::CpuBf16::gemm(Transpose::no, Transpose::yes, sizes[i].m, 12, 8, 1.0f, a.data() + i * 72, 8, b.data() + i * 96,
                       8, 0.0f, looped.data() + i * 108, 12);
  }
  ops::CpuBf16::gemm_grouped(Transpose::no, Transpose::yes, 1.0f, items, 8, 8, 0.0f, 12);
  CHECK(grouped == looped);
}

TEST_CASE("gemm_grouped: an empty group does nothing; lists of different lengths are refused") {
  std::vector<float> x(16, 1.0f);
  ops::Cpu::gemm_grouped(Transpose::no, Transpose::no, 1.0f, {}, 2, 2, 0.0f, 2);
  CHECK(x == std::vector<float>(16, 1.0f));
  ops::GroupedGemm items;
  items.add(2, 2, 2, x.data(), x.data(), x.data() + 8);
  items.k.push_back(2);  // one k too many
  CHECK_THROWS_WITH_AS(ops::Cpu::gemm_grouped(Transpose::no, Transpose::no, 1.0f, items, 2, 2, 0.0f, 2),
                       doctest::Contains("got 1 m, 1 n, 2 k, 1 a, 1 b and 1 c"), Error);
  Trace trace;
  const ScopedTrace recording(trace);
  CHECK_THROWS_AS(ops::Counting::gemm_grouped(Transpose::no, Transpose::no, 1.0f, items, 2, 2, 0.0f, 2), Error);
  ops::Counting::gemm_grouped(Transpose::no, Transpose::no, 1.0f, {}, 2, 2, 0.0f, 2);
  CHECK(trace.size() == 0);
}

TEST_CASE("gemm_grouped on the counting backend: an event per item with its weight, the later items grouped") {
  MemoryTracker meta(MemorySpace::meta);
  const ScopedTracker scoped(meta);
  // Meta buffers: addresses only (never read). Four experts' rows [m_e, 64] against their weights [96, 64].
  const std::int64_t rows[] = {5, 0, 12, 3};
  Tensor<float> x(Shape{20, 64}), w(Shape{4, 96, 64}), y(Shape{20, 96});
  ops::GroupedGemm items;
  std::int64_t begin = 0;
  for (std::int64_t e = 0; e < 4; ++e) {
    items.add(rows[e], 96, 64, x.data() + begin * 64, w.data() + e * 96 * 64, y.data() + begin * 96);
    begin += rows[e];
  }
  Trace grouped, looped;
  meta.set_trace(&grouped);
  {
    const ScopedTrace recording(grouped);
    ops::Counting::gemm_grouped(Transpose::no, Transpose::yes, 1.0f, items, 64, 64, 0.0f, 96);
  }
  meta.set_trace(&looped);
  {
    const ScopedTrace recording(looped);
    for (std::size_t i = 0; i < items.size(); ++i)
      ops::Counting::gemm(Transpose::no, Transpose::yes, items.m[i], 96, 64, 1.0f, items.a[i], 64, items.b[i], 64,
                          0.0f, items.c[i], 96);
  }
  meta.set_trace(nullptr);
  std::vector<TraceEvent> gemms, loop_gemms;
  for (const TraceEvent& e : grouped.events())
    if (e.kind == TraceKind::gemm) gemms.push_back(e);
  for (const TraceEvent& e : looped.events())
    if (e.kind == TraceKind::gemm) loop_gemms.push_back(e);
  REQUIRE(gemms.size() == 4);
  REQUIRE(loop_gemms.size() == 4);
  for (std::size_t i = 0; i < 4; ++i) {
    CAPTURE(i);
    CHECK(gemms[i].grouped == (i > 0));
    CHECK_FALSE(loop_gemms[i].grouped);
    CHECK(gemms[i].m == double(rows[i]));
    CHECK(gemms[i].n == 96);
    CHECK(gemms[i].k == 64);
    CHECK(gemms[i].operand == reinterpret_cast<std::uintptr_t>(w.data() + i * 96 * 64));
  }
  // The same workspaces as the loop's (the CPU op is that loop).
  std::vector<double> scratch, loop_scratch;
  for (const TraceEvent& e : grouped.events())
    if (e.kind == TraceKind::scratch) scratch.push_back(e.bytes);
  for (const TraceEvent& e : looped.events())
    if (e.kind == TraceKind::scratch) loop_scratch.push_back(e.bytes);
  CHECK(scratch == loop_scratch);

  // Priced: on a profile of one call per item (a CPU's), as the loop; on a GPU profile the later items without the
  // call's fixed cost.
  const auto seconds = [](const Trace& t, const cost::HardwareProfile& hw) {
    double s = 0;
    for (const TraceEvent& e : t.events()) s += cost::event_seconds(hw, e, 0.5, 2);
    return s;
  };
  cost::HardwareProfile one_call_each = cost::builtin_profile("h100");
  one_call_each.gemm.grouped_item_s.reset();
  CHECK(seconds(grouped, one_call_each) == doctest::Approx(seconds(looped, one_call_each)).scale(0));
  const cost::HardwareProfile h100 = cost::builtin_profile("h100");
  REQUIRE(h100.gemm.grouped_item_s.has_value());
  // Three non-empty items, the two after the first without the 6 us launch (the empty item costs nothing either way).
  CHECK(seconds(looped, h100) - seconds(grouped, h100) ==
        doctest::Approx(2 * (h100.gemm.overhead_s - *h100.gemm.grouped_item_s)).scale(0));
  cost::HardwareProfile costly = h100;
  costly.gemm.grouped_item_s = 1e-6;
  CHECK(seconds(grouped, costly) - seconds(grouped, h100) == doctest::Approx(2e-6).scale(0));
}

TEST_CASE("GemmModel::grouped_item_time: an item's call less its fit's fixed cost, plus the profile's per item") {
  cost::GemmModel g{.overhead_s = 5e-6, .flops_per_s = 1e12, .bytes_per_s = 1e12};
  const double alone = g.time(16, 256, 512, 2);
  CHECK(g.grouped_item_time(alone, 16, 256, 512, 2) == alone);  // unset: a call of its own
  g.grouped_item_s = 0.5e-6;
  CHECK(g.grouped_item_time(alone, 16, 256, 512, 2) == doctest::Approx(alone - 5e-6 + 0.5e-6).scale(0));
  CHECK(g.grouped_item_time(0, 0, 256, 512, 2) == 0);  // an empty item costs nothing
  // A row class's own overhead; a measured shape its table's call_overhead_s (0 unless recorded: kept whole).
  g.by_rows = {{.max_rows = 32, .overhead_s = 2e-6, .flops_per_s = 1e12}};
  const double classed = g.time(16, 256, 512, 2);
  CHECK(g.grouped_item_time(classed, 16, 256, 512, 2) == doctest::Approx(classed - 2e-6 + 0.5e-6).scale(0));
  g.measured = {.dtype_bytes = 2, .shapes = {{.n = 256, .k = 512, .rows = {8, 32}, .seconds = {3e-6, 9e-6}}}};
  CHECK(g.grouped_item_time(g.time(16, 256, 512, 2), 16, 256, 512, 2) ==
        doctest::Approx(g.time(16, 256, 512, 2) + 0.5e-6).scale(0));
  g.measured.call_overhead_s = 1.5e-6;  // 5e-6 at 16 rows, interpolated: the measured time less the recorded cost
  CHECK(g.time(16, 256, 512, 2) == doctest::Approx(5e-6).scale(0));
  CHECK(g.grouped_item_time(g.time(16, 256, 512, 2), 16, 256, 512, 2) ==
        doctest::Approx(5e-6 - 1.5e-6 + 0.5e-6).scale(0));
  CHECK(g.grouped_item_time(g.time(4, 256, 512, 2), 4, 256, 512, 2) ==  // below the rows: the class, its overhead
        doctest::Approx(g.time(4, 256, 512, 2) - 2e-6 + 0.5e-6).scale(0));
  // The profile's JSON keeps the settings, and leaves them unset where they were.
  cost::HardwareProfile p = cost::builtin_profile("h200");
  p.gemm.grouped_item_s = 0.75e-6;
  p.gemm.measured = g.measured;
  const cost::HardwareProfile back = cost::profile_from_json(cost::to_json(p));
  CHECK(back.gemm.grouped_item_s == 0.75e-6);
  CHECK(back.gemm.measured.call_overhead_s == 1.5e-6);
  CHECK(back.gemm.measured == p.gemm.measured);
  p.gemm.measured.call_overhead_s = 0;
  CHECK_FALSE(cost::to_json(p)["gemm"]["measured"].contains("call_overhead_s"));
  p.gemm.grouped_item_s.reset();
  CHECK_FALSE(cost::profile_from_json(cost::to_json(p)).gemm.grouped_item_s.has_value());
}
