// examples/command_line.hpp: the small flag reader the example programs share.
//
//   [[noreturn]] void usage(const std::string& problem) { print_usage_and_exit("train_gpt", problem, kUsageText); }
//   CommandLine cli(argc, argv, usage);
//   while (cli.next()) {
//     if (cli.flag() == "--steps") o.steps = cli.integer<int>(1, 1'000'000);
//     else if (cli.flag() == "--lr") o.lr = cli.number({.min = 0, .max = 10, .min_open = true});
//     else cli.unknown();
//   }
//
// Every numeric flag states the range it accepts: integers are parsed straight into the destination type (no
// 64-bit value silently wrapping into an int), numbers must be finite (no nan, no inf) and inside their interval,
// and a value outside is an error naming the flag, the value and the accepted range. `--help` / `-h` calls the
// usage with an empty problem: print_usage_and_exit then prints the usage to stdout and exits 0; with a problem it
// prints "program: problem" and the usage to stderr and exits 2.
#pragma once

#include <fmt/format.h>

#include <cctype>
#include <charconv>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <string>
#include <string_view>
#include <system_error>

namespace paradyse::examples {

// The usage of a program: on stdout with exit status 0 when `problem` is empty (--help), else on stderr after
// "program: problem", exit status 2.
[[noreturn]] inline void print_usage_and_exit(std::string_view program, const std::string& problem,
                                              std::string_view usage_text) {
  if (problem.empty()) {
    fmt::print(stdout, "{}", usage_text);
    std::fflush(stdout);
    std::exit(0);
  }
  fmt::print(stderr, "{}: {}\n{}", program, problem, usage_text);
  std::exit(2);
}

// The values a number flag accepts: [min, max], either end open on request. Always finite.
struct Interval {
  double min = -std::numeric_limits<double>::max();
  double max = std::numeric_limits<double>::max();
  bool min_open = false;  // (min, ...
  bool max_open = false;  // ..., max)

  bool contains(double x) const {
    return std::isfinite(x) && (min_open ? x > min : x >= min) && (max_open ? x < max : x <= max);
  }
  std::string describe() const {
    return fmt::format("{}{}, {}{}", min_open ? '(' : '[', min, max, max_open ? ')' : ']');
  }
};

// Parses all of `text` (decimal digits, an optional '-') as an integer of type T in [min, max]; false when it is not
// one (out-of-range values included: nothing wraps).
template <std::integral T>
bool parse_integer(std::string_view text, T min, T max, T& out) {
  if (text.empty()) return false;
  T value{};
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value, 10);
  if (error != std::errc() || end != text.data() + text.size() || value < min || value > max) return false;
  out = value;
  return true;
}

// Parses all of `text` as a finite number inside `range`.
inline bool parse_number(std::string_view text, const Interval& range, double& out) {
  const std::string s(text);  // strtod needs the terminator; from_chars for double is not in every libstdc++
  if (s.empty() || std::isspace(static_cast<unsigned char>(s[0]))) return false;
  char* end = nullptr;
  const double value = std::strtod(s.c_str(), &end);
  if (end != s.c_str() + s.size() || !range.contains(value)) return false;
  out = value;
  return true;
}

class CommandLine {
public:
  using Usage = std::function<void(const std::string& problem)>;  // must not return; an empty problem is --help

  CommandLine(int argc, char** argv, Usage usage) : argc_(argc), argv_(argv), usage_(std::move(usage)) {}

  // Moves to the next flag; false when none is left. --help / -h calls the usage with an empty problem.
  bool next() {
    if (++index_ >= argc_) return false;
    flag_ = argv_[index_];
    if (flag_ == "--help" || flag_ == "-h") {
      usage_(std::string());
      std::exit(0);  // a usage that returned
    }
    return true;
  }
  const std::string& flag() const noexcept { return flag_; }

  // The value after the current flag.
  std::string value() {
    if (index_ + 1 >= argc_) fail(flag_ + " needs a value");
    return argv_[++index_];
  }
  // An integer of type T in [min, max] (both inclusive).
  template <std::integral T>
  T integer(T min, T max = std::numeric_limits<T>::max()) {
    const std::string v = value();
    T x{};
    if (!parse_integer(v, min, max, x))
      fail(fmt::format("{} expects an integer in [{}, {}], got \"{}\"", flag_, min, max, v));
    return x;
  }
  // A finite number inside `range`.
  double number(const Interval& range) {
    const std::string v = value();
    double x = 0;
    if (!parse_number(v, range, x))
      fail(fmt::format("{} expects a finite number in {}, got \"{}\"", flag_, range.describe(), v));
    return x;
  }
  // One of two words; true for the first.
  bool choice(const char* first, const char* second) {
    const std::string v = value();
    if (v != first && v != second) fail(fmt::format("{} expects {} or {}, got \"{}\"", flag_, first, second, v));
    return v == first;
  }
  [[noreturn]] void unknown() { fail(fmt::format("unknown option \"{}\" (try --help)", flag_)); }
  [[noreturn]] void fail(const std::string& problem) {
    usage_(problem.empty() ? std::string("invalid arguments") : problem);
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
