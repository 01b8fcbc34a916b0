// The order of a packed sequence's documents (data/document_balance.hpp, data/packing.hpp's PackedOrder).
// rank_causal_pairs equals a brute-force count over the ranks' actual token positions (every token's keys from its
// document's start up to itself, the owner of each position by layout/chunking.hpp's zigzag_owner / chunk_owner) for
// random document lengths on p = 1..5 (uneven lengths, documents shorter than p, empty ones, a single document).
// balanced_document_order returns a permutation whose maximum over the ranks is never larger than the given order's,
// and lowers it where the given order is lopsided (one long document first). pack_sequences with a group balances
// every step (a permutation of the as-packed step, the padding still last), and a GPT trains a reordered step as its
// documents alone: the loss and the replicated gradients are their token-weighted means, on p = 3 and 4 under ring
// attention (MegatronCZ) and UlyssesZ.
#include "packed_documents.hpp"
#include "support/tolerance.hpp"

#include "paradyse/comm/threads.hpp"
#include "paradyse/layout/chunking.hpp"
#include "paradyse/data/document_balance.hpp"
#include "paradyse/data/packing.hpp"
#include "paradyse/model/gpt.hpp"
#include "paradyse/model/stack.hpp"
#include "paradyse/strategy/sequence_layout.hpp"
#include "paradyse/strategy/strategies.hpp"

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <span>
#include <string>
#include <vector>

// Everything in a namespace of its own: the file shares a unity batch with the other tests of the folder.
namespace pack_order_test {

using namespace paradyse;
using namespace paradyse::data;

// Each rank's pairs, one token at a time: the token at position t of a document starting at d sees t - d + 1 keys.
std::vector<std::int64_t> brute_force_pairs(const std::vector<std::int64_t>& lengths, SequenceSplit split) {
  const std::int64_t n = std::accumulate(lengths.begin(), lengths.end(), std::int64_t(0));
  std::vector<std::int64_t> pairs(std::size_t(split.ranks), 0);
  std::int64_t start = 0;
  for (const std::int64_t length : lengths) {
    for (std::int64_t t = start; t < start + length; ++t) {
      const std::int64_t owner = split.zigzag ? zigzag_owner(n, split.ranks, t) : chunk_owner(n, split.ranks, t);
      pairs[std::size_t(owner)] += t - start + 1;
    }
    start += length;
  }
  return pairs;
}

std::vector<std::int64_t> in_order(const std::vector<std::int64_t>& lengths, const std::vector<std::size_t>& order) {
  std::vector<std::int64_t> out;
  for (std::size_t i : order) out.push_back(lengths.at(i));
  return out;
}


TEST_CASE("rank_causal_pairs: each rank's causal pairs of a packed sequence equal a count over its token positions") {
  Rng rng(41);
  for (int p = 1; p <= 5; ++p)
    for (const bool zigzag : {true, false})
      for (int trial = 0; trial < 30; ++trial) {
        const SequenceSplit split{p, zigzag};
        const int chunks = zigzag ? 2 * p : p;
        std::vector<std::int64_t> lengths;
        const std::size_t documents = trial == 0 ? 1 : 1 + std::size_t(rng.below(7));  // a single document first
        const std::uint64_t longest = trial % 3 == 0 ? std::uint64_t(p) : 60;  // often shorter than p
        for (std::size_t d = 0; d < documents; ++d) lengths.push_back(std::int64_t(rng.below(longest + 1)));
        if (trial % 5 == 4) lengths.insert(lengths.begin() + std::ptrdiff_t(rng.below(lengths.size() + 1)), 0);
        // At least one token per chunk (what a SequenceLayout requires of a sequence the model runs).
        const std::int64_t n = std::accumulate(lengths.begin(), lengths.end(), std::int64_t(0));
        if (n < chunks) lengths.back() += chunks - n;
        CAPTURE(p);
        CAPTURE(zigzag);
        CAPTURE(fmt::format("{}", fmt::join(lengths, ",")));
        const std::vector<std::int64_t> got = rank_causal_pairs(lengths, split);
        CHECK(got == brute_force_pairs(lengths, split));
        CHECK(max_rank_causal_pairs(lengths, split) == *std::max_element(got.begin(), got.end()));
      }
  // The measured case of the brief: 3,072 + 4 x 256 tokens on p = 4, the long document first.
  const std::vector<std::int64_t> lopsided{3072, 256, 256, 256, 256};
  const std::vector<std::int64_t> pairs = rank_causal_pairs(lopsided, {4, true});
  CHECK(pairs == brute_force_pairs(lopsided, {4, true}));
  CHECK(pairs[0] < pairs[3] / 8);
  CHECK_THROWS_WITH_AS(rank_causal_pairs(std::vector<std::int64_t>{3, -1}, {2, true}),
                       doctest::Contains("document 1 has length -1"), Error);
  CHECK_THROWS_WITH_AS(rank_causal_pairs(lopsided, {0, true}), doctest::Contains("ranks = 0"), Error);
}

TEST_CASE("balanced_document_order: a permutation, never a larger maximum than the given order, lower when lopsided") {
  Rng rng(43);
  for (int p = 1; p <= 5; ++p)
    for (int trial = 0; trial < 40; ++trial) {
      const SequenceSplit split{p, trial % 4 != 3};
      std::vector<std::int64_t> lengths;
      const std::size_t documents = 1 + std::size_t(rng.below(trial % 2 == 0 ? 6 : 14));
      for (std::size_t d = 0; d < documents; ++d)
        lengths.push_back(1 + std::int64_t(rng.below(trial % 3 == 0 ? std::uint64_t(p) : 300)));
      const std::int64_t trailing = trial % 5 == 0 ? std::int64_t(rng.below(4)) : 0;
      CAPTURE(p);
      CAPTURE(split.zigzag);
      CAPTURE(trailing);
      CAPTURE(fmt::format("{}", fmt::join(lengths, ",")));
      const std::vector<std::size_t> order = balanced_document_order(lengths, split, trailing);
      std::vector<std::size_t> sorted = order;
      std::sort(sorted.begin(), sorted.end());
      std::vector<std::size_t> identity(lengths.size());
      std::iota(identity.begin(), identity.end(), std::size_t{0});
      REQUIRE(sorted == identity);
      std::vector<std::int64_t> given = lengths, chosen = in_order(lengths, order);
      if (trailing > 0) given.push_back(trailing), chosen.push_back(trailing);
      CHECK(max_rank_causal_pairs(chosen, split) <= max_rank_causal_pairs(given, split));
      if (p == 1) CHECK(order == identity);  // one rank: nothing to balance, the order stays
    }
  // One long document first, short ones after it: the ranks holding its end did nearly everything.
  const std::vector<std::int64_t> lopsided{3072, 256, 256, 256, 256};
  const std::int64_t before = max_rank_causal_pairs(lopsided, {4, true});
  const std::int64_t after = max_rank_causal_pairs(in_order(lopsided, balanced_document_order(lopsided, {4, true})),
                                                   {4, true});
  MESSAGE("3072 + 4 x 256 on p = 4, zigzag: the most pairs on a rank " << before << " as given, " << after
                                                                        << " balanced");
  CHECK(after < before * 4 / 5);
  // The search's bound is honoured: one evaluation keeps the given order.
  CHECK(balanced_document_order(lopsided, {4, true}, 0, 1) == std::vector<std::size_t>{0, 1, 2, 3, 4});
  CHECK_THROWS_WITH_AS(balanced_document_order(lopsided, {4, true}, -1), doctest::Contains("trailing padding -1"),
                       Error);
}

TEST_CASE("pack_sequences with a group: every step a permutation of the as-packed step, the padding last, balanced") {
  Rng rng(47);
  std::vector<data::Window> windows;
  for (std::size_t i = 0; i < 80; ++i) windows.push_back({i, 0, 1 + std::int64_t(rng.below(rng.below(4) == 0 ? 400 : 40))});
  for (const int p : {2, 3, 4})
    for (const std::int64_t budget : {std::int64_t(5), std::int64_t(300), std::int64_t(1000)}) {
      CAPTURE(p);
      CAPTURE(budget);
      const SequenceSplit split{p, true};
      const std::vector<data::Step> as_packed = data::pack_sequences(windows, budget, 2 * p);
      const std::vector<data::Step> balanced =
          data::pack_sequences(windows, budget, 2 * p, {.split = split, .balanced = true});
      const std::vector<data::Step> kept =
          data::pack_sequences(windows, budget, 2 * p, {.split = split, .balanced = false});
      REQUIRE(balanced.size() == as_packed.size());
      REQUIRE(kept.size() == as_packed.size());
      std::int64_t most_before = 0, most_after = 0;
      for (std::size_t k = 0; k < as_packed.size(); ++k) {
        const data::Step &a = as_packed[k], &b = balanced[k];
        CHECK(b.length == a.length);
        CHECK(b.packed);
        std::vector<std::size_t> da, db, dk;
        for (const data::Window& w : a.rows) da.push_back(w.document);
        for (const data::Window& w : b.rows) db.push_back(w.document);
        for (const data::Window& w : kept[k].rows) dk.push_back(w.document);
        CHECK(dk == da);  // as packed: first-fit decreasing's order
        std::sort(da.begin(), da.end());
        std::sort(db.begin(), db.end());
        CHECK(db == da);
        CHECK(b.padded_tokens() == a.padded_tokens());
        if (a.padded_tokens() > 0) CHECK(b.document_lengths().back() == a.padded_tokens());  // the padding stays last
        const std::vector<std::int64_t> pa = data::rank_causal_pairs(a, split), pb = data::rank_causal_pairs(b, split);
        CHECK(std::accumulate(pb.begin(), pb.end(), std::int64_t(0)) ==
              std::accumulate(pa.begin(), pa.end(), std::int64_t(0)));  // the same work, spread differently
        CHECK(*std::max_element(pb.begin(), pb.end()) <= *std::max_element(pa.begin(), pa.end()));
        most_before += *std::max_element(pa.begin(), pa.end());
        most_after += *std::max_element(pb.begin(), pb.end());
      }
      if (budget == 1000) CHECK(most_after < most_before);  // the long windows come first as packed
    }
  const data::Step rows{{{0, 0, 3}, {1, 0, 5}}, 5};
  data::Step copy = rows;
  CHECK_THROWS_WITH_AS(data::balance_documents(copy, {2, true}), doctest::Contains("not a packed sequence"), Error);
}

TEST_CASE("a balanced packed step trains as its documents alone under ring attention and UlyssesZ (p = 3, 4)") {
  using All = AllStrategies<>;
  using Model = Gpt<All>;
  GptConfig c;
  c.layer = LayerConfig::make(48, 12);  // heads divisible by p = 1, 3, 4
  c.layer.causal = c.layer.zigzag = c.layer.rope = true;
  c.layers = 2;
  c.vocab = 256;
  const std::vector<data::Document> docs = testing::documents_of({30, 3, 4, 5, 9}, 53);
  // A long document and short ones (1 token, p - 1 tokens, ...): as packed, the long one comes first.
  const std::vector<data::Window> windows{{0, 1, 27}, {1, 0, 1}, {2, 0, 2}, {3, 0, 3}, {4, 0, 7}};
  const auto run = [&](const data::Step& step, int p, const StackPlan& plan) {
    testing::RunResult result;
    std::vector<std::int32_t> inputs, targets;
    data::step_tokens(step, docs, ops::cpu::kIgnoreIndex, inputs, targets);
    const std::vector<std::int64_t> starts = step.document_starts();
    run_ranks(p, [&](ThreadCommunicator& comm) {
      const int r = comm.rank();
      BufferPool pool;
      Model model(c, p, r, 59);
      const SequenceLayout layout(step.length, p, c.layer.zigzag);
      const Tensor<std::int32_t> x = shard_tokens(inputs, 1, layout, r), y = shard_tokens(targets, 1, layout, r);
      model.zero_gradients();
      const GptStepResult out = model.forward_backward(comm, pool, plan, step.length, x.view(), y.view(), starts);
      if (r != 0) return;
      result.loss = out.loss;
      result.counted = out.counted;
      result.replicated_grad.assign(model.replicated_gradient().span().begin(), model.replicated_gradient().span().end());
    });
    return result;
  };
  // Each document alone on one rank (zigzag: at least 2 tokens; the 1-token one padded with a masked token).
  std::vector<testing::RunResult> alone;
  for (const data::Window& w : windows)
    alone.push_back(run({{w}, std::max<std::int64_t>(w.length, 2), false}, 1, uniform_plan<All>(2, "MegatronTS")));
  for (const int p : {3, 4}) {
    CAPTURE(p);
    const std::vector<data::Step> as_packed = data::pack_sequences(windows, 64, 2 * p);
    const std::vector<data::Step> balanced = data::pack_sequences(windows, 64, 2 * p, {.split = {p, true}});
    REQUIRE(balanced.size() == 1);
    const data::Step& step = balanced[0];
    CAPTURE(fmt::format("{}", fmt::join(step.document_lengths(), ",")));
    REQUIRE(step.document_lengths() != as_packed[0].document_lengths());  // reordered
    CHECK(max_rank_causal_pairs(step.document_lengths(), {p, true}) <
          max_rank_causal_pairs(as_packed[0].document_lengths(), {p, true}));
    const testing::DocumentsMean want = testing::documents_mean(alone, step);
    for (const std::string_view strategy : {"MegatronCZ", "UlyssesZ"}) {
      CAPTURE(strategy);
      const testing::RunResult got = run(step, p, uniform_plan<All>(2, strategy));
      CHECK(got.counted == want.counted);
      CHECK(got.loss == doctest::Approx(want.loss).epsilon(1e-5));
      CHECK(testing::first_mismatch(std::span<const float>(got.replicated_grad), std::span<const double>(want.grad),
                                    testing::kFloat32) == "");
    }
  }
}

}  // namespace pack_order_test
