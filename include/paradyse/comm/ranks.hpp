// paradyse/comm/ranks.hpp: the ranks a training program runs on, behind one interface: p threads of this process
// (comm/threads.hpp), or one rank per process under mpirun (comm/mpi.hpp, when built with PARADYSE_WITH_MPI), or
// (DeviceRanks) p threads on one GPU (comm/cuda_local.hpp).
//
//   Ranks<Model, BufferPool> ranks(RankBackend::threads, p, cap);   // or RankBackend::mpi under `mpirun -np p`
//   ranks.run([&](auto& comm, int r) { ... model(r) ... });   // every rank of this process, collectively
//
// Each rank has its own memory tracker (capped), model and buffer pool; a process holds those of its own ranks
// only (all p with threads, one with MPI: the others stay empty). run() is collective over the whole group: with
// threads it runs fn on p threads and returns when all are done; with MPI it runs fn on this process's rank.
//
// Out of memory: with threads, an OutOfMemory on one rank ends the collectives of all, and run() rethrows it with
// out_of_memory_rank() naming the rank, leaving every model as it was before the step (the caller recovers). With
// MPI the other processes cannot be interrupted inside a collective, so an OutOfMemory ends the job (MPI_Abort,
// naming the rank and the bytes): a caller under MPI lifts the cap for the step, compares every rank's peak with it
// afterwards and undoes the step when one passed it (train_gpt does), which is when the thread run's step fails.
#pragma once

#include "paradyse/comm/threads.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/core/memory.hpp"

#if PARADYSE_WITH_MPI
#include "paradyse/comm/mpi.hpp"
#endif
#if PARADYSE_WITH_CUDA
#include "paradyse/comm/cuda_local.hpp"
#include "paradyse/device/caching_allocator.hpp"
#endif

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace paradyse {

enum class RankBackend { threads, mpi };

// Whether this build can run ranks as MPI processes.
constexpr bool mpi_available() {
#if PARADYSE_WITH_MPI
  return true;
#else
  return false;
#endif
}

// Each rank holds a Model and a Pool (e.g. strategy/buffer_pool.hpp's BufferPool) of its own.
template <class Model, class Pool>
class Ranks {
public:
  // threads: p ranks in this process. mpi: this process is one rank of an MPI job of exactly p processes (MPI must be
  // initialised already, see MpiSession).
  Ranks(RankBackend backend, int p, std::size_t cap) : backend_(backend) {
    check(p >= 1, "Ranks: {} ranks; expected at least 1", p);
#if PARADYSE_WITH_MPI
    if (backend == RankBackend::mpi) {
      world_.emplace(MpiCommunicator::world());
      check(world_->size() == p, "--ranks {} but the MPI job has {} processes (mpirun -np {}): one rank per process",
            p, world_->size(), p);
      local_rank_ = world_->rank();
    }
#else
    check(backend == RankBackend::threads, "this train_gpt was built without MPI (no OpenMPI found by CMake)");
#endif
    for (int r = 0; r < p; ++r) trackers_.push_back(std::make_unique<MemoryTracker>(cap));
    models.resize(std::size_t(p));
    pools.resize(std::size_t(p));
  }

  RankBackend backend() const noexcept { return backend_; }
  int size() const noexcept { return int(trackers_.size()); }
  // Whether rank r lives in this process, and the first one that does (the one that reports).
  bool is_local(int r) const noexcept { return backend_ == RankBackend::threads || r == local_rank_; }
  int first_local() const noexcept { return backend_ == RankBackend::threads ? 0 : local_rank_; }
  // Whether this process prints the run's report (threads: always; MPI: world rank 0).
  bool reports() const noexcept { return first_local() == 0; }
  MemoryTracker& tracker(int r) { return *trackers_[std::size_t(r)]; }

  // Runs fn(comm, rank) on every rank of this process, with the rank's tracker installed. Collective.
  template <class Fn>
  void run(Fn&& fn) {
    oom_rank_ = -1;
#if PARADYSE_WITH_MPI
    if (backend_ == RankBackend::mpi) {
      ScopedTracker scoped(tracker(local_rank_));
      try {
        fn(*world_, local_rank_);
      } catch (const OutOfMemory& e) {
        abort_mpi_job(fmt::format("out of memory ({} more bytes asked with {} in use, cap {}): under MPI a step that "
                                  "runs out of memory ends the job",
                                  e.requested(), e.in_use(), tracker(local_rank_).cap()));
      }
      return;
    }
#endif
    run_ranks(size(), [&](ThreadCommunicator& comm) {
      ScopedTracker scoped(tracker(comm.rank()));
      if (pacing_) comm.set_link_pacing(*pacing_);
      try {
        fn(comm, comm.rank());
      } catch (const OutOfMemory&) {
        int none = -1;
        oom_rank_.compare_exchange_strong(none, comm.rank());
        throw;
      }
    });
  }
  int out_of_memory_rank() const { return oom_rank_; }
  // Thread ranks: every transfer from now on paced like an emulated interconnect (cost/emulation.hpp).
  void set_link_pacing(const LinkPacing& pacing) {
    check(backend_ == RankBackend::threads, "link pacing emulates an interconnect on thread ranks only");
    pacing_ = pacing;
  }

  // values[r] set by the ranks of this process (the others 0): afterwards every entry holds rank r's value in
  // every process. Collective.
  void share(std::vector<double>& values) {
#if PARADYSE_WITH_MPI
    if (backend_ == RankBackend::mpi) {
      world_->all_reduce(std::span<const double>(values), std::span<double>(values), ReduceOp::sum);
    }
#endif
  }

private:
  RankBackend backend_;
  int local_rank_ = 0;
  std::vector<std::unique_ptr<MemoryTracker>> trackers_;  // first: outlives the models and pools charged to it
  std::atomic<int> oom_rank_{-1};
  std::optional<LinkPacing> pacing_;
#if PARADYSE_WITH_MPI
  std::optional<MpiCommunicator> world_;
#endif

public:
  std::vector<std::unique_ptr<Model>> models;
  std::vector<std::unique_ptr<Pool>> pools;
};

#if PARADYSE_WITH_CUDA
// p ranks as threads on one GPU (comm/cuda_local.hpp), with Ranks' interface: each rank has its own device tracker
// (capped; its caching allocator keeps freed blocks for the next step) that outlives the runs, so the models stay in
// device memory from step to step. An OutOfMemory on one rank fails the others and run() rethrows it, as with
// threads.
template <class Model, class Pool>
class DeviceRanks {
public:
  DeviceRanks(int p, std::size_t cap) {
    check(p >= 1, "DeviceRanks: {} ranks; expected at least 1", p);
    PARADYSE_CUDA_CHECK(cudaGetDevice(&device_));
    for (int r = 0; r < p; ++r)
      trackers_.push_back(std::make_unique<MemoryTracker>(
          MemorySpace::device, std::make_shared<device::CachingAllocator>(device_), cap));
    models.resize(std::size_t(p));
    pools.resize(std::size_t(p));
  }

  RankBackend backend() const noexcept { return RankBackend::threads; }
  int size() const noexcept { return int(trackers_.size()); }
  bool is_local(int) const noexcept { return true; }
  int first_local() const noexcept { return 0; }
  bool reports() const noexcept { return true; }
  MemoryTracker& tracker(int r) { return *trackers_[std::size_t(r)]; }

  template <class Fn>
  void run(Fn&& fn) {
    oom_rank_ = -1;
    CudaLocalOptions options;
    options.device = device_;
    run_cuda_local_ranks(size(), [&](CudaLocalCommunicator& comm) {
      ScopedTracker scoped(tracker(comm.rank()));
      try {
        fn(comm, comm.rank());
        device::synchronize();  // the step's work is done when run() returns (timing, peaks)
      } catch (const OutOfMemory&) {
        int none = -1;
        oom_rank_.compare_exchange_strong(none, comm.rank());
        throw;
      }
    }, options);
  }
  int out_of_memory_rank() const { return oom_rank_; }
  void share(std::vector<double>&) {}  // every rank is in this process

private:
  int device_ = 0;
  std::vector<std::unique_ptr<MemoryTracker>> trackers_;  // first: outlives the models and pools charged to it
  std::atomic<int> oom_rank_{-1};

public:
  std::vector<std::unique_ptr<Model>> models;
  std::vector<std::unique_ptr<Pool>> pools;
};
#endif

}  // namespace paradyse
