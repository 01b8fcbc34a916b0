// paradyse/cost/schedules.hpp: what each strategy does on one rank, per sublayer, as a schedule over a Tally.
//
// One function per (strategy, sublayer), forward then backward: the buffers it allocates and frees, what it keeps
// for backward, its GEMMs, attention blocks and collectives, and which transfers overlap which compute. Memory is
// that of the rank holding the most tokens (uneven shards: ceil(s/p)). Sizes in elements are turned into bytes
// with the activation dtype; log-sum-exp and LayerNorm statistics are float32.
//
// Every sublayer starts with the pre-norm that the model block runs before the strategy (it keeps its input and
// two float32 statistics per token) and ends with the output [b, s/p, h] that the residual add consumes.
#pragma once

#include "paradyse/cost/model_shape.hpp"
#include "paradyse/cost/tally.hpp"

#include <cstdint>

namespace paradyse::cost {

// The sizes a schedule needs, per rank. Heads and ffn columns are split in whole shards (ceil for uneven ones).
struct ScheduleDims {
  double p, e;                   // group size, bytes per element
  double b, s, s_loc, n, N;      // batch, sequence, tokens per rank (max), local tokens b*s_loc, all tokens b*s
  double h, d, a, a_kv;          // hidden, head dim, heads, kv heads
  double a_loc, akv_loc;         // heads and kv heads per rank
  double q, kv, q_loc, kv_loc;   // widths: a*d, a_kv*d and per rank
  double qkv, qkv_loc;           // q + 2 kv, per rank
  double f, f_loc, g;            // ffn, per rank, input projections (2 for SwiGLU)
  double pairs;                  // attention query-key pairs per sample (causal: halved)

  ScheduleDims(const ModelShape& m, int group) {
    const auto ceil_div = [](std::int64_t x, std::int64_t y) { return double((x + y - 1) / y); };
    p = group;
    e = m.dtype_bytes;
    b = double(m.batch);
    s = double(m.seq);
    s_loc = ceil_div(m.seq, group);
    n = b * s_loc;
    N = b * s;
    h = double(m.hidden);
    d = double(m.head_dim);
    a = double(m.heads);
    a_kv = double(m.kv_heads);
    a_loc = ceil_div(m.heads, group);
    akv_loc = m.kv_heads % group == 0 ? double(m.kv_heads / group) : 1;  // replicated when kv_heads < p
    q = a * d;
    kv = a_kv * d;
    q_loc = a_loc * d;
    kv_loc = akv_loc * d;
    qkv = q + 2 * kv;
    qkv_loc = q_loc + 2 * kv_loc;
    f = double(m.ffn);
    f_loc = ceil_div(m.ffn, group);
    g = m.swiglu ? 2 : 1;
    pairs = m.attention_pairs();
  }

  // Forward attention flops for `heads` heads over a share `fraction` of all query-key pairs.
  double attention_flops(double heads, double fraction) const { return 4 * d * heads * b * pairs * fraction; }
};

namespace schedule {

// ---- pieces shared by several strategies ---------------------------------------------------------------------------

// The block's pre-norm: keeps its input and per-token statistics; its output is the strategy's input.
inline void norm_forward(Tally& t, const ScheduleDims& x) {
  t.save_input(x.n * x.h * x.e + 2 * x.n * 4);
  t.compute(t.elementwise_s(2 * x.n * x.h * x.e));
}
inline void norm_backward(Tally& t, const ScheduleDims& x) {
  t.compute(t.elementwise_s(3 * x.n * x.h * x.e));
  t.release(x.n * x.h * x.e + 2 * x.n * 4);
}

// ZeRO-3 column-sharded linear by a ring: the p shards [rows x h] travel (double-buffered), each step multiplies
// the local tokens by one and writes its column block of `out`. Returns nothing; `out` is the caller's.
inline void ring_column_forward(Tally& t, const ScheduleDims& x, double rows) {
  const double shard = rows * x.h * x.e;
  t.alloc(2 * shard);
  t.ring(int(x.p), t.gemm_s(x.n, rows, x.h, int(x.e)), t.collective_s(Collective::send_recv, shard));
  t.free(2 * shard);
}
// Backward: (w, dw) pairs travel together, dW accumulates on the way and a last hop returns it to its owner.
inline void ring_column_backward(Tally& t, const ScheduleDims& x, double rows) {
  const double shard = rows * x.h * x.e;
  t.alloc(4 * shard);
  const double step = t.gemm_s(x.n, x.h, rows, int(x.e)) + t.gemm_s(rows, x.h, x.n, int(x.e));
  t.ring(int(x.p), step, t.collective_s(Collective::send_recv, 2 * shard), /*final_hop=*/true);
  t.free(4 * shard);
}

// ZeRO-3 row-sharded linear by an all-gather of the whole weight [in x h]: y = x_in W.
inline void gather_row_forward(Tally& t, const ScheduleDims& x, double in) {
  const double weight = in * x.h * x.e;
  t.alloc(weight);
  t.communicate(t.collective_s(Collective::all_gather, weight));
  t.compute(t.gemm_s(x.n, x.h, in, int(x.e)));
  t.free(weight);
}
// Backward: gather again, dX_in = dY W^T, a full-size dW = X_in^T dY, reduce-scattered to the owners.
inline void gather_row_backward(Tally& t, const ScheduleDims& x, double in) {
  const double weight = in * x.h * x.e;
  t.alloc(weight);
  t.communicate(t.collective_s(Collective::all_gather, weight));
  t.compute(t.gemm_s(x.n, in, x.h, int(x.e)));
  t.alloc(weight);  // the full dW
  t.compute(t.gemm_s(in, x.h, x.n, int(x.e)));
  t.free(weight);
  t.communicate(t.collective_s(Collective::reduce_scatter, weight));
  t.free(weight);
}

// Flash ring attention over the p sequence shards for `heads` local heads: KV blocks travel, one flash call per
// block, partial outputs merged by log-sum-exp.
inline void ring_attention_forward(Tally& t, const ScheduleDims& x, double heads, double kv_heads) {
  const double kv_block = 2 * x.n * kv_heads * x.d * x.e;
  t.alloc(2 * kv_block + x.n * heads * x.d * 4 + x.b * heads * x.s_loc * 4);  // double buffer + one block's partials
  const double block = t.attention_forward_s(x.attention_flops(heads, 1 / (x.p * x.p)));
  t.ring(int(x.p), block + t.elementwise_s(3 * x.n * heads * x.d * 4), t.collective_s(Collective::send_recv, kv_block));
  t.free(2 * kv_block + x.n * heads * x.d * 4 + x.b * heads * x.s_loc * 4);
}
inline void ring_attention_backward(Tally& t, const ScheduleDims& x, double heads, double kv_heads) {
  const double kv_block = 2 * x.n * kv_heads * x.d * x.e;
  t.alloc(4 * kv_block);  // (kv, dkv) double-buffered
  const double block = t.attention_backward_s(x.attention_flops(heads, 1 / (x.p * x.p)));
  t.ring(int(x.p), block, t.collective_s(Collective::send_recv, 2 * kv_block), /*final_hop=*/true);
  t.free(4 * kv_block);
}

// Output of a sublayer (forward) or gradient of its input (backward): [b, s/p, h], handed to the block.
inline double block_tensor(const ScheduleDims& x) { return x.n * x.h * x.e; }

// ---- attention sublayer ------------------------------------------------------------------------------------------

// MegatronTS: all-gather X along s, QKV for the local heads over the whole sequence, attention, row-parallel
// projection, reduce-scatter. Backward re-gathers X for dW (overlapped with the dX GEMM).
inline void megatron_ts_attention_forward(Tally& t, const ScheduleDims& x) {
  const double full = x.N * x.h * x.e;
  norm_forward(t, x);
  t.save_input(block_tensor(x));
  t.alloc(full);
  t.communicate(t.collective_s(Collective::all_gather, full));
  t.save(x.N * x.qkv_loc * x.e);
  t.compute(t.gemm_s(x.N, x.qkv_loc, x.h, int(x.e)));
  t.free(full);
  t.save(x.N * x.q_loc * x.e + x.b * x.a_loc * x.s * 4);
  t.compute(t.attention_forward_s(x.attention_flops(x.a_loc, 1)));
  t.alloc(full);
  t.compute(t.gemm_s(x.N, x.h, x.q_loc, int(x.e)));
  t.alloc(block_tensor(x));
  t.communicate(t.collective_s(Collective::reduce_scatter, full));
  t.free(full);
  t.free(block_tensor(x));
}
inline void megatron_ts_attention_backward(Tally& t, const ScheduleDims& x) {
  const double full = x.N * x.h * x.e;
  t.alloc(full);  // gathered dY
  t.communicate(t.collective_s(Collective::all_gather, full));
  t.alloc(x.N * x.q_loc * x.e);
  t.compute(t.gemm_s(x.N, x.q_loc, x.h, int(x.e)) + t.gemm_s(x.q_loc, x.h, x.N, int(x.e)));
  t.free(full);
  t.alloc(x.N * x.qkv_loc * x.e);
  t.compute(t.attention_backward_s(x.attention_flops(x.a_loc, 1)));
  t.free(x.N * x.q_loc * x.e);
  t.release(x.N * x.q_loc * x.e + x.b * x.a_loc * x.s * 4);
  t.alloc(2 * full);  // re-gathered X and the full dX
  t.overlapped(t.gemm_s(x.N, x.h, x.qkv_loc, int(x.e)), t.collective_s(Collective::all_gather, full));
  t.compute(t.gemm_s(x.qkv_loc, x.h, x.N, int(x.e)));
  t.free(x.N * x.qkv_loc * x.e);
  t.release(x.N * x.qkv_loc * x.e);
  t.alloc(block_tensor(x));
  t.communicate(t.collective_s(Collective::reduce_scatter, full));
  t.free(2 * full);
  t.free(block_tensor(x));
  t.release(block_tensor(x));
  norm_backward(t, x);
}

// MegatronCZ: ZeRO-3 ring for QKV, ring attention over sequence shards (all heads), all-gathered projection.
inline void megatron_cz_attention_forward(Tally& t, const ScheduleDims& x) {
  norm_forward(t, x);
  t.save_input(block_tensor(x));
  t.save(x.n * x.qkv * x.e);
  ring_column_forward(t, x, x.qkv_loc);
  t.save(x.n * x.q * x.e + x.b * x.a * x.s_loc * 4);
  ring_attention_forward(t, x, x.a, x.a_kv);
  t.alloc(block_tensor(x));
  gather_row_forward(t, x, x.q);
  t.free(block_tensor(x));
}
inline void megatron_cz_attention_backward(Tally& t, const ScheduleDims& x) {
  t.alloc(x.n * x.q * x.e);
  gather_row_backward(t, x, x.q);
  t.alloc(x.n * x.qkv * x.e);
  ring_attention_backward(t, x, x.a, x.a_kv);
  t.free(x.n * x.q * x.e);
  t.release(x.n * x.q * x.e + x.b * x.a * x.s_loc * 4);
  t.alloc(block_tensor(x));
  ring_column_backward(t, x, x.qkv_loc);
  t.free(x.n * x.qkv * x.e);
  t.release(x.n * x.qkv * x.e);
  t.free(block_tensor(x));
  t.release(block_tensor(x));
  norm_backward(t, x);
}

// UlyssesZ: ZeRO-3 ring for QKV, all-to-all to head shards over the whole sequence, attention, all-to-all back,
// all-gathered projection.
inline void ulysses_z_attention_forward(Tally& t, const ScheduleDims& x) {
  norm_forward(t, x);
  t.save_input(block_tensor(x));
  t.alloc(x.n * x.qkv * x.e);
  ring_column_forward(t, x, x.qkv_loc);
  t.save(x.N * x.qkv_loc * x.e);
  t.communicate(t.collective_s(Collective::all_to_all, x.n * x.qkv * x.e));
  t.free(x.n * x.qkv * x.e);
  t.save(x.N * x.q_loc * x.e + x.b * x.a_loc * x.s * 4);
  t.compute(t.attention_forward_s(x.attention_flops(x.a_loc, 1)));
  t.save(x.n * x.q * x.e);
  t.communicate(t.collective_s(Collective::all_to_all, x.n * x.q * x.e));
  t.alloc(block_tensor(x));
  gather_row_forward(t, x, x.q);
  t.free(block_tensor(x));
}
inline void ulysses_z_attention_backward(Tally& t, const ScheduleDims& x) {
  t.alloc(x.n * x.q * x.e);
  gather_row_backward(t, x, x.q);
  t.alloc(x.N * x.q_loc * x.e);
  t.communicate(t.collective_s(Collective::all_to_all, x.n * x.q * x.e));
  t.free(x.n * x.q * x.e);
  t.release(x.n * x.q * x.e);
  t.alloc(x.N * x.qkv_loc * x.e);
  t.compute(t.attention_backward_s(x.attention_flops(x.a_loc, 1)));
  t.free(x.N * x.q_loc * x.e);
  t.release(x.N * x.q_loc * x.e + x.b * x.a_loc * x.s * 4);
  t.alloc(x.n * x.qkv * x.e);
  t.communicate(t.collective_s(Collective::all_to_all, x.n * x.qkv * x.e));
  t.free(x.N * x.qkv_loc * x.e);
  t.release(x.N * x.qkv_loc * x.e);
  t.alloc(block_tensor(x));
  ring_column_backward(t, x, x.qkv_loc);
  t.free(x.n * x.qkv * x.e);
  t.free(block_tensor(x));
  t.release(block_tensor(x));
  norm_backward(t, x);
}

// ColossalZ: Ring Self-Attention. Scores for the local queries against all keys are materialised (b a s/p s), K
// and then V travel the ring; memory grows with s^2 / p.
inline void colossal_z_attention_forward(Tally& t, const ScheduleDims& x) {
  const double scores = x.b * x.a * x.s_loc * x.s * x.e;
  const double block = x.n * x.kv * x.e;
  const double score_block = t.gemm_s(x.b * x.a * x.s_loc, x.s_loc, x.d, int(x.e));
  norm_forward(t, x);
  t.save_input(block_tensor(x));
  t.save(x.n * x.qkv * x.e);
  ring_column_forward(t, x, x.qkv_loc);
  t.alloc(2 * block);
  t.save(scores);
  t.ring(int(x.p), score_block, t.collective_s(Collective::send_recv, block));
  t.compute(t.elementwise_s(4 * scores));  // softmax: max, exp-sum, normalise
  t.save(x.n * x.q * x.e);
  t.ring(int(x.p), score_block, t.collective_s(Collective::send_recv, block));
  t.free(2 * block);
  t.alloc(block_tensor(x));
  gather_row_forward(t, x, x.q);
  t.free(block_tensor(x));
}
inline void colossal_z_attention_backward(Tally& t, const ScheduleDims& x) {
  const double scores = x.b * x.a * x.s_loc * x.s * x.e;
  const double block = x.n * x.kv * x.e;
  const double score_block = t.gemm_s(x.b * x.a * x.s_loc, x.s_loc, x.d, int(x.e));
  t.alloc(x.n * x.q * x.e);
  gather_row_backward(t, x, x.q);
  t.alloc(scores + 4 * block);  // dS, and (V, dV) then (K, dK) double-buffered
  t.ring(int(x.p), 2 * score_block, t.collective_s(Collective::send_recv, 2 * block), true);
  t.compute(t.elementwise_s(3 * scores));
  t.free(x.n * x.q * x.e);
  t.release(scores + x.n * x.q * x.e);
  t.alloc(x.n * x.qkv * x.e);
  t.ring(int(x.p), 2 * score_block, t.collective_s(Collective::send_recv, 2 * block), true);
  t.free(scores + 4 * block);
  t.alloc(block_tensor(x));
  ring_column_backward(t, x, x.qkv_loc);
  t.free(x.n * x.qkv * x.e);
  t.release(x.n * x.qkv * x.e);
  t.free(block_tensor(x));
  t.release(block_tensor(x));
  norm_backward(t, x);
}

// METP: an outer loop over the p weight shards, each broadcast by its owner (prefetched, double-buffered); for
// shard i, qkv_i for the local tokens (heads of rank i), an inner ring attention over sequence shards, and
// O += A_i W_proj_i. Keeps X and every A_i; backward recomputes qkv_i and reduces dW_i to its owner.
inline void metp_attention_forward(Tally& t, const ScheduleDims& x) {
  const double shard = (x.qkv_loc + x.q_loc) * x.h * x.e;
  const double kv_block = 2 * x.n * x.kv_loc * x.e;
  norm_forward(t, x);
  t.save_input(block_tensor(x));
  t.alloc(2 * shard + block_tensor(x));
  t.alloc(x.n * x.qkv_loc * x.e + 2 * kv_block + x.n * x.q_loc * 4 + x.b * x.a_loc * x.s_loc * 4);
  const double inner = t.ring_s(int(x.p), t.attention_forward_s(x.attention_flops(x.a_loc, 1 / (x.p * x.p))),
                                t.collective_s(Collective::send_recv, kv_block));
  const double step = t.gemm_s(x.n, x.qkv_loc, x.h, int(x.e)) + inner + t.gemm_s(x.n, x.h, x.q_loc, int(x.e));
  for (int i = 0; i < int(x.p); ++i) {
    t.save(x.n * x.q_loc * x.e + x.b * x.a_loc * x.s_loc * 4);
    if (i + 1 < int(x.p)) t.overlapped(step, t.collective_s(Collective::broadcast, shard));
    else t.compute(step);
  }
  t.free(x.n * x.qkv_loc * x.e + 2 * kv_block + x.n * x.q_loc * 4 + x.b * x.a_loc * x.s_loc * 4);
  t.free(2 * shard + block_tensor(x));
}
inline void metp_attention_backward(Tally& t, const ScheduleDims& x) {
  const double shard = (x.qkv_loc + x.q_loc) * x.h * x.e;
  const double kv_block = 2 * x.n * x.kv_loc * x.e;
  t.alloc(4 * shard + block_tensor(x));  // weight and dW double buffers, dX
  t.alloc(2 * x.n * x.qkv_loc * x.e + x.n * x.q_loc * x.e + 4 * kv_block);
  const double inner = t.ring_s(int(x.p), t.attention_backward_s(x.attention_flops(x.a_loc, 1 / (x.p * x.p))),
                                t.collective_s(Collective::send_recv, 2 * kv_block), true);
  const double step = t.gemm_s(x.n, x.qkv_loc, x.h, int(x.e)) + t.gemm_s(x.n, x.q_loc, x.h, int(x.e)) +
                      t.gemm_s(x.q_loc, x.h, x.n, int(x.e)) + inner + t.gemm_s(x.n, x.h, x.qkv_loc, int(x.e)) +
                      t.gemm_s(x.qkv_loc, x.h, x.n, int(x.e));
  const double transfer = t.collective_s(Collective::broadcast, shard) + t.collective_s(Collective::reduce, shard);
  for (int i = 0; i < int(x.p); ++i) {
    t.overlapped(step, i + 1 < int(x.p) ? transfer : 0);
    t.release(x.n * x.q_loc * x.e + x.b * x.a_loc * x.s_loc * 4);
  }
  t.communicate(t.collective_s(Collective::reduce, shard));  // the last dW reaches its owner
  t.free(2 * x.n * x.qkv_loc * x.e + x.n * x.q_loc * x.e + 4 * kv_block);
  t.free(4 * shard + block_tensor(x));
  t.release(block_tensor(x));
  norm_backward(t, x);
}

// ---- MLP sublayer ------------------------------------------------------------------------------------------------

inline double activation_bytes(const ScheduleDims& x, double tokens, double width) {
  return tokens * (x.g + 1) * width * x.e;  // reads the g inputs, writes one output
}

// MegatronTS: all-gather X, column-parallel W_in over all tokens, activation, row-parallel W_out, reduce-scatter.
inline void megatron_ts_mlp_forward(Tally& t, const ScheduleDims& x) {
  const double full = x.N * x.h * x.e;
  norm_forward(t, x);
  t.save_input(block_tensor(x));
  t.alloc(full);
  t.communicate(t.collective_s(Collective::all_gather, full));
  t.save(x.N * x.g * x.f_loc * x.e);
  t.compute(t.gemm_s(x.N, x.g * x.f_loc, x.h, int(x.e)));
  t.free(full);
  t.save(x.N * x.f_loc * x.e);
  t.compute(t.elementwise_s(activation_bytes(x, x.N, x.f_loc)));
  t.alloc(full);
  t.compute(t.gemm_s(x.N, x.h, x.f_loc, int(x.e)));
  t.alloc(block_tensor(x));
  t.communicate(t.collective_s(Collective::reduce_scatter, full));
  t.free(full);
  t.free(block_tensor(x));
}
inline void megatron_ts_mlp_backward(Tally& t, const ScheduleDims& x) {
  const double full = x.N * x.h * x.e;
  t.alloc(full);
  t.communicate(t.collective_s(Collective::all_gather, full));
  t.alloc(x.N * x.f_loc * x.e);
  t.compute(t.gemm_s(x.N, x.f_loc, x.h, int(x.e)) + t.gemm_s(x.f_loc, x.h, x.N, int(x.e)));
  t.free(full);
  t.alloc(x.N * x.g * x.f_loc * x.e);
  t.compute(t.elementwise_s(activation_bytes(x, x.N, x.f_loc) + x.N * x.f_loc * x.e));
  t.free(x.N * x.f_loc * x.e);
  t.release(x.N * x.f_loc * x.e);
  t.alloc(2 * full);
  t.overlapped(t.gemm_s(x.N, x.h, x.g * x.f_loc, int(x.e)), t.collective_s(Collective::all_gather, full));
  t.compute(t.gemm_s(x.g * x.f_loc, x.h, x.N, int(x.e)));
  t.free(x.N * x.g * x.f_loc * x.e);
  t.release(x.N * x.g * x.f_loc * x.e);
  t.alloc(block_tensor(x));
  t.communicate(t.collective_s(Collective::reduce_scatter, full));
  t.free(2 * full);
  t.free(block_tensor(x));
  t.release(block_tensor(x));
  norm_backward(t, x);
}

// The ZeRO-3 MLP of MegatronCZ, UlyssesZ and ColossalZ: W_in by the ring, W_out all-gathered.
inline void zero3_mlp_forward(Tally& t, const ScheduleDims& x) {
  norm_forward(t, x);
  t.save_input(block_tensor(x));
  t.save(x.n * x.g * x.f * x.e);
  ring_column_forward(t, x, x.g * x.f_loc);
  t.save(x.n * x.f * x.e);
  t.compute(t.elementwise_s(activation_bytes(x, x.n, x.f)));
  t.alloc(block_tensor(x));
  gather_row_forward(t, x, x.f);
  t.free(block_tensor(x));
}
inline void zero3_mlp_backward(Tally& t, const ScheduleDims& x) {
  t.alloc(x.n * x.f * x.e);
  gather_row_backward(t, x, x.f);
  t.alloc(x.n * x.g * x.f * x.e);
  t.compute(t.elementwise_s(activation_bytes(x, x.n, x.f) + x.n * x.f * x.e));
  t.free(x.n * x.f * x.e);
  t.release(x.n * x.f * x.e);
  t.alloc(block_tensor(x));
  ring_column_backward(t, x, x.g * x.f_loc);
  t.free(x.n * x.g * x.f * x.e);
  t.release(x.n * x.g * x.f * x.e);
  t.free(block_tensor(x));
  t.release(block_tensor(x));
  norm_backward(t, x);
}

// METP: the packed shard [W_in_j ; W_out_j] travels the ring; each step adds act(X W_in_j) W_out_j to the output.
// Keeps only X: backward recomputes each step's intermediate while (w, dw) travel together.
inline void metp_mlp_forward(Tally& t, const ScheduleDims& x) {
  const double shard = (x.g + 1) * x.f_loc * x.h * x.e;
  const double step_buffers = x.n * (x.g + 1) * x.f_loc * x.e;
  norm_forward(t, x);
  t.save_input(block_tensor(x));
  t.alloc(2 * shard + block_tensor(x) + step_buffers);
  const double step = t.gemm_s(x.n, x.g * x.f_loc, x.h, int(x.e)) +
                      t.elementwise_s(activation_bytes(x, x.n, x.f_loc)) + t.gemm_s(x.n, x.h, x.f_loc, int(x.e));
  t.ring(int(x.p), step, t.collective_s(Collective::send_recv, shard));
  t.free(2 * shard + block_tensor(x) + step_buffers);
}
inline void metp_mlp_backward(Tally& t, const ScheduleDims& x) {
  const double shard = (x.g + 1) * x.f_loc * x.h * x.e;
  const double step_buffers = 2 * x.n * (x.g + 1) * x.f_loc * x.e;
  t.alloc(4 * shard + block_tensor(x) + step_buffers);
  const double step = t.gemm_s(x.n, x.g * x.f_loc, x.h, int(x.e)) + t.gemm_s(x.n, x.f_loc, x.h, int(x.e)) +
                      t.gemm_s(x.f_loc, x.h, x.n, int(x.e)) + t.gemm_s(x.n, x.h, x.g * x.f_loc, int(x.e)) +
                      t.gemm_s(x.g * x.f_loc, x.h, x.n, int(x.e)) +
                      t.elementwise_s(2 * activation_bytes(x, x.n, x.f_loc) + x.n * x.f_loc * x.e);
  t.ring(int(x.p), step, t.collective_s(Collective::send_recv, 2 * shard), true);
  t.free(4 * shard + block_tensor(x) + step_buffers);
  t.release(block_tensor(x));
  norm_backward(t, x);
}

// ---- dispatch ----------------------------------------------------------------------------------------------------

inline void forward(Strategy s, Sublayer part, Tally& t, const ScheduleDims& x) {
  if (part == Sublayer::attention) {
    switch (s) {
      case Strategy::megatron_ts: return megatron_ts_attention_forward(t, x);
      case Strategy::megatron_cz: return megatron_cz_attention_forward(t, x);
      case Strategy::ulysses_z: return ulysses_z_attention_forward(t, x);
      case Strategy::colossal_z: return colossal_z_attention_forward(t, x);
      case Strategy::metp: return metp_attention_forward(t, x);
    }
  }
  switch (s) {
    case Strategy::megatron_ts: return megatron_ts_mlp_forward(t, x);
    case Strategy::megatron_cz:
    case Strategy::ulysses_z:
    case Strategy::colossal_z: return zero3_mlp_forward(t, x);
    case Strategy::metp: return metp_mlp_forward(t, x);
  }
}

inline void backward(Strategy s, Sublayer part, Tally& t, const ScheduleDims& x) {
  if (part == Sublayer::attention) {
    switch (s) {
      case Strategy::megatron_ts: return megatron_ts_attention_backward(t, x);
      case Strategy::megatron_cz: return megatron_cz_attention_backward(t, x);
      case Strategy::ulysses_z: return ulysses_z_attention_backward(t, x);
      case Strategy::colossal_z: return colossal_z_attention_backward(t, x);
      case Strategy::metp: return metp_attention_backward(t, x);
    }
  }
  switch (s) {
    case Strategy::megatron_ts: return megatron_ts_mlp_backward(t, x);
    case Strategy::megatron_cz:
    case Strategy::ulysses_z:
    case Strategy::colossal_z: return zero3_mlp_backward(t, x);
    case Strategy::metp: return metp_mlp_backward(t, x);
  }
}

}  // namespace schedule

// Memory (and, with a profile, time) of one sublayer under one strategy on one rank of a group of p.
inline SublayerCost evaluate_sublayer(Strategy s, Sublayer part, const ModelShape& m, int p,
                                      const HardwareProfile* hardware) {
  validate(m, p);
  const ScheduleDims dims(m, p);
  Tally t(hardware, p, m.recompute);
  schedule::forward(s, part, t, dims);
  t.end_forward();
  if (m.recompute) {
    schedule::forward(s, part, t, dims);
    t.end_replay();
  }
  schedule::backward(s, part, t, dims);
  return t.result();
}

}  // namespace paradyse::cost
