// ops::cuda copy, fill and add_into on device views of any strides against ops::cpu on the same data, and the cuBLAS
// GEMMs (gemm, matmul, gemm_batched, gemm_grouped, bf16) against ops::cpu and the float64 reference.
#include "cuda/device_test.hpp"

#include "ops/reference.hpp"
#include "support/fresh_seed.hpp"
#include "support/tolerance.hpp"

#include "paradyse/core/dtype.hpp"
#include "paradyse/core/memory.hpp"
#include "paradyse/core/rng.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/device/caching_allocator.hpp"
#include "paradyse/device/transfer.hpp"
#include "paradyse/ops/cpu/gemm.hpp"
#include "paradyse/ops/cpu/gemm_batched.hpp"
#include "paradyse/ops/cpu/gemm_grouped.hpp"
#include "paradyse/ops/cpu/tensor_ops.hpp"
#include "paradyse/ops/cuda/gemm.hpp"
#include "paradyse/ops/cuda/tensor_ops.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace pd = paradyse;
namespace dev = paradyse::device;
using pd::ops::Transpose;
using pd::testing::Tolerance;

namespace {

constexpr Tolerance kExact{0.0, 0.0};

std::vector<float> random_vector(std::size_t n, std::uint64_t seed) {
  std::vector<float> v(n);
  pd::Rng rng(seed);
  rng.fill_uniform(std::span<float>(v));
  return v;
}

template <class T>
pd::Tensor<T> upload(const std::vector<T>& v, pd::MemoryTracker& tracker) {
  return dev::to_device(pd::TensorView<const T>(v.data(), pd::Shape{std::int64_t(v.size())}), tracker);
}

template <class T>
std::vector<T> download(const pd::Tensor<T>& d) {
  const auto host = dev::to_host(d);
  return {host.span().begin(), host.span().end()};
}

// `count` bf16 values uniform in [-1, 1] from `seed`.
std::vector<pd::bf16> random_bf16(std::size_t count, std::uint64_t seed) {
  std::vector<pd::bf16> v(count);
  pd::Rng rng(seed);
  for (auto& x : v) x = pd::bf16(float(rng.uniform(-1.0, 1.0)));
  return v;
}

// bf16 or float values, exactly, as doubles (the reference's).
template <class T>
pd::testing::Vec as_double(const std::vector<T>& v) {
  pd::testing::Vec out;
  for (const T& x : v) out.push_back(double(float(x)));
  return out;
}

const char* name(Transpose t) { return t == Transpose::yes ? "T" : "N"; }

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("cuda copy, fill, add_into on strided device views match ops::cpu (add_into accumulates)") {
  PARADYSE_REQUIRE_DEVICE();
  pd::MemoryTracker tracker = dev::make_tracker();
  std::vector<float> x = random_vector(4 * 6 * 5, 1), y = random_vector(4 * 5 * 6, 2);  // y: nonzero destination
  pd::Tensor<float> dx = upload(x, tracker), dy = upload(y, tracker);
  const pd::Shape x_shape{4, 6, 5};
  const auto host_x = [&] { return pd::TensorView<float>(x.data(), x_shape); };
  const auto device_x = [&] { return pd::TensorView<float>(dx.data(), x_shape); };
  // A [4, 6, 3] view of y's 120 elements with strides {30, 1, 6}: the last dimension is not unit-stride.
  const pd::Shape view_shape{4, 6, 3}, view_strides{30, 1, 6};
  const pd::TensorView<float> host_y(y.data(), view_shape, view_strides);
  const pd::TensorView<float> device_y(dy.data(), view_shape, view_strides);

  SUBCASE("copy: column slice -> strided view") {
    pd::ops::cpu::copy(pd::TensorView<const float>(host_x().slice(2, 1, 3)), host_y);
    pd::ops::cuda::copy(device_x().slice(2, 1, 3), device_y);
    CHECK_CLOSE(download(dy), y, kExact);
  }
  SUBCASE("copy: contiguous") {
    pd::ops::cpu::copy(pd::TensorView<const float>(host_x().slice(0, 1, 2)), pd::TensorView<float>(y.data(), pd::Shape{2, 6, 5}));
    pd::ops::cuda::copy(device_x().slice(0, 1, 2), pd::TensorView<float>(dy.data(), pd::Shape{2, 6, 5}));
    CHECK_CLOSE(download(dy), y, kExact);
  }
  SUBCASE("fill: a middle slice, a strided view and a contiguous view") {
    pd::ops::cpu::fill(host_x().slice(1, 2, 3), 3.25f);
    pd::ops::cuda::fill(device_x().slice(1, 2, 3), 3.25f);
    pd::ops::cpu::fill(host_y, -1.5f);
    pd::ops::cuda::fill(device_y, -1.5f);
    CHECK_CLOSE(download(dx), x, kExact);
    CHECK_CLOSE(download(dy), y, kExact);
    pd::ops::cpu::fill(host_x(), 0.5f);
    pd::ops::cuda::fill(device_x(), 0.5f);
    CHECK_CLOSE(download(dx), x, kExact);
  }
  SUBCASE("add_into: strided destination and source, accumulating into nonzero values") {
    pd::ops::cpu::add_into(host_y, host_x().slice(2, 2, 3));
    pd::ops::cuda::add_into(device_y, device_x().slice(2, 2, 3));
    CHECK_CLOSE(download(dy), y, kExact);
    pd::ops::cpu::add_into(host_y, host_x().slice(2, 2, 3));  // twice: it adds, it does not overwrite
    pd::ops::cuda::add_into(device_y, device_x().slice(2, 2, 3));
    CHECK_CLOSE(download(dy), y, kExact);
  }
  SUBCASE("add_into: contiguous") {
    const pd::TensorView<float> host_whole(y.data(), x_shape), device_whole(dy.data(), x_shape);
    pd::ops::cpu::add_into(host_whole, host_x());
    pd::ops::cuda::add_into(device_whole, device_x());
    CHECK_CLOSE(download(dy), y, kExact);
  }
  SUBCASE("shape mismatches are errors with ops::cpu's messages") {
    try {
      pd::ops::cuda::copy(device_x(), device_y);
      FAIL("copy of differing shapes succeeded");
    } catch (const pd::Error& e) {
      CHECK(contains(e.what(), "copy: source shape"));
    }
    try {
      pd::ops::cuda::add_into(device_y, device_x());
      FAIL("add_into of differing shapes succeeded");
    } catch (const pd::Error& e) {
      CHECK(contains(e.what(), "add_into: destination"));
    }
  }
}

TEST_CASE("cuda gemm: all four transpose combinations, odd sizes, padded leading dimensions, beta != 0") {
  PARADYSE_REQUIRE_DEVICE();
  pd::MemoryTracker tracker = dev::make_tracker();
  const std::int64_t m = 37, n = 53, k = 29;
  const float alpha = 1.25f, beta = 0.75f;
  std::uint64_t seed = 10;
  for (const Transpose ta : {Transpose::no, Transpose::yes})
    for (const Transpose tb : {Transpose::no, Transpose::yes}) {
      INFO("op(a) = " << name(ta) << ", op(b) = " << name(tb) << ", m = " << m << ", n = " << n << ", k = " << k);
      const std::int64_t a_rows = ta == Transpose::yes ? k : m, lda = (ta == Transpose::yes ? m : k) + 3;
      const std::int64_t b_rows = tb == Transpose::yes ? n : k, ldb = (tb == Transpose::yes ? k : n) + 5;
      const std::int64_t ldc = n + 2;
      const auto a = random_vector(std::size_t(a_rows * lda), ++seed);
      const auto b = random_vector(std::size_t(b_rows * ldb), ++seed);
      auto want = random_vector(std::size_t(m * ldc), ++seed);
      const auto da = upload(a, tracker), db = upload(b, tracker);
      auto dc = upload(want, tracker);
      pd::testing::Vec want64(want.begin(), want.end());
      pd::testing::reference_gemm(ta == Transpose::yes, tb == Transpose::yes, m, n, k, alpha,
                                  pd::testing::Vec(a.begin(), a.end()), lda, pd::testing::Vec(b.begin(), b.end()), ldb,
                                  beta, want64, ldc);
      pd::ops::cpu::gemm(ta, tb, m, n, k, alpha, a.data(), lda, b.data(), ldb, beta, want.data(), ldc);
      pd::ops::cuda::gemm(ta, tb, m, n, k, alpha, da.data(), lda, db.data(), ldb, beta, dc.data(), ldc);
      const auto got = download(dc);
      CHECK_CLOSE(got, want, pd::testing::kFloat32);    // against ops::cpu (the padding columns untouched too)
      CHECK_CLOSE(got, want64, pd::testing::kFloat32);  // against the float64 reference
    }
}

TEST_CASE("cuda gemm: beta = 0 ignores NaN in c; k = 0 and alpha = 0 scale c by beta; bad arguments are errors") {
  PARADYSE_REQUIRE_DEVICE();
  pd::MemoryTracker tracker = dev::make_tracker();
  const std::int64_t m = 9, n = 7, k = 5;
  const auto a = random_vector(std::size_t(m * k), 1), b = random_vector(std::size_t(k * n), 2);
  const auto da = upload(a, tracker), db = upload(b, tracker);

  std::vector<float> want(std::size_t(m * n), std::numeric_limits<float>::quiet_NaN());
  auto dc = upload(want, tracker);
  pd::ops::cpu::gemm(Transpose::no, Transpose::no, m, n, k, 1.0f, a.data(), k, b.data(), n, 0.0f, want.data(), n);
  pd::ops::cuda::gemm(Transpose::no, Transpose::no, m, n, k, 1.0f, da.data(), k, db.data(), n, 0.0f, dc.data(), n);
  CHECK_CLOSE(download(dc), want, pd::testing::kFloat32);

  for (const float beta : {0.5f, 0.0f, 1.0f}) {
    INFO("beta = " << beta);
    auto c = random_vector(std::size_t(m * n), 3);
    auto dk0 = upload(c, tracker);
    auto dalpha0 = upload(c, tracker);
    const float* none = nullptr;
    pd::ops::cuda::gemm(Transpose::no, Transpose::no, m, n, 0, 1.0f, none, 1, none, n, beta, dk0.data(), n);
    pd::ops::cuda::gemm(Transpose::no, Transpose::no, m, n, k, 0.0f, da.data(), k, db.data(), n, beta,
                        dalpha0.data(), n);
    for (float& x : c) x *= beta;
    CHECK_CLOSE(download(dk0), c, pd::testing::kFloat32);
    CHECK_CLOSE(download(dalpha0), c, pd::testing::kFloat32);
  }

  try {
    pd::ops::cuda::gemm(Transpose::no, Transpose::no, m, n, k, 1.0f, da.data(), k - 1, db.data(), n, 0.0f, dc.data(),
                        n);
    FAIL("gemm with lda < k succeeded");
  } catch (const pd::Error& e) {
    INFO(e.what());
    CHECK(contains(e.what(), "lda = 4 must be at least 5"));
  }
}

TEST_CASE("cuda matmul on strided row views matches ops::cpu::matmul") {
  PARADYSE_REQUIRE_DEVICE();
  pd::MemoryTracker tracker = dev::make_tracker();
  // a: [37, 29] inside [37, 40]; b^T: b stored [53, 29] inside [53, 31] (trans_b); c: [37, 53] inside [37, 60].
  auto a = random_vector(37 * 40, 4), b = random_vector(53 * 31, 5), c = random_vector(37 * 60, 6);
  auto da = upload(a, tracker), db = upload(b, tracker), dc = upload(c, tracker);
  const auto a_view = [](float* p) { return pd::TensorView<const float>(p, pd::Shape{37, 40}).slice(1, 4, 29); };
  const auto b_view = [](float* p) { return pd::TensorView<const float>(p, pd::Shape{53, 31}).slice(1, 1, 29); };
  const auto c_view = [](float* p) { return pd::TensorView<float>(p, pd::Shape{37, 60}).slice(1, 3, 53); };
  pd::ops::cpu::matmul(a_view(a.data()), Transpose::no, b_view(b.data()), Transpose::yes, c_view(c.data()), 2.0f, 0.5f);
  pd::ops::cuda::matmul(a_view(da.data()), Transpose::no, b_view(db.data()), Transpose::yes, c_view(dc.data()), 2.0f,
                        0.5f);
  CHECK_CLOSE(download(dc), c, pd::testing::kFloat32);

  // A one-row view (its row stride is arbitrary) and a shape mismatch.
  auto row = random_vector(29, 7);
  auto drow = upload(row, tracker);
  std::vector<float> out(53, 0.0f);
  auto dout = upload(out, tracker);
  pd::ops::cpu::matmul(pd::TensorView<const float>(row.data(), pd::Shape{1, 29}, pd::Shape{1000, 1}), Transpose::no,
                       b_view(b.data()), Transpose::yes, pd::TensorView<float>(out.data(), pd::Shape{1, 53}));
  pd::ops::cuda::matmul(pd::TensorView<const float>(drow.data(), pd::Shape{1, 29}, pd::Shape{1000, 1}), Transpose::no,
                        b_view(db.data()), Transpose::yes, pd::TensorView<float>(dout.data(), pd::Shape{1, 53}));
  CHECK_CLOSE(download(dout), out, pd::testing::kFloat32);
  CHECK_THROWS_WITH_AS(pd::ops::cuda::matmul(a_view(da.data()), Transpose::yes, b_view(db.data()), Transpose::yes,
                                             c_view(dc.data())),
                       doctest::Contains("matmul: inner dimensions differ"), pd::Error);
}

TEST_CASE("cuda gemm_batched: disjoint outputs in one batched call, shared outputs accumulated in order") {
  PARADYSE_REQUIRE_DEVICE();
  pd::MemoryTracker tracker = dev::make_tracker();

  SUBCASE("per-head blocks of [s, heads * d] matrices (disjoint, interleaved): scores = q k^T") {
    const std::int64_t heads = 4, s = 19, d = 11, t = 23;  // c_h: [s, t] = q_h: [s, d] * k_h^T, k_h: [t, d]
    auto q = random_vector(std::size_t(s * heads * d), 1), kk = random_vector(std::size_t(t * heads * d), 2);
    auto c = random_vector(std::size_t(s * heads * t), 3);
    auto dq = upload(q, tracker), dk = upload(kk, tracker), dc = upload(c, tracker);
    std::vector<const float*> ha, hb, da, db;
    std::vector<float*> hc, dcs;
    for (std::int64_t h = 0; h < heads; ++h) {
      ha.push_back(q.data() + h * d), hb.push_back(kk.data() + h * d), hc.push_back(c.data() + h * t);
      da.push_back(dq.data() + h * d), db.push_back(dk.data() + h * d), dcs.push_back(dc.data() + h * t);
    }
    CHECK_FALSE(pd::ops::cpu::gemm_outputs_overlap(s, t, heads * t, dcs));
    pd::ops::cpu::gemm_batched(Transpose::no, Transpose::yes, s, t, d, 0.5f, ha, heads * d, hb, heads * d, 0.25f, hc,
                               heads * t);
    pd::ops::cuda::gemm_batched(Transpose::no, Transpose::yes, s, t, d, 0.5f, da, heads * d, db, heads * d, 0.25f, dcs,
                                heads * t);
    CHECK_CLOSE(download(dc), c, pd::testing::kFloat32);
  }
  SUBCASE("a GQA group: query heads share a key-gradient output (beta = 1 sums them)") {
    const std::int64_t items = 4, s = 13, d = 7;  // dk_g: [s, d] += p_h^T: [s, s]^T * q_h: [s, d]
    auto p = random_vector(std::size_t(items * s * s), 4), q = random_vector(std::size_t(items * s * d), 5);
    auto g = random_vector(std::size_t(2 * s * d), 6);
    auto dp = upload(p, tracker), dq = upload(q, tracker), dg = upload(g, tracker);
    std::vector<const float*> ha, hb, da, db;
    std::vector<float*> hc, dcs;
    for (std::int64_t i = 0; i < items; ++i) {
      ha.push_back(p.data() + i * s * s), hb.push_back(q.data() + i * s * d), hc.push_back(g.data() + (i / 2) * s * d);
      da.push_back(dp.data() + i * s * s), db.push_back(dq.data() + i * s * d),
          dcs.push_back(dg.data() + (i / 2) * s * d);
    }
    CHECK(pd::ops::cpu::gemm_outputs_overlap(s, d, d, dcs));
    pd::ops::cpu::gemm_batched(Transpose::yes, Transpose::no, s, d, s, 1.0f, ha, s, hb, d, 1.0f, hc, d);
    pd::ops::cuda::gemm_batched(Transpose::yes, Transpose::no, s, d, s, 1.0f, da, s, db, d, 1.0f, dcs, d);
    CHECK_CLOSE(download(dg), g, pd::testing::kFloat32);
  }
  SUBCASE("item counts must agree") {
    std::vector<const float*> two(2, nullptr);
    std::vector<float*> three(3, nullptr);
    CHECK_THROWS_WITH_AS(pd::ops::cuda::gemm_batched(Transpose::no, Transpose::no, 2, 2, 2, 1.0f, two, 2, two, 2, 0.0f,
                                                     three, 2),
                         doctest::Contains("gemm_batched: a, b and c must hold one pointer per item"), pd::Error);
  }
}

TEST_CASE("cuda gemm_grouped: an expert bank's ragged blocks in one grouped call, shared outputs in order") {
  PARADYSE_REQUIRE_DEVICE();
  pd::MemoryTracker tracker = dev::make_tracker();
  namespace gd = pd::ops::cuda::gemm_detail;
  std::uint64_t seed = 60;

  SUBCASE("the experts' projections and weight gradients against ops::cpu, every transpose") {
    const std::int64_t h = 24, f = 10, rows[] = {7, 0, 13, 1, 5};  // blocks of [rows, h] through [f, h] weights
    std::int64_t total = 0;
    for (const std::int64_t m : rows) total += m;
    for (const Transpose ta : {Transpose::no, Transpose::yes})
      for (const Transpose tb : {Transpose::no, Transpose::yes}) {
        CAPTURE(name(ta));
        CAPTURE(name(tb));
        // Item e: c_e [m_e, f] = op(a_e) op(b_e), a_e's block of rows [m_e, h] (or [h, m_e] stored transposed)...
        const std::int64_t lda = ta == Transpose::yes ? 16 : h, ldb = tb == Transpose::yes ? h : f, ldc = f + 2;
        auto a = random_vector(std::size_t(5 * h * 16), ++seed), b = random_vector(std::size_t(5 * h * h), ++seed);
        auto c = random_vector(std::size_t(total * ldc), ++seed);
        auto da = upload(a, tracker), db = upload(b, tracker), dc = upload(c, tracker);
        pd::ops::GroupedGemm host, device;
        std::int64_t begin = 0;
        for (std::int64_t e = 0; e < 5; ++e) {
          const std::int64_t m = rows[e], a_at = e * h * 16, b_at = e * h * h, c_at = begin * ldc;
          host.add(m, f, h, a.data() + a_at, b.data() + b_at, c.data() + c_at);
          device.add(m, f, h, da.data() + a_at, db.data() + b_at, dc.data() + c_at);
          begin += m;
        }
        CHECK_FALSE(gd::grouped_outputs_overlap(device, ldc));
        pd::ops::cpu::gemm_grouped(ta, tb, 0.75f, host, lda, ldb, 0.5f, ldc);
        pd::ops::cuda::gemm_grouped(ta, tb, 0.75f, device, lda, ldb, 0.5f, ldc);
        CHECK_CLOSE(download(dc), c, pd::testing::kFloat32);
      }
  }
  SUBCASE("items sharing an output with beta = 1 accumulate in order; k = 0 scales by beta") {
    const std::int64_t n = 6, k = 5;
    auto a = random_vector(std::size_t(3 * 8 * k), ++seed), b = random_vector(std::size_t(3 * k * n), ++seed);
    auto c = random_vector(std::size_t(2 * 8 * n), ++seed);
    auto da = upload(a, tracker), db = upload(b, tracker), dc = upload(c, tracker);
    pd::ops::GroupedGemm host, device;
    const std::int64_t m[] = {8, 4, 3}, inner[] = {k, k, 0}, out[] = {0, 0, 8 * n};
    for (std::size_t i = 0; i < 3; ++i) {
      host.add(m[i], n, inner[i], a.data() + i * 8 * k, b.data() + i * k * n, c.data() + out[i]);
      device.add(m[i], n, inner[i], da.data() + i * 8 * k, db.data() + i * k * n, dc.data() + out[i]);
    }
    CHECK(gd::grouped_outputs_overlap(device, n));
    pd::ops::cpu::gemm_grouped(Transpose::no, Transpose::no, 1.0f, host, k, n, 1.0f, n);
    pd::ops::cuda::gemm_grouped(Transpose::no, Transpose::no, 1.0f, device, k, n, 1.0f, n);
    CHECK_CLOSE(download(dc), c, pd::testing::kFloat32);
  }
  SUBCASE("lists of different lengths are refused") {
    pd::ops::GroupedGemm items;
    items.add(2, 2, 2, nullptr, nullptr, nullptr);
    items.n.push_back(2);
    CHECK_THROWS_WITH_AS(pd::ops::cuda::gemm_grouped(Transpose::no, Transpose::no, 1.0f, items, 2, 2, 0.0f, 2),
                         doctest::Contains("gemm_grouped: m, n, k, a, b and c must hold one entry per item"),
                         pd::Error);
  }
}

TEST_CASE("cuda gemm with bf16 operands and fp32 accumulation against the float64 reference") {
  PARADYSE_REQUIRE_DEVICE();
  pd::MemoryTracker tracker = dev::make_tracker();
  const std::int64_t m = 37, n = 53, k = 29;
  const float alpha = 1.25f, beta = 0.5f;
  std::uint64_t seed = 40;
  // Tolerances. The operands are bf16 values, exact in float64, and each bf16 x bf16 product is exact in fp32 (8 + 8
  // significant bits < 24), so an fp32 result differs from the float64 reference only by fp32 accumulation over k =
  // 29 terms: kFloat32 covers it. A bf16 result is additionally rounded once to 8 significant bits: at most half an
  // ulp, 2^-9 relative to the value's binade top, i.e. <= 2^-8 = 0.0039 of |value|; plus the fp32 error before it.
  const Tolerance bf16_result{2e-4, 0.0039 + 2e-3};
  for (const Transpose ta : {Transpose::no, Transpose::yes})
    for (const Transpose tb : {Transpose::no, Transpose::yes}) {
      INFO("op(a) = " << name(ta) << ", op(b) = " << name(tb));
      const std::int64_t a_rows = ta == Transpose::yes ? k : m, lda = (ta == Transpose::yes ? m : k) + 3;
      const std::int64_t b_rows = tb == Transpose::yes ? n : k, ldb = (tb == Transpose::yes ? k : n) + 1;
      const auto a = random_bf16(std::size_t(a_rows * lda), ++seed);
      const auto b = random_bf16(std::size_t(b_rows * ldb), ++seed);
      const auto da = upload(a, tracker), db = upload(b, tracker);
      const bool ta_ = ta == Transpose::yes, tb_ = tb == Transpose::yes;
      {  // fp32 result
        const auto c = random_vector(std::size_t(m * n), ++seed);
        auto dc = upload(c, tracker);
        pd::testing::Vec want(c.begin(), c.end());
        pd::testing::reference_gemm(ta_, tb_, m, n, k, alpha, as_double(a), lda, as_double(b), ldb, beta, want, n);
        pd::ops::cuda::gemm(ta, tb, m, n, k, alpha, da.data(), lda, db.data(), ldb, beta, dc.data(), n);
        CHECK_CLOSE(download(dc), want, pd::testing::kFloat32);
      }
      {  // bf16 result
        const auto c = random_bf16(std::size_t(m * n), ++seed);
        auto dc = upload(c, tracker);
        pd::testing::Vec want = as_double(c);
        pd::testing::reference_gemm(ta_, tb_, m, n, k, alpha, as_double(a), lda, as_double(b), ldb, beta, want, n);
        pd::ops::cuda::gemm(ta, tb, m, n, k, alpha, da.data(), lda, db.data(), ldb, beta, dc.data(), n);
        CHECK_CLOSE(as_double(download(dc)), want, bf16_result);
      }
    }
}

TEST_CASE("cuda gemm_grouped with bf16 items: an expert bank's blocks against the float64 reference") {
  PARADYSE_REQUIRE_DEVICE();
  pd::MemoryTracker tracker = dev::make_tracker();
  const std::uint64_t seed0 = pd::testing::fresh_seed();
  INFO("seed " << seed0);
  std::uint64_t seed = seed0;
  // A bf16 result: the fp32 sum over k = 40 exact products, rounded once to bf16 (the single bf16 GEMM's tolerance).
  const Tolerance bf16_result{2e-4, 0.0039 + 2e-3};
  const std::int64_t h = 40, f = 12, rows[] = {9, 0, 17, 1, 6};  // item e: c_e [m_e, f] = a_e [m_e, h] b_e^T
  std::int64_t total = 0;
  for (const std::int64_t m : rows) total += m;
  const std::int64_t ldc = f + 3;
  const auto a = random_bf16(std::size_t(total * h), ++seed), b = random_bf16(std::size_t(5 * f * h), ++seed);
  const auto c = random_bf16(std::size_t(total * ldc), ++seed);
  const auto da = upload(a, tracker), db = upload(b, tracker);
  auto dc = upload(c, tracker);
  pd::ops::GroupedGemmOf<pd::bf16> items;
  pd::testing::Vec want = as_double(c);
  const pd::testing::Vec a64 = as_double(a), b64 = as_double(b);
  std::int64_t begin = 0;
  for (std::int64_t e = 0; e < 5; ++e) {
    const std::int64_t m = rows[e];
    items.add(m, f, h, da.data() + begin * h, db.data() + e * f * h, dc.data() + begin * ldc);
    pd::testing::Vec block(want.begin() + begin * ldc, want.begin() + (begin + m) * ldc);
    const pd::testing::Vec ae(a64.begin() + begin * h, a64.begin() + (begin + m) * h);
    const pd::testing::Vec be(b64.begin() + e * f * h, b64.begin() + (e + 1) * f * h);
    if (m > 0) pd::testing::reference_gemm(false, true, m, f, h, 1.5, ae, h, be, h, 0.5, block, ldc);
    std::copy(block.begin(), block.end(), want.begin() + begin * ldc);
    begin += m;
  }
  pd::ops::cuda::gemm_grouped(Transpose::no, Transpose::yes, 1.5f, items, h, h, 0.5f, ldc);
  CHECK_CLOSE(as_double(download(dc)), want, bf16_result);
  // Refused: outputs that share memory (a bf16 sum would round at every item), and k = 0.
  pd::ops::GroupedGemmOf<pd::bf16> shared, empty_inner;
  shared.add(2, f, h, da.data(), db.data(), dc.data());
  shared.add(2, f, h, da.data(), db.data() + f * h, dc.data() + ldc);
  CHECK_THROWS_WITH_AS(pd::ops::cuda::gemm_grouped(Transpose::no, Transpose::yes, 1.0f, shared, h, h, 0.0f, ldc),
                       doctest::Contains("two items' outputs share memory"), pd::Error);
  empty_inner.add(2, f, 0, da.data(), db.data(), dc.data());
  CHECK_THROWS_WITH_AS(pd::ops::cuda::gemm_grouped(Transpose::no, Transpose::yes, 1.0f, empty_inner, h, h, 0.0f, ldc),
                       doctest::Contains("has k = 0"), pd::Error);
}

TEST_CASE("cuda gemm: TF32 is opt-in and off by default") {
  PARADYSE_REQUIRE_DEVICE();
  CHECK_FALSE(pd::ops::cuda::gemm_tf32());
  pd::MemoryTracker tracker = dev::make_tracker();
  const std::int64_t m = 64, n = 48, k = 256;
  const auto a = random_vector(std::size_t(m * k), 1), b = random_vector(std::size_t(k * n), 2);
  std::vector<float> want(std::size_t(m * n), 0.0f);
  pd::ops::cpu::gemm(Transpose::no, Transpose::no, m, n, k, 1.0f, a.data(), k, b.data(), n, 0.0f, want.data(), n);
  const auto da = upload(a, tracker), db = upload(b, tracker);
  auto dc = upload(want, tracker);
  pd::ops::cuda::set_gemm_tf32(true);
  pd::ops::cuda::gemm(Transpose::no, Transpose::no, m, n, k, 1.0f, da.data(), k, db.data(), n, 0.0f, dc.data(), n);
  pd::ops::cuda::set_gemm_tf32(false);
  // TF32 rounds the operands to 11 significant bits (relative 2^-11 each): over k = 256 products of values in
  // [-1, 1] (sums of size ~ sqrt(k) / 3 ~ 5) the error stays well below 0.05 absolute.
  CHECK_CLOSE(download(dc), want, (Tolerance{5e-2, 1e-2}));
  CHECK_FALSE(pd::ops::cuda::gemm_tf32());
}
