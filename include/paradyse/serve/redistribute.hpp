// paradyse/serve/redistribute.hpp: moving one MoE layer's routed experts between layouts (TP slices <-> EP whole
// experts, or one EP placement to another, as EPLB asks), by an all-to-all-v of weight pieces, layer by layer.
//
// A layout says where each column range of each expert lives: TP gives rank r columns chunk_range(f, p, r) of every
// expert (bank slot e); EP(placement) gives every listed slot the whole expert. The plan lists pieces (expert,
// columns [c0, c1), source rank and slot, destination rank and slot); every rank derives the same plan, packs the
// pieces it sends in destination order and unpacks what it receives. A piece is 3 (c1 - c0) h floats: the gate and
// up rows of W_in and the rows of W_out. Sources: a TP layout splits a range over the ranks that hold its parts;
// an EP layout sends from the first rank (and slot) that holds the expert.
//
// begin() posts the exchange (all_to_all_v_async) and returns; finish() waits, unpacks into the new banks and
// installs them. The engine posts layer l right after layer l computed in the old layout, so the transfer overlaps
// the next layers, and finishes every layer before the next step (the time spent there is the exposed time).
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/serve/rank_shard.hpp"

#include <cstdint>
#include <vector>

namespace paradyse::serve {

struct ExpertLayout {
  MoeMode mode = MoeMode::tp;
  std::vector<std::vector<std::int64_t>> placement;  // ep: experts of each rank

  static ExpertLayout tp() { return {MoeMode::tp, {}}; }
  static ExpertLayout ep(std::vector<std::vector<std::int64_t>> placement) { return {MoeMode::ep, std::move(placement)}; }
  friend bool operator==(const ExpertLayout&, const ExpertLayout&) = default;
};

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

// One layer's exchange in flight.
class LayerRedistribution {
public:
  // Posts the exchange of layer `L` (whose banks are in `from`) towards `to`. L must stay alive until finish().
  template <Communicator C>
  void begin(C& comm, const DecoderConfig& c, RankLayer& L, const ExpertLayout& from, const ExpertLayout& to) {
    layer_ = &L;
    to_ = to;
    const int p = comm.size(), me = comm.rank();
    const std::int64_t f = c.moe.expert_ffn, h = c.hidden;
    plan_ = redistribution_plan(from, to, c.moe.experts, f, p);
    send_counts_.assign(std::size_t(p), 0);
    recv_counts_.assign(std::size_t(p), 0);
    for (const WeightPiece& w : plan_) {
      if (w.src == me) send_counts_[std::size_t(w.dst)] += 3 * (w.c1 - w.c0) * h;
      if (w.dst == me) recv_counts_[std::size_t(w.src)] += 3 * (w.c1 - w.c0) * h;
    }
    std::int64_t total_send = 0, total_recv = 0;
    for (int q = 0; q < p; ++q) total_send += send_counts_[std::size_t(q)], total_recv += recv_counts_[std::size_t(q)];
    send_ = std::vector<float>(std::size_t(total_send));
    recv_ = std::vector<float>(std::size_t(total_recv));
    // Pack in (destination, plan) order: all_to_all_v sends block q to rank q.
    std::size_t at = 0;
    const std::int64_t src_width = L.expert_out.extent(1);
    for (int q = 0; q < p; ++q)
      for (const WeightPiece& w : plan_) {
        if (w.src != me || w.dst != q) continue;
        for (std::int64_t col = 0; col < w.c1 - w.c0; ++col) {
          const float* gate = &L.expert_in(w.src_slot, w.src_col + col, std::int64_t(0));
          const float* up = &L.expert_in(w.src_slot, src_width + w.src_col + col, std::int64_t(0));
          const float* out = &L.expert_out(w.src_slot, w.src_col + col, std::int64_t(0));
          for (const float* row : {gate, up, out}) {
            std::copy(row, row + h, send_.begin() + std::ptrdiff_t(at));
            at += std::size_t(h);
          }
        }
      }
    bytes_sent_ = std::size_t(total_send) * sizeof(float);
    request_ = comm.all_to_all_v_async(std::span<const float>(send_), send_counts_, std::span<float>(recv_), recv_counts_);
  }

  // Waits for the exchange, builds the new banks and installs them in the layer.
  void finish(const DecoderConfig& c, int p, int me) {
    request_.wait();
    const std::int64_t f = c.moe.expert_ffn, h = c.hidden;
    RankLayer& L = *layer_;
    Tensor<float> in, out;
    std::int64_t width = f;
    if (to_.mode == MoeMode::tp) {
      width = chunk_range(f, p, me).length;
      in = Tensor<float>(Shape{c.moe.experts, 2 * width, h});
      out = Tensor<float>(Shape{c.moe.experts, width, h});
    } else {
      const std::int64_t slots = std::int64_t(to_.placement[std::size_t(me)].size());
      in = Tensor<float>(Shape{slots, 2 * f, h});
      out = Tensor<float>(Shape{slots, f, h});
    }
    // Received blocks arrive in source-rank order, each in (destination, plan) order of that source.
    std::vector<std::size_t> start(static_cast<std::size_t>(p), 0);
    for (int q = 1; q < p; ++q) start[std::size_t(q)] = start[std::size_t(q - 1)] + std::size_t(recv_counts_[std::size_t(q - 1)]);
    for (const WeightPiece& w : plan_) {
      if (w.dst != me) continue;
      std::size_t& at = start[std::size_t(w.src)];
      for (std::int64_t col = 0; col < w.c1 - w.c0; ++col) {
        float* gate = &in(w.dst_slot, w.dst_col + col, std::int64_t(0));
        float* up = &in(w.dst_slot, width + w.dst_col + col, std::int64_t(0));
        float* o = &out(w.dst_slot, w.dst_col + col, std::int64_t(0));
        for (float* row : {gate, up, o}) {
          std::copy(recv_.begin() + std::ptrdiff_t(at), recv_.begin() + std::ptrdiff_t(at + std::size_t(h)), row);
          at += std::size_t(h);
        }
      }
    }
    L.expert_in = std::move(in);
    L.expert_out = std::move(out);
    L.mode = to_.mode;
    L.placement = to_.placement;
    L.slot_expert = to_.mode == MoeMode::ep ? to_.placement[std::size_t(me)] : std::vector<std::int64_t>{};
    send_ = {};
    recv_ = {};
  }

  std::size_t bytes_sent() const noexcept { return bytes_sent_; }

private:
  RankLayer* layer_ = nullptr;
  ExpertLayout to_;
  std::vector<WeightPiece> plan_;
  std::vector<std::int64_t> send_counts_, recv_counts_;
  std::vector<float> send_, recv_;
  Request request_;
  std::size_t bytes_sent_ = 0;
};

}  // namespace paradyse::serve
