// The vocabulary sharded over a tp group (model/vocab_parallel.hpp: Megatron's vocab-parallel embedding and
// cross-entropy) against a float64 single-rank reference: on T = 1, 2, 3, 4 thread ranks (V = 23: uneven rows, and
// V = 3 on 4 ranks: one rank without vocabulary rows), each rank bringing its own, uneven, count of tokens (one target
// ignored), fresh random tables, rows and ids: the embedding's output and its table gradient, the loss (summed over
// the ranks), the head's gradient and the rows' gradient, each rank's part equal to the reference's. The embedding's
// backward uses the forward's lookup (the group's ids gathered once).
#include "paradyse/comm/threads.hpp"
#include "paradyse/core/rng.hpp"
#include "paradyse/layout/chunking.hpp"
#include "paradyse/model/vocab_parallel.hpp"
#include "paradyse/ops/cpu/cross_entropy.hpp"
#include "support/tolerance.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <mutex>
#include <span>
#include <type_traits>
#include <vector>

namespace vocab_parallel_test {

using namespace paradyse;

// The float64 reference over all N tokens: the embedding out [N, h], its table gradient dE [V, h] for dout; the loss
// sum, dW [V, h] and dx [N, h] of the head W [V, h] on rows x [N, h] against targets [N], scaled by `scale`.
struct Reference {
  std::vector<double> out, d_table, d_weights, dx;
  double loss = 0;
};
Reference reference(std::int64_t V, std::int64_t h, const std::vector<std::int32_t>& tokens,
                    const std::vector<float>& table, const std::vector<float>& dout, const std::vector<float>& x,
                    const std::vector<std::int32_t>& targets, const std::vector<float>& weights, double scale) {
  const std::size_t n = tokens.size();
  Reference r{std::vector<double>(n * std::size_t(h)), std::vector<double>(std::size_t(V * h)),
              std::vector<double>(std::size_t(V * h)), std::vector<double>(n * std::size_t(h)), 0};
  for (std::size_t t = 0; t < n; ++t)
    for (std::int64_t j = 0; j < h; ++j) {
      r.out[t * std::size_t(h) + std::size_t(j)] = table[std::size_t(tokens[t] * h + j)];
      r.d_table[std::size_t(tokens[t] * h + j)] += dout[t * std::size_t(h) + std::size_t(j)];
    }
  for (std::size_t t = 0; t < n; ++t) {
    if (targets[t] == ops::cpu::kIgnoreIndex) continue;
    std::vector<double> logits(static_cast<std::size_t>(V));
    for (std::int64_t c = 0; c < V; ++c)
      for (std::int64_t j = 0; j < h; ++j)
        logits[std::size_t(c)] += double(x[t * std::size_t(h) + std::size_t(j)]) * weights[std::size_t(c * h + j)];
    double top = logits[0], sum = 0;
    for (double l : logits) top = std::max(top, l);
    for (double l : logits) sum += std::exp(l - top);
    const double lse = top + std::log(sum);
    r.loss += lse - logits[std::size_t(targets[t])];
    for (std::int64_t c = 0; c < V; ++c) {
      const double d = scale * (std::exp(logits[std::size_t(c)] - lse) - (c == targets[t] ? 1.0 : 0.0));
      for (std::int64_t j = 0; j < h; ++j) {
        r.d_weights[std::size_t(c * h + j)] += d * x[t * std::size_t(h) + std::size_t(j)];
        r.dx[t * std::size_t(h) + std::size_t(j)] += d * weights[std::size_t(c * h + j)];
      }
    }
  }
  return r;
}

std::vector<float> random_floats(Rng& rng, std::size_t n, double scale) {
  std::vector<float> out;
  for (std::size_t i = 0; i < n; ++i) out.push_back(float(rng.uniform(-scale, scale)));
  return out;
}

void check_vocab_parallel(int T, std::int64_t V) {
  CAPTURE(T);
  CAPTURE(V);
  const std::int64_t h = 12;
  Rng rng(4100 + std::uint64_t(T * 100 + V));
  std::vector<std::int64_t> rows;  // tokens per rank: uneven
  for (int q = 0; q < T; ++q) rows.push_back(3 + 2 * q);
  std::int64_t n = 0;
  for (std::int64_t r : rows) n += r;
  std::vector<std::int32_t> tokens, targets;
  for (std::int64_t t = 0; t < n; ++t) {
    tokens.push_back(std::int32_t(rng.next_u64() % std::uint64_t(V)));
    targets.push_back(std::int32_t(rng.next_u64() % std::uint64_t(V)));
  }
  targets[1] = ops::cpu::kIgnoreIndex;
  const std::vector<float> table = random_floats(rng, std::size_t(V * h), 1.0);
  const std::vector<float> weights = random_floats(rng, std::size_t(V * h), 1.0);
  const std::vector<float> x = random_floats(rng, std::size_t(n * h), 1.0);
  const std::vector<float> dout = random_floats(rng, std::size_t(n * h), 1.0);
  const double scale = 1.0 / double(n - 1);
  const Reference want = reference(V, h, tokens, table, dout, x, targets, weights, scale);

  std::mutex lock;
  double loss = 0;
  run_ranks(T, [&](ThreadCommunicator& tp) {
    const int r = int(tp.rank());
    const ChunkRange vocab = vocab_rows(V, T, r);
    std::int64_t first = 0;
    for (int q = 0; q < r; ++q) first += rows[std::size_t(q)];
    const std::int64_t mine = rows[std::size_t(r)];
    const auto part = [&](const auto& all, std::int64_t start, std::int64_t count, std::int64_t width) {
      using Element = typename std::decay_t<decltype(all)>::value_type;
      return std::span<const Element>(all).subspan(std::size_t(start * width), std::size_t(count * width));
    };
    const auto tensor_of = [](auto span, Shape shape) {
      using Element = std::remove_const_t<typename decltype(span)::element_type>;
      Tensor<Element> t(shape);
      std::copy(span.begin(), span.end(), t.span().begin());
      return t;
    };
    const Tensor<std::int32_t> my_tokens = tensor_of(part(tokens, first, mine, 1), Shape{mine});
    const Tensor<std::int32_t> my_targets = tensor_of(part(targets, first, mine, 1), Shape{mine});
    const Tensor<float> my_table = tensor_of(part(table, vocab.start, vocab.length, h), Shape{vocab.length, h});
    const Tensor<float> my_weights = tensor_of(part(weights, vocab.start, vocab.length, h), Shape{vocab.length, h});
    const Tensor<float> my_x = tensor_of(part(x, first, mine, h), Shape{mine, h});
    const Tensor<float> my_dout = tensor_of(part(dout, first, mine, h), Shape{mine, h});
    Tensor<float> out(Shape{mine, h}), d_table(Shape{vocab.length, h}), d_weights(Shape{vocab.length, h}),
        dx(Shape{mine, h});
    const VocabLookup lookup = vocab_lookup(tp, std::span<const std::int64_t>(rows), vocab, my_tokens.view(), h);
    vocab_parallel_embedding_forward(tp, lookup, my_table.view(), out.view());
    vocab_parallel_embedding_backward(tp, lookup, my_dout.view(), d_table.view());
    const double my_loss = vocab_parallel_head_loss(tp, std::span<const std::int64_t>(rows), vocab, my_x.view(),
                                                    my_targets.view(), my_weights.view(), float(scale),
                                                    d_weights.view(), dx.view());
    // The forward alone gives the same loss and leaves no gradient.
    const double forward_loss = vocab_parallel_head_loss(tp, std::span<const std::int64_t>(rows), vocab, my_x.view(),
                                                         my_targets.view(), my_weights.view(), 1.0f,
                                                         TensorView<float>(), TensorView<float>());
    const std::lock_guard guard(lock);
    CAPTURE(r);
    loss += my_loss;
    CHECK(forward_loss == my_loss);
    CHECK(testing::first_mismatch(std::span<const float>(out.span()), part(want.out, first, mine, h),
                                  testing::kFloat32) == "");
    CHECK(testing::first_mismatch(std::span<const float>(dx.span()), part(want.dx, first, mine, h),
                                  testing::kFloat32) == "");
    CHECK(testing::first_mismatch(std::span<const float>(d_table.span()), part(want.d_table, vocab.start, vocab.length, h),
                                  testing::kFloat32) == "");
    CHECK(testing::first_mismatch(std::span<const float>(d_weights.span()),
                                  part(want.d_weights, vocab.start, vocab.length, h), testing::kFloat32) == "");
  });
  CHECK(loss == doctest::Approx(want.loss).epsilon(1e-5));
  double norm = 0;  // the comparisons can fail: the reference's gradients are not zero
  for (double d : want.dx) norm += d * d;
  CHECK(norm > 0);
}

}  // namespace vocab_parallel_test

TEST_CASE("vocab-parallel embedding and cross-entropy (rows of V over tp, the logits' max and sum of exp all-reduced) "
          "equal the float64 single-rank reference: outputs, loss and every gradient, uneven V / tp and tokens") {
  using namespace vocab_parallel_test;
  for (int T : {1, 2, 3, 4}) check_vocab_parallel(T, 23);
  check_vocab_parallel(4, 3);  // one rank holds no vocabulary row
}
