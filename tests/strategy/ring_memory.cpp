// The ring strategies' memory, measured by the rank trackers on one long-sequence case (and checked against the
// float64 reference on it too): the per-rank peaks follow the strategies' designs.
//   attention: METP (one head group's q|k|v at a time) < MegatronCZ (every head's q|k|v saved) < ColossalZ (the
//   s x s/p probabilities saved);
//   mlp: METP (one f/p block) < the ZeRO-3 MLP of MegatronCZ and ColossalZ (the full-width pre-activation saved, the
//   whole W_out gathered).
#include "paradyse/strategy/colossal_z.hpp"
#include "paradyse/strategy/megatron_cz.hpp"
#include "paradyse/strategy/metp.hpp"

#include "strategy/harness.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <string>

namespace {

using namespace paradyse;
using testing::Sublayer;

template <class S>
std::size_t peak(const testing::SublayerCase& test, Sublayer which) {
  const std::vector<std::size_t> peaks = testing::check_sublayer<S>(test, which, 3);
  return *std::max_element(peaks.begin(), peaks.end());
}

}  // namespace

TEST_CASE("ring strategies: per-rank peak memory on a long sequence (p = 4, s = 256, causal zigzag)") {
  testing::SublayerCase test;
  test.config = testing::small_config(8, 8, 128);
  test.config.hidden = 32;
  test.config.causal = true;
  test.config.zigzag = true;
  test.ranks = 4;
  test.batch = 1;
  test.length = 256;
  test.name = "p=4 MHA causal zigzag s=256";
  for (Sublayer which : {Sublayer::attention, Sublayer::mlp}) {
    const std::size_t cz = peak<MegatronCZ<>>(test, which), metp = peak<METP<>>(test, which),
                      colossal = peak<ColossalZ<>>(test, which);
    const std::string sublayer = which == Sublayer::attention ? "attention" : "mlp";
    MESSAGE(sublayer << " peak bytes per rank: MegatronCZ " << cz << ", METP " << metp << ", ColossalZ " << colossal);
    CHECK(metp < cz);
    if (which == Sublayer::attention) CHECK(cz < colossal);
  }
}
