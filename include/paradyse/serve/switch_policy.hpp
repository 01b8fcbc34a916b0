// paradyse/serve/switch_policy.hpp: the cost of one step's MoE layers in TP and in EP mode, and the per-step choice
// between them with hysteresis.
//
// Cost of one MoE layer for n tokens with a measured routing (tokens per expert), after the reference's section B3:
//   TP: every rank reads 1/p of each active expert (3 h f words each) and computes 1/p of every pair's FLOPs
//       (6 h f per pair) with GEMMs of f/p columns: t = a * 3 h f w / (p B) + 6 h f M / (p F(f/p)), with a the
//       active experts, M the pairs;
//   EP: rank g reads its active experts whole and computes their pairs with GEMMs of f columns:
//       t = max_g (a_g 3 h f w / B + 6 h f M_g / F(f)) (the slowest rank sets the step: skew costs EP, not TP).
// B (memory bandwidth, bytes/s) and F(cols) = F cols / (cols + c_half) (a GEMM's rate falls for skinny widths;
// c_half is the width at half the peak F) are a machine's. Both modes
// end with the same all-reduce here (activations are replicated), so it does not enter the difference.
// The policy switches when the other mode is predicted cheaper by more than `margin` (relative) for `patience`
// consecutive steps, and never within `dwell` steps of the previous switch: a burst of one step does not flip it,
// and a load that hovers at the crossover does not thrash.
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/timer.hpp"
#include "paradyse/ops/backend.hpp"
#include "paradyse/serve/policy_rounds.hpp"
#include "paradyse/serve/rank_shard.hpp"

#include <algorithm>
#include <cstdint>
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

// One MoE layer's predicted time in both modes; routed [E] tokens per expert, placement: the EP experts of each rank
// (an expert held by m ranks gives each 1/m of its pairs).
inline ModeCosts moe_mode_costs(const MoeConfig& m, const std::vector<std::int64_t>& routed,
                                const std::vector<std::vector<std::int64_t>>& placement, const MachineRates& rates) {
  const int p = int(placement.size());
  check(p >= 1 && std::int64_t(routed.size()) == m.experts, "moe_mode_costs: {} ranks, {} expert counts for E = {}", p,
        routed.size(), m.experts);
  const double weight_bytes = 3.0 * double(m.hidden) * double(m.expert_ffn) * sizeof(float);
  const double pair_flops = 6.0 * double(m.hidden) * double(m.expert_ffn);
  std::vector<int> holders(static_cast<std::size_t>(m.experts), 0);
  for (const auto& slots : placement)
    for (const std::int64_t e : slots) ++holders[std::size_t(e)];
  double active = 0, pairs = 0;
  for (std::int64_t e = 0; e < m.experts; ++e)
    if (routed[std::size_t(e)] > 0) active += 1, pairs += double(routed[std::size_t(e)]);
  ModeCosts c;
  const double f = double(m.expert_ffn), tp_rate = rates.gemm_rate(std::max(1.0, f / p)), ep_rate = rates.gemm_rate(f);
  c.tp_s = active * weight_bytes / (p * rates.memory_bytes_per_s) + pairs * pair_flops / (p * tp_rate);
  for (const auto& slots : placement) {
    double t = 0;
    for (const std::int64_t e : slots) {
      const double share = double(routed[std::size_t(e)]) / double(std::max(1, holders[std::size_t(e)]));
      if (share > 0) t += weight_bytes / rates.memory_bytes_per_s + share * pair_flops / ep_rate;
    }
    c.ep_s = std::max(c.ep_s, t);
  }
  return c;
}

struct SwitchPolicy {
  double margin = 0.1;      // the other mode must be this much cheaper (relative)
  std::int64_t patience = 2;  // for this many consecutive steps
  std::int64_t dwell = 8;     // and at least this many steps since the last switch

  void validate() const {
    check(margin >= 0 && patience >= 1 && dwell >= 0, "SwitchPolicy: margin {} >= 0, patience {} >= 1, dwell {} >= 0",
          margin, patience, dwell);
  }
};

// The state of the per-step decision.
class ModeSwitcher {
public:
  ModeSwitcher(SwitchPolicy policy, MoeMode start) : policy_(policy), mode_(start) { policy_.validate(); }

  // The mode for the next step, given this step's predicted costs (summed over layers).
  MoeMode decide(const ModeCosts& cost) {
    ++since_switch_;
    const double current = mode_ == MoeMode::tp ? cost.tp_s : cost.ep_s;
    const double other = mode_ == MoeMode::tp ? cost.ep_s : cost.tp_s;
    streak_ = other < (1.0 - policy_.margin) * current ? streak_ + 1 : 0;
    if (streak_ >= policy_.patience && since_switch_ >= policy_.dwell) {
      mode_ = mode_ == MoeMode::tp ? MoeMode::ep : MoeMode::tp;
      since_switch_ = 0;
      streak_ = 0;
      ++switches_;
    }
    return mode_;
  }
  MoeMode mode() const noexcept { return mode_; }
  std::int64_t switches() const noexcept { return switches_; }

private:
  SwitchPolicy policy_;
  MoeMode mode_;
  std::int64_t streak_ = 0, since_switch_ = 1 << 30, switches_ = 0;
};

}  // namespace paradyse::serve
