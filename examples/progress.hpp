// examples/progress.hpp: TRANSITIONAL, for examples/train_gpt.cpp only (owned by another branch of issue 23): the
// progress line moved to paradyse/core/progress.hpp (paradyse::Progress). Delete this file when train_gpt.cpp includes
// paradyse/core/progress.hpp.
#pragma once

#include "paradyse/core/progress.hpp"

namespace paradyse::examples {
using paradyse::Progress;
}  // namespace paradyse::examples
