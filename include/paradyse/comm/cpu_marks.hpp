// paradyse/comm/cpu_marks.hpp: a thread communicator that notes its thread's CPU time as each blocking collective
// returns, the points where the ranks wait for one another.
//
//   run_ranks(2, [](ThreadCommunicator& plain) {
//     CpuMarkedCommunicator comm(std::move(plain));
//     ... comm.all_reduce(x, x, ReduceOp::sum); ...
//     const std::vector<double> marks = comm.take_marks();  // thread CPU seconds, one per collective returned
//   });
//
// What it is for: a step measured on thread ranks that share cores, cut at these marks, each piece taken at its
// slowest rank and the pieces summed, is the step as ranks with cores of their own take it (serve/clock.hpp's
// CpuClock, synchronised): thread CPU time does not count waiting for a core or for another rank, and the
// collectives make every rank wait for the slowest one piece by piece. The slowest rank's total CPU time alone
// misses the pieces where another rank was the slower (EP's expert work, uneven from layer to layer).
// Waits on the async forms (a switch's or a fetch's transfers posted behind compute) are not marked.
#pragma once

#include "paradyse/comm/threads.hpp"
#include "paradyse/core/timer.hpp"

#include <cstdint>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

namespace paradyse {

class CpuMarkedCommunicator : public ThreadCommunicator {
  template <class T>
  using In = std::type_identity_t<std::span<const T>>;

public:
  explicit CpuMarkedCommunicator(ThreadCommunicator&& c) : ThreadCommunicator(std::move(c)) {}
  // A split group's communicator marks its own collectives.
  CpuMarkedCommunicator split(int color, int key) { return CpuMarkedCommunicator(ThreadCommunicator::split(color, key)); }

  // The marks since the last call (thread CPU seconds, in the order the collectives returned), handed over.
  std::vector<double> take_marks() { return std::exchange(marks_, {}); }
  // This communicator without the marks (for collectives that are not the measured program's, e.g. the clock's own).
  ThreadCommunicator& unmarked() { return *this; }

  // The blocking collectives: ThreadCommunicator's, then a mark.
  template <CommElement T> void all_gather(In<T> in, std::span<T> out) { ThreadCommunicator::all_gather(in, out), mark(); }
  template <CommElement T> void all_gather_v(In<T> in, std::span<T> out, std::span<const std::int64_t> counts) {
    ThreadCommunicator::all_gather_v(in, out, counts), mark();
  }
  template <CommElement T> void reduce_scatter(In<T> in, std::span<T> out, ReduceOp op) {
    ThreadCommunicator::reduce_scatter(in, out, op), mark();
  }
  template <CommElement T>
  void reduce_scatter_v(In<T> in, std::span<T> out, std::span<const std::int64_t> counts, ReduceOp op) {
    ThreadCommunicator::reduce_scatter_v(in, out, counts, op), mark();
  }
  template <CommElement T> void all_reduce(In<T> in, std::span<T> out, ReduceOp op) {
    ThreadCommunicator::all_reduce(in, out, op), mark();
  }
  template <CommElement T> void all_to_all(In<T> in, std::span<T> out) { ThreadCommunicator::all_to_all(in, out), mark(); }
  template <CommElement T>
  void all_to_all_v(In<T> in, std::span<const std::int64_t> send_counts, std::span<T> out,
                    std::span<const std::int64_t> recv_counts) {
    ThreadCommunicator::all_to_all_v(in, send_counts, out, recv_counts), mark();
  }
  template <CommElement T> void broadcast(std::span<T> buffer, int root) { ThreadCommunicator::broadcast(buffer, root), mark(); }
  template <CommElement T> void reduce(In<T> in, std::span<T> out, ReduceOp op, int root) {
    ThreadCommunicator::reduce(in, out, op, root), mark();
  }
  void barrier() { ThreadCommunicator::barrier(), mark(); }

private:
  void mark() { marks_.push_back(thread_cpu_seconds()); }
  std::vector<double> marks_;
};

}  // namespace paradyse
