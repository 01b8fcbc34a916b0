// paradyse/plan/job_pool.hpp: a small persistent pool of worker threads that runs the independent jobs of one call
// (a cost table's dry runs) on every core.
//
// JobPool::shared().run(count, job) calls job(i) once for every i in [0, count): on the calling thread and on the
// pool's workers, which take the next index from one atomic counter. It returns when every job has finished. Each
// job writes only its own result, so the outcome is the serial one whatever thread ran what; when jobs throw, the
// exception of the lowest index is rethrown (the one a serial loop would have met first).
//
// The shared pool's workers are started once, on first use (hardware threads - 1 of them, at most kMaxWorkers;
// none on one core), and never per call; the shared pool is never destroyed (its workers sleep through exit).
// Between calls a worker spins for a short while (kSpin) so that back-to-back calls find it awake, then sleeps on a
// condition variable. One call at a time uses the workers: a call made while another is running (from another
// thread, or from inside a job) runs its jobs serially on its own thread.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace paradyse::plan {

class JobPool {
public:
  static constexpr int kMaxWorkers = 7;
  static constexpr std::chrono::microseconds kSpin{300};

  // The process's pool (never destroyed: its workers sleep through exit).
  static JobPool& shared() {
    static JobPool* const pool = new JobPool(default_workers());
    return *pool;
  }
  static int default_workers() {
    const unsigned threads = std::thread::hardware_concurrency();
    return std::clamp(int(threads) - 1, 0, kMaxWorkers);
  }

  explicit JobPool(int workers) : workers_(std::max(workers, 0)) {
    for (int w = 0; w < workers_; ++w) threads_.emplace_back([this] { work(); });
  }
  // Stops and joins the workers (no call may be running).
  ~JobPool() {
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    for (std::thread& t : threads_) t.join();
  }
  JobPool(const JobPool&) = delete;
  JobPool& operator=(const JobPool&) = delete;

  int workers() const noexcept { return workers_; }

  // While one lives, every run() of the pool calls its jobs on the calling thread, in index order (to measure the
  // serial path, or to debug a job).
  class Serial {
  public:
    explicit Serial(JobPool& pool) noexcept : pool_(pool) { pool_.serial_.fetch_add(1, std::memory_order_relaxed); }
    ~Serial() { pool_.serial_.fetch_sub(1, std::memory_order_relaxed); }
    Serial(const Serial&) = delete;
    Serial& operator=(const Serial&) = delete;

  private:
    JobPool& pool_;
  };

  // Calls job(i) for every i in [0, count) and returns when all are done; rethrows the lowest index's exception.
  template <class Job>
  void run(std::size_t count, Job&& job) {
    std::vector<std::exception_ptr> errors(count);
    const auto call = [&](std::size_t i) {
      try {
        job(i);
      } catch (...) {
        errors[i] = std::current_exception();
      }
    };
    if (workers_ == 0 || count < 2 || serial_.load(std::memory_order_relaxed) > 0 ||
        busy_.exchange(true, std::memory_order_acquire)) {
      for (std::size_t i = 0; i < count; ++i) call(i);
    } else {
      Batch batch{count, [](void* c, std::size_t i) { (*static_cast<decltype(call)*>(c))(i); },
                  const_cast<void*>(static_cast<const void*>(&call))};
      publish(&batch);
      batch.take_all();  // the caller works too
      while (batch.finished.load(std::memory_order_acquire) != count) std::this_thread::yield();
      publish(nullptr);  // no worker joins from now on
      // Every worker that joined has left the batch before it goes out of scope.
      while (batch.joined.load(std::memory_order_acquire) != 0) std::this_thread::yield();
      busy_.store(false, std::memory_order_release);
    }
    for (std::exception_ptr& e : errors)
      if (e) std::rethrow_exception(e);
  }

private:
  struct Batch {
    std::size_t count;
    void (*call)(void*, std::size_t);
    void* context;
    std::atomic<std::size_t> next{0}, finished{0};
    std::atomic<int> joined{0};

    Batch(std::size_t n, void (*c)(void*, std::size_t), void* ctx) : count(n), call(c), context(ctx) {}
    void take_all() {
      for (std::size_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < count;) {
        call(context, i);
        finished.fetch_add(1, std::memory_order_release);
      }
    }
  };

  void publish(Batch* batch) {
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      current_ = batch;
      generation_.fetch_add(1, std::memory_order_release);
    }
    if (batch) wake_.notify_all();
  }

  // Joins the batch of `generation` if it is still the current one (under the lock, so it cannot end meanwhile).
  void join(std::uint64_t generation) {
    Batch* batch = nullptr;
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      if (generation_.load(std::memory_order_relaxed) != generation || !current_) return;
      batch = current_;
      batch->joined.fetch_add(1, std::memory_order_acq_rel);
    }
    batch->take_all();
    batch->joined.fetch_sub(1, std::memory_order_acq_rel);
  }

  void work() {
    std::uint64_t seen = 0;  // nothing published yet (a worker that starts late joins the current batch, if any)
    for (;;) {
      // Spin a little: a caller that plans several lengths in a row finds this worker awake.
      const auto until = std::chrono::steady_clock::now() + kSpin;
      std::uint64_t now = seen;
      while ((now = generation_.load(std::memory_order_acquire)) == seen && std::chrono::steady_clock::now() < until)
        std::this_thread::yield();
      if (now == seen) {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return stop_ || generation_.load(std::memory_order_relaxed) != seen; });
        if (stop_) return;
        now = generation_.load(std::memory_order_relaxed);
      }
      seen = now;
      {
        const std::lock_guard<std::mutex> lock(mutex_);
        if (stop_) return;
      }
      join(now);
    }
  }

  int workers_ = 0;
  std::vector<std::thread> threads_;
  bool stop_ = false;  // guarded by mutex_
  std::atomic<bool> busy_{false};  // a call is using the workers
  std::atomic<int> serial_{0};     // live Serial scopes
  std::mutex mutex_;  // guards current_ and generation_ changes
  std::condition_variable wake_;
  std::atomic<std::uint64_t> generation_{0};
  Batch* current_ = nullptr;
};

}  // namespace paradyse::plan
