// paradyse/serve/redistribute.hpp: moving one MoE layer's routed experts between layouts (TP slices <-> EP whole
// experts, or one EP placement to another, as EPLB asks), by point-to-point transfers of weight pieces straight from
// the old banks into the new ones, layer by layer.
//
// A layout says where each column range of each expert lives: TP gives rank r columns chunk_range(f, p, r) of every
// expert (bank slot e); EP(placement) gives every listed slot the whole expert. The plan lists pieces (expert,
// columns [c0, c1), source rank and slot, destination rank and slot); every rank derives the same plan. A piece is 3
// (c1 - c0) h floats: the gate and up rows of W_in and the rows of W_out, three row ranges each contiguous in the
// source bank and in the destination bank alike, so each travels as one message, unpacked. Sources: a TP layout
// splits a range over the ranks that hold its parts; an EP layout sends from the first rank (and slot) that holds the
// expert.
//
// begin() allocates the new banks, copies the pieces the rank keeps and posts a send of every row range another rank
// needs and a receive of every one it needs from another (in plan order on every rank: the transfers of a pair match
// in order; every transfer is posted before any is waited for, as the engine's host ranks, threads and MPI, allow: a
// backend whose sends block until matched would need them grouped); finish() waits for them and installs the new
// banks. The engine posts layer l right after layer l computed in the old layout, so the transfers overlap the next
// layers, and finishes every layer before the next step (the time spent there is the exposed time).
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/serve/rank_shard.hpp"

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

namespace paradyse::serve {

struct ExpertLayout {
  MoeMode mode = MoeMode::tp;
  std::vector<std::vector<std::int64_t>> placement;  // ep: experts of each rank

  static ExpertLayout tp() { return {MoeMode::tp, {}}; }
  static ExpertLayout ep(std::vector<std::vector<std::int64_t>> placement) { return {MoeMode::ep, std::move(placement)}; }
  friend bool operator==(const ExpertLayout&, const ExpertLayout&) = default;
};

// The routed-expert banks rank r of p holds in `layout`: `slots` experts (TP every expert, EP its placement's slots)
// of `width` ffn columns (TP its chunk_range slice of f, EP all f); the banks are [slots, 2 width, h], [slots, width, h].
struct BankShape {
  std::int64_t slots = 0, width = 0;
};
inline BankShape bank_shape(const ExpertLayout& layout, std::int64_t experts, std::int64_t f, int p, int r) {
  if (layout.mode == MoeMode::tp) return {experts, chunk_range(f, p, r).length};
  return {std::int64_t(layout.placement[std::size_t(r)].size()), f};
}

struct WeightPiece {
  std::int64_t expert = 0, c0 = 0, c1 = 0;  // expert columns [c0, c1)
  int src = 0, dst = 0;
  std::int64_t src_slot = 0, src_col = 0;  // columns start at src_col of the source slot
  std::int64_t dst_slot = 0, dst_col = 0;
};

// The pieces that turn `from` into `to` for E experts of width f over p ranks, in destination order.
inline std::vector<WeightPiece> redistribution_plan(const ExpertLayout& from, const ExpertLayout& to,
                                                    std::int64_t experts, std::int64_t f, int p) {
  std::vector<WeightPiece> plan;
  auto add_from_source = [&](std::int64_t e, std::int64_t c0, std::int64_t c1, int dst, std::int64_t dst_slot,
                             std::int64_t dst_col0) {
    if (c1 <= c0) return;
    if (from.mode == MoeMode::tp) {
      for (int r = 0; r < p; ++r) {
        const ChunkRange cols = chunk_range(f, p, r);
        const std::int64_t a = std::max(c0, cols.start), b = std::min(c1, cols.end());
        if (a < b) plan.push_back({e, a, b, r, dst, e, a - cols.start, dst_slot, dst_col0 + (a - c0)});
      }
      return;
    }
    for (int r = 0; r < p; ++r) {
      const std::vector<std::int64_t>& slots = from.placement[std::size_t(r)];
      for (std::size_t s = 0; s < slots.size(); ++s)
        if (slots[s] == e) {
          plan.push_back({e, c0, c1, r, dst, std::int64_t(s), c0, dst_slot, dst_col0});
          return;
        }
    }
    throw Error(fmt::format("redistribution_plan: expert {} is held by no rank of the source layout", e));
  };
  for (int q = 0; q < p; ++q) {
    if (to.mode == MoeMode::tp) {
      const ChunkRange cols = chunk_range(f, p, q);
      for (std::int64_t e = 0; e < experts; ++e) add_from_source(e, cols.start, cols.end(), q, e, 0);
    } else {
      const std::vector<std::int64_t>& slots = to.placement[std::size_t(q)];
      for (std::size_t s = 0; s < slots.size(); ++s) add_from_source(slots[s], 0, f, q, std::int64_t(s), 0);
    }
  }
  return plan;
}

// Each rank's bytes in changing one layer by `plan` (a piece is 3 (c1 - c0) h elements of `b` bytes): sent to other
// ranks, received from them, and copied within the rank (the pieces it keeps).
struct RankMoveBytes {
  double sent = 0, received = 0, kept = 0;
};
inline std::vector<RankMoveBytes> move_bytes(const std::vector<WeightPiece>& plan, std::int64_t h, int p, int b) {
  std::vector<RankMoveBytes> out(static_cast<std::size_t>(p));
  for (const WeightPiece& w : plan) {
    const double bytes = 3.0 * double(w.c1 - w.c0) * double(h) * b;
    if (w.src == w.dst) {
      out[std::size_t(w.src)].kept += bytes;
    } else {
      out[std::size_t(w.src)].sent += bytes;
      out[std::size_t(w.dst)].received += bytes;
    }
  }
  return out;
}

// One layer's exchange in flight.
class LayerRedistribution {
public:
  // Starts moving layer `L` (whose banks are in `from`) towards `to`. L and its old banks must stay alive and
  // unwritten until finish().
  template <Communicator C>
  void begin(C& comm, const DecoderConfig& c, RankLayer& L, const ExpertLayout& from, const ExpertLayout& to) {
    layer_ = &L;
    to_ = to;
    const int p = comm.size(), me = comm.rank();
    rank_ = me;
    const std::int64_t f = c.moe.expert_ffn, h = c.hidden;
    // The new banks, unzeroed: the plan's pieces for this rank cover every column of every slot.
    const BankShape bank = bank_shape(to, c.moe.experts, f, p, me);
    const std::int64_t w = bank.width;
    in_ = Tensor<float>::uninitialized(Shape{bank.slots, 2 * w, h});
    out_ = Tensor<float>::uninitialized(Shape{bank.slots, w, h});
    const std::int64_t old_w = L.expert_out.extent(1);
    for (const WeightPiece& piece : redistribution_plan(from, to, c.moe.experts, f, p)) {
      if (piece.src != me && piece.dst != me) continue;
      const std::size_t floats = std::size_t((piece.c1 - piece.c0) * h);  // of each row range
      for (int part = 0; part < 3; ++part) {
        const float* src = piece.src == me ? rows(L.expert_in, L.expert_out, part, piece.src_slot, old_w, piece.src_col)
                                           : nullptr;
        float* dst = piece.dst == me ? rows(in_, out_, part, piece.dst_slot, w, piece.dst_col) : nullptr;
        if (!dst) {
          requests_.push_back(comm.send_async(std::span<const float>(src, floats), piece.dst));
          bytes_sent_ += floats * sizeof(float);
        } else if (!src) {
          requests_.push_back(comm.recv_async(std::span<float>(dst, floats), piece.src));
        } else {
          std::copy(src, src + floats, dst);  // a piece this rank keeps
        }
      }
    }
  }

  // Waits for the transfers and installs the new banks in the layer.
  void finish() {
    for (Request& r : requests_) r.wait();
    requests_.clear();
    RankLayer& L = *layer_;
    L.expert_in = std::move(in_);
    L.expert_out = std::move(out_);
    L.mode = to_.mode;
    L.placement = to_.placement;
    L.slot_expert = to_.mode == MoeMode::ep ? to_.placement[std::size_t(rank_)] : std::vector<std::int64_t>{};
  }

  // Expert bytes this rank sent to the other ranks.
  std::size_t bytes_sent() const noexcept { return bytes_sent_; }

private:
  // The first float of row range `part` of the columns from `col` of a bank pair of width w in `slot`: 0 the gate rows,
  // 1 the up rows (W_in's second half), 2 W_out's rows.
  static float* rows(Tensor<float>& in, Tensor<float>& out, int part, std::int64_t slot, std::int64_t w,
                     std::int64_t col) {
    return part < 2 ? &in(slot, part * w + col, std::int64_t(0)) : &out(slot, col, std::int64_t(0));
  }

  RankLayer* layer_ = nullptr;
  ExpertLayout to_;
  int rank_ = 0;
  Tensor<float> in_, out_;
  std::vector<Request> requests_;
  std::size_t bytes_sent_ = 0;
};

}  // namespace paradyse::serve
