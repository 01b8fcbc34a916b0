// Uses the installed headers: a tensor through the memory tracker, an all-reduce on 3 thread ranks, a JSON round
// trip (core/json.hpp needs the package's nlohmann_json dependency), and a strategy: UlyssesZ's and MegatronTS's
// attention forward and backward on 2 thread ranks (causal, RoPE, zigzag, an uneven 11 tokens) against the same
// sublayer on 1 rank: every rank's output and input gradient equal the 1-rank run's at the rank's token positions,
// and the ranks' weight-shard gradients hold, together, the 1-rank gradient's elements (sum and sum of squares).
#include <paradyse/comm/threads.hpp>
#include <paradyse/contract/weight_shards.hpp>
#include <paradyse/core/json.hpp>
#include <paradyse/core/rng.hpp>
#include <paradyse/core/tensor.hpp>
#include <paradyse/strategy/megatron_ts.hpp>
#include <paradyse/strategy/ulysses_z.hpp>

#include <array>
#include <cmath>
#include <cstdio>
#include <string>

namespace {

using namespace paradyse;

struct Run {
  Tensor<float> y, dx;    // [1, s, h], global token order
  double grad_sum = 0, grad_squares = 0;  // over every rank's attention shard gradient
};

// One attention forward + backward of strategy S on p thread ranks; x and dy: [1, s, h] in global order.
template <class S>
Run attention_on(int p, const LayerConfig& c, const Tensor<float>& x, const Tensor<float>& dy) {
  const std::int64_t s = x.extent(1), h = c.hidden;
  Run run{Tensor<float>(x.shape()), Tensor<float>(x.shape())};
  std::array<double, 2> grad_totals{0, 0};
  run_ranks(p, [&](ThreadCommunicator& comm) {
    const int r = comm.rank();
    BufferPool pool;
    const SublayerContext ctx(c, p, 1, s, pool);
    require(S{}.supports(ctx));
    const LayerWeights w = init_shard(c, p, r, 42);  // the same global model for every p
    LayerWeights grad(c, p);
    const std::int64_t n = ctx.local_tokens(r);
    Tensor<float> xl(Shape{1, n, h}), dyl(Shape{1, n, h}), yl(Shape{1, n, h}), dxl(Shape{1, n, h});
    for (std::int64_t i = 0; i < n; ++i)
      for (std::int64_t k = 0; k < h; ++k) {
        xl(0, i, k) = x(0, ctx.sequence.position(r, i), k);
        dyl(0, i, k) = dy(0, ctx.sequence.position(r, i), k);
      }
    const S strategy;
    auto saved = strategy.attention_forward(comm, ctx, w.attention, xl.view(), yl.view());
    strategy.attention_backward(comm, ctx, w.attention, saved, dyl.view(), dxl.view(), grad.attention);
    for (std::int64_t i = 0; i < n; ++i)  // each rank writes its own token positions
      for (std::int64_t k = 0; k < h; ++k) {
        run.y(0, ctx.sequence.position(r, i), k) = yl(0, i, k);
        run.dx(0, ctx.sequence.position(r, i), k) = dxl(0, i, k);
      }
    std::array<double, 2> mine{0, 0};
    for (float g : grad.attention.packed.span()) {
      mine[0] += g;
      mine[1] += double(g) * g;
    }
    comm.all_reduce(std::span<const double>(mine), std::span<double>(mine), ReduceOp::sum);
    if (r == 0) grad_totals = mine;
  });
  run.grad_sum = grad_totals[0];
  run.grad_squares = grad_totals[1];
  return run;
}

bool close(double got, double want) { return std::abs(got - want) <= 1e-4 + 1e-3 * std::abs(want); }

template <class S>
bool strategy_matches_one_rank(const LayerConfig& c, const Tensor<float>& x, const Tensor<float>& dy) {
  const Run one = attention_on<S>(1, c, x, dy), two = attention_on<S>(2, c, x, dy);
  bool ok = close(two.grad_sum, one.grad_sum) && close(two.grad_squares, one.grad_squares);
  for (std::int64_t i = 0; i < x.numel(); ++i)
    ok = ok && close(two.y.span()[std::size_t(i)], one.y.span()[std::size_t(i)]) &&
         close(two.dx.span()[std::size_t(i)], one.dx.span()[std::size_t(i)]);
  std::printf("package consumer: %s attention on 2 ranks vs 1: %s\n", std::string(S::name).c_str(), ok ? "ok" : "WRONG");
  return ok;
}

}  // namespace

int main() {
  bool ok = true;
  run_ranks(3, [&](ThreadCommunicator& comm) {
    Tensor<float> x({4});
    x.fill(float(comm.rank() + 1));
    comm.all_reduce(x.span(), x.span(), ReduceOp::sum);
    if (x(0) != 6.0f) ok = false;
  });
  const json::Value doc = json::parse(json::dump(json::Value{{"rate", 0.1}}));
  if (json::Field(doc, "consumer")["rate"].number() != 0.1) ok = false;

  LayerConfig c = LayerConfig::make(16, 4);
  c.causal = c.rope = c.zigzag = true;
  Rng rng(7);
  Tensor<float> x(Shape{1, 11, 16}), dy(Shape{1, 11, 16});
  rng.fill_uniform(x.span());
  rng.fill_uniform(dy.span());
  ok = strategy_matches_one_rank<UlyssesZ<>>(c, x, dy) && ok;
  ok = strategy_matches_one_rank<MegatronTS<>>(c, x, dy) && ok;
  std::printf("package consumer: %s\n", ok ? "ok" : "WRONG");
  return ok ? 0 : 1;
}
