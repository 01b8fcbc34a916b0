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
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/comm/threads_detail.hpp"
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

// Options for run_ranks.
struct RunOptions {
  std::size_t memory_cap_per_rank = MemoryTracker::kNoCap;
  std::chrono::milliseconds timeout = comm_timeout();
  LinkPacing pacing;  // interconnect emulation of the world group (threads_detail.hpp); off by default
  // How bytes move between the ranks' buffers; null: host memcpy and host reductions (this backend). The CUDA
  // ranks on one GPU (comm/cuda_local.hpp) move them with device copies on each rank's stream.
  std::shared_ptr<const threads_detail::DataMovement> movement;
  // Makes rank r's tracker from the cap; null: a host tracker (MemoryTracker(memory_cap_per_rank)).
  std::function<std::unique_ptr<MemoryTracker>(int rank, std::size_t cap)> make_tracker;
};

// The state shared by the thread ranks of one run: the lock every rendezvous uses, the failure flag, the trackers.
class ThreadWorld {
public:
  ThreadWorld(int size, RunOptions options) : size_(size), options_(options) {
    check(size >= 1, "a thread world needs at least one rank, got {}", size);
    for (int r = 0; r < size; ++r)
      trackers_.push_back(options.make_tracker ? options.make_tracker(r, options.memory_cap_per_rank)
                                               : std::make_unique<MemoryTracker>(options.memory_cap_per_rank));
    if (!options_.movement)
      options_.movement = std::shared_ptr<const threads_detail::DataMovement>(
          std::shared_ptr<const threads_detail::DataMovement>(), &threads_detail::host_data_movement());
    auto world = std::make_shared<threads_detail::Group>();
    for (int r = 0; r < size; ++r) world->world_ranks.push_back(r);
    world->pacing = options.pacing;
    world_group_ = std::move(world);
  }

  int size() const noexcept { return size_; }
  MemoryTracker& tracker(int rank) { return *trackers_.at(std::size_t(rank)); }
  const std::shared_ptr<threads_detail::Group>& world_group() const { return world_group_; }
  std::chrono::milliseconds timeout() const noexcept { return options_.timeout; }
  const threads_detail::DataMovement& movement() const noexcept { return *options_.movement; }
  int next_group_id() { return ++group_count_; }

  // Marks the run failed because of `rank`; every rank waiting or about to wait throws CommError.
  void abort(int rank, std::string reason) {
    {
      std::lock_guard lock(mutex_);
      if (failed_rank_ >= 0) return;
      failed_rank_ = rank;
      failure_ = std::move(reason);
    }
    changed_.notify_all();
  }
  int failed_rank() const {
    std::lock_guard lock(mutex_);
    return failed_rank_;
  }
  // Whether the run failed; call with mutex() held.
  bool failed() const noexcept { return failed_rank_ >= 0; }

  std::mutex& mutex() noexcept { return mutex_; }
  void notify() { changed_.notify_all(); }

  // Waits (holding `lock` on mutex()) until ready(); throws CommError when another rank failed or after the timeout.
  // `missing()` names the ranks being waited for; `what` the operation.
  template <class Ready, class Missing>
  void wait(std::unique_lock<std::mutex>& lock, int my_rank, Ready ready, Missing missing, const std::string& what) {
    const auto deadline = std::chrono::steady_clock::now() + options_.timeout;
    while (!ready()) {
      if (failed_rank_ >= 0)
        throw CommError(fmt::format("rank {} gave up on {}: rank {} failed: {}", my_rank, what, failed_rank_, failure_));
      if (changed_.wait_until(lock, deadline) == std::cv_status::timeout && !ready() && failed_rank_ < 0) {
        std::string message = fmt::format("timeout after {:.1f} s in {}: ranks {} never arrived",
                                          std::chrono::duration<double>(options_.timeout).count(), what, missing());
        failed_rank_ = my_rank;
        failure_ = message;
        changed_.notify_all();
        throw CommError(fmt::format("rank {}: {}", my_rank, message));
      }
    }
  }
  // Waits for a copy in progress to end: a memcpy by a running thread, so no timeout and no failure check.
  template <class Ready>
  void wait_for_copy(std::unique_lock<std::mutex>& lock, Ready ready) {
    changed_.wait(lock, ready);
  }

private:
  int size_;
  RunOptions options_;
  std::vector<std::unique_ptr<MemoryTracker>> trackers_;
  std::shared_ptr<threads_detail::Group> world_group_;
  std::atomic<int> group_count_{0};
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  int failed_rank_ = -1;
  std::string failure_;
};

// One rank's handle on a group of thread ranks. Move-only: operations are matched by per-rank sequence numbers, and
// a pending Request refers to its communicator, which must outlive it.
class ThreadCommunicator : public BlockingCollectives<ThreadCommunicator> {
  // An input span whose element type is deduced from the output span, so that a mutable span converts.
  template <class T>
  using In = std::type_identity_t<std::span<const T>>;

public:
  ThreadCommunicator(std::shared_ptr<ThreadWorld> world, std::shared_ptr<threads_detail::Group> group, int rank)
      : world_(std::move(world)), group_(std::move(group)), rank_(rank) {}
  ThreadCommunicator(ThreadCommunicator&&) noexcept = default;  // leaves the source without a group
  ThreadCommunicator& operator=(ThreadCommunicator&& other) noexcept {
    if (this != &other) {
      leave();
      world_ = std::move(other.world_);
      group_ = std::move(other.group_);
      rank_ = other.rank_;
      next_seq_ = other.next_seq_;
      stats_ = other.stats_;
    }
    return *this;
  }
  ThreadCommunicator(const ThreadCommunicator&) = delete;
  ThreadCommunicator& operator=(const ThreadCommunicator&) = delete;
  // Leaves the group: other ranks waiting for a collective this rank never posted fail as out of step. Not when the
  // destructor runs because of an exception: the failure of the run reports that.
  ~ThreadCommunicator() { leave(); }

  // Leaves the group, then waits until every other member has left too; throws CommError when one has posted more
  // collectives on it than this rank (this rank skipped one, or they called one more). run_ranks calls it when the
  // rank function returns.
  void finish() {
    if (!group_) return;
    leave();
    std::unique_lock lock(world_->mutex());
    const int n = size();
    const auto ahead = [&]() -> int {
      for (int r = 0; r < n; ++r)
        if (group_->posted[std::size_t(r)] > next_seq_) return r;
      return -1;
    };
    world_->wait_for_copy(lock, [&] {
      if (world_->failed() || ahead() >= 0) return true;
      for (int r = 0; r < n; ++r)
        if (!group_->left[std::size_t(r)]) return false;
      return true;
    });
    if (const int r = ahead(); r >= 0)
      throw CommError(fmt::format(
          "rank {}: collectives out of step on {}: this rank finished after posting {}, but rank {} (world rank {}) "
          "posted {}: a rank skipped a collective (or called one more), so the collectives matched by number since "
          "then paired different calls",
          world_rank(), group_->describe(), group_->posted_by(rank_), r, group_->world_ranks[std::size_t(r)],
          group_->posted_by(r)));
  }

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return group_->size(); }
  int world_rank() const { return group_->world_ranks[std::size_t(rank_)]; }
  CommStats stats() const noexcept { return stats_; }
  void reset_stats() noexcept { stats_ = {}; }
  std::string describe() const { return group_->describe(); }

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
  void count_bytes(std::size_t sent, std::size_t received) {
    stats_.bytes_sent += sent;
    stats_.bytes_received += received;
    ++stats_.operations;
    op_bytes_ = std::max(op_bytes_, std::max(sent, received));
  }
  // The emulated duration of the operation being posted (0 without pacing), from the bytes count_bytes saw for it.
  double paced_seconds(bool point_to_point, threads_detail::OpKind kind = threads_detail::OpKind::barrier) {
    const std::size_t bytes = std::exchange(op_bytes_, 0);
    LinkPacing pacing;
    {
      std::lock_guard lock(world_->mutex());
      pacing = group_->pacing;
    }
    if (!pacing.enabled()) return 0;
    const int p = size();
    if (point_to_point) return pacing.launch_s + pacing.alpha_s + double(bytes) * pacing.p2p_s_per_byte;
    if (p <= 1) return 0;
    const int steps = kind == threads_detail::OpKind::all_reduce ? 2 * (p - 1) : p - 1;
    return pacing.launch_s + pacing.alpha_s * steps + double(bytes) * pacing.collective_s_per_byte;
  }
  static void sleep_until_paced(threads_detail::PacingClock::time_point start, double seconds) {
    if (seconds <= 0) return;
    std::this_thread::sleep_until(start + std::chrono::duration_cast<threads_detail::PacingClock::duration>(
                                              std::chrono::duration<double>(seconds)));
  }

  // ---- collectives: post, then complete ------------------------------------------------------------------------
  Request start(threads_detail::Post post) {
    const double paced = paced_seconds(false, post.kind);
    const std::uint64_t seq = post_collective(std::move(post));
    if (paced <= 0) return Request([this, seq] { complete_collective(seq, [](threads_detail::Slot&) {}); });
    return Request([this, seq, paced] {
      threads_detail::PacingClock::time_point ready;
      complete_collective(seq, [&](threads_detail::Slot& slot) { ready = slot.ready; });
      sleep_until_paced(ready, paced);
    });
  }

  std::uint64_t post_collective(threads_detail::Post post) {
    world_->movement().before_post();
    const std::uint64_t seq = next_seq_++;
    {
      std::lock_guard lock(world_->mutex());
      group_->track_members();
      group_->posted[std::size_t(rank_)] = seq + 1;
      group_->last_kind[std::size_t(rank_)] = post.kind;
      auto& slot = group_->slots[seq];
      if (slot.posts.empty()) slot.posts.resize(std::size_t(size()));
      slot.posts[std::size_t(rank_)] = std::move(post);
      if (++slot.posted == size()) slot.ready = threads_detail::PacingClock::now();
    }
    world_->notify();
    return seq;
  }

  std::string describe_op(const threads_detail::Slot& slot, std::uint64_t seq) const {
    return fmt::format("{} (operation #{}) on {}", threads_detail::name_of(slot.posts[std::size_t(rank_)]->kind), seq,
                       group_->describe());
  }
  // Marks this rank as gone from the group (see finish()); nothing during an exception or for a moved-from handle.
  void leave() noexcept {
    if (!group_ || !world_ || std::uncaught_exceptions() > 0) return;
    {
      std::lock_guard lock(world_->mutex());
      group_->track_members();
      group_->left[std::size_t(rank_)] = true;
    }
    world_->notify();
  }

  // Why collective `seq` can never complete: ranks that have not posted it have left the group; empty otherwise.
  std::string out_of_step(const threads_detail::Slot& slot, std::uint64_t seq) const {
    std::string gone;
    for (int r = 0; r < size(); ++r)
      if (!slot.posts[std::size_t(r)] && group_->left[std::size_t(r)])
        gone += fmt::format("{}rank {} (world rank {}) left the group after posting {}", gone.empty() ? "" : "; ", r,
                            group_->world_ranks[std::size_t(r)], group_->posted_by(r));
    if (gone.empty()) return {};
    return fmt::format(
        "rank {}: collectives out of step on {}: this rank is in {} #{}, but {}: a rank skipped a collective (or "
        "the others called one more), so the collectives matched by number since then paired different calls",
        world_rank(), group_->describe(), threads_detail::name_of(slot.posts[std::size_t(rank_)]->kind), seq, gone);
  }

  // The world ranks that have not posted the operation yet.
  std::string missing(const threads_detail::Slot& slot) const {
    std::vector<int> absent;
    for (int r = 0; r < size(); ++r)
      if (!slot.posts[std::size_t(r)]) absent.push_back(group_->world_ranks[std::size_t(r)]);
    return absent.empty() ? std::string("(none: all posted, parts still running)") : fmt::format("{}", fmt::join(absent, ", "));
  }

  // Waits for every rank's post, then executes unclaimed parts (this rank's first) until the operation is done.
  // `on_done` runs once it is, with the lock held. Throws the validation error, or CommError when a rank failed; in
  // that case it first waits for parts in progress, which may be reading or writing this rank's buffers.
  template <class OnDone>
  void complete_collective(std::uint64_t seq, OnDone on_done) {
    std::unique_lock lock(world_->mutex());
    threads_detail::Slot& slot = group_->slots.at(seq);
    const std::string what = describe_op(slot, seq);
    const int n = size();
    try {
      std::string out_of_step_error;
      world_->wait(lock, world_rank(), [&] {
        if (slot.posted == n) return true;
        out_of_step_error = out_of_step(slot, seq);
        return !out_of_step_error.empty();
      }, [&] { return missing(slot); }, what);
      if (slot.posted != n) throw CommError(out_of_step_error);
      if (!slot.validated) {
        slot.invalid = threads_detail::validate(slot, *group_, seq);
        slot.phases = threads_detail::phases_of(slot.posts[0]->kind);
        slot.claimed.assign(std::size_t(n), false);
        slot.validated = true;
      }
      while (!slot.complete()) {
        const int part = next_unclaimed_part(slot);
        if (part < 0) {  // every part of this phase is being executed by someone: wait for them
          const int phase = slot.phase;
          world_->wait(lock, world_rank(), [&] { return slot.phase != phase; }, [&] { return missing(slot); }, what);
          continue;
        }
        if (world_->failed()) break;  // let world_->wait below report it
        slot.claimed[std::size_t(part)] = true;
        ++slot.claimed_count;
        const int phase = slot.phase;
        lock.unlock();
        try {
          threads_detail::execute_part(slot, n, phase, part, world_->movement());
        } catch (const std::exception& e) {  // a device copy failed: fail the run, let no one wait for this part
          world_->abort(world_rank(), fmt::format("{} failed on rank {}: {}", what, world_rank(), e.what()));
          lock.lock();
          ++slot.done_count;
          world_->notify();
          throw;
        }
        lock.lock();
        if (++slot.done_count == n) {
          ++slot.phase;
          slot.claimed.assign(std::size_t(n), false);
          slot.claimed_count = slot.done_count = 0;
        }
        world_->notify();
      }
      world_->wait(lock, world_rank(), [&] { return slot.complete(); }, [&] { return missing(slot); }, what);
    } catch (const CommError&) {
      world_->wait_for_copy(lock, [&] { return !slot.in_progress(); });
      throw;
    }
    if (slot.invalid.empty()) on_done(slot);
    const std::string invalid = slot.invalid;
    if (++slot.left == n) group_->slots.erase(seq);
    lock.unlock();
    if (!invalid.empty()) throw Error(invalid);
  }

  // This rank's own part when unclaimed, else the next unclaimed one after it; -1 when all are claimed.
  int next_unclaimed_part(const threads_detail::Slot& slot) const {
    const int n = size();
    for (int i = 0; i < n; ++i) {
      const int part = (rank_ + i) % n;
      if (!slot.claimed[std::size_t(part)]) return part;
    }
    return -1;
  }

  // ---- point to point: match a send with a receive, then whichever side waits first copies ----------------------
  // The send side (sending) or the receive side of the transfer source -> dest with `tag`.
  Request post_transfer(bool sending, int source, int dest, int tag, const std::byte* send, std::size_t send_bytes,
                        std::byte* recv, std::size_t recv_bytes, std::shared_ptr<threads_detail::Staging> staged) {
    world_->movement().before_post();
    std::shared_ptr<threads_detail::Transfer> transfer;
    {
      std::lock_guard lock(world_->mutex());
      auto& mine = sending ? group_->unmatched_sends[{source, dest, tag}] : group_->unmatched_recvs[{source, dest, tag}];
      auto& theirs = sending ? group_->unmatched_recvs[{source, dest, tag}] : group_->unmatched_sends[{source, dest, tag}];
      if (!theirs.empty()) {
        transfer = theirs.front();
        theirs.pop_front();
        transfer->matched_at = threads_detail::PacingClock::now();
      } else {
        transfer = std::make_shared<threads_detail::Transfer>();
        mine.push_back(transfer);
      }
      if (sending) {
        transfer->source = send;
        transfer->source_bytes = send_bytes;
        transfer->has_send = true;
        transfer->staged = std::move(staged);
      } else {
        transfer->dest = recv;
        transfer->dest_bytes = recv_bytes;
        transfer->has_recv = true;
      }
    }
    world_->notify();
    const int peer = sending ? dest : source;
    const double paced = paced_seconds(true);
    return Request([this, transfer, sending, source, dest, tag, peer, paced] {
      using State = threads_detail::Transfer::State;
      std::unique_lock lock(world_->mutex());
      const std::string what = fmt::format("{} rank {} (tag {}) on {}", sending ? "send to" : "recv from", peer, tag,
                                           group_->describe());
      try {
        world_->wait(lock, world_rank(), [&] { return transfer->matched() || transfer->state == State::done; },
                     [&] { return fmt::format("{}", group_->world_ranks[std::size_t(peer)]); }, what);
      } catch (const CommError&) {
        if (!transfer->matched()) {  // withdraw: nobody may copy from or into this rank's buffer any more
          auto& queue = sending ? group_->unmatched_sends[{source, dest, tag}] : group_->unmatched_recvs[{source, dest, tag}];
          queue.erase(std::find(queue.begin(), queue.end(), transfer));
        }
        world_->wait_for_copy(lock, [&] { return transfer->state != State::copying; });
        throw;
      }
      if (transfer->state == State::waiting) {
        if (transfer->source_bytes != transfer->dest_bytes) {
          transfer->error = fmt::format("rank {} sent {} bytes to rank {} (tag {}), which expected {} bytes",
                                        group_->world_ranks[std::size_t(source)], transfer->source_bytes,
                                        group_->world_ranks[std::size_t(dest)], tag, transfer->dest_bytes);
          transfer->state = State::done;
        } else {
          transfer->state = State::copying;
          lock.unlock();
          try {
            world_->movement().copy(transfer->dest, transfer->source, transfer->source_bytes);
            world_->movement().finish_part();
          } catch (const std::exception& e) {  // a device copy failed: fail the run, release the other side
            world_->abort(world_rank(), fmt::format("{} failed on rank {}: {}", what, world_rank(), e.what()));
            lock.lock();
            transfer->error = e.what();
            transfer->state = State::done;
            world_->notify();
            throw;
          }
          lock.lock();
          transfer->state = State::done;
          transfer->staged.reset();
        }
        world_->notify();
      }
      world_->wait_for_copy(lock, [&] { return transfer->state == State::done; });
      if (!transfer->error.empty()) throw Error(transfer->error);
      const auto matched_at = transfer->matched_at;
      lock.unlock();
      sleep_until_paced(matched_at, paced);
    });
  }

  std::shared_ptr<ThreadWorld> world_;
  std::shared_ptr<threads_detail::Group> group_;
  int rank_ = 0;
  std::uint64_t next_seq_ = 0;
  CommStats stats_;
  std::size_t op_bytes_ = 0;  // the larger of the bytes sent and received by the operation being posted (pacing)
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
