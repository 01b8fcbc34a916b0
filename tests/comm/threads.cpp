// Tests of paradyse/comm/threads.hpp on thread ranks: every operation and element type on 1..8 ranks (uneven
// ragged counts for the _v forms), bitwise reproducibility of the reductions, async overlap, failure propagation,
// timeouts and mismatched calls. Expected values come from tests/comm/collective_checks.hpp (shared with MPI).
#include "paradyse/comm/threads.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/strategy/buffer_pool.hpp"

#include "comm/collective_checks.hpp"

#include <doctest/doctest.h>

#include <atomic>
#include <bit>
#include <chrono>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace pd = paradyse;
using pd::ReduceOp;
using pd::ThreadCommunicator;

namespace {

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// The messages each rank caught, by rank.
struct Caught {
  std::mutex mutex;
  std::vector<std::string> messages;
  std::vector<std::string> kinds;
  explicit Caught(int ranks) : messages(std::size_t(ranks)), kinds(std::size_t(ranks)) {}
  void record(int rank, const std::string& kind, const std::string& message) {
    std::lock_guard lock(mutex);
    kinds[std::size_t(rank)] = kind;
    messages[std::size_t(rank)] = message;
  }
  bool has(int rank) {
    std::lock_guard lock(mutex);
    return !kinds[std::size_t(rank)].empty();
  }
};

// Blocks (without communicating) until every rank of `ranks` has recorded an error, or 20 s: a rank that stays away
// from a collective without leaving the group (one that leaves is reported at once, not by the timeout).
void stay_away_until_caught(Caught& caught, std::initializer_list<int> ranks) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  for (int r : ranks)
    while (!caught.has(r) && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

// Runs f on the rank and records what it threw (Error, CommError or other), then rethrows it.
template <class F>
void recording(Caught& caught, int rank, F&& f) {
  try {
    f();
  } catch (const pd::CommError& e) {
    caught.record(rank, "CommError", e.what());
    throw;
  } catch (const pd::Error& e) {
    caught.record(rank, "Error", e.what());
    throw;
  } catch (const std::exception& e) {
    caught.record(rank, "other", e.what());
    throw;
  }
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

TEST_CASE("threads: every operation, every element type, on 1 to 8 ranks") {
  for (int ranks = 1; ranks <= 8; ++ranks) {
    CAPTURE(ranks);
    pd::run_ranks(ranks, [&](ThreadCommunicator& comm) {
      CHECK(comm.size() == ranks);
      pd::testing::check_every_operation(comm, 100 + std::uint64_t(ranks));
    });
  }
}

TEST_CASE("threads: split into uneven groups, async overlap") {
  for (int ranks : {2, 3, 5, 8}) {
    CAPTURE(ranks);
    pd::run_ranks(ranks, [&](ThreadCommunicator& comm) {
      pd::testing::check_split(comm, 7);
      pd::testing::check_overlap(comm, 9);
      // A split of a split: groups of groups.
      ThreadCommunicator halves = comm.split(comm.rank() % 2, comm.rank());
      ThreadCommunicator quarters = halves.split(halves.rank() % 2, 0);
      pd::testing::check_all_reduce<std::int64_t>(quarters, 9, 3, ReduceOp::sum, false, false);
      CHECK(quarters.describe().find("world ranks") != std::string::npos);
    });
  }
}

TEST_CASE("threads: reductions add in rank order, bitwise identical from run to run") {
  const std::size_t n = 5000;
  for (int ranks : {3, 4, 7}) {
    CAPTURE(ranks);
    // The rank-order float sum, written out: ((x0 + x1) + x2) + ...
    const auto inputs = pd::testing::inputs_of_all<float>(ranks, n, 42);
    std::vector<float> rank_order(n);
    for (std::size_t i = 0; i < n; ++i) {
      float acc = inputs[0][i];
      for (int r = 1; r < ranks; ++r) acc += inputs[std::size_t(r)][i];
      rank_order[i] = acc;
    }
    std::vector<std::vector<float>> first(static_cast<std::size_t>(ranks)), second(static_cast<std::size_t>(ranks));
    for (auto* results : {&first, &second}) {
      pd::run_ranks(ranks, [&](ThreadCommunicator& comm) {
        std::vector<float> x = inputs[std::size_t(comm.rank())], sum(n), scattered(n / std::size_t(ranks));
        comm.all_reduce(std::span<const float>(x), std::span<float>(sum), ReduceOp::sum);
        pd::testing::check_same<float>(sum, rank_order, "all_reduce in rank order");
        std::span<const float> head(x.data(), scattered.size() * std::size_t(ranks));
        comm.reduce_scatter(head, std::span<float>(scattered), ReduceOp::sum);
        pd::testing::check_same<float>(
            scattered,
            std::span<const float>(rank_order.data() + scattered.size() * std::size_t(comm.rank()), scattered.size()),
            "reduce_scatter in rank order");
        (*results)[std::size_t(comm.rank())] = sum;
      });
    }
    for (int r = 0; r < ranks; ++r)
      CHECK(std::memcmp(first[std::size_t(r)].data(), second[std::size_t(r)].data(), n * sizeof(float)) == 0);
  }
}

TEST_CASE("threads: an exception on one rank fails every other rank promptly, naming it") {
  const int ranks = 4;
  Caught caught(ranks);
  const auto start = std::chrono::steady_clock::now();
  pd::RunOptions options;
  options.timeout = std::chrono::seconds(60);  // failing by timeout instead would take a minute
  CHECK_THROWS_WITH_AS(pd::run_ranks(ranks, [&](ThreadCommunicator& comm) {
    recording(caught, comm.rank(), [&] {
      std::vector<float> x(100, 1.0f);
      comm.all_reduce(std::span<const float>(x), std::span<float>(x), ReduceOp::sum);
      if (comm.rank() == 2) throw std::runtime_error("boom on rank two");
      // The others are blocked in (or enter) the next collective.
      comm.all_reduce(std::span<const float>(x), std::span<float>(x), ReduceOp::sum);
      comm.barrier();
    });
  }, options), "boom on rank two", std::runtime_error);  // run_ranks rethrows the original exception
  CHECK(seconds_since(start) < 30.0);
  for (int r = 0; r < ranks; ++r) {
    CAPTURE(r);
    if (r == 2) {
      CHECK(caught.kinds[2] == "other");
      continue;
    }
    CHECK(caught.kinds[std::size_t(r)] == "CommError");
    CHECK(contains(caught.messages[std::size_t(r)], "rank 2 failed: boom on rank two"));
    CHECK(contains(caught.messages[std::size_t(r)], "all_reduce"));
  }
}

TEST_CASE("threads: a failure also ends pending point-to-point waits") {
  Caught caught(2);
  CHECK_THROWS_AS(pd::run_ranks(2, [&](ThreadCommunicator& comm) {
    recording(caught, comm.rank(), [&] {
      std::vector<double> x(8);
      if (comm.rank() == 0) throw std::logic_error("rank zero gives up");
      comm.recv(std::span<double>(x), 0);  // never sent
    });
  }), std::logic_error);
  CHECK(caught.kinds[1] == "CommError");
  CHECK(contains(caught.messages[1], "rank 0 failed: rank zero gives up"));
  CHECK(contains(caught.messages[1], "recv from rank 0"));
}

TEST_CASE("threads: a timeout names the operation, the group and the ranks that never arrived") {
  const int ranks = 4;
  Caught caught(ranks);
  pd::RunOptions options;
  options.timeout = std::chrono::milliseconds(300);
  const auto start = std::chrono::steady_clock::now();
  CHECK_THROWS_AS(pd::run_ranks(ranks, [&](ThreadCommunicator& comm) {
    recording(caught, comm.rank(), [&] {
      // Ranks 1 and 3 stay away (busy elsewhere); 0 and 2 wait for them in the all-gather on the world group.
      if (comm.rank() % 2 == 1) return stay_away_until_caught(caught, {0, 2});
      std::vector<std::int32_t> x(3), out(3 * ranks);
      comm.all_gather(std::span<const std::int32_t>(x), std::span<std::int32_t>(out));
    });
  }, options), pd::CommError);
  CHECK(seconds_since(start) < 20.0);
  int timed_out = 0;
  for (int r : {0, 2}) {
    CAPTURE(r);
    const std::string& message = caught.messages[std::size_t(r)];
    CHECK(caught.kinds[std::size_t(r)] == "CommError");
    CHECK(contains(message, "timeout after 0.3 s"));
    CHECK(contains(message, "all_gather"));
    CHECK(contains(message, "world ranks 0, 1, 2, 3"));
    CHECK(contains(message, "ranks 1, 3 never arrived"));
    timed_out += contains(message, "gave up") ? 0 : 1;
  }
  CHECK(timed_out >= 1);  // one timed out, the other may have given up because of it
  CHECK(caught.messages[1].empty());
  CHECK(caught.messages[3].empty());
}

TEST_CASE("threads: a timeout in a split group names the group's world ranks") {
  Caught caught(4);
  pd::RunOptions options;
  options.timeout = std::chrono::milliseconds(200);
  CHECK_THROWS_AS(pd::run_ranks(4, [&](ThreadCommunicator& comm) {
    recording(caught, comm.rank(), [&] {
      ThreadCommunicator odd_even = comm.split(comm.rank() % 2, comm.rank());
      if (comm.rank() == 3) return stay_away_until_caught(caught, {1});  // missing from the odd group {1, 3}
      if (comm.rank() % 2 == 1) odd_even.barrier();
    });
  }, options), pd::CommError);
  CHECK(contains(caught.messages[1], "barrier"));
  CHECK(contains(caught.messages[1], "world ranks 1, 3"));
  CHECK(contains(caught.messages[1], "ranks 3 never arrived"));
}

TEST_CASE("threads: mismatched sizes between ranks are reported as such, on every rank") {
  const int ranks = 3;
  Caught caught(ranks);
  CHECK_THROWS_AS(pd::run_ranks(ranks, [&](ThreadCommunicator& comm) {
    recording(caught, comm.rank(), [&] {
      std::vector<float> x(comm.rank() == 1 ? 6 : 5);
      comm.all_reduce(std::span<const float>(x), std::span<float>(x), ReduceOp::sum);
    });
  }), pd::Error);
  for (int r = 0; r < ranks; ++r) {
    CAPTURE(r);
    CHECK(caught.kinds[std::size_t(r)] != "");
    const std::string& message = caught.messages[std::size_t(r)];
    // Every rank either reports the size mismatch itself or was told another rank failed because of it.
    CHECK((contains(message, "sends 6 elements") || contains(message, "sends 5 elements")));
  }
}

TEST_CASE("threads: mismatched operations, roots, types and ragged counts are reported") {
  auto first_message = [](int ranks, auto body) {
    std::string message;
    try {
      pd::run_ranks(ranks, body);
    } catch (const std::exception& e) {
      message = e.what();
    }
    return message;
  };
  CHECK(contains(first_message(2, [](ThreadCommunicator& comm) {
          std::vector<float> x(4);
          if (comm.rank() == 0) comm.all_reduce(std::span<const float>(x), std::span<float>(x), ReduceOp::sum);
          else comm.broadcast(std::span<float>(x), 0);
        }),
                 "rank 1 called broadcast where rank 0 called all_reduce"));
  CHECK(contains(first_message(2, [](ThreadCommunicator& comm) {
          std::vector<float> x(4);
          comm.broadcast(std::span<float>(x), comm.rank());
        }),
                 "names root"));
  CHECK(contains(first_message(2, [](ThreadCommunicator& comm) {
          if (comm.rank() == 0) {
            std::vector<float> x(4);
            comm.broadcast(std::span<float>(x), 0);
          } else {
            std::vector<double> x(4);
            comm.broadcast(std::span<double>(x), 0);
          }
        }),
                 "moves f64 where rank 0 moves f32"));
  CHECK(contains(first_message(2, [](ThreadCommunicator& comm) {
          std::vector<float> x(4);
          comm.all_reduce(std::span<const float>(x), std::span<float>(x), comm.rank() ? ReduceOp::max : ReduceOp::sum);
        }),
                 "reduces with"));
  CHECK(contains(first_message(3, [](ThreadCommunicator& comm) {
          // Rank 0 sends 1 element to rank 2, which expects 2.
          std::vector<std::int64_t> send{1, 1, 1}, recv{1, 1, 1};
          if (comm.rank() == 2) recv[0] = 2;
          std::vector<float> in(3), out(comm.rank() == 2 ? 4 : 3);
          comm.all_to_all_v(std::span<const float>(in), send, std::span<float>(out), recv);
        }),
                 "rank 0 sends 1 elements to rank 2, which expects 2"));
  CHECK(contains(first_message(2, [](ThreadCommunicator& comm) {
          std::vector<std::int64_t> counts{1, std::int64_t(2 + comm.rank())};
          std::vector<float> in(std::size_t(counts[std::size_t(comm.rank())])), out(std::size_t(counts[0] + counts[1]));
          comm.all_gather_v(std::span<const float>(in), std::span<float>(out), counts);
        }),
                 "different counts"));
  CHECK(contains(first_message(2, [](ThreadCommunicator& comm) {
          std::vector<std::int32_t> x(3), y(4);
          if (comm.rank() == 0) comm.send(std::span<const std::int32_t>(x), 1);
          else comm.recv(std::span<std::int32_t>(y), 0);
        }),
                 "rank 0 sent 12 bytes to rank 1 (tag 0), which expected 16 bytes"));
}

TEST_CASE("threads: bad arguments throw Error naming the value") {
  pd::run_ranks(2, [](ThreadCommunicator& comm) {
    std::vector<float> in(4), out(5);
    CHECK_THROWS_WITH(comm.all_gather(std::span<const float>(in), std::span<float>(out)),
                      doctest::Contains("all_gather: output holds 5 elements, expected 8"));
    CHECK_THROWS_WITH(comm.reduce_scatter(std::span<const float>(in), std::span<float>(out), ReduceOp::sum),
                      doctest::Contains("reduce_scatter: input holds 4 elements, expected 10"));
    CHECK_THROWS_WITH(comm.all_to_all(std::span<const float>(in), std::span<float>(out)),
                      doctest::Contains("divisible by 2 ranks"));
    CHECK_THROWS_WITH(comm.send(std::span<const float>(in), 2), doctest::Contains("rank 2 is not in"));
    if (comm.rank() == 0)  // only the root checks its output (elsewhere the call would start a reduce)
      CHECK_THROWS_WITH(comm.reduce(std::span<const float>(in), std::span<float>(out), ReduceOp::sum, 0),
                        doctest::Contains("root's output holds 5"));
    std::vector<std::int64_t> bad{-1, 2};
    CHECK_THROWS_WITH(comm.all_gather_v(std::span<const float>(in), std::span<float>(out), bad),
                      doctest::Contains("counts[0] = -1 must be non-negative"));
    comm.barrier();  // still in step
  });
}

TEST_CASE("threads: run_ranks reports each rank's peak memory and byte counts") {
  const std::size_t n = 1 << 14;
  pd::RunReport report = pd::run_ranks(3, [&](ThreadCommunicator& comm) {
    pd::Tensor<float> x(pd::Shape{std::int64_t(n)});  // tracked by this rank's tracker
    comm.all_reduce(std::span<const float>(x.span()), x.span(), ReduceOp::sum);
  });
  REQUIRE(report.peak_bytes.size() == 3);
  for (std::size_t r = 0; r < 3; ++r) {
    CHECK(report.peak_bytes[r] >= n * sizeof(float));
    CHECK(report.stats[r].bytes_sent == 2 * 2 * n * sizeof(float) / 3);
    CHECK(report.stats[r].operations == 1);
  }
  // A per-rank cap: an allocation beyond it throws OutOfMemory, which fails the run.
  pd::RunOptions capped;
  capped.memory_cap_per_rank = 1 << 10;
  CHECK_THROWS_AS(pd::run_ranks(2, [](ThreadCommunicator&) { pd::Tensor<float> big(pd::Shape{4096}); }, capped),
                  pd::OutOfMemory);
}

TEST_CASE("threads: a sender that gives up withdraws its message (no receiver reads a dead buffer)") {
  // Rank 1's blocking send has no receive posted; it times out and unwinds, freeing its buffer. Rank 0 posts the
  // matching receive only afterwards: it must fail, not copy from rank 1's withdrawn (and freed) buffer.
  Caught caught(2);
  pd::RunOptions options;
  options.timeout = std::chrono::milliseconds(200);
  std::atomic<bool> rank0_received{false};
  CHECK_THROWS_AS(pd::run_ranks(2, [&](ThreadCommunicator& comm) {
    recording(caught, comm.rank(), [&] {
      std::vector<float> back(64, -1.0f);
      if (comm.rank() == 1) {
        auto mine = std::make_unique<std::vector<float>>(64, 2.0f);
        comm.send(std::span<const float>(*mine), 0);  // times out
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(400));  // after rank 1 gave up
        comm.recv(std::span<float>(back), 1);
        rank0_received = true;
      }
    });
  }, options), pd::CommError);
  CHECK_FALSE(rank0_received.load());
  CHECK(caught.kinds[0] == "CommError");
}

TEST_CASE("threads: pending operations may be waited for in a different order on different ranks") {
  for (int p : {2, 3, 4}) {
    pd::run_ranks(p, [&](ThreadCommunicator& comm) {
      const int r = comm.rank();
      std::vector<float> mine(5, float(r + 1)), gathered(std::size_t(5 * p)), summed(5);
      pd::Request gather = comm.all_gather_async(std::span<const float>(mine), std::span<float>(gathered));
      pd::Request sum = comm.all_reduce_async(std::span<const float>(mine), std::span<float>(summed), ReduceOp::sum);
      if (r % 2) {  // odd ranks wait for the later operation first
        sum.wait();
        gather.wait();
      } else {
        gather.wait();
        sum.wait();
      }
      for (int j = 0; j < p; ++j) CHECK(gathered[std::size_t(5 * j)] == float(j + 1));
      CHECK(summed[4] == float(p * (p + 1) / 2));
    });
  }
}

TEST_CASE("threads: a send completes once its receive is posted, whoever waits first") {
  // Every rank waits for its send before its receive: matched sends and receives copy on the first wait.
  for (int p : {1, 2, 3}) {
    pd::run_ranks(p, [&](ThreadCommunicator& comm) {
      const int r = comm.rank(), n = comm.size();
      std::vector<double> out(7, double(r)), in(7, -1.0);
      pd::Request received = comm.recv_async(std::span<double>(in), (r + n - 1) % n, 3);
      pd::Request sent = comm.send_async(std::span<const double>(out), (r + 1) % n, 3);
      sent.wait();
      received.wait();
      CHECK(in[6] == double((r + n - 1) % n));
    });
  }
}

TEST_CASE("threads: a rank that skips one of a sequence of identical collectives is reported as out of step, on every rank") {
  const int ranks = 4;
  Caught caught(ranks);
  pd::RunOptions options;
  options.timeout = std::chrono::seconds(60);  // reported at once, not by the timeout
  std::vector<float> rank1_results;
  const auto start = std::chrono::steady_clock::now();
  std::string thrown;
  try {
    pd::run_ranks(ranks, [&](ThreadCommunicator& comm) {
      recording(caught, comm.rank(), [&] {
        for (int i = 0; i < 4; ++i) {
          if (comm.rank() == 1 && i == 2) continue;  // rank 1 skips all_reduce #2
          std::vector<float> x(16, float(10 * (i + 1)));
          comm.all_reduce(std::span<const float>(x), std::span<float>(x), ReduceOp::sum);
          if (comm.rank() == 1) rank1_results.push_back(x[0]);
        }
      });
    }, options);
  } catch (const pd::CommError& e) {
    thrown = e.what();
  }
  CHECK(seconds_since(start) < 30.0);
  CAPTURE(thrown);
  CHECK(contains(thrown, "collectives out of step on group #0 (world ranks 0, 1, 2, 3)"));
  for (int r : {0, 2, 3}) {
    CAPTURE(r);
    const std::string& message = caught.messages[std::size_t(r)];
    CAPTURE(message);
    CHECK(caught.kinds[std::size_t(r)] == "CommError");
    // Each rank reports it itself (or was told that another rank failed because of it).
    CHECK(contains(message, "collectives out of step"));
    CHECK(contains(message, "rank 1 (world rank 1) left the group after posting 3 collectives (#0 to #2, the last: all_reduce)"));
  }
  CHECK(contains(caught.messages[0] + caught.messages[2] + caught.messages[3], "this rank is in all_reduce #3"));
  // Rank 1's function returned: its third all_reduce (40s) met the others' #2 (30s) and gave 3 * 30 + 40 = 130,
  // another collective's data, which nothing at the meeting can tell; its run still ends in the error, so run_ranks
  // throws instead of returning.
  CHECK(caught.messages[1].empty());
  CHECK(rank1_results == std::vector<float>{40, 80, 130});
}

TEST_CASE("threads: ranks that leave while others wait for them are reported at once, naming them") {
  const int ranks = 4;
  Caught caught(ranks);
  pd::RunOptions options;
  options.timeout = std::chrono::seconds(60);
  const auto start = std::chrono::steady_clock::now();
  CHECK_THROWS_AS(pd::run_ranks(ranks, [&](ThreadCommunicator& comm) {
    recording(caught, comm.rank(), [&] {
      if (comm.rank() % 2 == 1) return;  // ranks 1 and 3 leave
      std::vector<std::int32_t> x(3), out(3 * ranks);
      comm.all_gather(std::span<const std::int32_t>(x), std::span<std::int32_t>(out));
    });
  }, options), pd::CommError);
  CHECK(seconds_since(start) < 30.0);
  const std::string& message = caught.messages[0];
  CAPTURE(message);
  CHECK(contains(message, "this rank is in all_gather #0"));
  // Ranks 1 and 3 both left; which one a waiting rank names first depends on the order the threads ran in.
  CHECK((contains(message, "rank 1 (world rank 1) left the group after posting no collective") ||
         contains(message, "rank 3 (world rank 3) left the group after posting no collective")));
  // A split group: rank 3 destroys its handle on the odd group {1, 3} while rank 1 waits in its barrier.
  Caught split_caught(4);
  CHECK_THROWS_AS(pd::run_ranks(4, [&](ThreadCommunicator& comm) {
    recording(split_caught, comm.rank(), [&] {
      ThreadCommunicator odd_even = comm.split(comm.rank() % 2, comm.rank());
      if (comm.rank() == 3) return;
      if (comm.rank() % 2 == 1) odd_even.barrier();
    });
  }, options), pd::CommError);
  CHECK(contains(split_caught.messages[1], "out of step on group #"));
  CHECK(contains(split_caught.messages[1], "(world ranks 1, 3)"));
  CHECK(contains(split_caught.messages[1], "rank 1 (world rank 3) left the group after posting no collective"));
  CHECK(seconds_since(start) < 30.0);
}

TEST_CASE("threads: tensors, pooled buffers and pools made on a rank may outlive run_ranks (issue 15)") {
  // Each rank's tracker is gone when run_ranks returns; what was allocated through it keeps its counts alive and
  // gives its memory back to them when destroyed later (heap-use-after-free under ASan before).
  std::vector<pd::Tensor<float>> kept(3);
  std::vector<std::unique_ptr<pd::BufferPool>> pools(3);
  std::vector<pd::PooledBuffer<float>> loans(3);
  pd::run_ranks(3, [&](ThreadCommunicator& comm) {
    const auto r = std::size_t(comm.rank());
    pd::Tensor<float> t(pd::Shape{1000 + 10 * std::int64_t(r)});
    t.fill(float(r));
    kept[r] = std::move(t);
    pools[r] = std::make_unique<pd::BufferPool>();
    loans[r] = pools[r]->acquire<float>(pd::Shape{256});
    pd::PooledBuffer<float> returned = pools[r]->acquire<float>(pd::Shape{4096});  // cached in the pool
  });
  for (std::size_t r = 0; r < 3; ++r) {
    CHECK(kept[r](0) == float(r));
    CHECK(kept[r].tracker().in_use() > 0);
  }
  // Destroyed after the trackers: the counts they return to are still alive, and they reach zero.
  const pd::MemoryTracker::Handle first = kept[0].tracker();
  kept.clear();
  loans.clear();
  CHECK(first.in_use() > 0);  // rank 0's pool still caches a buffer
  pools.clear();
  CHECK(first.in_use() == 0);
}

TEST_CASE("threads: all_to_all with some ranks in place and others not, chunks larger than the exchange block") {
  // In place runs as pairwise exchanges (no staged copy): every mix of in-place and out-of-place ranks, on uneven
  // group sizes, with chunks of several 32 KiB blocks plus a ragged tail.
  for (int p : {2, 3, 5}) {
    for (int mask = 0; mask < (1 << p); mask += (p == 5 ? 7 : 1)) {
      CAPTURE(p);
      CAPTURE(mask);
      const std::size_t chunk = 20011;  // floats: 78 KiB
      pd::run_ranks(p, [&](ThreadCommunicator& comm) {
        const int me = comm.rank();
        const bool in_place = (mask >> me) & 1;
        auto mine = pd::testing::input_of<float>(me, chunk * std::size_t(p), 41);
        std::vector<float> want;
        for (int r = 0; r < p; ++r) {
          const auto x = pd::testing::input_of<float>(r, chunk * std::size_t(p), 41);
          want.insert(want.end(), x.begin() + std::ptrdiff_t(std::size_t(me) * chunk),
                      x.begin() + std::ptrdiff_t(std::size_t(me + 1) * chunk));
        }
        std::vector<float> out(mine.size(), -7.0f);
        const std::span<float> target = in_place ? std::span<float>(mine) : std::span<float>(out);
        comm.all_to_all(std::span<const float>(mine), target);
        pd::testing::check_same<float>(target, want, fmt::format("all_to_all rank {} of {}, in place {}", me, p, in_place));
      });
    }
  }
}

TEST_CASE("threads: link pacing holds each transfer to its emulated time, keeps results, and overlaps compute") {
  using Clock = std::chrono::steady_clock;
  const auto seconds_since = [](Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); };
  const std::size_t n = 1 << 16;  // floats per rank: 256 KiB
  // all_gather on 2 ranks moves (p - 1) / p of 512 KiB = 256 KiB per rank: 60 ms at 4.2 MB/s, plus 2 x 5 ms.
  pd::LinkPacing pacing{.launch_s = 0.005, .alpha_s = 0.005, .collective_s_per_byte = 0.060 / double(n * 4),
                        .p2p_s_per_byte = 0.040 / double(n * 4)};
  pd::RunOptions options;
  options.pacing = pacing;
  pd::run_ranks(2, [&](ThreadCommunicator& comm) {
    CHECK(comm.link_pacing() == pacing);
    const auto mine = pd::testing::input_of<float>(comm.rank(), n, 5);
    std::vector<float> gathered(2 * n), want;
    for (int r = 0; r < 2; ++r) {
      const auto x = pd::testing::input_of<float>(r, n, 5);
      want.insert(want.end(), x.begin(), x.end());
    }
    comm.barrier();
    auto start = Clock::now();
    comm.all_gather(std::span<const float>(mine), std::span<float>(gathered));
    const double blocking = seconds_since(start);
    CHECK(blocking >= 0.070);  // 5 + 5 + 60 ms, never less
    CHECK(blocking < 0.070 + 1.0);
    pd::testing::check_same<float>(gathered, want, "paced all_gather");

    // Posted, then 50 ms of other work, then waited: about max(70, 50) ms, not their sum.
    comm.barrier();
    start = Clock::now();
    pd::Request pending = comm.all_gather_async(std::span<const float>(mine), std::span<float>(gathered));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    pending.wait();
    const double overlapped = seconds_since(start);
    CHECK(overlapped >= 0.070);
    CHECK(overlapped < 0.070 + 0.045);  // well under 120 ms: the work hid under the transfer
    pd::testing::check_same<float>(gathered, want, "paced all_gather_async");

    // A ring shift: one step, 256 KiB at the point-to-point rate: 5 + 5 + 40 ms.
    std::vector<float> shifted(n);
    comm.barrier();
    start = Clock::now();
    comm.shift(std::span<const float>(mine), std::span<float>(shifted), 1);
    CHECK(seconds_since(start) >= 0.050);
    pd::testing::check_same<float>(shifted, pd::testing::input_of<float>(1 - comm.rank(), n, 5), "paced shift");

    // A split group keeps the pacing; switching it off makes the same call fast again.
    ThreadCommunicator alone = comm.split(comm.rank(), 0);
    CHECK(alone.link_pacing() == pacing);
    comm.barrier();
    comm.set_link_pacing({});
    comm.barrier();
    start = Clock::now();
    comm.all_gather(std::span<const float>(mine), std::span<float>(gathered));
    CHECK(seconds_since(start) < 0.060);
    CHECK_THROWS_AS(comm.set_link_pacing({.alpha_s = -1}), pd::Error);
  }, options);
}
