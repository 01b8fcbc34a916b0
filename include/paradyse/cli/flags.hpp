// paradyse/cli/flags.hpp: a program's command line, through CLI11 (Debian libcli11-dev): the example programs,
// the benchmarks and a user's own programs state their flags once; the usage (--help) is generated from that
// statement. The package component paradyse::cli (the static library paradyse_cli, src/cli/flags.cpp: CLI11 compiled
// once) holds the compiled part; CLI11 is needed only to build it, not by its users.
//
//   paradyse::cli::Flags flags("plan_trace", "Plans a trace of sequence lengths ...");
//   flags.integer("--steps", o.steps, 1, 1'000'000, "optimizer steps");
//   flags.number("--lr", o.lr, {.min = 0, .max = 10, .min_open = true}, "learning rate");
//   flags.choice("--order", o.order, {"sorted", "random"}, "sequence order");
//   flags.flag("--causal", o.causal, "causal attention");
//   flags.parse(argc, argv);                    // --help: usage on stdout, exit 0; a bad flag: exit 2
//   if (...) flags.fail("--heads must divide --hidden");   // a problem found after parsing: exit 2
//
// Every numeric flag states the range it accepts: integers are parsed straight into the destination type (no
// 64-bit value silently wrapping into an int, no hex or octal), numbers must be finite (no nan, no inf) and inside
// their interval, and a value outside is an error naming the flag, the value and the accepted range. A flag given
// twice takes its last value. With a problem the program prints "program: problem" and the usage to stderr and
// exits 2.
#pragma once

#include "paradyse/core/printable.hpp"

#include <fmt/format.h>

#include <cctype>
#include <charconv>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <initializer_list>
#include <limits>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

namespace CLI {
class App;
class Option;
}

namespace paradyse::cli {

// The usage of a program: on stdout with exit status 0 when `problem` is empty (--help), else on stderr after
// "program: problem", exit status 2.
[[noreturn]] inline void print_usage_and_exit(std::string_view program, const std::string& problem,
                                              std::string_view usage_text) {
  if (problem.empty()) {
    fmt::print(stdout, "{}", usage_text);
    std::fflush(stdout);
    std::exit(0);
  }
  fmt::print(stderr, "{}: {}\n{}", program, bounded_message(problem), usage_text);  // a long value clipped
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

// The error a flag's value check throws while Flags parses (Flags turns it into CLI11's validation error).
struct FlagValueError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// What stating a flag returns: `.without_default()` keeps the usage from showing a default, for flags whose default
// is derived from other flags (--kv-heads: default --heads).
class FlagOption {
public:
  explicit FlagOption(CLI::Option* option) : option_(option) {}
  FlagOption& without_default();
  // Refuses an empty value (`--mesh ""`) instead of taking it as "not given": "<flag> is empty; expected <what>".
  FlagOption& nonempty(const std::string& expected);

private:
  CLI::Option* option_;
};

// One program's flags (a CLI::App): stated once, parsed, and printed as the usage. CLI11 itself is compiled once, in
// src/cli/flags.cpp (the library paradyse_cli, paradyse::cli, that every program links): it is a large header, and
// each program that included it paid about 10 s of compile time.
class Flags {
public:
  Flags(std::string program, std::string description);
  ~Flags();
  Flags(const Flags&) = delete;
  Flags& operator=(const Flags&) = delete;

  const std::string& program() const { return program_; }

  // An integer of type T in [min, max] (both inclusive).
  template <std::integral T>
  FlagOption integer(const std::string& name, T& out, T min, T max, const std::string& help) {
    return value(name, help, fmt::format("INT in [{}, {}]", min, max), fmt::format("{}", out),
          [&out, min, max, name](const std::string& v) {
            if (!parse_integer(v, min, max, out))
              throw FlagValueError(fmt::format("{} expects an integer in [{}, {}], got \"{}\"", name, min, max, printable(v)));
          });
  }
  // Two integers of type T in [min, max] after one flag (--prompt MIN MAX).
  template <std::integral T>
  FlagOption integers(const std::string& name, T& first, T& second, T min, T max, const std::string& help) {
    return values(name, help, 2, fmt::format("INT INT in [{}, {}]", min, max), fmt::format("{} {}", first, second),
           [&first, &second, min, max, name](const std::vector<std::string>& v) {
             if (v.size() != 2) throw FlagValueError(fmt::format("{} expects two integers", name));
             T a{}, b{};
             for (const auto& [x, into] : {std::pair{&v[0], &a}, std::pair{&v[1], &b}})
               if (!parse_integer(*x, min, max, *into))
                 throw FlagValueError(
                     fmt::format("{} expects two integers in [{}, {}], got \"{}\"", name, min, max, printable(*x)));
             first = a;
             second = b;
           });
  }
  // A finite number inside `range`.
  FlagOption number(const std::string& name, double& out, const Interval& range, const std::string& help);
  // Any text (a file name, a list parsed by the program).
  FlagOption text(const std::string& name, std::string& out, const std::string& help, const std::string& type = "TEXT");
  // One word of `choices`.
  FlagOption choice(const std::string& name, std::string& out, std::vector<std::string> choices, const std::string& help);
  // One of two words: `out` is true for the first.
  FlagOption choice(const std::string& name, bool& out, const std::string& first, const std::string& second,
              const std::string& help);
  // A flag without a value: sets `out` to true.
  FlagOption flag(const std::string& name, bool& out, const std::string& help);
  // A flag without a value that runs `action`.
  FlagOption flag(const std::string& name, std::function<void()> action, const std::string& help);

  // The usage text, generated from the flags.
  std::string usage() const;

  // Parses; std::nullopt when the flags are good, "" for --help, else the problem.
  std::optional<std::string> problem(int argc, const char* const* argv);
  // Parses, or exits: --help prints the usage and exits 0; a problem exits 2 (see print_usage_and_exit).
  void parse(int argc, const char* const* argv) {
    if (const std::optional<std::string> p = problem(argc, argv)) print_usage_and_exit(program_, *p, usage());
  }
  // A problem found after parsing (flags that do not fit together): exits 2 with the usage.
  [[noreturn]] void fail(const std::string& problem) const {
    print_usage_and_exit(program_, problem.empty() ? std::string("invalid arguments") : problem, usage());
  }

private:
  // An option with one value (`count` values) of the given type text and default, checked and stored by `store`,
  // which throws FlagValueError for a bad value.
  FlagOption value(const std::string& name, const std::string& help, const std::string& type,
             const std::string& default_text, std::function<void(const std::string&)> store);
  FlagOption values(const std::string& name, const std::string& help, int count, const std::string& type,
              const std::string& default_text, std::function<void(const std::vector<std::string>&)> store);

  std::string program_;
  std::unique_ptr<CLI::App> app_;
};

}  // namespace paradyse::cli
