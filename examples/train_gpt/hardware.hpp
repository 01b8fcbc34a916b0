// examples/train_gpt/hardware.hpp: what train_gpt plans with and against: the hardware profile (--profile, or
// calibrated on this machine once and cached), the emulated node of --emulate, and this machine's (or GPU's) memory.
#pragma once

#include "training_options.hpp"

#include "paradyse/comm/ranks.hpp"
#include "paradyse/core/csv_table.hpp"
#include "paradyse/core/timer.hpp"
#include "paradyse/cost/builtin_profiles.hpp"
#include "paradyse/cost/calibrate.hpp"
#include "paradyse/cost/emulation.hpp"
#include "paradyse/cost/gemm_engines.hpp"
#include "paradyse/cost/profile.hpp"
#include "paradyse/cost/profile_json.hpp"
#include "paradyse/cost/speed_probe.hpp"
#include "paradyse/ops/backend.hpp"
#if PARADYSE_WITH_CUDA
#include "paradyse/device/runtime.hpp"
#endif

#include <fmt/format.h>

#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

namespace paradyse::examples {

namespace pd = paradyse;

// The GPU's memory (--device cuda), 0 when unknown.
inline double device_memory_bytes() {
#if PARADYSE_WITH_CUDA
  std::size_t free = 0, total = 0;
  if (cudaMemGetInfo(&free, &total) == cudaSuccess) return double(total);
#endif
  return 0.0;
}

// The calibration's measurements for this run's model on Backend. On the host: the defaults, the model's attention
// heads, its elementwise kernels by size, the pool's misses, whole tiles and the head-width products of attention
// materialised. On a device (--device cuda): the model's own GEMMs (tokens by the projections' widths: a GPU's
// small GEMMs are launch-bound, so the host's small shapes would not extrapolate to them) and its head-width
// products at 1K-8K tokens (a layer's heads to a batched call), its causal attention there priced on the visible
// pairs (the GPU kernel skips the key tiles its queries cannot see), its elementwise kernels by size and by family,
// and the GPU's memory over the ranks sharing it.
template <class Backend>
pd::cost::CalibrationOptions calibration_options(const TrainingOptions& o) {
  pd::cost::CalibrationOptions options;
  options.repetitions = 3;
  // Each measurement the median of the passes' (one pass's fits move with the machine's speed). Five by default: on
  // a 2-core VM one of six calibrations of three passes priced some of train_gpt's steps 22-35% over the others' (a
  // bad median among three), none of six of five passes (docs/trainer_validation.md, stop 53).
  options.passes = o.calibration_passes;
  options.attention_heads = o.heads;
  options.head_dim = std::max<std::int64_t>(o.hidden / o.heads, 1);
  options.elementwise_class_rows.assign(pd::cost::kElementwiseClassRows.begin(), pd::cost::kElementwiseClassRows.end());
  constexpr bool on_device = pd::ops::on_device<Backend>;
  // The per-head products of attention materialised (ColossalZ: scores [n, n] = q k^T and P v, the head dimension
  // their short side): GemmModel's head-width class, at a rank's rows for 512 to 2,048 tokens on 2 host ranks, or
  // 1K-8K tokens on one GPU (where the planner picks ColossalZ: cuBLAS outruns the fp32 flash kernel).
  for (const std::int64_t n : on_device ? std::vector<std::int64_t>{1024, 2048, 4096, 8192}
                                        : std::vector<std::int64_t>{256, 512, 1024})
    for (const auto& shape : {std::array<std::int64_t, 3>{n, n, options.head_dim}, {n, options.head_dim, n}})
      options.gemm_thin_shapes.push_back(shape);
  if constexpr (on_device) {
    options.clock = pd::cost::TimeSource::wall;  // the device's time, not the host thread's
    options.gemm_thin_batch = o.heads;             // a layer's heads in one gemm_batched call, as its step runs them
    const std::int64_t h = o.hidden, f = 4 * o.hidden;
    options.gemm_shapes.clear();
    for (const std::int64_t m : {512, 2048, 8192})  // [tokens, in] x [out, in]^T: qkv, output, MLP up and down
      for (const auto& [n, k] : {std::array<std::int64_t, 2>{3 * h, h}, {h, h}, {f, h}, {h, f}})
        options.gemm_shapes.push_back({m, n, k});
    for (const std::int64_t k : {2048, 8192})  // weight gradients: [out, tokens] x [in, tokens]^T
      for (const auto& [m, n] : {std::array<std::int64_t, 2>{3 * h, h}, {f, h}})
        options.gemm_shapes.push_back({m, n, k});
    options.attention_lengths = {1024, 2048, 4096, 8192};
    options.attention_causal_only = true;  // the GPT's attention, causal: the GPU's causal kernel is its own rate
    options.copy_bytes = {std::int64_t(1) << 22, std::int64_t(1) << 25, std::int64_t(1) << 28};
    // Each family of elementwise kernels at its own rate (one mix misprices a GPU's streaming kernels and its norms
    // by 2-4x either way: docs/trainer_validation.md), at a small layer's tokens and a large one's.
    options.elementwise_family_rows = {2048, 16384};
    options.memory_bytes = std::int64_t(device_memory_bytes()) / o.ranks;
    return options;
  }
  options.pool_miss_bytes = {std::int64_t(1) << 18, std::int64_t(1) << 20};  // a step's activations (256 KiB, 1 MiB)
  options.attention_whole_tiles = true;  // causal diagonals cost the CPU kernel whole tiles
  return options;
}

// The hardware profile: given, cached from an earlier calibration, or calibrated now on Backend (and cached).
template <class Backend, class RanksT>
pd::cost::HardwareProfile find_or_calibrate_profile(const TrainingOptions& o, RanksT& ranks) {
  if (!o.profile.empty()) {
    for (std::string_view name : pd::cost::kBuiltinProfileNames)
      if (name == o.profile) {
        fmt::print("hardware profile: {} (built in)\n", o.profile);
        return pd::cost::builtin_profile(name);
      }
    fmt::print("hardware profile: {} (given)\n", o.profile);
    return pd::cost::load_profile(o.profile);
  }
  const bool mpi = o.backend == pd::RankBackend::mpi;
  constexpr bool on_device = pd::ops::on_device<Backend>;
  // build/train_gpt_profile_p2.json, ..._mpi_p2.json, ..._cuda_h1024_p1.json (a device's profile is its model's: the
  // GEMM shapes are the model's, so the name carries the width)
  const std::string kind = on_device ? fmt::format("{}_h{}_", Backend::name, o.hidden) : mpi ? "mpi_" : "";
  const std::filesystem::path cache = fmt::format("build/train_gpt_profile_{}p{}.json", kind, o.ranks);
  // Under MPI every process decides from the same state: rank 0 writes the cache only after all have looked.
  const bool cached = std::filesystem::exists(cache);
  ranks.run([](auto& comm, int) { comm.barrier(); });
  if (cached) {
    try {
      pd::cost::HardwareProfile profile = pd::cost::load_profile(cache.string());
      fmt::print("hardware profile: calibrated on this machine earlier, {} (delete it to recalibrate)\n", cache.string());
      return profile;
    } catch (const pd::Error& e) {
      fmt::print("hardware profile: the cached {} does not load ({}); calibrating again\n", cache.string(), e.what());
    }
  }
  fmt::print("hardware profile: calibrating {} {} ranks {} (once; cached in {}) ...\n", o.ranks,
             on_device ? "cuda_local" : mpi ? "MPI" : "thread", on_device ? "on the GPU" : "on this machine",
             cache.string());
  const pd::cost::CalibrationOptions options = calibration_options<Backend>(o);
  const Timer start;
  pd::cost::HardwareProfile profile;
  std::vector<double> spreads;
  std::vector<pd::cost::CalibrationSample> samples;
  ranks.run([&](auto& comm, int r) {
    pd::cost::Calibration c = pd::cost::calibrate<Backend>(comm, options);
    if (r == 0) {
      profile = std::move(c.profile), spreads = std::move(c.pass_spreads), samples = std::move(c.samples);
      // --speed-probe's baseline: its reading of the calibration's own samples of its shapes (the host's GEMMs).
      if (!on_device) profile.probe_baseline = pd::cost::slowdown_of(c.gemm_samples, profile);
    }
  });
  std::sort(spreads.begin(), spreads.end());
  fmt::print("  calibrated in {:.1f} s ({} passes; the passes' spread per measurement, (max - min) / median: median "
             "{:.0f}%, largest {:.0f}%)\n", start.seconds(), options.passes,
             spreads.empty() ? 0.0 : 100 * spreads[spreads.size() / 2], spreads.empty() ? 0.0 : 100 * spreads.back());
  if (ranks.reports()) {
    std::error_code ignored;
    std::filesystem::create_directories(cache.parent_path(), ignored);
    pd::cost::save_profile(profile, cache.string());
    // Each measurement beside its fit's price, so that a poor fit is visible (a side output: a failure warns).
    pd::CsvTable csv(cache.string() + ".samples.csv", {"what", "measured_s", "fitted_s"},
                     pd::CsvTable::OnFailure::warns);
    for (const pd::cost::CalibrationSample& s : samples) csv.row(s.what, s.measured_s, s.fitted_s);
  }
  if (mpi) {  // every process plans with rank 0's profile
    ranks.run([](auto& comm, int) { comm.barrier(); });
    profile = pd::cost::load_profile(cache.string());
  }
  return profile;
}

// The hardware profile (find_or_calibrate_profile), its GEMM engines made this process's: the steps run, and the
// planner's dry runs count (a fallback GEMM's packing workspace), the engines its rates were measured on, as
// plan_trace does with the same profile.
template <class Backend = pd::ops::Cpu, class RanksT>
pd::cost::HardwareProfile hardware_profile(const TrainingOptions& o, RanksT& ranks) {
  pd::cost::HardwareProfile profile = find_or_calibrate_profile<Backend>(o, ranks);
  pd::cost::use_gemm_engines(profile);
  return profile;
}

// --speed-probe: the machine's speed now against `profile` (cost/speed_probe.hpp), measured / priced over the
// calibration's compute-bound GEMM shapes (CalibrationOptions' defaults, which the single fit is calibrated on),
// timed as they were calibrated (hot operands, the fastest of 3 after one untimed, every rank at once, thread CPU
// time), on buffers of their own (not under the ranks' memory trackers), over the profile's baseline where it has one
// (HardwareProfile::probe_baseline: the same reading of the calibration's own samples; a profile calibrated before
// it has none).
template <class RanksT>
double probe_speed(RanksT& ranks, const pd::cost::HardwareProfile& profile) {
  pd::cost::GemmClassOptions probe;
  probe.repetitions = 3;
  probe.cold_bytes = 0;
  probe.shapes = pd::cost::CalibrationOptions{}.gemm_shapes;
  double slowdown = 0;
  ranks.run([&](auto& comm, int r) {
    pd::MemoryTracker own;  // the probe's operands are not the model's: outside the rank's tracker and its cap
    const pd::ScopedTracker scoped(own);
    const double reading = pd::cost::probe_slowdown<pd::ops::Cpu>(comm, probe, profile);
    const double s = pd::cost::slowdown_against_baseline(reading, profile);
    if (r == ranks.first_local()) slowdown = s;
  });
  return slowdown;
}

// This machine's memory, 0 when unknown.
inline double physical_memory_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? double(pages) * double(page) : 0.0;
}

// --emulate: an 8-GPU node's balance of compute and communication on this machine: transfers paced at the device's
// link latency and bandwidth, stretched by how much slower this machine computes (cost/emulation.hpp). Returns the
// profile to plan with (the emulated links).
template <class RanksT>
pd::cost::HardwareProfile emulated(const TrainingOptions& o, const pd::cost::HardwareProfile& hardware, RanksT& ranks) {
  const pd::cost::Emulation e = pd::cost::emulate(pd::cost::builtin_profile(o.emulate), hardware);
  if constexpr (requires { ranks.set_link_pacing(e.pacing); }) ranks.set_link_pacing(e.pacing);  // thread ranks
  fmt::print("emulated node: {} ranks with the links of {}, slowed {:.0f}x (its GEMM rate over this machine's); "
             "plans and predictions use the emulated links\n", o.ranks, pd::cost::builtin_profile(o.emulate).name,
             e.slowdown);
  return e.profile;
}

}  // namespace paradyse::examples
