// Tests of paradyse/ops/cpu/attention.hpp against the float64 reference (tests/ops/reference.hpp): forward (out
// and lse) and every gradient, causal and not, GQA, packed variable-length batches, blocks at offsets, strided
// q/k/v (slices of one packed qkv tensor), merge of partial results = attention over all keys (and block-by-block
// backward = full backward), extreme logits, linear memory, bad input.
#include "paradyse/ops/cpu/attention.hpp"

#include "paradyse/core/rng.hpp"
#include "support/tolerance.hpp"
#include "ops/attention_checks.hpp"
#include "ops/reference.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <thread>
#include <vector>

using namespace paradyse;
using namespace paradyse::testing;
using ops::AttentionMask;

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// q, k, v as views: either separate contiguous tensors, or (packed, sq == skv) slices of one [b, s, hq+2hkv, d].
struct Inputs {
  Tensor<float> q_store, k_store, v_store, packed;
  TensorView<const float> q, k, v;
};

Inputs make_inputs(const AttentionShape& s, bool packed, Rng& rng, double magnitude = 1.0) {
  Inputs in;
  if (packed) {
    REQUIRE(s.sq == s.skv);
    in.packed = random_uniform<float>(Shape{s.b, s.sq, s.hq + 2 * s.hkv, s.d}, rng, -magnitude, magnitude);
    const TensorView<const float> all = in.packed.view();
    in.q = all.slice(2, 0, s.hq);
    in.k = all.slice(2, s.hq, s.hkv);
    in.v = all.slice(2, s.hq + s.hkv, s.hkv);
  } else {
    in.q_store = random_uniform<float>(Shape{s.b, s.sq, s.hq, s.d}, rng, -magnitude, magnitude);
    in.k_store = random_uniform<float>(Shape{s.b, s.skv, s.hkv, s.d}, rng, -magnitude, magnitude);
    in.v_store = random_uniform<float>(Shape{s.b, s.skv, s.hkv, s.d}, rng);
    in.q = in.q_store.view();
    in.k = in.k_store.view();
    in.v = in.v_store.view();
  }
  return in;
}

// Forward and backward of one configuration against the reference. Gradients start from random values to check
// that backward accumulates.
void check_attention(const AttentionShape& s, const ReferenceMask& rmask, bool packed, std::uint64_t seed) {
  CAPTURE(s.b); CAPTURE(s.sq); CAPTURE(s.skv); CAPTURE(s.hq); CAPTURE(s.hkv); CAPTURE(s.d);
  CAPTURE(rmask.causal); CAPTURE(rmask.q_offset); CAPTURE(rmask.kv_offset); CAPTURE(rmask.document_starts.size());
  CAPTURE(packed);
  Rng rng(seed);
  Inputs in = make_inputs(s, packed, rng);
  const AttentionMask mask = to_mask(rmask);
  Tensor<float> out(Shape{s.b, s.sq, s.hq, s.d}), lse(Shape{s.b, s.hq, s.sq});
  out.fill(12345.0f);  // overwritten
  ops::cpu::attention_forward(in.q, in.k, in.v, mask, out.view(), lse.view());

  const Vec q = to_double(in.q), k = to_double(in.k), v = to_double(in.v);
  const ReferenceAttention want = reference_attention_forward(s, rmask, q, k, v);
  CHECK_CLOSE(to_double(out), want.out, kFloat32);
  check_lse(to_double(lse), want.lse);

  Tensor<float> dout = random_uniform<float>(Shape{s.b, s.sq, s.hq, s.d}, rng);
  Tensor<float> dq = random_uniform<float>(Shape{s.b, s.sq, s.hq, s.d}, rng);
  Tensor<float> dk = random_uniform<float>(Shape{s.b, s.skv, s.hkv, s.d}, rng);
  Tensor<float> dv = random_uniform<float>(Shape{s.b, s.skv, s.hkv, s.d}, rng);
  Vec want_dq = to_double(dq), want_dk = to_double(dk), want_dv = to_double(dv);
  const ReferenceAttentionGrads g = reference_attention_backward(s, rmask, q, k, v, to_double(dout));
  for (std::size_t i = 0; i < want_dq.size(); ++i) want_dq[i] += g.dq[i];
  for (std::size_t i = 0; i < want_dk.size(); ++i) want_dk[i] += g.dk[i];
  for (std::size_t i = 0; i < want_dv.size(); ++i) want_dv[i] += g.dv[i];
  ops::cpu::attention_backward(in.q, in.k, in.v, out.view(), lse.view(), dout.view(), mask, dq.view(), dk.view(),
                               dv.view());
  CHECK_CLOSE(to_double(dq), want_dq, kFloat32);
  CHECK_CLOSE(to_double(dk), want_dk, kFloat32);
  CHECK_CLOSE(to_double(dv), want_dv, kFloat32);
}

}  // namespace

TEST_CASE("attention, non-causal, several tiles, MHA and GQA") {
  check_attention({2, 150, 300, 4, 2, 8}, {}, false, 1);
  check_attention({1, 200, 70, 3, 3, 16}, {}, false, 2);
  check_attention({1, 33, 33, 6, 1, 72}, {}, false, 3);
  check_attention({1, 140, 300, 2, 1, 136}, {}, false, 5);  // head_dim > 128: the smaller tiling
  check_attention({1, 1, 1, 1, 1, 1}, {}, false, 4);
}

TEST_CASE("attention, causal, with q and kv blocks at offsets") {
  ReferenceMask causal;
  causal.causal = true;
  check_attention({2, 140, 140, 4, 2, 8}, causal, false, 10);  // the diagonal crosses several tiles
  causal.q_offset = 300;                                       // queries after the keys: all keys visible
  check_attention({1, 50, 160, 2, 1, 8}, causal, false, 11);
  causal.q_offset = 100;                                       // overlap: queries 100..229 over keys 40..239
  causal.kv_offset = 40;
  check_attention({1, 130, 200, 2, 2, 8}, causal, false, 12);
  causal.q_offset = 0;                                         // queries before the keys: nothing visible
  causal.kv_offset = 500;
  check_attention({1, 20, 30, 2, 1, 8}, causal, false, 13);
  causal.q_offset = 250;                                       // many tiles, the diagonal crossing tile borders
  causal.kv_offset = 0;
  check_attention({1, 300, 600, 2, 1, 4}, causal, false, 14);
  check_attention({1, 200, 500, 2, 1, 136}, causal, false, 15);
}

TEST_CASE("attention, packed q/k/v slices of one qkv tensor (strided views)") {
  ReferenceMask causal;
  causal.causal = true;
  check_attention({2, 90, 90, 4, 2, 16}, causal, true, 20);
  check_attention({1, 130, 130, 2, 2, 8}, {}, true, 21);
}

TEST_CASE("attention, packed variable-length documents") {
  ReferenceMask docs;
  docs.document_starts = {0, 5, 40, 41, 41, 100, 180};  // includes a one-token and an empty document
  check_attention({1, 200, 200, 2, 1, 8}, docs, false, 30);
  docs.causal = true;
  check_attention({1, 200, 200, 4, 2, 8}, docs, false, 31);
  docs.q_offset = 90;  // a block of queries against a block of keys at another offset, documents spanning both
  docs.kv_offset = 30;
  check_attention({2, 100, 120, 2, 2, 8}, docs, false, 32);
  ReferenceMask docs_scaled = docs;
  docs_scaled.scale = 0.3;
  check_attention({1, 100, 120, 2, 1, 4}, docs_scaled, false, 33);
}

TEST_CASE("attention gradients of the float64 reference pass finite differences (tiny shapes)") {
  const AttentionShape s{1, 4, 5, 2, 1, 3};
  for (int variant = 0; variant < 3; ++variant) {
    ReferenceMask mask;
    if (variant >= 1) mask.causal = true, mask.q_offset = 2, mask.kv_offset = 1;
    if (variant == 2) mask.document_starts = {0, 3};
    CAPTURE(variant);
    Rng rng(40 + variant);
    Vec q(s.b * s.sq * s.hq * s.d), k(s.b * s.skv * s.hkv * s.d), v(k.size()), dout(q.size());
    rng.fill_uniform(std::span<double>(q));
    rng.fill_uniform(std::span<double>(k));
    rng.fill_uniform(std::span<double>(v));
    rng.fill_uniform(std::span<double>(dout));
    const auto loss = [&] { return dot(reference_attention_forward(s, mask, q, k, v).out, dout); };
    const ReferenceAttentionGrads g = reference_attention_backward(s, mask, q, k, v, dout);
    CHECK_CLOSE(g.dq, finite_difference(q, loss), kFiniteDifference);
    CHECK_CLOSE(g.dk, finite_difference(k, loss), kFiniteDifference);
    CHECK_CLOSE(g.dv, finite_difference(v, loss), kFiniteDifference);
  }
}

TEST_CASE("attention_merge of key blocks equals attention over all keys; blockwise backward equals full backward") {
  const AttentionShape s{2, 96, 230, 4, 2, 8};
  for (int variant = 0; variant < 3; ++variant) {
    ReferenceMask rmask;
    if (variant >= 1) rmask.causal = true, rmask.q_offset = 150;  // queries 150..245 over keys 0..229
    if (variant == 2) rmask.document_starts = {0, 60, 170, 171};
    CAPTURE(variant);
    Rng rng(50 + variant);
    Inputs in = make_inputs(s, false, rng);
    const Vec q = to_double(in.q), k = to_double(in.k), v = to_double(in.v);
    const ReferenceAttention want = reference_attention_forward(s, rmask, q, k, v);

    // Key blocks of uneven lengths, as ranks of a ring would hold them; merged in an arbitrary order.
    const std::int64_t starts[] = {0, 70, 71, 160, 230};
    const int order[] = {2, 0, 3, 1};
    Tensor<float> out(Shape{s.b, s.sq, s.hq, s.d}), lse(Shape{s.b, s.hq, s.sq});
    lse.fill(-kInf);  // the merge identity: nothing seen yet
    std::vector<Tensor<float>> block_out, block_lse;
    for (int blk : order) {
      AttentionMask mask = to_mask(rmask);
      mask.kv_offset = starts[blk];
      const std::int64_t len = starts[blk + 1] - starts[blk];
      Tensor<float> bo(Shape{s.b, s.sq, s.hq, s.d}), bl(Shape{s.b, s.hq, s.sq});
      ops::cpu::attention_forward(in.q, in.k.slice(1, starts[blk], len), in.v.slice(1, starts[blk], len), mask,
                                  bo.view(), bl.view());
      ops::cpu::attention_merge(out.view(), lse.view(), bo.view(), bl.view());
    }
    CHECK_CLOSE(to_double(out), want.out, kFloat32);
    check_lse(to_double(lse), want.lse);

    // Backward block by block with the final out and lse; dq accumulates over blocks.
    Tensor<float> dout = random_uniform<float>(Shape{s.b, s.sq, s.hq, s.d}, rng);
    Tensor<float> dq(Shape{s.b, s.sq, s.hq, s.d}), dk(Shape{s.b, s.skv, s.hkv, s.d}), dv(Shape{s.b, s.skv, s.hkv, s.d});
    for (int blk : order) {
      AttentionMask mask = to_mask(rmask);
      mask.kv_offset = starts[blk];
      const std::int64_t len = starts[blk + 1] - starts[blk];
      ops::cpu::attention_backward(in.q, in.k.slice(1, starts[blk], len), in.v.slice(1, starts[blk], len), out.view(),
                                   lse.view(), dout.view(), mask, dq.view(), dk.view().slice(1, starts[blk], len),
                                   dv.view().slice(1, starts[blk], len));
    }
    const ReferenceAttentionGrads g = reference_attention_backward(s, rmask, q, k, v, to_double(dout));
    CHECK_CLOSE(to_double(dq), g.dq, kFloat32);
    CHECK_CLOSE(to_double(dk), g.dk, kFloat32);
    CHECK_CLOSE(to_double(dv), g.dv, kFloat32);
  }
}

TEST_CASE("attention_merge handles -inf on either side and is stable for large lse") {
  const Shape out_shape{1, 4, 1, 2}, lse_shape{1, 1, 4};
  Tensor<float> out(out_shape), lse(lse_shape), bo(out_shape), bl(lse_shape);
  // query 0: both empty; 1: only mine; 2: only theirs; 3: both, with lse near float max (exp(lse) would overflow).
  const float mine[] = {-kInf, 2.0f, -kInf, 3.0e38f}, theirs[] = {-kInf, -kInf, 5.0f, 3.0e38f - 0.0f};
  for (int i = 0; i < 4; ++i) {
    lse(0, 0, i) = mine[i];
    bl(0, 0, i) = theirs[i];
    for (int c = 0; c < 2; ++c) {
      out(0, i, 0, c) = mine[i] == -kInf ? 0.0f : float(i + c);
      bo(0, i, 0, c) = theirs[i] == -kInf ? 0.0f : float(10 * i + c);
    }
  }
  ops::cpu::attention_merge(out.view(), lse.view(), bo.view(), bl.view());
  CHECK(lse(0, 0, 0) == -kInf);
  CHECK(out(0, 0, 0, 0) == 0.0f);
  CHECK(lse(0, 0, 1) == 2.0f);
  CHECK(out(0, 1, 0, 1) == 2.0f);
  CHECK(lse(0, 0, 2) == 5.0f);
  CHECK(out(0, 2, 0, 1) == 21.0f);
  CHECK(std::isfinite(lse(0, 0, 3)));
  // Equal lse on both sides: the average, and lse + log 2 (which rounds to lse at this magnitude).
  CHECK(out(0, 3, 0, 0) == doctest::Approx(0.5 * (3 + 30)));
  CHECK(lse(0, 0, 3) == doctest::Approx(3.0e38));
}

TEST_CASE("attention with extreme logits (scores near float max) has no NaN or overflow") {
  // d = 4, scale 1, entries up to 8e18: scores reach +-2.5e38 (float max is 3.4e38).
  const AttentionShape s{1, 40, 60, 2, 1, 4};
  for (bool causal : {false, true}) {
    ReferenceMask rmask;
    rmask.causal = causal;
    rmask.scale = 1.0;
    rmask.document_starts = {0, 17};
    CAPTURE(causal);
    Rng rng(60);
    Inputs in = make_inputs(s, false, rng, 8e18);
    const AttentionMask mask = to_mask(rmask);
    Tensor<float> out(Shape{s.b, s.sq, s.hq, s.d}), lse(Shape{s.b, s.hq, s.sq});
    ops::cpu::attention_forward(in.q, in.k, in.v, mask, out.view(), lse.view());
    const Vec q = to_double(in.q), k = to_double(in.k), v = to_double(in.v);
    const ReferenceAttention want = reference_attention_forward(s, rmask, q, k, v);
    CHECK_CLOSE(to_double(out), want.out, kFloat32);
    check_lse(to_double(lse), want.lse);

    Tensor<float> dout = random_uniform<float>(Shape{s.b, s.sq, s.hq, s.d}, rng);
    Tensor<float> dq(Shape{s.b, s.sq, s.hq, s.d}), dk(Shape{s.b, s.skv, s.hkv, s.d}), dv(Shape{s.b, s.skv, s.hkv, s.d});
    ops::cpu::attention_backward(in.q, in.k, in.v, out.view(), lse.view(), dout.view(), mask, dq.view(), dk.view(),
                                 dv.view());
    const auto all_finite = [](const Tensor<float>& t) {
      for (float x : t.span())
        if (!std::isfinite(x)) return false;
      return true;
    };
    CHECK(all_finite(out));
    CHECK(all_finite(dq));
    CHECK(all_finite(dk));
    CHECK(all_finite(dv));
    // The probabilities are one-hot here, so dv is exact: each key receives the dout of the queries it wins.
    const ReferenceAttentionGrads g = reference_attention_backward(s, rmask, q, k, v, to_double(dout));
    CHECK_CLOSE(to_double(dv), g.dv, kFloat32);
  }

  SUBCASE("equal huge scores: uniform probabilities in forward, finite gradients") {
    const AttentionShape u{1, 8, 30, 1, 1, 4};
    ReferenceMask rmask;
    rmask.scale = 1.0;
    Tensor<float> q(Shape{1, 8, 1, 4}), k(Shape{1, 30, 1, 4});
    Rng rng(61);
    Tensor<float> v = random_uniform<float>(Shape{1, 30, 1, 4}, rng);
    q.fill(8e18f);
    k.fill(8e18f);  // every score is 2.56e38
    Tensor<float> out(Shape{1, 8, 1, 4}), lse(Shape{1, 1, 8});
    ops::cpu::attention_forward(q.view(), k.view(), v.view(), to_mask(rmask), out.view(), lse.view());
    const ReferenceAttention want = reference_attention_forward(u, rmask, to_double(q), to_double(k), to_double(v));
    CHECK_CLOSE(to_double(out), want.out, kFloat32);
    check_lse(to_double(lse), want.lse);
    Tensor<float> dout = random_uniform<float>(Shape{1, 8, 1, 4}, rng);
    Tensor<float> dq(Shape{1, 8, 1, 4}), dk(Shape{1, 30, 1, 4}), dv(Shape{1, 30, 1, 4});
    ops::cpu::attention_backward(q.view(), k.view(), v.view(), out.view(), lse.view(), dout.view(), to_mask(rmask),
                                 dq.view(), dk.view(), dv.view());
    // lse = 2.56e38 + log(30) rounds to 2.56e38 in float, so the probabilities cannot be recovered from lse
    // exactly here: backward only has to stay finite.
    for (float x : dv.span()) CHECK(std::isfinite(x));
    for (float x : dq.span()) CHECK(std::isfinite(x));
    for (float x : dk.span()) CHECK(std::isfinite(x));
  }
}

TEST_CASE("attention moderately large logits (exp would overflow without the max) match in forward and backward") {
  ReferenceMask rmask;
  rmask.causal = true;
  rmask.scale = 1.0;
  const AttentionShape s{1, 50, 50, 2, 1, 8};
  Rng rng(70);
  Inputs in = make_inputs(s, false, rng, 6.0);  // scores up to ~290: e^290 overflows float
  const Vec q = to_double(in.q), k = to_double(in.k), v = to_double(in.v);
  Tensor<float> out(Shape{s.b, s.sq, s.hq, s.d}), lse(Shape{s.b, s.hq, s.sq});
  ops::cpu::attention_forward(in.q, in.k, in.v, to_mask(rmask), out.view(), lse.view());
  const ReferenceAttention want = reference_attention_forward(s, rmask, q, k, v);
  CHECK_CLOSE(to_double(out), want.out, kFloat32);
  check_lse(to_double(lse), want.lse);
}

TEST_CASE("attention memory stays linear in the sequence length") {
  const std::int64_t s = 2048, d = 16;
  Rng rng(80);
  Tensor<float> q = random_uniform<float>(Shape{1, s, 1, d}, rng);
  Tensor<float> k = random_uniform<float>(Shape{1, s, 1, d}, rng);
  Tensor<float> v = random_uniform<float>(Shape{1, s, 1, d}, rng);
  Tensor<float> out(Shape{1, s, 1, d}), lse(Shape{1, 1, s}), dq(q.shape()), dk(k.shape()), dv(v.shape());
  MemoryTracker tracker;
  {
    ScopedTracker scope(tracker);
    AttentionMask mask;
    mask.causal = true;
    ops::cpu::attention_forward(q.view(), k.view(), v.view(), mask, out.view(), lse.view());
    ops::cpu::attention_backward(q.view(), k.view(), v.view(), out.view(), lse.view(), out.view(), mask, dq.view(),
                                 dk.view(), dv.view());
  }
  CHECK(tracker.in_use() == 0);
  CHECK(tracker.peak() > 0);  // the workspace goes through the tracker
  // An s x s score matrix would be 16 MiB; the workspace is tiles plus O(s) per-query terms.
  CHECK(tracker.peak() < std::size_t(s) * s * sizeof(float) / 32);
}

TEST_CASE("attention rejects bad input with a message naming the value") {
  Tensor<float> q(Shape{1, 4, 3, 8}), k(Shape{1, 5, 2, 8}), v(Shape{1, 5, 2, 8});
  Tensor<float> out(Shape{1, 4, 3, 8}), lse(Shape{1, 3, 4});
  CHECK_THROWS_WITH_AS(ops::cpu::attention_forward(q.view(), k.view(), v.view(), {}, out.view(), lse.view()),
                       doctest::Contains("kv heads = 2"), Error);
  Tensor<float> q2(Shape{1, 4, 4, 8}), out2(Shape{1, 4, 4, 8}), lse_bad(Shape{1, 4, 5});
  CHECK_THROWS_AS(ops::cpu::attention_forward(q2.view(), k.view(), v.view(), {}, out2.view(), lse_bad.view()), Error);
  Tensor<float> v_bad(Shape{1, 6, 2, 8});
  Tensor<float> lse2(Shape{1, 4, 4});
  CHECK_THROWS_AS(ops::cpu::attention_forward(q2.view(), k.view(), v_bad.view(), {}, out2.view(), lse2.view()), Error);
  // Non-unit stride on d: every other element of a [.., 16] tensor.
  Tensor<float> wide(Shape{1, 4, 4, 16});
  const TensorView<const float> strided(wide.data(), Shape{1, 4, 4, 8}, Shape{256, 64, 16, 2});
  CHECK_THROWS_AS(ops::cpu::attention_forward(strided, k.view(), v.view(), {}, out2.view(), lse2.view()), Error);
  const std::vector<std::int64_t> bad_starts = {1, 3};
  AttentionMask bad;
  bad.document_starts = bad_starts;
  CHECK_THROWS_WITH_AS(ops::cpu::attention_forward(q2.view(), k.view(), v.view(), bad, out2.view(), lse2.view()),
                       doctest::Contains("start at position 0"), Error);
  AttentionMask negative;
  negative.kv_offset = -3;
  CHECK_THROWS_AS(ops::cpu::attention_forward(q2.view(), k.view(), v.view(), negative, out2.view(), lse2.view()),
                  Error);
  Tensor<float> dq(q2.shape()), dk(Shape{1, 5, 2, 8}), dv_bad(Shape{1, 5, 2, 7});
  CHECK_THROWS_AS(ops::cpu::attention_backward(q2.view(), k.view(), v.view(), out2.view(), lse2.view(), out2.view(), {},
                                               dq.view(), dk.view(), dv_bad.view()),
                  Error);
  Tensor<float> lse_merge_bad(Shape{1, 4, 3});
  CHECK_THROWS_AS(ops::cpu::attention_merge(out2.view(), lse2.view(), out2.view(), lse_merge_bad.view()), Error);
}

TEST_CASE("attention is right at every instruction-set level this CPU has") {
  for (ops::cpu::SimdLevel level : {ops::cpu::SimdLevel::base, ops::cpu::SimdLevel::avx2, ops::cpu::SimdLevel::avx512}) {
    CAPTURE(int(level));
    ops::cpu::limit_simd_level(level);
    ReferenceMask docs;
    docs.causal = true;
    docs.document_starts = {0, 37, 90};
    check_attention({1, 150, 150, 2, 1, 24}, docs, false, 90 + int(level));
    check_attention({1, 70, 140, 2, 2, 8}, {}, false, 95 + int(level));
  }
  ops::cpu::limit_simd_level(ops::cpu::SimdLevel::avx512);
}

TEST_CASE("attention through the built-in fallback GEMM") {
  ops::cpu::set_gemm_engine(ops::cpu::GemmEngine::fallback);
  ReferenceMask causal;
  causal.causal = true;
  causal.q_offset = 64;
  check_attention({1, 130, 190, 4, 2, 16}, causal, false, 110);
  check_attention({2, 80, 80, 2, 2, 8}, {}, true, 111);
  ops::cpu::set_gemm_engine(ops::cpu::kGemmUsesCblas ? ops::cpu::GemmEngine::cblas : ops::cpu::GemmEngine::fallback);
}

TEST_CASE("attention on several threads at once (each rank is a thread) gives the single-thread results") {
  const AttentionShape s{1, 200, 300, 2, 1, 32};
  Rng rng(120);
  Inputs in = make_inputs(s, false, rng);
  AttentionMask mask;
  mask.causal = true;
  mask.q_offset = 100;
  Tensor<float> want_out(Shape{s.b, s.sq, s.hq, s.d}), want_lse(Shape{s.b, s.hq, s.sq});
  ops::cpu::attention_forward(in.q, in.k, in.v, mask, want_out.view(), want_lse.view());
  constexpr int kThreads = 4;
  std::vector<Tensor<float>> outs, lses;
  for (int t = 0; t < kThreads; ++t) {
    outs.emplace_back(Shape{s.b, s.sq, s.hq, s.d});
    lses.emplace_back(Shape{s.b, s.hq, s.sq});
  }
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      for (int repeat = 0; repeat < 3; ++repeat)
        ops::cpu::attention_forward(in.q, in.k, in.v, mask, outs[t].view(), lses[t].view());
    });
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) {
    CHECK(std::equal(outs[t].span().begin(), outs[t].span().end(), want_out.span().begin()));
    CHECK(std::equal(lses[t].span().begin(), lses[t].span().end(), want_lse.span().begin()));
  }
}
