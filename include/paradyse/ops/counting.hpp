// paradyse/ops/counting.hpp: ops::Counting, a backend that computes nothing and records every call with its shape.
//
// It has the members of ops/op_table.inc, as ops::Cpu, each forwarded to a counting rule below. Run over meta
// tensors (core/memory.hpp) it lets a strategy's real forward and backward execute on shapes alone: each kernel
// becomes one TraceEvent of the calling thread's Trace (core/trace.hpp) (GEMM m, n, k; attention visible query-key
// pairs, the pairs of the CPU kernel's whole tiles, heads and head dim; bytes moved by memory-bound kernels), and the
// scratch memory the CPU kernels would allocate (attention tiles, RoPE angles, the fallback GEMM's panels) is
// allocated and freed on the current tracker in the same order, so the dry run's memory trace is the real run's.
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/core/trace.hpp"
#include "paradyse/ops/attention_mask.hpp"
#include "paradyse/ops/cpu/adamw.hpp"
#include "paradyse/ops/cpu/attention.hpp"
#include "paradyse/ops/cpu/convert.hpp"
#include "paradyse/ops/cpu/cross_entropy.hpp"
#include "paradyse/ops/cpu/gemm.hpp"
#include "paradyse/ops/cpu/gemm_batched.hpp"
#include "paradyse/ops/cpu/moe_ops.hpp"
#include "paradyse/ops/cpu/rope.hpp"
#include "paradyse/ops/cpu/softmax.hpp"

#include <algorithm>
#include <utility>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

namespace paradyse::ops {

// Query-key pairs that `mask` leaves visible between q_len queries and kv_len keys (one batch entry, one head).
inline double visible_pairs(const AttentionMask& mask, std::int64_t q_len, std::int64_t kv_len) {
  if (!mask.document_starts.empty()) {
    double pairs = 0;
    for (std::int64_t i = 0; i < q_len; ++i) {
      const KeyRange r = visible_key_range(mask, i, kv_len);
      pairs += double(r.last - r.first);
    }
    return pairs;
  }
  if (!mask.causal) return double(q_len) * double(kv_len);
  // Query i sees clamp(a + i, 0, kv_len) keys, a = q_offset - kv_offset + 1: a ramp, then full rows.
  const double a = double(mask.q_offset - mask.kv_offset + 1), sq = double(q_len), sk = double(kv_len);
  const double ramp_begin = std::clamp(1 - a, 0.0, sq), ramp_end = std::clamp(sk - a, ramp_begin, sq);
  const double ramp = (ramp_end - ramp_begin) * ((a + ramp_begin) + (a + ramp_end - 1)) / 2;
  return ramp + (sq - ramp_end) * sk;
}

// Scores of one [n, c] block of a masked softmax (ops/cpu/softmax.hpp) that its kernel exponentiates: every score
// without causal, else the (row, column) pairs whose key position is at or before the query position (the kernel
// writes 0 for the others without an exp). Rows and columns by their runs of positions, in closed form per pair of
// runs: queries at [a, a + L) against keys at [b, b + M) see sum over q of clamp(q - b + 1, 0, M) of them.
inline double softmax_visible_scores(std::span<const PositionRun> query_runs, std::span<const PositionRun> key_runs,
                                     bool causal) {
  double rows = 0, columns = 0, visible = 0;
  for (const PositionRun& q : query_runs) rows += double(q.length);
  for (const PositionRun& k : key_runs) columns += double(k.length);
  if (!causal) return rows * columns;
  for (const PositionRun& q : query_runs)
    for (const PositionRun& k : key_runs) {
      // F(T) = sum of min(t, M) for t = 1..T (0 for T <= 0): the keys seen by queries up to T - 1 past the run's first.
      const double m = double(k.length);
      const auto ramp = [m](double t) { return t <= 0 ? 0 : t <= m ? t * (t + 1) / 2 : m * (m + 1) / 2 + (t - m) * m; };
      const double a = double(q.position - k.position);
      visible += ramp(a + double(q.length)) - ramp(a);
    }
  return visible;
}

// Query-key pairs of the tiles that the CPU flash kernel (ops/cpu/attention.hpp) computes between q_len queries and
// kv_len keys (one batch entry, one head): it walks a grid of tiling.q_block x tiling.kv_block tiles (the last row and
// column of tiles cut at the lengths) and computes every tile holding at least one visible pair whole, its masked
// pairs included; it skips the others. A causal diagonal thus costs whole tiles, not the half-square of visible pairs.
// Each call counts its own grid, so the chunks of zigzag and ring layouts (one call per chunk pair, offsets in the
// mask) count as the kernel runs them.
// The sum over u in [0, n) of floor((a u + b) / m), for a, b >= 0 and m > 0, in O(log) steps (Euclid-like).
inline __int128 floor_sum(__int128 n, __int128 m, __int128 a, __int128 b) {
  __int128 sum = 0;
  while (n > 0) {
    if (a >= m) sum += n * (n - 1) / 2 * (a / m), a %= m;
    if (b >= m) sum += n * (b / m), b %= m;
    const __int128 y = a * n + b;
    if (y < m) break;
    n = y / m, b = y % m;
    std::swap(m, a);
  }
  return sum;
}

inline double tiled_pairs(const AttentionMask& mask, std::int64_t q_len, std::int64_t kv_len,
                          const cpu::AttentionTiling& tiling) {
  if (q_len <= 0 || kv_len <= 0) return 0;
  const std::int64_t qb = tiling.q_block, kb = tiling.kv_block;
  double pairs = 0;
  if (mask.document_starts.empty()) {
    // Every query's keys start at 0, so a query tile's visible keys are [0, its last row's end): that many key tiles,
    // whole (the last cut short at kv_len). Summed in closed form (lengths reach 10^12 tokens in the planner's sweeps).
    const auto extent = [&](std::int64_t row) {  // the keys a tile whose last row is `row` computes
      const std::int64_t last = visible_key_range(mask, row, kv_len).last;
      return std::min(kv_len, (last + kb - 1) / kb * kb);
    };
    const std::int64_t full = q_len / qb, rest = q_len - full * qb;
    __int128 sum = rest > 0 ? __int128(rest) * extent(q_len - 1) : 0;
    if (!mask.causal) return double(sum + __int128(full) * qb * extent(0));
    // Causal: full tile t's last row sees L_t = d + (t + 1) qb keys (d = q_offset - kv_offset): none while L_t <= 0,
    // whole key tiles ceil(L_t / kb) kb while that stays below kv_len (L_t <= top), kv_len after.
    const std::int64_t d = mask.q_offset - mask.kv_offset, top = (kv_len - 1) / kb * kb;
    const std::int64_t first = std::min(full, d >= 0 ? 0 : -d / qb);
    const std::int64_t capped = std::clamp<std::int64_t>(top - d >= 0 ? (top - d) / qb : 0, first, full);
    sum += __int128(qb) * kb *
           floor_sum(capped - first, kb, qb, __int128(d) + __int128(first + 1) * qb + kb - 1);
    sum += __int128(full - capped) * qb * kv_len;
    return double(sum);
  }
  // Documents: a query's keys are any interval. Per query tile, each row marks the key tiles it touches (a
  // difference array over the key tiles), and the marked tiles count whole.
  const std::int64_t kv_tiles = (kv_len + kb - 1) / kb;
  std::vector<std::int64_t> marks(std::size_t(kv_tiles) + 1);
  for (std::int64_t i0 = 0; i0 < q_len; i0 += qb) {
    const std::int64_t rows = std::min(qb, q_len - i0);
    std::fill(marks.begin(), marks.end(), 0);
    for (std::int64_t r = i0; r < i0 + rows; ++r) {
      const KeyRange keys = visible_key_range(mask, r, kv_len);
      if (keys.first >= keys.last) continue;
      ++marks[std::size_t(keys.first / kb)];
      --marks[std::size_t((keys.last - 1) / kb + 1)];
    }
    std::int64_t touching = 0;
    for (std::int64_t j = 0; j < kv_tiles; ++j)
      if ((touching += marks[std::size_t(j)]) > 0) pairs += double(rows) * double(std::min(kb, kv_len - j * kb));
  }
  return pairs;
}

// The counting rules: one function for each op of ops/op_table.inc, with its signature, recording what the op would
// do. ops::Counting forwards to them.
namespace counting {

// ---- recording ----
// A kernel's workspace of `bytes` (as the tracker counts them), allocated and freed within the call: one scratch
// event, and the meta tracker's peak sees it.
inline void scratch(std::size_t bytes) {
  if (bytes == 0) return;
  MemoryTracker& tracker = MemoryTracker::current();
  tracker.raise_peak_to(tracker.in_use() + bytes);
  if (Trace* trace = tracker.trace()) trace->record({.kind = TraceKind::scratch, .bytes = double(bytes)});
}
inline void record(const TraceEvent& event) {
  Trace* trace = Trace::current();
  check(trace != nullptr, "ops::Counting: no Trace is installed on this thread (use ScopedTrace)");
  trace->record(event);
}
// A memory-bound kernel that reads and writes `elements` float32 elements in all.
inline void stream(double elements) { record({.kind = TraceKind::elementwise, .bytes = 4 * elements}); }
inline void stream(std::int64_t elements) { stream(double(elements)); }
// `function`: 1 SwiGLU's forward, 0 the others (cost::HardwareProfile::activation_time prices each at its rate).
inline void activation(std::int64_t elements, int tensors, int function = 0) {
  record({.kind = TraceKind::activation, .bytes = 4.0 * double(elements) * tensors, .m = double(elements),
          .n = double(function)});
}
// `calls` scalar math-library calls of `function` (0 exp, 1 cos or sin: cost::ScalarFunction), made one at a time.
inline void scalar_calls(double calls, int function) {
  record({.kind = TraceKind::transcendental, .m = calls, .n = double(function)});
}
inline void rope(TensorView<const float> x) {
  scratch(cpu::detail::tracked(std::size_t(x.extent(3) / 2) * 2 * sizeof(float)));  // the CPU kernel's angle table
  stream(2 * x.numel());
  scalar_calls(double(x.extent(1)) * double(x.extent(3)), 1);  // a cos and a sin per (token, frequency)
}
inline void record_attention(TraceKind kind, TensorView<const float> q, TensorView<const float> k,
                             const AttentionMask& mask) {
  check(q.rank() == 4 && k.rank() == 4, "attention: q {} and k {} must be [b, s, heads, d]", q.shape(), k.shape());
  const double batch = double(q.extent(0));
  const double pairs = visible_pairs(mask, q.extent(1), k.extent(1)) * batch;
  const double tiled = tiled_pairs(mask, q.extent(1), k.extent(1), cpu::attention_tiling(q.extent(3))) * batch;
  record({.kind = kind, .m = pairs, .n = double(q.extent(2)), .k = double(q.extent(3)), .tiled = tiled});
}

// ---- data movement ----
inline void copy(TensorView<const float> from, TensorView<float> to) {
  check(from.shape() == to.shape(), "copy: source shape {} differs from destination shape {}", from.shape(),
        to.shape());
  stream(2 * from.numel());
}
inline void fill(TensorView<float> x, float) { stream(x.numel()); }
inline void add_into(TensorView<float> to, TensorView<const float> from) {
  check(to.shape() == from.shape(), "add_into: destination {} and source {} differ in shape", to.shape(),
        from.shape());
  stream(3 * to.numel());
}

// ---- GEMM ----
inline void gemm(Transpose, Transpose, std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const float*,
                 std::int64_t, const float*, std::int64_t, float, float*, std::int64_t) {
  if (const std::size_t floats = cpu::gemm_workspace_floats(m, n, k, alpha))
    scratch(cpu::detail::tracked(floats * sizeof(float)));
  record({.kind = TraceKind::gemm, .m = double(m), .n = double(n), .k = double(k)});
}
// count GEMMs of one size: one event with a count. The CPU op allocates and frees each item's workspace in turn,
// so one scratch event of that size gives the same peak.
inline void gemm_batched(Transpose, Transpose, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
                         std::span<const float* const> a, std::int64_t, std::span<const float* const> b,
                         std::int64_t, float, std::span<float* const> c, std::int64_t) {
  cpu::check_gemm_batch(a.size(), b.size(), c.size());
  if (a.empty()) return;
  if (const std::size_t floats = cpu::gemm_workspace_floats(m, n, k, alpha))
    scratch(cpu::detail::tracked(floats * sizeof(float)));
  record({.kind = TraceKind::gemm, .count = std::int32_t(a.size()), .m = double(m), .n = double(n), .k = double(k)});
}
inline void matmul(TensorView<const float> a, Transpose trans_a, TensorView<const float> b, Transpose trans_b,
                   TensorView<float> c, float alpha, float) {
  check(a.rank() == 2 && b.rank() == 2 && c.rank() == 2, "matmul: views must be 2-D; got a {}, b {}, c {}",
        a.shape(), b.shape(), c.shape());
  const std::int64_t m = trans_a == Transpose::yes ? a.extent(1) : a.extent(0);
  const std::int64_t k = trans_a == Transpose::yes ? a.extent(0) : a.extent(1);
  const std::int64_t kb = trans_b == Transpose::yes ? b.extent(1) : b.extent(0);
  const std::int64_t n = trans_b == Transpose::yes ? b.extent(0) : b.extent(1);
  check(k == kb && c.extent(0) == m && c.extent(1) == n, "matmul: op(a) [{}, {}], op(b) [{}, {}], c {}", m, k, kb, n,
        c.shape());
  gemm(trans_a, trans_b, m, n, k, alpha, nullptr, 0, nullptr, 0, 0.0f, nullptr, 0);
}

// ---- attention: q [b, sq, hq, d], k/v [b, sk, hkv, d] ----
inline void attention_forward(TensorView<const float> q, TensorView<const float> k, TensorView<const float>,
                              const AttentionMask& mask, TensorView<float>, TensorView<float>) {
  // the CPU kernel's workspace
  scratch(cpu::detail::forward_workspace_bytes(cpu::attention_tiling(q.extent(3)), q.extent(1), k.extent(1),
                                                 q.extent(3)));
  record_attention(TraceKind::attention_forward, q, k, mask);
}
inline void attention_backward(TensorView<const float> q, TensorView<const float> k, TensorView<const float>,
                               TensorView<const float>, TensorView<const float>, TensorView<const float>,
                               const AttentionMask& mask, TensorView<float>, TensorView<float>, TensorView<float>) {
  scratch(cpu::detail::backward_workspace_bytes(cpu::attention_tiling(q.extent(3)), q.extent(1), k.extent(1),
                                                  q.extent(3)));
  record_attention(TraceKind::attention_backward, q, k, mask);
}
inline void attention_merge(TensorView<float> out, TensorView<float> lse, TensorView<const float>,
                            TensorView<const float>) {
  stream(3 * double(out.numel() + lse.numel()));
}

// ---- normalisation ----
inline void layer_norm_forward(TensorView<const float> x, TensorView<const float>, TensorView<const float>, float,
                               TensorView<float>, TensorView<float>, TensorView<float>) {
  stream(2 * x.numel());
}
inline void layer_norm_backward(TensorView<const float> x, TensorView<const float>, TensorView<const float>,
                                TensorView<const float>, TensorView<const float>, TensorView<float>,
                                TensorView<float>, TensorView<float>) {
  stream(3 * x.numel());
}
inline void rms_norm_forward(TensorView<const float> x, TensorView<const float>, float, TensorView<float>,
                             TensorView<float>) {
  stream(2 * x.numel());
}
inline void rms_norm_backward(TensorView<const float> x, TensorView<const float>, TensorView<const float>,
                              TensorView<const float>, TensorView<float>, TensorView<float>) {
  stream(3 * x.numel());
}

// ---- activations: elements through the function, and the bytes moved ----
inline void gelu_forward(TensorView<const float> x, TensorView<float>) { activation(x.numel(), 2); }
inline void gelu_backward(TensorView<const float> x, TensorView<const float>, TensorView<float>) {
  activation(2 * x.numel(), 2);
}
inline void swiglu_forward(TensorView<const float>, TensorView<const float>, TensorView<float> y) {
  activation(y.numel(), 3, 1);
}
inline void swiglu_backward(TensorView<const float> gate, TensorView<const float>, TensorView<const float>,
                            TensorView<float>, TensorView<float>) {
  activation(2 * gate.numel(), 3);
}

// ---- rotary position embedding: x [b, s, heads, d] ----
inline void rope_forward(TensorView<const float> x, TensorView<float>, std::int64_t, const RopeConfig&,
                         std::span<const std::int64_t>) {
  rope(x);
}
inline void rope_backward(TensorView<const float> dy, TensorView<float>, std::int64_t, const RopeConfig&,
                          std::span<const std::int64_t>) {
  rope(dy);
}

// ---- embedding, loss, optimizer, conversion ----
inline void embedding_forward(TensorView<const std::int32_t>, TensorView<const float>, TensorView<float> out) {
  stream(2 * out.numel());
}
inline void embedding_backward(TensorView<const std::int32_t>, TensorView<const float> dout, TensorView<float>) {
  stream(3 * dout.numel());
}
inline cpu::CrossEntropyResult cross_entropy_forward_backward(TensorView<const float> logits,
                                                              TensorView<const std::int32_t>, TensorView<float>,
                                                              float, std::int32_t) {
  stream(3 * logits.numel());
  return {};
}
inline void adamw_step(TensorView<float> params, TensorView<const float>, TensorView<float>, TensorView<float>,
                       const AdamWConfig&, std::int64_t) {
  stream(7 * params.numel());
}
template <cpu::FloatingStorage From, cpu::FloatingStorage To>
inline void convert(TensorView<const From> from, TensorView<To>) {
  record({.kind = TraceKind::elementwise, .bytes = double(from.numel()) * double(sizeof(From) + sizeof(To))});
}

// ---- materialised softmax ----
inline void masked_softmax_forward(TensorView<float> scores, std::span<const PositionRun> query_runs,
                                   std::span<const PositionRun> key_runs, bool causal) {
  activation(scores.numel(), 2);
  check(scores.rank() >= 2, "masked_softmax_forward: scores {} must be [..., n, c]", scores.shape());
  const double block = double(scores.extent(-2)) * double(scores.extent(-1));  // [n, c]
  const double blocks = block > 0 ? double(scores.numel()) / block : 0;
  scalar_calls(blocks * softmax_visible_scores(query_runs, key_runs, causal), 0);  // std::exp per visible score
}
inline void softmax_backward(TensorView<const float> probs, TensorView<float>) { stream(3 * probs.numel()); }

// ---- mixture of experts: bytes moved. The router has no logits to read on meta tensors, so it writes a balanced
// stand-in routing (token t selects experts t, t+1, ... mod E), which lets the rest of a layer run on shapes. ----
inline void router_forward(TensorView<const float> logits, RouterScoring, bool, float,
                           std::span<const std::int64_t> offsets, TensorView<float>, TensorView<float>,
                           std::span<std::int64_t> experts, TensorView<float>, TensorView<float>) {
  check(logits.rank() == 2 && std::int64_t(offsets.size()) == logits.extent(0) + 1 &&
            std::int64_t(experts.size()) == offsets.back(),
        "router_forward: logits {} with {} offsets and {} experts", logits.shape(), offsets.size(), experts.size());
  const std::int64_t n = logits.extent(0), e_count = logits.extent(1);
  for (std::int64_t t = 0; t < n; ++t)
    for (std::int64_t j = offsets[std::size_t(t)]; j < offsets[std::size_t(t + 1)]; ++j)
      experts[std::size_t(j)] = (t + j - offsets[std::size_t(t)]) % e_count;
  stream(2 * double(n) * double(e_count) + double(n) + 3 * double(experts.size()));
}
inline void router_backward(TensorView<const float> logits, TensorView<const float>, TensorView<const float>,
                            RouterScoring, bool, float, std::span<const std::int64_t>,
                            std::span<const std::int64_t> experts, TensorView<const float>, TensorView<const float>,
                            float, TensorView<float>) {
  stream(4 * double(logits.numel()) + 3 * double(experts.size()));
}
inline void gather_rows(TensorView<const float>, std::span<const std::int64_t>, TensorView<const float> scale,
                        TensorView<float> to) {
  stream(2 * double(to.numel()) + double(scale.rank() > 0 ? scale.numel() : 0));
}
inline void scatter_add_rows(TensorView<float>, std::span<const std::int64_t>, TensorView<const float> from,
                             TensorView<const float> scale) {
  stream(3 * double(from.numel()) + double(scale.rank() > 0 ? scale.numel() : 0));
}
inline void gathered_row_dot(TensorView<const float>, std::span<const std::int64_t>, TensorView<const float> b,
                             TensorView<float> out) {
  stream(2 * double(b.numel()) + double(out.numel()));
}
inline void sigmoid_forward(TensorView<const float> x, TensorView<float>) { activation(x.numel(), 2); }
inline void sigmoid_backward(TensorView<const float> y, TensorView<const float>, TensorView<float>) {
  stream(4 * y.numel());
}

}  // namespace counting

// The dry-run backend: every op of ops/op_table.inc, forwarded to its counting rule.
namespace counting_backend {
namespace impl = counting;
struct Counting {
  static constexpr std::string_view name = "counting";
  // Records each op into the trace of the current tracker instead of computing: code above ops/ may shortcut a dry
  // run on this (strategy/ring_attention.hpp replays a repeated ring, core/trace.hpp's record_or_replay).
  static constexpr bool records_trace = true;
#include "paradyse/ops/op_table.inc"
};
}  // namespace counting_backend
using counting_backend::Counting;

}  // namespace paradyse::ops
