// tests/cuda/dense_ops.cpp: the CUDA dense-model element-wise ops (ops/cuda/normalization, activation, rope,
// embedding, cross_entropy, adamw, convert) against ops::cpu on the same seeded inputs: every forward output and
// every gradient, gradients accumulated onto nonzero values, odd shapes (37 rows, widths 129 and 1), strided rows
// (the padding between rows must stay untouched, so whole storages are compared), in-place forwards, reproducible
// parameter gradients, and the CPU's error messages for bad input.
//
// Tolerances: kFloat32 (tests/support/tolerance.hpp) for float math, where the two sides differ legitimately only
// in reduction order (block trees vs 16 lanes) and in exp (the device's expf vs the CPU's exp_approx, both within a
// few ulp). Embedding and convert are compared bit for bit: the device performs the CPU's very operations in the
// CPU's order (embedding backward) or the same bit manipulations (convert).
#include "cuda/device_test.hpp"
#include "support/tolerance.hpp"

#include "paradyse/core/dtype.hpp"
#include "paradyse/core/rng.hpp"
#include "paradyse/device/runtime.hpp"
#include "paradyse/ops/cpu/activation.hpp"
#include "paradyse/ops/cpu/adamw.hpp"
#include "paradyse/ops/cpu/convert.hpp"
#include "paradyse/ops/cpu/cross_entropy.hpp"
#include "paradyse/ops/cpu/embedding.hpp"
#include "paradyse/ops/cpu/normalization.hpp"
#include "paradyse/ops/cpu/rope.hpp"
#include "paradyse/ops/cuda/activation.hpp"
#include "paradyse/ops/cuda/adamw.hpp"
#include "paradyse/ops/cuda/convert.hpp"
#include "paradyse/ops/cuda/cross_entropy.hpp"
#include "paradyse/ops/cuda/embedding.hpp"
#include "paradyse/ops/cuda/normalization.hpp"
#include "paradyse/ops/cuda/rope.hpp"

#include <cuda_runtime_api.h>
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <span>
#include <string>
#include <vector>

namespace pd = paradyse;
using pd::Shape;
using pd::TensorView;
using pd::testing::kFloat32;
using pd::testing::Tolerance;

namespace {

constexpr Tolerance kExact{0.0, 0.0};

// Device memory for a test: `count` elements; host() synchronizes the calling thread's stream and copies back.
template <class T>
class DeviceBuffer {
public:
  explicit DeviceBuffer(std::size_t count) : count_(count) {
    if (count_) PARADYSE_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&data_), count_ * sizeof(T)));
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (data_) (void)cudaFree(data_);
  }

  void upload(const std::vector<T>& host) {
    REQUIRE(host.size() == count_);
    pd::device::synchronize();
    if (count_) PARADYSE_CUDA_CHECK(cudaMemcpy(data_, host.data(), count_ * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> host() const {
    pd::device::synchronize();
    std::vector<T> out(count_);
    if (count_) PARADYSE_CUDA_CHECK(cudaMemcpy(out.data(), data_, count_ * sizeof(T), cudaMemcpyDeviceToHost));
    return out;
  }
  T* data() const { return data_; }

private:
  T* data_ = nullptr;
  std::size_t count_ = 0;
};

// One operand twice: a host storage for ops::cpu and a device copy for ops::cuda, seen through the same view
// (shape, strides). Comparing whole storages also checks that neither side writes between strided rows.
template <class T>
struct Mirror {
  std::vector<T> host;
  DeviceBuffer<T> device;
  Shape shape, strides;

  Mirror(std::vector<T> values, Shape shape_, Shape strides_)
      : host(std::move(values)), device(host), shape(shape_), strides(strides_) {}

  TensorView<T> cpu() { return TensorView<T>(host.data(), shape, strides); }
  TensorView<T> gpu() const { return TensorView<T>(device.data(), shape, strides); }
  std::vector<T> fetched() const { return device.host(); }
};

std::vector<float> uniform(std::size_t count, pd::Rng& rng, double lo = -1.0, double hi = 1.0) {
  std::vector<float> v(count);
  rng.fill_uniform(std::span<float>(v), lo, hi);
  return v;
}

Shape shape_of(const std::vector<std::int64_t>& e) {
  switch (e.size()) {
    case 1: return Shape{e[0]};
    case 2: return Shape{e[0], e[1]};
    case 3: return Shape{e[0], e[1], e[2]};
    case 4: return Shape{e[0], e[1], e[2], e[3]};
    default: FAIL("shape_of: rank ", e.size(), " is not used here"); return Shape{};
  }
}

// A [rows..., width] operand whose rows are `pad` elements apart beyond their width (pad 0: contiguous).
Mirror<float> rows_operand(Shape outer, std::int64_t width, std::int64_t pad, pd::Rng& rng, double lo = -1.0,
                           double hi = 1.0) {
  std::vector<std::int64_t> extents(outer.begin(), outer.end());
  extents.push_back(width);
  const Shape shape = shape_of(extents);
  std::vector<std::int64_t> stride(extents.size());
  std::int64_t step = 1;
  for (int d = int(extents.size()) - 1; d >= 0; --d) {
    stride[std::size_t(d)] = step;
    step *= d == int(extents.size()) - 1 ? width + pad : extents[std::size_t(d)];
  }
  return Mirror<float>(uniform(std::size_t(step), rng, lo, hi), shape, shape_of(stride));
}

Mirror<float> flat(std::int64_t n, pd::Rng& rng, double lo = -1.0, double hi = 1.0) {
  return Mirror<float>(uniform(std::size_t(n), rng, lo, hi), Shape{n}, Shape{1});
}

template <class T>
void check_same(const Mirror<T>& m, Tolerance tol, const char* what) {
  const std::vector<T> got = m.fetched();
  const std::string mismatch = pd::testing::first_mismatch(std::span<const T>(got), std::span<const T>(m.host), tol);
  CHECK_MESSAGE(mismatch.empty(), what, " (shape ", fmt::format("{}", m.shape), "): ", mismatch);
}

// The message of the paradyse::Error `f` throws, without its " [file:line]" suffix; "" when nothing is thrown.
std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const pd::Error& e) {
    const std::string what = e.what();
    return what.substr(0, what.rfind(" ["));
  }
  return "";
}

void check_same_error(const std::function<void()>& cpu, const std::function<void()>& gpu) {
  const std::string want = message_of(cpu), got = message_of(gpu);
  CHECK_MESSAGE(!want.empty(), "the CPU op accepted the bad input");
  CHECK_MESSAGE(got == want, "CUDA: '", got, "' CPU: '", want, "'");
}

}  // namespace

TEST_CASE("cuda layer_norm and rms_norm: forward, every accumulated gradient, reproducible dgamma, against ops::cpu") {
  PARADYSE_REQUIRE_DEVICE();
  struct Case {
    Shape outer;
    std::int64_t h, pad;
  };
  for (const Case& c : {Case{Shape{37}, 129, 0}, Case{Shape{3, 5}, 129, 5}, Case{Shape{37}, 1, 0},
                        Case{Shape{2, 300}, 1000, 3}}) {
    for (bool rms : {false, true}) {
      CAPTURE(c.h);
      CAPTURE(c.pad);
      CAPTURE(rms);
      pd::Rng rng(1000 + std::uint64_t(c.h) + std::uint64_t(c.pad) + (rms ? 7 : 0));
      const std::int64_t rows = c.outer.numel();
      Mirror<float> x = rows_operand(c.outer, c.h, c.pad, rng, 1.0, 3.0);  // nonzero mean: two-pass variance
      Mirror<float> y = rows_operand(c.outer, c.h, c.pad, rng);
      Mirror<float> gamma = flat(c.h, rng), beta = flat(c.h, rng);
      Mirror<float> mean = flat(rows, rng), rstd = flat(rows, rng);
      const float eps = 1e-5f;
      if (rms) {
        pd::ops::cpu::rms_norm_forward(x.cpu(), gamma.cpu(), eps, y.cpu(), rstd.cpu());
        pd::ops::cuda::rms_norm_forward(x.gpu(), gamma.gpu(), eps, y.gpu(), rstd.gpu());
      } else {
        pd::ops::cpu::layer_norm_forward(x.cpu(), gamma.cpu(), beta.cpu(), eps, y.cpu(), mean.cpu(), rstd.cpu());
        pd::ops::cuda::layer_norm_forward(x.gpu(), gamma.gpu(), beta.gpu(), eps, y.gpu(), mean.gpu(), rstd.gpu());
        check_same(mean, kFloat32, "mean");
      }
      check_same(y, kFloat32, "y");
      check_same(rstd, kFloat32, "rstd");

      // Backward from the CPU's saved statistics on both sides, onto nonzero gradients.
      rstd.device.upload(rstd.host);
      mean.device.upload(mean.host);
      Mirror<float> dy = rows_operand(c.outer, c.h, c.pad, rng), dx = rows_operand(c.outer, c.h, c.pad, rng);
      Mirror<float> dgamma = flat(c.h, rng), dbeta = flat(c.h, rng);
      const std::vector<float> dgamma_start = dgamma.host;
      if (rms) {
        pd::ops::cpu::rms_norm_backward(x.cpu(), gamma.cpu(), rstd.cpu(), dy.cpu(), dx.cpu(), dgamma.cpu());
        pd::ops::cuda::rms_norm_backward(x.gpu(), gamma.gpu(), rstd.gpu(), dy.gpu(), dx.gpu(), dgamma.gpu());
      } else {
        pd::ops::cpu::layer_norm_backward(x.cpu(), gamma.cpu(), mean.cpu(), rstd.cpu(), dy.cpu(), dx.cpu(),
                                          dgamma.cpu(), dbeta.cpu());
        pd::ops::cuda::layer_norm_backward(x.gpu(), gamma.gpu(), mean.gpu(), rstd.gpu(), dy.gpu(), dx.gpu(),
                                           dgamma.gpu(), dbeta.gpu());
        check_same(dbeta, kFloat32, "dbeta");
      }
      check_same(dx, kFloat32, "dx");
      check_same(dgamma, kFloat32, "dgamma");

      // The parameter gradient has no atomics: a second run from the same start gives the same bits.
      const std::vector<float> first = dgamma.fetched();
      dgamma.device.upload(dgamma_start);
      Mirror<float> dx2 = rows_operand(c.outer, c.h, c.pad, rng);
      if (rms)
        pd::ops::cuda::rms_norm_backward(x.gpu(), gamma.gpu(), rstd.gpu(), dy.gpu(), dx2.gpu(), dgamma.gpu());
      else
        pd::ops::cuda::layer_norm_backward(x.gpu(), gamma.gpu(), mean.gpu(), rstd.gpu(), dy.gpu(), dx2.gpu(),
                                           dgamma.gpu(), dbeta.gpu());
      const std::vector<float> second = dgamma.fetched();
      CHECK_MESSAGE(std::memcmp(first.data(), second.data(), first.size() * sizeof(float)) == 0,
                    "dgamma differs between two identical runs");
    }
  }
}

TEST_CASE("cuda layer_norm and rms_norm: in-place forward and the CPU's errors") {
  PARADYSE_REQUIRE_DEVICE();
  pd::Rng rng(11);
  Mirror<float> x = rows_operand(Shape{37}, 129, 0, rng), gamma = flat(129, rng), beta = flat(129, rng);
  Mirror<float> mean = flat(37, rng), rstd = flat(37, rng);
  pd::ops::cpu::layer_norm_forward(x.cpu(), gamma.cpu(), beta.cpu(), 1e-5f, x.cpu(), mean.cpu(), rstd.cpu());
  pd::ops::cuda::layer_norm_forward(x.gpu(), gamma.gpu(), beta.gpu(), 1e-5f, x.gpu(), mean.gpu(), rstd.gpu());
  check_same(x, kFloat32, "in-place layer_norm y");
  pd::ops::cpu::rms_norm_forward(x.cpu(), gamma.cpu(), 1e-5f, x.cpu(), rstd.cpu());
  pd::ops::cuda::rms_norm_forward(x.gpu(), gamma.gpu(), 1e-5f, x.gpu(), rstd.gpu());
  check_same(x, kFloat32, "in-place rms_norm y");

  Mirror<float> short_gamma = flat(128, rng);
  check_same_error([&] { pd::ops::cpu::rms_norm_forward(x.cpu(), short_gamma.cpu(), 1e-5f, x.cpu(), rstd.cpu()); },
                   [&] { pd::ops::cuda::rms_norm_forward(x.gpu(), short_gamma.gpu(), 1e-5f, x.gpu(), rstd.gpu()); });
  Mirror<float> short_mean = flat(36, rng);
  check_same_error(
      [&] {
        pd::ops::cpu::layer_norm_backward(x.cpu(), gamma.cpu(), short_mean.cpu(), rstd.cpu(), x.cpu(), x.cpu(),
                                          gamma.cpu(), beta.cpu());
      },
      [&] {
        pd::ops::cuda::layer_norm_backward(x.gpu(), gamma.gpu(), short_mean.gpu(), rstd.gpu(), x.gpu(), x.gpu(),
                                           gamma.gpu(), beta.gpu());
      });
  check_same_error(
      [&] { pd::ops::cpu::layer_norm_forward(x.cpu(), gamma.cpu(), beta.cpu(), -1.0f, x.cpu(), mean.cpu(), rstd.cpu()); },
      [&] {
        pd::ops::cuda::layer_norm_forward(x.gpu(), gamma.gpu(), beta.gpu(), -1.0f, x.gpu(), mean.gpu(), rstd.gpu());
      });
}

TEST_CASE("cuda gelu and swiglu: forward and accumulated gradients against ops::cpu, packed gate/up halves") {
  PARADYSE_REQUIRE_DEVICE();
  for (std::int64_t f : {129, 1, 64}) {
    CAPTURE(f);
    pd::Rng rng(2000 + std::uint64_t(f));
    // GELU over strided rows, inputs wide enough to reach the saturated tails.
    Mirror<float> x = rows_operand(Shape{37}, f, 3, rng, -6.0, 6.0), y = rows_operand(Shape{37}, f, 3, rng);
    pd::ops::cpu::gelu_forward(x.cpu(), y.cpu());
    pd::ops::cuda::gelu_forward(x.gpu(), y.gpu());
    check_same(y, kFloat32, "gelu y");
    Mirror<float> dy = rows_operand(Shape{37}, f, 3, rng), dx = rows_operand(Shape{37}, f, 3, rng);
    pd::ops::cpu::gelu_backward(x.cpu(), dy.cpu(), dx.cpu());
    pd::ops::cuda::gelu_backward(x.gpu(), dy.gpu(), dx.gpu());
    check_same(dx, kFloat32, "gelu dx");

    // SwiGLU: gate and up are the two halves of one packed [3, 5, 2f] tensor (as the MLP stores them).
    Mirror<float> packed = rows_operand(Shape{3, 5}, 2 * f, 0, rng, -4.0, 4.0);
    const auto gate_of = [&](TensorView<float> p) { return p.slice(2, 0, f); };
    const auto up_of = [&](TensorView<float> p) { return p.slice(2, f, f); };
    Mirror<float> out = rows_operand(Shape{3, 5}, f, 0, rng);
    pd::ops::cpu::swiglu_forward(gate_of(packed.cpu()), up_of(packed.cpu()), out.cpu());
    pd::ops::cuda::swiglu_forward(gate_of(packed.gpu()), up_of(packed.gpu()), out.gpu());
    check_same(out, kFloat32, "swiglu y");
    Mirror<float> dout = rows_operand(Shape{3, 5}, f, 0, rng), dpacked = rows_operand(Shape{3, 5}, 2 * f, 0, rng);
    pd::ops::cpu::swiglu_backward(gate_of(packed.cpu()), up_of(packed.cpu()), dout.cpu(), gate_of(dpacked.cpu()),
                                  up_of(dpacked.cpu()));
    pd::ops::cuda::swiglu_backward(gate_of(packed.gpu()), up_of(packed.gpu()), dout.gpu(), gate_of(dpacked.gpu()),
                                   up_of(dpacked.gpu()));
    check_same(dpacked, kFloat32, "swiglu dgate | dup");
  }
  pd::Rng rng(3);
  Mirror<float> a = rows_operand(Shape{4}, 8, 0, rng), b = rows_operand(Shape{4}, 9, 0, rng);
  check_same_error([&] { pd::ops::cpu::gelu_forward(a.cpu(), b.cpu()); },
                   [&] { pd::ops::cuda::gelu_forward(a.gpu(), b.gpu()); });
  check_same_error([&] { pd::ops::cpu::swiglu_forward(a.cpu(), a.cpu(), b.cpu()); },
                   [&] { pd::ops::cuda::swiglu_forward(a.gpu(), a.gpu(), b.gpu()); });
}

TEST_CASE("cuda rope: both layouts, position offset, documents, in place, accumulated backward, errors") {
  PARADYSE_REQUIRE_DEVICE();
  const std::vector<std::int64_t> documents{0, 3, 9};
  for (pd::ops::RopeLayout layout : {pd::ops::RopeLayout::halves, pd::ops::RopeLayout::interleaved})
    for (bool packed : {false, true}) {
      CAPTURE(int(layout));
      CAPTURE(packed);
      pd::Rng rng(3000 + std::uint64_t(layout) * 2 + std::uint64_t(packed));
      const pd::ops::RopeConfig config{500000.0, layout};
      const std::span<const std::int64_t> starts = packed ? std::span<const std::int64_t>(documents)
                                                          : std::span<const std::int64_t>();
      const std::int64_t offset = packed ? 5 : 1000;  // positions 5..11 across documents, or mid-sequence
      Mirror<float> x = rows_operand(Shape{2, 7, 3}, 18, 2, rng), y = rows_operand(Shape{2, 7, 3}, 18, 2, rng);
      pd::ops::cpu::rope_forward(x.cpu(), y.cpu(), offset, config, starts);
      pd::ops::cuda::rope_forward(x.gpu(), y.gpu(), offset, config, starts);
      check_same(y, kFloat32, "rope y");
      Mirror<float> dx = rows_operand(Shape{2, 7, 3}, 18, 2, rng);
      pd::ops::cpu::rope_backward(y.cpu(), dx.cpu(), offset, config, starts);
      pd::ops::cuda::rope_backward(y.gpu(), dx.gpu(), offset, config, starts);
      check_same(dx, kFloat32, "rope dx");
      pd::ops::cpu::rope_forward(x.cpu(), x.cpu(), offset, config, starts);
      pd::ops::cuda::rope_forward(x.gpu(), x.gpu(), offset, config, starts);
      check_same(x, kFloat32, "in-place rope y");
    }
  pd::Rng rng(5);
  Mirror<float> x = rows_operand(Shape{1, 4, 2}, 8, 0, rng), odd = rows_operand(Shape{1, 4, 2}, 7, 0, rng);
  const std::vector<std::int64_t> bad_starts{1, 3};
  check_same_error([&] { pd::ops::cpu::rope_forward(x.cpu(), x.cpu(), 0, {}, bad_starts); },
                   [&] { pd::ops::cuda::rope_forward(x.gpu(), x.gpu(), 0, {}, bad_starts); });
  check_same_error([&] { pd::ops::cpu::rope_forward(odd.cpu(), odd.cpu(), 0); },
                   [&] { pd::ops::cuda::rope_forward(odd.gpu(), odd.gpu(), 0); });
  check_same_error([&] { pd::ops::cpu::rope_backward(x.cpu(), x.cpu(), 0); },
                   [&] { pd::ops::cuda::rope_backward(x.gpu(), x.gpu(), 0); });
}

TEST_CASE("cuda embedding: forward and deterministic accumulated backward equal ops::cpu bit for bit; bad ids") {
  PARADYSE_REQUIRE_DEVICE();
  for (std::int64_t vocab : {50, 1, 70000}) {
    CAPTURE(vocab);
    pd::Rng rng(4000 + std::uint64_t(vocab));
    const std::int64_t h = 129;
    std::vector<std::int32_t> ids(3 * 37);
    for (auto& t : ids) t = std::int32_t(rng.below(std::uint64_t(std::min<std::int64_t>(vocab, 20))));  // repeats
    Mirror<std::int32_t> tokens(ids, Shape{3, 37}, Shape{37, 1});
    Mirror<float> table = rows_operand(Shape{vocab}, h, 0, rng);
    Mirror<float> out = rows_operand(Shape{3, 37}, h, 4, rng);
    pd::ops::cpu::embedding_forward(tokens.cpu(), table.cpu(), out.cpu());
    pd::ops::cuda::embedding_forward(tokens.gpu(), table.gpu(), out.gpu());
    check_same(out, kExact, "embedding out");
    Mirror<float> dout = rows_operand(Shape{3, 37}, h, 4, rng), dtable = rows_operand(Shape{vocab}, h, 0, rng);
    pd::ops::cpu::embedding_backward(tokens.cpu(), dout.cpu(), dtable.cpu());
    pd::ops::cuda::embedding_backward(tokens.gpu(), dout.gpu(), dtable.gpu());
    check_same(dtable, kExact, "embedding dtable");  // the CPU's additions in the CPU's order
  }
  pd::Rng rng(6);
  for (std::int32_t bad : {50, -1}) {
    std::vector<std::int32_t> ids{1, 2, 3, bad, 4, bad};
    Mirror<std::int32_t> tokens(ids, Shape{6}, Shape{1});
    Mirror<float> table = rows_operand(Shape{50}, 8, 0, rng), out = rows_operand(Shape{6}, 8, 0, rng);
    check_same_error([&] { pd::ops::cpu::embedding_forward(tokens.cpu(), table.cpu(), out.cpu()); },
                     [&] { pd::ops::cuda::embedding_forward(tokens.gpu(), table.gpu(), out.gpu()); });
    check_same_error([&] { pd::ops::cpu::embedding_backward(tokens.cpu(), out.cpu(), table.cpu()); },
                     [&] { pd::ops::cuda::embedding_backward(tokens.gpu(), out.gpu(), table.gpu()); });
  }
  Mirror<std::int32_t> tokens(std::vector<std::int32_t>{1, 2}, Shape{2}, Shape{1});
  Mirror<float> table = rows_operand(Shape{50}, 8, 0, rng), wide = rows_operand(Shape{2}, 9, 0, rng);
  check_same_error([&] { pd::ops::cpu::embedding_forward(tokens.cpu(), table.cpu(), wide.cpu()); },
                   [&] { pd::ops::cuda::embedding_forward(tokens.gpu(), table.gpu(), wide.gpu()); });
}

TEST_CASE("cuda cross_entropy_forward_backward: loss, count and dlogits against ops::cpu; ignore_index; alias") {
  PARADYSE_REQUIRE_DEVICE();
  for (std::int64_t vocab : {1001, 1, 32000})
    for (bool alias : {false, true}) {
      CAPTURE(vocab);
      CAPTURE(alias);
      pd::Rng rng(5000 + std::uint64_t(vocab) + (alias ? 1 : 0));
      std::vector<std::int32_t> ids(37);
      for (std::size_t r = 0; r < ids.size(); ++r)
        ids[r] = r % 5 == 2 ? pd::ops::cpu::kIgnoreIndex : std::int32_t(rng.below(std::uint64_t(vocab)));
      Mirror<std::int32_t> targets(ids, Shape{37}, Shape{1});
      Mirror<float> logits = rows_operand(Shape{37}, vocab, alias ? 0 : 3, rng, -8.0, 8.0);
      Mirror<float> dlogits = rows_operand(Shape{37}, vocab, 3, rng);
      const float scale = 1.0f / 30.0f;
      const auto want = pd::ops::cpu::cross_entropy_forward_backward(
          logits.cpu(), targets.cpu(), alias ? logits.cpu() : dlogits.cpu(), scale);
      const auto got = pd::ops::cuda::cross_entropy_forward_backward(
          logits.gpu(), targets.gpu(), alias ? logits.gpu() : dlogits.gpu(), scale);
      CHECK(got.counted == want.counted);
      // A sum of ~30 losses of magnitude ~10: float32 per-row lse, so the float32 tolerance.
      CHECK_MESSAGE(std::abs(got.loss_sum - want.loss_sum) <= kFloat32.atol + kFloat32.rtol * std::abs(want.loss_sum),
                    "loss_sum got ", got.loss_sum, " want ", want.loss_sum);
      // dlogits are scale * softmax, of order 1 / (30 vocab): far below kFloat32.atol, so they are compared
      // relatively (kFloat32.rtol) with a tiny absolute term, lest a wrong probability hide under the atol. The two
      // sides differ only by exp's few ulp and lse's rounding (relative ~1e-5 per element).
      constexpr Tolerance kProbabilities{1e-9, kFloat32.rtol};
      if (alias) check_same(logits, kProbabilities, "dlogits (aliasing logits)");
      else check_same(dlogits, kProbabilities, "dlogits");
    }
  pd::Rng rng(7);
  Mirror<std::int32_t> targets(std::vector<std::int32_t>{1, 2, 3, 1001, 4, -5}, Shape{6}, Shape{1});
  Mirror<float> logits = rows_operand(Shape{6}, 1001, 0, rng), dlogits = rows_operand(Shape{6}, 1001, 0, rng);
  check_same_error(
      [&] { pd::ops::cpu::cross_entropy_forward_backward(logits.cpu(), targets.cpu(), dlogits.cpu(), 1.0f); },
      [&] { pd::ops::cuda::cross_entropy_forward_backward(logits.gpu(), targets.gpu(), dlogits.gpu(), 1.0f); });
  Mirror<std::int32_t> few(std::vector<std::int32_t>{1, 2}, Shape{2}, Shape{1});
  check_same_error(
      [&] { pd::ops::cpu::cross_entropy_forward_backward(logits.cpu(), few.cpu(), dlogits.cpu(), 1.0f); },
      [&] { pd::ops::cuda::cross_entropy_forward_backward(logits.gpu(), few.gpu(), dlogits.gpu(), 1.0f); });
}

TEST_CASE("cuda adamw_step: params and both moments over three steps against ops::cpu; bad config") {
  PARADYSE_REQUIRE_DEVICE();
  pd::Rng rng(8);
  const std::int64_t n = 1237;
  Mirror<float> params = flat(n, rng), m = flat(n, rng, -0.1, 0.1), v = flat(n, rng, 0.0, 0.01);
  const pd::ops::AdamWConfig config{3e-3f, 0.9f, 0.95f, 1e-8f, 0.1f};
  for (std::int64_t step = 1; step <= 3; ++step) {
    CAPTURE(step);
    Mirror<float> grads = flat(n, rng);
    pd::ops::cpu::adamw_step(params.cpu(), grads.cpu(), m.cpu(), v.cpu(), config, step);
    pd::ops::cuda::adamw_step(params.gpu(), grads.gpu(), m.gpu(), v.gpu(), config, step);
    check_same(params, kFloat32, "params");
    check_same(m, kFloat32, "m");
    check_same(v, kFloat32, "v");
    // Continue both from the CPU's state so that the steps do not compound differences.
    params.device.upload(params.host), m.device.upload(m.host), v.device.upload(v.host);
  }
  Mirror<float> grads = flat(n, rng), shorter = flat(n - 1, rng);
  check_same_error([&] { pd::ops::cpu::adamw_step(params.cpu(), grads.cpu(), m.cpu(), v.cpu(), config, 0); },
                   [&] { pd::ops::cuda::adamw_step(params.gpu(), grads.gpu(), m.gpu(), v.gpu(), config, 0); });
  check_same_error([&] { pd::ops::cpu::adamw_step(params.cpu(), shorter.cpu(), m.cpu(), v.cpu(), config, 1); },
                   [&] { pd::ops::cuda::adamw_step(params.gpu(), shorter.gpu(), m.gpu(), v.gpu(), config, 1); });
}

namespace {

// Floats that exercise the roundings: ordinary values, ties, f16 subnormals and overflow, signed zeros, infinities
// and NaN.
std::vector<float> conversion_inputs(pd::Rng& rng, std::size_t count) {
  std::vector<float> v = uniform(count, rng, -3.0, 3.0);
  const float specials[] = {0.0f, -0.0f, 1.0f, -1.0f, 65504.0f, 65520.0f, 70000.0f, -1e9f, 1e-5f, 6e-8f, 3e-8f,
                            -2.9802322e-8f, 1.00390625f /* bf16 tie */, 1.0009765625f, 3.4e38f,
                            std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::denorm_min()};
  for (std::size_t i = 0; i < std::size(specials) && i < v.size(); ++i) v[i * 7 % v.size()] = specials[i];
  return v;
}

template <class T>
std::vector<std::uint32_t> bits_of(const std::vector<T>& v) {
  std::vector<std::uint32_t> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) {
    if constexpr (std::is_same_v<T, float>) std::memcpy(&out[i], &v[i], sizeof(float));
    else out[i] = v[i].bits;
  }
  return out;
}

template <class From, class To>
void check_convert(pd::Rng& rng) {
  CAPTURE(pd::name_of(pd::dtype_of<From>()));
  CAPTURE(pd::name_of(pd::dtype_of<To>()));
  // The source: a [37, 129] view with 3 elements of padding per row (strided), made by the CPU conversion.
  const std::vector<float> values = conversion_inputs(rng, 37 * 132);
  std::vector<From> source(values.size());
  pd::ops::cpu::convert(TensorView<const float>(values.data(), Shape{std::int64_t(values.size())}),
                        TensorView<From>(source.data(), Shape{std::int64_t(source.size())}));
  for (bool strided : {false, true}) {
    CAPTURE(strided);
    const Shape shape = strided ? Shape{37, 129} : Shape{37 * 132};
    const Shape from_strides = strided ? Shape{132, 1} : Shape{1};
    // The destination is transposed when strided: [37, 129] stored column-major.
    const Shape to_strides = strided ? Shape{1, 37} : Shape{1};
    Mirror<From> from(source, shape, from_strides);
    Mirror<To> to(std::vector<To>(strided ? 37 * 129 : 37 * 132), shape, to_strides);
    pd::ops::cpu::convert(TensorView<const From>(from.cpu()), to.cpu());
    pd::ops::cuda::convert(TensorView<const From>(from.gpu()), to.gpu());
    const std::vector<std::uint32_t> got = bits_of(to.fetched()), want = bits_of(to.host);
    std::size_t first = got.size();
    for (std::size_t i = 0; i < got.size() && first == got.size(); ++i)
      if (got[i] != want[i]) first = i;
    CHECK_MESSAGE(first == got.size(), "element ", first, ": got bits ",
                  first < got.size() ? fmt::format("{:#x}", got[first]) : "", " want ",
                  first < got.size() ? fmt::format("{:#x}", want[first]) : "");
  }
}

}  // namespace

TEST_CASE("cuda convert: f32, bf16, f16 in all nine pairs, contiguous and strided, bitwise as ops::cpu") {
  PARADYSE_REQUIRE_DEVICE();
  pd::Rng rng(9);
  check_convert<float, float>(rng);
  check_convert<float, pd::bf16>(rng);
  check_convert<float, pd::f16>(rng);
  check_convert<pd::bf16, float>(rng);
  check_convert<pd::bf16, pd::bf16>(rng);
  check_convert<pd::bf16, pd::f16>(rng);
  check_convert<pd::f16, float>(rng);
  check_convert<pd::f16, pd::bf16>(rng);
  check_convert<pd::f16, pd::f16>(rng);
  Mirror<float> a = flat(6, rng), b = flat(7, rng);
  check_same_error([&] { pd::ops::cpu::convert(TensorView<const float>(a.cpu()), b.cpu()); },
                   [&] { pd::ops::cuda::convert(TensorView<const float>(a.gpu()), b.gpu()); });
}
