// paradyse/model/vocab_parallel.hpp: the embedding and the LM head's cross-entropy with the vocabulary sharded over a
// tensor-parallel group of T ranks (Megatron-LM's VocabParallelEmbedding and vocab_parallel_cross_entropy): rank r
// holds rows vocab_rows(V, T, r) = chunk_range(V, T, r) of the embedding table and of the head (uneven allowed; a rank
// may hold none), and each rank brings its own rows of tokens (rows[q] on rank q: sequence parallelism), N = sum(rows)
// in all.
//
//   embedding   tokens [n_r] all-gathered [N] once (vocab_lookup: the positions among N of the tokens in this rank's
//               rows and their local ids, kept for the backward); forward: the rank's rows looked up (the backend's
//               embedding_forward) into their places of a zero partial [N, h] (scatter_add_rows), reduce-scattered
//               (summed) back to [n_r, h]. backward: dout [n_r, h] all-gathered [N, h], the rank's places picked
//               (gather_rows) and accumulated into its rows (embedding_backward).
//   head, loss  x [n_r, h] (normed) all-gathered [N, h]; logits [N, V_r] = x W_r^T; each row's max all-reduced (max),
//               its sum of exp(logit - max) and its target's logit all-reduced (sum; the rank holding the target
//               gives it): loss = log(sum) + max - target logit. dlogits = grad_scale (softmax - onehot(target)) on
//               the rank's columns; dW_r += dlogits^T x; dx [N, h] = dlogits W_r (partial, written over the chunk's
//               gathered x once used), reduce-scattered (summed) to [n_r, h]. The logits live for kHeadChunkRows
//               gathered rows at a time (every rank runs the same chunks).
//
// Data moves and GEMMs go through the Backend's ops; the token ids, the row positions and the head's per-row softmax
// statistics (max, sum of exp, target logit: no op of ops/op_table.inc computes them over a slice of the vocabulary)
// are host memory, so a backend computing on the host (ops::Cpu, ops::CpuBf16) runs it whole.
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/layout/chunking.hpp"
#include "paradyse/model/head_loss.hpp"
#include "paradyse/ops/backend.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <span>
#include <vector>

namespace paradyse {

// The vocabulary rows rank `rank` of `ranks` holds.
inline ChunkRange vocab_rows(std::int64_t vocab, int ranks, int rank) { return chunk_range(vocab, ranks, rank); }

namespace vocab_parallel_detail {

// counts [T] times `width` (a v-collective's counts of rows of `width` elements).
inline std::vector<std::int64_t> times(std::span<const std::int64_t> rows, std::int64_t width) {
  std::vector<std::int64_t> out;
  for (std::int64_t r : rows) out.push_back(r * width);
  return out;
}

template <Communicator C>
void check_group(const char* op, C& tp, std::span<const std::int64_t> rows, std::int64_t mine) {
  check(std::int64_t(rows.size()) == std::int64_t(tp.size()), "{}: {} row counts for a group of {} ranks", op,
        rows.size(), tp.size());
  check(rows[std::size_t(tp.rank())] == mine, "{}: rank {} brings {} rows, the counts say {}", op, tp.rank(), mine,
        rows[std::size_t(tp.rank())]);
}

inline void check_table(const char* op, ChunkRange vocab, std::int64_t table_rows, std::int64_t width,
                        std::int64_t h) {
  check(table_rows == vocab.length && width == h, "{}: a table of [{}, {}] for the vocabulary rows [{}, {}) of width "
        "{}", op, table_rows, width, vocab.start, vocab.end(), h);
}

// [N] all ids (tokens or targets) of the group, in rank order.
template <Communicator C>
std::vector<std::int32_t> gathered_ids(C& tp, std::span<const std::int64_t> rows, TensorView<const std::int32_t> mine) {
  std::vector<std::int32_t> all(std::size_t(std::accumulate(rows.begin(), rows.end(), std::int64_t(0))));
  tp.all_gather_v(std::span<const std::int32_t>(mine.data(), std::size_t(mine.numel())), std::span<std::int32_t>(all),
                  rows);
  return all;
}

}  // namespace vocab_parallel_detail

// The group's tokens of one use of the sharded embedding, as this rank needs them: gathered once (the forward's
// prologue) and kept for the backward.
struct VocabLookup {
  ChunkRange vocab;                     // this rank's vocabulary rows
  std::int64_t h = 0;                   // the table's width
  std::int64_t gathered = 0;            // N: the group's tokens
  std::vector<std::int64_t> counts;     // [T]: rows[q] * h, the v-collectives' counts
  std::vector<std::int64_t> positions;  // [m]: the places among the N of the tokens in this rank's rows
  Tensor<std::int32_t> ids;             // [m]: their rows in this rank's table (token - vocab.start)
};

// The lookup of tokens [n_r] (ids in [0, V)) of width h in this rank's vocabulary rows `vocab` over `tp`; rows[q]:
// the tokens rank q brings. Collective over tp (an all-gather of the ids).
template <Communicator C>
VocabLookup vocab_lookup(C& tp, std::span<const std::int64_t> rows, ChunkRange vocab,
                         TensorView<const std::int32_t> tokens, std::int64_t h) {
  using namespace vocab_parallel_detail;
  check_group("vocab_lookup", tp, rows, tokens.numel());
  const std::vector<std::int32_t> all = gathered_ids(tp, rows, tokens);
  VocabLookup out{vocab, h, std::int64_t(all.size()), times(rows, h), {}, {}};
  std::vector<std::int32_t> ids;
  for (std::size_t i = 0; i < all.size(); ++i)
    if (all[i] >= vocab.start && all[i] < vocab.end()) {
      out.positions.push_back(std::int64_t(i));
      ids.push_back(std::int32_t(all[i] - vocab.start));
    }
  out.ids = Tensor<std::int32_t>(Shape{std::int64_t(ids.size())});
  std::copy(ids.begin(), ids.end(), out.ids.span().begin());
  return out;
}

// out [n_r, h] (overwritten) <- the embedding of the lookup's tokens, the table's rows `lookup.vocab` ([V_r, h], this
// rank's). Collective over tp.
template <class Backend = ops::Cpu, Communicator C>
void vocab_parallel_embedding_forward(C& tp, const VocabLookup& lookup, TensorView<const float> table,
                                      TensorView<float> out) {
  const std::int64_t h = lookup.h, m = lookup.ids.numel();
  vocab_parallel_detail::check_table("vocab_parallel_embedding_forward", lookup.vocab, table.extent(0),
                                     table.extent(1), h);
  Tensor<float> mine(Shape{m, h}), partial(Shape{lookup.gathered, h});
  Backend::fill(partial.view(), 0.0f);
  if (m > 0) {  // (empty rows would mean the identity to the row ops)
    Backend::embedding_forward(lookup.ids.view(), table, mine.view());
    Backend::scatter_add_rows(partial.view(), std::span<const std::int64_t>(lookup.positions),
                              TensorView<const float>(mine.view()), TensorView<const float>());
  }
  tp.reduce_scatter_v(std::span<const float>(partial.span()), std::span<float>(out.data(), std::size_t(out.numel())),
                      std::span<const std::int64_t>(lookup.counts), ReduceOp::sum);
}

// dtable [V_r, h] += the gradient of this rank's vocabulary rows from dout [n_r, h] (each rank's tokens' gradients),
// for the lookup the forward used. Collective over tp.
template <class Backend = ops::Cpu, Communicator C>
void vocab_parallel_embedding_backward(C& tp, const VocabLookup& lookup, TensorView<const float> dout,
                                       TensorView<float> dtable) {
  const std::int64_t h = lookup.h, m = lookup.ids.numel();
  vocab_parallel_detail::check_table("vocab_parallel_embedding_backward", lookup.vocab, dtable.extent(0),
                                     dtable.extent(1), h);
  Tensor<float> all(Shape{lookup.gathered, h}), mine(Shape{m, h});
  tp.all_gather_v(std::span<const float>(dout.data(), std::size_t(dout.numel())), all.span(),
                  std::span<const std::int64_t>(lookup.counts));
  if (m == 0) return;  // (empty rows would mean the identity to the row ops)
  Backend::gather_rows(TensorView<const float>(all.view()), std::span<const std::int64_t>(lookup.positions),
                       TensorView<const float>(), mine.view());
  Backend::embedding_backward(lookup.ids.view(), TensorView<const float>(mine.view()), dtable);
}

// The LM head [V_r, h] (this rank's vocabulary rows `vocab` of V) and the cross-entropy over the group's normed rows
// (x [n_r, h], targets [n_r] in [0, V) or ops::cpu::kIgnoreIndex): returns the loss sum of this rank's rows. With a
// gradient (weights_grad [V_r, h] accumulates, dx [n_r, h] is overwritten) the backward too, each token's loss
// gradient scaled by grad_scale; with default (null) views the forward only (collectives as with). Collective over tp.
template <class Backend = ops::Cpu, Communicator C>
double vocab_parallel_head_loss(C& tp, std::span<const std::int64_t> rows, ChunkRange vocab, TensorView<const float> x,
                                TensorView<const std::int32_t> targets, TensorView<const float> weights,
                                float grad_scale, TensorView<float> weights_grad, TensorView<float> dx) {
  using namespace vocab_parallel_detail;
  using ops::Transpose;
  const std::int64_t h = x.extent(1), v = vocab.length;
  check_group("vocab_parallel_head_loss", tp, rows, targets.numel());
  check_table("vocab_parallel_head_loss", vocab, weights.extent(0), weights.extent(1), h);
  const bool backward = dx.data() != nullptr;
  const std::vector<std::int32_t> all_targets = gathered_ids(tp, rows, targets);
  const std::int64_t n = std::int64_t(all_targets.size());
  const std::vector<std::int64_t> counts = times(rows, h);
  Tensor<float> all_x(Shape{n, h});
  tp.all_gather_v(std::span<const float>(x.data(), std::size_t(x.numel())), all_x.span(),
                  std::span<const std::int64_t>(counts));
  std::int64_t first_mine = 0;  // this rank's rows among the gathered
  for (int q = 0; q < int(tp.rank()); ++q) first_mine += rows[std::size_t(q)];
  const std::int64_t last_mine = first_mine + rows[std::size_t(tp.rank())];
  const std::int64_t chunk_rows = std::min(n, kHeadChunkRows);
  Tensor<float> logits(Shape{chunk_rows, v});
  const std::size_t per_chunk = static_cast<std::size_t>(chunk_rows);
  std::vector<float> top(per_chunk), total(per_chunk), picked(per_chunk);
  double loss = 0.0;
  for (std::int64_t start = 0; start < n; start += kHeadChunkRows) {
    const std::int64_t count = std::min(kHeadChunkRows, n - start);
    const TensorView<float> chunk = logits.view().slice(0, 0, count);
    const TensorView<float> rows_of_chunk = all_x.view().slice(0, start, count);  // x, then the rows' partial dx
    const TensorView<const float> xs = rows_of_chunk;
    if (v > 0) Backend::matmul(xs, Transpose::no, weights, Transpose::yes, chunk);  // [count, V_r]
    const std::span<float> tops(top.data(), std::size_t(count)), totals(total.data(), std::size_t(count)),
        picks(picked.data(), std::size_t(count));
    for (std::int64_t r = 0; r < count; ++r) {
      const float* row = chunk.data() + r * v;
      tops[std::size_t(r)] = v > 0 ? *std::max_element(row, row + v) : -std::numeric_limits<float>::infinity();
    }
    tp.all_reduce(std::span<const float>(tops), tops, ReduceOp::max);
    for (std::int64_t r = 0; r < count; ++r) {
      const float* row = chunk.data() + r * v;
      float sum = 0.0f;
      for (std::int64_t c = 0; c < v; ++c) sum += std::exp(row[c] - tops[std::size_t(r)]);
      totals[std::size_t(r)] = sum;
      const std::int64_t target = std::int64_t(all_targets[std::size_t(start + r)]) - vocab.start;
      picks[std::size_t(r)] = target >= 0 && target < v ? row[target] : 0.0f;
    }
    tp.all_reduce(std::span<const float>(totals), totals, ReduceOp::sum);
    tp.all_reduce(std::span<const float>(picks), picks, ReduceOp::sum);
    for (std::int64_t r = 0; r < count; ++r) {
      const std::int64_t g = start + r;
      const std::int32_t target = all_targets[std::size_t(g)];
      float* row = chunk.data() + r * v;
      if (target == ops::cpu::kIgnoreIndex) {
        std::fill(row, row + v, 0.0f);
        continue;
      }
      const float lse = tops[std::size_t(r)] + std::log(totals[std::size_t(r)]);
      if (g >= first_mine && g < last_mine) loss += double(lse) - double(picks[std::size_t(r)]);
      for (std::int64_t c = 0; c < v; ++c) row[c] = grad_scale * std::exp(row[c] - lse);  // dlogits
      const std::int64_t local = std::int64_t(target) - vocab.start;
      if (local >= 0 && local < v) row[local] -= grad_scale;
    }
    if (!backward) continue;
    if (v == 0) {  // no vocabulary rows: no share of the rows' gradient
      Backend::fill(rows_of_chunk, 0.0f);
      continue;
    }
    const TensorView<const float> dlogits = chunk;
    Backend::matmul(dlogits, Transpose::yes, xs, Transpose::no, weights_grad, 1.0f, 1.0f);  // dW_r += dlogits^T x
    // The chunk's x is used up: its rows take their partial dx (one [N, h] buffer for both).
    Backend::matmul(dlogits, Transpose::no, weights, Transpose::no, rows_of_chunk);
  }
  if (backward)
    tp.reduce_scatter_v(std::span<const float>(all_x.span()), std::span<float>(dx.data(), std::size_t(dx.numel())),
                        std::span<const std::int64_t>(counts), ReduceOp::sum);
  return loss;
}

}  // namespace paradyse
