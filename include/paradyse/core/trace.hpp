// paradyse/core/trace.hpp: the ordered record of what one rank does in a dry run (allocations, kernels, transfers).
//
// A dry run executes a strategy's real code on meta tensors (core/memory.hpp: shapes and bytes, no storage) with a
// counting backend (ops/counting.hpp) and a symbolic communicator (comm/symbolic.hpp). Each of the three records
// into one Trace, in program order:
//   - the rank's memory tracker: every plain allocation and free, and every buffer lent or taken back by the buffer
//     pool (bytes as requested, before rounding, so that a model may rescale them to another element size);
//   - the backend: every kernel with its shape (GEMM m, n, k; attention visible query-key pairs, heads, head dim,
//     and the pairs of the whole tiles the CPU kernel computes; element-wise bytes moved and the kernel's family);
//   - the communicator: every transfer when it is posted (its kind and bytes) and when it is waited for.
// The cost models (cost/trace_cost.hpp) read memory and time off this record, so a strategy is written once.
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>
#include <utility>
#include <vector>

namespace paradyse {

enum class TraceKind : std::uint8_t {
  allocate,             // bytes: a plain allocation of the tracker
  scratch,              // bytes: a kernel's workspace, allocated and freed within the kernel call (count: in each
                        // of that many calls, or items of a batched call, one after another)
  deallocate,           // bytes: its release
  pool_acquire,         // bytes: a buffer lent by the buffer pool (requested bytes; the pool rounds to a size class)
  pool_give_back,       // bytes: its return
  gemm,                 // m, n, k, operand, grouped
  attention_forward,    // m: visible query-key pairs summed over the batch, n: query heads, k: head dim, tiled: the
                        // pairs of the tiles the CPU kernel computes whole (ops/counting.hpp tiled_pairs)
  attention_backward,   // as attention_forward
  paged_attention,      // as attention_forward: serving's attention over a paged KV cache (serve/paged_attention.hpp),
                        // priced per (query-key pair, head) visit (cost::PagedAttentionModel)
  latent_attention,     // as paged_attention, k the width r_kv + d_r / 2: MLA's attention over its latent cache
                        // (serve/mla_attention.hpp), priced by the profile's own model of it (else as paged_attention)
  elementwise,          // bytes read and written by a memory-bound kernel (copy, fill, add, norm, softmax, ...)
  activation,           // m: elements through GELU/SwiGLU, bytes: moved, n: which (1 SwiGLU forward, 0 others)
  transcendental,       // m: scalar math-library calls a kernel makes one at a time, n: which (cost::ScalarFunction:
                        // 0 exp, 1 cos or sin); recorded beside the kernel's own event, which holds its other work
  post,                 // transfer, bytes, request: a transfer starts
  wait,                 // request: the caller waits for it
};

// What a posted transfer is; bytes are those of the larger side (the gathered buffer of an all-gather, the
// scattered input of a reduce-scatter, the whole send buffer of an all-to-all, one block of a ring shift).
enum class TransferKind : std::uint8_t { all_gather, reduce_scatter, all_reduce, all_to_all, broadcast, reduce, send_recv, barrier };

constexpr std::string_view name_of(TransferKind t) {
  constexpr std::string_view names[] = {"all_gather", "reduce_scatter", "all_reduce", "all_to_all",
                                        "broadcast",  "reduce",         "send_recv",  "barrier"};
  return names[int(t)];
}

// Which family of memory-bound kernels an elementwise or activation event is: a profile may price each family at a
// rate of its own (cost::HardwareProfile::elementwise_families, calibrated on a device, where the streaming kernels
// and the norms run several times apart); `other`, and any family a profile has no rate for, at the size classes.
enum class ElementwiseFamily : std::uint8_t {
  other,       // attention merge, router, cross-entropy, conversions, ...
  copy,        // copy (any strides)
  fill,        // fill
  add,         // add_into
  norm,        // LayerNorm and RMSNorm, forward and backward
  rope,        // rotary embedding, forward and backward
  softmax,     // the materialised softmax, forward and backward
  activation,  // GELU, SwiGLU, sigmoid, forward and backward
  optimizer,   // the AdamW step
  rows,        // row gathers and scatters (MoE permutation and combine, embedding)
};
inline constexpr int kElementwiseFamilies = 10;

constexpr std::string_view name_of(ElementwiseFamily f) {
  constexpr std::string_view names[] = {"other",   "copy",       "fill",      "add",  "norm",
                                        "rope",    "softmax",    "activation", "optimizer", "rows"};
  return names[int(f)];
}

struct TraceEvent {
  TraceKind kind = TraceKind::elementwise;
  TransferKind transfer = TransferKind::barrier;
  ElementwiseFamily family = ElementwiseFamily::other;  // elementwise and activation events
  bool unzeroed = false;      // allocate: contents left unspecified (core/memory.hpp Contents), not zeroed
  bool grouped = false;       // gemm: an item after the first of a grouped call (ops/cpu/gemm_grouped.hpp), which a
                              // device launches with the first (cost/profile.hpp GemmModel::grouped_item_time)
  std::int32_t request = -1;  // links a post to its wait
  std::int32_t count = 1;     // identical kernels in a row (a per-head loop) are one event
  std::int32_t group = 0;     // post: the size of the group the transfer runs over (0: the trace's whole group)
  std::int32_t span = 0;      // post: the consecutive ranks its members spread over (0: as many as its size)
  double bytes = 0;
  double m = 0, n = 0, k = 0;
  double tiled = 0;  // attention: query-key pairs of the whole tiles computed (0: not counted, a hand-built event)
  // gemm: the address of its b operand, in a serving step a weight (cost/gemm_reuse.hpp keeps the bytes read between
  // a weight's reads by it); 0: not known. Not part of same_kernel: a run of merged GEMMs keeps its first's.
  std::uintptr_t operand = 0;

  bool is_kernel() const noexcept { return kind >= TraceKind::gemm && kind <= TraceKind::transcendental; }
  bool same_kernel(const TraceEvent& e) const noexcept {
    return kind == e.kind && family == e.family && grouped == e.grouped && bytes == e.bytes && m == e.m &&
           n == e.n && k == e.k && tiled == e.tiled;
  }
};

class Trace {
public:
  Trace() = default;
  // A trace that records into `storage` (emptied, its capacity kept): dry runs recycle one buffer per thread
  // (recycled_storage()) instead of growing and freeing a fresh one each time.
  explicit Trace(std::vector<TraceEvent>&& storage) : events_(std::move(storage)) { events_.clear(); }

  void record(const TraceEvent& event) {
    if (paused_ != 0) return;
    if (open_) open_->events.push_back(event);  // as called, before merging (a replay calls record() the same way)
    if (event.is_kernel() && !events_.empty() && events_.back().is_kernel() && events_.back().same_kernel(event)) {
      events_.back().count += event.count;
      return;
    }
    events_.push_back(event);
  }
  std::int32_t new_request() noexcept { return next_request_++; }
  const std::vector<TraceEvent>& events() const noexcept { return events_; }
  std::size_t size() const noexcept { return events_.size(); }
  void clear() noexcept { events_.clear(); }
  // The recorded events, moved out (the trace is empty afterwards).
  std::vector<TraceEvent> take() noexcept { return std::exchange(events_, {}); }

  // The calling thread's spare event buffer: take it with std::exchange(recycled_storage(), {}), give a buffer back
  // with give_back_storage (the larger of the two is kept). Only capacity matters; contents are cleared on use.
  static std::vector<TraceEvent>& recycled_storage() noexcept {
    thread_local std::vector<TraceEvent> spare;
    return spare;
  }
  static void give_back_storage(std::vector<TraceEvent>&& storage) noexcept {
    std::vector<TraceEvent>& spare = recycled_storage();
    if (storage.capacity() > spare.capacity()) spare = std::move(storage);
  }

  // Recording stops while a Pause lives (the buffer pool's own storage: its loans are recorded instead).
  class Pause {
  public:
    explicit Pause(Trace* trace) noexcept : trace_(trace) {
      if (trace_) ++trace_->paused_;
    }
    ~Pause() {
      if (trace_) --trace_->paused_;
    }
    Pause(const Pause&) = delete;
    Pause& operator=(const Pause&) = delete;

  private:
    Trace* trace_;
  };

  // The trace the calling thread's counting backend records into (nullptr: none).
  static Trace*& current() noexcept {
    thread_local Trace* trace = nullptr;
    return trace;
  }

  // ---- Repeated calls in a dry run ----
  // Code that makes one call again on the same shapes (METP's ring attention, once per head group) records the same
  // events again. record_or_replay (below) records such a call's events once under a key that names everything they
  // depend on, and appends them again, requests renumbered, for each later call with that key: a shortcut that
  // leaves the trace exactly as running the call would (tests/cost/dry_run_shortcuts.cpp compares both).
  using SegmentKey = std::vector<std::int64_t>;
  bool segment_open() const noexcept { return open_ != nullptr; }
  // Whether record_or_replay may record or replay now (replays are on, and no segment is open: a call inside one runs).
  bool replays_now() const noexcept { return replays_enabled() && !open_; }
  // Appends the events recorded under `key` (false: none, or they are not replayable).
  bool replay(const SegmentKey& key) {
    for (const Segment& s : segments_) {
      if (s.key != key) continue;
      if (!s.replayable) return false;
      const std::int32_t shift = next_request_ - s.first_request;
      next_request_ += s.requests;
      for (TraceEvent e : s.events) {
        if (e.request >= 0) e.request += shift;
        record(e);
      }
      return true;
    }
    return false;
  }
  void open_segment(SegmentKey key) {
    open_ = std::make_unique<Segment>();
    open_->key = std::move(key);
    open_->first_request = next_request_;
  }
  // Ends the open segment and keeps it, replayable when its events hold every request it numbered, posted and
  // waited for, and at least `min_posts` posts (a communicator that records elsewhere, or a pause, leaves it
  // unreplayable); `keep` false drops it.
  void close_segment(bool keep, std::int32_t min_posts = 0) {
    std::unique_ptr<Segment> s = std::move(open_);
    if (!keep || !s) return;
    s->requests = next_request_ - s->first_request;
    std::int32_t posts = 0, waits = 0;
    for (const TraceEvent& e : s->events) {
      if (e.kind != TraceKind::post && e.kind != TraceKind::wait) continue;
      s->replayable &= e.request >= s->first_request && e.request < next_request_;
      (e.kind == TraceKind::post ? posts : waits) += 1;
    }
    s->replayable &= posts == s->requests && waits == s->requests && posts >= min_posts;
    segments_.push_back(std::move(*s));
  }
  // Replays stay off on this thread while it is false (to compare a replayed trace with one that ran).
  static bool& replays_enabled() noexcept {
    thread_local bool enabled = true;
    return enabled;
  }

private:
  struct Segment {
    SegmentKey key;
    std::vector<TraceEvent> events;
    std::int32_t first_request = 0, requests = 0;
    bool replayable = true;
  };
  std::vector<TraceEvent> events_;
  int paused_ = 0;
  std::int32_t next_request_ = 0;
  std::vector<Segment> segments_;
  std::unique_ptr<Segment> open_;
};

// Runs `call` (which records into `trace`) or, when `trace` holds a replayable recording under `key`, appends that
// instead. The caller guarantees that `key` names everything the call's events depend on; `min_posts`: the
// transfers the call makes at least (fewer in the recording: its communicator records elsewhere, never replayed).
// Calls made while a segment is open run (their events are part of it).
template <class Call>
void record_or_replay(Trace& trace, Trace::SegmentKey key, Call&& call, std::int32_t min_posts = 0) {
  if (!trace.replays_now()) {
    call();
    return;
  }
  if (trace.replay(key)) return;
  trace.open_segment(std::move(key));
  try {
    call();
  } catch (...) {
    trace.close_segment(false);
    throw;
  }
  trace.close_segment(true, min_posts);
}

// Makes `trace` the calling thread's current trace for the lifetime of this object.
class ScopedTrace {
public:
  explicit ScopedTrace(Trace& trace) noexcept : previous_(Trace::current()) { Trace::current() = &trace; }
  ~ScopedTrace() { Trace::current() = previous_; }
  ScopedTrace(const ScopedTrace&) = delete;
  ScopedTrace& operator=(const ScopedTrace&) = delete;

private:
  Trace* previous_;
};

// The trace of what fn() records (a dry run of a call or a few, on the counting backend).
template <class Fn>
Trace trace_of(Fn&& fn) {
  Trace trace;
  const ScopedTrace recording(trace);
  fn();
  return trace;
}

}  // namespace paradyse
