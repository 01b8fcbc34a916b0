// paradyse/strategy/owner_broadcast.hpp: blocks broadcast from their owners one at a time, double-buffered.
//
// OwnerBroadcast walks a list of owner ranks in order. next() waits for the current owner's block and, before
// returning it, starts the broadcast of the next owner's block into the other buffer, so that block travels while
// the caller computes on this one: a rank holds at most two owners' blocks at a time, never all of them (ZeRO-3's
// prefetch, per owner). The owner packs its own block into the buffer just before its broadcast starts.
// It serves METP's attention shards (strategy/metp.hpp: every rank owns one [A, h] shard) and expert tensor
// parallelism's experts (moe/moe_layer.hpp: the ranks that own experts, blocks of different sizes).
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/strategy/buffer_pool.hpp"

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

namespace paradyse {

template <Communicator C, class Size, class Pack>
class OwnerBroadcast {
public:
  // owners: the broadcasting ranks, in order; size(owner): the elements of its block; pack(std::span<float> block):
  // writes this rank's own block (called once, when its turn comes). buffers: the two buffers the blocks alternate
  // in, each large enough for any block (the caller acquires them, in its order; the second may be empty when there
  // is one owner). The first broadcast starts here.
  OwnerBroadcast(C& comm, std::array<PooledBuffer<float>, 2> buffers, std::vector<int> owners, Size size, Pack pack)
      : comm_(comm), buffers_(std::move(buffers)), owners_(std::move(owners)), size_(std::move(size)),
        pack_(std::move(pack)) {
    if (!owners_.empty()) start(0);
  }

  std::size_t owners() const noexcept { return owners_.size(); }
  // The next owner's block: waits for it and starts the broadcast of the one after. The span stays valid until the
  // call after next.
  std::span<const float> next() {
    check(next_ < owners_.size(), "OwnerBroadcast: next() called after the last of {} owners", owners_.size());
    pending_.wait();
    const std::size_t i = next_++;
    if (next_ < owners_.size()) start(next_);
    return block(i);
  }

private:
  std::span<float> block(std::size_t i) const {
    return buffers_[i % 2].span().first(std::size_t(size_(owners_[i])));
  }
  void start(std::size_t i) {
    const std::span<float> target = block(i);
    if (owners_[i] == comm_.rank()) pack_(target);
    pending_ = comm_.broadcast_async(target, owners_[i]);
  }

  C& comm_;
  std::array<PooledBuffer<float>, 2> buffers_;
  std::vector<int> owners_;
  Size size_;
  Pack pack_;
  Request pending_;
  std::size_t next_ = 0;
};

}  // namespace paradyse
