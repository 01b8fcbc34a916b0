// Tests of the calibration on a device backend (cost/calibrate.hpp, issue 25's single-GPU check: train_gpt --device
// cuda calibrates ops::Cuda on the GPU). A device's kernels run asynchronously, so every measurement must wait for
// the work it queued before it reads the clock (Backend::synchronize), and the host's own terms (the CPU GEMM
// engines, compute-bound activations, fresh memory, the pool's misses, scalar math) must stay unpriced, as the
// built-in GPU profiles leave them. Deferred, below, is ops::Cpu whose ops run only at synchronize(): a measurement
// that did not wait would time the queueing alone.
#include "paradyse/comm/threads.hpp"
#include "paradyse/cost/calibrate.hpp"
#include "paradyse/ops/backend.hpp"

#include <doctest/doctest.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace paradyse::ops::deferred_test {

// The calling thread's queued ops, run in order at synchronize().
inline std::vector<std::function<void()>>& queue() {
  thread_local std::vector<std::function<void()>> q;
  return q;
}
inline std::atomic<std::int64_t> queued_ops = 0;  // over every thread

// ops::Cpu's ops, queued on the calling thread and run at synchronize(); tensors "on the device" (the calibration's
// device branch).
struct DeferredOps {
  static constexpr std::string_view name = "deferred";
  static constexpr MemorySpace space = MemorySpace::device;
  // Runs what is queued. Preferred to the queueing template below for a call without arguments.
  static void synchronize() {
    for (const auto& op : queue()) op();
    queue().clear();
  }
// An op that returns a value (the loss) waits for the queue and runs at once, as ops::Cuda's do.
#define PARADYSE_DEFERRED(op)                                    \
  template <class... A>                                          \
  static decltype(auto) op(A&&... a) {                           \
    if constexpr (std::is_void_v<decltype(cpu::op(a...))>) {     \
      ++queued_ops;                                              \
      queue().push_back([=] { cpu::op(a...); });                 \
    } else {                                                     \
      synchronize();                                             \
      return cpu::op(std::forward<A>(a)...);                     \
    }                                                            \
  }
#define PARADYSE_OP PARADYSE_DEFERRED
#include "paradyse/ops/op_names.inc"
#undef PARADYSE_OP
#undef PARADYSE_DEFERRED
};
using Deferred = BackendOf<DeferredOps>;

}  // namespace paradyse::ops::deferred_test

using namespace paradyse;
using namespace paradyse::cost;
using paradyse::ops::deferred_test::Deferred;

namespace device_calibration_test {

// Small measurements of each kind the device branch runs (GEMMs large enough to take a visible time on a CPU).
CalibrationOptions small_options() {
  CalibrationOptions o;
  o.clock = TimeSource::wall;
  o.repetitions = 2;
  o.gemm_shapes = {{256, 256, 256}, {512, 512, 256}, {1024, 512, 512}, {512, 1024, 512}};
  o.attention_heads = 2;
  o.head_dim = 32;
  o.attention_lengths = {128, 256, 512};
  o.copy_bytes = {std::int64_t(1) << 20, std::int64_t(1) << 22};
  o.elementwise_class_rows = {64, 1024};
  o.elementwise_family_rows = {64, 512};
  o.pool_miss_bytes = {std::int64_t(1) << 18};  // asked for, and left out on a device
  o.memory_bytes = std::int64_t(3) << 30;
  return o;
}

// The calibration on one rank; `left_queued`: the ops still queued on that rank when it returned.
template <class Backend>
Calibration calibrated(const CalibrationOptions& options, std::size_t* left_queued = nullptr) {
  Calibration result;
  run_ranks(1, [&](ThreadCommunicator& comm) {
    result = calibrate<Backend>(comm, options);
    if (left_queued) *left_queued = ops::deferred_test::queue().size();
  });
  return result;
}

}  // namespace device_calibration_test

TEST_CASE("device calibration: every measurement waits for the work it queued") {
  ops::deferred_test::queued_ops = 0;
  std::size_t left_queued = 1;
  const Calibration c =
      device_calibration_test::calibrated<Deferred>(device_calibration_test::small_options(), &left_queued);
  CHECK(left_queued == 0);
  CHECK(ops::deferred_test::queued_ops.load() > 50);
  // Each GEMM sample holds its flops' time: no CPU core of a CI machine runs 10 TFLOP/s, while the queueing alone of
  // a GEMM takes well under a microsecond (54 us at that rate for the largest shape). So does the fitted model at each
  // sample's shape, by whichever of its terms (on four shapes whose flops and bytes grow together a noisy sample can
  // put all of it on the bytes term and none on the rate).
  int gemms = 0;
  for (const CalibrationSample& s : c.samples) {
    std::int64_t m = 0, n = 0, k = 0;
    if (std::sscanf(s.what.c_str(), "gemm %ldx%ldx%ld", &m, &n, &k) != 3) continue;
    ++gemms;
    CAPTURE(s.what);
    const double at_10_tflops = 2.0 * double(m) * double(n) * double(k) / 10e12;
    CHECK(s.measured_s >= at_10_tflops);
    CHECK(c.profile.gemm.time(double(m), double(n), double(k), int(sizeof(float))) >= at_10_tflops);
  }
  CHECK(gemms == 4);
  CHECK(c.profile.attention.forward_flops_per_s < 10e12);
  CHECK(c.profile.attention.backward_flops_per_s < 10e12);
}

TEST_CASE("device calibration: the host's own terms stay unpriced, the device's are measured") {
  const CalibrationOptions options = device_calibration_test::small_options();
  const HardwareProfile device = device_calibration_test::calibrated<Deferred>(options).profile;
  CHECK(device.gemm_engines.empty());
  CHECK(device.activation_elements_per_s == 0);  // memory-bound: priced at the elementwise rates
  CHECK(device.swiglu_forward_elements_per_s == 0);
  CHECK(device.fresh_memory == FreshMemoryModel{});
  CHECK(device.scalar_math == ScalarMathModel{});
  CHECK(device.pool_miss_bytes_per_s == 0);
  CHECK(device.memory_bytes == options.memory_bytes);
  CHECK(device.elementwise_classes.size() >= 1);
  for (int f = 1; f < kElementwiseFamilies; ++f) CHECK(device.elementwise_families[std::size_t(f)].calibrated());
  CHECK(device.elementwise_bytes_per_s > 1);
  CHECK(!device.attention.whole_tiles);
  CHECK(device.name == "deferred-p1 (calibrated)");
  // The same options on the host backend price those terms (what the device branch leaves out is there to leave).
  const HardwareProfile host = device_calibration_test::calibrated<ops::Cpu>(options).profile;
  CHECK(!host.gemm_engines.empty());
  CHECK(host.activation_elements_per_s > 0);
  CHECK(host.fresh_memory.zero_bytes_per_s > 0);
  // Scalar math priced by some term (the softmax's two-term fit may put a loaded machine's exps on its loop: one
  // test run of fifteen under load read exp_per_s 0).
  CHECK(host.scalar_math != ScalarMathModel{});
  CHECK(host.pool_miss_bytes_per_s > 0);
  CHECK(host.memory_bytes == options.memory_bytes);
}

// The counting backend, its GEMM calls counted (one gemm_batched call = one, whatever its items).
struct CountedGemms : ops::Counting {
  static inline int single = 0, batched = 0;
  static void matmul(TensorView<const float> a, ops::Transpose ta, TensorView<const float> b, ops::Transpose tb,
                     TensorView<float> c, float alpha = 1.0f, float beta = 0.0f) {
    ++single;
    ops::Counting::matmul(a, ta, b, tb, c, alpha, beta);
  }
  template <class... A>
  static void gemm_batched(A&&... a) {
    ++batched;
    ops::Counting::gemm_batched(std::forward<A>(a)...);
  }
};

TEST_CASE("device calibration: head-width GEMMs timed a batch to a call, as a GPU step runs a layer's heads") {
  // 64x64x8 with every operand cold: 20,480 B a copy, 64 KiB cycled = 3 copies; batches round them up to a multiple.
  // Each of the three passes (the warm-up and two timed) runs every copy: the trace's GEMM items, in calls of `batch`.
  const std::array<std::int64_t, 3> shape{64, 64, 8};
  for (const auto& [batch, copies] : {std::pair{std::int64_t(1), 3}, {std::int64_t(2), 4}, {std::int64_t(4), 4}}) {
    CAPTURE(batch);
    CountedGemms::single = CountedGemms::batched = 0;
    std::int64_t items = 0;
    run_ranks(1, [&](ThreadCommunicator& comm) {
      const Trace trace = trace_of([&] {
        (void)calibrate_detail::time_gemm<CountedGemms>(comm, TimeSource::wall, 2, shape, std::int64_t(1) << 16,
                                                        calibrate_detail::ColdOperands::all, batch);
      });
      for (const TraceEvent& e : trace.events())
        if (e.kind == TraceKind::gemm) {
          CHECK((e.m == 64 && e.n == 64 && e.k == 8));
          items += e.count;
        }
    });
    CHECK(items == 3 * copies);
    CHECK(CountedGemms::single == (batch == 1 ? 3 * copies : 0));
    CHECK(CountedGemms::batched == (batch == 1 ? 0 : 3 * copies / batch));
  }
  run_ranks(1, [&](ThreadCommunicator& comm) {
    CHECK_THROWS_WITH_AS((void)calibrate_detail::time_gemm<ops::Counting>(comm, TimeSource::wall, 1, shape, 0,
                                                                          calibrate_detail::ColdOperands::weights, 4),
                         doctest::Contains("GEMM batch 4"), Error);
  });
}
