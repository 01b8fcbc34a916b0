// Tests of ops::cuda attention (ops/cuda/attention.hpp) against the float64 reference (tests/ops/reference.hpp):
// the float32 kernels for forward (out, lse) and every gradient (accumulating into nonzero starts), causal and not,
// GQA, blocks at offsets (ring blocks), packed documents, uneven lengths, head dims 8..128, strided q/k/v slices of
// one packed qkv tensor; merge of key blocks == attention over all keys; the bf16 tensor-core kernels with a derived
// bf16 tolerance; bad input.
#include "cuda/device_test.hpp"
#include "ops/attention_checks.hpp"
#include "ops/reference.hpp"
#include "support/tolerance.hpp"

#include "paradyse/core/dtype.hpp"
#include "paradyse/core/rng.hpp"
#include "paradyse/device/caching_allocator.hpp"
#include "paradyse/device/runtime.hpp"
#include "paradyse/device/transfer.hpp"
#include "paradyse/ops/cuda/attention.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

using namespace paradyse;
using namespace paradyse::testing;
using ops::AttentionMask;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

MemoryTracker& device_tracker() {
  static MemoryTracker tracker = device::make_tracker();
  return tracker;
}

template <class T>
Tensor<T> upload(const Tensor<T>& host) { return device::to_device(host.view(), device_tracker()); }
template <class T>
Tensor<T> download(const Tensor<T>& dev) { return device::to_host(dev); }

// bf16 views in float64 (the reference's to_double converts through double(), which bf16 does not offer).
Vec to_double(TensorView<const bf16> x) {
  Tensor<float> f(x.shape());
  TensorView<float> fv = f.view();
  const Shape& st = x.strides();
  for (std::int64_t n = 0; n < x.numel(); ++n) {
    std::int64_t rest = n, offset = 0;
    for (int d = x.rank() - 1; d >= 0; --d) {
      offset += (rest % x.extent(d)) * st[d];
      rest /= x.extent(d);
    }
    fv.data()[n] = float(x.data()[offset]);
  }
  return paradyse::testing::to_double(f);
}
Vec to_double(const Tensor<bf16>& x) { return to_double(TensorView<const bf16>(x.view())); }
using paradyse::testing::to_double;

// Host q, k, v (separate tensors, or slices of one packed [b, s, hq + 2 hkv, d] when packed) and their device copies
// as views of the same layout.
template <class T>
struct Inputs {
  Tensor<T> host_q, host_k, host_v, host_packed;
  Tensor<T> dev_q, dev_k, dev_v, dev_packed;
  TensorView<const T> q, k, v;  // device views
  Vec ref_q, ref_k, ref_v;      // the same values in float64 (after rounding to T)
};

template <class T>
Tensor<T> random_tensor(Shape shape, Rng& rng, double lo = -1.0, double hi = 1.0) {
  Tensor<float> f = random_uniform<float>(shape, rng, lo, hi);
  if constexpr (std::is_same_v<T, float>) {
    return f;
  } else {
    Tensor<T> t(shape);
    for (std::int64_t i = 0; i < f.numel(); ++i) t.data()[i] = T(f.data()[i]);
    return t;
  }
}

template <class T>
Inputs<T> make_inputs(const AttentionShape& s, bool packed, Rng& rng) {
  Inputs<T> in;
  if (packed) {
    REQUIRE(s.sq == s.skv);
    in.host_packed = random_tensor<T>(Shape{s.b, s.sq, s.hq + 2 * s.hkv, s.d}, rng);
    in.dev_packed = upload(in.host_packed);
    const TensorView<const T> host_all = in.host_packed.view(), dev_all = in.dev_packed.view();
    in.ref_q = to_double(host_all.slice(2, 0, s.hq));
    in.ref_k = to_double(host_all.slice(2, s.hq, s.hkv));
    in.ref_v = to_double(host_all.slice(2, s.hq + s.hkv, s.hkv));
    in.q = dev_all.slice(2, 0, s.hq);
    in.k = dev_all.slice(2, s.hq, s.hkv);
    in.v = dev_all.slice(2, s.hq + s.hkv, s.hkv);
  } else {
    in.host_q = random_tensor<T>(Shape{s.b, s.sq, s.hq, s.d}, rng);
    in.host_k = random_tensor<T>(Shape{s.b, s.skv, s.hkv, s.d}, rng);
    in.host_v = random_tensor<T>(Shape{s.b, s.skv, s.hkv, s.d}, rng);
    in.dev_q = upload(in.host_q);
    in.dev_k = upload(in.host_k);
    in.dev_v = upload(in.host_v);
    in.ref_q = to_double(in.host_q);
    in.ref_k = to_double(in.host_k);
    in.ref_v = to_double(in.host_v);
    in.q = in.dev_q.view();
    in.k = in.dev_k.view();
    in.v = in.dev_v.view();
  }
  return in;
}

Tensor<float> filled(Shape shape, float value) {
  Tensor<float> t(shape);
  t.fill(value);
  return t;
}

// float32 forward and backward of one configuration against the reference; gradients start from random values.
void check_f32(const AttentionShape& s, const ReferenceMask& rmask, bool packed, std::uint64_t seed) {
  CAPTURE(s.b); CAPTURE(s.sq); CAPTURE(s.skv); CAPTURE(s.hq); CAPTURE(s.hkv); CAPTURE(s.d);
  CAPTURE(rmask.causal); CAPTURE(rmask.q_offset); CAPTURE(rmask.kv_offset); CAPTURE(rmask.document_starts.size());
  CAPTURE(packed);
  Rng rng(seed);
  Inputs<float> in = make_inputs<float>(s, packed, rng);
  const AttentionMask mask = to_mask(rmask);
  Tensor<float> out = upload(filled(Shape{s.b, s.sq, s.hq, s.d}, 12345.0f));  // overwritten
  Tensor<float> lse = upload(filled(Shape{s.b, s.hq, s.sq}, 12345.0f));
  ops::cuda::attention_forward(in.q, in.k, in.v, mask, out.view(), lse.view());
  const Tensor<float> host_out = download(out), host_lse = download(lse);

  const ReferenceAttention want = reference_attention_forward(s, rmask, in.ref_q, in.ref_k, in.ref_v);
  CHECK_CLOSE(to_double(host_out), want.out, kFloat32);
  check_lse(to_double(host_lse), want.lse, kFloat32);

  const Tensor<float> dout = random_uniform<float>(Shape{s.b, s.sq, s.hq, s.d}, rng);
  const Tensor<float> dq0 = random_uniform<float>(Shape{s.b, s.sq, s.hq, s.d}, rng);
  const Tensor<float> dk0 = random_uniform<float>(Shape{s.b, s.skv, s.hkv, s.d}, rng);
  const Tensor<float> dv0 = random_uniform<float>(Shape{s.b, s.skv, s.hkv, s.d}, rng);
  Tensor<float> dev_dout = upload(dout), dq = upload(dq0), dk = upload(dk0), dv = upload(dv0);
  ops::cuda::attention_backward(in.q, in.k, in.v, out.view(), lse.view(), dev_dout.view(), mask, dq.view(), dk.view(),
                                dv.view());
  const ReferenceAttentionGrads g =
      reference_attention_backward(s, rmask, in.ref_q, in.ref_k, in.ref_v, to_double(dout));
  Vec want_dq = to_double(dq0), want_dk = to_double(dk0), want_dv = to_double(dv0);
  for (std::size_t i = 0; i < want_dq.size(); ++i) want_dq[i] += g.dq[i];
  for (std::size_t i = 0; i < want_dk.size(); ++i) want_dk[i] += g.dk[i];
  for (std::size_t i = 0; i < want_dv.size(); ++i) want_dv[i] += g.dv[i];
  CHECK_CLOSE(to_double(download(dq)), want_dq, kFloat32);
  CHECK_CLOSE(to_double(download(dk)), want_dk, kFloat32);
  CHECK_CLOSE(to_double(download(dv)), want_dv, kFloat32);
}

// ---- bf16 tolerance --------------------------------------------------------------------------------------------------
// The bf16 kernels see inputs that are exact bf16 values (the reference gets the same values in float64), multiply
// them exactly in fp32 and accumulate in fp32 (error ~1e-6 relative, negligible). The bf16 roundings, each of
// relative size at most u = 2^-8 (8 significant bits, round to nearest), are:
//   forward: P rounded before P V, then out rounded:        |err out_ic| <= u sum_j p_ij |v_jc| + u |out_ic|
//   backward: P rounded before dV = P^T dO                  |err dv_jc|  <= u sum_i p_ij |dO_ic|
//             dS = P (dP - delta) rounded before dQ = dS K and dK = dS^T Q, where delta = rowsum(dO * out) uses the
//             bf16 output (error <= 2u sum_c |dO_ic| |out_ic| from the forward bound above, |v| <= 1):
//             |err ds_ij| <= u |ds_ij| + 2u p_ij sum_c |dO_ic||out_ic| <= 3u p_ij (|dP_ij| + sum_c |dO_ic||out_ic|)
//                                                                        =: 3u B_ij
//             |err dq_ic| <= 3u scale sum_j B_ij |k_jc|,  |err dk_jc| <= 3u scale sum_i B_ij |q_ic|;
//   and the accumulation dx = bf16(dx + grad) rounds once more: + u |want|.
// check_bf16 computes these sums from the reference probabilities and compares element by element with
// |got - want| <= 2 * bound + u |want| + 1e-5 (a factor 2 over the bound for the fp32 accumulation and exp2f).
constexpr double kBf16Unit = 1.0 / 256.0;  // 2^-8: the unit roundoff of bf16

struct Bf16Bounds {
  Vec out, dq, dk, dv;
};

Bf16Bounds bf16_bounds(const AttentionShape& s, const ReferenceMask& mask, const Vec& q, const Vec& k, const Vec& v,
                       const Vec& dout, const Vec& out) {
  const double u = kBf16Unit;
  const double scale = mask.scale != 0.0 ? mask.scale : 1.0 / std::sqrt(double(s.d));
  Bf16Bounds r{Vec(q.size(), 0.0), Vec(q.size(), 0.0), Vec(k.size(), 0.0), Vec(k.size(), 0.0)};
  for (std::int64_t bi = 0; bi < s.b; ++bi)
    for (std::int64_t h = 0; h < s.hq; ++h)
      for (std::int64_t i = 0; i < s.sq; ++i) {
        double lse = 0.0;
        const Vec p = reference_probabilities(s, mask, q, k, bi, i, h, lse);
        const std::int64_t kvh = h / (s.hq / s.hkv);
        double do_out = 0.0;
        for (std::int64_t c = 0; c < s.d; ++c)
          do_out += std::abs(dout[s.q_index(bi, i, h, c)]) * std::abs(out[s.q_index(bi, i, h, c)]);
        for (std::int64_t j = 0; j < s.skv; ++j) {
          if (p[j] == 0.0) continue;
          double dp = 0.0;
          for (std::int64_t c = 0; c < s.d; ++c) dp += dout[s.q_index(bi, i, h, c)] * v[s.kv_index(bi, j, kvh, c)];
          const double bij = p[j] * (std::abs(dp) + do_out);
          for (std::int64_t c = 0; c < s.d; ++c) {
            r.out[s.q_index(bi, i, h, c)] += u * p[j] * std::abs(v[s.kv_index(bi, j, kvh, c)]);
            r.dv[s.kv_index(bi, j, kvh, c)] += u * p[j] * std::abs(dout[s.q_index(bi, i, h, c)]);
            r.dq[s.q_index(bi, i, h, c)] += 3 * u * scale * bij * std::abs(k[s.kv_index(bi, j, kvh, c)]);
            r.dk[s.kv_index(bi, j, kvh, c)] += 3 * u * scale * bij * std::abs(q[s.q_index(bi, i, h, c)]);
          }
        }
      }
  return r;
}

// The first element outside |got - want| <= 2 bound + u |want| + 1e-5; empty when all agree.
std::string bf16_mismatch(const Vec& got, const Vec& want, const Vec& bound) {
  if (got.size() != want.size()) return fmt::format("sizes differ: {} vs {}", got.size(), want.size());
  double worst = 0.0;
  std::string first;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double allowed = 2 * bound[i] + kBf16Unit * std::abs(want[i]) + 1e-5;
    const double diff = std::abs(got[i] - want[i]);
    worst = std::max(worst, diff / allowed);
    if (!(diff <= allowed) && first.empty())
      first = fmt::format("element {}: got {:.7g}, want {:.7g} (|diff| {:.3g} > allowed {:.3g})", i, got[i], want[i],
                          diff, allowed);
  }
  if (!first.empty()) first += fmt::format("; worst |diff| / allowed = {:.3g}", worst);
  return first;
}
#define CHECK_BF16(got, want, bound)                                       \
  do {                                                                     \
    const std::string mismatch_ = bf16_mismatch((got), (want), (bound));   \
    CHECK_MESSAGE(mismatch_.empty(), #got ": " << mismatch_);              \
  } while (0)

// bf16 forward and backward of one configuration against the reference of the same (bf16) values.
void check_bf16(const AttentionShape& s, const ReferenceMask& rmask, bool packed, std::uint64_t seed) {
  CAPTURE(s.b); CAPTURE(s.sq); CAPTURE(s.skv); CAPTURE(s.hq); CAPTURE(s.hkv); CAPTURE(s.d);
  CAPTURE(rmask.causal); CAPTURE(rmask.q_offset); CAPTURE(rmask.kv_offset); CAPTURE(rmask.document_starts.size());
  CAPTURE(packed);
  Rng rng(seed);
  Inputs<bf16> in = make_inputs<bf16>(s, packed, rng);
  const AttentionMask mask = to_mask(rmask);
  Tensor<bf16> out = upload(random_tensor<bf16>(Shape{s.b, s.sq, s.hq, s.d}, rng));  // overwritten
  Tensor<float> lse = upload(filled(Shape{s.b, s.hq, s.sq}, 12345.0f));
  ops::cuda::attention_forward(in.q, in.k, in.v, mask, out.view(), lse.view());
  const Vec got_out = to_double(download(out)), got_lse = to_double(download(lse));

  const Tensor<bf16> dout = random_tensor<bf16>(Shape{s.b, s.sq, s.hq, s.d}, rng);
  const Tensor<bf16> dq0 = random_tensor<bf16>(Shape{s.b, s.sq, s.hq, s.d}, rng);
  const Tensor<bf16> dk0 = random_tensor<bf16>(Shape{s.b, s.skv, s.hkv, s.d}, rng);
  const Tensor<bf16> dv0 = random_tensor<bf16>(Shape{s.b, s.skv, s.hkv, s.d}, rng);
  const Vec ref_dout = to_double(dout);
  const ReferenceAttention want = reference_attention_forward(s, rmask, in.ref_q, in.ref_k, in.ref_v);
  const Bf16Bounds bounds = bf16_bounds(s, rmask, in.ref_q, in.ref_k, in.ref_v, ref_dout, want.out);
  CHECK_BF16(got_out, want.out, bounds.out);
  check_lse(got_lse, want.lse, kFloat32);  // fp32 sums of exact products: float32 accuracy

  Tensor<bf16> dev_dout = upload(dout), dq = upload(dq0), dk = upload(dk0), dv = upload(dv0);
  ops::cuda::attention_backward(in.q, in.k, in.v, out.view(), lse.view(), dev_dout.view(), mask, dq.view(), dk.view(),
                                dv.view());
  const ReferenceAttentionGrads g = reference_attention_backward(s, rmask, in.ref_q, in.ref_k, in.ref_v, ref_dout);
  Vec want_dq = to_double(dq0), want_dk = to_double(dk0), want_dv = to_double(dv0);
  for (std::size_t i = 0; i < want_dq.size(); ++i) want_dq[i] += g.dq[i];
  for (std::size_t i = 0; i < want_dk.size(); ++i) want_dk[i] += g.dk[i];
  for (std::size_t i = 0; i < want_dv.size(); ++i) want_dv[i] += g.dv[i];
  CHECK_BF16(to_double(download(dq)), want_dq, bounds.dq);
  CHECK_BF16(to_double(download(dk)), want_dk, bounds.dk);
  CHECK_BF16(to_double(download(dv)), want_dv, bounds.dv);
}

}  // namespace

TEST_CASE("cuda attention float32: non-causal, MHA and GQA, uneven lengths, d = 8 .. 128") {
  PARADYSE_REQUIRE_DEVICE();
  check_f32({1, 37, 100, 4, 2, 64}, {}, false, 1);
  check_f32({2, 100, 37, 2, 2, 128}, {}, false, 2);
  check_f32({1, 33, 70, 3, 1, 72}, {}, false, 3);  // d not a multiple of 32
  check_f32({1, 1, 1, 1, 1, 1}, {}, false, 4);
  ReferenceMask scaled;
  scaled.scale = 0.3;
  check_f32({1, 20, 50, 2, 1, 16}, scaled, false, 5);
}

TEST_CASE("cuda attention float32: causal, and ring blocks at q/kv offsets") {
  PARADYSE_REQUIRE_DEVICE();
  ReferenceMask causal;
  causal.causal = true;
  check_f32({2, 100, 100, 4, 2, 64}, causal, false, 10);
  check_f32({1, 37, 37, 2, 1, 128}, causal, false, 11);
  causal.q_offset = 300;  // queries after the keys: all keys visible
  check_f32({1, 37, 100, 2, 1, 64}, causal, false, 12);
  causal.q_offset = 100;  // overlap: queries 100..229 over keys 40..239
  causal.kv_offset = 40;
  check_f32({1, 130, 200, 2, 2, 16}, causal, false, 13);
  causal.q_offset = 0;  // queries before the keys: nothing visible (out 0, lse -inf, no gradient)
  causal.kv_offset = 500;
  check_f32({1, 20, 30, 2, 1, 8}, causal, false, 14);
}

TEST_CASE("cuda attention float32: strided q/k/v slices of one packed qkv tensor") {
  PARADYSE_REQUIRE_DEVICE();
  ReferenceMask causal;
  causal.causal = true;
  check_f32({2, 100, 100, 4, 2, 64}, causal, true, 20);
  check_f32({1, 37, 37, 2, 2, 128}, {}, true, 21);
}

TEST_CASE("cuda attention float32: packed variable-length documents") {
  PARADYSE_REQUIRE_DEVICE();
  ReferenceMask docs;
  docs.document_starts = {0, 5, 40, 41, 41, 100, 180};  // includes a one-token and an empty document
  check_f32({1, 200, 200, 2, 1, 8}, docs, false, 30);
  docs.causal = true;
  check_f32({1, 200, 200, 4, 2, 64}, docs, false, 31);
  docs.q_offset = 90;  // a block of queries against a block of keys at another offset, documents spanning both
  docs.kv_offset = 30;
  check_f32({1, 100, 120, 2, 1, 32}, docs, false, 32);
}

TEST_CASE("cuda attention_merge of key blocks equals attention over all keys; blockwise backward equals full") {
  PARADYSE_REQUIRE_DEVICE();
  const AttentionShape s{2, 96, 230, 4, 2, 64};
  for (int variant = 0; variant < 3; ++variant) {
    ReferenceMask rmask;
    if (variant >= 1) rmask.causal = true, rmask.q_offset = 150;  // queries 150..245 over keys 0..229
    if (variant == 2) rmask.document_starts = {0, 60, 170, 171};
    CAPTURE(variant);
    Rng rng(50 + variant);
    Inputs<float> in = make_inputs<float>(s, false, rng);
    const ReferenceAttention want = reference_attention_forward(s, rmask, in.ref_q, in.ref_k, in.ref_v);

    // Key blocks of uneven lengths, as ranks of a ring would hold them; merged in an arbitrary order.
    const std::int64_t starts[] = {0, 70, 71, 160, 230};
    const int order[] = {2, 0, 3, 1};
    Tensor<float> out = upload(filled(Shape{s.b, s.sq, s.hq, s.d}, 0.0f));
    Tensor<float> lse = upload(filled(Shape{s.b, s.hq, s.sq}, -float(kInf)));  // the merge identity
    Tensor<float> bo = upload(filled(Shape{s.b, s.sq, s.hq, s.d}, 0.0f));
    Tensor<float> bl = upload(filled(Shape{s.b, s.hq, s.sq}, 0.0f));
    for (int blk : order) {
      AttentionMask mask = to_mask(rmask);
      mask.kv_offset = starts[blk];
      const std::int64_t len = starts[blk + 1] - starts[blk];
      ops::cuda::attention_forward(in.q, in.k.slice(1, starts[blk], len), in.v.slice(1, starts[blk], len), mask,
                                   bo.view(), bl.view());
      ops::cuda::attention_merge(out.view(), lse.view(), bo.view(), bl.view());
    }
    CHECK_CLOSE(to_double(download(out)), want.out, kFloat32);
    check_lse(to_double(download(lse)), want.lse, kFloat32);

    // Backward block by block with the final out and lse; dq accumulates over blocks.
    const Tensor<float> dout = random_uniform<float>(Shape{s.b, s.sq, s.hq, s.d}, rng);
    Tensor<float> dev_dout = upload(dout);
    Tensor<float> dq = upload(filled(Shape{s.b, s.sq, s.hq, s.d}, 0.0f));
    Tensor<float> dk = upload(filled(Shape{s.b, s.skv, s.hkv, s.d}, 0.0f));
    Tensor<float> dv = upload(filled(Shape{s.b, s.skv, s.hkv, s.d}, 0.0f));
    for (int blk : order) {
      AttentionMask mask = to_mask(rmask);
      mask.kv_offset = starts[blk];
      const std::int64_t len = starts[blk + 1] - starts[blk];
      ops::cuda::attention_backward(in.q, in.k.slice(1, starts[blk], len), in.v.slice(1, starts[blk], len),
                                    out.view(), lse.view(), dev_dout.view(), mask, dq.view(),
                                    dk.view().slice(1, starts[blk], len), dv.view().slice(1, starts[blk], len));
    }
    const ReferenceAttentionGrads g =
        reference_attention_backward(s, rmask, in.ref_q, in.ref_k, in.ref_v, to_double(dout));
    CHECK_CLOSE(to_double(download(dq)), g.dq, kFloat32);
    CHECK_CLOSE(to_double(download(dk)), g.dk, kFloat32);
    CHECK_CLOSE(to_double(download(dv)), g.dv, kFloat32);
  }
}

TEST_CASE("cuda attention_merge handles -inf on either side and is stable for large lse") {
  PARADYSE_REQUIRE_DEVICE();
  const Shape out_shape{1, 4, 1, 2}, lse_shape{1, 1, 4};
  Tensor<float> out(out_shape), lse(lse_shape), bo(out_shape), bl(lse_shape);
  const float ninf = -std::numeric_limits<float>::infinity();
  // query 0: both empty; 1: only mine; 2: only theirs; 3: both, with lse near float max (exp(lse) would overflow).
  const float mine[] = {ninf, 2.0f, ninf, 3.0e38f}, theirs[] = {ninf, ninf, 5.0f, 3.0e38f};
  for (int i = 0; i < 4; ++i) {
    lse(0, 0, i) = mine[i];
    bl(0, 0, i) = theirs[i];
    for (int c = 0; c < 2; ++c) {
      out(0, i, 0, c) = mine[i] == ninf ? 0.0f : float(i + c);
      bo(0, i, 0, c) = theirs[i] == ninf ? 0.0f : float(10 * i + c);
    }
  }
  Tensor<float> d_out = upload(out), d_lse = upload(lse), d_bo = upload(bo), d_bl = upload(bl);
  ops::cuda::attention_merge(d_out.view(), d_lse.view(), d_bo.view(), d_bl.view());
  const Tensor<float> got = download(d_out), got_lse = download(d_lse);
  CHECK(got_lse(0, 0, 0) == ninf);
  CHECK(got(0, 0, 0, 0) == 0.0f);
  CHECK(got(0, 0, 0, 1) == 0.0f);
  CHECK(got_lse(0, 0, 1) == doctest::Approx(2.0f));
  CHECK(got(0, 1, 0, 0) == doctest::Approx(1.0f));
  CHECK(got(0, 1, 0, 1) == doctest::Approx(2.0f));
  CHECK(got_lse(0, 0, 2) == doctest::Approx(5.0f));
  CHECK(got(0, 2, 0, 0) == doctest::Approx(20.0f));
  CHECK(got(0, 2, 0, 1) == doctest::Approx(21.0f));
  CHECK(std::isfinite(got_lse(0, 0, 3)));
  CHECK(got_lse(0, 0, 3) == doctest::Approx(3.0e38f));
  CHECK(got(0, 3, 0, 0) == doctest::Approx((3.0f + 30.0f) / 2));
  CHECK(got(0, 3, 0, 1) == doctest::Approx((4.0f + 31.0f) / 2));
}

TEST_CASE("cuda attention bf16 tensor cores: forward and backward against the float64 reference") {
  PARADYSE_REQUIRE_DEVICE();
  ReferenceMask causal;
  causal.causal = true;
  check_bf16({1, 100, 100, 4, 2, 64}, causal, false, 60);  // GQA, uneven tiles (100 = 64 + 36)
  check_bf16({2, 130, 200, 2, 2, 128}, {}, false, 61);
  check_bf16({1, 37, 37, 2, 1, 128}, causal, true, 62);    // strided slices of a packed qkv
  ReferenceMask ring;
  ring.causal = true;
  ring.q_offset = 100;  // a ring block: queries 100..229 over keys 40..239
  ring.kv_offset = 40;
  check_bf16({1, 130, 200, 2, 1, 64}, ring, false, 63);
  ReferenceMask docs;
  docs.causal = true;
  docs.document_starts = {0, 5, 40, 41, 41, 100, 180};
  check_bf16({1, 200, 200, 2, 2, 64}, docs, false, 64);
  ReferenceMask none;  // queries before every key: out 0, lse -inf, no gradient
  none.causal = true;
  none.kv_offset = 500;
  check_bf16({1, 20, 30, 2, 1, 64}, none, false, 65);
}

TEST_CASE("cuda attention rejects bad input with a message naming the value") {
  PARADYSE_REQUIRE_DEVICE();
  // The checks run before any device access: null data pointers with the shapes under test suffice.
  const auto f = [](Shape s) { return TensorView<float>(nullptr, s); };
  const auto cf = [](Shape s) { return TensorView<const float>(nullptr, s); };
  const Shape q{1, 4, 2, 8}, kv{1, 5, 2, 8}, lse{1, 2, 4};
  CHECK_THROWS_WITH_AS(ops::cuda::attention_forward(cf(q), cf(kv), cf(Shape{1, 5, 2, 4}), {}, f(q), f(lse)),
                       doctest::Contains("must have the same shape"), Error);
  CHECK_THROWS_WITH_AS(ops::cuda::attention_forward(cf(q), cf(kv), cf(kv), {}, f(q), f(Shape{1, 4, 2})),
                       doctest::Contains("lse has shape"), Error);
  CHECK_THROWS_WITH_AS(ops::cuda::attention_forward(cf(Shape{1, 4, 3, 8}), cf(kv), cf(kv), {}, f(Shape{1, 4, 3, 8}),
                                                    f(Shape{1, 3, 4})),
                       doctest::Contains("multiple of kv heads"), Error);
  CHECK_THROWS_WITH_AS(ops::cuda::attention_backward(cf(q), cf(kv), cf(kv), cf(q), cf(lse), cf(q), {}, f(q),
                                                     f(Shape{1, 5, 2, 7}), f(kv)),
                       doctest::Contains("dk has shape"), Error);
  CHECK_THROWS_WITH_AS(ops::cuda::attention_merge(f(q), f(lse), cf(q), cf(Shape{1, 4, 2})),
                       doctest::Contains("block_lse has shape"), Error);
  const auto b = [](Shape s) { return TensorView<bf16>(nullptr, s); };
  const auto cb = [](Shape s) { return TensorView<const bf16>(nullptr, s); };
  CHECK_THROWS_WITH_AS(ops::cuda::attention_forward(cb(q), cb(kv), cb(kv), {}, b(q), f(lse)),
                       doctest::Contains("head_dim 64 and 128, not 8"), Error);
  const Shape q64{1, 4, 2, 64}, kv64{1, 5, 2, 64};
  CHECK_THROWS_WITH_AS(ops::cuda::attention_backward(cb(q64), cb(kv64), cb(kv64), cb(q64), cf(lse), cb(q64), {},
                                                     b(q64), b(kv64), b(Shape{1, 5, 1, 64})),
                       doctest::Contains("dv has shape"), Error);
  // A packed qkv whose rows are not 16-byte aligned (heads of 64 at an odd element offset).
  const TensorView<const bf16> odd(reinterpret_cast<const bf16*>(std::uintptr_t(2)), q64, Shape{4 * 2 * 64, 2 * 64, 64, 1});
  CHECK_THROWS_WITH_AS(ops::cuda::attention_forward(odd, cb(kv64), cb(kv64), {}, b(q64), f(lse)),
                       doctest::Contains("16-byte aligned"), Error);
}
