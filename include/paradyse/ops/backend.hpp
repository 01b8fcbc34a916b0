// paradyse/ops/backend.hpp: the backend policy that the strategies are written over.
//
// A strategy takes a Backend template parameter and calls Backend::gemm(...), Backend::attention_forward(...) and
// so on; ops::Cpu forwards to ops::cpu, and a CUDA backend (ops::Cuda) will have the same members over device
// memory. Each member has exactly the signature and contract of the op it forwards to (see that op's header).
// Contract shared by every op: forward outputs are overwritten; backward gradients ACCUMULATE (+=) into every input
// and parameter gradient; cross_entropy_forward_backward overwrites dlogits (it starts the backward pass).
// Besides the kernels, a backend moves data for the code written over it (copy, fill, add_into, on views of any
// strides or on contiguous spans): strategy/ and model/ touch tensor data only through these, so they run
// unchanged on device memory and on meta tensors (ops/counting.hpp records what they would do).
#pragma once

#include "paradyse/core/memory.hpp"
#include "paradyse/ops/attention_mask.hpp"
#include "paradyse/ops/cpu/activation.hpp"
#include "paradyse/ops/cpu/adamw.hpp"
#include "paradyse/ops/cpu/attention.hpp"
#include "paradyse/ops/cpu/convert.hpp"
#include "paradyse/ops/cpu/cross_entropy.hpp"
#include "paradyse/ops/cpu/embedding.hpp"
#include "paradyse/ops/cpu/gemm.hpp"
#include "paradyse/ops/cpu/gemm_batched.hpp"
#include "paradyse/ops/cpu/moe_ops.hpp"
#include "paradyse/ops/cpu/normalization.hpp"
#include "paradyse/ops/cpu/rope.hpp"
#include "paradyse/ops/cpu/softmax.hpp"
#include "paradyse/ops/cpu/tensor_ops.hpp"

#include <cstdint>
#include <span>
#include <string_view>

namespace paradyse::ops {

struct Cpu {
  static constexpr std::string_view name = "cpu";
  static constexpr MemorySpace space = MemorySpace::host;  // where the tensors it computes on live

  // ---- data movement (ops/cpu/tensor_ops.hpp) ----
  static void copy(TensorView<const float> from, TensorView<float> to) { cpu::copy(from, to); }
  static void fill(TensorView<float> x, float value) { cpu::fill(x, value); }
  static void add_into(TensorView<float> to, TensorView<const float> from) { cpu::add_into(to, from); }
  static void copy(std::span<const float> from, std::span<float> to) { copy(vector(from), vector(to)); }
  static void fill(std::span<float> x, float value) { fill(vector(x), value); }
  static void add_into(std::span<float> to, std::span<const float> from) { add_into(vector(to), vector(from)); }

  // ---- GEMM (ops/cpu/gemm.hpp) ----
  static void gemm(Transpose trans_a, Transpose trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
                   const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c,
                   std::int64_t ldc) {
    cpu::gemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
  static void matmul(TensorView<const float> a, Transpose trans_a, TensorView<const float> b, Transpose trans_b,
                     TensorView<float> c, float alpha = 1.0f, float beta = 0.0f) {
    cpu::matmul(a, trans_a, b, trans_b, c, alpha, beta);
  }
  // count GEMMs of one size, in order (ops/cpu/gemm_batched.hpp): a per-head loop as one op.
  static void gemm_batched(Transpose trans_a, Transpose trans_b, std::int64_t m, std::int64_t n, std::int64_t k,
                           float alpha, std::span<const float* const> a, std::int64_t lda,
                           std::span<const float* const> b, std::int64_t ldb, float beta, std::span<float* const> c,
                           std::int64_t ldc) {
    cpu::gemm_batched(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }

  // ---- attention (ops/cpu/attention.hpp) ----
  static void attention_forward(TensorView<const float> q, TensorView<const float> k, TensorView<const float> v,
                                const AttentionMask& mask, TensorView<float> out, TensorView<float> lse) {
    cpu::attention_forward(q, k, v, mask, out, lse);
  }
  static void attention_backward(TensorView<const float> q, TensorView<const float> k, TensorView<const float> v,
                                 TensorView<const float> out, TensorView<const float> lse, TensorView<const float> dout,
                                 const AttentionMask& mask, TensorView<float> dq, TensorView<float> dk,
                                 TensorView<float> dv) {
    cpu::attention_backward(q, k, v, out, lse, dout, mask, dq, dk, dv);
  }
  static void attention_merge(TensorView<float> out, TensorView<float> lse, TensorView<const float> block_out,
                              TensorView<const float> block_lse) {
    cpu::attention_merge(out, lse, block_out, block_lse);
  }

  // ---- normalisation (ops/cpu/normalization.hpp) ----
  static void layer_norm_forward(TensorView<const float> x, TensorView<const float> gamma, TensorView<const float> beta,
                                 float epsilon, TensorView<float> y, TensorView<float> mean, TensorView<float> rstd) {
    cpu::layer_norm_forward(x, gamma, beta, epsilon, y, mean, rstd);
  }
  static void layer_norm_backward(TensorView<const float> x, TensorView<const float> gamma,
                                  TensorView<const float> mean, TensorView<const float> rstd,
                                  TensorView<const float> dy, TensorView<float> dx, TensorView<float> dgamma,
                                  TensorView<float> dbeta) {
    cpu::layer_norm_backward(x, gamma, mean, rstd, dy, dx, dgamma, dbeta);
  }
  static void rms_norm_forward(TensorView<const float> x, TensorView<const float> gamma, float epsilon,
                               TensorView<float> y, TensorView<float> rstd) {
    cpu::rms_norm_forward(x, gamma, epsilon, y, rstd);
  }
  static void rms_norm_backward(TensorView<const float> x, TensorView<const float> gamma, TensorView<const float> rstd,
                                TensorView<const float> dy, TensorView<float> dx, TensorView<float> dgamma) {
    cpu::rms_norm_backward(x, gamma, rstd, dy, dx, dgamma);
  }

  // ---- activations (ops/cpu/activation.hpp) ----
  static void gelu_forward(TensorView<const float> x, TensorView<float> y) { cpu::gelu_forward(x, y); }
  static void gelu_backward(TensorView<const float> x, TensorView<const float> dy, TensorView<float> dx) {
    cpu::gelu_backward(x, dy, dx);
  }
  static void swiglu_forward(TensorView<const float> gate, TensorView<const float> up, TensorView<float> y) {
    cpu::swiglu_forward(gate, up, y);
  }
  static void swiglu_backward(TensorView<const float> gate, TensorView<const float> up, TensorView<const float> dy,
                              TensorView<float> dgate, TensorView<float> dup) {
    cpu::swiglu_backward(gate, up, dy, dgate, dup);
  }

  // ---- rotary position embedding (ops/cpu/rope.hpp) ----
  static void rope_forward(TensorView<const float> x, TensorView<float> y, std::int64_t position_offset,
                           const RopeConfig& config = {}, std::span<const std::int64_t> document_starts = {}) {
    cpu::rope_forward(x, y, position_offset, config, document_starts);
  }
  static void rope_backward(TensorView<const float> dy, TensorView<float> dx, std::int64_t position_offset,
                            const RopeConfig& config = {}, std::span<const std::int64_t> document_starts = {}) {
    cpu::rope_backward(dy, dx, position_offset, config, document_starts);
  }

  // ---- embedding, loss, optimizer, conversion ----
  static void embedding_forward(TensorView<const std::int32_t> tokens, TensorView<const float> table,
                                TensorView<float> out) {
    cpu::embedding_forward(tokens, table, out);
  }
  static void embedding_backward(TensorView<const std::int32_t> tokens, TensorView<const float> dout,
                                 TensorView<float> dtable) {
    cpu::embedding_backward(tokens, dout, dtable);
  }
  static cpu::CrossEntropyResult cross_entropy_forward_backward(TensorView<const float> logits,
                                                                TensorView<const std::int32_t> targets,
                                                                TensorView<float> dlogits, float grad_scale,
                                                                std::int32_t ignore_index = cpu::kIgnoreIndex) {
    return cpu::cross_entropy_forward_backward(logits, targets, dlogits, grad_scale, ignore_index);
  }
  static void adamw_step(TensorView<float> params, TensorView<const float> grads, TensorView<float> m,
                         TensorView<float> v, const AdamWConfig& config, std::int64_t step) {
    cpu::adamw_step(params, grads, m, v, config, step);
  }
  template <cpu::FloatingStorage From, cpu::FloatingStorage To>
  static void convert(TensorView<const From> from, TensorView<To> to) {
    cpu::convert(from, to);
  }

  // ---- materialised softmax (ops/cpu/softmax.hpp) ----
  static void masked_softmax_forward(TensorView<float> scores, std::span<const PositionRun> query_runs,
                                     std::span<const PositionRun> key_runs, bool causal) {
    cpu::masked_softmax_forward(scores, query_runs, key_runs, causal);
  }
  static void softmax_backward(TensorView<const float> probs, TensorView<float> grads) {
    cpu::softmax_backward(probs, grads);
  }

  // ---- mixture of experts (ops/cpu/moe_ops.hpp) ----
  static void router_forward(TensorView<const float> logits, RouterScoring scoring, bool normalize, float scale,
                             std::span<const std::int64_t> offsets, TensorView<float> probs, TensorView<float> lse,
                             std::span<std::int64_t> experts, TensorView<float> gates, TensorView<float> stats) {
    cpu::router_forward(logits, scoring, normalize, scale, offsets, probs, lse, experts, gates, stats);
  }
  static void router_backward(TensorView<const float> logits, TensorView<const float> probs,
                              TensorView<const float> lse, RouterScoring scoring, bool normalize, float scale,
                              std::span<const std::int64_t> offsets, std::span<const std::int64_t> experts,
                              TensorView<const float> dgates, TensorView<const float> aux_grad, float z_grad,
                              TensorView<float> dlogits) {
    cpu::router_backward(logits, probs, lse, scoring, normalize, scale, offsets, experts, dgates, aux_grad, z_grad,
                         dlogits);
  }
  static void gather_rows(TensorView<const float> from, std::span<const std::int64_t> rows,
                          TensorView<const float> scale, TensorView<float> to) {
    cpu::gather_rows(from, rows, scale, to);
  }
  static void scatter_add_rows(TensorView<float> to, std::span<const std::int64_t> rows, TensorView<const float> from,
                               TensorView<const float> scale) {
    cpu::scatter_add_rows(to, rows, from, scale);
  }
  static void gathered_row_dot(TensorView<const float> a, std::span<const std::int64_t> rows,
                               TensorView<const float> b, TensorView<float> out) {
    cpu::gathered_row_dot(a, rows, b, out);
  }
  static void sigmoid_forward(TensorView<const float> x, TensorView<float> y) { cpu::sigmoid_forward(x, y); }
  static void sigmoid_backward(TensorView<const float> y, TensorView<const float> dy, TensorView<float> dx) {
    cpu::sigmoid_backward(y, dy, dx);
  }

  // A contiguous span as a 1-D view.
  template <class T>
  static TensorView<T> vector(std::span<T> x) { return {x.data(), Shape{std::int64_t(x.size())}}; }
};

// Where a backend's tensors live: its `space` member, or the host for a backend that names none.
template <class Backend>
inline constexpr MemorySpace memory_space_of = [] {
  if constexpr (requires { Backend::space; }) return MemorySpace(Backend::space);
  else return MemorySpace::host;
}();

}  // namespace paradyse::ops
