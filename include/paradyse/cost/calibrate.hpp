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
//     classes lent in turn: each evicts the other), its bytes lent per second of the timed misses (the profile's
//     pool_miss_bytes_per_s), each sample beside its price as unzeroed fresh memory;
//   - where options.call_overheads asks for it (moe_simulate --measure does): one-row calls of the backend's
//     non-GEMM kernels, their work priced on the rates above: the fixed seconds per kernel call (the profile's
//     call_overhead);
//   - every collective of the communicator at several sizes: t = alpha + beta * bytes, for this group size, a line per
//     size range (in the cores' caches, in the shared last-level cache, beyond it);
//   - a ring step (a GEMM beside a shift_async) against the two alone: the fraction of overlap the backend gives
//     (wall-clock time only; in thread CPU time it is 0 by construction).
//   - where options.copy_memory_bytes asks for it (moe_simulate --measure does), last: copies from memory (pieces,
//     each its own source and destination, cycled through that many bytes a rank): memory_copy_bytes_per_s.
// The fits minimise relative error with non-negative coefficients (cost/least_squares.hpp); their worst and median
// errors come back with the samples, so a poor fit is visible.
//
// calibrate_gemm_classes (below, separate) fits the GEMM model's size classes (GemmModel::by_rows) on the shapes a
// workload runs, with its weights read from memory: moe_simulate --measure calls it with the served model's GEMMs.
//
// The pieces: cost/calibration_options.hpp (what to measure, what comes back), cost/calibration_measure.hpp (how one
// measurement is timed), cost/calibration_fits.hpp (the fits), cost/calibrate_memory.hpp (the memory-bound and host
// terms); this header runs the pass (GEMMs, attention, copies, collectives, overlap) and the GEMM size classes.
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/core/timer.hpp"
#include "paradyse/cost/calibrate_memory.hpp"
#include "paradyse/cost/calibration_fits.hpp"
#include "paradyse/cost/calibration_measure.hpp"
#include "paradyse/cost/calibration_options.hpp"
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

namespace calibrate_detail {

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
  result.profile.attention = {f[0], rate_of(f[1], 1e30), rate_of(b[1], 1e30),
                              options.attention_whole_tiles, b[0]};
  for (std::size_t i = 0; i < rows.size(); ++i) {
    result.samples.push_back({"attention forward " + names[i], forward[i], f[0] + f[1] * rows[i][1]});
    result.samples.push_back({"attention backward " + names[i], backward[i], b[0] + b[1] * backward_rows[i][1]});
  }
}

// GEMMs: the engine per size class (on the host), then t = overhead + flops / rate + bytes / bandwidth over
// options.gemm_shapes, and the head-width class over options.gemm_thin_shapes where given.
template <class Backend, Communicator C>
void calibrate_gemms(C& comm, const CalibrationOptions& options, Calibration& result) {
  HardwareProfile& profile = result.profile;
  const int reps = options.repetitions;
  if constexpr (!ops::on_device<Backend>) profile.gemm_engines = gemm_engine_choices(ops::cpu::gemm_measurement());
  {
    std::vector<double> y;
    for (const auto& shape : options.gemm_shapes)
      y.push_back(calibrate_detail::time_gemm<Backend>(comm, options.clock, reps, shape, 0,
                                                       calibrate_detail::ColdOperands::all));
    const LinearGemmFit f = fit_linear_gemm(options.gemm_shapes, y);
    result.gemm_fit = f.fit;
    profile.gemm = {f.overhead_s, f.flops_per_s, f.bytes_per_s};
    for (std::size_t i = 0; i < y.size(); ++i) {
      const auto [m, n, k] = options.gemm_shapes[i];
      result.samples.push_back({fmt::format("gemm {}x{}x{}", m, n, k), y[i],
                                profile.gemm.time(double(m), double(n), double(k), int(sizeof(float)))});
      result.gemm_samples.push_back({m, n, k, y[i]});
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
    const LinearGemmFit f = fit_linear_gemm(options.gemm_thin_shapes, y);
    result.gemm_thin_fit = f.fit;
    profile.gemm.thin = {max_side, f.overhead_s, f.flops_per_s, f.bytes_per_s};
    std::vector<GemmSample> timed;
    for (std::size_t i = 0; i < y.size(); ++i)
      timed.push_back({options.gemm_thin_shapes[i][0], options.gemm_thin_shapes[i][1], options.gemm_thin_shapes[i][2],
                       y[i]});
    profile.gemm.thin.timed = measured_gemms(timed, int(sizeof(float)));
    for (std::size_t i = 0; i < y.size(); ++i) {
      const auto [m, n, k] = options.gemm_thin_shapes[i];
      result.samples.push_back({fmt::format("gemm {}x{}x{} head-width, cold{}", m, n, k,
                                            options.gemm_thin_batch > 1
                                                ? fmt::format(", {} a call", options.gemm_thin_batch) : ""),
                                y[i],
                                profile.gemm.time(double(m), double(n), double(k), int(sizeof(float)))});
    }
  }
}

// Copies from memory: pieces of copy_memory_piece_bytes, each from its own source into its own destination, the
// pairs adding up to copy_memory_bytes a rank; a pass copies every piece once, so that each one has left the caches
// when it is copied again (as a layout switch copies expert banks it has not touched since the last one). The pass's
// bytes read + written per second are the profile's memory_copy_bytes_per_s; copy_memory_bytes 0: not measured.
template <class Backend, Communicator C>
void calibrate_memory_copies(C& comm, const CalibrationOptions& options, Calibration& result) {
  if (options.copy_memory_bytes <= 0) return;
  const std::int64_t piece = options.copy_memory_piece_bytes;
  check(piece >= 4 && piece % 4 == 0 && piece <= options.copy_memory_bytes / 2, "calibrate: copy_memory_piece_bytes "
        "= {} must be a multiple of 4 (floats) and at most half of copy_memory_bytes = {} (a source and a "
        "destination)", piece, options.copy_memory_bytes);
  const std::size_t pairs = std::size_t(options.copy_memory_bytes / (2 * piece));
  std::vector<Tensor<float>> from, to;
  for (std::size_t i = 0; i < pairs; ++i) {
    from.emplace_back(Shape{piece / 4}), to.emplace_back(Shape{piece / 4});
    calibrate_detail::fill<Backend>(from.back(), 1.0f), calibrate_detail::fill<Backend>(to.back(), 0.0f);
  }
  const double pass = measure<Backend>(comm, options.clock, options.repetitions, [&] {
    for (std::size_t i = 0; i < pairs; ++i) {
      if constexpr (ops::on_device<Backend>) Backend::copy(from[i].view(), to[i].view());
      else std::memcpy(to[i].data(), from[i].data(), std::size_t(piece));
    }
  });
  const double moved = 2.0 * double(pairs) * double(piece);  // read + written
  result.profile.memory_copy_bytes_per_s = moved / std::max(pass, 1e-30);
  result.samples.push_back({fmt::format("copy from memory {} x {} B", pairs, piece), pass,
                            result.profile.memory_copy_time(moved)});
}

// Copies: bytes read + written per second (the elementwise rate; on the host a memcpy, on a device the backend's).
template <class Backend, Communicator C>
void calibrate_copies(C& comm, const CalibrationOptions& options, Calibration& result) {
  std::vector<std::vector<double>> rows;
  std::vector<double> y;
  for (std::int64_t bytes : options.copy_bytes) {
    Tensor<float> from(Shape{bytes / 4}), to(Shape{bytes / 4});
    calibrate_detail::fill<Backend>(from, 1.0f);
    y.push_back(measure<Backend>(comm, options.clock, options.repetitions, [&] {
      if constexpr (ops::on_device<Backend>) Backend::copy(from.view(), to.view());
      else std::memcpy(to.data(), from.data(), std::size_t(bytes));
    }));
    rows.push_back({2.0 * double(bytes)});
  }
  result.copy_fit = fit_non_negative(rows, y);
  result.profile.elementwise_bytes_per_s = 1 / std::max(result.copy_fit.coefficients[0], 1e-30);
  for (std::size_t i = 0; i < y.size(); ++i)
    result.samples.push_back({fmt::format("copy {} B", options.copy_bytes[i]), y[i],
                              rows[i][0] * result.copy_fit.coefficients[0]});
}

// Activations on the host, where they are compute-bound: GELU forward + backward in output elements per second, and
// SwiGLU forward with its gate and up halves read from one [rows, 2f] buffer, as the experts run it.
template <class Backend, Communicator C>
void calibrate_activations(C& comm, const CalibrationOptions& options, Calibration& result) {
  HardwareProfile& profile = result.profile;
  const int reps = options.repetitions;
  {  // GELU on blocks of the size strategies apply it to (a rank's tokens by its ffn columns), in cache
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
  {  // SwiGLU on a prefill chunk's expert rows by an expert's (slice of) width
    const std::int64_t rows = 128, f = 256;
    Tensor<float> pre(Shape{rows, 2 * f}), act(Shape{rows, f});
    calibrate_detail::fill<Backend>(pre, 0.3f);
    const double t = measure<Backend>(comm, options.clock, reps, [&] {
      Backend::swiglu_forward(pre.view().slice(1, 0, f), pre.view().slice(1, f, f), act.view());
    });
    profile.swiglu_forward_elements_per_s = double(rows * f) / t;
    result.samples.push_back({fmt::format("swiglu forward {}x{}", rows, f), t, t});
  }
}

// Collectives, p > 1: t = alpha + beta * bytes per collective (nccl-tests sizes), a line per size range
// (message_ranges: below options.large_message_bytes, from it, beyond the last-level cache), and the link model for
// other group sizes (the all-gather's bus bandwidth and per-step latency, the shift's bandwidth).
template <class Backend, Communicator C>
void calibrate_collectives(C& comm, const CalibrationOptions& options, Calibration& result) {
  HardwareProfile& profile = result.profile;
  const int p = comm.size(), reps = options.repetitions;
  // The host's caches say nothing of a device's collectives.
  const std::int64_t cache = ops::on_device<Backend> ? 0
                             : options.cache_bytes < 0 ? last_level_cache_bytes()
                                                       : options.cache_bytes;
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
    std::vector<std::int64_t> sizes;
    for (const std::vector<double>& row : rows) sizes.push_back(std::int64_t(row[1]));
    const std::vector<std::int64_t> from = message_ranges(options.large_message_bytes, cache, p, sizes);
    const std::vector<Fit> fits = fit_message_ranges(rows, y, from);
    for (std::size_t r = 0; r < from.size(); ++r)
      profile.set_collective(op, LinkLevel::intra_node, p, {fits[r].coefficients[0], fits[r].coefficients[1]},
                             from[r]);
    result.collective_fits.emplace_back(op, fits[0]);
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
                        rate_of(shift.beta_s_per_byte, 1e12)};
  profile.inter_node = profile.intra_node;
}

// Overlap, p > 1: a GEMM beside a ring shift against the two alone, the fraction of the shorter hidden (wall-clock
// time only).
template <class Backend, Communicator C>
void calibrate_overlap(C& comm, const CalibrationOptions& options, Calibration& result) {
  HardwareProfile& profile = result.profile;
  const int reps = options.repetitions;
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
}

// One pass of calibrate() (below): every measurement once, in this order (a calibration of several passes replays
// them in it).
template <class Backend, Communicator C>
Calibration calibrate_pass(C& comm, const CalibrationOptions& options) {
  const int p = comm.size();
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

  calibrate_gemms<Backend>(comm, options, result);
  calibrate_attention<Backend>(comm, options, result);
  calibrate_copies<Backend>(comm, options, result);
  if constexpr (!ops::on_device<Backend>) {
    calibrate_activations<Backend>(comm, options, result);
    calibrate_fresh_memory<Backend>(comm, options, result);
    calibrate_scalar_math<Backend>(comm, options, result);
  }
  // After the scalar math, whose kernels' other work is priced at the single rate: the classes add to the model.
  calibrate_elementwise_classes<Backend>(comm, options, result);
  calibrate_elementwise_families<Backend>(comm, options, result);
  if constexpr (!ops::on_device<Backend>) calibrate_pool_misses<Backend>(comm, options, result);
  // After every per-byte and per-element rate: the calls' work is priced on them.
  calibrate_call_overheads<Backend>(comm, options, result);
  if (p > 1) {
    calibrate_collectives<Backend>(comm, options, result);
    calibrate_overlap<Backend>(comm, options, result);
  } else {
    profile.intra_node = profile.inter_node = {0, 0, 1e12, 1e12};
    profile.overlap = 1;
  }
  // Last: its working set streams through every cache and its pieces go back to the C library's heap, which would
  // change what the measurements above see.
  calibrate_memory_copies<Backend>(comm, options, result);
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
// copies; 0 times the same operands again (hot). The samples are also kept as they were measured (measured_gemms,
// GemmModel::measured): the workload's own shapes are then priced by their own times, the classes price the rest.

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
    classes.push_back({bound, c[0], rate_of(c[1], 1e30), rate_of(c[2]), rate_of(c[3])});
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
  GemmMeasured measured;                     // the samples as measured shapes
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
  result.measured = measured_gemms(result.samples, int(sizeof(float)));
  result.measured.cycle_bytes = double(options.cold_bytes);  // 0 (hot operands): not a cycle
  GemmModel model;
  model.by_rows = result.classes;
  for (const GemmSample& x : result.samples)
    if (model.row_class(double(x.m)) >= 0)
      result.compared.push_back({fmt::format("gemm {}x{}x{} cold", x.m, x.n, x.k), x.seconds,
                                 model.time(double(x.m), double(x.n), double(x.k), int(sizeof(float)))});
  return result;
}

}  // namespace paradyse::cost
