// paradyse/comm/threads.hpp: the threads backend. Ranks are threads of one process.
//
//   run_ranks(4, [](ThreadCommunicator& comm) { ... comm.all_reduce(x, x, ReduceOp::sum); ... });
//
// Header-only and deterministic: a reduction adds the ranks' contributions in rank order, element by element, so
// results are bitwise identical from run to run. Each rank has its own MemoryTracker (optionally capped), so the
// peak memory of every rank is measured exactly.
//
// How an operation runs. Every rank posts a description of its buffers into the group's slot for that operation
// (the n-th collective of each rank meets the n-th collective of the others) and then, at wait(), pulls what it
// needs straight from the other ranks' buffers: one copy per byte, no staging. A final rendezvous keeps every send
// buffer alive until all ranks have read it. Point-to-point messages are rendezvous too: the receiver copies from
// the sender's buffer, and the sender's wait() returns once it has. So a blocking send() waits for its receive
// (like MPI_Ssend); use shift() or the async forms for exchanges.
//
// Bytes counted by stats() follow the bandwidth-optimal (ring) algorithms, the convention of nccl-tests' bus
// bandwidth: all_gather, reduce_scatter, all_to_all: (p-1)/p of the whole buffer; all_reduce: 2(p-1)/p of it;
// broadcast, reduce and send: the whole buffer once; received bytes likewise.
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/core/memory.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

namespace paradyse {

namespace threads_detail {

enum class OpKind : std::uint8_t {
  all_gather, all_gather_v, reduce_scatter, reduce_scatter_v, all_reduce, all_to_all, all_to_all_v, broadcast,
  reduce, barrier, split
};

constexpr std::string_view name_of(OpKind kind) {
  constexpr std::string_view names[] = {"all_gather", "all_gather_v", "reduce_scatter", "reduce_scatter_v",
                                        "all_reduce", "all_to_all",   "all_to_all_v",   "broadcast",
                                        "reduce",     "barrier",      "split"};
  return names[std::size_t(kind)];
}

// Element i of chunk `part` of n elements split into `parts`: the first n % parts chunks hold one more element.
inline std::pair<std::size_t, std::size_t> chunk_bounds(std::size_t n, int parts, int part) {
  const std::size_t base = n / std::size_t(parts), extra = n % std::size_t(parts), r = std::size_t(part);
  const std::size_t begin = r * base + std::min(r, extra);
  return {begin, begin + base + (r < extra ? 1 : 0)};
}

// out[i] = in[0][i] (op) in[1][i] (op) ... in rank order; `out` may alias one of the inputs.
using ReduceFn = void (*)(std::byte* out, const std::byte* const* in, int ranks, std::size_t begin, std::size_t end,
                          ReduceOp op);

template <class T>
void reduce_in_rank_order(std::byte* out_bytes, const std::byte* const* in_bytes, int ranks, std::size_t begin,
                          std::size_t end, ReduceOp op) {
  using Acc = std::conditional_t<std::is_same_v<T, bf16>, float, T>;
  auto in = [&](int r) { return reinterpret_cast<const T*>(in_bytes[r]); };
  T* out = reinterpret_cast<T*>(out_bytes);
  constexpr std::size_t kBlock = 1024;  // reduce a cache-resident block at a time, all ranks, in rank order
  Acc acc[kBlock];
  for (std::size_t b = begin; b < end; b += kBlock) {
    const std::size_t n = std::min(kBlock, end - b);
    for (std::size_t i = 0; i < n; ++i) acc[i] = Acc(in(0)[b + i]);
    for (int r = 1; r < ranks; ++r) {
      const T* src = in(r) + b;
      if (op == ReduceOp::max) {
        for (std::size_t i = 0; i < n; ++i) acc[i] = std::max(acc[i], Acc(src[i]));
      } else {
        for (std::size_t i = 0; i < n; ++i) acc[i] += Acc(src[i]);
      }
    }
    if (op == ReduceOp::avg)
      for (std::size_t i = 0; i < n; ++i) acc[i] = Acc(acc[i] / Acc(ranks));
    for (std::size_t i = 0; i < n; ++i) out[b + i] = T(acc[i]);
  }
}

// One rank's half of a collective: its buffers, as posted.
struct Post {
  OpKind kind{};
  DType dtype{};
  ReduceOp op{};
  int root = 0;
  const std::byte* send = nullptr;
  std::size_t send_count = 0;
  std::byte* recv = nullptr;
  std::size_t recv_count = 0;
  std::vector<std::int64_t> send_counts;  // all_to_all_v: per destination; reduce_scatter_v: per rank
  std::vector<std::int64_t> recv_counts;  // all_to_all_v: per source; all_gather_v: per rank
  int color = 0, key = 0;                 // split
  ReduceFn reduce = nullptr;
};

struct Group;

struct Slot {
  std::vector<std::optional<Post>> posts;
  int posted = 0, reduced = 0, finished = 0, left = 0;
  std::map<int, std::shared_ptr<Group>> split_groups;  // split: the new group of each color
};

// A point-to-point message: the receiver copies from `data` and then sets `done`.
struct Message {
  const std::byte* data = nullptr;
  std::size_t bytes = 0;
  bool taken = false;  // a receiver popped it and is copying
  bool done = false;
  std::string error;
};

struct Group {
  int id = 0;
  std::vector<int> world_ranks;          // member i of the group is world rank world_ranks[i]
  std::map<std::uint64_t, Slot> slots;   // by operation sequence number
  std::map<std::tuple<int, int, int>, std::deque<std::shared_ptr<Message>>> mailboxes;  // (source, dest, tag)

  int size() const { return int(world_ranks.size()); }
  std::string describe() const {
    return fmt::format("group #{} (world ranks {})", id, fmt::join(world_ranks, ", "));
  }
};

}  // namespace threads_detail

// Options for run_ranks.
struct RunOptions {
  std::size_t memory_cap_per_rank = MemoryTracker::kNoCap;
  std::chrono::milliseconds timeout = comm_timeout();
};

// The state shared by the thread ranks of one run: the lock every rendezvous uses, the failure flag, the trackers.
class ThreadWorld {
public:
  ThreadWorld(int size, RunOptions options) : size_(size), options_(options) {
    check(size >= 1, "a thread world needs at least one rank, got {}", size);
    for (int r = 0; r < size; ++r) trackers_.push_back(std::make_unique<MemoryTracker>(options.memory_cap_per_rank));
    auto world = std::make_shared<threads_detail::Group>();
    for (int r = 0; r < size; ++r) world->world_ranks.push_back(r);
    world_group_ = std::move(world);
  }

  int size() const noexcept { return size_; }
  MemoryTracker& tracker(int rank) { return *trackers_.at(std::size_t(rank)); }
  const std::shared_ptr<threads_detail::Group>& world_group() const { return world_group_; }
  std::chrono::milliseconds timeout() const noexcept { return options_.timeout; }
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

// One rank's handle on a group of thread ranks. Move-only: operations are matched by per-rank sequence numbers.
class ThreadCommunicator {
  // An input span whose element type is deduced from the output span, so that a mutable span converts.
  template <class T>
  using In = std::type_identity_t<std::span<const T>>;

public:
  ThreadCommunicator(std::shared_ptr<ThreadWorld> world, std::shared_ptr<threads_detail::Group> group, int rank)
      : world_(std::move(world)), group_(std::move(group)), rank_(rank) {}
  ThreadCommunicator(ThreadCommunicator&&) noexcept = default;
  ThreadCommunicator& operator=(ThreadCommunicator&&) noexcept = default;

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
    check_counts("all_gather_v", counts);
    check(in.size() == std::size_t(counts[rank_]), "all_gather_v: rank {} sends {} elements but counts[{}] = {}",
          rank_, in.size(), rank_, counts[rank_]);
    check(out.size() == total(counts), "all_gather_v: output holds {} elements, expected sum(counts) = {}",
          out.size(), total(counts));
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
    check_counts("reduce_scatter_v", counts);
    check(in.size() == total(counts), "reduce_scatter_v: input holds {} elements, expected sum(counts) = {}",
          in.size(), total(counts));
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
    check_counts("all_to_all_v (send counts)", send_counts);
    check_counts("all_to_all_v (receive counts)", recv_counts);
    check(in.size() == total(send_counts), "all_to_all_v: input holds {} elements, expected sum(send_counts) = {}",
          in.size(), total(send_counts));
    check(out.size() == total(recv_counts), "all_to_all_v: output holds {} elements, expected sum(recv_counts) = {}",
          out.size(), total(recv_counts));
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

  template <CommElement T> void all_gather(In<T> in, std::span<T> out) { all_gather_async(in, out).wait(); }
  template <CommElement T> void all_gather_v(In<T> in, std::span<T> out, std::span<const std::int64_t> counts) {
    all_gather_v_async(in, out, counts).wait();
  }
  template <CommElement T> void reduce_scatter(In<T> in, std::span<T> out, ReduceOp op) {
    reduce_scatter_async(in, out, op).wait();
  }
  template <CommElement T>
  void reduce_scatter_v(In<T> in, std::span<T> out, std::span<const std::int64_t> counts, ReduceOp op) {
    reduce_scatter_v_async(in, out, counts, op).wait();
  }
  template <CommElement T> void all_reduce(In<T> in, std::span<T> out, ReduceOp op) {
    all_reduce_async(in, out, op).wait();
  }
  template <CommElement T> void all_to_all(In<T> in, std::span<T> out) { all_to_all_async(in, out).wait(); }
  template <CommElement T>
  void all_to_all_v(In<T> in, std::span<const std::int64_t> send_counts, std::span<T> out,
                    std::span<const std::int64_t> recv_counts) {
    all_to_all_v_async(in, send_counts, out, recv_counts).wait();
  }
  template <CommElement T> void broadcast(std::span<T> buffer, int root) { broadcast_async(buffer, root).wait(); }
  template <CommElement T> void reduce(In<T> in, std::span<T> out, ReduceOp op, int root) {
    reduce_async(in, out, op, root).wait();
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
    int my_index = 0;
    complete_collective(seq, [&](threads_detail::Slot& slot) {
      std::lock_guard lock(world_->mutex());
      if (slot.split_groups.empty()) {  // the first rank through builds every color's group
        std::map<int, std::vector<std::pair<int, int>>> members;  // color -> (key, rank)
        for (int r = 0; r < size(); ++r) members[slot.posts[r]->color].push_back({slot.posts[r]->key, r});
        for (auto& [c, list] : members) {
          std::sort(list.begin(), list.end());
          auto group = std::make_shared<threads_detail::Group>();
          group->id = world_->next_group_id();
          for (auto [k, r] : list) group->world_ranks.push_back(group_->world_ranks[std::size_t(r)]);
          slot.split_groups[c] = std::move(group);
        }
      }
      mine = slot.split_groups.at(color);
      my_index = int(std::find(mine->world_ranks.begin(), mine->world_ranks.end(), world_rank()) -
                     mine->world_ranks.begin());
    });
    return ThreadCommunicator(world_, std::move(mine), my_index);
  }

  // ---- point to point -------------------------------------------------------------------------------------------
  template <CommElement T>
  Request send_async(std::span<const T> in, int dest, int tag = 0) {
    check_peer("send", dest);
    auto message = std::make_shared<threads_detail::Message>();
    message->data = reinterpret_cast<const std::byte*>(in.data());
    message->bytes = in.size_bytes();
    {
      std::lock_guard lock(world_->mutex());
      group_->mailboxes[{rank_, dest, tag}].push_back(message);
    }
    world_->notify();
    count_bytes(in.size_bytes(), 0);
    return Request([this, message, dest, tag] {
      std::unique_lock lock(world_->mutex());
      try {
        world_->wait(lock, world_rank(), [&] { return message->done; }, [&] { return fmt::format("{}", dest); },
                     fmt::format("send to rank {} (tag {}) on {}", dest, tag, group_->describe()));
      } catch (...) {
        // Giving up (failure or timeout): the buffer may die next, so no receiver may copy from it any more.
        if (!message->taken) {
          auto& box = group_->mailboxes[{rank_, dest, tag}];
          box.erase(std::find(box.begin(), box.end(), message));
        } else {
          while (!message->done) {  // a receiver is copying right now: a memcpy, it ends
            lock.unlock();
            std::this_thread::yield();
            lock.lock();
          }
        }
        throw;
      }
      if (!message->error.empty()) throw Error(message->error);
    });
  }
  template <CommElement T>
  Request recv_async(std::span<T> out, int source, int tag = 0) {
    check_peer("recv", source);
    count_bytes(0, out.size_bytes());
    return Request([this, out, source, tag] {
      std::unique_lock lock(world_->mutex());
      auto& box = group_->mailboxes[{source, rank_, tag}];
      world_->wait(lock, world_rank(), [&] { return !box.empty(); }, [&] { return fmt::format("{}", source); },
                   fmt::format("recv from rank {} (tag {}) on {}", source, tag, group_->describe()));
      std::shared_ptr<threads_detail::Message> message = box.front();
      box.pop_front();
      message->taken = true;
      lock.unlock();
      std::string error;
      if (message->bytes != out.size_bytes())
        error = fmt::format("rank {} sent {} bytes to rank {} (tag {}), which expected {} bytes", source,
                            message->bytes, rank_, tag, out.size_bytes());
      else if (message->bytes)
        std::memcpy(out.data(), message->data, message->bytes);
      lock.lock();
      message->error = error;
      message->done = true;
      lock.unlock();
      world_->notify();
      if (!error.empty()) throw Error(error);
    });
  }
  // Sends `in` to rank + offset and receives `out` from rank - offset (mod size): one step of a ring.
  template <CommElement T>
  Request shift_async(In<T> in, std::span<T> out, int offset = 1) {
    const int n = size();
    const int dest = ((rank_ + offset) % n + n) % n, source = ((rank_ - offset) % n + n) % n;
    // In place, this rank may receive into `out` before the next rank has read `in` from it: send a staged copy.
    std::shared_ptr<Staging> staged;
    if (!in.empty() && !out.empty() && in.data() < out.data() + out.size() && out.data() < in.data() + in.size()) {
      staged = std::make_shared<Staging>(in.size_bytes());
      std::memcpy(staged->data, in.data(), in.size_bytes());
      in = std::span<const T>(reinterpret_cast<const T*>(staged->data), in.size());
    }
    auto sent = std::make_shared<Request>(send_async(in, dest, kShiftTag));
    auto received = std::make_shared<Request>(recv_async(out, source, kShiftTag));
    return Request([sent, received, staged] {
      received->wait();
      sent->wait();
    });
  }
  template <CommElement T> void send(std::span<const T> in, int dest, int tag = 0) { send_async(in, dest, tag).wait(); }
  template <CommElement T> void recv(std::span<T> out, int source, int tag = 0) { recv_async(out, source, tag).wait(); }
  template <CommElement T> void shift(In<T> in, std::span<T> out, int offset = 1) {
    shift_async(in, out, offset).wait();
  }

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
  threads_detail::Post stage_if_aliased(threads_detail::Post post) {
    const std::size_t bytes = post.send_count * size_of(post.dtype);
    const std::byte *s = post.send, *r = post.recv;
    if (bytes && s < r + post.recv_count * size_of(post.dtype) && r < s + bytes) {
      staged_ = std::make_shared<Staging>(bytes);
      std::memcpy(staged_->data, post.send, bytes);
      post.send = staged_->data;
    }
    return post;
  }
  struct Staging {  // a tracked copy of an in-place all-to-all's input
    explicit Staging(std::size_t n) : tracker(&MemoryTracker::current()), bytes(n),
                                      data(static_cast<std::byte*>(tracker->allocate(n))) {}
    ~Staging() { tracker->deallocate(data, bytes); }
    MemoryTracker* tracker;
    std::size_t bytes;
    std::byte* data;
  };

  void check_peer(const char* op, int peer) const {
    check(peer >= 0 && peer < size(), "{}: rank {} is not in {} (size {})", op, peer, group_->describe(), size());
  }
  void check_counts(const char* op, std::span<const std::int64_t> counts) const {
    check(counts.size() == std::size_t(size()), "{}: {} counts given, expected one per rank ({})", op,
          counts.size(), size());
    for (std::size_t r = 0; r < counts.size(); ++r)
      check(counts[r] >= 0, "{}: counts[{}] = {} must be non-negative", op, r, counts[r]);
  }
  static std::size_t total(std::span<const std::int64_t> counts) {
    std::size_t n = 0;
    for (auto c : counts) n += std::size_t(c);
    return n;
  }
  void count_bytes(std::size_t sent, std::size_t received) {
    stats_.bytes_sent += sent;
    stats_.bytes_received += received;
    ++stats_.operations;
  }

  Request start(threads_detail::Post post) {
    const std::uint64_t seq = post_collective(std::move(post));
    auto staged = std::exchange(staged_, nullptr);
    return Request([this, seq, staged] { complete_collective(seq, [](threads_detail::Slot&) {}); });
  }

  std::uint64_t post_collective(threads_detail::Post post) {
    const std::uint64_t seq = next_seq_++;
    {
      std::lock_guard lock(world_->mutex());
      auto& slot = group_->slots[seq];
      if (slot.posts.empty()) slot.posts.resize(std::size_t(size()));
      slot.posts[std::size_t(rank_)] = std::move(post);
      ++slot.posted;
    }
    world_->notify();
    return seq;
  }

  std::string describe_op(const threads_detail::Slot& slot, std::uint64_t seq) const {
    return fmt::format("{} (operation #{}) on {}", threads_detail::name_of(slot.posts[std::size_t(rank_)]->kind), seq,
                       group_->describe());
  }

  // Which ranks have not reached `count` yet, as world ranks.
  std::string missing(const threads_detail::Slot& slot) const {
    std::vector<int> absent;
    for (int r = 0; r < size(); ++r)
      if (!slot.posts[std::size_t(r)]) absent.push_back(group_->world_ranks[std::size_t(r)]);
    return absent.empty() ? std::string("(all arrived; some had not finished)") : fmt::format("{}", fmt::join(absent, ", "));
  }

  // Every rank posted the same operation with compatible sizes; otherwise a clear error (on every rank).
  void validate(const threads_detail::Slot& slot, std::uint64_t seq) const {
    using threads_detail::OpKind;
    const auto& mine = *slot.posts[std::size_t(rank_)];
    const auto& first = *slot.posts[0];
    for (int r = 0; r < size(); ++r) {
      const auto& other = *slot.posts[std::size_t(r)];
      check(other.kind == first.kind, "rank {} called {} where rank 0 called {} (operation #{} on {})", r,
            threads_detail::name_of(other.kind), threads_detail::name_of(first.kind), seq, group_->describe());
      if (first.kind == OpKind::barrier || first.kind == OpKind::split) continue;
      check(other.dtype == first.dtype, "{}: rank {} moves {} where rank 0 moves {}", describe_op(slot, seq), r,
            name_of(other.dtype), name_of(first.dtype));
      check(other.op == first.op || first.kind == OpKind::all_gather || first.kind == OpKind::all_to_all ||
                first.kind == OpKind::broadcast || first.kind == OpKind::all_gather_v || first.kind == OpKind::all_to_all_v,
            "{}: rank {} reduces with {} where rank 0 uses {}", describe_op(slot, seq), r, name_of(other.op), name_of(first.op));
      check(other.root == first.root, "{}: rank {} names root {} where rank 0 names root {}", describe_op(slot, seq), r,
            other.root, first.root);
      switch (first.kind) {
        case OpKind::all_gather: case OpKind::all_reduce: case OpKind::all_to_all: case OpKind::reduce_scatter:
          check(other.send_count == mine.send_count, "{}: rank {} sends {} elements but rank {} sends {}",
                describe_op(slot, seq), r, other.send_count, rank_, mine.send_count);
          break;
        case OpKind::broadcast:
          check(other.recv_count == mine.recv_count, "{}: rank {} has a buffer of {} elements but rank {} has {}",
                describe_op(slot, seq), r, other.recv_count, rank_, mine.recv_count);
          break;
        case OpKind::reduce:
          check(other.send_count == mine.send_count, "{}: rank {} contributes {} elements but rank {} contributes {}",
                describe_op(slot, seq), r, other.send_count, rank_, mine.send_count);
          break;
        case OpKind::all_gather_v: case OpKind::reduce_scatter_v:
          check(other.recv_counts == first.recv_counts && other.send_counts == first.send_counts,
                "{}: rank {} passes different counts than rank 0", describe_op(slot, seq), r);
          break;
        case OpKind::all_to_all_v:
          check(std::size_t(other.send_counts[std::size_t(rank_)]) == std::size_t(mine.recv_counts[std::size_t(r)]),
                "{}: rank {} sends {} elements to rank {}, which expects {}", describe_op(slot, seq), r,
                other.send_counts[std::size_t(rank_)], rank_, mine.recv_counts[std::size_t(r)]);
          break;
        default: break;
      }
    }
  }

  // Waits for every rank's post, does this rank's part, then waits until every rank has done its part (so every
  // send buffer stays valid while others read it). `extra` runs once all posts are in (used by split).
  template <class Extra>
  void complete_collective(std::uint64_t seq, Extra extra) {
    using threads_detail::OpKind;
    std::unique_lock lock(world_->mutex());
    threads_detail::Slot& slot = group_->slots.at(seq);
    const std::string what = describe_op(slot, seq);
    world_->wait(lock, world_rank(), [&] { return slot.posted == size(); }, [&] { return missing(slot); }, what);
    lock.unlock();
    try {
      validate(slot, seq);
    } catch (...) {
      leave(slot, seq);
      throw;
    }

    const auto& mine = *slot.posts[std::size_t(rank_)];
    auto post = [&](int r) -> const threads_detail::Post& { return *slot.posts[std::size_t(r)]; };
    const std::size_t elem = size_of(mine.dtype);
    const int n = size();
    switch (mine.kind) {
      case OpKind::all_gather:
        for (int r = 0; r < n; ++r) {
          std::byte* dst = mine.recv + std::size_t(r) * mine.send_count * elem;
          if (dst != post(r).send) std::memcpy(dst, post(r).send, mine.send_count * elem);
        }
        break;
      case OpKind::all_gather_v: {
        std::size_t offset = 0;
        for (int r = 0; r < n; ++r) {
          const std::size_t bytes = std::size_t(mine.recv_counts[std::size_t(r)]) * elem;
          if (bytes && mine.recv + offset != post(r).send) std::memcpy(mine.recv + offset, post(r).send, bytes);
          offset += bytes;
        }
        break;
      }
      case OpKind::reduce_scatter: case OpKind::reduce_scatter_v: {
        std::size_t begin = 0, count = mine.recv_count;
        if (mine.kind == OpKind::reduce_scatter) begin = std::size_t(rank_) * mine.recv_count;
        else
          for (int r = 0; r < rank_; ++r) begin += std::size_t(mine.send_counts[std::size_t(r)]);
        std::vector<const std::byte*> inputs(static_cast<std::size_t>(n));
        for (int r = 0; r < n; ++r) inputs[std::size_t(r)] = post(r).send + begin * elem;
        mine.reduce(mine.recv, inputs.data(), n, 0, count, mine.op);
        break;
      }
      case OpKind::all_reduce: {
        // Phase 1: rank r reduces chunk r into its own output; phase 2: everyone copies the other chunks.
        const auto [begin, end] = threads_detail::chunk_bounds(mine.send_count, n, rank_);
        std::vector<const std::byte*> inputs(static_cast<std::size_t>(n));
        for (int r = 0; r < n; ++r) inputs[std::size_t(r)] = post(r).send;
        mine.reduce(mine.recv, inputs.data(), n, begin, end, mine.op);
        lock.lock();
        ++slot.reduced;
        world_->notify();
        world_->wait(lock, world_rank(), [&] { return slot.reduced == n; }, [&] { return std::string("(reducing)"); },
                     what);
        lock.unlock();
        for (int r = 0; r < n; ++r) {
          if (r == rank_) continue;
          const auto [b, e] = threads_detail::chunk_bounds(mine.send_count, n, r);
          if (e > b) std::memcpy(mine.recv + b * elem, post(r).recv + b * elem, (e - b) * elem);
        }
        break;
      }
      case OpKind::all_to_all: {
        const std::size_t chunk = mine.send_count / std::size_t(n) * elem;
        for (int r = 0; r < n; ++r)
          if (chunk) std::memcpy(mine.recv + std::size_t(r) * chunk, post(r).send + std::size_t(rank_) * chunk, chunk);
        break;
      }
      case OpKind::all_to_all_v: {
        std::size_t recv_offset = 0;
        for (int r = 0; r < n; ++r) {
          std::size_t send_offset = 0;
          for (int j = 0; j < rank_; ++j) send_offset += std::size_t(post(r).send_counts[std::size_t(j)]);
          const std::size_t bytes = std::size_t(mine.recv_counts[std::size_t(r)]) * elem;
          if (bytes) std::memcpy(mine.recv + recv_offset, post(r).send + send_offset * elem, bytes);
          recv_offset += bytes;
        }
        break;
      }
      case OpKind::broadcast:
        if (rank_ != mine.root && mine.recv_count)
          std::memcpy(mine.recv, post(mine.root).send, mine.recv_count * elem);
        break;
      case OpKind::reduce:
        if (rank_ == mine.root && mine.send_count) {
          std::vector<const std::byte*> inputs(static_cast<std::size_t>(n));
          for (int r = 0; r < n; ++r) inputs[std::size_t(r)] = post(r).send;
          mine.reduce(mine.recv, inputs.data(), n, 0, mine.send_count, mine.op);
        }
        break;
      case OpKind::barrier: break;
      case OpKind::split: extra(slot); break;
    }
    leave(slot, seq);
  }

  // The closing rendezvous of a collective; the last rank out frees the slot.
  void leave(threads_detail::Slot& slot, std::uint64_t seq) {
    std::unique_lock lock(world_->mutex());
    ++slot.finished;
    world_->notify();
    world_->wait(lock, world_rank(), [&] { return slot.finished == size(); }, [&] { return missing(slot); },
                 describe_op(slot, seq));
    if (++slot.left == size()) group_->slots.erase(seq);
  }

  std::shared_ptr<ThreadWorld> world_;
  std::shared_ptr<threads_detail::Group> group_;
  int rank_ = 0;
  std::uint64_t next_seq_ = 0;
  CommStats stats_;
  std::shared_ptr<Staging> staged_;
};

static_assert(Communicator<ThreadCommunicator>);

// What a run measured on each rank.
struct RunReport {
  std::vector<std::size_t> peak_bytes;  // the MemoryTracker peak of each rank
  std::vector<CommStats> stats;         // the world communicator's byte counts of each rank
};

// Runs fn(comm) on `ranks` thread ranks, each with its own MemoryTracker installed. If a rank throws, every other
// rank's communication fails promptly with a CommError naming it, and run_ranks rethrows the first failure.
template <class Fn>
RunReport run_ranks(int ranks, Fn&& fn, RunOptions options = {}) {
  auto world = std::make_shared<ThreadWorld>(ranks, options);
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
          ThreadCommunicator comm(world, world->world_group(), r);
          fn(comm);
          report.stats[std::size_t(r)] = comm.stats();
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

}  // namespace paradyse
