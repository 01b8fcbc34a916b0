// paradyse/cost/trace_cost.hpp: memory and time of a sublayer, computed from its dry-run trace (cost/dry_run.hpp).
//
// Memory. Allocations are replayed in program order, rounded to 64 bytes as the memory tracker rounds them; pooled
// buffers are counted in the buffer pool's size classes. Three numbers come out, as the planner needs them:
// `saved` (live at the end of forward: kept for backward), and per phase the highest plain live memory above the
// saved bytes and the pool's peak (its largest working set, which the pool keeps). The ordered event lists let
// cost/memory_model.hpp replay a whole stack through the pool's own rule, exactly. Bytes were recorded at float32;
// `dtype_bytes` rescales them to the activation type of the model (log-sum-exp and norm statistics, float32 in a
// mixed-precision run, are rescaled too: they are O(tokens x heads), a few per cent of the activations at most).
//
// Time. Two streams, as on a device: kernels run one after another on the compute stream at the profile's rates;
// a transfer starts when it is posted (or when the communication stream frees up) and takes the profile's
// alpha-beta time for its kind and group size. A wait blocks the compute stream until the transfer ends; the
// compute that ran between the post and the wait overlaps it, as far as the profile's `overlap` allows. Two more
// terms run on the compute stream where the profile prices them (cost/profile.hpp): the zeroing and first touch of
// every plain allocation and kernel workspace (FreshMemoryModel: a host Tensor is zeroed when made; buffers lent by
// the pool are not, they come back warm from the layer before; the pool's own growth is the planner's, once per
// step, plan/cost_table.hpp), the scalar math-library calls of TraceKind::transcendental (ScalarMathModel), and the
// fixed host cost of each kernel call (CallOverheadModel). Given a rank's weight reads (a serving step's dry run on a
// calibrated profile), each GEMM is priced at its weight's reuse distance (cost/gemm_reuse.hpp).
// (The buffer pool's misses depend on the whole step's order of loans: plan/cost_table.hpp's evaluate replays them
// through detail::PoolReplay, below, and prices them.)
#pragma once

#include "paradyse/core/trace.hpp"
#include "paradyse/cost/dry_run.hpp"
#include "paradyse/cost/gemm_reuse.hpp"
#include "paradyse/cost/profile.hpp"
#include "paradyse/strategy/buffer_pool.hpp"

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <set>
#include <span>
#include <utility>
#include <vector>

namespace paradyse::cost {

// One change of a rank's memory: plain bytes (+ allocated, - freed; `release`: a saved tensor freed, which a layer
// stack defers to the end of the layer's backward), or a pool buffer of a size class lent or returned.
struct MemoryEvent {
  enum Kind : std::uint8_t { plain, release, acquire, give_back } kind = plain;
  std::int64_t bytes = 0;
};

// One sublayer's cost on one rank for one training step.
struct SublayerCost {
  std::int64_t saved_bytes = 0;               // kept from forward to backward
  std::int64_t forward_transient_bytes = 0;   // peak live memory in forward, minus saved_bytes (plain + pool)
  std::int64_t backward_transient_bytes = 0;  // peak live memory in backward, minus saved_bytes (plain + pool)
  // The two parts: plain allocations above the saved bytes, and the pool's peak (which the pool keeps); and their
  // joint peak (plain live + the pool's high-water mark so far, at the same moment), for ordered estimates.
  std::int64_t forward_plain_bytes = 0, forward_pool_bytes = 0, forward_joint_bytes = 0;
  std::int64_t backward_plain_bytes = 0, backward_pool_bytes = 0, backward_joint_bytes = 0;
  double forward_s = 0;
  double backward_s = 0;
  double compute_s = 0;                       // kernel time, forward + backward
  double exposed_comm_s = 0;                  // communication not hidden under compute

  std::int64_t transient_bytes() const { return std::max(forward_transient_bytes, backward_transient_bytes); }
  std::int64_t pool_bytes() const { return std::max(forward_pool_bytes, backward_pool_bytes); }
  std::int64_t plain_bytes() const { return std::max(forward_plain_bytes, backward_plain_bytes); }
  double time_s() const { return forward_s + backward_s; }
  // Every memory event of forward and of backward (releases last) in order.
  std::vector<MemoryEvent> forward_events, backward_events;
};

inline constexpr std::int64_t round_allocation(double bytes) {
  if (bytes <= 0) return 0;
  const auto b = std::int64_t(bytes + 0.5);
  return (b + 63) / 64 * 64;
}
inline std::int64_t pool_class(double bytes) {
  return bytes <= 0 ? 0 : std::int64_t(BufferPool::size_class(std::size_t(bytes + 0.5)));
}

namespace detail {

// The buffer pool's rule (strategy/buffer_pool.hpp) on size classes: a hit reuses a cached buffer of the class; a
// miss raises the high-water mark to in-use + request, then frees cached buffers, largest first, until in-use +
// cached + request fits under it. held() is what the memory tracker sees; missed() the bytes the misses allocated,
// misses() each of them.
class PoolReplay {
public:
  void acquire(std::int64_t size) {
    if (auto it = cached_.find(size); it != cached_.end()) {
      cached_.erase(it);
      cached_bytes_ -= size;
    } else {
      high_water_ = std::max(high_water_, in_use_ + size);
      while (!cached_.empty() && in_use_ + cached_bytes_ + size > high_water_) {
        const auto largest = std::prev(cached_.end());
        cached_bytes_ -= *largest;
        held_ -= round_allocation(double(*largest));
        cached_.erase(largest);
      }
      held_ += round_allocation(double(size));
      missed_ += size;
      misses_.push_back(size);
    }
    in_use_ += size;
  }
  void give_back(std::int64_t size) {
    in_use_ -= size;
    cached_.insert(size);
    cached_bytes_ += size;
  }
  std::int64_t held() const { return held_; }
  std::int64_t missed() const { return missed_; }
  const std::vector<std::int64_t>& misses() const { return misses_; }  // each miss's bytes, in order

private:
  std::vector<std::int64_t> misses_;
  std::multiset<std::int64_t> cached_;
  std::int64_t in_use_ = 0, cached_bytes_ = 0, high_water_ = 0, held_ = 0, missed_ = 0;
};

}  // namespace detail

// The compute stream's price of one event, as the clock below charges it (a transfer, a wait and a pool event: 0).
// Kernels: `count` calls at the profile's rates, each with its fixed call cost (CallOverheadModel: GEMMs and flash
// attention carry their own fitted overheads, transcendental calls ride on their kernel's event); given the rank's
// weight `reads`, a GEMM is priced at its weight's reuse distance and its read recorded (cost/gemm_reuse.hpp).
// Allocations: a plain allocation's zeroing and first touch (none for an unzeroed one below the new-page size), and
// `count` kernel workspaces. Bytes were recorded at float32: `scale` (dtype_bytes / 4) rescales them.
inline double event_seconds(const HardwareProfile& hw, const TraceEvent& e, double scale, int dtype_bytes,
                            WeightReads* reads = nullptr) {
  const auto attention_flops = [&] { return 4 * e.k * e.n * hw.attention.pairs(e.m, e.tiled); };  // forward, per call
  double call = 0;
  switch (e.kind) {
    case TraceKind::gemm: call = gemm_time(e, hw.gemm, dtype_bytes, reads); break;
    case TraceKind::attention_forward: call = hw.attention.forward_time(attention_flops()); break;
    case TraceKind::attention_backward: call = hw.attention.backward_time(attention_flops()); break;
    case TraceKind::paged_attention:
      call = hw.paged_attention_time(e.m, e.n, e.k) + hw.call_overhead.kernel_call_s;
      break;
    case TraceKind::latent_attention:
      call = hw.latent_attention_time(e.m, e.n, e.k) + hw.call_overhead.kernel_call_s;
      break;
    case TraceKind::elementwise:
      call = hw.elementwise_time(e.bytes * scale, e.family) + hw.call_overhead.kernel_call_s;
      break;
    case TraceKind::activation:
      call = hw.activation_time(e.m, e.bytes * scale, e.n == 1, e.family) + hw.call_overhead.kernel_call_s;
      break;
    case TraceKind::transcendental: call = hw.scalar_math.time(ScalarFunction(int(e.n)), e.m); break;
    case TraceKind::allocate: return hw.fresh_memory.time(double(round_allocation(e.bytes * scale)), !e.unzeroed);
    case TraceKind::scratch: call = hw.fresh_memory.time(e.bytes * scale); break;
    default: return 0;
  }
  return e.count * call;
}

namespace trace_cost_detail {

constexpr Collective collective_of(TransferKind t) {
  switch (t) {
    case TransferKind::all_gather: return Collective::all_gather;
    case TransferKind::reduce_scatter: return Collective::reduce_scatter;
    case TransferKind::all_reduce: return Collective::all_reduce;
    case TransferKind::all_to_all: return Collective::all_to_all;
    case TransferKind::broadcast: return Collective::broadcast;
    case TransferKind::reduce: return Collective::reduce;
    default: return Collective::send_recv;
  }
}

class MemoryWalk {
public:
  explicit MemoryWalk(double scale) : scale_(scale) {}
  // Walks one phase's events, appending the memory events to *out (nullptr: peaks only); `release`: the events free
  // saved tensors.
  void walk(std::span<const TraceEvent> events, std::vector<MemoryEvent>* out, bool release = false) {
    const auto emit = [out](MemoryEvent::Kind kind, std::int64_t bytes) {
      if (out) out->push_back({kind, bytes});
    };
    for (const TraceEvent& e : events) {
      switch (e.kind) {
        case TraceKind::allocate: {
          const std::int64_t b = round_allocation(e.bytes * scale_);
          grow(b);
          emit(MemoryEvent::plain, b);
          break;
        }
        case TraceKind::scratch: {  // tracker bytes (already rounded), there and gone within one kernel
          const std::int64_t b = std::int64_t(e.bytes * scale_ + 0.5) / 64 * 64;
          grow(b);
          live_ -= b;
          emit(MemoryEvent::plain, b);
          emit(MemoryEvent::plain, -b);
          break;
        }
        case TraceKind::deallocate: {
          const std::int64_t b = round_allocation(e.bytes * scale_);
          live_ -= b;
          emit(release ? MemoryEvent::release : MemoryEvent::plain, -b);
          break;
        }
        case TraceKind::pool_acquire: {
          const std::int64_t b = pool_class(e.bytes * scale_);
          pool_live_ += b;
          pool_peak_ = std::max(pool_peak_, pool_live_);
          emit(MemoryEvent::acquire, b);
          joint_ = std::max(joint_, live_ + pool_peak_);
          break;
        }
        case TraceKind::pool_give_back: {
          const std::int64_t b = pool_class(e.bytes * scale_);
          pool_live_ -= b;
          emit(MemoryEvent::give_back, b);
          break;
        }
        default: break;
      }
    }
  }
  // Starts a new phase: peaks restart from what is live now.
  void next_phase() {
    peak_ = live_;
    pool_peak_ = pool_live_;
    joint_ = live_ + pool_peak_;
  }
  std::int64_t live() const { return live_; }
  std::int64_t peak() const { return peak_; }
  std::int64_t pool_peak() const { return pool_peak_; }
  std::int64_t joint() const { return joint_; }

private:
  void grow(std::int64_t bytes) {
    live_ += bytes;
    peak_ = std::max(peak_, live_);
    joint_ = std::max(joint_, live_ + pool_peak_);
  }
  double scale_;
  std::int64_t live_ = 0, peak_ = 0, pool_live_ = 0, pool_peak_ = 0, joint_ = 0;
};

// The two-stream clock.
class Clock {
public:
  // `reads`: the rank's weight reads, each GEMM priced at its weight's reuse distance (null: GemmModel::time).
  Clock(const HardwareProfile& hw, int group_size, double scale, int dtype_bytes, WeightReads* reads = nullptr)
      : hw_(hw), p_(group_size), scale_(scale), dtype_bytes_(dtype_bytes), reads_(reads) {}

  void walk(std::span<const TraceEvent> events) {
    for (const TraceEvent& e : events) step(e);
  }
  double now() const { return now_; }
  double compute() const { return compute_; }

private:
  struct Transfer {
    double end = 0, duration = 0, posted_at_compute = 0;
    bool pending = false;
  };
  void run(double seconds) {
    now_ += seconds;
    compute_ += seconds;
  }
  // Seconds of a transfer over a group of `group` ranks spread over `span` consecutive ranks (0: the trace's whole
  // group; a sub-group's transfers say theirs), the profile's lookup remembered per kind for the last size: a ring
  // posts one size p times in a row.
  double transfer_time(TransferKind kind, double bytes, int group, int span) {
    if (kind == TransferKind::barrier) return 0;
    group = group > 0 ? group : p_;
    span = span > 0 ? span : group;
    Memo& memo = transfer_memo_[std::size_t(kind)];
    if (memo.bytes != bytes || memo.group != group || memo.span != span)
      memo = {bytes, group, span, hw_.collective_time(collective_of(kind), group, bytes, span)};
    return memo.seconds;
  }
  void step(const TraceEvent& e) {
    switch (e.kind) {
      case TraceKind::post: {
        const double duration = transfer_time(e.transfer, e.bytes * scale_, e.group, e.span);
        const double start = std::max(now_, comm_free_);
        comm_free_ = start + duration;
        transfer(e.request) = {comm_free_, duration, compute_, true};
        break;
      }
      case TraceKind::wait: {
        if (e.request < 0 || std::size_t(e.request) >= transfers_.size() || !transfers_[std::size_t(e.request)].pending)
          break;
        const Transfer t = std::exchange(transfers_[std::size_t(e.request)], Transfer{});
        // Compute that ran while the transfer was in flight slows down as far as overlap is imperfect.
        const double overlapped = std::min(compute_ - t.posted_at_compute, t.duration);
        now_ = std::max(now_, t.end) + (1 - hw_.overlap) * std::max(0.0, overlapped);
        break;
      }
      default: run(event_seconds(hw_, e, scale_, dtype_bytes_, reads_)); break;  // kernels and allocations
    }
  }

  const HardwareProfile& hw_;
  int p_;
  double scale_;
  int dtype_bytes_;
  WeightReads* reads_;
  // The transfer of a request id (a trace numbers its requests 0, 1, 2, ...).
  Transfer& transfer(std::int32_t request) {
    check(request >= 0, "cost_of: a posted transfer has request id {}; ids are numbered from 0", request);
    if (std::size_t(request) >= transfers_.size()) transfers_.resize(std::size_t(request) + 1);
    return transfers_[std::size_t(request)];
  }

  struct Memo {
    double bytes = -1;
    int group = 0, span = 0;
    double seconds = 0;
  };
  double now_ = 0, compute_ = 0, comm_free_ = 0;
  std::vector<Transfer> transfers_;  // by request id
  Memo transfer_memo_[std::size_t(TransferKind::barrier) + 1];  // by TransferKind
};

}  // namespace trace_cost_detail

// Memory (always) and time (when `hardware` is given) of a sublayer trace, bytes rescaled to `dtype_bytes`;
// keep_events: fill forward_events and backward_events (the ordered replay needs them; a cost table does not).
// reads: the rank's weight reads so far (cost/gemm_reuse.hpp), each GEMM priced at its weight's reuse distance and
// the trace's reads recorded; null: every GEMM at GemmModel::time.
inline SublayerCost cost_of(const SublayerTraceView& trace, const HardwareProfile* hardware, int dtype_bytes = 4,
                            bool keep_events = true, WeightReads* reads = nullptr) {
  const double scale = double(dtype_bytes) / 4.0;
  SublayerCost c;
  trace_cost_detail::MemoryWalk memory(scale);
  std::vector<MemoryEvent>* forward_events = keep_events ? &c.forward_events : nullptr;
  std::vector<MemoryEvent>* backward_events = keep_events ? &c.backward_events : nullptr;
  memory.walk(trace.forward, forward_events);
  c.saved_bytes = memory.live();
  c.forward_plain_bytes = std::max<std::int64_t>(0, memory.peak() - c.saved_bytes);
  c.forward_pool_bytes = memory.pool_peak();
  c.forward_joint_bytes = std::max<std::int64_t>(0, memory.joint() - c.saved_bytes);
  memory.next_phase();
  memory.walk(trace.backward, backward_events);
  memory.walk(trace.release, backward_events, /*release=*/true);
  c.backward_plain_bytes = std::max<std::int64_t>(0, memory.peak() - c.saved_bytes);
  c.backward_pool_bytes = memory.pool_peak();
  c.backward_joint_bytes = std::max<std::int64_t>(0, memory.joint() - c.saved_bytes);
  c.forward_transient_bytes = c.forward_plain_bytes + c.forward_pool_bytes;
  c.backward_transient_bytes = c.backward_plain_bytes + c.backward_pool_bytes;
  if (hardware) {
    trace_cost_detail::Clock clock(*hardware, trace.group_size, scale, dtype_bytes, reads);
    clock.walk(trace.forward);
    c.forward_s = clock.now();
    clock.walk(trace.backward);
    c.backward_s = clock.now() - c.forward_s;
    c.compute_s = clock.compute();
    c.exposed_comm_s = clock.now() - clock.compute();
    if (reads) forget_far_weights(*reads, hardware->gemm);
  }
  return c;
}

inline SublayerCost cost_of(const SublayerTrace& trace, const HardwareProfile* hardware, int dtype_bytes = 4,
                            bool keep_events = true) {
  return cost_of(trace.view(), hardware, dtype_bytes, keep_events);
}

// The cost of sublayer `part` of catalog strategy `strategy` for shape m on p ranks (its trace read in place).
// Rank 0 stands for the group: it holds the most tokens, and with one sequence per sample every rank does the same
// work. A packed sample's documents do not: under ring attention a rank whose chunks fall in short documents skips
// most key blocks (4,096 tokens as 3,072 + 4 x 256 on p = 4: rank 0 does a tenth of rank 3's attention). So a packed
// shape is also dry-run on ranks 1..p-1, and the group's time is the slowest rank's (the ranks meet at every shift);
// its memory stays rank 0's.
inline SublayerCost evaluate_sublayer(const StrategyCatalog& catalog, int strategy, Sublayer part, const ModelShape& m,
                                      int p, const HardwareProfile* hardware, bool keep_events = false) {
  SublayerCost c;
  catalog.visit_trace(strategy, part, m, p, 0, [&](const SublayerTraceView& trace) {
    c = cost_of(trace, hardware, m.dtype_bytes, keep_events);
  });
  if (m.packed_lengths.empty() || !hardware) return c;
  for (int rank = 1; rank < p; ++rank)
    catalog.visit_trace(strategy, part, m, p, rank, [&](const SublayerTraceView& trace) {
      const SublayerCost other = cost_of(trace, hardware, m.dtype_bytes, /*keep_events=*/false);
      if (other.time_s() <= c.time_s()) return;
      c.forward_s = other.forward_s;
      c.backward_s = other.backward_s;
      c.compute_s = other.compute_s;
      c.exposed_comm_s = other.exposed_comm_s;
    });
  return c;
}

}  // namespace paradyse::cost
