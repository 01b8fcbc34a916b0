// bench/cuda_comm.cpp: the CUDA communicators' collectives against the device's own copy bandwidth.
//
// all_gather, reduce_scatter, all_reduce and all_to_all (float32, sum) on cuda_local ranks (threads on one GPU,
// p = 2 and 4) and on NCCL with p = 1 (one GPU: NCCL refuses two ranks on one device), buffer sizes 1 MiB to
// 256 MiB. Conventions of nccl-tests: the size is the whole buffer (all_gather's output, reduce_scatter's input,
// all_reduce's buffer, all_to_all's input); algorithm bandwidth = size / time; bus bandwidth = algbw x (p-1)/p
// (all_reduce: 2 (p-1)/p), the bytes each rank's link would carry in a ring, so 0 at p = 1. It is compared with
// cudaMemcpy device-to-device bandwidth (bytes copied / time) measured in the same run: on one GPU every collective
// byte is a device copy, so that is cuda_local's ceiling. Times are medians of wall-clock times on rank 0 from a
// barrier to the blocking collective's return.
#include "paradyse/cli/flags.hpp"

#include <fmt/format.h>

#if defined(PARADYSE_WITH_CUDA)
#include "paradyse/comm/cuda_local.hpp"
#include "paradyse/core/statistics.hpp"
#include "paradyse/core/timer.hpp"
#include "paradyse/device/runtime.hpp"
#include "paradyse/device/stream.hpp"
#if defined(PARADYSE_WITH_NCCL)
#include "paradyse/comm/nccl.hpp"
#endif

#include <algorithm>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <string>
#include <string_view>
#include <unistd.h>
#include <vector>
#endif

namespace {

struct Options {
  bool quick = false;
  int reps = 0;  // 0: 10, or 5 with --quick
};

// The command line: --help prints the usage generated from these flags (exit 0), a bad one exits 2.
Options parse(int argc, char** argv) {
  Options o;
  paradyse::cli::Flags flags("cuda_comm",
                               "CUDA collectives (cuda_local p = 2, 4; NCCL p = 1) against cudaMemcpy device-to-device "
                               "bandwidth, as a Markdown table.");
  flags.flag("--quick", o.quick, "sizes 1 and 16 MiB only, 5 repetitions unless --reps says (a smoke run)");
  flags.integer("--reps", o.reps, 0, 1000, "timed repetitions per point, the median reported (0: 10, or 5 with --quick)");
  flags.parse(argc, argv);
  if (o.reps == 0) o.reps = o.quick ? 5 : 10;
  return o;
}

}  // namespace

#if !defined(PARADYSE_WITH_CUDA)
int main(int argc, char** argv) {
  parse(argc, argv);
  fmt::print("cuda_comm: built without CUDA; nothing to measure\n");
  return 0;
}
#else

namespace pd = paradyse;
using pd::median;

namespace {

enum class Op { all_gather, reduce_scatter, all_reduce, all_to_all };
constexpr Op kOps[] = {Op::all_gather, Op::reduce_scatter, Op::all_reduce, Op::all_to_all};

std::string_view name_of(Op op) {
  switch (op) {
    case Op::all_gather: return "all_gather";
    case Op::reduce_scatter: return "reduce_scatter";
    case Op::all_reduce: return "all_reduce";
    case Op::all_to_all: return "all_to_all";
  }
  return "?";
}

double bus_factor(Op op, int p) {
  const double q = p;
  return op == Op::all_reduce ? 2 * (q - 1) / q : (q - 1) / q;
}

// Device memory of `bytes` (cudaMalloc), freed on destruction.
class DeviceBytes {
public:
  explicit DeviceBytes(std::size_t bytes) : bytes_(bytes) {
    PARADYSE_CUDA_CHECK(cudaMalloc(&data_, std::max<std::size_t>(bytes, 1)));
    PARADYSE_CUDA_CHECK(cudaMemset(data_, 0, std::max<std::size_t>(bytes, 1)));
  }
  ~DeviceBytes() { (void)cudaFree(data_); }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;
  float* floats() const { return static_cast<float*>(data_); }
  std::size_t count() const { return bytes_ / sizeof(float); }

private:
  void* data_ = nullptr;
  std::size_t bytes_;
};

// Seconds per cudaMemcpyAsync device to device of `bytes` (median, timed with events on one stream).
double memcpy_seconds(std::size_t bytes, int reps) {
  DeviceBytes from(bytes), to(bytes);
  pd::device::Stream stream;
  std::vector<double> times;
  for (int i = 0; i < reps + 2; ++i) {
    pd::device::Event start, stop;
    start.record(stream.get());
    PARADYSE_CUDA_CHECK(cudaMemcpyAsync(to.floats(), from.floats(), bytes, cudaMemcpyDeviceToDevice, stream.get()));
    stop.record(stream.get());
    const double seconds = pd::device::elapsed_ms(start, stop) / 1e3;
    if (i >= 2) times.push_back(seconds);
  }
  return median(times);
}

// One collective of `size_bytes` (nccl-tests' size) on `comm`, with buffers made here; returns the median seconds.
template <class Comm>
double time_collective(Comm& comm, Op op, std::size_t size_bytes, int reps) {
  const int p = comm.size();
  const std::size_t n = size_bytes / sizeof(float) / std::size_t(p) * std::size_t(p);  // divisible by p
  const std::size_t chunk = n / std::size_t(p);
  const std::size_t in_count = op == Op::all_gather ? chunk : n;
  const std::size_t out_count = op == Op::reduce_scatter ? chunk : n;
  DeviceBytes in(in_count * sizeof(float)), out(out_count * sizeof(float));
  const std::span<const float> input(in.floats(), in_count);
  const std::span<float> output(out.floats(), out_count);
  std::vector<double> times;
  for (int i = 0; i < reps + 2; ++i) {
    comm.barrier();
    const pd::Timer timer;
    switch (op) {
      case Op::all_gather: comm.all_gather(input, output); break;
      case Op::reduce_scatter: comm.reduce_scatter(input, output, pd::ReduceOp::sum); break;
      case Op::all_reduce: comm.all_reduce(input, output, pd::ReduceOp::sum); break;
      case Op::all_to_all: comm.all_to_all(input, output); break;
    }
    pd::device::synchronize();
    const double seconds = timer.seconds();
    if (i >= 2) times.push_back(seconds);
  }
  return median(times);
}

struct Row {
  std::string backend;
  int p;
  Op op;
  std::size_t bytes;
  double seconds;
};

}  // namespace

int main(int argc, char** argv) {
  const Options options = parse(argc, argv);
  const bool quick = options.quick;
  const int reps = options.reps;
  if (!pd::device::available()) {
    fmt::print("cuda_comm: {}; nothing to measure\n", pd::device::unavailable_reason());
    return 0;
  }
  std::vector<std::size_t> sizes;
  for (std::size_t mib : quick ? std::vector<std::size_t>{1, 16} : std::vector<std::size_t>{1, 4, 16, 64, 256})
    sizes.push_back(mib << 20);

  cudaDeviceProp properties{};
  int device = 0;
  PARADYSE_CUDA_CHECK(cudaGetDevice(&device));
  PARADYSE_CUDA_CHECK(cudaGetDeviceProperties(&properties, device));

  std::vector<double> memcpy_gbps;
  for (std::size_t bytes : sizes) memcpy_gbps.push_back(double(bytes) / memcpy_seconds(bytes, reps) / 1e9);

  std::vector<Row> rows;
  for (int p : {2, 4}) {
    std::vector<Row> measured;
    pd::run_cuda_local_ranks(p, [&](pd::CudaLocalCommunicator& comm) {
      for (Op op : kOps)
        for (std::size_t bytes : sizes) {
          const double seconds = time_collective(comm, op, bytes, reps);
          if (comm.rank() == 0) measured.push_back({"cuda_local", p, op, bytes, seconds});
        }
    });
    rows.insert(rows.end(), measured.begin(), measured.end());
  }
#if defined(PARADYSE_WITH_NCCL)
  {
    const std::string path = fmt::format("/tmp/paradyse_cuda_comm_{}.ncclid", ::getpid());
    std::remove(path.c_str());
    pd::NcclCommunicator comm = pd::NcclCommunicator::from_file(path, 0, 1);
    for (Op op : kOps)
      for (std::size_t bytes : sizes) rows.push_back({"nccl", 1, op, bytes, time_collective(comm, op, bytes, reps)});
    std::remove(path.c_str());
  }
#endif

  fmt::print("## CUDA collectives on {} (float32, sum; median of {} runs)\n\n", properties.name, reps);
  fmt::print("cudaMemcpy device-to-device (bytes copied / time):");
  for (std::size_t i = 0; i < sizes.size(); ++i)
    fmt::print(" {} MiB {:.0f} GB/s{}", sizes[i] >> 20, memcpy_gbps[i], i + 1 < sizes.size() ? "," : "\n\n");
  fmt::print("| backend | p | collective | size (MiB) | time (ms) | algbw (GB/s) | busbw (GB/s) | busbw / memcpy |\n");
  fmt::print("|---|---|---|---|---|---|---|---|\n");
  for (const Row& row : rows) {
    const std::size_t i = std::size_t(std::find(sizes.begin(), sizes.end(), row.bytes) - sizes.begin());
    const double algbw = double(row.bytes) / row.seconds / 1e9;
    const double busbw = algbw * bus_factor(row.op, row.p);
    fmt::print("| {} | {} | {} | {} | {:.3f} | {:.1f} | {:.1f} | {:.2f} |\n", row.backend, row.p, name_of(row.op),
               row.bytes >> 20, row.seconds * 1e3, algbw, busbw, busbw / memcpy_gbps[i]);
  }
  fmt::print("\nbusbw = algbw x (p-1)/p (all_reduce 2 (p-1)/p), nccl-tests' convention: 0 at p = 1 (NCCL on one "
             "GPU), where algbw is the number to read.\n");
  return 0;
}
#endif
