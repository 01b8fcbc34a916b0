// paradyse/serve/switch_policy.hpp: the dynamic policy's per-step choice between TP and EP, made by the time model's
// cost of the step (StepPricer: serve/step_cost.hpp's analytic model by default, or the dry run of the step that the
// simulated clock charges, serve/step_dry_run.hpp; ForecastModel).
//
// Before each step the scheduler forecasts the step about to run (its chunks and cached lengths, the recent routing's
// expert shares laid over its tokens: LoadForecast) in both layouts: the price of the whole step in TP and in EP, and
// the exposed time of switching to the other layout during this step (the price's switch term, pipelined as the
// engine does it).
// A step favours the other layout when step(other) < (1 - margin) * step(current); the switcher moves when
//   - `patience` consecutive steps favoured it,
//   - the switch's exposed time is paid for: with `break_even` (moe_simulate's and the named dynamic policy's
//     choice), the time the streak's steps would have saved in the other layout, sum of step(current) -
//     step(other), covers it (its cost amortised over the streak that asks for it: rent-or-buy's break-even rule);
//     else each step's saving must exceed it amortised over `horizon` steps (step(other) + switch / horizon <
//     (1 - margin) step(current)). A fixed horizon charges the switch to steps the new layout may never serve:
//     with 32 steps, on Mixtral-8x7B at 1 request/s every 1-2 step prefill switched to EP and back (202 switches,
//     4.2 s exposed in 300 requests; break-even: see docs/serving_simulation.md),
//   - and `dwell` steps have passed since the previous switch:
// a burst of one step does not flip it, and a load that hovers at the crossover does not thrash. With
// SwitchPolicy::window = k the forecast is of the step and the k after it (forecast_batches, forecast_window, below):
// the switcher moves when that window's savings pay for the switch (docs/serving_simulation.md: on the Azure code
// trace 0.96x of the best static policy against the one-step forecast's 0.81x; worse at 1-2 requests/s).
//
// The time model is a hardware profile (cost/profile.hpp) and the dtype's bytes: a named cluster's under simulation
// (moe_simulate sets the policy's to the clock's), this machine's calibrated profile, or, for a run that has neither,
// the three rates measure_machine_rates takes in a second (time_model_of: GEMMs at the measured rate with their
// operands at the measured weight-streaming bandwidth; the half-rate width is reported, not used).
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/timer.hpp"
#include "paradyse/ops/backend.hpp"
#include "paradyse/serve/policy_rounds.hpp"
#include "paradyse/serve/rank_shard.hpp"
#include "paradyse/serve/step_cost.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string_view>
#include <vector>

namespace paradyse::serve {

struct MachineRates {
  double memory_bytes_per_s = 20e9;
  double flops_per_s = 20e9;
  double half_rate_columns = 64;  // GEMM width at which the rate is half of flops_per_s

  double gemm_rate(double columns) const { return flops_per_s * columns / (columns + half_rate_columns); }
};

// The rates of this machine for experts of width f over p ranks, measured: the GEMM rate of an expert's W_in
// product (256 rows) at f / p and at f columns gives F and c_half (the model evaluates F(cols) only at these two
// widths, so the fit passes through both); one row against the whole W_in gives the bandwidth at which a decode step
// streams weights. The TP/EP choice rests on the ratio of the two GEMM rates, and a shared machine's load comes and
// goes: so the three measurements alternate within each of `repetitions` rounds (a burst of load hits them alike),
// after one untimed round, and each is the median of its rounds. (Measured one after the other with 5 repetitions
// each, c_half came out anywhere from 0 to 1148 columns between runs here, and F from 17 to 93 GFLOP/s.)
inline MachineRates measure_machine_rates(const MoeConfig& m, int ranks, int repetitions = 9) {
  check(ranks >= 1 && repetitions >= 1, "measure_machine_rates: ranks {} and repetitions {} must be >= 1", ranks,
        repetitions);
  const std::int64_t h = m.hidden, rows = 256;
  const std::int64_t c1 = std::max<std::int64_t>(1, m.expert_ffn / ranks), c2 = m.expert_ffn;
  Tensor<float> x(Shape{rows, h}), w1(Shape{2 * c1, h}), y1(Shape{rows, 2 * c1}), w2(Shape{2 * c2, h}),
      y2(Shape{rows, 2 * c2}), one(Shape{1, h}), y(Shape{1, 2 * c2});
  x.fill(0.5f);
  w1.fill(0.25f);
  w2.fill(0.25f);
  one.fill(0.5f);
  auto seconds = [](auto&& body) {
    return std::max(time_seconds(body), 1e-9);
  };
  std::vector<double> t1, t2, tm;
  for (int r = -1; r < repetitions; ++r) {
    const double a = seconds([&] { ops::Cpu::matmul(x.view(), ops::Transpose::no, w1.view(), ops::Transpose::yes, y1.view()); });
    const double b = seconds([&] { ops::Cpu::matmul(x.view(), ops::Transpose::no, w2.view(), ops::Transpose::yes, y2.view()); });
    const double c = seconds([&] { ops::Cpu::matmul(one.view(), ops::Transpose::no, w2.view(), ops::Transpose::yes, y.view()); });
    if (r < 0) continue;
    t1.push_back(a), t2.push_back(b), tm.push_back(c);
  }
  const double r1 = 2.0 * double(rows) * double(h) * double(2 * c1) / median(t1);
  const double r2 = 2.0 * double(rows) * double(h) * double(2 * c2) / median(t2);
  MachineRates rates;
  const double d1 = double(c1), d2 = double(c2);
  rates.half_rate_columns = (d2 > d1 && r2 > r1 && r1 / d1 > r2 / d2) ? (r2 - r1) / (r1 / d1 - r2 / d2) : 0.0;
  rates.flops_per_s = r2 * (d2 + rates.half_rate_columns) / d2;
  rates.memory_bytes_per_s = double(w2.bytes()) / median(tm);
  return rates;
}

struct ModeCosts {
  double tp_s = 0, ep_s = 0;
};

// The time model of a machine known only by measure_machine_rates' three rates (float weights and activations):
// GEMMs at flops_per_s with their operands read at memory_bytes_per_s, elementwise work and the links (thread ranks
// copy through memory: a switch's exchange reads and writes its bytes, step_cost.hpp exchange_time) at
// memory_bytes_per_s, attention at flops_per_s; one node.
inline SimulatedCluster time_model_of(const MachineRates& rates) {
  check(rates.flops_per_s > 0 && rates.memory_bytes_per_s > 0, "time_model_of: rates {} FLOP/s and {} B/s must be "
        "positive", rates.flops_per_s, rates.memory_bytes_per_s);
  SimulatedCluster c;
  c.dtype_bytes = 4;
  cost::HardwareProfile& hw = c.profile;
  hw.name = "measured rates";
  hw.source = "measure_machine_rates";
  hw.devices_per_node = std::numeric_limits<int>::max();
  hw.gemm = {0, rates.flops_per_s, rates.memory_bytes_per_s};
  hw.attention = {0, rates.flops_per_s, rates.flops_per_s};
  hw.elementwise_bytes_per_s = rates.memory_bytes_per_s;
  hw.intra_node = {0, 0, rates.memory_bytes_per_s, rates.memory_bytes_per_s};
  hw.inter_node = hw.intra_node;
  return c;
}

// One MoE layer's routed experts in both modes on the slowest rank, by step_cost's term (moe_experts_time) on
// time_model_of(rates); routed [E] tokens per expert, placement: the EP experts of each rank (an expert held by m
// ranks gives each 1/m of its pairs).
inline ModeCosts moe_mode_costs(const MoeConfig& m, const std::vector<std::int64_t>& routed,
                                const std::vector<std::vector<std::int64_t>>& placement, const MachineRates& rates) {
  const int p = int(placement.size());
  check(p >= 1 && std::int64_t(routed.size()) == m.experts, "moe_mode_costs: {} ranks, {} expert counts for E = {}", p,
        routed.size(), m.experts);
  const SimulatedCluster model = time_model_of(rates);
  ModeCosts c;
  const ExpertLayout tp = ExpertLayout::tp(), ep = ExpertLayout::ep(placement);
  for (int r = 0; r < p; ++r) {
    c.tp_s = std::max(c.tp_s, moe_experts_time(model.profile, m, tp, routed, p, r, model.dtype_bytes));
    c.ep_s = std::max(c.ep_s, moe_experts_time(model.profile, m, ep, routed, p, r, model.dtype_bytes));
  }
  return c;
}

// What a step costs: step_cost's analytic model on a time model (analytic_pricer), or the dry run's price of it
// (serve/step_dry_run.hpp DryRunPricer, what the simulated clock advances by). The engine forecasts with the one its
// policy names (ForecastModel), the same whatever the clock: the wall, step and simulated clocks take the same
// decisions.
using StepPricer = std::function<StepCost(const StepTrace&)>;

// The dynamic policy's forecast (EnginePolicy::forecast). `analytic` (the default): step_cost's closed form, the
// dry run's kernels summed from the step's quantities, the DryRunPricer's price to rounding (serve/step_cost.hpp;
// both price GEMMs at the calibration's reuse, not at the clock's weight reads), at 0.10-0.14 ms of this machine's
// core a forecast of Mixtral-8x7B on 8 simulated H100s (1-256 decode tokens) against the dry run's 1.1-22 ms (the
// decoder dry-run on 8 ranks, every chunk's attention recorded); on the synthetic MoE's CPU profile 3-5 us against
// 27-95 us (docs/serving_simulation.md, stop 58). `dry_run`: the dry run itself (DryRunPricer; its events are the
// step's planning_events, priced as host work), the reference the analytic forecast is tested against.
enum class ForecastModel { analytic, dry_run };
// As moe_simulate's and moe_infer's --forecast name it.
constexpr std::string_view name_of(ForecastModel f) { return f == ForecastModel::analytic ? "analytic" : "dry-run"; }

// (`c` and `model` must outlive the pricer.)
inline StepPricer analytic_pricer(const DecoderConfig& c, const SimulatedCluster& model) {
  return [&c, &model](const StepTrace& t) { return step_cost(c, t, model); };
}

// The step about to run, forecast in both layouts by `price` (whole step: attention, experts, collectives), and the
// exposed time of changing from the current layouts to the other mode's during it (with_switch). A pipelined switch's
// step computes in the current layouts, one of the two runs just priced: the dry-run forecast's
// DryRunPricer (serve/step_dry_run.hpp) prices the switch from that run's layer-end times, with no third dry run.
struct LayoutForecast {
  ModeCosts step;           // price(...).total_s() with every MoE layer in TP, and in EP
  double to_tp_s = 0;       // exposed switch time of moving from `current` to TP in this step
  double to_ep_s = 0;       // ... to EP (`ep`)
};

// `current`: every layer's layout now ([layers]; dense layers ignored); `ep`: the EP placement a switch installs (and
// what EP costs in when the layers are not in EP now); `routed` [layers][E]: the forecast expert loads.
inline LayoutForecast forecast_layouts(const DecoderConfig& c, const std::vector<ChunkShape>& chunks,
                                       const std::vector<std::vector<std::int64_t>>& routed,
                                       const std::vector<ExpertLayout>& current, const ExpertLayout& ep, int p,
                                       bool pipelined, const StepPricer& price, bool with_switch = true) {
  StepTrace t;
  t.ranks = p;
  t.chunks = chunks;
  t.routed = routed;
  t.pipelined_switch = pipelined;
  t.next.assign(std::size_t(c.layers), std::nullopt);
  LayoutForecast f;
  t.layout.assign(std::size_t(c.layers), ExpertLayout::tp());
  f.step.tp_s = price(t).total_s();
  for (std::int64_t l = 0; l < c.layers; ++l)
    if (c.is_moe(l)) t.layout[std::size_t(l)] = current[std::size_t(l)].mode == MoeMode::ep ? current[std::size_t(l)] : ep;
  f.step.ep_s = price(t).total_s();
  t.layout = current;
  if (!with_switch) return f;
  for (const bool to_ep : {false, true}) {
    bool moves = false;
    for (std::int64_t l = 0; l < c.layers; ++l) {
      const std::size_t i = std::size_t(l);
      t.next[i].reset();
      if (c.is_moe(l) && (current[i].mode == MoeMode::ep) != to_ep)
        t.next[i] = to_ep ? ep : ExpertLayout::tp(), moves = true;
    }
    (to_ep ? f.to_ep_s : f.to_tp_s) = moves ? price(t).switch_s : 0.0;
  }
  return f;
}

// The same on step_cost's analytic model.
inline LayoutForecast forecast_layouts(const DecoderConfig& c, const std::vector<ChunkShape>& chunks,
                                       const std::vector<std::vector<std::int64_t>>& routed,
                                       const std::vector<ExpertLayout>& current, const ExpertLayout& ep, int p,
                                       bool pipelined, const SimulatedCluster& model, bool with_switch = true) {
  return forecast_layouts(c, chunks, routed, current, ep, p, pipelined, analytic_pricer(c, model), with_switch);
}

// ---- the forecast's expert loads -----------------------------------------------------------------------------------
//
// The step being planned has not been routed yet. Its loads are forecast from each MoE layer's recent routing: the
// share of the pairs each expert took (decayed by `decay` per step) and the pairs per token, laid out over the step's
// tokens by largest remainder (none above the step's tokens). The last step's counts scaled to the new step's tokens
// are wrong whenever the step size jumps: scaled from a 1-token decode to an 89-token prompt step they put all 178
// pairs on the decode's 2 experts (TP then forecast at 5.5 ms where the step cost 11.0 on Mixtral-8x7B, 8x H100);
// scaled from 512 tokens to 1 they give every expert a pair (8 pairs for a top-2 token).
class LoadForecast {
public:
  explicit LoadForecast(std::int64_t layers, double decay = 0.5) : decay_(decay), share_(std::size_t(layers)) {
    check(decay >= 0 && decay < 1, "LoadForecast: decay {} must be in [0, 1)", decay);
  }

  // A step of `tokens` tokens routed `routed` [layers][E] pairs per expert (dense layers: empty).
  void observe(const std::vector<std::vector<std::int64_t>>& routed, std::int64_t tokens) {
    check(routed.size() == share_.size(), "LoadForecast: {} layers' loads for {} layers", routed.size(), share_.size());
    for (std::size_t l = 0; l < routed.size(); ++l) {
      std::vector<double>& s = share_[l];
      if (s.size() != routed[l].size()) s.assign(routed[l].size(), 0.0);
      for (std::size_t e = 0; e < s.size(); ++e) s[e] = decay_ * s[e] + double(routed[l][e]);
    }
    tokens_ = decay_ * tokens_ + double(tokens);
  }
  bool ready() const noexcept { return tokens_ > 0; }

  // [layers][E]: the forecast loads of a step of `tokens` tokens (dense layers: empty).
  std::vector<std::vector<std::int64_t>> loads(std::int64_t tokens) const {
    std::vector<std::vector<std::int64_t>> out(share_.size());
    for (std::size_t l = 0; l < share_.size(); ++l) out[l] = layer_loads(share_[l], tokens);
    return out;
  }

private:
  std::vector<std::int64_t> layer_loads(const std::vector<double>& share, std::int64_t tokens) const {
    const std::size_t E = share.size();
    std::vector<std::int64_t> out(E, 0);
    double total = 0;
    for (const double x : share) total += x;
    if (E == 0 || total <= 0 || tokens <= 0) return out;
    // Pairs of the step: the recent pairs per token (top-k, or less under a routing budget), whole.
    const std::int64_t pairs = std::min<std::int64_t>(std::int64_t(E) * tokens, std::llround(total / tokens_ * double(tokens)));
    std::vector<double> rest(E);
    std::int64_t given = 0;
    for (std::size_t e = 0; e < E; ++e) {
      const double want = share[e] / total * double(pairs);
      out[e] = std::min<std::int64_t>(tokens, std::int64_t(want));
      rest[e] = want - double(out[e]);
      given += out[e];
    }
    std::vector<std::size_t> order(E);
    for (std::size_t e = 0; e < E; ++e) order[e] = e;
    std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return rest[a] > rest[b]; });
    while (given < pairs) {  // the remainder, largest fraction first, to experts below the step's tokens
      bool placed = false;
      for (const std::size_t e : order)
        if (given < pairs && out[e] < tokens) ++out[e], ++given, placed = true;
      if (!placed) break;
    }
    return out;
  }

  double decay_;
  std::vector<std::vector<double>> share_;  // [layers][E]: decayed pairs per expert
  double tokens_ = 0;                       // decayed tokens of the same steps
};

// ---- the forecast of the coming steps (SwitchPolicy::window) ------------------------------------------------------
//
// One step is a poor forecast where the steps alternate: on the Azure code trace decode-only steps favour TP and the
// steps that carry a prompt chunk favour EP, so a streak rarely pays for a switch, whichever layout the mix as a whole
// favours. The scheduler knows the coming steps' mix: the running requests' remaining prompt chunks and outputs, and
// the queue. forecast_batches plays serve_loop's batching forward over them; forecast_window costs the steps in both
// layouts, and the switcher moves when the window pays for the switch.

// A request as the forecast sees it (serve_loop's state of it before the step).
struct PendingRequest {
  std::int64_t prompt_left = 0;   // prompt tokens still to process
  std::int64_t cached = 0;        // positions in its KV cache
  std::int64_t outputs_left = 0;  // tokens still to generate (the first comes with the prompt's last chunk)
};

// The chunks of `steps` steps as serve_loop batches them, starting with the step being planned: `running` (admission
// order) plus `queued` (arrived, not yet admitted: admitted in order while fewer than `max_running` run; the KV pool is
// not modelled); each step every request past its prompt decodes one token, then prompt chunks fill the rest of
// `step_tokens` in order; a request leaves after its last token. Requests yet to arrive are not forecast; the list
// ends early when no request is left.
inline std::vector<std::vector<ChunkShape>> forecast_batches(std::vector<PendingRequest> running,
                                                             std::vector<PendingRequest> queued,
                                                             std::int64_t step_tokens, std::int64_t max_running,
                                                             std::int64_t steps) {
  check(step_tokens >= 1 && max_running >= 1 && steps >= 0,
        "forecast_batches: step_tokens {} and max_running {} must be >= 1, steps {} >= 0", step_tokens, max_running,
        steps);
  std::vector<std::vector<ChunkShape>> out;
  std::size_t next_queued = 0;
  for (std::int64_t s = 0; s < steps; ++s) {
    while (next_queued < queued.size() && std::int64_t(running.size()) < max_running)
      running.push_back(queued[next_queued++]);
    if (running.empty()) break;
    std::vector<ChunkShape> batch;
    std::vector<std::int64_t> take(running.size(), 0);  // prompt tokens of each request this step
    std::int64_t budget = step_tokens;
    for (const PendingRequest& r : running)
      if (r.prompt_left == 0) batch.push_back({1, r.cached, true}), --budget;
    for (std::size_t i = 0; i < running.size(); ++i)
      if (running[i].prompt_left > 0 && budget > 0) {
        take[i] = std::min(running[i].prompt_left, budget);
        batch.push_back({take[i], running[i].cached, false});
        budget -= take[i];
      }
    out.push_back(std::move(batch));
    std::vector<PendingRequest> left;
    for (std::size_t i = 0; i < running.size(); ++i) {
      PendingRequest r = running[i];
      if (r.prompt_left == 0) {
        ++r.cached, --r.outputs_left;
      } else if (take[i] > 0) {
        r.cached += take[i], r.prompt_left -= take[i];
        if (r.prompt_left == 0) --r.outputs_left;
      }
      if (r.outputs_left > 0) left.push_back(r);
    }
    running = std::move(left);
  }
  return out;
}

// The window's forecast: batches[0] is the step being planned (the switch is carried out during it), batches[1..] the
// steps after it. `step` sums the window's steps with every MoE layer in TP and in EP: the steps after this one (a
// pipelined switch installs the new layout after the step), this one too when the switch is not pipelined; the
// switch terms are those of this step (forecast_layouts). Expert loads: `loads`' forecast for each step's tokens.
inline LayoutForecast forecast_window(const DecoderConfig& c, const std::vector<std::vector<ChunkShape>>& batches,
                                      const LoadForecast& loads, const std::vector<ExpertLayout>& current,
                                      const ExpertLayout& ep, int p, bool pipelined, const StepPricer& price) {
  check(!batches.empty() && loads.ready(), "forecast_window: {} batches (>= 1), routing observed: {}", batches.size(),
        loads.ready());
  auto routed = [&](const std::vector<ChunkShape>& batch) {
    std::int64_t n = 0;
    for (const ChunkShape& ch : batch) n += ch.tokens;
    return loads.loads(n);
  };
  LayoutForecast f = forecast_layouts(c, batches[0], routed(batches[0]), current, ep, p, pipelined, price);
  if (pipelined) f.step = {};
  for (std::size_t s = 1; s < batches.size(); ++s) {
    const ModeCosts x = forecast_layouts(c, batches[s], routed(batches[s]), current, ep, p, pipelined, price, false).step;
    f.step.tp_s += x.tp_s;
    f.step.ep_s += x.ep_s;
  }
  return f;
}

struct SwitchPolicy {
  double margin = 0.1;      // the other mode must be this much cheaper (relative)
  std::int64_t patience = 2;  // for this many consecutive steps
  std::int64_t dwell = 8;     // and at least this many steps since the last switch
  std::int64_t horizon = 32;  // without break_even: steps a switch's exposed time is amortised over
  bool break_even = false;    // the streak's savings must pay for the switch's exposed time
  // 0: forecast the step being planned (above). k >= 1: forecast it and the k steps after it (forecast_batches) and
  // move when the window in the other layout is cheaper by the margin than in the current one and its savings pay
  // for the switch's exposed time (for `patience` plans in a row, `dwell` steps after the last switch); break_even
  // and horizon do not apply (the window's own savings pay for the switch).
  std::int64_t window = 0;

  void validate() const {
    check(margin >= 0 && patience >= 1 && dwell >= 0 && horizon >= 1 && window >= 0,
          "SwitchPolicy: margin {} >= 0, patience {} >= 1, dwell {} >= 0, horizon {} >= 1, window {} >= 0", margin,
          patience, dwell, horizon, window);
  }
};

// The state of the per-step decision.
class ModeSwitcher {
public:
  ModeSwitcher(SwitchPolicy policy, MoeMode start) : policy_(policy), mode_(start) { policy_.validate(); }

  // The mode for the next step, given this step's predicted costs in both modes and the exposed time of switching
  // to the other mode (paid for by the streak's savings).
  MoeMode decide(const ModeCosts& cost, double switch_s = 0) {
    ++since_switch_;
    const double current = mode_ == MoeMode::tp ? cost.tp_s : cost.ep_s;
    const double other = (mode_ == MoeMode::tp ? cost.ep_s : cost.tp_s) +
                         (policy_.break_even ? 0.0 : switch_s / double(policy_.horizon));
    if (other < (1.0 - policy_.margin) * current) {
      ++streak_;
      saved_ += current - other;
    } else {
      streak_ = 0;
      saved_ = 0;
    }
    if (streak_ >= policy_.patience && (!policy_.break_even || saved_ >= switch_s) && since_switch_ >= policy_.dwell)
      flip();
    return mode_;
  }
  // The same, from a forecast of the step (forecast_layouts), or with SwitchPolicy::window of the window
  // (forecast_window): the window in the other layout against this one, its savings against the switch.
  MoeMode decide(const LayoutForecast& f) {
    const double switch_s = mode_ == MoeMode::tp ? f.to_ep_s : f.to_tp_s;
    if (policy_.window == 0) return decide(f.step, switch_s);
    ++since_switch_;
    const double current = mode_ == MoeMode::tp ? f.step.tp_s : f.step.ep_s;
    const double other = mode_ == MoeMode::tp ? f.step.ep_s : f.step.tp_s;
    streak_ = other < (1.0 - policy_.margin) * current && current - other >= switch_s ? streak_ + 1 : 0;
    if (streak_ >= policy_.patience && since_switch_ >= policy_.dwell) flip();
    return mode_;
  }
  MoeMode mode() const noexcept { return mode_; }
  std::int64_t switches() const noexcept { return switches_; }

  const SwitchPolicy& policy() const noexcept { return policy_; }

private:
  void flip() {
    mode_ = mode_ == MoeMode::tp ? MoeMode::ep : MoeMode::tp;
    since_switch_ = 0;
    streak_ = 0;
    saved_ = 0;
    ++switches_;
  }

  SwitchPolicy policy_;
  MoeMode mode_;
  std::int64_t streak_ = 0, since_switch_ = 1 << 30, switches_ = 0;
  double saved_ = 0;  // seconds the streak's steps would have saved in the other mode
};

}  // namespace paradyse::serve
