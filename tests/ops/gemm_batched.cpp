// Tests of ops/cpu/gemm_batched.hpp (through ops::Cpu) and its ops::Counting record: every item against the float64
// reference on fresh random inputs, every transpose combination, alpha/beta, padded leading dimensions, items that
// share an input (a GQA group's key head) and items that share an output with beta = 1 (summed in order); mismatched
// pointer counts are refused; the dry run records the first item's GEMM event and the others' as one event with a
// count, marked grouped where the outputs are disjoint (one launch on a device), and the CPU kernel's workspace.
#include "paradyse/ops/backend.hpp"
#include "paradyse/ops/counting.hpp"

#include "paradyse/core/rng.hpp"
#include "support/tolerance.hpp"
#include "ops/reference.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <string>
#include <vector>

using namespace paradyse;
using namespace paradyse::testing;
using ops::Transpose;

namespace {

struct BatchCase {
  std::int64_t count, m, n, k, pad;
  float alpha, beta;
  int share_b;  // items per b (a GQA group: 2 means items 2j and 2j + 1 read the same b)
  int share_c;  // items per c (with beta = 1 they sum into it, in order)
};

// Items i of a, b and c live at i * stride in one buffer each (padded leading dimensions, gaps between items).
void check_batch(const BatchCase& t, bool ta, bool tb, Rng& rng) {
  CAPTURE(t.count); CAPTURE(t.m); CAPTURE(t.n); CAPTURE(t.k); CAPTURE(ta); CAPTURE(tb); CAPTURE(t.alpha);
  CAPTURE(t.beta); CAPTURE(t.share_b); CAPTURE(t.share_c);
  const std::int64_t a_rows = ta ? t.k : t.m, a_cols = ta ? t.m : t.k;
  const std::int64_t b_rows = tb ? t.n : t.k, b_cols = tb ? t.k : t.n;
  const std::int64_t lda = a_cols + t.pad, ldb = b_cols + t.pad, ldc = t.n + t.pad;
  const std::int64_t a_stride = a_rows * lda + 5, b_stride = b_rows * ldb + 3, c_stride = t.m * ldc + 7;
  const std::int64_t b_items = (t.count + t.share_b - 1) / t.share_b, c_items = (t.count + t.share_c - 1) / t.share_c;
  std::vector<float> a(std::size_t(t.count * a_stride)), b(std::size_t(b_items * b_stride)),
      c(std::size_t(c_items * c_stride));
  rng.fill_uniform(std::span<float>(a));
  rng.fill_uniform(std::span<float>(b));
  rng.fill_uniform(std::span<float>(c));
  // The reference: the items one after another in float64 (an output shared by items sums them in this order).
  Vec want(c.begin(), c.end());
  const Vec a64(a.begin(), a.end());
  for (std::int64_t i = 0; i < t.count; ++i) {
    const Vec ai(a64.begin() + i * a_stride, a64.begin() + (i + 1) * a_stride);
    const Vec bi(b.begin() + (i / t.share_b) * b_stride, b.begin() + (i / t.share_b + 1) * b_stride);
    Vec ci(want.begin() + (i / t.share_c) * c_stride, want.begin() + (i / t.share_c + 1) * c_stride);
    reference_gemm(ta, tb, t.m, t.n, t.k, t.alpha, ai, lda, bi, ldb, t.beta, ci, ldc);
    std::copy(ci.begin(), ci.end(), want.begin() + (i / t.share_c) * c_stride);
  }
  std::vector<const float*> a_items, b_items_ptrs;
  std::vector<float*> c_items_ptrs;
  for (std::int64_t i = 0; i < t.count; ++i) {
    a_items.push_back(a.data() + i * a_stride);
    b_items_ptrs.push_back(b.data() + (i / t.share_b) * b_stride);
    c_items_ptrs.push_back(c.data() + (i / t.share_c) * c_stride);
  }
  ops::Cpu::gemm_batched(ta ? Transpose::yes : Transpose::no, tb ? Transpose::yes : Transpose::no, t.m, t.n, t.k,
                         t.alpha, a_items, lda, b_items_ptrs, ldb, t.beta, c_items_ptrs, ldc);
  // The whole buffer: padding columns and the gaps between items stay untouched.
  CHECK_CLOSE(c, want, kFloat32);
}

}  // namespace

TEST_CASE("gemm_batched: every item matches the float64 reference, in order") {
  Rng rng(0x6a7c);
  const BatchCase cases[] = {
      {1, 5, 7, 3, 0, 1.0f, 0.0f, 1, 1},      // one item
      {4, 17, 9, 33, 0, 1.0f, 0.0f, 1, 1},    // a per-head loop: scores of 4 heads
      {6, 8, 16, 12, 2, 0.35f, 0.0f, 2, 1},   // GQA: pairs of query heads read one key head; scaled; padded
      {6, 12, 5, 9, 1, 1.0f, 1.0f, 1, 3},     // three items sum into each output (beta = 1), in order
      {3, 31, 40, 7, 3, -1.5f, 0.5f, 1, 1},   // alpha and beta
      {4, 6, 5, 3, 0, 1.0f, 0.5f, 1, 2},      // a shared output with beta = 0.5: only the in-order result matches
      {5, 1, 1, 1, 0, 1.0f, 1.0f, 5, 5},      // edge sizes, everything shared
  };
  for (const BatchCase& t : cases)
    for (bool ta : {false, true})
      for (bool tb : {false, true}) check_batch(t, ta, tb, rng);
}

TEST_CASE("gemm_batched: an empty batch does nothing; mismatched pointer counts are refused") {
  std::vector<float> x(16, 1.0f);
  std::vector<const float*> two{x.data(), x.data()}, one{x.data()};
  std::vector<float*> out_two{x.data(), x.data() + 4}, none;
  ops::Cpu::gemm_batched(Transpose::no, Transpose::no, 2, 2, 2, 1.0f, {}, 2, {}, 2, 0.0f, none, 2);
  CHECK(x == std::vector<float>(16, 1.0f));
  try {
    ops::Cpu::gemm_batched(Transpose::no, Transpose::no, 2, 2, 2, 1.0f, two, 2, one, 2, 0.0f, out_two, 2);
    FAIL("a batch of 2 a, 1 b and 2 c pointers was accepted");
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find("got 2 a, 1 b and 2 c pointers") != std::string::npos);
  }
  Trace trace;
  const ScopedTrace recording(trace);
  CHECK_THROWS_AS(ops::Counting::gemm_batched(Transpose::no, Transpose::no, 2, 2, 2, 1.0f, two, 2, one, 2, 0.0f,
                                              out_two, 2),
                  Error);
  ops::Counting::gemm_batched(Transpose::no, Transpose::no, 2, 2, 2, 1.0f, {}, 2, {}, 2, 0.0f, none, 2);
  CHECK(trace.size() == 0);
}

TEST_CASE("gemm_batched on the counting backend: one GEMM event with a count, one item's workspace made count times") {
  MemoryTracker meta(MemorySpace::meta);
  const ScopedTracker scoped(meta);
  for (const auto& [m, n, k] : {std::array<std::int64_t, 3>{4096, 4096, 128}, std::array<std::int64_t, 3>{3, 5, 7}}) {
    CAPTURE(m);
    // Meta buffers: addresses only (never read); 12 heads' scores against one key block.
    Tensor<float> q(Shape{12, m, k}), keys(Shape{n, k}), scores(Shape{12, m, n});
    std::vector<const float*> a, b;
    std::vector<float*> c;
    for (std::int64_t h = 0; h < 12; ++h) {
      a.push_back(q.data() + h * m * k);
      b.push_back(keys.data());
      c.push_back(scores.data() + h * m * n);
    }
    Trace batched, looped;
    meta.set_trace(&batched);
    {
      const ScopedTrace recording(batched);
      ops::Counting::gemm_batched(Transpose::no, Transpose::yes, m, n, k, 0.5f, a, k, b, k, 0.0f, c, n);
    }
    meta.set_trace(&looped);
    {
      const ScopedTrace recording(looped);
      for (std::size_t h = 0; h < 12; ++h)
        ops::Counting::gemm(Transpose::no, Transpose::yes, m, n, k, 0.5f, a[h], k, b[h], k, 0.0f, c[h], n);
    }
    meta.set_trace(nullptr);
    // The batch (after its workspace, when the engine for this size takes one): the first item's GEMM event, then the
    // other 11 as one event marked grouped (disjoint outputs: a device runs the 12 as one launch).
    REQUIRE(batched.size() >= 2);
    const TraceEvent& first = batched.events()[batched.size() - 2];
    const TraceEvent& rest = batched.events().back();
    CHECK(first.kind == TraceKind::gemm);
    CHECK(rest.kind == TraceKind::gemm);
    CHECK(first.count == 1);
    CHECK_FALSE(first.grouped);
    CHECK(rest.count == 11);
    CHECK(rest.grouped);
    for (const TraceEvent* e : {&first, &rest}) {
      CHECK(e->m == double(m));
      CHECK(e->n == double(n));
      CHECK(e->k == double(k));
    }
    // The loop: the same GEMMs (12 calls in all) and the same largest workspace.
    std::int64_t calls = 0;
    double loop_scratch = 0, batch_scratch = 0;
    for (const TraceEvent& e : looped.events()) {
      if (e.kind == TraceKind::gemm) {
        calls += e.count;
        CHECK(e.m == double(m));
      }
      if (e.kind == TraceKind::scratch) loop_scratch = std::max(loop_scratch, e.bytes);
    }
    std::int64_t loop_workspaces = 0, batch_workspaces = 0;  // workspaces made, one after another
    for (const TraceEvent& e : looped.events())
      if (e.kind == TraceKind::scratch) loop_workspaces += e.count;
    for (const TraceEvent& e : batched.events())
      if (e.kind == TraceKind::scratch) batch_scratch = std::max(batch_scratch, e.bytes), batch_workspaces += e.count;
    CHECK(calls == 12);
    CHECK(batch_scratch == loop_scratch);
    CHECK(batch_workspaces == loop_workspaces);  // the time model prices each item's workspace
    CHECK(loop_workspaces == (loop_scratch > 0 ? 12 : 0));
    CHECK(batched.size() == (batch_scratch > 0 ? 3u : 2u));
  }
}

TEST_CASE("gemm_batched on the counting backend: items that share an output run one by one, one event of count") {
  MemoryTracker meta(MemorySpace::meta);
  const ScopedTracker scoped(meta);
  // A GQA group's key gradient: 4 query heads' products summed into 2 outputs (beta = 1), and an alpha of 0.
  Tensor<float> p(Shape{4, 13, 13}), q(Shape{4, 13, 7}), g(Shape{2, 13, 7});
  std::vector<const float*> a, b;
  std::vector<float*> c;
  for (std::int64_t i = 0; i < 4; ++i) {
    a.push_back(p.data() + i * 13 * 13), b.push_back(q.data() + i * 13 * 7), c.push_back(g.data() + (i / 2) * 13 * 7);
  }
  for (const float alpha : {1.0f, 0.0f}) {
    CAPTURE(alpha);
    Trace trace;
    meta.set_trace(&trace);
    {
      const ScopedTrace recording(trace);
      ops::Counting::gemm_batched(Transpose::yes, Transpose::no, 13, 7, 13, alpha, a, 13, b, 7, 1.0f, c, 7);
    }
    meta.set_trace(nullptr);
    std::vector<TraceEvent> gemms;
    for (const TraceEvent& e : trace.events())
      if (e.kind == TraceKind::gemm) gemms.push_back(e);
    REQUIRE(gemms.size() == 1);
    CHECK(gemms[0].count == 4);
    CHECK_FALSE(gemms[0].grouped);
  }
}

TEST_CASE("gemm_outputs_overlap: which batched outputs share an element") {
  std::vector<float> storage(1000);
  float* base = storage.data();
  using ops::cpu::gemm_outputs_overlap;
  CHECK_FALSE(gemm_outputs_overlap(3, 4, 12, std::vector<float*>{base, base + 4, base + 8}));  // column blocks
  CHECK(gemm_outputs_overlap(3, 4, 12, std::vector<float*>{base, base + 3}));                   // one shared column
  CHECK(gemm_outputs_overlap(3, 4, 12, std::vector<float*>{base, base + 24}));                  // row 2 of the first
  CHECK_FALSE(gemm_outputs_overlap(3, 4, 12, std::vector<float*>{base, base + 36}));            // after it
  CHECK(gemm_outputs_overlap(3, 4, 12, std::vector<float*>{base + 10, base + 20}));             // wraps into row 1
  CHECK_FALSE(gemm_outputs_overlap(3, 4, 4, std::vector<float*>{base + 12, base}));             // back to back
  CHECK(gemm_outputs_overlap(3, 4, 12, std::vector<float*>{base + 5, base + 5}));               // the same output
}
