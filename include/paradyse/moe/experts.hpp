// paradyse/moe/experts.hpp: SwiGLU experts over ragged blocks, one GEMM per expert and projection.
//
// Rows arrive grouped by expert (moe/dispatch.hpp): block e is rows [offsets[e], offsets[e+1]) and goes through
// expert e of the bank: pre = x_e W_in_e^T ([m_e, 2f]: gate columns, then up), act = silu(gate) * up, y_e = act W_out_e.
// An empty block costs nothing. The same code runs the shared experts (a bank of one expert over every token).
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/ops/cpu/gemm.hpp"
#include "paradyse/strategy/buffer_pool.hpp"

#include <algorithm>
#include <cstdint>
#include <span>

namespace paradyse {

// The experts a block list runs through: in [E_b, 2f, h] (W_in^T, gate rows then up rows), out [E_b, f, h] (W_out).
template <class T>
struct ExpertBank {
  TensorView<T> in;
  TensorView<T> out;

  std::int64_t experts() const { return in.extent(0); }
  std::int64_t ffn() const { return out.extent(1); }
  std::int64_t hidden() const { return out.extent(2); }
  TensorView<T> in_of(std::int64_t e) const { return in.slice(0, e, 1).reshape(Shape{in.extent(1), in.extent(2)}); }
  TensorView<T> out_of(std::int64_t e) const {
    return out.slice(0, e, 1).reshape(Shape{out.extent(1), out.extent(2)});
  }
};

namespace experts_detail {
template <class T>
void check_bank(const char* who, const ExpertBank<T>& bank, std::span<const std::int64_t> offsets,
                TensorView<const float> x) {
  check(bank.in.rank() == 3 && bank.out.rank() == 3 && bank.in.is_contiguous() && bank.out.is_contiguous() &&
            bank.in.extent(0) == bank.out.extent(0) && bank.in.extent(1) == 2 * bank.out.extent(1) &&
            bank.in.extent(2) == bank.out.extent(2),
        "{}: the bank must be contiguous in [E, 2f, h] and out [E, f, h]; got in {} and out {}", who, bank.in.shape(),
        bank.out.shape());
  check(std::int64_t(offsets.size()) == bank.experts() + 1 && offsets[0] == 0,
        "{}: {} block offsets for {} experts (expected E + 1, starting at 0)", who, offsets.size(), bank.experts());
  for (std::size_t e = 0; e + 1 < offsets.size(); ++e)
    check(offsets[e + 1] >= offsets[e], "{}: block {} has negative length", who, e);
  check(x.rank() == 2 && x.is_contiguous() && x.extent(0) == offsets.back() && x.extent(1) == bank.hidden(),
        "{}: x {} must be contiguous [rows = {}, h = {}]", who, x.shape(), offsets.back(), bank.hidden());
}
}  // namespace experts_detail

// x: [rows, h]; pre: [rows, 2f] (overwritten, kept for backward); y: [rows, h] (overwritten). Scratch from `pool`.
template <class Backend>
void experts_forward(const ExpertBank<const float>& bank, std::span<const std::int64_t> offsets,
                     TensorView<const float> x, TensorView<float> pre, TensorView<float> y, BufferPool& pool) {
  experts_detail::check_bank("experts_forward", bank, offsets, x);
  const std::int64_t f = bank.ffn(), rows = x.extent(0);
  check(pre.shape() == Shape{rows, 2 * f} && y.shape() == x.shape(), "experts_forward: pre {} must be [{}, {}], y {} {}",
        pre.shape(), rows, 2 * f, y.shape(), x.shape());
  std::int64_t widest = 0;
  for (std::int64_t e = 0; e < bank.experts(); ++e) widest = std::max(widest, offsets[std::size_t(e + 1)] - offsets[std::size_t(e)]);
  PooledBuffer<float> act = pool.acquire<float>(Shape{widest, f});
  for (std::int64_t e = 0; e < bank.experts(); ++e) {
    const std::int64_t begin = offsets[std::size_t(e)], m = offsets[std::size_t(e + 1)] - begin;
    if (m == 0) continue;
    const TensorView<float> pre_e = pre.slice(0, begin, m), act_e = act.view().slice(0, 0, m);
    Backend::matmul(x.slice(0, begin, m), ops::Transpose::no, bank.in_of(e), ops::Transpose::yes, pre_e);
    Backend::swiglu_forward(pre_e.slice(1, 0, f), pre_e.slice(1, f, f), act_e);
    Backend::matmul(act_e, ops::Transpose::no, bank.out_of(e), ops::Transpose::no, y.slice(0, begin, m));
  }
}

// dy: [rows, h]; dx: [rows, h] (overwritten); grad: the bank's gradient (ACCUMULATED). The activation is recomputed.
template <class Backend>
void experts_backward(const ExpertBank<const float>& bank, std::span<const std::int64_t> offsets,
                      TensorView<const float> x, TensorView<const float> pre, TensorView<const float> dy,
                      TensorView<float> dx, const ExpertBank<float>& grad, BufferPool& pool) {
  experts_detail::check_bank("experts_backward", bank, offsets, x);
  const std::int64_t f = bank.ffn(), rows = x.extent(0);
  check(pre.shape() == Shape{rows, 2 * f} && dy.shape() == x.shape() && dx.shape() == x.shape() &&
            grad.in.shape() == bank.in.shape() && grad.out.shape() == bank.out.shape(),
        "experts_backward: pre {}, dy {}, dx {}, grad in {} out {} do not match x {} and the bank in {} out {}",
        pre.shape(), dy.shape(), dx.shape(), grad.in.shape(), grad.out.shape(), x.shape(), bank.in.shape(),
        bank.out.shape());
  std::int64_t widest = 0;
  for (std::int64_t e = 0; e < bank.experts(); ++e) widest = std::max(widest, offsets[std::size_t(e + 1)] - offsets[std::size_t(e)]);
  PooledBuffer<float> act = pool.acquire<float>(Shape{widest, f}), dact = pool.acquire<float>(Shape{widest, f}),
                      dpre = pool.acquire<float>(Shape{widest, 2 * f});
  for (std::int64_t e = 0; e < bank.experts(); ++e) {
    const std::int64_t begin = offsets[std::size_t(e)], m = offsets[std::size_t(e + 1)] - begin;
    if (m == 0) continue;
    const TensorView<const float> pre_e = pre.slice(0, begin, m), x_e = x.slice(0, begin, m), dy_e = dy.slice(0, begin, m);
    const TensorView<float> act_e = act.view().slice(0, 0, m), dact_e = dact.view().slice(0, 0, m),
                            dpre_e = dpre.view().slice(0, 0, m);
    Backend::swiglu_forward(pre_e.slice(1, 0, f), pre_e.slice(1, f, f), act_e);
    Backend::matmul(dy_e, ops::Transpose::no, bank.out_of(e), ops::Transpose::yes, dact_e);
    Backend::matmul(act_e, ops::Transpose::yes, dy_e, ops::Transpose::no, grad.out_of(e), 1.0f, 1.0f);
    Backend::fill(dpre_e, 0.0f);  // the op accumulates
    Backend::swiglu_backward(pre_e.slice(1, 0, f), pre_e.slice(1, f, f), dact_e, dpre_e.slice(1, 0, f),
                             dpre_e.slice(1, f, f));
    Backend::matmul(dpre_e, ops::Transpose::yes, x_e, ops::Transpose::no, grad.in_of(e), 1.0f, 1.0f);
    Backend::matmul(dpre_e, ops::Transpose::no, bank.in_of(e), ops::Transpose::no, dx.slice(0, begin, m));
  }
}

}  // namespace paradyse
