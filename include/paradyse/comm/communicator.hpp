// paradyse/comm/communicator.hpp: the Communicator concept shared by every backend (threads, mpi, nccl, cuda_local).
//
// Buffers are spans of elements; counts are in elements. A collective is called by every rank of the group in the
// same order. Blocking forms return when this rank's part is complete; `*_async` forms return a Request whose
// wait() completes it, so the caller can compute in between (the send buffer must stay untouched and alive until
// then). In-place use: pass the same span as input and output (for all_gather: the input is this rank's chunk of
// the output). Chunk r of a gathered or scattered buffer belongs to rank r of the group.
//
// Failure semantics: an exception on one rank makes every other rank's pending and later operations throw
// CommError naming the failed rank; every wait gives up after a timeout (PARADYSE_COMM_TIMEOUT seconds, default
// 300) with a message naming the operation, the group and the ranks that never arrived.
#pragma once

#include "paradyse/core/dtype.hpp"
#include "paradyse/core/error.hpp"

#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <span>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace paradyse {

enum class ReduceOp : std::uint8_t { sum, max, avg };

constexpr std::string_view name_of(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return "sum";
    case ReduceOp::max: return "max";
    case ReduceOp::avg: return "avg";
  }
  return "?";
}

// An element type the communicators move (f32, f64, bf16, i32, i64 and raw bytes).
template <class T>
concept CommElement = std::same_as<T, float> || std::same_as<T, double> || std::same_as<T, bf16> ||
                      std::same_as<T, std::int32_t> || std::same_as<T, std::int64_t> || std::same_as<T, std::byte>;

// Bytes moved by one rank, for benchmarks and for checking the cost model's communication volumes.
struct CommStats {
  std::uint64_t bytes_sent = 0;
  std::uint64_t bytes_received = 0;
  std::uint64_t operations = 0;
};

namespace comm_detail {
// The counts of a v-collective (all_gather_v, reduce_scatter_v, all_to_all_v): one per rank of a group of `ranks`,
// none negative; otherwise Error naming `op`.
inline void check_counts(const char* op, std::span<const std::int64_t> counts, int ranks) {
  check(counts.size() == std::size_t(ranks), "{}: {} counts given, expected one per rank ({})", op, counts.size(),
        ranks);
  for (std::size_t r = 0; r < counts.size(); ++r)
    check(counts[r] >= 0, "{}: counts[{}] = {} must be non-negative", op, r, counts[r]);
}
// sum(counts), in elements.
inline std::size_t total(std::span<const std::int64_t> counts) {
  std::size_t n = 0;
  for (auto c : counts) n += std::size_t(c);
  return n;
}
}  // namespace comm_detail

// The pending completion of an asynchronous operation. wait() is idempotent; destroying a Request that was not
// waited for waits (errors then surface on the next operation, since a destructor must not throw).
// Two ways to complete: any callable (std::function), or a plain function of two words of state,
// complete(context, argument), which costs no type erasure (the symbolic communicator of dry runs posts thousands).
class Request {
public:
  using PlainCompletion = void (*)(void* context, std::int64_t argument);

  Request() = default;
  explicit Request(std::function<void()> complete) : complete_(std::move(complete)) {}
  Request(PlainCompletion complete, void* context, std::int64_t argument) noexcept
      : plain_{complete, context, argument} {}
  Request(Request&& other) noexcept
      : complete_(std::exchange(other.complete_, nullptr)), plain_(std::exchange(other.plain_, Plain{})) {}
  Request& operator=(Request&& other) noexcept {
    if (this != &other) {
      finish_quietly();
      complete_ = std::exchange(other.complete_, nullptr);
      plain_ = std::exchange(other.plain_, Plain{});
    }
    return *this;
  }
  Request(const Request&) = delete;
  Request& operator=(const Request&) = delete;
  ~Request() { finish_quietly(); }

  void wait() {
    if (plain_.complete) {
      const Plain plain = std::exchange(plain_, Plain{});
      plain.complete(plain.context, plain.argument);
      return;
    }
    if (auto complete = std::exchange(complete_, nullptr)) complete();
  }
  bool pending() const noexcept { return plain_.complete != nullptr || bool(complete_); }

private:
  struct Plain {
    PlainCompletion complete = nullptr;
    void* context = nullptr;
    std::int64_t argument = 0;
  };
  void finish_quietly() noexcept {
    if (!pending()) return;
    try {
      wait();
    } catch (...) {
    }
  }
  std::function<void()> complete_;
  Plain plain_;
};

// The timeout every wait uses: PARADYSE_COMM_TIMEOUT seconds from the environment, default 300.
inline std::chrono::milliseconds comm_timeout() {
  static const std::chrono::milliseconds timeout = [] {
    if (const char* text = std::getenv("PARADYSE_COMM_TIMEOUT")) {
      char* end = nullptr;
      const double seconds = std::strtod(text, &end);
      if (end != text && seconds > 0) return std::chrono::milliseconds(std::int64_t(seconds * 1000));
    }
    return std::chrono::milliseconds(300'000);
  }();
  return timeout;
}

template <class C>
concept Communicator = requires(C& c, const C& cc, std::span<const float> in, std::span<float> out,
                                std::span<const std::int64_t> counts, int peer, ReduceOp op) {
  { cc.rank() } -> std::convertible_to<int>;
  { cc.size() } -> std::convertible_to<int>;
  { cc.stats() } -> std::convertible_to<CommStats>;
  c.all_gather(in, out);                      // out: [size * in.size()]
  c.all_gather_v(in, out, counts);            // out: [sum(counts)], counts[r] from rank r
  c.reduce_scatter(in, out, op);              // in: [size * out.size()]
  c.reduce_scatter_v(in, out, counts, op);    // in: [sum(counts)], rank r keeps counts[r]
  c.all_reduce(in, out, op);
  c.all_to_all(in, out);                      // equal chunks of in.size() / size
  c.all_to_all_v(in, counts, out, counts);    // send counts, receive counts
  c.broadcast(out, peer);                     // from root = peer
  c.reduce(in, out, op, peer);                // to root = peer (out used on the root only)
  c.send(in, peer);
  c.recv(out, peer);
  c.shift(in, out, peer);                     // send to rank + offset, receive from rank - offset (mod size)
  c.barrier();
  { c.all_gather_async(in, out) } -> std::same_as<Request>;
  { c.reduce_scatter_async(in, out, op) } -> std::same_as<Request>;
  { c.all_gather_v_async(in, out, counts) } -> std::same_as<Request>;
  { c.reduce_scatter_v_async(in, out, counts, op) } -> std::same_as<Request>;
  { c.all_reduce_async(in, out, op) } -> std::same_as<Request>;
  { c.all_to_all_async(in, out) } -> std::same_as<Request>;
  { c.broadcast_async(out, peer) } -> std::same_as<Request>;
  { c.reduce_async(in, out, op, peer) } -> std::same_as<Request>;
  { c.send_async(in, peer) } -> std::same_as<Request>;
  { c.recv_async(out, peer) } -> std::same_as<Request>;
  { c.shift_async(in, out, peer) } -> std::same_as<Request>;
  { c.split(peer, peer) } -> std::same_as<C>;  // (color, key): the ranks of one color, ordered by key then rank
};

// Element by element, the largest of every rank's `values`, in place (every rank passes as many); every rank gets the
// same: per piece of a serving step its slowest rank's time (serve/clock.hpp's synchronised CpuClock).
template <Communicator C>
void max_over_ranks(C& comm, std::span<double> values) {
  const std::vector<double> mine(values.begin(), values.end());
  comm.all_reduce(std::span<const double>(mine), values, ReduceOp::max);
}
// The largest of every rank's `mine`: the slowest rank's time of a measurement (cost/calibrate.hpp) or of a serving
// step (serve/clock.hpp's CpuClock).
template <Communicator C>
double max_over_ranks(C& comm, double mine) {
  max_over_ranks(comm, std::span<double>(&mine, 1));
  return mine;
}

// The blocking collectives of a backend whose blocking form is its async form waited for at once (threads, nccl,
// and cuda_local through threads): `class X : public BlockingCollectives<X>` gives X all_gather(...) =
// all_gather_async(...).wait() and so on, for the collectives and shift (send and recv differ between backends).
// The MPI backend has blocking forms of its own (its shared-memory collectives are blocking only).
template <class Derived>
class BlockingCollectives {
  template <class T>
  using In = std::type_identity_t<std::span<const T>>;  // deduced from the output span, so a mutable span converts
  Derived& self() { return static_cast<Derived&>(*this); }

public:
  template <CommElement T> void all_gather(In<T> in, std::span<T> out) { self().all_gather_async(in, out).wait(); }
  template <CommElement T> void all_gather_v(In<T> in, std::span<T> out, std::span<const std::int64_t> counts) {
    self().all_gather_v_async(in, out, counts).wait();
  }
  template <CommElement T> void reduce_scatter(In<T> in, std::span<T> out, ReduceOp op) {
    self().reduce_scatter_async(in, out, op).wait();
  }
  template <CommElement T>
  void reduce_scatter_v(In<T> in, std::span<T> out, std::span<const std::int64_t> counts, ReduceOp op) {
    self().reduce_scatter_v_async(in, out, counts, op).wait();
  }
  template <CommElement T> void all_reduce(In<T> in, std::span<T> out, ReduceOp op) {
    self().all_reduce_async(in, out, op).wait();
  }
  template <CommElement T> void all_to_all(In<T> in, std::span<T> out) { self().all_to_all_async(in, out).wait(); }
  template <CommElement T>
  void all_to_all_v(In<T> in, std::span<const std::int64_t> send_counts, std::span<T> out,
                    std::span<const std::int64_t> recv_counts) {
    self().all_to_all_v_async(in, send_counts, out, recv_counts).wait();
  }
  template <CommElement T> void broadcast(std::span<T> buffer, int root) { self().broadcast_async(buffer, root).wait(); }
  template <CommElement T> void reduce(In<T> in, std::span<T> out, ReduceOp op, int root) {
    self().reduce_async(in, out, op, root).wait();
  }
  template <CommElement T> void shift(In<T> in, std::span<T> out, int offset = 1) {
    self().shift_async(in, out, offset).wait();
  }
};

}  // namespace paradyse
