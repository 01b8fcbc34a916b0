// tests/cuda/comm.cpp: the CUDA communicators on device memory: cuda_local (thread ranks on one GPU) for p in
// {1, 2, 3, 4} and NCCL with p = 1 (one GPU) over the file bootstrap.
//
// Every rank regenerates every other rank's input (input_of, tests/comm/collective_checks.hpp), so the expected
// result of each collective is computed here on the host. Moves must be bitwise; reductions too: cuda_local reduces
// in rank order with float accumulation for bf16, exactly as the threads backend's host reduction
// (threads_detail::reduce_in_rank_order), which computes the expectation here; at p = 1 NCCL's reductions are the
// identity. A mismatch names the operation, the dtype, the rank and the first differing element with both values.
#include "comm/collective_checks.hpp"
#include "cuda/device_test.hpp"

#include "paradyse/comm/cuda_local.hpp"
#include "paradyse/comm/threads_detail.hpp"
#include "paradyse/core/memory.hpp"
#include "paradyse/device/runtime.hpp"
#if defined(PARADYSE_WITH_NCCL)
#include "paradyse/comm/nccl.hpp"
#endif

#include <doctest/doctest.h>
#include <fmt/format.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <numeric>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <unistd.h>
#include <vector>

namespace pd = paradyse;
using pd::testing::input_of;
using pd::testing::sentinel;

namespace {

// n elements of device memory: from the calling thread's tracker when it is a device tracker (a cuda_local rank),
// else cudaMalloc. Uploads and downloads run on the calling thread's stream and synchronise it.
template <class T>
class DeviceBuffer {
public:
  explicit DeviceBuffer(std::size_t n) : n_(n) {
    if (n_ == 0) return;
    if (pd::MemoryTracker::current().space() == pd::MemorySpace::device) {
      tracker_ = pd::MemoryTracker::current().handle();
      data_ = static_cast<T*>(tracker_.allocate(n_ * sizeof(T), pd::Contents::unspecified));
    } else {
      void* p = nullptr;
      PARADYSE_CUDA_CHECK(cudaMalloc(&p, n_ * sizeof(T)));
      data_ = static_cast<T*>(p);
    }
  }
  explicit DeviceBuffer(const std::vector<T>& values) : DeviceBuffer(values.size()) { upload(values); }
  DeviceBuffer(std::size_t n, T fill) : DeviceBuffer(std::vector<T>(n, fill)) {}
  ~DeviceBuffer() {
    if (!data_) return;
    (void)cudaStreamSynchronize(pd::device::current_stream());
    if (tracker_) tracker_.deallocate(data_, n_ * sizeof(T));
    else (void)cudaFree(data_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void upload(const std::vector<T>& values) {
    REQUIRE(values.size() == n_);
    if (n_ == 0) return;
    PARADYSE_CUDA_CHECK(cudaMemcpyAsync(data_, values.data(), n_ * sizeof(T), cudaMemcpyHostToDevice,
                                        pd::device::current_stream()));
    pd::device::synchronize();
  }
  std::vector<T> download() const {
    std::vector<T> values(n_);
    if (n_ == 0) return values;
    PARADYSE_CUDA_CHECK(cudaMemcpyAsync(values.data(), data_, n_ * sizeof(T), cudaMemcpyDeviceToHost,
                                        pd::device::current_stream()));
    pd::device::synchronize();
    return values;
  }
  std::span<T> span() { return {data_, n_}; }
  std::span<const T> cspan() const { return {data_, n_}; }
  std::size_t size() const { return n_; }

private:
  std::size_t n_ = 0;
  T* data_ = nullptr;
  pd::MemoryTracker::Handle tracker_;
};

// Failures found by any rank thread, reported once the run is over (doctest's CHECK from the main thread).
struct Findings {
  std::mutex mutex;
  std::vector<std::string> failures;
  void add(std::string failure) {
    std::lock_guard lock(mutex);
    failures.push_back(std::move(failure));
  }
  void report() {
    for (const auto& f : failures) FAIL_CHECK(f);
    CHECK(failures.empty());
  }
};

template <class T>
void expect(Findings& findings, const std::vector<T>& got, const std::vector<T>& want, const std::string& what) {
  const std::string difference = pd::testing::first_difference<T>(got, want);
  if (!difference.empty()) findings.add(fmt::format("{}: {}", what, difference));
}

// The rank-order reduction of the ranks' vectors over [begin, begin + n) (the threads backend's host reduction).
template <class T>
std::vector<T> reduced(const std::vector<std::vector<T>>& per_rank, std::size_t begin, std::size_t n, pd::ReduceOp op) {
  std::vector<T> out(n);
  std::vector<const std::byte*> inputs;
  for (const auto& v : per_rank) inputs.push_back(reinterpret_cast<const std::byte*>(v.data() + begin));
  if (n) pd::threads_detail::reduce_in_rank_order<T>(reinterpret_cast<std::byte*>(out.data()), inputs.data(),
                                                     int(per_rank.size()), 0, n, op);
  return out;
}

template <class T>
std::vector<std::vector<T>> inputs_of_all(int p, std::size_t n, std::uint64_t seed) {
  std::vector<std::vector<T>> all;
  for (int r = 0; r < p; ++r) all.push_back(input_of<T>(r, n, seed));
  return all;
}

// Uneven counts with zeros: f(0..3) = 2, 3, 0, 1, ...
inline std::int64_t uneven(int r) { return std::int64_t((r * 5 + 2) % 4); }
// all_to_all_v: what rank i sends to rank j.
inline std::int64_t a2a_count(int i, int j) { return std::int64_t((i * 3 + j * 5) % 4); }

// Every moving collective (and for reducible T every reduction with `ops`) of `comm` on device buffers, against
// the host expectation. Called by every rank of the group.
template <class T, class Comm>
void check_collectives(Comm& comm, Findings& findings, std::uint64_t seed, std::span<const pd::ReduceOp> ops) {
  const int p = comm.size(), me = comm.rank();
  const std::string type = pd::testing::type_name<T>();
  const auto name = [&](std::string_view op) { return fmt::format("{} {} (rank {} of {})", op, type, me, p); };
  constexpr std::size_t chunk = 37;

  {  // all_gather, out of place and in place
    const auto all = inputs_of_all<T>(p, chunk, seed);
    std::vector<T> want;
    for (const auto& v : all) want.insert(want.end(), v.begin(), v.end());
    DeviceBuffer<T> in(all[std::size_t(me)]), out(chunk * std::size_t(p), sentinel<T>());
    comm.all_gather(in.cspan(), out.span());
    expect(findings, out.download(), want, name("all_gather"));
    std::vector<T> start(chunk * std::size_t(p), sentinel<T>());
    std::copy(all[std::size_t(me)].begin(), all[std::size_t(me)].end(), start.begin() + std::ptrdiff_t(chunk) * me);
    DeviceBuffer<T> inplace(start);
    comm.all_gather(std::span<const T>(inplace.span().subspan(chunk * std::size_t(me), chunk)), inplace.span());
    expect(findings, inplace.download(), want, name("all_gather in place"));
  }
  {  // all_gather_v with uneven counts (some zero)
    std::vector<std::int64_t> counts;
    for (int r = 0; r < p; ++r) counts.push_back(uneven(r));
    std::vector<T> want;
    for (int r = 0; r < p; ++r) {
      const auto v = input_of<T>(r, std::size_t(counts[std::size_t(r)]), seed + 1);
      want.insert(want.end(), v.begin(), v.end());
    }
    DeviceBuffer<T> in(input_of<T>(me, std::size_t(counts[std::size_t(me)]), seed + 1));
    DeviceBuffer<T> out(want.size(), sentinel<T>());
    comm.all_gather_v(in.cspan(), out.span(), counts);
    expect(findings, out.download(), want, name("all_gather_v"));
  }
  {  // all_to_all, out of place and in place
    const auto all = inputs_of_all<T>(p, chunk * std::size_t(p), seed + 2);
    std::vector<T> want;
    for (int r = 0; r < p; ++r)
      want.insert(want.end(), all[std::size_t(r)].begin() + std::ptrdiff_t(chunk) * me,
                  all[std::size_t(r)].begin() + std::ptrdiff_t(chunk) * (me + 1));
    DeviceBuffer<T> in(all[std::size_t(me)]), out(want.size(), sentinel<T>());
    comm.all_to_all(in.cspan(), out.span());
    expect(findings, out.download(), want, name("all_to_all"));
    DeviceBuffer<T> inplace(all[std::size_t(me)]);
    comm.all_to_all(inplace.cspan(), inplace.span());
    expect(findings, inplace.download(), want, name("all_to_all in place"));
  }
  {  // all_to_all_v with uneven counts (some zero)
    std::vector<std::int64_t> send_counts, recv_counts;
    for (int j = 0; j < p; ++j) {
      send_counts.push_back(a2a_count(me, j));
      recv_counts.push_back(a2a_count(j, me));
    }
    const auto total_of = [&](int i) {
      std::int64_t t = 0;
      for (int j = 0; j < p; ++j) t += a2a_count(i, j);
      return std::size_t(t);
    };
    std::vector<T> want;
    for (int j = 0; j < p; ++j) {
      const auto v = input_of<T>(j, total_of(j), seed + 3);
      std::size_t offset = 0;
      for (int k = 0; k < me; ++k) offset += std::size_t(a2a_count(j, k));
      want.insert(want.end(), v.begin() + std::ptrdiff_t(offset),
                  v.begin() + std::ptrdiff_t(offset + std::size_t(a2a_count(j, me))));
    }
    DeviceBuffer<T> in(input_of<T>(me, total_of(me), seed + 3)), out(want.size(), sentinel<T>());
    comm.all_to_all_v(in.cspan(), send_counts, out.span(), recv_counts);
    expect(findings, out.download(), want, name("all_to_all_v"));
  }
  {  // broadcast from the last rank
    const int root = p - 1;
    const auto want = input_of<T>(root, chunk, seed + 4);
    DeviceBuffer<T> buffer(me == root ? want : std::vector<T>(chunk, sentinel<T>()));
    comm.broadcast(buffer.span(), root);
    expect(findings, buffer.download(), want, name("broadcast"));
  }
  {  // shift by one, out of place and in place; and by -1
    const auto mine = input_of<T>(me, chunk, seed + 5);
    const auto from_left = input_of<T>((me - 1 + p) % p, chunk, seed + 5);
    const auto from_right = input_of<T>((me + 1) % p, chunk, seed + 5);
    DeviceBuffer<T> in(mine), out(chunk, sentinel<T>());
    comm.shift(in.cspan(), out.span(), 1);
    expect(findings, out.download(), from_left, name("shift +1"));
    comm.shift(in.cspan(), out.span(), -1);
    expect(findings, out.download(), from_right, name("shift -1"));
    DeviceBuffer<T> inplace(mine);
    comm.shift(inplace.cspan(), inplace.span(), 1);
    expect(findings, inplace.download(), from_left, name("shift +1 in place"));
  }
  if (p > 1) {  // send and recv around the ring
    const auto mine = input_of<T>(me, chunk, seed + 6);
    DeviceBuffer<T> in(mine), out(chunk, sentinel<T>());
    auto received = comm.recv_async(out.span(), (me - 1 + p) % p);
    comm.send(in.cspan(), (me + 1) % p);
    received.wait();
    expect(findings, out.download(), input_of<T>((me - 1 + p) % p, chunk, seed + 6), name("send/recv"));
  }
  if constexpr (!std::is_same_v<T, std::byte>) {
    for (const pd::ReduceOp op : ops) {
      const auto opname = [&](std::string_view what) { return name(fmt::format("{} {}", what, pd::name_of(op))); };
      {  // all_reduce, out of place and in place, an odd size (uneven chunks per rank)
        const std::size_t n = 3 * chunk + std::size_t(p) - 1;
        const auto all = inputs_of_all<T>(p, n, seed + 7);
        const auto want = reduced(all, 0, n, op);
        DeviceBuffer<T> in(all[std::size_t(me)]), out(n, sentinel<T>());
        comm.all_reduce(in.cspan(), out.span(), op);
        expect(findings, out.download(), want, opname("all_reduce"));
        DeviceBuffer<T> inplace(all[std::size_t(me)]);
        comm.all_reduce(inplace.cspan(), inplace.span(), op);
        expect(findings, inplace.download(), want, opname("all_reduce in place"));
      }
      {  // reduce_scatter, out of place and in place
        const auto all = inputs_of_all<T>(p, chunk * std::size_t(p), seed + 8);
        const auto want = reduced(all, chunk * std::size_t(me), chunk, op);
        DeviceBuffer<T> in(all[std::size_t(me)]), out(chunk, sentinel<T>());
        comm.reduce_scatter(in.cspan(), out.span(), op);
        expect(findings, out.download(), want, opname("reduce_scatter"));
        DeviceBuffer<T> inplace(all[std::size_t(me)]);
        const auto my_chunk = inplace.span().subspan(chunk * std::size_t(me), chunk);
        comm.reduce_scatter(inplace.cspan(), my_chunk, op);
        auto got = inplace.download();
        expect(findings, std::vector<T>(got.begin() + std::ptrdiff_t(chunk) * me,
                                        got.begin() + std::ptrdiff_t(chunk) * (me + 1)),
               want, opname("reduce_scatter in place"));
      }
      {  // reduce_scatter_v with uneven counts (some zero)
        std::vector<std::int64_t> counts;
        std::size_t total = 0, begin = 0;
        for (int r = 0; r < p; ++r) {
          counts.push_back(uneven(r) * 3);
          if (r < me) begin += std::size_t(counts.back());
          total += std::size_t(counts.back());
        }
        const auto all = inputs_of_all<T>(p, total, seed + 9);
        const auto want = reduced(all, begin, std::size_t(counts[std::size_t(me)]), op);
        DeviceBuffer<T> in(all[std::size_t(me)]), out(want.size(), sentinel<T>());
        comm.reduce_scatter_v(in.cspan(), out.span(), counts, op);
        expect(findings, out.download(), want, opname("reduce_scatter_v"));
      }
      {  // reduce to rank 0 (others pass an empty output)
        const auto all = inputs_of_all<T>(p, chunk, seed + 10);
        DeviceBuffer<T> in(all[std::size_t(me)]), out(me == 0 ? chunk : 0, sentinel<T>());
        comm.reduce(in.cspan(), out.span(), op, 0);
        if (me == 0) expect(findings, out.download(), reduced(all, 0, chunk, op), opname("reduce"));
      }
    }
    {  // async forms: post several, wait in reverse order; the stats count ring bytes
      const std::size_t n = chunk * std::size_t(p);
      const auto all = inputs_of_all<T>(p, n, seed + 11);
      const auto gathered_in = input_of<T>(me, chunk, seed + 12);
      std::vector<T> gathered_want;
      for (int r = 0; r < p; ++r) {
        const auto v = input_of<T>(r, chunk, seed + 12);
        gathered_want.insert(gathered_want.end(), v.begin(), v.end());
      }
      DeviceBuffer<T> reduce_in(all[std::size_t(me)]), reduce_out(n, sentinel<T>());
      DeviceBuffer<T> gather_in(gathered_in), gather_out(n, sentinel<T>());
      DeviceBuffer<T> scatter_out(chunk, sentinel<T>());
      DeviceBuffer<T> shift_in(gathered_in), shift_out(chunk, sentinel<T>());
      DeviceBuffer<T> bcast(me == 0 ? gathered_in : std::vector<T>(chunk, sentinel<T>()));
      comm.reset_stats();
      auto a = comm.all_reduce_async(reduce_in.cspan(), reduce_out.span(), pd::ReduceOp::sum);
      auto b = comm.all_gather_async(gather_in.cspan(), gather_out.span());
      auto c = comm.reduce_scatter_async(reduce_in.cspan(), scatter_out.span(), pd::ReduceOp::sum);
      auto d = comm.shift_async(shift_in.cspan(), shift_out.span(), 1);
      auto e = comm.broadcast_async(bcast.span(), 0);
      e.wait();
      d.wait();
      c.wait();
      b.wait();
      a.wait();
      expect(findings, reduce_out.download(), reduced(all, 0, n, pd::ReduceOp::sum), name("all_reduce_async"));
      expect(findings, gather_out.download(), gathered_want, name("all_gather_async"));
      expect(findings, scatter_out.download(), reduced(all, chunk * std::size_t(me), chunk, pd::ReduceOp::sum),
             name("reduce_scatter_async"));
      expect(findings, shift_out.download(), input_of<T>((me - 1 + p) % p, chunk, seed + 12), name("shift_async"));
      expect(findings, bcast.download(), input_of<T>(0, chunk, seed + 12), name("broadcast_async"));
      const std::size_t q = std::size_t(p), bytes = n * sizeof(T), chunk_bytes = chunk * sizeof(T);
      const std::size_t want_sent = 2 * (q - 1) * bytes / q + (q - 1) * chunk_bytes + (q - 1) * chunk_bytes +
                                    chunk_bytes + (p > 1 && me == 0 ? chunk_bytes : 0);
      const pd::CommStats stats = comm.stats();
      const std::uint64_t want_operations = p > 1 ? 6 : 5;  // shift counts 2; broadcast nothing at p = 1
      if (stats.bytes_sent != want_sent || stats.operations != want_operations)
        findings.add(fmt::format("{}: stats sent {} bytes in {} operations, want {} in {}", name("async stats"),
                                 stats.bytes_sent, stats.operations, want_sent, want_operations));
    }
  }
  comm.barrier();
}

constexpr pd::ReduceOp kAllOps[] = {pd::ReduceOp::sum, pd::ReduceOp::max, pd::ReduceOp::avg};

}  // namespace

TEST_CASE("cuda_local: every collective on device memory, p = 1..4, f32/bf16/i64/f64/bytes, against the host") {
  PARADYSE_REQUIRE_DEVICE();
  for (int p = 1; p <= 4; ++p) {
    CAPTURE(p);
    Findings findings;
    std::atomic<int> device_trackers{0};
    pd::run_cuda_local_ranks(p, [&](pd::CudaLocalCommunicator& comm) {
      if (pd::MemoryTracker::current().space() == pd::MemorySpace::device) ++device_trackers;
      if (pd::device::current_stream() == cudaStreamPerThread)
        findings.add(fmt::format("rank {} runs on the per-thread default stream, not its own", comm.rank()));
      check_collectives<float>(comm, findings, 100, kAllOps);
      check_collectives<pd::bf16>(comm, findings, 200, kAllOps);
      check_collectives<std::int64_t>(comm, findings, 300, kAllOps);
      constexpr pd::ReduceOp sum_only[] = {pd::ReduceOp::sum};
      check_collectives<double>(comm, findings, 400, sum_only);
      check_collectives<std::byte>(comm, findings, 500, {});
    });
    findings.report();
    CHECK(device_trackers.load() == p);
  }
}

TEST_CASE("cuda_local: split gives CudaLocalCommunicators over the ranks of a color, ordered by key") {
  PARADYSE_REQUIRE_DEVICE();
  Findings findings;
  pd::run_cuda_local_ranks(4, [&](pd::CudaLocalCommunicator& comm) {
    // color = rank % 2, key = -rank: group {0, 2} as ranks {2 -> 0, 0 -> 1}, group {1, 3} as {3 -> 0, 1 -> 1}.
    pd::CudaLocalCommunicator half = comm.split(comm.rank() % 2, -comm.rank());
    static_assert(std::is_same_v<decltype(comm.split(0, 0)), pd::CudaLocalCommunicator>);
    const int want_rank = comm.rank() >= 2 ? 0 : 1;
    if (half.size() != 2 || half.rank() != want_rank)
      findings.add(fmt::format("world rank {}: split rank {} of {}, want {} of 2", comm.rank(), half.rank(),
                               half.size(), want_rank));
    check_collectives<float>(half, findings, 600 + std::uint64_t(comm.rank() % 2), kAllOps);
    // And the world communicator still works after the split.
    DeviceBuffer<float> x(std::vector<float>(8, float(comm.rank() + 1)));
    comm.all_reduce(x.cspan(), x.span(), pd::ReduceOp::sum);
    expect(findings, x.download(), std::vector<float>(8, 10.0f), "world all_reduce after split");
  });
  findings.report();
}

TEST_CASE("cuda_local: a rank that throws fails the others with a CommError naming it") {
  PARADYSE_REQUIRE_DEVICE();
  std::mutex mutex;
  std::vector<std::string> others;
  bool rethrown = false;
  try {
    pd::run_cuda_local_ranks(3, [&](pd::CudaLocalCommunicator& comm) {
      DeviceBuffer<float> x(std::vector<float>(16, 1.0f));
      if (comm.rank() == 1) throw std::runtime_error("rank 1 broke on purpose");
      try {
        comm.all_reduce(x.cspan(), x.span(), pd::ReduceOp::sum);
        std::lock_guard lock(mutex);
        others.push_back("no error");
      } catch (const pd::CommError& e) {
        std::lock_guard lock(mutex);
        others.push_back(e.what());
      }
    });
  } catch (const std::runtime_error& e) {
    rethrown = std::string(e.what()).find("rank 1 broke on purpose") != std::string::npos;
  }
  CHECK(rethrown);
  REQUIRE(others.size() == 2);
  for (const auto& message : others) {
    CAPTURE(message);
    CHECK(message.find("rank 1 failed") != std::string::npos);
    CHECK(message.find("rank 1 broke on purpose") != std::string::npos);
  }
}

TEST_CASE("cuda_local: the reduction kernel rejects what it cannot reduce, naming it") {
  PARADYSE_REQUIRE_DEVICE();
  std::byte* none[1] = {nullptr};
  CHECK_THROWS_WITH_AS(pd::comm_cuda::reduce_in_rank_order(pd::DType::f16, nullptr, none, 1, 0, 4, pd::ReduceOp::sum,
                                                           pd::device::current_stream()),
                       doctest::Contains("cannot reduce f16"), pd::Error);
  CHECK_THROWS_WITH_AS(pd::comm_cuda::reduce_in_rank_order(pd::DType::f32, nullptr, none, 65, 0, 4, pd::ReduceOp::sum,
                                                           pd::device::current_stream()),
                       doctest::Contains("65 ranks"), pd::Error);
}

#if defined(PARADYSE_WITH_NCCL)
TEST_CASE("nccl: p = 1 over the file bootstrap: every collective, split, stats (the plumbing; one GPU runs p = 1)") {
  PARADYSE_REQUIRE_DEVICE();
  const std::string path = fmt::format("/tmp/paradyse_test_nccl_{}.id", ::getpid());
  std::remove(path.c_str());
  Findings findings;
  {
    pd::NcclCommunicator comm = pd::NcclCommunicator::from_file(path, 0, 1);
    CHECK(comm.size() == 1);
    CHECK(comm.rank() == 0);
    check_collectives<float>(comm, findings, 700, kAllOps);
    check_collectives<pd::bf16>(comm, findings, 800, kAllOps);
    check_collectives<std::int64_t>(comm, findings, 900, kAllOps);
    check_collectives<std::byte>(comm, findings, 1000, {});
    pd::NcclCommunicator alone = comm.split(3, 0);
    CHECK(alone.size() == 1);
    check_collectives<float>(alone, findings, 1100, kAllOps);
    CHECK_FALSE(comm.aborted());
  }
  std::remove(path.c_str());
  findings.report();
}

TEST_CASE("nccl: a rank other than 0 times out waiting for the id file, naming the path") {
  PARADYSE_REQUIRE_DEVICE();
  const std::string path = fmt::format("/tmp/paradyse_test_nccl_missing_{}.id", ::getpid());
  std::remove(path.c_str());
  pd::NcclOptions options;
  options.timeout = std::chrono::milliseconds(200);
  CHECK_THROWS_WITH_AS(pd::NcclCommunicator::from_file(path, 1, 2, options), doctest::Contains(path.c_str()),
                       pd::CommError);
}
#endif
