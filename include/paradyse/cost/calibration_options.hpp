// paradyse/cost/calibration_options.hpp: what a calibration measures (CalibrationOptions) and what it returns (the
// profile, its samples measured beside fitted, the fits: Calibration); cost/calibrate.hpp runs it.
#pragma once

#include "paradyse/core/timer.hpp"
#include "paradyse/cost/least_squares.hpp"
#include "paradyse/cost/profile.hpp"

#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace paradyse::cost {

enum class TimeSource : std::uint8_t { thread_cpu, wall };

// Seconds from `source`: a monotonic clock, or the calling thread's CPU time (core/timer.hpp's two clocks).
inline double now_seconds(TimeSource source) {
  return source == TimeSource::thread_cpu ? thread_cpu_seconds() : wall_seconds();
}

// Token rows of the elementwise classes' sizes for a trainer (options.elementwise_class_rows): with h = 128, calls of
// 80 KB to 80 MB, from a small model's norms to ColossalZ's materialised probabilities.
inline constexpr std::array<std::int64_t, 5> kElementwiseClassRows = {64, 256, 2048, 16384, 65536};

struct CalibrationOptions {
  TimeSource clock = TimeSource::thread_cpu;
  int repetitions = 5;
  // Whole passes over every measurement, each measurement the median of the passes' (cost/calibration_passes.hpp):
  // a shared machine's speed moves between seconds-apart passes, one pass's fits with it. train_gpt asks for 5,
  // moe_simulate --measure for 3.
  int passes = 1;
  // GEMM shapes (m, n, k): tall activation products and wide weight-gradient products.
  std::vector<std::array<std::int64_t, 3>> gemm_shapes = {
      {128, 256, 256},   {512, 256, 256},   {2048, 256, 256},  {512, 768, 256},  {2048, 768, 256},
      {512, 256, 1024},  {2048, 256, 1024}, {512, 1024, 256},  {2048, 1024, 256}, {256, 256, 2048},
      {768, 256, 2048},  {1024, 256, 4096}, {64, 64, 64},      {4096, 256, 256}};
  // Head-width GEMM shapes (GemmModel::thin): products whose short side, min(n, k), is the head dimension (the
  // per-head score products of attention materialised, ColossalZ's [n, keys] x d), timed with their operands from
  // memory (each call on its own copy of a, b and c, cycling through copies that add up to gemm_thin_cold_bytes a
  // rank, as a step's 4-32 MB score matrices are), and fitted as their own class: t = overhead + flops / rate +
  // operand bytes / bandwidth, for every GEMM whose short side is at most the largest short side here. Empty (the
  // default): no class, the single fit prices them; train_gpt adds its model's.
  std::vector<std::array<std::int64_t, 3>> gemm_thin_shapes;
  std::int64_t gemm_thin_cold_bytes = std::int64_t(64) << 20;
  // How many head-width GEMMs go through one gemm_batched call (time_gemm's batch): 1 (the default) times them one
  // by one; a GPU's step runs a layer's heads in one call (train_gpt sets its heads on a device).
  std::int64_t gemm_thin_batch = 1;
  std::int64_t attention_heads = 4;
  std::int64_t head_dim = 32;
  std::vector<std::int64_t> attention_lengths = {256, 512, 1024, 2048, 4096};
  // Attention priced on whole tiles (AttentionModel::whole_tiles), fitted on causal calls beside the full ones;
  // false (the default): on the visible pairs of full calls.
  bool attention_whole_tiles = false;
  // Causal calls only, priced on their visible pairs (train_gpt on a device: its attention is always causal, and an
  // H200's causal kernel ran its pairs 1.3-1.8x slower than a full call's at 1K-2K tokens, its query tiles' work
  // uneven, so full calls priced its steps fast); ignored with attention_whole_tiles.
  bool attention_causal_only = false;
  // Copies and messages over the range strategies move. Collectives get an alpha-beta line per size range: below
  // `large_message_bytes` (on a CPU, messages that fit in the cores' own caches move faster), from it, and from the
  // size at which the p ranks' buffers leave the shared last-level cache, `cache_bytes` / (p + 1) (an all-gather's
  // p inputs and p outputs), where at least two samples lie beyond it (on a 32 MiB L3 two ranks' 32 MiB messages
  // ran 2.7x the line fitted from 4 MiB). cache_bytes: -1 the host's (calibrate_detail::last_level_cache_bytes),
  // 0 no such range (a device backend has none).
  std::vector<std::int64_t> copy_bytes = {std::int64_t(1) << 20, std::int64_t(1) << 23, std::int64_t(1) << 25};
  // Copies from memory (HardwareProfile::memory_copy_bytes_per_s): pieces of copy_memory_piece_bytes cycled through
  // sources and destinations that add up to copy_memory_bytes a rank (moe_simulate --measure asks for 128 MiB, 4x a
  // 32 MiB last-level cache; take more where the cache is larger); 0 (the default): not measured, the profile prices
  // such copies at the elementwise rate.
  std::int64_t copy_memory_bytes = 0;
  std::int64_t copy_memory_piece_bytes = std::int64_t(4) << 20;
  std::vector<std::int64_t> message_bytes = {std::int64_t(1) << 15, std::int64_t(1) << 18, std::int64_t(1) << 20,
                                             std::int64_t(1) << 22, std::int64_t(1) << 23, std::int64_t(1) << 24,
                                             std::int64_t(1) << 25, std::int64_t(1) << 26};
  std::int64_t large_message_bytes = std::int64_t(1) << 22;
  std::int64_t cache_bytes = -1;
  // Fresh allocations (bytes, ascending): per size, Tensors made (zeroed) up to a working set of
  // `fresh_working_set_bytes` live at once, then all freed, as a training step's activations are.
  // 32 MiB: core/host_malloc.hpp's mmap threshold, from which allocations get new pages (with freed memory kept).
  std::vector<std::int64_t> fresh_bytes = {std::int64_t(1) << 16, std::int64_t(1) << 18, std::int64_t(1) << 20,
                                           std::int64_t(1) << 22, std::int64_t(1) << 24, std::int64_t(1) << 25,
                                           std::int64_t(1) << 26};
  std::int64_t fresh_working_set_bytes = std::int64_t(1) << 26;
  // Elementwise size classes (HardwareProfile::elementwise_classes): token rows of the [rows, attention_heads,
  // head_dim] tensors the kernel mix runs on, ascending; empty (the default): no classes, the single copy rate.
  std::vector<std::int64_t> elementwise_class_rows;
  // Elementwise kernel families (HardwareProfile::elementwise_families): token rows of the [rows, attention_heads,
  // head_dim] tensors each family's kernels run on, two or more sizes, t = overhead + bytes / rate fitted per family;
  // empty (the default): none, the classes price every family. train_gpt asks on a device.
  std::vector<std::int64_t> elementwise_family_rows;
  // The pool's misses (HardwareProfile::pool_miss_bytes_per_s): loan sizes; empty (the default): unpriced.
  std::vector<std::int64_t> pool_miss_bytes;
  // The fixed cost per kernel call (HardwareProfile::call_overhead); false (the default): unpriced. moe_simulate --measure asks for them (a serving step's kernels run on a handful of rows).
  bool call_overheads = false;
  std::string name;  // default: "<backend>-p<group size> (calibrated)"
  // Memory per rank (HardwareProfile::memory_bytes); 0: this machine's physical memory over the ranks. A device
  // backend's caller gives its device's (train_gpt --device cuda: the GPU's memory over the ranks sharing it).
  std::int64_t memory_bytes = 0;
};

// One measured GEMM: C[m, n] = A[m, k] B[n, k]^T took `seconds`.
struct GemmSample {
  std::int64_t m = 0, n = 0, k = 0;
  double seconds = 0;
};

struct CalibrationSample {
  std::string what;         // "gemm 512x256x1024", "all_gather 1048576 B", ...
  double measured_s = 0;
  double fitted_s = 0;
};

struct Calibration {
  HardwareProfile profile;
  std::vector<CalibrationSample> samples;
  std::vector<GemmSample> gemm_samples;  // the single GEMM fit's shapes (options.gemm_shapes) as measured
  Fit gemm_fit, gemm_thin_fit, attention_forward_fit, attention_backward_fit, copy_fit;
  std::vector<std::pair<Collective, Fit>> collective_fits;
  // With several passes: each measurement's (max - min) / median over the passes, in the order measured.
  std::vector<double> pass_spreads;
};

}  // namespace paradyse::cost
