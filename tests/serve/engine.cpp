// tests/serve/engine.cpp: the serving engine over the transformers fixtures (tests/data/hf/): continuous batching
// with staggered arrivals and chunked prefill, every MoE policy (static TP, static EP, EP + EPLB, EP + token sorting,
// on-demand loading from the owning rank alone and with sorting, dynamic TP<->EP switching, pipelined or stalled) on
// p in {1, 2, 3, 4} gives the reference's greedy tokens; Alloc-MoE budgets (the full budget gives the unbudgeted
// tokens; B activations per token; the same tokens on every p and mode; Alloc-T per chunk); the work pieces and the
// fetch directory; seeded sampling; the paged cache; the layout redistribution round trip; EPLB against DeepSeek's
// published example; the switcher's hysteresis; the per-step statistics (time, tokens, the cost model's prediction);
// the rounds that compare policies (rotation, medians and spreads, the verdict against the best baseline).
#include "paradyse/comm/threads.hpp"
#include "paradyse/core/json.hpp"
#include "paradyse/core/rng.hpp"
#include "paradyse/serve/engine.hpp"
#include "paradyse/serve/policy_rounds.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <filesystem>
#include <map>
#include <numeric>
#include <string>
#include <vector>

using namespace paradyse;
using namespace paradyse::serve;

namespace {

std::filesystem::path hf_root() { return std::filesystem::path(PARADYSE_TEST_DATA_DIR) / "hf"; }
std::filesystem::path fixture(const std::string& family) { return hf_root() / family; }

struct Reference {
  std::vector<std::vector<std::int32_t>> prompts, tokens;  // the greedy tokens transformers generated
};

Reference read_reference(const std::string& family) {
  const json::Value doc = json::load_file((fixture(family) / "expected.json").string());
  Reference r;
  for (const json::Value& c : doc.at("cases")) {
    r.prompts.emplace_back();
    r.tokens.emplace_back();
    for (const json::Value& t : c.at("prompt")) r.prompts.back().push_back(t.get<std::int32_t>());
    for (const json::Value& t : c.at("generated")) r.tokens.back().push_back(t.get<std::int32_t>());
  }
  return r;
}

// Six requests over the fixture's prompts, arriving at steps 0, 0, 1, 3, 4, 9 (they join and leave mid-run).
std::vector<ServeRequest> staggered(const Reference& ref, SamplingParams sampling = {}) {
  const double arrivals[] = {0, 0, 1, 3, 4, 9};
  std::vector<ServeRequest> out;
  for (std::int64_t i = 0; i < 6; ++i) {
    ServeRequest r;
    r.id = 100 + i;
    r.prompt = ref.prompts[std::size_t(i) % ref.prompts.size()];
    r.max_new_tokens = std::int64_t(ref.tokens[0].size());
    r.sampling = sampling;
    r.arrival = arrivals[i];
    out.push_back(r);
  }
  return out;
}

// A family's fixture, its reference and the six staggered requests, with the engine options these tests share:
// blocks of 4 positions, and steps of `step_tokens` tokens (6: the prompts of 5 and 9 tokens are prefilled in chunks).
struct ServedFixture {
  LoadedDecoder model;
  Reference ref;
  std::vector<ServeRequest> requests;
  EngineOptions opt;
};

ServedFixture served_fixture(const std::string& family, std::int64_t step_tokens = 6) {
  ServedFixture f{load_decoder(fixture(family).string()), read_reference(family), {}, {}};
  f.requests = staggered(f.ref);
  f.opt.step_tokens = step_tokens;
  f.opt.block_size = 4;
  f.opt.kv_blocks = 64;
  return f;
}

struct Served {
  std::vector<RequestOutcome> outcomes;
  EngineStats stats;         // rank 0's
  std::int64_t fetches = 0;  // experts fetched, over every rank
};

Served serve_on(const LoadedDecoder& m, const std::vector<ServeRequest>& requests, int p, const EngineOptions& opt,
             const EnginePolicy& policy) {
  Served s;
  std::vector<EngineStats> stats(static_cast<std::size_t>(p));
  run_ranks(p, [&](ThreadCommunicator& comm) {
    auto out = serve_requests(comm, m, requests, opt, policy, &stats[std::size_t(comm.rank())]);
    if (comm.rank() == 0) s.outcomes = std::move(out);
  });
  s.stats = stats[0];
  for (const EngineStats& r : stats) s.fetches += r.fetch.fetches;
  return s;
}

// Rates under which prefill steps favour EP and decode steps TP (skinny GEMMs cost TP at large batches, weight reads
// cost EP at small ones), and a switcher with no hysteresis, so the fixtures' runs switch both ways.
EnginePolicy dynamic_policy(bool pipelined) {
  EnginePolicy p;
  p.mode = ModePolicy::dynamic;
  p.pipelined_switch = pipelined;
  p.switching = {0.0, 1, 1};
  p.rates = {1e9, 1e12, 1e4};
  return p;
}

std::map<std::string, EnginePolicy> policies() {
  std::map<std::string, EnginePolicy> all;
  all["static TP"] = {};
  all["static EP"].mode = ModePolicy::static_ep;
  EnginePolicy eplb;
  eplb.mode = ModePolicy::static_ep;
  eplb.eplb = true;
  eplb.eplb_interval = 3;
  all["EP + EPLB"] = eplb;
  EnginePolicy sorting;
  sorting.mode = ModePolicy::static_ep;
  sorting.token_sorting = true;
  sorting.fetch_capacity = 1;
  all["EP + token sorting"] = sorting;
  EnginePolicy on_demand;
  on_demand.mode = ModePolicy::static_ep;
  on_demand.on_demand = true;
  on_demand.fetch_capacity = 1;
  all["EP + on-demand loading"] = on_demand;
  on_demand.token_sorting = true;
  all["EP + token sorting + on-demand loading"] = on_demand;
  all["dynamic (pipelined)"] = dynamic_policy(true);
  all["dynamic (stalled)"] = dynamic_policy(false);
  EnginePolicy everything = dynamic_policy(true);
  everything.eplb = true;
  everything.eplb_interval = 2;
  everything.token_sorting = true;
  all["dynamic + EPLB + token sorting"] = everything;
  everything.on_demand = true;
  all["dynamic + EPLB + token sorting + on-demand"] = everything;
  return all;
}

}  // namespace

TEST_CASE("engine: every policy on p in {1, 2, 3, 4} gives transformers' greedy tokens under continuous batching") {
  for (const std::string family :
       {"mixtral", "qwen2_moe", "olmoe", "qwen3_moe", "deepseek_v2_lite", "deepseek_v2", "deepseek_v3",
        "deepseek_v3_rope_halves", "deepseek_v2_lite_yarn", "deepseek_v3_yarn"}) {
    const auto [m, ref, requests, opt] = served_fixture(family);
    for (const auto& [name, policy] : policies())
      for (const int p : {1, 2, 3, 4}) {
        INFO(family, ", ", name, ", p = ", p);
        const Served s = serve_on(m, requests, p, opt, policy);
        REQUIRE(s.outcomes.size() == requests.size());
        for (std::size_t i = 0; i < requests.size(); ++i) {
          CHECK(s.outcomes[i].id == requests[i].id);
          CHECK(s.outcomes[i].tokens == ref.tokens[i % ref.tokens.size()]);
          CHECK(s.outcomes[i].first_token > requests[i].arrival);
          CHECK(s.outcomes[i].finish >= s.outcomes[i].first_token + 7);
        }
        if (policy.mode == ModePolicy::dynamic && p > 1) {
          CHECK(s.stats.switches >= 2);  // prefill steps went EP and decode steps back to TP
          CHECK(s.stats.switch_bytes > 0);
        }
        if (policy.eplb && policy.mode == ModePolicy::static_ep && p > 1) CHECK(s.stats.rebalances >= 1);
        if ((policy.token_sorting || policy.on_demand) && policy.mode == ModePolicy::static_ep && p > 1) {
          CHECK(s.fetches > 0);
          // Equal pairs per rank: the largest rank share exceeds the mean by less than one row per step.
          for (std::int64_t l = 0; l < m.config.layers; ++l)
            if (m.config.is_moe(l))
              CHECK(s.stats.rank_max[std::size_t(l)] < s.stats.rank_mean[std::size_t(l)] + double(s.stats.steps));
        }
      }
  }
}

TEST_CASE("engine: a KV pool for one request at a time serves them one after another with the same tokens") {
  const LoadedDecoder m = load_decoder(fixture("qwen2_moe").string());
  const Reference ref = read_reference("qwen2_moe");
  EngineOptions opt;
  opt.block_size = 4;
  opt.kv_blocks = 5;  // 9 + 8 positions: 5 blocks of 4
  const Served s = serve_on(m, staggered(ref), 2, opt, {});
  for (std::size_t i = 0; i < s.outcomes.size(); ++i) CHECK(s.outcomes[i].tokens == ref.tokens[i % ref.tokens.size()]);
  // One request at a time: each starts after the previous one finished.
  for (std::size_t i = 1; i < s.outcomes.size(); ++i) CHECK(s.outcomes[i].first_token > s.outcomes[i - 1].finish);
  opt.kv_blocks = 4;
  CHECK_THROWS_WITH_AS(serve_on(m, staggered(ref), 1, opt, {}), doctest::Contains("needs 5 KV blocks, the pool has 4"), Error);
}

TEST_CASE("engine: seeded sampling gives each request the same tokens whatever the ranks and the batch") {
  const LoadedDecoder m = load_decoder(fixture("mixtral").string());
  const Reference ref = read_reference("mixtral");
  const SamplingParams sampling{1.5, 0.9, 7};
  std::vector<ServeRequest> together = staggered(ref, sampling), alone = together;
  for (ServeRequest& r : together) r.arrival = 0;
  EngineOptions opt;
  const Served a = serve_on(m, together, 1, opt, {});
  EnginePolicy ep;
  ep.mode = ModePolicy::static_ep;
  const Served b = serve_on(m, alone, 4, opt, ep);
  bool differs_from_greedy = false;
  for (std::size_t i = 0; i < together.size(); ++i) {
    CHECK(a.outcomes[i].tokens == b.outcomes[i].tokens);
    differs_from_greedy |= a.outcomes[i].tokens != ref.tokens[i % ref.tokens.size()];
  }
  CHECK(differs_from_greedy);  // temperature 1.5 over these logits does not always pick the argmax
  // Requests 0 and 2 share a prompt but not an id: their streams are independent draws.
  CHECK(a.outcomes[0].tokens != a.outcomes[2].tokens);
  // Another seed, other tokens.
  for (ServeRequest& r : together) r.sampling.seed = 8;
  const Served c = serve_on(m, together, 1, opt, {});
  bool differs = false;
  for (std::size_t i = 0; i < together.size(); ++i) differs |= c.outcomes[i].tokens != a.outcomes[i].tokens;
  CHECK(differs);
  // A nucleus that keeps only the top token is greedy.
  for (ServeRequest& r : together) r.sampling = {2.0, 1e-6, 3};
  const Served g = serve_on(m, together, 2, opt, {});
  for (std::size_t i = 0; i < together.size(); ++i) CHECK(g.outcomes[i].tokens == ref.tokens[i % ref.tokens.size()]);
}

TEST_CASE("sampling: frequencies follow softmax(logits / T) truncated to the nucleus") {
  const std::vector<float> logits{2.0f, 1.0f, 0.5f, -1.0f, 0.0f};
  for (const double top_p : {1.0, 0.8}) {
    const SamplingParams s{0.7, top_p, 11};
    const auto kept = nucleus(logits, s);
    // Reference probabilities in double.
    std::vector<double> p(logits.size());
    double total = 0;
    for (std::size_t i = 0; i < logits.size(); ++i) total += (p[i] = std::exp(double(logits[i]) / 0.7));
    for (double& x : p) x /= total;
    // The kept set: the most likely tokens until their mass reaches top_p.
    std::vector<std::size_t> order{0, 1, 2, 4, 3};
    double mass = 0;
    std::size_t count = 0;
    while (count < order.size() && (count == 0 || mass < top_p - 1e-12)) mass += p[order[count++]];
    REQUIRE(kept.size() == count);
    Rng rng = request_rng(s, 5);
    std::vector<int> hits(logits.size(), 0);
    const int draws = 40000;
    for (int i = 0; i < draws; ++i) ++hits[std::size_t(sample_token(logits, s, rng))];
    for (std::size_t k = 0; k < order.size(); ++k) {
      const std::size_t token = order[k];
      const double want = k < count ? p[token] / mass : 0.0;
      CHECK(kept.size() > 0);
      if (k < count) CHECK(kept[k].first == std::int32_t(token));
      const double sigma = std::sqrt(want * (1 - want) / draws);
      CHECK(std::abs(double(hits[token]) / draws - want) <= 5 * sigma + 1e-12);
    }
  }
  CHECK_THROWS_WITH_AS(sample_token(logits, SamplingParams{-1.0, 1.0, 0}, *std::make_unique<Rng>(1)),
                       doctest::Contains("temperature = -1 must be >= 0"), Error);
}

TEST_CASE("paged KV cache: blocks are taken as requests grow and given back when they leave") {
  PagedKvCache cache({2, 6, 4, 1, 2});
  cache.reserve(1, 9);  // 3 blocks
  CHECK(cache.free_blocks() == 3);
  cache.reserve(2, 4);
  CHECK(cache.free_blocks() == 2);
  CHECK_THROWS_WITH_AS(cache.reserve(3, 12), doctest::Contains("request 3 needs 3 more blocks, 2 of 6 are free"), Error);
  Tensor<float> k(Shape{9, 1, 2}), v(Shape{9, 1, 2});
  for (std::int64_t i = 0; i < 18; ++i) k.data()[i] = float(i), v.data()[i] = float(-i);
  for (std::int64_t l = 0; l < 2; ++l) cache.append(1, l, k.view(), v.view());
  CHECK(cache.length(1) == 9);
  for (std::int64_t pos = 0; pos < 9; ++pos) {
    CHECK(cache.key(1, 1, pos, 0)[1] == float(2 * pos + 1));
    CHECK(cache.value(1, 0, pos, 0)[0] == float(-2 * pos));
  }
  Tensor<float> one(Shape{1, 1, 2});
  CHECK_THROWS_WITH_AS(cache.append(1, 0, one.view(), one.view()), doctest::Contains("past its reservation"), Error);
  cache.release(1);
  CHECK(cache.free_blocks() == 5);
}

TEST_CASE("redistribution: TP -> EP -> EPLB placement with replicas -> TP moves every weight back into place") {
  const LoadedDecoder m = load_decoder(fixture("olmoe").string());
  const DecoderConfig& c = m.config;
  for (const int p : {2, 3, 4}) {
    std::vector<std::string> failures(static_cast<std::size_t>(p));
    run_ranks(p, [&](ThreadCommunicator& comm) {
      const int me = comm.rank();
      RankShard s = make_rank_shard(c, m.weights, p, me, MoeMode::tp);
      const RankShard tp = make_rank_shard(c, m.weights, p, me, MoeMode::tp);
      const ExpertPlacement chunked = ExpertPlacement::chunked(c.moe.experts, p);
      // An uneven placement with replicas: expert 0 on every rank, the rest chunked.
      std::vector<std::vector<std::int64_t>> replicas = chunked.experts_of_rank;
      for (auto& slots : replicas)
        if (std::find(slots.begin(), slots.end(), 0) == slots.end()) slots.push_back(0);
      const RankShard ep = make_rank_shard(c, m.weights, p, me, MoeMode::ep);
      const ExpertPlacement rep{replicas};
      const RankShard ep2 = make_rank_shard(c, m.weights, p, me, MoeMode::ep, &rep);
      auto same = [](const Tensor<float>& a, const Tensor<float>& b) {
        return a.shape() == b.shape() && std::equal(a.span().begin(), a.span().end(), b.span().begin());
      };
      const std::vector<ExpertLayout> path{ExpertLayout::ep(chunked.experts_of_rank), ExpertLayout::ep(replicas),
                                           ExpertLayout::tp()};
      const std::vector<const RankShard*> want{&ep, &ep2, &tp};
      ExpertLayout from = ExpertLayout::tp();
      for (std::size_t step = 0; step < path.size(); ++step) {
        std::vector<LayerRedistribution> moving(static_cast<std::size_t>(c.layers));
        for (std::int64_t l = 0; l < c.layers; ++l) moving[std::size_t(l)].begin(comm, c, s.layers[std::size_t(l)], from, path[step]);
        for (std::int64_t l = 0; l < c.layers; ++l) moving[std::size_t(l)].finish();
        for (std::int64_t l = 0; l < c.layers; ++l) {
          const RankLayer &got = s.layers[std::size_t(l)], &exp = want[step]->layers[std::size_t(l)];
          if (!same(got.expert_in, exp.expert_in) || !same(got.expert_out, exp.expert_out) ||
              got.slot_expert != exp.slot_expert || got.mode != exp.mode)
            failures[std::size_t(me)] += fmt::format("step {} layer {} differs; ", step, l);
        }
        from = path[step];
      }
    });
    for (int r = 0; r < p; ++r) CHECK_MESSAGE(failures[std::size_t(r)] == "", "p = ", p, " rank ", r);
  }
}

TEST_CASE("EPLB: DeepSeek's example balances no worse than the published placement") {
  // A copy of ../shared/data/moe/eplb_example.json (DeepSeek's EPLB README example).
  const json::Value ex = json::load_file((hf_root() / "eplb_example.json").string());
  const EplbShape shape{ex.at("num_replicas").get<std::int64_t>(), ex.at("num_groups").get<std::int64_t>(),
                        ex.at("num_nodes").get<std::int64_t>(), ex.at("num_gpus").get<std::int64_t>()};
  const json::Value& weights = ex.at("weight");
  const json::Value& published = ex.at("hierarchical_phy2log");
  for (std::size_t l = 0; l < weights.size(); ++l) {
    std::vector<double> load;
    for (const json::Value& w : weights[l]) load.push_back(w.get<double>());
    std::vector<std::int64_t> theirs;
    for (const json::Value& e : published[l]) theirs.push_back(e.get<std::int64_t>());
    const std::vector<std::int64_t> ours = eplb_place(load, shape);
    REQUIRE(ours.size() == std::size_t(shape.replicas));
    const double ours_imbalance = eplb_imbalance(load, ours, shape.ranks);
    const double their_imbalance = eplb_imbalance(load, theirs, shape.ranks);
    MESSAGE(fmt::format("layer {}: max/mean rank load ours {:.4f}, published {:.4f}, unbalanced (one replica each, "
                        "chunked) {:.4f}", l, ours_imbalance, their_imbalance,
                        eplb_imbalance(load, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 0, 1, 2, 3}, shape.ranks)));
    CHECK(ours_imbalance <= their_imbalance + 1e-12);
    // Every expert placed; the node's groups are whole (hierarchical: group g = experts 3g..3g+2 on one node).
    for (std::int64_t e = 0; e < 12; ++e) CHECK(std::find(ours.begin(), ours.end(), e) != ours.end());
    for (std::size_t i = 0; i < ours.size(); ++i)
      for (std::size_t j = 0; j < ours.size(); ++j)
        if (ours[i] / 3 == ours[j] / 3) CHECK(i / 8 == j / 8);
  }
  // Global mode (groups not divisible by nodes) and a bad shape.
  CHECK(eplb_imbalance({5, 1, 1, 1}, eplb_place({5, 1, 1, 1}, {8, 3, 2, 4}), 4) <= 1.25 + 1e-12);
  CHECK_THROWS_WITH_AS(eplb_place({1, 2, 3}, {7, 1, 1, 2}), doctest::Contains("replicas must split evenly"), Error);
}

TEST_CASE("switcher: switches after `patience` steps that favour the other mode, never within `dwell` steps") {
  ModeSwitcher s({0.1, 2, 3}, MoeMode::tp);
  const ModeCosts ep_better{1.0, 0.5}, tp_better{0.5, 1.0}, close{1.0, 0.95};
  CHECK(s.decide(ep_better) == MoeMode::tp);  // one step is not enough
  CHECK(s.decide(close) == MoeMode::tp);      // within the margin: the streak restarts
  CHECK(s.decide(ep_better) == MoeMode::tp);
  CHECK(s.decide(ep_better) == MoeMode::ep);  // two in a row
  CHECK(s.decide(tp_better) == MoeMode::ep);
  CHECK(s.decide(tp_better) == MoeMode::ep);  // patience met but only 2 steps since the switch
  CHECK(s.decide(tp_better) == MoeMode::tp);  // dwell of 3 met
  CHECK(s.switches() == 2);
  // Alternating load never switches (no thrash).
  ModeSwitcher t({0.1, 2, 0}, MoeMode::tp);
  for (int i = 0; i < 20; ++i) t.decide(i % 2 ? ep_better : tp_better);
  CHECK(t.switches() == 0);
  // The cost model: TP's weight reads are split p ways (decode), EP's GEMMs are wide (prefill), skew costs EP.
  MoeConfig mc;
  mc.hidden = 64, mc.experts = 8, mc.top_k = 2, mc.expert_ffn = 256;
  const auto placement = ExpertPlacement::chunked(8, 4).experts_of_rank;
  const MachineRates rates{1e10, 1e11, 128};
  const ModeCosts decode = moe_mode_costs(mc, {1, 0, 0, 1, 0, 0, 0, 0}, placement, rates);
  CHECK(decode.tp_s < decode.ep_s);
  const ModeCosts prefill = moe_mode_costs(mc, {4096, 4096, 4096, 4096, 4096, 4096, 4096, 4096}, placement, rates);
  CHECK(prefill.ep_s < prefill.tp_s);
  const ModeCosts skewed = moe_mode_costs(mc, {32768, 0, 0, 0, 0, 0, 0, 0}, placement, rates);
  CHECK(skewed.tp_s < skewed.ep_s);
}

TEST_CASE("engine: per-step time, tokens and the cost model's prediction for the step's routing, whatever the mode") {
  const auto [m, ref, requests, opt] = served_fixture("mixtral");
  EnginePolicy tp, ep;
  tp.rates = ep.rates = {1e9, 1e10, 64};
  ep.mode = ModePolicy::static_ep;
  const Served one = serve_on(m, requests, 1, opt, tp);
  const Served a = serve_on(m, requests, 2, opt, tp), b = serve_on(m, requests, 2, opt, ep);
  for (const Served* s : {&one, &a, &b}) {
    const EngineStats& st = s->stats;
    REQUIRE(std::int64_t(st.step_seconds.size()) == st.steps);
    REQUIRE(std::int64_t(st.step_tokens.size()) == st.steps);
    REQUIRE(std::int64_t(st.predicted.size()) == st.steps);
    CHECK(std::accumulate(st.step_tokens.begin(), st.step_tokens.end(), std::int64_t(0)) == st.tokens);
    for (std::size_t k = 0; k < st.step_seconds.size(); ++k) {
      CHECK(st.step_seconds[k] > 0);
      CHECK(st.predicted[k].tp_s > 0);
      CHECK(st.predicted[k].ep_s > 0);
    }
  }
  // One rank: both layouts read every active expert whole and compute every pair at full width.
  for (const ModeCosts& c : one.stats.predicted) CHECK(c.tp_s == doctest::Approx(c.ep_s).epsilon(1e-12));
  // Steps are counted (not timed), so both modes schedule the same batches and route alike: the same predictions.
  REQUIRE(a.stats.steps == b.stats.steps);
  for (std::size_t k = 0; k < a.stats.predicted.size(); ++k) {
    CHECK(a.stats.step_tokens[k] == b.stats.step_tokens[k]);
    CHECK(a.stats.predicted[k].tp_s == doctest::Approx(b.stats.predicted[k].tp_s).epsilon(1e-12));
    CHECK(a.stats.predicted[k].ep_s == doctest::Approx(b.stats.predicted[k].ep_s).epsilon(1e-12));
  }
}

TEST_CASE("policy rounds: each policy takes every position once over n rounds; medians, spreads and the verdict") {
  for (const std::size_t n : {1, 2, 3, 6, 7}) {
    std::vector<std::vector<int>> seen(n, std::vector<int>(n, 0));  // [policy][position]
    for (std::size_t r = 0; r < n; ++r) {
      const std::vector<std::size_t> order = rotated_order(n, r);
      REQUIRE(order.size() == n);
      std::vector<std::size_t> sorted = order, all(n);
      std::sort(sorted.begin(), sorted.end());
      std::iota(all.begin(), all.end(), std::size_t(0));
      CHECK(sorted == all);  // a permutation
      for (std::size_t at = 0; at < n; ++at) ++seen[order[at]][at];
    }
    for (const auto& row : seen) CHECK(std::all_of(row.begin(), row.end(), [](int x) { return x == 1; }));
    CHECK(rotated_order(n, n + 1) == rotated_order(n, 1));
  }
  Rng rng(20261201);
  for (const std::size_t count : {1, 2, 3, 4, 5, 10}) {
    std::vector<double> v;
    for (std::size_t i = 0; i < count; ++i) v.push_back(100 * rng.uniform() - 20);
    std::vector<double> s = v;
    std::sort(s.begin(), s.end());
    const double median = count % 2 ? s[count / 2] : 0.5 * (s[count / 2 - 1] + s[count / 2]);
    const Spread got = spread_of(v);
    CHECK(got.median == median);
    CHECK(got.min == s.front());
    CHECK(got.max == s.back());
  }
  CHECK_THROWS_WITH_AS(spread_of({}), doctest::Contains("no values"), Error);
  // Latencies (lower is better): the baselines' best by median; ratio best / policy; noise when the ranges overlap.
  const Spread slow{20, 19, 21}, fast{10, 9, 11};
  PolicyComparison c = compare_to_best({12, 11.5, 13}, {slow, fast}, Better::lower);
  CHECK(c.best == 1);
  CHECK(c.ratio == doctest::Approx(10.0 / 12.0));
  CHECK(c.verdict == Verdict::slower);
  c = compare_to_best({10.5, 10, 12}, {slow, fast}, Better::lower);
  CHECK(c.verdict == Verdict::within_noise);
  CHECK(c.ratio == doctest::Approx(10.0 / 10.5));
  c = compare_to_best({8, 7.5, 8.5}, {fast, slow}, Better::lower);
  CHECK(c.best == 0);
  CHECK(c.ratio == doctest::Approx(1.25));
  CHECK(c.verdict == Verdict::faster);
  // Throughput (higher is better): ratio policy / best.
  c = compare_to_best({25, 24, 26}, {fast, slow}, Better::higher);
  CHECK(c.best == 1);
  CHECK(c.ratio == doctest::Approx(1.25));
  CHECK(c.verdict == Verdict::faster);
  c = compare_to_best({15, 14, 16}, {fast, slow}, Better::higher);
  CHECK(c.verdict == Verdict::slower);
  CHECK(c.ratio == doctest::Approx(0.75));
  CHECK(std::string(name_of(Verdict::within_noise)) == "matches within noise");
  CHECK_THROWS_WITH_AS(compare_to_best(fast, {}, Better::lower), doctest::Contains("no baselines"), Error);
}

TEST_CASE("expert fetch cache: bounded, least recently used out first, never an expert the current layer uses") {
  const LoadedDecoder m = load_decoder(fixture("olmoe").string());
  const MoeShard& whole = m.weights.layers[1].moe;
  ExpertFetchCache cache(2);
  const auto [in0, out0] = cache.get(m.weights, 1, 0, 1);
  const auto same = [](TensorView<const float> a, TensorView<const float> b) {
    return a.shape() == b.shape() && std::equal(a.span().begin(), a.span().end(), b.span().begin());
  };
  CHECK(same(in0, whole.expert_in.view().slice(0, 0, 1)));
  CHECK(same(out0, whole.expert_out.view().slice(0, 0, 1)));
  cache.get(m.weights, 1, 1, 1);
  cache.get(m.weights, 1, 2, 2);  // full: expert 0 (least recently used) goes
  CHECK(cache.size() == 2);
  CHECK(cache.stats().evictions == 1);
  cache.get(m.weights, 1, 1, 3);  // a hit
  CHECK(cache.stats().hits == 1);
  cache.get(m.weights, 1, 3, 3);  // expert 1 serves call 3: expert 2 goes
  CHECK(cache.stats().evictions == 2);
  const auto [in4, out4] = cache.get(m.weights, 1, 4, 3);  // experts 1 and 3 both serve call 3: the cache overflows
  CHECK(cache.stats().overflows == 1);
  CHECK(cache.size() == 3);
  CHECK(same(in4, whole.expert_in.view().slice(0, 4, 1)));
  cache.get(m.weights, 1, 5, 4);  // back under the bound
  CHECK(cache.size() == 2);
  CHECK(cache.stats().fetches == 6);  // experts 0 to 5, each once
  CHECK(cache.stats().bytes_fetched == 6 * 3 * std::size_t(m.config.moe.expert_ffn * m.config.hidden) * sizeof(float));
  CHECK_THROWS_WITH_AS(ExpertFetchCache(0), doctest::Contains("capacity = 0 must be at least 1"), Error);
}

// ---- Alloc-MoE budgets in the engine (serve/routing_budget.hpp) ----

namespace {

std::vector<std::int64_t> moe_ks(const DecoderConfig& c, const RoutingBudget& b) {
  std::vector<std::int64_t> k;
  for (std::int64_t l = 0; l < c.layers; ++l)
    if (c.is_moe(l)) k.push_back(b.layer_k[std::size_t(l)]);
  return k;
}

}  // namespace

TEST_CASE("engine budget: the full budget (uniform, Alloc-L) gives the unbudgeted greedy tokens on p in {1, 2}, TP and EP") {
  // DeepSeek-V2 and V3 route by groups (moe/grouped_routing.hpp): a per-layer k applies, but this test's families are
  // the plain top-k ones.
  for (const std::string family : {"mixtral", "qwen2_moe", "olmoe", "qwen3_moe", "deepseek_v2_lite"}) {
    const auto [m, ref, requests, opt] = served_fixture(family);
    SensitivityTable table;  // any table: at the full budget every layer keeps its top-k
    table.top_k = moe_layer_top_k(m.config);
    for (const std::int64_t k : table.top_k) table.delta.push_back(std::vector<double>(std::size_t(k), 0.5));
    for (const SensitivityTable* t : std::array<const SensitivityTable*, 2>{nullptr, &table})
      for (const ModePolicy mode : {ModePolicy::static_tp, ModePolicy::static_ep})
        for (const int p : {1, 2}) {
          INFO(family, t ? ", Alloc-L" : ", uniform", ", ", mode == ModePolicy::static_tp ? "TP" : "EP", ", p = ", p);
          EnginePolicy policy;
          policy.mode = mode;
          policy.budget = make_routing_budget(m.config, parse_budget("100%"), t, false);
          CHECK(moe_ks(m.config, policy.budget) == moe_layer_top_k(m.config));
          const Served s = serve_on(m, requests, p, opt, policy);
          for (std::size_t i = 0; i < requests.size(); ++i) CHECK(s.outcomes[i].tokens == ref.tokens[i % ref.tokens.size()]);
          CHECK(s.stats.routed_activations == full_budget(moe_layer_top_k(m.config)) * s.stats.tokens);
        }
  }
}

TEST_CASE("engine budget: every budget B runs B routed activations per token (Alloc-L, Alloc-T), the same tokens on "
          "p in {1, 2, 3}, TP and EP") {
  for (const std::string family : {"mixtral", "qwen2_moe", "olmoe"}) {
    const auto [m, ref, requests, opt] = served_fixture(family);
    const DecoderConfig& c = m.config;
    const std::vector<std::int64_t> top_k = moe_layer_top_k(c);
    // A table whose last MoE layer is the sensitive one: Alloc-L cuts the others first.
    SensitivityTable table;
    table.top_k = top_k;
    for (std::size_t l = 0; l < top_k.size(); ++l) {
      std::vector<double> row(std::size_t(c.moe.top_k), 0.0);
      for (std::int64_t k = 1; k < c.moe.top_k; ++k) row[std::size_t(k - 1)] = double(c.moe.top_k - k) * (l + 1 == top_k.size() ? 10.0 : 1.0);
      table.delta.push_back(row);
    }
    bool some_differ = false;
    for (std::int64_t B = std::int64_t(top_k.size()); B <= full_budget(top_k); ++B)
      for (const bool pooled : {false, true})
        for (const SensitivityTable* t : std::array<const SensitivityTable*, 2>{nullptr, &table}) {
          const RoutingBudget budget = make_routing_budget(c, BudgetSpec::of_count(B), t, pooled);
          CHECK(budget.activations_per_token(c) == B);
          if (t && B < full_budget(top_k) && top_k.size() > 1)  // the sensitive last layer keeps its top-k first
            CHECK(moe_ks(c, budget).back() == std::min<std::int64_t>(c.moe.top_k, B - std::int64_t(top_k.size()) + 1));
          std::vector<std::vector<std::int32_t>> first;
          for (const ModePolicy mode : {ModePolicy::static_tp, ModePolicy::static_ep})
            for (const int p : {1, 2, 3}) {
              INFO(family, ", B = ", B, pooled ? ", Alloc-T" : "", t ? ", Alloc-L" : ", uniform", ", ",
                   mode == ModePolicy::static_tp ? "TP" : "EP", ", p = ", p);
              EnginePolicy policy;
              policy.mode = mode;
              policy.budget = budget;
              const Served s = serve_on(m, requests, p, opt, policy);
              CHECK(s.stats.routed_activations == B * s.stats.tokens);
              std::vector<std::vector<std::int32_t>> tokens;
              for (const RequestOutcome& o : s.outcomes) tokens.push_back(o.tokens);
              if (first.empty()) first = tokens;
              CHECK(tokens == first);
            }
          for (std::size_t i = 0; i < first.size(); ++i) some_differ |= first[i] != ref.tokens[i % ref.tokens.size()];
        }
    CHECK(some_differ);  // a cut budget changes some greedy token
  }
}

TEST_CASE("engine budget: Alloc-T pools each chunk, so a request's tokens do not depend on its batch mates") {
  const auto [m, ref, together, opt] = served_fixture("olmoe", 64);  // every prompt in one chunk, in every run
  EnginePolicy policy;
  policy.budget = make_routing_budget(m.config, parse_budget("75%"), nullptr, true);
  const Served all = serve_on(m, together, 2, opt, policy);
  for (std::size_t i = 0; i < together.size(); ++i) {
    std::vector<ServeRequest> alone{together[i]};
    alone[0].arrival = 0;
    CHECK(serve_on(m, alone, 1, opt, policy).outcomes[0].tokens == all.outcomes[i].tokens);
  }
}

TEST_CASE("routing budget: Alloc-L follows the table, uniform spreads the cut; errors name the mismatch") {
  const LoadedDecoder m = load_decoder(fixture("mixtral").string());
  const DecoderConfig& c = m.config;
  SensitivityTable table;
  table.top_k = {2, 2};
  table.delta = {{0.9, 0.0}, {0.1, 0.0}};  // layer 1 loses less at k = 1
  CHECK(moe_ks(c, make_routing_budget(c, parse_budget("3"), &table, false)) == std::vector<std::int64_t>{2, 1});
  CHECK(moe_ks(c, make_routing_budget(c, parse_budget("3"), nullptr, false)) == std::vector<std::int64_t>{2, 1});
  table.delta = {{0.1, 0.0}, {0.9, 0.0}};
  CHECK(moe_ks(c, make_routing_budget(c, parse_budget("0.75"), &table, false)) == std::vector<std::int64_t>{1, 2});
  CHECK(moe_ks(c, make_routing_budget(c, parse_budget("50%"), &table, true)) == std::vector<std::int64_t>{1, 1});
  SensitivityTable other = table;
  other.top_k = {2, 2, 2};
  other.delta.push_back({0.5, 0.0});
  CHECK_THROWS_WITH_AS(make_routing_budget(c, parse_budget("3"), &other, false),
                       doctest::Contains("the sensitivity table has 3 MoE layers"), Error);
  CHECK_THROWS_WITH_AS(make_routing_budget(c, parse_budget("1"), nullptr, false),
                       doctest::Contains("1 activations per token; expected 2"), Error);
  RoutingBudget bad;
  bad.layer_k = {2, 7};
  CHECK_THROWS_WITH_AS(bad.validate(c), doctest::Contains("MoE layer 1 has K = 7; expected 1 to E = 4"), Error);
}

TEST_CASE("expert pieces: every permuted row once; token sorting cuts equal shares, on-demand alone evens the ranks "
          "to one row") {
  Rng rng(77);
  for (int trial = 0; trial < 200; ++trial) {
    const int p = 1 + int(rng.below(5));
    const std::int64_t E = 1 + std::int64_t(rng.below(9)), n = std::int64_t(rng.below(40));
    std::vector<std::int64_t> offsets{0}, expert;
    for (std::int64_t t = 0; t < n; ++t) {
      offsets.push_back(offsets.back() + 1);
      // skewed: expert 0 takes about half the tokens
      expert.push_back(rng.below(2) == 0 ? 0 : std::int64_t(rng.below(std::uint64_t(E))));
    }
    const Dispatch d = dispatch_by_expert(offsets, expert, E);
    // a placement with a replica of expert 0 on the last rank when there is room
    std::vector<std::vector<std::int64_t>> placement = ExpertPlacement::chunked(E, p).experts_of_rank;
    for (int r = 0; r < p; ++r)
      if (placement[std::size_t(r)].empty()) placement[std::size_t(r)].push_back(std::int64_t(r) % E);
    if (trial % 2 == 0) placement.back().push_back(0);
    for (const bool sorting : {false, true}) {
      INFO("trial ", trial, ", p = ", p, ", E = ", E, ", n = ", n, sorting ? ", sorting" : ", on-demand alone");
      const std::vector<std::vector<ExpertPiece>> pieces = assign_pieces(placement, d, sorting);
      REQUIRE(pieces.size() == std::size_t(p));
      std::vector<int> seen(static_cast<std::size_t>(d.rows()), 0);
      std::vector<std::int64_t> load;
      for (const auto& mine : pieces) {
        load.push_back(0);
        for (const ExpertPiece& piece : mine) {
          CHECK(piece.rows() > 0);
          CHECK(piece.begin >= d.offsets[std::size_t(piece.expert)]);
          CHECK(piece.end <= d.offsets[std::size_t(piece.expert + 1)]);
          for (std::int64_t i = piece.begin; i < piece.end; ++i) ++seen[std::size_t(i)];
          load.back() += piece.rows();
        }
      }
      CHECK(std::all_of(seen.begin(), seen.end(), [](int c) { return c == 1; }));
      CHECK(*std::max_element(load.begin(), load.end()) - *std::min_element(load.begin(), load.end()) <= 1);
    }
  }
}

TEST_CASE("fetch directory: bounded LRU of keys, never evicting what the current call uses") {
  FetchDirectory dir(2);
  FetchStats st;
  CHECK_FALSE(dir.use(0, 1, 1, st).hit);
  CHECK_FALSE(dir.use(0, 2, 1, st).hit);
  CHECK(dir.use(0, 1, 2, st).hit);
  CHECK_FALSE(dir.use(0, 3, 2, st).hit);  // expert 2 (least recently used, not in call 2) goes
  CHECK(dir.take_evicted() == std::vector<std::pair<std::int64_t, std::int64_t>>{{0, 2}});
  CHECK_FALSE(dir.use(1, 4, 2, st).hit);  // 1 and 3 serve call 2: overflow
  CHECK(st.overflows == 1);
  CHECK(dir.size() == 3);
  CHECK(st.fetches == 4);
  CHECK(st.hits == 1);
  CHECK_THROWS_WITH_AS(FetchDirectory(0), doctest::Contains("capacity = 0 must be at least 1"), Error);
}

TEST_CASE("on-demand loading waited at once (the overlap's baseline) computes what the overlapped one does; both "
          "count their fetch waits") {
  const LoadedDecoder m = load_decoder(fixture("olmoe").string());
  const DecoderConfig& c = m.config;
  Rng rng(5);
  std::vector<SequenceChunk> chunks;  // 3 prompts of 7 random tokens: enough rows for uneven expert loads
  for (std::int64_t i = 0; i < 3; ++i) {
    chunks.push_back({i, {}, false});
    for (int t = 0; t < 7; ++t) chunks.back().tokens.push_back(std::int32_t(rng.below(std::uint64_t(c.vocab))));
  }
  for (const int p : {2, 3}) {
    INFO("p = ", p);
    std::vector<std::vector<float>> logits(3);  // rank 0's: default split, overlapped, at once
    std::vector<FetchStats> stats(2);  // over all ranks: overlapped, at once
    run_ranks(p, [&](ThreadCommunicator& comm) {
      const RankShard s = make_rank_shard(c, m.weights, p, comm.rank(), MoeMode::ep);
      for (int run = 0; run < 3; ++run) {
        PagedKvCache cache({c.layers, 8, 4, s.kv_heads.length, c.head_dim});
        BufferPool pool;
        PeerFetchWork<ThreadCommunicator> fetch(comm, false, 1, run == 1);
        ExpertWorkFn work;
        if (run > 0) work = [&](const RankShard& rs, std::int64_t l, const Dispatch& d) { return fetch(rs, l, d); };
        for (const SequenceChunk& ch : chunks) cache.reserve(ch.request, std::int64_t(ch.tokens.size()));
        const StepResult out = decoder_step(comm, c, s, cache, std::span<const SequenceChunk>(chunks), pool, work);
        std::vector<double> all{fetch.stats().wait_s, double(fetch.stats().bytes_fetched)};  // over the ranks
        comm.all_reduce(std::span<const double>(all), std::span<double>(all), ReduceOp::sum);
        if (comm.rank() != 0) continue;
        for (const Tensor<float>& l : out.logits) logits[std::size_t(run)].insert(logits[std::size_t(run)].end(), l.span().begin(), l.span().end());
        if (run > 0) {
          stats[std::size_t(run - 1)].wait_s = all[0];
          stats[std::size_t(run - 1)].bytes_fetched = std::size_t(all[1]);
        }
      }
    });
    CHECK(logits[1] == logits[2]);  // the same tasks in the same order: only the waits move
    REQUIRE(logits[0].size() == logits[1].size());
    for (std::size_t i = 0; i < logits[0].size(); ++i) CHECK(logits[1][i] == doctest::Approx(logits[0][i]).epsilon(1e-5));
    for (const FetchStats& st : stats) {
      CHECK(st.bytes_fetched > 0);  // the uneven routing moved rows, so some rank fetched
      CHECK(st.wait_s > 0);         // and waited on the fetches
    }
    CHECK(stats[0].bytes_fetched == stats[1].bytes_fetched);
  }
}
