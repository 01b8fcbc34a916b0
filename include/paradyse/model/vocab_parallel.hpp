// paradyse/model/vocab_parallel.hpp: the embedding and the LM head's cross-entropy with the vocabulary sharded over a
// tensor-parallel group of T ranks (Megatron-LM's VocabParallelEmbedding and vocab_parallel_cross_entropy): rank r
// holds rows vocab_rows(V, T, r) = chunk_range(V, T, r) of the embedding table and of the head (uneven allowed), and
// each rank brings its own rows of tokens (rows[q] on rank q: sequence parallelism), N = sum(rows) in all.
//
//   embedding   tokens [n_r] all-gathered [N]; each rank looks up the tokens of its vocabulary rows (zero rows for
//               the others) and the partial [N, h] is reduce-scattered (summed) back to [n_r, h].
//     backward  dout [n_r, h] all-gathered [N, h]; each rank accumulates the gradients of its vocabulary rows.
//   head, loss  x [n_r, h] (normed) all-gathered [N, h]; logits [N, V_r] = x W_r^T; each row's max all-reduced (max),
//               its sum of exp(logit - max) and its target's logit all-reduced (sum; the rank holding the target
//               gives it): loss = log(sum) + max - target logit. dlogits = grad_scale (softmax - onehot(target)) on
//               the rank's columns; dW_r += dlogits^T x; dx [N, h] = dlogits W_r (partial), reduce-scattered (summed)
//               to [n_r, h].
//
// The logits live for kHeadChunkRows gathered rows at a time (every rank runs the same chunks). Host (ops::Cpu) only.
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
void check_group(const char* op, C& tp, std::span<const std::int64_t> rows, std::int64_t mine, ChunkRange vocab,
                 std::int64_t table_rows) {
  check(std::int64_t(rows.size()) == std::int64_t(tp.size()), "{}: {} row counts for a group of {} ranks", op,
        rows.size(), tp.size());
  check(rows[std::size_t(tp.rank())] == mine, "{}: rank {} brings {} rows, the counts say {}", op, tp.rank(), mine,
        rows[std::size_t(tp.rank())]);
  check(table_rows == vocab.length, "{}: a table of {} rows for the vocabulary rows [{}, {})", op, table_rows,
        vocab.start, vocab.end());
}

// [N] all tokens (or targets) of the group, in rank order.
template <Communicator C>
std::vector<std::int32_t> gathered_ids(C& tp, std::span<const std::int64_t> rows, TensorView<const std::int32_t> mine) {
  std::vector<std::int32_t> all(std::size_t(std::accumulate(rows.begin(), rows.end(), std::int64_t(0))));
  tp.all_gather_v(std::span<const std::int32_t>(mine.data(), std::size_t(mine.numel())), std::span<std::int32_t>(all),
                  rows);
  return all;
}

}  // namespace vocab_parallel_detail

// out [n_r, h] (overwritten) <- the embedding of tokens [n_r] (ids in [0, V)), the table's rows `vocab` ([V_r, h],
// this rank's) over `tp`; rows[q]: the tokens rank q brings. Collective over tp.
template <Communicator C>
void vocab_parallel_embedding_forward(C& tp, std::span<const std::int64_t> rows, ChunkRange vocab,
                                      TensorView<const std::int32_t> tokens, TensorView<const float> table,
                                      TensorView<float> out) {
  using namespace vocab_parallel_detail;
  const std::int64_t h = table.extent(1);
  check_group("vocab_parallel_embedding_forward", tp, rows, tokens.numel(), vocab, table.extent(0));
  const std::vector<std::int32_t> all = gathered_ids(tp, rows, tokens);
  Tensor<float> partial(Shape{std::int64_t(all.size()), h});  // zeros
  for (std::size_t i = 0; i < all.size(); ++i) {
    const std::int64_t id = all[i] - vocab.start;
    if (id < 0 || id >= vocab.length) continue;
    const float* row = table.data() + id * h;
    std::copy(row, row + h, partial.data() + std::int64_t(i) * h);
  }
  const std::vector<std::int64_t> counts = times(rows, h);
  tp.reduce_scatter_v(std::span<const float>(partial.span()), std::span<float>(out.data(), std::size_t(out.numel())),
                      std::span<const std::int64_t>(counts), ReduceOp::sum);
}

// dtable [V_r, h] += the gradient of this rank's vocabulary rows from dout [n_r, h] (each rank's tokens' gradients).
// Collective over tp.
template <Communicator C>
void vocab_parallel_embedding_backward(C& tp, std::span<const std::int64_t> rows, ChunkRange vocab,
                                       TensorView<const std::int32_t> tokens, TensorView<const float> dout,
                                       TensorView<float> dtable) {
  using namespace vocab_parallel_detail;
  const std::int64_t h = dtable.extent(1);
  check_group("vocab_parallel_embedding_backward", tp, rows, tokens.numel(), vocab, dtable.extent(0));
  const std::vector<std::int32_t> all = gathered_ids(tp, rows, tokens);
  std::vector<float> dall(all.size() * std::size_t(h));
  const std::vector<std::int64_t> counts = times(rows, h);
  tp.all_gather_v(std::span<const float>(dout.data(), std::size_t(dout.numel())), std::span<float>(dall),
                  std::span<const std::int64_t>(counts));
  for (std::size_t i = 0; i < all.size(); ++i) {
    const std::int64_t id = all[i] - vocab.start;
    if (id < 0 || id >= vocab.length) continue;
    float* to = dtable.data() + id * h;
    const float* from = dall.data() + i * std::size_t(h);
    for (std::int64_t j = 0; j < h; ++j) to[j] += from[j];
  }
}

// The LM head [V_r, h] (this rank's vocabulary rows `vocab` of V) and the cross-entropy over the group's normed rows
// (x [n_r, h], targets [n_r] in [0, V) or ops::cpu::kIgnoreIndex): returns the loss sum of this rank's rows. With a
// gradient (weights_grad [V_r, h] accumulates, dx [n_r, h] is overwritten) the backward too, each token's loss
// gradient scaled by grad_scale; with default (null) views the forward only (collectives as with). Collective over tp.
template <Communicator C>
double vocab_parallel_head_loss(C& tp, std::span<const std::int64_t> rows, ChunkRange vocab, TensorView<const float> x,
                                TensorView<const std::int32_t> targets, TensorView<const float> weights,
                                float grad_scale, TensorView<float> weights_grad, TensorView<float> dx) {
  using namespace vocab_parallel_detail;
  using ops::Transpose;
  using Backend = ops::Cpu;
  const std::int64_t h = weights.extent(1), v = vocab.length;
  check_group("vocab_parallel_head_loss", tp, rows, targets.numel(), vocab, weights.extent(0));
  const bool backward = dx.data() != nullptr;
  const std::vector<std::int32_t> all_targets = gathered_ids(tp, rows, targets);
  const std::int64_t n = std::int64_t(all_targets.size());
  const std::vector<std::int64_t> counts = times(rows, h);
  Tensor<float> all_x(Shape{n, h});
  tp.all_gather_v(std::span<const float>(x.data(), std::size_t(x.numel())), all_x.span(),
                  std::span<const std::int64_t>(counts));
  Tensor<float> all_dx(Shape{backward ? n : 0, h});
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
    const TensorView<const float> xs = TensorView<const float>(all_x.view()).slice(0, start, count);
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
    if (!backward || v == 0) continue;
    const TensorView<const float> dlogits = chunk;
    Backend::matmul(dlogits, Transpose::yes, xs, Transpose::no, weights_grad, 1.0f, 1.0f);  // dW_r += dlogits^T x
    Backend::matmul(dlogits, Transpose::no, weights, Transpose::no, all_dx.view().slice(0, start, count));
  }
  if (backward)
    tp.reduce_scatter_v(std::span<const float>(all_dx.span()), std::span<float>(dx.data(), std::size_t(dx.numel())),
                        std::span<const std::int64_t>(counts), ReduceOp::sum);
  return loss;
}

}  // namespace paradyse
