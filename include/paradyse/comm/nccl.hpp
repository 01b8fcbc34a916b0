// paradyse/comm/nccl.hpp: the NCCL backend of the Communicator concept: one rank per GPU and process.
//
//   auto comm = NcclCommunicator::from_file("/shared/job42.ncclid", rank, size);     // or from_mpi(mpi_comm)
//   comm.all_reduce(grad, grad, ReduceOp::avg);                                      // device spans
//
// Built only where NCCL is found (PARADYSE_WITH_NCCL; link paradyse::nccl). Buffers are device memory of this
// process's GPU. ONE GPU ONLY RUNS p = 1: NCCL refuses two ranks of one communicator on the same device, so the
// ranks of a single-GPU machine are cuda_local's threads (comm/cuda_local.hpp), and this backend needs a GPU per rank.
//
// Bootstrap. The ranks share an ncclUniqueId: over MPI (from_mpi: rank 0 of the MPI communicator makes it and
// broadcasts it; needs PARADYSE_WITH_MPI) or through a file (from_file: rank 0 writes it to a temporary name and
// renames it onto `path`, atomically; the others poll for it until the timeout). Use a fresh path per run: a file
// left by an earlier run would be read as this run's id.
//
// Streams and overlap. Every operation runs on this communicator's own communication stream, which first waits (an
// event) for the work issued so far on the caller's current stream (device::current_stream()), so the operation
// sees the data the caller produced asynchronously. An `*_async` form returns at once; its Request records an event
// on the communication stream, and wait() makes the caller's current stream (at the time of wait) wait for it, so
// compute issued on the caller's stream between post and wait overlaps the transfer (ring attention). wait() also
// watches the operation from the host: it returns when the event is reached, and after the timeout
// (CommOptions::timeout, PARADYSE_COMM_TIMEOUT by default) or an asynchronous NCCL error it aborts the communicator
// (ncclCommAbort) and throws CommError naming the operation; every later operation then throws too. Blocking forms
// are the async form and its wait. Buffers must stay alive and untouched until wait() returns.
//
// Collectives map onto NCCL: all_gather, reduce_scatter, all_reduce, broadcast and reduce are NCCL's collectives
// (avg: a sum, then a division kernel, so every dtype averages as the threads backend does: sum, then divide);
// all_gather_v, all_to_all, all_to_all_v, send, recv and shift are grouped ncclSend/ncclRecv (ncclGroupStart/End),
// this rank's own chunk copied on the communication stream; reduce_scatter_v receives the other ranks' chunks with
// grouped send/recv into scratch and reduces them in rank order with comm/cuda_reduce.hpp's kernel (deterministic).
// In-place forms follow the concept; an input that overlaps the output of an exchange (all_to_all in place, shift)
// is staged in stream-ordered scratch first. split() is ncclCommSplit (colors must be >= 0). stats() counts bytes
// as the threads backend does (ring volumes, nccl-tests' bus-bandwidth convention). Errors name the NCCL result,
// NCCL's last error text and the operation.
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/comm/cuda_reduce.hpp"
#include "paradyse/comm/nccl_detail.hpp"
#include "paradyse/core/dtype.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/device/runtime.hpp"
#include "paradyse/device/stream.hpp"

#if defined(PARADYSE_WITH_MPI)
#include "paradyse/comm/mpi.hpp"
#endif

#include <cuda_runtime_api.h>
#include <fmt/format.h>
#include <nccl.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <unistd.h>
#include <utility>
#include <vector>

namespace paradyse {

// Options of an NcclCommunicator.
struct NcclOptions {
  std::chrono::milliseconds timeout = comm_timeout();  // per wait, and for the file bootstrap
  int device = -1;  // the GPU of this rank; -1: the calling thread's current device
};

// One rank's handle on an NCCL communicator. Move-only; a pending Request refers to its communicator, which must
// outlive it.
class NcclCommunicator : public BlockingCollectives<NcclCommunicator> {
  template <class T>
  using In = std::type_identity_t<std::span<const T>>;

public:
  // Joins the communicator of `size` ranks that share `id`, as rank `rank` (collective over those ranks; blocks until
  // all have joined).
  NcclCommunicator(const ncclUniqueId& id, int rank, int size, NcclOptions options = {}) {
    paradyse::check(size >= 1 && rank >= 0 && rank < size, "NcclCommunicator: rank {} of {} ranks is not valid", rank,
                    size);
    int device = options.device;
    if (device < 0) PARADYSE_CUDA_CHECK(cudaGetDevice(&device));
    PARADYSE_CUDA_CHECK(cudaSetDevice(device));
    ncclComm_t comm = nullptr;
    nccl_detail::check(ncclCommInitRank(&comm, size, id, rank),
                       fmt::format("ncclCommInitRank (rank {} of {} on device {})", rank, size, device));
    state_ = std::make_unique<nccl_detail::State>(comm, rank, size, device, options.timeout);
  }

  // The unique id through a file: rank 0 makes it and writes it to `path` atomically (a temporary name, then
  // rename), the others poll for it until the timeout. `path` must be fresh for this run (see the top).
  static NcclCommunicator from_file(const std::string& path, int rank, int size, NcclOptions options = {}) {
    ncclUniqueId id{};
    if (rank == 0) {
      nccl_detail::check(ncclGetUniqueId(&id), "ncclGetUniqueId");
      const std::string temporary = fmt::format("{}.tmp.{}", path, ::getpid());
      {
        std::ofstream file(temporary, std::ios::binary | std::ios::trunc);
        file.write(reinterpret_cast<const char*>(&id), sizeof id);
        paradyse::check(bool(file), "NcclCommunicator::from_file: cannot write the unique id to {}", temporary);
      }
      std::error_code error;
      std::filesystem::rename(temporary, path, error);
      paradyse::check(!error, "NcclCommunicator::from_file: cannot rename {} to {}: {}", temporary, path,
                      error.message());
    } else {
      const auto deadline = std::chrono::steady_clock::now() + options.timeout;
      for (;;) {
        std::ifstream file(path, std::ios::binary);
        if (file && file.read(reinterpret_cast<char*>(&id), sizeof id) && file.gcount() == sizeof id) break;
        if (std::chrono::steady_clock::now() > deadline)
          throw CommError(fmt::format("rank {}: timeout after {:.1f} s waiting for rank 0 to write the NCCL unique id "
                                      "to {}", rank, std::chrono::duration<double>(options.timeout).count(), path));
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    }
    return NcclCommunicator(id, rank, size, options);
  }

#if defined(PARADYSE_WITH_MPI)
  // The unique id over MPI: rank 0 of `mpi` makes it, everyone receives it; the NCCL ranks are the MPI ranks.
  static NcclCommunicator from_mpi(MpiCommunicator& mpi, NcclOptions options = {}) {
    ncclUniqueId id{};
    if (mpi.rank() == 0) nccl_detail::check(ncclGetUniqueId(&id), "ncclGetUniqueId");
    mpi.broadcast(std::span<std::byte>(reinterpret_cast<std::byte*>(&id), sizeof id), 0);
    return NcclCommunicator(id, mpi.rank(), mpi.size(), options);
  }
#endif

  NcclCommunicator(NcclCommunicator&&) noexcept = default;
  NcclCommunicator& operator=(NcclCommunicator&&) noexcept = default;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const noexcept { return state_->rank; }
  int size() const noexcept { return state_->size; }
  int device() const noexcept { return state_->device; }
  CommStats stats() const noexcept { return stats_; }
  void reset_stats() noexcept { stats_ = {}; }
  ncclComm_t native() const noexcept { return state_->comm; }
  cudaStream_t stream() const noexcept { return state_->stream.get(); }
  bool aborted() const noexcept { return state_->aborted; }

  // ---- collectives -------------------------------------------------------------------------------------------
  // out: [size * in.size()]; in may be this rank's chunk of out (in place).
  template <CommElement T>
  Request all_gather_async(In<T> in, std::span<T> out) {
    paradyse::check(out.size() == in.size() * std::size_t(size()),
                    "all_gather: output holds {} elements, expected {} ({} ranks x {} per rank)", out.size(),
                    in.size() * std::size_t(size()), size(), in.size());
    count_bytes((size() - 1) * in.size_bytes(), (size() - 1) * in.size_bytes());
    return launch("all_gather", [&](cudaStream_t s) {
      nccl_detail::check(ncclAllGather(in.data(), out.data(), in.size(), nccl_detail::data_type<T>(), comm(), s),
                         "ncclAllGather (all_gather)", comm());
    });
  }
  // out: [sum(counts)], counts[r] elements from rank r; in.size() must equal counts[rank()].
  template <CommElement T>
  Request all_gather_v_async(In<T> in, std::span<T> out, std::span<const std::int64_t> counts) {
    comm_detail::check_counts("all_gather_v", counts, size());
    paradyse::check(in.size() == std::size_t(counts[rank()]),
                    "all_gather_v: rank {} sends {} elements but counts[{}] = {}", rank(), in.size(), rank(),
                    counts[rank()]);
    paradyse::check(out.size() == comm_detail::total(counts),
                    "all_gather_v: output holds {} elements, expected sum(counts) = {}",
                    out.size(), comm_detail::total(counts));
    count_bytes((size() - 1) * in.size_bytes(), (out.size() - in.size()) * sizeof(T));
    return launch("all_gather_v", [&](cudaStream_t s) {
      group("all_gather_v", [&] {
        std::size_t offset = 0;
        for (int r = 0; r < size(); ++r) {
          const std::size_t n = std::size_t(counts[r]);
          if (r == rank()) copy_on(s, out.data() + offset, in.data(), n);
          else {
            send_part(in.data(), in.size(), r, s, "all_gather_v");
            recv_part(out.data() + offset, n, r, s, "all_gather_v");
          }
          offset += n;
        }
      });
    });
  }
  // in: [size * out.size()]; rank r receives the reduction of chunk r.
  template <CommElement T>
  Request reduce_scatter_async(In<T> in, std::span<T> out, ReduceOp op) {
    static_assert(!std::is_same_v<T, std::byte>, "raw bytes cannot be reduced");
    paradyse::check(in.size() == out.size() * std::size_t(size()),
                    "reduce_scatter: input holds {} elements, expected {} ({} ranks x {} per rank)", in.size(),
                    out.size() * std::size_t(size()), size(), out.size());
    count_bytes((size() - 1) * out.size_bytes(), (size() - 1) * out.size_bytes());
    return launch("reduce_scatter", [&](cudaStream_t s) {
      nccl_detail::check(ncclReduceScatter(in.data(), out.data(), out.size(), nccl_detail::data_type<T>(),
                                           nccl_detail::red_op(op), comm(), s),
                         "ncclReduceScatter (reduce_scatter)", comm());
      finish_avg<T>(out.data(), out.size(), op, s);
    });
  }
  // in: [sum(counts)]; rank r receives the reduction of its counts[r] elements, in rank order (deterministic).
  template <CommElement T>
  Request reduce_scatter_v_async(In<T> in, std::span<T> out, std::span<const std::int64_t> counts, ReduceOp op) {
    static_assert(!std::is_same_v<T, std::byte>, "raw bytes cannot be reduced");
    comm_detail::check_counts("reduce_scatter_v", counts, size());
    paradyse::check(in.size() == comm_detail::total(counts),
                    "reduce_scatter_v: input holds {} elements, expected sum(counts) = {}",
                    in.size(), comm_detail::total(counts));
    paradyse::check(out.size() == std::size_t(counts[rank()]),
                    "reduce_scatter_v: rank {} receives into {} elements but counts[{}] = {}", rank(), out.size(),
                    rank(), counts[rank()]);
    paradyse::check(size() <= comm_cuda::kMaxReduceRanks, "reduce_scatter_v: {} ranks, at most {} supported", size(),
                    comm_cuda::kMaxReduceRanks);
    count_bytes((in.size() - out.size()) * sizeof(T), (size() - 1) * out.size_bytes());
    return launch("reduce_scatter_v", [&](cudaStream_t s) {
      const std::size_t mine = out.size();
      std::vector<std::size_t> offsets(std::size_t(size()) + 1, 0);
      for (int r = 0; r < size(); ++r) offsets[std::size_t(r) + 1] = offsets[std::size_t(r)] + std::size_t(counts[r]);
      // The other ranks' chunk for this rank, slot r of the scratch (this rank's slot unused).
      T* scratch = scratch_on<T>(s, mine * std::size_t(size()));
      group("reduce_scatter_v", [&] {
        for (int r = 0; r < size(); ++r) {
          if (r == rank()) continue;
          send_part(in.data() + offsets[std::size_t(r)], std::size_t(counts[r]), r, s, "reduce_scatter_v");
          recv_part(scratch + std::size_t(r) * mine, mine, r, s, "reduce_scatter_v");
        }
      });
      std::vector<const std::byte*> inputs(static_cast<std::size_t>(size()));
      for (int r = 0; r < size(); ++r)
        inputs[std::size_t(r)] = reinterpret_cast<const std::byte*>(
            r == rank() ? in.data() + offsets[std::size_t(r)] : scratch + std::size_t(r) * mine);
      comm_cuda::reduce_in_rank_order(dtype_of<T>(), reinterpret_cast<std::byte*>(out.data()), inputs.data(), size(),
                                      0, mine, op, s);
      free_on(s, scratch);
    });
  }
  template <CommElement T>
  Request all_reduce_async(In<T> in, std::span<T> out, ReduceOp op) {
    static_assert(!std::is_same_v<T, std::byte>, "raw bytes cannot be reduced");
    paradyse::check(in.size() == out.size(), "all_reduce: input holds {} elements but output holds {}", in.size(),
                    out.size());
    const std::size_t ring = 2 * (size() - 1) * in.size_bytes() / std::size_t(size());
    count_bytes(ring, ring);
    return launch("all_reduce", [&](cudaStream_t s) {
      nccl_detail::check(ncclAllReduce(in.data(), out.data(), in.size(), nccl_detail::data_type<T>(),
                                       nccl_detail::red_op(op), comm(), s),
                         "ncclAllReduce (all_reduce)", comm());
      finish_avg<T>(out.data(), out.size(), op, s);
    });
  }
  // Equal chunks: chunk j of in goes to rank j; chunk j of out comes from rank j. In place allowed (staged).
  template <CommElement T>
  Request all_to_all_async(In<T> in, std::span<T> out) {
    paradyse::check(in.size() == out.size() && in.size() % std::size_t(size()) == 0,
                    "all_to_all: input ({}) and output ({}) must hold the same number of elements, divisible by {} "
                    "ranks", in.size(), out.size(), size());
    const std::size_t moved = (size() - 1) * in.size_bytes() / std::size_t(size());
    count_bytes(moved, moved);
    std::vector<std::int64_t> counts(std::size_t(size()), std::int64_t(in.size() / std::size_t(size())));
    return launch("all_to_all", [&](cudaStream_t s) { exchange_v<T>("all_to_all", in, counts, out, counts, s); });
  }
  // send_counts[j] elements to rank j (in rank order in `in`), recv_counts[j] from rank j.
  template <CommElement T>
  Request all_to_all_v_async(In<T> in, std::span<const std::int64_t> send_counts, std::span<T> out,
                             std::span<const std::int64_t> recv_counts) {
    comm_detail::check_counts("all_to_all_v (send counts)", send_counts, size());
    comm_detail::check_counts("all_to_all_v (receive counts)", recv_counts, size());
    paradyse::check(in.size() == comm_detail::total(send_counts),
                    "all_to_all_v: input holds {} elements, expected sum(send_counts) = {}", in.size(),
                    comm_detail::total(send_counts));
    paradyse::check(out.size() == comm_detail::total(recv_counts),
                    "all_to_all_v: output holds {} elements, expected sum(recv_counts) = {}", out.size(),
                    comm_detail::total(recv_counts));
    paradyse::check(send_counts[rank()] == recv_counts[rank()],
                    "all_to_all_v: rank {} sends {} elements to itself but expects {}", rank(), send_counts[rank()],
                    recv_counts[rank()]);
    count_bytes((in.size() - std::size_t(send_counts[rank()])) * sizeof(T),
                (out.size() - std::size_t(recv_counts[rank()])) * sizeof(T));
    return launch("all_to_all_v",
                  [&](cudaStream_t s) { exchange_v<T>("all_to_all_v", in, send_counts, out, recv_counts, s); });
  }
  template <CommElement T>
  Request broadcast_async(std::span<T> buffer, int root) {
    check_peer("broadcast", root);
    if (size() > 1) count_bytes(rank() == root ? buffer.size_bytes() : 0, rank() == root ? 0 : buffer.size_bytes());
    return launch("broadcast", [&](cudaStream_t s) {
      nccl_detail::check(ncclBroadcast(buffer.data(), buffer.data(), buffer.size(), nccl_detail::data_type<T>(), root,
                                       comm(), s),
                         "ncclBroadcast (broadcast)", comm());
    });
  }
  // The reduction lands in `out` on the root; other ranks may pass an empty `out`.
  template <CommElement T>
  Request reduce_async(In<T> in, std::span<T> out, ReduceOp op, int root) {
    static_assert(!std::is_same_v<T, std::byte>, "raw bytes cannot be reduced");
    check_peer("reduce", root);
    paradyse::check(rank() != root || out.size() == in.size(),
                    "reduce: the root's output holds {} elements, expected {}", out.size(), in.size());
    if (size() > 1) count_bytes(rank() == root ? 0 : in.size_bytes(), rank() == root ? in.size_bytes() : 0);
    return launch("reduce", [&](cudaStream_t s) {
      T* recv = rank() == root ? out.data() : nullptr;
      nccl_detail::check(ncclReduce(in.data(), recv, in.size(), nccl_detail::data_type<T>(), nccl_detail::red_op(op),
                                    root, comm(), s),
                         "ncclReduce (reduce)", comm());
      if (rank() == root) finish_avg<T>(out.data(), out.size(), op, s);
    });
  }

  // The blocking collectives and shift: BlockingCollectives (communicator.hpp), each the async form waited for.

  // Returns when every rank has called it (a one-element all-reduce, waited for on the host).
  void barrier() {
    ensure_scratch_word();
    launch("barrier", [&](cudaStream_t s) {
      nccl_detail::check(ncclAllReduce(barrier_word_.get(), barrier_word_.get(), 1, ncclInt32, ncclSum, comm(), s),
                         "ncclAllReduce (barrier)", comm());
    }).wait();
  }

  // The ranks of one color (>= 0) form a new communicator, ordered by key and then by rank (ncclCommSplit).
  // Collective over this communicator; the new one has its own communication stream on the same device.
  NcclCommunicator split(int color, int key) {
    paradyse::check(color >= 0, "split: color {} must be non-negative", color);
    ensure_alive("split");
    PARADYSE_CUDA_CHECK(cudaSetDevice(device()));
    PARADYSE_CUDA_CHECK(cudaStreamSynchronize(stream()));  // pending operations first
    ncclComm_t split_comm = nullptr;
    nccl_detail::check(ncclCommSplit(comm(), color, key, &split_comm, nullptr),
                       fmt::format("ncclCommSplit (split color {} key {})", color, key), comm());
    int new_rank = 0, new_size = 0;
    nccl_detail::check(ncclCommUserRank(split_comm, &new_rank), "ncclCommUserRank (split)", split_comm);
    nccl_detail::check(ncclCommCount(split_comm, &new_size), "ncclCommCount (split)", split_comm);
    return NcclCommunicator(
        std::make_unique<nccl_detail::State>(split_comm, new_rank, new_size, device(), state_->timeout));
  }

  // ---- point to point -------------------------------------------------------------------------------------------
  template <CommElement T>
  Request send_async(std::span<const T> in, int dest) {
    check_peer("send", dest);
    count_bytes(in.size_bytes(), 0);
    return launch("send", [&](cudaStream_t s) {
      paradyse::check(dest != rank(), "send: rank {} sends to itself (use a copy)", rank());
      send_part(in.data(), in.size(), dest, s, "send");
    });
  }
  template <CommElement T>
  Request recv_async(std::span<T> out, int source) {
    check_peer("recv", source);
    count_bytes(0, out.size_bytes());
    return launch("recv", [&](cudaStream_t s) {
      paradyse::check(source != rank(), "recv: rank {} receives from itself (use a copy)", rank());
      recv_part(out.data(), out.size(), source, s, "recv");
    });
  }
  // Sends `in` to rank + offset and receives `out` from rank - offset (mod size): one step of a ring.
  template <CommElement T>
  Request shift_async(In<T> in, std::span<T> out, int offset = 1) {
    const int n = size();
    const int dest = ((rank() + offset) % n + n) % n, source = ((rank() - offset) % n + n) % n;
    paradyse::check(in.size() == out.size() || dest != rank(),
                    "shift: rank {} sends {} elements to itself but receives {}", rank(), in.size(), out.size());
    count_bytes(in.size_bytes(), 0);  // a send and a receive, as MPI's Sendrecv (and the threads backend)
    count_bytes(0, out.size_bytes());
    return launch("shift", [&](cudaStream_t s) {
      if (dest == rank()) {  // offset a multiple of size: to itself
        copy_on(s, out.data(), in.data(), in.size());
        return;
      }
      const T* source_data = in.data();
      T* staged = nullptr;
      if (nccl_detail::overlaps(in.data(), in.size_bytes(), out.data(), out.size_bytes())) {
        staged = scratch_on<T>(s, in.size());
        copy_on(s, staged, in.data(), in.size());
        source_data = staged;
      }
      group("shift", [&] {
        send_part(source_data, in.size(), dest, s, "shift");
        recv_part(out.data(), out.size(), source, s, "shift");
      });
      if (staged) free_on(s, staged);
    });
  }
  template <CommElement T> void send(std::span<const T> in, int dest) { send_async(in, dest).wait(); }
  template <CommElement T> void recv(std::span<T> out, int source) { recv_async(out, source).wait(); }
  template <CommElement T> Request send_async(std::span<T> in, int dest) {
    return send_async(std::span<const T>(in), dest);
  }
  template <CommElement T> void send(std::span<T> in, int dest) { send(std::span<const T>(in), dest); }

private:
  explicit NcclCommunicator(std::unique_ptr<nccl_detail::State> state) : state_(std::move(state)) {}

  ncclComm_t comm() const noexcept { return state_->comm; }

  void ensure_alive(std::string_view what) const {
    if (state_->aborted)
      throw CommError(fmt::format("rank {}: {} on an aborted NCCL communicator ({})", rank(), what,
                                  state_->abort_reason));
  }

  // Issues an operation on the communication stream after the caller's stream's work so far; the Request waits for
  // it (host watch with timeout) and orders the caller's stream after it.
  template <class Issue>
  Request launch(std::string_view what, Issue&& issue) {
    ensure_alive(what);
    const std::uint64_t seq = operations_++;
    const cudaStream_t s = stream();
    device::Event ready(false);
    ready.record(device::current_stream());
    ready.wait(s);
    issue(s);
    auto done = std::make_shared<device::Event>(false);
    done->record(s);
    return Request([this, done, seq, name = std::string(what)] { finish(*done, name, seq); });
  }

  void finish(const device::Event& done, const std::string& what, std::uint64_t seq) {
    const auto describe = [&] {
      return fmt::format("{} (operation #{} of rank {} of {} NCCL ranks on device {})", what, seq, rank(), size(),
                         device());
    };
    ensure_alive(describe());
    const auto start = std::chrono::steady_clock::now();
    const auto deadline = start + state_->timeout;
    for (int polls = 0;; ++polls) {
      if (done.done()) break;
      ncclResult_t async_error = ncclSuccess;
      nccl_detail::check(ncclCommGetAsyncError(comm(), &async_error), "ncclCommGetAsyncError", comm());
      if (async_error != ncclSuccess && async_error != ncclInProgress) {
        const std::string reason = fmt::format("NCCL error {} ({}) during {}: {}", int(async_error),
                                               ncclGetErrorString(async_error), describe(), ncclGetLastError(comm()));
        state_->abort(reason);
        throw CommError(fmt::format("rank {}: {}; the communicator was aborted", rank(), reason));
      }
      if (std::chrono::steady_clock::now() > deadline) {
        const std::string reason = fmt::format("timeout after {:.1f} s in {}: a rank never arrived or failed",
                                               std::chrono::duration<double>(state_->timeout).count(), describe());
        state_->abort(reason);
        throw CommError(fmt::format("rank {}: {}; the communicator was aborted", rank(), reason));
      }
      if (polls < 1000) std::this_thread::yield();
      else std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    done.wait(device::current_stream());
  }

  template <class Body>
  void group(std::string_view what, Body&& body) {
    nccl_detail::check(ncclGroupStart(), fmt::format("ncclGroupStart ({})", what), comm());
    try {
      body();
    } catch (...) {
      (void)ncclGroupEnd();
      throw;
    }
    nccl_detail::check(ncclGroupEnd(), fmt::format("ncclGroupEnd ({})", what), comm());
  }

  template <class T>
  void send_part(const T* data, std::size_t count, int peer, cudaStream_t s, std::string_view what) {
    nccl_detail::check(ncclSend(data, count, nccl_detail::data_type<T>(), peer, comm(), s),
                       fmt::format("ncclSend to rank {} ({})", peer, what), comm());
  }
  template <class T>
  void recv_part(T* data, std::size_t count, int peer, cudaStream_t s, std::string_view what) {
    nccl_detail::check(ncclRecv(data, count, nccl_detail::data_type<T>(), peer, comm(), s),
                       fmt::format("ncclRecv from rank {} ({})", peer, what), comm());
  }
  template <class T>
  static void copy_on(cudaStream_t s, T* to, const T* from, std::size_t count) {
    if (count && to != from) PARADYSE_CUDA_CHECK(cudaMemcpyAsync(to, from, count * sizeof(T), cudaMemcpyDefault, s));
  }
  // Stream-ordered scratch (cudaMallocAsync) freed with free_on after its last use on the same stream.
  template <class T>
  static T* scratch_on(cudaStream_t s, std::size_t count) {
    void* p = nullptr;
    if (count) PARADYSE_CUDA_CHECK(cudaMallocAsync(&p, count * sizeof(T), s));
    return static_cast<T*>(p);
  }
  static void free_on(cudaStream_t s, void* p) {
    if (p) PARADYSE_CUDA_CHECK(cudaFreeAsync(p, s));
  }
  // avg = sum / size, after NCCL's sum.
  template <class T>
  void finish_avg(T* data, std::size_t count, ReduceOp op, cudaStream_t s) {
    if (op == ReduceOp::avg && size() > 1)
      comm_cuda::divide_in_place(dtype_of<T>(), reinterpret_cast<std::byte*>(data), count, size(), s);
  }

  // all_to_all(_v) as grouped send/recv; this rank's own chunk is a copy; an input overlapping the output is staged.
  template <class T>
  void exchange_v(std::string_view what, std::span<const T> in, std::span<const std::int64_t> send_counts,
                  std::span<T> out, std::span<const std::int64_t> recv_counts, cudaStream_t s) {
    const T* source = in.data();
    T* staged = nullptr;
    if (nccl_detail::overlaps(in.data(), in.size_bytes(), out.data(), out.size_bytes())) {
      staged = scratch_on<T>(s, in.size());
      copy_on(s, staged, in.data(), in.size());
      source = staged;
    }
    std::size_t send_offset = 0, recv_offset = 0;
    group(what, [&] {
      for (int r = 0; r < size(); ++r) {
        const std::size_t sn = std::size_t(send_counts[r]), rn = std::size_t(recv_counts[r]);
        if (r == rank()) copy_on(s, out.data() + recv_offset, source + send_offset, sn);
        else {
          send_part(source + send_offset, sn, r, s, what);
          recv_part(out.data() + recv_offset, rn, r, s, what);
        }
        send_offset += sn;
        recv_offset += rn;
      }
    });
    if (staged) free_on(s, staged);
  }

  void ensure_scratch_word() {
    if (barrier_word_) return;
    void* p = nullptr;
    PARADYSE_CUDA_CHECK(cudaMalloc(&p, sizeof(std::int32_t)));
    barrier_word_.reset(static_cast<std::int32_t*>(p));
    PARADYSE_CUDA_CHECK(cudaMemset(p, 0, sizeof(std::int32_t)));
  }

  void check_peer(const char* op, int peer) const {
    paradyse::check(peer >= 0 && peer < size(), "{}: rank {} is not in the NCCL communicator (size {})", op, peer,
                    size());
  }
  void count_bytes(std::size_t sent, std::size_t received) {
    stats_.bytes_sent += sent;
    stats_.bytes_received += received;
    ++stats_.operations;
  }

  std::unique_ptr<nccl_detail::State> state_;
  CommStats stats_;
  std::uint64_t operations_ = 0;
  struct CudaFree {
    void operator()(void* p) const noexcept { (void)cudaFree(p); }
  };
  std::unique_ptr<std::int32_t, CudaFree> barrier_word_;  // the barrier's one element, made on first use
};

static_assert(Communicator<NcclCommunicator>);

}  // namespace paradyse
