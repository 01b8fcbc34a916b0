// paradyse/core/dtype.hpp: the element types (f32, f64, bf16, f16) and their conversions.
//
// bf16 and f16 are storage types: arithmetic happens in float. Conversions from float round to nearest, ties to
// even, and keep NaN a NaN and infinities infinite.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace paradyse {

struct bf16 {
  std::uint16_t bits = 0;

  bf16() = default;
  explicit bf16(float value) : bits(from_float(value)) {}
  explicit operator float() const { return std::bit_cast<float>(std::uint32_t(bits) << 16); }

  static constexpr bf16 from_bits(std::uint16_t b) { bf16 x; x.bits = b; return x; }
  friend bool operator==(bf16 a, bf16 b) { return float(a) == float(b); }

  static std::uint16_t from_float(float value) {
    const std::uint32_t u = std::bit_cast<std::uint32_t>(value);
    if ((u & 0x7fffffffu) > 0x7f800000u) return std::uint16_t((u >> 16) | 0x0040u);  // quiet NaN, keep sign
    const std::uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);                          // ties to even
    return std::uint16_t((u + rounding) >> 16);
  }
};

struct f16 {
  std::uint16_t bits = 0;

  f16() = default;
  explicit f16(float value) : bits(from_float(value)) {}
  explicit operator float() const { return to_float(bits); }

  static constexpr f16 from_bits(std::uint16_t b) { f16 x; x.bits = b; return x; }
  friend bool operator==(f16 a, f16 b) { return float(a) == float(b); }

  static std::uint16_t from_float(float value) {
    const std::uint32_t u = std::bit_cast<std::uint32_t>(value);
    const std::uint16_t sign = std::uint16_t((u >> 16) & 0x8000u);
    const std::uint32_t magnitude = u & 0x7fffffffu;
    if (magnitude > 0x7f800000u) return sign | 0x7e00u;          // NaN
    if (magnitude >= 0x477ff000u) return sign | 0x7c00u;         // rounds to beyond 65504: infinity
    if (magnitude < 0x38800000u) {                               // below the smallest normal half: subnormal
      // value = m * 2^-24 with m = round(|x| * 2^24); add 2^-1 magic to let the FPU round to even.
      const float scaled = std::bit_cast<float>(magnitude) + 0.5f;
      return sign | std::uint16_t(std::bit_cast<std::uint32_t>(scaled) - 0x3f000000u);
    }
    const std::uint32_t rounding = 0xfffu + ((magnitude >> 13) & 1u);
    return sign | std::uint16_t((magnitude - 0x38000000u + rounding) >> 13);
  }

  static float to_float(std::uint16_t h) {
    const std::uint32_t sign = std::uint32_t(h & 0x8000u) << 16;
    const std::uint32_t exponent = (h >> 10) & 0x1fu;
    const std::uint32_t mantissa = h & 0x3ffu;
    if (exponent == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
    if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24
      const float magnitude = float(mantissa) * 5.9604644775390625e-8f;
      return sign ? -magnitude : magnitude;
    }
    return std::bit_cast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  }
};

enum class DType : std::uint8_t { f32, f64, bf16, f16, i32, i64, byte };

template <class T> inline constexpr bool is_dtype_v = false;
template <> inline constexpr bool is_dtype_v<float> = true;
template <> inline constexpr bool is_dtype_v<double> = true;
template <> inline constexpr bool is_dtype_v<bf16> = true;
template <> inline constexpr bool is_dtype_v<f16> = true;
template <> inline constexpr bool is_dtype_v<std::int32_t> = true;
template <> inline constexpr bool is_dtype_v<std::int64_t> = true;
template <> inline constexpr bool is_dtype_v<std::byte> = true;

// An element type the library stores and moves.
template <class T>
concept Element = is_dtype_v<T>;

template <Element T>
constexpr DType dtype_of() {
  if constexpr (std::is_same_v<T, float>) return DType::f32;
  else if constexpr (std::is_same_v<T, double>) return DType::f64;
  else if constexpr (std::is_same_v<T, bf16>) return DType::bf16;
  else if constexpr (std::is_same_v<T, f16>) return DType::f16;
  else if constexpr (std::is_same_v<T, std::int32_t>) return DType::i32;
  else if constexpr (std::is_same_v<T, std::int64_t>) return DType::i64;
  else return DType::byte;
}

constexpr std::size_t size_of(DType t) {
  switch (t) {
    case DType::f32: case DType::i32: return 4;
    case DType::f64: case DType::i64: return 8;
    case DType::bf16: case DType::f16: return 2;
    case DType::byte: return 1;
  }
  return 0;
}

constexpr std::string_view name_of(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::f64: return "f64";
    case DType::bf16: return "bf16";
    case DType::f16: return "f16";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
    case DType::byte: return "byte";
  }
  return "?";
}

}  // namespace paradyse
