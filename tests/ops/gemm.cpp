// Tests of paradyse/ops/cpu/gemm.hpp: gemm (the measured engine per size class) and both engines against the float64
// reference, every transpose combination, padded leading dimensions, alpha/beta, edge sizes, bad input; the
// measured choice (gemm_choice.hpp), its cache text and its determinism.
#include "paradyse/ops/cpu/gemm.hpp"

#include "paradyse/core/rng.hpp"
#include "support/tolerance.hpp"
#include "ops/reference.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <thread>
#include <limits>
#include <vector>

using namespace paradyse;
using namespace paradyse::testing;
using ops::Transpose;

namespace {

using GemmFn = void (*)(Transpose, Transpose, std::int64_t, std::int64_t, std::int64_t, float, const float*,
                        std::int64_t, const float*, std::int64_t, float, float*, std::int64_t);

// One random problem, checked for all four transpose combinations.
void check_gemm(GemmFn fn, std::int64_t m, std::int64_t n, std::int64_t k, float alpha, float beta, std::int64_t pad,
                Rng& rng) {
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      CAPTURE(m); CAPTURE(n); CAPTURE(k); CAPTURE(ta); CAPTURE(tb); CAPTURE(alpha); CAPTURE(beta); CAPTURE(pad);
      const std::int64_t a_rows = ta ? k : m, a_cols = ta ? m : k;
      const std::int64_t b_rows = tb ? n : k, b_cols = tb ? k : n;
      const std::int64_t lda = a_cols + pad, ldb = b_cols + pad, ldc = n + pad;
      std::vector<float> a(std::size_t(std::max<std::int64_t>(a_rows * lda, 1)));
      std::vector<float> b(std::size_t(std::max<std::int64_t>(b_rows * ldb, 1)));
      std::vector<float> c(std::size_t(std::max<std::int64_t>(m * ldc, 1)));
      rng.fill_uniform(std::span<float>(a));
      rng.fill_uniform(std::span<float>(b));
      rng.fill_uniform(std::span<float>(c));
      Vec want(c.begin(), c.end());
      reference_gemm(ta, tb, m, n, k, alpha, Vec(a.begin(), a.end()), std::max<std::int64_t>(lda, 1),
                     Vec(b.begin(), b.end()), std::max<std::int64_t>(ldb, 1), beta, want, std::max<std::int64_t>(ldc, 1));
      fn(ta ? Transpose::yes : Transpose::no, tb ? Transpose::yes : Transpose::no, m, n, k, alpha, a.data(),
         std::max<std::int64_t>(lda, 1), b.data(), std::max<std::int64_t>(ldb, 1), beta, c.data(),
         std::max<std::int64_t>(ldc, 1));
      // Padding columns of c must be untouched too: compare the whole buffer.
      CHECK_CLOSE(c, want, kFloat32);
    }
}

void check_gemm_sizes(GemmFn fn) {
  Rng rng(0x6e11);
  const std::int64_t sizes[][3] = {{1, 1, 1}, {3, 5, 7}, {17, 33, 9}, {64, 64, 64}, {97, 130, 257}, {5, 1100, 3},
                                   {130, 7, 300}, {1, 40, 513}};
  for (const auto& s : sizes) check_gemm(fn, s[0], s[1], s[2], 1.0f, 0.0f, 0, rng);
  check_gemm(fn, 23, 19, 31, 0.75f, 0.5f, 3, rng);   // alpha, beta and padded leading dimensions
  check_gemm(fn, 40, 70, 90, -1.5f, 1.0f, 1, rng);   // pure accumulate
  check_gemm(fn, 9, 11, 13, 0.0f, -2.0f, 0, rng);    // alpha = 0: only the scaling
  check_gemm(fn, 9, 11, 0, 1.0f, 0.25f, 2, rng);     // k = 0: c = beta * c
  check_gemm(fn, 0, 11, 5, 1.0f, 0.0f, 0, rng);      // empty result
}

void check_beta_zero_overwrites_nan(GemmFn fn) {
  Rng rng(7);
  const std::int64_t m = 6, n = 9, k = 4;
  std::vector<float> a(m * k), b(k * n), c(m * n, std::numeric_limits<float>::quiet_NaN());
  rng.fill_uniform(std::span<float>(a));
  rng.fill_uniform(std::span<float>(b));
  Vec want(c.size(), 0.0);
  reference_gemm(false, false, m, n, k, 1.0, Vec(a.begin(), a.end()), k, Vec(b.begin(), b.end()), n, 0.0, want, n);
  fn(Transpose::no, Transpose::no, m, n, k, 1.0f, a.data(), k, b.data(), n, 0.0f, c.data(), n);
  CHECK_CLOSE(c, want, kFloat32);
  // k = 0 and beta = 0 also clears NaN.
  std::fill(c.begin(), c.end(), std::numeric_limits<float>::quiet_NaN());
  fn(Transpose::no, Transpose::no, m, n, 0, 1.0f, a.data(), 1, b.data(), n, 0.0f, c.data(), n);
  CHECK_CLOSE(c, Vec(c.size(), 0.0), kFloat32);
}

}  // namespace

TEST_CASE("gemm matches the float64 reference for every transpose, alpha, beta and padding") {
  check_gemm_sizes(&ops::cpu::gemm);
  check_beta_zero_overwrites_nan(&ops::cpu::gemm);
}

TEST_CASE("gemm_fallback (the built-in blocked kernel) matches the float64 reference") {
  check_gemm_sizes(&ops::cpu::gemm_fallback);
  check_beta_zero_overwrites_nan(&ops::cpu::gemm_fallback);
}

#if defined(PARADYSE_WITH_CBLAS)
TEST_CASE("gemm_cblas matches the float64 reference") {
  check_gemm_sizes(&ops::cpu::gemm_cblas);
  check_beta_zero_overwrites_nan(&ops::cpu::gemm_cblas);
  CHECK(ops::cpu::kGemmUsesCblas);
}
#endif

TEST_CASE("set_gemm_engine switches gemm() to the fallback and back") {
  ops::cpu::set_gemm_engine(ops::cpu::GemmEngine::fallback);
  CHECK(ops::cpu::gemm_engine() == ops::cpu::GemmEngine::fallback);
  check_gemm_sizes(&ops::cpu::gemm);
  if (ops::cpu::kGemmUsesCblas) {
    ops::cpu::set_gemm_engine(ops::cpu::GemmEngine::cblas);
    CHECK(ops::cpu::gemm_engine() == ops::cpu::GemmEngine::cblas);
  } else {
    CHECK_THROWS_AS(ops::cpu::set_gemm_engine(ops::cpu::GemmEngine::cblas), Error);
  }
  ops::cpu::use_measured_gemm_engines();
}

TEST_CASE("the measured GEMM choice: the faster engine per size class, applied per call, deterministic") {
  using ops::cpu::GemmEngine;
  using ops::cpu::GemmSizeClass;
  CHECK(ops::cpu::gemm_size_class(64, 64, 64) == GemmSizeClass::small);
  CHECK(ops::cpu::gemm_size_class(128, 256, 128) == GemmSizeClass::medium);
  CHECK(ops::cpu::gemm_size_class(1024, 1024, 1024) == GemmSizeClass::large);

  const ops::cpu::GemmMeasurement measured = ops::cpu::measure_gemm_engines(1);
  for (std::size_t i = 0; i < measured.engine.size(); ++i) {
    CAPTURE(i);
    CHECK(measured.fallback_flops_per_s[i] > 1e6);  // a real rate, not a placeholder
    if (ops::cpu::kGemmUsesCblas) {
      CHECK(measured.cblas_flops_per_s[i] > 1e6);
      const bool fallback_faster =
          measured.fallback_flops_per_s[i] > ops::cpu::kFallbackMargin * measured.cblas_flops_per_s[i];
      CHECK(measured.engine[i] == (fallback_faster ? GemmEngine::fallback : GemmEngine::cblas));
      // Never more than the margin slower than the faster engine.
      CHECK(measured.flops_per_s(ops::cpu::GemmSizeClass(i)) * ops::cpu::kFallbackMargin >=
            std::max(measured.cblas_flops_per_s[i], measured.fallback_flops_per_s[i]));
    } else {
      CHECK(measured.engine[i] == GemmEngine::fallback);
    }
  }
  CHECK(measured.peak_flops_per_s() == measured.flops_per_s(GemmSizeClass::large));

  // A measurement that mixes the engines by size: gemm() follows it per call, the workspace report with it.
  ops::cpu::GemmMeasurement mixed = measured;
  mixed.engine = {GemmEngine::fallback, ops::cpu::kGemmUsesCblas ? GemmEngine::cblas : GemmEngine::fallback,
                  GemmEngine::fallback};
  ops::cpu::set_gemm_measurement(mixed);
  CHECK(ops::cpu::gemm_measurement() == mixed);
  CHECK(ops::cpu::gemm_engine_for(8, 8, 8) == GemmEngine::fallback);
  CHECK(ops::cpu::gemm_workspace_floats(8, 8, 8, 1.0f) > 0);
  if (ops::cpu::kGemmUsesCblas) {
    CHECK(ops::cpu::gemm_engine_for(128, 256, 128) == GemmEngine::cblas);
    CHECK(ops::cpu::gemm_workspace_floats(128, 256, 128, 1.0f) == 0);
  }
  check_gemm_sizes(&ops::cpu::gemm);  // sizes of both classes, against float64

  // Deterministic for a choice: the same product twice, and from four threads at once, gives the same bits.
  Rng rng(0xde7);
  const std::int64_t m = 96, n = 200, k = 130;
  Tensor<float> a = random_uniform<float>(Shape{m, k}, rng), b = random_uniform<float>(Shape{k, n}, rng);
  Tensor<float> first(Shape{m, n});
  ops::cpu::gemm(Transpose::no, Transpose::no, m, n, k, 1.0f, a.data(), k, b.data(), n, 0.0f, first.data(), n);
  std::vector<Tensor<float>> again;
  for (int t = 0; t < 4; ++t) again.emplace_back(Shape{m, n});
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      ops::cpu::gemm(Transpose::no, Transpose::no, m, n, k, 1.0f, a.data(), k, b.data(), n, 0.0f, again[t].data(), n);
    });
  for (auto& t : threads) t.join();
  for (int t = 0; t < 4; ++t) CHECK(std::memcmp(again[t].data(), first.data(), sizeof(float) * m * n) == 0);
  ops::cpu::set_gemm_measurement(measured);
}

TEST_CASE("the GEMM choice's cache text: round trip, and refused for another machine or when malformed") {
  ops::cpu::GemmMeasurement m;
  m.engine = {ops::cpu::GemmEngine::fallback, ops::cpu::GemmEngine::fallback, ops::cpu::GemmEngine::fallback};
  m.cblas_flops_per_s = {1e9, 2e9, 3e9};
  m.fallback_flops_per_s = {4e9, 5.5e9, 6e9};
  const std::string key = ops::cpu::gemm_machine_key();
  CHECK(key.find('\n') == std::string::npos);
  const std::string text = ops::cpu::gemm_measurement_text(m, key);
  ops::cpu::GemmMeasurement back;
  REQUIRE(ops::cpu::parse_gemm_measurement(text, key, back));
  CHECK(back == m);
  CHECK_FALSE(ops::cpu::parse_gemm_measurement(text, key + " (another machine)", back));
  CHECK_FALSE(ops::cpu::parse_gemm_measurement(text.substr(0, text.size() / 2), key, back));
  std::string bad = text;
  bad.replace(bad.find("fallback"), 8, "turbo123");
  CHECK_FALSE(ops::cpu::parse_gemm_measurement(bad, key, back));
}

TEST_CASE("set_gemm_threads changes the thread count and results stay right") {
  CHECK(ops::cpu::gemm_threads() >= 1);
  ops::cpu::set_gemm_threads(2);
  CHECK(ops::cpu::gemm_threads() == 2);
  Rng rng(99);
  check_gemm(&ops::cpu::gemm, 70, 80, 90, 1.0f, 0.0f, 0, rng);
  ops::cpu::set_gemm_threads(1);
  CHECK(ops::cpu::gemm_threads() == 1);
  CHECK_THROWS_AS(ops::cpu::set_gemm_threads(0), Error);
}

TEST_CASE("matmul over strided 2-D views") {
  Rng rng(0x3a7);
  // a is the left 20 columns of a [30, 50] tensor, b the rows 5..45 of a transposed [60, 20] store, c a slice too.
  Tensor<float> a_store = random_uniform<float>(Shape{30, 50}, rng);
  Tensor<float> b_store = random_uniform<float>(Shape{60, 20}, rng);
  Tensor<float> c_store = random_uniform<float>(Shape{40, 64}, rng);
  const TensorView<const float> a = a_store.view().slice(1, 0, 20);        // [30, 20], row stride 50
  const TensorView<const float> b = b_store.view().slice(0, 5, 40);        // [40, 20], used transposed: [20, 40]
  const TensorView<float> c = c_store.view().slice(0, 5, 30).slice(1, 10, 40);  // [30, 40], row stride 64
  const Vec a64 = to_double(a), b64 = to_double(b);
  Vec want = to_double(c);
  reference_gemm(false, true, 30, 40, 20, 2.0, a64, 20, b64, 20, 0.5, want, 40);
  ops::cpu::matmul(a, Transpose::no, b, Transpose::yes, c, 2.0f, 0.5f);
  CHECK_CLOSE(to_double(c), want, kFloat32);

  SUBCASE("bad shapes throw with the shapes in the message") {
    Tensor<float> wrong(Shape{30, 41});
    CHECK_THROWS_AS(ops::cpu::matmul(a, Transpose::no, b, Transpose::yes, wrong.view()), Error);
    CHECK_THROWS_AS(ops::cpu::matmul(a, Transpose::no, b, Transpose::no, c), Error);
    Tensor<float> three_d(Shape{2, 3, 4});
    CHECK_THROWS_AS(ops::cpu::matmul(three_d.view(), Transpose::no, b, Transpose::no, c), Error);
  }
}

TEST_CASE("gemm rejects bad leading dimensions and sizes") {
  std::vector<float> a(100), b(100), c(100);
  CHECK_THROWS_AS(ops::cpu::gemm(Transpose::no, Transpose::no, 4, 4, 4, 1.0f, a.data(), 3, b.data(), 4, 0.0f,
                                 c.data(), 4), Error);
  CHECK_THROWS_AS(ops::cpu::gemm(Transpose::yes, Transpose::no, 5, 4, 4, 1.0f, a.data(), 4, b.data(), 4, 0.0f,
                                 c.data(), 4), Error);
  CHECK_THROWS_AS(ops::cpu::gemm(Transpose::no, Transpose::yes, 4, 4, 6, 1.0f, a.data(), 6, b.data(), 5, 0.0f,
                                 c.data(), 4), Error);
  CHECK_THROWS_AS(ops::cpu::gemm(Transpose::no, Transpose::no, 4, 5, 4, 1.0f, a.data(), 4, b.data(), 5, 0.0f,
                                 c.data(), 4), Error);
  CHECK_THROWS_AS(ops::cpu::gemm(Transpose::no, Transpose::no, -1, 4, 4, 1.0f, a.data(), 4, b.data(), 4, 0.0f,
                                 c.data(), 4), Error);
  try {
    ops::cpu::gemm(Transpose::no, Transpose::no, 4, 4, 4, 1.0f, a.data(), 3, b.data(), 4, 0.0f, c.data(), 4);
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find("lda = 3") != std::string::npos);
  }
}

TEST_CASE("gemm_fallback is right at every instruction-set level this CPU has") {
  for (ops::cpu::SimdLevel level : {ops::cpu::SimdLevel::base, ops::cpu::SimdLevel::avx2, ops::cpu::SimdLevel::avx512}) {
    CAPTURE(int(level));
    ops::cpu::limit_simd_level(level);
    Rng rng(0x51 + int(level));
    check_gemm(&ops::cpu::gemm_fallback, 37, 70, 300, 1.25f, 0.5f, 2, rng);
    check_gemm(&ops::cpu::gemm_fallback, 100, 33, 17, 1.0f, 0.0f, 0, rng);
  }
  ops::cpu::limit_simd_level(ops::cpu::SimdLevel::avx512);
}

TEST_CASE("gemm_fallback takes its packing workspace from the calling thread's memory tracker") {
  Rng rng(0x77);
  Tensor<float> a = random_uniform<float>(Shape{50, 60}, rng), b = random_uniform<float>(Shape{60, 70}, rng);
  Tensor<float> c(Shape{50, 70});
  MemoryTracker tracker;
  {
    ScopedTracker scope(tracker);
    ops::cpu::gemm_fallback(Transpose::no, Transpose::no, 50, 70, 60, 1.0f, a.data(), 60, b.data(), 70, 0.0f, c.data(), 70);
  }
  CHECK(tracker.peak() > 0);
  CHECK(tracker.in_use() == 0);
  MemoryTracker tiny(64);  // a cap below the workspace: OutOfMemory, not a crash
  ScopedTracker scope(tiny);
  CHECK_THROWS_AS(ops::cpu::gemm_fallback(Transpose::no, Transpose::no, 50, 70, 60, 1.0f, a.data(), 60, b.data(), 70,
                                          0.0f, c.data(), 70),
                  OutOfMemory);
}
