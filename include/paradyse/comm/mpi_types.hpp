// paradyse/comm/mpi_types.hpp: MPI datatypes and reduction operators for the communicator's element types, and the
// error check every MPI call goes through.
//
// f32, f64, i32, i64 map to MPI's predefined types and operators; raw bytes travel as MPI_BYTE. bf16 has no MPI
// type: it travels as a named 2-byte derived type and is reduced in float (mpi.hpp converts to a float staging
// buffer and rounds the result once), so its sums are as accurate as the threads backend's. avg is a sum followed
// by a division on the receiving rank (see mpi.hpp).
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/comm/mpi_h.hpp"
#include "paradyse/core/dtype.hpp"
#include "paradyse/core/error.hpp"


#include <fmt/format.h>

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>

namespace paradyse::mpi_detail {

// The text of an MPI error code ("MPI_ERR_TRUNCATE: message truncated", ...).
inline std::string error_text(int code) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) return fmt::format("MPI error code {}", code);
  return std::string(text, std::size_t(std::max(length, 0)));
}

// Counts and displacements are ints in MPI: a larger value is an error we report, never a silent wrap.
inline int to_int_count(std::size_t value, std::string_view op, std::string_view what) {
  check(value <= std::size_t(INT_MAX), "{}: {} = {} exceeds MPI's int count limit {}; split the message", op, what,
        value, INT_MAX);
  return int(value);
}
inline int to_int_count(std::int64_t value, std::string_view op, std::string_view what) {
  check(value >= 0, "{}: {} = {} must be non-negative", op, what, value);
  return to_int_count(std::size_t(value), op, what);
}

// bf16 travels as a named 2-byte type (it is never reduced as bf16: see reduce_datatype).
inline MPI_Datatype bf16_datatype() {
  static const MPI_Datatype type = [] {
    MPI_Datatype t = MPI_DATATYPE_NULL;
    MPI_Type_contiguous(2, MPI_BYTE, &t);
    MPI_Type_set_name(t, "paradyse_bf16");
    MPI_Type_commit(&t);
    return t;
  }();
  return type;
}

// ---- element type -> datatype, operator -------------------------------------------------------------------------------

// The datatype a buffer of T travels as.
template <CommElement T>
MPI_Datatype datatype() {
  if constexpr (std::is_same_v<T, float>) return MPI_FLOAT;
  else if constexpr (std::is_same_v<T, double>) return MPI_DOUBLE;
  else if constexpr (std::is_same_v<T, std::int32_t>) return MPI_INT32_T;
  else if constexpr (std::is_same_v<T, std::int64_t>) return MPI_INT64_T;
  else if constexpr (std::is_same_v<T, bf16>) return bf16_datatype();
  else return MPI_BYTE;
}

// The element type a reduction of T runs in: T itself, float for bf16 (reduced in float, rounded to bf16 once at
// the end, like the threads backend; MPI operators on bf16 itself would round at every step). Raw bytes are not
// reduced (a compile-time error in mpi.hpp).
template <CommElement T>
using ReduceIn = std::conditional_t<std::is_same_v<T, bf16>, float, T>;

template <CommElement T>
MPI_Datatype reduce_datatype() {
  return datatype<ReduceIn<T>>();
}

// The MPI operator for `op`; avg reduces as sum (the division follows, on the receiving rank).
inline MPI_Op reduce_operator(ReduceOp op) { return op == ReduceOp::max ? MPI_MAX : MPI_SUM; }

}  // namespace paradyse::mpi_detail
