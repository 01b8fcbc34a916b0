// The unified shards: packing order (checked row by row against the global weights), initialisation that gives the
// same global model for every p, and shards that tile the global weights exactly.
#include "paradyse/contract/weight_shards.hpp"

#include <doctest/doctest.h>

#include <set>

using namespace paradyse;

namespace {
bool same_row(std::span<const float> a, const Tensor<double>& global, std::int64_t row) {
  for (std::size_t i = 0; i < a.size(); ++i)
    if (double(a[i]) != double(float(global(row, std::int64_t(i))))) return false;
  return true;
}
std::span<const float> row_of(const Tensor<float>& t, std::int64_t row) {
  return {t.data() + row * t.extent(1), std::size_t(t.extent(1))};
}
}  // namespace

TEST_CASE("init_shard: the same global model for every p, and equal to shard_of(init_global)") {
  for (Activation act : {Activation::gelu, Activation::swiglu})
    for (std::int64_t kv : {8, 2, 1}) {
      LayerConfig c = LayerConfig::make(32, 8);
      c.kv_heads = kv;
      c.ffn = 48;
      c.activation = act;
      const auto global = init_global<double>(c, 7);
      for (int p : {1, 2, 4, 8}) {
        if (c.ffn % p) continue;
        CAPTURE(p);
        CAPTURE(kv);
        for (int r = 0; r < p; ++r) {
          const LayerWeights direct = init_shard(c, p, r, 7);
          const LayerWeights sliced = shard_of(global, c, p, r);
          CHECK(std::equal(direct.attention.packed.span().begin(), direct.attention.packed.span().end(),
                           sliced.attention.packed.span().begin()));
          CHECK(std::equal(direct.mlp.packed.span().begin(), direct.mlp.packed.span().end(), sliced.mlp.packed.span().begin()));
          CHECK(std::equal(direct.norms.packed.span().begin(), direct.norms.packed.span().end(),
                           sliced.norms.packed.span().begin()));
        }
      }
    }
}

TEST_CASE("shard_of: packing order of the attention and MLP shards") {
  LayerConfig c = LayerConfig::make(16, 4);  // d = 4
  c.kv_heads = 2;                            // G = 2
  c.ffn = 8;
  c.activation = Activation::swiglu;
  const auto global = init_global<double>(c, 3);
  const int p = 2;
  for (int r = 0; r < p; ++r) {
    const LayerWeights w = shard_of(global, c, p, r);
    const Tensor<float>& a = w.attention.packed;
    // rank r: kv head r, q heads 2r and 2r+1; rows: q(2r) q(2r+1) k(r) v(r), then proj rows of heads 2r, 2r+1.
    for (std::int64_t i = 0; i < 4; ++i) {
      CHECK(same_row(row_of(a, i), global.w_q, (2 * r) * 4 + i));
      CHECK(same_row(row_of(a, 4 + i), global.w_q, (2 * r + 1) * 4 + i));
      CHECK(same_row(row_of(a, 8 + i), global.w_k, r * 4 + i));
      CHECK(same_row(row_of(a, 12 + i), global.w_v, r * 4 + i));
    }
    for (std::int64_t i = 0; i < 8; ++i) CHECK(same_row(row_of(a, 16 + i), global.w_proj, r * 8 + i));
    const Tensor<float>& m = w.mlp.packed;
    for (std::int64_t i = 0; i < 4; ++i) {
      CHECK(same_row(row_of(m, i), global.w_in, r * 4 + i));
      CHECK(same_row(row_of(m, 4 + i), global.w_up, r * 4 + i));
      CHECK(same_row(row_of(m, 8 + i), global.w_out, r * 4 + i));
    }
  }
}

TEST_CASE("shard_of: every global row is held by exactly one rank, or by p/kv ranks when replicated") {
  LayerConfig c = LayerConfig::make(16, 8);  // d = 2
  c.kv_heads = 2;
  c.ffn = 16;
  const int p = 4;  // kv heads replicated over 2 ranks each
  const ShardGeometry g(c, p);
  CHECK(g.kv_replicas == 2);
  const auto global = init_global<double>(c, 5);
  std::multiset<std::int64_t> q_rows, k_rows;
  for (int r = 0; r < p; ++r) {
    const LayerWeights w = shard_of(global, c, p, r);
    for (std::int64_t i = 0; i < g.qkv_rows; ++i) {
      const auto row = row_of(w.attention.packed, i);
      for (std::int64_t q = 0; q < global.w_q.extent(0); ++q)
        if (same_row(row, global.w_q, q)) q_rows.insert(q);
      for (std::int64_t k = 0; k < global.w_k.extent(0); ++k)
        if (same_row(row, global.w_k, k)) k_rows.insert(k);
    }
  }
  CHECK(q_rows.size() == std::size_t(c.q_width()));
  CHECK(std::set<std::int64_t>(q_rows.begin(), q_rows.end()).size() == std::size_t(c.q_width()));
  CHECK(k_rows.size() == std::size_t(2 * c.kv_width()));
  for (std::int64_t k = 0; k < c.kv_width(); ++k) CHECK(k_rows.count(k) == 2);
}

TEST_CASE("weights: bad ranks are rejected") {
  LayerConfig c = LayerConfig::make(16, 4);
  CHECK_THROWS_AS(init_shard(c, 2, 2, 1), Error);
  CHECK_THROWS_AS(init_shard(c, 3, 0, 1), Error);  // heads = 4 not divisible by 3
}
