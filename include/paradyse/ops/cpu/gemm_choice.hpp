// paradyse/ops/cpu/gemm_choice.hpp: which GEMM engine gemm() runs, chosen by measuring both on this machine.
//
// A distribution's OpenBLAS may not know the CPU it runs on and fall back to a generic kernel several times slower
// than the library's own (or the reverse: the built-in kernel has no AVX-512 on an AVX2 machine). So the choice is
// measured, never assumed: both engines run a few representative GEMMs of each size class (small, medium, large by
// flops, since the winner may change with size: OpenBLAS's per-call overhead shows on small tiles) and the faster
// one per class is used from then on.
//
// Once per machine and program: the first gemm() of a process reads the choice from a cache file keyed by the CPU
// model, the instruction set, the BLAS build and the executable (a test built at -O1 runs the built-in kernel at half
// the speed of a -O3 program, so programs do not share a choice), or measures (about a third of a second) and
// writes it there, in the folder
//   $PARADYSE_GEMM_CACHE              ("off": measure in every process, write nothing)
//   else $XDG_CACHE_HOME/paradyse, else $HOME/.cache/paradyse
// as gemm-<hash of the key>.txt.
// A calibrated profile (cost/calibrate.hpp) carries the same measurement; set_gemm_measurement applies one.
// $PARADYSE_GEMM=cblas|fallback forces one engine for the process, as does set_gemm_engine().
//
// Thread safety: the choice is a process-wide table of atomics, measured under std::call_once. It does not change
// during a run unless a program calls set_gemm_engine / set_gemm_measurement, so results are deterministic: the same
// inputs give the same bits, run after run, on one machine.
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/memory.hpp"
#include "paradyse/ops/cpu/gemm_kernels.hpp"
#include "paradyse/ops/cpu/simd.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <string>
#include <string_view>
#include <unistd.h>
#include <vector>

namespace paradyse::ops::cpu {

// True when the build found CBLAS (then both engines exist and the faster is chosen).
#if defined(PARADYSE_WITH_CBLAS)
inline constexpr bool kGemmUsesCblas = true;
#else
inline constexpr bool kGemmUsesCblas = false;
#endif

enum class GemmEngine : std::uint8_t { cblas, fallback };
constexpr std::string_view name_of(GemmEngine e) { return e == GemmEngine::cblas ? "cblas" : "fallback"; }

// Size classes by flops (2 m n k): small below 2^22 (128^3 and under: attention tiles of short heads, skinny
// products), medium below 2^28 (up to 512^3), large from there.
enum class GemmSizeClass : std::uint8_t { small, medium, large };
inline constexpr int kGemmSizeClasses = 3;
inline constexpr std::array<GemmSizeClass, kGemmSizeClasses> kAllGemmSizeClasses{
    GemmSizeClass::small, GemmSizeClass::medium, GemmSizeClass::large};
constexpr std::string_view name_of(GemmSizeClass c) {
  return c == GemmSizeClass::small ? "small" : c == GemmSizeClass::medium ? "medium" : "large";
}
inline GemmSizeClass gemm_size_class(std::int64_t m, std::int64_t n, std::int64_t k) {
  const double flops = 2.0 * double(m) * double(n) * double(k);
  if (flops < double(std::int64_t(1) << 22)) return GemmSizeClass::small;
  if (flops < double(std::int64_t(1) << 28)) return GemmSizeClass::medium;
  return GemmSizeClass::large;
}

// What measuring found: per size class, each engine's rate (0: not available) and the engine chosen.
struct GemmMeasurement {
  std::array<GemmEngine, kGemmSizeClasses> engine{GemmEngine::fallback, GemmEngine::fallback, GemmEngine::fallback};
  std::array<double, kGemmSizeClasses> cblas_flops_per_s{};
  std::array<double, kGemmSizeClasses> fallback_flops_per_s{};

  // The chosen engine's rate in a class.
  double flops_per_s(GemmSizeClass c) const {
    const auto i = std::size_t(c);
    return engine[i] == GemmEngine::cblas ? cblas_flops_per_s[i] : fallback_flops_per_s[i];
  }
  // The rate of large GEMMs through the chosen engine: the machine's GEMM rate (what MFU is measured against).
  double peak_flops_per_s() const { return flops_per_s(GemmSizeClass::large); }
  friend bool operator==(const GemmMeasurement&, const GemmMeasurement&) = default;
};

namespace detail {

// Products measured per class: (m, n, k, op(a) transposed, op(b) transposed), in the forms the library calls: a
// linear layer's x w^T, x w, x^T dy, and flash attention's tiles on its 128 x 256 grid (attention_tiles.hpp): scores
// q k^T, p v and ds k, dk = ds^T q, at d = 32 (small), 64 and 128 (medium). The narrow p v product ([128, 256] x
// [256, d]) is where the engines differ most: OpenBLAS 0.3.21 ran it at 8.4 GFLOP/s at d = 32 and 64 on the 2-core
// EPYC (AVX2), the built-in kernel at 20-24, while both ran the square probes within 10% of each other.
struct GemmProbe {
  std::int64_t m, n, k;
  bool trans_a, trans_b;
};
// Changes whenever the probes do: part of the cache key, so a choice measured on other probes is measured again.
inline constexpr int kGemmProbeVersion = 2;
inline const std::array<std::vector<GemmProbe>, kGemmSizeClasses>& gemm_probe_shapes() {
  static const std::array<std::vector<GemmProbe>, kGemmSizeClasses> shapes{{
      {{64, 128, 64, false, true}, {64, 64, 128, false, false}, {128, 64, 64, true, false},
       {128, 256, 32, false, true}, {128, 32, 256, false, false}, {256, 32, 128, true, false}},
      {{128, 256, 128, false, true}, {128, 128, 256, false, false}, {256, 128, 128, true, false},
       {128, 256, 64, false, true}, {128, 64, 256, false, false}, {256, 64, 128, true, false},
       {256, 512, 256, false, true}},
      {{512, 512, 1024, false, true}, {512, 1024, 512, false, false}, {1024, 512, 512, true, false}},
  }};
  return shapes;
}

inline double thread_cpu_now() {
  timespec ts{};
  ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

// Flops per second of `engine` over the class's shapes: the fastest of `repetitions` timed runs (thread CPU time:
// other work on a shared machine only ever slows a run down) after a warm-up.
inline double measure_engine(GemmEngine engine, GemmSizeClass size_class, int repetitions) {
  double flops = 0, seconds = 0;
  for (const GemmProbe& probe : gemm_probe_shapes()[std::size_t(size_class)]) {
    const std::int64_t m = probe.m, n = probe.n, k = probe.k;
    std::vector<float> a(std::size_t(m * k)), b(std::size_t(k * n)), c(std::size_t(m * n));
    for (std::size_t i = 0; i < a.size(); ++i) a[i] = float(i % 7) * 0.125f - 0.375f;
    for (std::size_t i = 0; i < b.size(); ++i) b[i] = float(i % 5) * 0.25f - 0.5f;
    const Transpose ta = probe.trans_a ? Transpose::yes : Transpose::no;
    const Transpose tb = probe.trans_b ? Transpose::yes : Transpose::no;
    const std::int64_t lda = probe.trans_a ? m : k, ldb = probe.trans_b ? k : n;
    const auto run = [&] {
#if defined(PARADYSE_WITH_CBLAS)
      if (engine == GemmEngine::cblas)
        return gemm_cblas(ta, tb, m, n, k, 1.0f, a.data(), lda, b.data(), ldb, 0.0f, c.data(), n);
#endif
      gemm_fallback(ta, tb, m, n, k, 1.0f, a.data(), lda, b.data(), ldb, 0.0f, c.data(), n);
    };
    run();
    double best = 1e30;
    for (int r = 0; r < repetitions; ++r) {
      const double start = thread_cpu_now();
      run();
      best = std::min(best, thread_cpu_now() - start);
    }
    flops += 2.0 * double(m) * double(n) * double(k);
    seconds += std::max(best, 1e-9);
  }
  return flops / seconds;
}

}  // namespace detail

// The fallback is chosen when it beats CBLAS by more than this margin: probes and real calls differ a little (the
// attention kernel's strided tiles; the fallback's packing buffer per call). Measured on a Zen 2: the medium probes
// gave the fallback 34.6 against 32.8 GFLOP/s (5.5% ahead), yet the attention kernel ran 9% faster through OpenBLAS;
// within 10% of each other the established library is the safer choice. Where the built-in kernel is decisively
// faster (AVX-512 against a generic OpenBLAS: 4x) it is still chosen.
inline constexpr double kFallbackMargin = 1.10;
inline bool prefer_fallback(double fallback_flops_per_s, double cblas_flops_per_s) {
  return fallback_flops_per_s > kFallbackMargin * cblas_flops_per_s;
}

// Runs both engines (one when the build has no CBLAS) on every size class and picks the faster per class, engines
// measured alternately, each the fastest of `repetitions`. Takes about half a second; its workspace is counted by a tracker of its own, never the caller's.
inline GemmMeasurement measure_gemm_engines(int repetitions = 5) {
  check(repetitions >= 1, "measure_gemm_engines: repetitions = {} must be at least 1", repetitions);
  MemoryTracker own;
  ScopedTracker scope(own);
  GemmMeasurement result;
  for (const GemmSizeClass c : kAllGemmSizeClasses) {
    const auto i = std::size_t(c);
    for (int round = 0; round < 2; ++round) {  // two alternating rounds: a burst of other work hits both engines
      result.fallback_flops_per_s[i] = std::max(result.fallback_flops_per_s[i],
                                                detail::measure_engine(GemmEngine::fallback, c, repetitions));
      if (kGemmUsesCblas)
        result.cblas_flops_per_s[i] = std::max(result.cblas_flops_per_s[i],
                                               detail::measure_engine(GemmEngine::cblas, c, repetitions));
    }
    result.engine[i] = prefer_fallback(result.fallback_flops_per_s[i], result.cblas_flops_per_s[i])
                           ? GemmEngine::fallback
                           : GemmEngine::cblas;
  }
  return result;
}

// ---- the cache file ------------------------------------------------------------------------------------------------

// What the choice depends on: the CPU model, the instruction set the kernels use, the BLAS build and the program.
inline std::string gemm_machine_key() {
  std::string model = "unknown cpu";
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line);)
    if (line.rfind("model name", 0) == 0) {
      model = line.substr(std::min(line.size(), line.find(':') + 2));
      break;
    }
  std::string blas = kGemmUsesCblas ? "cblas" : "none";
#if defined(PARADYSE_WITH_CBLAS)
  if (openblas_get_config) blas = openblas_get_config();
#endif
  std::error_code ignored;
  const std::string program = std::filesystem::read_symlink("/proc/self/exe", ignored).string();
  std::string key = fmt::format("{} | simd {} | {} | {} | margin {} | probes {}", model, int(simd_level()), blas,
                                program, kFallbackMargin, detail::kGemmProbeVersion);
  std::replace(key.begin(), key.end(), '\n', ' ');
  return key;
}

// The cache file for `key` from the environment; empty: no cache.
inline std::string gemm_cache_path(const std::string& key) {
  std::string folder;
  if (const char* path = std::getenv("PARADYSE_GEMM_CACHE")) {
    if (std::string_view(path) == "off" || !*path) return {};
    folder = path;
  } else if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg && *xdg) {
    folder = std::string(xdg) + "/paradyse";
  } else if (const char* home = std::getenv("HOME"); home && *home) {
    folder = std::string(home) + "/.cache/paradyse";
  } else {
    return {};
  }
  std::uint64_t hash = 0xcbf29ce484222325ull;  // FNV-1a: stable across runs and builds, unlike std::hash
  for (const unsigned char ch : key) hash = (hash ^ ch) * 0x100000001b3ull;
  return fmt::format("{}/gemm-{:016x}.txt", folder, hash);
}

// Text form: the key line, then per class "<class> <engine> <cblas flops/s> <fallback flops/s>".
inline std::string gemm_measurement_text(const GemmMeasurement& m, const std::string& key) {
  std::string text = "paradyse gemm choice 1\n" + key + "\n";
  for (const GemmSizeClass c : kAllGemmSizeClasses) {
    const auto i = std::size_t(c);
    text += fmt::format("{} {} {:.6e} {:.6e}\n", name_of(c), name_of(m.engine[i]), m.cblas_flops_per_s[i],
                        m.fallback_flops_per_s[i]);
  }
  return text;
}

// The measurement in `text` if it is well formed and was made for `key`.
inline bool parse_gemm_measurement(const std::string& text, const std::string& key, GemmMeasurement& out) {
  std::istringstream in(text);
  std::string line;
  if (!std::getline(in, line) || line != "paradyse gemm choice 1") return false;
  if (!std::getline(in, line) || line != key) return false;
  GemmMeasurement m;
  for (const GemmSizeClass c : kAllGemmSizeClasses) {
    std::string name, engine;
    double cblas = 0, fallback = 0;
    if (!(in >> name >> engine >> cblas >> fallback) || name != name_of(c)) return false;
    if (engine != "cblas" && engine != "fallback") return false;
    if (!(cblas >= 0 && fallback >= 0 && cblas < 1e18 && fallback < 1e18)) return false;
    const auto i = std::size_t(c);
    m.engine[i] = engine == "cblas" ? GemmEngine::cblas : GemmEngine::fallback;
    if (m.engine[i] == GemmEngine::cblas && !kGemmUsesCblas) return false;
    m.cblas_flops_per_s[i] = cblas;
    m.fallback_flops_per_s[i] = fallback;
  }
  out = m;
  return true;
}

namespace detail {

inline bool read_gemm_cache(const std::string& path, const std::string& key, GemmMeasurement& out) {
  if (path.empty()) return false;
  std::ifstream file(path);
  if (!file) return false;
  std::stringstream text;
  text << file.rdbuf();
  return parse_gemm_measurement(text.str(), key, out);
}

// Written to a temporary file and renamed, so concurrent processes (mpirun) never read half a file. Failures are
// ignored: the cache only saves time.
inline void write_gemm_cache(const std::string& path, const std::string& text) {
  if (path.empty()) return;
  std::error_code ignored;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ignored);
  const std::string temporary = fmt::format("{}.{}.tmp", path, ::getpid());
  {
    std::ofstream file(temporary, std::ios::trunc);
    if (!file) return;
    file << text;
    if (!file.flush()) return;
  }
  std::filesystem::rename(temporary, path, ignored);
  if (ignored) std::filesystem::remove(temporary, ignored);
}

// The process-wide table: per class the engine (kUnset until measured), the forced engine, and the measurement.
inline constexpr std::uint8_t kUnset = 0xff;
struct GemmChoiceState {
  std::array<std::atomic<std::uint8_t>, kGemmSizeClasses> engine{kUnset, kUnset, kUnset};
  std::atomic<std::uint8_t> forced{kUnset};
  std::once_flag measured_once;
  std::mutex mutex;  // guards measurement
  GemmMeasurement measurement;
};
inline GemmChoiceState& gemm_choice_state() {
  static GemmChoiceState state;
  return state;
}

inline void store_measurement(const GemmMeasurement& m) {
  GemmChoiceState& s = gemm_choice_state();
  {
    std::lock_guard lock(s.mutex);
    s.measurement = m;
  }
  for (std::size_t i = 0; i < kGemmSizeClasses; ++i) s.engine[i].store(std::uint8_t(m.engine[i]), std::memory_order_release);
}

// The first call of the process: $PARADYSE_GEMM, then the cache, then a measurement (written to the cache).
inline void choose_gemm_engines_once() {
  GemmChoiceState& s = gemm_choice_state();
  std::call_once(s.measured_once, [&] {
    if (s.engine[0].load(std::memory_order_acquire) != kUnset) return;  // set_gemm_measurement came first
    if (const char* forced = std::getenv("PARADYSE_GEMM")) {
      const std::string_view f(forced);
      check(f == "cblas" || f == "fallback" || f == "auto",
            "PARADYSE_GEMM = \"{}\": expected cblas, fallback or auto", f);
      check(f != "cblas" || kGemmUsesCblas, "PARADYSE_GEMM = cblas, but this build has no CBLAS");
      if (f != "auto") s.forced.store(std::uint8_t(f == "cblas" ? GemmEngine::cblas : GemmEngine::fallback));
    }
    const std::string key = gemm_machine_key(), path = gemm_cache_path(key);
    GemmMeasurement m;
    if (!read_gemm_cache(path, key, m)) {
      m = measure_gemm_engines();
      write_gemm_cache(path, gemm_measurement_text(m, key));
    }
    store_measurement(m);
  });
}

}  // namespace detail

// The engine gemm() runs for an m x n x k product.
inline GemmEngine gemm_engine_for(std::int64_t m, std::int64_t n, std::int64_t k) {
  detail::GemmChoiceState& s = detail::gemm_choice_state();
  if (!kGemmUsesCblas) return GemmEngine::fallback;
  if (const std::uint8_t forced = s.forced.load(std::memory_order_relaxed); forced != detail::kUnset)
    return GemmEngine(forced);
  const auto i = std::size_t(gemm_size_class(m, n, k));
  std::uint8_t e = s.engine[i].load(std::memory_order_acquire);
  if (e == detail::kUnset) {
    detail::choose_gemm_engines_once();
    if (const std::uint8_t forced = s.forced.load(std::memory_order_relaxed); forced != detail::kUnset)
      return GemmEngine(forced);
    e = s.engine[i].load(std::memory_order_acquire);
  }
  return GemmEngine(e);
}

// The engine of large GEMMs (what most of a model's flops go through).
inline GemmEngine gemm_engine() { return gemm_engine_for(1024, 1024, 1024); }

// This process's measurement (measured or read from the cache on first use).
inline GemmMeasurement gemm_measurement() {
  detail::choose_gemm_engines_once();
  detail::GemmChoiceState& s = detail::gemm_choice_state();
  std::lock_guard lock(s.mutex);
  return s.measurement;
}

// Uses the choice of a measurement made earlier (a calibrated profile's). Process-wide, from the next gemm() on.
inline void set_gemm_measurement(const GemmMeasurement& m) {
  for (const GemmEngine e : m.engine)
    check(e == GemmEngine::fallback || kGemmUsesCblas,
          "set_gemm_measurement: the measurement chose CBLAS but this build has no CBLAS (PARADYSE_WITH_CBLAS)");
  detail::store_measurement(m);
}

// Forces one engine for every size (process-wide), to compare the two or to run one under everything that calls
// gemm(); use_measured_gemm_engines() goes back to the measured choice.
inline void set_gemm_engine(GemmEngine engine) {
  check(engine == GemmEngine::fallback || kGemmUsesCblas,
        "set_gemm_engine: CBLAS was requested but this build has no CBLAS (PARADYSE_WITH_CBLAS is not defined)");
  detail::gemm_choice_state().forced.store(std::uint8_t(engine), std::memory_order_relaxed);
}
inline void use_measured_gemm_engines() {
  detail::choose_gemm_engines_once();  // a $PARADYSE_GEMM setting is read (and then cleared) first
  detail::gemm_choice_state().forced.store(detail::kUnset, std::memory_order_relaxed);
}

}  // namespace paradyse::ops::cpu
