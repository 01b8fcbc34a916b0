// paradyse/ops/cuda_backend.hpp: ops::Cuda, the backend policy over device memory.
//
// The same members, signatures and contracts as ops::Cpu (ops/backend.hpp): forward outputs are overwritten,
// backward gradients ACCUMULATE (+=), cross_entropy_forward_backward overwrites dlogits. Every TensorView's data is
// device memory (a tensor made while a device tracker is current, device/caching_allocator.hpp); host-side index
// spans (document starts, rows, experts, offsets) stay host memory, as on the CPU. Every op runs asynchronously on
// the calling thread's stream (device/runtime.hpp); an op that returns a host value (the loss) or writes a host span
// (the router's expert choices) synchronises that stream first.
//
// This header is host code: it declares the launchers (ops/cuda/*.hpp), whose definitions are the kernels of
// kernels/all.cuh, compiled once per program by nvcc (cmake/paradyse_kernels.cu).
#pragma once

#include "paradyse/ops/attention_mask.hpp"
#include "paradyse/ops/cuda/activation.hpp"
#include "paradyse/ops/cuda/adamw.hpp"
#include "paradyse/ops/cuda/attention.hpp"
#include "paradyse/ops/cuda/convert.hpp"
#include "paradyse/ops/cuda/cross_entropy.hpp"
#include "paradyse/ops/cuda/embedding.hpp"
#include "paradyse/ops/cuda/gemm.hpp"
#include "paradyse/ops/cuda/moe_ops.hpp"
#include "paradyse/ops/cuda/normalization.hpp"
#include "paradyse/ops/cuda/rope.hpp"
#include "paradyse/ops/cuda/softmax.hpp"
#include "paradyse/ops/cuda/tensor_ops.hpp"

#include <cstdint>
#include <span>
#include <string_view>

namespace paradyse::ops {

struct Cuda {
  static constexpr std::string_view name = "cuda";
  static constexpr MemorySpace space = MemorySpace::device;  // where the tensors it computes on live

  // ---- data movement (ops/cuda/tensor_ops.hpp) ----
  static void copy(TensorView<const float> from, TensorView<float> to) { cuda::copy(from, to); }
  static void fill(TensorView<float> x, float value) { cuda::fill(x, value); }
  static void add_into(TensorView<float> to, TensorView<const float> from) { cuda::add_into(to, from); }
  static void copy(std::span<const float> from, std::span<float> to) { copy(vector(from), vector(to)); }
  static void fill(std::span<float> x, float value) { fill(vector(x), value); }
  static void add_into(std::span<float> to, std::span<const float> from) { add_into(vector(to), vector(from)); }

  // ---- GEMM (ops/cuda/gemm.hpp) ----
  static void gemm(Transpose trans_a, Transpose trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
                   const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c,
                   std::int64_t ldc) {
    cuda::gemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
  static void matmul(TensorView<const float> a, Transpose trans_a, TensorView<const float> b, Transpose trans_b,
                     TensorView<float> c, float alpha = 1.0f, float beta = 0.0f) {
    cuda::matmul(a, trans_a, b, trans_b, c, alpha, beta);
  }
  // count GEMMs of one size, in order (ops/cuda/gemm_batched.hpp): a per-head loop as one op.
  static void gemm_batched(Transpose trans_a, Transpose trans_b, std::int64_t m, std::int64_t n, std::int64_t k,
                           float alpha, std::span<const float* const> a, std::int64_t lda,
                           std::span<const float* const> b, std::int64_t ldb, float beta, std::span<float* const> c,
                           std::int64_t ldc) {
    cuda::gemm_batched(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }

  // ---- attention (ops/cuda/attention.hpp) ----
  static void attention_forward(TensorView<const float> q, TensorView<const float> k, TensorView<const float> v,
                                const AttentionMask& mask, TensorView<float> out, TensorView<float> lse) {
    cuda::attention_forward(q, k, v, mask, out, lse);
  }
  static void attention_backward(TensorView<const float> q, TensorView<const float> k, TensorView<const float> v,
                                 TensorView<const float> out, TensorView<const float> lse, TensorView<const float> dout,
                                 const AttentionMask& mask, TensorView<float> dq, TensorView<float> dk,
                                 TensorView<float> dv) {
    cuda::attention_backward(q, k, v, out, lse, dout, mask, dq, dk, dv);
  }
  static void attention_merge(TensorView<float> out, TensorView<float> lse, TensorView<const float> block_out,
                              TensorView<const float> block_lse) {
    cuda::attention_merge(out, lse, block_out, block_lse);
  }

  // ---- normalisation (ops/cuda/normalization.hpp) ----
  static void layer_norm_forward(TensorView<const float> x, TensorView<const float> gamma, TensorView<const float> beta,
                                 float epsilon, TensorView<float> y, TensorView<float> mean, TensorView<float> rstd) {
    cuda::layer_norm_forward(x, gamma, beta, epsilon, y, mean, rstd);
  }
  static void layer_norm_backward(TensorView<const float> x, TensorView<const float> gamma,
                                  TensorView<const float> mean, TensorView<const float> rstd,
                                  TensorView<const float> dy, TensorView<float> dx, TensorView<float> dgamma,
                                  TensorView<float> dbeta) {
    cuda::layer_norm_backward(x, gamma, mean, rstd, dy, dx, dgamma, dbeta);
  }
  static void rms_norm_forward(TensorView<const float> x, TensorView<const float> gamma, float epsilon,
                               TensorView<float> y, TensorView<float> rstd) {
    cuda::rms_norm_forward(x, gamma, epsilon, y, rstd);
  }
  static void rms_norm_backward(TensorView<const float> x, TensorView<const float> gamma, TensorView<const float> rstd,
                                TensorView<const float> dy, TensorView<float> dx, TensorView<float> dgamma) {
    cuda::rms_norm_backward(x, gamma, rstd, dy, dx, dgamma);
  }

  // ---- activations (ops/cuda/activation.hpp) ----
  static void gelu_forward(TensorView<const float> x, TensorView<float> y) { cuda::gelu_forward(x, y); }
  static void gelu_backward(TensorView<const float> x, TensorView<const float> dy, TensorView<float> dx) {
    cuda::gelu_backward(x, dy, dx);
  }
  static void swiglu_forward(TensorView<const float> gate, TensorView<const float> up, TensorView<float> y) {
    cuda::swiglu_forward(gate, up, y);
  }
  static void swiglu_backward(TensorView<const float> gate, TensorView<const float> up, TensorView<const float> dy,
                              TensorView<float> dgate, TensorView<float> dup) {
    cuda::swiglu_backward(gate, up, dy, dgate, dup);
  }

  // ---- rotary position embedding (ops/cuda/rope.hpp) ----
  static void rope_forward(TensorView<const float> x, TensorView<float> y, std::int64_t position_offset,
                           const RopeConfig& config = {}, std::span<const std::int64_t> document_starts = {}) {
    cuda::rope_forward(x, y, position_offset, config, document_starts);
  }
  static void rope_backward(TensorView<const float> dy, TensorView<float> dx, std::int64_t position_offset,
                            const RopeConfig& config = {}, std::span<const std::int64_t> document_starts = {}) {
    cuda::rope_backward(dy, dx, position_offset, config, document_starts);
  }

  // ---- embedding, loss, optimizer, conversion ----
  static void embedding_forward(TensorView<const std::int32_t> tokens, TensorView<const float> table,
                                TensorView<float> out) {
    cuda::embedding_forward(tokens, table, out);
  }
  static void embedding_backward(TensorView<const std::int32_t> tokens, TensorView<const float> dout,
                                 TensorView<float> dtable) {
    cuda::embedding_backward(tokens, dout, dtable);
  }
  static cpu::CrossEntropyResult cross_entropy_forward_backward(TensorView<const float> logits,
                                                                TensorView<const std::int32_t> targets,
                                                                TensorView<float> dlogits, float grad_scale,
                                                                std::int32_t ignore_index = cpu::kIgnoreIndex) {
    return cuda::cross_entropy_forward_backward(logits, targets, dlogits, grad_scale, ignore_index);
  }
  static void adamw_step(TensorView<float> params, TensorView<const float> grads, TensorView<float> m,
                         TensorView<float> v, const AdamWConfig& config, std::int64_t step) {
    cuda::adamw_step(params, grads, m, v, config, step);
  }
  template <cpu::FloatingStorage From, cpu::FloatingStorage To>
  static void convert(TensorView<const From> from, TensorView<To> to) {
    cuda::convert(from, to);
  }

  // ---- materialised softmax (ops/cuda/softmax.hpp) ----
  static void masked_softmax_forward(TensorView<float> scores, std::span<const PositionRun> query_runs,
                                     std::span<const PositionRun> key_runs, bool causal) {
    cuda::masked_softmax_forward(scores, query_runs, key_runs, causal);
  }
  static void softmax_backward(TensorView<const float> probs, TensorView<float> grads) {
    cuda::softmax_backward(probs, grads);
  }

  // ---- mixture of experts (ops/cuda/moe_ops.hpp) ----
  static void router_forward(TensorView<const float> logits, RouterScoring scoring, bool normalize, float scale,
                             std::span<const std::int64_t> offsets, TensorView<float> probs, TensorView<float> lse,
                             std::span<std::int64_t> experts, TensorView<float> gates, TensorView<float> stats) {
    cuda::router_forward(logits, scoring, normalize, scale, offsets, probs, lse, experts, gates, stats);
  }
  static void router_backward(TensorView<const float> logits, TensorView<const float> probs,
                              TensorView<const float> lse, RouterScoring scoring, bool normalize, float scale,
                              std::span<const std::int64_t> offsets, std::span<const std::int64_t> experts,
                              TensorView<const float> dgates, TensorView<const float> aux_grad, float z_grad,
                              TensorView<float> dlogits) {
    cuda::router_backward(logits, probs, lse, scoring, normalize, scale, offsets, experts, dgates, aux_grad, z_grad,
                         dlogits);
  }
  static void gather_rows(TensorView<const float> from, std::span<const std::int64_t> rows,
                          TensorView<const float> scale, TensorView<float> to) {
    cuda::gather_rows(from, rows, scale, to);
  }
  static void scatter_add_rows(TensorView<float> to, std::span<const std::int64_t> rows, TensorView<const float> from,
                               TensorView<const float> scale) {
    cuda::scatter_add_rows(to, rows, from, scale);
  }
  static void gathered_row_dot(TensorView<const float> a, std::span<const std::int64_t> rows,
                               TensorView<const float> b, TensorView<float> out) {
    cuda::gathered_row_dot(a, rows, b, out);
  }
  static void sigmoid_forward(TensorView<const float> x, TensorView<float> y) { cuda::sigmoid_forward(x, y); }
  static void sigmoid_backward(TensorView<const float> y, TensorView<const float> dy, TensorView<float> dx) {
    cuda::sigmoid_backward(y, dy, dx);
  }

  // A contiguous span as a 1-D view.
  template <class T>
  static TensorView<T> vector(std::span<T> x) { return {x.data(), Shape{std::int64_t(x.size())}}; }
};

}  // namespace paradyse::ops
