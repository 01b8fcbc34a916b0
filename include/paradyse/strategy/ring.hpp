// paradyse/strategy/ring.hpp: passing blocks around the ring of ranks, double-buffered so the transfer of the
// next block overlaps the computation on the current one.
//
// At step i (0 <= i < p) rank r holds the block that started on rank (r - i) mod p; each step sends the current
// block to rank r + 1 and receives the next one from rank r - 1. ZeRO-3's rotating weight shards, ring attention's
// K/V blocks and the (w, dw) pairs of a ZeRO-3 backward all use it:
//
//   RingPass ring(comm, pool, my_block);
//   for (int i = 0; i < p; ++i) {
//     if (i + 1 < p) ring.start_next();     // async: send current, receive next into the other buffer
//     compute(ring.current(), ring.owner());
//     if (i + 1 < p) ring.finish_next();    // wait; the received block becomes current
//   }
//
// A block that must change before it travels on (an accumulating gradient) uses mutable_current() and calls
// start_next() only after the change. Only two buffers of the block's size are alive at a time.
//
// Several rings may be in flight on the same neighbours (weights and their gradients): receives from one peer are
// matched to its messages in the order they were posted (MPI's rule, and the threads backend's), so each ring gets
// its own blocks; the ZeRO-3 backward still finishes them in the order it started them.
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/ops/backend.hpp"
#include "paradyse/strategy/buffer_pool.hpp"

#include <cstdint>
#include <span>
#include <utility>

namespace paradyse {

template <Communicator Comm, class Backend = ops::Cpu>
class RingPass {
public:
  // The ring starts on `first` (this rank's block). With copy = false the first block is read in place and must
  // stay alive and unchanged until the first finish_next(); with copy = true it is copied into a pool buffer (so
  // it may be mutated through mutable_current()).
  RingPass(Comm& comm, BufferPool& pool, std::span<const float> first, bool copy = false)
      : comm_(&comm), size_(first.size()) {
    if (copy || comm.size() > 1) buffers_[0] = pool.acquire<float>(Shape{std::int64_t(size_)});
    if (comm.size() > 1) buffers_[1] = pool.acquire<float>(Shape{std::int64_t(size_)});
    if (copy) {
      if (size_) Backend::copy(first, buffers_[0].span());
      current_ = buffers_[0].data();
      current_index_ = 0;
    } else {
      current_ = const_cast<float*>(first.data());  // read-only until a buffer of ours holds the block
      current_index_ = -1;
    }
  }

  // A ring that starts on a zero block of `size` elements (an accumulator, such as a travelling gradient).
  static RingPass zeros(Comm& comm, BufferPool& pool, std::size_t size) {
    RingPass ring(comm, pool, std::span<const float>(static_cast<const float*>(nullptr), 0), true);
    ring.size_ = size;
    ring.buffers_[0] = pool.acquire<float>(Shape{std::int64_t(size)});
    Backend::fill(ring.buffers_[0].view(), 0.0f);
    if (comm.size() > 1) ring.buffers_[1] = pool.acquire<float>(Shape{std::int64_t(size)});
    ring.current_ = ring.buffers_[0].data();
    return ring;
  }

  int step() const noexcept { return step_; }
  // The rank whose block this rank holds now.
  int owner() const noexcept {
    const int p = comm_->size();
    return ((comm_->rank() - step_) % p + p) % p;
  }
  std::span<const float> current() const noexcept { return {current_, size_}; }
  std::span<float> mutable_current() {
    check(current_index_ >= 0, "RingPass: the first block is read in place; construct with copy = true to mutate it");
    return {current_, size_};
  }

  // Starts sending the current block to rank + 1 and receiving the next into the other buffer.
  void start_next() {
    check(!pending_.pending(), "RingPass: start_next() twice without finish_next()");
    const int next_index = current_index_ == 0 ? 1 : 0;
    next_ = buffers_[std::size_t(next_index)].data();
    next_index_ = next_index;
    pending_ = comm_->shift_async(std::span<const float>(current_, size_), std::span<float>(next_, size_), 1);
  }
  // Completes the exchange; the received block becomes current.
  void finish_next() {
    pending_.wait();
    current_ = next_;
    current_index_ = next_index_;
    ++step_;
  }

private:
  Comm* comm_;
  std::size_t size_;
  PooledBuffer<float> buffers_[2];
  float* current_ = nullptr;
  float* next_ = nullptr;
  int current_index_ = -1, next_index_ = 0;
  int step_ = 0;
  Request pending_;
};

}  // namespace paradyse
