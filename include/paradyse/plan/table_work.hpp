// paradyse/plan/table_work.hpp: how much work building one cost table takes, so that a program can refuse a setting
// that would spend minutes on every sequence instead of running it.
//
// A cost table dry-runs every strategy's sublayers (cost/dry_run.hpp) on one rank of the group; the ring strategies
// record an event per attention block (one per sample row, query head and ring step: batch x heads x p) and the
// trace's replay keeps a clock per pair of ranks (p^2). Measured with plan_trace (one table per sequence plus the
// planners' cached ones, -O1 build, a loaded 2-core machine): about 1 us per unit of batch x heads x p and 11 us per
// p^2 (p = 8, 1024 rows, 512 heads: 3.8 s; p = 1024, 1024 heads: 12 s; p = 256, 256 heads: 0.7 s). The limit,
// 2^23 units, keeps one table under about 10 s there.
#pragma once

#include <cstdint>

namespace paradyse::plan {

// The work units of one cost table for `batch` rows of a layer with `heads` query heads on a group of p ranks.
inline double cost_table_work(std::int64_t batch, std::int64_t heads, std::int64_t p) {
  return double(batch) * double(heads) * double(p) + 12.0 * double(p) * double(p);
}

// The most work units a program should ask of one cost table (see the top).
inline constexpr double kMaxCostTableWork = 8'388'608.0;

}  // namespace paradyse::plan
