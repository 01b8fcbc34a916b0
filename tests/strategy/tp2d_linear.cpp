// 2D tensor-parallel linear and GELU MLP (strategy/tp2d_linear.hpp) on thread ranks, grids 2x2, 2x3, 3x2, 1x3 and
// 3x1, against a float64 single-rank reference: the output, the input gradient and every rank's weight-block
// gradient, in both directions of the linear (layout A -> B and B -> A), on fresh random inputs.
#include "paradyse/strategy/tp2d_linear.hpp"

#include "paradyse/comm/threads.hpp"
#include "paradyse/core/rng.hpp"
#include "ops/reference.hpp"
#include "strategy/harness.hpp"
#include "strategy/tp2d_reference.hpp"

#include <doctest/doctest.h>

#include <utility>
#include <vector>

using namespace paradyse;
using namespace paradyse::testing;

namespace {

const std::vector<std::pair<int, int>> kGrids{{2, 2}, {2, 3}, {3, 2}, {1, 3}, {3, 1}};

// The columns of several float64 matrices of equal rows, side by side.
Tensor<double> side_by_side(const Tensor<double>& a, const Tensor<double>& b, const Tensor<double>& c) {
  const Tensor<double>* parts[] = {&a, &b, &c};
  std::int64_t cols = 0;
  for (const Tensor<double>* p : parts) cols += p->extent(1);
  Tensor<double> out(Shape{a.extent(0), cols});
  std::int64_t at = 0;
  for (const Tensor<double>* part : parts) {
    const Tensor<double>& p = *part;
    for (std::int64_t i = 0; i < p.extent(0); ++i)
      for (std::int64_t j = 0; j < p.extent(1); ++j) out(i, at + j) = p(i, j);
    at += p.extent(1);
  }
  return out;
}
// Block (r, c) of [rows, cols] blocks of a float64 matrix, as float64.
Tensor<double> block_of(const Tensor<double>& t, int r, int rows, int c, int cols) {
  const std::int64_t br = t.extent(0) / rows, bc = t.extent(1) / cols;
  Tensor<double> b(Shape{br, bc});
  for (std::int64_t i = 0; i < br; ++i)
    for (std::int64_t j = 0; j < bc; ++j) b(i, j) = t(r * br + i, c * bc + j);
  return b;
}
Tensor<double> from_vec(const std::vector<double>& v, std::int64_t rows, std::int64_t cols) {
  Tensor<double> t(Shape{rows, cols});
  std::copy(v.begin(), v.end(), t.data());
  return t;
}

}  // namespace

TEST_CASE("tp2d linear: output, input gradient and every weight block's gradient, both directions") {
  std::uint64_t seed = 1;
  for (auto [gx, gy] : kGrids)
    for (bool a_to_b : {true, false}) {
      CAPTURE(gx);
      CAPTURE(gy);
      CAPTURE(a_to_b);
      const std::int64_t T = 12, k = 12, n = 18;
      Rng rng(seed++);
      const Tensor<double> x = random_uniform<double>(Shape{T, k}, rng);
      const Tensor<double> w = random_uniform<double>(Shape{k, n}, rng);
      const Tensor<double> dy = random_uniform<double>(Shape{T, n}, rng);
      const Tensor<double> y = product(x, false, w, false);
      const Tensor<double> dx = product(dy, false, w, true);
      const Tensor<double> dw = product(x, true, dy, false);
      const DeviceMesh mesh({{"tp_x", gx}, {"tp_y", gy}});
      Findings findings;
      run_ranks(gx * gy, [&](ThreadCommunicator& world) {
        const int i = mesh.coordinate(world.rank(), "tp_x"), j = mesh.coordinate(world.rank(), "tp_y");
        Tp2dGrid<ThreadCommunicator> grid = Tp2dGrid<ThreadCommunicator>::make(mesh, world);
        BufferPool pool;
        // A -> B gathers over tp_y and scatters over tp_x; B -> A the reverse. With (g, G) my index and size in the
        // gather group and (s, S) in the scatter group: x and dx are block (g, s) of [G, S] blocks, W, dW, y and dy
        // block (s, g) of [S, G].
        const int g = a_to_b ? j : i, G = a_to_b ? gy : gx, s = a_to_b ? i : j, S = a_to_b ? gx : gy;
        ThreadCommunicator& gather = a_to_b ? grid.y : grid.x;
        ThreadCommunicator& scatter = a_to_b ? grid.x : grid.y;
        const Tensor<float> xl = block(x, g, G, s, S), wl = block(w, s, S, g, G), dyl = block(dy, s, S, g, G);
        Tensor<float> yl(Shape{T / S, n / G});
        tp2d_linear_forward<ops::Cpu>(gather, scatter, pool, xl.view(), wl.view(), yl.view());
        const std::string where = fmt::format("rank ({}, {})", i, j);
        findings.compare(yl.span(), block64(y, s, S, g, G), where + " y");
        Tensor<float> dxl(xl.shape()), dwl(wl.shape());
        dwl.fill(1.0f);  // accumulates on top
        tp2d_linear_backward<ops::Cpu>(gather, scatter, pool, xl.view(), wl.view(), dyl.view(), dxl.view(),
                                       dwl.view());
        findings.compare(dxl.span(), block64(dx, g, G, s, S), where + " dx");
        findings.compare(dwl.span(), block64(dw, s, S, g, G, 1.0), where + " dw");
      });
      findings.check_all("tp2d linear");
    }
}

TEST_CASE("tp2d MLP: gelu(x W1) W2 from layout A back to layout A, forward and every gradient") {
  std::uint64_t seed = 100;
  for (auto [gx, gy] : kGrids) {
    CAPTURE(gx);
    CAPTURE(gy);
    const std::int64_t T = 12, h = 12, f = 18;
    Rng rng(seed++);
    const Tensor<double> x = random_uniform<double>(Shape{T, h}, rng);
    const Tensor<double> w1 = random_uniform<double>(Shape{h, f}, rng);
    const Tensor<double> w2 = random_uniform<double>(Shape{f, h}, rng);
    const Tensor<double> dout = random_uniform<double>(Shape{T, h}, rng);
    // Reference: pre = x W1, act = gelu(pre), out = act W2, and the chain rule back.
    const Tensor<double> pre = product(x, false, w1, false);
    Tensor<double> act(pre.shape());
    for (std::int64_t e = 0; e < pre.numel(); ++e) act.span()[std::size_t(e)] = ref::gelu(pre.span()[std::size_t(e)]);
    const Tensor<double> out = product(act, false, w2, false);
    const Tensor<double> dw2 = product(act, true, dout, false);
    Tensor<double> dpre = product(dout, false, w2, true);
    for (std::int64_t e = 0; e < pre.numel(); ++e)
      dpre.span()[std::size_t(e)] *= ref::gelu_derivative(pre.span()[std::size_t(e)]);
    const Tensor<double> dx = product(dpre, false, w1, true);
    const Tensor<double> dw1 = product(x, true, dpre, false);
    const DeviceMesh mesh({{"tp_x", gx}, {"tp_y", gy}});
    Findings findings;
    run_ranks(gx * gy, [&](ThreadCommunicator& world) {
      const int i = mesh.coordinate(world.rank(), "tp_x"), j = mesh.coordinate(world.rank(), "tp_y");
      Tp2dGrid<ThreadCommunicator> grid = Tp2dGrid<ThreadCommunicator>::make(mesh, world);
      BufferPool pool;
      const Tensor<float> xl = block(x, j, gy, i, gx);     // [T / y, h / x]
      const Tensor<float> w1l = block(w1, i, gx, j, gy);   // [h / x, f / y]
      const Tensor<float> w2l = block(w2, j, gy, i, gx);   // [f / y, h / x]
      const Tensor<float> doutl = block(dout, j, gy, i, gx);
      Tensor<float> prel(Shape{T / gx, f / gy}), outl(xl.shape());
      tp2d_mlp_forward<ops::Cpu>(grid, pool, xl.view(), w1l.view(), w2l.view(), prel.view(), outl.view());
      const std::string where = fmt::format("rank ({}, {})", i, j);
      findings.compare(prel.span(), block64(pre, i, gx, j, gy), where + " pre");
      findings.compare(outl.span(), block64(out, j, gy, i, gx), where + " out");
      Tensor<float> dxl(xl.shape()), dw1l(w1l.shape()), dw2l(w2l.shape());
      dw1l.fill(0.0f);
      dw2l.fill(0.0f);
      tp2d_mlp_backward<ops::Cpu>(grid, pool, xl.view(), w1l.view(), w2l.view(), prel.view(), doutl.view(),
                                  dxl.view(), dw1l.view(), dw2l.view());
      findings.compare(dxl.span(), block64(dx, j, gy, i, gx), where + " dx");
      findings.compare(dw1l.span(), block64(dw1, i, gx, j, gy), where + " dW1");
      findings.compare(dw2l.span(), block64(dw2, j, gy, i, gx), where + " dW2");
    });
    findings.check_all("tp2d MLP");
  }
}

TEST_CASE("tp2d linear: shapes that do not split and meshes without the axes are refused naming them") {
  Findings findings;
  auto expect_error = [&](auto&& f, const std::string& needle) {
    try {
      f();
      findings.fail("no error; expected one containing \"" + needle + "\"");
    } catch (const Error& e) {
      if (std::string(e.what()).find(needle) == std::string::npos)
        findings.fail(fmt::format("error \"{}\" does not contain \"{}\"", e.what(), needle));
    }
  };
  run_ranks(2, [&](ThreadCommunicator& world) {
    Tp2dGrid<ThreadCommunicator> grid = Tp2dGrid<ThreadCommunicator>::make(DeviceMesh({{"tp_x", 2}, {"tp_y", 1}}), world);
    BufferPool pool;
    Tensor<float> x(Shape{3, 4}), w(Shape{4, 5}), y(Shape{1, 5}), wrong(Shape{5, 5});
    x.fill(0.0f);
    w.fill(0.0f);
    wrong.fill(0.0f);
    // 3 tokens gathered over tp_y (1) do not split over tp_x (2).
    expect_error([&] { tp2d_linear_forward<ops::Cpu>(grid.y, grid.x, pool, x.view(), w.view(), y.view()); },
                 "3 tokens do not split over the scatter group of 2");
    expect_error([&] { tp2d_linear_forward<ops::Cpu>(grid.y, grid.x, pool, x.view(), wrong.view(), y.view()); },
                 "must be [T / 1, k = 5]");
    expect_error([&] { Tp2dGrid<ThreadCommunicator>::make(DeviceMesh({{"dp", 2}}), world); }, "unknown mesh axis 'tp_x'");
  });
  findings.check_all("tp2d errors");
}

TEST_CASE("tp2d attention: q, k, v and output projections on 2x2 and 2x3 grids, forward and every gradient") {
  std::uint64_t seed = 300;
  struct Heads {
    std::int64_t q, kv, d;
    bool causal;
  };
  for (auto [gx, gy] : std::vector<std::pair<int, int>>{{2, 2}, {2, 3}, {3, 2}, {1, 2}, {2, 1}})
    for (const Heads heads : {Heads{6, 6, 2, true}, Heads{12, 6, 2, false}, Heads{6, 6, 2, false}, Heads{12, 6, 1, true}}) {
      CAPTURE(gx);
      CAPTURE(gy);
      CAPTURE(heads.q);
      CAPTURE(heads.causal);
      const std::int64_t T = 12, h = 12, q = heads.q * heads.d, kv = heads.kv * heads.d;
      Rng rng(seed++);
      const Tensor<double> x = random_uniform<double>(Shape{T, h}, rng);
      const Tensor<double> wq = random_uniform<double>(Shape{h, q}, rng), wk = random_uniform<double>(Shape{h, kv}, rng);
      const Tensor<double> wv = random_uniform<double>(Shape{h, kv}, rng), wo = random_uniform<double>(Shape{q, h}, rng);
      const Tensor<double> dout = random_uniform<double>(Shape{T, h}, rng);
      // Reference: Q = x Wq, K = x Wk, V = x Wv, A = attention(Q, K, V), out = A Wo, and the chain rule back.
      const Tensor<double> Q = product(x, false, wq, false), K = product(x, false, wk, false),
                           V = product(x, false, wv, false);
      const AttentionShape shape{1, T, T, heads.q, heads.kv, heads.d};
      ReferenceMask mask;
      mask.causal = heads.causal;
      const auto vec = [](const Tensor<double>& t) { return std::vector<double>(t.data(), t.data() + t.numel()); };
      const ReferenceAttention attention = reference_attention_forward(shape, mask, vec(Q), vec(K), vec(V));
      const Tensor<double> A = from_vec(attention.out, T, q);
      const Tensor<double> out = product(A, false, wo, false);
      const Tensor<double> dwo = product(A, true, dout, false), dA = product(dout, false, wo, true);
      const ReferenceAttentionGrads g = reference_attention_backward(shape, mask, vec(Q), vec(K), vec(V), vec(dA));
      const Tensor<double> dQ = from_vec(g.dq, T, q), dK = from_vec(g.dk, T, kv), dV = from_vec(g.dv, T, kv);
      const Tensor<double> dwq = product(x, true, dQ, false), dwk = product(x, true, dK, false),
                           dwv = product(x, true, dV, false);
      Tensor<double> dx = product(dQ, false, wq, true);
      const Tensor<double> dxk = product(dK, false, wk, true), dxv = product(dV, false, wv, true);
      for (std::int64_t e = 0; e < dx.numel(); ++e) dx.data()[e] += dxk.data()[e] + dxv.data()[e];

      const DeviceMesh mesh({{"tp_x", gx}, {"tp_y", gy}});
      const Tp2dAttentionHeads layout{heads.q, heads.kv, heads.d, heads.causal};
      Findings findings;
      run_ranks(gx * gy, [&](ThreadCommunicator& world) {
        const int i = mesh.coordinate(world.rank(), "tp_x"), j = mesh.coordinate(world.rank(), "tp_y");
        Tp2dGrid<ThreadCommunicator> grid = Tp2dGrid<ThreadCommunicator>::make(mesh, world);
        BufferPool pool;
        // Rank (i, j): rows block i of Wq, Wk, Wv with their head block j side by side; block (j, i) of Wo.
        const auto packed = [&](const Tensor<double>& a, const Tensor<double>& b, const Tensor<double>& c, int r,
                                int rows) {
          return side_by_side(block_of(a, r, rows, j, gy), block_of(b, r, rows, j, gy), block_of(c, r, rows, j, gy));
        };
        const Tensor<float> xl = block(x, j, gy, i, gx);
        const Tensor<float> wqkv = block(packed(wq, wk, wv, i, gx), 0, 1, 0, 1);
        const Tensor<float> wol = block(wo, j, gy, i, gx), doutl = block(dout, j, gy, i, gx);
        const std::int64_t hq = layout.local_q(gy);
        Tensor<float> qkv(Shape{T / gx, layout.local_qkv_width(gy)}), attn(Shape{T / gx, hq * heads.d});
        Tensor<float> lse(Shape{1, hq, T / gx}), outl(xl.shape());
        tp2d_attention_forward<ops::Cpu>(grid, pool, layout, xl.view(), wqkv.view(), wol.view(), qkv.view(),
                                         attn.view(), lse.view(), outl.view());
        const std::string where = fmt::format("rank ({}, {})", i, j);
        findings.compare(qkv.span(), block64(packed(Q, K, V, i, gx), 0, 1, 0, 1), where + " qkv");
        findings.compare(attn.span(), block64(A, i, gx, j, gy), where + " attention output");
        findings.compare(outl.span(), block64(out, j, gy, i, gx), where + " out");
        Tensor<float> dxl(xl.shape()), dwqkv(wqkv.shape()), dwol(wol.shape());
        dwqkv.fill(1.0f);  // accumulate on top
        dwol.fill(1.0f);
        tp2d_attention_backward<ops::Cpu>(grid, pool, layout, xl.view(), wqkv.view(), wol.view(), qkv.view(),
                                          attn.view(), lse.view(), doutl.view(), dxl.view(), dwqkv.view(), dwol.view());
        findings.compare(dxl.span(), block64(dx, j, gy, i, gx), where + " dx");
        findings.compare(dwqkv.span(), block64(packed(dwq, dwk, dwv, i, gx), 0, 1, 0, 1, 1.0), where + " dW_qkv");
        findings.compare(dwol.span(), block64(dwo, j, gy, i, gx, 1.0), where + " dW_o");
      });
      findings.check_all("tp2d attention");
    }
  // Heads that do not split over tp_y are refused, naming the sizes.
  std::vector<std::string> messages(2);
  run_ranks(2, [&](ThreadCommunicator& world) {
    Tp2dGrid<ThreadCommunicator> grid = Tp2dGrid<ThreadCommunicator>::make(DeviceMesh({{"tp_x", 1}, {"tp_y", 2}}), world);
    BufferPool pool;
    Tensor<float> x(Shape{2, 4}), w(Shape{4, 6}), wo(Shape{1, 4}), qkv(Shape{4, 6}), attn(Shape{4, 3}),
        lse(Shape{1, 1, 4}), out(Shape{2, 4});
    x.fill(0.0f);
    w.fill(0.0f);
    wo.fill(0.0f);
    const Tp2dAttentionHeads odd{3, 3, 1, false};
    try {
      tp2d_attention_forward<ops::Cpu>(grid, pool, odd, x.view(), w.view(), wo.view(), qkv.view(), attn.view(),
                                       lse.view(), out.view());
    } catch (const Error& e) {
      messages[std::size_t(world.rank())] = e.what();
    }
  });
  for (const std::string& message : messages)
    CHECK_MESSAGE(message.find("q_heads = 3 and kv_heads = 3 must split over tp_y of 2") != std::string::npos, message);
}
