// paradyse/comm/mpi_shm.hpp: the large collectives of the MPI backend through a shared-memory window within a node.
//
// OpenMPI 4.1 on one machine moves large messages slowly (measured here: reduce_scatter 0.3-1.3 GB/s and a 64 MiB
// send/recv at 1.4 GB/s, against 8 GB/s memcpy; single-copy CMA reads ran at 1-3 GB/s). So when every rank of a
// communicator is on one node, all_gather(_v), reduce_scatter(_v) and all_reduce go through a window of shared
// memory (MPI_Win_allocate_shared) instead: each rank has two slots of slot_bytes(); in rounds, every rank copies a
// segment of its data into its slot (alternating slots), the ranks meet at a barrier of shared counters, and each
// reads what it needs straight from the others' slots. Segments are small enough that the slots of all ranks stay
// in the shared last-level cache, so the staging copy costs cache bandwidth, not memory bandwidth.
//
// Reductions add in rank order, element by element (threads_detail::reduce_in_rank_order, the threads backend's
// own), so results are bitwise the threads backend's and identical on every rank and from run to run; bf16 adds in
// float and rounds once; avg divides once at the end.
//
// Slots are reused by alternating: a rank writes slot (round % 2) only after the barrier of the previous round, by
// which every rank has finished reading the slot it wrote two rounds ago. The round counter persists across calls.
// The barrier spins on one counter per rank (each rank only increments its own) and yields the core while it waits,
// so oversubscribed runs (more ranks than cores) still progress. Blocking only: the async forms stay on MPI's
// non-blocking collectives, which progress on their own.
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/comm/threads_detail.hpp"
#include "paradyse/core/error.hpp"

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <sched.h>
#include <span>
#include <vector>

namespace paradyse::mpi_detail {

class SharedWindow {
public:
  // Bytes per slot (two slots per rank): $PARADYSE_MPI_SHM_SLOT_KIB, default 16 MiB. Small slots stay in the last-level
  // cache but need a barrier per slot; on a loaded machine each barrier may wait for a descheduled peer, so fewer,
  // larger rounds won (measured with bench/comm_bench).
  static std::size_t slot_bytes() {
    static const std::size_t bytes = [] {
      const char* v = std::getenv("PARADYSE_MPI_SHM_SLOT_KIB");
      const long kib = v ? std::atol(v) : 16384;
      return std::size_t(std::clamp(kib, 64L, 1L << 20)) << 10;
    }();
    return bytes;
  }
  static constexpr std::size_t kHeaderBytes = 128;                   // this rank's barrier counter, own cache lines

  // Collective over `comm`. Null when the ranks are not all on one node or the window cannot be created.
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
    const MPI_Aint bytes = MPI_Aint(kHeaderBytes + 2 * slot_bytes());
    int ok = MPI_Win_allocate_shared(bytes, 1, MPI_INFO_NULL, comm, &base, &window->window_) == MPI_SUCCESS;
    int all_ok = 0;
    MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, comm);
    if (!all_ok) return nullptr;
    window->bases_.resize(std::size_t(size));
    for (int r = 0; r < size; ++r) {
      MPI_Aint length = 0;
      int unit = 0;
      void* pointer = nullptr;
      MPI_Win_shared_query(window->window_, r, &length, &unit, &pointer);
      window->bases_[std::size_t(r)] = static_cast<std::byte*>(pointer);
    }
    new (window->bases_[std::size_t(rank)]) std::atomic<std::uint64_t>(0);
    MPI_Barrier(comm);  // every counter is initialised before anyone reads it
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
  // Rank r's slot for `round` (alternating between its two).
  std::byte* slot(int r, std::uint64_t round) const {
    return bases_[std::size_t(r)] + kHeaderBytes + (round % 2) * slot_bytes();
  }
  std::uint64_t next_round() { return round_++; }

  // Every rank has reached this barrier (and its writes before it are visible after it).
  void barrier() {
    const std::uint64_t mine = counter(rank_).fetch_add(1, std::memory_order_acq_rel) + 1;
    for (int r = 0; r < size_; ++r) {
      int spins = 0;
      while (counter(r).load(std::memory_order_acquire) < mine) {
        if (++spins > 64) sched_yield();
        else __builtin_ia32_pause();
      }
    }
  }

private:
  SharedWindow() = default;
  std::atomic<std::uint64_t>& counter(int r) const {
    return *std::launder(reinterpret_cast<std::atomic<std::uint64_t>*>(bases_[std::size_t(r)]));
  }
  MPI_Win window_ = MPI_WIN_NULL;
  int rank_ = 0, size_ = 1;
  std::vector<std::byte*> bases_;
  std::uint64_t round_ = 0;
};

// out: the chunks of every rank (counts[r] elements of rank r at displacements[r]); in: this rank's chunk (or that
// chunk of out: in place). Rounds of slot_bytes() per rank.
template <CommElement T>
void shm_all_gather_v(SharedWindow& w, std::span<const T> in, std::span<T> out, std::span<const std::size_t> counts,
                      std::span<const std::size_t> displacements) {
  const int me = w.rank(), p = w.size();
  const std::size_t segment = SharedWindow::slot_bytes() / sizeof(T);
  const std::size_t longest = *std::max_element(counts.begin(), counts.end());
  T* mine_out = out.data() + displacements[std::size_t(me)];
  if (in.data() != mine_out && !in.empty()) std::memcpy(mine_out, in.data(), in.size_bytes());
  for (std::size_t begin = 0; begin < longest; begin += segment) {
    const std::uint64_t round = w.next_round();
    const std::size_t n_mine = begin < counts[std::size_t(me)] ? std::min(segment, counts[std::size_t(me)] - begin) : 0;
    if (n_mine) std::memcpy(w.slot(me, round), in.data() + begin, n_mine * sizeof(T));
    w.barrier();
    for (int k = 1; k < p; ++k) {  // start with the next rank, so the ranks do not all read one slot at once
      const int r = (me + k) % p;
      const std::size_t count = counts[std::size_t(r)];
      if (begin >= count) continue;
      std::memcpy(out.data() + displacements[std::size_t(r)] + begin, w.slot(r, round),
                  std::min(segment, count - begin) * sizeof(T));
    }
  }
}

// in: every rank's chunk (counts[r] elements at displacements[r]); out: the rank-order reduction of this rank's
// chunk over all ranks (out may be this rank's chunk of in: in place).
template <CommElement T>
void shm_reduce_scatter_v(SharedWindow& w, std::span<const T> in, std::span<T> out, std::span<const std::size_t> counts,
                          std::span<const std::size_t> displacements, ReduceOp op) {
  const int me = w.rank(), p = w.size();
  // Each round a rank posts one segment of every other rank's chunk: p segments per slot.
  const std::size_t segment = std::max<std::size_t>(1, SharedWindow::slot_bytes() / sizeof(T) / std::size_t(p));
  const std::size_t longest = *std::max_element(counts.begin(), counts.end());
  std::vector<const std::byte*> sources(static_cast<std::size_t>(p));
  for (std::size_t begin = 0; begin < longest; begin += segment) {
    const std::uint64_t round = w.next_round();
    for (int r = 0; r < p; ++r) {
      const std::size_t count = counts[std::size_t(r)];
      if (r == me || begin >= count) continue;
      std::memcpy(w.slot(me, round) + std::size_t(r) * segment * sizeof(T), in.data() + displacements[std::size_t(r)] + begin,
                  std::min(segment, count - begin) * sizeof(T));
    }
    w.barrier();
    const std::size_t count = counts[std::size_t(me)];
    if (begin < count) {
      const std::size_t n = std::min(segment, count - begin);
      for (int r = 0; r < p; ++r)
        sources[std::size_t(r)] = r == me ? reinterpret_cast<const std::byte*>(in.data() + displacements[std::size_t(me)] + begin)
                                          : w.slot(r, round) + std::size_t(me) * segment * sizeof(T);
      threads_detail::reduce_in_rank_order<T>(reinterpret_cast<std::byte*>(out.data() + begin), sources.data(), p, 0,
                                              n, op);
    }
  }
}

// out = the rank-order reduction of every rank's in (out may be in: in place). Each round reduces one segment of
// each rank's share of the buffer (a reduce-scatter) and hands the shares around (an all-gather) through the slots.
template <CommElement T>
void shm_all_reduce(SharedWindow& w, std::span<const T> in, std::span<T> out, ReduceOp op) {
  const int me = w.rank(), p = w.size();
  const std::size_t total = in.size();
  // A slot holds p input segments and this rank's reduced segment.
  const std::size_t segment = std::max<std::size_t>(1, SharedWindow::slot_bytes() / sizeof(T) / std::size_t(p + 1));
  const auto share_begin = [&](int r) { return total * std::size_t(r) / std::size_t(p); };
  const std::size_t longest = share_begin(1) + (total % std::size_t(p) ? 1 : 0);
  std::vector<const std::byte*> sources(static_cast<std::size_t>(p));
  for (std::size_t begin = 0; begin < longest; begin += segment) {
    const std::uint64_t round = w.next_round();
    const auto segment_of = [&](int r) -> std::size_t {  // elements of rank r's share in this round
      const std::size_t count = share_begin(r + 1) - share_begin(r);
      return begin < count ? std::min(segment, count - begin) : 0;
    };
    for (int r = 0; r < p; ++r)
      if (r != me && segment_of(r))
        std::memcpy(w.slot(me, round) + std::size_t(r) * segment * sizeof(T), in.data() + share_begin(r) + begin,
                    segment_of(r) * sizeof(T));
    w.barrier();
    if (const std::size_t n = segment_of(me)) {
      for (int r = 0; r < p; ++r)
        sources[std::size_t(r)] = r == me ? reinterpret_cast<const std::byte*>(in.data() + share_begin(me) + begin)
                                          : w.slot(r, round) + std::size_t(me) * segment * sizeof(T);
      std::byte* reduced = w.slot(me, round) + std::size_t(p) * segment * sizeof(T);
      threads_detail::reduce_in_rank_order<T>(reduced, sources.data(), p, 0, n, op);
      std::memcpy(out.data() + share_begin(me) + begin, reduced, n * sizeof(T));
    }
    w.barrier();
    for (int k = 1; k < p; ++k) {
      const int r = (me + k) % p;
      if (const std::size_t n = segment_of(r))
        std::memcpy(out.data() + share_begin(r) + begin, w.slot(r, round) + std::size_t(p) * segment * sizeof(T),
                    n * sizeof(T));
    }
  }
}

}  // namespace paradyse::mpi_detail
