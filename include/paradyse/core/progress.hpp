// paradyse/core/progress.hpp: a progress line for long runs (train_gpt's steps, plan_trace's sequences): how far, the
// rate and the time left, redrawn in place at most every 0.2 s.
//
//   Progress progress("steps", total, "tokens");   // quiet when stdout is not a terminal (a log, a pipe, mpirun)
//   progress.clear();                               // before printing a table row over it
//   progress.show(done, units_done);                // "steps 12/32 (37%)  4210 tokens/s  ETA 0:41"
//   progress.finish();                              // erase it at the end
//
// The line goes to stdout (the terminal the table is on) without a newline and is erased with "\r\033[K", so the
// table reads the same with or without it; when stdout is not a terminal nothing is written at all.
#pragma once

#include <fmt/format.h>

#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace paradyse {

class Progress {
public:
  using Clock = std::chrono::steady_clock;

  Progress(std::string what, std::int64_t total, std::string unit = {}, bool enabled = stdout_is_terminal())
      : what_(std::move(what)), unit_(std::move(unit)), total_(total), enabled_(enabled), start_(Clock::now()) {}
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;
  ~Progress() { finish(); }

  bool enabled() const noexcept { return enabled_; }

  // Whether stdout is a terminal a person watches. Under mpirun it never counts as one: OpenMPI gives the processes
  // a pseudo-terminal even when mpirun's own output goes to a file or a pipe.
  static bool stdout_is_terminal() {
    return ::isatty(STDOUT_FILENO) == 1 && !std::getenv("OMPI_COMM_WORLD_SIZE") && !std::getenv("PMI_SIZE");
  }

  // `done` of the total items (and `units` of the unit, e.g. tokens, for the rate; 0: the rate is in items).
  void show(std::int64_t done, double units = 0, bool force = false) {
    if (!enabled_) return;
    const Clock::time_point now = Clock::now();
    if (!force && shown_ && now - last_ < std::chrono::milliseconds(200) && done < total_) return;
    last_ = now;
    shown_ = true;
    const double elapsed = std::chrono::duration<double>(now - start_).count();
    std::fputs(("\r\033[K" + line(done, units, elapsed)).c_str(), stdout);
    std::fflush(stdout);
  }
  // Erases the line (before a table row is printed over it).
  void clear() {
    if (!enabled_ || !shown_) return;
    std::fputs("\r\033[K", stdout);
    std::fflush(stdout);
    shown_ = false;
  }
  void finish() { clear(); }

  // The text of the line after `elapsed` seconds (public for tests).
  std::string line(std::int64_t done, double units, double elapsed) const {
    const double rate = elapsed > 0 ? (unit_.empty() ? double(done) : units) / elapsed : 0;
    std::string text = fmt::format("{} {}/{} ({:.0f}%)", what_, done, total_, total_ > 0 ? 100.0 * double(done) / double(total_) : 0.0);
    if (elapsed > 0) text += fmt::format("  {:.4g} {}/s", rate, unit_.empty() ? what_ : unit_);
    if (done > 0 && done < total_) {
      const auto left = std::int64_t(elapsed / double(done) * double(total_ - done) + 0.5);
      text += fmt::format("  ETA {}:{:02}", left / 60, left % 60);
    }
    return text;
  }

private:
  std::string what_, unit_;
  std::int64_t total_;
  bool enabled_;
  bool shown_ = false;
  Clock::time_point start_, last_;
};

}  // namespace paradyse
