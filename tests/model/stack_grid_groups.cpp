// The layer stack holds its group's grid sub-groups (model/stack.hpp's set_tp_inner / set_tp_x, comm/grid_groups.hpp's
// AnyGridGroups): split when the factorisation is set, with the group in hand, once for both when tp_inner = tp_x
// (and then, tp_x dividing tp_inner, the tp sub-group's own tp_x x tp_y grid for RingTp2d: two more splits);
// a step's MegatronRing and Tp2d layers (forward and backward) split nothing; a new inner size splits its grid anew
// and the other factorisation keeps its own; a stack run on a group its grid was not split from is refused by name.
#include "paradyse/comm/threads.hpp"
#include "paradyse/core/rng.hpp"
#include "paradyse/model/stack.hpp"
#include "paradyse/strategy/sequence_layout.hpp"
#include "paradyse/strategy/strategies.hpp"
#include "strategy/harness.hpp"  // testing::SplitCounting

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <array>
#include <string>

TEST_CASE("the layer stack splits its grid sub-groups when the factorisation is set, once, and a step splits none") {
  using namespace paradyse;
  using Strategies = MeshStrategies<>;
  LayerConfig config = LayerConfig::make(32, 4);
  config.causal = config.zigzag = config.rope = true;
  const int p = 4;
  const std::int64_t seq = 16;
  // Layer 0 MegatronRing (tp_inner), layer 1 Tp2d (tp_x).
  const std::size_t ring = Strategies::index_of("MegatronRing"), tp2d = Strategies::index_of("Tp2d");
  const StackPlan plan{{ring, ring, 0}, {tp2d, tp2d, 0}};
  // Splits after: set_tp_inner(2), set_tp_x(2), two steps, set_tp_x(4), set_tp_inner(2) again, two more steps.
  std::array<std::array<int, 6>, p> counts{};
  std::array<std::string, p> refusals;
  run_ranks(p, [&](ThreadCommunicator& threads) {
    int splits = 0;
    testing::SplitCounting comm(threads.split(0, threads.rank()), &splits);
    const int r = comm.rank();
    TransformerStack<Strategies> stack(config, 2, p, r, 5);
    BufferPool pool;
    const std::int64_t n = SequenceLayout(seq, p, config.zigzag).local_length(r);
    Tensor<float> x(Shape{1, n, config.hidden}), y(x.shape()), dy(x.shape()), dx(x.shape());
    Rng rng(90 + std::uint64_t(r));
    rng.fill_uniform(x.span());
    rng.fill_uniform(dy.span());
    const auto steps = [&] {
      for (int k = 0; k < 2; ++k) {
        stack.forward(comm, pool, plan, seq, TensorView<const float>(x.view()), y.view());
        stack.backward(comm, pool, TensorView<const float>(dy.view()), dx.view());
      }
    };
    std::array<int, 6>& count = counts[std::size_t(r)];
    stack.set_tp_inner(comm, 2);
    count[0] = splits;
    stack.set_tp_x(comm, 2);  // the same 2 x 2 grid: shared; the tp sub-group's 2 x 1 grid split (RingTp2d's)
    count[1] = splits;
    steps();
    count[2] = splits;
    stack.set_tp_x(comm, 4);  // a 4 x 1 grid of its own; 4 does not divide tp_inner = 2: no RingTp2d grid
    count[3] = splits;
    stack.set_tp_inner(comm, 2);  // kept
    count[4] = splits;
    steps();
    count[5] = splits;
    // Run on another group (the plain thread group, another communicator type) than its grids were split from.
    try {
      stack.forward(threads, pool, plan, seq, TensorView<const float>(x.view()), y.view());
    } catch (const Error& e) {
      refusals[std::size_t(r)] = e.what();
    }
  });
  for (int r = 0; r < p; ++r) {
    CAPTURE(r);
    CHECK(fmt::format("{}", fmt::join(counts[std::size_t(r)], " ")) == "2 4 4 6 6 6");
    CHECK(refusals[std::size_t(r)].find("grid sub-groups: held a grid of 4 ranks with inner = 2") != std::string::npos);
  }
}
