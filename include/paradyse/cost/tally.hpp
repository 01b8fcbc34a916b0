// paradyse/cost/tally.hpp: evaluates a strategy's schedule (what one rank allocates, computes and sends in forward
// and backward) into its memory and time.
//
// The strategy schedules (cost/schedules.hpp) are straight-line code over a Tally: `alloc`/`free` transient
// buffers, `save`/`release` what backward needs, `gemm`/`attention`/`collective` kernels and transfers, `ring` for
// p steps that overlap compute with a transfer. The same code gives both the memory model (no profile needed) and
// the time model (a HardwareProfile), so the two never disagree about what a strategy does.
//
// Memory is counted above a baseline (what earlier layers saved), in 64-byte-rounded allocations like the memory
// tracker. Transient buffers are of two kinds: plain allocations (`alloc`/`free`) and buffers of the per-rank
// buffer pool (`acquire`/`give_back`), counted in the pool's size classes. The pool keeps what it has handed out up
// to its high-water mark, so its contribution is the largest set of pooled buffers in use at once (`pool_peak`).
// Three numbers come out: `saved` (kept from this sublayer's forward to its backward), and the forward and backward
// `transient`: the highest plain live memory above the saved bytes plus the pool's peak (a bound that is reached
// when the two peaks coincide, as they do in the strategies, whose transients are all pooled). With full
// recomputation only `save_input` survives forward; backward replays the forward first.
#pragma once

#include "paradyse/cost/profile.hpp"
#include "paradyse/strategy/buffer_pool.hpp"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace paradyse::cost {

// One change of a rank's memory: plain bytes (+ allocated, - freed; `release`: a saved tensor freed, which a layer
// stack may defer to the end of the layer's backward), or a pool buffer of a size class lent or returned.
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
  double backward_s = 0;                      // includes the forward replay under recomputation
  double compute_s = 0;                       // kernel time, forward + backward
  double exposed_comm_s = 0;                  // communication not hidden under compute

  std::int64_t transient_bytes() const { return std::max(forward_transient_bytes, backward_transient_bytes); }
  // The largest pooled working set (the pool keeps it) and the largest plain workspace, forward or backward.
  std::int64_t pool_bytes() const { return std::max(forward_pool_bytes, backward_pool_bytes); }
  std::int64_t plain_bytes() const { return std::max(forward_plain_bytes, backward_plain_bytes); }
  double time_s() const { return forward_s + backward_s; }
  // Every memory event of forward and of backward in order (recorded on request only: see Tally).
  std::vector<MemoryEvent> forward_events, backward_events;
};

inline constexpr std::int64_t round_allocation(double bytes) {
  if (bytes <= 0) return 0;
  const auto b = std::int64_t(bytes + 0.5);
  return (b + 63) / 64 * 64;
}

class Tally {
public:
  enum class Phase { forward, replay, backward };

  // `hardware` may be null: memory only, every time is 0. `record_events`: keep every memory event for ordered
  // replays (cost/memory_model.hpp); off for the planner, which needs only the totals.
  Tally(const HardwareProfile* hardware, int group_size, bool recompute, bool record_events = false)
      : hw_(hardware), p_(group_size), recompute_(recompute), record_(record_events) {}

  int group_size() const { return p_; }
  bool recompute() const { return recompute_; }
  Phase phase() const { return phase_; }

  // ---- phases --------------------------------------------------------------------------------------------------
  // After forward: drops what recomputation does not keep. Then backward starts with exactly the saved bytes live.
  void end_forward() {
    live_ -= dropped_;
    note(MemoryEvent::plain, -dropped_);
    dropped_ = 0;
    phase_ = recompute_ ? Phase::replay : Phase::backward;
  }
  // Under recomputation, after the replayed forward.
  void end_replay() { phase_ = Phase::backward; }

  // ---- memory --------------------------------------------------------------------------------------------------
  void alloc(double bytes) { grow(round_allocation(bytes)); }
  void free(double bytes) {
    live_ -= round_allocation(bytes);
    note(MemoryEvent::plain, -round_allocation(bytes));
  }
  // The sublayer's input, kept for backward (recomputation keeps it too).
  void save_input(double bytes) {
    if (phase_ == Phase::forward) grow(round_allocation(bytes)), saved_ += round_allocation(bytes);
  }
  // Allocates a tensor that backward needs.
  void save(double bytes) {
    const std::int64_t b = round_allocation(bytes);
    grow(b);
    keep_allocated(b);
  }
  // Turns a live transient allocation into one that backward needs.
  void keep(double bytes) { keep_allocated(round_allocation(bytes)); }
  // Backward is done with a saved tensor.
  void release(double bytes) {
    live_ -= round_allocation(bytes);
    note(MemoryEvent::release, -round_allocation(bytes));
  }
  // A buffer from the pool (size-class rounded) and its return.
  void acquire(double bytes) {
    if (bytes <= 0) return;
    note(MemoryEvent::acquire, pool_class(bytes));
    pool_live_ += pool_class(bytes);
    if (phase_ == Phase::forward) forward_pool_peak_ = std::max(forward_pool_peak_, pool_live_);
    else backward_pool_peak_ = std::max(backward_pool_peak_, pool_live_);
    note_joint();
  }
  void give_back(double bytes) {
    if (bytes <= 0) return;
    note(MemoryEvent::give_back, pool_class(bytes));
    pool_live_ -= pool_class(bytes);
  }
  static std::int64_t pool_class(double bytes) {
    return bytes <= 0 ? 0 : std::int64_t(BufferPool::size_class(std::size_t(bytes + 0.5)));
  }

  // ---- time ----------------------------------------------------------------------------------------------------
  double gemm_s(double m, double n, double k, int dtype_bytes) const {
    return hw_ ? hw_->gemm.time(m, n, k, dtype_bytes) : 0;
  }
  double collective_s(Collective op, double bytes) const { return hw_ ? hw_->collective_time(op, p_, bytes) : 0; }
  double attention_forward_s(double flops) const { return hw_ ? hw_->attention.forward_time(flops) : 0; }
  double attention_backward_s(double forward_flops) const {
    return hw_ ? hw_->attention.backward_time(forward_flops) : 0;
  }
  double elementwise_s(double bytes) const { return hw_ ? hw_->elementwise_time(bytes) : 0; }
  double activation_s(double elements, double bytes) const { return hw_ ? hw_->activation_time(elements, bytes) : 0; }

  void compute(double seconds) { add(seconds, seconds, 0); }
  void communicate(double seconds) { add(seconds, 0, seconds); }
  // Compute and a transfer that run at once: the shorter hides under the longer as far as the device allows.
  void overlapped(double compute_s, double comm_s) {
    const double overlap = hw_ ? hw_->overlap : 1;
    const double longer = std::max(compute_s, comm_s), shorter = std::min(compute_s, comm_s);
    const double total = longer + (1 - overlap) * shorter;
    add(total, compute_s, total - compute_s);
  }
  // `steps` steps of `compute_s` each; all but the last also pass a block around the ring (`transfer_s`), overlapped
  // with that step's compute (double buffering). `final_hop` adds one more transfer after the last step (a gradient
  // returning to its owner).
  void ring(int steps, double compute_s, double transfer_s, bool final_hop = false) {
    for (int i = 0; i < steps; ++i) {
      if (i + 1 < steps) overlapped(compute_s, transfer_s);
      else compute(compute_s);
    }
    if (final_hop && steps > 1) communicate(transfer_s);
  }

  // The seconds `ring` would add, without adding them (for a ring nested inside an overlapped step).
  double ring_s(int steps, double compute_s, double transfer_s, bool final_hop = false) const {
    const double overlap = hw_ ? hw_->overlap : 1;
    const double longer = std::max(compute_s, transfer_s), shorter = std::min(compute_s, transfer_s);
    const double step = longer + (1 - overlap) * shorter;
    return steps <= 0 ? 0 : (steps - 1) * step + compute_s + (final_hop && steps > 1 ? transfer_s : 0);
  }

  SublayerCost result() const {
    SublayerCost c;
    c.saved_bytes = saved_;
    c.forward_plain_bytes = std::max<std::int64_t>(0, forward_peak_ - saved_);
    c.backward_plain_bytes = std::max<std::int64_t>(0, backward_peak_ - saved_);
    c.forward_pool_bytes = forward_pool_peak_;
    c.backward_pool_bytes = backward_pool_peak_;
    c.forward_transient_bytes = c.forward_plain_bytes + c.forward_pool_bytes;
    c.backward_transient_bytes = c.backward_plain_bytes + c.backward_pool_bytes;
    c.forward_joint_bytes = std::max<std::int64_t>(0, forward_joint_ - saved_);
    c.backward_joint_bytes = std::max<std::int64_t>(0, backward_joint_ - saved_);
    c.forward_events = forward_events_;
    c.backward_events = backward_events_;
    c.forward_s = forward_s_;
    c.backward_s = backward_s_;
    c.compute_s = compute_s_;
    c.exposed_comm_s = comm_s_;
    return c;
  }

private:
  void note(MemoryEvent::Kind kind, std::int64_t bytes) {
    if (record_ && bytes != 0) (phase_ == Phase::forward ? forward_events_ : backward_events_).push_back({kind, bytes});
  }
  void grow(std::int64_t bytes) {
    live_ += bytes;
    note(MemoryEvent::plain, bytes);
    if (phase_ == Phase::forward) forward_peak_ = std::max(forward_peak_, live_);
    else backward_peak_ = std::max(backward_peak_, live_);
    note_joint();
  }
  // Plain live memory plus the pool's high-water mark of this phase.
  void note_joint() {
    if (phase_ == Phase::forward) forward_joint_ = std::max(forward_joint_, live_ + forward_pool_peak_);
    else backward_joint_ = std::max(backward_joint_, live_ + backward_pool_peak_);
  }
  void keep_allocated(std::int64_t bytes) {
    if (phase_ != Phase::forward) return;  // in the replay the bytes simply stay live until released
    if (recompute_) dropped_ += bytes;
    else saved_ += bytes;
  }
  void add(double total, double compute, double comm) {
    (phase_ == Phase::forward ? forward_s_ : backward_s_) += total;
    compute_s_ += compute;
    comm_s_ += comm;
  }

  const HardwareProfile* hw_;
  int p_;
  bool recompute_;
  bool record_ = false;
  std::vector<MemoryEvent> forward_events_, backward_events_;
  Phase phase_ = Phase::forward;
  std::int64_t live_ = 0, saved_ = 0, dropped_ = 0;
  std::int64_t forward_peak_ = 0, backward_peak_ = 0;
  std::int64_t pool_live_ = 0, forward_pool_peak_ = 0, backward_pool_peak_ = 0;
  std::int64_t forward_joint_ = 0, backward_joint_ = 0;
  double forward_s_ = 0, backward_s_ = 0, compute_s_ = 0, comm_s_ = 0;
};

}  // namespace paradyse::cost
