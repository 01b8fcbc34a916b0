// bench/bench_usage.hpp: the benchmarks' command lines. Each benchmark states its flags once through
// paradyse::bench::Flags (examples/command_line.hpp, over CLI11); --help prints the usage generated from them and
// exits 0, a bad flag or value prints the problem and the usage and exits 2.
//
// exit_with_usage_on_help stays for the CUDA benchmarks, which are only built on a GPU machine and still write their
// usage by hand.
#pragma once

#include "../examples/command_line.hpp"

#include <fmt/core.h>

#include <cstdlib>
#include <string_view>

namespace paradyse::bench {

using examples::Flags;
using examples::Interval;

// Prints `usage` and exits 0 when any argument asks for help; returns otherwise.
inline void exit_with_usage_on_help(int argc, char** argv, std::string_view usage) {
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      fmt::print("{}", usage);
      std::exit(0);
    }
  }
}

}  // namespace paradyse::bench
