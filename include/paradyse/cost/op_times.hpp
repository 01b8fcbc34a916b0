// paradyse/cost/op_times.hpp: where a step's measured time and its predicted time part, op by op.
//
//   using Timed = cost::OpTimed<ops::Cuda>;               // a backend: every op runs on ops::Cuda
//   cost::OpTimes times(profile);                         // the profile the ops are priced on
//   {
//     const cost::ScopedOpTimes on(times);                // this thread's ops, from here to the end of the scope
//     model.forward_backward(...);                        // a model over Timed
//   }
//   for (const auto& [op, t] : times.by_op()) ...         // t.calls, t.measured_s, t.priced_s
//
// OpTimed<Base> runs each op of ops/op_table.inc on Base. While an OpTimes is current on the calling thread, each
// call is priced first (the counting backend's events of the same call, ops/counting.hpp, on the profile through
// cost/trace_cost.hpp's clock for one rank: exactly what a dry run of the step charges for it) and then timed alone
// in wall-clock seconds, between two Base::synchronize (a device's queued work first, then the op's own). With no
// OpTimes current an op is Base's, untimed. The waits cost the host's running ahead of the device that an untimed
// step has, so the measured ops add up to more than such a step where a step's kernels are short; each op's measured
// time against its price says which of the time model's terms a device runs at another rate.
#pragma once

#include "paradyse/core/timer.hpp"
#include "paradyse/core/trace.hpp"
#include "paradyse/cost/profile.hpp"
#include "paradyse/cost/trace_cost.hpp"
#include "paradyse/ops/counting.hpp"

#include <cstdint>
#include <exception>
#include <map>
#include <string>
#include <string_view>
#include <utility>

namespace paradyse::cost {

// One op's calls on one thread: how many, their measured seconds and their price, summed.
struct OpTime {
  std::int64_t calls = 0;
  double measured_s = 0;
  double priced_s = 0;
};

class OpTimes {
public:
  explicit OpTimes(HardwareProfile profile) : profile_(std::move(profile)) {}

  const HardwareProfile& profile() const noexcept { return profile_; }
  const std::map<std::string, OpTime, std::less<>>& by_op() const noexcept { return by_op_; }
  OpTime total() const {
    OpTime t;
    for (const auto& [op, one] : by_op_) t.calls += one.calls, t.measured_s += one.measured_s, t.priced_s += one.priced_s;
    return t;
  }
  void clear() { by_op_.clear(); }
  void add(std::string_view op, double measured_s, double priced_s) {
    auto it = by_op_.find(op);
    if (it == by_op_.end()) it = by_op_.emplace(std::string(op), OpTime{}).first;
    ++it->second.calls;
    it->second.measured_s += measured_s;
    it->second.priced_s += priced_s;
  }

  // The calling thread's current table (nullptr: none; ops run untimed).
  static OpTimes*& current() noexcept {
    thread_local OpTimes* table = nullptr;
    return table;
  }

private:
  HardwareProfile profile_;
  std::map<std::string, OpTime, std::less<>> by_op_;
};

// Makes `times` the calling thread's table for the scope.
class ScopedOpTimes {
public:
  explicit ScopedOpTimes(OpTimes& times) : previous_(std::exchange(OpTimes::current(), &times)) {}
  ScopedOpTimes(const ScopedOpTimes&) = delete;
  ScopedOpTimes& operator=(const ScopedOpTimes&) = delete;
  ~ScopedOpTimes() { OpTimes::current() = previous_; }

private:
  OpTimes* previous_;
};

namespace op_times_detail {

// Seconds the time model charges for what record() records (one rank's kernels on `profile`).
template <class Record>
double price(const HardwareProfile& profile, Record&& record) {
  const Trace trace = trace_of(record);
  const SublayerTraceView one{.forward = trace.events(), .backward = {}, .release = {}, .group_size = 1};
  return cost_of(one, &profile, 4, /*keep_events=*/false).forward_s;
}

// Times one call from its construction to its destruction (after the Base's work is done), then records it. A call
// that throws is not recorded (and its device work not waited for: the exception is what the caller sees).
template <class Base>
class CallTimer {
public:
  CallTimer(OpTimes& times, std::string_view op, double priced_s)
      : times_(times), op_(op), priced_s_(priced_s), exceptions_(std::uncaught_exceptions()) {
    Base::synchronize();  // the work queued before this op is not its own
    start_ = wall_seconds();
  }
  CallTimer(const CallTimer&) = delete;
  CallTimer& operator=(const CallTimer&) = delete;
  ~CallTimer() {
    if (std::uncaught_exceptions() != exceptions_) return;
    Base::synchronize();
    times_.add(op_, wall_seconds() - start_, priced_s_);
  }

private:
  OpTimes& times_;
  std::string_view op_;
  double priced_s_;
  int exceptions_;
  double start_ = 0;
};

// The ops: each priced by the counting backend's rule for the same call (run first: where the counting rule writes
// a host index span, the router's stand-in choices, Base's op then writes the real ones), then run on Base, timed.
template <class Base>
struct TimedImpl {
  static constexpr std::string_view name = "timed";
  static constexpr MemorySpace space = ops::memory_space_of<Base>;  // tensors live where Base's do
#define PARADYSE_OP_TIMED(op)                                                                                    \
  template <class... A>                                                                                          \
  static decltype(auto) op(A&&... a) {                                                                           \
    OpTimes* times = OpTimes::current();                                                                         \
    if (!times) return Base::op(std::forward<A>(a)...);                                                          \
    const double priced = price(times->profile(), [&] { ops::counting::op(a...); });                             \
    const CallTimer<Base> timer(*times, #op, priced);                                                            \
    return Base::op(std::forward<A>(a)...);                                                                      \
  }
#define PARADYSE_OP PARADYSE_OP_TIMED
#include "paradyse/ops/op_names.inc"
#undef PARADYSE_OP
#undef PARADYSE_OP_TIMED
};

}  // namespace op_times_detail

}  // namespace paradyse::cost

namespace paradyse::ops {
// The backend: Base's ops, timed and priced while an OpTimes is current (above). Tensors live where Base's do.
template <class Base>
using OpTimed = BackendOf<cost::op_times_detail::TimedImpl<Base>>;
}  // namespace paradyse::ops

namespace paradyse::cost {
using ops::OpTimed;
}  // namespace paradyse::cost
