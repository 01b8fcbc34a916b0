// ZeRO-3 linears on thread ranks against a plain float64 product with the whole weight: ring column linear (rotating
// shards, gradients returned to their owners) and all-gather row linear (gradients reduce-scattered).
#include "paradyse/strategy/zero3_linear.hpp"

#include "paradyse/comm/threads.hpp"
#include "paradyse/core/rng.hpp"
#include "strategy/harness.hpp"

#include <doctest/doctest.h>

using namespace paradyse;
using namespace paradyse::testing;

TEST_CASE("ring column linear: every block, dx and every shard's gradient") {
  for (int p : {1, 2, 3, 4}) {
    CAPTURE(p);
    const std::int64_t h = 12, R = 5, m_base = 7;
    Rng rng{std::uint64_t(p)};
    const Tensor<double> w = random_uniform<double>(Shape{p * R, h}, rng);  // rows = output features
    std::vector<Tensor<double>> x, dy;  // per rank: x [m_r, h], dy [m_r, p*R]; uneven m_r
    for (int r = 0; r < p; ++r) {
      x.push_back(random_uniform<double>(Shape{m_base + r, h}, rng));
      dy.push_back(random_uniform<double>(Shape{m_base + r, p * R}, rng));
    }
    // Reference: y_r = x_r w^T; dx_r = dy_r w; dw = sum_r dy_r^T x_r.
    Tensor<double> dw(Shape{p * R, h});
    for (int r = 0; r < p; ++r) {
      Tensor<double> dx_unused(x[std::size_t(r)].shape());
      ref::linear_backward(x[std::size_t(r)], w, dy[std::size_t(r)], dx_unused, dw);
    }
    Findings findings;
    run_ranks(p, [&](ThreadCommunicator& comm) {
      const int r = comm.rank();
      BufferPool pool;
      auto to_float = [](const Tensor<double>& t) {
        Tensor<float> f(t.shape());
        for (std::int64_t i = 0; i < t.numel(); ++i) f.span()[std::size_t(i)] = float(t.span()[std::size_t(i)]);
        return f;
      };
      Tensor<float> shard(Shape{R, h});
      for (std::int64_t i = 0; i < R * h; ++i) shard.span()[std::size_t(i)] = float(w.span()[std::size_t(r * R * h + i)]);
      const Tensor<float> xr = to_float(x[std::size_t(r)]), dyr = to_float(dy[std::size_t(r)]);
      const std::int64_t m = xr.extent(0);
      Tensor<float> y(Shape{m, p * R});
      ring_column_linear_forward<ops::Cpu>(comm, pool, xr.view(), shard.view(), [&](int j) { return y.view().slice(1, j * R, R); });
      const Tensor<double> y_ref = ref::linear(x[std::size_t(r)], w);
      findings.compare(y.span(), y_ref.span(), fmt::format("rank {} y", r));
      Tensor<float> dx(xr.shape()), grad(Shape{R, h});
      grad.fill(1.0f);  // accumulates on top
      ring_column_linear_backward<ops::Cpu>(comm, pool, xr.view(), shard.view(),
                                            [&](int j) { return TensorView<const float>(dyr.view()).slice(1, j * R, R); },
                                            dx.view(), grad.view());
      Tensor<double> dx_ref(xr.shape()), dw_unused(w.shape());
      ref::linear_backward(x[std::size_t(r)], w, dy[std::size_t(r)], dx_ref, dw_unused);
      findings.compare(dx.span(), dx_ref.span(), fmt::format("rank {} dx", r));
      std::vector<double> want(std::size_t(R * h));
      for (std::int64_t i = 0; i < R * h; ++i) want[std::size_t(i)] = 1.0 + dw.span()[std::size_t(r * R * h + i)];
      findings.compare(grad.span(), want, fmt::format("rank {} shard gradient", r));
    });
    findings.check_all("ring column linear");
  }
}

TEST_CASE("gathered row linear: output, input blocks' gradients and every shard's gradient") {
  for (int p : {1, 2, 3, 4}) {
    CAPTURE(p);
    const std::int64_t h = 9, R = 4, m = 6;
    Rng rng(10 + std::uint64_t(p));
    const Tensor<double> w = random_uniform<double>(Shape{p * R, h}, rng);  // y = a w
    std::vector<Tensor<double>> a, dy;
    for (int r = 0; r < p; ++r) {
      a.push_back(random_uniform<double>(Shape{m, p * R}, rng));
      dy.push_back(random_uniform<double>(Shape{m, h}, rng));
    }
    Tensor<double> dw(w.shape());
    for (int r = 0; r < p; ++r) {
      Tensor<double> da_unused(a[std::size_t(r)].shape());
      ref::linear_rows_backward(a[std::size_t(r)], w, dy[std::size_t(r)], da_unused, dw);
    }
    Findings findings;
    run_ranks(p, [&](ThreadCommunicator& comm) {
      const int r = comm.rank();
      BufferPool pool;
      Tensor<float> shard(Shape{R, h}), ar(Shape{m, p * R}), dyr(Shape{m, h});
      for (std::int64_t i = 0; i < R * h; ++i) shard.span()[std::size_t(i)] = float(w.span()[std::size_t(r * R * h + i)]);
      for (std::int64_t i = 0; i < ar.numel(); ++i) ar.span()[std::size_t(i)] = float(a[std::size_t(r)].span()[std::size_t(i)]);
      for (std::int64_t i = 0; i < dyr.numel(); ++i) dyr.span()[std::size_t(i)] = float(dy[std::size_t(r)].span()[std::size_t(i)]);
      Tensor<float> y(Shape{m, h}), da(ar.shape()), grad(Shape{R, h});
      auto block = [&](int j) { return TensorView<const float>(ar.view()).slice(1, j * R, R); };
      gathered_row_linear_forward<ops::Cpu>(comm, pool, shard.view(), block, y.view());
      findings.compare(y.span(), ref::linear_rows(a[std::size_t(r)], w).span(), fmt::format("rank {} y", r));
      gathered_row_linear_backward<ops::Cpu>(comm, pool, shard.view(), block, dyr.view(),
                                             [&](int j) { return da.view().slice(1, j * R, R); }, grad.view());
      Tensor<double> da_ref(ar.shape()), dw_unused(w.shape());
      ref::linear_rows_backward(a[std::size_t(r)], w, dy[std::size_t(r)], da_ref, dw_unused);
      findings.compare(da.span(), da_ref.span(), fmt::format("rank {} da", r));
      findings.compare(grad.span(), std::span<const double>(dw.data() + r * R * h, std::size_t(R * h)), fmt::format("rank {} shard gradient", r));
    });
    findings.check_all("gathered row linear");
  }
}
