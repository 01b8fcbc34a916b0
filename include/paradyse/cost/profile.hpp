// paradyse/cost/profile.hpp: a hardware profile, the plain value the time and memory models read.
//
// A profile says, per device: its memory, how fast it runs GEMMs (with their dependence on size), attention and
// elementwise kernels, and per collective and group size an alpha-beta cost for each link level (inside a node,
// across nodes). Built-in profiles are in cost/builtin_profiles.hpp; `calibrate` (cost/calibrate.hpp) measures the
// machine at hand and fits one. Profiles load from and save to JSON through cost/profile_json.hpp (kept apart so that
// the many headers that need only the profile do not compile the JSON library).
//
// Collective sizes follow nccl-tests: `bytes` is the size of the whole array, i.e. the output of all_gather, the
// input of reduce_scatter, the buffer of all_reduce / broadcast / reduce, one rank's input of all_to_all and one
// message of send_recv (a ring shift: every rank sends one message and receives one).
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/statistics.hpp"
#include "paradyse/core/trace.hpp"  // ElementwiseFamily

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace paradyse::cost {

enum class Collective : std::uint8_t { all_gather, reduce_scatter, all_reduce, all_to_all, broadcast, reduce, send_recv };
inline constexpr std::array<Collective, 7> kAllCollectives{Collective::all_gather, Collective::reduce_scatter,
                                                           Collective::all_reduce, Collective::all_to_all,
                                                           Collective::broadcast,  Collective::reduce,
                                                           Collective::send_recv};

constexpr std::string_view name_of(Collective c) {
  switch (c) {
    case Collective::all_gather: return "all_gather";
    case Collective::reduce_scatter: return "reduce_scatter";
    case Collective::all_reduce: return "all_reduce";
    case Collective::all_to_all: return "all_to_all";
    case Collective::broadcast: return "broadcast";
    case Collective::reduce: return "reduce";
    case Collective::send_recv: return "send_recv";
  }
  return "?";
}

enum class LinkLevel : std::uint8_t { intra_node, inter_node };
constexpr std::string_view name_of(LinkLevel l) { return l == LinkLevel::intra_node ? "intra_node" : "inter_node"; }

// nccl-tests' bus-bandwidth factor: bytes each rank's busiest link carries per byte of `bytes` (a ring algorithm).
constexpr double bus_factor(Collective c, int p) {
  if (p <= 1) return 0;
  switch (c) {
    case Collective::all_gather:
    case Collective::reduce_scatter:
    case Collective::all_to_all: return double(p - 1) / p;
    case Collective::all_reduce: return 2.0 * (p - 1) / p;
    case Collective::broadcast:
    case Collective::reduce:
    case Collective::send_recv: return 1;
  }
  return 1;
}

// Latency-bound steps of the same ring algorithm.
constexpr int latency_steps(Collective c, int p) {
  if (p <= 1) return 0;
  switch (c) {
    case Collective::all_reduce: return 2 * (p - 1);
    case Collective::send_recv: return 1;
    default: return p - 1;
  }
}

// t = alpha + beta * bytes.
struct AlphaBeta {
  double alpha_s = 0;
  double beta_s_per_byte = 0;
  double time(double bytes) const { return alpha_s + beta_s_per_byte * bytes; }
};

// A measured (or datasheet-derived) cost of one collective on one group size and link level, for sizes from
// `min_bytes` up (several entries of one collective split its sizes into ranges: a calibrated CPU backend is faster
// while messages stay in cache).
struct CollectiveCost {
  Collective op = Collective::all_gather;
  LinkLevel level = LinkLevel::intra_node;
  int group_size = 2;
  AlphaBeta cost;
  std::int64_t min_bytes = 0;
};

// The default for a collective that has no entry: a ring over links of this latency and bus bandwidth.
struct LinkModel {
  double launch_s = 0;          // fixed cost of one collective call
  double step_latency_s = 0;    // per ring step
  double bus_bytes_per_s = 1;   // achieved bus bandwidth of ring collectives (nccl-tests busbw)
  double p2p_bytes_per_s = 1;   // achieved bandwidth of one send/recv pair, all ranks shifting at once
};

// GEMM time: t = overhead + flops / rate + operand bytes / bandwidth. The two roofline terms are added rather than
// maxed so that the form is linear in its coefficients (least squares fits it) and the achieved rate rises
// smoothly with size, as it does on real devices: small and skinny GEMMs are bound by their operands, big ones by
// the rate. `flops = 2 m n k`, `bytes = (m k + k n + m n) * dtype bytes`.
//
// The single fit covers every size. A profile may refine it by size class (`by_rows`): GEMMs of at most `max_rows`
// rows (m), e.g. decode GEMMs (m <= 16) and the expert GEMMs of a prefill chunk (m <= 128) against weights read from
// memory, where one linear form over all sizes missed by 25-35% (docs/serving_simulation.md). A class has its own
// terms, in the features that explain small GEMMs measured with cold weights (cost/calibrate.hpp
// calibrate_gemm_classes): t = overhead + flops / rate + weight bytes (n k) / bandwidth + output elements (m n) /
// output rate. The activations' reads (m k) are no term: their coefficient fitted to 0, while the outputs' was
// needed (the same flops and weight bytes took twice as long with n = 512, k = 256 as with n = 256, k = 512).
// A GEMM takes the first class whose max_rows holds its m (classes ascending), else the single fit; a profile
// without classes (every built-in one, and profile JSON written before them) is the single fit alone.
struct GemmRowClass {
  double max_rows = 0;          // this class: GEMMs with m <= max_rows (and above the previous class's)
  double overhead_s = 0;
  double flops_per_s = 1;
  double bytes_per_s = 0;       // weight operand (n k) bytes per second; 0: no term
  double outputs_per_s = 0;     // output elements (m n) per second; 0: no term
  double time(double m, double n, double k, int dtype_bytes) const {
    return overhead_s + 2 * m * n * k / flops_per_s + (bytes_per_s > 0 ? n * k * dtype_bytes / bytes_per_s : 0) +
           (outputs_per_s > 0 ? m * n / outputs_per_s : 0);
  }
  friend bool operator==(const GemmRowClass&, const GemmRowClass&) = default;
};

// A workload's own GEMMs as measured (`measured`): per weight shape (n, k), its times at a few row counts m. The
// class fits above share their terms across shapes, and their errors do not average out within a step: on this
// machine's serving calibration one shape (n 256, k 512, an expert's down projection under EP) ran 14-27% over its
// class's price at every m, another (n 64) 8-15% under, so a step's price moved with which shapes it ran (Vidur
// prices each operator from its own profiled times for the same reason). A GEMM of a measured shape, of the dtype it
// was measured in, with m within the measured rows, is priced by linear interpolation in m between the two measured
// rows around it (a measured row: its own time); any other GEMM by the fits.
struct GemmMeasuredShape {
  double n = 0, k = 0;
  std::vector<double> rows;     // m, strictly ascending
  std::vector<double> seconds;  // the time at each row
  bool holds(double m) const { return !rows.empty() && m >= rows.front() && m <= rows.back(); }
  double time(double m) const {
    const auto hi = std::size_t(std::lower_bound(rows.begin(), rows.end(), m) - rows.begin());
    if (rows[hi] == m || hi == 0) return seconds[hi];
    const double f = (m - rows[hi - 1]) / (rows[hi] - rows[hi - 1]);
    return seconds[hi - 1] + f * (seconds[hi] - seconds[hi - 1]);
  }
  friend bool operator==(const GemmMeasuredShape&, const GemmMeasuredShape&) = default;
};

// `cycle_bytes`: the weight bytes a rank cycled through between two reads of one weight when the shapes were timed
// (cost/calibrate.hpp GemmClassOptions::cold_bytes): the reuse distance they were measured at (GemmModel::reuse).
// `call_overhead_s`: the fixed cost within each measured time that an item of a grouped call does not pay (a device's
// launch: what grouping saved per item where it was measured, bench/serve_experts); 0: the times are kept whole.
struct GemmMeasured {
  int dtype_bytes = 4;                    // the element size the shapes were measured in
  std::vector<GemmMeasuredShape> shapes;  // at most one per (n, k)
  double cycle_bytes = 0;                 // 0: not recorded
  double call_overhead_s = 0;             // 0: none apart
  const GemmMeasuredShape* find(double m, double n, double k, int dtype) const {
    if (dtype != dtype_bytes) return nullptr;
    for (const GemmMeasuredShape& s : shapes)
      if (s.n == n && s.k == k) return s.holds(m) ? &s : nullptr;
    return nullptr;
  }
  friend bool operator==(const GemmMeasured&, const GemmMeasured&) = default;
};

// The linear form of the single fit and of the head-width class: t = overhead + flops / rate + operand bytes /
// bandwidth (bandwidth 0: no operand term).
inline double linear_gemm_time(double overhead_s, double flops_per_s, double bytes_per_s, double m, double n, double k,
                               int dtype_bytes) {
  const double bytes = (m * k + k * n + m * n) * dtype_bytes;
  return overhead_s + 2 * m * n * k / flops_per_s + (bytes_per_s > 0 ? bytes / bytes_per_s : 0);
}

// Head-width GEMMs (`thin`): products whose short side, min(n, k), is at most `max_side`: the per-head products of
// attention materialised (ColossalZ: scores [n, keys] = q k^T with k the head dimension, P v with n the head
// dimension, and their gradients). The CPU kernel packs their large operand for a few flops per element, so they are
// bound by its bytes (44-73 GFLOP/s on this machine's 2 ranks against 180-280 for the compute-bound shapes), and the
// single fit, whose operand term the compute-bound shapes leave to the noise (0 in one calibration, 4.6 GB/s in the
// next), priced them anywhere between a third of their time and all of it. Their own terms, fitted on such shapes
// with their operands from memory (cost/calibrate.hpp, CalibrationOptions::gemm_thin_shapes): t = overhead +
// flops / rate + operand bytes / bandwidth. max_side 0 (built-in profiles, profile JSON written before): none.
// One fit for both orientations missed each: on an Intel Xeon VM (2 MiB of L2 a core) the output-heavy 1024x1024x32
// (scores, 4 MiB out) ran 1.60 ms against 1.22 fitted and 1024x32x1024 1.11, where at 256 and 512 rows the other
// orientation was the slower; flops and bytes grow together over such shapes, so no linear terms tell them apart.
// The calibration's own shapes, which train_gpt picks as a step's blocks on its ranks (examples/train_gpt/
// hardware.hpp), are therefore kept as timed too (`timed`, float32, one row each): a GEMM of one of them is priced at
// its time, any other head-width GEMM by the fit.
struct GemmThinClass {
  double max_side = 0;
  double overhead_s = 0;
  double flops_per_s = 1;
  double bytes_per_s = 0;  // 0: no operand term
  GemmMeasured timed = {};  // the calibration's shapes as timed (one row each); empty: the fit for every shape
  bool holds(double n, double k) const { return max_side > 0 && std::min(n, k) <= max_side; }
  double time(double m, double n, double k, int dtype_bytes) const {
    if (const GemmMeasuredShape* s = timed.find(m, n, k, dtype_bytes)) return s->time(m);
    return linear_gemm_time(overhead_s, flops_per_s, bytes_per_s, m, n, k, dtype_bytes);
  }
  friend bool operator==(const GemmThinClass&, const GemmThinClass&) = default;
};

struct GemmModel {
  double overhead_s = 0;
  double flops_per_s = 1;
  double bytes_per_s = 0;  // 0: no operand term
  std::vector<GemmRowClass> by_rows = {};  // ascending max_rows; empty: the single fit for every size
  GemmThinClass thin = {};                 // head-width products (before the row classes); max_side 0: none
  GemmMeasured measured = {};              // a workload's shapes as measured (before every fit); empty: none
  std::vector<GemmMeasured> reuse = {};    // the same shapes at other reuse distances than measured's (ascending
                                           // cycle_bytes, each recorded); empty: none (time_at_reuse)
  // The fixed cost an item after the first adds to a grouped call (ops/cpu/gemm_grouped.hpp: cuBLAS's grouped GEMM
  // launches every item at once); unset: each item is a call of its own, as the CPU backend's loop makes it.
  std::optional<double> grouped_item_s = std::nullopt;

  // The class of a GEMM of m rows: its index in by_rows, or -1 for the single fit.
  int row_class(double m) const {
    for (std::size_t i = 0; i < by_rows.size(); ++i)
      if (m <= by_rows[i].max_rows) return int(i);
    return -1;
  }
  double time(double m, double n, double k, int dtype_bytes) const {
    if (m <= 0 || n <= 0 || k <= 0) return 0;
    if (const GemmMeasuredShape* s = measured.find(m, n, k, dtype_bytes)) return s->time(m);
    if (thin.holds(n, k)) return thin.time(m, n, k, dtype_bytes);
    if (const int c = row_class(m); c >= 0) return by_rows[std::size_t(c)].time(m, n, k, dtype_bytes);
    return linear_gemm_time(overhead_s, flops_per_s, bytes_per_s, m, n, k, dtype_bytes);
  }
  // The fixed cost within time(m, n, k) that a call of its own pays (its fit's overhead; a measured shape's table's
  // call_overhead_s, 0 unless recorded).
  double call_overhead(double m, double n, double k, int dtype_bytes) const {
    if (measured.find(m, n, k, dtype_bytes)) return measured.call_overhead_s;
    if (thin.holds(n, k)) return thin.timed.find(m, n, k, dtype_bytes) ? 0 : thin.overhead_s;
    if (const int c = row_class(m); c >= 0) return by_rows[std::size_t(c)].overhead_s;
    return overhead_s;
  }
  // An item after the first of a grouped call, whose call alone would take `alone`: that less its call's fixed cost,
  // plus grouped_item_s (unset: `alone`).
  double grouped_item_time(double alone, double m, double n, double k, int dtype_bytes) const {
    if (!grouped_item_s || alone <= 0) return alone;
    return std::max(0.0, alone - call_overhead(m, n, k, dtype_bytes)) + *grouped_item_s;
  }
  double achieved_flops_per_s(double m, double n, double k, int dtype_bytes) const {
    return 2 * m * n * k / time(m, n, k, dtype_bytes);
  }
  // A GEMM whose weight (n k) was last read `distance_bytes` of weight reads ago on its rank, itself included
  // (infinity: not read before): the measured tables that hold the shape, `measured` and each of `reuse`, taken as
  // points in cycle bytes, interpolated linearly between the two around the distance (outside them: the nearest); a
  // shape no table with a recorded cycle holds, time(). On this machine the same GEMMs ran 0.54-0.87x as long with
  // their weights back after a decode step's 5 MB as after a whole step's 14.4 MB (2 ranks against a 32 MB L3;
  // bench/serve_gemm_reuse).
  double time_at_reuse(double m, double n, double k, int dtype_bytes, double distance_bytes) const {
    double below_cycle = 0, below_s = 0, above_cycle = 0, above_s = 0;
    bool below = false, above = false;
    const auto consider = [&](const GemmMeasured& table) {
      if (table.cycle_bytes <= 0) return;
      const GemmMeasuredShape* s = table.find(m, n, k, dtype_bytes);
      if (!s) return;
      if (table.cycle_bytes <= distance_bytes && (!below || table.cycle_bytes > below_cycle))
        below = true, below_cycle = table.cycle_bytes, below_s = s->time(m);
      if (table.cycle_bytes >= distance_bytes && (!above || table.cycle_bytes < above_cycle))
        above = true, above_cycle = table.cycle_bytes, above_s = s->time(m);
    };
    consider(measured);
    for (const GemmMeasured& table : reuse) consider(table);
    if (!below && !above) return time(m, n, k, dtype_bytes);
    if (!below) return above_s;
    if (!above || above_cycle == below_cycle) return below_s;
    const double f = (distance_bytes - below_cycle) / (above_cycle - below_cycle);
    return below_s + f * (above_s - below_s);
  }
};

// Flash-style attention: t = overhead + flops / rate, separately forward and backward. Forward flops are
// 4 * d * (query-key pairs) * heads; backward does 2.5 times the forward flops (it recomputes the scores).
// The pairs are the visible ones, or with `whole_tiles` those of the whole tiles the CPU kernel computes (a causal
// diagonal tile costs the kernel all its pairs: ops/counting.hpp tiled_pairs); calibrate sets it where asked.
// A backward call's overhead is its own where given (calibrated: on one H200's fp32 kernels at 1K-8K causal tokens the
// fitted intercepts were 0.21 ms forward and 1.10 ms backward), else the forward's.
struct AttentionModel {
  double overhead_s = 0;
  double forward_flops_per_s = 1;
  double backward_flops_per_s = 1;
  bool whole_tiles = false;
  std::optional<double> backward_overhead_s = std::nullopt;
  // The pairs to price of a call with `visible` visible pairs and `tiled` pairs in its tiles (0: not counted).
  double pairs(double visible, double tiled) const { return whole_tiles && tiled > 0 ? tiled : visible; }
  double backward_overhead() const { return backward_overhead_s.value_or(overhead_s); }
  double forward_time(double flops) const { return flops > 0 ? overhead_s + flops / forward_flops_per_s : 0; }
  double backward_time(double forward_flops) const {
    return forward_flops > 0 ? backward_overhead() + 2.5 * forward_flops / backward_flops_per_s : 0;
  }
};

// A CPU's GEMM engine for one size class ("small", "medium", "large" by flops; ops/cpu/gemm_choice.hpp), as measured
// when the profile was calibrated: the engine chosen and both engines' rates (0: not built in).
struct GemmEngineChoice {
  std::string size_class;
  std::string engine;  // "cblas" or "fallback"
  double cblas_flops_per_s = 0;
  double fallback_flops_per_s = 0;
  friend bool operator==(const GemmEngineChoice&, const GemmEngineChoice&) = default;
};

// Fresh memory. A host Tensor is zeroed when it is allocated (core/memory.hpp); an allocation that the C library
// serves from pages it already touched costs that memset, one served from new pages (glibc maps requests above its
// mmap threshold afresh, and the buffer pool is emptied before every training step) also takes a page fault per page
// (here 1.56 GB/s against a memset's 22-38 GB/s). t = bytes / zero rate below `fresh_min_bytes`, bytes / fresh rate
// from it. Storage left unzeroed (Contents::unspecified: Tensor::uninitialized, the pool's buffers) costs only its new
// pages' faults, which the first kernel to write it takes: the fresh price less the memset's, nothing below
// `fresh_min_bytes`. A rate of 0 prices that range at nothing (profiles written before these fields existed; devices,
// whose caching allocators reuse their memory and whose zeroing is a fill at memory bandwidth, small beside the step).
struct FreshMemoryModel {
  double zero_bytes_per_s = 0;      // zeroing an allocation on pages already touched
  double fresh_bytes_per_s = 0;     // first touch of new pages: faults and zeroing
  std::int64_t fresh_min_bytes = 0; // allocations of this size and more are served from new pages
  double time(double bytes, bool zeroed = true) const {
    if (bytes <= 0) return 0;
    const auto at = [bytes](double rate) { return rate > 0 ? bytes / rate : 0; };
    if (bytes < double(fresh_min_bytes)) return zeroed ? at(zero_bytes_per_s) : 0;
    return zeroed ? at(fresh_bytes_per_s) : std::max(0.0, at(fresh_bytes_per_s) - at(zero_bytes_per_s));
  }
  friend bool operator==(const FreshMemoryModel&, const FreshMemoryModel&) = default;
};

// Scalar math. Some CPU kernels call the math library once per element, one call at a time: the materialised
// softmax's and the cross-entropy's exp, RoPE's cos and sin per (token, frequency). The dry run records those calls
// (TraceKind::transcendental, core/trace.hpp) beside the kernel's other work; each costs 1 / rate of its function.
// A rate of 0 prices the calls at nothing (older profiles, and devices, whose special-function units make them part
// of a memory-bound kernel). The materialised softmax's own scalar loop (its max, exp-and-sum and scale passes over
// every score of a row, ops/cpu/softmax.hpp) has a rate per score here too: fitted beside the exp on one calibration
// sample it went to the activation rate (0.54 ns a score) and the exp took the rest (4.8 ns a call), where two
// samples of other visible shares (25% and 100%) put them at 1.7 and 3.2 ns, so a step whose rows see half their keys
// (ColossalZ at 2,048 tokens, zigzag) was priced 15-20% under its softmax (stop 52). 0: the scores are priced as
// activation elements (older profiles; devices).
enum class ScalarFunction : std::uint8_t { exp, sincos };
struct ScalarMathModel {
  double exp_per_s = 0;     // expf calls per second
  double sincos_per_s = 0;  // cos or sin calls (double precision) per second
  double softmax_scores_per_s = 0;  // scores per second of the materialised softmax's own loop (beside its exps)
  double time(ScalarFunction f, double calls) const {
    const double rate = f == ScalarFunction::exp ? exp_per_s : sincos_per_s;
    return calls > 0 && rate > 0 ? calls / rate : 0;
  }
  friend bool operator==(const ScalarMathModel&, const ScalarMathModel&) = default;
};

// Elementwise kernels by size. The profile's one elementwise rate is measured on copies of buffers that stay in
// cache (here 69 GB/s), which prices a 32 MB softmax gradient, a strided re-layout or a LayerNorm as fast as a cached
// memcpy. A profile may refine it by the bytes one kernel call moves (TraceKind::elementwise's bytes): a class holds
// the calls of at most `max_bytes` (and above the previous class's) at its own rate; calls above the last class take
// the last class's rate. Calibrated on the CPU backend's own elementwise kernels (a copy, a copy into a re-laid-out
// view, a sum, LayerNorm forward and backward) at several sizes, each call's bytes those its counting rule records
// (cost/calibrate.hpp calibrate_elementwise_classes). Empty (every built-in profile, and profile JSON written before
// the classes): the single rate for every size.
struct ElementwiseClass {
  double max_bytes = 0;    // this class: calls moving at most this many bytes (and more than the previous class's)
  double bytes_per_s = 1;  // bytes read and written per second
  friend bool operator==(const ElementwiseClass&, const ElementwiseClass&) = default;
};

// A family of memory-bound kernels (ElementwiseFamily, core/trace.hpp) at a rate of its own: one kernel t = overhead
// + bytes / rate. Calibrated on a device (CalibrationOptions::elementwise_family_rows, cost/calibrate.hpp), where one
// mix of the backend's kernels priced its streaming kernels (softmax, SwiGLU, AdamW: 2-4 TB/s on an H200) 2-4x slow
// and its norms and RoPE 2-3x fast (docs/trainer_validation.md). Not calibrated (rate 0): the size classes price it.
struct ElementwiseFamilyRate {
  double overhead_s = 0;
  double bytes_per_s = 0;
  bool calibrated() const { return bytes_per_s > 0; }
  friend bool operator==(const ElementwiseFamilyRate&, const ElementwiseFamilyRate&) = default;
};

// Serving's attention over a paged KV cache (serve/paged_attention.hpp): scalar code that reads each visible
// position's key and value through the cache's block table, so its time goes with the visits, one per (query-key
// pair, query head): t = visits / visits_per_s + 4 d visits / flops_per_s (the dot products and the weighted sum).
// Both rates 0 (older profiles; devices, whose paged kernels run at the attention rate): not calibrated, and
// HardwareProfile::paged_attention_time prices the kernel as flash attention forward, as before the model existed.
struct PagedAttentionModel {
  double visits_per_s = 0;  // the per-visit work: the block-table lookups, the exp, the loop
  double flops_per_s = 0;   // the d-long dot product and weighted sum of each visit
  bool calibrated() const { return visits_per_s > 0 || flops_per_s > 0; }
  double time(double visits, double d) const {
    return (visits_per_s > 0 ? visits / visits_per_s : 0) + (flops_per_s > 0 ? 4 * d * visits / flops_per_s : 0);
  }
  friend bool operator==(const PagedAttentionModel&, const PagedAttentionModel&) = default;
};

// MLA's attention over its latent cache (serve/mla_attention.hpp mla_detail::latent_attention): per query, every
// visible position's latent read once for all the rank's heads. The paged kernel's two terms per (query-key pair,
// head) visit (the exp, the d-wide dot product and weighted sum), plus the work a pair does once whatever the heads
// (loading each of the latent's d elements and spreading it over the heads' dot products): t = visits / visits_per_s
// + 4 d visits / flops_per_s + d pairs / shared_per_s, visits = pairs x heads. Calibrated on a CPU
// (serve/paged_attention_calibration.hpp); all rates 0 (older profiles, devices): priced as the paged kernel.
struct LatentAttentionModel {
  double visits_per_s = 0;  // per (pair, head): the exp, the loop
  double flops_per_s = 0;   // the heads' dot products and weighted sums
  double shared_per_s = 0;  // per (pair, latent element): its load, shared by the heads
  bool calibrated() const { return visits_per_s > 0 || flops_per_s > 0 || shared_per_s > 0; }
  double time(double pairs, double heads, double d) const {
    const double visits = pairs * heads;
    return (visits_per_s > 0 ? visits / visits_per_s : 0) + (flops_per_s > 0 ? 4 * d * visits / flops_per_s : 0) +
           (shared_per_s > 0 ? d * pairs / shared_per_s : 0);
  }
  friend bool operator==(const LatentAttentionModel&, const LatentAttentionModel&) = default;
};

// The fixed host cost of a kernel call, beside the work the other terms price by size. On a CPU rank every backend
// kernel call has its own dispatch, loop set-up and views, which the per-byte and per-element rates do not hold (they
// are fitted on calls large enough to hide it). A serving step of a small model makes ~40 such calls per layer on a
// handful of rows (a decode step of the synthetic MoE, 2 layers: 75). Calibrated here at 0.05-0.18 us a call: small
// beside such a step (docs/serving_simulation.md; a timed step's apparent per-op excess was mostly its timers).
// Priced per TraceEvent (cost/trace_cost.hpp): `kernel_call_s` for each call of an elementwise, activation or paged
// attention kernel (GEMMs and flash attention have their own fitted overheads; a kernel's transcendental calls ride
// on its own event). Calibrated on one-row calls of the backend's kernels (cost/calibrate.hpp,
// options.call_overheads). 0 (built-in profiles, profiles written before the model, calibrations that do not ask for
// it): unpriced, as before.
struct CallOverheadModel {
  double kernel_call_s = 0;  // seconds per non-GEMM kernel call
  friend bool operator==(const CallOverheadModel&, const CallOverheadModel&) = default;
};

// The serving engine's own host work per step besides the dynamic policy's forecast (serve/engine.hpp: planning the
// batch, the statistics, sampling, the requests' bookkeeping), rank 0's CPU on the step's critical path: step_s +
// chunk_s per chunk of the batch. Calibrated (moe_simulate --measure: serve/serving_calibration.hpp fit_serving_host);
// 0: unpriced (built-in profiles: no datasheet gives it).
struct ServingHostModel {
  double step_s = 0;
  double chunk_s = 0;
  friend bool operator==(const ServingHostModel&, const ServingHostModel&) = default;
};

struct HardwareProfile {
  std::string name;
  std::string description;
  std::string source;                 // where the figures come from (datasheets, or "calibrated on ...")
  int devices_per_node = 8;
  std::int64_t memory_bytes = 0;      // per device
  std::int64_t reserved_bytes = 0;    // taken by the runtime (context, communicator buffers, allocator slack)
  GemmModel gemm;
  AttentionModel attention;
  double elementwise_bytes_per_s = 1; // bytes read + written per second by elementwise kernels
  std::vector<ElementwiseClass> elementwise_classes;  // by bytes per call, ascending; empty: the single rate above
  // Per kernel family, where calibrated (a device's profile): before the classes for that family's calls.
  std::array<ElementwiseFamilyRate, kElementwiseFamilies> elementwise_families{};
  // Bytes read + written per second by a copy whose source and destination come from memory, not cache: a layout
  // switch's expert banks (serve/step_cost.hpp layer_switch), a working set many times the last-level cache. On a
  // 2-core VM's thread ranks 14 GB/s, where its elementwise rate, fitted on copies the caches partly hold, read 38-63.
  // 0: the elementwise rate (built-in profiles, whose elementwise rate is already HBM's).
  double memory_copy_bytes_per_s = 0;
  // Output elements per second of activation kernels (GELU, SwiGLU, softmax exponentials), which are compute-bound
  // on CPUs; 0: memory-bound like the other elementwise kernels (GPUs).
  double activation_elements_per_s = 0;
  // SwiGLU forward's own rate (its gate and up halves read from one [rows, 2f] buffer, a sigmoid per element),
  // which this machine ran at a fourth of GELU's; 0: priced at activation_elements_per_s (older profiles, as
  // before). Its backward stays at activation_elements_per_s.
  double swiglu_forward_elements_per_s = 0;
  // Fraction of a ring step's shorter side (compute or transfer) that hides under the longer one: 1 on GPUs
  // (copy engines and streams), lower where compute and communication share the same cores.
  double overlap = 1;
  LinkModel intra_node, inter_node;
  std::vector<CollectiveCost> collectives;
  // Calibrated CPU profiles: gemm()'s engine per size class (empty for devices and built-in profiles).
  std::vector<GemmEngineChoice> gemm_engines;
  // First touch of fresh allocations and scalar math-library calls (0 rates: not priced, as before they existed).
  FreshMemoryModel fresh_memory;
  ScalarMathModel scalar_math;
  // The buffer pool's misses (plan/cost_table.hpp: the step's loans replayed in order through the pool's rule, each
  // miss priced as the unzeroed fresh allocation of its size it is, at fresh_memory's rates). > 0 turns the replay
  // on; the value, bytes per second of the calibration's timed misses (cost/calibrate.hpp), prices the misses only
  // where a profile has no fresh-memory rates. 0: unpriced, the pool's first fill priced once per step at the
  // fresh-memory rates instead (built-in profiles, profiles written before, calibrations that do not ask for it).
  double pool_miss_bytes_per_s = 0;
  // The serving scheduler's host work: trace events per second a dry run of a step records on the host (the dynamic
  // policy's forecast dry-runs the step in both layouts before it runs: serve/engine.hpp; the simulated clock charges
  // the events at this rate, serve/step_dry_run.hpp host_work_s). Calibrated per machine from a served run's
  // forecasts (moe_simulate --measure, serve/serving_calibration.hpp fit_planning_rate); 0: the forecast is not
  // charged (built-in profiles: a datasheet gives no host rate).
  double planning_events_per_s = 0;
  ServingHostModel serving_host;  // the engine's other host work per step (0: unpriced)
  // The serving steps' spread around their price on this machine: a step's measured time over its price, over the
  // median of those ratios, as equal-probability quantiles (ascending). The simulated clock multiplies each step's
  // price by one drawn for it (seeded: a run gives the same times every time), so its p99s see the spread that the
  // calibration's medians price away. Calibrated (moe_simulate --measure: serve/serving_calibration.hpp
  // step_jitter_quantiles); empty: none (built-in profiles).
  std::vector<double> step_jitter;
  // The ranks' spread within a step: the standard deviation of one rank's kernel time between two collectives over
  // its price (relative; in [0, 1)). Ranks that meet at every collective wait for the slowest, so each piece of a
  // step on p ranks takes sigma x E[max of p standard normals] x its kernels longer than one rank alone (straggle_s),
  // a wait the step jitter above does not price (its median is 1). Calibrated (moe_simulate --measure:
  // serve/serving_calibration.hpp fit_rank_jitter); 0: none (built-in profiles).
  double rank_jitter = 0;
  // The speed probe's reading of this profile's calibration (cost/speed_probe.hpp: the workload's GEMMs, measured /
  // priced, over the calibration's own samples of them; serve/speed_probe.hpp the served model's decode GEMMs,
  // train_gpt --speed-probe the compute-bound shapes of the single fit): a later reading over it is the machine's
  // speed against the calibration, the fit's error on the probe's shapes cancelled. 0: none (a reading is taken as it
  // is).
  double probe_baseline = 0;

  // Serving's paged attention kernel (not calibrated: priced as flash attention).
  PagedAttentionModel paged_attention;
  // MLA's attention over its latent cache, at width r_kv + d_r / 2 (not calibrated: priced as the paged kernel).
  LatentAttentionModel latent_attention;
  // The fixed cost per kernel call (0: unpriced).
  CallOverheadModel call_overhead;

  // Seconds of the paged attention kernel over `pairs` visible query-key pairs of `heads` query heads of width d.
  double paged_attention_time(double pairs, double heads, double d) const {
    if (pairs <= 0 || heads <= 0) return 0;
    return paged_attention.calibrated() ? paged_attention.time(pairs * heads, d) : attention.forward_time(4 * d * heads * pairs);
  }
  // Seconds of MLA's latent attention over `pairs` visible query-key pairs of `heads` query heads at width
  // r_kv + d_r / 2.
  double latent_attention_time(double pairs, double heads, double width) const {
    if (pairs <= 0 || heads <= 0) return 0;
    return latent_attention.calibrated() ? latent_attention.time(pairs, heads, width)
                                         : paged_attention_time(pairs, heads, width);
  }

  // The device's GEMM rate, what model-FLOPs utilisation is measured against: the chosen engine's measured rate on
  // large GEMMs where the profile has one, else the fitted asymptotic rate.
  double gemm_peak_flops_per_s() const {
    for (const GemmEngineChoice& c : gemm_engines)
      if (c.size_class == "large") return c.engine == "cblas" ? c.cblas_flops_per_s : c.fallback_flops_per_s;
    return gemm.flops_per_s;
  }

  // Seconds p ranks wait for the slowest of them at the collective after `kernels_s` of kernels on each.
  double straggle_s(double kernels_s, int ranks) const {
    return ranks > 1 && rank_jitter > 0 ? rank_jitter * expected_max_of_normals(ranks) * kernels_s : 0.0;
  }

  std::int64_t usable_memory_bytes() const { return memory_bytes - reserved_bytes; }

  LinkLevel level_of(int group_size) const {
    return group_size <= devices_per_node ? LinkLevel::intra_node : LinkLevel::inter_node;
  }
  const LinkModel& link(LinkLevel level) const { return level == LinkLevel::intra_node ? intra_node : inter_node; }

  // Seconds for one collective of `bytes` (nccl-tests size) over a group of `group_size` ranks. An exact entry
  // wins; otherwise the nearest group size of the same collective and level is carried over by the ring formula
  // (alpha scales with the ring steps, beta with the bus factor); otherwise the level's link model.
  double collective_time(Collective op, int group_size, double bytes) const {
    return collective_time(op, group_size, bytes, group_size);
  }
  // The same over a group whose members spread over `span` consecutive devices (a strided sub-group, such as a
  // column of a grid: its ranks i, i + inner, ...): priced on the level of the span.
  double collective_time(Collective op, int group_size, double bytes, int span) const {
    if (group_size <= 1 || bytes <= 0) return 0;
    const LinkLevel level = level_of(std::max(span, group_size));
    // The entry of the nearest group size (an exact one first) whose size range holds `bytes`.
    const CollectiveCost* nearest = nullptr;
    for (const CollectiveCost& entry : collectives) {
      if (entry.op != op || entry.level != level || double(entry.min_bytes) > bytes) continue;
      if (!nearest) {
        nearest = &entry;
        continue;
      }
      const int distance = std::abs(entry.group_size - group_size);
      const int best = std::abs(nearest->group_size - group_size);
      if (distance < best || (distance == best && entry.group_size == nearest->group_size &&
                              entry.min_bytes > nearest->min_bytes))
        nearest = &entry;
    }
    if (nearest && nearest->group_size == group_size) return nearest->cost.time(bytes);
    if (nearest && nearest->group_size > 1) {
      const double alpha_per_step = nearest->cost.alpha_s / latency_steps(op, nearest->group_size);
      const double beta_bus = nearest->cost.beta_s_per_byte / bus_factor(op, nearest->group_size);
      return alpha_per_step * latency_steps(op, group_size) + beta_bus * bus_factor(op, group_size) * bytes;
    }
    const LinkModel& l = link(level);
    const double bandwidth = op == Collective::send_recv ? l.p2p_bytes_per_s : l.bus_bytes_per_s;
    return l.launch_s + l.step_latency_s * latency_steps(op, group_size) + bus_factor(op, group_size) * bytes / bandwidth;
  }

  // Seconds of one elementwise call moving `bytes`: its size class's rate, or the single rate without classes.
  double elementwise_time(double bytes) const {
    if (bytes <= 0) return 0;
    if (elementwise_classes.empty()) return bytes / elementwise_bytes_per_s;
    for (const ElementwiseClass& c : elementwise_classes)
      if (bytes <= c.max_bytes) return bytes / c.bytes_per_s;
    return bytes / elementwise_classes.back().bytes_per_s;
  }
  // Seconds of a copy moving `bytes` (read + written) from memory to memory: memory_copy_bytes_per_s, else as above.
  double memory_copy_time(double bytes) const {
    if (memory_copy_bytes_per_s > 0) return bytes > 0 ? bytes / memory_copy_bytes_per_s : 0;
    return elementwise_time(bytes);
  }
  // A kernel of `family`: at the family's rate where calibrated, else as above.
  double elementwise_time(double bytes, ElementwiseFamily family) const {
    const ElementwiseFamilyRate& f = elementwise_families[std::size_t(family)];
    if (bytes > 0 && f.calibrated()) return f.overhead_s + bytes / f.bytes_per_s;
    return elementwise_time(bytes);
  }
  // An activation producing `elements` outputs from `bytes` of reads and writes (memory-bound, where the profile has
  // no activation rate, at its family's elementwise rate).
  double activation_time(double elements, double bytes, bool swiglu_forward = false,
                         ElementwiseFamily family = ElementwiseFamily::activation) const {
    if (elements <= 0) return 0;
    if (swiglu_forward && swiglu_forward_elements_per_s > 0) return elements / swiglu_forward_elements_per_s;
    if (family == ElementwiseFamily::softmax && scalar_math.softmax_scores_per_s > 0)
      return elements / scalar_math.softmax_scores_per_s;
    return activation_elements_per_s > 0 ? elements / activation_elements_per_s : elementwise_time(bytes, family);
  }

  // Sets (or replaces) the entry for one collective, group size, level and size range.
  void set_collective(Collective op, LinkLevel level, int group_size, AlphaBeta cost, std::int64_t min_bytes = 0) {
    for (CollectiveCost& entry : collectives)
      if (entry.op == op && entry.level == level && entry.group_size == group_size && entry.min_bytes == min_bytes) {
        entry.cost = cost;
        return;
      }
    collectives.push_back({op, level, group_size, cost, min_bytes});
  }
};

}  // namespace paradyse::cost
