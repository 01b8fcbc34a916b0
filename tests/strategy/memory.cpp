// The MemoryTracker's per-rank peak of every strategy in the list, recorded per sublayer on one shape (p = 4, a
// sequence long enough that activations dominate the weights), each run also checked against the reference. The
// relations asserted are the structural ones: METP never duplicates a tensor, so its peak is the lowest;
// ColossalZ keeps the s x s/p score block, so its attention peak is the highest.
#include "paradyse/strategy/strategies.hpp"

#include "strategy/harness.hpp"

#include <doctest/doctest.h>

#include <algorithm>

using namespace paradyse;
using namespace paradyse::testing;
using Strategies = AllStrategies<>;

TEST_CASE("memory: per-rank peak of every strategy, per sublayer (p = 4, s = 384, h = 64, 8 heads)") {
  LayerConfig c = small_config(8, 8, 256);
  c.hidden = 64;
  c.head_dim = 8;
  c.causal = true;
  c.zigzag = true;
  const SublayerCase test{"memory", c, 4, 1, 384};
  std::array<std::size_t, Strategies::count> attention{}, mlp{};
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    ((attention[I] = std::ranges::max(check_sublayer<std::variant_alternative_t<I, Strategies::Policy>>(test, Sublayer::attention))),
     ...);
    ((mlp[I] = std::ranges::max(check_sublayer<std::variant_alternative_t<I, Strategies::Policy>>(test, Sublayer::mlp))), ...);
  }(std::make_index_sequence<Strategies::count>{});
  std::string table = "peak bytes per rank (attention, mlp):";
  for (std::size_t k = 0; k < Strategies::count; ++k)
    table += fmt::format("\n  {:>11} {:>9} {:>9}", Strategies::name(k), attention[k], mlp[k]);
  MESSAGE(table);
  const std::size_t metp = Strategies::index_of("METP"), colossal = Strategies::index_of("ColossalZ");
  for (std::size_t k = 0; k < Strategies::count; ++k) {
    CAPTURE(Strategies::name(k));
    CHECK(attention[metp] <= attention[k]);
    CHECK(mlp[metp] <= mlp[k]);
    CHECK(attention[colossal] >= attention[k]);
  }
}
