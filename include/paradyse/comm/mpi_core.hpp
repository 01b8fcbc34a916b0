// paradyse/comm/mpi_core.hpp: what every operation of the MPI communicator (comm/mpi.hpp) goes through, as its base
// class MpiCore: the rank's handle state (group, byte counts, timeout, validation, collective engine), the sequence
// numbers and watchdog of each wait, requests of up to two MPI requests, the blocking or non-blocking run of a
// collective, the choice of the shared-memory engine with its measured crossover (mpi_shm.hpp), and the argument
// checks. The public operations (mpi.hpp) check their buffers, count their bytes and call these.
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/comm/mpi_detail.hpp"
#include "paradyse/comm/mpi_h.hpp"
#include "paradyse/comm/mpi_shm.hpp"
#include "paradyse/comm/mpi_types.hpp"
#include "paradyse/comm/mpi_watchdog.hpp"
#include "paradyse/core/dtype.hpp"
#include "paradyse/core/error.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace paradyse::mpi_detail {

// One rank's handle on an MPI communicator, without its operations. Move-only; owns (and frees) its MPI_Comm.
class MpiCore {
public:
  static constexpr int kMaxUserTag = 32766;  // user tags are 0..kMaxUserTag; shift uses the tag above

  explicit MpiCore(MPI_Comm owned) : state_(std::make_unique<CommState>(owned)) {}
  MpiCore(MpiCore&&) noexcept = default;
  MpiCore& operator=(MpiCore&&) noexcept = default;

  int rank() const noexcept { return state_->rank; }
  int size() const noexcept { return state_->size; }
  int world_rank() const { return state_->world_ranks[std::size_t(state_->rank)]; }
  CommStats stats() const noexcept { return state_->stats; }
  void reset_stats() noexcept { state_->stats = {}; }
  std::string describe() const { return state_->description; }
  MPI_Comm native() const noexcept { return state_->comm; }

  // How long a wait may take before the watchdog aborts the job (default PARADYSE_COMM_TIMEOUT, 300 s).
  std::chrono::milliseconds timeout() const noexcept { return state_->timeout; }
  void set_timeout(std::chrono::milliseconds timeout) {
    check(timeout.count() > 0, "timeout {} ms must be positive", timeout.count());
    state_->timeout = timeout;
  }
  // Which implementation runs the blocking all_gather(_v), reduce_scatter(_v) and all_reduce (mpi_shm.hpp): MPI's
  // own, the shared-memory window (when every rank is on one node; otherwise MPI's), or automatic: shared memory
  // from a message size measured on this machine (the first large collective of a group measures both, about a
  // tenth of a second, once per group size and process). Set the same on every rank. Default automatic, or
  // $PARADYSE_MPI_COLLECTIVES = mpi | shm | auto. The async forms always use MPI's non-blocking collectives.
  enum class Engine : std::uint8_t { mpi, shared_memory, automatic };
  Engine collective_engine() const noexcept { return Engine(state_->engine); }
  void set_collective_engine(Engine engine) noexcept { state_->engine = std::uint8_t(engine); }
  // The measured crossovers in bytes (nccl-tests sizes: all_gather's output, reduce_scatter's input, all_reduce's
  // buffer) from which shared memory is used, for all_gather, reduce_scatter and all_reduce; -1: never (MPI was
  // faster at every measured size, or the ranks span nodes). Collective: measures when not yet measured.
  std::array<std::int64_t, 3> collective_crossover_bytes() {
    enter();
    if (!shared_window()) return {-1, -1, -1};
    if (!state_->crossover_bytes) measure_crossover();
    return *state_->crossover_bytes;
  }

  // Cross-rank checks of every collective's sizes (set the same on every rank).
  bool validating() const noexcept { return state_->validate; }
  void set_validate(bool on) noexcept { state_->validate = on; }

protected:
  static void require_initialized() {
    int initialized = 0, finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    check(initialized && !finalized, "MPI is not running (initialised {}, finalised {}): create an MpiSession first",
          bool(initialized), bool(finalized));
  }
  static MPI_Comm duplicate(MPI_Comm comm) {
    require_initialized();
    MPI_Comm copy = MPI_COMM_NULL;
    const int rc = MPI_Comm_dup(comm, &copy);
    if (rc != MPI_SUCCESS) throw CommError(fmt::format("MPI_Comm_dup failed: {}", error_text(rc)));
    return copy;
  }

  int count_of(std::size_t n, std::string_view op) const { return to_int_count(n, op, "the count"); }
  void check_peer(std::string_view op, int peer) const {
    check(peer >= 0 && peer < size(), "{}: rank {} is not in {} (size {})", op, peer, describe(), size());
  }
  static void check_tag(std::string_view op, int tag) {
    check(tag >= 0 && tag <= kMaxUserTag, "{}: tag {} is outside 0..{}", op, tag, kMaxUserTag);
  }
  std::pair<int, int> ring_peers(int offset) const {
    const int n = size();
    return {((rank() + offset) % n + n) % n, ((rank() - offset) % n + n) % n};
  }
  void count_bytes(std::size_t sent, std::size_t received) {
    state_->stats.bytes_sent += sent;
    state_->stats.bytes_received += received;
    ++state_->stats.operations;
  }

  // A received message has exactly `expected` elements; otherwise Error naming both sizes.
  template <CommElement T>
  void check_received(int rc, const MPI_Status& status, std::size_t expected, int source, const char* op) const {
    mpi_detail::check_received<T>(state_.get(), rc, status, expected, source, op);
  }

  // Enters the next collective: same sequence number on every rank of the group.
  std::uint64_t enter() {
    const std::uint64_t sequence = ++state_->sequence;
    state_->board->arrive(sequence);
    return sequence;
  }
  Watchdog::Watch watch_wait(const char* op, std::uint64_t sequence, int peer = -1) const {
    return Watchdog::instance().watch(state_->timeout, &describe_wait, state_.get(), op,
                                                  sequence, peer);
  }

  // The Request of up to two MPI requests; `after(statuses)` runs once they completed. When `first_receives`, the
  // first request is a receive whose error (a truncation) `after` reports from its status; other errors throw here.
  template <class After>
  Request pending(const char* op, std::uint64_t sequence, int peer, std::array<MPI_Request, 2> requests,
                  bool first_receives, After after) {
    auto* state = state_.get();
    return Request([state, op, sequence, peer, requests, first_receives, after = std::move(after)]() mutable {
      std::array<MPI_Status, 2> statuses{};
      const int count = requests[1] == MPI_REQUEST_NULL ? 1 : 2;
      int rc = MPI_SUCCESS;
      {
        auto watch = Watchdog::instance().watch(state->timeout, &describe_wait, state, op,
                                                            sequence, peer);
        rc = MPI_Waitall(count, requests.data(), statuses.data());
      }
      if (rc == MPI_ERR_IN_STATUS) {
        for (int i = 0; i < count; ++i)
          if (!(i == 0 && first_receives)) state->check_rc(statuses[std::size_t(i)].MPI_ERROR, op);
      } else {
        state->check_rc(rc, op);
        for (auto& status : statuses) status.MPI_ERROR = MPI_SUCCESS;
      }
      after(statuses.data());
    });
  }

  // Runs a collective: start(request) calls the blocking MPI function when request is null, the non-blocking one
  // otherwise; after() completes the operation (avg division, copy out of a staging buffer).
  template <bool Async, class Start, class After>
  Request collective(const char* op, Start start, After after) {
    const std::uint64_t sequence = enter();
    if constexpr (Async) {
      MPI_Request request = MPI_REQUEST_NULL;
      state_->check_rc(start(&request), op);
      return pending(op, sequence, -1, {request, MPI_REQUEST_NULL}, false, [after](const MPI_Status*) mutable { after(); });
    } else {
      {
        auto watch = watch_wait(op, sequence);
        state_->check_rc(start(nullptr), op);
      }
      after();
      return {};
    }
  }
  static constexpr auto kNothing = [] {};

  // ---- shared-memory collectives (mpi_shm.hpp) ------------------------------------------------------------------
  enum SharedOp { kSharedAllGather = 0, kSharedReduceScatter = 1, kSharedAllReduce = 2 };
  static constexpr std::size_t kMinSharedBytes = std::size_t(16) << 10;  // automatic never goes below

  // The window, made on first use (collective: every rank reaches this in the same collective with the same size).
  SharedWindow* shared_window() {
    if (!state_->shared_tried) {
      state_->shared_tried = true;
      if (size() > 1) state_->shared = SharedWindow::create(state_->comm);
    }
    return state_->shared.get();
  }

  // Whether this blocking collective of `bytes` (identical on every rank) goes through shared memory.
  bool use_shared(SharedOp op, std::size_t bytes) {
    if (size() == 1 || state_->engine == std::uint8_t(Engine::mpi)) return false;
    if (state_->engine == std::uint8_t(Engine::automatic) && bytes < kMinSharedBytes) return false;
    if (!shared_window()) return false;
    if (state_->engine == std::uint8_t(Engine::shared_memory)) return true;
    if (!state_->crossover_bytes) measure_crossover();
    const std::int64_t from = (*state_->crossover_bytes)[op];
    return from >= 0 && std::int64_t(bytes) >= from;
  }

  // Runs fn (a shared-memory collective) as collective `op`: sequence number, watchdog.
  template <class Fn>
  void run_shared(const char* op, Fn&& fn) {
    const std::uint64_t sequence = enter();
    auto watch = watch_wait(op, sequence);
    fn();
  }
  // The shared-memory all-gather and reduce-scatter of chunks of `sizes` elements (one per rank), as collective `op`.
  template <CommElement T>
  void shared_all_gather(const char* op, std::span<const T> in, std::span<T> out, const std::vector<std::size_t>& sizes) {
    const std::vector<std::size_t> displacements = displacements_of(sizes);
    run_shared(op, [&] { shm_all_gather_v<T>(*state_->shared, in, out, sizes, displacements); });
  }
  template <CommElement T>
  void shared_reduce_scatter(const char* op, std::span<const T> in, std::span<T> out,
                             const std::vector<std::size_t>& sizes, ReduceOp reduce) {
    const std::vector<std::size_t> displacements = displacements_of(sizes);
    run_shared(op, [&] { shm_reduce_scatter_v<T>(*state_->shared, in, out, sizes, displacements, reduce); });
  }

  // Times MPI's and the shared-memory all_gather, reduce_scatter and all_reduce at 64 KiB .. 16 MiB (slowest rank,
  // fastest of kCrossoverRounds calls of each, the two alternated so that both see the same load) and keeps, per
  // collective, the smallest measured size from which shared memory wins at every larger measured size (above the
  // largest, its verdict there holds). Rank 0's verdict is broadcast, so every rank
  // decides alike; it is kept per group size for the process, and a later group of that size adopts it when all its
  // ranks have it (they agree on the largest), so a group whose ranks measured apart never decides differently.
  static constexpr int kCrossoverRounds = 4;
  void measure_crossover() {
    using Crossover = std::array<std::int64_t, 3>;
    static std::vector<std::pair<int, Crossover>> known;  // per group size; the ranks' own threads never share it
    const auto found = std::find_if(known.begin(), known.end(), [&](const auto& e) { return e.first == size(); });
    int have = found != known.end(), all_have = 0;
    MPI_Allreduce(&have, &all_have, 1, MPI_INT, MPI_MIN, state_->comm);
    if (all_have) {
      Crossover agreed{};
      MPI_Allreduce(found->second.data(), agreed.data(), 3, MPI_INT64_T, MPI_MAX, state_->comm);
      state_->crossover_bytes = agreed;
      return;
    }
    const std::vector<std::int64_t> sizes = {std::int64_t(64) << 10, std::int64_t(256) << 10, std::int64_t(1) << 20,
                                             std::int64_t(4) << 20, std::int64_t(16) << 20};
    SharedWindow& w = *state_->shared;
    const int n = size();
    Crossover result{};
    for (int op = 0; op < 3; ++op) {
      std::vector<bool> shared_wins;
      for (const std::int64_t bytes : sizes) {
        const std::size_t count = std::size_t(bytes) / sizeof(float) / std::size_t(n) * std::size_t(n);
        std::vector<float> whole(count, 1.0f), other(count), part(count / std::size_t(n), 1.0f);
        std::vector<std::size_t> counts(std::size_t(n), count / std::size_t(n)), displacements;
        for (int r = 0; r < n; ++r) displacements.push_back(std::size_t(r) * (count / std::size_t(n)));
        const auto run = [&](bool shared) {
          if (op == kSharedAllGather) {
            if (shared) shm_all_gather_v<float>(w, part, other, counts, displacements);
            else MPI_Allgather(part.data(), int(part.size()), MPI_FLOAT, other.data(), int(part.size()), MPI_FLOAT, state_->comm);
          } else if (op == kSharedReduceScatter) {
            if (shared) shm_reduce_scatter_v<float>(w, whole, part, counts, displacements, ReduceOp::sum);
            else MPI_Reduce_scatter_block(whole.data(), part.data(), int(part.size()), MPI_FLOAT, MPI_SUM, state_->comm);
          } else {
            if (shared) shm_all_reduce<float>(w, whole, other, ReduceOp::sum);
            else MPI_Allreduce(whole.data(), other.data(), int(count), MPI_FLOAT, MPI_SUM, state_->comm);
          }
        };
        // The slowest rank's time of one call.
        const auto time = [&](bool shared) {
          MPI_Barrier(state_->comm);
          const double start = MPI_Wtime();
          run(shared);
          double mine = MPI_Wtime() - start, slowest = 0;
          MPI_Allreduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, state_->comm);
          return slowest;
        };
        run(false);
        run(true);
        // Alternated, so both see the same load (other jobs on a shared machine); fastest of each.
        double mpi = 1e30, shared = 1e30;
        for (int r = 0; r < kCrossoverRounds; ++r) {
          mpi = std::min(mpi, time(false));
          shared = std::min(shared, time(true));
        }
        shared_wins.push_back(shared < mpi);
      }
      std::int64_t from = -1;
      for (std::size_t i = sizes.size(); i-- > 0 && shared_wins[i];) from = sizes[i];
      result[std::size_t(op)] = from;
    }
    MPI_Bcast(result.data(), 3, MPI_INT64_T, 0, state_->comm);
    known.emplace_back(size(), result);
    state_->crossover_bytes = result;
  }
  static std::vector<std::size_t> to_sizes(std::span<const std::int64_t> counts) {
    return std::vector<std::size_t>(counts.begin(), counts.end());
  }
  static std::vector<std::size_t> displacements_of(const std::vector<std::size_t>& counts) {
    std::vector<std::size_t> d(counts.size());
    for (std::size_t r = 1; r < counts.size(); ++r) d[r] = d[r - 1] + counts[r - 1];
    return d;
  }

  // The send buffer of an exchange (all_to_all(_v)): MPI_IN_PLACE when in place, else a copy of `in` when it overlaps
  // `out` (kept alive by `staged` until completion), else `in` itself.
  template <CommElement T>
  static const void* send_buffer(std::span<const T> in, std::span<T> out, bool in_place,
                                 std::shared_ptr<Scratch<T>>& staged) {
    if (in_place) return MPI_IN_PLACE;
    if (!overlaps(in, out)) return in.data();
    staged = std::make_shared<Scratch<T>>(in.size());
    std::memcpy(staged->span().data(), in.data(), in.size_bytes());
    return staged->span().data();
  }

  // Every rank passed the same signature (only when validating); otherwise Error on every rank.
  void validate(const char* op, Signature mine) {
    if (state_->validate) validate_signature(*state_, op, mine);
  }
  template <CommElement T>
  static Signature signature(std::uint64_t count, ReduceOp op = ReduceOp::sum, int root = 0) {
    return {0, std::int64_t(dtype_of<T>()), std::int64_t(op), root, count};
  }
  template <CommElement T>
  static void check_reducible() {
    static_assert(!std::is_same_v<T, std::byte>, "raw bytes cannot be reduced: reduce a numeric element type");
  }

  std::unique_ptr<CommState> state_;
};

}  // namespace paradyse::mpi_detail
