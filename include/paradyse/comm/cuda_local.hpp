// paradyse/comm/cuda_local.hpp: p ranks on ONE GPU, as threads of one process, so that every strategy and mix can
// run on a single device.
//
//   run_cuda_local_ranks(4, [](CudaLocalCommunicator& comm) { ... comm.all_reduce(x, x, ReduceOp::sum); ... });
//
// It is the threads backend (comm/threads.hpp) with device data movement: the same rendezvous, sequence numbers,
// failure propagation (a rank that throws fails the others with a CommError naming it), timeouts, out-of-step
// detection and stats (ring bytes, nccl-tests' bus-bandwidth convention). What differs is how bytes move
// (CudaDataMovement): a part of a collective is executed by whichever rank thread waits for it, as
// cudaMemcpyAsync(cudaMemcpyDefault) and the rank-order reduction kernel (comm/cuda_reduce.hpp) on THAT thread's
// stream, and the stream is synchronised before the part is marked done. Reductions are bitwise those of the
// threads backend (rank order, bf16 accumulated in float).
//
// Streams and ordering. Each rank thread gets its own non-blocking stream, installed as its current stream
// (device::ScopedStream), so its ops and those of other ranks may overlap. A rank's buffers are produced and
// consumed asynchronously on its stream, so posting an operation first synchronises the posting rank's stream
// (its data is final and nothing of its own still reads or writes its buffers); when a wait returns the bytes are
// in place (the executing streams were synchronised), visible to any later work. Asynchronous forms overlap compute
// issued between post and wait only on the host side: the copies run when some rank waits.
//
// Buffers are device pointers (or any pointer cudaMemcpyDefault understands); a reduction runs on the device when its
// buffers are device memory and on the host, as the threads backend's, when they are all host memory (a model's
// scalars). A reduction mixing the two is not supported.
// Memory. Each rank's tracker (installed as its current one) is a device tracker over its own caching allocator
// (device/caching_allocator.hpp), so the tensors a rank makes are device memory on its GPU, counted and capped per
// rank; a block freed by a rank comes back only to that rank's stream. Staged copies of a collective's input (an
// in-place shift, an overlapping all_to_all) come from the posting rank's tracker and are freed only after every
// stream that read them was synchronised.
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/comm/cuda_reduce.hpp"
#include "paradyse/comm/threads.hpp"
#include "paradyse/comm/threads_detail.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/core/memory.hpp"
#include "paradyse/device/caching_allocator.hpp"
#include "paradyse/device/runtime.hpp"
#include "paradyse/device/stream.hpp"

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <utility>

namespace paradyse {

// Device data movement for thread ranks on one GPU: copies and reductions on the calling thread's current stream.
class CudaDataMovement final : public threads_detail::DataMovement {
public:
  void before_post() const override { device::synchronize(); }
  void copy(std::byte* dst, const std::byte* src, std::size_t bytes) const override {
    if (bytes == 0 || dst == src) return;
    PARADYSE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, device::current_stream()));
  }
  // Chunk i -> j and j -> i, either possibly in place: i's chunk is staged in stream-ordered scratch first.
  void exchange(const std::byte* from_i, std::byte* to_i, const std::byte* from_j, std::byte* to_j,
                std::size_t bytes) const override {
    if (bytes == 0) return;
    if (from_i == from_j) {  // the diagonal
      copy(to_i, from_i, bytes);
      return;
    }
    const cudaStream_t stream = device::current_stream();
    void* scratch = nullptr;
    PARADYSE_CUDA_CHECK(cudaMallocAsync(&scratch, bytes, stream));
    auto* staged = static_cast<std::byte*>(scratch);
    copy(staged, from_i, bytes);  // what j receives, kept aside
    copy(to_i, from_j, bytes);    // i receives j's chunk (may overwrite from_i: it is staged)
    copy(to_j, staged, bytes);    // j receives i's chunk (may overwrite from_j: already read)
    PARADYSE_CUDA_CHECK(cudaFreeAsync(scratch, stream));
  }
  // Device buffers: the rank-order kernel. Host buffers (a loss or a token count on the stack, as a model
  // all-reduces its scalars): the threads backend's own host reduction, in the same rank order.
  void reduce(DType dtype, threads_detail::ReduceFn host_reduce, std::byte* out, const std::byte* const* in, int ranks,
              std::size_t begin, std::size_t end, ReduceOp op) const override {
    bool host = !on_device(out);
    for (int r = 0; r < ranks && host; ++r) host = !on_device(in[r]);
    if (host) {
      host_reduce(out, in, ranks, begin, end, op);
      return;
    }
    comm_cuda::reduce_in_rank_order(dtype, out, in, ranks, begin, end, op, device::current_stream());
  }
  void finish_part() const override { device::synchronize(); }

private:
  // Whether p is device (or managed) memory; plain host memory is unknown to CUDA.
  static bool on_device(const void* p) {
    cudaPointerAttributes attributes{};
    if (cudaPointerGetAttributes(&attributes, p) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    return attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged;
  }
};

// One rank's handle on a group of CUDA ranks on one GPU: a ThreadCommunicator whose bytes move on the device, and
// whose split() stays a CudaLocalCommunicator. Move-only; a pending Request refers to its communicator.
class CudaLocalCommunicator : public ThreadCommunicator {
public:
  using ThreadCommunicator::ThreadCommunicator;
  explicit CudaLocalCommunicator(ThreadCommunicator&& base) noexcept : ThreadCommunicator(std::move(base)) {}

  // The ranks of one color form a new group, ordered by key and then by rank. Collective over this group.
  CudaLocalCommunicator split(int color, int key) { return CudaLocalCommunicator(ThreadCommunicator::split(color, key)); }
};

static_assert(Communicator<CudaLocalCommunicator>);

// Options for run_cuda_local_ranks.
struct CudaLocalOptions {
  std::size_t memory_cap_per_rank = MemoryTracker::kNoCap;
  std::chrono::milliseconds timeout = comm_timeout();
  int device = -1;  // the GPU every rank uses; -1: the calling thread's current device
  // Makes rank r's tracker from the cap; null: a device tracker over its own caching allocator on `device`.
  std::function<std::unique_ptr<MemoryTracker>(int rank, std::size_t cap)> make_tracker;
};

namespace cuda_local_detail {
// What a rank thread holds while it runs: its device selected, its own stream created and installed as current.
class RankDevice {
public:
  explicit RankDevice(int device) : stream_(select(device)), scoped_(stream_.get()) {}
  RankDevice(const RankDevice&) = delete;
  RankDevice& operator=(const RankDevice&) = delete;

private:
  static device::Stream select(int device) {
    PARADYSE_CUDA_CHECK(cudaSetDevice(device));
    return device::Stream();
  }
  device::Stream stream_;  // waits for its work when destroyed (after scoped_ restored the previous stream)
  device::ScopedStream scoped_;
};
}  // namespace cuda_local_detail

// Runs fn(comm) on `ranks` thread ranks on one GPU, each with its own stream (its current stream) and tracker. If a
// rank throws, every other rank's communication fails promptly with a CommError naming it, and the first failure
// is rethrown. Returns each rank's peak tracked bytes and stats.
template <class Fn>
RunReport run_cuda_local_ranks(int ranks, Fn&& fn, CudaLocalOptions options = {}) {
  check(ranks >= 1 && ranks <= comm_cuda::kMaxReduceRanks, "run_cuda_local_ranks: {} ranks, expected 1 to {}", ranks,
        comm_cuda::kMaxReduceRanks);
  int device = options.device;
  if (device < 0) PARADYSE_CUDA_CHECK(cudaGetDevice(&device));
  RunOptions run;
  run.memory_cap_per_rank = options.memory_cap_per_rank;
  run.timeout = options.timeout;
  run.movement = std::make_shared<const CudaDataMovement>();
  run.make_tracker = std::move(options.make_tracker);
  if (!run.make_tracker)
    run.make_tracker = [device](int, std::size_t cap) {
      return std::make_unique<MemoryTracker>(MemorySpace::device, std::make_shared<device::CachingAllocator>(device),
                                             cap);
    };
  return threads_detail::run_thread_ranks<CudaLocalCommunicator>(
      ranks, fn, std::move(run), [device](int) { return std::make_unique<cuda_local_detail::RankDevice>(device); });
}

}  // namespace paradyse
