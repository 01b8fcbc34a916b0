// paradyse/serve/engine.hpp: the MoE serving loop on p ranks: continuous batching over a paged KV cache, chunked
// prefill, greedy or seeded sampling, an Alloc-MoE activation budget, and the MoE layout policy (static TP, static EP,
// EP + EPLB, token sorting, on-demand expert loading from the owning rank, dynamic TP<->EP switching with the
// redistribution pipelined behind compute).
//
// Every rank runs serve_requests with the same requests (SPMD). Rank 0 plans each step and broadcasts the plan:
//   - admission: requests that have arrived (on the engine's clock, serve/clock.hpp: in steps, seconds of the wall
//     clock, or seconds of a simulated cluster), in arrival order, while
//     fewer than max_running run and the KV pool has the blocks of prompt + max_new_tokens (reserved at admission,
//     so a running request never waits for memory);
//   - the batch: one decode token of every running request that finished its prompt, then prompt chunks of the
//     others in admission order while the step's token budget lasts (a long prompt takes several steps);
//   - the layout: under the dynamic policy the switcher (serve/switch_policy.hpp) forecasts this batch (its chunks,
//     the recent routing's expert shares over its tokens: LoadForecast) in both layouts, and the switch's exposed
//     time, on policy.time_model by policy.forecast (serve/switch_policy.hpp ForecastModel: step_cost's analytic
//     model, or the dry run of the step, what the simulated clock charges on that cluster), or policy.forecast_price;
//     with SwitchPolicy::window the coming steps too (the running requests' chunks and the queue played forward); the
//     events a dry-run forecast recorded go in the step's trace (host work the simulated clock charges:
//     serve/step_dry_run.hpp host_work_s; an analytic forecast records none, its microseconds unpriced); a change is
//     carried out during the step: each layer's weights are posted for redistribution right after the layer computed
//     in the old layout, and the new layout is installed before the next step (exposed time: what the posting and the
//     final waits took);
//   - EPLB (EP only): every eplb_interval steps the expert loads gathered since the last rebalance give a new
//     placement (serve/eplb.hpp) with redundant slots, installed the same way.
// Rank 0 samples (each request from its own seeded Rng) and broadcasts the tokens. Requests leave when they have
// max_new_tokens tokens; their blocks go back to the pool. The scheduler (serve_loop) drives a stepper: ModelStepper
// computes on the weights; serve/shape_step.hpp's ShapeStepper only accounts (a shape that does not fit here, its
// routing from a routing source). Each step's trace (serve/step_trace.hpp) goes to the clock.
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/timer.hpp"
#include "paradyse/serve/clock.hpp"
#include "paradyse/serve/decoder_step.hpp"
#include "paradyse/serve/eplb.hpp"
#include "paradyse/serve/expert_balance.hpp"
#include "paradyse/serve/redistribute.hpp"
#include "paradyse/serve/sampling.hpp"
#include "paradyse/serve/step_trace.hpp"
#include "paradyse/serve/switch_policy.hpp"

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <vector>

namespace paradyse::serve {

struct ServeRequest {
  std::int64_t id = 0;
  std::vector<std::int32_t> prompt;
  std::int64_t max_new_tokens = 8;
  SamplingParams sampling;
  double arrival = 0;  // steps, or seconds since the start with EngineOptions::wall_clock
};

struct RequestOutcome {
  std::int64_t id = 0, prompt_tokens = 0;
  std::vector<std::int32_t> tokens;
  double arrival = 0, first_token = 0, finish = 0;  // seconds since the start (wall clock) or steps
};

enum class ModePolicy { static_tp, static_ep, dynamic };

struct EnginePolicy {
  ModePolicy mode = ModePolicy::static_tp;
  bool eplb = false;                  // EP: rebalance the placement from the gathered loads
  std::int64_t eplb_interval = 8;     // steps between rebalances
  std::int64_t redundant_slots = 1;   // extra expert slots per rank for EPLB's replicas
  bool token_sorting = false;         // EP: equal pairs per rank (the experts a rank lacks from the host copy)
  bool on_demand = false;             // EP: lacking experts fetched from their owner, overlapped (alone: rows moved
                                      // from the busiest rank to the least busy; with token_sorting: its cut)
  std::int64_t fetch_capacity = 4;    // fetched experts a rank caches
  bool pipelined_switch = true;       // redistribute layer by layer during the step (else stall before it)
  SwitchPolicy switching;
  // The time model the switcher forecasts on (stats.predicted reports step_cost's analytic model on it); under
  // simulation the clock's cluster. Unset: time_model_of(rates).
  std::optional<SimulatedCluster> time_model;
  ForecastModel forecast = ForecastModel::analytic;  // how the switcher prices a step on it (serve/switch_policy.hpp)
  StepPricer forecast_price;  // when set, the switcher's cost of a step instead of `forecast`
  MachineRates rates;
  RoutingBudget budget;               // Alloc-MoE: K_l per MoE layer, Alloc-T per chunk (serve/routing_budget.hpp)
};

struct EngineOptions {
  std::int64_t step_tokens = 32;   // tokens per step (decodes first, prompt chunks fill the rest)
  std::int64_t max_running = 16;
  std::int64_t kv_blocks = 256;
  std::int64_t block_size = 16;
  bool wall_clock = false;         // without `clock`: seconds of the wall clock, else steps
  EngineClock* clock = nullptr;    // when set, the clock the engine runs on (serve/clock.hpp; wall_clock ignored)
};

struct EngineStats {
  std::int64_t steps = 0, tokens = 0, switches = 0, rebalances = 0;
  std::int64_t routed_activations = 0;  // (token, expert) pairs over every MoE layer and step (B per token)
  double elapsed_s = 0;
  double switch_exposed_s = 0;      // time the layout changes took on the critical path
  std::size_t switch_bytes = 0;     // expert bytes this rank sent to the others for layout changes
  std::vector<MoeMode> mode_of_step;
  std::vector<double> expert_max, expert_mean;  // per layer: sums over steps of max / mean tokens per expert
  std::vector<double> rank_max, rank_mean;      // per layer: sums over steps of max / mean rows per rank
  FetchStats fetch;
  // Per step that computed (for --explain style reports: the cost model against the measured step):
  std::vector<double> step_seconds;       // the step's time on the engine's clock (wall: on this rank), planning to
                                          // the sampled tokens
  std::vector<std::int64_t> step_tokens;  // tokens the step computed
  std::vector<double> step_host_s;        // this rank's thread CPU seconds in the step outside the stepper's compute
                                          // and the forecast: planning, the plan's and tokens' broadcasts, the
                                          // statistics, sampling (rank 0's: the engine's own host work)
  std::vector<double> step_run_s;         // this rank's thread CPU seconds in the stepper's compute (decoder_step and
                                          // the layout change's posting and waits)
  std::vector<double> step_forecast_s;    // this rank's thread CPU seconds in the dynamic policy's forecast (rank 0's;
                                          // 0 where no forecast ran: the other ranks, a static policy)
  std::vector<ModeCosts> predicted;       // the step's predicted time (step_cost on policy's time model) with every
                                          // MoE layer in TP and in EP, for its actual batch and routing
};

struct EngineProgress {
  std::int64_t step = 0, finished = 0, total = 0, running = 0;
  MoeMode mode = MoeMode::tp;
};

// What a stepper's step computed, for the scheduler.
struct StepOutput {
  std::vector<MoeLayerLoad> moe_load;  // per layer (empty for dense layers)
  double switch_wall_s = 0;            // wall time the layout change took on the critical path
  std::size_t switch_bytes = 0;        // expert bytes this rank sent to the others for it
};

namespace engine_detail {

struct Live {
  const ServeRequest* request = nullptr;
  std::int64_t done_prompt = 0;  // prompt positions processed
  RequestOutcome outcome;
  std::optional<Rng> rng;
};

inline std::vector<std::vector<std::int64_t>> placement_of(const std::vector<std::int64_t>& phy2log, int ranks) {
  std::vector<std::vector<std::int64_t>> pl(static_cast<std::size_t>(ranks));
  const std::size_t per = phy2log.size() / std::size_t(ranks);
  for (std::size_t i = 0; i < phy2log.size(); ++i) pl[i / per].push_back(phy2log[i]);
  return pl;
}

}  // namespace engine_detail

// The engine's work on real weights, rank comm.rank() of comm.size(): the rank's shard, its paged KV cache, the
// decoder step in the current layout (token sorting or on-demand loading in EP), the layout changes (each MoE layer
// posted for redistribution right after it computed in the old layout when pipelined, else all before the step) and
// sampling from the step's logits. The scheduler (serve_loop) drives it; serve/shape_step.hpp is the same interface
// without weights, for shapes that do not fit here.
template <Communicator C>
class ModelStepper {
public:
  ModelStepper(C& comm, const LoadedDecoder& model, const EngineOptions& opt, const EnginePolicy& policy, MoeMode start)
      : comm_(comm), model_(model), budget_(policy.budget),
        shard_(make_rank_shard(model.config, model.weights, comm.size(), comm.rank(), start)),
        cache_(kv_cache_shape(model.config, shard_, opt.kv_blocks, opt.block_size)) {
    if (policy.on_demand)
      on_demand_.emplace(comm, policy.token_sorting, policy.fetch_capacity);
    else if (policy.token_sorting)
      sorting_.emplace(model.weights, policy.fetch_capacity);
    if (sorting_) work_ = [this](const RankShard& s, std::int64_t l, const Dispatch& d) { return (*sorting_)(s, l, d); };
    if (on_demand_) work_ = [this](const RankShard& s, std::int64_t l, const Dispatch& d) { return (*on_demand_)(s, l, d); };
  }
  ModelStepper(const ModelStepper&) = delete;
  ModelStepper& operator=(const ModelStepper&) = delete;

  const DecoderConfig& config() const noexcept { return model_.config; }
  int ranks() const noexcept { return comm_.size(); }
  PagedKvCache& cache() noexcept { return cache_; }
  ExpertLayout layout(std::int64_t l) const {
    const RankLayer& L = shard_.layers[std::size_t(l)];
    return L.mode == MoeMode::tp ? ExpertLayout::tp() : ExpertLayout::ep(L.placement);
  }
  FetchStats fetch_stats() const {
    if (sorting_) return sorting_->stats();
    if (on_demand_) return on_demand_->stats();
    return {};
  }

  // One step over `batch` computed in `ran` (the layout of every MoE layer); next[l], when set, is installed for
  // layer l by this step (pipelined: posted after layer l computed; else before the step, and `ran` is the new one).
  StepOutput run(std::span<const SequenceChunk> batch, MoeMode ran, const std::vector<std::optional<ExpertLayout>>& next,
                 bool pipelined) {
    const DecoderConfig& c = model_.config;
    bool any = false;
    for (const auto& n : next) any = any || n.has_value();
    std::vector<LayerRedistribution> moving(static_cast<std::size_t>(c.layers));
    StepOutput result;
    auto layout_of = [&](const RankLayer& L) {
      return L.mode == MoeMode::tp ? ExpertLayout::tp() : ExpertLayout::ep(L.placement);
    };
    auto post = [&](std::int64_t l) {
      if (!any || !c.is_moe(l) || !next[std::size_t(l)]) return;
      const Timer t0;
      RankLayer& L = shard_.layers[std::size_t(l)];
      moving[std::size_t(l)].begin(comm_, c, L, layout_of(L), *next[std::size_t(l)]);
      result.switch_wall_s += t0.seconds();
    };
    auto finish_all = [&]() {
      if (!any) return;
      const Timer t0;
      for (std::int64_t l = 0; l < c.layers; ++l)
        if (c.is_moe(l) && next[std::size_t(l)]) {
          moving[std::size_t(l)].finish();
          result.switch_bytes += moving[std::size_t(l)].bytes_sent();
        }
      result.switch_wall_s += t0.seconds();
    };
    if (any && !pipelined) {
      for (std::int64_t l = 0; l < c.layers; ++l) post(l);
      finish_all();
    }
    // Token sorting is an EP policy; TP layers take the plain path.
    out_ = decoder_step(comm_, c, shard_, cache_, batch, pool_, ran == MoeMode::ep ? work_ : ExpertWorkFn{},
                        (any && pipelined) ? std::function<void(std::int64_t)>(post) : std::function<void(std::int64_t)>{},
                        budget_);
    if (any && pipelined) finish_all();
    result.moe_load = out_.moe_load;
    return result;
  }
  // Rank 0: the next token of chunk k of the last step.
  std::int32_t sample(std::size_t k, const SamplingParams& s, Rng& rng) const {
    return sample_token(out_.logits[k].span(), s, rng);
  }

private:
  C& comm_;
  const LoadedDecoder& model_;
  RoutingBudget budget_;
  RankShard shard_;
  PagedKvCache cache_;
  BufferPool pool_;
  std::optional<TokenSortingWork> sorting_;
  std::optional<PeerFetchWork<C>> on_demand_;
  ExpertWorkFn work_;
  StepResult out_;
};

// The scheduler over any stepper (ModelStepper, or serve/shape_step.hpp's ShapeStepper), on `clock`. Rank 0 plans;
// the plans and sampled tokens are broadcast over `comm` (which may have one rank while the stepper models p).
template <Communicator C, class Stepper>
std::vector<RequestOutcome> serve_loop(C& comm, Stepper& stepper, const std::vector<ServeRequest>& requests,
                                       const EngineOptions& opt, const EnginePolicy& policy, EngineClock& clock,
                                       EngineStats* stats_out = nullptr,
                                       const std::function<void(const EngineProgress&)>& progress = {}) {
  using namespace engine_detail;
  const DecoderConfig& c = stepper.config();
  const int p = stepper.ranks(), me = comm.rank();
  const bool share = comm.size() > 1;
  for (const ServeRequest& r : requests) {
    check(!r.prompt.empty() && r.max_new_tokens >= 1, "serve_requests: request {} needs a prompt and max_new_tokens >= 1",
          r.id);
    r.sampling.validate();
  }
  policy.budget.validate(c);
  check(opt.step_tokens >= 1 && opt.max_running >= 1, "serve_requests: step_tokens {} and max_running {} must be >= 1",
        opt.step_tokens, opt.max_running);
  const bool any_moe = c.any_moe();
  const ExpertPlacement chunked = any_moe ? ExpertPlacement::chunked(c.moe.experts, p) : ExpertPlacement{};
  MoeMode mode = policy.mode == ModePolicy::static_ep ? MoeMode::ep : MoeMode::tp;
  PagedKvCache& cache = stepper.cache();
  ModeSwitcher switcher(policy.switching, mode);
  const SimulatedCluster time_model = policy.time_model ? *policy.time_model : time_model_of(policy.rates);
  // The switcher's cost of a step: policy.forecast_price, else policy.forecast on the time model (the same on every
  // clock, so the wall, step and simulated clocks take the same decisions). The dry-run pricer remembers its last
  // steps' runs: the switch's exposed time is priced from the current layout's run.
  DryRunPricer dry_run_price(c, time_model, policy.budget);
  const StepPricer forecast_price = policy.forecast_price ? policy.forecast_price
                                    : policy.forecast == ForecastModel::dry_run
                                        ? StepPricer([&](const StepTrace& t) { return dry_run_price(t); })
                                        : analytic_pricer(c, time_model);
  auto current_layouts = [&] {
    std::vector<ExpertLayout> now(std::size_t(c.layers), ExpertLayout::tp());
    for (std::int64_t l = 0; l < c.layers; ++l)
      if (c.is_moe(l)) now[std::size_t(l)] = stepper.layout(l);
    return now;
  };
  const ExpertLayout chunked_ep = any_moe ? ExpertLayout::ep(chunked.experts_of_rank) : ExpertLayout::tp();

  EngineStats stats;
  stats.expert_max.assign(std::size_t(c.layers), 0.0);
  stats.expert_mean = stats.rank_max = stats.rank_mean = stats.expert_max;
  std::vector<std::vector<double>> window(static_cast<std::size_t>(c.layers), std::vector<double>(std::size_t(c.moe.experts), 0.0));
  LoadForecast loads(c.layers);  // the forecast's expert loads, from the steps' routing

  std::vector<Live> live(requests.size());
  std::vector<std::size_t> order(requests.size());  // by arrival
  for (std::size_t i = 0; i < requests.size(); ++i) live[i].request = &requests[i], order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return requests[a].arrival < requests[b].arrival; });
  std::size_t next_arrival = 0, finished = 0;
  std::vector<std::size_t> running;  // admission order
  clock.start();
  std::vector<std::int64_t> plan;

  while (finished < requests.size()) {
    clock.step_begin();
    const double cpu_at_begin = thread_cpu_seconds();
    double forecast_cpu_s = 0;  // the forecast's own, charged by its events
    // ---- rank 0 plans the step ----
    plan.clear();
    if (me == 0) {
      std::vector<std::int64_t> admitted;
      std::int64_t free_blocks = cache.free_blocks();
      while (next_arrival < order.size() && requests[order[next_arrival]].arrival <= clock.now() &&
             std::int64_t(running.size() + admitted.size()) < opt.max_running) {
        const ServeRequest& r = requests[order[next_arrival]];
        const std::int64_t need = cache.blocks_for(std::int64_t(r.prompt.size()) + r.max_new_tokens);
        check(need <= opt.kv_blocks, "serve_requests: request {} needs {} KV blocks, the pool has {}", r.id, need,
              opt.kv_blocks);
        if (need > free_blocks) break;
        free_blocks -= need;
        admitted.push_back(std::int64_t(order[next_arrival++]));
      }
      if (running.empty() && admitted.empty() && next_arrival < order.size())
        clock.wait_for(requests[order[next_arrival]].arrival);
      // Chunks: decodes, then prompt chunks under the budget.
      std::vector<std::size_t> all = running;
      for (const std::int64_t a : admitted) all.push_back(std::size_t(a));
      std::vector<std::pair<std::int64_t, std::int64_t>> chunks;  // (request index, tokens)
      std::int64_t budget = opt.step_tokens;
      for (const std::size_t i : all)
        if (live[i].done_prompt == std::int64_t(requests[i].prompt.size())) chunks.push_back({std::int64_t(i), 1}), --budget;
      for (const std::size_t i : all) {
        const std::int64_t left = std::int64_t(requests[i].prompt.size()) - live[i].done_prompt;
        if (left > 0 && budget > 0) {
          const std::int64_t take = std::min(left, budget);
          chunks.push_back({std::int64_t(i), take});
          budget -= take;
        }
      }
      std::int64_t n = 0;
      for (const auto& ch : chunks) n += ch.second;
      // The layout after this step.
      MoeMode target = mode;
      const std::int64_t events_before = dry_run_price.events();
      if (policy.mode == ModePolicy::dynamic && any_moe && n > 0 && loads.ready()) {
        const double forecast_begin = thread_cpu_seconds();
        std::vector<ChunkShape> shapes;  // the step's chunks and what their requests have cached
        for (const auto& [i, len] : chunks) {
          const Live& L = live[std::size_t(i)];
          const std::int64_t prompt = std::int64_t(requests[std::size_t(i)].prompt.size());
          const bool decode = L.done_prompt >= prompt;
          shapes.push_back({len, decode ? prompt + std::int64_t(L.outcome.tokens.size()) - 1 : L.done_prompt, decode});
        }
        if (policy.switching.window == 0) {
          target = switcher.decide(forecast_layouts(c, shapes, loads.loads(n), current_layouts(), chunked_ep, p,
                                                    policy.pipelined_switch, forecast_price));
        } else {  // the window: this step and the next `window`, from the running requests and the queue
          std::vector<PendingRequest> now, queue;
          for (const std::size_t i : all) {
            const std::int64_t prompt = std::int64_t(requests[i].prompt.size()), out = std::int64_t(live[i].outcome.tokens.size());
            const bool decode = live[i].done_prompt >= prompt;
            now.push_back({prompt - live[i].done_prompt, decode ? prompt + out - 1 : live[i].done_prompt,
                           requests[i].max_new_tokens - out});
          }
          for (std::size_t q = next_arrival; q < order.size() && requests[order[q]].arrival <= clock.now(); ++q)
            queue.push_back({std::int64_t(requests[order[q]].prompt.size()), 0, requests[order[q]].max_new_tokens});
          target = switcher.decide(forecast_window(
              c, forecast_batches(now, queue, opt.step_tokens, opt.max_running, policy.switching.window + 1),
              loads, current_layouts(), chunked_ep, p, policy.pipelined_switch, forecast_price));
        }
        forecast_cpu_s = thread_cpu_seconds() - forecast_begin;
      }
      const bool rebalance = policy.eplb && mode == MoeMode::ep && target == MoeMode::ep && any_moe &&
                             stats.steps > 0 && stats.steps % policy.eplb_interval == 0;
      plan = {std::int64_t(admitted.size()), std::int64_t(chunks.size()), std::int64_t(target), rebalance ? 1 : 0,
              dry_run_price.events() - events_before};  // the forecast's host work, for the clock
      plan.insert(plan.end(), admitted.begin(), admitted.end());
      for (const auto& ch : chunks) plan.push_back(ch.first), plan.push_back(ch.second);
    }
    std::int64_t size = std::int64_t(plan.size());
    if (share) comm.broadcast(std::span<std::int64_t>(&size, 1), 0);
    plan.resize(std::size_t(size));
    if (share) comm.broadcast(std::span<std::int64_t>(plan), 0);
    const std::int64_t n_admit = plan[0], n_chunks = plan[1];
    const MoeMode target = MoeMode(plan[2]);
    const bool rebalance = plan[3] != 0;
    const std::int64_t planning_events = plan[4];
    for (std::int64_t a = 0; a < n_admit; ++a) {
      const std::size_t i = std::size_t(plan[std::size_t(5 + a)]);
      const ServeRequest& r = requests[i];
      cache.reserve(r.id, std::int64_t(r.prompt.size()) + r.max_new_tokens);
      running.push_back(i);
      live[i].outcome.id = r.id;
      live[i].outcome.prompt_tokens = std::int64_t(r.prompt.size());
      live[i].outcome.arrival = r.arrival;
      if (me == 0) live[i].rng.emplace(request_rng(r.sampling, r.id));
    }
    if (n_chunks == 0) {  // nothing arrived yet: time passes
      double next = std::numeric_limits<double>::infinity();
      for (const ServeRequest& r : requests)
        if (r.arrival > clock.now()) next = std::min(next, r.arrival);
      clock.idle(next);
      if (clock.counts_idle_steps()) ++stats.steps;
      continue;
    }
    std::vector<SequenceChunk> batch;
    std::vector<std::size_t> index_of_chunk;
    StepTrace trace;
    trace.ranks = p;
    trace.admitted = n_admit;
    trace.planning_events = planning_events;
    for (std::int64_t k = 0; k < n_chunks; ++k) {
      const std::size_t i = std::size_t(plan[std::size_t(5 + n_admit + 2 * k)]);
      const std::int64_t len = plan[std::size_t(6 + n_admit + 2 * k)];
      const ServeRequest& r = requests[i];
      SequenceChunk ch{r.id, {}, false};
      const bool decode = live[i].done_prompt >= std::int64_t(r.prompt.size());
      if (!decode)
        ch.tokens.assign(r.prompt.begin() + live[i].done_prompt, r.prompt.begin() + live[i].done_prompt + len);
      else
        ch.tokens = {live[i].outcome.tokens.back()};
      trace.chunks.push_back({std::int64_t(ch.tokens.size()), cache.length(r.id), decode});
      batch.push_back(std::move(ch));
      index_of_chunk.push_back(i);
    }
    // ---- the layout change (or EPLB's new placement) this step carries out ----
    const bool change = target != mode || rebalance;
    trace.layout.resize(std::size_t(c.layers));
    trace.next.resize(std::size_t(c.layers));
    trace.routed.resize(std::size_t(c.layers));
    trace.pipelined_switch = policy.pipelined_switch;
    for (std::int64_t l = 0; l < c.layers; ++l) {
      if (!c.is_moe(l)) continue;
      trace.layout[std::size_t(l)] = stepper.layout(l);
      if (!change) continue;
      if (target != mode) {
        trace.next[std::size_t(l)] = target == MoeMode::tp ? ExpertLayout::tp() : ExpertLayout::ep(chunked.experts_of_rank);
      } else {  // EPLB: the placement differs per layer
        const std::int64_t slots = (c.moe.experts + p - 1) / p + policy.redundant_slots;
        const std::vector<std::int64_t> phy2log = eplb_place(window[std::size_t(l)], {slots * p, 1, 1, std::int64_t(p)});
        trace.next[std::size_t(l)] = ExpertLayout::ep(placement_of(phy2log, p));
      }
    }
    const bool pipelined = policy.pipelined_switch;
    // The layout this step computes in.
    const MoeMode ran = (change && !pipelined) ? target : mode;
    const double run_begin = thread_cpu_seconds();
    const StepOutput out = stepper.run(std::span<const SequenceChunk>(batch), ran, trace.next, pipelined);
    const double run_cpu_s = thread_cpu_seconds() - run_begin;
    clock.stepper_ran(run_begin, run_begin + run_cpu_s);
    if (change) {
      stats.switch_bytes += out.switch_bytes;
      if (target != mode) ++stats.switches;
      else ++stats.rebalances;
      if (rebalance)
        for (auto& w : window) std::fill(w.begin(), w.end(), 0.0);
    }
    mode = target;
    // ---- statistics ----
    std::int64_t n = 0;
    for (const SequenceChunk& ch : batch) n += std::int64_t(ch.tokens.size());
    for (std::int64_t l = 0; l < c.layers; ++l) {
      if (!c.is_moe(l)) continue;
      const MoeLayerLoad& load = out.moe_load[std::size_t(l)];
      trace.routed[std::size_t(l)] = load.routed;
      for (const std::int64_t pairs : load.routed) stats.routed_activations += pairs;
      double mx = 0, sum = 0;
      for (std::size_t e = 0; e < load.routed.size(); ++e) {
        window[std::size_t(l)][e] += double(load.routed[e]);
        mx = std::max(mx, double(load.routed[e]));
        sum += double(load.routed[e]);
      }
      stats.expert_max[std::size_t(l)] += mx;
      stats.expert_mean[std::size_t(l)] += sum / double(std::max<std::size_t>(1, load.routed.size()));
      double rmax = 0, rsum = 0;
      for (const std::int64_t rows : load.rank_rows) rmax = std::max(rmax, double(rows)), rsum += double(rows);
      stats.rank_max[std::size_t(l)] += rmax;
      stats.rank_mean[std::size_t(l)] += rsum / double(p);
    }
    loads.observe(trace.routed, n);
    stats.mode_of_step.push_back(ran);
    ++stats.steps;
    stats.tokens += n;
    // ---- sampling on rank 0, tokens to every rank ----
    std::vector<std::int64_t> sampled;
    for (std::size_t k = 0; k < batch.size(); ++k) {
      Live& L = live[index_of_chunk[k]];
      const ServeRequest& r = *L.request;
      const bool prompt_chunk = L.done_prompt < std::int64_t(r.prompt.size());
      if (prompt_chunk) L.done_prompt += std::int64_t(batch[k].tokens.size());
      if (L.done_prompt < std::int64_t(r.prompt.size())) continue;  // more prompt to come
      std::int64_t token = 0;
      if (me == 0) token = stepper.sample(k, r.sampling, *L.rng);
      sampled.push_back(token);
    }
    if (share && !sampled.empty()) comm.broadcast(std::span<std::int64_t>(sampled), 0);
    const double host_s = thread_cpu_seconds() - cpu_at_begin - forecast_cpu_s - run_cpu_s;
    const StepTiming timing = clock.step_end(trace, out.switch_wall_s);
    if (change) stats.switch_exposed_s += timing.switch_exposed_s;
    std::size_t next = 0;
    const double t = clock.now();
    for (std::size_t k = 0; k < batch.size(); ++k) {
      const std::size_t i = index_of_chunk[k];
      Live& L = live[i];
      if (L.done_prompt < std::int64_t(L.request->prompt.size())) continue;
      if (L.outcome.tokens.empty()) L.outcome.first_token = t;
      L.outcome.tokens.push_back(std::int32_t(sampled[next++]));
      if (std::int64_t(L.outcome.tokens.size()) == L.request->max_new_tokens) {
        L.outcome.finish = t;
        cache.release(L.request->id);
        running.erase(std::find(running.begin(), running.end(), i));
        ++finished;
      }
    }
    stats.step_seconds.push_back(timing.step_s);
    stats.step_tokens.push_back(n);
    stats.step_host_s.push_back(host_s);
    stats.step_run_s.push_back(run_cpu_s);
    stats.step_forecast_s.push_back(forecast_cpu_s);
    stats.predicted.push_back(
        forecast_layouts(c, trace.chunks, trace.routed, trace.layout, chunked_ep, p, trace.pipelined_switch, time_model,
                         false)
            .step);
    if (progress && me == 0)
      progress({stats.steps, std::int64_t(finished), std::int64_t(requests.size()), std::int64_t(running.size()), mode});
  }
  stats.elapsed_s = clock.elapsed_s();
  stats.fetch = stepper.fetch_stats();
  if (stats_out) *stats_out = stats;
  std::vector<RequestOutcome> outcomes;
  if (me == 0)
    for (const Live& L : live) outcomes.push_back(L.outcome);
  return outcomes;
}

// Serves `requests` on this rank; rank 0 returns the outcomes (in request order), the others an empty list.
template <Communicator C>
std::vector<RequestOutcome> serve_requests(C& comm, const LoadedDecoder& model, const std::vector<ServeRequest>& requests,
                                           const EngineOptions& opt, const EnginePolicy& policy,
                                           EngineStats* stats_out = nullptr,
                                           const std::function<void(const EngineProgress&)>& progress = {}) {
  StepClock steps;
  WallClock wall;
  EngineClock& clock = opt.clock ? *opt.clock : opt.wall_clock ? static_cast<EngineClock&>(wall) : steps;
  ModelStepper<C> stepper(comm, model, opt, policy, policy.mode == ModePolicy::static_ep ? MoeMode::ep : MoeMode::tp);
  return serve_loop(comm, stepper, requests, opt, policy, clock, stats_out, progress);
}

}  // namespace paradyse::serve
