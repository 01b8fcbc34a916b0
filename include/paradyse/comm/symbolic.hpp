// paradyse/comm/symbolic.hpp: SymbolicCommunicator, one rank of a p-rank group that records its transfers and moves
// nothing.
//
// It models the Communicator concept for the dry run (core/trace.hpp): every operation appends a `post` event
// (what kind of transfer, how many bytes on the larger side) to the trace and, for the blocking forms, the matching
// `wait` at once; the async forms return a Request whose wait() appends the `wait`. The time model reads the overlap
// of a transfer with compute from the events between its post and its wait. Buffers are never read or written, so
// the spans may point at meta memory. Sizes are checked as the real backends check them on one rank.
//
// Sub-groups: split_by(rule) (comm/grid_groups.hpp's split_by calls it) gives the sub-group of symbolic ranks that
// rule(rank) = (color, key) gives this rank, its members found by applying the rule to every rank of the group (one
// symbolic rank cannot ask its peers, so the plain split(color, key) is refused). Its transfers record into the same
// trace with the sub-group's size and the span of its members (TraceEvent::group, span: a strided sub-group of 2
// ranks 0 and 2 spans 3), which the time model prices them at; members() names its ranks in the numbering of the
// group the dry run started with (sorted ascending for every split the strategies make: key = the rank's order). A split itself records nothing: a model splits its
// sub-groups once (comm/grid_groups.hpp's AnyGridGroups, held by the layer stack), not per call.
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/core/trace.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <span>
#include <utility>
#include <vector>

namespace paradyse {

class SymbolicCommunicator {
public:
  SymbolicCommunicator(int rank, int size, Trace& trace) : rank_(rank), size_(size), trace_(&trace) {
    check(size >= 1 && rank >= 0 && rank < size, "SymbolicCommunicator: rank {} of a group of {}", rank, size);
    for (int r = 0; r < size; ++r) members_.push_back(r);
  }

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  CommStats stats() const noexcept { return stats_; }

  template <CommElement T>
  void all_gather(std::span<const T> in, std::span<T> out) { complete(all_gather_async(in, out)); }
  template <CommElement T>
  void all_gather_v(std::span<const T> in, std::span<T> out, std::span<const std::int64_t> counts) {
    complete(all_gather_v_async(in, out, counts));
  }
  template <CommElement T>
  void reduce_scatter(std::span<const T> in, std::span<T> out, ReduceOp) { complete(reduce_scatter_async(in, out, ReduceOp::sum)); }
  template <CommElement T>
  void reduce_scatter_v(std::span<const T> in, std::span<T> out, std::span<const std::int64_t> counts, ReduceOp op) {
    complete(reduce_scatter_v_async(in, out, counts, op));
  }
  template <CommElement T>
  void all_reduce(std::span<const T> in, std::span<T> out, ReduceOp op) { complete(all_reduce_async(in, out, op)); }
  template <CommElement T>
  void all_to_all(std::span<const T> in, std::span<T> out) { complete(all_to_all_async(in, out)); }
  template <CommElement T>
  void all_to_all_v(std::span<const T> in, std::span<const std::int64_t> send_counts, std::span<T> out,
                    std::span<const std::int64_t> recv_counts) {
    check_counts("all_to_all_v send", send_counts, in.size());
    check_counts("all_to_all_v receive", recv_counts, out.size());
    complete(post(TransferKind::all_to_all, bytes(in), bytes(in)));
  }
  template <CommElement T>
  void broadcast(std::span<T> buffer, int root) { complete(broadcast_async(buffer, root)); }
  template <CommElement T>
  void reduce(std::span<const T> in, std::span<T> out, ReduceOp op, int root) { complete(reduce_async(in, out, op, root)); }
  template <CommElement T>
  void send(std::span<const T> in, int peer) { complete(send_async(in, peer)); }
  template <CommElement T>
  void recv(std::span<T> out, int peer) { complete(recv_async(out, peer)); }
  template <CommElement T>
  void shift(std::span<const T> in, std::span<T> out, int offset) { complete(shift_async(in, out, offset)); }
  void barrier() { complete(post(TransferKind::barrier, 0, 0)); }

  template <CommElement T>
  Request all_gather_async(std::span<const T> in, std::span<T> out) {
    check(out.size() == in.size() * std::size_t(size_), "all_gather: out has {} elements, expected {} x {}",
          out.size(), size_, in.size());
    return post(TransferKind::all_gather, bytes(out), bytes(out) - bytes(in));
  }
  template <CommElement T>
  Request reduce_scatter_async(std::span<const T> in, std::span<T> out, ReduceOp) {
    check(in.size() == out.size() * std::size_t(size_), "reduce_scatter: in has {} elements, expected {} x {}",
          in.size(), size_, out.size());
    return post(TransferKind::reduce_scatter, bytes(in), bytes(in) - bytes(out));
  }
  template <CommElement T>
  Request all_gather_v_async(std::span<const T> in, std::span<T> out, std::span<const std::int64_t> counts) {
    check_counts("all_gather_v", counts, out.size());
    return post(TransferKind::all_gather, bytes(out), bytes(out) - bytes(in));
  }
  template <CommElement T>
  Request reduce_scatter_v_async(std::span<const T> in, std::span<T> out, std::span<const std::int64_t> counts,
                                 ReduceOp) {
    check_counts("reduce_scatter_v", counts, in.size());
    return post(TransferKind::reduce_scatter, bytes(in), bytes(in) - bytes(out));
  }
  template <CommElement T>
  Request all_reduce_async(std::span<const T> in, std::span<T> out, ReduceOp) {
    check(in.size() == out.size(), "all_reduce: in has {} elements, out {}", in.size(), out.size());
    return post(TransferKind::all_reduce, bytes(in), bytes(in));
  }
  template <CommElement T>
  Request all_to_all_async(std::span<const T> in, std::span<T> out) {
    check(in.size() == out.size() && in.size() % std::size_t(size_) == 0,
          "all_to_all: in has {} and out {} elements; both must be equal multiples of {}", in.size(), out.size(), size_);
    return post(TransferKind::all_to_all, bytes(in), bytes(in));
  }
  template <CommElement T>
  Request broadcast_async(std::span<T> buffer, int root) {
    check_peer("broadcast", root);
    return post(TransferKind::broadcast, bytes(buffer), rank_ == root ? bytes(buffer) : 0);
  }
  template <CommElement T>
  Request reduce_async(std::span<const T> in, std::span<T>, ReduceOp, int root) {
    check_peer("reduce", root);
    return post(TransferKind::reduce, bytes(in), bytes(in));
  }
  template <CommElement T>
  Request send_async(std::span<const T> in, int peer) {
    check_peer("send", peer);
    return post(TransferKind::send_recv, bytes(in), bytes(in));
  }
  template <CommElement T>
  Request recv_async(std::span<T> out, int peer) {
    check_peer("recv", peer);
    return post(TransferKind::send_recv, bytes(out), 0);
  }
  template <CommElement T>
  Request shift_async(std::span<const T> in, std::span<T> out, int) {
    return post(TransferKind::send_recv, double(std::max(in.size_bytes(), out.size_bytes())), bytes(in));
  }

  // The ranks of the group in the numbering of the group the dry run started with (0 .. size - 1 there).
  const std::vector<int>& members() const noexcept { return members_; }

  // The sub-group that rule(rank) = (color, key) gives this rank: the ranks of its color, ordered by key then rank.
  template <class Rule>
  SymbolicCommunicator split_by(Rule rule) const {
    const auto [color, key] = rule(rank_);
    std::vector<std::pair<int, int>> chosen;  // (key, rank) of each rank of this color
    for (int r = 0; r < size_; ++r)
      if (const auto [c, k] = rule(r); c == color) chosen.push_back({k, r});
    std::sort(chosen.begin(), chosen.end());
    SymbolicCommunicator sub(*this);
    sub.members_.clear();
    for (std::size_t i = 0; i < chosen.size(); ++i) {
      if (chosen[i].second == rank_) sub.rank_ = int(i);
      sub.members_.push_back(members_[std::size_t(chosen[i].second)]);
    }
    sub.size_ = int(chosen.size());
    sub.stats_ = {};
    return sub;
  }
  // One symbolic rank cannot learn its peers' colors: split through split_by (comm/grid_groups.hpp).
  SymbolicCommunicator split(int color, int key) const {
    throw Error(fmt::format("SymbolicCommunicator: split(color = {}, key = {}) needs every rank's color; a dry run "
                            "splits with split_by(comm, rule) (comm/grid_groups.hpp), the rule applied to every rank",
                            color, key));
  }

private:
  template <class T>
  static double bytes(std::span<T> x) { return double(x.size_bytes()); }

  Request post(TransferKind kind, double bytes, double sent) {
    const std::int32_t id = trace_->new_request();
    trace_->record({.kind = TraceKind::post, .transfer = kind, .request = id, .group = size_,
                    .span = members_.back() - members_.front() + 1, .bytes = bytes});
    stats_.bytes_sent += std::uint64_t(sent);
    ++stats_.operations;
    return Request(&record_wait, trace_, id);
  }
  // A Request's completion: the `wait` event of request `id` (no type-erased callable per transfer).
  static void record_wait(void* trace, std::int64_t id) {
    static_cast<Trace*>(trace)->record({.kind = TraceKind::wait, .request = std::int32_t(id)});
  }
  static void complete(Request request) { request.wait(); }

  void check_counts(const char* op, std::span<const std::int64_t> counts, std::size_t total) const {
    check(counts.size() == std::size_t(size_), "{}: {} counts for a group of {}", op, counts.size(), size_);
    const std::int64_t sum = std::accumulate(counts.begin(), counts.end(), std::int64_t(0));
    check(std::size_t(sum) == total, "{}: counts sum to {}, the buffer has {} elements", op, sum, total);
  }
  void check_peer(const char* op, int peer) const {
    check(peer >= 0 && peer < size_, "{}: rank {} is outside a group of {}", op, peer, size_);
  }

  int rank_;
  int size_;
  Trace* trace_;
  CommStats stats_;
  std::vector<int> members_;
};

static_assert(Communicator<SymbolicCommunicator>);

}  // namespace paradyse
