// Tests of paradyse/cost/model_shape.hpp: attention pairs, parameter counts, validation; the catalog's strategy names and
// supports() (cost/dry_run.hpp).
#include "paradyse/cost/dry_run.hpp"
#include "paradyse/cost/model_shape.hpp"

#include <doctest/doctest.h>

#include <string>
#include <vector>

using namespace paradyse;
using namespace paradyse::cost;

namespace {
ModelShape small_shape() {
  ModelShape m;
  m.batch = 2;
  m.seq = 64;
  m.hidden = 32;
  m.heads = 4;
  m.kv_heads = 2;
  m.head_dim = 8;
  m.ffn = 96;
  return m;
}
}  // namespace

TEST_CASE("model_shape: attention pairs of one sequence, a packed sample and causal masks") {
  ModelShape m = small_shape();
  CHECK(m.attention_pairs() == 64.0 * 64.0);
  m.packed_lengths = {10, 50, 4};
  CHECK(m.attention_pairs() == 10.0 * 10 + 50.0 * 50 + 4.0 * 4);
  m.causal = true;
  CHECK(m.attention_pairs() == (10.0 * 10 + 50.0 * 50 + 4.0 * 4) / 2);
}

TEST_CASE("model_shape: parameter counts") {
  ModelShape m = small_shape();
  // q and output projections: 2 h a d; k and v: 2 h a_kv d.
  CHECK(m.attention_parameters() == 2 * 32 * 4 * 8 + 2 * 32 * 2 * 8);
  CHECK(m.mlp_parameters() == 2 * 32 * 96);
  m.swiglu = true;
  CHECK(m.mlp_parameters() == 3 * 32 * 96);
}

TEST_CASE("model_shape: validate names the bad field") {
  ModelShape m = small_shape();
  CHECK_NOTHROW(validate(m, 4));
  m.kv_heads = 3;
  CHECK_THROWS_WITH_AS(validate(m, 4), doctest::Contains("heads = 4 must be a positive multiple of kv_heads = 3"),
                       Error);
  m = small_shape();
  m.packed_lengths = {10, 20};
  CHECK_THROWS_WITH_AS(validate(m, 4), doctest::Contains("packed lengths sum to 30, expected seq = 64"), Error);
  m = small_shape();
  CHECK_THROWS_WITH_AS(validate(m, 0), doctest::Contains("p = 0"), Error);
  m.dtype_bytes = 3;
  CHECK_THROWS_WITH_AS(validate(m, 2), doctest::Contains("dtype_bytes = 3"), Error);
}

TEST_CASE("model_shape: the strategies' own requirements (catalog supports), every strategy alike") {
  // The unified layout (LayerConfig::validate_for) gives every rank heads/p whole heads, whatever the strategy: 6
  // heads run on 2 ranks but on 4 ranks no strategy runs them (the old model let all but UlyssesZ through, which
  // the code never could), and the reason names the heads and p.
  const StrategyCatalog& catalog = default_catalog();
  ModelShape m = small_shape();
  m.heads = 6;
  m.kv_heads = 6;
  for (int s : catalog.all()) {
    CAPTURE(catalog.name(s));
    CHECK(catalog.supports(s, m, 2).ok());
    const Support refused = catalog.supports(s, m, 4);
    REQUIRE_FALSE(refused.ok());
    CHECK(refused.reason.find("heads = 6 must be divisible by the group size p = 4") != std::string::npos);
  }
  // kv heads: a multiple of p, or a divisor of p (replicated), as the unified layout allows.
  for (int s : catalog.all()) {
    CAPTURE(catalog.name(s));
    m.heads = 8;
    m.kv_heads = 2;
    CHECK(catalog.supports(s, m, 4).ok());
    m.kv_heads = 4;
    CHECK(catalog.supports(s, m, 8).ok());
    m.heads = 12;
    m.kv_heads = 3;
    const Support refused = catalog.supports(s, m, 4);
    REQUIRE_FALSE(refused.ok());
    CHECK(refused.reason.find("kv_heads = 3") != std::string::npos);
  }
  // Fewer tokens than ranks: nothing runs, and the reason names p and the strategy (a refusal, not an exception:
  // the planner shows it).
  m = small_shape();
  m.seq = 3;
  for (int s : catalog.all()) {
    CAPTURE(catalog.name(s));
    Support refused{"supports() threw"};
    CHECK_NOTHROW(refused = catalog.supports(s, m, 4));
    REQUIRE_FALSE(refused.ok());
    CHECK(refused.reason.find("a sequence of 3 tokens cannot give each of the 4 chunks (4 ranks) a token") != std::string::npos);
    CHECK(refused.reason.find(catalog.name(s)) != std::string::npos);
    CHECK(catalog.supports(s, m, 2).ok());
  }
}

TEST_CASE("model_shape: strategy names round trip through the catalog") {
  const StrategyCatalog& catalog = default_catalog();
  // The order of strategy/strategies.hpp.
  CHECK(catalog.names() == std::vector<std::string>{"MegatronTS", "UlyssesZ", "MegatronCZ", "METP", "ColossalZ"});
  CHECK(catalog.count() == 5);
  for (int s : catalog.all()) {
    CHECK(catalog.find(catalog.name(s)) == s);
    CHECK(catalog.index_of(catalog.name(s)) == s);
  }
  CHECK(catalog.find("Megatron") == -1);
  CHECK_THROWS_WITH_AS(catalog.index_of("Megatron"), doctest::Contains("no strategy named 'Megatron'"), Error);
  CHECK_THROWS_AS(catalog.name(5), Error);
}
