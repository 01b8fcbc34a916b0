// paradyse/cost/dry_run.hpp: a strategy's cost, read off its own code run on shapes alone.
//
// dry_run_sublayer executes one sublayer of the real pre-norm layer (model/layer.hpp's halves, with the norm and
// residual around the strategy) on one rank of a p-rank group: meta tensors (core/memory.hpp), the counting
// backend (ops/counting.hpp) and a symbolic communicator (comm/symbolic.hpp). Its Trace holds every allocation,
// pooled buffer, kernel and transfer of forward, of backward, and the release of what forward saved; the memory
// and time models (cost/trace_cost.hpp) are computed from it. No activation memory is allocated: the meta
// tracker counts the bytes.
//
// StrategyCatalog names the strategies a planner may choose, by the index and name of a Switchable list
// (strategy/strategies.hpp): a new strategy needs no edit here. The dry run uses the list instantiated with
// ops::Counting; the real run uses the same list with its own backend, so indices and names agree.
#pragma once

#include "paradyse/comm/symbolic.hpp"
#include "paradyse/contract/layer_config.hpp"
#include "paradyse/contract/weight_shards.hpp"
#include "paradyse/core/memory.hpp"
#include "paradyse/core/trace.hpp"
#include "paradyse/cost/model_shape.hpp"
#include "paradyse/model/layer.hpp"
#include "paradyse/ops/counting.hpp"
#include "paradyse/strategy/buffer_pool.hpp"
#include "paradyse/strategy/policy.hpp"
#include "paradyse/strategy/strategies.hpp"

#include <fmt/format.h>

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace paradyse::cost {

// One sublayer's events on one rank: forward, backward, then the release of the tensors forward saved (the layer
// stack frees them when the layer's whole backward is done).
// The same events in place (spans into a trace that outlives the view): what the cost models read.
struct SublayerTraceView {
  std::span<const TraceEvent> forward, backward, release;
  int group_size = 1;
};

struct SublayerTrace {
  std::vector<TraceEvent> forward, backward, release;
  int group_size = 1;

  SublayerTrace() = default;
  explicit SublayerTrace(const SublayerTraceView& v)
      : forward(v.forward.begin(), v.forward.end()), backward(v.backward.begin(), v.backward.end()),
        release(v.release.begin(), v.release.end()), group_size(v.group_size) {}
  SublayerTraceView view() const { return {forward, backward, release, group_size}; }
};

// The layer a cost shape describes (the norm kind does not change the cost; RoPE and zigzag do).
inline LayerConfig layer_config_of(const ModelShape& m) {
  LayerConfig c;
  c.hidden = m.hidden;
  c.heads = m.heads;
  c.kv_heads = m.kv_heads;
  c.head_dim = m.head_dim;
  c.ffn = m.ffn;
  c.activation = m.swiglu ? Activation::swiglu : Activation::gelu;
  c.causal = m.causal;
  c.rope = m.rope;
  c.zigzag = m.zigzag;
  return c;
}

// The document starts of a packed sample (ModelShape::packed_lengths, summing to seq): empty for one sequence.
inline std::vector<std::int64_t> document_starts_of(const ModelShape& m) {
  std::vector<std::int64_t> starts;
  std::int64_t at = 0;
  for (std::int64_t length : m.packed_lengths) {
    starts.push_back(at);
    at += length;
  }
  return starts;
}

// The group's factorisation of a cost shape, on a sublayer context (MegatronRing's tp_inner, Tp2d's tp_x). Their
// sub-groups are the symbolic communicator's (comm/symbolic.hpp's split_by), split per call in a dry run and
// recording nothing: a model splits them once (comm/grid_groups.hpp).
inline void set_factorisation(SublayerContext& ctx, const ModelShape& m) {
  ctx.tp_inner = m.tp_inner;
  ctx.tp_x = m.tp_x;
}

// The setting of one dry run on rank `rank` of a p-rank group, for as long as the object lives: a meta tracker
// (current on this thread), the trace that it, the counting backend and `comm` record into, and the buffer pool.
// Between record() and stop() every allocation and pooled buffer is part of the trace; end_forward() and
// end_backward() mark the phases, and what follows end_backward() is the release of what forward saved.
class DryRun {
public:
  DryRun(int rank, int p)
      : scoped_(meta_), trace_(std::exchange(Trace::recycled_storage(), {})), counting_(trace_), comm(rank, p, trace_) {}
  ~DryRun() {
    stop();
    Trace::give_back_storage(trace_.take());  // the next dry run on this thread records into the same buffer
  }
  DryRun(const DryRun&) = delete;
  DryRun& operator=(const DryRun&) = delete;

  void record() noexcept { meta_.set_trace(&trace_); }
  void stop() noexcept { meta_.set_trace(nullptr); }
  void end_forward() noexcept { forward_end_ = trace_.size(); }
  void end_backward() noexcept { backward_end_ = trace_.size(); }
  Trace& trace() noexcept { return trace_; }

  // The recorded events, split at the marks: in place (valid while this DryRun lives and records no more), or copied.
  SublayerTraceView phases_view() const {
    const std::span<const TraceEvent> e(trace_.events());
    return {e.first(forward_end_), e.subspan(forward_end_, backward_end_ - forward_end_), e.subspan(backward_end_),
            comm.size()};
  }
  SublayerTrace phases() const { return SublayerTrace(phases_view()); }

private:
  MemoryTracker meta_{MemorySpace::meta};
  ScopedTracker scoped_;
  Trace trace_;
  ScopedTrace counting_;
  std::size_t forward_end_ = 0, backward_end_ = 0;

public:
  SymbolicCommunicator comm;
  BufferPool pool;  // made under the meta tracker (after scoped_)
};

// Why strategy `index` of `strategies` cannot run this shape on p ranks (empty: it can).
template <class Strategies>
Support dry_run_support(const Strategies& strategies, std::size_t index, const ModelShape& m, int p) {
  const LayerConfig config = layer_config_of(m);
  try {
    config.validate_for(p);
  } catch (const Error& e) {
    return {e.what()};
  }
  DryRun run(0, p);
  const std::vector<std::int64_t> starts = document_starts_of(m);
  std::optional<SublayerContext> ctx;
  try {
    ctx.emplace(config, p, m.batch, m.seq, run.pool);  // the sequence layout refuses fewer tokens than ranks
    ctx->set_documents(starts);
    set_factorisation(*ctx, m);
  } catch (const Error& e) {
    return {fmt::format("{}: {}", Strategies::name(index), e.what())};
  }
  return strategies.supports(index, *ctx);
}

// Runs sublayer `part` of strategy `index` for shape `m` on rank `rank` of a group of p (rank 0 holds the most
// tokens) and returns on_trace(view) for its trace, read in place (the view is valid during the call only).
// `strategies` is the list instantiated with ops::Counting.
template <class Strategies, class OnTrace>
decltype(auto) visit_sublayer_trace(const Strategies& strategies, std::size_t index, Sublayer part,
                                    const ModelShape& m, int p, int rank, OnTrace&& on_trace) {
  using Backend = ops::Counting;
  const LayerConfig config = layer_config_of(m);
  DryRun run(rank, p);
  SymbolicCommunicator& comm = run.comm;
  BufferPool& pool = run.pool;
  SublayerContext ctx(config, p, m.batch, m.seq, pool);
  const std::vector<std::int64_t> starts = document_starts_of(m);  // a packed sample: attention within documents
  ctx.set_documents(starts);
  set_factorisation(ctx, m);
  require(strategies.supports(index, ctx));
  const std::int64_t n = ctx.local_tokens(rank), h = config.hidden;
  const Shape activation{m.batch, n, h};
  // What exists around the sublayer (weights, the stack's activations): not part of its trace.
  LayerWeights weights(config, p), grads(config, p);
  Tensor<float> x(activation), z(activation), dz(activation), dx(activation), norm_partial(Shape{4, h});
  LayerSaved<Strategies> saved;
  if (part == Sublayer::attention) {
    run.record();
    attention_half_forward<Backend>(strategies, int(index), comm, ctx, weights, x.view(), saved);
    if (m.selective) {  // as TransformerStack drops it: the core re-runs at the start of the backward below
      strategies.drop_attention_core(saved.attention);
      saved.attention_core_dropped = true;
    }
    run.end_forward();
    PooledBuffer<float> dy;
    {
      const Trace::Pause quiet(&run.trace());  // the layer's residual gradient comes from the MLP half
      dy = pool.acquire<float>(activation);
    }
    attention_half_backward<Backend>(strategies, comm, ctx, weights, saved, TensorView<const float>(dy.view()),
                                     dx.view(), grads, norm_partial.view());
    dy = PooledBuffer<float>();  // the layer's dy goes back after the attention half
    run.end_backward();
    saved = LayerSaved<Strategies>();  // released with the layer (model/stack.hpp)
    run.stop();
  } else {
    {
      const Trace::Pause quiet(&run.trace());  // made by the attention half
      saved.y = Tensor<float>(activation);
      saved.stats = Tensor<float>(Shape{4, m.batch * n});
    }
    run.record();
    mlp_half_forward<Backend>(strategies, int(index), comm, ctx, weights, saved, z.view());
    run.end_forward();
    PooledBuffer<float> dy = pool.acquire<float>(activation);
    mlp_half_backward<Backend>(strategies, comm, ctx, weights, saved, TensorView<const float>(dz.view()), dy.view(),
                               grads, norm_partial.view());
    run.end_backward();
    {
      auto mlp = std::move(saved.mlp);  // released with the layer
      (void)mlp;
    }
    run.stop();  // before dy goes back: that return belongs to the attention half
  }
  return on_trace(run.phases_view());
}

// The trace of sublayer `part` of strategy `index` for shape `m` on rank `rank` of a group of p, copied out.
template <class Strategies>
SublayerTrace dry_run_sublayer(const Strategies& strategies, std::size_t index, Sublayer part, const ModelShape& m,
                               int p, int rank = 0) {
  return visit_sublayer_trace(strategies, index, part, m, p, rank,
                              [](const SublayerTraceView& view) { return SublayerTrace(view); });
}

namespace dry_run_detail {
// A strategy's declared sublayer code (its optional `attention_sublayer` / `mlp_sublayer`; empty: its own).
template <class P>
constexpr std::string_view declared_sublayer(Sublayer part) {
  if (part == Sublayer::attention) {
    if constexpr (requires { std::string_view(P::attention_sublayer); }) return P::attention_sublayer;
  } else {
    if constexpr (requires { std::string_view(P::mlp_sublayer); }) return P::mlp_sublayer;
  }
  return {};
}
template <class Strategies>
struct DeclaredSublayers {  // a list that is not a Switchable: no declarations
  static std::vector<std::string> of(Sublayer) { return std::vector<std::string>(Strategies::count); }
};
template <class... Ps>
struct DeclaredSublayers<Switchable<Ps...>> {
  static std::vector<std::string> of(Sublayer part) { return {std::string(declared_sublayer<Ps>(part))...}; }
};
}  // namespace dry_run_detail

// The strategies a planner chooses among: count, names and a dry run of each, type-erased over a Switchable list
// instantiated with ops::Counting (for example AllStrategies<ops::Counting>).
//
// A strategy whose sublayer runs code shared op for op with others says so in one statement, naming that code
// (`static constexpr std::string_view mlp_sublayer = "zero3_mlp";`, or `attention_sublayer`): strategies that
// declare the same name have the same trace whenever both are supported, so a cost table dry-runs it once
// (shared_sublayer). tests/cost/dry_run_shortcuts.cpp holds every declaration to it, event for event.
class StrategyCatalog {
public:
  template <class Strategies>
  static StrategyCatalog of() {
    auto list = std::make_shared<const Strategies>();
    StrategyCatalog c;
    for (std::string_view name : Strategies::names) c.names_.emplace_back(name);
    for (Sublayer part : kAllSublayers)
      c.declared_[std::size_t(part)] = dry_run_detail::DeclaredSublayers<Strategies>::of(part);
    c.trace_ = [list](std::size_t index, Sublayer part, const ModelShape& m, int p, int rank) {
      return dry_run_sublayer(*list, index, part, m, p, rank);
    };
    c.visit_ = [list](std::size_t index, Sublayer part, const ModelShape& m, int p, int rank, const TraceVisitor& fn) {
      visit_sublayer_trace(*list, index, part, m, p, rank, fn);
    };
    c.support_ = [list](std::size_t index, const ModelShape& m, int p) { return dry_run_support(*list, index, m, p); };
    return c;
  }

  int count() const noexcept { return int(names_.size()); }
  std::string_view name(int index) const {
    check(index >= 0 && index < count(), "strategy index {} is out of range: there are {} strategies", index, count());
    return names_[std::size_t(index)];
  }
  // The index of a name, or -1.
  int find(std::string_view name) const {
    for (int i = 0; i < count(); ++i)
      if (names_[std::size_t(i)] == name) return i;
    return -1;
  }
  int index_of(std::string_view name) const {
    const int i = find(name);
    check(i >= 0, "no strategy named '{}'; the strategies are {}", name, fmt::join(names_, ", "));
    return i;
  }
  const std::vector<std::string>& names() const noexcept { return names_; }
  std::vector<int> all() const {
    std::vector<int> indices(names_.size());
    for (std::size_t i = 0; i < indices.size(); ++i) indices[i] = int(i);
    return indices;
  }

  // The sublayer code strategy `index` declares for `part` (empty: its own, shared with no other).
  std::string_view shared_sublayer(int index, Sublayer part) const {
    return declared_[std::size_t(part)].at(std::size_t(index));
  }

  Support supports(int index, const ModelShape& m, int p) const { return support_(std::size_t(index), m, p); }
  SublayerTrace trace(int index, Sublayer part, const ModelShape& m, int p, int rank = 0) const {
    return trace_(std::size_t(index), part, m, p, rank);
  }
  // Calls fn(view) with the same trace read in place (no copy; the view is valid during the call only).
  using TraceVisitor = std::function<void(const SublayerTraceView&)>;
  void visit_trace(int index, Sublayer part, const ModelShape& m, int p, int rank, const TraceVisitor& fn) const {
    visit_(std::size_t(index), part, m, p, rank, fn);
  }

private:
  std::vector<std::string> names_;
  std::array<std::vector<std::string>, 2> declared_;  // [sublayer][strategy]
  std::function<SublayerTrace(std::size_t, Sublayer, const ModelShape&, int, int)> trace_;
  std::function<void(std::size_t, Sublayer, const ModelShape&, int, int, const TraceVisitor&)> visit_;
  std::function<Support(std::size_t, const ModelShape&, int)> support_;
};

// The library's own strategies (strategy/strategies.hpp), in their list order.
inline const StrategyCatalog& default_catalog() {
  static const StrategyCatalog catalog = StrategyCatalog::of<AllStrategies<ops::Counting>>();
  return catalog;
}

// A training mesh's stage group (MeshStrategies): the five, then MegatronRing, Tp2d and RingTp2d, which a cost table
// prices where the shape carries their factorisation (ModelShape::tp_inner, tp_x; RingTp2d both) and forbids
// elsewhere, saying why. The first five keep default_catalog()'s indices.
inline const StrategyCatalog& mesh_catalog() {
  static const StrategyCatalog catalog = StrategyCatalog::of<MeshStrategies<ops::Counting>>();
  return catalog;
}

}  // namespace paradyse::cost
