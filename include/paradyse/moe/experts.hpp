// paradyse/moe/experts.hpp: SwiGLU experts over ragged blocks, each projection one grouped GEMM over the experts.
//
// Rows arrive grouped by expert (moe/dispatch.hpp): block e is rows [offsets[e], offsets[e+1]) and goes through
// expert e of the bank: pre = x_e W_in_e^T ([m_e, 2f]: gate columns, then up), act = silu(gate) * up, y_e = act W_out_e.
// Each projection is one Backend::gemm_grouped call with an item per non-empty block (ops/cpu/gemm_grouped.hpp: one
// cuBLAS launch for every expert on a device, where a loop launched one per expert and projection), the SwiGLU one
// call over every row. An empty block costs nothing. The same code runs the shared experts (a bank of one expert over
// every token).
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/ops/cpu/gemm_grouped.hpp"
#include "paradyse/strategy/buffer_pool.hpp"

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

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

// One expert's weights, wherever they live (a bank's slot, a fetched copy): in [2f, h] (W_in^T), out [f, h] (W_out).
template <class T>
struct ExpertWeights {
  TensorView<T> in;
  TensorView<T> out;
};

namespace experts_detail {
// Checks a block list's offsets [E + 1] (from 0, ascending) and its rows x [offsets.back(), h] (contiguous).
inline void check_blocks(const char* who, std::int64_t experts, std::span<const std::int64_t> offsets,
                         TensorView<const float> x, std::int64_t h) {
  check(std::int64_t(offsets.size()) == experts + 1 && offsets[0] == 0,
        "{}: {} block offsets for {} experts (expected E + 1, starting at 0)", who, offsets.size(), experts);
  for (std::size_t e = 0; e + 1 < offsets.size(); ++e)
    check(offsets[e + 1] >= offsets[e], "{}: block {} has negative length", who, e);
  check(x.rank() == 2 && x.is_contiguous() && x.extent(0) == offsets.back() && x.extent(1) == h,
        "{}: x {} must be contiguous [rows = {}, h = {}]", who, x.shape(), offsets.back(), h);
}

template <class T>
void check_bank(const char* who, const ExpertBank<T>& bank, std::span<const std::int64_t> offsets,
                TensorView<const float> x) {
  check(bank.in.rank() == 3 && bank.out.rank() == 3 && bank.in.is_contiguous() && bank.out.is_contiguous() &&
            bank.in.extent(0) == bank.out.extent(0) && bank.in.extent(1) == 2 * bank.out.extent(1) &&
            bank.in.extent(2) == bank.out.extent(2),
        "{}: the bank must be contiguous in [E, 2f, h] and out [E, f, h]; got in {} and out {}", who, bank.in.shape(),
        bank.out.shape());
  check_blocks(who, bank.experts(), offsets, x, bank.hidden());
}

// Whether a 2-D view's columns are contiguous (its rows may be strided): what a GEMM operand needs.
template <class T>
bool rows_of_columns(TensorView<T> v) {
  return v.rank() == 2 && (v.extent(1) <= 1 || v.strides()[1] == 1);
}

// The non-empty blocks of a bank's offsets: (expert, first row, rows) for each, in expert order.
class Blocks {
public:
  struct Block {
    std::int64_t expert, begin, rows;
  };
  explicit Blocks(std::span<const std::int64_t> offsets) {
    for (std::size_t e = 0; e + 1 < offsets.size(); ++e)
      if (offsets[e + 1] > offsets[e]) blocks_.push_back({std::int64_t(e), offsets[e], offsets[e + 1] - offsets[e]});
  }
  auto begin() const { return blocks_.begin(); }
  auto end() const { return blocks_.end(); }

private:
  std::vector<Block> blocks_;
};
}  // namespace experts_detail

// x: [rows, h]; pre: [rows, 2f] (overwritten, kept for backward); y: [rows, h] (overwritten). Scratch from `pool`.
// Block e goes through experts[e]: E = experts.size() blocks, offsets [E + 1]. x is contiguous; pre's and y's rows may
// be strided, their columns contiguous. Two grouped GEMMs (one item per non-empty block) and one SwiGLU over every row.
template <class Backend>
void experts_forward(std::span<const ExpertWeights<const float>> experts, std::span<const std::int64_t> offsets,
                     TensorView<const float> x, TensorView<float> pre, TensorView<float> y, BufferPool& pool) {
  const std::int64_t f = pre.extent(1) / 2, h = x.extent(1), rows = x.extent(0);
  for (const ExpertWeights<const float>& w : experts)
    check(w.in.shape() == Shape{2 * f, h} && w.out.shape() == Shape{f, h} && w.in.is_contiguous() &&
              w.out.is_contiguous(),
          "experts_forward: an expert's weights in {} and out {} must be contiguous [{}, {}] and [{}, {}]",
          w.in.shape(), w.out.shape(), 2 * f, h, f, h);
  experts_detail::check_blocks("experts_forward", std::int64_t(experts.size()), offsets, x, h);
  check(pre.shape() == Shape{rows, 2 * f} && y.shape() == x.shape() && experts_detail::rows_of_columns(pre) &&
            experts_detail::rows_of_columns(y),
        "experts_forward: pre {} must be [{}, {}] and y {} {}, columns contiguous", pre.shape(), rows, 2 * f,
        y.shape(), x.shape());
  if (rows == 0) return;
  PooledBuffer<float> act = pool.acquire<float>(Shape{rows, f});
  const experts_detail::Blocks blocks(offsets);
  const std::int64_t ldx = x.strides()[0], ldp = pre.strides()[0];
  ops::GroupedGemm items;
  for (const auto& [e, begin, m] : blocks)  // pre_e [m, 2f] = x_e [m, h] W_in_e^T
    items.add(m, 2 * f, h, x.data() + begin * ldx, experts[std::size_t(e)].in.data(), pre.data() + begin * ldp);
  Backend::gemm_grouped(ops::Transpose::no, ops::Transpose::yes, 1.0f, items, ldx, h, 0.0f, ldp);
  Backend::swiglu_forward(pre.slice(1, 0, f), pre.slice(1, f, f), act.view());
  items.clear();
  for (const auto& [e, begin, m] : blocks)  // y_e [m, h] = act_e [m, f] W_out_e
    items.add(m, h, f, act.data() + begin * f, experts[std::size_t(e)].out.data(), y.data() + begin * y.strides()[0]);
  Backend::gemm_grouped(ops::Transpose::no, ops::Transpose::no, 1.0f, items, f, h, 0.0f, y.strides()[0]);
}

// The same through a bank's experts (block e through expert e of the bank).
template <class Backend>
void experts_forward(const ExpertBank<const float>& bank, std::span<const std::int64_t> offsets,
                     TensorView<const float> x, TensorView<float> pre, TensorView<float> y, BufferPool& pool) {
  experts_detail::check_bank("experts_forward", bank, offsets, x);
  std::vector<ExpertWeights<const float>> experts;
  for (std::int64_t e = 0; e < bank.experts(); ++e) experts.push_back({bank.in_of(e), bank.out_of(e)});
  experts_forward<Backend>(experts, offsets, x, pre, y, pool);
}

// dy: [rows, h]; dx: [rows, h] (overwritten); grad: the bank's gradient (ACCUMULATED). The activation is recomputed.
// x is contiguous; the rows of pre, dy and dx may be strided, their columns contiguous. Four grouped GEMMs and the
// SwiGLU's forward and backward over every row.
template <class Backend>
void experts_backward(const ExpertBank<const float>& bank, std::span<const std::int64_t> offsets,
                      TensorView<const float> x, TensorView<const float> pre, TensorView<const float> dy,
                      TensorView<float> dx, const ExpertBank<float>& grad, BufferPool& pool) {
  experts_detail::check_bank("experts_backward", bank, offsets, x);
  const std::int64_t f = bank.ffn(), h = bank.hidden(), rows = x.extent(0);
  check(pre.shape() == Shape{rows, 2 * f} && dy.shape() == x.shape() && dx.shape() == x.shape() &&
            grad.in.shape() == bank.in.shape() && grad.out.shape() == bank.out.shape() &&
            grad.in.is_contiguous() && grad.out.is_contiguous() && experts_detail::rows_of_columns(pre) &&
            experts_detail::rows_of_columns(dy) && experts_detail::rows_of_columns(dx),
        "experts_backward: pre {}, dy {}, dx {}, grad in {} out {} do not match x {} and the bank in {} out {} (or "
        "their columns, or the gradient, are not contiguous)", pre.shape(), dy.shape(), dx.shape(), grad.in.shape(),
        grad.out.shape(), x.shape(), bank.in.shape(), bank.out.shape());
  if (rows == 0) return;
  PooledBuffer<float> act = pool.acquire<float>(Shape{rows, f}), dact = pool.acquire<float>(Shape{rows, f}),
                      dpre = pool.acquire<float>(Shape{rows, 2 * f});
  const experts_detail::Blocks blocks(offsets);
  using ops::Transpose;
  const std::int64_t ldx = x.strides()[0], ldy = dy.strides()[0];
  Backend::swiglu_forward(pre.slice(1, 0, f), pre.slice(1, f, f), act.view());
  ops::GroupedGemm items;
  for (const auto& [e, begin, m] : blocks)  // dact_e [m, f] = dy_e [m, h] W_out_e^T
    items.add(m, f, h, dy.data() + begin * ldy, bank.out_of(e).data(), dact.data() + begin * f);
  Backend::gemm_grouped(Transpose::no, Transpose::yes, 1.0f, items, ldy, h, 0.0f, f);
  items.clear();
  for (const auto& [e, begin, m] : blocks)  // dW_out_e [f, h] += act_e^T [f, m] dy_e [m, h]
    items.add(f, h, m, act.data() + begin * f, dy.data() + begin * ldy, grad.out_of(e).data());
  Backend::gemm_grouped(Transpose::yes, Transpose::no, 1.0f, items, f, ldy, 1.0f, h);
  Backend::fill(dpre.view(), 0.0f);  // the op accumulates
  Backend::swiglu_backward(pre.slice(1, 0, f), pre.slice(1, f, f), dact.view(), dpre.view().slice(1, 0, f),
                           dpre.view().slice(1, f, f));
  items.clear();
  for (const auto& [e, begin, m] : blocks)  // dW_in_e [2f, h] += dpre_e^T [2f, m] x_e [m, h]
    items.add(2 * f, h, m, dpre.data() + begin * 2 * f, x.data() + begin * ldx, grad.in_of(e).data());
  Backend::gemm_grouped(Transpose::yes, Transpose::no, 1.0f, items, 2 * f, ldx, 1.0f, h);
  items.clear();
  for (const auto& [e, begin, m] : blocks)  // dx_e [m, h] = dpre_e [m, 2f] W_in_e [2f, h]
    items.add(m, h, 2 * f, dpre.data() + begin * 2 * f, bank.in_of(e).data(), dx.data() + begin * dx.strides()[0]);
  Backend::gemm_grouped(Transpose::no, Transpose::no, 1.0f, items, 2 * f, h, 0.0f, dx.strides()[0]);
}

}  // namespace paradyse
