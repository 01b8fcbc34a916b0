// paradyse/serve/rank_shard.hpp: what rank r of p holds of a decoder for serving.
//
// Attention is tensor-parallel by heads: rank r owns the query heads chunk_range(H, p, r) and the key/value heads
// those queries read (GQA: when p > KV, ranks whose queries share a key/value head each hold it). The dense FFN and
// the shared expert are sliced by ffn columns (chunk_range(F, p, r)); norms, the router, the shared expert's gate,
// the embedding and the lm_head are replicated. The routed experts have two layouts (MoeMode):
//   - tp: every expert sliced by ffn columns (chunk_range(f, p, r) of each); a partial output, summed by the
//     all-reduce that ends the sublayer;
//   - ep: whole experts, the ones listed for the rank (the chunking rule by default, or any placement with
//     replicas, serve/eplb.hpp).
// MLA (DeepSeek): rank r owns query heads chunk_range(H, p, r): its rows of wq (or q_b_proj), of kv_b_proj and of
// wo_t; the down-projections (q_a_proj, kv_a_proj_with_mqa) and their norms are replicated (the latent is every
// head's), and so is the cache of latents (kv_cache_shape).
#pragma once

#include "paradyse/layout/chunking.hpp"
#include "paradyse/serve/decoder_weights.hpp"
#include "paradyse/serve/paged_kv_cache.hpp"

#include <cstdint>
#include <vector>

namespace paradyse::serve {

enum class MoeMode { tp, ep };

constexpr std::string_view name_of(MoeMode m) { return m == MoeMode::tp ? "TP" : "EP"; }

// EP: the experts each rank holds (a logical expert may sit on several ranks).
struct ExpertPlacement {
  std::vector<std::vector<std::int64_t>> experts_of_rank;  // [p][slots]

  // The chunking rule: rank r holds experts chunk_range(E, p, r).
  static ExpertPlacement chunked(std::int64_t experts, int ranks) {
    ExpertPlacement pl;
    pl.experts_of_rank.resize(std::size_t(ranks));
    for (int r = 0; r < ranks; ++r) {
      const ChunkRange c = chunk_range(experts, ranks, r);
      for (std::int64_t e = c.start; e < c.end(); ++e) pl.experts_of_rank[std::size_t(r)].push_back(e);
    }
    return pl;
  }
  int ranks() const { return int(experts_of_rank.size()); }
  // Every expert placed at least once, and every listed one in [0, E).
  void validate(std::int64_t experts, int ranks_expected) const {
    check(ranks() == ranks_expected, "ExpertPlacement: {} ranks listed, expected {}", ranks(), ranks_expected);
    std::vector<int> seen(static_cast<std::size_t>(experts), 0);
    for (int r = 0; r < ranks(); ++r)
      for (const std::int64_t e : experts_of_rank[std::size_t(r)]) {
        check(e >= 0 && e < experts, "ExpertPlacement: rank {} lists expert {}, outside [0, {})", r, e, experts);
        ++seen[std::size_t(e)];
      }
    for (std::int64_t e = 0; e < experts; ++e)
      check(seen[std::size_t(e)] > 0, "ExpertPlacement: expert {} is placed on no rank", e);
  }
};

struct RankLayer {
  Tensor<float> attn_norm, ffn_norm;
  Tensor<float> wq, wk, wv, bq, bk, bv, q_norm, k_norm;  // this rank's heads' rows
  Tensor<float> wo_t;                                    // [H_r d, h] (MLA: [H_r v, h])
  Tensor<float> wq_a, q_a_norm, wkv_a, kv_a_norm;        // MLA: replicated
  Tensor<float> wkv_b;                                   // MLA: [H_r (nope + v), kv_lora_rank]
  Tensor<float> router_bias;                             // [E]: noaux_tc
  Tensor<float> dense_in, dense_out;                     // [1, 2F_r, h], [1, F_r, h]
  Tensor<float> router;                                  // [E, h]
  Tensor<float> shared_in, shared_out, shared_gate;      // [1, 2fs_r, h], [1, fs_r, h], [1, h]
  MoeMode mode = MoeMode::tp;
  Tensor<float> expert_in, expert_out;  // tp: [E, 2 f_r, h], [E, f_r, h]; ep: [slots, 2f, h], [slots, f, h]
  std::vector<std::int64_t> slot_expert;  // ep: the logical expert of each slot
  std::vector<std::vector<std::int64_t>> placement;  // ep: the experts of every rank (ExpertPlacement)
};

struct RankShard {
  int rank = 0, ranks = 1;
  ChunkRange q_heads, kv_heads;  // global head ranges of this rank
  const DecoderWeights* whole = nullptr;  // embedding, final norm, lm_head: replicated (read-only)
  std::vector<RankLayer> layers;

  std::size_t expert_bytes() const {
    std::size_t b = 0;
    for (const RankLayer& l : layers) b += l.expert_in.bytes() + l.expert_out.bytes();
    return b;
  }
};

namespace shard_detail {

inline Tensor<float> whole(const Tensor<float>& t) {
  if (t.shape().rank() == 0 || t.numel() == 0) return Tensor<float>(Shape{0});
  return Tensor<float>::copy_of(t.view());
}
inline Tensor<float> rows(const Tensor<float>& t, std::int64_t start, std::int64_t length) {
  if (t.shape().rank() == 0 || t.numel() == 0) return Tensor<float>(Shape{0});
  return Tensor<float>::copy_of(t.view().slice(0, start, length));
}
// The SwiGLU bank in [E, 2f, h] / out [E, f, h] sliced to ffn columns `cols` of every expert.
inline void slice_bank(TensorView<const float> in, TensorView<const float> out, ChunkRange cols, Tensor<float>& in_r,
                       Tensor<float>& out_r) {
  const std::int64_t E = in.extent(0), f = out.extent(1), h = out.extent(2);
  in_r = Tensor<float>(Shape{E, 2 * cols.length, h});
  out_r = Tensor<float>(Shape{E, cols.length, h});
  for (std::int64_t e = 0; e < E; ++e) {
    copy(in.slice(0, e, 1).slice(1, cols.start, cols.length), in_r.view().slice(0, e, 1).slice(1, 0, cols.length));
    copy(in.slice(0, e, 1).slice(1, f + cols.start, cols.length),
         in_r.view().slice(0, e, 1).slice(1, cols.length, cols.length));
    copy(out.slice(0, e, 1).slice(1, cols.start, cols.length), out_r.view().slice(0, e, 1));
  }
}

}  // namespace shard_detail

// The head ranges of rank r.
inline ChunkRange query_heads(const DecoderConfig& c, int ranks, int rank) { return chunk_range(c.heads, ranks, rank); }
inline ChunkRange kv_heads_of(const DecoderConfig& c, int ranks, int rank) {
  const ChunkRange q = query_heads(c, ranks, rank);
  const std::int64_t group = c.heads / c.kv_heads, first = q.start / group, last = (q.end() - 1) / group;
  return {first, last - first + 1};
}

// Layer l's routed experts in `mode` for rank r (placement: EP only).
inline void place_experts(const DecoderConfig& c, const DecoderLayerWeights& whole, RankLayer& layer, MoeMode mode,
                          int ranks, int rank, const ExpertPlacement* placement) {
  layer.mode = mode;
  layer.slot_expert.clear();
  layer.placement.clear();
  if (mode == MoeMode::tp) {
    shard_detail::slice_bank(whole.moe.expert_in.view(), whole.moe.expert_out.view(),
                             chunk_range(c.moe.expert_ffn, ranks, rank), layer.expert_in, layer.expert_out);
    return;
  }
  const ExpertPlacement chunked = ExpertPlacement::chunked(c.moe.experts, ranks);
  const ExpertPlacement& pl = placement ? *placement : chunked;
  pl.validate(c.moe.experts, ranks);
  const std::vector<std::int64_t>& mine = pl.experts_of_rank[std::size_t(rank)];
  const std::int64_t f = c.moe.expert_ffn, h = c.hidden, slots = std::int64_t(mine.size());
  layer.expert_in = Tensor<float>(Shape{slots, 2 * f, h});
  layer.expert_out = Tensor<float>(Shape{slots, f, h});
  for (std::int64_t s = 0; s < slots; ++s) {
    const std::int64_t e = mine[std::size_t(s)];
    copy(whole.moe.expert_in.view().slice(0, e, 1), layer.expert_in.view().slice(0, s, 1));
    copy(whole.moe.expert_out.view().slice(0, e, 1), layer.expert_out.view().slice(0, s, 1));
    layer.slot_expert.push_back(e);
  }
  layer.placement = pl.experts_of_rank;
}

// Rank r's shard of the whole weights, with the routed experts in `mode`.
inline RankShard make_rank_shard(const DecoderConfig& c, const DecoderWeights& w, int ranks, int rank, MoeMode mode,
                                 const ExpertPlacement* placement = nullptr) {
  using shard_detail::rows;
  check(ranks >= 1 && ranks <= c.heads, "make_rank_shard: {} ranks for {} attention heads (at most one rank per head)",
        ranks, c.heads);
  check(rank >= 0 && rank < ranks, "make_rank_shard: rank {} outside [0, {})", rank, ranks);
  RankShard s;
  s.rank = rank;
  s.ranks = ranks;
  s.whole = &w;
  s.q_heads = query_heads(c, ranks, rank);
  s.kv_heads = kv_heads_of(c, ranks, rank);
  const std::int64_t d = c.head_dim, h = c.hidden;
  for (std::int64_t l = 0; l < c.layers; ++l) {
    const DecoderLayerWeights& W = w.layers[std::size_t(l)];
    RankLayer L;
    L.attn_norm = Tensor<float>::copy_of(W.attn_norm.view());
    L.ffn_norm = Tensor<float>::copy_of(W.ffn_norm.view());
    const std::int64_t q0 = s.q_heads.start * d, qn = s.q_heads.length * d, k0 = s.kv_heads.start * d,
                       kn = s.kv_heads.length * d;
    L.wq = rows(W.wq, q0, qn);
    L.wk = rows(W.wk, k0, kn);
    L.wv = rows(W.wv, k0, kn);
    L.wo_t = rows(W.wo_t, s.q_heads.start * c.value_dim(), s.q_heads.length * c.value_dim());
    if (c.is_mla()) {
      const std::int64_t per_head = c.mla.nope + c.mla.v;
      L.wq_a = shard_detail::whole(W.wq_a);
      L.q_a_norm = shard_detail::whole(W.q_a_norm);
      L.wkv_a = shard_detail::whole(W.wkv_a);
      L.kv_a_norm = shard_detail::whole(W.kv_a_norm);
      L.wkv_b = rows(W.wkv_b, s.q_heads.start * per_head, s.q_heads.length * per_head);
    }
    L.bq = rows(W.bq, q0, qn);
    L.bk = rows(W.bk, k0, kn);
    L.bv = rows(W.bv, k0, kn);
    L.q_norm = c.head_qk_norm ? Tensor<float>::copy_of(W.q_norm.view()) : rows(W.q_norm, q0, qn);  // per head: whole
    L.k_norm = c.head_qk_norm ? Tensor<float>::copy_of(W.k_norm.view()) : rows(W.k_norm, k0, kn);
    if (!c.is_moe(l)) {
      shard_detail::slice_bank(W.dense_in.view(), W.dense_out.view(), chunk_range(c.dense_ffn, ranks, rank),
                               L.dense_in, L.dense_out);
    } else {
      L.router = Tensor<float>::copy_of(W.moe.router.view());
      L.router_bias = shard_detail::whole(W.router_bias);
      if (c.moe.has_shared()) {
        const std::int64_t fs = c.moe.shared_width();
        shard_detail::slice_bank(W.moe.shared_in.view().reshape(Shape{1, 2 * fs, h}),
                                 W.moe.shared_out.view().reshape(Shape{1, fs, h}), chunk_range(fs, ranks, rank),
                                 L.shared_in, L.shared_out);
        if (c.moe.shared_gate) L.shared_gate = Tensor<float>::copy_of(W.moe.shared_gate.view());
      }
      place_experts(c, W, L, mode, ranks, rank, placement);
    }
    s.layers.push_back(std::move(L));
  }
  return s;
}

// The paged cache of rank `shard` for `blocks` blocks of `block_size` positions: its key/value heads, or MLA's
// latent (one row of kv_lora_rank + qk_rope_head_dim per position, no values).
inline KvCacheShape kv_cache_shape(const DecoderConfig& c, const RankShard& shard, std::int64_t blocks,
                                   std::int64_t block_size) {
  if (c.is_mla()) return {c.layers, blocks, block_size, 1, c.kv_cache_floats(1), true};
  return {c.layers, blocks, block_size, shard.kv_heads.length, c.head_dim};
}

}  // namespace paradyse::serve
