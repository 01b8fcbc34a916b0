// paradyse/contract/layer_config.hpp: the shape of one Transformer layer (LayerConfig) and of its per-rank weight shards
// under the unified layout (ShardGeometry).
//
// A layer is pre-norm: y = x + Attn(Norm1(x)); z = y + Mlp(Norm2(y)). Attention has `heads` query heads and
// `kv_heads` key/value heads (MHA when equal, GQA when fewer), each `head_dim` wide; the MLP is GELU (one input
// matrix) or SwiGLU (gate and up). Linear layers have no bias. RoPE, causality and the zigzag token order are
// options; zigzag is a property of the whole model (every layer and every strategy must agree on it).
//
// The unified shard layout over p ranks (see contract/weight_shards.hpp for the packing) needs:
//   - heads % p == 0: rank r owns query heads [r * heads/p, (r+1) * heads/p);
//   - kv_heads % p == 0 (rank r owns kv heads [r * kv/p, ...)), or, with GQA, p % kv_heads == 0: then the p/kv ranks
//     whose query heads share kv head g each hold a replica of k_g and v_g and reduce its gradient among themselves;
//   - ffn % p == 0: rank r owns ffn columns [r * ffn/p, (r+1) * ffn/p).
#pragma once

#include "paradyse/core/error.hpp"

#include <fmt/format.h>

#include <cstdint>
#include <string_view>

namespace paradyse {

enum class Activation : std::uint8_t { gelu, swiglu };
enum class NormKind : std::uint8_t { layer_norm, rms_norm };

constexpr std::string_view name_of(Activation a) { return a == Activation::gelu ? "gelu" : "swiglu"; }
constexpr std::string_view name_of(NormKind n) { return n == NormKind::layer_norm ? "layer_norm" : "rms_norm"; }

struct LayerConfig {
  std::int64_t hidden = 0;     // h: the residual stream width
  std::int64_t heads = 0;      // query heads
  std::int64_t kv_heads = 0;   // key/value heads; == heads for MHA, divides heads for GQA
  std::int64_t head_dim = 0;   // d; heads * d need not equal h (the projections map h <-> heads * d)
  std::int64_t ffn = 0;        // f: the MLP's inner width (SwiGLU: the width of gate and of up each)
  Activation activation = Activation::gelu;
  NormKind norm = NormKind::layer_norm;
  double norm_eps = 1e-5;
  bool rope = false;           // rotary position embedding on q and k (global token positions)
  double rope_base = 10000.0;
  bool causal = false;
  bool zigzag = false;         // tokens in zigzag order (2p chunks, rank i holds chunks i and 2p-1-i)

  // A typical config: d = h / heads, f = 4h, MHA.
  static LayerConfig make(std::int64_t hidden, std::int64_t heads) {
    LayerConfig c;
    c.hidden = hidden;
    c.heads = heads;
    c.kv_heads = heads;
    c.head_dim = heads > 0 ? hidden / heads : 0;
    c.ffn = 4 * hidden;
    return c;
  }

  std::int64_t q_width() const noexcept { return heads * head_dim; }      // width of q and of the attention output
  std::int64_t kv_width() const noexcept { return kv_heads * head_dim; }  // width of k and of v
  std::int64_t group_size() const noexcept { return kv_heads ? heads / kv_heads : 0; }  // query heads per kv head
  std::int64_t ffn_in_rows() const noexcept { return activation == Activation::swiglu ? 2 * ffn : ffn; }

  // The layer is well formed on its own.
  void validate() const {
    check(hidden > 0, "LayerConfig: hidden = {} must be positive", hidden);
    check(heads > 0, "LayerConfig: heads = {} must be positive", heads);
    check(kv_heads > 0, "LayerConfig: kv_heads = {} must be positive (set it to heads = {} for MHA)", kv_heads, heads);
    check(heads % kv_heads == 0, "LayerConfig: kv_heads = {} must divide heads = {} (GQA groups are equal)", kv_heads,
          heads);
    check(head_dim > 0, "LayerConfig: head_dim = {} must be positive", head_dim);
    check(!rope || head_dim % 2 == 0, "LayerConfig: RoPE rotates pairs, so head_dim = {} must be even", head_dim);
    check(!rope || rope_base > 1.0, "LayerConfig: rope_base = {} must exceed 1", rope_base);
    check(ffn > 0, "LayerConfig: ffn = {} must be positive", ffn);
    check(norm_eps > 0.0, "LayerConfig: norm_eps = {} must be positive", norm_eps);
  }

  // The layer can be sharded over `ranks` ranks in the unified layout.
  void validate_for(int ranks) const {
    validate();
    check(ranks >= 1, "LayerConfig: the group size {} must be at least 1", ranks);
    check(heads % ranks == 0,
          "LayerConfig: heads = {} must be divisible by the group size p = {} (the unified layout gives every rank "
          "heads/p whole heads)",
          heads, ranks);
    check(kv_heads % ranks == 0 || ranks % kv_heads == 0,
          "LayerConfig: kv_heads = {} must be a multiple of p = {} or divide it (then kv heads are replicated over "
          "p/kv_heads ranks)",
          kv_heads, ranks);
    check(ffn % ranks == 0, "LayerConfig: ffn = {} must be divisible by the group size p = {}", ffn, ranks);
  }

  friend bool operator==(const LayerConfig&, const LayerConfig&) = default;
};

// Sizes of rank r's shards in the unified layout, and which global heads and ffn columns it holds.
struct ShardGeometry {
  std::int64_t ranks = 1;
  std::int64_t hidden = 0, head_dim = 0;
  std::int64_t q_heads = 0;       // query heads per rank: heads / p
  std::int64_t kv_heads = 0;      // kv heads per rank: kv_heads / p, or 1 when replicated
  std::int64_t kv_replicas = 1;   // ranks holding each kv head: 1, or p / kv_heads
  std::int64_t group_size = 0;    // local query heads per local kv head: heads/kv_heads, or q_heads when replicated
  std::int64_t qkv_rows = 0;      // rows of the W_qkv^T shard: (q_heads + 2 * kv_heads) * d
  std::int64_t proj_rows = 0;     // rows of the W_proj shard: q_heads * d
  std::int64_t ffn = 0;           // ffn columns per rank: f / p
  std::int64_t ffn_in_rows = 0;   // rows of the W_in^T shard: f/p (GELU) or 2f/p (SwiGLU: gate rows, then up rows)
  bool swiglu = false;

  ShardGeometry() = default;
  ShardGeometry(const LayerConfig& c, int p) {
    c.validate_for(p);
    ranks = p;
    hidden = c.hidden;
    head_dim = c.head_dim;
    q_heads = c.heads / p;
    kv_heads = c.kv_heads % p == 0 ? c.kv_heads / p : 1;
    kv_replicas = c.kv_heads % p == 0 ? 1 : p / c.kv_heads;
    group_size = q_heads / kv_heads;
    qkv_rows = (q_heads + 2 * kv_heads) * head_dim;
    proj_rows = q_heads * head_dim;
    ffn = c.ffn / p;
    swiglu = c.activation == Activation::swiglu;
    ffn_in_rows = swiglu ? 2 * ffn : ffn;
  }

  bool kv_replicated() const noexcept { return kv_replicas > 1; }
  // Rows of one local kv group in the W_qkv^T shard: its query heads, then k, then v.
  std::int64_t group_rows() const noexcept { return (group_size + 2) * head_dim; }
  std::int64_t first_q_head(int rank) const noexcept { return rank * q_heads; }
  std::int64_t first_kv_head(int rank) const noexcept {
    return kv_replicated() ? rank / kv_replicas : rank * kv_heads;
  }
  std::int64_t first_ffn_column(int rank) const noexcept { return rank * ffn; }
  std::int64_t attention_rows() const noexcept { return qkv_rows + proj_rows; }
  std::int64_t mlp_rows() const noexcept { return ffn_in_rows + ffn; }
};

}  // namespace paradyse

template <>
struct fmt::formatter<paradyse::LayerConfig> : fmt::formatter<std::string_view> {
  auto format(const paradyse::LayerConfig& c, format_context& ctx) const {
    return fmt::format_to(ctx.out(), "{{h={} heads={} kv={} d={} ffn={} {} {}{}{}{}}}", c.hidden, c.heads, c.kv_heads,
                          c.head_dim, c.ffn, paradyse::name_of(c.activation), paradyse::name_of(c.norm),
                          c.rope ? " rope" : "", c.causal ? " causal" : "", c.zigzag ? " zigzag" : "");
  }
};
