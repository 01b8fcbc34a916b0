// paradyse/plan/cost_table.hpp: the planner's inputs (model, batch) and the table of costs it plans over.
//
// A model is a sequence of layers, each of one kind (dense, MoE, ...); layers of one kind cost the same. For one
// batch the cost table holds, per kind, sublayer and strategy, the predicted time and memory of that sublayer on one
// rank (or why the strategy is forbidden there), plus the memory every plan needs (model states). Every planner
// (exact, heuristic, static) reads the same table, and `evaluate` scores any per-layer plan against it.
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/cost/memory_model.hpp"
#include "paradyse/cost/model_shape.hpp"
#include "paradyse/cost/profile.hpp"
#include "paradyse/cost/trace_cost.hpp"
#include "paradyse/plan/job_pool.hpp"
#include "paradyse/plan/outside_stack.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace paradyse::plan {

using cost::LayerStrategies;
using cost::Sublayer;
using Strategy = int;  // an index into the strategy list (cost::StrategyCatalog)

// One kind of layer; the batch fields of `shape` (batch, seq, packed_lengths) and `layers` are ignored.
struct LayerKind {
  std::string name;
  cost::ModelShape shape;
};

struct ModelConfig {
  std::vector<LayerKind> kinds;
  std::vector<int> layer_kinds;           // kind of each layer, in order
  cost::TrainingPrecision precision;
  std::int64_t extra_bytes = 0;           // per rank, outside the layers (embeddings, loss, framework)
  OutsideStack outside;                   // the head whose time every plan adds (vocab 0: none, a stack alone)

  // `layers` layers of one shape.
  static ModelConfig uniform(const cost::ModelShape& shape, int layers, std::string name = "layer") {
    ModelConfig m;
    m.kinds.push_back({std::move(name), shape});
    m.layer_kinds.assign(std::size_t(layers), 0);
    return m;
  }
  int layer_count() const { return int(layer_kinds.size()); }
};

// Samples of one length, or packed samples holding several sequences each.
struct Batch {
  std::int64_t samples = 1;
  std::vector<std::int64_t> lengths;  // one entry: one sequence per sample; several: a packed sample

  static Batch single(std::int64_t length, std::int64_t samples = 1) { return {samples, {length}}; }
  static Batch packed(std::vector<std::int64_t> lengths, std::int64_t samples = 1) {
    return {samples, std::move(lengths)};
  }
  std::int64_t tokens_per_sample() const { return std::accumulate(lengths.begin(), lengths.end(), std::int64_t(0)); }
};


// One strategy's cost in one sublayer. transient_bytes: its largest pooled working set (the pool keeps the largest
// of any sublayer, so the planner counts the maximum once). forward_s: the forward's part of time_s (what a full
// recompute runs again: plan/activation_stash.hpp).
struct Option {
  Strategy strategy = 0;
  double time_s = 0;
  std::int64_t saved_bytes = 0;
  std::int64_t transient_bytes = 0;
  double forward_s = 0;
};

struct CostTable {
  struct Entry {
    std::optional<Option> option;  // empty: forbidden
    std::string forbidden_reason;
    // The option's memory events in order (kept where the profile prices the pool's misses: evaluate replays them).
    std::vector<cost::MemoryEvent> forward_events, backward_events;
  };
  int group_size = 1;
  Batch batch;
  std::vector<std::string> kind_names;
  std::vector<int> layer_kinds;
  // Every plan needs: model states of all layers, the stack's own buffers, the largest plain workspace of any
  // option (attention kernels' scratch: small, and about the same for every strategy), extra bytes.
  std::int64_t fixed_bytes = 0;
  std::int64_t model_state_bytes = 0;
  std::int64_t stack_bytes = 0;
  std::int64_t plain_bytes = 0;
  std::vector<std::string> strategy_names;                  // the catalog's, by index
  // Every plan's step also spends: the work outside the stack (plan/outside_stack.hpp; zero without a head), and
  // the first touch of the pool's working set, which the trainer empties before every step (priced on the largest
  // transient of the plan as one unzeroed allocation: the pool's buffers come back warm from layer to layer, not step
  // to step). Where the profile prices the pool's misses (pool_miss_bytes_per_s > 0), the step's loans replayed in
  // order instead (the first fill and the churn between sublayers of other sizes: cost/memory_model.hpp
  // ordered_replay, with the stack's own buffers), each miss priced as an unzeroed fresh allocation of its size
  // (fresh_memory; at pool_miss_bytes_per_s where the profile has no fresh-memory rates).
  OutsideStackTime outside_time;
  cost::FreshMemoryModel fresh_memory;
  double pool_miss_bytes_per_s = 0;
  cost::StackBuffers stack_buffers;
  std::vector<std::array<std::vector<Entry>, 2>> entries;   // [kind][sublayer][strategy]

  int strategy_count() const { return int(strategy_names.size()); }
  std::string_view strategy_name(Strategy s) const { return strategy_names.at(std::size_t(s)); }

  const Entry& entry(int kind, Sublayer part, Strategy s) const {
    return entries[std::size_t(kind)][std::size_t(part)][std::size_t(s)];
  }
  const Option* option(int kind, Sublayer part, Strategy s) const {
    const auto& o = entry(kind, part, s).option;
    return o ? &*o : nullptr;
  }
  int layer_count() const { return int(layer_kinds.size()); }
};

// The shape of one layer kind for this batch.
inline cost::ModelShape shape_for_batch(const cost::ModelShape& kind, const Batch& batch) {
  cost::ModelShape m = kind;
  m.batch = batch.samples;
  m.seq = batch.tokens_per_sample();
  m.packed_lengths = batch.lengths.size() > 1 ? batch.lengths : std::vector<std::int64_t>{};
  m.layers = 1;
  return m;
}

// The most bytes per rank a plan may need (1 EiB, the most a memory tracker counts: core/error.hpp): a model or a
// length that needs more is beyond what any plan can hold, and build_cost_table says so instead of computing byte
// counts that overflow 64 bits. Below it, every sum a planner forms (model states + every layer's saved
// activations + the largest transient) stays far from overflow.
inline constexpr std::int64_t kMaxPlanBytes = std::int64_t(kMaxTrackedBytes);
// The longest sequence a cost table is built for: 2^50 tokens.
inline constexpr std::int64_t kMaxPlanLength = std::int64_t(1) << 50;

namespace cost_table_detail {
// cost::model_state_bytes in double (no overflow for any shape): weights, gradients and optimizer states of one
// layer on one rank.
inline double state_bytes(const cost::ModelShape& m, int p, const cost::TrainingPrecision& precision) {
  const double q_heads = std::ceil(double(m.heads) / p), kv_heads = m.kv_heads % p == 0 ? double(m.kv_heads / p) : 1;
  const double ffn = std::ceil(double(m.ffn) / p), inputs = m.swiglu ? 2 : 1;
  const double parameters =
      ((2 * q_heads + 2 * kv_heads) * double(m.head_dim) + (inputs + 1) * ffn) * double(m.hidden) + 4.0 * double(m.hidden);
  return parameters * precision.bytes_per_parameter();
}
}  // namespace cost_table_detail

// Predicts every (kind, sublayer, strategy) of `model` for `batch` on a group of `group_size` ranks of `hardware`,
// each from a dry run of the strategy's own code (cost/dry_run.hpp). Strategies not in `candidates` (empty: all),
// or not supporting the shape, get no option and say why. A length (or a model) whose memory per rank would exceed
// kMaxPlanBytes under every strategy throws Error saying that it is beyond what any plan can hold; a strategy that
// alone exceeds it is forbidden, saying so.
inline CostTable build_cost_table(const ModelConfig& model, const cost::HardwareProfile& hardware, int group_size,
                                  const Batch& batch, std::span<const Strategy> candidates = {},
                                  const cost::StrategyCatalog& catalog = cost::default_catalog()) {
  check(!model.kinds.empty() && !model.layer_kinds.empty(), "plan: the model has {} layer kinds and {} layers",
        model.kinds.size(), model.layer_kinds.size());
  check(batch.samples >= 1 && !batch.lengths.empty(), "plan: a batch needs samples >= 1 (got {}) and lengths",
        batch.samples);
  for (std::int64_t length : batch.lengths) check(length >= 1, "plan: sequence length {} must be positive", length);
  for (Strategy s : candidates)
    check(s >= 0 && s < catalog.count(), "plan: candidate strategy {} is not in the list of {}", s, catalog.count());
  check(group_size >= 1, "plan: group size p = {} must be at least 1", group_size);
  const std::int64_t length = batch.tokens_per_sample();
  for (std::int64_t l : batch.lengths)
    check(l <= kMaxPlanLength && length <= kMaxPlanLength,
          "plan: length {} is beyond what any plan can hold (lengths up to 2^50 = {} tokens are planned)", l,
          kMaxPlanLength);
  // What every plan needs, in double first: byte counts that would overflow 64 bits are refused here.
  {
    double states = 0;
    for (int layer_kind : model.layer_kinds)
      if (layer_kind >= 0 && layer_kind < int(model.kinds.size()))
        states += cost_table_detail::state_bytes(model.kinds[std::size_t(layer_kind)].shape, group_size, model.precision);
    check(states <= double(kMaxPlanBytes),
          "plan: the model is beyond what any plan can hold: its weights, gradients and optimizer states need {:.4g} "
          "bytes per rank on {} ranks (at most 2^60 are planned)",
          states, group_size);
    const cost::ModelShape& first = model.kinds[0].shape;
    const double activation = double(batch.samples) * std::ceil(double(length) / group_size) * double(first.hidden) *
                              double(first.dtype_bytes);
    check(activation <= double(kMaxPlanBytes / 4) && double(model.extra_bytes) <= double(kMaxPlanBytes),
          "plan: length {} is beyond what any plan can hold: one activation of {} x {} tokens x {} on each of {} "
          "ranks alone needs {:.4g} bytes per rank (at most 2^58 per activation, 2^60 in all, are planned)",
          length, batch.samples, length, first.hidden, group_size, activation);
  }
  CostTable t;
  t.group_size = group_size;
  t.batch = batch;
  t.layer_kinds = model.layer_kinds;
  t.strategy_names = catalog.names();
  t.entries.resize(model.kinds.size());
  for (const LayerKind& kind : model.kinds) t.kind_names.push_back(kind.name);
  for (int layer_kind : model.layer_kinds) {
    check(layer_kind >= 0 && layer_kind < int(model.kinds.size()), "plan: layer kind {} is not in [0, {})",
          layer_kind, model.kinds.size());
    cost::ModelShape shape = model.kinds[std::size_t(layer_kind)].shape;
    shape.layers = 1;
    t.model_state_bytes += cost::model_state_bytes(shape, group_size, model.precision);
  }
  // The layer stack's own buffers (pooled layer outputs, input gradients, norm gradient sums): every plan has them.
  {
    cost::ModelShape shape = shape_for_batch(model.kinds[0].shape, batch);
    shape.layers = model.layer_count();
    t.stack_buffers = cost::stack_buffers(shape, group_size);
    t.stack_bytes = cost::stack_buffer_bytes(t.stack_buffers);
  }
  // Each sublayer group's share of kMaxPlanBytes: an option whose saved bytes over all layers of its kind, or whose
  // transient, exceeds it is beyond what any plan can hold (so no sum of allowed options overflows).
  const double share = double(kMaxPlanBytes) / double(2 * model.kinds.size() + 2);
  std::vector<cost::ModelShape> shapes;
  for (const LayerKind& kind : model.kinds) {
    shapes.push_back(shape_for_batch(kind.shape, batch));
    cost::validate(shapes.back(), group_size);
  }
  // Which (sublayer, kind, strategy) need a dry run: candidates that support the shape (asked once per kind and
  // strategy). Strategies that declare the same sublayer code (StrategyCatalog::shared_sublayer) share one dry run:
  // the lowest supported index of them runs it, the others copy its result.
  struct DryRunResult {
    std::string reason;                      // not a candidate, or not supported
    std::optional<cost::SublayerCost> cost;  // empty with an empty reason: beyond what a tracker counts
    std::string beyond;                      // why, then
    std::size_t source = 0;                  // the result this one copies (its own index: it runs)
  };
  const std::size_t kinds = model.kinds.size(), strategies = std::size_t(catalog.count());
  std::vector<DryRunResult> results(2 * kinds * strategies);
  const auto result_index = [&](std::size_t k, Sublayer part, Strategy s) {
    return (std::size_t(part) * kinds + k) * strategies + std::size_t(s);
  };
  std::vector<std::size_t> jobs;  // the results that run a dry run, attention first (the longer runs start first)
  for (std::size_t k = 0; k < kinds; ++k)
    for (Strategy s = 0; s < catalog.count(); ++s) {
      std::string reason;
      if (!candidates.empty() && std::find(candidates.begin(), candidates.end(), s) == candidates.end())
        reason = fmt::format("{} is not a candidate", catalog.name(s));
      else reason = catalog.supports(s, shapes[k], group_size).reason;
      for (Sublayer part : cost::kAllSublayers) {
        DryRunResult& r = results[result_index(k, part, s)];
        r.reason = reason;
        r.source = result_index(k, part, s);
        if (!reason.empty()) continue;
        const std::string_view code = catalog.shared_sublayer(s, part);
        for (Strategy t = 0; t < s && !code.empty(); ++t)
          if (catalog.shared_sublayer(t, part) == code && results[result_index(k, part, t)].reason.empty()) {
            r.source = result_index(k, part, t);
            break;
          }
      }
    }
  for (Sublayer part : cost::kAllSublayers)
    for (std::size_t k = 0; k < kinds; ++k)
      for (Strategy s = 0; s < catalog.count(); ++s) {
        const std::size_t i = result_index(k, part, s);
        if (results[i].reason.empty() && results[i].source == i) jobs.push_back(i);
      }
  // Each job fills only its own result, so the table is the same whichever thread ran which (plan/job_pool.hpp).
  JobPool::shared().run(jobs.size(), [&](std::size_t job) {
    const std::size_t i = jobs[job];
    const auto s = Strategy(i % strategies);
    const std::size_t k = i / strategies % kinds;
    const auto part = Sublayer(i / strategies / kinds);
    DryRunResult& r = results[i];
    try {
      r.cost = cost::evaluate_sublayer(catalog, s, part, shapes[k], group_size, &hardware,
                                       /*keep_events=*/hardware.pool_miss_bytes_per_s > 0);
    } catch (const OutOfMemory& oom) {  // the dry run's tensors exceed what a tracker counts (2^60 bytes)
      r.beyond = oom.what();
    }
  });
  for (DryRunResult& r : results)
    if (r.reason.empty() && r.source != std::size_t(&r - results.data())) {
      r.cost = results[r.source].cost;
      r.beyond = results[r.source].beyond;
    }
  for (std::size_t k = 0; k < kinds; ++k) {
    const auto count = double(std::count(model.layer_kinds.begin(), model.layer_kinds.end(), int(k)));
    for (auto& part : t.entries[k]) part.resize(strategies);
    std::array<std::string, 2> too_large;  // per sublayer: the strategies refused for their size, and why
    for (Strategy s = 0; s < catalog.count(); ++s)
      for (Sublayer part : cost::kAllSublayers) {
        CostTable::Entry& e = t.entries[k][std::size_t(part)][std::size_t(s)];
        DryRunResult& r = results[result_index(k, part, s)];
        if (!r.reason.empty()) {
          e.forbidden_reason = std::move(r.reason);
          continue;
        }
        std::optional<cost::SublayerCost>& c = r.cost;
        if (!c)
          e.forbidden_reason = fmt::format("{}: length {} is beyond what it can hold on {} ranks ({})", catalog.name(s),
                                           length, group_size, r.beyond);
        if (c && (count * double(c->saved_bytes) > share || double(c->pool_bytes()) > share ||
                  double(c->plain_bytes()) > share)) {
          e.forbidden_reason = fmt::format(
              "{}: length {} is beyond what it can hold on {} ranks ({} layers save {:.4g} bytes per rank, with a "
              "transient of {:.4g})",
              catalog.name(s), length, group_size, count, count * double(c->saved_bytes),
              double(c->pool_bytes() + c->plain_bytes()));
          c.reset();
        }
        if (!c) {
          too_large[std::size_t(part)] += fmt::format("; {}", e.forbidden_reason);
          continue;
        }
        e.option = Option{s, c->time_s(), c->saved_bytes, c->pool_bytes(), c->forward_s};
        e.forward_events = std::move(c->forward_events);
        e.backward_events = std::move(c->backward_events);
        t.plain_bytes = std::max(t.plain_bytes, c->plain_bytes());
      }
    for (Sublayer part : cost::kAllSublayers) {
      const auto& options = t.entries[k][std::size_t(part)];
      const bool any = std::any_of(options.begin(), options.end(), [](const CostTable::Entry& e) { return e.option.has_value(); });
      check(any || too_large[std::size_t(part)].empty() || count == 0,
            "plan: length {} is beyond what any plan can hold on {} ranks: no strategy fits the {} of a {} layer in "
            "2^60 bytes per rank{}",
            length, group_size, cost::name_of(part), t.kind_names[k], too_large[std::size_t(part)]);
    }
  }
  t.fixed_bytes = t.model_state_bytes + t.stack_bytes + t.plain_bytes + model.extra_bytes;
  t.fresh_memory = hardware.fresh_memory;
  t.pool_miss_bytes_per_s = hardware.pool_miss_bytes_per_s;
  if (model.outside.vocab > 0) {
    std::int64_t stack_parameters = 0;
    for (int layer_kind : model.layer_kinds)
      stack_parameters += cost::parameters_per_rank(model.kinds[std::size_t(layer_kind)].shape, group_size);
    t.outside_time = outside_stack_time(model.outside, cost::layer_config_of(model.kinds[0].shape),
                                        outside_rows(batch.samples, length, group_size), stack_parameters, group_size,
                                        hardware);
  }
  return t;
}

// The predicted time and memory of a per-layer plan.
struct Evaluation {
  bool allowed = true;            // no forbidden strategy
  double time_s = 0;
  cost::MemoryEstimate memory;    // model_states holds the table's fixed bytes
  std::string forbidden;          // the first forbidden choice, when not allowed
  std::int64_t peak_bytes() const { return memory.peak(); }
};

inline Evaluation evaluate(const CostTable& table, std::span<const LayerStrategies> layers) {
  check(int(layers.size()) == table.layer_count(), "evaluate: {} layer choices for a model of {} layers",
        layers.size(), table.layer_count());
  Evaluation e;
  e.memory.model_states = table.fixed_bytes;
  for (std::size_t l = 0; l < layers.size(); ++l) {
    const int kind = table.layer_kinds[l];
    for (Sublayer part : cost::kAllSublayers) {
      const Strategy s = part == Sublayer::attention ? layers[l].attention : layers[l].mlp;
      const Option* o = table.option(kind, part, s);
      if (!o) {
        if (e.allowed)
          e.forbidden = fmt::format("layer {} {}: {}", l, cost::name_of(part),
                                    table.entry(kind, part, s).forbidden_reason);
        e.allowed = false;
        continue;
      }
      e.time_s += o->time_s;
      e.memory.saved_activations += o->saved_bytes;
      e.memory.largest_transient = std::max(e.memory.largest_transient, o->transient_bytes);
    }
  }
  e.time_s += table.outside_time.time_s();
  if (table.pool_miss_bytes_per_s <= 0 || !e.allowed) {
    e.time_s += table.fresh_memory.time(double(e.memory.largest_transient), /*zeroed=*/false);
    return e;
  }
  std::vector<cost::SublayerMemory> order(2 * layers.size());
  for (std::size_t l = 0; l < layers.size(); ++l)
    for (Sublayer part : cost::kAllSublayers) {
      const CostTable::Entry& entry =
          table.entry(table.layer_kinds[l], part, part == Sublayer::attention ? layers[l].attention : layers[l].mlp);
      cost::SublayerMemory& m = order[2 * l + std::size_t(part == Sublayer::mlp)];
      m.forward_events = entry.forward_events;
      m.backward_events = entry.backward_events;
    }
  // A miss is a new buffer of its size, not zeroed (the pool's contents are unspecified): priced as the fresh
  // allocation it is (nothing for reused heap below the profile's fresh size, the page faults of new pages from it:
  // ColossalZ's 32 MiB score gradients), at the pool's own rate where the profile has no fresh-memory rates.
  const bool fresh_rates = table.fresh_memory.zero_bytes_per_s > 0 && table.fresh_memory.fresh_bytes_per_s > 0;
  for (const std::int64_t bytes : cost::ordered_replay(order, table.stack_buffers).pool_misses) {
    e.time_s += fresh_rates ? table.fresh_memory.time(double(bytes), /*zeroed=*/false)
                            : double(bytes) / table.pool_miss_bytes_per_s;
  }
  return e;
}

// Every layer and sublayer on strategy s.
inline std::vector<LayerStrategies> uniform_layers(const CostTable& table, Strategy s) {
  return std::vector<LayerStrategies>(std::size_t(table.layer_count()), LayerStrategies{s, s});
}

}  // namespace paradyse::plan
