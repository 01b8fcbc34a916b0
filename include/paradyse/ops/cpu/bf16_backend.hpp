// paradyse/ops/cpu/bf16_backend.hpp: ops::CpuBf16, the CPU backend of bf16 mixed precision (bf16 storage, fp32
// compute): the numerics of a bf16 GPU run, on any CPU, so that the mixed-precision logic is tested in CI.
//
// The rule every op follows (the one a bf16 kernel follows in Megatron / TransformerEngine):
//  - a COMPUTE op reads its floating-point operands (activations, their gradients, weights) as bf16: each rounded
//    to nearest, ties to even (core/dtype.hpp), at load: the values a bf16 tensor holds. It computes in fp32: the
//    result is ops::cpu's fp32 op on the rounded operands, bit for bit (CpuBf16::op(x) == Cpu::op(bf16(x))).
//  - its outputs leave in fp32 (the accumulator). A forward output is read as an operand by the next compute op,
//    which rounds it, so it acts as the bf16 tensor it is on the GPU; where a value would be STORED bf16 without
//    passing through a compute op (the residual stream between sublayers and layers, model/layer.hpp) the model
//    calls store_activation, which rounds it in place.
//  - fp32 stays fp32 exactly where the bf16 GPU path keeps fp32: norm statistics (mean, rstd) and attention's lse;
//    every gradient accumulator (backward outputs accumulate += in fp32: weight gradients across micro-batches and
//    sequences, dq/dk/dv across ring steps, the norms' dgamma/dbeta); the loss and dlogits; the MoE router (fp32
//    as in Megatron); AdamW (fp32 master weights, fp32 gradients, fp32 m and v).
//  - data movement and accumulation (copy, fill, add_into, convert, attention_merge, gather_rows,
//    scatter_add_rows) is exact fp32.
// Master weights: the model's fp32 weights are the masters the optimizer owns; the bf16 working weights are their
// rounding at load, the same values as a bf16 copy cast from the masters after each optimizer step (the GPU path
// keeps that copy to halve its reads). Checkpoints therefore save the fp32 masters.
// Memory: on the CPU the tensors stay fp32 (the memory model's bytes hold); the rounded operands are host scratch
// outside the memory tracker, freed when the op returns.
#pragma once

#include "paradyse/core/dtype.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/core/memory.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/ops/attention_mask.hpp"
#include "paradyse/ops/cpu/activation.hpp"
#include "paradyse/ops/cpu/adamw.hpp"
#include "paradyse/ops/cpu/attention.hpp"
#include "paradyse/ops/cpu/convert.hpp"
#include "paradyse/ops/cpu/cross_entropy.hpp"
#include "paradyse/ops/cpu/embedding.hpp"
#include "paradyse/ops/cpu/gemm.hpp"
#include "paradyse/ops/cpu/gemm_batched.hpp"
#include "paradyse/ops/cpu/gemm_grouped.hpp"
#include "paradyse/ops/cpu/moe_ops.hpp"
#include "paradyse/ops/cpu/normalization.hpp"
#include "paradyse/ops/cpu/rope.hpp"
#include "paradyse/ops/cpu/softmax.hpp"
#include "paradyse/ops/cpu/tensor_ops.hpp"

#include <algorithm>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

namespace paradyse::ops::cpu_bf16 {

namespace cpu = ops::cpu;

// x rounded to bf16 and back (exact): the value a bf16 tensor holds for x.
inline float to_bf16(float x) { return float(bf16(x)); }

// x: any shape and strides, rounded to bf16 in place.
inline void round_in_place(TensorView<float> x) {
  cpu::tensor_ops_detail::for_each_row(x, x, [](float* row, float*, std::int64_t count, std::int64_t stride,
                                                 std::int64_t) {
    for (std::int64_t i = 0; i < count; ++i) row[i * stride] = to_bf16(row[i * stride]);
  });
}

// A contiguous bf16-rounded copy of a view (same shape), the operand a bf16 kernel loads.
class Rounded {
public:
  explicit Rounded(TensorView<const float> x) : data_(std::size_t(x.numel())) {
    const TensorView<float> to(data_.data(), x.shape());
    cpu::copy(x, to);
    for (float& v : data_) v = to_bf16(v);
    view_ = TensorView<const float>(data_.data(), x.shape());
  }
  TensorView<const float> view() const { return view_; }
  operator TensorView<const float>() const { return view_; }  // NOLINT: an operand where a view is taken

private:
  std::vector<float> data_;
  TensorView<const float> view_{nullptr, Shape{0}};
};

// The rows x cols matrix at a (leading dimension ld), rounded to bf16 and packed (leading dimension cols).
inline std::vector<float> rounded_matrix(const float* a, std::int64_t rows, std::int64_t cols, std::int64_t ld) {
  std::vector<float> out(std::size_t(rows * cols));
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) out[std::size_t(r * cols + c)] = to_bf16(a[r * ld + c]);
  return out;
}

// ---- data movement: exact fp32 ----
inline void copy(TensorView<const float> from, TensorView<float> to) { cpu::copy(from, to); }
inline void fill(TensorView<float> x, float value) { cpu::fill(x, value); }
inline void synchronize() {}
inline void add_into(TensorView<float> to, TensorView<const float> from) { cpu::add_into(to, from); }

// ---- GEMM: bf16 operands, fp32 accumulation and output ----
inline void gemm(Transpose trans_a, Transpose trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
                 const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c,
                 std::int64_t ldc) {
  const bool ta = trans_a == Transpose::yes, tb = trans_b == Transpose::yes;
  const std::int64_t a_rows = ta ? k : m, a_cols = ta ? m : k, b_rows = tb ? n : k, b_cols = tb ? k : n;
  const std::vector<float> ra = rounded_matrix(a, a_rows, a_cols, lda), rb = rounded_matrix(b, b_rows, b_cols, ldb);
  cpu::gemm(trans_a, trans_b, m, n, k, alpha, ra.data(), std::max<std::int64_t>(1, a_cols), rb.data(),
            std::max<std::int64_t>(1, b_cols), beta, c, ldc);
}
inline void matmul(TensorView<const float> a, Transpose trans_a, TensorView<const float> b, Transpose trans_b,
                   TensorView<float> c, float alpha = 1.0f, float beta = 0.0f) {
  cpu::matmul(Rounded(a), trans_a, Rounded(b), trans_b, c, alpha, beta);
}
inline void gemm_batched(Transpose trans_a, Transpose trans_b, std::int64_t m, std::int64_t n, std::int64_t k,
                         float alpha, std::span<const float* const> a, std::int64_t lda,
                         std::span<const float* const> b, std::int64_t ldb, float beta, std::span<float* const> c,
                         std::int64_t ldc) {
  cpu::check_gemm_batch(a.size(), b.size(), c.size());
  for (std::size_t i = 0; i < a.size(); ++i) gemm(trans_a, trans_b, m, n, k, alpha, a[i], lda, b[i], ldb, beta, c[i], ldc);
}
inline void gemm_grouped(Transpose trans_a, Transpose trans_b, float alpha, const GroupedGemm& items, std::int64_t lda,
                         std::int64_t ldb, float beta, std::int64_t ldc) {
  cpu::check_gemm_group(items);
  for (std::size_t i = 0; i < items.size(); ++i)
    gemm(trans_a, trans_b, items.m[i], items.n[i], items.k[i], alpha, items.a[i], lda, items.b[i], ldb, beta,
         items.c[i], ldc);
}

// ---- attention: q, k, v, out, dout read as bf16; lse fp32; dq, dk, dv accumulate in fp32 ----
inline void attention_forward(TensorView<const float> q, TensorView<const float> k, TensorView<const float> v,
                              const AttentionMask& mask, TensorView<float> out, TensorView<float> lse) {
  cpu::attention_forward(Rounded(q), Rounded(k), Rounded(v), mask, out, lse);
}
inline void attention_backward(TensorView<const float> q, TensorView<const float> k, TensorView<const float> v,
                               TensorView<const float> out, TensorView<const float> lse, TensorView<const float> dout,
                               const AttentionMask& mask, TensorView<float> dq, TensorView<float> dk,
                               TensorView<float> dv) {
  cpu::attention_backward(Rounded(q), Rounded(k), Rounded(v), Rounded(out), lse, Rounded(dout), mask, dq, dk, dv);
}
inline void attention_merge(TensorView<float> out, TensorView<float> lse, TensorView<const float> block_out,
                            TensorView<const float> block_lse) {
  cpu::attention_merge(out, lse, block_out, block_lse);  // the fp32 accumulation of a ring's blocks
}

// ---- normalisation: x, dy and the (working) gamma, beta read as bf16; statistics fp32; dx, dgamma, dbeta += fp32 ----
inline void layer_norm_forward(TensorView<const float> x, TensorView<const float> gamma, TensorView<const float> beta,
                               float epsilon, TensorView<float> y, TensorView<float> mean, TensorView<float> rstd) {
  cpu::layer_norm_forward(Rounded(x), Rounded(gamma), Rounded(beta), epsilon, y, mean, rstd);
}
inline void layer_norm_backward(TensorView<const float> x, TensorView<const float> gamma, TensorView<const float> mean,
                                TensorView<const float> rstd, TensorView<const float> dy, TensorView<float> dx,
                                TensorView<float> dgamma, TensorView<float> dbeta) {
  cpu::layer_norm_backward(Rounded(x), Rounded(gamma), mean, rstd, Rounded(dy), dx, dgamma, dbeta);
}
inline void rms_norm_forward(TensorView<const float> x, TensorView<const float> gamma, float epsilon,
                             TensorView<float> y, TensorView<float> rstd) {
  cpu::rms_norm_forward(Rounded(x), Rounded(gamma), epsilon, y, rstd);
}
inline void rms_norm_backward(TensorView<const float> x, TensorView<const float> gamma, TensorView<const float> rstd,
                              TensorView<const float> dy, TensorView<float> dx, TensorView<float> dgamma) {
  cpu::rms_norm_backward(Rounded(x), Rounded(gamma), rstd, Rounded(dy), dx, dgamma);
}

// ---- activations and RoPE: inputs and incoming gradients read as bf16 ----
inline void gelu_forward(TensorView<const float> x, TensorView<float> y) { cpu::gelu_forward(Rounded(x), y); }
inline void gelu_backward(TensorView<const float> x, TensorView<const float> dy, TensorView<float> dx) {
  cpu::gelu_backward(Rounded(x), Rounded(dy), dx);
}
inline void swiglu_forward(TensorView<const float> gate, TensorView<const float> up, TensorView<float> y) {
  cpu::swiglu_forward(Rounded(gate), Rounded(up), y);
}
inline void swiglu_backward(TensorView<const float> gate, TensorView<const float> up, TensorView<const float> dy,
                            TensorView<float> dgate, TensorView<float> dup) {
  cpu::swiglu_backward(Rounded(gate), Rounded(up), Rounded(dy), dgate, dup);
}
inline void rope_forward(TensorView<const float> x, TensorView<float> y, std::int64_t position_offset,
                         const RopeConfig& config = {}, std::span<const std::int64_t> document_starts = {}) {
  cpu::rope_forward(Rounded(x), y, position_offset, config, document_starts);
}
inline void rope_backward(TensorView<const float> dy, TensorView<float> dx, std::int64_t position_offset,
                          const RopeConfig& config = {}, std::span<const std::int64_t> document_starts = {}) {
  cpu::rope_backward(Rounded(dy), dx, position_offset, config, document_starts);
}

// ---- embedding (a bf16 table's rows: the output rounded), loss (bf16 logits, fp32 loss and dlogits), AdamW (fp32) ----
inline void embedding_forward(TensorView<const std::int32_t> tokens, TensorView<const float> table,
                              TensorView<float> out) {
  cpu::embedding_forward(tokens, table, out);
  round_in_place(out);  // a gather: rounding the rows gathered is rounding the table
}
inline void embedding_backward(TensorView<const std::int32_t> tokens, TensorView<const float> dout,
                               TensorView<float> dtable) {
  cpu::embedding_backward(tokens, Rounded(dout), dtable);
}
inline cpu::CrossEntropyResult cross_entropy_forward_backward(TensorView<const float> logits,
                                                              TensorView<const std::int32_t> targets,
                                                              TensorView<float> dlogits, float grad_scale,
                                                              std::int32_t ignore_index = cpu::kIgnoreIndex) {
  return cpu::cross_entropy_forward_backward(Rounded(logits), targets, dlogits, grad_scale, ignore_index);
}
inline void adamw_step(TensorView<float> params, TensorView<const float> grads, TensorView<float> m,
                       TensorView<float> v, const AdamWConfig& config, std::int64_t step) {
  cpu::adamw_step(params, grads, m, v, config, step);  // the fp32 masters and moments
}
template <cpu::FloatingStorage From, cpu::FloatingStorage To>
void convert(TensorView<const From> from, TensorView<To> to) {
  cpu::convert(from, to);
}

// ---- materialised softmax: scores and incoming gradients read as bf16, probabilities fp32 ----
inline void masked_softmax_forward(TensorView<float> scores, std::span<const PositionRun> query_runs,
                                   std::span<const PositionRun> key_runs, bool causal) {
  round_in_place(scores);
  cpu::masked_softmax_forward(scores, query_runs, key_runs, causal);
}
inline void softmax_backward(TensorView<const float> probs, TensorView<float> grads) {
  round_in_place(grads);
  cpu::softmax_backward(Rounded(probs), grads);
}

// ---- mixture of experts: the router in fp32; gathers and scatters exact; the gate dot and sigmoid read bf16 ----
inline void router_forward(TensorView<const float> logits, RouterScoring scoring, bool normalize, float scale,
                           std::span<const std::int64_t> offsets, TensorView<float> probs, TensorView<float> lse,
                           std::span<std::int64_t> experts, TensorView<float> gates, TensorView<float> stats) {
  cpu::router_forward(logits, scoring, normalize, scale, offsets, probs, lse, experts, gates, stats);
}
inline void router_backward(TensorView<const float> logits, TensorView<const float> probs, TensorView<const float> lse,
                            RouterScoring scoring, bool normalize, float scale, std::span<const std::int64_t> offsets,
                            std::span<const std::int64_t> experts, TensorView<const float> dgates,
                            TensorView<const float> aux_grad, float z_grad, TensorView<float> dlogits) {
  cpu::router_backward(logits, probs, lse, scoring, normalize, scale, offsets, experts, dgates, aux_grad, z_grad,
                       dlogits);
}
inline void gather_rows(TensorView<const float> from, std::span<const std::int64_t> rows, TensorView<const float> scale,
                        TensorView<float> to) {
  cpu::gather_rows(from, rows, scale, to);
}
inline void scatter_add_rows(TensorView<float> to, std::span<const std::int64_t> rows, TensorView<const float> from,
                             TensorView<const float> scale) {
  cpu::scatter_add_rows(to, rows, from, scale);
}
inline void gathered_row_dot(TensorView<const float> a, std::span<const std::int64_t> rows, TensorView<const float> b,
                             TensorView<float> out) {
  cpu::gathered_row_dot(Rounded(a), rows, Rounded(b), out);
}
inline void sigmoid_forward(TensorView<const float> x, TensorView<float> y) { cpu::sigmoid_forward(Rounded(x), y); }
inline void sigmoid_backward(TensorView<const float> y, TensorView<const float> dy, TensorView<float> dx) {
  cpu::sigmoid_backward(Rounded(y), Rounded(dy), dx);
}

}  // namespace paradyse::ops::cpu_bf16

namespace paradyse::ops {

// The CPU backend with bf16 storage semantics: every op of ops/op_table.inc, forwarded to ops::cpu_bf16 (above).
namespace cpu_bf16_backend {
namespace impl = cpu_bf16;
struct CpuBf16 {
  static constexpr std::string_view name = "cpu-bf16";
  static constexpr MemorySpace space = MemorySpace::host;
  static constexpr DType activation_dtype = DType::bf16;  // what activations and working weights are stored as
  // x (an activation the GPU path stores bf16: the residual stream) rounded to bf16 in place (model/layer.hpp).
  static void store_activation(TensorView<float> x) { cpu_bf16::round_in_place(x); }
#include "paradyse/ops/op_table.inc"
};
}  // namespace cpu_bf16_backend
using cpu_bf16_backend::CpuBf16;

}  // namespace paradyse::ops
