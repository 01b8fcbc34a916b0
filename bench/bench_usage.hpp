// bench/bench_usage.hpp: the benchmarks' command lines. Each benchmark states its flags once through
// paradyse::bench::Flags (examples/command_line.hpp, over CLI11); --help prints the usage generated from them and
// exits 0, a bad flag or value prints the problem and the usage and exits 2.
#pragma once

#include "../examples/command_line.hpp"

namespace paradyse::bench {

using examples::Flags;
using examples::Interval;

}  // namespace paradyse::bench
