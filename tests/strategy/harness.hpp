// tests/strategy/harness.hpp: checks a strategy's sublayers on thread ranks against the float64 single-rank
// reference (tests/model/reference_transformer.hpp): output, input gradient and the gradient of every rank's own
// shard, over the standard cases (p in {1, 2, 3, 4, 8}, MHA/GQA with and without replicated kv heads, causal or
// not, RoPE, zigzag, GELU/SwiGLU, uneven sequence lengths, batch 1 and 2) and the packed-document cases (p in
// {1, 2, 3, 4}: a 1-token document, one shorter than p, one across a chunk boundary; causal or not, RoPE, zigzag).
//
// Use: paradyse::testing::check_sublayers<MegatronTS<>>(). Each rank collects its mismatches; the main thread checks
// them (doctest assertions are not made from rank threads).
#pragma once

#include "model/reference_transformer.hpp"
#include "support/tolerance.hpp"

#include "paradyse/comm/threads.hpp"
#include "paradyse/core/rng.hpp"
#include "paradyse/contract/weight_shards.hpp"
#include "paradyse/strategy/buffer_pool.hpp"
#include "paradyse/strategy/policy.hpp"

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <mutex>
#include <string>
#include <vector>

namespace paradyse::testing {

struct SublayerCase {
  std::string name;
  LayerConfig config;
  int ranks = 1;
  std::int64_t batch = 1;
  std::int64_t length = 8;
  std::vector<std::int64_t> documents = {};  // packed documents (starts, first 0); empty: one document
  int tp_x = 1;  // the group as a tp_x x (ranks / tp_x) grid (SublayerContext::tp_x; strategy/tp2d.hpp)
  int tp_inner = 0;  // the group's cp x tp factorisation (SublayerContext::tp_inner); 0: none
};

inline LayerConfig small_config(std::int64_t heads, std::int64_t kv_heads, std::int64_t ffn) {
  LayerConfig c;
  c.hidden = 16;
  c.heads = heads;
  c.kv_heads = kv_heads;
  c.head_dim = 4;
  c.ffn = ffn;
  return c;
}

// The cases for group size p: every feature at least once, uneven lengths throughout.
inline std::vector<SublayerCase> standard_cases(int p) {
  std::vector<SublayerCase> cases;
  auto add = [&](std::string name, LayerConfig c, std::int64_t batch, std::int64_t length) {
    cases.push_back({fmt::format("p={} {} b={} s={}", p, name, batch, length), c, p, batch, length});
  };
  LayerConfig mha = small_config(2 * p, 2 * p, 8 * p);
  add("MHA", mha, 1, 5 * p + 3);
  LayerConfig causal = mha;
  causal.causal = true;
  causal.rope = true;
  causal.zigzag = true;
  causal.norm = NormKind::rms_norm;
  add("MHA causal RoPE zigzag", causal, 2, 4 * p + 3);
  // GQA: kv heads divisible by p, or fewer than p (replicated over p / kv ranks).
  const std::int64_t kv = p <= 3 ? p : 2;
  LayerConfig gqa = small_config(2 * p, kv, 4 * p);
  gqa.activation = Activation::swiglu;
  gqa.causal = true;
  add(fmt::format("GQA kv={} causal SwiGLU", kv), gqa, 2, 3 * p + 1);
  LayerConfig gqa_rope = gqa;
  gqa_rope.causal = false;
  gqa_rope.rope = true;
  add(fmt::format("GQA kv={} RoPE SwiGLU", kv), gqa_rope, 1, 6 * p + 5);
  if (p <= 4) {  // several kv groups per rank (one attention call per group)
    LayerConfig groups = small_config(4 * p, 2 * p, 4 * p);
    groups.causal = true;
    groups.zigzag = true;
    add("GQA 2 groups/rank causal zigzag", groups, 1, 4 * p + 1);
  }
  return cases;
}

// Starts of packed documents in a sequence of `length` >= 3p + 3 tokens: a 1-token document, one of p - 1 tokens
// (shorter than the group), one of 2p + 1 (it spans a chunk boundary, contiguous or zigzag), the rest in two.
inline std::vector<std::int64_t> packed_documents(int p, std::int64_t length) {
  const std::int64_t lengths[] = {1, std::max(p - 1, 1), 2 * p + 1};
  std::vector<std::int64_t> starts{0};
  for (std::int64_t l : lengths) starts.push_back(starts.back() + l);
  const std::int64_t rest = length - starts.back();
  REQUIRE(rest >= 2);
  starts.push_back(starts.back() + rest / 2);
  return starts;
}

// Packed-document cases for group size p: causal with RoPE (zigzag and contiguous), non-causal with RoPE, GQA.
inline std::vector<SublayerCase> packed_cases(int p) {
  std::vector<SublayerCase> cases;
  auto add = [&](std::string name, LayerConfig c, std::int64_t batch, std::int64_t length) {
    const std::vector<std::int64_t> docs = packed_documents(p, length);
    cases.push_back({fmt::format("p={} {} b={} s={} documents {}", p, name, batch, length, fmt::join(docs, ",")), c, p,
                     batch, length, docs});
  };
  LayerConfig causal = small_config(2 * p, 2 * p, 4 * p);
  causal.causal = true;
  causal.rope = true;
  causal.zigzag = true;
  add("MHA causal RoPE zigzag", causal, 2, 5 * p + 3);
  const std::int64_t kv = p <= 3 ? p : 2;
  LayerConfig gqa = small_config(2 * p, kv, 4 * p);
  gqa.causal = true;
  gqa.rope = true;
  gqa.activation = Activation::swiglu;
  add(fmt::format("GQA kv={} causal RoPE", kv), gqa, 1, 4 * p + 5);
  LayerConfig bidirectional = small_config(2 * p, 2 * p, 4 * p);
  bidirectional.rope = true;
  add("MHA non-causal RoPE", bidirectional, 1, 3 * p + 4);
  return cases;
}

// The cases of 2-D tensor-parallel grids of tp_x = x (strategy/tp2d.hpp), named `group`, over p ranks: one grid
// (Tp2d, tp_inner = 0) or a cp ring of them (RingTp2d, tp_inner = the grid's size). MHA GELU, causal RoPE zigzag (rms
// norm, b = 2), GQA SwiGLU with kv_heads = p, packed documents: token counts multiples of p (2p under zigzag), h of x.
inline std::vector<SublayerCase> grid_cases(const std::string& group, int p, int x, int tp_inner) {
  std::vector<SublayerCase> cases;
  auto add = [&](std::string name, LayerConfig c, std::int64_t batch, std::int64_t length,
                 std::vector<std::int64_t> documents = {}) {
    c.hidden = 6 * x;  // h % tp_x == 0
    cases.push_back({fmt::format("{} {} b={} s={}{}", group, name, batch, length,
                                 documents.empty() ? "" : fmt::format(" documents {}", fmt::join(documents, ","))),
                     c, p, batch, length, documents, x, tp_inner});
  };
  add("MHA GELU", small_config(2 * p, 2 * p, 4 * p), 2, 2 * p);
  LayerConfig causal = small_config(p, p, 2 * p);
  causal.causal = true;
  causal.rope = true;
  causal.zigzag = true;
  causal.norm = NormKind::rms_norm;
  add("MHA causal RoPE zigzag", causal, 2, 4 * p);
  LayerConfig gqa = small_config(2 * p, p, 4 * p);
  gqa.activation = Activation::swiglu;
  gqa.causal = true;
  gqa.rope = true;
  add(fmt::format("GQA kv={} causal RoPE SwiGLU", p), gqa, 1, 3 * p);
  add("MHA causal RoPE zigzag", causal, 1, 4 * p, packed_documents(p, 4 * p));
  return cases;
}

// Global inputs of one case: random weights (norms included), x and dy: [b, s, h].
struct Problem {
  LayerConfig config;
  GlobalLayerWeights<double> weights;
  Tensor<double> x, dy;
};

inline Problem make_problem(const LayerConfig& c, std::int64_t batch, std::int64_t length, std::uint64_t seed) {
  Rng rng(seed);
  Problem problem{c, init_global<double>(c, seed), {}, {}};
  for (Tensor<double>* m : {&problem.weights.norm1_gamma, &problem.weights.norm2_gamma}) rng.fill_uniform(m->span(), 0.5, 1.5);
  for (Tensor<double>* m : {&problem.weights.norm1_beta, &problem.weights.norm2_beta}) rng.fill_uniform(m->span(), -0.5, 0.5);
  problem.x = random_uniform<double>(Shape{batch, length, c.hidden}, rng);
  problem.dy = random_uniform<double>(Shape{batch, length, c.hidden}, rng);
  return problem;
}

// Rank r's tokens [b, n_r, h] of a global [b, s, h] tensor, as float.
inline Tensor<float> local_tokens(const Tensor<double>& global, const SequenceLayout& layout, int rank) {
  const std::int64_t b = global.extent(0), h = global.extent(2), n = layout.local_length(rank);
  Tensor<float> local(Shape{b, n, h});
  for (std::int64_t i = 0; i < b; ++i)
    for (std::int64_t t = 0; t < n; ++t) {
      const std::int64_t position = layout.position(rank, t);
      for (std::int64_t c = 0; c < h; ++c) local(i, t, c) = float(global(i, position, c));
    }
  return local;
}

// Mismatches collected on the rank threads and checked on the main thread.
class Findings {
public:
  template <class Got, class Want>
  void compare(const Got& got, const Want& want, const std::string& what, Tolerance tol = kFloat32) {
    using G = std::remove_cvref_t<decltype(*std::data(got))>;
    using W = std::remove_cvref_t<decltype(*std::data(want))>;
    std::string miss = first_mismatch(std::span<const G>(std::data(got), std::size(got)),
                                      std::span<const W>(std::data(want), std::size(want)), tol);
    if (miss.empty()) return;
    std::lock_guard lock(mutex_);
    messages_.push_back(what + ": " + miss);
  }
  void compare(const Tensor<float>& got, const Tensor<double>& want_global, const SequenceLayout& layout, int rank,
               const std::string& what) {
    const Tensor<float> want = local_tokens(want_global, layout, rank);
    compare(got.span(), want.span(), what, kFloat32);
  }
  void fail(const std::string& message) {
    std::lock_guard lock(mutex_);
    messages_.push_back(message);
  }
  // doctest checks, on the calling (main) thread.
  void check_all(const std::string& context) const {
    INFO(context);
    for (const std::string& m : messages_) CHECK_MESSAGE(false, m);
    CHECK(messages_.empty());
  }

private:
  std::mutex mutex_;
  std::vector<std::string> messages_;
};

enum class Sublayer { attention, mlp };

// Runs forward and backward of one sublayer of strategy S on p thread ranks and compares with the reference.
// Returns the per-rank peak bytes.
template <class S>
std::vector<std::size_t> check_sublayer(const SublayerCase& test, Sublayer which, std::uint64_t seed = 1) {
  const LayerConfig& c = test.config;
  const Problem problem = make_problem(c, test.batch, test.length, seed);
  GlobalLayerWeights<double> dw(c);
  Tensor<double> y_ref, dx_ref;
  if (which == Sublayer::attention) {
    y_ref = ref::attention_forward(c, problem.weights, problem.x, test.documents);
    dx_ref = ref::attention_backward(c, problem.weights, problem.x, problem.dy, dw, test.documents);
    if (!test.documents.empty()) {  // the documents must matter, or the case could not catch a strategy ignoring them
      const Tensor<double> unpacked = ref::attention_forward(c, problem.weights, problem.x);
      CHECK_MESSAGE(!first_mismatch(std::span<const double>(unpacked.span()), std::span<const double>(y_ref.span()), kFloat32).empty(),
                    "packed documents leave the reference unchanged: ", test.name);
    }
  } else {
    y_ref = ref::mlp_forward(c, problem.weights, problem.x);
    dx_ref = ref::mlp_backward(c, problem.weights, problem.x, problem.dy, dw);
  }
  Findings findings;
  const int p = test.ranks;
  const RunReport report = run_ranks(p, [&](ThreadCommunicator& comm) {
    const int r = comm.rank();
    BufferPool pool;
    SublayerContext ctx(c, p, test.batch, test.length, pool);
    ctx.set_documents(test.documents);
    ctx.tp_x = test.tp_x;
    ctx.tp_inner = test.tp_inner;
    const LayerWeights weights = shard_of(problem.weights, c, p, r);
    LayerWeights grads(c, p);
    const Tensor<float> x = local_tokens(problem.x, ctx.sequence, r), dy = local_tokens(problem.dy, ctx.sequence, r);
    Tensor<float> y(x.shape()), dx(x.shape());
    const S strategy;
    require(strategy.supports(ctx));
    const LayerWeights want = shard_of(dw, c, p, r);
    const std::string where = fmt::format("{} rank {}", S::name, r);
    if (which == Sublayer::attention) {
      auto saved = strategy.attention_forward(comm, ctx, weights.attention, x.view(), y.view());
      strategy.attention_backward(comm, ctx, weights.attention, saved, dy.view(), dx.view(), grads.attention);
      findings.compare(grads.attention.packed.span(), want.attention.packed.span(), where + " attention weight gradient");
    } else {
      auto saved = strategy.mlp_forward(comm, ctx, weights.mlp, x.view(), y.view());
      strategy.mlp_backward(comm, ctx, weights.mlp, saved, dy.view(), dx.view(), grads.mlp);
      findings.compare(grads.mlp.packed.span(), want.mlp.packed.span(), where + " mlp weight gradient");
    }
    findings.compare(y, y_ref, ctx.sequence, r, where + " output");
    findings.compare(dx, dx_ref, ctx.sequence, r, where + " input gradient");
    if (pool.stats().in_use_bytes != 0) findings.fail(fmt::format("{}: {} pool bytes still on loan", where, pool.stats().in_use_bytes));
  });
  findings.check_all(fmt::format("{} {} {}", S::name, which == Sublayer::attention ? "attention" : "mlp", test.name));
  return report.peak_bytes;
}

// A thread communicator that counts the splits made from it and from the groups split from it (in *splits).
struct SplitCounting : ThreadCommunicator {
  int* splits;
  SplitCounting(ThreadCommunicator comm, int* counter) : ThreadCommunicator(std::move(comm)), splits(counter) {}
  SplitCounting split(int color, int key) {
    ++*splits;
    return {ThreadCommunicator::split(color, key), splits};
  }
};

// Strategy S's sub-groups come from the context's held grid (comm/grid_groups.hpp's AnyGridGroups, as the layer
// stack holds it), split once: the grid made once (two splits: inner and outer), then both sublayers' forward and
// backward, `calls` times, split nothing more, and give bit for bit what the same calls give with none held (each
// splitting for itself, four splits per sublayer). With tp_inner and tp_x both set (RingTp2d), the tp sub-group's own
// grid too (tp_grid_groups): twice the splits.
template <class S>
void check_grid_split_once(const SublayerCase& test, int calls = 3) {
  const LayerConfig& c = test.config;
  const Problem problem = make_problem(c, test.batch, test.length, 7);
  const int p = test.ranks;
  Findings findings;
  run_ranks(p, [&](ThreadCommunicator& threads) {
    int splits = 0;
    SplitCounting comm(threads.split(0, threads.rank()), &splits);
    const int r = comm.rank();
    BufferPool pool;
    SublayerContext ctx(c, p, test.batch, test.length, pool);
    ctx.tp_x = test.tp_x;
    ctx.tp_inner = test.tp_inner;
    const LayerWeights weights = shard_of(problem.weights, c, p, r);
    const Tensor<float> x = local_tokens(problem.x, ctx.sequence, r), dy = local_tokens(problem.dy, ctx.sequence, r);
    const S strategy;
    // y and dx of both sublayers, and the weight gradients after them: with or without the held grid.
    const int levels = ctx.tp_inner > 0 && ctx.tp_x > 1 ? 2 : 1;
    const auto run = [&](const AnyGridGroups* held, const AnyGridGroups* held_grid) {
      ctx.tp_inner_groups = ctx.tp_inner > 0 ? held : nullptr;
      ctx.tp_x_groups = ctx.tp_x > 1 ? held : nullptr;
      ctx.tp_grid_groups = held_grid;
      LayerWeights grads(c, p);
      std::vector<Tensor<float>> out;
      for (int i = 0; i < 4; ++i) out.emplace_back(x.shape());
      auto a = strategy.attention_forward(comm, ctx, weights.attention, x.view(), out[0].view());
      strategy.attention_backward(comm, ctx, weights.attention, a, dy.view(), out[1].view(), grads.attention);
      auto m = strategy.mlp_forward(comm, ctx, weights.mlp, x.view(), out[2].view());
      strategy.mlp_backward(comm, ctx, weights.mlp, m, dy.view(), out[3].view(), grads.mlp);
      out.push_back(std::move(grads.attention.packed));
      out.push_back(std::move(grads.mlp.packed));
      return out;
    };
    const std::vector<Tensor<float>> alone = run(nullptr, nullptr);
    if (splits != 8 * levels)
      findings.fail(fmt::format("{} rank {}: {} splits with no grid held, expected {}", S::name, r, splits, 8 * levels));
    splits = 0;
    const AnyGridGroups held(comm, ctx.tp_inner > 0 ? ctx.tp_inner : ctx.tp_x);
    const AnyGridGroups held_grid =
        levels == 2 ? AnyGridGroups(held.of(comm, ctx.tp_inner).inner, ctx.tp_x) : AnyGridGroups();
    for (int call = 0; call < calls; ++call) {
      const std::vector<Tensor<float>> kept = run(&held, levels == 2 ? &held_grid : nullptr);
      for (std::size_t i = 0; i < kept.size(); ++i)
        if (!std::equal(kept[i].span().begin(), kept[i].span().end(), alone[i].span().begin()))
          findings.fail(fmt::format("{} rank {} call {}: result {} differs with the held grid", S::name, r, call, i));
    }
    if (splits != 2 * levels)
      findings.fail(fmt::format("{} rank {}: the grid and {} calls of both sublayers split {} times, expected {}",
                                S::name, r, calls, splits, 2 * levels));
  });
  findings.check_all(fmt::format("{} split once: {}", S::name, test.name));
}

// Every packed-document case, both sublayers, p in {1, 2, 3, 4}.
template <class S>
void check_packed_sublayers() {
  for (int p : {1, 2, 3, 4})
    for (const SublayerCase& test : packed_cases(p)) {
      check_sublayer<S>(test, Sublayer::attention);
      check_sublayer<S>(test, Sublayer::mlp);
    }
}

// Every standard case, both sublayers, p in {1, 2, 3, 4, 8}.
template <class S>
void check_sublayers() {
  for (int p : {1, 2, 3, 4, 8})
    for (const SublayerCase& test : standard_cases(p)) {
      check_sublayer<S>(test, Sublayer::attention);
      check_sublayer<S>(test, Sublayer::mlp);
    }
}

}  // namespace paradyse::testing
