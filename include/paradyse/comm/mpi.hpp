// paradyse/comm/mpi.hpp: the MPI backend. One process per rank (OpenMPI); groups are communicator splits.
//
//   int main(int argc, char** argv) {
//     paradyse::MpiSession session(&argc, &argv);
//     paradyse::run_mpi([](paradyse::MpiCommunicator& comm) { ... comm.all_reduce(x, x, ReduceOp::sum); ... });
//   }
//
// The same Communicator concept and semantics as the threads backend (see communicator.hpp and threads.hpp):
// chunk r belongs to rank r; in place means the same span for all_reduce, all_to_all(_v) and shift, this rank's
// chunk of the output as the input of all_gather(_v), this rank's chunk of the input as the output of
// reduce_scatter(_v), and the same span on the root of reduce. avg is a sum divided by the group size on the
// receiving rank; bf16 is reduced in float and rounded once (mpi_detail.hpp), like the threads backend; raw bytes
// are not reduced (a compile-time error). stats() counts bytes by threads.hpp's rule (ring volumes), so both
// backends report the same numbers for the same program. Operations are the blocking MPI collectives, except that
// all_gather(_v), reduce_scatter(_v) and all_reduce go through a shared-memory window when all ranks share a node
// and a measured crossover says it is faster (mpi_shm.hpp; set_collective_engine); those reduce in rank order, bitwise
// like the threads backend. The async forms are the MPI-3 non-blocking ones (MPI_Iallgather, ...), completed by
// Request::wait().
//
// Differences from the threads backend, because MPI cannot do better:
// - Failure of one rank: run_mpi catches the exception, prints "MPI world rank R failed: ..." and calls MPI_Abort,
//   so mpirun ends every rank at once (they do not throw CommError; they are terminated).
// - Timeouts: a blocking MPI call cannot be interrupted, so when a wait passes PARADYSE_COMM_TIMEOUT (or
//   set_timeout) the watchdog thread prints the operation, the group and the ranks that never arrived, then aborts
//   the job with exit code 124 (mpi_watchdog.hpp).
// - Mismatched sizes between ranks are undefined behaviour in MPI (truncation errors or hangs that end in the
//   timeout). set_validate(true) on every rank (or PARADYSE_COMM_VALIDATE=1) exchanges each collective's
//   signature first and throws Error on every rank naming the mismatch, at the cost of one small all-gather per call.
// - Message sizes are ints in MPI: larger counts throw Error saying so.
// - Destroy communicators and wait for requests before MPI_Finalize (MpiSession's destructor). Requests hold a
//   pointer to their communicator's state: wait before destroying the communicator.
//
// The parts: mpi_core.hpp (MpiCore, the base: handle state, waits, requests, engine choice), mpi_session.hpp
// (MpiSession, abort_mpi_job), mpi_detail.hpp, mpi_types.hpp, mpi_shm.hpp, mpi_watchdog.hpp. This header: the
// communicator's operations and run_mpi.
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/comm/mpi_core.hpp"
#include "paradyse/comm/mpi_detail.hpp"
#include "paradyse/comm/mpi_session.hpp"
#include "paradyse/comm/mpi_types.hpp"
#include "paradyse/comm/mpi_watchdog.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/core/memory.hpp"

#include "paradyse/comm/mpi_h.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace paradyse {

// One rank's handle on an MPI communicator. Move-only; owns (and frees) its MPI_Comm.
class MpiCommunicator : public mpi_detail::MpiCore {
  // An input span whose element type is deduced from the output span, so that a mutable span converts.
  template <class T>
  using In = std::type_identity_t<std::span<const T>>;
  struct Adopt {};

public:
  // A duplicate of `comm` (its own message space and error handler); collective over `comm`.
  explicit MpiCommunicator(MPI_Comm comm) : MpiCommunicator(duplicate(comm), Adopt{}) {}
  // All the processes of the job; collective over MPI_COMM_WORLD. The first call also creates the arrival boards.
  static MpiCommunicator world() {
    require_initialized();
    mpi_detail::ArrivalBoards::instance().create();
    return MpiCommunicator(MPI_COMM_WORLD);
  }
  MpiCommunicator(MpiCommunicator&&) noexcept = default;
  MpiCommunicator& operator=(MpiCommunicator&&) noexcept = default;

  // ---- collectives -----------------------------------------------------------------------------------------------
  // out: [size * in.size()]; in may be this rank's chunk of out (in place).
  template <CommElement T> void all_gather(In<T> in, std::span<T> out) { all_gather_impl<false>(in, out); }
  template <CommElement T> Request all_gather_async(In<T> in, std::span<T> out) { return all_gather_impl<true>(in, out); }
  // out: [sum(counts)], counts[r] elements from rank r; in.size() == counts[rank()].
  template <CommElement T> void all_gather_v(In<T> in, std::span<T> out, std::span<const std::int64_t> counts) {
    all_gather_v_impl<false>(in, out, counts);
  }
  template <CommElement T>
  Request all_gather_v_async(In<T> in, std::span<T> out, std::span<const std::int64_t> counts) {
    return all_gather_v_impl<true>(in, out, counts);
  }
  // in: [size * out.size()]; rank r receives the reduction of chunk r.
  template <CommElement T> void reduce_scatter(In<T> in, std::span<T> out, ReduceOp op) {
    reduce_scatter_impl<false>(in, out, op);
  }
  template <CommElement T> Request reduce_scatter_async(In<T> in, std::span<T> out, ReduceOp op) {
    return reduce_scatter_impl<true>(in, out, op);
  }
  // in: [sum(counts)]; rank r receives the reduction of its counts[r] elements.
  template <CommElement T>
  void reduce_scatter_v(In<T> in, std::span<T> out, std::span<const std::int64_t> counts, ReduceOp op) {
    reduce_scatter_v_impl<false>(in, out, counts, op);
  }
  template <CommElement T>
  Request reduce_scatter_v_async(In<T> in, std::span<T> out, std::span<const std::int64_t> counts, ReduceOp op) {
    return reduce_scatter_v_impl<true>(in, out, counts, op);
  }
  template <CommElement T> void all_reduce(In<T> in, std::span<T> out, ReduceOp op) {
    all_reduce_impl<false>(in, out, op);
  }
  template <CommElement T> Request all_reduce_async(In<T> in, std::span<T> out, ReduceOp op) {
    return all_reduce_impl<true>(in, out, op);
  }
  // Equal chunks: chunk j of in goes to rank j; chunk j of out comes from rank j.
  template <CommElement T> void all_to_all(In<T> in, std::span<T> out) { all_to_all_impl<false>(in, out); }
  template <CommElement T> Request all_to_all_async(In<T> in, std::span<T> out) { return all_to_all_impl<true>(in, out); }
  // send_counts[j] elements to rank j (in rank order in `in`), recv_counts[j] from rank j.
  template <CommElement T>
  void all_to_all_v(In<T> in, std::span<const std::int64_t> send_counts, std::span<T> out,
                    std::span<const std::int64_t> recv_counts) {
    all_to_all_v_impl<false>(in, send_counts, out, recv_counts);
  }
  template <CommElement T>
  Request all_to_all_v_async(In<T> in, std::span<const std::int64_t> send_counts, std::span<T> out,
                             std::span<const std::int64_t> recv_counts) {
    return all_to_all_v_impl<true>(in, send_counts, out, recv_counts);
  }
  template <CommElement T> void broadcast(std::span<T> buffer, int root) { broadcast_impl<false>(buffer, root); }
  template <CommElement T> Request broadcast_async(std::span<T> buffer, int root) {
    return broadcast_impl<true>(buffer, root);
  }
  // The reduction lands in `out` on the root; other ranks may pass an empty `out`.
  template <CommElement T> void reduce(In<T> in, std::span<T> out, ReduceOp op, int root) {
    reduce_impl<false>(in, out, op, root);
  }
  template <CommElement T> Request reduce_async(In<T> in, std::span<T> out, ReduceOp op, int root) {
    return reduce_impl<true>(in, out, op, root);
  }
  void barrier() { barrier_impl<false>(); }
  Request barrier_async() { return barrier_impl<true>(); }

  // The ranks of one color (>= 0) form a new communicator, ordered by key and then by rank. Collective.
  MpiCommunicator split(int color, int key) {
    check(color >= 0, "split: color {} must be non-negative", color);
    validate("split", {});
    MPI_Comm part = MPI_COMM_NULL;
    const std::uint64_t sequence = enter();
    {
      auto watch = watch_wait("split", sequence);
      state_->check_rc(MPI_Comm_split(state_->comm, color, key, &part), "split");
    }
    MpiCommunicator result(part, Adopt{});
    result.state_->timeout = state_->timeout;
    result.state_->validate = state_->validate;
    return result;
  }

  // ---- point to point --------------------------------------------------------------------------------------------
  template <CommElement T> void send(std::span<const T> in, int dest, int tag = 0) {
    check_peer("send", dest);
    check_tag("send", tag);
    count_bytes(in.size_bytes(), 0);
    auto watch = watch_wait("send", state_->sequence, dest);
    state_->check_rc(MPI_Send(in.data(), count_of(in.size(), "send"), mpi_detail::datatype<T>(), dest, tag,
                              state_->comm),
                     "send");
  }
  template <CommElement T> void send(std::span<T> in, int dest, int tag = 0) { send(std::span<const T>(in), dest, tag); }
  template <CommElement T> Request send_async(std::span<const T> in, int dest, int tag = 0) {
    check_peer("send", dest);
    check_tag("send", tag);
    count_bytes(in.size_bytes(), 0);
    MPI_Request request = MPI_REQUEST_NULL;
    state_->check_rc(MPI_Isend(in.data(), count_of(in.size(), "send"), mpi_detail::datatype<T>(), dest, tag,
                               state_->comm, &request),
                     "send");
    return pending("send", state_->sequence, dest, {request, MPI_REQUEST_NULL}, false, [](const MPI_Status*) {});
  }
  template <CommElement T> Request send_async(std::span<T> in, int dest, int tag = 0) {
    return send_async(std::span<const T>(in), dest, tag);
  }
  // out.size() elements from `source`; a message of another size is an Error naming both sizes.
  template <CommElement T> void recv(std::span<T> out, int source, int tag = 0) {
    check_peer("recv", source);
    check_tag("recv", tag);
    count_bytes(0, out.size_bytes());
    MPI_Status status;
    int rc = MPI_SUCCESS;
    {
      auto watch = watch_wait("recv", state_->sequence, source);
      rc = MPI_Recv(out.data(), count_of(out.size(), "recv"), mpi_detail::datatype<T>(), source, tag, state_->comm,
                    &status);
    }
    check_received<T>(rc, status, out.size(), source, "recv");
  }
  template <CommElement T> Request recv_async(std::span<T> out, int source, int tag = 0) {
    check_peer("recv", source);
    check_tag("recv", tag);
    count_bytes(0, out.size_bytes());
    MPI_Request request = MPI_REQUEST_NULL;
    state_->check_rc(MPI_Irecv(out.data(), count_of(out.size(), "recv"), mpi_detail::datatype<T>(), source, tag,
                               state_->comm, &request),
                     "recv");
    auto* state = state_.get();
    return pending("recv", state_->sequence, source, {request, MPI_REQUEST_NULL}, true,
                   [state, expected = out.size(), source](const MPI_Status* status) {
                     mpi_detail::check_received<T>(state, status[0].MPI_ERROR, status[0], expected, source, "recv");
                   });
  }
  // Sends `in` to rank + offset and receives `out` from rank - offset (mod size): one step of a ring. Every rank
  // calls it (it counts as a collective for the timeout report); in and out may differ in size between ranks.
  template <CommElement T> void shift(In<T> in, std::span<T> out, int offset = 1) {
    const auto [dest, source] = ring_peers(offset);
    const bool in_place = in.data() == out.data() && !in.empty();
    check(in_place ? in.size() == out.size() : !mpi_detail::overlaps(in, out),
          "shift: the input ({} elements) and output ({} elements) overlap without being the same span", in.size(),
          out.size());
    count_bytes(in.size_bytes(), 0);
    count_bytes(0, out.size_bytes());
    const auto type = mpi_detail::datatype<T>();
    const std::uint64_t sequence = enter();
    MPI_Status status;
    int rc = MPI_SUCCESS;
    {
      auto watch = watch_wait("shift", sequence);
      if (in_place)
        rc = MPI_Sendrecv_replace(out.data(), count_of(out.size(), "shift"), type, dest, kShiftTag, source, kShiftTag,
                                  state_->comm, &status);
      else
        rc = MPI_Sendrecv(in.data(), count_of(in.size(), "shift"), type, dest, kShiftTag, out.data(),
                          count_of(out.size(), "shift"), type, source, kShiftTag, state_->comm, &status);
    }
    check_received<T>(rc, status, out.size(), source, "shift");
  }
  template <CommElement T> Request shift_async(In<T> in, std::span<T> out, int offset = 1) {
    const auto [dest, source] = ring_peers(offset);
    const bool aliased = mpi_detail::overlaps(in, out);
    check(!aliased || (in.data() == out.data() && in.size() == out.size()),
          "shift: the input ({} elements) and output ({} elements) overlap without being the same span", in.size(),
          out.size());
    count_bytes(in.size_bytes(), 0);
    count_bytes(0, out.size_bytes());
    std::shared_ptr<mpi_detail::Scratch<T>> staged;
    if (aliased) {  // a send and a receive may not share a buffer: send a copy
      staged = std::make_shared<mpi_detail::Scratch<T>>(in.size());
      std::memcpy(staged->span().data(), in.data(), in.size_bytes());
      in = staged->span();
    }
    const auto type = mpi_detail::datatype<T>();
    const std::uint64_t sequence = enter();
    std::array<MPI_Request, 2> requests{MPI_REQUEST_NULL, MPI_REQUEST_NULL};
    state_->check_rc(MPI_Irecv(out.data(), count_of(out.size(), "shift"), type, source, kShiftTag, state_->comm,
                               &requests[0]),
                     "shift");
    state_->check_rc(MPI_Isend(in.data(), count_of(in.size(), "shift"), type, dest, kShiftTag, state_->comm,
                               &requests[1]),
                     "shift");
    auto* state = state_.get();
    return pending("shift", sequence, -1, requests, true,
                   [state, staged, expected = out.size(), source](const MPI_Status* status) {
                     mpi_detail::check_received<T>(state, status[0].MPI_ERROR, status[0], expected, source, "shift");
                   });
  }

private:
  static constexpr int kShiftTag = kMaxUserTag + 1;

  MpiCommunicator(MPI_Comm owned, Adopt) : MpiCore(owned) {}

  // ---- the collectives, blocking (Async = false) or not ------------------------------------------------------------
  template <bool Async, CommElement T>
  Request all_gather_impl(std::span<const T> in, std::span<T> out) {
    const int n = size();
    check(out.size() == in.size() * std::size_t(n),
          "all_gather: output holds {} elements, expected {} ({} ranks x {} per rank)", out.size(),
          in.size() * std::size_t(n), n, in.size());
    const bool in_place = !in.empty() && in.data() == out.data() + std::size_t(rank()) * in.size();
    check(in_place || !mpi_detail::overlaps(in, out),
          "all_gather: the input overlaps the output without being this rank's chunk of it");
    const int count = count_of(in.size(), "all_gather");
    validate("all_gather", signature<T>(in.size()));
    count_bytes((n - 1) * in.size_bytes(), (n - 1) * in.size_bytes());
    if constexpr (!Async) {
      if (use_shared(kSharedAllGather, out.size_bytes())) {
        shared_all_gather<T>("all_gather", in, out, std::vector<std::size_t>(std::size_t(n), in.size()));
        return {};
      }
    }
    const void* send = in_place ? MPI_IN_PLACE : in.data();
    const auto type = mpi_detail::datatype<T>();
    MPI_Comm comm = state_->comm;
    return collective<Async>("all_gather", [=](MPI_Request* r) {
      return r ? MPI_Iallgather(send, count, type, out.data(), count, type, comm, r)
               : MPI_Allgather(send, count, type, out.data(), count, type, comm);
    }, kNothing);
  }

  template <bool Async, CommElement T>
  Request all_gather_v_impl(std::span<const T> in, std::span<T> out, std::span<const std::int64_t> counts) {
    auto c = std::make_shared<mpi_detail::IntCounts>(mpi_detail::int_counts(counts, size(), "all_gather_v", "counts"));
    check(in.size() == std::size_t(counts[std::size_t(rank())]),
          "all_gather_v: rank {} sends {} elements but counts[{}] = {}", rank(), in.size(), rank(),
          counts[std::size_t(rank())]);
    check(out.size() == c->total, "all_gather_v: output holds {} elements, expected sum(counts) = {}", out.size(),
          c->total);
    const bool in_place = !in.empty() && in.data() == out.data() + c->displacements[std::size_t(rank())];
    check(in_place || !mpi_detail::overlaps(in, out),
          "all_gather_v: the input overlaps the output without being this rank's chunk of it");
    validate("all_gather_v", signature<T>(mpi_detail::fingerprint(counts)));
    count_bytes((size() - 1) * in.size_bytes(), (out.size() - in.size()) * sizeof(T));
    if constexpr (!Async) {
      if (use_shared(kSharedAllGather, out.size_bytes())) {
        shared_all_gather<T>("all_gather_v", in, out, to_sizes(counts));
        return {};
      }
    }
    const void* send = in_place ? MPI_IN_PLACE : in.data();
    const int count = int(in.size());
    const auto type = mpi_detail::datatype<T>();
    MPI_Comm comm = state_->comm;
    return collective<Async>("all_gather_v", [=](MPI_Request* r) {
      return r ? MPI_Iallgatherv(send, count, type, out.data(), c->counts.data(), c->displacements.data(), type, comm, r)
               : MPI_Allgatherv(send, count, type, out.data(), c->counts.data(), c->displacements.data(), type, comm);
    }, [c] {});  // the count arrays live until completion
  }

  template <bool Async, CommElement T>
  Request reduce_scatter_impl(std::span<const T> in, std::span<T> out, ReduceOp op) {
    check_reducible<T>();
    const int n = size();
    check(in.size() == out.size() * std::size_t(n),
          "reduce_scatter: input holds {} elements, expected {} ({} ranks x {} per rank)", in.size(),
          out.size() * std::size_t(n), n, out.size());
    const bool in_place = !out.empty() && out.data() == in.data() + std::size_t(rank()) * out.size();
    check(in_place || !mpi_detail::overlaps(in, out),
          "reduce_scatter: the output overlaps the input without being this rank's chunk of it");
    const int count = count_of(out.size(), "reduce_scatter");
    validate("reduce_scatter", signature<T>(out.size(), op));
    count_bytes((n - 1) * out.size_bytes(), (n - 1) * out.size_bytes());
    if constexpr (!Async) {
      if (use_shared(kSharedReduceScatter, in.size_bytes())) {
        shared_reduce_scatter<T>("reduce_scatter", in, out, std::vector<std::size_t>(std::size_t(n), out.size()), op);
        return {};
      }
    }
    return reduce_scatter_common<Async>("reduce_scatter", in, out, in_place, op, [=](const void* send, void* recv,
                                                                                    MPI_Datatype type, MPI_Op mpi_op,
                                                                                    MPI_Comm comm, MPI_Request* r) {
      return r ? MPI_Ireduce_scatter_block(send, recv, count, type, mpi_op, comm, r)
               : MPI_Reduce_scatter_block(send, recv, count, type, mpi_op, comm);
    }, nullptr);
  }

  template <bool Async, CommElement T>
  Request reduce_scatter_v_impl(std::span<const T> in, std::span<T> out, std::span<const std::int64_t> counts,
                                ReduceOp op) {
    check_reducible<T>();
    auto c = std::make_shared<mpi_detail::IntCounts>(
        mpi_detail::int_counts(counts, size(), "reduce_scatter_v", "counts"));
    check(in.size() == c->total, "reduce_scatter_v: input holds {} elements, expected sum(counts) = {}", in.size(),
          c->total);
    check(out.size() == std::size_t(counts[std::size_t(rank())]),
          "reduce_scatter_v: rank {} receives into {} elements but counts[{}] = {}", rank(), out.size(), rank(),
          counts[std::size_t(rank())]);
    const bool in_place = !out.empty() && out.data() == in.data() + c->displacements[std::size_t(rank())];
    check(in_place || !mpi_detail::overlaps(in, out),
          "reduce_scatter_v: the output overlaps the input without being this rank's chunk of it");
    validate("reduce_scatter_v", signature<T>(mpi_detail::fingerprint(counts), op));
    count_bytes((in.size() - out.size()) * sizeof(T), (size() - 1) * out.size_bytes());
    if constexpr (!Async) {
      if (use_shared(kSharedReduceScatter, in.size_bytes())) {
        shared_reduce_scatter<T>("reduce_scatter_v", in, out, to_sizes(counts), op);
        return {};
      }
    }
    return reduce_scatter_common<Async>("reduce_scatter_v", in, out, in_place, op, [=](const void* send, void* recv,
                                                                                      MPI_Datatype type, MPI_Op mpi_op,
                                                                                      MPI_Comm comm, MPI_Request* r) {
      return r ? MPI_Ireduce_scatter(send, recv, c->counts.data(), type, mpi_op, comm, r)
               : MPI_Reduce_scatter(send, recv, c->counts.data(), type, mpi_op, comm);
    }, c);  // the count array lives until completion
  }

  // In place, MPI would leave a reduce-scatter's result at the start of the input: reduce into a staging buffer.
  template <bool Async, CommElement T, class Call>
  Request reduce_scatter_common(const char* name, std::span<const T> in, std::span<T> out, bool in_place, ReduceOp op,
                                Call call, std::shared_ptr<mpi_detail::IntCounts> keep) {
    std::shared_ptr<mpi_detail::Scratch<T>> staged;
    if (in_place && !std::is_same_v<T, bf16>) staged = std::make_shared<mpi_detail::Scratch<T>>(out.size());
    auto reduction = mpi_detail::Reduction<T>::prepare(in, staged ? staged->span().data() : out.data(), out.size(),
                                                        false, true);
    reduction.staged = staged;
    const auto type = mpi_detail::reduce_datatype<T>();
    const auto mpi_op = mpi_detail::reduce_operator(op);
    MPI_Comm comm = state_->comm;
    const int n = size();
    return collective<Async>(name, [=](MPI_Request* r) { return call(reduction.send, reduction.recv, type, mpi_op, comm, r); },
                             [=] {
                               (void)keep;
                               reduction.finish(out, op, n);
                             });
  }

  template <bool Async, CommElement T>
  Request all_reduce_impl(std::span<const T> in, std::span<T> out, ReduceOp op) {
    check_reducible<T>();
    check(in.size() == out.size(), "all_reduce: input holds {} elements but output holds {}", in.size(), out.size());
    const bool in_place = !in.empty() && in.data() == out.data();
    check(in_place || !mpi_detail::overlaps(in, out),
          "all_reduce: the input and output overlap without being the same span");
    const int count = count_of(in.size(), "all_reduce");
    validate("all_reduce", signature<T>(in.size(), op));
    const int n = size();
    const std::size_t ring = 2 * (n - 1) * in.size_bytes() / std::size_t(n);
    count_bytes(ring, ring);
    if constexpr (!Async) {
      if (use_shared(kSharedAllReduce, in.size_bytes())) {
        run_shared("all_reduce", [&] { mpi_detail::shm_all_reduce<T>(*state_->shared, in, out, op); });
        return {};
      }
    }
    // bf16 always reduces its float copy in place.
    const auto reduction =
        mpi_detail::Reduction<T>::prepare(in, out.data(), out.size(), in_place || std::is_same_v<T, bf16>, true);
    const auto type = mpi_detail::reduce_datatype<T>();
    const auto mpi_op = mpi_detail::reduce_operator(op);
    MPI_Comm comm = state_->comm;
    return collective<Async>("all_reduce", [=](MPI_Request* r) {
      return r ? MPI_Iallreduce(reduction.send, reduction.recv, count, type, mpi_op, comm, r)
               : MPI_Allreduce(reduction.send, reduction.recv, count, type, mpi_op, comm);
    }, [=] { reduction.finish(out, op, n); });
  }

  template <bool Async, CommElement T>
  Request all_to_all_impl(std::span<const T> in, std::span<T> out) {
    const int n = size();
    check(in.size() == out.size() && in.size() % std::size_t(n) == 0,
          "all_to_all: input ({}) and output ({}) must hold the same number of elements, divisible by {} ranks",
          in.size(), out.size(), n);
    const int count = count_of(in.size() / std::size_t(n), "all_to_all");
    validate("all_to_all", signature<T>(in.size()));
    const std::size_t moved = (n - 1) * in.size_bytes() / std::size_t(n);
    count_bytes(moved, moved);
    // Blocking and exactly in place: MPI_IN_PLACE. Otherwise an overlapping input is staged.
    const bool in_place = !Async && !in.empty() && in.data() == out.data();
    std::shared_ptr<mpi_detail::Scratch<T>> staged;
    const void* send = send_buffer(in, out, in_place, staged);
    const auto type = mpi_detail::datatype<T>();
    MPI_Comm comm = state_->comm;
    return collective<Async>("all_to_all", [=](MPI_Request* r) {
      return r ? MPI_Ialltoall(send, count, type, out.data(), count, type, comm, r)
               : MPI_Alltoall(send, count, type, out.data(), count, type, comm);
    }, [staged] {});
  }

  template <bool Async, CommElement T>
  Request all_to_all_v_impl(std::span<const T> in, std::span<const std::int64_t> send_counts, std::span<T> out,
                            std::span<const std::int64_t> recv_counts) {
    auto s = std::make_shared<mpi_detail::IntCounts>(
        mpi_detail::int_counts(send_counts, size(), "all_to_all_v", "send counts"));
    auto c = std::make_shared<mpi_detail::IntCounts>(
        mpi_detail::int_counts(recv_counts, size(), "all_to_all_v", "receive counts"));
    check(in.size() == s->total, "all_to_all_v: input holds {} elements, expected sum(send_counts) = {}", in.size(),
          s->total);
    check(out.size() == c->total, "all_to_all_v: output holds {} elements, expected sum(recv_counts) = {}",
          out.size(), c->total);
    validate("all_to_all_v", signature<T>(0));
    if (state_->validate) mpi_detail::validate_exchange(*state_, send_counts, recv_counts);
    count_bytes((in.size() - std::size_t(send_counts[std::size_t(rank())])) * sizeof(T),
                (out.size() - std::size_t(recv_counts[std::size_t(rank())])) * sizeof(T));
    const bool in_place = !Async && !in.empty() && in.data() == out.data() && s->counts == c->counts;
    std::shared_ptr<mpi_detail::Scratch<T>> staged;
    const void* send = send_buffer(in, out, in_place, staged);
    const auto type = mpi_detail::datatype<T>();
    MPI_Comm comm = state_->comm;
    return collective<Async>("all_to_all_v", [=](MPI_Request* r) {
      return r ? MPI_Ialltoallv(send, s->counts.data(), s->displacements.data(), type, out.data(), c->counts.data(),
                                c->displacements.data(), type, comm, r)
               : MPI_Alltoallv(send, s->counts.data(), s->displacements.data(), type, out.data(), c->counts.data(),
                               c->displacements.data(), type, comm);
    }, [s, c, staged] {});
  }

  template <bool Async, CommElement T>
  Request broadcast_impl(std::span<T> buffer, int root) {
    check_peer("broadcast", root);
    const int count = count_of(buffer.size(), "broadcast");
    validate("broadcast", signature<T>(buffer.size(), ReduceOp::sum, root));
    if (size() > 1) count_bytes(rank() == root ? buffer.size_bytes() : 0, rank() == root ? 0 : buffer.size_bytes());
    const auto type = mpi_detail::datatype<T>();
    MPI_Comm comm = state_->comm;
    return collective<Async>("broadcast", [=](MPI_Request* r) {
      return r ? MPI_Ibcast(buffer.data(), count, type, root, comm, r) : MPI_Bcast(buffer.data(), count, type, root, comm);
    }, kNothing);
  }

  template <bool Async, CommElement T>
  Request reduce_impl(std::span<const T> in, std::span<T> out, ReduceOp op, int root) {
    check_reducible<T>();
    check_peer("reduce", root);
    const bool is_root = rank() == root;
    check(!is_root || out.size() == in.size(), "reduce: the root's output holds {} elements, expected {}", out.size(),
          in.size());
    const bool in_place = is_root && !in.empty() && in.data() == out.data();
    check(!is_root || in_place || !mpi_detail::overlaps(in, out),
          "reduce: the input and output overlap without being the same span");
    const int count = count_of(in.size(), "reduce");
    validate("reduce", signature<T>(in.size(), op, root));
    if (size() > 1) count_bytes(is_root ? 0 : in.size_bytes(), is_root ? in.size_bytes() : 0);
    // bf16 reduces its float copy in place on the root.
    const auto reduction = mpi_detail::Reduction<T>::prepare(
        in, out.data(), out.size(), in_place || (is_root && std::is_same_v<T, bf16>), is_root);
    const auto type = mpi_detail::reduce_datatype<T>();
    const auto mpi_op = mpi_detail::reduce_operator(op);
    MPI_Comm comm = state_->comm;
    const int n = size();
    return collective<Async>("reduce", [=](MPI_Request* r) {
      return r ? MPI_Ireduce(reduction.send, reduction.recv, count, type, mpi_op, root, comm, r)
               : MPI_Reduce(reduction.send, reduction.recv, count, type, mpi_op, root, comm);
    }, [=] { if (is_root) reduction.finish(out, op, n); });
  }

  template <bool Async>
  Request barrier_impl() {
    validate("barrier", {});
    MPI_Comm comm = state_->comm;
    return collective<Async>("barrier", [=](MPI_Request* r) { return r ? MPI_Ibarrier(comm, r) : MPI_Barrier(comm); },
                             kNothing);
  }

};

static_assert(Communicator<MpiCommunicator>);

// Runs fn(world) on this process's rank. An exception ends the job on every rank at once (MPI_Abort) after printing
// the failed rank and the reason; so no rank is left waiting for it.
template <class Fn>
void run_mpi(Fn&& fn) {
  try {
    MpiCommunicator world = MpiCommunicator::world();
    fn(world);
  } catch (const std::exception& e) {
    abort_mpi_job(e.what());
  } catch (...) {
    abort_mpi_job("an exception not derived from std::exception");
  }
}

}  // namespace paradyse
