// What moe_policies and moe_infer refuse or decline to conclude (issue 27): an unknown policy name among --policies
// (a typo used to run the others alone), a verdict from one round (no spread), a TPOT from one-token outputs, a
// sensitivity table measured on another model.
#include "paradyse/moe/sensitivity.hpp"
#include "paradyse/serve/hf_config.hpp"
#include "paradyse/serve/named_policies.hpp"
#include "paradyse/serve/policy_rounds.hpp"
#include "paradyse/serve/request_trace.hpp"
#include "paradyse/serve/serving_metrics.hpp"
#include "paradyse/serve/synthetic_decoder.hpp"

#include <doctest/doctest.h>

#include <string>

using namespace paradyse;
using namespace paradyse::serve;

TEST_CASE("policy names: an unknown or empty name is refused, naming it and the accepted list") {
  CHECK_NOTHROW(check_policy_keys("tp,ep,eplb,sort,ondemand,dynamic"));
  CHECK_NOTHROW(check_policy_keys("dynamic"));
  CHECK_THROWS_WITH_AS(check_policy_keys("tp,dynamc"),
                       doctest::Contains("policies \"tp,dynamc\": unknown \"dynamc\" policy; expected a "
                                         "comma-separated subset of tp,ep,eplb,sort,ondemand,dynamic"),
                       Error);
  CHECK_THROWS_WITH_AS(check_policy_keys("tp,,ep"), doctest::Contains("an empty policy"), Error);
  CHECK_THROWS_WITH_AS(check_policy_keys(""), doctest::Contains("an empty policy"), Error);
  const std::vector<NamedPolicy> all = {{"tp", "static TP", {}}, {"dynamic", "dynamic", {}}};
  CHECK_THROWS_AS(select_policies(all, "tp,dynamc"), Error);
  CHECK(select_policies(all, "dynamic,tp").size() == 2);
}

TEST_CASE("one round has no spread: no verdict, said so") {
  const Spread once = spread_of({10.0}), other = spread_of({20.0});
  CHECK(once.count == 1);
  const PolicyComparison c = compare_to_best(once, {other}, Better::lower);
  CHECK(c.verdict == Verdict::no_spread);
  CHECK(c.ratio == doctest::Approx(2.0));
  CHECK(std::string(name_of(c.verdict)) == "no verdict: no spread with 1 round");
  CHECK(compare_to_best(spread_of({10.0, 11.0}), {spread_of({20.0, 21.0})}, Better::lower).verdict == Verdict::faster);
}

TEST_CASE("TPOT of one-token outputs is undefined, not 0") {
  DecoderConfig c;
  c.layers = 0;
  EngineStats stats;
  stats.elapsed_s = 1;
  std::vector<RequestOutcome> out(2);
  for (RequestOutcome& r : out) r.tokens = {7}, r.arrival = 0, r.first_token = 0.5, r.finish = 0.5;
  CHECK(summarize_run(out, stats, c).tpot_requests == 0);
  out[1].tokens = {7, 8};
  out[1].finish = 1.0;
  const ServeRun run = summarize_run(out, stats, c);
  CHECK(run.tpot_requests == 1);
  CHECK(run.metric[tpot50] == doctest::Approx(500.0));
}

TEST_CASE("a sensitivity table records its model and is refused for another, naming both") {
  DecoderConfig a;
  a.family = Family::mixtral, a.vocab = 64, a.hidden = 32, a.layers = 2, a.heads = 4, a.kv_heads = 2, a.head_dim = 8;
  a.moe_layer = {true, true};
  a.moe.hidden = 32, a.moe.experts = 4, a.moe.top_k = 2, a.moe.expert_ffn = 16;
  DecoderConfig b = a;
  b.moe.experts = 8;
  CHECK(model_identity(a) != model_identity(b));
  CHECK(model_identity(a).starts_with("mixtral layers 2 (2 MoE) hidden 32 experts 4 top-k 2 config "));
  SensitivityTable t;
  t.top_k = {2, 2};
  t.delta = {{0.5, 0.0}, {0.25, 0.0}};
  t.model = model_identity(a);
  const SensitivityTable back = sensitivity_from_json(sensitivity_to_json(t));
  CHECK(back.model == t.model);
  CHECK_NOTHROW(check_sensitivity_model(back, model_identity(a), "t.json"));
  CHECK_THROWS_WITH_AS(check_sensitivity_model(back, model_identity(b), "t.json"),
                       doctest::Contains(("sensitivity table t.json was measured on another model: it names \"" +
                                          model_identity(a) + "\", this model is \"" + model_identity(b) + "\"")
                                             .c_str()),
                       Error);
  t.model.clear();  // a table written before identities: taken as is
  CHECK_NOTHROW(check_sensitivity_model(sensitivity_from_json(sensitivity_to_json(t)), model_identity(b), "old.json"));
}

TEST_CASE("a trace whose arrivals would span more than an hour is refused, naming the rate (no endless wait)") {
  TraceShape shape;
  shape.rate = 1e-300;
  CHECK_THROWS_WITH_AS(make_trace(shape, 64), doctest::Contains("Poisson at 1e-300 requests/s); at most 3600 s"),
                       Error);
  shape.rate = 8;
  CHECK(make_trace(shape, 64).size() == 32);
}

TEST_CASE("a synthetic model that cannot fit this machine is refused up front with what it needs and what there is") {
  const DecoderConfig huge = synthetic_config(8192, 256, 8, 4, 1024, 2, 65536, 1024);
  CHECK(decoder_weight_bytes(huge) > 1e15);
  CHECK_THROWS_WITH_AS(check_fits_host(huge, 2, "--experts"), doctest::Contains("GiB of float32 weights"), Error);
  CHECK_THROWS_WITH_AS(check_fits_host(huge, 2, "--experts"), doctest::Contains("this machine has"), Error);
  const DecoderConfig small = synthetic_config(32, 2, 8, 4, 4, 2, 16, 64);
  CHECK_NOTHROW(check_fits_host(small, 2, "--experts"));
  // 2 layers: embedding + lm_head 2 * 64 * 32, final norm 32; per layer norms 64, q/o 2 * 32 * 32, k/v 2 * 16 * 32,
  // 4 experts of 3 * 16 * 32 plus their router rows 32: 4 bytes each.
  CHECK(decoder_weight_bytes(small) == 4.0 * (2 * 64 * 32 + 32 + 2 * (64 + 2048 + 1024 + 4 * (1536 + 32))));
}
