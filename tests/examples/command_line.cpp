// Tests of examples/command_line.hpp, the flag reader of the example programs: integers parse into their
// destination type without wrapping, numbers must be finite and inside their interval, errors name the flag, the
// value and the accepted range, and --help reaches the usage with an empty problem.
#include "../../examples/command_line.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

using paradyse::examples::CommandLine;
using paradyse::examples::Interval;

namespace {

// What the usage callback was called with (it throws instead of exiting, so the test goes on).
struct UsageCalled {
  std::string problem;
};

// Runs `read` on a command line of `args` and returns the problem the usage was called with ("" for --help,
// "none" when it was not called).
template <class Read>
std::string problem_of(std::vector<std::string> args, Read read) {
  args.insert(args.begin(), "program");
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  CommandLine cli(int(argv.size()), argv.data(), [](const std::string& problem) { throw UsageCalled{problem}; });
  try {
    while (cli.next()) read(cli);
  } catch (const UsageCalled& u) {
    return u.problem;
  }
  return "none";
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("command line: an integer beyond its type is an error naming the flag, the value and the range") {
  int steps = 0;
  auto read_steps = [&](CommandLine& cli) { steps = cli.integer<int>(1, 10'000'000); };
  CHECK(problem_of({"--steps", "3000"}, read_steps) == "none");
  CHECK(steps == 3000);
  // 3e9 wrapped to -1294967296 through int(int64); 2^32 + 4 wrapped to 4.
  for (const char* wraps : {"3000000000", "4294967300", "4294967297", "99999999999999999999999", "-1", "0"}) {
    CAPTURE(wraps);
    const std::string problem = problem_of({"--steps", wraps}, read_steps);
    CHECK(contains(problem, "--steps expects an integer in [1, 10000000]"));
    CHECK(contains(problem, std::string("got \"") + wraps + "\""));
  }
  for (const char* junk : {"12x", "", "1e3", " 5", "0x10", "+-3"}) {
    CAPTURE(junk);
    CHECK(contains(problem_of({"--steps", junk}, read_steps), "expects an integer"));
  }
  std::uint64_t seed = 0;
  CHECK(problem_of({"--seed", "18446744073709551615"}, [&](CommandLine& cli) { seed = cli.integer<std::uint64_t>(0); }) == "none");
  CHECK(seed == std::numeric_limits<std::uint64_t>::max());
  CHECK(contains(problem_of({"--seed", "-1"}, [&](CommandLine& cli) { seed = cli.integer<std::uint64_t>(0); }),
                 "--seed expects an integer in [0, 18446744073709551615], got \"-1\""));
}

TEST_CASE("command line: numbers must be finite and inside their interval") {
  double cap = 0;
  auto read_cap = [&](CommandLine& cli) { cap = cli.number({.min = 0, .max = 1 << 30, .min_open = true}); };
  CHECK(problem_of({"--cap-mib", "7.5"}, read_cap) == "none");
  CHECK(cap == 7.5);
  for (const char* bad : {"inf", "-inf", "nan", "1e14", "1e999", "0", "-5", "", "3MiB"}) {
    CAPTURE(bad);
    const std::string problem = problem_of({"--cap-mib", bad}, read_cap);
    CHECK(contains(problem, "--cap-mib expects a finite number in (0, 1073741824]"));
    CHECK(contains(problem, std::string("got \"") + bad + "\""));
  }
  double gamma = -1;
  auto read_gamma = [&](CommandLine& cli) { gamma = cli.number({.min = 0, .max = 1}); };
  CHECK(problem_of({"--gamma", "0"}, read_gamma) == "none");
  CHECK(problem_of({"--gamma", "1"}, read_gamma) == "none");
  CHECK(contains(problem_of({"--gamma", "-1"}, read_gamma), "--gamma expects a finite number in [0, 1], got \"-1\""));
  CHECK(contains(problem_of({"--gamma", "nan"}, read_gamma), "got \"nan\""));
  CHECK(Interval{.min = 0, .max = 1, .max_open = true}.contains(0.5));
  CHECK_FALSE(Interval{.min = 0, .max = 1, .max_open = true}.contains(1));
  CHECK_FALSE(Interval{}.contains(std::numeric_limits<double>::infinity()));
}

TEST_CASE("command line: --help and -h reach the usage with no problem; other mistakes with one") {
  auto ignore = [](CommandLine& cli) {
    if (cli.flag() == "--x") cli.value();
    else cli.unknown();
  };
  CHECK(problem_of({"--help"}, ignore).empty());
  CHECK(problem_of({"--x", "1", "-h"}, ignore).empty());
  CHECK(contains(problem_of({"--bogus"}, ignore), "unknown option \"--bogus\""));
  CHECK(problem_of({"--x"}, ignore) == "--x needs a value");
}
