// paradyse/cost/schedules.hpp: what each strategy does on one rank, per sublayer, as a schedule over a Tally.
//
// One function per (strategy, sublayer), forward then backward, written after the strategy's code in
// include/paradyse/strategy/ (MegatronTS, MegatronCZ, UlyssesZ and the ZeRO-3 MLP; METP and ColossalZ after the
// ParaDySe digest until their code lands): the tensors it keeps for backward (its Saved struct), the pooled buffers
// it acquires and when it gives them back, its GEMMs, attention calls, copies and collectives, and which transfers
// overlap which compute. Memory is that of the rank holding the most tokens (uneven shards: ceil(s/p)). Sizes in
// elements are turned into bytes with the activation dtype; log-sum-exp and LayerNorm statistics are float32.
//
// Around each sublayer the model's pre-norm block keeps the sublayer's input (the residual stream, [b, s/p, h]) and
// two float32 statistics per token, and hands the strategy the normalised input; the strategy's output and, in
// backward, the gradient of its input are [b, s/p, h] tensors of the block.
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
  double seg;                    // the longest token segment of a rank (zigzag: half a chunk)
  bool staged;                   // gathers in natural order go through a staging copy (b > 1 or zigzag)

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
    seg = m.causal && group > 1 ? double((m.seq + 2 * group - 1) / (2 * group)) : s_loc;
    staged = m.batch > 1 || (m.causal && group > 1);
  }

  // Forward attention flops for `heads` heads over a share `fraction` of all query-key pairs.
  double attention_flops(double heads, double fraction) const { return 4 * d * heads * b * pairs * fraction; }
};

namespace schedule {

// ---- pieces shared by several strategies ---------------------------------------------------------------------------

// A kernel that reads and writes `elements` elements once each (copies, zero fills, adds, activations).
inline void stream(Tally& t, const ScheduleDims& x, double elements) { t.compute(t.elementwise_s(2 * elements * x.e)); }

// The block's pre-norm: keeps the residual input and the norm's two per-token statistics; the normalised input is
// the strategy's input, and its output a block tensor. After the strategy the residual add makes the next
// sublayer's input (which that sublayer counts as its saved residual).
inline void norm_forward(Tally& t, const ScheduleDims& x) {
  t.save_input(x.n * x.h * x.e);  // the residual input
  t.save_input(x.n * 4);          // mean
  t.save_input(x.n * 4);          // rstd
  t.alloc(x.n * x.h * x.e);       // the normalised input
  stream(t, x, x.n * x.h);
  t.alloc(x.n * x.h * x.e);       // the sublayer's output
}
inline void block_forward_end(Tally& t, const ScheduleDims& x) {
  t.alloc(x.n * x.h * x.e);       // input + output: the next sublayer's residual
  stream(t, x, x.n * x.h);
  t.free(3 * x.n * x.h * x.e);    // that residual (counted by the next sublayer), the output, the normalised input
}
// Backward: the input gradient and the normalised input's gradient, before the strategy runs.
inline void block_backward_begin(Tally& t, const ScheduleDims& x) { t.alloc(2 * x.n * x.h * x.e); }
inline void norm_backward(Tally& t, const ScheduleDims& x) {
  t.alloc(2 * x.h * 4);           // the norm's parameter gradients of this call
  stream(t, x, 3 * x.n * x.h);    // the residual path's copy and the norm's backward
  t.free(2 * x.h * 4);
  t.free(2 * x.n * x.h * x.e);    // the normalised input's gradient; the incoming gradient (the input's replaces it)
  t.release(x.n * x.h * x.e);
  t.release(x.n * 4);
  t.release(x.n * 4);
}

// The strategy's own copy of its input, kept for backward.
inline void keep_input_copy(Tally& t, const ScheduleDims& x) {
  t.save_input(x.n * x.h * x.e);
  stream(t, x, x.n * x.h);
}

// One flash-attention call's workspace, as the CPU kernels allocate it (ops/cpu/attention_tiles.hpp): per-query
// visible key ranges (two int64), float32 tiles of 128 x 256 (forward: the score tile and a 128 x d accumulator;
// backward: two tiles and two per-query terms).
inline double attention_scratch(double queries, bool backward, double d) {
  const double tile = 128.0 * 256.0 * 4;
  if (backward) return round_allocation(16 * queries) + 2 * round_allocation(tile) + 2 * round_allocation(4 * queries);
  return round_allocation(16 * queries) + round_allocation(tile) + round_allocation(128 * d * 4) +
         2 * round_allocation(128 * 4);
}

// All-gather of the sequence ([b, s, width] from [b, s/p, width]); natural order needs a staging copy unless b = 1
// and the layout is contiguous.
inline void gather_sequence(Tally& t, const ScheduleDims& x, double width, bool natural) {
  const double full = x.N * width * x.e;
  if (natural && x.staged) t.acquire(full);
  t.communicate(t.collective_s(Collective::all_gather, full));
  if (natural && x.staged) stream(t, x, x.N * width), t.give_back(full);
}
inline void reduce_scatter_sequence(Tally& t, const ScheduleDims& x, double width, bool natural) {
  const double full = x.N * width * x.e;
  if (natural && x.staged) t.acquire(full), stream(t, x, x.N * width);
  t.communicate(t.collective_s(Collective::reduce_scatter, full));
  if (natural && x.staged) t.give_back(full);
}
// Ulysses' all-to-alls between [p][b n_r, width] chunks and [b, s, width] of one head group.
inline void all_to_all_sequence(Tally& t, const ScheduleDims& x, double width) {
  const double full = x.N * width * x.e;
  if (x.staged) t.acquire(full), stream(t, x, x.N * width);
  t.communicate(t.collective_s(Collective::all_to_all, x.p * x.n * width * x.e));
  if (x.staged) t.give_back(full);
}

// ZeRO-3 column linear by a ring (strategy/zero3_linear.hpp): two shard buffers of [rows, h]; each of the p steps
// multiplies the local tokens by one shard while the next arrives.
inline void ring_column_forward(Tally& t, const ScheduleDims& x, double rows) {
  const double shard = rows * x.h * x.e;
  if (x.p > 1) t.acquire(shard), t.acquire(shard);
  t.ring(int(x.p), t.gemm_s(x.n, rows, x.h, int(x.e)), t.collective_s(Collective::send_recv, shard));
  if (x.p > 1) t.give_back(shard), t.give_back(shard);
}
// Backward: the shards travel again with their gradient accumulators (two rings of two buffers); a last hop
// returns each gradient to its owner.
inline void ring_column_backward(Tally& t, const ScheduleDims& x, double rows) {
  const double shard = rows * x.h * x.e;
  if (x.p > 1) t.acquire(shard), t.acquire(shard);
  t.acquire(shard);
  if (x.p > 1) t.acquire(shard);
  stream(t, x, rows * x.h);  // the zeroed accumulator
  const double step = t.gemm_s(x.n, x.h, rows, int(x.e)) + t.gemm_s(rows, x.h, x.n, int(x.e));
  t.ring(int(x.p), step, 2 * t.collective_s(Collective::send_recv, shard));
  if (x.p > 1) {
    t.acquire(shard);
    t.communicate(t.collective_s(Collective::send_recv, shard));
    t.give_back(shard);
  }
  stream(t, x, rows * x.h);  // added into the gradient
  if (x.p > 1) t.give_back(shard), t.give_back(shard), t.give_back(shard);
  t.give_back(shard);
}

// ZeRO-3 row linear: all-gather the whole weight [p rows, h], y = sum_j a_j W_j.
inline void gathered_row_forward(Tally& t, const ScheduleDims& x, double rows) {
  const double full = x.p * rows * x.h * x.e;
  t.acquire(full);
  t.communicate(t.collective_s(Collective::all_gather, full));
  t.compute(x.p * t.gemm_s(x.n, x.h, rows, int(x.e)));
  t.give_back(full);
}
// Backward: gather again, da_j = dy W_j^T, the full partial dW (block j = a_j^T dy), reduce-scattered.
inline void gathered_row_backward(Tally& t, const ScheduleDims& x, double rows) {
  const double full = x.p * rows * x.h * x.e;
  t.acquire(full);
  t.communicate(t.collective_s(Collective::all_gather, full));
  t.acquire(full);
  t.compute(x.p * (t.gemm_s(x.n, rows, x.h, int(x.e)) + t.gemm_s(rows, x.h, x.n, int(x.e))));
  t.give_back(full);
  t.acquire(rows * x.h * x.e);
  t.communicate(t.collective_s(Collective::reduce_scatter, full));
  stream(t, x, rows * x.h);
  t.give_back(rows * x.h * x.e);
  t.give_back(full);
}

// Ring attention (strategy/ring_attention.hpp) for `heads` query heads over the local tokens: K/V blocks of
// `kv_heads` heads travel (double-buffered), one flash call per visible block pair, merged by log-sum-exp.
inline void ring_attention_forward(Tally& t, const ScheduleDims& x, double heads, double kv_heads) {
  const double block = 2 * x.b * x.s_loc * kv_heads * x.d * x.e;
  const double partial = x.b * x.seg * heads * x.d * x.e + x.b * heads * x.seg * 4;
  t.acquire(x.b * x.seg * heads * x.d * x.e);
  t.acquire(x.b * heads * x.seg * 4);
  t.acquire(block);
  t.acquire(x.p > 1 ? block : 0);
  stream(t, x, block / x.e);  // pack the own block
  t.alloc(attention_scratch(x.seg, false, x.d));
  const double step = t.attention_forward_s(x.attention_flops(heads, 1 / (x.p * x.p))) +
                      t.elementwise_s(3 * partial);  // the log-sum-exp merge
  t.ring(int(x.p), step, t.collective_s(Collective::send_recv, block));
  t.free(attention_scratch(x.seg, false, x.d));
  t.give_back(x.b * x.seg * heads * x.d * x.e);
  t.give_back(x.b * heads * x.seg * 4);
  t.give_back(block);
  t.give_back(x.p > 1 ? block : 0);
}
// Backward: (K/V, dK/dV) travel together (five buffers: block, next block, and three sums), dK/dV hop home.
inline void ring_attention_backward(Tally& t, const ScheduleDims& x, double heads, double kv_heads) {
  const double block = 2 * x.b * x.s_loc * kv_heads * x.d * x.e;
  const int buffers = x.p > 1 ? 5 : 2;
  for (int i = 0; i < buffers; ++i) t.acquire(block);
  stream(t, x, block / x.e);
  t.alloc(attention_scratch(x.seg, true, x.d));
  const double step = t.attention_backward_s(x.attention_flops(heads, 1 / (x.p * x.p))) + t.elementwise_s(2 * block);
  t.ring(int(x.p), step, 2 * t.collective_s(Collective::send_recv, block), /*final_hop=*/true);
  t.free(attention_scratch(x.seg, true, x.d));
  stream(t, x, block / x.e);  // added into dK/dV
  for (int i = 0; i < buffers; ++i) t.give_back(block);
}

// ---- MegatronTS (strategy/megatron_ts.hpp) -------------------------------------------------------------------------

inline void megatron_ts_attention_forward(Tally& t, const ScheduleDims& x) {
  const double R = x.qkv_loc, W = x.q_loc;
  norm_forward(t, x);
  keep_input_copy(t, x);
  t.save(x.N * R * x.e);
  t.save(x.N * W * x.e);
  t.save(x.b * x.a_loc * x.s * 4);
  t.acquire(x.N * x.h * x.e);
  gather_sequence(t, x, x.h, true);
  t.compute(t.gemm_s(x.N, R, x.h, int(x.e)));
  t.give_back(x.N * x.h * x.e);
  t.alloc(attention_scratch(x.s, false, x.d));
  t.compute(t.attention_forward_s(x.attention_flops(x.a_loc, 1)));
  t.free(attention_scratch(x.s, false, x.d));
  t.acquire(x.N * x.h * x.e);
  t.compute(t.gemm_s(x.N, x.h, W, int(x.e)));
  reduce_scatter_sequence(t, x, x.h, true);
  t.give_back(x.N * x.h * x.e);
  block_forward_end(t, x);
}
inline void megatron_ts_attention_backward(Tally& t, const ScheduleDims& x) {
  const double R = x.qkv_loc, W = x.q_loc;
  block_backward_begin(t, x);
  t.acquire(x.N * R * x.e);
  stream(t, x, x.N * R);  // zeroed
  t.acquire(x.N * x.h * x.e);
  gather_sequence(t, x, x.h, true);
  t.acquire(x.N * W * x.e);
  t.compute(t.gemm_s(x.N, W, x.h, int(x.e)) + t.gemm_s(W, x.h, x.N, int(x.e)));
  t.alloc(attention_scratch(x.s, true, x.d));
  t.compute(t.attention_backward_s(x.attention_flops(x.a_loc, 1)));
  t.free(attention_scratch(x.s, true, x.d));
  t.give_back(x.N * W * x.e);
  t.give_back(x.N * x.h * x.e);
  t.acquire(x.N * x.h * x.e);
  gather_sequence(t, x, x.h, true);
  t.compute(t.gemm_s(R, x.h, x.N, int(x.e)) + t.gemm_s(x.N, x.h, R, int(x.e)));
  reduce_scatter_sequence(t, x, x.h, true);
  t.give_back(x.N * x.h * x.e);
  t.give_back(x.N * R * x.e);
  t.release(x.N * R * x.e + x.N * W * x.e);
  t.release(x.b * x.a_loc * x.s * 4);
  t.release(x.n * x.h * x.e);
  norm_backward(t, x);
}

inline void megatron_ts_mlp_forward(Tally& t, const ScheduleDims& x) {
  const double Fin = x.g * x.f_loc, F = x.f_loc;
  norm_forward(t, x);
  keep_input_copy(t, x);
  t.save(x.N * Fin * x.e);
  t.acquire(x.N * x.h * x.e);
  gather_sequence(t, x, x.h, false);
  t.compute(t.gemm_s(x.N, Fin, x.h, int(x.e)));
  t.acquire(x.N * F * x.e);
  stream(t, x, x.N * (Fin + F) / 2);  // the activation
  t.compute(t.gemm_s(x.N, x.h, F, int(x.e)));
  reduce_scatter_sequence(t, x, x.h, false);
  t.give_back(x.N * F * x.e);
  t.give_back(x.N * x.h * x.e);
  block_forward_end(t, x);
}
inline void megatron_ts_mlp_backward(Tally& t, const ScheduleDims& x) {
  const double Fin = x.g * x.f_loc, F = x.f_loc;
  block_backward_begin(t, x);
  t.acquire(x.N * Fin * x.e);
  t.acquire(x.N * x.h * x.e);
  gather_sequence(t, x, x.h, false);
  t.acquire(x.N * F * x.e);
  stream(t, x, x.N * (Fin + F) / 2);  // the activation, recomputed
  t.compute(t.gemm_s(F, x.h, x.N, int(x.e)) + t.gemm_s(x.N, F, x.h, int(x.e)));
  stream(t, x, x.N * (Fin + 2 * F) / 2);  // its backward (after zeroing dpre)
  t.give_back(x.N * F * x.e);
  t.give_back(x.N * x.h * x.e);
  t.acquire(x.N * x.h * x.e);
  gather_sequence(t, x, x.h, false);
  t.compute(t.gemm_s(Fin, x.h, x.N, int(x.e)) + t.gemm_s(x.N, x.h, Fin, int(x.e)));
  reduce_scatter_sequence(t, x, x.h, false);
  t.give_back(x.N * x.h * x.e);
  t.give_back(x.N * Fin * x.e);
  t.release(x.N * Fin * x.e);
  t.release(x.n * x.h * x.e);
  norm_backward(t, x);
}

// ---- the ZeRO-3 MLP of MegatronCZ, UlyssesZ and ColossalZ (strategy/zero3_mlp.hpp) ---------------------------------

inline void zero3_mlp_forward(Tally& t, const ScheduleDims& x) {
  const double Fin = x.g * x.f_loc, F = x.f_loc;
  norm_forward(t, x);
  keep_input_copy(t, x);
  t.save(x.n * x.p * Fin * x.e);
  ring_column_forward(t, x, Fin);
  t.acquire(x.n * x.p * F * x.e);
  stream(t, x, x.n * x.p * (Fin + F) / 2);
  gathered_row_forward(t, x, F);
  t.give_back(x.n * x.p * F * x.e);
  block_forward_end(t, x);
}
inline void zero3_mlp_backward(Tally& t, const ScheduleDims& x) {
  const double Fin = x.g * x.f_loc, F = x.f_loc;
  block_backward_begin(t, x);
  t.acquire(x.n * x.p * Fin * x.e);
  t.acquire(x.n * x.p * F * x.e);
  t.acquire(x.n * x.p * F * x.e);
  stream(t, x, x.n * x.p * (Fin + F) / 2);
  gathered_row_backward(t, x, F);
  stream(t, x, x.n * x.p * (2 * Fin + 2 * F) / 2);  // zero dpre, activation backward
  t.give_back(x.n * x.p * F * x.e);
  t.give_back(x.n * x.p * F * x.e);
  ring_column_backward(t, x, Fin);
  t.give_back(x.n * x.p * Fin * x.e);
  t.release(x.n * x.p * Fin * x.e);
  t.release(x.n * x.h * x.e);
  norm_backward(t, x);
}

// ---- MegatronCZ attention (strategy/megatron_cz.hpp) ---------------------------------------------------------------

inline void megatron_cz_attention_forward(Tally& t, const ScheduleDims& x) {
  const double R = x.qkv_loc, W = x.q_loc, heads = x.p * x.a_loc, kv_heads = x.p * x.akv_loc;
  norm_forward(t, x);
  keep_input_copy(t, x);
  t.save(x.n * x.p * R * x.e);           // q|k|v heads
  t.save(x.n * x.p * W * x.e);           // out
  t.save(x.b * heads * x.s_loc * 4);     // lse
  t.acquire(x.n * x.p * R * x.e);
  ring_column_forward(t, x, R);
  stream(t, x, x.n * x.p * R);           // unpack into heads
  t.give_back(x.n * x.p * R * x.e);
  ring_attention_forward(t, x, heads, kv_heads);
  gathered_row_forward(t, x, W);
  block_forward_end(t, x);
}
inline void megatron_cz_attention_backward(Tally& t, const ScheduleDims& x) {
  const double R = x.qkv_loc, W = x.q_loc, heads = x.p * x.a_loc, kv_heads = x.p * x.akv_loc;
  block_backward_begin(t, x);
  t.acquire(x.n * x.p * R * x.e);        // dpacked
  t.acquire(x.n * x.p * R * x.e);        // dheads, zeroed
  stream(t, x, x.n * x.p * R);
  t.acquire(x.n * x.p * W * x.e);        // dout
  gathered_row_backward(t, x, W);
  ring_attention_backward(t, x, heads, kv_heads);
  t.give_back(x.n * x.p * W * x.e);
  stream(t, x, x.n * x.p * R);           // pack the gradients
  t.give_back(x.n * x.p * R * x.e);
  ring_column_backward(t, x, R);
  t.give_back(x.n * x.p * R * x.e);
  t.release(x.n * x.p * (R + W) * x.e);
  t.release(x.b * heads * x.s_loc * 4);
  t.release(x.n * x.h * x.e);
  norm_backward(t, x);
}

// ---- UlyssesZ attention (strategy/ulysses_z.hpp) -------------------------------------------------------------------

inline void ulysses_z_attention_forward(Tally& t, const ScheduleDims& x) {
  const double R = x.qkv_loc, W = x.q_loc;
  norm_forward(t, x);
  keep_input_copy(t, x);
  t.save(x.N * R * x.e);
  t.save(x.N * W * x.e);
  t.save(x.b * x.a_loc * x.s * 4);
  t.save(x.p * x.n * W * x.e);           // the projection input, per head group
  t.acquire(x.p * x.n * R * x.e);
  ring_column_forward(t, x, R);
  all_to_all_sequence(t, x, R);
  t.give_back(x.p * x.n * R * x.e);
  t.alloc(attention_scratch(x.s, false, x.d));
  t.compute(t.attention_forward_s(x.attention_flops(x.a_loc, 1)));
  t.free(attention_scratch(x.s, false, x.d));
  all_to_all_sequence(t, x, W);
  gathered_row_forward(t, x, W);
  block_forward_end(t, x);
}
inline void ulysses_z_attention_backward(Tally& t, const ScheduleDims& x) {
  const double R = x.qkv_loc, W = x.q_loc;
  block_backward_begin(t, x);
  t.acquire(x.N * R * x.e);              // dqkv, zeroed
  stream(t, x, x.N * R);
  t.acquire(x.N * W * x.e);              // dout
  t.acquire(x.p * x.n * W * x.e);        // da
  gathered_row_backward(t, x, W);
  all_to_all_sequence(t, x, W);
  t.give_back(x.p * x.n * W * x.e);
  t.alloc(attention_scratch(x.s, true, x.d));
  t.compute(t.attention_backward_s(x.attention_flops(x.a_loc, 1)));
  t.free(attention_scratch(x.s, true, x.d));
  t.give_back(x.N * W * x.e);
  t.acquire(x.p * x.n * R * x.e);        // dsend
  all_to_all_sequence(t, x, R);
  t.give_back(x.N * R * x.e);
  ring_column_backward(t, x, R);
  t.give_back(x.p * x.n * R * x.e);
  t.release(x.N * (R + W) * x.e + x.p * x.n * W * x.e);
  t.release(x.b * x.a_loc * x.s * 4);
  t.release(x.n * x.h * x.e);
  norm_backward(t, x);
}

// ---- ColossalZ attention: Ring Self-Attention (from the digest; to be aligned with its code) ------------------------

// Scores of the local queries against every key are materialised (b a s/p s); K, then V travel the ring.
inline void colossal_z_attention_forward(Tally& t, const ScheduleDims& x) {
  const double scores = x.b * x.a * x.s_loc * x.s * x.e;
  const double block = x.n * x.kv * x.e;
  const double score_block = t.gemm_s(x.b * x.a * x.s_loc, x.s_loc, x.d, int(x.e));
  norm_forward(t, x);
  keep_input_copy(t, x);
  t.save(x.n * x.qkv * x.e);
  t.acquire(x.n * x.qkv * x.e);
  ring_column_forward(t, x, x.qkv_loc);
  t.give_back(x.n * x.qkv * x.e);
  t.acquire(block);
  t.acquire(block);
  t.save(scores);
  t.ring(int(x.p), score_block, t.collective_s(Collective::send_recv, block));
  t.compute(t.elementwise_s(4 * scores));  // softmax: max, exp-sum, normalise
  t.save(x.n * x.q * x.e);
  t.ring(int(x.p), score_block, t.collective_s(Collective::send_recv, block));
  t.give_back(block);
  t.give_back(block);
  gathered_row_forward(t, x, x.q_loc);
  block_forward_end(t, x);
}
inline void colossal_z_attention_backward(Tally& t, const ScheduleDims& x) {
  const double scores = x.b * x.a * x.s_loc * x.s * x.e;
  const double block = x.n * x.kv * x.e;
  const double score_block = t.gemm_s(x.b * x.a * x.s_loc, x.s_loc, x.d, int(x.e));
  block_backward_begin(t, x);
  t.acquire(x.n * x.q * x.e);
  gathered_row_backward(t, x, x.q_loc);
  t.acquire(scores);
  for (int i = 0; i < 4; ++i) t.acquire(block);
  t.ring(int(x.p), 2 * score_block, 2 * t.collective_s(Collective::send_recv, block), true);
  t.compute(t.elementwise_s(3 * scores));
  t.give_back(x.n * x.q * x.e);
  t.release(scores + x.n * x.q * x.e);
  t.acquire(x.n * x.qkv * x.e);
  t.ring(int(x.p), 2 * score_block, 2 * t.collective_s(Collective::send_recv, block), true);
  t.give_back(scores);
  for (int i = 0; i < 4; ++i) t.give_back(block);
  ring_column_backward(t, x, x.qkv_loc);
  t.give_back(x.n * x.qkv * x.e);
  t.release(x.n * x.qkv * x.e);
  t.release(x.n * x.h * x.e);
  norm_backward(t, x);
}

// ---- METP (from the digest; to be aligned with its code) -----------------------------------------------------------

// Attention: an outer loop over the p weight shards, each broadcast by its owner (prefetched, double-buffered); for
// shard i, qkv_i for the local tokens (heads of rank i), an inner ring attention over sequence shards, and
// O += A_i W_proj_i. Keeps X and every A_i; backward recomputes qkv_i and reduces dW_i to its owner.
inline void metp_attention_forward(Tally& t, const ScheduleDims& x) {
  const double shard = (x.qkv_loc + x.q_loc) * x.h * x.e;
  const double kv_block = 2 * x.n * x.kv_loc * x.e;
  const double step_buffers = x.n * x.qkv_loc * x.e + 2 * kv_block + x.n * x.q_loc * 4 + x.b * x.a_loc * x.s_loc * 4;
  norm_forward(t, x);
  keep_input_copy(t, x);
  t.acquire(2 * shard);
  t.acquire(step_buffers);
  const double inner = t.ring_s(int(x.p), t.attention_forward_s(x.attention_flops(x.a_loc, 1 / (x.p * x.p))),
                                t.collective_s(Collective::send_recv, kv_block));
  const double step = t.gemm_s(x.n, x.qkv_loc, x.h, int(x.e)) + inner + t.gemm_s(x.n, x.h, x.q_loc, int(x.e));
  for (int i = 0; i < int(x.p); ++i) {
    t.save(x.n * x.q_loc * x.e + x.b * x.a_loc * x.s_loc * 4);
    if (i + 1 < int(x.p)) t.overlapped(step, t.collective_s(Collective::broadcast, shard));
    else t.compute(step);
  }
  t.give_back(step_buffers);
  t.give_back(2 * shard);
  block_forward_end(t, x);
}
inline void metp_attention_backward(Tally& t, const ScheduleDims& x) {
  const double shard = (x.qkv_loc + x.q_loc) * x.h * x.e;
  const double kv_block = 2 * x.n * x.kv_loc * x.e;
  const double step_buffers = 2 * x.n * x.qkv_loc * x.e + x.n * x.q_loc * x.e + 4 * kv_block;
  block_backward_begin(t, x);
  t.acquire(4 * shard);  // weight and dW double buffers
  t.acquire(step_buffers);
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
  t.give_back(step_buffers);
  t.give_back(4 * shard);
  t.release(x.n * x.h * x.e);
  norm_backward(t, x);
}

// MLP: the packed shard [W_in_j ; W_out_j] travels the ring; each step adds act(X W_in_j) W_out_j to the output.
// Keeps only X: backward recomputes each step's intermediate while (w, dw) travel together.
inline void metp_mlp_forward(Tally& t, const ScheduleDims& x) {
  const double shard = (x.g + 1) * x.f_loc * x.h * x.e;
  const double step_buffers = x.n * (x.g + 1) * x.f_loc * x.e;
  norm_forward(t, x);
  keep_input_copy(t, x);
  t.acquire(2 * shard);
  t.acquire(step_buffers);
  const double step = t.gemm_s(x.n, x.g * x.f_loc, x.h, int(x.e)) + t.elementwise_s(x.n * (x.g + 1) * x.f_loc * x.e) +
                      t.gemm_s(x.n, x.h, x.f_loc, int(x.e));
  t.ring(int(x.p), step, t.collective_s(Collective::send_recv, shard));
  t.give_back(step_buffers);
  t.give_back(2 * shard);
  block_forward_end(t, x);
}
inline void metp_mlp_backward(Tally& t, const ScheduleDims& x) {
  const double shard = (x.g + 1) * x.f_loc * x.h * x.e;
  const double step_buffers = 2 * x.n * (x.g + 1) * x.f_loc * x.e;
  block_backward_begin(t, x);
  t.acquire(4 * shard);
  t.acquire(step_buffers);
  const double step = t.gemm_s(x.n, x.g * x.f_loc, x.h, int(x.e)) + t.gemm_s(x.n, x.f_loc, x.h, int(x.e)) +
                      t.gemm_s(x.f_loc, x.h, x.n, int(x.e)) + t.gemm_s(x.n, x.h, x.g * x.f_loc, int(x.e)) +
                      t.gemm_s(x.g * x.f_loc, x.h, x.n, int(x.e)) +
                      t.elementwise_s(2 * x.n * (x.g + 2) * x.f_loc * x.e);
  t.ring(int(x.p), step, t.collective_s(Collective::send_recv, 2 * shard), true);
  t.give_back(step_buffers);
  t.give_back(4 * shard);
  t.release(x.n * x.h * x.e);
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
// `record_events` keeps the memory events for ordered replays (cost/memory_model.hpp).
inline SublayerCost evaluate_sublayer(Strategy s, Sublayer part, const ModelShape& m, int p,
                                      const HardwareProfile* hardware, bool record_events = false) {
  validate(m, p);
  const ScheduleDims dims(m, p);
  Tally t(hardware, p, m.recompute, record_events);
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
