// paradyse/serve/step_trace.hpp: what one engine step did, as the time model needs it: the batch (each chunk's new
// tokens and the positions its request had cached before), the layout every MoE layer computed in, the expert loads
// of its routing, and the layouts installed by the step (a TP<->EP switch or an EPLB placement), plus the rows each
// rank computes in a layout (shared by the engine's statistics and the cost).
//
// The engine fills one per step (serve/engine.hpp) and hands it to its clock (serve/clock.hpp): the simulated clock
// advances by the cost of its dry run (serve/step_dry_run.hpp), observers record the routing
// (serve/routing_source.hpp) or the layout over time.
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/serve/redistribute.hpp"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

namespace paradyse::serve {

struct ChunkShape {
  std::int64_t tokens = 0;  // new positions this step
  std::int64_t cached = 0;  // positions the request's cache held before the step
  bool decode = false;      // a decode token (else a prompt chunk)
};

struct StepTrace {
  int ranks = 1;
  std::int64_t admitted = 0;                          // requests admitted this step (the engine's plan names them)
  std::vector<ChunkShape> chunks;
  std::vector<std::vector<std::int64_t>> routed;      // [layers][E]: (token, expert) pairs; empty for dense layers
  std::vector<ExpertLayout> layout;                   // [layers]: each MoE layer's layout before the step
  std::vector<std::optional<ExpertLayout>> next;      // [layers]: the layout installed by this step, when it changes
  bool pipelined_switch = true;                       // the change travels layer by layer behind compute (the step
                                                      // computes in `layout`); else it stalls before the step, which
                                                      // computes in `next`
  std::int64_t planning_events = 0;                   // trace events rank 0's scheduler dry-ran planning the step
                                                      // (the dynamic policy's forecast: host work before the step)

  std::int64_t tokens() const {
    std::int64_t n = 0;
    for (const ChunkShape& c : chunks) n += c.tokens;
    return n;
  }
  // Whether a prompt chunk rides in the step (else it holds decode tokens alone).
  bool has_prompt() const {
    return std::any_of(chunks.begin(), chunks.end(), [](const ChunkShape& c) { return !c.decode; });
  }
  bool changes_layout() const {
    for (const auto& n : next)
      if (n) return true;
    return false;
  }
};

// The layout the step's MoE layers computed in, "TP" or "EP" (the first MoE layer's: its layout before the step, or
// the one a switch that stalls installed before it), or "dense" for a model without MoE layers.
inline std::string_view computed_layout(const StepTrace& t) {
  for (std::size_t l = 0; l < t.layout.size(); ++l) {
    if (t.routed.empty() || t.routed[l].empty()) continue;
    const bool stalled = !t.pipelined_switch && l < t.next.size() && t.next[l];
    return name_of(stalled ? t.next[l]->mode : t.layout[l].mode);
  }
  return "dense";
}

// Rows (token, expert pairs) each of p ranks computes in one MoE layer: TP: every pair (a slice of every expert);
// EP: the pairs of its slots, an expert held by m ranks split evenly over them (holder i of m, in rank then slot
// order, takes chunk_range(count, m, i)), as the engine's default EP work does (serve/decoder_step.hpp).
inline std::vector<std::int64_t> rows_per_rank(const ExpertLayout& layout, const std::vector<std::int64_t>& routed,
                                               int p) {
  std::vector<std::int64_t> rows(static_cast<std::size_t>(p), 0);
  if (layout.mode == MoeMode::tp) {
    std::int64_t all = 0;
    for (const std::int64_t r : routed) all += r;
    std::fill(rows.begin(), rows.end(), all);
    return rows;
  }
  check(int(layout.placement.size()) == p, "rows_per_rank: an EP placement of {} ranks for p = {}",
        layout.placement.size(), p);
  std::vector<std::int64_t> holders(routed.size(), 0), seen(routed.size(), 0);
  for (const auto& slots : layout.placement)
    for (const std::int64_t e : slots) ++holders[std::size_t(e)];
  for (int q = 0; q < p; ++q)
    for (const std::int64_t e : layout.placement[std::size_t(q)]) {
      const std::size_t i = std::size_t(e);
      rows[std::size_t(q)] += chunk_range(routed[i], holders[i], seen[i]++).length;
    }
  return rows;
}

}  // namespace paradyse::serve
