// paradyse/ops/backend.hpp: the backend policy that the strategies are written over.
//
// A strategy takes a Backend template parameter and calls Backend::gemm(...), Backend::attention_forward(...) and
// so on; ops::Cpu forwards to ops::cpu, and a CUDA backend (ops::Cuda) will have the same members over device
// memory. Each member has exactly the signature and contract of the op it forwards to (see that op's header).
#pragma once

#include "paradyse/ops/attention_mask.hpp"
#include "paradyse/ops/cpu/attention.hpp"
#include "paradyse/ops/cpu/gemm.hpp"

#include <cstdint>
#include <string_view>

namespace paradyse::ops {

struct Cpu {
  static constexpr std::string_view name = "cpu";

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
};

}  // namespace paradyse::ops
