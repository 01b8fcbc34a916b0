// paradyse/cost/gemm_reuse.hpp: a GEMM priced at its weight's reuse distance: the weight bytes its rank read since it
// last read that weight.
//
// A serving step reads each of its rank's weights once (a layer's projections, its router, each expert it routes to,
// the lm_head). Where they come from depends on how many weight bytes the rank read in between: a decode step of 1-2
// tokens reads 2-4 experts a layer and its weights come back after a few MB; a prompt chunk routes to every expert and
// reads them all. On this machine (2 ranks, a 32 MB L3 shared) the model's GEMMs ran 0.54-0.87x as long cycling
// through a decode step's weights as through a whole step's (bench/serve_gemm_reuse), and the decode steps amid
// decode steps ran 10-25% further under their price than the steps with a prompt chunk (docs/serving_simulation.md).
// So the profile keeps the model's shapes measured at a few cycle sizes (GemmModel::measured and ::reuse, each with
// its cycle_bytes), and a rank's WeightReads follows its reads step after step; cost/trace_cost.hpp's cost_of, given
// them, prices each GEMM where its clock reaches it:
//
//   WeightReads reads;                                      // one per rank, kept across steps
//   SublayerCost k = cost_of(piece, &hw, 4, false, &reads); // its GEMMs at their distances, the reads advanced
//   double t = gemm_time(e, hw.gemm, 4, &reads);            // what cost_of charges one call of GEMM event e
//
// A weight is the b operand's address (TraceEvent::operand, recorded by ops::Counting's matmul: a dry run's meta
// shards keep their addresses from step to step); a run of merged GEMMs (TraceEvent::count) is one weight of count
// times n k elements. A weight not read before is as far as the largest table's cycle.
#pragma once

#include "paradyse/core/trace.hpp"
#include "paradyse/cost/profile.hpp"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <unordered_map>

namespace paradyse::cost {

class WeightReads {
public:
  // The reuse distance of `e`'s weight if it were read now: the bytes read since its last read ended, plus its own
  // (what a calibration cycling through that many bytes of copies measures); infinity: not read before.
  double distance(const TraceEvent& e, int dtype_bytes) const {
    const auto it = last_.find(e.operand);
    return it == last_.end() ? std::numeric_limits<double>::infinity() : read_ - it->second + bytes_of(e, dtype_bytes);
  }
  void read(const TraceEvent& e, int dtype_bytes) {
    read_ += bytes_of(e, dtype_bytes);
    last_[e.operand] = read_;
  }
  // Weight bytes read in all.
  double bytes_read() const noexcept { return read_; }
  std::size_t weights() const noexcept { return last_.size(); }
  // Weights remembered before forget_far_weights forgets the far ones (a dry run's shards of older layouts).
  static constexpr std::size_t kRemembered = 1 << 14;
  // Forgets the weights last read more than `beyond` bytes ago (they are as far as any table reaches).
  void forget_beyond(double beyond) {
    std::erase_if(last_, [&](const auto& w) { return read_ - w.second > beyond; });
  }

private:
  static double bytes_of(const TraceEvent& e, int dtype_bytes) { return double(e.count) * e.n * e.k * dtype_bytes; }
  double read_ = 0;
  std::unordered_map<std::uintptr_t, double> last_;  // weight -> read_ when its last read ended
};

// The largest cycle the model's measured tables were timed at (0: none recorded): beyond it nothing changes.
inline double largest_reuse_cycle(const GemmModel& g) {
  double largest = g.measured.cycle_bytes;
  for (const GemmMeasured& t : g.reuse) largest = std::max(largest, t.cycle_bytes);
  return largest;
}

// Whether `g` prices any GEMM by its reuse distance (it holds the measured shapes at other cycles besides measured's).
inline bool prices_reuse(const GemmModel& g) { return !g.reuse.empty(); }

// One call of GEMM event `e` on `g`: at its weight's reuse distance in `reads`, the read recorded there;
// GemmModel::time without reads, without a known operand, or where `g` has no reuse tables (nothing recorded then).
// An item after the first of a grouped call (e.grouped) is priced as one (GemmModel::grouped_item_time).
inline double gemm_time(const TraceEvent& e, const GemmModel& g, int dtype_bytes, WeightReads* reads) {
  double alone = 0;
  if (!reads || e.operand == 0 || !prices_reuse(g)) {
    alone = g.time(e.m, e.n, e.k, dtype_bytes);
  } else {
    alone = g.time_at_reuse(e.m, e.n, e.k, dtype_bytes, reads->distance(e, dtype_bytes));
    reads->read(e, dtype_bytes);
  }
  return e.grouped ? g.grouped_item_time(alone, e.m, e.n, e.k, dtype_bytes) : alone;
}

// Past WeightReads::kRemembered weights (a dry run's shards of older layouts), forgets those farther than any of
// `g`'s tables reaches (they are priced alike).
inline void forget_far_weights(WeightReads& reads, const GemmModel& g) {
  if (reads.weights() > WeightReads::kRemembered) reads.forget_beyond(largest_reuse_cycle(g));
}

}  // namespace paradyse::cost
