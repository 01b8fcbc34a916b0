// Tests of paradyse/comm/mpi.hpp, run by mpiexec with 2 and 4 processes: every operation and element type, in place
// and out of place, blocking and async, on the world and on split groups of uneven sizes (1 and size-1 ranks),
// against expected values computed independently (tests/comm/collective_checks.hpp, shared with the threads tests);
// the same through the shared-memory collectives (mpi_shm.hpp) on ragged multi-round sizes, bitwise in rank order.
#include "paradyse/comm/mpi.hpp"

#include "comm/collective_checks.hpp"

#include <doctest/doctest.h>

#include <array>
#include <numeric>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

namespace pd = paradyse;
using pd::MpiCommunicator;
using pd::ReduceOp;

namespace {

// Small shared-memory pieces (64 KiB, read once at the first window), so the shared-memory collectives below have many
// parts even on test-sized buffers; an explicit setting from the environment wins.
const bool small_shared_slots = (setenv("PARADYSE_MPI_SHM_PIECE_KIB", "64", 0), true);

// Error messages are compared by substring.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no exception)";
}

}  // namespace

TEST_CASE("mpi: the world communicator") {
  MpiCommunicator world = MpiCommunicator::world();
  int size = 0, rank = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  CHECK(world.size() == size);
  CHECK(world.rank() == rank);
  CHECK(world.world_rank() == rank);
  CHECK(world.describe().find("world ranks 0, 1") != std::string::npos);
  CHECK(world.timeout() == pd::comm_timeout());
}

TEST_CASE("mpi: every operation on the world") {
  MpiCommunicator world = MpiCommunicator::world();
  pd::testing::check_every_operation(world, 11);
}

TEST_CASE("mpi: every operation on uneven split groups") {
  MpiCommunicator world = MpiCommunicator::world();
  // Rank 0 alone (a group of one) and the others together (size - 1: 1 or 3 ranks).
  MpiCommunicator part = world.split(world.rank() == 0 ? 0 : 1, world.rank());
  CHECK(part.size() == (world.rank() == 0 ? 1 : world.size() - 1));
  pd::testing::check_every_operation(part, 23);
  pd::testing::check_split(world, 5);
}

TEST_CASE("mpi: the shared-memory collectives: every operation, on the world and on uneven split groups") {
  MpiCommunicator world = MpiCommunicator::world();
  world.set_collective_engine(MpiCommunicator::Engine::shared_memory);
  pd::testing::check_every_operation(world, 13);
  MpiCommunicator part = world.split(world.rank() == 0 ? 0 : 1, world.rank());
  part.set_collective_engine(MpiCommunicator::Engine::shared_memory);
  pd::testing::check_every_operation(part, 29);
  pd::testing::check_overlap(world, 37);
}

TEST_CASE("mpi: shared-memory collectives over many rounds and ragged counts, bitwise in rank order") {
  MpiCommunicator world = MpiCommunicator::world();
  world.set_collective_engine(MpiCommunicator::Engine::shared_memory);
  const int p = world.size(), me = world.rank();
  // Counts of several slot rounds (pieces of 64 KiB here: $PARADYSE_MPI_SHM_PIECE_KIB), a few elements, and none.
  std::vector<std::int64_t> counts;
  for (int r = 0; r < p; ++r) counts.push_back(r % 3 == 0 ? 300001 + r : r % 3 == 1 ? 7 : 0);
  if (p == 2) counts[1] = 140003;
  const std::size_t total = std::size_t(std::accumulate(counts.begin(), counts.end(), std::int64_t(0)));
  const std::size_t offset = pd::testing::offset_of(counts, me);
  std::vector<std::vector<float>> inputs;
  for (int r = 0; r < p; ++r) inputs.push_back(pd::testing::input_of<float>(r, total, 71));
  // The rank-order float sum, written out: ((x0 + x1) + x2) + ...
  std::vector<float> sum(total);
  for (std::size_t i = 0; i < total; ++i) {
    float acc = inputs[0][i];
    for (int r = 1; r < p; ++r) acc += inputs[std::size_t(r)][i];
    sum[i] = acc;
  }
  for (const bool in_place : {false, true}) {
    CAPTURE(in_place);
    // all_gather_v: rank r's chunk is its input's first counts[r] elements.
    std::vector<float> gathered(total, -9.0f), want_gathered;
    for (int r = 0; r < p; ++r)
      want_gathered.insert(want_gathered.end(), inputs[std::size_t(r)].begin(),
                           inputs[std::size_t(r)].begin() + std::ptrdiff_t(counts[std::size_t(r)]));
    std::span<const float> chunk(inputs[std::size_t(me)].data(), std::size_t(counts[std::size_t(me)]));
    if (in_place) {
      std::copy(chunk.begin(), chunk.end(), gathered.begin() + std::ptrdiff_t(offset));
      chunk = std::span<const float>(gathered.data() + offset, chunk.size());
    }
    world.all_gather_v(chunk, std::span<float>(gathered), std::span<const std::int64_t>(counts));
    pd::testing::check_same<float>(gathered, want_gathered, "all_gather_v through shared memory");
    // reduce_scatter_v: bitwise the rank-order sum of this rank's part.
    std::vector<float> in = inputs[std::size_t(me)], scattered(static_cast<std::size_t>(counts[std::size_t(me)]));
    const std::span<float> out = in_place ? std::span<float>(in.data() + offset, scattered.size()) : std::span<float>(scattered);
    world.reduce_scatter_v(std::span<const float>(in), out, std::span<const std::int64_t>(counts), ReduceOp::sum);
    pd::testing::check_same<float>(out, std::span<const float>(sum.data() + offset, out.size()),
                                   "reduce_scatter_v through shared memory, rank order");
    // all_reduce: bitwise the rank-order sum everywhere.
    std::vector<float> reduced(total), buffer = inputs[std::size_t(me)];
    const std::span<float> target = in_place ? std::span<float>(buffer) : std::span<float>(reduced);
    world.all_reduce(std::span<const float>(buffer), target, ReduceOp::sum);
    pd::testing::check_same<float>(target, sum, "all_reduce through shared memory, rank order");
  }
  // The same through MPI's own collectives, for comparison: equal within float rounding (MPI's order is its own).
  world.set_collective_engine(MpiCommunicator::Engine::mpi);
  std::vector<float> reduced(total);
  world.all_reduce(std::span<const float>(inputs[std::size_t(me)]), std::span<float>(reduced), ReduceOp::sum);
  std::vector<std::vector<float>> all(inputs.begin(), inputs.end());
  pd::testing::check_reduced<float>(reduced, pd::testing::reduce_reference(all, ReduceOp::sum, 0, total),
                                    "all_reduce through MPI");
}

TEST_CASE("mpi: shared-memory collectives when one rank is late: the others execute its parts, same bits") {
  MpiCommunicator world = MpiCommunicator::world();
  world.set_collective_engine(MpiCommunicator::Engine::shared_memory);
  const int p = world.size(), me = world.rank();
  // Odd, uneven counts over many 64 KiB pieces; the last rank arrives 30 ms late to every collective (the others wait
  // for it to publish its buffers) and then sleeps 3 ms after each part it executes, so the others claim nearly all
  // parts, its own queue included, reading its input and writing its output from their processes.
  pd::mpi_detail::shm_test_part_delay_us = me == p - 1 ? 3000 : 0;
  std::vector<std::int64_t> counts;
  for (int r = 0; r < p; ++r) counts.push_back(40001 + 9973 * r);
  const std::size_t total = std::size_t(std::accumulate(counts.begin(), counts.end(), std::int64_t(0)));
  const std::size_t offset = pd::testing::offset_of(counts, me);
  std::vector<std::vector<float>> inputs;
  for (int r = 0; r < p; ++r) inputs.push_back(pd::testing::input_of<float>(r, total, 83));
  const auto late = [&] {
    if (me == p - 1) std::this_thread::sleep_for(std::chrono::milliseconds(30));
  };
  for (const ReduceOp op : {ReduceOp::sum, ReduceOp::max, ReduceOp::avg}) {
    CAPTURE(pd::name_of(op));
    // The rank-order reduction, written out as the threads backend computes it.
    std::vector<float> want(total);
    for (std::size_t i = 0; i < total; ++i) {
      float acc = inputs[0][i];
      for (int r = 1; r < p; ++r) acc = op == ReduceOp::max ? std::max(acc, inputs[std::size_t(r)][i]) : acc + inputs[std::size_t(r)][i];
      want[i] = op == ReduceOp::avg ? acc / float(p) : acc;
    }
    std::vector<float> buffer = inputs[std::size_t(me)];
    late();
    world.all_reduce(std::span<const float>(buffer), std::span<float>(buffer), op);  // in place
    pd::testing::check_same<float>(buffer, want, "all_reduce with a late rank");
    std::vector<float> scattered(static_cast<std::size_t>(counts[std::size_t(me)]));
    late();
    world.reduce_scatter_v(std::span<const float>(inputs[std::size_t(me)]), std::span<float>(scattered),
                           std::span<const std::int64_t>(counts), op);
    pd::testing::check_same<float>(scattered, std::span<const float>(want.data() + offset, scattered.size()),
                                   "reduce_scatter_v with a late rank");
  }
  std::vector<float> gathered(total), want_gathered;
  for (int r = 0; r < p; ++r)
    want_gathered.insert(want_gathered.end(), inputs[std::size_t(r)].begin(),
                         inputs[std::size_t(r)].begin() + std::ptrdiff_t(counts[std::size_t(r)]));
  late();
  world.all_gather_v(std::span<const float>(inputs[std::size_t(me)].data(), std::size_t(counts[std::size_t(me)])),
                     std::span<float>(gathered), std::span<const std::int64_t>(counts));
  pd::testing::check_same<float>(gathered, want_gathered, "all_gather_v with a late rank");
  // bf16 and int64 through the generic rank-order reduction: bf16 sums in float and rounds once.
  std::vector<pd::bf16> halves(total), halves_out(total);
  for (std::size_t i = 0; i < total; ++i) halves[i] = pd::bf16(inputs[std::size_t(me)][i]);
  late();
  world.all_reduce(std::span<const pd::bf16>(halves), std::span<pd::bf16>(halves_out), ReduceOp::sum);
  for (std::size_t i = 0; i < total; i += 997) {
    float acc = 0;
    for (int r = 0; r < p; ++r) acc += float(pd::bf16(inputs[std::size_t(r)][i]));
    CHECK(float(halves_out[i]) == float(pd::bf16(acc)));
  }
  pd::mpi_detail::shm_test_part_delay_us = 0;
}

namespace {

// The rank-order reduction the threads backend computes, written out: acc = x0 (op) x1 (op) ... in the accumulation
// type (float for bf16, which rounds once at the end).
template <pd::CommElement T>
std::vector<T> rank_order(const std::vector<std::vector<T>>& inputs, ReduceOp op, std::size_t begin, std::size_t n) {
  using Acc = std::conditional_t<std::is_same_v<T, pd::bf16>, float, T>;
  std::vector<T> out(n);
  for (std::size_t i = 0; i < n; ++i) {
    Acc acc = Acc(inputs[0][begin + i]);
    for (std::size_t r = 1; r < inputs.size(); ++r)
      acc = op == ReduceOp::max ? std::max(acc, Acc(inputs[r][begin + i])) : Acc(acc + Acc(inputs[r][begin + i]));
    out[i] = T(acc);
  }
  return out;
}

// all_gather_v, reduce_scatter_v (sum, max) and all_reduce through shared memory, in place and out of place, with
// uneven counts of about `n` elements per rank (one rank none when p > 2), bitwise against the rank-order reference.
template <pd::CommElement T>
void check_shared_forms(MpiCommunicator& comm, std::size_t n, std::uint64_t seed) {
  const int p = comm.size(), me = comm.rank();
  std::vector<std::int64_t> counts;
  for (int r = 0; r < p; ++r) counts.push_back(p > 2 && r == 1 ? 0 : std::int64_t(n + std::size_t(r) * 3));
  const std::size_t total = std::size_t(std::accumulate(counts.begin(), counts.end(), std::int64_t(0)));
  const std::size_t offset = pd::testing::offset_of(counts, me), mine = std::size_t(counts[std::size_t(me)]);
  std::vector<std::vector<T>> inputs;
  for (int r = 0; r < p; ++r) inputs.push_back(pd::testing::input_of<T>(r, total, seed));
  const std::string type = pd::testing::type_name<T>();
  for (const bool in_place : {false, true}) {
    CAPTURE(in_place);
    std::vector<T> want_gathered;
    for (int r = 0; r < p; ++r)
      want_gathered.insert(want_gathered.end(), inputs[std::size_t(r)].begin() + std::ptrdiff_t(pd::testing::offset_of(counts, r)),
                           inputs[std::size_t(r)].begin() + std::ptrdiff_t(pd::testing::offset_of(counts, r + 1)));
    std::vector<T> gathered(total, pd::testing::sentinel<T>());
    std::span<const T> chunk(inputs[std::size_t(me)].data() + offset, mine);
    if (in_place) {
      std::copy(chunk.begin(), chunk.end(), gathered.begin() + std::ptrdiff_t(offset));
      chunk = std::span<const T>(gathered.data() + offset, mine);
    }
    comm.all_gather_v(chunk, std::span<T>(gathered), std::span<const std::int64_t>(counts));
    pd::testing::check_same<T>(gathered, want_gathered, "shared all_gather_v " + type);
    for (const ReduceOp op : {ReduceOp::sum, ReduceOp::max}) {
      CAPTURE(pd::name_of(op));
      std::vector<T> in = inputs[std::size_t(me)], scattered(mine, pd::testing::sentinel<T>());
      const std::span<T> out = in_place ? std::span<T>(in.data() + offset, mine) : std::span<T>(scattered);
      comm.reduce_scatter_v(std::span<const T>(in), out, std::span<const std::int64_t>(counts), op);
      pd::testing::check_same<T>(out, rank_order(inputs, op, offset, mine), "shared reduce_scatter_v " + type);
      std::vector<T> buffer = inputs[std::size_t(me)], reduced(total, pd::testing::sentinel<T>());
      const std::span<T> target = in_place ? std::span<T>(buffer) : std::span<T>(reduced);
      comm.all_reduce(std::span<const T>(buffer), target, op);
      pd::testing::check_same<T>(target, rank_order(inputs, op, 0, total), "shared all_reduce " + type);
    }
  }
}

template <pd::CommElement T>
void check_shared_sizes(MpiCommunicator& comm, std::uint64_t seed) {
  const std::size_t piece = pd::mpi_detail::SharedWindow::piece_bytes() / sizeof(T);
  for (const std::size_t n : {std::size_t(1), piece - 1, piece, piece + 1, 2 * piece + 5}) {
    CAPTURE(n);
    check_shared_forms<T>(comm, n, seed + n);
  }
}

}  // namespace

TEST_CASE("mpi: shared-memory collectives with a slow rank: its queue executed by the others, same bits, every type") {
  MpiCommunicator world = MpiCommunicator::world();
  // The last rank sleeps after each part it executes, so the others take most of its queue (and its pieces are
  // read from and written to its process by theirs); on every rank of the world, then of a group of size - 1.
  for (int group = 0; group < 2; ++group) {
    MpiCommunicator comm = group == 0 ? world.split(0, world.rank()) : world.split(world.rank() == 0 ? 0 : 1, world.rank());
    if (comm.size() < 2) continue;
    CAPTURE(comm.size());
    comm.set_collective_engine(MpiCommunicator::Engine::shared_memory);
    pd::mpi_detail::shm_test_part_delay_us = comm.rank() == comm.size() - 1 ? 2000 : 0;
    check_shared_sizes<float>(comm, 101);
    check_shared_sizes<double>(comm, 103);
    check_shared_sizes<pd::bf16>(comm, 107);
    check_shared_sizes<std::int32_t>(comm, 109);
    check_shared_sizes<std::int64_t>(comm, 113);
    pd::mpi_detail::shm_test_part_delay_us = 0;
  }
}

TEST_CASE("mpi: the measured crossover is one of the measured sizes (or never) and the same on every rank") {
  MpiCommunicator world = MpiCommunicator::world();
  CHECK(world.collective_engine() == MpiCommunicator::Engine::automatic);
  const std::array<std::int64_t, 3> crossover = world.collective_crossover_bytes();
  for (const std::int64_t bytes : crossover) {
    CAPTURE(bytes);
    CHECK((bytes == -1 || bytes == (64 << 10) || bytes == (256 << 10) || bytes == (1 << 20) || bytes == (4 << 20) ||
           bytes == (16 << 20)));
  }
  std::vector<std::int64_t> everyone(3 * std::size_t(world.size()));
  world.all_gather(std::span<const std::int64_t>(crossover), std::span<std::int64_t>(everyone));
  for (int r = 0; r < world.size(); ++r)
    for (int i = 0; i < 3; ++i) CHECK(everyone[std::size_t(3 * r + i)] == crossover[std::size_t(i)]);
  // A second group of the same size adopts the verdict without measuring again, and agrees with it.
  MpiCommunicator again = world.split(0, world.rank());
  CHECK(again.collective_crossover_bytes() == crossover);
}

TEST_CASE("mpi: async operations overlap with compute and with other collectives") {
  MpiCommunicator world = MpiCommunicator::world();
  pd::testing::check_overlap(world, 31);
  // Unlike the threads backend, MPI lets ranks complete pending operations in different orders.
  std::vector<float> a(1000, float(world.rank())), b(1000), c(1000 * std::size_t(world.size()));
  pd::Request reduce = world.all_reduce_async(std::span<const float>(a), std::span<float>(b), ReduceOp::max);
  pd::Request gather = world.all_gather_async(std::span<const float>(a), std::span<float>(c));
  if (world.rank() % 2) {
    reduce.wait();
    gather.wait();
  } else {
    gather.wait();
    reduce.wait();
  }
  CHECK(b[999] == float(world.size() - 1));
  CHECK(c[999 + 1000 * std::size_t(world.size() - 1)] == float(world.size() - 1));
}

TEST_CASE("mpi: a request left unwaited completes in its destructor") {
  MpiCommunicator world = MpiCommunicator::world();
  std::vector<std::int64_t> x(7, 1), y(7);
  { pd::Request r = world.all_reduce_async(std::span<const std::int64_t>(x), std::span<std::int64_t>(y), ReduceOp::sum); }
  CHECK(y[6] == world.size());
}

TEST_CASE("mpi: bad arguments throw Error naming the value, before any communication") {
  MpiCommunicator world = MpiCommunicator::world();
  std::vector<float> in(4), out(5);
  CHECK(error_of([&] { world.all_gather(std::span<const float>(in), std::span<float>(out)); })
            .find("all_gather: output holds 5 elements") != std::string::npos);
  CHECK(error_of([&] { world.all_reduce(std::span<const float>(in), std::span<float>(out), ReduceOp::sum); })
            .find("input holds 4 elements but output holds 5") != std::string::npos);
  CHECK(error_of([&] { world.broadcast(std::span<float>(in), world.size()); }).find("is not in") != std::string::npos);
  CHECK(error_of([&] { world.send(std::span<const float>(in), 0, -3); }).find("tag -3") != std::string::npos);
  std::vector<std::int64_t> counts(std::size_t(world.size()), -1);
  CHECK(error_of([&] { world.all_gather_v(std::span<const float>(in), std::span<float>(out), counts); })
            .find("must be non-negative") != std::string::npos);
  // Overlap that is not the in-place form.
  std::vector<float> buffer(8 * std::size_t(world.size()));
  CHECK(error_of([&] {
          world.all_gather(std::span<const float>(buffer.data() + 1, 2), std::span<float>(buffer.data(), 2 * std::size_t(world.size())));
        }).find("overlaps") != std::string::npos);
  CHECK(error_of([&] { world.split(-1, 0); }).find("color -1") != std::string::npos);
  CHECK(error_of([&] { world.set_timeout(std::chrono::milliseconds(0)); }).find("must be positive") != std::string::npos);
  world.barrier();  // every rank is still in step
}

TEST_CASE("mpi: counts beyond MPI's int range are refused") {
  CHECK(error_of([] { pd::mpi_detail::to_int_count(std::size_t(1) << 31, "all_gather", "the count"); })
            .find("exceeds MPI's int count limit") != std::string::npos);
  CHECK(pd::mpi_detail::to_int_count(std::size_t(INT_MAX), "x", "y") == INT_MAX);
}

TEST_CASE("mpi: a receive of the wrong size is reported on the receiver") {
  MpiCommunicator world = MpiCommunicator::world();
  if (world.size() < 2) return;
  std::vector<std::int32_t> three(3, 7), four(4);
  if (world.rank() == 0) {
    world.send(std::span<const std::int32_t>(three), 1, 1);  // fewer than expected
    world.send(std::span<const std::int32_t>(three), 1, 2);  // more than expected
  } else if (world.rank() == 1) {
    CHECK(error_of([&] { world.recv(std::span<std::int32_t>(four), 0, 1); })
              .find("rank 0 sent 3 elements to rank 1, which expected 4") != std::string::npos);
    std::vector<std::int32_t> two(2);
    CHECK(error_of([&] { world.recv_async(std::span<std::int32_t>(two), 0, 2).wait(); })
              .find("rank 0 sent more than the 2 elements rank 1 expected") != std::string::npos);
  }
  world.barrier();
}

TEST_CASE("mpi: with validation on, mismatched collectives throw on every rank") {
  MpiCommunicator world = MpiCommunicator::world();
  world.set_validate(true);
  const int me = world.rank(), p = world.size();
  // Sizes differ on the last rank.
  std::vector<float> x(me == p - 1 ? 5 : 4), y(x.size());
  CHECK(error_of([&] { world.all_reduce(std::span<const float>(x), std::span<float>(y), ReduceOp::sum); })
            .find(fmt::format("all_reduce: rank {} passes 5 elements where rank 0 passes 4", p - 1)) != std::string::npos);
  // Different operations.
  CHECK(error_of([&] {
          if (me == 0) world.all_reduce(std::span<const float>(x), std::span<float>(y), ReduceOp::sum);
          else world.broadcast(std::span<float>(y), 0);
        }).find("rank 1 called broadcast where rank 0 called all_reduce") != std::string::npos);
  // Different reduction operators and roots.
  CHECK(error_of([&] {
          world.all_reduce(std::span<const float>(x.data(), 4), std::span<float>(y.data(), 4),
                           me == 0 ? ReduceOp::sum : ReduceOp::max);
        }).find("reduces with max where rank 0 uses sum") != std::string::npos);
  // all_to_all_v: what rank 0 sends to rank 1 differs from what rank 1 expects.
  std::vector<std::int64_t> send_counts(std::size_t(p), 1), recv_counts(static_cast<std::size_t>(p), 1);
  if (me == 1) recv_counts[0] = 2;
  std::vector<float> in(static_cast<std::size_t>(p)), out(std::size_t(p) + (me == 1 ? 1 : 0));
  CHECK(error_of([&] {
          world.all_to_all_v(std::span<const float>(in), send_counts, std::span<float>(out), recv_counts);
        }).find("rank 0 sends 1 elements to rank 1, which expects 2") != std::string::npos);
  // Matching calls go through, and the communicator is still usable.
  std::vector<float> ones(4, 1.0f), sum(4);
  world.all_reduce(std::span<const float>(ones), std::span<float>(sum), ReduceOp::sum);
  CHECK(sum[3] == float(p));
  pd::testing::check_all_to_all_v<double>(world, 3, false);
}

TEST_CASE("mpi: a split communicator inherits the timeout and validation, and frees its MPI_Comm") {
  MpiCommunicator world = MpiCommunicator::world();
  world.set_timeout(std::chrono::seconds(77));
  world.set_validate(true);
  for (int round = 0; round < 100; ++round) {  // more than the 64 arrival boards: each is given back
    MpiCommunicator part = world.split(world.rank() % 2, 0);
    CHECK(part.timeout() == std::chrono::seconds(77));
    CHECK(part.validating());
    part.barrier();
  }
  MpiCommunicator moved = world.split(0, world.rank());
  MpiCommunicator target = std::move(moved);
  CHECK(target.size() == world.size());
  target.barrier();
}
