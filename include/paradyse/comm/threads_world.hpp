// paradyse/comm/threads_world.hpp: the state the thread ranks of one run share (ThreadWorld: the lock every
// rendezvous uses, the failure flag, the timeout, the ranks' memory trackers) and the options of run_ranks
// (RunOptions) it is made from.
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/comm/threads_detail.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/core/memory.hpp"

#include <fmt/format.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
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

}  // namespace paradyse
