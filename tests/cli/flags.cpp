// Tests of paradyse/cli/flags.hpp, the command lines of the example programs and benchmarks (CLI11 through
// Flags): integers parse into their destination type without wrapping, numbers must be finite and inside their
// interval, errors name the flag, the value and the accepted range, --help is not a problem, and the usage is
// generated from the flags (each flag with its range and default).
#include "paradyse/cli/flags.hpp"
#include "paradyse/cli/model_flags.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

using paradyse::cli::Flags;
using paradyse::cli::Interval;

namespace {

// The problem Flags reports for `args`: "none" when they parse, "" for --help.
std::string flags_problem(Flags& flags, std::vector<std::string> args) {
  args.insert(args.begin(), flags.program());
  std::vector<const char*> argv;
  for (const std::string& a : args) argv.push_back(a.c_str());
  const std::optional<std::string> problem = flags.problem(int(argv.size()), argv.data());
  return problem ? *problem : "none";
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("command line: an integer beyond its type is an error naming the flag, the value and the range") {
  int steps = 7;
  auto problem = [&](std::vector<std::string> args) {
    Flags flags("program", "a test");
    flags.integer("--steps", steps, 1, 10'000'000, "steps");
    return flags_problem(flags, std::move(args));
  };
  CHECK(problem({}) == "none");
  CHECK(steps == 7);  // the default stays
  CHECK(problem({"--steps", "3000"}) == "none");
  CHECK(steps == 3000);
  CHECK(problem({"--steps=42"}) == "none");
  CHECK(steps == 42);
  CHECK(problem({"--steps", "5", "--steps", "6"}) == "none");  // the last one counts
  CHECK(steps == 6);
  // 3e9 wrapped to -1294967296 through int(int64); 2^32 + 4 wrapped to 4.
  for (const char* wraps : {"3000000000", "4294967300", "4294967297", "99999999999999999999999", "-1", "0"}) {
    CAPTURE(wraps);
    const std::string p = problem({"--steps", wraps});
    CHECK(contains(p, "--steps expects an integer in [1, 10000000]"));
    CHECK(contains(p, std::string("got \"") + wraps + "\""));
  }
  for (const char* junk : {"12x", "", "1e3", " 5", "0x10", "010x", "+-3"}) {
    CAPTURE(junk);
    CHECK(contains(problem({"--steps", junk}), "expects an integer"));
  }
  std::uint64_t seed = 0;
  auto seed_problem = [&](const char* value) {
    Flags flags("program", "a test");
    flags.integer("--seed", seed, std::uint64_t(0), std::numeric_limits<std::uint64_t>::max(), "seed");
    return flags_problem(flags, {"--seed", value});
  };
  CHECK(seed_problem("18446744073709551615") == "none");
  CHECK(seed == std::numeric_limits<std::uint64_t>::max());
  CHECK(contains(seed_problem("-1"), "--seed expects an integer in [0, 18446744073709551615], got \"-1\""));
}

TEST_CASE("command line: numbers must be finite and inside their interval") {
  double cap = 0;
  auto cap_problem = [&](std::vector<std::string> args) {
    Flags flags("program", "a test");
    flags.number("--cap-mib", cap, {.min = 0, .max = 1 << 30, .min_open = true}, "cap");
    return flags_problem(flags, std::move(args));
  };
  CHECK(cap_problem({"--cap-mib", "7.5"}) == "none");
  CHECK(cap == 7.5);
  for (const char* bad : {"inf", "nan", "1e14", "1e999", "0", "-5", "", "3MiB"}) {
    CAPTURE(bad);
    const std::string p = cap_problem({"--cap-mib", bad});
    CHECK(contains(p, "--cap-mib expects a finite number in (0, 1073741824]"));
    CHECK(contains(p, std::string("got \"") + bad + "\""));
  }
  CHECK(contains(cap_problem({"--cap-mib=-inf"}), "got \"-inf\""));
  double gamma = -1;
  auto gamma_problem = [&](const char* value) {
    Flags flags("program", "a test");
    flags.number("--gamma", gamma, {.min = 0, .max = 1}, "gamma");
    return flags_problem(flags, {"--gamma", value});
  };
  CHECK(gamma_problem("0") == "none");
  CHECK(gamma_problem("1") == "none");
  CHECK(contains(gamma_problem("-1"), "--gamma expects a finite number in [0, 1], got \"-1\""));
  CHECK(contains(gamma_problem("nan"), "got \"nan\""));
  CHECK(Interval{.min = 0, .max = 1, .max_open = true}.contains(0.5));
  CHECK_FALSE(Interval{.min = 0, .max = 1, .max_open = true}.contains(1));
  CHECK_FALSE(Interval{}.contains(std::numeric_limits<double>::infinity()));
}

TEST_CASE("command line: choices, flags, --help, unknown and missing values") {
  std::string dataset = "all";
  bool sorted = true, causal = false;
  int x = 0;
  auto problem = [&](std::vector<std::string> args) {
    Flags flags("program", "a test");
    flags.choice("--dataset", dataset, {"githubcode", "grch38", "all"}, "dataset");
    flags.choice("--order", sorted, "sorted", "random", "order");
    flags.flag("--causal", causal, "causal");
    flags.integer("--x", x, 0, 9, "x");
    return flags_problem(flags, std::move(args));
  };
  CHECK(problem({"--dataset", "grch38", "--order", "random", "--causal"}) == "none");
  CHECK(dataset == "grch38");
  CHECK_FALSE(sorted);
  CHECK(causal);
  CHECK(contains(problem({"--dataset", "imagenet"}), "--dataset expects one of githubcode|grch38|all, got \"imagenet\""));
  CHECK(contains(problem({"--order", "shuffled"}), "--order expects sorted or random, got \"shuffled\""));
  CHECK(problem({"--help"}).empty());
  CHECK(problem({"--x", "1", "-h"}).empty());
  CHECK(contains(problem({"--bogus"}), "--bogus"));
  CHECK(contains(problem({"--bogus"}), "(try --help)"));
  CHECK(contains(problem({"--x"}), "--x"));
  CHECK_FALSE(contains(problem({"--x"}), "none"));
}

TEST_CASE("command line: the usage is generated from the flags, with ranges and defaults") {
  int steps = 300;
  double lr = 0.003;
  std::string order = "random";
  bool flag = false;
  Flags flags("train", "Trains a model.");
  flags.integer("--steps", steps, 1, 1'000'000, "optimizer steps");
  flags.number("--lr", lr, {.min = 0, .max = 10, .min_open = true}, "learning rate");
  flags.choice("--order", order, {"random", "sorted"}, "data order");
  flags.flag("--check", flag, "check gradients");
  const std::string usage = flags.usage();
  CAPTURE(usage);
  CHECK(contains(usage, "Trains a model."));
  CHECK(contains(usage, "--steps INT in [1, 1000000]=300"));
  CHECK(contains(usage, "optimizer steps"));
  CHECK(contains(usage, "--lr NUM in (0, 10]=0.003"));
  CHECK(contains(usage, "--order random|sorted=random"));
  CHECK(contains(usage, "--check"));
  CHECK(contains(usage, "--help"));
}

TEST_CASE("model flags: the head dimension is --hidden / --heads, refused naming both flags when not whole") {
  // One check for train_gpt, plan_trace, custom_block and bench/emulated_switching (issue 27: the benchmark
  // truncated 4097 / 32 to 128).
  CHECK(paradyse::cli::head_dim_of(4096, 32) == 128);
  CHECK(paradyse::cli::head_dim_of(7, 7) == 1);
  CHECK_THROWS_WITH_AS(paradyse::cli::head_dim_of(4097, 32),
                       "--hidden 4097 is not a multiple of --heads 32 (head dimension 128.031): pick --hidden a "
                       "multiple of --heads",
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(paradyse::cli::head_dim_of(10, 4, "give --head-dim explicitly"),
                       "--hidden 10 is not a multiple of --heads 4 (head dimension 2.5): pick --hidden a multiple of "
                       "--heads, or give --head-dim explicitly",
                       std::invalid_argument);
  CHECK_THROWS_AS(paradyse::cli::head_dim_of(8, 0), std::invalid_argument);
}

TEST_CASE("command line: a long bad value is echoed clipped, with its length") {
  int steps = 1;
  Flags flags("train", "Trains a model.");
  flags.integer("--steps", steps, 1, 10, "steps");
  const std::string problem = flags_problem(flags, {"--steps", std::string(100000, '9')});
  CHECK(problem.size() < 400);
  CHECK(contains(problem, "... (100000 bytes)"));
}
