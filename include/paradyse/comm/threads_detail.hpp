// paradyse/comm/threads_detail.hpp: the machinery under the threads backend (comm/threads.hpp): what a rank posts
// for an operation, the rendezvous slot of a collective, and the work of a collective cut into parts.
//
// A collective is cut into one part per receiving rank (all_reduce into two phases of such parts: reduce chunk r,
// then copy chunk r everywhere). Any rank that waits on the operation claims parts that nobody has claimed yet,
// its own first, and executes them; so a rank that waits early does the work of ranks that have not waited yet, and
// ranks may wait on several pending operations in different orders without deadlock (as MPI allows).
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/dtype.hpp"
#include "paradyse/core/memory.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <chrono>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace paradyse {

// Interconnect emulation for the thread communicator (threads.hpp, set_link_pacing / RunOptions::pacing): every
// operation of a paced group completes no earlier than
//   start + launch_s + alpha_s * latency steps + (bytes this rank moves) * s_per_byte
// where start is the moment the last rank posted it (the match, for point to point), the bytes are this rank's
// share as stats() counts them (ring volumes), latency steps are the ring algorithm's (p - 1; all_reduce 2 (p - 1);
// point to point and shift 1), and s_per_byte is collective_s_per_byte for collectives (1 / bus bandwidth) and
// p2p_s_per_byte for send, recv and shift. Plain numbers: comm/ sits below cost/, so the caller converts a hardware
// profile (cost/emulation.hpp does, scaled by the ratio of this machine's compute rate to the device's). The copy
// itself still happens when a rank waits; the pacing only holds the completion back, so compute between post and
// wait overlaps the emulated transfer as it would on the device.
struct LinkPacing {
  double launch_s = 0;  // per operation
  double alpha_s = 0;   // per latency step
  double collective_s_per_byte = 0;
  double p2p_s_per_byte = 0;
  bool enabled() const noexcept {
    return launch_s > 0 || alpha_s > 0 || collective_s_per_byte > 0 || p2p_s_per_byte > 0;
  }
  friend bool operator==(const LinkPacing&, const LinkPacing&) = default;
};

}  // namespace paradyse

namespace paradyse::threads_detail {

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

// Chunk `part` of n elements split into `parts`: the first n % parts chunks hold one more element.
inline std::pair<std::size_t, std::size_t> chunk_bounds(std::size_t n, int parts, int part) {
  const std::size_t base = n / std::size_t(parts), extra = n % std::size_t(parts), r = std::size_t(part);
  const std::size_t begin = r * base + std::min(r, extra);
  return {begin, begin + base + (r < extra ? 1 : 0)};
}

// out[i] = in[0][i] (op) in[1][i] (op) ... in rank order, for i in [begin, end); `out` may alias an input.
using ReduceFn = void (*)(std::byte* out, const std::byte* const* in, int ranks, std::size_t begin, std::size_t end,
                          ReduceOp op);

template <class T>
void reduce_in_rank_order(std::byte* out_bytes, const std::byte* const* in_bytes, int ranks, std::size_t begin,
                          std::size_t end, ReduceOp op) {
  using Acc = std::conditional_t<std::is_same_v<T, bf16>, float, T>;  // bf16 adds in float, rounds once
  auto in = [&](int r) { return reinterpret_cast<const T*>(in_bytes[r]); };
  T* out = reinterpret_cast<T*>(out_bytes);
  constexpr std::size_t kBlock = 1024;  // a cache-resident block at a time, all ranks, in rank order
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

// A tracked copy of an input that its own output would overwrite (in-place all_to_all and shift).
struct Staging {
  explicit Staging(std::size_t n)
      : tracker(MemoryTracker::current().handle()), bytes(n),
        data(static_cast<std::byte*>(tracker.allocate(n, Contents::unspecified))) {}
  ~Staging() { tracker.deallocate(data, bytes); }
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;
  MemoryTracker::Handle tracker;
  std::size_t bytes;
  std::byte* data;
};

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
  std::shared_ptr<Staging> staged;        // keeps a staged input alive until the operation is done
};

struct Group;

using PacingClock = std::chrono::steady_clock;

// The rendezvous of one collective: every rank's post, and the progress of its parts.
struct Slot {
  std::vector<std::optional<Post>> posts;
  int posted = 0;
  bool validated = false;
  std::string invalid;             // why the posts do not fit together; empty when they do
  int phases = 1;                  // all_reduce: 2
  int phase = 0;                   // the phase being executed; == phases when the operation is done
  std::vector<bool> claimed;       // parts of the current phase
  int claimed_count = 0, done_count = 0;
  int left = 0;                    // ranks whose wait has returned
  std::map<int, std::shared_ptr<Group>> split_groups;  // split: the new group of each color
  PacingClock::time_point ready;   // when the last rank posted (link pacing counts from there)

  bool complete() const noexcept { return validated && (!invalid.empty() || phase == phases); }
  bool in_progress() const noexcept { return claimed_count != done_count; }
};

// A point-to-point transfer: a send and a receive matched in posting order; whichever side waits first copies.
struct Transfer {
  const std::byte* source = nullptr;
  std::size_t source_bytes = 0;
  std::byte* dest = nullptr;
  std::size_t dest_bytes = 0;
  bool has_send = false, has_recv = false;
  enum class State : std::uint8_t { waiting, copying, done } state = State::waiting;
  std::string error;
  std::shared_ptr<Staging> staged;  // an in-place shift's staged input
  PacingClock::time_point matched_at;  // when the second side was posted (link pacing counts from there)

  bool matched() const noexcept { return has_send && has_recv; }
};

struct Group {
  int id = 0;
  LinkPacing pacing;                    // interconnect emulation of this group (threads.hpp); off by default
  std::vector<int> world_ranks;         // member i of the group is world rank world_ranks[i]
  std::map<std::uint64_t, Slot> slots;  // by operation sequence number
  // Unmatched sends and receives per (source, dest, tag), in posting order.
  std::map<std::tuple<int, int, int>, std::deque<std::shared_ptr<Transfer>>> unmatched_sends, unmatched_recvs;

  // Per member: how many collectives it has posted on this group (its next sequence number), the kind of its last
  // one, and whether it has left the group (its communicator finished or was destroyed, other than by an
  // exception). Sized on first use.
  std::vector<std::uint64_t> posted;
  std::vector<OpKind> last_kind;
  std::vector<bool> left;

  int size() const { return int(world_ranks.size()); }
  void track_members() {
    if (posted.size() == world_ranks.size()) return;
    posted.assign(world_ranks.size(), 0);
    last_kind.assign(world_ranks.size(), OpKind::barrier);
    left.assign(world_ranks.size(), false);
  }
  // "N collectives (#0 to #N-1, the last: all_reduce)" for member r.
  std::string posted_by(int r) const {
    const std::uint64_t n = posted[std::size_t(r)];
    if (n == 0) return "no collective";
    if (n == 1) return fmt::format("1 collective (#0, {})", name_of(last_kind[std::size_t(r)]));
    return fmt::format("{} collectives (#0 to #{}, the last: {})", n, n - 1, name_of(last_kind[std::size_t(r)]));
  }
  std::string describe() const {
    return fmt::format("group #{} (world ranks {})", id, fmt::join(world_ranks, ", "));
  }
};

// Why the posts of a collective do not fit together (from the point of view of `rank`), or empty.
inline std::string validate(const Slot& slot, const Group& group, std::uint64_t seq) {
  const int n = group.size();
  const Post& first = *slot.posts[0];
  const auto where = [&] { return fmt::format("{} (operation #{}) on {}", name_of(first.kind), seq, group.describe()); };
  for (int r = 0; r < n; ++r) {
    const Post& other = *slot.posts[std::size_t(r)];
    if (other.kind != first.kind)
      return fmt::format("rank {} called {} where rank 0 called {} (operation #{} on {})", r, name_of(other.kind),
                         name_of(first.kind), seq, group.describe());
    if (first.kind == OpKind::barrier || first.kind == OpKind::split) continue;
    if (other.dtype != first.dtype)
      return fmt::format("{}: rank {} moves {} where rank 0 moves {}", where(), r, name_of(other.dtype),
                         name_of(first.dtype));
    if (first.reduce && other.op != first.op)
      return fmt::format("{}: rank {} reduces with {} where rank 0 uses {}", where(), r, name_of(other.op),
                         name_of(first.op));
    if (other.root != first.root)
      return fmt::format("{}: rank {} names root {} where rank 0 names root {}", where(), r, other.root, first.root);
    switch (first.kind) {
      case OpKind::all_gather: case OpKind::all_reduce: case OpKind::all_to_all: case OpKind::reduce_scatter:
        if (other.send_count != first.send_count)
          return fmt::format("{}: rank {} sends {} elements but rank 0 sends {}", where(), r, other.send_count,
                             first.send_count);
        break;
      case OpKind::broadcast:
        if (other.recv_count != first.recv_count)
          return fmt::format("{}: rank {} has a buffer of {} elements but rank 0 has {}", where(), r,
                             other.recv_count, first.recv_count);
        break;
      case OpKind::reduce:
        if (other.send_count != first.send_count)
          return fmt::format("{}: rank {} contributes {} elements but rank 0 contributes {}", where(), r,
                             other.send_count, first.send_count);
        break;
      case OpKind::all_gather_v: case OpKind::reduce_scatter_v:
        if (other.recv_counts != first.recv_counts || other.send_counts != first.send_counts)
          return fmt::format("{}: rank {} passes different counts than rank 0", where(), r);
        break;
      case OpKind::all_to_all_v:
        for (int j = 0; j < n; ++j)
          if (other.send_counts[std::size_t(j)] != slot.posts[std::size_t(j)]->recv_counts[std::size_t(r)])
            return fmt::format("{}: rank {} sends {} elements to rank {}, which expects {}", where(), r,
                               other.send_counts[std::size_t(j)], j,
                               slot.posts[std::size_t(j)]->recv_counts[std::size_t(r)]);
        break;
      default: break;
    }
  }
  return {};
}

inline int phases_of(OpKind kind) { return kind == OpKind::all_reduce ? 2 : 1; }

// One pair of an all-to-all: rank i sends `from_i` (its chunk for j) and receives `to_i` (its chunk from j), rank j
// likewise; either may be in place (from == to). Both sources are read before either destination is written, a
// block at a time, so an in-place exchange needs no staged copy of the whole input. i == j: one chunk to itself.
inline void exchange_chunks(const std::byte* from_i, std::byte* to_i, const std::byte* from_j, std::byte* to_j,
                            std::size_t bytes) {
  if (from_i == from_j) {  // the diagonal
    if (to_i != from_i && bytes) std::memcpy(to_i, from_i, bytes);
    return;
  }
  constexpr std::size_t kBlock = std::size_t(32) << 10;
  alignas(64) std::byte block[kBlock];
  for (std::size_t at = 0; at < bytes; at += kBlock) {
    const std::size_t n = std::min(kBlock, bytes - at);
    std::memcpy(block, from_i + at, n);         // what j receives, kept aside
    std::memcpy(to_i + at, from_j + at, n);     // i receives j's chunk (may overwrite from_i: it is saved)
    std::memcpy(to_j + at, block, n);           // j receives i's chunk (may overwrite from_j: already read)
  }
}

// How the bytes of an operation move between the posted buffers. The default is the threads backend's: memcpy and
// the host reduction in rank order, complete when each call returns. The CUDA backend on one GPU
// (comm/cuda_local.hpp) overrides it with device copies and a reduction kernel on the executing thread's stream.
// Whoever executes a part calls copy/exchange/reduce for it, then finish_part() before the part is marked done, so
// a done part's bytes are in place for every rank; a rank calls before_post() before it posts an operation, so the
// data it posts is final (and nothing of its own is still reading or writing its buffers).
struct DataMovement {
  virtual ~DataMovement() = default;
  virtual void before_post() const {}
  virtual void copy(std::byte* dst, const std::byte* src, std::size_t bytes) const {
    if (bytes) std::memcpy(dst, src, bytes);
  }
  // One pair of an in-place all-to-all (see exchange_chunks).
  virtual void exchange(const std::byte* from_i, std::byte* to_i, const std::byte* from_j, std::byte* to_j,
                        std::size_t bytes) const {
    exchange_chunks(from_i, to_i, from_j, to_j, bytes);
  }
  // out[i] = in[0][i] (op) ... (op) in[ranks-1][i] in rank order for i in [begin, end); `host` is the dtype's host
  // reduction (Post::reduce).
  virtual void reduce(DType dtype, ReduceFn host, std::byte* out, const std::byte* const* in, int ranks,
                      std::size_t begin, std::size_t end, ReduceOp op) const {
    (void)dtype;
    host(out, in, ranks, begin, end, op);
  }
  virtual void finish_part() const {}
};

// The threads backend's data movement (host memory).
inline const DataMovement& host_data_movement() {
  static const DataMovement movement;
  return movement;
}

// Executes part `part` (the receiving side of rank `part`) of phase `phase` of a validated collective, moving bytes
// through `move` (complete when this returns).
inline void execute_part(const Slot& slot, int n, int phase, int part,
                         const DataMovement& move = host_data_movement()) {
  const Post& mine = *slot.posts[std::size_t(part)];
  const auto post = [&](int r) -> const Post& { return *slot.posts[std::size_t(r)]; };
  const std::size_t elem = size_of(mine.dtype);
  std::vector<const std::byte*> inputs(static_cast<std::size_t>(n));
  switch (mine.kind) {
    case OpKind::all_gather:
      for (int r = 0; r < n; ++r) {
        std::byte* dst = mine.recv + std::size_t(r) * mine.send_count * elem;
        if (dst != post(r).send && mine.send_count) move.copy(dst, post(r).send, mine.send_count * elem);
      }
      break;
    case OpKind::all_gather_v: {
      std::size_t offset = 0;
      for (int r = 0; r < n; ++r) {
        const std::size_t bytes = std::size_t(mine.recv_counts[std::size_t(r)]) * elem;
        if (bytes && mine.recv + offset != post(r).send) move.copy(mine.recv + offset, post(r).send, bytes);
        offset += bytes;
      }
      break;
    }
    case OpKind::reduce_scatter: case OpKind::reduce_scatter_v: {
      std::size_t begin = 0;
      if (mine.kind == OpKind::reduce_scatter) begin = std::size_t(part) * mine.recv_count;
      else
        for (int r = 0; r < part; ++r) begin += std::size_t(mine.send_counts[std::size_t(r)]);
      for (int r = 0; r < n; ++r) inputs[std::size_t(r)] = post(r).send + begin * elem;
      move.reduce(mine.dtype, mine.reduce, mine.recv, inputs.data(), n, 0, mine.recv_count, mine.op);
      break;
    }
    case OpKind::all_reduce: {
      const auto [begin, end] = chunk_bounds(mine.send_count, n, part);
      if (phase == 0) {  // reduce chunk `part` into its owner's output
        for (int r = 0; r < n; ++r) inputs[std::size_t(r)] = post(r).send;
        move.reduce(mine.dtype, mine.reduce, mine.recv, inputs.data(), n, begin, end, mine.op);
      } else {  // copy the reduced chunk `part` from its owner to everyone
        for (int r = 0; r < n; ++r)
          if (r != part && end > begin) move.copy(post(r).recv + begin * elem, mine.recv + begin * elem, (end - begin) * elem);
      }
      break;
    }
    case OpKind::all_to_all: {
      const std::size_t chunk = mine.send_count / std::size_t(n) * elem;
      bool any_in_place = false;
      for (int r = 0; r < n; ++r) any_in_place = any_in_place || (post(r).send == post(r).recv && chunk);
      if (!any_in_place) {
        for (int r = 0; r < n; ++r)
          if (chunk) move.copy(mine.recv + std::size_t(r) * chunk, post(r).send + std::size_t(part) * chunk, chunk);
        break;
      }
      // Some rank works in place (unstaged): chunk j of rank i's input sits exactly where rank i receives from
      // rank j. So the pair (i, j) is one exchange of two chunks, done here by part min(i, j), reading both sources
      // before writing either (through a cache-sized block).
      for (int r = part; r < n; ++r)
        move.exchange(post(part).send + std::size_t(r) * chunk, post(part).recv + std::size_t(r) * chunk,
                        post(r).send + std::size_t(part) * chunk, post(r).recv + std::size_t(part) * chunk, chunk);
      break;
    }
    case OpKind::all_to_all_v: {
      std::size_t recv_offset = 0;
      for (int r = 0; r < n; ++r) {
        std::size_t send_offset = 0;
        for (int j = 0; j < part; ++j) send_offset += std::size_t(post(r).send_counts[std::size_t(j)]);
        const std::size_t bytes = std::size_t(mine.recv_counts[std::size_t(r)]) * elem;
        if (bytes) move.copy(mine.recv + recv_offset, post(r).send + send_offset * elem, bytes);
        recv_offset += bytes;
      }
      break;
    }
    case OpKind::broadcast:
      if (part != mine.root && mine.recv_count) move.copy(mine.recv, post(mine.root).send, mine.recv_count * elem);
      break;
    case OpKind::reduce:
      if (part == mine.root && mine.send_count) {
        for (int r = 0; r < n; ++r) inputs[std::size_t(r)] = post(r).send;
        move.reduce(mine.dtype, mine.reduce, mine.recv, inputs.data(), n, 0, mine.send_count, mine.op);
      }
      break;
    case OpKind::barrier: case OpKind::split: break;
  }
  move.finish_part();
}

}  // namespace paradyse::threads_detail
