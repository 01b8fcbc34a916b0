// tests/cost/small_calibration.hpp: calibration options small enough to calibrate in well under a second, every kind
// of host measurement still made (tests/cost/calibration_passes.cpp, collective_ranges.cpp).
#pragma once

#include "paradyse/cost/calibration_options.hpp"

#include <cstdint>

namespace paradyse::testing {

inline cost::CalibrationOptions small_calibration_options() {
  cost::CalibrationOptions o;
  o.repetitions = 1;
  o.gemm_shapes = {{32, 32, 32}, {64, 32, 32}, {32, 64, 48}, {64, 64, 64}};
  o.gemm_thin_shapes = {{64, 64, 8}, {64, 8, 64}, {128, 128, 8}};
  o.gemm_thin_cold_bytes = std::int64_t(1) << 18;
  o.attention_heads = 2;
  o.head_dim = 8;
  o.attention_lengths = {16, 32, 64};
  o.attention_whole_tiles = true;
  o.copy_bytes = {std::int64_t(1) << 12, std::int64_t(1) << 14};
  o.copy_memory_bytes = std::int64_t(1) << 16;
  o.copy_memory_piece_bytes = std::int64_t(1) << 12;
  o.message_bytes = {std::int64_t(1) << 10, std::int64_t(1) << 12, std::int64_t(1) << 14};
  o.large_message_bytes = std::int64_t(1) << 12;
  o.fresh_bytes = {std::int64_t(1) << 12, std::int64_t(1) << 14};
  o.fresh_working_set_bytes = std::int64_t(1) << 16;
  o.elementwise_class_rows = {4, 16};
  o.pool_miss_bytes = {std::int64_t(1) << 12};
  o.call_overheads = true;
  return o;
}

}  // namespace paradyse::testing
