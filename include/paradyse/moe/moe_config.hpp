// paradyse/moe/moe_config.hpp: the shape of one MoE FFN sublayer (MoeConfig), the fixed expert layout (rank r owns
// whole experts, a contiguous range by the chunking rule) and the per-rank weight shard (MoeShard).
//
// The families it expresses: Mixtral (softmax, top-2, norm_topk_prob), Qwen1.5/Qwen2-MoE (softmax, top-k, shared
// experts behind a sigmoid gate), OLMoE (softmax, top-8, no renormalisation), DeepSeek-MoE (shared experts, routed
// scaling factor; sigmoid scoring with renormalisation as in V3).
//
// Shared experts are fused into one SwiGLU of width shared_experts * shared_ffn (the sum of N SwiGLU experts over
// the same tokens is one SwiGLU with their ffn columns side by side), replicated on every rank like the router.
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/layout/chunking.hpp"
#include "paradyse/ops/cpu/moe_ops.hpp"

#include <cmath>
#include <cstdint>
#include <span>

namespace paradyse {

using ops::RouterScoring;

// The convention of the load-balancing loss aux = E * sum_i f_i P_i (moe/router.hpp), which a coefficient is tied to:
//   - per_assignment (the default): f_i = assignments to expert i / all (token, expert) assignments, as Switch and
//     GShard write it; aux = 1 when perfectly balanced, whatever top-k;
//   - per_token_hf: f_i = assignments to expert i / tokens, as Hugging Face's load_balancing_loss_func (Mixtral,
//     Qwen2-MoE, OLMoE) computes it; aux = top-k when balanced, k times the default for the same routing. Choose it
//     to use a router_aux_loss_coef from a Hugging Face config unchanged (with the default, multiply it by k).
enum class AuxLossScaling { per_assignment, per_token_hf };

// How the top-k experts are chosen (moe/grouped_routing.hpp for the grouped ones):
//   - greedy: the top-k scores of all E experts (moe/router.hpp);
//   - group_limited_greedy (DeepSeek-V2): only within the topk_group of n_group groups with the largest best score;
//   - noaux_tc (DeepSeek-V3): sigmoid scores plus a per-expert correction bias choose (groups ranked by the sum of
//     their two best), the plain scores weight.
enum class TopkMethod : std::uint8_t { greedy, group_limited_greedy, noaux_tc };

constexpr std::string_view name_of(TopkMethod m) {
  switch (m) {
    case TopkMethod::greedy: return "greedy";
    case TopkMethod::group_limited_greedy: return "group_limited_greedy";
    case TopkMethod::noaux_tc: return "noaux_tc";
  }
  return "?";
}

struct MoeConfig {
  std::int64_t hidden = 0;       // h
  std::int64_t experts = 0;      // E routed experts
  std::int64_t top_k = 1;        // default experts per token (a call may override it, or give one count per token)
  std::int64_t expert_ffn = 0;   // f: ffn width of one routed expert
  RouterScoring scoring = RouterScoring::softmax;
  bool norm_topk_prob = false;   // renormalise the selected experts' scores to sum to 1
  double routed_scaling_factor = 1.0;
  std::int64_t shared_experts = 0;  // always-on experts (0: none)
  std::int64_t shared_ffn = 0;      // ffn width of one shared expert
  bool shared_gate = false;         // Qwen-MoE: the shared output times sigmoid(x . w_gate)
  double capacity_factor = 0;       // 0: dropless; else each expert keeps ceil(cf * assignments / E) per rank
  double aux_loss_coef = 0;         // load-balancing loss coefficient, in the convention of aux_scaling
  double z_loss_coef = 0;           // router z-loss coefficient
  AuxLossScaling aux_scaling = AuxLossScaling::per_assignment;  // Switch's f_i (default) or Hugging Face's (k times)
  TopkMethod topk_method = TopkMethod::greedy;  // grouped methods: serving only (moe/grouped_routing.hpp)
  std::int64_t n_group = 1;                     // groups of E / n_group consecutive experts (grouped methods)
  std::int64_t topk_group = 1;                  // groups kept per token (grouped methods)

  friend bool operator==(const MoeConfig&, const MoeConfig&) = default;

  std::int64_t shared_width() const noexcept { return shared_experts * shared_ffn; }
  bool has_shared() const noexcept { return shared_experts > 0; }

  // Throws paradyse::Error naming the first bad value and what is expected.
  void validate() const {
    check(hidden >= 1, "MoeConfig: hidden = {} must be at least 1", hidden);
    check(experts >= 1, "MoeConfig: experts = {} must be at least 1", experts);
    check(top_k >= 1 && top_k <= experts, "MoeConfig: top_k = {} must be in [1, experts = {}]", top_k, experts);
    check(expert_ffn >= 1, "MoeConfig: expert_ffn = {} must be at least 1", expert_ffn);
    check(scoring == RouterScoring::softmax || scoring == RouterScoring::sigmoid,
          "MoeConfig: scoring = {} must be softmax or sigmoid", int(scoring));
    check(std::isfinite(routed_scaling_factor) && routed_scaling_factor > 0,
          "MoeConfig: routed_scaling_factor = {} must be finite and positive", routed_scaling_factor);
    check(shared_experts >= 0, "MoeConfig: shared_experts = {} must be non-negative", shared_experts);
    check(shared_experts == 0 || shared_ffn >= 1, "MoeConfig: shared_ffn = {} must be at least 1 with {} shared experts",
          shared_ffn, shared_experts);
    check(!shared_gate || shared_experts > 0, "MoeConfig: shared_gate needs shared experts (shared_experts = 0)");
    check(std::isfinite(capacity_factor) && (capacity_factor == 0 || capacity_factor > 0),
          "MoeConfig: capacity_factor = {} must be 0 (dropless) or finite and positive", capacity_factor);
    check(std::isfinite(aux_loss_coef) && aux_loss_coef >= 0,
          "MoeConfig: aux_loss_coef = {} must be finite and non-negative", aux_loss_coef);
    check(std::isfinite(z_loss_coef) && z_loss_coef >= 0, "MoeConfig: z_loss_coef = {} must be finite and non-negative",
          z_loss_coef);
    if (topk_method != TopkMethod::greedy) {
      check(n_group >= 1 && experts % n_group == 0, "MoeConfig: n_group = {} must divide experts = {}", n_group, experts);
      check(topk_group >= 1 && topk_group <= n_group, "MoeConfig: topk_group = {} must be in [1, n_group = {}]",
            topk_group, n_group);
      check(top_k <= topk_group * (experts / n_group), "MoeConfig: top_k = {} exceeds the {} experts of topk_group = {} "
            "groups", top_k, topk_group * (experts / n_group), topk_group);
      check(topk_method != TopkMethod::noaux_tc || experts / n_group >= 2, "MoeConfig: noaux_tc ranks groups by their "
            "two best experts; {} experts in {} groups leave fewer than 2 per group", experts, n_group);
    }
  }
};

// How many experts each token of one call selects: the config's top_k, a per-call k (Alloc-L: per layer), or one
// count per token (Alloc-T). Counts must lie in [0, E].
struct TopK {
  std::int64_t k = 0;                            // 0: the config's top_k
  std::span<const std::int64_t> per_token = {};  // non-empty: one count per local token (overrides k)
  // Alloc-T (moe/alloc_tokens.hpp): the k * n largest scores of the call's [n, E] score matrix, at least one expert
  // per token, instead of k in every row; `pools` (row counts summing to n, e.g. one per sequence) pools separately.
  bool pool_tokens = false;
  std::span<const std::int64_t> pools = {};
};

// Experts [first, first + count) of rank `rank` of `ranks`: the chunking rule (the first E % p ranks own one more).
inline ChunkRange owned_experts(const MoeConfig& c, int ranks, int rank) { return chunk_range(c.experts, ranks, rank); }

// Rank r's weights of one MoE sublayer. Router and shared experts are replicated; routed experts are whole on their
// owner. Gradients use the same type (ACCUMULATED, fully reduced over every token of every rank).
struct MoeShard {
  Tensor<float> router;       // [E, h]: W_r (logits = x W_r^T)
  Tensor<float> expert_in;    // [E_r, 2f, h]: W_in^T per owned expert, gate rows then up rows
  Tensor<float> expert_out;   // [E_r, f, h]: W_out per owned expert
  Tensor<float> shared_in;    // [2 fs, h] (fs = shared_experts * shared_ffn; empty without shared experts)
  Tensor<float> shared_out;   // [fs, h]
  Tensor<float> shared_gate;  // [1, h] (empty without shared_gate)

  // Zeros of rank `rank`'s shapes.
  static MoeShard zeros(const MoeConfig& c, int ranks, int rank) {
    const std::int64_t h = c.hidden, f = c.expert_ffn, fs = c.shared_width(),
                       owned = owned_experts(c, ranks, rank).length;
    MoeShard s;
    s.router = Tensor<float>(Shape{c.experts, h});
    s.expert_in = Tensor<float>(Shape{owned, 2 * f, h});
    s.expert_out = Tensor<float>(Shape{owned, f, h});
    s.shared_in = Tensor<float>(Shape{2 * fs, h});
    s.shared_out = Tensor<float>(Shape{fs, h});
    s.shared_gate = Tensor<float>(Shape{c.shared_gate ? 1 : 0, h});
    return s;
  }
};

}  // namespace paradyse
