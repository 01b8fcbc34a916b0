// paradyse/serve/paged_kv_cache.hpp: a paged key/value cache: fixed-size blocks from one pool, a block table per
// request (vLLM's PagedAttention layout, on the host).
//
// One rank's cache holds its own key/value heads (attention is tensor-parallel by heads, so the cache is sharded
// by heads): per layer K and V of [blocks, block_size, kv_heads_local, d]. Position t of a request lives in block
// table[t / block_size] at slot t % block_size. Blocks are taken when a request grows past its last block and
// given back when it leaves; running out of blocks is an Error naming the request and the pool size (the engine
// checks free_blocks() before admitting a request, so serving never hits it).
// keys_only (MLA, serve/mla_attention.hpp): one row per position and layer, the compressed latent [c_kv | k_pe]
// (kv_heads = 1, head_dim = kv_lora_rank + qk_rope_head_dim), and no values: key() reads it, value() is refused.
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/tensor.hpp"

#include <cstdint>
#include <map>
#include <vector>

namespace paradyse::serve {

struct KvCacheShape {
  std::int64_t layers = 0;
  std::int64_t blocks = 0;      // in the pool
  std::int64_t block_size = 16; // positions per block
  std::int64_t kv_heads = 0;    // this rank's key/value heads
  std::int64_t head_dim = 0;
  bool keys_only = false;       // MLA's latent cache: no value rows
};

class PagedKvCache {
public:
  explicit PagedKvCache(const KvCacheShape& s) : shape_(s) {
    check(s.layers >= 1 && s.blocks >= 1 && s.block_size >= 1 && s.kv_heads >= 1 && s.head_dim >= 1,
          "PagedKvCache: layers {}, blocks {}, block_size {}, kv_heads {}, head_dim {} must all be positive", s.layers,
          s.blocks, s.block_size, s.kv_heads, s.head_dim);
    for (std::int64_t l = 0; l < s.layers; ++l) {
      k_.emplace_back(Shape{s.blocks, s.block_size, s.kv_heads, s.head_dim});
      if (!s.keys_only) v_.emplace_back(Shape{s.blocks, s.block_size, s.kv_heads, s.head_dim});
    }
    for (std::int64_t b = s.blocks - 1; b >= 0; --b) free_.push_back(b);
  }

  const KvCacheShape& shape() const noexcept { return shape_; }
  std::int64_t free_blocks() const noexcept { return std::int64_t(free_.size()); }
  std::int64_t blocks_for(std::int64_t positions) const { return (positions + shape_.block_size - 1) / shape_.block_size; }
  bool holds(std::int64_t request) const { return tables_.count(request) != 0; }
  std::int64_t length(std::int64_t request) const { return table(request).length; }

  // Makes room for `positions` more positions of `request` (a new request starts empty).
  void reserve(std::int64_t request, std::int64_t positions) {
    Table& t = tables_[request];
    const std::int64_t need = blocks_for(t.length + positions) - std::int64_t(t.blocks.size());
    check(need <= free_blocks(), "PagedKvCache: request {} needs {} more blocks, {} of {} are free", request, need,
          free_blocks(), shape_.blocks);
    for (std::int64_t i = 0; i < need; ++i) {
      t.blocks.push_back(free_.back());
      free_.pop_back();
    }
    t.reserved = t.length + positions;
  }
  // Stores k, v [positions, kv_heads, d] of layer `layer` at the request's next positions (reserved before); v is
  // empty in a keys_only cache. The request's length grows when the last layer is written.
  void append(std::int64_t request, std::int64_t layer, TensorView<const float> k, TensorView<const float> v) {
    Table& t = tables_.at(request);
    const std::int64_t n = k.extent(0);
    check(k.shape() == Shape{n, shape_.kv_heads, shape_.head_dim} && (shape_.keys_only ? v.data() == nullptr : v.shape() == k.shape()),
          "PagedKvCache: k {} and v {} must be [positions, kv_heads = {}, d = {}]{}", k.shape(), v.shape(),
          shape_.kv_heads, shape_.head_dim, shape_.keys_only ? " (v none: a keys-only cache)" : "");
    check(t.length + n <= t.reserved, "PagedKvCache: request {} writes {} positions past its reservation of {}",
          request, t.length + n, t.reserved);
    const Shape row{shape_.kv_heads, shape_.head_dim};
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int64_t pos = t.length + i;
      const std::int64_t block = t.blocks[std::size_t(pos / shape_.block_size)], slot = pos % shape_.block_size;
      copy(TensorView<const float>(&k(i, 0, 0), row, Shape{k.strides()[1], k.strides()[2]}),
           TensorView<float>(&k_[std::size_t(layer)](block, slot, std::int64_t(0), std::int64_t(0)), row));
      if (!shape_.keys_only)
        copy(TensorView<const float>(&v(i, 0, 0), row, Shape{v.strides()[1], v.strides()[2]}),
             TensorView<float>(&v_[std::size_t(layer)](block, slot, std::int64_t(0), std::int64_t(0)), row));
    }
    if (layer == shape_.layers - 1) t.length += n;
  }
  // Key / value of head `head` at position `pos` of `request` ([d], contiguous).
  const float* key(std::int64_t request, std::int64_t layer, std::int64_t pos, std::int64_t head) const {
    return at(k_, request, layer, pos, head);
  }
  const float* value(std::int64_t request, std::int64_t layer, std::int64_t pos, std::int64_t head) const {
    check(!shape_.keys_only, "PagedKvCache: value() of a keys-only (MLA latent) cache");
    return at(v_, request, layer, pos, head);
  }
  // Gives the request's blocks back.
  void release(std::int64_t request) {
    auto it = tables_.find(request);
    if (it == tables_.end()) return;
    for (auto b = it->second.blocks.rbegin(); b != it->second.blocks.rend(); ++b) free_.push_back(*b);
    tables_.erase(it);
  }
  std::size_t bytes() const noexcept { return (shape_.keys_only ? 1 : 2) * std::size_t(shape_.layers) * k_[0].bytes(); }

private:
  struct Table {
    std::vector<std::int64_t> blocks;
    std::int64_t length = 0, reserved = 0;
  };
  const Table& table(std::int64_t request) const {
    auto it = tables_.find(request);
    check(it != tables_.end(), "PagedKvCache: request {} holds no cache", request);
    return it->second;
  }
  const float* at(const std::vector<Tensor<float>>& store, std::int64_t request, std::int64_t layer, std::int64_t pos,
                  std::int64_t head) const {
    const Table& t = tables_.at(request);
    const std::int64_t block = t.blocks[std::size_t(pos / shape_.block_size)], slot = pos % shape_.block_size;
    return &store[std::size_t(layer)](block, slot, head, std::int64_t(0));
  }

  KvCacheShape shape_;
  std::vector<Tensor<float>> k_, v_;
  std::vector<std::int64_t> free_;
  std::map<std::int64_t, Table> tables_;
};

}  // namespace paradyse::serve
