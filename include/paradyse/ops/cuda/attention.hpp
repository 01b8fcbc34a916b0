// paradyse/ops/cuda/attention.hpp: flash attention on the GPU (forward, backward, merge of partial results).
//
// The same signatures and contracts as ops/cpu/attention.hpp, over TensorViews whose data is device memory:
//   q: [b, sq, hq, d]; k, v: [b, skv, hkv, d] with hq % hkv == 0 (GQA); any strides, unit stride in d (q/k/v may be
//   slices of one packed qkv tensor). out: [b, sq, hq, d]; lse: [b, hq, sq] (natural log). A query that sees no key
//   gets out = 0 and lse = -inf. Backward ACCUMULATES (+=) into dq, dk, dv. The mask's document_starts is a HOST
//   span; it is uploaded per call.
// Work runs asynchronously on device::current_stream().
//
// Two kernel sets (definitions in kernels/attention_forward.cuh, attention_backward.cuh):
//   * float32: every shape and mask, fp32 arithmetic; head_dim up to what one block's shared memory holds (about
//     550 forward, 290 backward on an H200; beyond it the launcher throws naming the bytes needed). Simple and slow
//     (~9 TFLOP/s forward, ~5 backward at s = 2K, d = 128 on an H200): the reference path.
//   * bf16 on tensor cores (mma.sync): bf16 q/k/v/out/dout/dq/dk/dv, fp32 lse and fp32 accumulation; head_dim 64 or
//     128 (other head dims are refused with an error naming the value); every mask (causal, offsets, documents); the
//     rows of q, k, v, out, dout must start on 16-byte boundaries (strides multiples of 8 elements). On an H200 at
//     d = 128: forward ~145 TFLOP/s, backward ~100 (18% and 13% of cuBLAS's bf16 GEMM; bench/cuda_attention).
#pragma once

#include "paradyse/core/dtype.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/ops/attention_mask.hpp"

namespace paradyse::ops::cuda {

// out: [b, sq, hq, d], lse: [b, hq, sq]; both overwritten.
void attention_forward(TensorView<const float> q, TensorView<const float> k, TensorView<const float> v,
                       const AttentionMask& mask, TensorView<float> out, TensorView<float> lse);

// dq += dL/dq, dk += dL/dk, dv += dL/dv; out and lse are the FINAL output and lse of these queries over all key
// blocks (ring attention runs backward block by block).
void attention_backward(TensorView<const float> q, TensorView<const float> k, TensorView<const float> v,
                        TensorView<const float> out, TensorView<const float> lse, TensorView<const float> dout,
                        const AttentionMask& mask, TensorView<float> dq, TensorView<float> dk, TensorView<float> dv);

// Merges (block_out, block_lse) of the same queries over another key block into (out, lse) (stable log-sum-exp).
void attention_merge(TensorView<float> out, TensorView<float> lse, TensorView<const float> block_out,
                     TensorView<const float> block_lse);

// bf16 on tensor cores (head_dim 64 or 128); lse stays fp32.
void attention_forward(TensorView<const bf16> q, TensorView<const bf16> k, TensorView<const bf16> v,
                       const AttentionMask& mask, TensorView<bf16> out, TensorView<float> lse);

// bf16 gradients accumulate too: dq = bf16(dq + dL/dq) (one rounding per element).
void attention_backward(TensorView<const bf16> q, TensorView<const bf16> k, TensorView<const bf16> v,
                        TensorView<const bf16> out, TensorView<const float> lse, TensorView<const bf16> dout,
                        const AttentionMask& mask, TensorView<bf16> dq, TensorView<bf16> dk, TensorView<bf16> dv);

}  // namespace paradyse::ops::cuda
