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
#include "paradyse/ops/cpu/gemm_grouped.hpp"
#include "paradyse/ops/cpu/moe_ops.hpp"
#include "paradyse/ops/cpu/rope.hpp"
#include "paradyse/ops/cpu/softmax.hpp"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

namespace paradyse::ops {

namespace counting_detail {

// The documents of a mask, each the global positions [first(k), end(k)), in order; without document_starts, one
// document of every position.
class Documents {
public:
  explicit Documents(const AttentionMask& mask)
      : starts_(mask.document_starts.empty() ? std::span<const std::int64_t>(whole_) : mask.document_starts) {}
  std::size_t count() const { return starts_.size(); }
  std::int64_t first(std::size_t k) const { return starts_[k]; }
  std::int64_t end(std::size_t k) const {
    return k + 1 < starts_.size() ? starts_[k + 1] : std::numeric_limits<std::int64_t>::max();
  }
  // The document holding `position` (the last one starting at or before it: empty documents share a start).
  std::size_t holding(std::int64_t position) const {
    return std::size_t(std::upper_bound(starts_.begin(), starts_.end(), position) - starts_.begin()) - 1;
  }

private:
  static constexpr std::int64_t whole_[1] = {0};
  std::span<const std::int64_t> starts_;
};

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
inline std::int64_t floor_div(std::int64_t a, std::int64_t b) { return a / b - (a % b != 0 && (a < 0) != (b < 0)); }

// tiled_pairs' walk over the grid of q_block x kv_block tiles of one call. Within a document the visible keys of a
// query are [the document's first key, its end or, causal, the query itself], so the key tiles that a run of query
// tiles inside one document computes follow the causal ramp of the whole sequence, offset: summed in closed form.
// Only the query tiles holding a document's start (and a last short tile) are counted one by one.
struct TileWalk {
  const AttentionMask& mask;
  std::int64_t q_len, kv_len, qb, kb;
  Documents docs{mask};

  // Pairs of the query tiles [t0, t1) (whole q_block rows), all of whose rows lie in document k.
  __int128 run(std::size_t k, std::int64_t t0, std::int64_t t1) const {
    const std::int64_t a = local_key(mask, docs.first(k), kv_len);  // the document's first key
    if (a >= kv_len) return 0;
    const std::int64_t base = a / kb * kb;                           // where its key tiles start
    if (!mask.causal) return __int128(t1 - t0) * qb * span(a, local_key(mask, docs.end(k), kv_len)).size();
    // Causal: query tile t's last row sees keys [a, L_t), L_t = d + (t + 1) qb (d = q_offset - kv_offset): none
    // while L_t <= a; key tiles up to ceil(L_t / kb) kb while that stays below kv_len (L_t <= top), kv_len after.
    const std::int64_t d = mask.q_offset - mask.kv_offset, top = (kv_len - 1) / kb * kb;
    const std::int64_t first = std::clamp(floor_div(a - d, qb), t0, t1);
    const std::int64_t capped = std::clamp(floor_div(top - d, qb), first, t1);
    const __int128 ramp = __int128(kb) * floor_sum(capped - first, kb, qb, __int128(d) + (first + 1) * qb + kb - 1);
    return __int128(qb) * (ramp + __int128(t1 - capped) * kv_len - __int128(t1 - first) * base);
  }

  // Pairs of the query tile of rows [i0, i0 + rows), whose first row lies in document k: the union of the key tiles
  // of each document's rows in it (neighbouring documents may share a key tile).
  __int128 tile(std::size_t k, std::int64_t i0, std::int64_t rows) const {
    std::int64_t covered = 0, keys = 0;  // key tiles [.., covered) counted so far: keys
    for (; k < docs.count() && docs.first(k) < mask.q_offset + i0 + rows; ++k) {
      const std::int64_t r1 = std::min(i0 + rows, docs.end(k) - mask.q_offset);  // past the document's last row here
      const std::int64_t last = mask.causal ? mask.q_offset + r1 : docs.end(k);
      const KeySpan s = span(local_key(mask, docs.first(k), kv_len), local_key(mask, last, kv_len));
      if (s.size() == 0) continue;
      keys += s.end - std::max(s.first, covered);
      covered = s.end;
    }
    return __int128(rows) * keys;
  }

  // The whole key tiles that keys [a, b) touch, cut at kv_len.
  struct KeySpan {
    std::int64_t first = 0, end = 0;
    std::int64_t size() const { return end - first; }
  };
  KeySpan span(std::int64_t a, std::int64_t b) const {
    if (a >= b) return {};
    return {a / kb * kb, std::min(kv_len, (b + kb - 1) / kb * kb)};
  }
};

}  // namespace counting_detail

// Query-key pairs that `mask` leaves visible between q_len queries and kv_len keys (one batch entry, one head).
inline double visible_pairs(const AttentionMask& mask, std::int64_t q_len, std::int64_t kv_len) {
  if (!mask.document_starts.empty()) {
    // Within a document the mask is one sequence's: the blocks of each document's queries and keys, summed.
    const counting_detail::Documents docs(mask);
    double pairs = 0;
    for (std::size_t k = docs.holding(mask.q_offset); k < docs.count() && docs.first(k) < mask.q_offset + q_len; ++k) {
      const std::int64_t r0 = std::max<std::int64_t>(docs.first(k) - mask.q_offset, 0);
      const std::int64_t r1 = std::min(docs.end(k) - mask.q_offset, q_len);
      const std::int64_t a = local_key(mask, docs.first(k), kv_len), b = local_key(mask, docs.end(k), kv_len);
      if (r0 < r1 && a < b)
        pairs += visible_pairs({.causal = mask.causal, .q_offset = mask.q_offset + r0, .kv_offset = mask.kv_offset + a},
                               r1 - r0, b - a);
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
// mask) count as the kernel runs them. In closed form per document (lengths reach 10^12 tokens in the planner's
// sweeps): O(documents) steps, not O(tokens).
inline double tiled_pairs(const AttentionMask& mask, std::int64_t q_len, std::int64_t kv_len,
                          const cpu::AttentionTiling& tiling) {
  if (q_len <= 0 || kv_len <= 0) return 0;
  const counting_detail::TileWalk walk{mask, q_len, kv_len, tiling.q_block, tiling.kv_block};
  const std::int64_t qb = walk.qb, tiles = (q_len + qb - 1) / qb, full = q_len / qb;
  __int128 pairs = 0;
  std::size_t k = walk.docs.holding(mask.q_offset);
  for (std::int64_t t = 0; t < tiles;) {
    while (k + 1 < walk.docs.count() && walk.docs.first(k + 1) <= mask.q_offset + t * qb) ++k;
    // The whole tiles from t on that lie in document k, in closed form; else tile t alone.
    const std::int64_t inside = std::min(full, (walk.docs.end(k) - mask.q_offset) / qb);
    if (inside > t) {
      pairs += walk.run(k, t, inside);
      t = inside;
    } else {
      pairs += walk.tile(k, t * qb, std::min(qb, q_len - t * qb));
      ++t;
    }
  }
  return double(pairs);
}

// The counting rules: one function for each op of ops/op_table.inc, with its signature, recording what the op would
// do. ops::Counting forwards to them.
namespace counting {

// ---- recording ----
// A kernel's workspace of `bytes` (as the tracker counts them), allocated and freed within the call (`times` times
// one after another: a batched call's items): one scratch event, and the meta tracker's peak sees it once.
inline void scratch(std::size_t bytes, std::int32_t times = 1) {
  if (bytes == 0) return;
  MemoryTracker& tracker = MemoryTracker::current();
  tracker.raise_peak_to(tracker.in_use() + bytes);
  if (Trace* trace = tracker.trace())
    trace->record({.kind = TraceKind::scratch, .count = times, .bytes = double(bytes)});
}
inline void record(const TraceEvent& event) {
  Trace* trace = Trace::current();
  check(trace != nullptr, "ops::Counting: no Trace is installed on this thread (use ScopedTrace)");
  trace->record(event);
}
// A memory-bound kernel that reads and writes `elements` float32 elements in all.
inline void stream(double elements, ElementwiseFamily family = ElementwiseFamily::other) {
  record({.kind = TraceKind::elementwise, .family = family, .bytes = 4 * elements});
}
inline void stream(std::int64_t elements, ElementwiseFamily family = ElementwiseFamily::other) {
  stream(double(elements), family);
}
// `function`: 1 SwiGLU's forward, 0 the others (cost::HardwareProfile::activation_time prices each at its rate).
inline void activation(std::int64_t elements, int tensors, int function = 0,
                       ElementwiseFamily family = ElementwiseFamily::activation) {
  record({.kind = TraceKind::activation, .family = family, .bytes = 4.0 * double(elements) * tensors,
          .m = double(elements), .n = double(function)});
}
// `calls` scalar math-library calls of `function` (0 exp, 1 cos or sin: cost::ScalarFunction), made one at a time.
inline void scalar_calls(double calls, int function) {
  record({.kind = TraceKind::transcendental, .m = calls, .n = double(function)});
}
inline void rope(TensorView<const float> x) {
  scratch(cpu::detail::tracked(std::size_t(x.extent(3) / 2) * 2 * sizeof(float)));  // the CPU kernel's angle table
  stream(2 * x.numel(), ElementwiseFamily::rope);
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
  stream(2 * from.numel(), ElementwiseFamily::copy);
}
inline void fill(TensorView<float> x, float) { stream(x.numel(), ElementwiseFamily::fill); }
inline void synchronize() {}  // a dry run queues nothing
inline void add_into(TensorView<float> to, TensorView<const float> from) {
  check(to.shape() == from.shape(), "add_into: destination {} and source {} differ in shape", to.shape(),
        from.shape());
  stream(3 * to.numel(), ElementwiseFamily::add);
}

// ---- GEMM ----
inline void gemm(Transpose, Transpose, std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const float*,
                 std::int64_t, const float* b, std::int64_t, float, float*, std::int64_t) {
  if (const std::size_t floats = cpu::gemm_workspace_floats(m, n, k, alpha))
    scratch(cpu::detail::tracked(floats * sizeof(float)));
  record({.kind = TraceKind::gemm, .m = double(m), .n = double(n), .k = double(k),
          .operand = reinterpret_cast<std::uintptr_t>(b)});
}
// count GEMMs of one size: the first item's event, then the others' as one event of count - 1, marked `grouped` where a
// device runs the batch as one launch (disjoint outputs, k and alpha nonzero: ops/cuda/gemm.hpp's cublasSgemmBatched;
// unmarked, the two events merge into one of count). The CPU op allocates and frees each item's workspace in turn:
// one scratch event of that size with the same count (the peak sees it once, the time model count times).
inline void gemm_batched(Transpose, Transpose, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
                         std::span<const float* const> a, std::int64_t, std::span<const float* const> b,
                         std::int64_t, float, std::span<float* const> c, std::int64_t ldc) {
  cpu::check_gemm_batch(a.size(), b.size(), c.size());
  if (a.empty()) return;
  if (const std::size_t floats = cpu::gemm_workspace_floats(m, n, k, alpha))
    scratch(cpu::detail::tracked(floats * sizeof(float)), std::int32_t(a.size()));
  const TraceEvent first{.kind = TraceKind::gemm, .m = double(m), .n = double(n), .k = double(k)};
  record(first);
  if (a.size() == 1) return;
  TraceEvent rest = first;
  rest.grouped = k > 0 && alpha != 0.0f && m > 0 && n > 0 && !cpu::gemm_outputs_overlap(m, n, ldc, c);
  rest.count = std::int32_t(a.size()) - 1;
  record(rest);
}
// A grouped GEMM's items, each as gemm records it (its own m, n, k, weight and the CPU op's workspace), every item
// after the first marked `grouped`: a device launches them with the first (cost/profile.hpp GemmModel::
// grouped_item_time).
inline void gemm_grouped(Transpose, Transpose, float alpha, const GroupedGemm& items, std::int64_t, std::int64_t, float,
                         std::int64_t) {
  cpu::check_gemm_group(items);
  for (std::size_t i = 0; i < items.size(); ++i) {
    const std::int64_t m = items.m[i], n = items.n[i], k = items.k[i];
    if (const std::size_t floats = cpu::gemm_workspace_floats(m, n, k, alpha))
      scratch(cpu::detail::tracked(floats * sizeof(float)));
    record({.kind = TraceKind::gemm, .grouped = i > 0, .m = double(m), .n = double(n), .k = double(k),
            .operand = reinterpret_cast<std::uintptr_t>(items.b[i])});
  }
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
  gemm(trans_a, trans_b, m, n, k, alpha, nullptr, 0, b.data(), 0, 0.0f, nullptr, 0);
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
  stream(2 * x.numel(), ElementwiseFamily::norm);
}
inline void layer_norm_backward(TensorView<const float> x, TensorView<const float>, TensorView<const float>,
                                TensorView<const float>, TensorView<const float>, TensorView<float>,
                                TensorView<float>, TensorView<float>) {
  stream(3 * x.numel(), ElementwiseFamily::norm);
}
inline void rms_norm_forward(TensorView<const float> x, TensorView<const float>, float, TensorView<float>,
                             TensorView<float>) {
  stream(2 * x.numel(), ElementwiseFamily::norm);
}
inline void rms_norm_backward(TensorView<const float> x, TensorView<const float>, TensorView<const float>,
                              TensorView<const float>, TensorView<float>, TensorView<float>) {
  stream(3 * x.numel(), ElementwiseFamily::norm);
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
  stream(2 * out.numel(), ElementwiseFamily::rows);
}
inline void embedding_backward(TensorView<const std::int32_t>, TensorView<const float> dout, TensorView<float>) {
  stream(3 * dout.numel(), ElementwiseFamily::rows);
}
inline cpu::CrossEntropyResult cross_entropy_forward_backward(TensorView<const float> logits,
                                                              TensorView<const std::int32_t>, TensorView<float>,
                                                              float, std::int32_t) {
  stream(3 * logits.numel());
  return {};
}
inline void adamw_step(TensorView<float> params, TensorView<const float>, TensorView<float>, TensorView<float>,
                       const AdamWConfig&, std::int64_t) {
  stream(7 * params.numel(), ElementwiseFamily::optimizer);
}
template <cpu::FloatingStorage From, cpu::FloatingStorage To>
inline void convert(TensorView<const From> from, TensorView<To>) {
  record({.kind = TraceKind::elementwise, .family = ElementwiseFamily::copy,
          .bytes = double(from.numel()) * double(sizeof(From) + sizeof(To))});
}

// ---- materialised softmax ----
inline void masked_softmax_forward(TensorView<float> scores, std::span<const PositionRun> query_runs,
                                   std::span<const PositionRun> key_runs, bool causal) {
  activation(scores.numel(), 2, 0, ElementwiseFamily::softmax);
  check(scores.rank() >= 2, "masked_softmax_forward: scores {} must be [..., n, c]", scores.shape());
  const double block = double(scores.extent(-2)) * double(scores.extent(-1));  // [n, c]
  const double blocks = block > 0 ? double(scores.numel()) / block : 0;
  scalar_calls(blocks * softmax_visible_scores(query_runs, key_runs, causal), 0);  // std::exp per visible score
}
inline void softmax_backward(TensorView<const float> probs, TensorView<float>) {
  stream(3 * probs.numel(), ElementwiseFamily::softmax);
}

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
  stream(2 * double(to.numel()) + double(scale.rank() > 0 ? scale.numel() : 0), ElementwiseFamily::rows);
}
inline void scatter_add_rows(TensorView<float>, std::span<const std::int64_t>, TensorView<const float> from,
                             TensorView<const float> scale) {
  stream(3 * double(from.numel()) + double(scale.rank() > 0 ? scale.numel() : 0), ElementwiseFamily::rows);
}
inline void gathered_row_dot(TensorView<const float>, std::span<const std::int64_t>, TensorView<const float> b,
                             TensorView<float> out) {
  stream(2 * double(b.numel()) + double(out.numel()), ElementwiseFamily::rows);
}
inline void sigmoid_forward(TensorView<const float> x, TensorView<float>) { activation(x.numel(), 2); }
inline void sigmoid_backward(TensorView<const float> y, TensorView<const float>, TensorView<float>) {
  stream(4 * y.numel(), ElementwiseFamily::activation);
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
