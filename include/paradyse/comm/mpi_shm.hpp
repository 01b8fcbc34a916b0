// paradyse/comm/mpi_shm.hpp: the large collectives of the MPI backend through a shared-memory window within a node.
//
// OpenMPI 4.1 on one machine moves large messages slowly (measured here: reduce_scatter 0.3-1.3 GB/s and a 64 MiB
// send/recv at 1.4 GB/s, against 5-7 GB/s memcpy). On this machine one core's memcpy already takes most of the
// memory bandwidth (two cores copying at once get 5.6-6.2 GB/s together against 6.7 GB/s for one alone).
//
// The machine is also shared: when a job runs beside the ranks, one rank's core is busy with it and that rank copies
// at a third of the other's speed (measured: a 64 MiB memcpy at the same time on both ranks, 10 ms on one and 30 ms
// on the other). A collective that gives each rank a fixed share of the work (MPI's rings, or a pipeline through
// shared slots, tried first here: 40-70 ms for 64 MiB on 2 ranks) runs at the slowest rank's speed.
//
// So when every rank of a communicator is on one node, all_gather(_v), reduce_scatter(_v) and all_reduce are cut
// into parts (pieces of piece_bytes()) that any rank can execute, and the ranks share them out as they go, like the
// threads backend: every rank publishes its buffers' addresses in a small window of shared memory
// (MPI_Win_allocate_shared), then claims unclaimed parts and executes them, reading the other processes' inputs and
// writing their outputs directly with single-copy system calls (process_vm_readv / process_vm_writev, Linux
// cross-memory attach), then waits until every part is finished. Every rank has a queue of parts (a counter in the
// window); a rank claims from its own queue first, then from the others'. A fast rank does most parts; a descheduled
// one holds nobody up but by the part it is in.
// - all_gather: rank q's queue is the pieces of q's output. Its own parts q pulls (its own chunk copied locally;
//   another rank's piece read into scratch, which stays in cache, then streamed into its output); a part of another
//   rank's queue is pushed into that rank's output, from this rank's output when it pulled the same piece there (so
//   a descheduled rank's pieces are read from its process once, not once per output).
// - reduce_scatter: rank q's queue is the pieces of q's result; each reads that piece of every other input into
//   scratch and reduces it, straight into q's output when q executes it (streaming stores), else through scratch
//   and a write into q's process. Before the queues (one shared counter, parts in rank order) both ranks of a pair
//   started on rank 0's chunk, so half the parts took a second cross-process copy.
// - all_reduce: one queue (rank 0's): a part reads a piece from every input, reduces it once into the executing
//   rank's output and writes it from there (in cache) to every other output.
// comm_bench --goal-only, 2 ranks, 64 MiB, GB/s per rank (S / time), medians of 3 runs alternated with the build
// before the queues, load ~1.5: all_gather 4.51 (75% of "memcpy all", 53% of one core's memcpy; before 4.24, 65%),
// reduce_scatter 5.03 (81%, 59%; before 3.88, 58%), all_reduce 2.87 (45%, 31%; before 2.74, 43%); raw OpenMPI
// 3.35-3.56, 0.93-0.95, 1.01-1.15.
// Measured on the 2-core EPYC VM (no ERMS: the kernel copies with rep movsq, no streaming stores): the kernel copies
// 64 MiB from another process at 4.5-5.7 GB/s into a cache-sized buffer and 3.3-3.7 GB/s straight into a large one
// (process_vm_writev 3.8-4.0), against 8-9 GB/s for a streaming copy in user space; perf of all_reduce on 2 ranks:
// 34% kernel copy, 27% reduction, 8% page pinning. all_reduce on 2 ranks moves S per rank across processes either
// way, so it costs about reduce_scatter's time plus all_gather's. Also tried, slower and not kept: all_reduce on 2
// ranks as "each rank reads the other's whole input and reduces into its own output" (within noise of the split,
// 2.3-2.6 against 2.4-2.8 GB/s per rank at 64 MiB), and a pipeline through small shared slots that stay in cache
// (each rank copies its input into its slot, every rank reduces from all slots, idle ranks take over stalled ranks'
// steps): 31-46 ms at 64 MiB against the split's 32-36 ms at load 2, and 68-75 ms against 35-60 ms at load 3.5-5
// (other jobs beside the ranks), as every piece waits for every rank's copy. Pieces of 128 KiB - 512 KiB measured
// within noise of each other.
//
// Reductions add in rank order, element by element, exactly as the threads backend's
// threads_detail::reduce_in_rank_order (which they call, except for a vectorised float path with the same order),
// so results are bitwise the threads backend's and identical on every rank and from run to run, whichever rank
// executed a part; bf16 adds in float and rounds once; avg divides once at the end. The window is used only when
// every process could read the others' memory at creation (otherwise MPI's collectives are). Blocking only: the
// async forms stay on MPI's non-blocking collectives, which progress on their own.
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/comm/threads_detail.hpp"
#include "paradyse/core/error.hpp"

#include "paradyse/comm/mpi_h.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <cerrno>
#include <sched.h>
#include <span>
#include <sys/uio.h>
#include <thread>
#include <tuple>
#include <unistd.h>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace paradyse::mpi_detail {

// ---- copy and reduce kernels --------------------------------------------------------------------------------------

// memcpy with streaming stores for a destination written once and not read again soon (a collective's output): the
// store does not first read the line from memory, nor evict the channels' slots from the cache. Small copies and
// machines without SSE2 use memcpy. Call stream_fence() before another rank or the caller relies on the data.
inline void stream_copy(void* destination, const void* source, std::size_t bytes) {
#if defined(__SSE2__)
  if (bytes >= 4096) {
    auto* d = static_cast<std::byte*>(destination);
    const auto* s = static_cast<const std::byte*>(source);
    const std::size_t head = (16 - reinterpret_cast<std::uintptr_t>(d) % 16) % 16;
    std::memcpy(d, s, head);
    d += head;
    s += head;
    bytes -= head;
    const std::size_t body = bytes / 64 * 64;
    for (std::size_t i = 0; i < body; i += 64) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
      const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
    }
    std::memcpy(d + body, s + body, bytes - body);
    return;
  }
#endif
  std::memcpy(destination, source, bytes);
}

inline void stream_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

// out[i] = sources[0][i] (op) sources[1][i] (op) ... (op) sources[p-1][i] for i < n, in rank order; avg divides once
// at the end. Bitwise threads_detail::reduce_in_rank_order; float uses SSE2 lanes in the same order (max as
// std::max(acc, x): MAXPS(x, acc) keeps acc unless x > acc, NaN included), with streaming stores when `stream`.
// `out` may be one of the sources (each element is read before it is written).
template <CommElement T>
void reduce_sources(T* out, const T* const* sources, int p, std::size_t n, ReduceOp op, bool stream) {
#if defined(__SSE2__)
  if constexpr (std::is_same_v<T, float>) {
    const auto scalar = [&](std::size_t i) {
      float acc = sources[0][i];
      for (int r = 1; r < p; ++r) acc = op == ReduceOp::max ? std::max(acc, sources[r][i]) : acc + sources[r][i];
      out[i] = op == ReduceOp::avg ? acc / float(p) : acc;
    };
    std::size_t i = 0;
    for (; i < n && reinterpret_cast<std::uintptr_t>(out + i) % 16 != 0; ++i) scalar(i);
    const __m128 ranks = _mm_set1_ps(float(p));
    const auto lanes = [&](std::size_t at) {
      __m128 acc = _mm_loadu_ps(sources[0] + at);
      if (op == ReduceOp::max)
        for (int r = 1; r < p; ++r) acc = _mm_max_ps(_mm_loadu_ps(sources[r] + at), acc);
      else
        for (int r = 1; r < p; ++r) acc = _mm_add_ps(acc, _mm_loadu_ps(sources[r] + at));
      return op == ReduceOp::avg ? _mm_div_ps(acc, ranks) : acc;
    };
    if (stream) {
      for (; i + 8 <= n; i += 8) {
        const __m128 a = lanes(i), b = lanes(i + 4);
        _mm_stream_ps(out + i, a);
        _mm_stream_ps(out + i + 4, b);
      }
    } else {
      for (; i + 8 <= n; i += 8) {
        const __m128 a = lanes(i), b = lanes(i + 4);
        _mm_store_ps(out + i, a);
        _mm_store_ps(out + i + 4, b);
      }
    }
    for (; i < n; ++i) scalar(i);
    return;
  }
#endif
  (void)stream;
  threads_detail::reduce_in_rank_order<T>(reinterpret_cast<std::byte*>(out),
                                          reinterpret_cast<const std::byte* const*>(sources), p, 0, n, op);
}

// ---- the window: arrival, buffers, claimed and finished parts --------------------------------------------------

// Waiting with nothing to do: spin briefly, then give the core away (more ranks than cores, or other load).
struct IdleWait {
  int idle = 0;
  void wait() {
    if (++idle > 32) {
      sched_yield();
    } else {
#if defined(__SSE2__)
      _mm_pause();
#endif
    }
  }
};

class SharedWindow {
public:
  // Bytes per part: $PARADYSE_MPI_SHM_PIECE_KIB, default 512 KiB (measured with bench/comm_bench on 2 ranks at 64 MiB:
  // 256 KiB - 1 MiB within noise, smaller pieces slower: a system call and page pinning per piece and peer).
  static std::size_t piece_bytes() {
    static const std::size_t bytes = [] {
      const char* v = std::getenv("PARADYSE_MPI_SHM_PIECE_KIB");
      return std::size_t(std::clamp(v ? std::atol(v) : 512L, 4L, 1L << 20)) << 10;
    }();
    return bytes;
  }
  static constexpr std::size_t kLine = 128;  // one counter per line pair (the adjacent-line prefetcher)

  // Collective over `comm`. Null when the ranks are not all on one node, the window cannot be created, or one
  // process cannot read another's memory (process_vm_readv refused, e.g. by ptrace restrictions).
  static std::unique_ptr<SharedWindow> create(MPI_Comm comm) {
    int size = 0, rank = 0;
    MPI_Comm_size(comm, &size);
    MPI_Comm_rank(comm, &rank);
    MPI_Comm node = MPI_COMM_NULL;
    if (MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node) != MPI_SUCCESS) return nullptr;
    int node_size = 0;
    MPI_Comm_size(node, &node_size);
    MPI_Comm_free(&node);
    if (node_size != size) return nullptr;  // every rank computes the same sizes: all return null together
    auto window = std::unique_ptr<SharedWindow>(new SharedWindow());
    window->rank_ = rank;
    window->size_ = size;
    void* base = nullptr;
    int ok = MPI_Win_allocate_shared(MPI_Aint(kLines * kLine), 1, MPI_INFO_NULL, comm, &base, &window->window_) ==
             MPI_SUCCESS;
    int all_ok = 0;
    MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, comm);
    if (!all_ok) return nullptr;
    window->bases_.resize(std::size_t(size));
    window->queue_base_.assign(std::size_t(size), 0);
    for (int r = 0; r < size; ++r) {
      MPI_Aint length = 0;
      int unit = 0;
      void* pointer = nullptr;
      MPI_Win_shared_query(window->window_, r, &length, &unit, &pointer);
      window->bases_[std::size_t(r)] = static_cast<std::byte*>(pointer);
    }
    for (int line = 0; line < kLines; ++line) new (window->line(rank, line)) std::atomic<std::uint64_t>(0);
    window->pids_.resize(std::size_t(size));
    const int pid = int(getpid());
    MPI_Allgather(&pid, 1, MPI_INT, window->pids_.data(), 1, MPI_INT, comm);
    // Every rank reads a word of every other rank's memory once: single-copy transfers work, or nobody uses them.
    std::uint64_t probe = std::uint64_t(rank) + 1, seen = 0;
    std::vector<std::uint64_t> addresses(static_cast<std::size_t>(size));
    const auto mine = std::uint64_t(reinterpret_cast<std::uintptr_t>(&probe));
    MPI_Allgather(&mine, 1, MPI_UINT64_T, addresses.data(), 1, MPI_UINT64_T, comm);
    ok = 1;
    for (int r = 0; r < size && ok; ++r) {
      iovec local{&seen, sizeof seen}, remote{reinterpret_cast<void*>(addresses[std::size_t(r)]), sizeof seen};
      ok = process_vm_readv(window->pids_[std::size_t(r)], &local, 1, &remote, 1, 0) == ssize_t(sizeof seen) &&
           seen == std::uint64_t(r) + 1;
    }
    MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, comm);  // also: nobody's probe is read after this
    if (!all_ok) return nullptr;
    return window;
  }
  SharedWindow(const SharedWindow&) = delete;
  SharedWindow& operator=(const SharedWindow&) = delete;
  ~SharedWindow() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized && window_ != MPI_WIN_NULL) MPI_Win_free(&window_);
  }

  int rank() const { return rank_; }
  int size() const { return size_; }

  // Starts a collective of `parts` parts: publishes this rank's buffers and waits until every rank has published.
  void arrive(const void* in, const void* out) {
    line(rank_, kIn)->store(std::uint64_t(reinterpret_cast<std::uintptr_t>(in)), std::memory_order_relaxed);
    line(rank_, kOut)->store(std::uint64_t(reinterpret_cast<std::uintptr_t>(out)), std::memory_order_relaxed);
    line(rank_, kArrived)->store(++calls_, std::memory_order_release);
    IdleWait idle;
    for (int r = 0; r < size_; ++r)
      while (line(r, kArrived)->load(std::memory_order_acquire) < calls_) idle.wait();
  }
  // Rank r's buffers in this collective (addresses in r's process).
  std::uintptr_t in_of(int r) const { return std::uintptr_t(line(r, kIn)->load(std::memory_order_relaxed)); }
  std::uintptr_t out_of(int r) const { return std::uintptr_t(line(r, kOut)->load(std::memory_order_relaxed)); }

  // Claims the next unclaimed part (0 .. parts - 1) of rank `owner`'s queue in this collective, or returns false
  // when all are claimed. Every rank has a queue (a counter in its own lines); the counters only move on a claim,
  // so each starts a collective where the last one left it (queue_base_, the same on every rank).
  bool claim(int owner, std::uint64_t parts, std::uint64_t& part) {
    std::atomic<std::uint64_t>& next = *line(owner, kClaimed);
    const std::uint64_t base = queue_base_[std::size_t(owner)];
    std::uint64_t ticket = next.load(std::memory_order_relaxed);
    while (ticket < base + parts)
      if (next.compare_exchange_weak(ticket, ticket + 1, std::memory_order_acq_rel)) {
        part = ticket - base;
        return true;
      }
    return false;
  }
  // A part is complete (its stores visible); then, after the last claim: every part of the collective is complete
  // (parts[r]: the parts of rank r's queue; identical on every rank).
  void finished_part() {
    stream_fence();
    line(0, kFinished)->fetch_add(1, std::memory_order_acq_rel);
  }
  void wait_finished(std::span<const std::uint64_t> parts) {
    for (int r = 0; r < size_; ++r) {
      queue_base_[std::size_t(r)] += parts[std::size_t(r)];
      finished_base_ += parts[std::size_t(r)];
    }
    IdleWait idle;
    while (line(0, kFinished)->load(std::memory_order_acquire) < finished_base_) idle.wait();
  }

  // Copies between this process and rank r's (memcpy for this rank's own memory): single-copy, by the kernel.
  void read(int r, std::uintptr_t from, void* to, std::size_t bytes) const {
    if (r == rank_) return void(std::memcpy(to, reinterpret_cast<const void*>(from), bytes));
    move(r, reinterpret_cast<std::byte*>(to), from, bytes, false);
  }
  void write(int r, const void* from, std::uintptr_t to, std::size_t bytes) const {
    if (r == rank_) return void(stream_copy(reinterpret_cast<void*>(to), from, bytes));
    move(r, const_cast<std::byte*>(static_cast<const std::byte*>(from)), to, bytes, true);
  }
  // Scratch of this process for `count` pieces (kept between collectives).
  std::byte* scratch(std::size_t count) {
    if (scratch_.size() < count * piece_bytes()) scratch_.resize(count * piece_bytes());
    return scratch_.data();
  }

private:
  enum Line { kArrived = 0, kIn = 1, kOut = 2, kClaimed = 3, kFinished = 4, kLines = 5 };  // kFinished: rank 0's
  SharedWindow() = default;
  std::atomic<std::uint64_t>* line(int r, int which) const {
    return std::launder(reinterpret_cast<std::atomic<std::uint64_t>*>(bases_[std::size_t(r)] + std::size_t(which) * kLine));
  }
  void move(int r, std::byte* local, std::uintptr_t remote, std::size_t bytes, bool to_remote) const {
    while (bytes > 0) {
      iovec mine{local, bytes}, theirs{reinterpret_cast<void*>(remote), bytes};
      const ssize_t moved = to_remote ? process_vm_writev(pids_[std::size_t(r)], &mine, 1, &theirs, 1, 0)
                                      : process_vm_readv(pids_[std::size_t(r)], &mine, 1, &theirs, 1, 0);
      if (moved <= 0)
        throw CommError(fmt::format("shared-memory collective: {} {} bytes {} rank {} (pid {}) failed: {}",
                                    to_remote ? "writing" : "reading", bytes, to_remote ? "to" : "from", r,
                                    pids_[std::size_t(r)], std::strerror(errno)));
      local += moved;
      remote += std::uintptr_t(moved);
      bytes -= std::size_t(moved);
    }
  }
  MPI_Win window_ = MPI_WIN_NULL;
  int rank_ = 0, size_ = 1;
  std::vector<std::byte*> bases_;
  std::vector<int> pids_;
  std::uint64_t calls_ = 0, finished_base_ = 0;  // collectives entered; parts of the earlier collectives
  std::vector<std::uint64_t> queue_base_;          // per rank: the parts of its queue in earlier collectives
  std::vector<std::byte> scratch_;
};

// Tests only: microseconds this process sleeps after each part it executes, to make it the slow rank whose queue the
// others execute; 0 (never sleeps) unless a test sets it.
inline int shm_test_part_delay_us = 0;

// Runs a collective's parts: parts[q] in rank q's queue (identical on every rank). Every rank publishes its
// buffers, then claims and executes parts (run(q, part)): first from its own queue, then from the others'
// (q = me + 1, ...), until none is left, then waits until every part is finished. A rank that is descheduled or late does fewer parts; the others do more of its
// queue. Call only when the collective has parts (every rank decides alike).
template <class Run>
void run_parts(SharedWindow& w, const void* in, const void* out, std::span<const std::uint64_t> parts, Run&& run) {
  w.arrive(in, out);
  const int p = w.size();
  for (int i = 0; i < p; ++i) {
    const int q = (w.rank() + i) % p;
    std::uint64_t part = 0;
    while (w.claim(q, parts[std::size_t(q)], part)) {
      run(q, part);
      w.finished_part();
      if (shm_test_part_delay_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(shm_test_part_delay_us));
    }
  }
  w.wait_finished(parts);
}

// The pieces of counts[r] elements per rank: part k is piece k - first[r] of rank first[r] <= k < first[r + 1].
struct Pieces {
  std::vector<std::uint64_t> first;  // p + 1 entries
  std::size_t piece = 0;             // elements
  Pieces(std::span<const std::size_t> counts, std::size_t piece_elements) : piece(piece_elements) {
    first.push_back(0);
    for (const std::size_t c : counts) first.push_back(first.back() + (c + piece - 1) / piece);
  }
  std::uint64_t total() const { return first.back(); }
  // (rank, element offset within its chunk, elements) of part k.
  std::tuple<int, std::size_t, std::size_t> at(std::uint64_t k, std::span<const std::size_t> counts) const {
    const int r = int(std::upper_bound(first.begin(), first.end(), k) - first.begin()) - 1;
    const std::size_t begin = std::size_t(k - first[std::size_t(r)]) * piece;
    return {r, begin, std::min(piece, counts[std::size_t(r)] - begin)};
  }
};

// out: the chunks of every rank (counts[r] elements of rank r at displacements[r]); in: this rank's chunk (or that
// chunk of out: in place). Rank q's queue: the pieces of q's output. Its own parts q pulls: its own chunk copied
// locally, a piece of rank r's chunk read from r's input into scratch (in cache) and streamed into its output. A
// part of another rank's queue is pushed: from this rank's input, from this rank's output when this rank pulled that
// piece there, else read from r's input into scratch first.
template <CommElement T>
void shm_all_gather_v(SharedWindow& w, std::span<const T> in, std::span<T> out, std::span<const std::size_t> counts,
                      std::span<const std::size_t> displacements) {
  const int me = w.rank(), p = w.size();
  const Pieces pieces(counts, SharedWindow::piece_bytes() / sizeof(T));
  if (pieces.total() == 0) return;
  const std::vector<std::uint64_t> parts(std::size_t(p), pieces.total());
  std::vector<bool> pulled(pieces.total());  // this rank's own parts it executed: the piece is in its output
  run_parts(w, in.data(), out.data(), parts, [&](int q, std::uint64_t k) {
    const auto [r, begin, n] = pieces.at(k, counts);
    const std::size_t at = (displacements[std::size_t(r)] + begin) * sizeof(T), bytes = n * sizeof(T);
    const std::uintptr_t source = w.in_of(r) + begin * sizeof(T), target = w.out_of(q) + at;
    if (q == me) pulled[k] = true;
    if (q == r && target == source) return;  // rank r's own chunk in place: there already
    if (r == me) return w.write(q, reinterpret_cast<const void*>(source), target, bytes);
    // Another rank's piece for another rank: from this rank's output when this rank pulled it there (own queues
    // come first), so it is read from r's process once.
    if (q != me && pulled[k]) return w.write(q, reinterpret_cast<const std::byte*>(out.data()) + at, target, bytes);
    std::byte* staged = w.scratch(1);
    w.read(r, source, staged, bytes);
    w.write(q, staged, target, bytes);
  });
}

// Reduces elements [at, at + n) of every rank's input in rank order into `result` (this process): this rank's input
// (`mine`) in place, the others' read into this process's scratch first. stream: streaming stores into `result`.
template <CommElement T>
void reduce_remote(SharedWindow& w, const T* mine, std::size_t at, std::size_t n, T* result, ReduceOp op, bool stream) {
  const int me = w.rank(), p = w.size();
  std::byte* scratch = w.scratch(std::size_t(p));
  std::vector<const T*> sources(static_cast<std::size_t>(p));
  for (int r = 0; r < p; ++r) {
    if (r == me) {
      sources[std::size_t(r)] = mine + at;
      continue;
    }
    T* copy = reinterpret_cast<T*>(scratch + std::size_t(r) * SharedWindow::piece_bytes());
    w.read(r, w.in_of(r) + at * sizeof(T), copy, n * sizeof(T));
    sources[std::size_t(r)] = copy;
  }
  reduce_sources<T>(result, sources.data(), p, n, op, stream);
}

// Part (q, k): piece k of rank q's result, the rank-order reduction of elements [from + k * piece, ...) over every
// rank's input, written to q's output at element k * piece: reduced straight into this rank's output when q is this
// rank (streaming stores), else reduced into scratch and written to q's output.
template <CommElement T>
void reduce_piece(SharedWindow& w, const T* in, T* out, int q, std::size_t from, std::size_t begin, std::size_t n,
                  ReduceOp op) {
  if (q == w.rank()) return reduce_remote<T>(w, in, from + begin, n, out + begin, op, true);
  T* result = reinterpret_cast<T*>(w.scratch(std::size_t(w.size()) + 1) + std::size_t(w.size()) * SharedWindow::piece_bytes());
  reduce_remote<T>(w, in, from + begin, n, result, op, false);
  w.write(q, result, w.out_of(q) + begin * sizeof(T), n * sizeof(T));
}

// in: every rank's chunk (counts[r] elements at displacements[r]); out: the rank-order reduction of this rank's
// chunk over all ranks (out may be this rank's chunk of in: in place). Rank q's queue: the pieces of q's result.
template <CommElement T>
void shm_reduce_scatter_v(SharedWindow& w, std::span<const T> in, std::span<T> out, std::span<const std::size_t> counts,
                          std::span<const std::size_t> displacements, ReduceOp op) {
  const std::size_t piece = SharedWindow::piece_bytes() / sizeof(T);
  std::vector<std::uint64_t> pieces;
  for (const std::size_t c : counts) pieces.push_back((c + piece - 1) / piece);
  if (std::all_of(pieces.begin(), pieces.end(), [](std::uint64_t n) { return n == 0; })) return;
  run_parts(w, in.data(), out.data(), pieces, [&](int q, std::uint64_t k) {
    const std::size_t begin = std::size_t(k) * piece;
    reduce_piece<T>(w, in.data(), out.data(), q, displacements[std::size_t(q)], begin,
                    std::min(piece, counts[std::size_t(q)] - begin), op);
  });
}

// out = the rank-order reduction of every rank's in (out may be in: in place). One queue (rank 0's) of pieces of
// the buffer; a part reduces its piece once into the executing rank's output (ordinary stores: the piece stays in
// cache) and copies it from there to every other rank's output.
template <CommElement T>
void shm_all_reduce(SharedWindow& w, std::span<const T> in, std::span<T> out, ReduceOp op) {
  const int me = w.rank(), p = w.size();
  const std::size_t piece = SharedWindow::piece_bytes() / sizeof(T);
  const std::uint64_t pieces = (in.size() + piece - 1) / piece;
  if (pieces == 0) return;  // every rank alike
  std::vector<std::uint64_t> parts(std::size_t(p), 0);  // one queue, rank 0's
  parts[0] = pieces;
  run_parts(w, in.data(), out.data(), parts, [&](int, std::uint64_t k) {
    const std::size_t begin = std::size_t(k) * piece, n = std::min(piece, in.size() - begin);
    T* result = out.data() + begin;
    reduce_remote<T>(w, in.data(), begin, n, result, op, false);
    for (int r = 0; r < p; ++r)
      if (r != me) w.write(r, result, w.out_of(r) + begin * sizeof(T), n * sizeof(T));
  });
}

}  // namespace paradyse::mpi_detail
