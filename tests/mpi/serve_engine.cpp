// The serving engine (serve/engine.hpp) through OpenMPI, one process per rank (mpiexec with 2 and 4 processes): on
// the Mixtral and OLMoE fixtures, with staggered arrivals and chunked prefill, static TP, static EP, EP + token
// sorting + on-demand loading from the owning process, on-demand loading alone, dynamic TP<->EP switching, and an
// Alloc-MoE budget (Alloc-T) give rank 0 the same tokens as the same policy on as many thread ranks, and the
// unbudgeted policies give transformers' greedy tokens (the fixtures' expected.json).
#include "paradyse/comm/mpi.hpp"
#include "paradyse/comm/threads.hpp"
#include "paradyse/core/json.hpp"
#include "paradyse/serve/engine.hpp"

#include <doctest/doctest.h>

#include <filesystem>
#include <string>
#include <vector>

namespace {

using namespace paradyse;
using namespace paradyse::serve;

std::filesystem::path fixture(const std::string& family) {
  return std::filesystem::path(PARADYSE_TEST_DATA_DIR) / "hf" / family;
}

}  // namespace

TEST_CASE("mpi serve: the engine on p processes gives the thread ranks' tokens under every EP policy and a budget") {
  MpiCommunicator comm = MpiCommunicator::world();
  const int p = comm.size();
  for (const std::string family : {"mixtral", "olmoe"}) {
    const LoadedDecoder m = load_decoder(fixture(family).string());
    const json::Value doc = json::load_file((fixture(family) / "expected.json").string());
    std::vector<std::vector<std::int32_t>> prompts, expected;
    for (const json::Value& c : doc.at("cases")) {
      prompts.emplace_back();
      expected.emplace_back();
      for (const json::Value& t : c.at("prompt")) prompts.back().push_back(t.get<std::int32_t>());
      for (const json::Value& t : c.at("generated")) expected.back().push_back(t.get<std::int32_t>());
    }
    std::vector<ServeRequest> requests;
    const double arrivals[] = {0, 0, 1, 3, 4};
    for (std::size_t i = 0; i < 5; ++i)
      requests.push_back({std::int64_t(i), prompts[i % prompts.size()], std::int64_t(expected[0].size()), {}, arrivals[i]});
    EngineOptions opt;
    opt.step_tokens = 6;
    opt.block_size = 4;
    opt.kv_blocks = 64;
    std::vector<std::pair<std::string, EnginePolicy>> policies(6);
    policies[0].first = "static TP";
    policies[1] = {"static EP", {}};
    policies[1].second.mode = ModePolicy::static_ep;
    policies[2] = {"EP + token sorting + on-demand", policies[1].second};
    policies[2].second.token_sorting = policies[2].second.on_demand = true;
    policies[2].second.fetch_capacity = 1;
    policies[3] = {"EP + on-demand", policies[1].second};
    policies[3].second.on_demand = true;
    policies[4].first = "dynamic";
    policies[4].second.mode = ModePolicy::dynamic;
    policies[4].second.switching = {0.0, 1, 1};
    policies[4].second.rates = {1e9, 1e12, 1e4};
    policies[5] = {"EP + budget 75% Alloc-T", policies[1].second};
    policies[5].second.budget = make_routing_budget(m.config, parse_budget("75%"), nullptr, true);
    for (const auto& [name, policy] : policies) {
      INFO(family, ", ", name, ", p = ", p);
      EngineStats stats;
      const std::vector<RequestOutcome> got = serve_requests(comm, m, requests, opt, policy, &stats);
      const std::int64_t mine = stats.fetch.fetches;
      std::int64_t fetches = 0;  // over every process
      comm.all_reduce(std::span<const std::int64_t>(&mine, 1), std::span<std::int64_t>(&fetches, 1), ReduceOp::sum);
      if (comm.rank() != 0) continue;
      std::vector<RequestOutcome> threads;
      run_ranks(p, [&](ThreadCommunicator& tc) {
        auto out = serve_requests(tc, m, requests, opt, policy);
        if (tc.rank() == 0) threads = std::move(out);
      });
      REQUIRE(got.size() == requests.size());
      for (std::size_t i = 0; i < got.size(); ++i) {
        CHECK(got[i].tokens == threads[i].tokens);
        if (!policy.budget.active()) CHECK(got[i].tokens == expected[i % expected.size()]);
      }
      if (policy.on_demand) CHECK(fetches > 0);
      if (policy.budget.active()) CHECK(stats.routed_activations == 3 * stats.tokens);
    }
  }
}
