// paradyse/cost/tally.hpp: evaluates a strategy's schedule (what one rank allocates, computes and sends in forward
// and backward) into its memory and time.
//
// The strategy schedules (cost/schedules.hpp) are straight-line code over a Tally: `alloc`/`free` transient
// buffers, `save`/`release` what backward needs, `gemm`/`attention`/`collective` kernels and transfers, `ring` for
// p steps that overlap compute with a transfer. The same code gives both the memory model (no profile needed) and
// the time model (a HardwareProfile), so the two never disagree about what a strategy does.
//
// Memory is counted above a baseline (what earlier layers saved), in 64-byte-rounded allocations like the memory
// tracker. Three numbers come out: `saved` (kept from this sublayer's forward to its backward), and the forward and
// backward `transient` (the highest live memory of the sublayer minus its saved bytes). With full recomputation only
// `save_input` survives forward; backward replays the forward first.
#pragma once

#include "paradyse/cost/profile.hpp"

#include <algorithm>
#include <cstdint>

namespace paradyse::cost {

// One sublayer's cost on one rank for one training step.
struct SublayerCost {
  std::int64_t saved_bytes = 0;               // kept from forward to backward
  std::int64_t forward_transient_bytes = 0;   // peak live memory in forward, minus saved_bytes
  std::int64_t backward_transient_bytes = 0;  // peak live memory in backward, minus saved_bytes
  double forward_s = 0;
  double backward_s = 0;                      // includes the forward replay under recomputation
  double compute_s = 0;                       // kernel time, forward + backward
  double exposed_comm_s = 0;                  // communication not hidden under compute

  std::int64_t transient_bytes() const { return std::max(forward_transient_bytes, backward_transient_bytes); }
  double time_s() const { return forward_s + backward_s; }
};

inline constexpr std::int64_t round_allocation(double bytes) {
  if (bytes <= 0) return 0;
  const auto b = std::int64_t(bytes + 0.5);
  return (b + 63) / 64 * 64;
}

class Tally {
public:
  enum class Phase { forward, replay, backward };

  // `hardware` may be null: memory only, every time is 0.
  Tally(const HardwareProfile* hardware, int group_size, bool recompute)
      : hw_(hardware), p_(group_size), recompute_(recompute) {}

  int group_size() const { return p_; }
  bool recompute() const { return recompute_; }
  Phase phase() const { return phase_; }

  // ---- phases --------------------------------------------------------------------------------------------------
  // After forward: drops what recomputation does not keep. Then backward starts with exactly the saved bytes live.
  void end_forward() {
    live_ -= dropped_;
    dropped_ = 0;
    phase_ = recompute_ ? Phase::replay : Phase::backward;
  }
  // Under recomputation, after the replayed forward.
  void end_replay() { phase_ = Phase::backward; }

  // ---- memory --------------------------------------------------------------------------------------------------
  void alloc(double bytes) { grow(round_allocation(bytes)); }
  void free(double bytes) { live_ -= round_allocation(bytes); }
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
  void release(double bytes) { live_ -= round_allocation(bytes); }

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
    c.forward_transient_bytes = std::max<std::int64_t>(0, forward_peak_ - saved_);
    c.backward_transient_bytes = std::max<std::int64_t>(0, backward_peak_ - saved_);
    c.forward_s = forward_s_;
    c.backward_s = backward_s_;
    c.compute_s = compute_s_;
    c.exposed_comm_s = comm_s_;
    return c;
  }

private:
  void grow(std::int64_t bytes) {
    live_ += bytes;
    if (phase_ == Phase::forward) forward_peak_ = std::max(forward_peak_, live_);
    else backward_peak_ = std::max(backward_peak_, live_);
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
  Phase phase_ = Phase::forward;
  std::int64_t live_ = 0, saved_ = 0, dropped_ = 0;
  std::int64_t forward_peak_ = 0, backward_peak_ = 0;
  double forward_s_ = 0, backward_s_ = 0, compute_s_ = 0, comm_s_ = 0;
};

}  // namespace paradyse::cost
