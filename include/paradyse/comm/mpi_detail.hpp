// paradyse/comm/mpi_detail.hpp: the pieces of the MPI communicator (mpi.hpp): each communicator's state, staging
// buffers, reductions through float for bf16, int counts, and the optional cross-rank validation of collectives.
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/comm/mpi_shm.hpp"
#include "paradyse/comm/mpi_types.hpp"
#include "paradyse/comm/mpi_watchdog.hpp"
#include "paradyse/core/dtype.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/core/memory.hpp"

#include "paradyse/comm/mpi_h.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace paradyse::mpi_detail {

// A tracked buffer for staging (in-place forms MPI cannot express); not zero-filled.
template <class T>
class Scratch {
public:
  explicit Scratch(std::size_t count)
      : tracker_(MemoryTracker::current().handle()), count_(count),
        data_(static_cast<T*>(tracker_.allocate(count * sizeof(T), Contents::unspecified))) {}
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() { tracker_.deallocate(data_, count_ * sizeof(T)); }
  std::span<T> span() const noexcept { return {data_, count_}; }

private:
  MemoryTracker::Handle tracker_;
  std::size_t count_;
  T* data_;
};

// The buffers an MPI reduction runs on, and how its result reaches `out`. bf16 is reduced in float: its input is
// widened into `wide` (the result lands there too when MPI reduces in place, else in `wide_out`) and narrowed once
// at the end. Other types use their own buffers, with `staged` holding a result that MPI cannot put in place.
template <CommElement T>
struct Reduction {
  const void* send = nullptr;  // or MPI_IN_PLACE
  void* recv = nullptr;
  std::shared_ptr<Scratch<float>> wide, wide_out;
  std::shared_ptr<Scratch<T>> staged;

  // in: the input; result: where T's result goes (out, or a staging buffer); result_count: its elements;
  // mpi_in_place: MPI reads the input from and writes the result to the same buffer; receives: this rank gets one.
  static Reduction prepare(std::span<const T> in, T* result, std::size_t result_count, bool mpi_in_place,
                           bool receives) {
    Reduction r;
    if constexpr (std::is_same_v<T, bf16>) {
      r.wide = std::make_shared<Scratch<float>>(in.size());
      float* w = r.wide->span().data();
      for (std::size_t i = 0; i < in.size(); ++i) w[i] = float(in[i]);
      if (mpi_in_place) {
        r.send = MPI_IN_PLACE;
        r.recv = w;
      } else {
        r.send = w;
        if (receives) {
          r.wide_out = std::make_shared<Scratch<float>>(result_count);
          r.recv = r.wide_out->span().data();
        }
      }
    } else {
      r.send = mpi_in_place ? MPI_IN_PLACE : static_cast<const void*>(in.data());
      r.recv = receives ? result : nullptr;
    }
    return r;
  }

  // Completes the result in `out` (on a receiving rank): narrows bf16, copies a staged result, divides for avg.
  void finish(std::span<T> out, ReduceOp op, int ranks) const {
    if constexpr (std::is_same_v<T, bf16>) {
      const float* w = (wide_out ? wide_out : wide)->span().data();
      for (std::size_t i = 0; i < out.size(); ++i)
        out[i] = bf16(op == ReduceOp::avg ? w[i] / float(ranks) : w[i]);
    } else {
      if (staged && !out.empty()) std::memcpy(out.data(), staged->span().data(), out.size_bytes());
      if (op == ReduceOp::avg)
        for (T& v : out) v = T(v / T(ranks));  // integers truncate, as in C++ (and the threads backend)
    }
  }
};

template <class A, class B>
bool overlaps(std::span<A> a, std::span<B> b) {
  if (a.empty() || b.empty()) return false;
  const auto a0 = reinterpret_cast<std::uintptr_t>(a.data()), b0 = reinterpret_cast<std::uintptr_t>(b.data());
  return a0 < b0 + b.size_bytes() && b0 < a0 + a.size_bytes();
}

// Per-rank counts as MPI ints, with displacements; all of them must fit an int.
struct IntCounts {
  std::vector<int> counts, displacements;
  std::size_t total = 0;
};
inline IntCounts int_counts(std::span<const std::int64_t> counts, int size, std::string_view op, std::string_view what) {
  check(counts.size() == std::size_t(size), "{}: {} {} given, expected one per rank ({})", op, counts.size(), what,
        size);
  IntCounts out;
  for (std::size_t r = 0; r < counts.size(); ++r) {
    check(counts[r] >= 0, "{}: {}[{}] = {} must be non-negative", op, what, r, counts[r]);
    out.displacements.push_back(to_int_count(out.total, op, "a displacement"));
    out.counts.push_back(to_int_count(counts[r], op, what));
    out.total += std::size_t(counts[r]);
  }
  return out;
}

// FNV-1a over a list of counts: equal lists give equal signatures on every rank.
inline std::uint64_t fingerprint(std::span<const std::int64_t> counts) {
  std::uint64_t h = 1469598103934665603ull;
  for (std::int64_t c : counts)
    for (int b = 0; b < 8; ++b) h = (h ^ ((std::uint64_t(c) >> (8 * b)) & 0xffu)) * 1099511628211ull;
  return h;
}

// What one rank passed to a collective, exchanged when validation is on.
struct Signature {
  std::int64_t kind = 0;     // index into kOpNames
  std::int64_t dtype = 0;
  std::int64_t op = 0;
  std::int64_t root = 0;
  std::uint64_t count = 0;   // elements (or a fingerprint of the counts of a _v form)
};
inline constexpr const char* kOpNames[] = {"all_gather",   "all_gather_v", "reduce_scatter", "reduce_scatter_v",
                                           "all_reduce",   "all_to_all",   "all_to_all_v",   "broadcast",
                                           "reduce",       "barrier",      "split",          "shift"};
inline int op_index(const char* name) {
  for (int i = 0; i < int(std::size(kOpNames)); ++i)
    if (std::string_view(kOpNames[i]) == name) return i;
  return -1;
}

// The state of one communicator; at a stable address, so requests and the watchdog can point to it.
struct CommState {
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0, size = 1;
  std::vector<int> world_ranks;  // rank r of this communicator is world rank world_ranks[r]
  std::string description;
  std::unique_ptr<ArrivalBoard> board;
  std::uint64_t sequence = 0;    // collectives entered so far
  std::chrono::milliseconds timeout = comm_timeout();
  bool validate = false;
  CommStats stats;
  // The large collectives through shared memory (mpi_shm.hpp): the window (made at the first collective that could
  // use it), the engine setting, and per collective the measured size from which shared memory is faster.
  std::unique_ptr<SharedWindow> shared;
  bool shared_tried = false;
  std::uint8_t engine = 2;  // MpiCollectiveEngine: 0 mpi, 1 shared_memory, 2 automatic
  std::optional<std::array<std::int64_t, 3>> crossover_bytes;

  // Takes ownership of `owned`; collective over it.
  explicit CommState(MPI_Comm owned) : comm(owned) {
    MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm, &rank);
    MPI_Comm_size(comm, &size);
    MPI_Group group = MPI_GROUP_NULL, world_group = MPI_GROUP_NULL;
    MPI_Comm_group(comm, &group);
    MPI_Comm_group(MPI_COMM_WORLD, &world_group);
    std::vector<int> ranks(static_cast<std::size_t>(size));
    for (int r = 0; r < size; ++r) ranks[std::size_t(r)] = r;
    world_ranks.resize(std::size_t(size));
    MPI_Group_translate_ranks(group, size, ranks.data(), world_group, world_ranks.data());
    MPI_Group_free(&group);
    MPI_Group_free(&world_group);
    description = fmt::format("MPI group of {} (world ranks {})", size, fmt::join(world_ranks, ", "));
    board = std::make_unique<ArrivalBoard>(comm, world_ranks, rank);
    if (const char* v = std::getenv("PARADYSE_COMM_VALIDATE")) validate = std::string_view(v) == "1";
    if (const char* v = std::getenv("PARADYSE_MPI_COLLECTIVES")) {
      const std::string_view e(v);
      check(e == "mpi" || e == "shm" || e == "auto", "PARADYSE_MPI_COLLECTIVES = \"{}\": expected mpi, shm or auto", e);
      engine = e == "mpi" ? 0 : e == "shm" ? 1 : 2;
    }
  }
  CommState(const CommState&) = delete;
  CommState& operator=(const CommState&) = delete;
  ~CommState() {
    shared.reset();
    board.reset();
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized && comm != MPI_COMM_NULL) MPI_Comm_free(&comm);  // local in OpenMPI: safe while unwinding
  }

  [[noreturn]] void fail(int rc, std::string_view op) const {
    throw CommError(fmt::format("{} on {} failed on rank {}: {}", op, description, rank, error_text(rc)));
  }
  void check_rc(int rc, std::string_view op) const {
    if (rc != MPI_SUCCESS) [[unlikely]] fail(rc, op);
  }
};

// The watchdog's report of a stalled wait (called at expiry only).
inline std::string describe_wait(const void* context, const char* op, std::uint64_t sequence, int peer) {
  const auto& state = *static_cast<const CommState*>(context);
  if (peer >= 0)
    return fmt::format("{} with rank {} (world rank {}) on {}: the peer never matched it", op, peer,
                       state.world_ranks[std::size_t(peer)], state.description);
  return fmt::format("{} (collective #{}) on {}: {}", op, sequence, state.description,
                     state.board ? state.board->describe_missing(sequence, state.world_ranks) : std::string("?"));
}


// A received message has exactly `expected` elements; otherwise Error naming both sizes.
template <CommElement T>
void check_received(const mpi_detail::CommState* state, int rc, const MPI_Status& status,
                           std::size_t expected, int source, const char* op) {
  int error_class = MPI_SUCCESS;
  if (rc != MPI_SUCCESS) MPI_Error_class(rc, &error_class);
  if (error_class == MPI_ERR_TRUNCATE)
    throw Error(fmt::format("{}: rank {} sent more than the {} elements rank {} expected (on {})", op, source,
                            expected, state->rank, state->description));
  state->check_rc(rc, op);
  int received = 0;
  MPI_Get_count(&status, datatype<T>(), &received);
  if (std::size_t(received) != expected)
    throw Error(fmt::format("{}: rank {} sent {} elements to rank {}, which expected {} (on {})", op, source,
                            received, state->rank, expected, state->description));
}

// Every rank passed the same signature to the collective `op`; otherwise Error on every rank (all of them see
// every signature, so all throw the same message). Collective over state.comm.
inline void validate_signature(const CommState& state, const char* op, Signature mine) {
  mine.kind = op_index(op);
  std::vector<Signature> all(static_cast<std::size_t>(state.size));
  state.check_rc(MPI_Allgather(&mine, sizeof mine, MPI_BYTE, all.data(), sizeof mine, MPI_BYTE, state.comm),
                 "validate");
  const auto name = [](std::int64_t kind) { return kind >= 0 ? kOpNames[kind] : "?"; };
  const auto amount = [op](std::uint64_t count) {
    return std::string_view(op).ends_with("_v") ? std::string("different counts") : fmt::format("{} elements", count);
  };
  const auto& first = all[0];
  for (int r = 1; r < state.size; ++r) {
    const auto& other = all[std::size_t(r)];
    check(other.kind == first.kind, "rank {} called {} where rank 0 called {} (collective #{} on {})", r,
          name(other.kind), name(first.kind), state.sequence + 1, state.description);
    check(other.dtype == first.dtype, "{}: rank {} moves {} where rank 0 moves {} (on {})", op, r,
          name_of(DType(other.dtype)), name_of(DType(first.dtype)), state.description);
    check(other.op == first.op, "{}: rank {} reduces with {} where rank 0 uses {} (on {})", op, r,
          name_of(ReduceOp(other.op)), name_of(ReduceOp(first.op)), state.description);
    check(other.root == first.root, "{}: rank {} names root {} where rank 0 names root {} (on {})", op, r, other.root,
          first.root, state.description);
    check(other.count == first.count, "{}: rank {} passes {} where rank 0 passes {} (on {})", op, r,
          amount(other.count), amount(first.count), state.description);
  }
}

// What each rank sends to each other rank in an all_to_all_v matches what that rank expects; otherwise Error on
// every rank. Collective over state.comm.
inline void validate_exchange(const CommState& state, std::span<const std::int64_t> send_counts,
                              std::span<const std::int64_t> recv_counts) {
  const int n = state.size;
  std::vector<std::int64_t> announced(static_cast<std::size_t>(n));  // announced[r]: what rank r sends to this rank
  state.check_rc(MPI_Alltoall(send_counts.data(), 1, MPI_INT64_T, announced.data(), 1, MPI_INT64_T, state.comm),
                 "validate");
  std::array<std::int64_t, 4> mine{-1, -1, -1, -1};  // (sender, receiver, sent, expected) of the first mismatch
  for (int r = 0; r < n; ++r)
    if (announced[std::size_t(r)] != recv_counts[std::size_t(r)]) {
      mine = {r, state.rank, announced[std::size_t(r)], recv_counts[std::size_t(r)]};
      break;
    }
  std::vector<std::int64_t> all(static_cast<std::size_t>(4 * n));
  state.check_rc(MPI_Allgather(mine.data(), 4, MPI_INT64_T, all.data(), 4, MPI_INT64_T, state.comm), "validate");
  for (int r = 0; r < n; ++r)
    check(all[std::size_t(4 * r)] < 0, "all_to_all_v: rank {} sends {} elements to rank {}, which expects {} (on {})",
          all[std::size_t(4 * r)], all[std::size_t(4 * r + 2)], all[std::size_t(4 * r + 1)], all[std::size_t(4 * r + 3)],
          state.description);
}

}  // namespace paradyse::mpi_detail
