// paradyse/contract/weight_shards.hpp: the unified per-rank weight shards of one layer, their gradients, deterministic
// initialisation, and the bridge to global (unsharded) weights used by tests and checkpoints.
//
// Convention: every matrix is stored with one row per output feature, so a linear layer is y = x * W^T with
// x: [tokens, in] and W: [out, in]. W_qkv^T and W_in^T are therefore stored as they are used ("transposed" in the
// paper's terms), and W_proj and W_out (which map a sharded inner dimension back to h) as y = a * W with W: [in, h].
// Both kinds of shard are then contiguous row blocks: at once Megatron's tensor-parallel shards and ZeRO-3 shards.
//
// Packing of rank r's shards (G = query heads per local kv group, see ShardGeometry):
//   AttentionShard [qkv_rows + proj_rows, h]
//     rows [0, qkv_rows): W_qkv^T of rank r's heads, per local kv group g in order: its G query heads (d rows each,
//                         in global head order), then k_g (d rows), then v_g (d rows). MHA gives q|k|v per head.
//     rows [qkv_rows, +proj_rows): W_proj rows of rank r's query heads, in global head order.
//   MlpShard [ffn_in_rows + ffn/p, h]
//     rows [0, ffn_in_rows): W_in^T rows of rank r's ffn columns c in [r f/p, (r+1) f/p) (SwiGLU: the gate rows of
//                            those columns, then the up rows of the same columns).
//     rows [ffn_in_rows, +f/p): W_out rows of the same columns.
//   NormWeights [4, h], replicated on every rank: norm1 gamma, norm1 beta, norm2 gamma, norm2 beta (the betas stay
//     zero and unused under RMSNorm).
// When kv heads are replicated (kv_heads < p), the p/kv ranks sharing kv head g each hold k_g and v_g; after a
// backward each of them holds the full gradient of k_g and v_g.
//
// Initialisation draws every global row from its own Rng stream keyed by (seed, matrix, row), so the global model
// is the same for any p and a rank draws only the rows it holds.
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/rng.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/contract/layer_config.hpp"

#include <cmath>
#include <cstdint>
#include <span>

namespace paradyse {

// One sublayer's packed shard: a single contiguous tensor, so a whole shard moves in one message.
struct AttentionShard {
  Tensor<float> packed;  // [qkv_rows + proj_rows, h]
  std::int64_t qkv_rows = 0, proj_rows = 0;

  AttentionShard() = default;
  explicit AttentionShard(const ShardGeometry& g)
      : packed(Shape{g.attention_rows(), g.hidden}), qkv_rows(g.qkv_rows), proj_rows(g.proj_rows) {}

  std::int64_t hidden() const { return packed.extent(1); }
  TensorView<float> qkv() { return packed.view().slice(0, 0, qkv_rows); }             // [qkv_rows, h]
  TensorView<float> proj() { return packed.view().slice(0, qkv_rows, proj_rows); }    // [proj_rows, h]
  TensorView<const float> qkv() const { return TensorView<const float>(packed.view()).slice(0, 0, qkv_rows); }
  TensorView<const float> proj() const {
    return TensorView<const float>(packed.view()).slice(0, qkv_rows, proj_rows);
  }
};

struct MlpShard {
  Tensor<float> packed;  // [ffn_in_rows + ffn/p, h]
  std::int64_t in_rows = 0, out_rows = 0;

  MlpShard() = default;
  explicit MlpShard(const ShardGeometry& g) : packed(Shape{g.mlp_rows(), g.hidden}), in_rows(g.ffn_in_rows), out_rows(g.ffn) {}

  std::int64_t hidden() const { return packed.extent(1); }
  TensorView<float> in() { return packed.view().slice(0, 0, in_rows); }             // W_in^T rows: [in_rows, h]
  TensorView<float> out() { return packed.view().slice(0, in_rows, out_rows); }     // W_out rows: [f/p, h]
  TensorView<const float> in() const { return TensorView<const float>(packed.view()).slice(0, 0, in_rows); }
  TensorView<const float> out() const {
    return TensorView<const float>(packed.view()).slice(0, in_rows, out_rows);
  }
};

struct NormWeights {
  Tensor<float> packed;  // [4, h]: norm1 gamma, norm1 beta, norm2 gamma, norm2 beta

  NormWeights() = default;
  explicit NormWeights(std::int64_t hidden) : packed(Shape{4, hidden}) {}

  std::span<float> row(int i) { return {packed.data() + i * packed.extent(1), std::size_t(packed.extent(1))}; }
  std::span<const float> row(int i) const {
    return {packed.data() + i * packed.extent(1), std::size_t(packed.extent(1))};
  }
  std::span<float> norm1_gamma() { return row(0); }
  std::span<float> norm1_beta() { return row(1); }
  std::span<float> norm2_gamma() { return row(2); }
  std::span<float> norm2_beta() { return row(3); }
  std::span<const float> norm1_gamma() const { return row(0); }
  std::span<const float> norm1_beta() const { return row(1); }
  std::span<const float> norm2_gamma() const { return row(2); }
  std::span<const float> norm2_beta() const { return row(3); }
};

// The weights (or, zero-initialised, the gradients) one rank holds for one layer.
struct LayerWeights {
  AttentionShard attention;
  MlpShard mlp;
  NormWeights norms;

  LayerWeights() = default;
  LayerWeights(const LayerConfig& config, int ranks) : LayerWeights(ShardGeometry(config, ranks)) {}
  explicit LayerWeights(const ShardGeometry& g) : attention(g), mlp(g), norms(g.hidden) {}

  static LayerWeights zeros(const LayerConfig& config, int ranks) { return LayerWeights(config, ranks); }
  void fill_zero() {
    attention.packed.fill(0.0f);
    mlp.packed.fill(0.0f);
    norms.packed.fill(0.0f);
  }
};

// The global weights of one layer, unsharded; float64 for references, float for checkpoints.
template <class T>
struct GlobalLayerWeights {
  Tensor<T> w_q;     // [heads * d, h]
  Tensor<T> w_k;     // [kv_heads * d, h]
  Tensor<T> w_v;     // [kv_heads * d, h]
  Tensor<T> w_proj;  // [heads * d, h]: out = attention_output * w_proj
  Tensor<T> w_in;    // [f, h]: GELU's input matrix, or SwiGLU's gate
  Tensor<T> w_up;    // [f, h]: SwiGLU's up matrix (empty under GELU)
  Tensor<T> w_out;   // [f, h]: out = act * w_out
  Tensor<T> norm1_gamma, norm1_beta, norm2_gamma, norm2_beta;  // [h]

  GlobalLayerWeights() = default;
  explicit GlobalLayerWeights(const LayerConfig& c)
      : w_q(Shape{c.q_width(), c.hidden}), w_k(Shape{c.kv_width(), c.hidden}), w_v(Shape{c.kv_width(), c.hidden}),
        w_proj(Shape{c.q_width(), c.hidden}), w_in(Shape{c.ffn, c.hidden}),
        w_up(Shape{c.activation == Activation::swiglu ? c.ffn : 0, c.hidden}), w_out(Shape{c.ffn, c.hidden}),
        norm1_gamma(Shape{c.hidden}), norm1_beta(Shape{c.hidden}), norm2_gamma(Shape{c.hidden}),
        norm2_beta(Shape{c.hidden}) {}
};

namespace weights_detail {

// The matrices of a layer, as keys of the initialisation streams.
enum class Matrix : std::uint64_t { q = 1, k, v, proj, in, up, out, norm1_gamma, norm1_beta, norm2_gamma, norm2_beta };

inline std::uint64_t stream_seed(std::uint64_t seed, Matrix m, std::int64_t row) {
  Rng mix(seed ^ (std::uint64_t(m) * 0x9e3779b97f4a7c15ull));
  mix.next_u64();
  return mix.next_u64() ^ (std::uint64_t(row) * 0xd1b54a32d192ed03ull);
}

// Calls row(matrix, global_row, destination) for every row rank r holds, in packing order.
template <class RowFn>
void for_each_shard_row(const LayerConfig& c, int p, int r, LayerWeights& w, RowFn&& row) {
  const ShardGeometry g(c, p);
  const std::int64_t d = c.head_dim, h = c.hidden;
  auto dest = [&](Tensor<float>& t, std::int64_t local_row) { return std::span<float>(t.data() + local_row * h, std::size_t(h)); };
  std::int64_t local = 0;
  const std::int64_t q0 = g.first_q_head(r), kv0 = g.first_kv_head(r);
  for (std::int64_t group = 0; group < g.kv_heads; ++group) {
    for (std::int64_t j = 0; j < g.group_size; ++j)
      for (std::int64_t i = 0; i < d; ++i) row(Matrix::q, (q0 + group * g.group_size + j) * d + i, dest(w.attention.packed, local++));
    for (std::int64_t i = 0; i < d; ++i) row(Matrix::k, (kv0 + group) * d + i, dest(w.attention.packed, local++));
    for (std::int64_t i = 0; i < d; ++i) row(Matrix::v, (kv0 + group) * d + i, dest(w.attention.packed, local++));
  }
  for (std::int64_t i = 0; i < g.proj_rows; ++i) row(Matrix::proj, q0 * d + i, dest(w.attention.packed, local++));
  const std::int64_t c0 = g.first_ffn_column(r);
  local = 0;
  for (std::int64_t i = 0; i < g.ffn; ++i) row(Matrix::in, c0 + i, dest(w.mlp.packed, local++));
  if (g.swiglu)
    for (std::int64_t i = 0; i < g.ffn; ++i) row(Matrix::up, c0 + i, dest(w.mlp.packed, local++));
  for (std::int64_t i = 0; i < g.ffn; ++i) row(Matrix::out, c0 + i, dest(w.mlp.packed, local++));
  for (int i = 0; i < 4; ++i) row(Matrix(std::uint64_t(Matrix::norm1_gamma) + std::uint64_t(i)), 0, w.norms.row(i));
}

// The value of every initialised row: normal with std 1/sqrt(fan_in) for matrices, gamma = 1 and beta = 0.
template <class T>
void init_row(const LayerConfig& c, std::uint64_t seed, Matrix m, std::int64_t row, std::span<T> out) {
  if (m == Matrix::norm1_gamma || m == Matrix::norm2_gamma) {
    for (T& x : out) x = T(1);
    return;
  }
  if (m == Matrix::norm1_beta || m == Matrix::norm2_beta) {
    for (T& x : out) x = T(0);
    return;
  }
  // W_proj and W_out are used as y = a * W: their fan-in is their row count.
  const double fan_in = m == Matrix::proj ? double(c.q_width()) : m == Matrix::out ? double(c.ffn) : double(c.hidden);
  Rng rng(stream_seed(seed, m, row));
  rng.fill_normal(out, 1.0 / std::sqrt(fan_in));
}

}  // namespace weights_detail

// Rank r's shard of the global model drawn from `seed`: the same global model for every p.
inline LayerWeights init_shard(const LayerConfig& config, int ranks, int rank, std::uint64_t seed) {
  check(rank >= 0 && rank < ranks, "init_shard: rank {} outside [0, {})", rank, ranks);
  LayerWeights w(config, ranks);
  weights_detail::for_each_shard_row(config, ranks, rank, w, [&](weights_detail::Matrix m, std::int64_t row, std::span<float> out) {
    weights_detail::init_row(config, seed, m, row, out);
  });
  return w;
}

// The whole global layer drawn from `seed` (what init_shard's shards assemble to).
template <class T>
GlobalLayerWeights<T> init_global(const LayerConfig& config, std::uint64_t seed) {
  config.validate();
  using weights_detail::Matrix;
  GlobalLayerWeights<T> g(config);
  auto fill = [&](Tensor<T>& t, Matrix m) {
    const std::int64_t rows = t.shape().rank() == 1 ? 1 : t.extent(0), cols = t.numel() / std::max<std::int64_t>(rows, 1);
    for (std::int64_t i = 0; i < rows && cols; ++i)
      weights_detail::init_row(config, seed, m, i, std::span<T>(t.data() + i * cols, std::size_t(cols)));
  };
  fill(g.w_q, Matrix::q);
  fill(g.w_k, Matrix::k);
  fill(g.w_v, Matrix::v);
  fill(g.w_proj, Matrix::proj);
  fill(g.w_in, Matrix::in);
  fill(g.w_up, Matrix::up);
  fill(g.w_out, Matrix::out);
  fill(g.norm1_gamma, Matrix::norm1_gamma);
  fill(g.norm1_beta, Matrix::norm1_beta);
  fill(g.norm2_gamma, Matrix::norm2_gamma);
  fill(g.norm2_beta, Matrix::norm2_beta);
  return g;
}

// Rank r's shard of global weights (any element type, converted to float). Applied to global gradients it gives
// what rank r's shard gradient must equal after a backward.
template <class T>
LayerWeights shard_of(const GlobalLayerWeights<T>& global, const LayerConfig& config, int ranks, int rank) {
  check(rank >= 0 && rank < ranks, "shard_of: rank {} outside [0, {})", rank, ranks);
  check(global.w_q.shape() == Shape{config.q_width(), config.hidden} && global.w_k.shape() == Shape{config.kv_width(), config.hidden} &&
            global.w_in.shape() == Shape{config.ffn, config.hidden},
        "shard_of: the global weights (w_q {}, w_k {}, w_in {}) do not match the config {}", global.w_q.shape(),
        global.w_k.shape(), global.w_in.shape(), config);
  using weights_detail::Matrix;
  LayerWeights w(config, ranks);
  const std::int64_t h = config.hidden;
  weights_detail::for_each_shard_row(config, ranks, rank, w, [&](Matrix m, std::int64_t row, std::span<float> out) {
    const Tensor<T>* source = nullptr;
    switch (m) {
      case Matrix::q: source = &global.w_q; break;
      case Matrix::k: source = &global.w_k; break;
      case Matrix::v: source = &global.w_v; break;
      case Matrix::proj: source = &global.w_proj; break;
      case Matrix::in: source = &global.w_in; break;
      case Matrix::up: source = &global.w_up; break;
      case Matrix::out: source = &global.w_out; break;
      case Matrix::norm1_gamma: source = &global.norm1_gamma; break;
      case Matrix::norm1_beta: source = &global.norm1_beta; break;
      case Matrix::norm2_gamma: source = &global.norm2_gamma; break;
      case Matrix::norm2_beta: source = &global.norm2_beta; break;
    }
    const T* from = source->data() + row * h;
    for (std::int64_t i = 0; i < h; ++i) out[std::size_t(i)] = float(from[i]);
  });
  return w;
}

}  // namespace paradyse
