// ops::CpuBf16 (ops/cpu/bf16_backend.hpp), op by op, against ops::Cpu (fp32), forward and every gradient:
//  1. the rule, bit for bit: each op equals the fp32 op applied to its operands rounded to bf16 (the fp32-only
//     tensors, statistics and accumulators untouched), so a GPU kernel that loads bf16 and computes in fp32 has one
//     exact CPU model;
//  2. the error against the fp32 op on the unrounded inputs, within a tolerance DERIVED per op (below), on fresh
//     random inputs; and each check can fail: the bf16 result differs from the fp32 one.
// Notation: u = 2^-8 (bf16's unit roundoff: 8 significant bits, round to nearest), e = 2^-24 (fp32's); a rounded
// operand is x(1 + d) with |d| <= u.
#include "paradyse/ops/backend.hpp"
#include "paradyse/ops/cpu/bf16_backend.hpp"

#include "paradyse/core/rng.hpp"

#include <doctest/doctest.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

// Its own namespace: the file joins a unity batch of tests/ops (tests/CMakeLists.txt).
namespace bf16_ops_test {

using namespace paradyse;
using ops::Cpu;
using ops::CpuBf16;
constexpr double kU = 0x1p-8;
constexpr double kE = 0x1p-24;

Tensor<float> random_tensor(Shape shape, Rng& rng, double lo = -2.0, double hi = 2.0) {
  Tensor<float> t(shape);
  rng.fill_uniform(t.span(), lo, hi);
  return t;
}
Tensor<float> rounded(const Tensor<float>& x) {
  Tensor<float> r(x.shape());
  for (std::int64_t i = 0; i < x.numel(); ++i) r.data()[i] = float(bf16(x.data()[i]));
  return r;
}
Tensor<float> zeros_like(const Tensor<float>& x) { return Tensor<float>(x.shape()); }
Tensor<float> filled_like(const Tensor<float>& x, Rng& rng) {  // an accumulator that already holds values
  Tensor<float> t(x.shape());
  rng.fill_uniform(t.span(), -1.0, 1.0);
  return t;
}
Tensor<float> copy_of(const Tensor<float>& x) {
  Tensor<float> t(x.shape());
  std::copy(x.span().begin(), x.span().end(), t.span().begin());
  return t;
}
bool same_bits(const Tensor<float>& a, const Tensor<float>& b) {
  return a.numel() == b.numel() && std::equal(a.span().begin(), a.span().end(), b.span().begin());
}
// Every |got - want| <= bound[i]; and got differs from want somewhere (the check can fail). Returns the worst
// ratio |got - want| / bound.
template <class Bound>
double check_within(const std::string& what, const Tensor<float>& got, const Tensor<float>& want, Bound&& bound) {
  double worst = 0;
  bool differs = false;
  for (std::int64_t i = 0; i < got.numel(); ++i) {
    const double diff = std::abs(double(got.data()[i]) - double(want.data()[i])), b = bound(i);
    differs |= diff > 0;
    worst = std::max(worst, diff / std::max(b, 1e-300));
    if (!(diff <= b)) {
      FAIL_CHECK(fmt::format("{}: element {}: bf16 {:.9g}, fp32 {:.9g}, |diff| {:.3g} > bound {:.3g}", what, i,
                             got.data()[i], want.data()[i], diff, b));
      return worst;
    }
  }
  CHECK_MESSAGE(differs, (what + ": the bf16 result equals the fp32 one everywhere (no rounding happened?)"));
  MESSAGE(fmt::format("{}: worst |diff| / bound = {:.3f}", what, worst));
  return worst;
}

}  // namespace bf16_ops_test

namespace bf16_ops_test {

TEST_CASE("bf16 ops: GEMM and matmul, bf16 operands and fp32 accumulation") {
  // c = sum_i a_i b_i over k terms. bf16 operands: a^ b^ = a b (1 + d1)(1 + d2), so |sum a^b^ - sum ab| <= (2u + u^2)
  // sum |a b|; each fp32 summation (any order, the blocked kernels included) adds <= g_k sum |a^ b^| with
  // g_k = k e / (1 - k e): |c16 - c32| <= (2u + u^2 + 2 g_k (1 + u)^2) sum_i |a_i b_i|.
  Rng rng(1);
  for (const auto& [m, n, k] : {std::tuple{7, 5, 3}, std::tuple{33, 17, 129}, std::tuple{64, 48, 300}}) {
    for (auto ta : {ops::Transpose::no, ops::Transpose::yes})
      for (auto tb : {ops::Transpose::no, ops::Transpose::yes}) {
        const std::string where = fmt::format("gemm m={} n={} k={} ta={} tb={}", m, n, k, int(ta), int(tb));
        const Tensor<float> a = random_tensor(ta == ops::Transpose::yes ? Shape{k, m} : Shape{m, k}, rng);
        const Tensor<float> b = random_tensor(tb == ops::Transpose::yes ? Shape{n, k} : Shape{k, n}, rng);
        const Tensor<float> c0 = random_tensor(Shape{m, n}, rng);
        Tensor<float> c16 = copy_of(c0), c32 = copy_of(c0), crule = copy_of(c0);
        // beta = 1: the weight-gradient accumulation in fp32
        CpuBf16::matmul(a.view(), ta, b.view(), tb, c16.view(), 1.0f, 1.0f);
        Cpu::matmul(a.view(), ta, b.view(), tb, c32.view(), 1.0f, 1.0f);
        Cpu::matmul(rounded(a).view(), ta, rounded(b).view(), tb, crule.view(), 1.0f, 1.0f);
        CHECK_MESSAGE(same_bits(c16, crule), (where + ": not the fp32 GEMM of the rounded operands"));
        const double gk = (k + 1) * kE / (1 - (k + 1) * kE);  // + 1: the beta * c term
        check_within(where, c16, c32, [&](std::int64_t i) {
          const std::int64_t r = i / n, col = i % n;
          double sum = std::abs(double(c0.data()[i]));
          for (std::int64_t t = 0; t < k; ++t) {
            const double av = ta == ops::Transpose::yes ? a(t, r) : a(r, t);
            const double bv = tb == ops::Transpose::yes ? b(col, t) : b(t, col);
            sum += std::abs(av * bv);
          }
          return (2 * kU + kU * kU + 2 * gk * (1 + kU) * (1 + kU)) * sum;
        });
      }
  }
}

TEST_CASE("bf16 ops: GELU and SwiGLU, forward and backward") {
  // Elementwise: |f(x^) - f(x)| <= max|f'| |x^ - x| <= max|f'| u |x| (mean value theorem), plus both fp32
  // evaluations of the tanh/sigmoid approximation (exp_approx: a few ulps): <= 64 e (|x| + |y|) for the two.
  // GELU (tanh form): max|gelu'| < 1.13, max|gelu''| < 0.8 (at 0: 2 phi(0) = 0.798). Backward dx += dy gelu'(x):
  // |d| <= |dy| 0.8 u |x| + 1.13 u |dy| (dy rounded) + 64 e |dy| (1 + |x|).
  // SwiGLU y = silu(g) up: max|silu'| < 1.1, |silu(g)| <= |g|: |dy| <= 1.1 u |g| |up| (1 + u) + |g| u |up| + 64 e
  // |g| |up|. Backward: dgate += dy up silu'(g), dup += dy silu(g); max|silu''| < 0.5:
  // |d dgate| <= |dy||up| (0.5 u |g| + 1.1 (2u + u^2)) + 64 e |dy||up|; |d dup| <= |dy| (1.1 u |g| + u |g| (1 + u)) + 64 e |dy||g|.
  Rng rng(2);
  const Shape shape{9, 77};
  const Tensor<float> x = random_tensor(shape, rng, -4, 4), up = random_tensor(shape, rng), dy = random_tensor(shape, rng);
  {
    Tensor<float> y16 = zeros_like(x), y32 = zeros_like(x), yr = zeros_like(x);
    CpuBf16::gelu_forward(x.view(), y16.view());
    Cpu::gelu_forward(x.view(), y32.view());
    Cpu::gelu_forward(rounded(x).view(), yr.view());
    CHECK(same_bits(y16, yr));
    check_within("gelu forward", y16, y32, [&](std::int64_t i) {
      const double xv = std::abs(x.data()[i]), yv = std::abs(y32.data()[i]);
      return 1.13 * kU * xv + 64 * kE * (xv + yv);
    });
    Tensor<float> acc = filled_like(x, rng);
    Tensor<float> d16 = copy_of(acc), d32 = copy_of(acc), dr = copy_of(acc);
    CpuBf16::gelu_backward(x.view(), dy.view(), d16.view());
    Cpu::gelu_backward(x.view(), dy.view(), d32.view());
    Cpu::gelu_backward(rounded(x).view(), rounded(dy).view(), dr.view());
    CHECK(same_bits(d16, dr));
    check_within("gelu backward (+= into fp32)", d16, d32, [&](std::int64_t i) {
      const double xv = std::abs(x.data()[i]), g = std::abs(dy.data()[i]);
      return g * 0.8 * kU * xv + 1.13 * kU * g * (1 + kU) + 64 * kE * (g * (1 + xv) + std::abs(acc.data()[i]));
    });
  }
  {
    Tensor<float> y16 = zeros_like(x), y32 = zeros_like(x), yr = zeros_like(x);
    CpuBf16::swiglu_forward(x.view(), up.view(), y16.view());
    Cpu::swiglu_forward(x.view(), up.view(), y32.view());
    Cpu::swiglu_forward(rounded(x).view(), rounded(up).view(), yr.view());
    CHECK(same_bits(y16, yr));
    check_within("swiglu forward", y16, y32, [&](std::int64_t i) {
      const double g = std::abs(x.data()[i]), u = std::abs(up.data()[i]);
      return 1.1 * kU * g * u * (1 + kU) + g * kU * u + 64 * kE * g * u;
    });
    Tensor<float> acc_g = filled_like(x, rng), acc_u = filled_like(x, rng);
    Tensor<float> g16 = copy_of(acc_g), g32 = copy_of(acc_g), gr = copy_of(acc_g);
    Tensor<float> u16 = copy_of(acc_u), u32 = copy_of(acc_u), ur = copy_of(acc_u);
    CpuBf16::swiglu_backward(x.view(), up.view(), dy.view(), g16.view(), u16.view());
    Cpu::swiglu_backward(x.view(), up.view(), dy.view(), g32.view(), u32.view());
    Cpu::swiglu_backward(rounded(x).view(), rounded(up).view(), rounded(dy).view(), gr.view(), ur.view());
    CHECK(same_bits(g16, gr));
    CHECK(same_bits(u16, ur));
    check_within("swiglu backward dgate", g16, g32, [&](std::int64_t i) {
      const double g = std::abs(x.data()[i]), u = std::abs(up.data()[i]), d = std::abs(dy.data()[i]);
      return d * u * (0.5 * kU * g + 1.1 * (2 * kU + kU * kU)) + 64 * kE * (d * u + std::abs(acc_g.data()[i]));
    });
    check_within("swiglu backward dup", u16, u32, [&](std::int64_t i) {
      const double g = std::abs(x.data()[i]), d = std::abs(dy.data()[i]);
      return d * (1.1 * kU * g + kU * g * (1 + kU)) * (1 + kU) + 64 * kE * (d * g + std::abs(acc_u.data()[i]));
    });
  }
}

TEST_CASE("bf16 ops: RoPE forward and backward") {
  // A rotation of pairs (x_i, x_j): y_i = x_i c - x_j s, |c|, |s| <= 1. Rounded inputs: |dy_i| <= u (|x_i| + |x_j|)
  // <= u 2 max(|x_i|, |x_j|); plus the fp32 evaluation, both runs: 8 e (|x_i| + |x_j|). The bound per element
  // uses its row's largest |x| over the head dimension (the partner of i is in the same head row).
  Rng rng(3);
  const Shape shape{2, 11, 3, 8};
  const Tensor<float> x = random_tensor(shape, rng);
  for (bool backward : {false, true}) {
    Tensor<float> y16 = zeros_like(x), y32 = zeros_like(x), yr = zeros_like(x);
    if (!backward) {
      CpuBf16::rope_forward(x.view(), y16.view(), 5);
      Cpu::rope_forward(x.view(), y32.view(), 5);
      Cpu::rope_forward(rounded(x).view(), yr.view(), 5);
    } else {
      CpuBf16::rope_backward(x.view(), y16.view(), 5);
      Cpu::rope_backward(x.view(), y32.view(), 5);
      Cpu::rope_backward(rounded(x).view(), yr.view(), 5);
    }
    CHECK(same_bits(y16, yr));
    check_within(backward ? "rope backward" : "rope forward", y16, y32, [&](std::int64_t i) {
      const std::int64_t row = i / 8;
      double top = 0;
      for (std::int64_t j = 0; j < 8; ++j) top = std::max(top, double(std::abs(x.data()[row * 8 + j])));
      return 2 * kU * top + 16 * kE * top;
    });
  }
}

TEST_CASE("bf16 ops: LayerNorm and RMSNorm forward (fp32 statistics), and the rule for their backward") {
  // LayerNorm y = gamma z + beta, z = (x - mean) / sigma. x^ = x + dx, |dx_i| <= u |x_i|: to first order
  // dz_i = (dx_i - dmean) / sigma - z_i dsigma / sigma with |dmean| <= u mean|x| and |dsigma| <= u mean(|z| |x|)
  // (dsigma / dx_j = z_j / n), so |dz_i| <= u (|x_i| + mean|x| + |z_i| mean(|z||x|)) / sigma; gamma^, beta^ add
  // u |gamma_i z_i| + u |beta_i|: |dy_i| <= |gamma_i| |dz_i| (1 + u) + u |gamma_i z_i| + u |beta_i|. The bound is
  // twice that (the O(u^2) terms and both fp32 evaluations, ~n e relative, are far below it at n = 96), plus
  // 32 e (|gamma z| + |beta|). RMSNorm: the same without the mean terms (z = x / rms).
  Rng rng(4);
  const std::int64_t rows = 13, h = 96;
  const Tensor<float> x = random_tensor(Shape{rows, h}, rng, -3, 5), dy = random_tensor(Shape{rows, h}, rng);
  const Tensor<float> gamma = random_tensor(Shape{h}, rng, 0.5, 1.5), beta = random_tensor(Shape{h}, rng, -0.5, 0.5);
  for (bool rms : {false, true}) {
    const std::string name = rms ? "rms_norm" : "layer_norm";
    Tensor<float> y16(Shape{rows, h}), y32(Shape{rows, h}), yr(Shape{rows, h});
    Tensor<float> mean16(Shape{rows}), rstd16(Shape{rows}), mean32(Shape{rows}), rstd32(Shape{rows});
    Tensor<float> meanr(Shape{rows}), rstdr(Shape{rows});
    if (rms) {
      CpuBf16::rms_norm_forward(x.view(), gamma.view(), 1e-5f, y16.view(), rstd16.view());
      Cpu::rms_norm_forward(x.view(), gamma.view(), 1e-5f, y32.view(), rstd32.view());
      Cpu::rms_norm_forward(rounded(x).view(), rounded(gamma).view(), 1e-5f, yr.view(), rstdr.view());
    } else {
      CpuBf16::layer_norm_forward(x.view(), gamma.view(), beta.view(), 1e-5f, y16.view(), mean16.view(), rstd16.view());
      Cpu::layer_norm_forward(x.view(), gamma.view(), beta.view(), 1e-5f, y32.view(), mean32.view(), rstd32.view());
      Cpu::layer_norm_forward(rounded(x).view(), rounded(gamma).view(), rounded(beta).view(), 1e-5f, yr.view(),
                              meanr.view(), rstdr.view());
    }
    CHECK(same_bits(y16, yr));
    CHECK(same_bits(rstd16, rstdr));  // the statistics stay fp32: those of the rounded input, not rounded again
    CHECK(std::any_of(rstd16.span().begin(), rstd16.span().end(), [](float v) { return v != float(bf16(v)); }));
    check_within(name + " forward", y16, y32, [&](std::int64_t i) {
      const std::int64_t r = i / h, j = i % h;
      double mean = 0, mean_abs = 0;
      for (std::int64_t t = 0; t < h; ++t) mean += x(r, t) / double(h), mean_abs += std::abs(double(x(r, t))) / double(h);
      if (rms) mean = 0, mean_abs = 0;
      double var = 0;
      for (std::int64_t t = 0; t < h; ++t) var += (x(r, t) - mean) * (x(r, t) - mean) / double(h);
      const double sigma = std::sqrt(var + 1e-5);
      double zx = 0;
      for (std::int64_t t = 0; t < h; ++t) zx += std::abs((x(r, t) - mean) / sigma * x(r, t)) / double(h);
      const double z = (x(r, j) - mean) / sigma, g = std::abs(gamma.data()[j]), b = rms ? 0.0 : std::abs(beta.data()[j]);
      const double dz = kU * (std::abs(double(x(r, j))) + mean_abs + std::abs(z) * zx) / sigma;
      return 2 * (g * dz * (1 + kU) + kU * g * std::abs(z) + kU * b) + 32 * kE * (g * std::abs(z) + b);
    });
    // Backward: the rule (x, gamma, dy read as bf16; mean, rstd fp32; dx, dgamma, dbeta accumulate in fp32).
    Tensor<float> dx0 = filled_like(x, rng), dg0 = filled_like(gamma, rng), db0 = filled_like(beta, rng);
    Tensor<float> dx16 = copy_of(dx0), dg16 = copy_of(dg0), db16 = copy_of(db0);
    Tensor<float> dxr = copy_of(dx0), dgr = copy_of(dg0), dbr = copy_of(db0);
    if (rms) {
      CpuBf16::rms_norm_backward(x.view(), gamma.view(), rstd16.view(), dy.view(), dx16.view(), dg16.view());
      Cpu::rms_norm_backward(rounded(x).view(), rounded(gamma).view(), rstd16.view(), rounded(dy).view(), dxr.view(), dgr.view());
    } else {
      CpuBf16::layer_norm_backward(x.view(), gamma.view(), mean16.view(), rstd16.view(), dy.view(), dx16.view(),
                                   dg16.view(), db16.view());
      Cpu::layer_norm_backward(rounded(x).view(), rounded(gamma).view(), mean16.view(), rstd16.view(), rounded(dy).view(),
                               dxr.view(), dgr.view(), dbr.view());
    }
    CHECK(same_bits(dx16, dxr));
    CHECK(same_bits(dg16, dgr));
    CHECK(same_bits(db16, dbr));
    // dgamma sums over rows in fp32: not a bf16 value.
    CHECK(std::any_of(dg16.span().begin(), dg16.span().end(), [](float v) { return v != float(bf16(v)); }));
  }
}

TEST_CASE("bf16 ops: attention forward (fp32 lse) and the rule for its backward and merge") {
  // s_ij = scale q_i.k_j: |ds_ij| <= (2u + u^2) scale sum_d |q_id k_jd| + 2 g_d scale sum_d |q k| =: E_ij. The
  // probabilities p_i = softmax(s_i) move by |dp_ij| <= p_ij (exp(2 E_i) - 1), E_i = max_j E_ij (p^/p is a ratio of
  // exp(ds_ij) to a p-weighted mean of exp(ds_il), each within exp(+-E_i)). out_id = sum_j p_ij v_jd:
  // |dout_id| <= (exp(2 E_i) - 1) sum_j p_ij |v_jd| (1 + u) + u sum_j p_ij |v_jd| + 2 (n_keys + 16) e sum_j p_ij |v_jd|
  // (the fp32 accumulation and exp_approx of both runs). p from float64 on the fp32 inputs.
  Rng rng(5);
  const std::int64_t b = 2, sq = 19, skv = 23, hq = 4, hkv = 2, d = 16;
  const Tensor<float> q = random_tensor(Shape{b, sq, hq, d}, rng), k = random_tensor(Shape{b, skv, hkv, d}, rng);
  const Tensor<float> v = random_tensor(Shape{b, skv, hkv, d}, rng), dout = random_tensor(Shape{b, sq, hq, d}, rng);
  ops::AttentionMask mask;  // non-causal, scale 1/sqrt(d)
  Tensor<float> o16(q.shape()), o32(q.shape()), orr(q.shape());
  Tensor<float> l16(Shape{b, hq, sq}), l32(Shape{b, hq, sq}), lr(Shape{b, hq, sq});
  CpuBf16::attention_forward(q.view(), k.view(), v.view(), mask, o16.view(), l16.view());
  Cpu::attention_forward(q.view(), k.view(), v.view(), mask, o32.view(), l32.view());
  Cpu::attention_forward(rounded(q).view(), rounded(k).view(), rounded(v).view(), mask, orr.view(), lr.view());
  CHECK(same_bits(o16, orr));
  CHECK(same_bits(l16, lr));
  const double scale = 1.0 / std::sqrt(double(d)), gd = d * kE / (1 - d * kE);
  check_within("attention forward", o16, o32, [&](std::int64_t i) {
    const std::int64_t dd = i % d, h = (i / d) % hq, s = (i / (d * hq)) % sq, bb = i / (d * hq * sq);
    const std::int64_t kh = h / (hq / hkv);
    std::vector<double> score(static_cast<std::size_t>(skv));
    double top = -1e300, big_e = 0;
    for (std::int64_t j = 0; j < skv; ++j) {
      double dot = 0, abs_dot = 0;
      for (std::int64_t t = 0; t < d; ++t) {
        dot += double(q(bb, s, h, t)) * double(k(bb, j, kh, t));
        abs_dot += std::abs(double(q(bb, s, h, t)) * double(k(bb, j, kh, t)));
      }
      score[std::size_t(j)] = scale * dot;
      top = std::max(top, score[std::size_t(j)]);
      big_e = std::max(big_e, (2 * kU + kU * kU + 2 * gd) * scale * abs_dot);
    }
    double sum = 0;
    for (std::int64_t j = 0; j < skv; ++j) sum += std::exp(score[std::size_t(j)] - top);
    double pv = 0;
    for (std::int64_t j = 0; j < skv; ++j) pv += std::exp(score[std::size_t(j)] - top) / sum * std::abs(double(v(bb, j, kh, dd)));
    return (std::exp(2 * big_e) - 1) * pv * (1 + kU) + kU * pv + 2 * double(skv + 16) * kE * pv;
  });
  // Backward: q, k, v, out, dout read as bf16, lse fp32, dq, dk, dv accumulate in fp32.
  Tensor<float> dq0 = filled_like(q, rng), dk0 = filled_like(k, rng), dv0 = filled_like(v, rng);
  Tensor<float> dq16 = copy_of(dq0), dk16 = copy_of(dk0), dv16 = copy_of(dv0);
  Tensor<float> dqr = copy_of(dq0), dkr = copy_of(dk0), dvr = copy_of(dv0);
  CpuBf16::attention_backward(q.view(), k.view(), v.view(), o16.view(), l16.view(), dout.view(), mask, dq16.view(),
                              dk16.view(), dv16.view());
  Cpu::attention_backward(rounded(q).view(), rounded(k).view(), rounded(v).view(), rounded(o16).view(), l16.view(),
                          rounded(dout).view(), mask, dqr.view(), dkr.view(), dvr.view());
  CHECK(same_bits(dq16, dqr));
  CHECK(same_bits(dk16, dkr));
  CHECK(same_bits(dv16, dvr));
  // The merge of two key blocks is the fp32 accumulation: exactly ops::Cpu's.
  Tensor<float> m16 = copy_of(o16), ml16 = copy_of(l16), m32 = copy_of(o16), ml32 = copy_of(l16);
  CpuBf16::attention_merge(m16.view(), ml16.view(), o32.view(), l32.view());
  Cpu::attention_merge(m32.view(), ml32.view(), o32.view(), l32.view());
  CHECK(same_bits(m16, m32));
  CHECK(same_bits(ml16, ml32));
}

TEST_CASE("bf16 ops: embedding, cross-entropy, AdamW, softmax and the data movement") {
  Rng rng(6);
  const std::int64_t vocab = 29, h = 12, n = 17;
  const Tensor<float> table = random_tensor(Shape{vocab, h}, rng);
  Tensor<std::int32_t> tokens(Shape{n});
  for (std::int64_t i = 0; i < n; ++i) tokens.data()[i] = std::int32_t(rng.below(std::uint64_t(vocab)));
  // Embedding forward: the rows of a bf16 table, |d| <= u |x| (one rounding, exact otherwise).
  Tensor<float> e16(Shape{n, h}), e32(Shape{n, h}), er(Shape{n, h});
  CpuBf16::embedding_forward(tokens.view(), table.view(), e16.view());
  Cpu::embedding_forward(tokens.view(), table.view(), e32.view());
  Cpu::embedding_forward(tokens.view(), rounded(table).view(), er.view());
  CHECK(same_bits(e16, er));
  check_within("embedding forward", e16, e32, [&](std::int64_t i) { return kU * std::abs(double(e32.data()[i])); });
  // Embedding backward: dtable += rounded dout rows, summed in fp32 (the rule).
  const Tensor<float> dout = random_tensor(Shape{n, h}, rng);
  Tensor<float> dt0 = filled_like(table, rng), dt16 = copy_of(dt0), dtr = copy_of(dt0), dt32 = copy_of(dt0);
  CpuBf16::embedding_backward(tokens.view(), dout.view(), dt16.view());
  Cpu::embedding_backward(tokens.view(), rounded(dout).view(), dtr.view());
  Cpu::embedding_backward(tokens.view(), dout.view(), dt32.view());
  CHECK(same_bits(dt16, dtr));
  // A row's gradient is its start plus the dout rows of its tokens: each rounded once (<= u |dout|), summed in fp32
  // (<= g_m (|start| + sum |dout|) per run, m the row's count + 1): |d| <= u S + 2 g_m (|start| + S (1 + u)),
  // S = sum of |dout| over the row's tokens.
  check_within("embedding backward (+= into fp32)", dt16, dt32, [&](std::int64_t i) {
    const std::int64_t row = i / h, col = i % h;
    double sum = 0, count = 1;
    for (std::int64_t t = 0; t < n; ++t)
      if (tokens.data()[t] == row) sum += std::abs(double(dout(t, col))), count += 1;
    const double gm = count * kE / (1 - count * kE);
    return kU * sum + 2 * gm * (std::abs(double(dt0.data()[i])) + sum * (1 + kU));
  });
  // Cross-entropy: logits read as bf16, loss and dlogits fp32. With d = u max_j |z_j| per row, the probabilities
  // move by |dp_j| <= p_j (exp(2d) - 1) (as in attention), so |d dlogit_j| <= scale (p_j (exp(2d) - 1) + 16 e
  // (p_j + 1)) and the row's loss lse - z_t by <= 2d (+ 16 e (|lse| + |z_t|)).
  const std::int64_t rows = 21, classes = 37;
  const Tensor<float> logits = random_tensor(Shape{rows, classes}, rng, -6, 6);
  Tensor<std::int32_t> targets(Shape{rows});
  for (std::int64_t i = 0; i < rows; ++i) targets.data()[i] = std::int32_t(rng.below(std::uint64_t(classes)));
  Tensor<float> g16(logits.shape()), g32(logits.shape()), gr(logits.shape());
  const float grad_scale = 1.0f / float(rows);
  const auto r16 = CpuBf16::cross_entropy_forward_backward(logits.view(), targets.view(), g16.view(), grad_scale);
  const auto r32 = Cpu::cross_entropy_forward_backward(logits.view(), targets.view(), g32.view(), grad_scale);
  const auto rr = Cpu::cross_entropy_forward_backward(rounded(logits).view(), targets.view(), gr.view(), grad_scale);
  CHECK(same_bits(g16, gr));
  CHECK(r16.loss_sum == rr.loss_sum);
  std::vector<double> row_d(std::size_t(rows), 0.0), row_p;
  double loss_bound = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    double top = 0;
    for (std::int64_t j = 0; j < classes; ++j) top = std::max(top, double(std::abs(logits(r, j))));
    row_d[std::size_t(r)] = kU * top;
    loss_bound += 2 * kU * top + 16 * kE * 2 * (top + std::log(double(classes)));
  }
  CHECK(std::abs(r16.loss_sum - r32.loss_sum) <= loss_bound);
  check_within("cross-entropy dlogits", g16, g32, [&](std::int64_t i) {
    const std::int64_t r = i / classes, j = i % classes;
    double top = -1e300, sum = 0;
    for (std::int64_t t = 0; t < classes; ++t) top = std::max(top, double(logits(r, t)));
    for (std::int64_t t = 0; t < classes; ++t) sum += std::exp(double(logits(r, t)) - top);
    const double p = std::exp(double(logits(r, j)) - top) / sum;
    return grad_scale * (p * (std::exp(2 * row_d[std::size_t(r)]) - 1) + 16 * kE * (p + 1));
  });
  // AdamW, copy, fill, add_into, attention_merge: fp32, exactly ops::Cpu's.
  Tensor<float> p16 = random_tensor(Shape{50}, rng), p32 = copy_of(p16);
  Tensor<float> m16 = random_tensor(Shape{50}, rng), m32 = copy_of(m16);
  Tensor<float> v16 = random_tensor(Shape{50}, rng, 0, 1), v32 = copy_of(v16);
  const Tensor<float> g = random_tensor(Shape{50}, rng);
  CpuBf16::adamw_step(p16.view(), g.view(), m16.view(), v16.view(), ops::AdamWConfig{}, 3);
  Cpu::adamw_step(p32.view(), g.view(), m32.view(), v32.view(), ops::AdamWConfig{}, 3);
  CHECK((same_bits(p16, p32) && same_bits(m16, m32) && same_bits(v16, v32)));
  Tensor<float> a16 = copy_of(p16), a32 = copy_of(p16);
  CpuBf16::add_into(a16.view(), g.view());
  Cpu::add_into(a32.view(), g.view());
  CHECK(same_bits(a16, a32));
  // Materialised softmax: scores read as bf16, probabilities fp32; its backward reads probs and grads as bf16.
  Tensor<float> s16 = random_tensor(Shape{2, 5, 7}, rng, -3, 3), sr = rounded(s16);
  const ops::PositionRun qrun{0, 0, 5}, krun{0, 0, 7};
  CpuBf16::masked_softmax_forward(s16.view(), std::span(&qrun, 1), std::span(&krun, 1), false);
  Cpu::masked_softmax_forward(sr.view(), std::span(&qrun, 1), std::span(&krun, 1), false);
  CHECK(same_bits(s16, sr));
  Tensor<float> d16 = random_tensor(Shape{2, 5, 7}, rng), drr = rounded(d16);
  CpuBf16::softmax_backward(s16.view(), d16.view());
  Cpu::softmax_backward(rounded(s16).view(), drr.view());
  CHECK(same_bits(d16, drr));
}

TEST_CASE("bf16 ops: store_activation rounds to nearest, ties to even, in place, on strided views") {
  Tensor<float> x(Shape{3, 4});
  const float one_plus_half_ulp = 1.0f + 0x1p-8f;             // a tie: to even (1.0)
  const float one_plus_three_half = 1.0f + 3 * 0x1p-8f;       // a tie: to even (1 + 2^-6)
  const float just_above = 1.0f + 0x1p-8f + 0x1p-20f;         // above the tie: up
  for (std::int64_t i = 0; i < x.numel(); ++i) x.data()[i] = 7.0f;
  x(0, 0) = one_plus_half_ulp;
  x(1, 0) = one_plus_three_half;
  x(2, 0) = just_above;
  x(0, 1) = one_plus_half_ulp;  // outside the column view: untouched
  CpuBf16::store_activation(x.view().slice(1, 0, 1));
  CHECK(x(0, 0) == 1.0f);
  CHECK(x(1, 0) == 1.0f + 0x1p-6f);
  CHECK(x(2, 0) == 1.0f + 0x1p-7f);
  CHECK(x(0, 1) == one_plus_half_ulp);
}

}  // namespace bf16_ops_test
