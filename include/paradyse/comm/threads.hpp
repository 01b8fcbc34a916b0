// paradyse/comm/threads.hpp: the threads backend. Ranks are threads of one process.
//
//   run_ranks(4, [](ThreadCommunicator& comm) { ... comm.all_reduce(x, x, ReduceOp::sum); ... });
//
// Header-only and deterministic: a reduction adds the ranks' contributions in rank order, element by element, so
// results are bitwise identical from run to run. Each rank has its own MemoryTracker (optionally capped), so the
// peak memory of every rank is measured exactly.
//
// How an operation runs. Every rank posts a description of its buffers into the group's slot for that operation
// (the n-th collective of each rank meets the n-th collective of the others). Waiting ranks then execute the
// operation's parts straight between the posted buffers (one copy per byte, no staging), each claiming parts no
// one has claimed, its own first (comm/threads_detail.hpp); a wait returns when every part is done, so every send
// buffer has been read and every receive buffer written. Ranks may wait on pending operations in any order.
// Point-to-point: a send and a receive are matched in posting order per (source, dest, tag), and whichever side
// waits first copies; a blocking send() therefore returns once its receive has been posted and copied.
//
// Collectives out of step. Each rank numbers the collectives it posts on a group (#0, #1, ...) and the numbers
// meet. A rank that skips one of a sequence of identical collectives therefore meets the others' next one, which
// nothing can tell apart from the one it skipped; what can be seen is that it runs out of collectives first: it
// leaves the group (its rank function returns, or a split communicator is destroyed) while the others wait for a
// collective it never posted. Then every waiting rank fails at once, without waiting for the timeout, with a
// CommError naming the group, its own collective's number and how many the rank that left had posted ("out of
// step"), and the rank that left ends its run with the same kind of error (run_ranks throws even though its
// function returned); the data of the collectives matched since the skip must be considered wrong. A rank that
// calls a different collective than the others (a barrier where they all_reduce) is reported at that collective.
//
// Bytes counted by stats() follow the bandwidth-optimal (ring) algorithms, the convention of nccl-tests' bus
// bandwidth: all_gather, reduce_scatter, all_to_all: (p-1)/p of the whole buffer; all_reduce: 2(p-1)/p of it;
// broadcast, reduce and send: the whole buffer once; received bytes likewise.
//
// The parts: threads_world.hpp (ThreadWorld, RunOptions: what the ranks of a run share), threads_member.hpp (the
// rendezvous every operation goes through: ThreadCommunicator's base), threads_detail.hpp (slots, parts, reductions,
// pacing). This header: the communicator's operations, which describe their buffers, and run_ranks.
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/comm/threads_detail.hpp"
#include "paradyse/comm/threads_member.hpp"
#include "paradyse/comm/threads_world.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/core/memory.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

namespace paradyse {

// One rank's handle on a group of thread ranks. Move-only: operations are matched by per-rank sequence numbers, and
// a pending Request refers to its communicator, which must outlive it.
class ThreadCommunicator : public BlockingCollectives<ThreadCommunicator>, public threads_detail::GroupMember {
  // An input span whose element type is deduced from the output span, so that a mutable span converts.
  template <class T>
  using In = std::type_identity_t<std::span<const T>>;

public:
  ThreadCommunicator(std::shared_ptr<ThreadWorld> world, std::shared_ptr<threads_detail::Group> group, int rank)
      : GroupMember(std::move(world), std::move(group), rank) {}

  // ---- collectives -------------------------------------------------------------------------------------------
  // out: [size * in.size()]; in may be this rank's chunk of out (in place).
  template <CommElement T>
  Request all_gather_async(In<T> in, std::span<T> out) {
    check(out.size() == in.size() * std::size_t(size()),
          "all_gather: output holds {} elements, expected {} ({} ranks x {} per rank)", out.size(),
          in.size() * std::size_t(size()), size(), in.size());
    auto post = make_post<T>(threads_detail::OpKind::all_gather, in, out);
    count_bytes((size() - 1) * in.size_bytes(), (size() - 1) * in.size_bytes());
    return start(std::move(post));
  }
  // out: [sum(counts)], counts[r] elements from rank r; in.size() must equal counts[rank()].
  template <CommElement T>
  Request all_gather_v_async(In<T> in, std::span<T> out, std::span<const std::int64_t> counts) {
    comm_detail::check_counts("all_gather_v", counts, size());
    check(in.size() == std::size_t(counts[rank_]), "all_gather_v: rank {} sends {} elements but counts[{}] = {}",
          rank_, in.size(), rank_, counts[rank_]);
    check(out.size() == comm_detail::total(counts), "all_gather_v: output holds {} elements, expected sum(counts) = {}",
          out.size(), comm_detail::total(counts));
    auto post = make_post<T>(threads_detail::OpKind::all_gather_v, in, out);
    post.recv_counts.assign(counts.begin(), counts.end());
    count_bytes((size() - 1) * in.size_bytes(), (out.size() - in.size()) * sizeof(T));
    return start(std::move(post));
  }
  // in: [size * out.size()]; rank r receives the reduction of chunk r.
  template <CommElement T>
  Request reduce_scatter_async(In<T> in, std::span<T> out, ReduceOp op) {
    static_assert(!std::is_same_v<T, std::byte>, "raw bytes cannot be reduced");
    check(in.size() == out.size() * std::size_t(size()),
          "reduce_scatter: input holds {} elements, expected {} ({} ranks x {} per rank)", in.size(),
          out.size() * std::size_t(size()), size(), out.size());
    auto post = make_post<T>(threads_detail::OpKind::reduce_scatter, in, out, op);
    count_bytes((size() - 1) * out.size_bytes(), (size() - 1) * out.size_bytes());
    return start(std::move(post));
  }
  // in: [sum(counts)]; rank r receives the reduction of its counts[r] elements.
  template <CommElement T>
  Request reduce_scatter_v_async(In<T> in, std::span<T> out, std::span<const std::int64_t> counts,
                                 ReduceOp op) {
    static_assert(!std::is_same_v<T, std::byte>, "raw bytes cannot be reduced");
    comm_detail::check_counts("reduce_scatter_v", counts, size());
    check(in.size() == comm_detail::total(counts),
          "reduce_scatter_v: input holds {} elements, expected sum(counts) = {}",
          in.size(), comm_detail::total(counts));
    check(out.size() == std::size_t(counts[rank_]), "reduce_scatter_v: rank {} receives into {} elements but counts[{}] = {}",
          rank_, out.size(), rank_, counts[rank_]);
    auto post = make_post<T>(threads_detail::OpKind::reduce_scatter_v, in, out, op);
    post.send_counts.assign(counts.begin(), counts.end());
    count_bytes((in.size() - out.size()) * sizeof(T), (size() - 1) * out.size_bytes());
    return start(std::move(post));
  }
  template <CommElement T>
  Request all_reduce_async(In<T> in, std::span<T> out, ReduceOp op) {
    static_assert(!std::is_same_v<T, std::byte>, "raw bytes cannot be reduced");
    check(in.size() == out.size(), "all_reduce: input holds {} elements but output holds {}", in.size(), out.size());
    auto post = make_post<T>(threads_detail::OpKind::all_reduce, in, out, op);
    const std::size_t ring = 2 * (size() - 1) * in.size_bytes() / std::size_t(size());
    count_bytes(ring, ring);
    return start(std::move(post));
  }
  // Equal chunks: chunk j of in goes to rank j; chunk j of out comes from rank j.
  template <CommElement T>
  Request all_to_all_async(In<T> in, std::span<T> out) {
    check(in.size() == out.size() && in.size() % std::size_t(size()) == 0,
          "all_to_all: input ({}) and output ({}) must hold the same number of elements, divisible by {} ranks",
          in.size(), out.size(), size());
    auto post = make_post<T>(threads_detail::OpKind::all_to_all, in, out);
    const std::size_t moved = (size() - 1) * in.size_bytes() / std::size_t(size());
    count_bytes(moved, moved);
    return start(stage_if_aliased(std::move(post)));
  }
  // send_counts[j] elements to rank j (in rank order in `in`), recv_counts[j] from rank j.
  template <CommElement T>
  Request all_to_all_v_async(In<T> in, std::span<const std::int64_t> send_counts, std::span<T> out,
                             std::span<const std::int64_t> recv_counts) {
    comm_detail::check_counts("all_to_all_v (send counts)", send_counts, size());
    comm_detail::check_counts("all_to_all_v (receive counts)", recv_counts, size());
    check(in.size() == comm_detail::total(send_counts),
          "all_to_all_v: input holds {} elements, expected sum(send_counts) = {}",
          in.size(), comm_detail::total(send_counts));
    check(out.size() == comm_detail::total(recv_counts),
          "all_to_all_v: output holds {} elements, expected sum(recv_counts) = {}",
          out.size(), comm_detail::total(recv_counts));
    auto post = make_post<T>(threads_detail::OpKind::all_to_all_v, in, out);
    post.send_counts.assign(send_counts.begin(), send_counts.end());
    post.recv_counts.assign(recv_counts.begin(), recv_counts.end());
    count_bytes((in.size() - std::size_t(send_counts[rank_])) * sizeof(T),
                (out.size() - std::size_t(recv_counts[rank_])) * sizeof(T));
    return start(stage_if_aliased(std::move(post)));
  }
  template <CommElement T>
  Request broadcast_async(std::span<T> buffer, int root) {
    check_peer("broadcast", root);
    auto post = make_post<T>(threads_detail::OpKind::broadcast, std::span<const T>(buffer), buffer);
    post.root = root;
    if (size() > 1) count_bytes(rank_ == root ? buffer.size_bytes() : 0, rank_ == root ? 0 : buffer.size_bytes());
    return start(std::move(post));
  }
  // The reduction lands in `out` on the root; other ranks may pass an empty `out`.
  template <CommElement T>
  Request reduce_async(In<T> in, std::span<T> out, ReduceOp op, int root) {
    static_assert(!std::is_same_v<T, std::byte>, "raw bytes cannot be reduced");
    check_peer("reduce", root);
    check(rank_ != root || out.size() == in.size(), "reduce: the root's output holds {} elements, expected {}",
          out.size(), in.size());
    auto post = make_post<T>(threads_detail::OpKind::reduce, in, out, op);
    post.root = root;
    if (size() > 1) count_bytes(rank_ == root ? 0 : in.size_bytes(), rank_ == root ? in.size_bytes() : 0);
    return start(std::move(post));
  }

  // The blocking collectives and shift: BlockingCollectives (communicator.hpp), each the async form waited for.
  // Interconnect emulation (LinkPacing, threads_detail.hpp) of this communicator's group: from the next operation
  // on, for every rank of the group and the groups split from it later. Set it between operations (every rank
  // reaches the same setting before the next collective, e.g. on every rank with the same value).
  void set_link_pacing(LinkPacing pacing) {
    check(pacing.launch_s >= 0 && pacing.alpha_s >= 0 && pacing.collective_s_per_byte >= 0 && pacing.p2p_s_per_byte >= 0,
          "set_link_pacing: launch_s = {}, alpha_s = {}, collective_s_per_byte = {}, p2p_s_per_byte = {} must not be "
          "negative", pacing.launch_s, pacing.alpha_s, pacing.collective_s_per_byte, pacing.p2p_s_per_byte);
    std::lock_guard lock(world_->mutex());
    group_->pacing = pacing;
  }
  LinkPacing link_pacing() const {
    std::lock_guard lock(world_->mutex());
    return group_->pacing;
  }

  void barrier() {
    threads_detail::Post post;
    post.kind = threads_detail::OpKind::barrier;
    start(std::move(post)).wait();
  }

  // The ranks of one color form a new group, ordered by key and then by rank. Collective over this group.
  ThreadCommunicator split(int color, int key) {
    threads_detail::Post post;
    post.kind = threads_detail::OpKind::split;
    post.color = color;
    post.key = key;
    const std::uint64_t seq = post_collective(std::move(post));
    std::shared_ptr<threads_detail::Group> mine;
    complete_collective(seq, [&](threads_detail::Slot& slot) {  // runs with the lock held
      if (slot.split_groups.empty()) {  // the first rank through builds every color's group
        std::map<int, std::vector<std::pair<int, int>>> members;  // color -> (key, rank)
        for (int r = 0; r < size(); ++r) members[slot.posts[r]->color].push_back({slot.posts[r]->key, r});
        for (auto& [c, list] : members) {
          std::sort(list.begin(), list.end());
          auto group = std::make_shared<threads_detail::Group>();
          group->id = world_->next_group_id();
          group->pacing = group_->pacing;  // a split group keeps the emulated interconnect
          for (auto [k, r] : list) group->world_ranks.push_back(group_->world_ranks[std::size_t(r)]);
          slot.split_groups[c] = std::move(group);
        }
      }
      mine = slot.split_groups.at(color);
    });
    const int my_index = int(std::find(mine->world_ranks.begin(), mine->world_ranks.end(), world_rank()) -
                             mine->world_ranks.begin());
    return ThreadCommunicator(world_, std::move(mine), my_index);
  }

  // ---- point to point -------------------------------------------------------------------------------------------
  template <CommElement T>
  Request send_async(std::span<const T> in, int dest, int tag = 0) {
    check_peer("send", dest);
    count_bytes(in.size_bytes(), 0);
    return post_transfer(true, rank_, dest, tag, reinterpret_cast<const std::byte*>(in.data()), in.size_bytes(), nullptr, 0,
                         nullptr);
  }
  template <CommElement T>
  Request recv_async(std::span<T> out, int source, int tag = 0) {
    check_peer("recv", source);
    count_bytes(0, out.size_bytes());
    return post_transfer(false, source, rank_, tag, nullptr, 0, reinterpret_cast<std::byte*>(out.data()), out.size_bytes(),
                         nullptr);
  }
  // Sends `in` to rank + offset and receives `out` from rank - offset (mod size): one step of a ring.
  template <CommElement T>
  Request shift_async(In<T> in, std::span<T> out, int offset = 1) {
    const int n = size();
    const int dest = ((rank_ + offset) % n + n) % n, source = ((rank_ - offset) % n + n) % n;
    // In place, this rank may receive into `out` before the next rank has read `in` from it: send a staged copy.
    std::shared_ptr<threads_detail::Staging> staged;
    const std::byte* data = reinterpret_cast<const std::byte*>(in.data());
    if (!in.empty() && !out.empty() && in.data() < out.data() + out.size() && out.data() < in.data() + in.size()) {
      staged = std::make_shared<threads_detail::Staging>(in.size_bytes());
      world_->movement().copy(staged->data, reinterpret_cast<const std::byte*>(in.data()), in.size_bytes());
      data = staged->data;
    }
    count_bytes(in.size_bytes(), 0);  // a send and a receive, as MPI's Sendrecv
    count_bytes(0, out.size_bytes());
    auto sent = std::make_shared<Request>(post_transfer(true, rank_, dest, kShiftTag, data, in.size_bytes(), nullptr, 0,
                                                        std::move(staged)));
    auto received = std::make_shared<Request>(post_transfer(false, source, rank_, kShiftTag, nullptr, 0,
                                                            reinterpret_cast<std::byte*>(out.data()), out.size_bytes(),
                                                            nullptr));
    return Request([sent, received] {
      received->wait();
      sent->wait();
    });
  }
  template <CommElement T> void send(std::span<const T> in, int dest, int tag = 0) { send_async(in, dest, tag).wait(); }
  template <CommElement T> void recv(std::span<T> out, int source, int tag = 0) { recv_async(out, source, tag).wait(); }
  // Sending from a mutable span.
  template <CommElement T> Request send_async(std::span<T> in, int dest, int tag = 0) {
    return send_async(std::span<const T>(in), dest, tag);
  }
  template <CommElement T> void send(std::span<T> in, int dest, int tag = 0) { send(std::span<const T>(in), dest, tag); }

private:
  static constexpr int kShiftTag = -1;  // user tags are >= 0

  template <class T>
  static threads_detail::Post make_post(threads_detail::OpKind kind, std::span<const T> in, std::span<T> out,
                                        ReduceOp op = ReduceOp::sum) {
    threads_detail::Post post;
    post.kind = kind;
    post.dtype = dtype_of<T>();
    post.op = op;
    post.send = reinterpret_cast<const std::byte*>(in.data());
    post.send_count = in.size();
    post.recv = reinterpret_cast<std::byte*>(out.data());
    post.recv_count = out.size();
    if constexpr (!std::is_same_v<T, std::byte>) post.reduce = &threads_detail::reduce_in_rank_order<T>;
    return post;
  }

  // An all-to-all whose output overlaps its input would overwrite data other ranks still read: stage the input.
  // Except an exactly in-place all_to_all (equal chunks): it runs as pairwise exchanges of chunks, each pair read
  // before it is written (threads_detail::exchange_chunks), with no copy of the whole input (64 MiB on 4 ranks:
  // 214 ms staged, the copy's page faults included).
  threads_detail::Post stage_if_aliased(threads_detail::Post post) const {
    const std::size_t bytes = post.send_count * size_of(post.dtype);
    const std::byte *s = post.send, *r = post.recv;
    if (post.kind == threads_detail::OpKind::all_to_all && s == r && post.send_count == post.recv_count) return post;
    if (bytes && s < r + post.recv_count * size_of(post.dtype) && r < s + bytes) {
      post.staged = std::make_shared<threads_detail::Staging>(bytes);
      world_->movement().copy(post.staged->data, post.send, bytes);  // complete once posted (before_post)
      post.send = post.staged->data;
    }
    return post;
  }

  void check_peer(const char* op, int peer) const {
    check(peer >= 0 && peer < size(), "{}: rank {} is not in {} (size {})", op, peer, group_->describe(), size());
  }
};

static_assert(Communicator<ThreadCommunicator>);

// What a run measured on each rank.
struct RunReport {
  std::vector<std::size_t> peak_bytes;  // the MemoryTracker peak of each rank
  std::vector<CommStats> stats;         // the world communicator's byte counts of each rank
};

namespace threads_detail {
// run_ranks with a communicator type built on ThreadCommunicator (constructible from (world, group, rank)) and a
// per-rank setup: `rank_context(r)` runs first on rank r's thread, its result lives until the thread ends (the CUDA
// ranks install their device and stream this way, comm/cuda_local.hpp).
template <class Comm, class Fn, class RankContext>
RunReport run_thread_ranks(int ranks, Fn& fn, RunOptions options, RankContext rank_context) {
  auto world = std::make_shared<ThreadWorld>(ranks, std::move(options));
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(ranks));
  RunReport report;
  report.peak_bytes.resize(std::size_t(ranks));
  report.stats.resize(std::size_t(ranks));
  {
    std::vector<std::jthread> threads;
    threads.reserve(std::size_t(ranks));
    for (int r = 0; r < ranks; ++r) {
      threads.emplace_back([&, r] {
        ScopedTracker scoped(world->tracker(r));
        try {
          [[maybe_unused]] auto context = rank_context(r);
          Comm comm(world, world->world_group(), r);
          fn(comm);
          report.stats[std::size_t(r)] = comm.stats();
          comm.finish();  // throws when the ranks' collectives went out of step
        } catch (const std::exception& e) {
          errors[std::size_t(r)] = std::current_exception();
          world->abort(r, e.what());
        } catch (...) {
          errors[std::size_t(r)] = std::current_exception();
          world->abort(r, "an exception not derived from std::exception");
        }
      });
    }
  }
  for (int r = 0; r < ranks; ++r) report.peak_bytes[std::size_t(r)] = world->tracker(r).peak();
  if (const int failed = world->failed_rank(); failed >= 0) {
    if (errors[std::size_t(failed)]) std::rethrow_exception(errors[std::size_t(failed)]);
    for (auto& e : errors)
      if (e) std::rethrow_exception(e);
  }
  return report;
}
}  // namespace threads_detail

// Runs fn(comm) on `ranks` thread ranks, each with its own MemoryTracker installed. If a rank throws, every other
// rank's communication fails promptly with a CommError naming it, and run_ranks rethrows the first failure.
// Tensors, pooled buffers and pools a rank makes may outlive the run: each keeps its tracker's counts alive
// (core/memory.hpp), so destroying them after run_ranks returns is safe.
template <class Fn>
RunReport run_ranks(int ranks, Fn&& fn, RunOptions options = {}) {
  return threads_detail::run_thread_ranks<ThreadCommunicator>(ranks, fn, std::move(options), [](int) { return 0; });
}

}  // namespace paradyse
