// Tests of the op-by-op timing backend (cost/op_times.hpp): each call is priced as the time model prices its events
// (the GEMM's fit, flash attention's rate, an elementwise kernel's class, the call overhead), counted and timed under
// the thread's current table only; a call that throws is not recorded; outputs are the base backend's.
#include "paradyse/cost/builtin_profiles.hpp"
#include "paradyse/cost/op_times.hpp"
#include "paradyse/ops/backend.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <thread>

using namespace paradyse;
using Timed = cost::OpTimed<ops::Cpu>;

namespace op_times_test {

Tensor<float> filled(Shape shape, float value) {
  Tensor<float> t(shape);
  ops::Cpu::fill(t.view(), value);
  return t;
}

}  // namespace op_times_test

TEST_CASE("op times: each call priced as the time model prices its events, counted and timed") {
  cost::HardwareProfile hw = cost::h100_sxm_80gb_x8();
  hw.call_overhead.kernel_call_s = 3e-6;
  cost::OpTimes times(hw);
  const std::int64_t m = 96, n = 80, k = 64, s = 128, heads = 2, d = 32;
  const Tensor<float> a = op_times_test::filled({m, k}, 0.5f), b = op_times_test::filled({n, k}, 0.25f);
  Tensor<float> c({m, n});
  const Tensor<float> q = op_times_test::filled({1, s, heads, d}, 0.1f);
  Tensor<float> out({1, s, heads, d}), lse({1, heads, s}), y({m, k});
  const ops::AttentionMask causal{.causal = true};
  {
    const cost::ScopedOpTimes on(times);
    for (int i = 0; i < 2; ++i) Timed::matmul(a.view(), ops::Transpose::no, b.view(), ops::Transpose::yes, c.view());
    Timed::attention_forward(q.view(), q.view(), q.view(), causal, out.view(), lse.view());
    Timed::copy(a.view(), y.view());
    CHECK_THROWS(Timed::copy(a.view(), c.view()));  // shapes differ: thrown, not recorded
  }
  Timed::copy(a.view(), y.view());  // no table current: untimed
  REQUIRE(times.by_op().size() == 3);
  const cost::OpTime& gemm = times.by_op().find("matmul")->second;
  CHECK(gemm.calls == 2);
  CHECK(gemm.priced_s == doctest::Approx(2 * hw.gemm.time(double(m), double(n), double(k), 4)).epsilon(1e-12));
  CHECK(gemm.measured_s > 0);
  const cost::OpTime& attention = times.by_op().find("attention_forward")->second;
  CHECK(attention.calls == 1);
  const double pairs = double(s) * double(s + 1) / 2;  // causal: the visible pairs
  CHECK(attention.priced_s == doctest::Approx(hw.attention.forward_time(4.0 * d * heads * pairs)).epsilon(1e-12));
  const cost::OpTime& copy = times.by_op().find("copy")->second;
  CHECK(copy.calls == 1);
  CHECK(copy.priced_s == doctest::Approx(hw.elementwise_time(2.0 * 4 * double(m * k)) + 3e-6).epsilon(1e-12));
  const cost::OpTime total = times.total();
  CHECK(total.calls == 4);
  CHECK(total.priced_s == doctest::Approx(gemm.priced_s + attention.priced_s + copy.priced_s).epsilon(1e-12));
  // The outputs are the base backend's.
  Tensor<float> want({m, n});
  ops::Cpu::matmul(a.view(), ops::Transpose::no, b.view(), ops::Transpose::yes, want.view());
  for (std::int64_t i = 0; i < m * n; ++i) REQUIRE(c.data()[i] == want.data()[i]);
}

TEST_CASE("op times: another thread's table is not this thread's") {
  cost::OpTimes mine(cost::h100_sxm_80gb_x8());
  const cost::ScopedOpTimes on(mine);
  const Tensor<float> a = op_times_test::filled({8, 8}, 1.0f);
  Tensor<float> b({8, 8});
  std::thread other([&] { Timed::copy(a.view(), b.view()); });
  other.join();
  CHECK(mine.by_op().empty());
  Timed::copy(a.view(), b.view());
  CHECK(mine.by_op().size() == 1);
}
