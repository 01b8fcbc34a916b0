// examples/command_line.hpp: the small flag reader the example programs share.
//
//   CommandLine cli(argc, argv, usage);      // usage(problem) prints the problem and the program's usage, exits 2
//   while (cli.next()) {
//     if (cli.flag() == "--steps") o.steps = int(cli.integer(1));
//     else cli.unknown();
//   }
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <cstdlib>
#include <functional>
#include <limits>
#include <string>

namespace paradyse::examples {

class CommandLine {
public:
  using Usage = std::function<void(const std::string& problem)>;  // must not return

  CommandLine(int argc, char** argv, Usage usage) : argc_(argc), argv_(argv), usage_(std::move(usage)) {}

  // Moves to the next flag; false when none is left.
  bool next() {
    if (++index_ >= argc_) return false;
    flag_ = argv_[index_];
    if (flag_ == "--help" || flag_ == "-h") fail("help");
    return true;
  }
  const std::string& flag() const noexcept { return flag_; }

  // The value after the current flag.
  std::string value() {
    if (index_ + 1 >= argc_) fail(flag_ + " needs a value");
    return argv_[++index_];
  }
  // An integer value of at least `min`.
  std::int64_t integer(std::int64_t min = 0) {
    const std::string v = value();
    char* end = nullptr;
    const long long x = std::strtoll(v.c_str(), &end, 10);
    if (end == v.c_str() || *end || x < min) fail(fmt::format("{} expects an integer >= {}, got \"{}\"", flag_, min, v));
    return std::int64_t(x);
  }
  // A number value; with `positive`, above zero.
  double number(bool positive = false) {
    const std::string v = value();
    char* end = nullptr;
    const double x = std::strtod(v.c_str(), &end);
    if (end == v.c_str() || *end || (positive && !(x > 0)))
      fail(fmt::format("{} expects a {}number, got \"{}\"", flag_, positive ? "positive " : "", v));
    return x;
  }
  // One of two words; true for the first.
  bool choice(const char* first, const char* second) {
    const std::string v = value();
    if (v != first && v != second) fail(fmt::format("{} expects {} or {}, got \"{}\"", flag_, first, second, v));
    return v == first;
  }
  [[noreturn]] void unknown() { fail(fmt::format("unknown option \"{}\"", flag_)); }
  [[noreturn]] void fail(const std::string& problem) {
    usage_(problem);
    std::exit(2);
  }

private:
  int argc_;
  char** argv_;
  Usage usage_;
  int index_ = 0;
  std::string flag_;
};

}  // namespace paradyse::examples
