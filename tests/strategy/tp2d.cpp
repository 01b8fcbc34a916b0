// Tp2d (strategy/tp2d.hpp), 2-D tensor parallelism in the unified layout, against the float64 single-rank reference:
// output, input gradient and every rank's unified shard gradient, both sublayers, grids 2x2, 2x3, 3x2 and 4x2
// (tp_x x tp_y): MHA GELU, causal RoPE zigzag (rms norm, b = 2), GQA SwiGLU, GQA with several kv groups per rank,
// packed documents; and its refusals (no grid, uneven tokens, replicated kv heads), each naming the sizes.
#include "paradyse/strategy/tp2d.hpp"

#include "strategy/harness.hpp"

#include <doctest/doctest.h>
#include <fmt/format.h>

#include <string>
#include <utility>
#include <vector>

using namespace paradyse;
using namespace paradyse::testing;

namespace {

const std::vector<std::pair<int, int>> kTp2dGrids{{2, 2}, {2, 3}, {3, 2}, {4, 2}};

// The cases of a tp_x x tp_y grid (C ranks): grid_cases' and GQA with several kv groups per rank.
std::vector<SublayerCase> tp2d_grid_cases(int x, int y) {
  const int p = x * y;
  std::vector<SublayerCase> cases = grid_cases(fmt::format("grid {}x{}", x, y), p, x, 0);
  LayerConfig groups = small_config(4 * p, 2 * p, 2 * p);
  groups.hidden = 6 * x;
  groups.causal = true;
  groups.zigzag = true;
  cases.push_back({fmt::format("grid {}x{} GQA 2 groups/rank causal zigzag b=1 s={}", x, y, 2 * p), groups, p, 1, 2 * p,
                   {}, x});
  return cases;
}

std::string tp2d_refusal(const SublayerCase& test) {
  BufferPool pool;
  SublayerContext ctx(test.config, test.ranks, test.batch, test.length, pool);
  ctx.tp_x = test.tp_x;
  return Tp2d<>().supports(ctx).reason;
}

}  // namespace

TEST_CASE("Tp2d: both sublayers match the float64 reference on grids 2x2, 2x3, 3x2 and 4x2") {
  for (const auto& [x, y] : kTp2dGrids)
    for (const SublayerCase& test : tp2d_grid_cases(x, y)) {
      check_sublayer<Tp2d<>>(test, Sublayer::attention);
      check_sublayer<Tp2d<>>(test, Sublayer::mlp);
    }
}

TEST_CASE("Tp2d: refuses, naming the sizes, a group without a grid, uneven tokens and replicated kv heads") {
  SublayerCase test{"", small_config(4, 4, 8), 4, 1, 8, {}, 2};
  test.config.hidden = 12;
  CHECK(tp2d_refusal(test).empty());
  test.tp_x = 1;
  CHECK(tp2d_refusal(test).find("tp_x = 1 must be > 1") != std::string::npos);
  test.tp_x = 3;
  CHECK(tp2d_refusal(test).find("divide it") != std::string::npos);
  test.tp_x = 2;
  test.length = 10;  // 10 tokens over 4 ranks: 3, 3, 2, 2
  CHECK(tp2d_refusal(test).find("s = 10 splits unevenly over 4 ranks") != std::string::npos);
  test.length = 8;
  test.config.zigzag = true;  // 8 tokens in 8 chunks: even
  CHECK(tp2d_refusal(test).empty());
  test.config.zigzag = false;
  test.config.kv_heads = 2;  // replicated over 2 ranks each
  CHECK(tp2d_refusal(test).find("kv_heads = 2 must be divisible by the group size 4") != std::string::npos);
  test.config.kv_heads = 4;
  test.config.hidden = 13;
  CHECK(tp2d_refusal(test).find("hidden = 13 must be divisible by tp_x = 2") != std::string::npos);
}

TEST_CASE("Tp2d: the tp_x and tp_y groups come from the held grid (as the stack holds it), split once for every "
          "call (2x2, 3x2)") {
  check_grid_split_once<Tp2d<>>(tp2d_grid_cases(2, 2)[2]);
  check_grid_split_once<Tp2d<>>(tp2d_grid_cases(3, 2)[1]);
}
