// examples/csv_table.hpp: TRANSITIONAL, for train_gpt's files only (examples/train_gpt.cpp, train_mesh.hpp,
// train_moe.hpp, owned by another branch of issue 23): the CSV writer moved to paradyse/core/csv_table.hpp
// (paradyse::CsvTable). Delete this file when they include paradyse/core/csv_table.hpp.
#pragma once

#include "paradyse/core/csv_table.hpp"

namespace paradyse::examples {
using paradyse::CsvTable;
}  // namespace paradyse::examples
