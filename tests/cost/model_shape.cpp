// Tests of paradyse/cost/model_shape.hpp: attention pairs, parameter counts, validation, forbidden strategies.
#include "paradyse/cost/model_shape.hpp"

#include <doctest/doctest.h>

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

TEST_CASE("model_shape: Ulysses is forbidden when heads do not divide by p, the others are not") {
  ModelShape m = small_shape();
  m.heads = 6;
  m.kv_heads = 6;
  CHECK(strategy_forbidden(Strategy::ulysses_z, m, 2) == std::nullopt);
  const auto reason = strategy_forbidden(Strategy::ulysses_z, m, 4);
  REQUIRE(reason);
  CHECK(reason->find("heads (6) divisible by p (4)") != std::string::npos);
  for (Strategy s : {Strategy::megatron_ts, Strategy::megatron_cz, Strategy::colossal_z, Strategy::metp})
    CHECK(strategy_forbidden(s, m, 4) == std::nullopt);
  const std::vector<Strategy> allowed = allowed_strategies(m, 4);
  CHECK(allowed.size() == 4);
  CHECK(std::find(allowed.begin(), allowed.end(), Strategy::ulysses_z) == allowed.end());
  // kv heads: a multiple of p, or a divisor of p (replicated), as the unified layout allows.
  m.heads = 8;
  m.kv_heads = 2;
  CHECK(strategy_forbidden(Strategy::ulysses_z, m, 4) == std::nullopt);
  m.kv_heads = 4;
  CHECK(strategy_forbidden(Strategy::ulysses_z, m, 8) == std::nullopt);
  m.heads = 12;
  m.kv_heads = 3;
  CHECK(strategy_forbidden(Strategy::ulysses_z, m, 4));
  // Fewer tokens than ranks: nothing runs.
  m = small_shape();
  m.seq = 3;
  for (Strategy s : kAllStrategies) CHECK(strategy_forbidden(s, m, 4));
}

TEST_CASE("model_shape: strategy names round trip") {
  for (Strategy s : kAllStrategies) CHECK(strategy_from_name(name_of(s)) == s);
  CHECK(strategy_from_name("Megatron") == std::nullopt);
}
