// paradyse/cost/calibrate.hpp: measures the machine at hand and fits a hardware profile by least squares.
//
//   HardwareProfile profile;
//   run_ranks(4, [&](ThreadCommunicator& comm) {
//     const Calibration c = calibrate<ops::Cpu>(comm);   // every rank calls it (SPMD)
//     if (comm.rank() == 0) profile = c.profile;
//   });
//   save_profile(profile, "threads-p4.json");
//
// Time source. Thread ranks share the cores of one machine, often with other work; what a rank of a real group of
// devices would take is the time its thread actually ran: TimeSource::thread_cpu (the default) measures that
// (the backend's waits block, so waiting is not counted; the copies a collective makes are). Use TimeSource::wall
// for ranks that own their device (MPI processes on dedicated cores, GPUs).
//
// What is measured, every rank at once (so that ranks sharing caches or a network show in the numbers), the
// slowest rank of each run counting, the fastest of `repetitions` runs kept (interference from other work on a
// shared machine, even on a sibling hyperthread, only ever slows a run down; with options.passes > 1, the median of
// that over whole passes run one after another, as the machine's speed also moves from second to second):
//   - which GEMM engine gemm() runs per size class (OpenBLAS or the built-in kernel, ops/cpu/gemm_choice.hpp: this
//     process's measured choice), kept in profile.gemm_engines; use_gemm_engines(profile) (cost/gemm_engines.hpp)
//     applies it in a later run;
//   - GEMMs of several shapes (Backend::matmul): fits t = overhead + flops / rate + operand bytes / bandwidth; where
//     options.gemm_thin_shapes asks for them (train_gpt does), the head-width products of attention materialised,
//     timed with their operands from memory, fitted as their own class (GemmModel::thin);
//   - flash attention forward and backward over several lengths: t = overhead + flops / rate; where
//     options.attention_whole_tiles asks for it (train_gpt does), causal calls too, every call's flops counted on
//     the pairs of the whole tiles the kernel computes (AttentionModel::whole_tiles); where
//     options.attention_causal_only asks for it (train_gpt on a device), causal calls alone on their visible pairs;
//   - copies of several sizes: elementwise bytes per second;
//   - fresh allocations (Tensors made and zeroed up to a 64 MiB working set, then freed) from 64 KiB to 64 MiB: the
//     zeroing rate of reused pages,
//     the first-touch rate of new ones and the size from which the C library hands out new pages (fit_fresh_memory);
//   - the scalar math-library calls of the materialised softmax (exp) and RoPE (cos, sin): their kernels' time
//     beyond what their memory traffic and activation work cost (fit_scalar_rate);
//   - where options.elementwise_class_rows asks for them (train_gpt does): the backend's own elementwise kernels
//     (a copy, a copy out of a head-major view, a sum, LayerNorm forward and backward) on [rows, heads, head dim]
//     tensors of each size, priced per byte their counting rule records: the profile's elementwise size classes
//     (fit_elementwise_classes);
//   - where options.pool_miss_bytes asks for it (train_gpt does): a buffer pool made to miss on every loan (two size
//     classes lent in turn: each evicts the other), its bytes lent per second priced at the fresh-memory rates (a
//     miss is a fresh Tensor; the profile's pool_miss_bytes_per_s), the timed misses beside that in the samples;
//   - where options.call_overheads asks for it (moe_simulate --measure does): one-row calls of the backend's
//     non-GEMM kernels, their work priced on the rates above: the fixed seconds per kernel call (the profile's
//     call_overhead);
//   - every collective of the communicator at several sizes: t = alpha + beta * bytes, for this group size;
//   - a ring step (a GEMM beside a shift_async) against the two alone: the fraction of overlap the backend gives
//     (wall-clock time only; in thread CPU time it is 0 by construction).
// The fits minimise relative error with non-negative coefficients (cost/least_squares.hpp); their worst and median
// errors come back with the samples, so a poor fit is visible.
//
// calibrate_gemm_classes (below, separate) fits the GEMM model's size classes (GemmModel::by_rows) on the shapes a
// workload runs, with its weights read from memory: moe_simulate --measure calls it with the served model's GEMMs.
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/core/timer.hpp"
#include "paradyse/cost/calibration_passes.hpp"
#include "paradyse/cost/gemm_engines.hpp"
#include "paradyse/cost/least_squares.hpp"
#include "paradyse/cost/profile.hpp"
#include "paradyse/cost/profile_json.hpp"  // save_profile / load_profile for what is calibrated
#include "paradyse/ops/attention_mask.hpp"
#include "paradyse/ops/backend.hpp"
#include "paradyse/ops/counting.hpp"
#include "paradyse/ops/cpu/gemm_choice.hpp"
#include "paradyse/strategy/buffer_pool.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <unistd.h>
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
  // a shared machine's speed moves between seconds-apart passes, one pass's fits with it. train_gpt asks for 3.
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
  // Causal calls only, priced on their visible pairs (train_gpt on a device: its attention is always causal, and a
  // GPU's causal kernel runs its pairs up to 1.4x slower than a full call's at 2K tokens, its query tiles' work
  // uneven, so full calls would price its steps fast); ignored with attention_whole_tiles.
  bool attention_causal_only = false;
  // Copies and messages over the range strategies move. Collectives get two alpha-beta lines, below and from
  // `large_message_bytes` (on a CPU, messages that fit in cache move faster).
  std::vector<std::int64_t> copy_bytes = {std::int64_t(1) << 20, std::int64_t(1) << 23, std::int64_t(1) << 25};
  std::vector<std::int64_t> message_bytes = {std::int64_t(1) << 15, std::int64_t(1) << 18, std::int64_t(1) << 20,
                                             std::int64_t(1) << 22, std::int64_t(1) << 23, std::int64_t(1) << 25};
  std::int64_t large_message_bytes = std::int64_t(1) << 22;
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

struct CalibrationSample {
  std::string what;         // "gemm 512x256x1024", "all_gather 1048576 B", ...
  double measured_s = 0;
  double fitted_s = 0;
};

struct Calibration {
  HardwareProfile profile;
  std::vector<CalibrationSample> samples;
  Fit gemm_fit, gemm_thin_fit, attention_forward_fit, attention_backward_fit, copy_fit;
  std::vector<std::pair<Collective, Fit>> collective_fits;
  // With several passes: each measurement's (max - min) / median over the passes, in the order measured.
  std::vector<double> pass_spreads;
};

// ---- fresh memory and scalar math: the fits, pure functions of measurements (tests feed them synthetic ones) ----

// One allocation size and the seconds to make, zero and free a Tensor of it (the fastest of several runs).
struct AllocationSample {
  double bytes = 0;
  double seconds = 0;
};

// Reused pages cost a memset, new pages a fault each on top (8x here): a sample is fresh when its seconds per byte
// exceed `fresh_factor` times the smallest sample's. The zero rate is fitted on the others, the fresh rate on the
// fresh ones, and fresh_min_bytes is the smallest size from which every larger sample is fresh (none: the largest
// sample plus one, so that every allocation is priced at the zero rate). Samples must be ascending in bytes.
inline FreshMemoryModel fit_fresh_memory(std::span<const AllocationSample> samples, double fresh_factor = 3) {
  check(!samples.empty(), "fit_fresh_memory: no samples");
  double fastest = 1e300;
  for (std::size_t i = 0; i < samples.size(); ++i) {
    check(samples[i].bytes > 0 && samples[i].seconds > 0, "fit_fresh_memory: sample {} has bytes = {}, seconds = {}",
          i, samples[i].bytes, samples[i].seconds);
    check(i == 0 || samples[i].bytes > samples[i - 1].bytes, "fit_fresh_memory: samples must be ascending in bytes");
    fastest = std::min(fastest, samples[i].seconds / samples[i].bytes);
  }
  // The first fresh sample of the trailing run of fresh ones.
  std::size_t first_fresh = samples.size();
  while (first_fresh > 0 && samples[first_fresh - 1].seconds / samples[first_fresh - 1].bytes > fresh_factor * fastest)
    --first_fresh;
  // Bytes over seconds of the group (a relative least-squares slope would follow its fastest sample).
  const auto rate_of = [&](std::size_t begin, std::size_t end) {
    double bytes = 0, seconds = 0;
    for (std::size_t i = begin; i < end; ++i) bytes += samples[i].bytes, seconds += samples[i].seconds;
    return bytes / seconds;
  };
  FreshMemoryModel model;
  model.zero_bytes_per_s = rate_of(0, std::max<std::size_t>(first_fresh, 1));
  model.fresh_bytes_per_s = first_fresh < samples.size() ? rate_of(first_fresh, samples.size()) : model.zero_bytes_per_s;
  model.fresh_min_bytes = first_fresh < samples.size() ? std::int64_t(samples[first_fresh].bytes)
                                                       : std::int64_t(samples.back().bytes) + 1;
  return model;
}

// A kernel that makes `calls` scalar math-library calls, measured at `seconds`, of which `other_s` are its other
// work as the profile prices it (memory traffic, activation elements).
struct ScalarSample {
  double calls = 0;
  double seconds = 0;
  double other_s = 0;
};

// Calls per second: the calls over the kernels' seconds beyond their other work (0, unpriced, when the kernels take
// no longer than their other work).
inline double fit_scalar_rate(std::span<const ScalarSample> samples) {
  double calls = 0, seconds = 0;
  for (const ScalarSample& s : samples) {
    check(s.calls > 0 && s.seconds > 0 && s.other_s >= 0, "fit_scalar_rate: calls = {}, seconds = {}, other = {}",
          s.calls, s.seconds, s.other_s);
    calls += s.calls;
    seconds += std::max(0.0, s.seconds - s.other_s);
  }
  return seconds > 0 ? calls / seconds : 0;
}

// An elementwise kernel mix at one size: the bytes its calls record in a dry run per call, and its seconds per call.
struct ElementwiseSample {
  double bytes = 0;
  double seconds = 0;
};

// Size classes from samples ascending in bytes: sample i's rate (bytes / seconds) holds the calls up to the
// geometric mean of its bytes and the next sample's, the last sample's up to its own bytes (larger calls take the
// last class's rate, cost/profile.hpp).
inline std::vector<ElementwiseClass> fit_elementwise_classes(std::span<const ElementwiseSample> samples) {
  check(!samples.empty(), "fit_elementwise_classes: no samples");
  std::vector<ElementwiseClass> classes;
  for (std::size_t i = 0; i < samples.size(); ++i) {
    const ElementwiseSample& s = samples[i];
    check(s.bytes >= 1 && s.seconds > 0, "fit_elementwise_classes: sample {} has bytes = {}, seconds = {}", i,
          s.bytes, s.seconds);
    check(i == 0 || s.bytes > samples[i - 1].bytes, "fit_elementwise_classes: samples must be ascending in bytes");
    const double bound = i + 1 < samples.size() ? std::sqrt(s.bytes * samples[i + 1].bytes) : s.bytes;
    classes.push_back({std::round(bound), s.bytes / s.seconds});
  }
  return classes;
}

// Serving's paged attention kernel (serve/paged_attention.hpp, which measures it): `visits` (query-key pair, head)
// visits of head dim `head_dim` measured at `seconds`.
struct PagedAttentionSample {
  double visits = 0;
  double head_dim = 0;
  double seconds = 0;
};

// The PagedAttentionModel of the samples (t = visits / visits_per_s + 4 d visits / flops_per_s, least relative error,
// non-negative; a coefficient fitted to 0 leaves its rate 0, that term unpriced) into `model`; the fit's errors back.
inline Fit fit_paged_attention(std::span<const PagedAttentionSample> samples, PagedAttentionModel& model) {
  check(!samples.empty(), "fit_paged_attention: no samples");
  std::vector<std::vector<double>> rows;
  std::vector<double> y;
  for (const PagedAttentionSample& s : samples) {
    check(s.visits > 0 && s.head_dim > 0 && s.seconds > 0,
          "fit_paged_attention: a sample of {} visits, head dim {}, {} s (all must be positive)", s.visits,
          s.head_dim, s.seconds);
    rows.push_back({s.visits, 4 * s.head_dim * s.visits});
    y.push_back(s.seconds);
  }
  Fit fit = fit_non_negative(rows, y);
  const std::vector<double>& c = fit.coefficients;
  model = {c[0] > 0 ? 1 / c[0] : 0, c[1] > 0 ? 1 / c[1] : 0};
  return fit;
}

namespace calibrate_detail {

// The slowest rank's seconds for fn(), the fastest of `repetitions` runs; every rank calls it. Within a calibration of
// several passes (cost/calibration_passes.hpp) a recording pass logs the result, and the replay returns the median of
// the passes' without running fn. fn's work on Backend is done before the clock is read (Backend::synchronize: a
// device backend's kernels run asynchronously; on the host it returns at once).
template <class Backend = ops::Cpu, Communicator C, class Fn>
double measure(C& comm, TimeSource clock, int repetitions, Fn&& fn) {
  PassLog* log = PassLog::current();
  if (log && log->mode() == PassLog::Mode::replay) return log->replay();
  std::vector<double> times;
  fn();  // warm up (page faults, first-touch, lazily built state)
  Backend::synchronize();
  for (int r = 0; r < repetitions; ++r) {
    comm.barrier();
    const double start = now_seconds(clock);
    fn();
    Backend::synchronize();
    times.push_back(max_over_ranks(comm, now_seconds(clock) - start));
  }
  const double fastest = *std::min_element(times.begin(), times.end());
  if (log) log->record(fastest);
  return fastest;
}

// t = value wherever Backend keeps its tensors (host or device memory).
template <class Backend>
void fill(Tensor<float>& t, float value) {
  Backend::fill(t.view(), value);
}

// t = overhead + flops / rate + operand bytes / bandwidth (cost/profile.hpp linear_gemm_time) fitted to float32 GEMM
// samples (shapes[i] took seconds[i]): the fit, and its terms as {overhead, rate, bandwidth} (1e30 and 0 for a
// coefficient fitted to 0: no term).
struct LinearGemmFit {
  Fit fit;
  double overhead_s = 0, flops_per_s = 1e30, bytes_per_s = 0;
};
inline LinearGemmFit fit_linear_gemm(const std::vector<std::array<std::int64_t, 3>>& shapes,
                                     const std::vector<double>& seconds) {
  std::vector<std::vector<double>> rows;
  for (const auto& [m, n, k] : shapes)
    rows.push_back({1.0, 2.0 * double(m) * double(n) * double(k), double(m * k + k * n + m * n) * sizeof(float)});
  LinearGemmFit r{fit_non_negative(rows, seconds)};
  const auto& c = r.fit.coefficients;
  r.overhead_s = c[0];
  r.flops_per_s = c[1] > 0 ? 1 / c[1] : 1e30;
  r.bytes_per_s = c[2] > 0 ? 1 / c[2] : 0;
  return r;
}

// Which operands a GEMM timing cycles through copies of, so that they come from memory: the weights b (a serving
// step reads every weight once: calibrate_gemm_classes, the speed probes) or all three (the head-width products'
// score matrices: CalibrationOptions::gemm_thin_shapes).
enum class ColdOperands { weights, all };

// Seconds of one GEMM c = a b^T (a = [m, k], b = [n, k]) on every rank at once (measure: the slowest rank, the fastest
// of `repetitions` passes after one untimed): a pass runs one GEMM per copy of the `cold` operands, as many copies as
// add up to cold_bytes (at least one; 0: operands hot, one GEMM a pass), and the time is the pass's over its GEMMs.
// batch > 1 (cold operands `all` only): the copies, a multiple of batch, go `batch` at a time through one gemm_batched
// call, as attention materialised runs its heads (on a GPU a single head-width GEMM leaves most of the SMs idle).
template <class Backend, Communicator C>
double time_gemm(C& comm, TimeSource clock, int repetitions, const std::array<std::int64_t, 3>& shape,
                 std::int64_t cold_bytes, ColdOperands cold, std::int64_t batch = 1) {
  const auto [m, n, k] = shape;
  check(m > 0 && n > 0 && k > 0, "calibrate: GEMM shape {}x{}x{} must be positive", m, n, k);
  check(batch >= 1 && (batch == 1 || cold == ColdOperands::all), "calibrate: GEMM batch {} must be at least 1 (and "
        "batch only with every operand cold)", batch);
  const std::int64_t weight_bytes = n * k * std::int64_t(sizeof(float));
  const std::int64_t cycled_bytes =
      cold == ColdOperands::all ? weight_bytes + (m * k + m * n) * std::int64_t(sizeof(float)) : weight_bytes;
  const std::int64_t items = std::max<std::int64_t>(1, cold_bytes / cycled_bytes);
  const std::size_t copies = std::size_t((items + batch - 1) / batch * batch);
  const std::size_t others = cold == ColdOperands::all ? copies : 1;  // copies of a and c
  std::vector<Tensor<float>> a, b, c;
  for (std::size_t i = 0; i < others; ++i) a.emplace_back(Shape{m, k}), c.emplace_back(Shape{m, n}), fill<Backend>(a.back(), 0.5f);
  for (std::size_t i = 0; i < copies; ++i) b.emplace_back(Shape{n, k}), fill<Backend>(b.back(), 0.25f);
  std::vector<const float*> a_items, b_items;  // gemm_batched's operand pointers, copy by copy
  std::vector<float*> c_items;
  for (std::size_t i = 0; i < copies; ++i)
    a_items.push_back(a[i % others].data()), b_items.push_back(b[i].data()), c_items.push_back(c[i % others].data());
  const double pass = measure<Backend>(comm, clock, repetitions, [&] {
    if (batch == 1) {
      for (std::size_t i = 0; i < copies; ++i)
        Backend::matmul(a[i % others].view(), ops::Transpose::no, b[i].view(), ops::Transpose::yes,
                        c[i % others].view());
      return;
    }
    const std::size_t step = std::size_t(batch);
    for (std::size_t i = 0; i < copies; i += step)
      Backend::gemm_batched(ops::Transpose::no, ops::Transpose::yes, m, n, k, 1.0f,
                            std::span<const float* const>(a_items).subspan(i, step), k,
                            std::span<const float* const>(b_items).subspan(i, step), k, 0.0f,
                            std::span<float* const>(c_items).subspan(i, step), n);
  });
  return pass / double(copies);
}

// Fresh allocations, per size of options.fresh_bytes: Tensors made (zeroed) until the working set is live, then
// all freed, as a step's activations are (one Tensor made and freed again and again would measure the C library's
// reuse of that one block, not a step; when the working set is freed the library gives its pages back, so the next
// step faults them in again). Samples are per allocation: the working set's time over its tensors.
template <class Backend, Communicator C>
void calibrate_fresh_memory(C& comm, const CalibrationOptions& options, Calibration& result) {
  std::vector<AllocationSample> samples;
  for (std::int64_t bytes : options.fresh_bytes) {
    const std::int64_t count = std::max<std::int64_t>(1, options.fresh_working_set_bytes / bytes);
    const double t = measure<Backend>(comm, options.clock, options.repetitions, [&] {
      std::vector<Tensor<float>> live;
      live.reserve(std::size_t(count));
      for (std::int64_t i = 0; i < count; ++i) live.emplace_back(Shape{bytes / 4});
    });
    samples.push_back({double(bytes), t / double(count)});
  }
  result.profile.fresh_memory = fit_fresh_memory(samples);
  for (const AllocationSample& s : samples)
    result.samples.push_back({fmt::format("fresh tensor {} B", std::int64_t(s.bytes)), s.seconds,
                              result.profile.fresh_memory.time(s.bytes)});
}

// Elementwise kernels by size (options.elementwise_class_rows): per size, a mix of the backend's elementwise kernels
// as a layer runs them on its activations [rows, heads, d] (a copy, a copy out of the head-major view a re-layout
// reads, a sum into, LayerNorm forward and backward over rows of heads x d), their inputs just written (a step's are
// the previous kernel's outputs: in cache while they fit). Each call is priced per byte the counting backend records
// for it (ops/counting.hpp, run on the same views), so the rates are in the dry run's bytes.
template <class Backend, Communicator C>
void calibrate_elementwise_classes(C& comm, const CalibrationOptions& options, Calibration& result) {
  if (options.elementwise_class_rows.empty()) return;
  const std::int64_t heads = options.attention_heads, d = options.head_dim, h = heads * d;
  std::vector<ElementwiseSample> samples;
  for (const std::int64_t rows : options.elementwise_class_rows) {
    Tensor<float> x(Shape{rows, heads, d}), y(Shape{rows, heads, d}), dy(Shape{rows, h}), dx(Shape{rows, h});
    Tensor<float> norm(Shape{4, h}), mean(Shape{rows}), rstd(Shape{rows});  // gamma, beta, dgamma, dbeta
    calibrate_detail::fill<Backend>(x, 0.5f);
    calibrate_detail::fill<Backend>(dy, 0.25f);
    calibrate_detail::fill<Backend>(norm, 1.0f);
    const auto row = [&](std::int64_t i) { return norm.view().slice(0, i, 1).reshape(Shape{h}); };
    const TensorView<const float> by_head(x.data(), Shape{heads, rows, d}, Shape{d, h, 1});  // [heads, rows, d]
    const TensorView<const float> x2(x.data(), Shape{rows, h});
    const TensorView<float> y2(y.data(), Shape{rows, h});
    const auto mix = [&]<class B>() {
      B::copy(x.view(), y.view());
      B::copy(by_head, y.view().reshape(Shape{heads, rows, d}));
      B::add_into(y.view(), x.view());
      B::layer_norm_forward(x2, row(0), row(1), 1e-5f, y2, mean.view(), rstd.view());
      B::layer_norm_backward(x2, row(0), mean.view(), rstd.view(), dy.view(), dx.view(), row(2), row(3));
    };
    const double seconds =
        measure<Backend>(comm, options.clock, options.repetitions, [&] { mix.template operator()<Backend>(); });
    const Trace trace = trace_of([&] { mix.template operator()<ops::Counting>(); });
    double bytes = 0, calls = 0;
    for (const TraceEvent& e : trace.events())
      if (e.kind == TraceKind::elementwise) bytes += e.bytes * e.count, calls += e.count;
    check(calls > 0, "calibrate_elementwise_classes: the counting backend recorded no elementwise call");
    samples.push_back({bytes / calls, seconds / calls});
  }
  result.profile.elementwise_classes = fit_elementwise_classes(samples);
  for (const ElementwiseSample& s : samples)
    result.samples.push_back({fmt::format("elementwise mix, {} B per call", std::int64_t(s.bytes)), s.seconds,
                              result.profile.elementwise_time(s.bytes)});
}

// One elementwise family's calls at one size: how many kernels, their bytes, their time.
struct FamilySample {
  double kernels, bytes, seconds;
};
// t = kernels x overhead + bytes / rate, least squares over the samples (non-negative terms; 0 bytes/s: no rate).
inline ElementwiseFamilyRate fit_elementwise_family(const std::vector<FamilySample>& samples) {
  std::vector<std::vector<double>> rows;
  std::vector<double> y;
  for (const FamilySample& s : samples) rows.push_back({s.kernels, s.bytes}), y.push_back(s.seconds);
  const Fit fit = fit_non_negative(rows, y);
  ElementwiseFamilyRate rate;
  rate.overhead_s = fit.coefficients[0];
  rate.bytes_per_s = fit.coefficients[1] > 0 ? 1 / fit.coefficients[1] : 0;
  return rate;
}

// Elementwise kernel families (options.elementwise_family_rows): per family (ElementwiseFamily, core/trace.hpp) its
// kernels as a layer runs them on [rows, heads, d] activations (copy; fill; add_into; LayerNorm and RMSNorm forward
// and backward; RoPE forward and backward; the materialised causal softmax forward and backward on heads x n x n
// scores of as many elements; GELU and SwiGLU forward and backward; an AdamW step over as many parameters; a row
// gather and scatter-add in reversed order), at each size: t = kernels x overhead + bytes / rate over the sizes, the
// kernels and bytes the counting backend records for the same calls (ops/counting.hpp). The overhead is a kernel's, as
// the time model charges it per event (fitted per mix, a call was charged the overhead of the family's two to four
// kernels).
template <class Backend, Communicator C>
void calibrate_elementwise_families(C& comm, const CalibrationOptions& options, Calibration& result) {
  if (options.elementwise_family_rows.empty()) return;
  const std::int64_t heads = options.attention_heads, d = options.head_dim, h = heads * d;
  std::array<std::vector<FamilySample>, kElementwiseFamilies> samples;
  for (const std::int64_t rows : options.elementwise_family_rows) {
    check(rows >= 2 && h % 2 == 0, "calibrate: elementwise family rows {} (h = {}) must be at least 2 (h even)", rows, h);
    Tensor<float> x(Shape{rows, h}), y(Shape{rows, h}), dy(Shape{rows, h}), dx(Shape{rows, h});
    Tensor<float> norm(Shape{4, h}), mean(Shape{rows}), rstd(Shape{rows});
    const std::int64_t n = std::max<std::int64_t>(8, std::int64_t(std::sqrt(double(rows * d))));
    Tensor<float> scores(Shape{1, heads, n, n}), dscores(Shape{1, heads, n, n});
    calibrate_detail::fill<Backend>(x, 0.5f);
    calibrate_detail::fill<Backend>(dy, 0.25f);
    calibrate_detail::fill<Backend>(dx, 0.01f);
    calibrate_detail::fill<Backend>(norm, 1.0f);
    calibrate_detail::fill<Backend>(scores, 0.5f);
    calibrate_detail::fill<Backend>(dscores, 0.1f);
    const auto row = [&](std::int64_t i) { return norm.view().slice(0, i, 1).reshape(Shape{h}); };
    const auto heads_of = [&](Tensor<float>& t) { return t.view().reshape(Shape{1, rows, heads, d}); };
    const auto half = [&](Tensor<float>& t, std::int64_t i) { return t.view().slice(1, i * h / 2, h / 2); };
    const std::vector<ops::PositionRun> runs{{0, 0, n}};
    std::vector<std::int64_t> reversed(static_cast<std::size_t>(rows));
    for (std::int64_t i = 0; i < rows; ++i) reversed[std::size_t(i)] = rows - 1 - i;
    ops::AdamWConfig adamw;
    const auto kernels = [&]<class B>(ElementwiseFamily family) {
      switch (family) {
        case ElementwiseFamily::copy: B::copy(x.view(), y.view()); break;
        case ElementwiseFamily::fill: B::fill(y.view(), 0.0f); break;
        case ElementwiseFamily::add: B::add_into(y.view(), x.view()); break;
        case ElementwiseFamily::norm:
          B::layer_norm_forward(x.view(), row(0), row(1), 1e-5f, y.view(), mean.view(), rstd.view());
          B::layer_norm_backward(x.view(), row(0), mean.view(), rstd.view(), dy.view(), dx.view(), row(2), row(3));
          B::rms_norm_forward(x.view(), row(0), 1e-5f, y.view(), rstd.view());
          B::rms_norm_backward(x.view(), row(0), rstd.view(), dy.view(), dx.view(), row(2));
          break;
        case ElementwiseFamily::rope:
          B::rope_forward(heads_of(x), heads_of(y), 0);
          B::rope_backward(heads_of(dy), heads_of(dx), 0);
          break;
        case ElementwiseFamily::softmax:  // in place, on the last call's probabilities (finite, as scores are)
          B::masked_softmax_forward(scores.view(), runs, runs, true);
          B::softmax_backward(scores.view(), dscores.view());
          break;
        case ElementwiseFamily::activation:
          B::gelu_forward(x.view(), y.view());
          B::gelu_backward(x.view(), dy.view(), dx.view());
          B::swiglu_forward(half(x, 0), half(x, 1), half(y, 0));
          B::swiglu_backward(half(x, 0), half(x, 1), half(dy, 0), half(dx, 0), half(dx, 1));
          break;
        case ElementwiseFamily::optimizer: B::adamw_step(y.view(), x.view(), dy.view(), dx.view(), adamw, 1); break;
        case ElementwiseFamily::rows:
          B::gather_rows(x.view(), reversed, {}, y.view());
          B::scatter_add_rows(dx.view(), reversed, y.view(), {});
          break;
        case ElementwiseFamily::other: break;
      }
    };
    for (int f = 1; f < kElementwiseFamilies; ++f) {
      const ElementwiseFamily family = ElementwiseFamily(f);
      const double seconds = measure<Backend>(comm, options.clock, options.repetitions,
                                              [&] { kernels.template operator()<Backend>(family); });
      const Trace trace = trace_of([&] { kernels.template operator()<ops::Counting>(family); });
      double kernels = 0, bytes = 0;
      for (const TraceEvent& e : trace.events())
        if (e.kind == TraceKind::elementwise || e.kind == TraceKind::activation)
          kernels += e.count, bytes += e.bytes * e.count;
      samples[std::size_t(f)].push_back({kernels, bytes, seconds});
    }
  }
  for (int f = 1; f < kElementwiseFamilies; ++f) {
    result.profile.elementwise_families[std::size_t(f)] = fit_elementwise_family(samples[std::size_t(f)]);
    for (const FamilySample& s : samples[std::size_t(f)])
      result.samples.push_back(
          {fmt::format("elementwise {} {} B in {} kernels", name_of(ElementwiseFamily(f)), std::int64_t(s.bytes),
                       std::int64_t(s.kernels)),
           s.seconds, s.kernels * result.profile.elementwise_time(s.bytes / s.kernels, ElementwiseFamily(f))});
  }
}

// The buffer pool's misses (options.pool_miss_bytes): per size, a pool lends buffers of that size and of a size a
// quarter larger (another class) in turn, so that every loan misses and evicts the other's cached buffer, as the
// churn of a step does. A miss makes a new zeroed Tensor of its class, the allocation calibrate_fresh_memory times
// under a working set that makes the C library hand out new pages, as a step's live activations do; timed alone the
// misses were bimodal here (the C library served 1 MiB misses from its heap's free top in one pass in four: 150 GB/s
// against 2-3 GB/s, the rate's error moving a step's prediction by 40%). So the rate is the bytes lent over their
// price at the fresh-memory rates (calibrated before this); the timed misses stay in the samples beside that price.
template <class Backend, Communicator C>
void calibrate_pool_misses(C& comm, const CalibrationOptions& options, Calibration& result) {
  if (options.pool_miss_bytes.empty()) return;
  constexpr int kLoans = 16;
  double bytes = 0, priced = 0;
  for (const std::int64_t size : options.pool_miss_bytes) {
    const std::int64_t sizes[2] = {size, size + size / 4};
    const double t = measure<Backend>(comm, options.clock, options.repetitions, [&] {
      BufferPool pool;
      for (int i = 0; i < kLoans; ++i) (void)pool.acquire<float>(Shape{sizes[i % 2] / 4});
    });
    double lent = 0, price = 0;
    for (const std::int64_t loan : sizes) {
      const double class_bytes = double(BufferPool::size_class(std::size_t(loan)));
      lent += kLoans / 2 * class_bytes;
      price += kLoans / 2 * result.profile.fresh_memory.time(class_bytes);
    }
    bytes += lent;
    priced += price;
    result.samples.push_back({fmt::format("pool misses, {} and {} B in turn", sizes[0], sizes[1]), t / kLoans,
                              price / kLoans});
  }
  result.profile.pool_miss_bytes_per_s = priced > 0 ? bytes / priced : 0;
}

// The fixed cost per kernel call (options.call_overheads): the non-GEMM kernels a serving step calls on its few rows
// (RMSNorm, a residual add, RoPE, SwiGLU, a row gather and scatter-add, a copy), each on one row of h = heads x d,
// kCallRounds times in turn; their work priced as the counting backend records it (ops/counting.hpp) on the rates
// calibrated before, the rest over the calls is kernel_call_s.
template <class Backend, Communicator C>
void calibrate_call_overheads(C& comm, const CalibrationOptions& options, Calibration& result) {
  if (!options.call_overheads) return;
  constexpr int kCallRounds = 256;
  HardwareProfile& profile = result.profile;
  const std::int64_t heads = options.attention_heads, d = options.head_dim, h = heads * d;
  Tensor<float> x(Shape{1, h}), y(Shape{1, h}), gamma(Shape{h}), rstd(Shape{1}), gate(Shape{1, h}), act(Shape{1, h});
  Tensor<float> q(Shape{1, 1, heads, d});
  calibrate_detail::fill<Backend>(x, 0.5f);
  calibrate_detail::fill<Backend>(gamma, 1.0f);
  calibrate_detail::fill<Backend>(gate, 0.3f);
  calibrate_detail::fill<Backend>(q, 0.1f);
  const std::vector<std::int64_t> rows = {0};
  const auto mix = [&]<class B>() {
    for (int i = 0; i < kCallRounds; ++i) {
      B::rms_norm_forward(x.view(), gamma.view(), 1e-5f, y.view(), rstd.view());
      B::add_into(x.view(), y.view());
      B::rope_forward(q.view(), q.view(), i);
      B::swiglu_forward(gate.view(), y.view(), act.view());
      B::gather_rows(x.view(), rows, {}, y.view());
      B::scatter_add_rows(x.view(), rows, act.view(), {});
      B::copy(y.view(), x.view());
    }
  };
  const double kernels =
      measure<Backend>(comm, options.clock, options.repetitions, [&] { mix.template operator()<Backend>(); });
  const Trace trace = trace_of([&] { mix.template operator()<ops::Counting>(); });
  double calls = 0, work = 0;
  for (const TraceEvent& e : trace.events()) {
    const double n = e.count;
    switch (e.kind) {
      case TraceKind::elementwise: calls += n, work += n * profile.elementwise_time(e.bytes); break;
      case TraceKind::activation: calls += n, work += n * profile.activation_time(e.m, e.bytes, e.n == 1); break;
      case TraceKind::transcendental: work += n * profile.scalar_math.time(ScalarFunction(int(e.n)), e.m); break;
      case TraceKind::scratch: work += n * profile.fresh_memory.time(e.bytes); break;
      default: break;
    }
  }
  check(calls > 0, "calibrate_call_overheads: the counting backend recorded no kernel call");
  profile.call_overhead.kernel_call_s = std::max(0.0, (kernels - work) / calls);
  result.samples.push_back({fmt::format("{} one-row kernel calls", std::int64_t(calls)), kernels,
                            work + calls * profile.call_overhead.kernel_call_s});
}

// Scalar math: the materialised softmax (an exp per score) and RoPE (a cos and a sin per token and frequency) at
// the shapes ColossalZ and every rope model run, their other work priced as the dry run records it (ops/counting.hpp).
template <class Backend, Communicator C>
void calibrate_scalar_math(C& comm, const CalibrationOptions& options, Calibration& result) {
  HardwareProfile& profile = result.profile;
  const std::int64_t heads = options.attention_heads, d = options.head_dim, n = 512, keys = 1024;
  Tensor<float> scores(Shape{1, heads, n, keys});
  const std::vector<ops::PositionRun> queries{{0, keys - n, n}}, key_runs{{0, 0, keys}};
  const double softmax = measure<Backend>(comm, options.clock, options.repetitions, [&] {
    calibrate_detail::fill<Backend>(scores, 0.5f);
    Backend::masked_softmax_forward(scores.view(), queries, key_runs, true);
  });
  const double elements = double(scores.numel());
  const double fill_s = profile.elementwise_time(4 * elements);  // the refill above, a write of the scores
  // The kernel calls exp on the visible scores only (causal: 75% of these), as the dry run counts them.
  const double exps = double(heads) * ops::softmax_visible_scores(queries, key_runs, true);
  const ScalarSample exp_sample{exps, softmax, fill_s + profile.activation_time(elements, 8 * elements)};
  profile.scalar_math.exp_per_s = fit_scalar_rate(std::span(&exp_sample, 1));

  Tensor<float> x(Shape{1, keys, heads, d}), y(Shape{1, keys, heads, d});
  calibrate_detail::fill<Backend>(x, 0.5f);
  const double rope = measure<Backend>(comm, options.clock, options.repetitions,
                              [&] { Backend::rope_forward(x.view(), y.view(), 0); });
  const ScalarSample sincos_sample{double(keys * d), rope, profile.elementwise_time(8.0 * double(x.numel()))};
  profile.scalar_math.sincos_per_s = fit_scalar_rate(std::span(&sincos_sample, 1));
  result.samples.push_back({fmt::format("softmax {}x{}x{} (exp)", heads, n, keys), softmax,
                            exp_sample.other_s + profile.scalar_math.time(ScalarFunction::exp, exps)});
  result.samples.push_back({fmt::format("rope {}x{}x{} (cos, sin)", keys, heads, d), rope,
                            sincos_sample.other_s + profile.scalar_math.time(ScalarFunction::sincos, double(keys * d))});
}

// Flash attention forward and backward over options.attention_lengths: t = overhead + flops / rate, the forward
// flops 4 d heads pairs. Full calls (every pair visible) of each length; with options.attention_whole_tiles, causal
// ones too and every call's pairs those of the whole tiles the kernel computes (AttentionModel::whole_tiles); with
// options.attention_causal_only, causal ones alone on their visible pairs.
template <class Backend, Communicator C>
void calibrate_attention(C& comm, const CalibrationOptions& options, Calibration& result) {
  std::vector<std::vector<double>> rows;
  std::vector<double> forward, backward;
  std::vector<std::string> names;
  const std::int64_t heads = options.attention_heads, d = options.head_dim;
  // The calls measured, per length: full (every pair visible) and causal where whole tiles are asked, else causal
  // where asked alone, else full.
  const bool full = options.attention_whole_tiles || !options.attention_causal_only;
  const bool causal_too = options.attention_whole_tiles || options.attention_causal_only;
  std::vector<std::pair<std::int64_t, bool>> calls;
  for (std::int64_t len : options.attention_lengths)
    for (const bool causal : {false, true})
      if (causal ? causal_too : full) calls.emplace_back(len, causal);
  for (const auto& [len, causal] : calls) {
    const ops::AttentionMask mask{.causal = causal};
    Tensor<float> q(Shape{1, len, heads, d}), k(Shape{1, len, heads, d}), v(Shape{1, len, heads, d});
    Tensor<float> out(Shape{1, len, heads, d}), lse(Shape{1, heads, len}), dout(Shape{1, len, heads, d});
    Tensor<float> dq(Shape{1, len, heads, d}), dk(Shape{1, len, heads, d}), dv(Shape{1, len, heads, d});
    calibrate_detail::fill<Backend>(q, 0.1f);
    calibrate_detail::fill<Backend>(k, 0.2f);
    calibrate_detail::fill<Backend>(v, 0.3f);
    calibrate_detail::fill<Backend>(dout, 0.01f);
    forward.push_back(measure<Backend>(comm, options.clock, options.repetitions, [&] {
      Backend::attention_forward(q.view(), k.view(), v.view(), mask, out.view(), lse.view());
    }));
    backward.push_back(measure<Backend>(comm, options.clock, options.repetitions, [&] {
      Backend::attention_backward(q.view(), k.view(), v.view(), out.view(), lse.view(), dout.view(), mask,
                                  dq.view(), dk.view(), dv.view());
    }));
    const double pairs = options.attention_whole_tiles
                             ? ops::tiled_pairs(mask, len, len, ops::cpu::attention_tiling(d))
                             : ops::visible_pairs(mask, len, len);
    rows.push_back({1.0, 4.0 * double(d) * pairs * double(heads)});
    names.push_back(fmt::format("s={}{}", len, causal ? " causal" : ""));
  }
  result.attention_forward_fit = fit_non_negative(rows, forward);
  std::vector<std::vector<double>> backward_rows = rows;
  for (auto& r : backward_rows) r[1] *= 2.5;  // the model's backward flops
  result.attention_backward_fit = fit_non_negative(backward_rows, backward);
  const auto& f = result.attention_forward_fit.coefficients;
  const auto& b = result.attention_backward_fit.coefficients;
  result.profile.attention = {f[0], f[1] > 0 ? 1 / f[1] : 1e30, b[1] > 0 ? 1 / b[1] : 1e30,
                              options.attention_whole_tiles, b[0]};
  for (std::size_t i = 0; i < rows.size(); ++i) {
    result.samples.push_back({"attention forward " + names[i], forward[i], f[0] + f[1] * rows[i][1]});
    result.samples.push_back({"attention backward " + names[i], backward[i], b[0] + b[1] * backward_rows[i][1]});
  }
}

// One pass of calibrate() (below): every measurement once.
template <class Backend, Communicator C>
Calibration calibrate_pass(C& comm, const CalibrationOptions& options) {
  const int p = comm.size();
  const int reps = options.repetitions;
  Calibration result;
  HardwareProfile& profile = result.profile;
  profile.name = options.name.empty() ? fmt::format("{}-p{} (calibrated)", Backend::name, p) : options.name;
  profile.description = fmt::format("{} ranks of the {} backend measured together ({})", p, Backend::name,
                                    options.clock == TimeSource::thread_cpu ? "thread CPU time" : "wall-clock time");
  profile.source = "calibrated by paradyse::cost::calibrate";
  profile.devices_per_node = p;
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGE_SIZE);
  profile.memory_bytes = options.memory_bytes > 0          ? options.memory_bytes
                         : pages > 0 && page > 0 ? std::int64_t(pages) * page / p
                                                 : std::int64_t(1) << 34;
  profile.reserved_bytes = 0;
  // A device backend (ops::Cuda) is measured on the terms a GPU's time has (the built-in profiles' terms, measured):
  // GEMMs, attention, copies, elementwise classes, call overheads, collectives. The host's own terms stay unpriced
  // there, as the built-in profiles leave them (cost/builtin_profiles.hpp): the CPU GEMM engines, compute-bound
  // activations (a GPU's are memory-bound: priced at the elementwise rates), fresh memory and the pool's misses (the
  // caching allocator reuses device blocks) and scalar math (the special-function units run inside memory-bound
  // kernels).
  constexpr bool on_device = ops::memory_space_of<Backend> == MemorySpace::device;

  // ---- GEMMs: the engine per size class, then t = overhead + flops / rate + bytes / bandwidth ---------------------
  if constexpr (!on_device) profile.gemm_engines = gemm_engine_choices(ops::cpu::gemm_measurement());
  {
    std::vector<double> y;
    for (const auto& shape : options.gemm_shapes)
      y.push_back(calibrate_detail::time_gemm<Backend>(comm, options.clock, reps, shape, 0,
                                                       calibrate_detail::ColdOperands::all));
    const calibrate_detail::LinearGemmFit f = calibrate_detail::fit_linear_gemm(options.gemm_shapes, y);
    result.gemm_fit = f.fit;
    profile.gemm = {f.overhead_s, f.flops_per_s, f.bytes_per_s};
    for (std::size_t i = 0; i < y.size(); ++i) {
      const auto [m, n, k] = options.gemm_shapes[i];
      result.samples.push_back({fmt::format("gemm {}x{}x{}", m, n, k), y[i],
                                profile.gemm.time(double(m), double(n), double(k), int(sizeof(float)))});
    }
  }
  if (!options.gemm_thin_shapes.empty()) {  // the head-width class, on its own shapes with their operands cold
    std::vector<double> y;
    double max_side = 0;
    for (const auto& shape : options.gemm_thin_shapes) {
      y.push_back(calibrate_detail::time_gemm<Backend>(comm, options.clock, reps, shape, options.gemm_thin_cold_bytes,
                                                       calibrate_detail::ColdOperands::all, options.gemm_thin_batch));
      max_side = std::max(max_side, double(std::min(shape[1], shape[2])));
    }
    const calibrate_detail::LinearGemmFit f = calibrate_detail::fit_linear_gemm(options.gemm_thin_shapes, y);
    result.gemm_thin_fit = f.fit;
    profile.gemm.thin = {max_side, f.overhead_s, f.flops_per_s, f.bytes_per_s};
    for (std::size_t i = 0; i < y.size(); ++i) {
      const auto [m, n, k] = options.gemm_thin_shapes[i];
      result.samples.push_back({fmt::format("gemm {}x{}x{} head-width, cold{}", m, n, k,
                                            options.gemm_thin_batch > 1
                                                ? fmt::format(", {} a call", options.gemm_thin_batch) : ""),
                                y[i],
                                profile.gemm.time(double(m), double(n), double(k), int(sizeof(float)))});
    }
  }

  calibrate_detail::calibrate_attention<Backend>(comm, options, result);

  // ---- copies: bytes read + written per second --------------------------------------------------------------------
  {
    std::vector<std::vector<double>> rows;
    std::vector<double> y;
    for (std::int64_t bytes : options.copy_bytes) {
      Tensor<float> from(Shape{bytes / 4}), to(Shape{bytes / 4});
      calibrate_detail::fill<Backend>(from, 1.0f);
      y.push_back(measure<Backend>(comm, options.clock, reps, [&] {
        if constexpr (on_device) Backend::copy(from.view(), to.view());
        else std::memcpy(to.data(), from.data(), std::size_t(bytes));
      }));
      rows.push_back({2.0 * double(bytes)});
    }
    result.copy_fit = fit_non_negative(rows, y);
    profile.elementwise_bytes_per_s = 1 / std::max(result.copy_fit.coefficients[0], 1e-30);
    for (std::size_t i = 0; i < y.size(); ++i)
      result.samples.push_back({fmt::format("copy {} B", options.copy_bytes[i]), y[i],
                                rows[i][0] * result.copy_fit.coefficients[0]});
  }

  // ---- activations: output elements per second of GELU forward + backward (compute-bound on CPUs) -----------------
  if constexpr (!on_device) {
    // Blocks of the size strategies apply them to (a rank's tokens by its ffn columns), in cache.
    const std::int64_t elements = std::int64_t(1) << 17;
    Tensor<float> pre(Shape{512, elements / 512}), act(Shape{512, elements / 512}), dpre(Shape{512, elements / 512});
    calibrate_detail::fill<Backend>(pre, 0.3f);
    const double t = measure<Backend>(comm, options.clock, reps, [&] {
      Backend::gelu_forward(pre.view(), act.view());
      Backend::gelu_backward(pre.view(), act.view(), dpre.view());
    });
    profile.activation_elements_per_s = 3.0 * double(elements) / t;  // forward + backward = 3 units (backward 2)
    result.samples.push_back({fmt::format("gelu forward + backward {} elements", elements), t, t});
  }
  // ---- SwiGLU forward: its gate and up halves read from one [rows, 2f] buffer, as the experts run it -------------
  if constexpr (!on_device) {
    const std::int64_t rows = 128, f = 256;  // a prefill chunk's expert rows by an expert's (slice of) width
    Tensor<float> pre(Shape{rows, 2 * f}), act(Shape{rows, f});
    calibrate_detail::fill<Backend>(pre, 0.3f);
    const double t = measure<Backend>(comm, options.clock, reps, [&] {
      Backend::swiglu_forward(pre.view().slice(1, 0, f), pre.view().slice(1, f, f), act.view());
    });
    profile.swiglu_forward_elements_per_s = double(rows * f) / t;
    result.samples.push_back({fmt::format("swiglu forward {}x{}", rows, f), t, t});
  }

  if constexpr (!on_device) {
    calibrate_detail::calibrate_fresh_memory<Backend>(comm, options, result);
    calibrate_detail::calibrate_scalar_math<Backend>(comm, options, result);
  }
  // After the scalar math, whose kernels' other work is priced at the single rate: the classes add to the model.
  calibrate_detail::calibrate_elementwise_classes<Backend>(comm, options, result);
  calibrate_detail::calibrate_elementwise_families<Backend>(comm, options, result);
  if constexpr (!on_device) calibrate_detail::calibrate_pool_misses<Backend>(comm, options, result);
  // After every per-byte and per-element rate: the calls' work is priced on them.
  calibrate_detail::calibrate_call_overheads<Backend>(comm, options, result);

  // ---- collectives: t = alpha + beta * bytes (nccl-tests sizes) ---------------------------------------------------
  if (p > 1) {
    for (Collective op : kAllCollectives) {
      std::vector<std::vector<double>> rows;
      std::vector<double> y;
      for (std::int64_t bytes : options.message_bytes) {
        const std::int64_t count = std::max<std::int64_t>(p, bytes / 4 / p * p);  // divisible by p
        Tensor<float> whole(Shape{count}), part(Shape{count / p}), other(Shape{count});
        calibrate_detail::fill<Backend>(whole, 1.0f);
        calibrate_detail::fill<Backend>(part, 1.0f);
        const std::span<const float> whole_in(whole.data(), std::size_t(count));
        const std::span<float> whole_out(other.data(), std::size_t(count));
        const std::span<const float> part_in(part.data(), std::size_t(count / p));
        const std::span<float> part_out(part.data(), std::size_t(count / p));
        const double t = measure<Backend>(comm, options.clock, reps, [&] {
          switch (op) {
            case Collective::all_gather: comm.all_gather(part_in, whole_out); break;
            case Collective::reduce_scatter: comm.reduce_scatter(whole_in, part_out, ReduceOp::sum); break;
            case Collective::all_reduce: comm.all_reduce(whole_in, whole_out, ReduceOp::sum); break;
            case Collective::all_to_all: comm.all_to_all(whole_in, whole_out); break;
            case Collective::broadcast: comm.broadcast(whole_out, 0); break;
            case Collective::reduce: comm.reduce(whole_in, whole_out, ReduceOp::sum, 0); break;
            case Collective::send_recv: comm.shift(whole_in, whole_out, 1); break;
          }
        });
        rows.push_back({1.0, double(count) * sizeof(float)});
        y.push_back(t);
      }
      // One line below the large-message size, one from it (each range falls back to all samples when it has
      // fewer than two).
      for (const bool large : {false, true}) {
        std::vector<std::vector<double>> range_rows;
        std::vector<double> range_y;
        for (std::size_t i = 0; i < y.size(); ++i)
          if ((rows[i][1] >= double(options.large_message_bytes)) == large) range_rows.push_back(rows[i]), range_y.push_back(y[i]);
        if (range_y.size() < 2) range_rows = rows, range_y = y;
        const Fit fit = fit_non_negative(range_rows, range_y);
        profile.set_collective(op, LinkLevel::intra_node, p, {fit.coefficients[0], fit.coefficients[1]},
                               large ? options.large_message_bytes : 0);
        if (!large) result.collective_fits.emplace_back(op, fit);
      }
      for (std::size_t i = 0; i < y.size(); ++i)
        result.samples.push_back({fmt::format("{} {} B", name_of(op), std::int64_t(rows[i][1])), y[i],
                                  profile.collective_time(op, p, rows[i][1])});
    }
    // The link model for other group sizes: the bus bandwidth and per-step latency of the all-gather.
    const AlphaBeta& gather = result.collective_fits[0].second.coefficients.empty()
                                  ? AlphaBeta{}
                                  : AlphaBeta{result.collective_fits[0].second.coefficients[0],
                                              result.collective_fits[0].second.coefficients[1]};
    const double bus = gather.beta_s_per_byte > 0 ? bus_factor(Collective::all_gather, p) / gather.beta_s_per_byte : 1e12;
    const AlphaBeta& shift = AlphaBeta{result.collective_fits.back().second.coefficients[0],
                                       result.collective_fits.back().second.coefficients[1]};
    profile.intra_node = {0, gather.alpha_s / latency_steps(Collective::all_gather, p), bus,
                          shift.beta_s_per_byte > 0 ? 1 / shift.beta_s_per_byte : 1e12};
    profile.inter_node = profile.intra_node;

    // ---- overlap: a GEMM beside a ring shift, against the two alone -----------------------------------------------
    const std::int64_t m = 1024, n = 256, k = 256, message = std::int64_t(1) << 20;
    Tensor<float> a(Shape{m, k}), b(Shape{n, k}), c(Shape{m, n}), send(Shape{message}), recv(Shape{message});
    calibrate_detail::fill<Backend>(a, 0.5f);
    calibrate_detail::fill<Backend>(b, 0.5f);
    const std::span<const float> send_span(send.data(), std::size_t(message));
    const std::span<float> recv_span(recv.data(), std::size_t(message));
    const auto gemm = [&] { Backend::matmul(a.view(), ops::Transpose::no, b.view(), ops::Transpose::yes, c.view()); };
    const double compute = measure<Backend>(comm, options.clock, reps, gemm);
    const double transfer = measure<Backend>(comm, options.clock, reps, [&] { comm.shift(send_span, recv_span, 1); });
    const double both = measure<Backend>(comm, options.clock, reps, [&] {
      Request r = comm.shift_async(send_span, recv_span, 1);
      gemm();
      r.wait();
    });
    const double hidden = compute + transfer - both;
    // In thread CPU time a rank's own thread does both its compute and its copies: nothing can hide, and what the
    // difference shows is noise. Overlap is measured only in wall-clock time.
    profile.overlap = options.clock == TimeSource::thread_cpu
                          ? 0.0
                          : std::clamp(hidden / std::max(std::min(compute, transfer), 1e-12), 0.0, 1.0);
    result.samples.push_back({"ring step: gemm alone", compute, compute});
    result.samples.push_back({"ring step: shift alone", transfer, transfer});
    result.samples.push_back({"ring step: both", both,
                              std::max(compute, transfer) + (1 - profile.overlap) * std::min(compute, transfer)});
  } else {
    profile.intra_node = profile.inter_node = {0, 0, 1e12, 1e12};
    profile.overlap = 1;
  }
  return result;
}

}  // namespace calibrate_detail

// Measures this machine and fits its profile (the header's comment says what is measured); with options.passes > 1,
// every measurement is the median of that many passes' (cost/calibration_passes.hpp) and result.pass_spreads says how
// far they disagreed. Every rank calls it (SPMD) and gets the same result.
template <class Backend = ops::Cpu, Communicator C>
Calibration calibrate(C& comm, const CalibrationOptions& options = {}) {
  check(options.repetitions >= 1, "calibrate: repetitions = {} must be at least 1", options.repetitions);
  std::vector<double> spreads;
  Calibration result = median_of_passes(
      options.passes, [&] { return calibrate_detail::calibrate_pass<Backend>(comm, options); }, &spreads);
  result.pass_spreads = std::move(spreads);
  return result;
}


// ---- GEMMs by size class (GemmModel::by_rows), on the shapes a workload runs, with its weights cold ----------------
//
// One linear form over every size misses the small GEMMs a serving step runs: fitted on calibrate's compute-bound
// shapes and the decode shapes together, it under-predicted 4 x 1024 x 256 by 28% here (318 us measured, 229 fitted)
// while over-predicting the 16-row ones. So the rows (m) split the shapes into classes, each fitted on its own
// (GemmRowClass: t = overhead + flops / rate + weight bytes / bandwidth + output elements / rate, relative least
// squares, non-negative), and the GEMMs are timed as the workload runs them: every weight read once per step, from memory rather than cache. A shape's time is
// one pass over copies of its weight operand that together exceed the caches (`cold_bytes` per rank), divided by the
// copies; 0 times the same operands again (hot).

// One measured GEMM: C[m, n] = A[m, k] B[n, k]^T took `seconds`.
struct GemmSample {
  std::int64_t m = 0, n = 0, k = 0;
  double seconds = 0;
};

// Fits one class per bound of `max_rows` (ascending): the samples with previous bound < m <= bound (samples above the
// last bound are left to the single fit). Every class needs at least 4 samples (its 4 terms), else an Error names
// it. `fits`, when given, gets each class's fit (its worst and median relative errors).
inline std::vector<GemmRowClass> fit_gemm_classes(const std::vector<GemmSample>& samples,
                                                  const std::vector<double>& max_rows, int dtype_bytes,
                                                  std::vector<Fit>* fits = nullptr) {
  check(dtype_bytes >= 1, "fit_gemm_classes: dtype_bytes = {} must be at least 1", dtype_bytes);
  for (std::size_t i = 0; i < max_rows.size(); ++i)
    check(max_rows[i] >= 1 && (i == 0 || max_rows[i] > max_rows[i - 1]),
          "fit_gemm_classes: class bounds must ascend from 1 (got {} after {})", max_rows[i],
          i == 0 ? 0.0 : max_rows[i - 1]);
  std::vector<GemmRowClass> classes;
  double below = 0;
  for (const double bound : max_rows) {
    std::vector<std::vector<double>> rows;
    std::vector<double> y;
    for (const GemmSample& x : samples) {
      if (double(x.m) <= below || double(x.m) > bound) continue;
      check(x.m > 0 && x.n > 0 && x.k > 0 && x.seconds > 0, "fit_gemm_classes: sample {}x{}x{} took {} s", x.m, x.n,
            x.k, x.seconds);
      const double m = double(x.m), n = double(x.n), k = double(x.k);
      rows.push_back({1.0, 2 * m * n * k, n * k * dtype_bytes, m * n});
      y.push_back(x.seconds);
    }
    check(y.size() >= 4, "fit_gemm_classes: the class {} < m <= {} has {} GEMM samples, at least 4 are needed", below,
          bound, y.size());
    const Fit fit = fit_non_negative(rows, y);
    const auto& c = fit.coefficients;
    classes.push_back({bound, c[0], c[1] > 0 ? 1 / c[1] : 1e30, c[2] > 0 ? 1 / c[2] : 0, c[3] > 0 ? 1 / c[3] : 0});
    if (fits) fits->push_back(fit);
    below = bound;
  }
  return classes;
}

struct GemmClassOptions {
  TimeSource clock = TimeSource::thread_cpu;
  int repetitions = 3;
  int passes = 1;  // each shape the median of this many passes' (cost/calibration_passes.hpp)
  std::vector<std::array<std::int64_t, 3>> shapes;  // (m, n, k): the workload's GEMMs
  std::vector<double> max_rows = {16, 128};         // class bounds; above the last, the profile's single fit
  std::int64_t cold_bytes = std::int64_t(128) << 20;  // weight copies per shape and rank (0: hot operands)
};

struct GemmClassCalibration {
  std::vector<GemmRowClass> classes;
  std::vector<GemmSample> samples;
  std::vector<Fit> fits;                     // per class
  std::vector<CalibrationSample> compared;   // each sample against its class's fit
};

// Times one shape on every rank at once, cycling through options.cold_bytes of weight copies: the slowest rank, the
// fastest of options.repetitions passes after one untimed, per GEMM. Every rank calls it (SPMD).
template <class Backend = ops::Cpu, Communicator C>
GemmSample time_gemm_shape(C& comm, const GemmClassOptions& options, const std::array<std::int64_t, 3>& shape) {
  return {shape[0], shape[1], shape[2],
          calibrate_detail::time_gemm<Backend>(comm, options.clock, options.repetitions, shape, options.cold_bytes,
                                               calibrate_detail::ColdOperands::weights)};
}

// Measures options.shapes (time_gemm_shape) and fits the classes; every rank calls it (SPMD) and gets the same result.
template <class Backend = ops::Cpu, Communicator C>
GemmClassCalibration calibrate_gemm_classes(C& comm, const GemmClassOptions& options) {
  check(options.repetitions >= 1 && options.cold_bytes >= 0 && !options.shapes.empty(),
        "calibrate_gemm_classes: repetitions = {} (>= 1), cold_bytes = {} (>= 0) and {} shapes (>= 1)",
        options.repetitions, options.cold_bytes, options.shapes.size());
  GemmClassCalibration result;
  result.samples = median_of_passes(options.passes, [&] {
    std::vector<GemmSample> samples;
    for (const auto& shape : options.shapes) samples.push_back(time_gemm_shape<Backend>(comm, options, shape));
    return samples;
  });
  result.classes = fit_gemm_classes(result.samples, options.max_rows, int(sizeof(float)), &result.fits);
  GemmModel model;
  model.by_rows = result.classes;
  for (const GemmSample& x : result.samples)
    if (model.row_class(double(x.m)) >= 0)
      result.compared.push_back({fmt::format("gemm {}x{}x{} cold", x.m, x.n, x.k), x.seconds,
                                 model.time(double(x.m), double(x.n), double(x.k), int(sizeof(float)))});
  return result;
}

}  // namespace paradyse::cost
