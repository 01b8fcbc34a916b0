// bench/ops_bench: GFLOP/s and time of the CPU kernels, with the best single-thread GEMM measured in the same run
// (OpenBLAS sgemm or the built-in kernel, whichever is faster at 1024^3 here) as the yardstick.
//
//   ops_bench            GEMM table; attention at s = 1K, 4K (4 heads), 16K (1 head), 64K (1 head, forward only)
//   ops_bench --quick    s = 1K and 4K only
//   ops_bench --full     also attention backward at 64K
//
// FLOPs: GEMM 2mnk. Attention forward 4 s^2 d per head (half that causal); backward 2.5x forward (five GEMM-shaped
// products against forward's two, the FlashAttention-2 convention). Times are medians of several repetitions
// // of thread CPU time (the machine is shared). "ratio" = GFLOP/s over the yardstick. Every kernel runs on one thread.
// The first table also shows the engine gemm() chose per size class (ops/cpu/gemm_choice.hpp) and its measured rates.
#include "paradyse/cli/flags.hpp"
#include "paradyse/core/memory.hpp"
#include "paradyse/core/rng.hpp"
#include "paradyse/core/statistics.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/core/timer.hpp"
#include "paradyse/ops/cpu/attention.hpp"
#include "paradyse/ops/cpu/gemm.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <vector>

using namespace paradyse;
using ops::Transpose;

namespace {

// CPU time of the calling thread (core/timer.hpp): on a shared machine, wall time also counts the time other
// processes held the core; kernel and yardstick are measured the same way, so the ratios compare like with like.
double seconds_of(const std::function<void()>& fn) {
  const double start = thread_cpu_seconds();
  fn();
  return thread_cpu_seconds() - start;
}

// Median of `reps` timed runs after one warm-up run (skipped when reps == 1 and the run is long).
double median_seconds(int reps, const std::function<void()>& fn, bool warm_up = true) {
  if (warm_up) fn();
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) t.push_back(seconds_of(fn));
  return paradyse::median(std::move(t));
}

// The plain i-k-j triple loop: what a GEMM costs without blocking.
void naive_gemm(std::int64_t m, std::int64_t n, std::int64_t k, const float* a, const float* b, float* c) {
  std::fill(c, c + m * n, 0.0f);
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t p = 0; p < k; ++p) {
      const float aip = a[i * k + p];
      for (std::int64_t j = 0; j < n; ++j) c[i * n + j] += aip * b[p * n + j];
    }
}

// Attention that materialises the s x s score matrix (one head, non-causal): the textbook baseline.
void materialised_attention(std::int64_t s, std::int64_t d, const float* q, const float* k, const float* v,
                            float* scores, float* out) {
  const float scale = 1.0f / std::sqrt(float(d));
  ops::cpu::gemm(Transpose::no, Transpose::yes, s, s, d, scale, q, d, k, d, 0.0f, scores, s);
  for (std::int64_t i = 0; i < s; ++i) {
    float* row = scores + i * s;
    const float top = *std::max_element(row, row + s);
    float sum = 0.0f;
    for (std::int64_t j = 0; j < s; ++j) sum += (row[j] = std::exp(row[j] - top));
    for (std::int64_t j = 0; j < s; ++j) row[j] /= sum;
  }
  ops::cpu::gemm(Transpose::no, Transpose::no, s, d, s, 1.0f, scores, s, v, d, 0.0f, out, d);
}

std::string human_bytes(double bytes) {
  if (bytes >= 1024.0 * 1024 * 1024) return fmt::format("{:.2f} GiB", bytes / (1024.0 * 1024 * 1024));
  if (bytes >= 1024.0 * 1024) return fmt::format("{:.1f} MiB", bytes / (1024.0 * 1024));
  return fmt::format("{:.1f} KiB", bytes / 1024.0);
}

struct GemmRow {
  std::string kernel;
  std::int64_t m, n, k;
  double seconds;
};

}  // namespace

int main(int argc, char** argv) {
  bool quick = false, full = false;
  paradyse::cli::Flags flags("ops_bench", "GEMM and attention kernels against the best GEMM measured in the same run.");
  flags.flag("--quick", quick, "fewer sizes and repetitions");
  flags.flag("--full", full, "more sizes");
  flags.parse(argc, argv);
  Rng rng(2024);

  // ---- GEMM ----------------------------------------------------------------------------------------------------
  {
    const ops::cpu::GemmMeasurement choice = ops::cpu::gemm_measurement();
    fmt::print("# gemm()'s engine per size class, measured on this machine (GFLOP/s: cblas / fallback)\n");
    for (const ops::cpu::GemmSizeClass c : ops::cpu::kAllGemmSizeClasses) {
      const auto i = std::size_t(c);
      fmt::print("{:<7} {:<9} {:>7.1f} / {:>7.1f}\n", ops::cpu::name_of(c), ops::cpu::name_of(choice.engine[i]),
                 choice.cblas_flops_per_s[i] / 1e9, choice.fallback_flops_per_s[i] / 1e9);
    }
    fmt::print("\n");
  }
  fmt::print("# GEMM, f32, row-major, one thread\n");
  double yardstick = 0.0;
  std::string yardstick_kernel;
  {
    const std::int64_t sizes[][3] = {{1024, 1024, 1024}, {512, 512, 512}, {256, 256, 256}, {128, 256, 128},
                                     {64, 128, 128},     {64, 128, 64},   {4096, 128, 128}, {512, 1024, 32}};
    std::vector<GemmRow> rows;
    for (const auto& s : sizes) {
      const std::int64_t m = s[0], n = s[1], k = s[2];
      Tensor<float> a = random_uniform<float>(Shape{m, k}, rng), b = random_uniform<float>(Shape{k, n}, rng);
      Tensor<float> c(Shape{m, n});
      const double flops = 2.0 * m * n * k;
      const int reps = std::clamp(int(2e9 / flops), 3, 200);
      const auto best_so_far = [&](const GemmRow& r) {
        if (m == 1024 && flops / r.seconds / 1e9 > yardstick) {
          yardstick = flops / r.seconds / 1e9;
          yardstick_kernel = r.kernel;
        }
      };
#if defined(PARADYSE_WITH_CBLAS)
      rows.push_back({"openblas sgemm", m, n, k, median_seconds(reps, [&] {
                        ops::cpu::gemm_cblas(Transpose::no, Transpose::no, m, n, k, 1.0f, a.data(), k, b.data(), n,
                                             0.0f, c.data(), n);
                      })});
      best_so_far(rows.back());
      // The BLAS called plainly with beta 0: OpenBLAS zeroes c in a pass of its own; the wrapper above clears c once
      // and asks for beta 1 (ops/cpu/gemm_kernels.hpp gemm_cblas).
      rows.push_back({"cblas_sgemm, beta 0", m, n, k, median_seconds(reps, [&] {
                        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(m), int(n), int(k), 1.0f, a.data(),
                                    int(k), b.data(), int(n), 0.0f, c.data(), int(n));
                      })});
      best_so_far(rows.back());
#endif
      rows.push_back({"fallback (blocked)", m, n, k, median_seconds(reps, [&] {
                        ops::cpu::gemm_fallback(Transpose::no, Transpose::no, m, n, k, 1.0f, a.data(), k, b.data(), n,
                                                0.0f, c.data(), n);
                      })});
      best_so_far(rows.back());
      Tensor<float> at = random_uniform<float>(Shape{k, m}, rng), bt = random_uniform<float>(Shape{n, k}, rng);
      rows.push_back({"fallback, A^T B^T", m, n, k, median_seconds(reps, [&] {
                        ops::cpu::gemm_fallback(Transpose::yes, Transpose::yes, m, n, k, 1.0f, at.data(), m, bt.data(),
                                                k, 0.0f, c.data(), n);
                      })});
      rows.push_back({fmt::format("gemm() ({})", ops::cpu::name_of(ops::cpu::gemm_engine_for(m, n, k))), m, n, k,
                      median_seconds(reps, [&] {
                        ops::cpu::gemm(Transpose::no, Transpose::no, m, n, k, 1.0f, a.data(), k, b.data(), n, 0.0f,
                                       c.data(), n);
                      })});
      if (m <= 512 && m * n * k <= 512 * 512 * 512 && m != 256 && m != 128)
        rows.push_back({"naive i-k-j loop", m, n, k, median_seconds(std::max(1, reps / 10), [&] {
                          naive_gemm(m, n, k, a.data(), b.data(), c.data());
                        })});
    }
    fmt::print("{:<20} {:>6} {:>6} {:>6} {:>11} {:>9} {:>7}\n", "kernel", "m", "n", "k", "time", "GFLOP/s", "ratio");
    for (const GemmRow& r : rows) {
      const double gflops = 2.0 * r.m * r.n * r.k / r.seconds / 1e9;
      fmt::print("{:<20} {:>6} {:>6} {:>6} {:>8.3f} ms {:>9.1f} {:>7.2f}\n", r.kernel, r.m, r.n, r.k, r.seconds * 1e3,
                 gflops, gflops / yardstick);
    }
    fmt::print("yardstick: the best 1024^3 GEMM of this run, {} at {:.1f} GFLOP/s (ratio 1.00)\n\n",
               yardstick_kernel, yardstick);
  }

  // ---- attention -----------------------------------------------------------------------------------------------
  struct Case {
    std::int64_t s, d, heads;
    bool causal, backward;
    int reps;
    std::optional<ops::cpu::GemmEngine> engine;  // none: gemm()'s measured choice
  };
  std::vector<Case> cases;
  for (std::int64_t d : {64, 128}) {
    for (bool causal : {false, true}) {
      cases.push_back({1024, d, 4, causal, true, 5});
      cases.push_back({4096, d, 4, causal, true, 3});
    }
    if (!quick) {
      cases.push_back({16384, d, 1, true, true, 1});
      cases.push_back({65536, d, 1, true, full, 1});
    }
  }
  // d = 128 at 4K through each engine forced, beside the measured choice above.
  if (ops::cpu::kGemmUsesCblas)
    for (const auto e : {ops::cpu::GemmEngine::cblas, ops::cpu::GemmEngine::fallback})
      cases.push_back({4096, 128, 4, false, true, 3, e});
  const auto engine_name = [](std::optional<ops::cpu::GemmEngine> e) {
    return e ? std::string(ops::cpu::name_of(*e)) : std::string("measured");
  };
  fmt::print("# attention, f32, one thread, q/k/v [1, s, heads, d], heads = kv heads\n");
  fmt::print("{:<10} {:>6} {:>4} {:>5} {:>7} {:>9} {:>11} {:>9} {:>7} {:>11}\n", "pass", "s", "d", "heads", "mask",
             "gemm", "time", "GFLOP/s", "ratio", "peak mem");
  for (const Case& c : cases) {
    if (c.engine) ops::cpu::set_gemm_engine(*c.engine);
    else ops::cpu::use_measured_gemm_engines();
    Tensor<float> q = random_uniform<float>(Shape{1, c.s, c.heads, c.d}, rng);
    Tensor<float> k = random_uniform<float>(Shape{1, c.s, c.heads, c.d}, rng);
    Tensor<float> v = random_uniform<float>(Shape{1, c.s, c.heads, c.d}, rng);
    Tensor<float> out(q.shape()), lse(Shape{1, c.heads, c.s}), dout = random_uniform<float>(q.shape(), rng);
    Tensor<float> dq(q.shape()), dk(k.shape()), dv(v.shape());
    ops::AttentionMask mask;
    mask.causal = c.causal;
    const double forward_flops = 4.0 * double(c.s) * double(c.s) * double(c.d) * double(c.heads) * (c.causal ? 0.5 : 1.0);
    const bool long_run = c.s >= 16384;
    // Workspace of the kernel alone, through a tracker of its own (inputs and outputs are allocated outside).
    MemoryTracker tracker;
    const double t_forward = median_seconds(c.reps, [&] {
      ScopedTracker scope(tracker);
      ops::cpu::attention_forward(q.view(), k.view(), v.view(), mask, out.view(), lse.view());
    }, !long_run);
    const double gf = forward_flops / t_forward / 1e9;
    fmt::print("{:<10} {:>6} {:>4} {:>5} {:>7} {:>9} {:>8.1f} ms {:>9.1f} {:>7.2f} {:>11}\n", "forward", c.s, c.d,
               c.heads, c.causal ? "causal" : "full", engine_name(c.engine), t_forward * 1e3, gf, gf / yardstick, human_bytes(double(tracker.peak())));
    std::fflush(stdout);
    if (!c.backward) continue;
    MemoryTracker tracker_backward;
    const double t_backward = median_seconds(c.reps, [&] {
      ScopedTracker scope(tracker_backward);
      ops::cpu::attention_backward(q.view(), k.view(), v.view(), out.view(), lse.view(), dout.view(), mask, dq.view(),
                                   dk.view(), dv.view());
    }, !long_run);
    const double gb = 2.5 * forward_flops / t_backward / 1e9;
    fmt::print("{:<10} {:>6} {:>4} {:>5} {:>7} {:>9} {:>8.1f} ms {:>9.1f} {:>7.2f} {:>11}\n", "backward", c.s, c.d,
               c.heads, c.causal ? "causal" : "full", engine_name(c.engine), t_backward * 1e3, gb, gb / yardstick,
               human_bytes(double(tracker_backward.peak())));
    std::fflush(stdout);
  }
  ops::cpu::use_measured_gemm_engines();
  fmt::print("(peak mem: the kernel's own workspace from the memory tracker; an s x s f32 score matrix would be "
             "{} at 16K and {} at 64K per head)\n\n",
             human_bytes(16384.0 * 16384 * 4), human_bytes(65536.0 * 65536 * 4));

  // ---- the materialised baseline -------------------------------------------------------------------------------
  fmt::print("# baseline: attention that materialises s x s (one head, non-causal, d = 128), vs the flash kernel\n");
  fmt::print("{:<22} {:>6} {:>11} {:>9} {:>11}\n", "kernel", "s", "time", "GFLOP/s", "s x s bytes");
  for (std::int64_t s : {1024, 4096}) {
    const std::int64_t d = 128;
    Tensor<float> q = random_uniform<float>(Shape{1, s, 1, d}, rng), k = random_uniform<float>(Shape{1, s, 1, d}, rng);
    Tensor<float> v = random_uniform<float>(Shape{1, s, 1, d}, rng), out(Shape{1, s, 1, d}), lse(Shape{1, 1, s});
    Tensor<float> scores(Shape{s, s});
    const double flops = 4.0 * double(s) * double(s) * double(d);
    const double t_naive = median_seconds(3, [&] {
      materialised_attention(s, d, q.data(), k.data(), v.data(), scores.data(), out.data());
    });
    const double t_flash = median_seconds(3, [&] {
      ops::cpu::attention_forward(q.view(), k.view(), v.view(), {}, out.view(), lse.view());
    });
    fmt::print("{:<22} {:>6} {:>8.1f} ms {:>9.1f} {:>11}\n", "materialised (std::exp)", s, t_naive * 1e3,
               flops / t_naive / 1e9, human_bytes(double(s) * double(s) * 4));
    fmt::print("{:<22} {:>6} {:>8.1f} ms {:>9.1f} {:>11}\n", "flash (this library)", s, t_flash * 1e3,
               flops / t_flash / 1e9, "-");
  }
  return 0;
}
