// paradyse/comm/mpi_watchdog.hpp: timeouts for MPI waits, and the arrival board that names the missing ranks.
//
// A blocking MPI call cannot be interrupted, so a timeout under MPI cannot be an exception: the watchdog, one thread
// per process, aborts the whole job (MPI_Abort) when a watched wait passes its deadline, after printing which
// operation on which group waited for how long and which ranks never arrived. Nothing hangs past the timeout.
//
// Which ranks never arrived: every communicator has an arrival board, one 64-bit counter per rank in an MPI
// shared-memory window (MPI_Win_allocate_shared over the world ranks on this node). A rank stores the sequence
// number of each collective it enters; at a timeout, a rank whose counter is below the stalled operation's number
// never arrived. The watchdog reads the counters directly (atomic loads, no MPI call, so MPI_THREAD_SINGLE is
// enough). Ranks on other nodes have no counter here and are reported as unknown; without a window (it could not be
// created, or more than 64 communicators are alive) the report says so.
#pragma once

#include "paradyse/comm/mpi_h.hpp"
#include "paradyse/core/error.hpp"


#include <fmt/format.h>
#include <fmt/ranges.h>

#include <atomic>
#include <bit>
#include <cstddef>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <list>
#include <mutex>
#include <new>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

namespace paradyse::mpi_detail {

// Lock-free, so it works between processes in shared memory.
using Counter = std::atomic<std::uint64_t>;
static_assert(Counter::is_always_lock_free);

// The arrival counters of the process: one shared-memory window over the ranks of MPI_COMM_WORLD on this node,
// kSlots counters per rank (a cache line each). A communicator claims the same counter index on all its ranks when
// it is created (a bitwise AND of the ranks' free masks), so destroying a communicator is local: it only gives the
// index back. The window is freed by MPI_Finalize (through a delete callback on MPI_COMM_SELF).
class ArrivalBoards {
public:
  static constexpr int kSlots = 64;  // communicators alive at once with a board; more get none

  static ArrivalBoards& instance() {
    static ArrivalBoards boards;
    return boards;
  }

  // Collective over MPI_COMM_WORLD, done once (by MpiCommunicator::world()). Never throws: on failure the boards
  // are absent and timeouts report the missing ranks as unknown.
  void create() {
    std::lock_guard lock(mutex_);
    if (created_) return;
    created_ = true;
    int world_size = 0;
    MPI_Comm_size(MPI_COMM_WORLD, &world_size);
    slots_.assign(std::size_t(world_size), nullptr);
    if (MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node_) != MPI_SUCCESS) {
      node_ = MPI_COMM_NULL;
      return;
    }
    MPI_Comm_set_errhandler(node_, MPI_ERRORS_RETURN);
    void* base = nullptr;
    if (MPI_Win_allocate_shared(kSlots * kSlotBytes, 1, MPI_INFO_NULL, node_, &base, &window_) != MPI_SUCCESS) {
      window_ = MPI_WIN_NULL;
      return;
    }
    for (int i = 0; i < kSlots; ++i) new (static_cast<std::byte*>(base) + i * kSlotBytes) Counter(0);
    // World rank -> node rank (MPI_UNDEFINED when on another node) -> that rank's counters.
    MPI_Group world_group = MPI_GROUP_NULL, node_group = MPI_GROUP_NULL;
    MPI_Comm_group(MPI_COMM_WORLD, &world_group);
    MPI_Comm_group(node_, &node_group);
    std::vector<int> ranks(static_cast<std::size_t>(world_size)), node_ranks(static_cast<std::size_t>(world_size));
    for (int r = 0; r < world_size; ++r) ranks[std::size_t(r)] = r;
    MPI_Group_translate_ranks(world_group, world_size, ranks.data(), node_group, node_ranks.data());
    MPI_Group_free(&world_group);
    MPI_Group_free(&node_group);
    for (int r = 0; r < world_size; ++r) {
      if (node_ranks[std::size_t(r)] == MPI_UNDEFINED) continue;
      MPI_Aint bytes = 0;
      int unit = 0;
      void* counters = nullptr;
      if (MPI_Win_shared_query(window_, node_ranks[std::size_t(r)], &bytes, &unit, &counters) == MPI_SUCCESS)
        slots_[std::size_t(r)] = static_cast<std::byte*>(counters);
    }
    MPI_Barrier(node_);  // every counter is initialised before anyone reads it
    // Free the window at the start of MPI_Finalize, while MPI still works.
    int keyval = MPI_KEYVAL_INVALID;
    if (MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, &on_finalize, &keyval, nullptr) == MPI_SUCCESS)
      MPI_Comm_set_attr(MPI_COMM_SELF, keyval, this);
    available_ = true;
  }

  // Claims a counter index for a new communicator; collective over `comm`. -1 when none is free on every rank.
  int acquire(MPI_Comm comm) {
    std::uint64_t free_here = 0;
    {
      std::lock_guard lock(mutex_);
      free_here = available_ ? free_mask_ : 0;
    }
    std::uint64_t free_everywhere = 0;
    if (MPI_Allreduce(&free_here, &free_everywhere, 1, MPI_UINT64_T, MPI_BAND, comm) != MPI_SUCCESS ||
        free_everywhere == 0)
      return -1;
    const int index = std::countr_zero(free_everywhere);
    std::lock_guard lock(mutex_);
    free_mask_ &= ~(std::uint64_t(1) << index);
    return index;
  }
  // Gives the index back and zeroes this rank's counter (unless MPI_Finalize already freed the window).
  void release(int index, Counter* mine) noexcept {
    if (index < 0) return;
    std::lock_guard lock(mutex_);
    if (available_ && mine) mine->store(0, std::memory_order_release);
    free_mask_ |= std::uint64_t(1) << index;
  }

  // Counter `index` of a world rank; nullptr when that rank is on another node or there is no board.
  Counter* counter(int world_rank, int index) const noexcept {
    if (index < 0 || !available_ || world_rank < 0 || std::size_t(world_rank) >= slots_.size() ||
        !slots_[std::size_t(world_rank)])
      return nullptr;
    return reinterpret_cast<Counter*>(slots_[std::size_t(world_rank)] + index * kSlotBytes);
  }

private:
  static constexpr int kSlotBytes = 64;

  ArrivalBoards() = default;

  static int on_finalize(MPI_Comm, int keyval, void* attribute, void*) {
    auto* self = static_cast<ArrivalBoards*>(attribute);
    std::lock_guard lock(self->mutex_);
    self->available_ = false;
    if (self->window_ != MPI_WIN_NULL) MPI_Win_free(&self->window_);
    if (self->node_ != MPI_COMM_NULL) MPI_Comm_free(&self->node_);
    self->slots_.clear();
    MPI_Comm_free_keyval(&keyval);
    return MPI_SUCCESS;
  }

  mutable std::mutex mutex_;
  bool created_ = false;
  bool available_ = false;
  std::uint64_t free_mask_ = ~std::uint64_t(0);
  MPI_Comm node_ = MPI_COMM_NULL;
  MPI_Win window_ = MPI_WIN_NULL;
  std::vector<std::byte*> slots_;  // by world rank: the start of that rank's counters
};

// One communicator's view of the boards: the counters of its ranks.
class ArrivalBoard {
public:
  ArrivalBoard() = default;
  // Collective over `comm`; `world_ranks[r]` is the world rank of rank r of `comm`.
  ArrivalBoard(MPI_Comm comm, const std::vector<int>& world_ranks, int my_rank) {
    auto& boards = ArrivalBoards::instance();
    index_ = boards.acquire(comm);
    if (index_ < 0) return;
    for (int w : world_ranks) counters_.push_back(boards.counter(w, index_));
    mine_ = counters_[std::size_t(my_rank)];
    if (mine_) mine_->store(0, std::memory_order_release);
  }
  ArrivalBoard(const ArrivalBoard&) = delete;
  ArrivalBoard& operator=(const ArrivalBoard&) = delete;
  ~ArrivalBoard() { ArrivalBoards::instance().release(index_, mine_); }

  void arrive(std::uint64_t sequence) noexcept {
    if (mine_) mine_->store(sequence, std::memory_order_release);
  }

  // Which ranks (named by `names[r]`) have not entered operation `sequence`.
  std::string describe_missing(std::uint64_t sequence, const std::vector<int>& names) const {
    if (!mine_) return "which ranks never arrived is unknown (no shared-memory arrival board)";
    std::vector<int> missing, unknown;
    for (std::size_t r = 0; r < counters_.size(); ++r) {
      if (!counters_[r]) unknown.push_back(names[r]);
      else if (counters_[r]->load(std::memory_order_acquire) < sequence) missing.push_back(names[r]);
    }
    std::string text = missing.empty() ? std::string("every rank on this node arrived; some had not finished")
                                       : fmt::format("world ranks {} never arrived", fmt::join(missing, ", "));
    if (!unknown.empty()) text += fmt::format(" (world ranks {} are on other nodes: unknown)", fmt::join(unknown, ", "));
    return text;
  }

private:
  int index_ = -1;
  std::vector<Counter*> counters_;  // by rank of the communicator; nullptr when off this node
  Counter* mine_ = nullptr;
};

// The process's watchdog thread. A Watch registers a wait with a deadline; the thread sleeps until the earliest
// deadline and, if that wait is still registered then, reports it and aborts the job.
class Watchdog {
public:
  // What a timed-out wait reports: describe(context, op, sequence, peer), called on the watchdog thread at expiry
  // only (a plain function pointer, so registering a wait allocates nothing but the list node).
  using Describe = std::string (*)(const void* context, const char* op, std::uint64_t sequence, int peer);
  struct Entry {
    std::chrono::steady_clock::time_point deadline;
    std::chrono::milliseconds timeout;
    Describe describe;
    const void* context;
    const char* op;
    std::uint64_t sequence;
    int peer;
  };

  class Watch {
  public:
    Watch() = default;
    Watch(Watchdog* dog, std::list<Entry>::iterator it) : dog_(dog), it_(it) {}
    Watch(Watch&& other) noexcept : dog_(std::exchange(other.dog_, nullptr)), it_(other.it_) {}
    Watch& operator=(Watch&&) = delete;
    ~Watch() {
      if (dog_) dog_->remove(it_);
    }

  private:
    Watchdog* dog_ = nullptr;
    std::list<Entry>::iterator it_;
  };

  static Watchdog& instance() {
    static Watchdog dog;
    return dog;
  }

  Watch watch(std::chrono::milliseconds timeout, Describe describe, const void* context, const char* op,
              std::uint64_t sequence, int peer = -1) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    std::unique_lock lock(mutex_);
    if (!thread_.joinable()) {
      MPI_Comm_rank(MPI_COMM_WORLD, &world_rank_);  // here, on a thread that may call MPI
      thread_ = std::jthread([this](std::stop_token stop) { loop(stop); });
    }
    const bool earlier = entries_.empty() || deadline < next_deadline_;
    auto it = entries_.insert(entries_.end(), Entry{deadline, timeout, describe, context, op, sequence, peer});
    if (earlier) {
      next_deadline_ = deadline;
      lock.unlock();
      changed_.notify_one();
    }
    return Watch(this, it);
  }

  ~Watchdog() {
    if (!thread_.joinable()) return;
    {
      std::lock_guard lock(mutex_);  // the loop checks for a stop under the lock: no wake-up is lost
      thread_.request_stop();
    }
    changed_.notify_all();
    thread_.join();
  }

private:
  Watchdog() = default;

  void remove(std::list<Entry>::iterator it) noexcept {
    std::lock_guard lock(mutex_);
    entries_.erase(it);
  }

  void loop(std::stop_token stop) {
    std::unique_lock lock(mutex_);
    while (!stop.stop_requested()) {
      if (entries_.empty()) {
        changed_.wait(lock, [&] { return stop.stop_requested() || !entries_.empty(); });
        continue;
      }
      auto earliest = entries_.begin();
      for (auto it = entries_.begin(); it != entries_.end(); ++it)
        if (it->deadline < earliest->deadline) earliest = it;
      next_deadline_ = earliest->deadline;
      if (std::chrono::steady_clock::now() >= earliest->deadline) {
        expire(*earliest);  // does not return
      }
      changed_.wait_until(lock, next_deadline_);
    }
  }

  // Reports and ends the job. MPI_Abort is the one MPI call made from this thread (OpenMPI allows it at any
  // thread level; it is what the standard offers to end a job that cannot finish).
  [[noreturn]] void expire(const Entry& entry) const {
    const int world_rank = world_rank_;
    const std::string message =
        fmt::format("paradyse: MPI world rank {}: timeout after {:.1f} s (PARADYSE_COMM_TIMEOUT) in {}; aborting the "
                    "job\n",
                    world_rank, std::chrono::duration<double>(entry.timeout).count(),
                    entry.describe(entry.context, entry.op, entry.sequence, entry.peer));
    std::fputs(message.c_str(), stderr);
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, kTimeoutExitCode);
    std::abort();  // MPI_Abort does not return; this only satisfies [[noreturn]]
  }

  static constexpr int kTimeoutExitCode = 124;  // like timeout(1)

  std::mutex mutex_;
  std::condition_variable changed_;
  std::list<Entry> entries_;
  std::chrono::steady_clock::time_point next_deadline_{};
  int world_rank_ = -1;
  std::jthread thread_;
};

}  // namespace paradyse::mpi_detail
