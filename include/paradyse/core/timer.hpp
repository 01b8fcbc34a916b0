// paradyse/core/timer.hpp: the one stopwatch (wall time on the steady clock) and the calling thread's CPU time, for
// everything the library, the programs and the benchmarks time.
//
//   const Timer timer;                        // started
//   work();
//   const double s = timer.seconds();         // wall seconds since the start
//   timer.restart();                          // or: const double lap = timer.lap();  (seconds, then restarted)
//   const double cpu = thread_cpu_seconds();  // CPU seconds this thread has run (a difference of two is its time)
//
// Deadlines and timeouts (comm/) keep their own time points: this is for measuring, not for waiting.
#pragma once

#include <time.h>

#include <chrono>

namespace paradyse {

class Timer {
public:
  using Clock = std::chrono::steady_clock;

  Timer() noexcept : start_(Clock::now()) {}

  // Wall seconds since the start (or the last restart).
  double seconds() const noexcept { return std::chrono::duration<double>(Clock::now() - start_).count(); }
  // Starts again from now.
  void restart() noexcept { start_ = Clock::now(); }
  // Wall seconds since the start, and starts again from now.
  double lap() noexcept {
    const Clock::time_point now = Clock::now();
    const double s = std::chrono::duration<double>(now - start_).count();
    start_ = now;
    return s;
  }
  Clock::time_point started() const noexcept { return start_; }

private:
  Clock::time_point start_;
};

// Wall seconds on the steady clock since its epoch (only differences mean anything).
inline double wall_seconds() noexcept {
  return std::chrono::duration<double>(Timer::Clock::now().time_since_epoch()).count();
}

// Seconds of CPU time the calling thread has run.
inline double thread_cpu_seconds() noexcept {
  timespec ts{};
  ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

// Wall seconds `body()` takes.
template <class Body>
double time_seconds(Body&& body) {
  const Timer timer;
  body();
  return timer.seconds();
}

}  // namespace paradyse
