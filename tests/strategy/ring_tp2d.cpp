// RingTp2d (strategy/ring_tp2d.hpp), a cp ring of 2-D tensor-parallel grids, against the float64 single-rank
// reference: output, input gradient and every rank's unified shard gradient, both sublayers, cp x (tp_x x tp_y) =
// 2 x 2x1, 2 x 2x2, 3 x 2x1, 2 x 4x1 and 1 x 2x2: MHA GELU, causal RoPE zigzag (rms norm, b = 2), GQA SwiGLU, packed
// documents; selective recomputation bit for bit the kept activations' run; the groups split once when held; its
// refusals (no grid inside the cp group, tp_x = 1, uneven tokens, replicated kv heads), each naming the sizes.
#include "paradyse/strategy/ring_tp2d.hpp"

#include "strategy/harness.hpp"

#include <doctest/doctest.h>
#include <fmt/format.h>

#include <algorithm>
#include <string>
#include <tuple>
#include <vector>

using namespace paradyse;
using namespace paradyse::testing;

namespace {

// cp x (tp_x x tp_y).
const std::vector<std::tuple<int, int, int>> kRingTp2dShapes{{2, 2, 1}, {2, 2, 2}, {3, 2, 1}, {2, 4, 1}, {1, 2, 2}};

// The cases of a cp x (x x y) group: grid_cases over p = cp x y ranks, the grid's size x y the factorisation.
std::vector<SublayerCase> ring_tp2d_cases(int cp, int x, int y) {
  return grid_cases(fmt::format("cp {} x grid {}x{}", cp, x, y), cp * x * y, x, x * y);
}

std::string ring_tp2d_refusal(const SublayerCase& test) {
  BufferPool pool;
  SublayerContext ctx(test.config, test.ranks, test.batch, test.length, pool);
  ctx.tp_x = test.tp_x;
  ctx.tp_inner = test.tp_inner;
  return RingTp2d<>().supports(ctx).reason;
}

// Attention forward and backward with the core dropped after forward and re-run before backward gives bit for bit
// what keeping it gives: y, dx and the weight gradient.
void check_recompute_bitwise(const SublayerCase& test) {
  const LayerConfig& c = test.config;
  const Problem problem = make_problem(c, test.batch, test.length, 11);
  Findings findings;
  run_ranks(test.ranks, [&](ThreadCommunicator& comm) {
    const int r = comm.rank();
    BufferPool pool;
    SublayerContext ctx(c, test.ranks, test.batch, test.length, pool);
    ctx.set_documents(test.documents);
    ctx.tp_x = test.tp_x;
    ctx.tp_inner = test.tp_inner;
    const LayerWeights weights = shard_of(problem.weights, c, test.ranks, r);
    const Tensor<float> x = local_tokens(problem.x, ctx.sequence, r), dy = local_tokens(problem.dy, ctx.sequence, r);
    const RingTp2d<> strategy;
    const auto run = [&](bool recompute) {
      std::vector<Tensor<float>> out;
      for (int i = 0; i < 2; ++i) out.emplace_back(x.shape());
      LayerWeights grads(c, test.ranks);
      auto saved = strategy.attention_forward(comm, ctx, weights.attention, x.view(), out[0].view());
      if (recompute) {
        RingTp2d<>::drop_attention_core(saved);
        if (saved.out.data() != nullptr || saved.lse.data() != nullptr) findings.fail(fmt::format("rank {}: core kept", r));
        strategy.recompute_attention_core(comm, ctx, weights.attention, saved);
      }
      strategy.attention_backward(comm, ctx, weights.attention, saved, dy.view(), out[1].view(), grads.attention);
      out.push_back(std::move(grads.attention.packed));
      return out;
    };
    const std::vector<Tensor<float>> kept = run(false), rerun = run(true);
    for (std::size_t i = 0; i < kept.size(); ++i)
      if (!std::equal(kept[i].span().begin(), kept[i].span().end(), rerun[i].span().begin()))
        findings.fail(fmt::format("rank {}: result {} differs when the core is recomputed", r, i));
  });
  findings.check_all(fmt::format("RingTp2d recompute: {}", test.name));
}

}  // namespace

TEST_CASE("RingTp2d: both sublayers match the float64 reference on cp x grid 2 x 2x1, 2 x 2x2, 3 x 2x1, 2 x 4x1, "
          "1 x 2x2") {
  for (const auto& [cp, x, y] : kRingTp2dShapes)
    for (const SublayerCase& test : ring_tp2d_cases(cp, x, y)) {
      check_sublayer<RingTp2d<>>(test, Sublayer::attention);
      check_sublayer<RingTp2d<>>(test, Sublayer::mlp);
    }
}

TEST_CASE("RingTp2d: selective recomputation of the ring core is bit for bit the kept activations' run") {
  check_recompute_bitwise(ring_tp2d_cases(2, 2, 2)[1]);
  check_recompute_bitwise(ring_tp2d_cases(2, 2, 1)[3]);
}

TEST_CASE("RingTp2d: refuses, naming the sizes, no grid inside the cp group, uneven tokens and replicated kv heads") {
  SublayerCase test{"", small_config(8, 8, 16), 8, 1, 16, {}, 2, 4};
  test.config.hidden = 12;
  CHECK(ring_tp2d_refusal(test).empty());
  test.tp_x = 1;  // a 1-D tp inside cp is MegatronRing's
  CHECK(ring_tp2d_refusal(test).find("tp_inner = 4 (the grid's size) must divide it and tp_x = 1 must be > 1") !=
        std::string::npos);
  test.tp_x = 2;
  test.tp_inner = 0;
  CHECK(ring_tp2d_refusal(test).find("group of 8 ranks: tp_inner = 0") != std::string::npos);
  test.tp_inner = 4;
  test.length = 12;  // 12 tokens over 8 ranks
  CHECK(ring_tp2d_refusal(test).find("s = 12 splits unevenly over 8 ranks") != std::string::npos);
  test.length = 16;
  test.config.kv_heads = 4;  // replicated over 2 ranks each
  CHECK(ring_tp2d_refusal(test).find("kv_heads = 4 must be divisible by the group size 8") != std::string::npos);
  test.config.kv_heads = 8;
  test.config.hidden = 13;
  CHECK(ring_tp2d_refusal(test).find("hidden = 13 must be divisible by tp_x = 2") != std::string::npos);
}

TEST_CASE("RingTp2d: its cp and grid groups and the grid's tp_x and tp_y come from the held grids (as the stack holds "
          "them), split once for every call (cp 2 x 2x2, 3 x 2x1)") {
  check_grid_split_once<RingTp2d<>>(ring_tp2d_cases(2, 2, 2)[2]);
  check_grid_split_once<RingTp2d<>>(ring_tp2d_cases(3, 2, 1)[1]);
}
