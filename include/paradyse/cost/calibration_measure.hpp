// paradyse/cost/calibration_measure.hpp: how a calibration times a piece of work on every rank at once (measure:
// the slowest rank, the fastest of a few repetitions, recorded or replayed by a calibration of several passes) and
// the GEMM timing the GEMM fits share (time_gemm: operands hot or cycled through memory, single or batched calls).
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/cost/calibration_options.hpp"
#include "paradyse/cost/calibration_passes.hpp"
#include "paradyse/ops/backend.hpp"

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace paradyse::cost::calibrate_detail {

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

// A quantity read beside a measurement (the share of new pages an allocation timing faulted in, ...): the largest
// rank's, recorded with the pass's measurements; the replay returns the median of the passes' (measure's rule), so
// `value` is only read in a recording pass or without passes.
template <Communicator C>
double measured_quantity(C& comm, double value) {
  PassLog* log = PassLog::current();
  if (log && log->mode() == PassLog::Mode::replay) return log->replay();
  value = max_over_ranks(comm, value);
  if (log) log->record(value);
  return value;
}

// t = value wherever Backend keeps its tensors (host or device memory).
template <class Backend>
void fill(Tensor<float>& t, float value) {
  Backend::fill(t.view(), value);
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
  for (std::size_t i = 0; i < others; ++i)
    a.emplace_back(Shape{m, k}), c.emplace_back(Shape{m, n}), fill<Backend>(a.back(), 0.5f);
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

}  // namespace paradyse::cost::calibrate_detail
