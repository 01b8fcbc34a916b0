// paradyse/ops/cpu/simd.hpp: run-time choice of the instruction set for the hot loops.
//
// The build does not pass -march (a library's users choose their flags), so the hot loops are plain C++ that the
// compiler vectorises, compiled once more under __attribute__((target("avx2,fma"))) and target("avx512f,...") and
// picked by simd_level() at run time. The loop bodies are always_inline templates: a function with a wider target
// may inline a plain one, and then its loops are vectorised for that target.
#pragma once

#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
#define PARADYSE_X86_DISPATCH 1
#define PARADYSE_TARGET_AVX2 __attribute__((target("avx2,fma")))
#define PARADYSE_TARGET_AVX512 __attribute__((target("avx512f,avx512vl,avx512dq,avx512bw,avx2,fma")))
#endif

#include <algorithm>
#include <atomic>

namespace paradyse::ops::cpu {

enum class SimdLevel { base, avx2, avx512 };

// The widest instruction set of this CPU that the kernels have a version for.
inline SimdLevel detected_simd_level() {
#if defined(PARADYSE_X86_DISPATCH)
  static const SimdLevel level = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw"))
      return SimdLevel::avx512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return SimdLevel::avx2;
    return SimdLevel::base;
  }();
  return level;
#else
  return SimdLevel::base;
#endif
}

namespace detail {
inline std::atomic<int>& simd_limit() {
  static std::atomic<int> limit{int(SimdLevel::avx512)};
  return limit;
}
}  // namespace detail

// The level the kernels use: the detected one, or less after limit_simd_level.
inline SimdLevel simd_level() {
  return SimdLevel(std::min(int(detected_simd_level()), detail::simd_limit().load(std::memory_order_relaxed)));
}

// Caps the instruction set the kernels use (process-wide), so tests can run every version on one machine.
inline void limit_simd_level(SimdLevel level) { detail::simd_limit().store(int(level), std::memory_order_relaxed); }

}  // namespace paradyse::ops::cpu
