// paradyse/cost/schedules.hpp: what each strategy does on one rank, per sublayer, as a schedule over a Tally.
//
// One function per (strategy, sublayer), forward then backward, written after the strategy's code in
// include/paradyse/strategy/: the tensors it keeps for backward (its Saved struct), the pooled buffers it acquires
// and when it gives them back, its GEMMs, attention calls, copies and collectives, and which transfers overlap which
// compute. Memory is that of the rank holding the most tokens (uneven shards: ceil(s/p)). Sizes in elements are
// turned into bytes with the activation dtype; log-sum-exp and norm statistics are float32.
//
// Around the strategies, the pre-norm layer of model/layer.hpp: forward keeps the layer input x, the post-attention
// residual y and four statistics per token, and normalises into a pooled buffer for each sublayer; backward holds
// the layer's residual gradient and one pooled normalised-input gradient per sublayer. A layer's saved tensors are
// freed when its whole backward is done (model/stack.hpp): releases are marked so that ordered replays
// (cost/memory_model.hpp) can defer them.
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
  bool kv_replicated;            // fewer kv heads than ranks: each rank holds a replica, gradients summed
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
    kv_replicated = m.kv_heads % group != 0;
  }

  // Forward attention flops for `heads` heads over a share `fraction` of all query-key pairs.
  double attention_flops(double heads, double fraction) const { return 4 * d * heads * b * pairs * fraction; }
};

namespace schedule {

// ---- pieces shared by several strategies ---------------------------------------------------------------------------

// A kernel that reads and writes `elements` elements once each (copies, zero fills, adds, activations).
inline void stream(Tally& t, const ScheduleDims& x, double elements) { t.compute(t.elementwise_s(2 * elements * x.e)); }

// The pre-norm layer around the strategies (model/layer.hpp). Forward of attention: keep x (a copy), y and the
// four statistics; normalise into a pooled buffer; the strategy writes y; y += x. Forward of the MLP: normalise y
// into a pooled buffer; the strategy writes the layer output z; z += y.
inline void layer_forward_begin(Tally& t, const ScheduleDims& x, Sublayer part) {
  if (part == Sublayer::attention) {
    t.save_input(x.n * x.h * x.e);  // x
    t.save_input(x.n * x.h * x.e);  // y
    t.save_input(4 * x.n * 4);      // statistics
    stream(t, x, x.n * x.h);        // the copy of x
  }
  t.acquire(x.n * x.h * x.e);
  stream(t, x, x.n * x.h);          // the norm
}
inline void layer_forward_end(Tally& t, const ScheduleDims& x) {
  t.give_back(x.n * x.h * x.e);
  stream(t, x, 1.5 * x.n * x.h);    // the residual add
}
// Backward of the MLP (first): the layer's residual gradient dy = dz, then a pooled gradient of the normalised input.
// Backward of attention: dx = dy, a pooled gradient of the normalised input; at the end the layer's dy goes back and
// its saved tensors are freed.
inline void layer_backward_begin(Tally& t, const ScheduleDims& x, Sublayer part) {
  if (part == Sublayer::mlp) t.acquire(x.n * x.h * x.e), stream(t, x, x.n * x.h);
  else stream(t, x, x.n * x.h);
  t.acquire(x.n * x.h * x.e);
}
inline void layer_backward_end(Tally& t, const ScheduleDims& x, Sublayer part) {
  stream(t, x, 2 * x.n * x.h);      // the norm's backward
  t.give_back(x.n * x.h * x.e);
  if (part == Sublayer::attention) {
    t.give_back(x.n * x.h * x.e);   // the layer's dy
    t.release(x.n * x.h * x.e);
    t.release(x.n * x.h * x.e);
    t.release(4 * x.n * 4);
  }
}

// The MLP activation over `tokens` tokens and `width` ffn columns: forward reads g inputs and writes one output per
// column; backward (dpre from dact at pre) costs about twice that.
inline void activation(Tally& t, const ScheduleDims& x, double tokens, double width, bool backward) {
  const double elements = tokens * width * (backward ? 2 : 1);
  t.compute(t.activation_s(elements, elements * (x.g + 1) * x.e));
}

// The W_qkv^T gradient of replicated kv heads (strategy/policy.hpp QkvGradient): a zeroed scratch shard, then an
// all-reduce of every kv head's k and v rows over the group.
inline void qkv_gradient_begin(Tally& t, const ScheduleDims& x) {
  if (x.kv_replicated) t.acquire(x.qkv_loc * x.h * x.e), stream(t, x, x.qkv_loc * x.h);
}
inline void qkv_gradient_end(Tally& t, const ScheduleDims& x) {
  if (!x.kv_replicated) return;
  const double all = x.a_kv * 2 * x.d * x.h * x.e;
  t.acquire(all);
  t.communicate(t.collective_s(Collective::all_reduce, all));
  t.give_back(all);
  t.give_back(x.qkv_loc * x.h * x.e);
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
}
inline void megatron_ts_attention_backward(Tally& t, const ScheduleDims& x) {
  const double R = x.qkv_loc, W = x.q_loc;
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
  qkv_gradient_begin(t, x);
  t.compute(t.gemm_s(R, x.h, x.N, int(x.e)) + t.gemm_s(x.N, x.h, R, int(x.e)));
  reduce_scatter_sequence(t, x, x.h, true);
  qkv_gradient_end(t, x);
  t.give_back(x.N * x.h * x.e);
  t.give_back(x.N * R * x.e);
  t.release(x.N * R * x.e + x.N * W * x.e);
  t.release(x.b * x.a_loc * x.s * 4);
  t.release(x.n * x.h * x.e);
}

inline void megatron_ts_mlp_forward(Tally& t, const ScheduleDims& x) {
  const double Fin = x.g * x.f_loc, F = x.f_loc;
  keep_input_copy(t, x);
  t.save(x.N * Fin * x.e);
  t.acquire(x.N * x.h * x.e);
  gather_sequence(t, x, x.h, false);
  t.compute(t.gemm_s(x.N, Fin, x.h, int(x.e)));
  t.acquire(x.N * F * x.e);
  activation(t, x, x.N, F, false);
  t.compute(t.gemm_s(x.N, x.h, F, int(x.e)));
  reduce_scatter_sequence(t, x, x.h, false);
  t.give_back(x.N * F * x.e);
  t.give_back(x.N * x.h * x.e);
}
inline void megatron_ts_mlp_backward(Tally& t, const ScheduleDims& x) {
  const double Fin = x.g * x.f_loc, F = x.f_loc;
  t.acquire(x.N * Fin * x.e);
  t.acquire(x.N * x.h * x.e);
  gather_sequence(t, x, x.h, false);
  t.acquire(x.N * F * x.e);
  activation(t, x, x.N, F, false);  // recomputed
  t.compute(t.gemm_s(F, x.h, x.N, int(x.e)) + t.gemm_s(x.N, F, x.h, int(x.e)));
  stream(t, x, x.N * Fin / 2);      // zero dpre
  activation(t, x, x.N, F, true);
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
}

// ---- the ZeRO-3 MLP of MegatronCZ, UlyssesZ and ColossalZ (strategy/zero3_mlp.hpp) ---------------------------------

inline void zero3_mlp_forward(Tally& t, const ScheduleDims& x) {
  const double Fin = x.g * x.f_loc, F = x.f_loc;
  keep_input_copy(t, x);
  t.save(x.n * x.p * Fin * x.e);
  ring_column_forward(t, x, Fin);
  t.acquire(x.n * x.p * F * x.e);
  activation(t, x, x.n, x.p * F, false);
  gathered_row_forward(t, x, F);
  t.give_back(x.n * x.p * F * x.e);
}
inline void zero3_mlp_backward(Tally& t, const ScheduleDims& x) {
  const double Fin = x.g * x.f_loc, F = x.f_loc;
  t.acquire(x.n * x.p * Fin * x.e);
  t.acquire(x.n * x.p * F * x.e);
  t.acquire(x.n * x.p * F * x.e);
  activation(t, x, x.n, x.p * F, false);  // recomputed
  gathered_row_backward(t, x, F);
  stream(t, x, x.n * x.p * Fin / 2);      // zero dpre
  activation(t, x, x.n, x.p * F, true);
  t.give_back(x.n * x.p * F * x.e);
  t.give_back(x.n * x.p * F * x.e);
  ring_column_backward(t, x, Fin);
  t.give_back(x.n * x.p * Fin * x.e);
  t.release(x.n * x.p * Fin * x.e);
  t.release(x.n * x.h * x.e);
}

// ---- MegatronCZ attention (strategy/megatron_cz.hpp) ---------------------------------------------------------------

inline void megatron_cz_attention_forward(Tally& t, const ScheduleDims& x) {
  const double R = x.qkv_loc, W = x.q_loc, heads = x.p * x.a_loc, kv_heads = x.p * x.akv_loc;
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
}
inline void megatron_cz_attention_backward(Tally& t, const ScheduleDims& x) {
  const double R = x.qkv_loc, W = x.q_loc, heads = x.p * x.a_loc, kv_heads = x.p * x.akv_loc;
  t.acquire(x.n * x.p * R * x.e);        // dpacked
  t.acquire(x.n * x.p * R * x.e);        // dheads, zeroed
  stream(t, x, x.n * x.p * R);
  t.acquire(x.n * x.p * W * x.e);        // dout
  gathered_row_backward(t, x, W);
  ring_attention_backward(t, x, heads, kv_heads);
  t.give_back(x.n * x.p * W * x.e);
  stream(t, x, x.n * x.p * R);           // pack the gradients
  t.give_back(x.n * x.p * R * x.e);
  qkv_gradient_begin(t, x);
  ring_column_backward(t, x, R);
  qkv_gradient_end(t, x);
  t.give_back(x.n * x.p * R * x.e);
  t.release(x.n * x.p * (R + W) * x.e);
  t.release(x.b * heads * x.s_loc * 4);
  t.release(x.n * x.h * x.e);
}

// ---- UlyssesZ attention (strategy/ulysses_z.hpp) -------------------------------------------------------------------

inline void ulysses_z_attention_forward(Tally& t, const ScheduleDims& x) {
  const double R = x.qkv_loc, W = x.q_loc;
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
}
inline void ulysses_z_attention_backward(Tally& t, const ScheduleDims& x) {
  const double R = x.qkv_loc, W = x.q_loc;
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
  qkv_gradient_begin(t, x);
  ring_column_backward(t, x, R);
  qkv_gradient_end(t, x);
  t.give_back(x.p * x.n * R * x.e);
  t.release(x.N * (R + W) * x.e + x.p * x.n * W * x.e);
  t.release(x.b * x.a_loc * x.s * 4);
  t.release(x.n * x.h * x.e);
}

// ---- ColossalZ attention: ring self-attention (strategy/colossal_z.hpp) ---------------------------------------------

// q|k|v as MegatronCZ; K blocks travel and fill the score rows [b, hq, n_r, s] (saved: the probabilities), softmax,
// V blocks travel for out = P V. Per (batch, head) one small GEMM per block.
inline void colossal_z_attention_forward(Tally& t, const ScheduleDims& x) {
  const double R = x.qkv_loc, W = x.q_loc, heads = x.p * x.a_loc, kv_heads = x.p * x.akv_loc;
  const double probs = x.b * heads * x.s_loc * x.s * 4;
  const double block = x.b * x.s_loc * kv_heads * x.d * x.e;
  const double calls = x.b * heads;
  keep_input_copy(t, x);
  t.save(x.n * x.p * R * x.e);
  t.save(probs);
  t.save(x.n * x.p * W * x.e);
  t.acquire(x.n * x.p * R * x.e);
  ring_column_forward(t, x, R);
  stream(t, x, x.n * x.p * R);
  t.give_back(x.n * x.p * R * x.e);
  for (int pass = 0; pass < 2; ++pass) {  // K, then V
    t.acquire(block);
    t.acquire(x.p > 1 ? block : 0);
    stream(t, x, block / x.e);
    const double gemms = calls * (pass == 0 ? t.gemm_s(x.s_loc, x.s_loc, x.d, int(x.e)) : t.gemm_s(x.s_loc, x.d, x.s_loc, int(x.e)));
    t.ring(int(x.p), gemms, t.collective_s(Collective::send_recv, block));
    t.give_back(block);
    t.give_back(x.p > 1 ? block : 0);
    if (pass == 0) t.compute(t.activation_s(probs / 4, 3 * probs));  // softmax rows: an exponential each
  }
  gathered_row_forward(t, x, W);
}
inline void colossal_z_attention_backward(Tally& t, const ScheduleDims& x) {
  const double R = x.qkv_loc, W = x.q_loc, heads = x.p * x.a_loc, kv_heads = x.p * x.akv_loc;
  const double probs = x.b * heads * x.s_loc * x.s * 4;
  const double block = x.b * x.s_loc * kv_heads * x.d * x.e;
  const double calls = x.b * heads;
  t.acquire(x.n * x.p * R * x.e);        // dpacked
  t.acquire(x.n * x.p * R * x.e);        // dheads, zeroed
  stream(t, x, x.n * x.p * R);
  t.acquire(x.n * x.p * W * x.e);        // dout
  gathered_row_backward(t, x, W);
  t.acquire(probs);                      // dP, then dS in place
  for (int pass = 0; pass < 2; ++pass) {  // (V, dV), then (K, dK)
    const int buffers = x.p > 1 ? 5 : 2;
    for (int i = 0; i < buffers; ++i) t.acquire(block);
    stream(t, x, block / x.e);
    const double gemms = calls * (t.gemm_s(x.s_loc, x.s_loc, x.d, int(x.e)) + t.gemm_s(x.s_loc, x.d, x.s_loc, int(x.e)));
    t.ring(int(x.p), gemms + t.elementwise_s(block), 2 * t.collective_s(Collective::send_recv, block), true);
    stream(t, x, block / x.e);           // the sum comes home
    for (int i = 0; i < buffers; ++i) t.give_back(block);
    if (pass == 0) t.compute(t.activation_s(probs / 4, 4 * probs));  // softmax backward
  }
  t.give_back(probs);
  t.give_back(x.n * x.p * W * x.e);
  stream(t, x, x.n * x.p * R);           // pack the gradients
  t.give_back(x.n * x.p * R * x.e);
  qkv_gradient_begin(t, x);
  ring_column_backward(t, x, R);
  qkv_gradient_end(t, x);
  t.give_back(x.n * x.p * R * x.e);
  t.release(x.n * x.h * x.e);
  t.release(x.n * x.p * R * x.e);
  t.release(probs);
  t.release(x.n * x.p * W * x.e);
}

// ---- METP (strategy/metp.hpp) --------------------------------------------------------------------------------------

// Attention: the packed shards [W_qkv^T_i; W_proj_i] are broadcast one at a time (double-buffered); for head group
// i, q|k|v of the rank's tokens, ring attention over the sequence shards, y += a_i W_proj_i. Saved: x, every head
// group's output and lse.
inline void metp_attention_forward(Tally& t, const ScheduleDims& x) {
  const double R = x.qkv_loc, W = x.q_loc, A = (R + W) * x.h * x.e;
  keep_input_copy(t, x);
  t.save(x.n * x.p * W * x.e);
  t.save(x.p * x.b * x.a_loc * x.s_loc * 4);
  t.acquire(A);
  t.acquire(A);
  stream(t, x, A / x.e / 2);             // the owner's own shard into its buffer
  for (int i = 0; i < int(x.p); ++i) {
    if (i + 1 < int(x.p)) t.communicate(t.collective_s(Collective::broadcast, A));
    t.acquire(x.n * R * x.e);            // heads
    t.acquire(x.n * R * x.e);            // packed
    t.compute(t.gemm_s(x.n, R, x.h, int(x.e)));
    stream(t, x, x.n * R);
    t.give_back(x.n * R * x.e);
    ring_attention_forward(t, x, x.a_loc, x.akv_loc);
    t.give_back(x.n * R * x.e);
    t.compute(t.gemm_s(x.n, x.h, W, int(x.e)));
  }
  t.give_back(A);
  t.give_back(A);
}
inline void metp_attention_backward(Tally& t, const ScheduleDims& x) {
  const double R = x.qkv_loc, W = x.q_loc, A = (R + W) * x.h * x.e;
  qkv_gradient_begin(t, x);
  for (int i = 0; i < 5; ++i) t.acquire(A);  // two partial gradients, the received sum, two shard buffers
  stream(t, x, A / x.e / 2);
  for (int i = 0; i < int(x.p); ++i) {
    if (i + 1 < int(x.p)) t.communicate(t.collective_s(Collective::broadcast, A));
    t.acquire(x.n * R * x.e);            // dpacked
    t.acquire(x.n * R * x.e);            // dheads, zeroed
    stream(t, x, x.n * R);
    t.acquire(x.n * R * x.e);            // heads, recomputed
    t.acquire(x.n * R * x.e);            // packed
    t.compute(t.gemm_s(x.n, R, x.h, int(x.e)));
    stream(t, x, x.n * R);
    t.give_back(x.n * R * x.e);
    t.acquire(x.n * W * x.e);            // dout
    t.compute(t.gemm_s(x.n, W, x.h, int(x.e)) + t.gemm_s(W, x.h, x.n, int(x.e)));
    ring_attention_backward(t, x, x.a_loc, x.akv_loc);
    t.give_back(x.n * W * x.e);
    t.give_back(x.n * R * x.e);
    stream(t, x, x.n * R);               // pack the gradients
    t.give_back(x.n * R * x.e);
    t.compute(t.gemm_s(x.n, x.h, R, int(x.e)) + t.gemm_s(R, x.h, x.n, int(x.e)));
    t.communicate(t.collective_s(Collective::reduce, A));  // head group i's gradient to its owner
    t.give_back(x.n * R * x.e);
  }
  stream(t, x, A / x.e);                 // the own gradient added in
  qkv_gradient_end(t, x);
  for (int i = 0; i < 5; ++i) t.give_back(A);
  t.release(x.n * x.h * x.e);
  t.release(x.n * x.p * W * x.e);
  t.release(x.p * x.b * x.a_loc * x.s_loc * 4);
}

// MLP: the packed shards [W_in^T_j; W_out_j] rotate (strategy/ring_schedule.hpp); every step adds
// act(x W_in^T_j) W_out_j. Keeps only x (copied at the end of forward).
inline void metp_mlp_forward(Tally& t, const ScheduleDims& x) {
  const double Fin = x.g * x.f_loc, F = x.f_loc, shard = (Fin + F) * x.h * x.e;
  t.acquire(x.n * Fin * x.e);
  t.acquire(x.n * F * x.e);
  t.acquire(shard);
  t.acquire(x.p > 1 ? shard : 0);
  stream(t, x, shard / x.e);
  const double step = t.gemm_s(x.n, Fin, x.h, int(x.e)) + t.activation_s(x.n * F, x.n * (Fin + F) * x.e) +
                      t.gemm_s(x.n, x.h, F, int(x.e));
  t.ring(int(x.p), step, t.collective_s(Collective::send_recv, shard));
  t.give_back(shard);
  t.give_back(x.p > 1 ? shard : 0);
  t.give_back(x.n * F * x.e);
  t.give_back(x.n * Fin * x.e);
  keep_input_copy(t, x);
}
inline void metp_mlp_backward(Tally& t, const ScheduleDims& x) {
  const double Fin = x.g * x.f_loc, F = x.f_loc, shard = (Fin + F) * x.h * x.e;
  t.acquire(x.n * Fin * x.e);
  t.acquire(x.n * F * x.e);
  t.acquire(x.n * F * x.e);
  t.acquire(x.n * Fin * x.e);
  const int buffers = x.p > 1 ? 5 : 2;
  for (int i = 0; i < buffers; ++i) t.acquire(shard);
  stream(t, x, shard / x.e);
  const double step = t.gemm_s(x.n, Fin, x.h, int(x.e)) + t.gemm_s(x.n, F, x.h, int(x.e)) +
                      t.gemm_s(F, x.h, x.n, int(x.e)) + t.gemm_s(x.n, x.h, Fin, int(x.e)) +
                      t.gemm_s(Fin, x.h, x.n, int(x.e)) + t.activation_s(3 * x.n * F, 3 * x.n * (Fin + F) * x.e) +
                      t.elementwise_s(x.n * Fin * x.e + shard);
  t.ring(int(x.p), step, 2 * t.collective_s(Collective::send_recv, shard), /*final_hop=*/true);
  stream(t, x, shard / x.e);             // the gradient comes home
  for (int i = 0; i < buffers; ++i) t.give_back(shard);
  t.give_back(x.n * Fin * x.e);
  t.give_back(x.n * F * x.e);
  t.give_back(x.n * F * x.e);
  t.give_back(x.n * Fin * x.e);
  t.release(x.n * x.h * x.e);
}

// ---- dispatch ----------------------------------------------------------------------------------------------------

inline void strategy_forward(Strategy s, Sublayer part, Tally& t, const ScheduleDims& x) {
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

inline void strategy_backward(Strategy s, Sublayer part, Tally& t, const ScheduleDims& x) {
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

// A sublayer inside its layer: the layer's norm and residual around the strategy.
inline void forward(Strategy s, Sublayer part, Tally& t, const ScheduleDims& x) {
  layer_forward_begin(t, x, part);
  strategy_forward(s, part, t, x);
  layer_forward_end(t, x);
}
inline void backward(Strategy s, Sublayer part, Tally& t, const ScheduleDims& x) {
  layer_backward_begin(t, x, part);
  strategy_backward(s, part, t, x);
  layer_backward_end(t, x, part);
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
