// Tests of paradyse/comm/mpi_watchdog.hpp: the arrival board names the ranks that have not entered an operation,
// the watchdog stays quiet for waits that finish, and (run alone by ctest, since they end the job) a timeout and a
// failed rank abort every process with a message naming the operation, the group and the missing or failed rank,
// and a process killed mid-collective ends the whole job within the timeout.
#include "paradyse/comm/mpi.hpp"

#include <doctest/doctest.h>

#include <chrono>
#include <csignal>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace pd = paradyse;
using pd::MpiCommunicator;

namespace {
bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }
}  // namespace

TEST_CASE("mpi watchdog: the arrival board names the ranks that have not arrived") {
  MpiCommunicator world = MpiCommunicator::world();  // creates the process's boards
  const int p = world.size(), me = world.rank();
  std::vector<int> world_ranks(static_cast<std::size_t>(p));
  for (int r = 0; r < p; ++r) world_ranks[std::size_t(r)] = r;
  {
    pd::mpi_detail::ArrivalBoard board(world.native(), world_ranks, me);
    board.arrive(std::uint64_t(me) + 1);  // rank r has entered operations 1..r+1
    world.barrier();
    CHECK(contains(board.describe_missing(1, world_ranks), "every rank on this node arrived"));
    CHECK(contains(board.describe_missing(2, world_ranks), "world ranks 0 never arrived"));
    std::string all_but_last;
    for (int r = 0; r + 1 < p; ++r) all_but_last += (r ? ", " : "") + std::to_string(r);
    CHECK(contains(board.describe_missing(std::uint64_t(p), world_ranks), "world ranks " + all_but_last + " never arrived"));
    world.barrier();  // nobody releases the board while others still read it
  }
  // The boards are reused: many communicators in turn each get one.
  for (int i = 0; i < 80; ++i) {
    pd::mpi_detail::ArrivalBoard board(world.native(), world_ranks, me);
    board.arrive(1);
    world.barrier();
    CHECK(contains(board.describe_missing(1, world_ranks), "every rank on this node arrived"));
    world.barrier();
  }
}

TEST_CASE("mpi watchdog: the report of a stalled wait") {
  MpiCommunicator world = MpiCommunicator::world();
  MPI_Comm self = MPI_COMM_NULL;
  MPI_Comm_dup(MPI_COMM_SELF, &self);
  pd::mpi_detail::CommState state(self);  // a group of one, owning `self`
  const std::string collective = pd::mpi_detail::describe_wait(&state, "all_gather", 3, -1);
  CHECK(contains(collective, "all_gather (collective #3) on MPI group of 1 (world ranks " + std::to_string(world.rank()) + ")"));
  CHECK(contains(collective, "never arrived"));
  const std::string p2p = pd::mpi_detail::describe_wait(&state, "recv", 0, 0);
  CHECK(contains(p2p, "recv with rank 0 (world rank " + std::to_string(world.rank()) + ")"));
}

TEST_CASE("mpi watchdog: waits that finish in time are never reported") {
  auto& dog = pd::mpi_detail::Watchdog::instance();
  auto describe = [](const void*, const char*, std::uint64_t, int) { return std::string("must not fire"); };
  for (int i = 0; i < 100; ++i) {
    auto watch = dog.watch(std::chrono::milliseconds(100), describe, nullptr, "test", 0);
  }
  {
    auto long_one = dog.watch(std::chrono::seconds(100), describe, nullptr, "test", 0);
    auto short_one = dog.watch(std::chrono::milliseconds(150), describe, nullptr, "test", 0);  // an earlier deadline
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // past every deadline: still alive
  CHECK(true);
}

// ---- run alone by ctest (mpi_timeout_np3, mpi_failure_np2): each ends the whole job -------------------------------------

TEST_CASE("mpi: a timeout aborts the job naming the missing ranks" * doctest::skip()) {
  MpiCommunicator world = MpiCommunicator::world();
  world.set_timeout(std::chrono::milliseconds(500));
  if (world.rank() == world.size() - 1) return;  // never arrives at the barrier
  world.barrier();
  FAIL("the barrier cannot complete without the last rank");
}

TEST_CASE("mpi: a failed rank aborts the job naming it" * doctest::skip()) {
  pd::run_mpi([](MpiCommunicator& world) {
    world.barrier();
    if (world.rank() == 1) throw std::runtime_error("rank one broke");
    std::vector<float> x(16);
    world.all_reduce(std::span<const float>(x), std::span<float>(x), pd::ReduceOp::sum);  // waits for rank 1
    FAIL("the all-reduce cannot complete without rank 1");
  });
}

// Run alone by ctest (mpi_killed_np2): rank 1 is killed (SIGKILL: no handler, no MPI_Abort of its own) while rank 0
// waits in a collective of a running sequence. The job must end within the test's timeout, by mpirun noticing the
// dead process or by rank 0's watchdog (5 s) aborting the job; ctest judges what mpirun prints.
TEST_CASE("mpi: a killed process ends the job" * doctest::skip()) {
  MpiCommunicator world = MpiCommunicator::world();
  world.set_timeout(std::chrono::seconds(5));
  std::vector<float> x(1 << 16, 1.0f), y(x.size());
  for (int step = 0; step < 1000; ++step) {
    if (world.rank() == 1 && step == 10) {
      // Mid-sequence, with its part of the next all-reduce posted: the peer is inside the collective.
      pd::Request pending = world.all_reduce_async(std::span<const float>(x), std::span<float>(y), pd::ReduceOp::sum);
      std::raise(SIGKILL);
    }
    world.all_reduce(std::span<const float>(x), std::span<float>(y), pd::ReduceOp::sum);
  }
  FAIL("the all-reduces cannot complete without rank 1");
}
