// tests/comm/collective_checks.hpp: backend-independent checks of the Communicator concept, used by the threads
// tests (tests/comm, thread ranks) and by the MPI tests (tests/mpi, processes).
//
// Every rank can regenerate every other rank's input (input_of(rank, n, seed)), so each check computes the expected
// result here, plainly, from the inputs: moves must be bit-exact, reductions match a float64 rank-order reference
// within the project tolerances (integers exactly). Each operation is checked out of place and in place, with the
// byte counts of stats() (threads.hpp's rule: ring volumes) computed independently.
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/rng.hpp"
#include "support/tolerance.hpp"

#include <doctest/doctest.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

namespace paradyse::testing {

// The backends under test also offer these (not part of the concept).
template <class C>
concept TestableCommunicator = Communicator<C> && requires(C& c) {
  c.reset_stats();
  { c.describe() } -> std::convertible_to<std::string>;
};

template <CommElement T>
std::string type_name() {
  return std::string(name_of(dtype_of<T>()));
}

template <CommElement T>
T make_value(Rng& rng) {
  if constexpr (std::is_same_v<T, float>) return float(rng.uniform(-1.0, 1.0));
  else if constexpr (std::is_same_v<T, double>) return rng.uniform(-1.0, 1.0);
  else if constexpr (std::is_same_v<T, bf16>) return bf16(float(rng.uniform(-1.0, 1.0)));
  else if constexpr (std::is_same_v<T, std::byte>) return std::byte(rng.next_u64() & 0xffu);
  else return T(std::int64_t(rng.below(2001)) - 1000);
}

// The n elements rank `rank` contributes under `seed`: the same on every rank and every backend.
template <CommElement T>
std::vector<T> input_of(int rank, std::size_t n, std::uint64_t seed) {
  Rng rng(seed * 0x9e3779b97f4a7c15ull + std::uint64_t(rank) * 7919u + 1u);
  std::vector<T> values(n);
  for (T& v : values) v = make_value<T>(rng);
  return values;
}

// A value no input takes, so an element the operation forgot to write is caught.
template <CommElement T>
T sentinel() {
  if constexpr (std::is_same_v<T, bf16>) return bf16(777.0f);
  else if constexpr (std::is_same_v<T, std::byte>) return std::byte(0xa5);  // bytes take every value: still detects
  else return T(7777);
}

template <CommElement T>
double as_double(T v) {
  if constexpr (std::is_same_v<T, std::byte>) return double(std::to_integer<int>(v));
  else if constexpr (std::is_same_v<T, bf16>) return double(float(v));
  else return double(v);
}

// Bitwise equality; the message names the first differing element.
template <CommElement T>
std::string first_difference(std::span<const T> got, std::span<const T> want) {
  if (got.size() != want.size()) return fmt::format("sizes differ: got {}, want {}", got.size(), want.size());
  for (std::size_t i = 0; i < got.size(); ++i)
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0)
      return fmt::format("element {} of {}: got {}, want {}", i, got.size(), as_double(got[i]), as_double(want[i]));
  return {};
}

template <CommElement T>
void check_same(std::span<const T> got, std::span<const T> want, const std::string& what) {
  const std::string difference = first_difference(got, want);
  CHECK_MESSAGE(difference.empty(), what, ": ", difference);
}

template <CommElement T>
constexpr bool is_floating() {
  return std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, bf16>;
}

// The float64 reference of a reduction over ranks, in rank order, elements [begin, begin + count) of each input.
// Integers: exact in int64, avg by truncating division (what C++ integer division does).
template <CommElement T>
std::vector<double> reduce_reference(const std::vector<std::vector<T>>& inputs, ReduceOp op, std::size_t begin,
                                     std::size_t count) {
  const int ranks = int(inputs.size());
  std::vector<double> out(count);
  for (std::size_t i = 0; i < count; ++i) {
    if constexpr (is_floating<T>()) {
      double acc = as_double(inputs[0][begin + i]);
      for (int r = 1; r < ranks; ++r) {
        const double x = as_double(inputs[std::size_t(r)][begin + i]);
        acc = op == ReduceOp::max ? std::max(acc, x) : acc + x;
      }
      out[i] = op == ReduceOp::avg ? acc / ranks : acc;
    } else {
      std::int64_t acc = std::int64_t(inputs[0][begin + i]);
      for (int r = 1; r < ranks; ++r) {
        const std::int64_t x = std::int64_t(inputs[std::size_t(r)][begin + i]);
        acc = op == ReduceOp::max ? std::max(acc, x) : acc + x;
      }
      out[i] = double(op == ReduceOp::avg ? acc / ranks : acc);
    }
  }
  return out;
}

template <CommElement T>
void check_reduced(std::span<const T> got, const std::vector<double>& want, const std::string& what) {
  std::vector<double> values(got.size());
  for (std::size_t i = 0; i < got.size(); ++i) values[i] = as_double(got[i]);
  Tolerance tol{0, 0};  // integers: exact
  if constexpr (std::is_same_v<T, float>) tol = kFloat32;
  else if constexpr (std::is_same_v<T, double>) tol = kFloat64;
  else if constexpr (std::is_same_v<T, bf16>) tol = kBfloat16;
  const std::string mismatch = first_mismatch(std::span<const double>(values), std::span<const double>(want), tol);
  CHECK_MESSAGE(mismatch.empty(), what, ": ", mismatch);
}

template <class C>
void check_stats(const C& comm, std::uint64_t sent, std::uint64_t received, std::uint64_t operations,
                 const std::string& what) {
  const CommStats stats = comm.stats();
  CHECK_MESSAGE(stats.bytes_sent == sent, what, ": bytes_sent ", stats.bytes_sent, ", want ", sent);
  CHECK_MESSAGE(stats.bytes_received == received, what, ": bytes_received ", stats.bytes_received, ", want ", received);
  CHECK_MESSAGE(stats.operations == operations, what, ": operations ", stats.operations, ", want ", operations);
}

template <class C>
std::string label(const C& comm, std::string_view op, std::string_view type, bool in_place) {
  return fmt::format("{} {} {} on rank {} of {}", op, type, in_place ? "in place" : "out of place", comm.rank(),
                     comm.size());
}

// Ragged counts (zeros included) that every rank derives alike from the seed.
inline std::vector<std::int64_t> ragged_counts(int ranks, std::uint64_t seed, int salt = 0) {
  std::vector<std::int64_t> counts(static_cast<std::size_t>(ranks));
  for (int r = 0; r < ranks; ++r) counts[std::size_t(r)] = std::int64_t((seed + 3u * std::uint64_t(r) + std::uint64_t(salt) * 5u) % 7u);
  return counts;
}
inline std::size_t offset_of(const std::vector<std::int64_t>& counts, int rank) {
  return std::size_t(std::accumulate(counts.begin(), counts.begin() + rank, std::int64_t(0)));
}

template <CommElement T>
std::vector<std::vector<T>> inputs_of_all(int ranks, std::size_t n, std::uint64_t seed) {
  std::vector<std::vector<T>> all;
  for (int r = 0; r < ranks; ++r) all.push_back(input_of<T>(r, n, seed));
  return all;
}

// ---- moves -----------------------------------------------------------------------------------------------------------

template <CommElement T, TestableCommunicator C>
void check_all_gather(C& comm, std::size_t n, std::uint64_t seed, bool in_place, bool async) {
  const int p = comm.size(), me = comm.rank();
  const auto mine = input_of<T>(me, n, seed);
  std::vector<T> want;
  for (int r = 0; r < p; ++r) {
    const auto x = input_of<T>(r, n, seed);
    want.insert(want.end(), x.begin(), x.end());
  }
  std::vector<T> out(n * std::size_t(p), sentinel<T>());
  comm.reset_stats();
  if (in_place) {
    std::copy(mine.begin(), mine.end(), out.begin() + std::ptrdiff_t(std::size_t(me) * n));
    std::span<T> chunk(out.data() + std::size_t(me) * n, n);
    if (async) comm.all_gather_async(std::span<const T>(chunk), std::span<T>(out)).wait();
    else comm.all_gather(std::span<const T>(chunk), std::span<T>(out));
  } else {
    if (async) comm.all_gather_async(std::span<const T>(mine), std::span<T>(out)).wait();
    else comm.all_gather(std::span<const T>(mine), std::span<T>(out));
  }
  const std::string what = label(comm, async ? "all_gather_async" : "all_gather", type_name<T>(), in_place);
  check_same<T>(out, want, what);
  check_stats(comm, (p - 1) * n * sizeof(T), (p - 1) * n * sizeof(T), 1, what);
}

template <CommElement T, TestableCommunicator C>
void check_all_gather_v(C& comm, std::uint64_t seed, bool in_place) {
  const int p = comm.size(), me = comm.rank();
  const auto counts = ragged_counts(p, seed);
  const auto mine = input_of<T>(me, std::size_t(counts[std::size_t(me)]), seed);
  std::vector<T> want;
  for (int r = 0; r < p; ++r) {
    const auto x = input_of<T>(r, std::size_t(counts[std::size_t(r)]), seed);
    want.insert(want.end(), x.begin(), x.end());
  }
  std::vector<T> out(want.size(), sentinel<T>());
  comm.reset_stats();
  const std::size_t at = offset_of(counts, me);
  if (in_place) {
    std::copy(mine.begin(), mine.end(), out.begin() + std::ptrdiff_t(at));
    comm.all_gather_v(std::span<const T>(out.data() + at, mine.size()), std::span<T>(out),
                      std::span<const std::int64_t>(counts));
  } else {
    comm.all_gather_v(std::span<const T>(mine), std::span<T>(out), std::span<const std::int64_t>(counts));
  }
  const std::string what = label(comm, "all_gather_v", type_name<T>(), in_place);
  check_same<T>(out, want, what);
  check_stats(comm, (p - 1) * mine.size() * sizeof(T), (want.size() - mine.size()) * sizeof(T), 1, what);
}

template <CommElement T, TestableCommunicator C>
void check_all_to_all(C& comm, std::size_t chunk, std::uint64_t seed, bool in_place, bool async) {
  const int p = comm.size(), me = comm.rank();
  const std::size_t n = chunk * std::size_t(p);
  auto mine = input_of<T>(me, n, seed);
  std::vector<T> want;  // chunk r of the output: chunk `me` of rank r's input
  for (int r = 0; r < p; ++r) {
    const auto x = input_of<T>(r, n, seed);
    want.insert(want.end(), x.begin() + std::ptrdiff_t(std::size_t(me) * chunk),
                x.begin() + std::ptrdiff_t(std::size_t(me + 1) * chunk));
  }
  std::vector<T> out(n, sentinel<T>());
  std::span<T> target = in_place ? std::span<T>(mine) : std::span<T>(out);
  comm.reset_stats();
  if (async) comm.all_to_all_async(std::span<const T>(mine), target).wait();
  else comm.all_to_all(std::span<const T>(mine), target);
  const std::string what = label(comm, async ? "all_to_all_async" : "all_to_all", type_name<T>(), in_place);
  check_same<T>(target, want, what);
  const std::uint64_t moved = (p - 1) * n * sizeof(T) / std::size_t(p);
  check_stats(comm, moved, moved, 1, what);
}

template <CommElement T, TestableCommunicator C>
void check_all_to_all_v(C& comm, std::uint64_t seed, bool in_place) {
  const int p = comm.size(), me = comm.rank();
  // Rank r sends counts_of(r)[j] elements to rank j; in place needs the same send and receive counts.
  auto counts_of = [&](int r) {
    std::vector<std::int64_t> c(static_cast<std::size_t>(p));
    for (int j = 0; j < p; ++j)
      c[std::size_t(j)] = in_place ? std::int64_t((seed + std::uint64_t(r + j)) % 5u)
                                   : std::int64_t((seed + 2u * std::uint64_t(r) + 5u * std::uint64_t(j)) % 6u);
    return c;
  };
  const auto send_counts = counts_of(me);
  std::vector<std::int64_t> recv_counts(static_cast<std::size_t>(p));
  for (int r = 0; r < p; ++r) recv_counts[std::size_t(r)] = counts_of(r)[std::size_t(me)];
  const std::size_t in_total = offset_of(send_counts, p), out_total = offset_of(recv_counts, p);
  auto mine = input_of<T>(me, in_total, seed);
  std::vector<T> want;
  for (int r = 0; r < p; ++r) {
    const auto counts = counts_of(r);
    const auto x = input_of<T>(r, offset_of(counts, p), seed);
    const std::size_t at = offset_of(counts, me);
    want.insert(want.end(), x.begin() + std::ptrdiff_t(at), x.begin() + std::ptrdiff_t(at + std::size_t(counts[std::size_t(me)])));
  }
  std::vector<T> out(out_total, sentinel<T>());
  std::span<T> target = in_place ? std::span<T>(mine) : std::span<T>(out);
  comm.reset_stats();
  comm.all_to_all_v(std::span<const T>(mine), std::span<const std::int64_t>(send_counts), target,
                    std::span<const std::int64_t>(recv_counts));
  const std::string what = label(comm, "all_to_all_v", type_name<T>(), in_place);
  check_same<T>(target, want, what);
  check_stats(comm, (in_total - std::size_t(send_counts[std::size_t(me)])) * sizeof(T),
              (out_total - std::size_t(recv_counts[std::size_t(me)])) * sizeof(T), 1, what);
}

template <CommElement T, TestableCommunicator C>
void check_broadcast(C& comm, std::size_t n, std::uint64_t seed, bool async) {
  const int p = comm.size(), me = comm.rank();
  const int root = int(seed % std::uint64_t(p));
  const auto want = input_of<T>(root, n, seed);
  std::vector<T> buffer = me == root ? want : std::vector<T>(n, sentinel<T>());
  comm.reset_stats();
  if (async) comm.broadcast_async(std::span<T>(buffer), root).wait();
  else comm.broadcast(std::span<T>(buffer), root);
  const std::string what = label(comm, async ? "broadcast_async" : "broadcast", type_name<T>(), true) +
                           fmt::format(" (root {})", root);
  check_same<T>(buffer, want, what);
  if (p > 1) check_stats(comm, me == root ? n * sizeof(T) : 0, me == root ? 0 : n * sizeof(T), 1, what);
  else check_stats(comm, 0, 0, 0, what);
}

// ---- reductions --------------------------------------------------------------------------------------------------------

template <CommElement T, TestableCommunicator C>
void check_all_reduce(C& comm, std::size_t n, std::uint64_t seed, ReduceOp op, bool in_place, bool async) {
  const int p = comm.size(), me = comm.rank();
  const auto all = inputs_of_all<T>(p, n, seed);
  auto mine = all[std::size_t(me)];
  std::vector<T> out(n, sentinel<T>());
  std::span<T> target = in_place ? std::span<T>(mine) : std::span<T>(out);
  comm.reset_stats();
  if (async) comm.all_reduce_async(std::span<const T>(mine), target, op).wait();
  else comm.all_reduce(std::span<const T>(mine), target, op);
  const std::string what = label(comm, async ? "all_reduce_async" : "all_reduce", type_name<T>(), in_place) + " " +
                           std::string(name_of(op));
  check_reduced<T>(target, reduce_reference(all, op, 0, n), what);
  const std::uint64_t ring = 2 * (p - 1) * n * sizeof(T) / std::size_t(p);
  check_stats(comm, ring, ring, 1, what);
}

template <CommElement T, TestableCommunicator C>
void check_reduce_scatter(C& comm, std::size_t n, std::uint64_t seed, ReduceOp op, bool in_place, bool async) {
  const int p = comm.size(), me = comm.rank();
  const auto all = inputs_of_all<T>(p, n * std::size_t(p), seed);
  auto mine = all[std::size_t(me)];
  std::vector<T> out(n, sentinel<T>());
  std::span<T> target = in_place ? std::span<T>(mine.data() + std::size_t(me) * n, n) : std::span<T>(out);
  comm.reset_stats();
  if (async) comm.reduce_scatter_async(std::span<const T>(mine), target, op).wait();
  else comm.reduce_scatter(std::span<const T>(mine), target, op);
  const std::string what = label(comm, async ? "reduce_scatter_async" : "reduce_scatter", type_name<T>(), in_place) +
                           " " + std::string(name_of(op));
  check_reduced<T>(target, reduce_reference(all, op, std::size_t(me) * n, n), what);
  check_stats(comm, (p - 1) * n * sizeof(T), (p - 1) * n * sizeof(T), 1, what);
}

template <CommElement T, TestableCommunicator C>
void check_reduce_scatter_v(C& comm, std::uint64_t seed, ReduceOp op, bool in_place) {
  const int p = comm.size(), me = comm.rank();
  const auto counts = ragged_counts(p, seed, 1);
  const std::size_t total = offset_of(counts, p), at = offset_of(counts, me), n = std::size_t(counts[std::size_t(me)]);
  const auto all = inputs_of_all<T>(p, total, seed);
  auto mine = all[std::size_t(me)];
  std::vector<T> out(n, sentinel<T>());
  std::span<T> target = in_place ? std::span<T>(mine.data() + at, n) : std::span<T>(out);
  comm.reset_stats();
  comm.reduce_scatter_v(std::span<const T>(mine), target, std::span<const std::int64_t>(counts), op);
  const std::string what = label(comm, "reduce_scatter_v", type_name<T>(), in_place) + " " + std::string(name_of(op));
  check_reduced<T>(target, reduce_reference(all, op, at, n), what);
  check_stats(comm, (total - n) * sizeof(T), (p - 1) * n * sizeof(T), 1, what);
}

template <CommElement T, TestableCommunicator C>
void check_reduce(C& comm, std::size_t n, std::uint64_t seed, ReduceOp op, bool in_place, bool async) {
  const int p = comm.size(), me = comm.rank();
  const int root = int((seed + 1) % std::uint64_t(p));
  const auto all = inputs_of_all<T>(p, n, seed);
  auto mine = all[std::size_t(me)];
  std::vector<T> out(me == root ? n : 0, sentinel<T>());
  std::span<T> target = in_place && me == root ? std::span<T>(mine) : std::span<T>(out);
  comm.reset_stats();
  if (async) comm.reduce_async(std::span<const T>(mine), target, op, root).wait();
  else comm.reduce(std::span<const T>(mine), target, op, root);
  const std::string what = label(comm, async ? "reduce_async" : "reduce", type_name<T>(), in_place) + " " +
                           std::string(name_of(op)) + fmt::format(" (root {})", root);
  if (me == root) check_reduced<T>(target, reduce_reference(all, op, 0, n), what);
  else check_same<T>(mine, all[std::size_t(me)], what + " (a non-root input is untouched)");
  if (p > 1) check_stats(comm, me == root ? 0 : n * sizeof(T), me == root ? n * sizeof(T) : 0, 1, what);
}

// ---- point to point and ring shift ------------------------------------------------------------------------------------

// Each rank sends to the next and receives from the previous with explicit send/recv (async send first, since a
// blocking send may wait for its receive).
template <CommElement T, TestableCommunicator C>
void check_send_recv(C& comm, std::uint64_t seed) {
  const int p = comm.size(), me = comm.rank();
  const int next = (me + 1) % p, previous = (me + p - 1) % p;
  const auto mine = input_of<T>(me, 3 + std::size_t(me), seed);
  std::vector<T> got(3 + std::size_t(previous), sentinel<T>());
  comm.reset_stats();
  Request sent = comm.send_async(std::span<const T>(mine), next, 5);
  comm.recv(std::span<T>(got), previous, 5);
  sent.wait();
  const std::string what = label(comm, "send/recv", type_name<T>(), false);
  check_same<T>(got, input_of<T>(previous, got.size(), seed), what);
  check_stats(comm, mine.size() * sizeof(T), got.size() * sizeof(T), 2, what);
  // The other direction with blocking calls only (p even): even ranks send first, odd ranks receive first, so no
  // cycle of sends waits on itself even where a blocking send waits for its receive.
  if (p % 2 == 0) {
    std::vector<T> back(3 + std::size_t(next), sentinel<T>());
    if (me % 2 == 0) {
      comm.send(std::span<const T>(mine), previous, 6);
      comm.recv(std::span<T>(back), next, 6);
    } else {
      comm.recv_async(std::span<T>(back), next, 6).wait();
      comm.send(std::span<const T>(mine), previous, 6);
    }
    check_same<T>(back, input_of<T>(next, back.size(), seed), what + " (backwards)");
  }
}

// Rank r holds 2 + r elements (ragged): each rank receives its source's size.
template <CommElement T, TestableCommunicator C>
void check_shift(C& comm, std::uint64_t seed, int offset, bool in_place, bool async) {
  const int p = comm.size(), me = comm.rank();
  const int source = ((me - offset) % p + p) % p;
  auto size_of_rank = [&](int r) { return in_place ? std::size_t(9) : 2 + std::size_t(r); };
  auto mine = input_of<T>(me, size_of_rank(me), seed);
  std::vector<T> out(size_of_rank(source), sentinel<T>());
  std::span<T> target = in_place ? std::span<T>(mine) : std::span<T>(out);
  comm.reset_stats();
  if (async) comm.shift_async(std::span<const T>(mine), target, offset).wait();
  else comm.shift(std::span<const T>(mine), target, offset);
  const std::string what =
      label(comm, async ? "shift_async" : "shift", type_name<T>(), in_place) + fmt::format(" (offset {})", offset);
  check_same<T>(target, input_of<T>(source, size_of_rank(source), seed), what);
  check_stats(comm, size_of_rank(me) * sizeof(T), size_of_rank(source) * sizeof(T), 2, what);
}

// ---- everything, for one element type ----------------------------------------------------------------------------------

template <CommElement T, TestableCommunicator C>
void check_moves(C& comm, std::uint64_t seed) {
  for (std::size_t n : {std::size_t(0), std::size_t(5), std::size_t(1037)})
    for (bool in_place : {false, true})
      for (bool async : {false, true}) {
        check_all_gather<T>(comm, n, seed + n, in_place, async);
        check_all_to_all<T>(comm, n / 4, seed + n, in_place, async);
      }
  for (bool in_place : {false, true}) {
    check_all_gather_v<T>(comm, seed, in_place);
    check_all_to_all_v<T>(comm, seed, in_place);
  }
  for (bool async : {false, true}) check_broadcast<T>(comm, 333, seed, async);
  check_send_recv<T>(comm, seed);
  for (int offset : {1, -1, 2})
    for (bool in_place : {false, true})
      for (bool async : {false, true}) check_shift<T>(comm, seed, offset, in_place, async);
}

template <CommElement T, TestableCommunicator C>
void check_reductions(C& comm, std::uint64_t seed) {
  for (ReduceOp op : {ReduceOp::sum, ReduceOp::max, ReduceOp::avg})
    for (bool in_place : {false, true}) {
      for (bool async : {false, true}) {
        check_all_reduce<T>(comm, 1037, seed, op, in_place, async);
        check_reduce_scatter<T>(comm, 129, seed, op, in_place, async);
        check_reduce<T>(comm, 257, seed, op, in_place, async);
      }
      check_reduce_scatter_v<T>(comm, seed, op, in_place);
    }
  check_all_reduce<T>(comm, 0, seed, ReduceOp::sum, false, false);  // empty buffers are fine
}

// Every operation, every element type, in place and out of place, blocking and async.
template <TestableCommunicator C>
void check_every_operation(C& comm, std::uint64_t seed) {
  check_moves<float>(comm, seed);
  check_moves<double>(comm, seed);
  check_moves<bf16>(comm, seed);
  check_moves<std::int32_t>(comm, seed);
  check_moves<std::int64_t>(comm, seed);
  check_moves<std::byte>(comm, seed);
  check_reductions<float>(comm, seed);
  check_reductions<double>(comm, seed);
  check_reductions<bf16>(comm, seed);
  check_reductions<std::int32_t>(comm, seed);
  check_reductions<std::int64_t>(comm, seed);
  comm.barrier();
}

// Posting several operations, computing, then waiting (in reverse order) gives the same results as blocking calls.
template <TestableCommunicator C>
void check_overlap(C& comm, std::uint64_t seed) {
  const int p = comm.size(), me = comm.rank();
  const std::size_t n = 4096;
  const auto all = inputs_of_all<float>(p, n, seed);
  auto reduced = all[std::size_t(me)];
  std::vector<float> gathered(n * std::size_t(p));
  Request a = comm.all_reduce_async(std::span<const float>(reduced), std::span<float>(reduced), ReduceOp::sum);
  Request b = comm.all_gather_async(std::span<const float>(all[std::size_t(me)]), std::span<float>(gathered));
  // Compute while the operations are pending (the send buffers stay untouched).
  double local = 0;
  for (int repeat = 0; repeat < 50; ++repeat)
    for (float x : all[std::size_t(me)]) local += double(x) * double(x);
  CHECK(local > 0);
  CHECK(a.pending());
  // A blocking collective between post and wait, then the waits out of order.
  std::vector<std::int64_t> one{std::int64_t(me)}, total(1);
  comm.all_reduce(std::span<const std::int64_t>(one), std::span<std::int64_t>(total), ReduceOp::sum);
  CHECK(total[0] == std::int64_t(p) * (p - 1) / 2);
  b.wait();
  a.wait();
  CHECK_FALSE(a.pending());
  a.wait();  // idempotent
  check_reduced<float>(reduced, reduce_reference(all, ReduceOp::sum, 0, n), "all_reduce_async overlapped");
  std::vector<float> want;
  for (const auto& x : all) want.insert(want.end(), x.begin(), x.end());
  check_same<float>(gathered, want, "all_gather_async overlapped");
}

// split(color, key): members ordered by key then rank; the new group works on its own.
template <TestableCommunicator C>
void check_split(C& comm, std::uint64_t seed) {
  const int p = comm.size(), me = comm.rank();
  // Two colors of uneven sizes (rank 0 alone, the rest together), keys reversing the order.
  const int color = me == 0 ? 0 : 1;
  C part = comm.split(color, p - me);
  std::vector<int> members;
  for (int r = 0; r < p; ++r)
    if ((r == 0 ? 0 : 1) == color) members.push_back(r);
  std::reverse(members.begin(), members.end());  // larger keys last: descending rank
  CHECK(part.size() == int(members.size()));
  CHECK(members[std::size_t(part.rank())] == me);
  // Sum of the parent ranks in each part.
  std::vector<std::int64_t> mine{std::int64_t(me)}, sum(1);
  part.all_reduce(std::span<const std::int64_t>(mine), std::span<std::int64_t>(sum), ReduceOp::sum);
  CHECK(sum[0] == std::accumulate(members.begin(), members.end(), std::int64_t(0)));
  check_all_gather<float>(part, 17, seed, false, false);
  check_all_reduce<float>(part, 17, seed, ReduceOp::sum, true, false);
  check_shift<std::int32_t>(part, seed, 1, false, false);
  // The parent still works after the split.
  check_all_reduce<double>(comm, 33, seed, ReduceOp::max, false, false);
}

}  // namespace paradyse::testing
