// bench/bench_usage.hpp: what every benchmark does with --help (or -h): print its usage and exit 0.
#pragma once

#include <fmt/core.h>

#include <cstdlib>
#include <string_view>

namespace paradyse::bench {

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
