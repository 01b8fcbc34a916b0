// paradyse/cost/model_shape.hpp: what the cost models need to know about a layer, a batch and a strategy.
//
// ModelShape is the cost models' own plain description of one Transformer layer and one batch (the model engineer's
// LayerConfig converts to it, and back: cost/dry_run.hpp runs the strategies on it). Strategies are named by the
// strategy list itself (cost/dry_run.hpp's StrategyCatalog); each states its own requirements (supports()).
#pragma once

#include "paradyse/core/error.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace paradyse::cost {

// A Transformer layer has two sublayers, each with its own strategy.
enum class Sublayer : std::uint8_t { attention, mlp };
inline constexpr std::array<Sublayer, 2> kAllSublayers{Sublayer::attention, Sublayer::mlp};

constexpr std::string_view name_of(Sublayer s) { return s == Sublayer::attention ? "attention" : "mlp"; }

// Bytes per parameter of the model states. The default is mixed-precision Adam: 16-bit weights and gradients,
// float32 master weights and two float32 moments (12 bytes), Rajbhandari et al.'s K = 12.
struct TrainingPrecision {
  int parameter_bytes = 2;
  int gradient_bytes = 2;
  int optimizer_bytes = 12;
  int bytes_per_parameter() const { return parameter_bytes + gradient_bytes + optimizer_bytes; }
};

// One layer of a Transformer and one batch, as the cost models see them. Token counts are per sample; `batch`
// samples run together. A packed sample holds several sequences (`packed_lengths`, summing to `seq`): linear layers
// see all its tokens, attention only pairs within one sequence.
struct ModelShape {
  std::int64_t batch = 1;        // b
  std::int64_t seq = 0;          // s: tokens per sample
  std::int64_t hidden = 0;       // h
  std::int64_t heads = 0;        // a: query heads
  std::int64_t kv_heads = 0;     // a_kv: key/value heads (GQA when < heads)
  std::int64_t head_dim = 0;     // d
  std::int64_t ffn = 0;          // f: MLP inner width
  std::int64_t layers = 1;       // L
  int dtype_bytes = 2;           // activations and weights in compute
  bool swiglu = false;           // gated MLP: two input projections of width f
  bool causal = false;
  bool zigzag = false;           // tokens in zigzag order (balances causal ring attention)
  bool rope = false;             // rotary position embedding on q and k
  std::vector<std::int64_t> packed_lengths;  // empty: one sequence of `seq` tokens per sample
  // The group's factorisation, for the strategies that compute over its sub-groups (strategy/policy.hpp's
  // SublayerContext): tp_inner, the cp x tp split's inner size (0: none; MegatronRing runs where it is set), and
  // tp_x, the 2-D grid's inner side (1: none; Tp2d runs where it is > 1).
  int tp_inner = 0;
  int tp_x = 1;
  // Selective recomputation (model/stack.hpp's set_selective_recompute): attention's core tensors dropped after
  // forward and re-run before backward, so the dry run's saved bytes leave them out and its backward re-runs the core.
  bool selective = false;

  // The common layer: multi-head attention with d = h / heads and a GELU MLP of f = 4h (as LayerConfig::make).
  static ModelShape mha(std::int64_t hidden, std::int64_t heads, std::int64_t seq = 0, std::int64_t layers = 1) {
    ModelShape m;
    m.seq = seq;
    m.hidden = hidden;
    m.heads = heads;
    m.kv_heads = heads;
    m.head_dim = heads > 0 ? hidden / heads : 0;
    m.ffn = 4 * hidden;
    m.layers = layers;
    return m;
  }

  // Query-key pairs that attention computes per sample: sum of squared sequence lengths, halved when causal.
  double attention_pairs() const {
    double pairs = 0;
    if (packed_lengths.empty()) pairs = double(seq) * double(seq);
    else
      for (std::int64_t length : packed_lengths) pairs += double(length) * double(length);
    return causal ? pairs / 2 : pairs;
  }
  // Weights of one layer (attention: q, k, v and output projections; MLP: in (x2 for SwiGLU) and out).
  std::int64_t attention_parameters() const { return hidden * (2 * heads + 2 * kv_heads) * head_dim; }
  std::int64_t mlp_parameters() const { return (swiglu ? 3 : 2) * hidden * ffn; }
  // LayerNorm gains and biases, replicated on every rank.
  std::int64_t norm_parameters() const { return 4 * hidden; }
};

inline std::string describe(const ModelShape& m) {
  return fmt::format("b={} s={} h={} heads={} kv_heads={} d={} ffn={} L={} dtype={}B{}{}{}{}{}{}", m.batch, m.seq,
                     m.hidden, m.heads, m.kv_heads, m.head_dim, m.ffn, m.layers, m.dtype_bytes,
                     m.swiglu ? " swiglu" : "", m.causal ? " causal" : "", m.zigzag ? " zigzag" : "",
                     m.tp_inner > 0 ? fmt::format(" tp_inner={}", m.tp_inner) : "",
                     m.tp_x > 1 ? fmt::format(" tp_x={}", m.tp_x) : "", m.selective ? " selective" : "");
}

// Checks that a shape is usable at all (independently of the strategy); throws naming the bad field.
inline void validate(const ModelShape& m, int p) {
  check(p >= 1, "group size p = {} must be at least 1", p);
  check(m.batch >= 1, "batch = {} must be at least 1", m.batch);
  check(m.seq >= 1, "seq = {} must be at least 1", m.seq);
  check(m.hidden >= 1 && m.head_dim >= 1 && m.ffn >= 1, "hidden = {}, head_dim = {}, ffn = {} must be positive",
        m.hidden, m.head_dim, m.ffn);
  check(m.heads >= 1 && m.kv_heads >= 1 && m.heads % m.kv_heads == 0,
        "heads = {} must be a positive multiple of kv_heads = {}", m.heads, m.kv_heads);
  check(m.layers >= 1, "layers = {} must be at least 1", m.layers);
  check(m.dtype_bytes == 2 || m.dtype_bytes == 4 || m.dtype_bytes == 8, "dtype_bytes = {} must be 2, 4 or 8",
        m.dtype_bytes);
  check(m.tp_inner == 0 || (m.tp_inner >= 1 && p % m.tp_inner == 0),
        "tp_inner = {} must be 0 (no cp x tp factorisation) or divide the group size p = {}", m.tp_inner, p);
  check(m.tp_x >= 1 && p % m.tp_x == 0, "tp_x = {} must be 1 (no 2-D grid) or divide the group size p = {}", m.tp_x,
        p);
  if (!m.packed_lengths.empty()) {
    std::int64_t total = 0;
    for (std::int64_t length : m.packed_lengths) {
      check(length >= 1, "packed length {} must be positive", length);
      total += length;
    }
    check(total == m.seq, "packed lengths sum to {}, expected seq = {}", total, m.seq);
  }
}

}  // namespace paradyse::cost
