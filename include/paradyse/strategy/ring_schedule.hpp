// paradyse/strategy/ring_schedule.hpp: the ring engine: the two ring schedules every ring in the library runs on,
// as functions over visits (ZeRO-3 column linears, ring attention, METP's shard rings, ColossalZ's RSA).
//
//   rotate_blocks: every rank's block visits every rank once (p - 1 hops of shift_async). Double-buffered: the next
//     hop is posted before the current block is visited, so the transfer overlaps the visit. ZeRO-3 weight shards,
//     ring attention's K/V, METP's MLP weight shards and RSA's K and V travel this way.
//   rotate_blocks_with_sums: the same, and a running sum (a gradient) travels with each block: every rank adds its
//     contribution and passes the sum on; one extra hop brings the complete sum home to the block's owner (a
//     reduce-scatter fused into the ring). Used by every backward of the above.
//
// Blocks may differ in size from owner to owner (uneven token chunks): size_of(owner) gives the element count of
// owner's block, so every receive is posted with the exact size the sender sends.
//
// Message order: rotate_blocks_with_sums keeps two exchanges in flight (blocks and sums) on the same neighbour pair.
// Every rank posts and waits them in one fixed order, so the per-pair FIFO matching of the communicators pairs them,
// and no wait can deadlock (every exchange's receive completes before its send is awaited, in the same order on every
// rank). A visit must not communicate on the same communicator unless every rank does so identically.
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/ops/backend.hpp"
#include "paradyse/strategy/buffer_pool.hpp"

#include <algorithm>
#include <cstdint>
#include <span>
#include <utility>

namespace paradyse {

namespace ring_schedule_detail {
template <class SizeOf>
std::int64_t largest(int ranks, SizeOf& size_of) {
  std::int64_t most = 0;
  for (int r = 0; r < ranks; ++r) most = std::max(most, std::int64_t(size_of(r)));
  return most;
}
inline int wrap(int rank, int ranks) { return ((rank % ranks) + ranks) % ranks; }
}  // namespace ring_schedule_detail

// Calls visit(source, block) for the block of every rank, starting with this rank's own and then those of rank - 1,
// rank - 2, ... (block: std::span<const float>, valid during the call only). pack_own(destination) writes this
// rank's block (size_of(rank) elements) straight into the ring's first buffer.
template <Communicator C, class SizeOf, class PackOwn, class Visit>
void rotate_blocks(C& comm, BufferPool& pool, SizeOf&& size_of, PackOwn&& pack_own, Visit&& visit) {
  using ring_schedule_detail::wrap;
  const int p = comm.size(), rank = comm.rank();
  const std::int64_t capacity = ring_schedule_detail::largest(p, size_of);
  PooledBuffer<float> first = pool.acquire<float>(Shape{capacity});
  PooledBuffer<float> second = pool.acquire<float>(Shape{p > 1 ? capacity : 0});
  // The two buffers trade roles each step (pointers swap, the loans stay put).
  float* current = first.data();
  float* incoming = second.data();
  pack_own(std::span<float>(current, std::size_t(size_of(rank))));
  for (int step = 0; step < p; ++step) {
    const int source = wrap(rank - step, p);
    const std::span<const float> block(current, std::size_t(size_of(source)));
    Request next;
    if (step + 1 < p)
      next = comm.shift_async(block, std::span<float>(incoming, std::size_t(size_of(wrap(source - 1, p)))), 1);
    visit(source, block);
    next.wait();
    std::swap(current, incoming);
  }
}

// Calls visit(source, block, sum) for the block of every rank as rotate_blocks does, with sum (std::span<float>,
// sum_size_of(source) elements) zeroed for visit to accumulate this rank's contribution into. Then calls
// home(total) once with the sum of every rank's contribution to this rank's own block.
template <class Backend = ops::Cpu, Communicator C, class SizeOf, class SumSizeOf, class PackOwn, class Visit, class Home>
void rotate_blocks_with_sums(C& comm, BufferPool& pool, SizeOf&& size_of, SumSizeOf&& sum_size_of, PackOwn&& pack_own,
                         Visit&& visit, Home&& home) {
  using ring_schedule_detail::wrap;
  const int p = comm.size(), rank = comm.rank();
  const std::int64_t capacity = ring_schedule_detail::largest(p, size_of);
  PooledBuffer<float> block_a = pool.acquire<float>(Shape{capacity});
  float* current = block_a.data();
  pack_own(std::span<float>(current, std::size_t(size_of(rank))));
  const std::int64_t sum_capacity = ring_schedule_detail::largest(p, sum_size_of);
  auto sum_span = [&](float* buffer, int owner) {
    return std::span<float>(buffer, std::size_t(sum_size_of(wrap(owner, p))));
  };
  PooledBuffer<float> sum_a = pool.acquire<float>(Shape{sum_capacity});
  float* work = sum_a.data();
  if (p == 1) {
    const std::span<float> sum = sum_span(work, rank);
    Backend::fill(sum, 0.0f);
    visit(rank, std::span<const float>(current, std::size_t(size_of(rank))), sum);
    home(std::span<const float>(sum));
    return;
  }
  PooledBuffer<float> block_b = pool.acquire<float>(Shape{capacity});
  float* incoming = block_b.data();
  // The sums: the one this step adds into, the one on its way to the next rank, the one arriving from the last.
  // Buffers trade roles by pointer; the loans stay put.
  PooledBuffer<float> sum_b = pool.acquire<float>(Shape{sum_capacity});
  PooledBuffer<float> sum_c = pool.acquire<float>(Shape{sum_capacity});
  float* sending = sum_b.data();
  float* arriving = sum_c.data();
  Request block_next, sum_next;
  for (int step = 0; step < p; ++step) {
    const int source = wrap(rank - step, p);
    const std::span<const float> block(current, std::size_t(size_of(source)));
    if (step + 1 < p)
      block_next = comm.shift_async(block, std::span<float>(incoming, std::size_t(size_of(wrap(source - 1, p)))), 1);
    const std::span<float> sum = sum_span(work, source);
    Backend::fill(sum, 0.0f);
    visit(source, block, sum);
    if (step > 0) {  // the running sum of this block from the ranks before us
      sum_next.wait();
      Backend::add_into(sum, std::span<const float>(sum_span(arriving, source)));
    }
    std::swap(work, sending);  // the sum travels on; last step's sent buffer (its send is complete) is the next work
    sum_next = comm.shift_async(std::span<const float>(sum_span(sending, source)), sum_span(arriving, source - 1), 1);
    if (step + 1 < p) {
      block_next.wait();
      std::swap(current, incoming);
    }
  }
  sum_next.wait();  // the last hop: this rank's own block's complete sum
  home(std::span<const float>(sum_span(arriving, rank)));
}

}  // namespace paradyse
