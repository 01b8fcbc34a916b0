// paradyse/strategy/megatron_cz.hpp: MegatronCZ, Megatron-LM context parallelism (ring attention) with ZeRO-3
// weights.
//
// Attention: every head of the rank's own tokens. q|k|v comes out of the ring column linear (the W_qkv^T shards
// rotate; block j, rank j's head group, lands in columns [j R, (j+1) R) of [b*n_r, p R]), is reordered into heads
// with RoPE at the tokens' global positions (strategy/ring_heads.hpp), and ring attention
// (strategy/ring_attention.hpp) passes the K/V blocks around the ring: double-buffered shifts, a stable log-sum-exp
// merge, causal blocks skipped, zigzag balancing when the layout is zigzag. The output projection multiplies with
// the all-gathered W_proj. Backward: W_proj all-gather and gradient reduce-scatter, ring attention backward (dK/dV
// travel with K/V and return to their owners), the W_qkv^T shards rotating again with their gradients.
// MLP: the ZeRO-3 MLP (strategy/zero3_mlp.hpp).
//
// Per rank and sublayer. Communication: K/V 2 b (s - n_{r+1}) hkv d forward (independent of p per rank: about
// 2 b s hkv d), twice that plus the dK/dV sums backward; weights as the other ZeRO-3 strategies (~4 h^2 (p-1)/p
// forward for MHA, independent of s). Saved: x [b, n_r, h], q|k|v heads [b, n_r, hq + 2 hkv, d] (after RoPE),
// out [b, n_r, hq d], lse [b, hq, n_r]. Transient: two K/V blocks forward, five backward (ring buffers), the packed
// projection [b n_r, p R], the gathered W_proj. Requirements: those of the unified layout only (heads % p == 0);
// with kv heads replicated (kv_heads < p) every replica's K/V travels and the replicas' gradients are summed.
// The projections, checks, requirement and MLP are strategy/unified_ring.hpp's Zero3Ring; this file holds the core.
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/ops/backend.hpp"
#include "paradyse/strategy/policy.hpp"
#include "paradyse/strategy/ring_attention.hpp"
#include "paradyse/strategy/ring_heads.hpp"
#include "paradyse/strategy/unified_ring.hpp"

#include <string_view>

namespace paradyse {

template <class Backend = ops::Cpu>
struct MegatronCZ : Zero3Ring<MegatronCZ<Backend>, Backend> {
  static constexpr std::string_view name = "MegatronCZ";

  struct AttentionSaved {
    Tensor<float> x;      // [b, n_r, h]
    Tensor<float> heads;  // [b, n_r, hq + 2 hkv, d]: q, k, v of every head group (RoPE applied)
    Tensor<float> out;    // [b, n_r, hq, d]: attention output in global head order
    Tensor<float> lse;    // [b, hq, n_r]
  };

private:
  friend struct Zero3Ring<MegatronCZ, Backend>;

  // The core's own tensors: out and lse.
  static void make_core(const SublayerContext& ctx, const QkvPacking& packing, const RingCall& call,
                        AttentionSaved& saved) {
    saved.out = Tensor<float>(Shape{call.b, call.n, packing.q_heads(), ctx.geometry.head_dim});
    saved.lse = Tensor<float>(Shape{call.b, packing.q_heads(), call.n});
  }
  static void drop_core(AttentionSaved& saved) {
    saved.out = Tensor<float>();
    saved.lse = Tensor<float>();
  }
  // Ring attention over the K/V blocks of every rank.
  template <Communicator C>
  void core_forward(C& comm, const SublayerContext& ctx, const QkvPacking& packing, const RingCall&,
                    AttentionSaved& saved) const {
    const HeadViews<const float> qkv = head_views(TensorView<const float>(saved.heads.view()), packing);
    ring_attention_forward<Backend>(comm, this->ring_spec(ctx), *ctx.pool, qkv.q, qkv.k, qkv.v, saved.out.view(),
                                    saved.lse.view());
  }
  // Its backward: dK/dV travel with K/V and return to their owners.
  template <Communicator C>
  void core_backward(C& comm, const SublayerContext& ctx, const QkvPacking& packing, const RingCall&,
                     AttentionSaved& saved, TensorView<const float> dout, const HeadViews<float>& dqkv) const {
    const HeadViews<const float> qkv = head_views(TensorView<const float>(saved.heads.view()), packing);
    ring_attention_backward<Backend>(comm, this->ring_spec(ctx), *ctx.pool, qkv.q, qkv.k, qkv.v, saved.out.view(),
                                     saved.lse.view(), dout, dqkv.q, dqkv.k, dqkv.v);
  }
};

}  // namespace paradyse
