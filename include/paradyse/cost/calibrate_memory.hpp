// paradyse/cost/calibrate_memory.hpp: the calibration's memory-bound and host terms (cost/calibrate.hpp runs them
// in its pass): fresh allocations, the elementwise size classes and kernel families, the buffer pool's misses, the
// fixed cost per kernel call and the scalar math of the materialised softmax and RoPE; and the host queries they and
// the collectives use (page faults, the page size, the last-level cache).
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/core/host_malloc.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/core/trace.hpp"
#include "paradyse/cost/calibration_fits.hpp"
#include "paradyse/cost/calibration_measure.hpp"
#include "paradyse/cost/calibration_options.hpp"
#include "paradyse/cost/profile.hpp"
#include "paradyse/ops/backend.hpp"
#include "paradyse/ops/counting.hpp"
#include "paradyse/strategy/buffer_pool.hpp"

#include <fmt/format.h>

#if defined(__linux__)
#include <sys/resource.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <span>
#include <string>
#include <vector>

namespace paradyse::cost::calibrate_detail {

// The page faults this thread has taken so far (Linux: getrusage's minor faults); -1 where they cannot be counted.
inline std::int64_t thread_page_faults() {
#if defined(__linux__)
  rusage usage{};
  if (getrusage(RUSAGE_THREAD, &usage) == 0) return std::int64_t(usage.ru_minflt);
#endif
  return -1;
}

// The bytes of one page a fault brings in (Linux: the system's page size; 4 KiB where it cannot be asked).
inline double page_bytes() {
#if defined(__linux__)
  if (const long bytes = ::sysconf(_SC_PAGESIZE); bytes > 0) return double(bytes);
#endif
  return 4096;
}

// The largest cache of CPU 0 (Linux: the sysfs cache directory `cpu0_cache`, index*/size such as "32768K" with the
// highest index*/level); 0 where none is listed. Not sysconf(_SC_LEVEL3_CACHE_SIZE): on an AMD EPYC VM whose guests
// share a 32 MiB L3 (sysfs, lscpu) the C library's cpuid reading said 320 MiB.
inline std::int64_t last_level_cache_bytes(
    const std::filesystem::path& cpu0_cache = "/sys/devices/system/cpu/cpu0/cache") {
  std::error_code error;
  int top_level = 0;
  std::int64_t bytes = 0;
  for (const auto& entry : std::filesystem::directory_iterator(cpu0_cache, error)) {
    if (!entry.path().filename().string().starts_with("index")) continue;
    std::ifstream level_file(entry.path() / "level"), size_file(entry.path() / "size");
    int level = 0;
    std::int64_t size = 0;
    char unit = 0;
    if (!(level_file >> level) || !(size_file >> size) || size <= 0) continue;
    size_file >> unit;  // "K", "M" or "G"; none: bytes
    const std::int64_t scale = unit == 'K' ? 1 << 10 : unit == 'M' ? 1 << 20 : unit == 'G' ? 1 << 30 : 1;
    if (level > top_level || (level == top_level && size * scale > bytes)) top_level = level, bytes = size * scale;
  }
  return bytes;
}

// Fresh allocations, per size of options.fresh_bytes: Tensors made (zeroed) until the working set is live, then
// all freed, as a step's activations are (one Tensor made and freed again and again would measure the C library's
// reuse of that one block, not a step; when the working set is freed the library gives its pages back, so the next
// step faults them in again). Samples are per allocation: the working set's time over its tensors. The size from
// which allocations get new pages is the C library's threshold where this process set it (core/host_malloc.hpp).
// Each sample also counts the page faults its allocations took (AllocationSample::new_share): the library serves a
// request above its threshold from the free top of a heap when one is large enough, which the earlier, smaller
// samples leave behind (a thread's heap holds up to 64 MiB), so one calibration's 32 MiB sample faulted in half its
// pages (9.3 ms an allocation) where a training step's 32 MiB score matrices fault in all of theirs (16-17 ms; stop
// 52).
template <class Backend, Communicator C>
void calibrate_fresh_memory(C& comm, const CalibrationOptions& options, Calibration& result) {
  const double page = page_bytes();
  std::vector<AllocationSample> samples;
  for (std::int64_t bytes : options.fresh_bytes) {
    const std::int64_t count = std::max<std::int64_t>(1, options.fresh_working_set_bytes / bytes);
    std::int64_t faults = 0, calls = 0;
    const double t = measure<Backend>(comm, options.clock, options.repetitions, [&] {
      const std::int64_t before = thread_page_faults();
      std::vector<Tensor<float>> live;
      live.reserve(std::size_t(count));
      for (std::int64_t i = 0; i < count; ++i) live.emplace_back(Shape{bytes / 4});
      const std::int64_t after = thread_page_faults();
      faults = before >= 0 && after >= before && faults >= 0 ? faults + after - before : -1;
      ++calls;
    });
    const double counted =
        faults >= 0 && calls > 0 ? std::min(1.0, double(faults) * page / (double(calls) * double(count * bytes))) : 1.0;
    samples.push_back({double(bytes), t / double(count), measured_quantity(comm, counted)});
  }
  result.profile.fresh_memory = fit_fresh_memory(samples, host_new_pages_from());
  for (const AllocationSample& s : samples)
    result.samples.push_back({fmt::format("fresh tensor {} B ({:.0f}% new pages)", std::int64_t(s.bytes),
                                          100 * s.new_share),
                              s.seconds, result.profile.fresh_memory.time(s.bytes)});
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
// churn of a step does. A miss allocates its class unzeroed (the pool's contents are unspecified), so what it costs
// is the C library's work and, from the fresh size on, the new pages' faults that the first kernel to write it takes:
// the replay prices those at the fresh-memory rates (plan/cost_table.hpp). The rate here, the bytes lent over the
// timed misses, turns that replay on and prices the misses only where a profile has no fresh-memory rates.
template <class Backend, Communicator C>
void calibrate_pool_misses(C& comm, const CalibrationOptions& options, Calibration& result) {
  if (options.pool_miss_bytes.empty()) return;
  constexpr int kLoans = 16;
  double bytes = 0, seconds = 0;
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
      price += kLoans / 2 * result.profile.fresh_memory.time(class_bytes, /*zeroed=*/false);
    }
    bytes += lent;
    seconds += t;
    result.samples.push_back({fmt::format("pool misses, {} and {} B in turn", sizes[0], sizes[1]), t / kLoans,
                              price / kLoans});
  }
  result.profile.pool_miss_bytes_per_s = seconds > 0 ? bytes / seconds : 0;
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

// Scalar math: the materialised softmax (its loop per score and an exp per visible score) and RoPE (a cos and a sin
// per token and frequency) at the shapes ColossalZ and every rope model run, their other work priced as the dry run
// records it (ops/counting.hpp). The softmax at two visible shares, its queries the first n positions of the keys
// (causal: a quarter of the scores visible here) and the last n (three quarters), tells its two terms apart.
template <class Backend, Communicator C>
void calibrate_scalar_math(C& comm, const CalibrationOptions& options, Calibration& result) {
  HardwareProfile& profile = result.profile;
  const std::int64_t heads = options.attention_heads, d = options.head_dim, n = 512, keys = 1024;
  Tensor<float> scores(Shape{1, heads, n, keys});
  const double elements = double(scores.numel());
  const double fill_s = profile.elementwise_time(4 * elements);  // the refill below, a write of the scores
  const std::vector<ops::PositionRun> key_runs{{0, 0, keys}};
  std::vector<SoftmaxSample> softmax;
  for (const std::int64_t first_query : {std::int64_t(0), keys - n}) {
    const std::vector<ops::PositionRun> queries{{0, first_query, n}};
    const double t = measure<Backend>(comm, options.clock, options.repetitions, [&] {
      calibrate_detail::fill<Backend>(scores, 0.5f);
      Backend::masked_softmax_forward(scores.view(), queries, key_runs, true);
    });
    // The kernel calls exp on the visible scores only, as the dry run counts them.
    softmax.push_back({elements, double(heads) * ops::softmax_visible_scores(queries, key_runs, true), t, fill_s});
  }
  const ScalarMathModel rates = fit_softmax_rates(softmax);
  profile.scalar_math.exp_per_s = rates.exp_per_s;
  profile.scalar_math.softmax_scores_per_s = rates.softmax_scores_per_s;

  Tensor<float> x(Shape{1, keys, heads, d}), y(Shape{1, keys, heads, d});
  calibrate_detail::fill<Backend>(x, 0.5f);
  const double rope = measure<Backend>(comm, options.clock, options.repetitions,
                              [&] { Backend::rope_forward(x.view(), y.view(), 0); });
  const ScalarSample sincos_sample{double(keys * d), rope, profile.elementwise_time(8.0 * double(x.numel()))};
  profile.scalar_math.sincos_per_s = fit_scalar_rate(std::span(&sincos_sample, 1));
  for (const SoftmaxSample& s : softmax)
    result.samples.push_back({fmt::format("softmax {}x{}x{} ({:.0f}% exp)", heads, n, keys, 100 * s.exps / s.scores),
                              s.seconds, s.other_s + profile.activation_time(s.scores, 8 * s.scores, false,
                                                                             ElementwiseFamily::softmax) +
                                             profile.scalar_math.time(ScalarFunction::exp, s.exps)});
  result.samples.push_back({fmt::format("rope {}x{}x{} (cos, sin)", keys, heads, d), rope,
                            sincos_sample.other_s + profile.scalar_math.time(ScalarFunction::sincos, double(keys * d))});
}

}  // namespace paradyse::cost::calibrate_detail
