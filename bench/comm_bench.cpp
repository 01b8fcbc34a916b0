// bench/comm_bench: collective bandwidth of the communicator backends, nccl-tests style.
//
//   comm_bench                                  threads backend, 2 and 4 ranks, 4 KiB .. 256 MiB per rank
//   mpirun -np 4 comm_bench --backend mpi       MPI backend on the launched processes: raw OpenMPI (the backend's
//                                               Engine::mpi) beside ours (Engine::automatic), and a goal table
//   comm_bench --ranks 2,8 --max 64M --ops all_gather,all_to_all --reps 7
//   comm_bench --help                           every flag with its range and default (generated from parse())
//
// For each collective, size and form (out of place, in place) it prints the median time and the nccl-tests
// bandwidths: algbw = S / time, where S is the per-rank size of the nccl-tests "size" column (all_gather: the
// gathered output; reduce_scatter: the input; all_to_all, all_reduce, broadcast, reduce, shift: the buffer), and
// busbw = algbw x factor: (n-1)/n for all_gather, reduce_scatter and all_to_all, 2(n-1)/n for all_reduce, 1 for
// broadcast, reduce and shift (nccl-tests' sendrecv). The ceiling is single-thread memcpy bandwidth (copied bytes per
// second), measured first in the same run; the summary compares the threads backend's all_gather and all_to_all at
// 64 MiB per rank to memcpy measured in alternation with them (out of place each rank copies S bytes per call).
// Times are medians over repetitions (fewer at large sizes); the machine is shared, so expect noise.
#include "paradyse/cli/flags.hpp"

#include "paradyse/comm/threads.hpp"
#include "paradyse/core/statistics.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/core/timer.hpp"
#if defined(PARADYSE_WITH_MPI)
#include "paradyse/comm/mpi.hpp"
#endif

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

namespace pd = paradyse;

namespace {

constexpr std::size_t KiB = 1024, MiB = 1024 * KiB;

enum class Collective { all_gather, reduce_scatter, all_reduce, all_to_all, broadcast, reduce, shift };
constexpr Collective kAll[] = {Collective::all_gather, Collective::reduce_scatter, Collective::all_reduce,
                               Collective::all_to_all, Collective::broadcast,      Collective::reduce,
                               Collective::shift};

std::string_view name_of(Collective c) {
  switch (c) {
    case Collective::all_gather: return "all_gather";
    case Collective::reduce_scatter: return "reduce_scatter";
    case Collective::all_reduce: return "all_reduce";
    case Collective::all_to_all: return "all_to_all";
    case Collective::broadcast: return "broadcast";
    case Collective::reduce: return "reduce";
    case Collective::shift: return "shift";
  }
  return "?";
}

// nccl-tests' bus bandwidth factors.
double bus_factor(Collective c, int n) {
  switch (c) {
    case Collective::all_gather: case Collective::reduce_scatter: case Collective::all_to_all:
      return double(n - 1) / n;
    case Collective::all_reduce: return 2.0 * (n - 1) / n;
    default: return 1.0;
  }
}
bool has_in_place(Collective c) { return c != Collective::broadcast; }  // broadcast has one buffer

struct Options {
  std::string backend = "threads";
  std::vector<int> ranks{2, 4};
  std::size_t min_bytes = 4 * KiB, max_bytes = 256 * MiB;
  std::vector<Collective> collectives{std::begin(kAll), std::end(kAll)};
  int reps = 0;  // 0: 5 below 64 MiB, 3 from 64 MiB
  bool goal_only = false;  // only the goal table
  std::string ours = "auto";  // the engine of "ours" under MPI: auto (measured crossover) or shm (always)
};

// A size in bytes with an optional unit: 4096, 4K, 64M, 1G (binary units); false when `text` is not one or the
// size exceeds `max`.
bool parse_size(std::string_view text, std::size_t max, std::size_t& out) {
  std::size_t multiplier = 1;
  if (!text.empty()) {
    const char unit = text.back();
    if (unit == 'K' || unit == 'k') multiplier = KiB;
    if (unit == 'M' || unit == 'm') multiplier = MiB;
    if (unit == 'G' || unit == 'g') multiplier = 1024 * MiB;
    if (multiplier != 1) text.remove_suffix(1);
  }
  std::size_t count = 0;
  if (!pd::cli::parse_integer(text, std::size_t(0), max / multiplier, count)) return false;
  out = count * multiplier;
  return true;
}

std::vector<std::string> split_list(std::string_view text) {
  std::vector<std::string> items;
  while (!text.empty()) {
    const auto comma = text.find(',');
    items.emplace_back(text.substr(0, comma));
    text = comma == std::string_view::npos ? std::string_view() : text.substr(comma + 1);
  }
  return items;
}

Options parse(int argc, char** argv) {
  Options o;
  if (std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMI_SIZE")) o.backend = "mpi";  // launched by mpirun
  constexpr int kMaxRanks = 256;
  constexpr std::size_t kMinBytes = 64, kMaxBytes = std::size_t(64) * 1024 * MiB;
  std::string ranks = "2,4", min_size = "4K", max_size = "256M", ops;
  for (const Collective c : kAll) ops += (ops.empty() ? "" : ",") + std::string(name_of(c));
  const std::string all_ops = ops;
  pd::cli::Flags flags("comm_bench",
                         "Collective bandwidth of the communicator backends, nccl-tests style: per collective, size and "
                         "form (out of place, in place) the median time, algbw and busbw, against single-thread memcpy "
                         "measured in the same run. Under mpirun the backend is mpi and the ranks are the launched "
                         "processes: raw OpenMPI beside ours, and a goal table.");
  flags.choice("--backend", o.backend, {"threads", "mpi"}, "communicator backend (default: mpi under mpirun)");
  flags.text("--ranks", ranks, fmt::format("threads: rank counts to run, each in [1, {}]", kMaxRanks), "LIST");
  flags.text("--min", min_size, "smallest size per rank (bytes, or with a unit K, M, G; at least 64)", "SIZE");
  flags.text("--max", max_size, "largest size per rank (at most 64G)", "SIZE");
  flags.integer("--reps", o.reps, 1, 1'000'000, "repetitions per size (default: 5 below 64 MiB, 3 from 64 MiB)")
      .without_default();
  flags.flag("--goal-only", o.goal_only, "only the goal table");
  flags.choice("--ours", o.ours, {"auto", "shm"},
               "MPI: the engine of ours: auto (chosen by the measured crossover) or shm (always)");
  flags.text("--ops", ops, "collectives to run, comma-separated, of " + all_ops, "LIST");
  flags.parse(argc, argv);

  o.ranks.clear();
  for (const std::string& r : split_list(ranks)) {
    int n = 0;
    if (!pd::cli::parse_integer(std::string_view(r), 1, kMaxRanks, n))
      flags.fail(fmt::format("--ranks expects a comma-separated list of rank counts in [1, {}], got \"{}\"", kMaxRanks,
                             ranks));
    o.ranks.push_back(n);
  }
  if (o.ranks.empty()) flags.fail("--ranks expects at least one rank count, got \"\"");
  for (const auto& [flag, text, into] : {std::tuple{"--min", &min_size, &o.min_bytes},
                                         std::tuple{"--max", &max_size, &o.max_bytes}})
    if (!parse_size(*text, kMaxBytes, *into) || *into < kMinBytes)
      flags.fail(fmt::format("{} expects a size in [64, 64G] bytes (a number, optionally with K, M or G), got \"{}\"",
                             flag, *text));
  if (o.min_bytes > o.max_bytes)
    flags.fail(fmt::format("--min {} exceeds --max {}", min_size, max_size));
  o.collectives.clear();
  for (const std::string& name : split_list(ops)) {
    const auto* c = std::find_if(std::begin(kAll), std::end(kAll), [&](Collective c) { return name_of(c) == name; });
    if (c == std::end(kAll))
      flags.fail(fmt::format("--ops expects a comma-separated list of {}, got \"{}\" (\"{}\" is none of them)", all_ops,
                             ops, name));
    o.collectives.push_back(*c);
  }
  if (o.collectives.empty()) flags.fail("--ops expects at least one collective, got \"\"");
  return o;
}

using pd::median;  // core/statistics.hpp

// Single-thread memcpy bandwidth in copied bytes per second (pre-faulted buffers larger than the caches).
double measure_memcpy(std::size_t bytes, int reps) {
  pd::Tensor<std::byte> from(pd::Shape{std::int64_t(bytes)}), to(pd::Shape{std::int64_t(bytes)});
  std::memset(from.data(), 1, bytes);
  std::memcpy(to.data(), from.data(), bytes);  // warm up
  std::vector<double> times;
  for (int r = 0; r < reps; ++r) {
    const pd::Timer timer;
    std::memcpy(to.data(), from.data(), bytes);
    times.push_back(timer.seconds());
  }
  return double(bytes) / median(times);
}

// One call of the collective on `bytes` per rank (the nccl-tests size), floats from buffers a and b.
template <class C>
void run_once(C& comm, Collective c, bool in_place, std::size_t bytes, std::span<float> a, std::span<float> b) {
  const int n = comm.size(), me = comm.rank();
  const std::size_t count = bytes / sizeof(float), chunk = count / std::size_t(n);
  using pd::ReduceOp;
  switch (c) {
    case Collective::all_gather:
      if (in_place) comm.all_gather(std::span<const float>(b.data() + std::size_t(me) * chunk, chunk), b.first(count));
      else comm.all_gather(std::span<const float>(a.first(chunk)), b.first(count));
      break;
    case Collective::reduce_scatter:
      if (in_place) comm.reduce_scatter(std::span<const float>(a.first(count)), a.subspan(std::size_t(me) * chunk, chunk), ReduceOp::sum);
      else comm.reduce_scatter(std::span<const float>(a.first(count)), b.first(chunk), ReduceOp::sum);
      break;
    case Collective::all_reduce:
      comm.all_reduce(std::span<const float>(a.first(count)), in_place ? a.first(count) : b.first(count), ReduceOp::sum);
      break;
    case Collective::all_to_all:
      comm.all_to_all(std::span<const float>(a.first(count)), in_place ? a.first(count) : b.first(count));
      break;
    case Collective::broadcast: comm.broadcast(a.first(count), 0); break;
    case Collective::reduce:
      comm.reduce(std::span<const float>(a.first(count)), in_place ? a.first(count) : b.first(me == 0 ? count : 0),
                  ReduceOp::sum, 0);
      break;
    case Collective::shift:
      comm.shift(std::span<const float>(a.first(count)), in_place ? a.first(count) : b.first(count), 1);
      break;
  }
}

// Median seconds per call, the slowest rank's (every rank returns the same value).
template <class C>
double time_collective(C& comm, Collective c, bool in_place, std::size_t bytes, std::span<float> a, std::span<float> b,
                       int reps) {
  const int iterations = int(std::clamp<std::size_t>(32 * MiB / bytes, 1, 100));
  run_once(comm, c, in_place, bytes, a, b);  // warm up
  std::vector<double> times;
  for (int r = 0; r < reps; ++r) {
    comm.barrier();
    const pd::Timer timer;
    for (int i = 0; i < iterations; ++i) run_once(comm, c, in_place, bytes, a, b);
    comm.barrier();
    double seconds = timer.seconds() / iterations;
    comm.all_reduce(std::span<const double>(&seconds, 1), std::span<double>(&seconds, 1), pd::ReduceOp::max);
    times.push_back(seconds);
  }
  return median(times);
}

struct Row {
  std::size_t bytes;
  double seconds[2];  // out of place, in place (negative: not applicable)
};

// Every collective and size on one communicator; returns the rows by collective (filled on rank 0 only).
template <class C>
std::map<Collective, std::vector<Row>> sweep(C& comm, const Options& o) {
  const std::size_t max_count = o.max_bytes / sizeof(float);
  pd::Tensor<float> a(pd::Shape{std::int64_t(max_count)}), b(pd::Shape{std::int64_t(max_count)});  // zero-filled
  std::map<Collective, std::vector<Row>> rows;
  for (Collective c : o.collectives) {
    for (std::size_t bytes = o.min_bytes; bytes <= o.max_bytes; bytes *= 4) {
      if (bytes % (sizeof(float) * std::size_t(comm.size())) != 0) continue;
      const int reps = o.reps > 0 ? o.reps : bytes >= 64 * MiB ? 3 : 5;
      Row row{bytes, {-1, -1}};
      for (int form = 0; form < 2; ++form)
        if (form == 0 || has_in_place(c)) row.seconds[form] = time_collective(comm, c, form == 1, bytes, a.span(), b.span(), reps);
      rows[c].push_back(row);
    }
  }
  return rows;
}

void print_table(std::string_view backend, int n, Collective c, const std::vector<Row>& rows) {
  fmt::print("\n# {} backend, {} ranks, {} (float32); busbw = algbw x {:.3f}\n", backend, n, name_of(c),
             bus_factor(c, n));
  fmt::print("# {:>10} {:>11}  {:>10} {:>8} {:>8}  {:>10} {:>8} {:>8}\n", "", "", "out-of-place", "", "", "in-place", "", "");
  fmt::print("# {:>10} {:>11}  {:>10} {:>8} {:>8}  {:>10} {:>8} {:>8}\n", "size(B)", "count", "time(us)", "algbw",
             "busbw", "time(us)", "algbw", "busbw");
  for (const Row& row : rows) {
    std::string line = fmt::format("  {:>10} {:>11}", row.bytes, row.bytes / sizeof(float));
    for (double s : row.seconds) {
      if (s < 0) {
        line += fmt::format("  {:>10} {:>8} {:>8}", "n/a", "", "");
        continue;
      }
      const double algbw = double(row.bytes) / s / 1e9;
      line += fmt::format("  {:>10.1f} {:>8.2f} {:>8.2f}", s * 1e6, algbw, algbw * bus_factor(c, n));
    }
    fmt::print("{}\n", line);
  }
}

std::optional<double> seconds_at(const std::vector<Row>& rows, std::size_t bytes) {
  for (const Row& row : rows)
    if (row.bytes == bytes) return row.seconds[0];
  return std::nullopt;
}

// The goal check, paired against memcpy under the same load: repetitions alternate a single-thread memcpy of
// 64 MiB (rank 0, the other ranks waiting) with one all_gather and one all_to_all of 64 MiB per rank.
struct Goal {
  int ranks;
  double memcpy_seconds, seconds[3];  // all_gather, all_to_all (out of place), all_to_all in place
};
Goal measure_goal(int n, int reps) {
  constexpr std::size_t bytes = 64 * MiB;
  Goal goal{n, 0, {0, 0, 0}};
  pd::run_ranks(n, [&](pd::ThreadCommunicator& comm) {
    pd::Tensor<float> a(pd::Shape{std::int64_t(bytes / sizeof(float))}), b(pd::Shape{std::int64_t(bytes / sizeof(float))});
    std::optional<pd::Tensor<std::byte>> from, to;
    if (comm.rank() == 0) {
      from.emplace(pd::Shape{std::int64_t(bytes)});
      to.emplace(pd::Shape{std::int64_t(bytes)});
      std::memset(from->data(), 1, bytes);
    }
    std::vector<double> copy_times, times[3];
    for (int r = 0; r < reps; ++r) {
      comm.barrier();
      if (comm.rank() == 0) {
        const pd::Timer timer;
        std::memcpy(to->data(), from->data(), bytes);
        copy_times.push_back(timer.seconds());
      }
      const Collective pair[2] = {Collective::all_gather, Collective::all_to_all};
      for (int i = 0; i < 2; ++i) times[i].push_back(time_collective(comm, pair[i], false, bytes, a.span(), b.span(), 1));
      times[2].push_back(time_collective(comm, Collective::all_to_all, true, bytes, a.span(), b.span(), 1));
    }
    if (comm.rank() == 0) goal = {n, median(copy_times), {median(times[0]), median(times[1]), median(times[2])}};
  });
  return goal;
}

int run_threads(const Options& o, double memcpy_bw) {
  for (int n : o.ranks) {
    std::map<Collective, std::vector<Row>> rows;
    pd::run_ranks(n, [&](pd::ThreadCommunicator& comm) {
      auto mine = sweep(comm, o);
      if (comm.rank() == 0) rows = std::move(mine);
    });
    for (const auto& [c, table] : rows) print_table("threads", n, c, table);
    std::fflush(stdout);
  }
  fmt::print("\n# goal: threads all_gather / all_to_all at 64 MiB per rank (and all_to_all in place), against single-thread memcpy "
             "(copied bytes/s)\n# measured in alternation (median of {} pairs), so both see the same machine load. "
             "Each rank copies 64 MiB per call:\n# 'per rank' is one rank's copy rate, 'all ranks' the ranks' copies "
             "together (memcpy at the start: {:.2f} GB/s)\n", o.reps > 0 ? o.reps : 7, memcpy_bw / 1e9);
  fmt::print("# {:>5} {:>12} {:>12} {:>10} {:>14} {:>8} {:>14} {:>8}\n", "ranks", "collective", "memcpy GB/s",
             "time(ms)", "per rank GB/s", "ratio", "all ranks GB/s", "ratio");
  for (int n : o.ranks) {
    const Goal g = measure_goal(n, o.reps > 0 ? o.reps : 7);
    const double copy_bw = double(64 * MiB) / g.memcpy_seconds;
    for (int i = 0; i < 3; ++i) {
      const double per_rank = double(64 * MiB) / g.seconds[i], all = per_rank * n;
      fmt::print("  {:>5} {:>12} {:>12.2f} {:>10.2f} {:>14.2f} {:>7.0f}% {:>14.2f} {:>7.0f}%\n", n,
                 i == 0 ? "all_gather" : i == 1 ? "all_to_all" : "a2a in place", copy_bw / 1e9, g.seconds[i] * 1e3, per_rank / 1e9,
                 100 * per_rank / copy_bw, all / 1e9, 100 * all / copy_bw);
    }
  }
  return 0;
}

#if defined(PARADYSE_WITH_MPI)
// The MPI goal: all_gather, reduce_scatter, all_reduce at 4, 16, 64 MiB (nccl-tests sizes S, out of place), through
// raw OpenMPI (Engine::mpi) and through this backend (Engine::automatic: shared memory above the measured
// crossover). Per rank, a collective of size S moves at least what a memcpy of S bytes moves (all_gather: writes its
// S-byte output, reads S / p of it; reduce_scatter: reads its S-byte input, writes S / p; all_reduce: reads S,
// writes S), so its rate is S / time per rank (nccl-tests' algbw), compared against two memcpy rates measured in
// alternation with the collectives (median of the repetitions, so all see the same load):
//   alone:     rank 0 copies S bytes while the others wait (one core's memcpy);
//   all ranks: every rank copies S bytes at the same time (the slowest rank's time): what each rank gets of the
//              memory bandwidth when all copy, the ceiling of a collective in which all ranks copy at once.
void mpi_goal(pd::MpiCommunicator& comm, int reps, pd::MpiCommunicator::Engine ours) {
  using Engine = pd::MpiCommunicator::Engine;
  const Collective ops[3] = {Collective::all_gather, Collective::reduce_scatter, Collective::all_reduce};
  const std::size_t sizes[3] = {4 * MiB, 16 * MiB, 64 * MiB};
  pd::Tensor<float> a(pd::Shape{std::int64_t(64 * MiB / sizeof(float))}), b(pd::Shape{std::int64_t(64 * MiB / sizeof(float))});
  pd::Tensor<std::byte> from(pd::Shape{std::int64_t(64 * MiB)}), to(pd::Shape{std::int64_t(64 * MiB)});
  std::memset(from.data(), 1, 64 * MiB);
  std::memset(to.data(), 1, 64 * MiB);
  const std::array<std::int64_t, 3> crossover = comm.collective_crossover_bytes();
  if (comm.rank() == 0) {
    fmt::print("\n# goal: {} ranks, out of place; raw = OpenMPI's own collective, ours = this backend (shared memory "
               "from the measured crossover: all_gather {}, reduce_scatter {}, all_reduce {} bytes; -1 never)\n"
               "# GB/s per rank = S / time; memcpy alone = one rank copying S bytes while the others wait; memcpy all "
               "= every rank copying S bytes at once (per rank);\n# % = ours against each memcpy rate; medians of {} "
               "repetitions alternating memcpy and collectives\n",
               comm.size(), crossover[0], crossover[1], crossover[2], reps);
    fmt::print("# {:>14} {:>6} {:>12} {:>10} {:>8} {:>8} {:>12} {:>10} {:>8}\n", "collective", "S", "memcpy alone",
               "memcpy all", "raw", "ours", "ours/alone", "ours/all", "vs raw");
    fmt::print("# {:>14} {:>6} {:>12} {:>10} {:>8} {:>8} {:>12} {:>10} {:>8}\n", "", "", "GB/s", "GB/s", "GB/s",
               "GB/s", "%", "%", "x");
  }
  const auto timed_copy = [&](std::size_t bytes, bool copies) {
    comm.barrier();
    const pd::Timer timer;
    if (copies) std::memcpy(to.data(), from.data(), bytes);
    double seconds = timer.seconds();
    comm.all_reduce(std::span<const double>(&seconds, 1), std::span<double>(&seconds, 1), pd::ReduceOp::max);
    return seconds;
  };
  for (const Collective c : ops)
    for (const std::size_t bytes : sizes) {
      if (bytes % (sizeof(float) * std::size_t(comm.size())) != 0) continue;
      std::vector<double> alone_times, all_times, raw_times, our_times;
      for (int r = 0; r < reps; ++r) {
        alone_times.push_back(timed_copy(bytes, comm.rank() == 0));
        all_times.push_back(timed_copy(bytes, true));
        comm.set_collective_engine(Engine::mpi);
        raw_times.push_back(time_collective(comm, c, false, bytes, a.span(), b.span(), 1));
        comm.set_collective_engine(ours);
        our_times.push_back(time_collective(comm, c, false, bytes, a.span(), b.span(), 1));
      }
      if (comm.rank() != 0) continue;
      const double s = double(bytes), alone = s / median(alone_times) / 1e9, all = s / median(all_times) / 1e9,
                   raw = s / median(raw_times) / 1e9, ours = s / median(our_times) / 1e9;
      fmt::print("  {:>14} {:>4}Mi {:>12.2f} {:>10.2f} {:>8.2f} {:>8.2f} {:>11.0f}% {:>9.0f}% {:>7.1f}x\n", name_of(c),
                 bytes / MiB, alone, all, raw, ours, 100 * ours / alone, 100 * ours / all, ours / raw);
    }
}

int run_mpi_backend(int argc, char** argv, const Options& o) {
  pd::MpiSession session(&argc, &argv);
  int world_rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  double memcpy_bw = 0;
  if (world_rank == 0) memcpy_bw = measure_memcpy(256 * MiB, 5);  // alone: the others wait at the barrier
  pd::run_mpi([&](pd::MpiCommunicator& comm) {
    comm.barrier();
    using Engine = pd::MpiCommunicator::Engine;
    const Engine ours = o.ours == "shm" ? Engine::shared_memory : Engine::automatic;
    std::map<Collective, std::vector<Row>> rows[2];
    for (int e = 0; e < 2 && !o.goal_only; ++e) {
      comm.set_collective_engine(e == 0 ? Engine::mpi : ours);
      rows[e] = sweep(comm, o);
    }
    if (comm.rank() == 0 && !o.goal_only) {
      fmt::print("# memcpy, 1 thread, 256 MiB: {:.2f} GB/s copied (the ceiling)\n", memcpy_bw / 1e9);
      for (int e = 0; e < 2; ++e)
        for (const auto& [c, table] : rows[e]) print_table(e == 0 ? "raw OpenMPI" : "mpi (ours)", comm.size(), c, table);
    }
    std::fflush(stdout);
    mpi_goal(comm, o.reps > 0 ? o.reps : 5, ours);
  });
  return 0;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  try {
    const Options o = parse(argc, argv);
    if (o.backend == "mpi") {
#if defined(PARADYSE_WITH_MPI)
      return run_mpi_backend(argc, argv, o);
#else
      std::fputs("comm_bench: built without MPI\n", stderr);
      return 2;
#endif
    }
    const double memcpy_bw = measure_memcpy(256 * MiB, 5);
    fmt::print("# memcpy, 1 thread, 256 MiB: {:.2f} GB/s copied (the ceiling)\n", memcpy_bw / 1e9);
    return run_threads(o, memcpy_bw);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "comm_bench: %s\n", e.what());
    return 1;
  }
}
