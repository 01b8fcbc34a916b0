// examples/command_line.hpp: TRANSITIONAL, for train_gpt's files only (examples/train_gpt.cpp, owned by another branch
// of issue 23): the command line moved to paradyse/cli/flags.hpp (namespace paradyse::cli). Delete this file when
// train_gpt.cpp includes paradyse/cli/flags.hpp and names cli::Flags.
#pragma once

#include "paradyse/cli/flags.hpp"

namespace paradyse::examples {
using cli::Flags;
using cli::FlagOption;
using cli::Interval;
using cli::parse_integer;
using cli::parse_number;
using cli::print_usage_and_exit;
}  // namespace paradyse::examples
