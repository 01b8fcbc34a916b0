// paradyse/plan/moe_plan.hpp: the planner for a GPT with MoE layers (model/gpt.hpp's GptConfig::moe): per layer the
// attention strategy, and the dense MLP's strategy (first_k_dense layers) or the MoE FFN's (MoE layers), minimising
// predicted time under the memory budget, exactly (plan/exact_solver.hpp), with zero redistribution between layers.
//
//   const plan::MoeGptCosts<Model> costs{config, p, &profile};
//   const plan::MoePlan best = plan::plan_moe_exact(costs.table(s), budget);   // throws plan::NoFeasiblePlan
//   model.forward_backward(comm, pool, best.stack_plan<AllStrategies<>>(), s, tokens, targets);
//
// The cost table. The dense rows are plan/cost_table.hpp's, for two layer kinds: "dense" (the first_k_dense layers)
// and "moe" (the MoE layers; their dense MLP row is never used, and the kind is built with a token ffn of p columns
// whose model states are taken out again). The MoE layer kind adds one row kind, the MoE FFN: an option per MoE
// strategy (moe/moe_strategies.hpp), each from the dry run of the strategy's own code inside the MoE half of the
// layer (cost/moe_cost.hpp's dry_run_moe_half: norm, MoE, residual). Routing is data-dependent; the dry run assumes a
// balanced one, so the rows are the balanced costs (EP's traffic grows with the skew, ETP's does not).
//
// A plan's time is its layers' plus what every step spends besides them, as for a dense GPT (plan/cost_table.hpp's
// evaluate): the work outside the stack (plan/outside_stack.hpp: embedding, final norm, LM head, loss, replicated
// all-reduce, AdamW over the rank's parameters with its experts) and the first touch of the pool's working set.
// MoeGptCosts prices the dense and the MoE rows as the rank keeps and re-runs them (plan/activation_stash.hpp, the
// dense planner's rule) and the embedding and head as sharded over its vocab_shards.
//
// Slot groups for the solver: attention of dense layers, MLP of dense layers, attention of MoE layers, MoE FFN of
// MoE layers. Within a group, layers with larger transients come later (as plan/planner.hpp does).
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/cost/dry_run.hpp"
#include "paradyse/cost/from_config.hpp"
#include "paradyse/cost/moe_cost.hpp"
#include "paradyse/cost/profile.hpp"
#include "paradyse/model/gpt.hpp"
#include "paradyse/model/stack.hpp"
#include "paradyse/moe/moe_strategies.hpp"
#include "paradyse/plan/activation_stash.hpp"
#include "paradyse/plan/cost_table.hpp"
#include "paradyse/plan/exact_solver.hpp"
#include "paradyse/plan/gpt_costs.hpp"
#include "paradyse/plan/outside_stack.hpp"
#include "paradyse/plan/planner.hpp"
#include "paradyse/plan/stack_plan.hpp"
#include "paradyse/strategy/sequence_layout.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace paradyse::plan {

// The dense cost table of a GPT with MoE layers plus its MoE rows.
struct MoeCostTable {
  static constexpr int kDenseKind = 0, kMoeKind = 1;
  CostTable dense;                           // kinds: 0 "dense", 1 "moe" (its mlp row unused)
  std::vector<CostTable::Entry> moe;         // [MoE strategy]: the MoE FFN row of the MoE kind
  std::vector<std::string> moe_strategy_names;
  std::vector<bool> is_moe;                  // per layer

  int layer_count() const { return dense.layer_count(); }
  // Seconds every plan's step spends besides its layers (as plan/cost_table.hpp's evaluate for a dense GPT): the
  // work outside the stack (dense.outside_time: embedding, head, loss, replicated all-reduce, AdamW over the rank's
  // parameters, experts included) and the first touch of the plan's largest working set in the emptied pool.
  double outside_s(std::int64_t largest_transient_bytes) const {
    return dense.outside_time.time_s() + dense.fresh_memory.time(double(largest_transient_bytes), /*zeroed=*/false);
  }
};

// The parameters of one MoE sublayer on the rank owning the most experts: its ceil(E / p) routed experts, the
// router and the shared experts (replicated).
inline double moe_parameters_per_rank(const MoeConfig& c, int p) {
  const std::int64_t owned = (c.experts + p - 1) / p;
  return double(c.experts * c.hidden) + double(owned) * 3.0 * double(c.expert_ffn * c.hidden) +
         3.0 * double(c.shared_width() * c.hidden) + (c.shared_gate ? double(c.hidden) : 0.0);
}

// The bytes per rank of one MoE sublayer's weights, gradients and optimizer states on the rank owning the most
// experts (router and shared experts replicated).
inline std::int64_t moe_state_bytes(const MoeConfig& c, int p, const cost::TrainingPrecision& precision) {
  return std::int64_t(std::ceil(moe_parameters_per_rank(c, p) * precision.bytes_per_parameter()));
}

// Every (kind, sublayer, strategy) of the GPT `config` for `batch` on p ranks of `hardware`, and the MoE rows.
// model_precision and extra_bytes as for build_cost_table (plan/cost_table.hpp). The dense rows are the catalog's,
// on the group's factorisation (cost::ModelShape::tp_inner, tp_x): with cost::mesh_catalog() MegatronRing and Tp2d
// are priced where it is set, as for a dense GPT (plan/gpt_costs.hpp); `selective`: every layer's attention as
// selective recomputation runs it (cost::ModelShape::selective). The work outside the stack with the vocabulary
// sharded over `vocab_shards` ranks (plan/outside_stack.hpp).
inline MoeCostTable build_moe_cost_table(const GptConfig& config, const cost::HardwareProfile& hardware, int p,
                                         const Batch& batch, const cost::TrainingPrecision& precision,
                                         std::int64_t extra_bytes,
                                         const cost::StrategyCatalog& catalog = cost::default_catalog(),
                                         int tp_inner = 0, int tp_x = 1, bool selective = false,
                                         int vocab_shards = 1) {
  check(config.moe.has_value(), "plan: build_moe_cost_table needs a GPT with MoE layers (GptConfig::moe is empty)");
  config.validate_for(p);
  const MoeLayers& moe = *config.moe;
  ModelConfig model;
  cost::ModelShape dense_shape = cost::shape_of(config.layer, 1, 1, 4);
  dense_shape.tp_inner = tp_inner;
  dense_shape.tp_x = tp_x;
  dense_shape.selective = selective;
  cost::ModelShape moe_shape = dense_shape;
  moe_shape.ffn = p;  // a token MLP: its row is never used, its model states are taken out below
  model.kinds.push_back({"dense", dense_shape});
  model.kinds.push_back({"moe", moe_shape});
  for (int l = 0; l < config.layers; ++l) model.layer_kinds.push_back(moe.is_moe(l) ? MoeCostTable::kMoeKind : MoeCostTable::kDenseKind);
  model.precision = precision;
  model.extra_bytes = extra_bytes;
  MoeCostTable t;
  t.dense = build_cost_table(model, hardware, p, batch, {}, catalog);
  for (int l = 0; l < config.layers; ++l) t.is_moe.push_back(moe.is_moe(l));
  // Model states: the MoE layers' experts instead of the token MLP.
  const int moe_layers = int(std::count(t.is_moe.begin(), t.is_moe.end(), true));
  cost::ModelShape no_mlp = moe_shape;
  no_mlp.ffn = 0;
  const auto token_mlp = std::int64_t(cost_table_detail::state_bytes(moe_shape, p, precision) -
                                      cost_table_detail::state_bytes(no_mlp, p, precision));
  const std::int64_t change = moe_layers * (moe_state_bytes(moe.moe, p, precision) - token_mlp);
  t.dense.model_state_bytes += change;
  t.dense.fixed_bytes += change;
  // The MoE rows.
  for (std::size_t s = 0; s < MoeStrategies<>::count; ++s) {
    t.moe_strategy_names.emplace_back(MoeStrategies<>::name(s));
    CostTable::Entry& e = t.moe.emplace_back();
    try {
      const cost::SublayerCost c = moe_half_cost(config.layer, moe.moe, s, p, batch.samples, batch.tokens_per_sample(),
                                                 &hardware);
      e.option = Option{int(s), c.time_s(), c.saved_bytes, c.pool_bytes(), c.forward_s};
      t.dense.plain_bytes = std::max(t.dense.plain_bytes, c.plain_bytes());
    } catch (const Error& error) {
      e.forbidden_reason = fmt::format("{}: {}", MoeStrategies<>::name(s), error.what());
    }
  }
  t.dense.fixed_bytes = t.dense.model_state_bytes + t.dense.stack_bytes + t.dense.plain_bytes + extra_bytes;
  // The work outside the stack (plan/outside_stack.hpp), its AdamW over what the rank holds: the dense layers'
  // shards, the MoE layers' attention and norms and their experts (not the token MLP the MoE kind was built with).
  if (config.vocab > 0) {
    double stack_parameters = 0;
    for (const bool is_moe : t.is_moe)
      stack_parameters += is_moe ? double(cost::parameters_per_rank(no_mlp, p)) + moe_parameters_per_rank(moe.moe, p)
                                 : double(cost::parameters_per_rank(dense_shape, p));
    t.dense.outside_time = outside_stack_time({config.vocab, config.tied_head, vocab_shards}, config.layer,
                                              outside_rows(batch.samples, batch.tokens_per_sample(), p),
                                              std::int64_t(stack_parameters), p, hardware);
  }
  return t;
}

// Per layer: the attention strategy, the dense MLP's (dense layers) or the MoE FFN's (MoE layers), their costs.
struct MoeLayerPlan {
  bool moe = false;
  int attention = 0;  // catalog index
  int ffn = 0;        // catalog index (dense layer) or MoeStrategies index (MoE layer)
  double attention_s = 0, ffn_s = 0;
};

struct MoePlan {
  std::vector<MoeLayerPlan> layers;
  double time_s = 0;
  cost::MemoryEstimate memory;  // model_states holds all fixed bytes
  std::int64_t budget_bytes = 0;
  std::vector<std::string> strategy_names, moe_strategy_names;

  std::int64_t peak_bytes() const { return memory.peak(); }
  bool fits() const { return peak_bytes() <= budget_bytes; }
  std::string_view ffn_name(const MoeLayerPlan& l) const {
    return l.moe ? moe_strategy_names.at(std::size_t(l.ffn)) : strategy_names.at(std::size_t(l.ffn));
  }
  // "attention 4x MegatronTS; mlp 1x METP; moe 2x ExpertParallel + 1x ExpertTensorParallel"
  std::string summary() const {
    std::map<std::string, int> attention, mlp, moe;
    for (const MoeLayerPlan& l : layers) {
      ++attention[strategy_names.at(std::size_t(l.attention))];
      ++(l.moe ? moe : mlp)[std::string(ffn_name(l))];
    }
    const auto part = [](const char* name, const std::map<std::string, int>& counts) {
      std::string out = fmt::format("{} ", name);
      bool first = true;
      for (const auto& [s, n] : counts) out += fmt::format("{}{}x {}", std::exchange(first, false) ? "" : " + ", n, s);
      return out;
    };
    std::string out = part("attention", attention);
    if (!mlp.empty()) out += "; " + part("mlp", mlp);
    return out + "; " + part("moe", moe);
  }
  // The stack's plan (indices of the strategy list `Strategies` and of MoeStrategies).
  template <class Strategies>
  StackPlan stack_plan() const {
    StackPlan out;
    for (const MoeLayerPlan& l : layers) {
      SublayerChoice c;
      c.attention = Strategies::index_of(strategy_names.at(std::size_t(l.attention)));
      if (l.moe) c.moe = std::size_t(l.ffn);
      else c.mlp = Strategies::index_of(strategy_names.at(std::size_t(l.ffn)));
      out.push_back(c);
    }
    return out;
  }
};

namespace moe_plan_detail {

// Group g of the problem: 0 dense attention, 1 dense mlp, 2 MoE attention, 3 MoE FFN.
inline Problem problem_of(const MoeCostTable& t, std::int64_t budget_bytes) {
  Problem problem;
  problem.fixed_bytes = t.dense.fixed_bytes;
  problem.budget_bytes = budget_bytes;
  const int moe_layers = int(std::count(t.is_moe.begin(), t.is_moe.end(), true));
  const int counts[2] = {t.layer_count() - moe_layers, moe_layers};
  for (int kind : {MoeCostTable::kDenseKind, MoeCostTable::kMoeKind}) {
    for (int row = 0; row < 2; ++row) {
      SlotGroup g;
      const bool moe_row = kind == MoeCostTable::kMoeKind && row == 1;
      g.name = fmt::format("{} {}", t.dense.kind_names[std::size_t(kind)], row == 0 ? "attention" : moe_row ? "moe" : "mlp");
      g.count = counts[kind];
      std::string reasons;
      if (moe_row) {
        for (const CostTable::Entry& e : t.moe)
          if (e.option) g.options.push_back(*e.option);
          else reasons += fmt::format("{}{}", reasons.empty() ? "" : "; ", e.forbidden_reason);
      } else {
        const Sublayer part = row == 0 ? Sublayer::attention : Sublayer::mlp;
        for (Strategy s = 0; s < t.dense.strategy_count(); ++s)
          if (const Option* o = t.dense.option(kind, part, s)) g.options.push_back(*o);
          else reasons += fmt::format("{}{}", reasons.empty() ? "" : "; ", t.dense.entry(kind, part, s).forbidden_reason);
      }
      check(g.count == 0 || !g.options.empty(), "plan: {} has no allowed strategy ({})", g.name, reasons);
      problem.groups.push_back(std::move(g));
    }
  }
  return problem;
}

inline MoePlan plan_of(const MoeCostTable& t, const Problem& problem, const Assignment& a, std::int64_t budget_bytes) {
  MoePlan plan;
  plan.strategy_names = t.dense.strategy_names;
  plan.moe_strategy_names = t.moe_strategy_names;
  plan.budget_bytes = budget_bytes;
  plan.time_s = a.time_s + t.outside_s(a.largest_transient_bytes);
  plan.memory.model_states = a.fixed_bytes;
  plan.memory.saved_activations = a.saved_bytes;
  plan.memory.largest_transient = a.largest_transient_bytes;
  plan.layers.resize(std::size_t(t.layer_count()));
  for (std::size_t l = 0; l < plan.layers.size(); ++l) plan.layers[l].moe = t.is_moe[l];
  for (std::size_t g = 0; g < problem.groups.size(); ++g) {
    const SlotGroup& group = problem.groups[g];
    const bool moe_kind = g >= 2, attention = g % 2 == 0;
    std::vector<const Option*> slots;  // one per layer of the group, smaller transients first
    for (std::size_t i = 0; i < group.options.size(); ++i)
      for (int c = 0; c < a.counts[g][i]; ++c) slots.push_back(&group.options[i]);
    std::stable_sort(slots.begin(), slots.end(),
                     [](const Option* x, const Option* y) { return x->transient_bytes < y->transient_bytes; });
    std::size_t next = 0;
    for (MoeLayerPlan& layer : plan.layers) {
      if (layer.moe != moe_kind) continue;
      check(next < slots.size(), "plan: group {} has {} slots assigned for more layers", group.name, slots.size());
      const Option& o = *slots[next++];
      (attention ? layer.attention : layer.ffn) = o.strategy;
      (attention ? layer.attention_s : layer.ffn_s) = o.time_s;
    }
  }
  return plan;
}

}  // namespace moe_plan_detail

// The fastest plan within `budget_bytes` per rank; throws NoFeasiblePlan (saying what the least-memory plan needs)
// when nothing fits.
inline MoePlan plan_moe_exact(const MoeCostTable& table, std::int64_t budget_bytes) {
  const Problem problem = moe_plan_detail::problem_of(table, budget_bytes);
  if (const std::optional<Assignment> best = solve_exact(problem))
    return moe_plan_detail::plan_of(table, problem, *best, budget_bytes);
  const MoePlan least = moe_plan_detail::plan_of(table, problem, least_memory(problem), budget_bytes);
  throw NoFeasiblePlan(
      fmt::format("no plan fits the memory budget of {} per device: the least-memory plan ({}) needs {} (model states "
                  "and fixed {}, saved activations {}, largest transient {}) for a batch of {} x {} tokens on {} ranks",
                  format_bytes(double(budget_bytes)), least.summary(), format_bytes(double(least.peak_bytes())),
                  format_bytes(double(least.memory.model_states)), format_bytes(double(least.memory.saved_activations)),
                  format_bytes(double(least.memory.largest_transient)), table.dense.batch.samples,
                  table.dense.batch.tokens_per_sample(), table.dense.group_size),
      least.peak_bytes(), budget_bytes);
}

// The plan of given choices (every layer's attention, and its MLP or MoE strategy), with its predicted time and memory.
inline MoePlan moe_plan_of(const MoeCostTable& t, const std::vector<MoeLayerPlan>& choices, std::int64_t budget_bytes) {
  check(int(choices.size()) == t.layer_count(), "plan: {} layer choices for {} layers", choices.size(), t.layer_count());
  MoePlan plan;
  plan.strategy_names = t.dense.strategy_names;
  plan.moe_strategy_names = t.moe_strategy_names;
  plan.budget_bytes = budget_bytes;
  plan.memory.model_states = t.dense.fixed_bytes;
  for (std::size_t l = 0; l < choices.size(); ++l) {
    MoeLayerPlan layer = choices[l];
    layer.moe = t.is_moe[l];
    const int kind = layer.moe ? MoeCostTable::kMoeKind : MoeCostTable::kDenseKind;
    const Option* a = t.dense.option(kind, Sublayer::attention, layer.attention);
    check(a != nullptr, "plan: layer {} attention: {}", l, t.dense.entry(kind, Sublayer::attention, layer.attention).forbidden_reason);
    const Option* f = nullptr;
    if (layer.moe) {
      check(layer.ffn >= 0 && layer.ffn < int(t.moe.size()), "plan: layer {}: MoE strategy {} out of range", l, layer.ffn);
      f = t.moe[std::size_t(layer.ffn)].option ? &*t.moe[std::size_t(layer.ffn)].option : nullptr;
      check(f != nullptr, "plan: layer {} moe: {}", l, t.moe[std::size_t(layer.ffn)].forbidden_reason);
    } else {
      f = t.dense.option(kind, Sublayer::mlp, layer.ffn);
      check(f != nullptr, "plan: layer {} mlp: {}", l, t.dense.entry(kind, Sublayer::mlp, layer.ffn).forbidden_reason);
    }
    layer.attention_s = a->time_s;
    layer.ffn_s = f->time_s;
    plan.time_s += a->time_s + f->time_s;
    plan.memory.saved_activations += a->saved_bytes + f->saved_bytes;
    plan.memory.largest_transient = std::max({plan.memory.largest_transient, a->transient_bytes, f->transient_bytes});
    plan.layers.push_back(layer);
  }
  plan.time_s += t.outside_s(plan.memory.largest_transient);
  return plan;
}

// The planner's view of a GPT with MoE layers (as plan/gpt_costs.hpp's GptCosts for a dense one).
template <class Model>
struct MoeGptCosts {
  GptConfig config;
  int ranks = 1;
  const cost::HardwareProfile* hardware = nullptr;
  const cost::StrategyCatalog* catalog = &cost::default_catalog();
  // The group's factorisation, as GptCosts's (with cost::mesh_catalog(): MegatronRing and Tp2d priced where set).
  int tp_inner = 0;
  int tp_x = 1;
  // What a rank keeps and re-runs (plan/activation_stash.hpp), applied to the dense and the MoE rows alike, and the
  // vocabulary's shards: as GptCosts's.
  ActivationStash stash{};
  int vocab_shards = 1;

  // The most tokens any rank holds, and the bytes outside the stack: as for a dense GPT of the same config.
  std::int64_t max_local_tokens(std::int64_t s) const { return dense().max_local_tokens(s); }
  std::int64_t extra_bytes(std::int64_t s, std::int64_t batch = 1) const { return dense().extra_bytes(s, batch); }
  // `batch` sequences of s tokens: float32 activations, weights and gradients, two AdamW moments. Shorter than the
  // group's minimum (a token per chunk): padded, as the trainer runs it (data::padded_length).
  MoeCostTable table(std::int64_t s, std::int64_t batch = 1) const {
    s = dense().run_length(s);
    return stashed(build_moe_cost_table(config, *hardware, ranks, Batch::single(s, batch), {4, 4, 8},
                                        extra_bytes(s, batch), *catalog, tp_inner, tp_x, stash.selective(),
                                        vocab_shards));
  }
  // One sequence of packed documents of these lengths, in this order (attention within each document, so the dry
  // runs cost the causal-within-document pairs of every rank and the group is timed by its slowest); one document
  // is table(s).
  MoeCostTable packed_table(std::vector<std::int64_t> lengths) const {
    check(!lengths.empty(), "MoeGptCosts::packed_table: a packed sequence needs at least one document");
    if (lengths.size() == 1) return table(lengths[0]);
    Batch batch = Batch::packed(std::move(lengths));
    if (const std::int64_t s = batch.tokens_per_sample(), padded = dense().run_length(s); padded > s)
      batch.lengths.push_back(padded - s);  // the padding at the end, a document of its own (data/packing.hpp)
    return stashed(build_moe_cost_table(config, *hardware, ranks, batch, {4, 4, 8},
                                        extra_bytes(batch.tokens_per_sample()), *catalog, tp_inner, tp_x,
                                        stash.selective(), vocab_shards));
  }

private:
  GptCosts<Model> dense() const { return {config, ranks, hardware, catalog, tp_inner, tp_x, stash, vocab_shards}; }
  MoeCostTable stashed(MoeCostTable t) const {
    t.dense = stash.apply(std::move(t.dense));
    for (CostTable::Entry& e : t.moe) stash.apply(e);
    return t;
  }
};

}  // namespace paradyse::plan
