// paradyse/comm/threads_member.hpp: one thread rank's membership of a group (ThreadCommunicator's base, threads.hpp):
// the rendezvous every operation goes through. A collective is posted into the group's slot for its sequence number
// and completed by executing unclaimed parts once every rank posted (complete_collective); a send and a receive are
// matched per (source, dest, tag) and whichever side waits first copies (post_transfer); leaving the group and
// finish() detect collectives out of step; byte counts and the emulated link pacing of each operation. The
// communicator's public operations (threads.hpp) describe their buffers and call these.
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/comm/threads_detail.hpp"
#include "paradyse/comm/threads_world.hpp"
#include "paradyse/core/error.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace paradyse::threads_detail {

// One rank of a group of thread ranks: its world, its group, its rank in the group and its operation count. Move-only
// (a pending Request refers to it).
class GroupMember {
public:
  GroupMember(std::shared_ptr<ThreadWorld> world, std::shared_ptr<Group> group, int rank)
      : world_(std::move(world)), group_(std::move(group)), rank_(rank) {}
  GroupMember(GroupMember&&) noexcept = default;  // leaves the source without a group
  GroupMember& operator=(GroupMember&& other) noexcept {
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
  GroupMember(const GroupMember&) = delete;
  GroupMember& operator=(const GroupMember&) = delete;
  // Leaves the group: other ranks waiting for a collective this rank never posted fail as out of step. Not when the
  // destructor runs because of an exception: the failure of the run reports that.
  ~GroupMember() { leave(); }

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

protected:
  void count_bytes(std::size_t sent, std::size_t received) {
    stats_.bytes_sent += sent;
    stats_.bytes_received += received;
    ++stats_.operations;
    op_bytes_ = std::max(op_bytes_, std::max(sent, received));
  }
  // The emulated duration of the operation being posted (0 without pacing), from the bytes count_bytes saw for it.
  double paced_seconds(bool point_to_point, OpKind kind = OpKind::barrier) {
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
    const int steps = kind == OpKind::all_reduce ? 2 * (p - 1) : p - 1;
    return pacing.launch_s + pacing.alpha_s * steps + double(bytes) * pacing.collective_s_per_byte;
  }
  static void sleep_until_paced(PacingClock::time_point start, double seconds) {
    if (seconds <= 0) return;
    std::this_thread::sleep_until(start + std::chrono::duration_cast<PacingClock::duration>(
                                              std::chrono::duration<double>(seconds)));
  }


  // ---- collectives: post, then complete ------------------------------------------------------------------------
  Request start(Post post) {
    const double paced = paced_seconds(false, post.kind);
    const std::uint64_t seq = post_collective(std::move(post));
    if (paced <= 0) return Request([this, seq] { complete_collective(seq, [](Slot&) {}); });
    return Request([this, seq, paced] {
      PacingClock::time_point ready;
      complete_collective(seq, [&](Slot& slot) { ready = slot.ready; });
      sleep_until_paced(ready, paced);
    });
  }

  std::uint64_t post_collective(Post post) {
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
      if (++slot.posted == size()) slot.ready = PacingClock::now();
    }
    world_->notify();
    return seq;
  }

  std::string describe_op(const Slot& slot, std::uint64_t seq) const {
    return fmt::format("{} (operation #{}) on {}", name_of(slot.posts[std::size_t(rank_)]->kind), seq,
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
  std::string out_of_step(const Slot& slot, std::uint64_t seq) const {
    std::string gone;
    for (int r = 0; r < size(); ++r)
      if (!slot.posts[std::size_t(r)] && group_->left[std::size_t(r)])
        gone += fmt::format("{}rank {} (world rank {}) left the group after posting {}", gone.empty() ? "" : "; ", r,
                            group_->world_ranks[std::size_t(r)], group_->posted_by(r));
    if (gone.empty()) return {};
    return fmt::format(
        "rank {}: collectives out of step on {}: this rank is in {} #{}, but {}: a rank skipped a collective (or "
        "the others called one more), so the collectives matched by number since then paired different calls",
        world_rank(), group_->describe(), name_of(slot.posts[std::size_t(rank_)]->kind), seq, gone);
  }

  // The world ranks that have not posted the operation yet.
  std::string missing(const Slot& slot) const {
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
    Slot& slot = group_->slots.at(seq);
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
        slot.invalid = validate(slot, *group_, seq);
        slot.phases = phases_of(slot.posts[0]->kind);
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
          execute_part(slot, n, phase, part, world_->movement());
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
  int next_unclaimed_part(const Slot& slot) const {
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
                        std::byte* recv, std::size_t recv_bytes, std::shared_ptr<Staging> staged) {
    world_->movement().before_post();
    std::shared_ptr<Transfer> transfer;
    {
      std::lock_guard lock(world_->mutex());
      auto& mine = sending ? group_->unmatched_sends[{source, dest, tag}] : group_->unmatched_recvs[{source, dest, tag}];
      auto& theirs = sending ? group_->unmatched_recvs[{source, dest, tag}] : group_->unmatched_sends[{source, dest, tag}];
      if (!theirs.empty()) {
        transfer = theirs.front();
        theirs.pop_front();
        transfer->matched_at = PacingClock::now();
      } else {
        transfer = std::make_shared<Transfer>();
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
      using State = Transfer::State;
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
  std::shared_ptr<Group> group_;
  int rank_ = 0;
  std::uint64_t next_seq_ = 0;
  CommStats stats_;
  std::size_t op_bytes_ = 0;  // the larger of the bytes sent and received by the operation being posted (pacing)
};

}  // namespace paradyse::threads_detail
