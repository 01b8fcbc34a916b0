// paradyse/strategy/attention_heads.hpp: attention over one rank's head group, read straight out of packed q|k|v
// buffers (no unpacking copies).
//
// A packed buffer [b, len, R] holds, for each token, the W_qkv^T shard's outputs in shard order (contract/weight_shards.hpp):
// per local kv group, its G query heads, then k, then v, each d wide. The attention op takes 4-D views
// [b, len, heads, d] with any strides, so a buffer is cut into as few calls as the packing allows:
//   G == 1 (MHA): one call, every head at stride 3d;  one local kv group: one call (GQA or replicated kv);
//   otherwise one call per local kv group.
// Outputs: out [b, len, q_heads * d] in local head order (the order of the W_proj shard's rows), lse
// [b, q_heads, len]. Ring strategies pass different buffers for the queries and for the keys/values (a block
// from another rank) and a mask carrying the blocks' global positions.
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/contract/layer_config.hpp"
#include "paradyse/ops/attention_mask.hpp"

#include <cstdint>
#include <vector>

namespace paradyse {

// One attention call: `heads` query heads starting at local head `first_head`, with their kv heads.
template <class T>
struct HeadCall {
  TensorView<T> q;  // [b, len, heads, d]
  TensorView<T> k;  // [b, len, kv, d]
  TensorView<T> v;  // [b, len, kv, d]
  std::int64_t first_head = 0, heads = 0;
};

// The calls over a packed buffer `base`: [b, len, R] (contiguous, R = g.qkv_rows).
template <class T>
std::vector<HeadCall<T>> head_calls(const ShardGeometry& g, T* base, std::int64_t batch, std::int64_t len) {
  const std::int64_t d = g.head_dim, R = g.qkv_rows, G = g.group_size, group_rows = g.group_rows();
  const std::int64_t batch_stride = len * R;
  auto view = [&](std::int64_t offset, std::int64_t heads, std::int64_t head_stride) {
    return TensorView<T>(base + offset, Shape{batch, len, heads, d}, Shape{batch_stride, R, head_stride, 1});
  };
  std::vector<HeadCall<T>> calls;
  if (G == 1) {  // per head q|k|v: every head is one kv group
    calls.push_back({view(0, g.kv_heads, group_rows), view(d, g.kv_heads, group_rows), view(2 * d, g.kv_heads, group_rows), 0,
                     g.kv_heads});
    return calls;
  }
  for (std::int64_t group = 0; group < g.kv_heads; ++group) {
    const std::int64_t at = group * group_rows;
    calls.push_back({view(at, G, d), view(at + G * d, 1, d), view(at + (G + 1) * d, 1, d), group * G, G});
  }
  return calls;
}

// out restricted to a call's heads: [b, len, heads, d] of out: [b, len, q_heads * d].
template <class T>
TensorView<T> heads_of(TensorView<T> out, const ShardGeometry& g, std::int64_t first_head, std::int64_t heads) {
  const std::int64_t b = out.extent(0), len = out.extent(1), d = g.head_dim;
  return TensorView<T>(out.data(), Shape{b, len, g.q_heads, d}).slice(2, first_head, heads);
}
// lse restricted to a call's heads: [b, heads, len] of lse: [b, q_heads, len].
template <class T>
TensorView<T> lse_of(TensorView<T> lse, std::int64_t first_head, std::int64_t heads) {
  return lse.slice(1, first_head, heads);
}

// out: [b, lq, q_heads*d], lse: [b, q_heads, lq] (both overwritten) = attention of the queries in q_source:
// [b, lq, R] over the keys and values in kv_source: [b, lkv, R] (the same buffer for self-attention).
template <class Backend>
void attention_forward_heads(const ShardGeometry& g, TensorView<const float> q_source, TensorView<const float> kv_source,
                             const ops::AttentionMask& mask, TensorView<float> out, TensorView<float> lse) {
  const std::int64_t b = q_source.extent(0);
  check(q_source.is_contiguous() && kv_source.is_contiguous() && q_source.extent(2) == g.qkv_rows &&
            kv_source.extent(2) == g.qkv_rows,
        "attention_forward_heads: q source {} and kv source {} must be contiguous [b, len, {}]", q_source.shape(),
        kv_source.shape(), g.qkv_rows);
  const auto q_calls = head_calls(g, q_source.data(), b, q_source.extent(1));
  const auto kv_calls = head_calls(g, kv_source.data(), b, kv_source.extent(1));
  for (std::size_t c = 0; c < q_calls.size(); ++c)
    Backend::attention_forward(q_calls[c].q, kv_calls[c].k, kv_calls[c].v, mask,
                               heads_of(out, g, q_calls[c].first_head, q_calls[c].heads),
                               lse_of(lse, q_calls[c].first_head, q_calls[c].heads));
}

// Accumulates dq into dq_target: [b, lq, R] and dk, dv into dkv_target: [b, lkv, R] (packed like the sources; the
// same buffer for self-attention). out, lse: the FINAL output and log-sum-exp of the queries; dout: [b, lq, q_heads*d].
template <class Backend>
void attention_backward_heads(const ShardGeometry& g, TensorView<const float> q_source,
                              TensorView<const float> kv_source, TensorView<const float> out,
                              TensorView<const float> lse, TensorView<const float> dout, const ops::AttentionMask& mask,
                              TensorView<float> dq_target, TensorView<float> dkv_target) {
  const std::int64_t b = q_source.extent(0);
  check(dq_target.shape() == q_source.shape() && dkv_target.shape() == kv_source.shape() &&
            dq_target.is_contiguous() && dkv_target.is_contiguous(),
        "attention_backward_heads: gradient buffers {} and {} must be contiguous like the sources {} and {}",
        dq_target.shape(), dkv_target.shape(), q_source.shape(), kv_source.shape());
  const auto q_calls = head_calls(g, q_source.data(), b, q_source.extent(1));
  const auto kv_calls = head_calls(g, kv_source.data(), b, kv_source.extent(1));
  const auto dq_calls = head_calls(g, dq_target.data(), b, dq_target.extent(1));
  const auto dkv_calls = head_calls(g, dkv_target.data(), b, dkv_target.extent(1));
  for (std::size_t c = 0; c < q_calls.size(); ++c) {
    const std::int64_t first = q_calls[c].first_head, heads = q_calls[c].heads;
    Backend::attention_backward(q_calls[c].q, kv_calls[c].k, kv_calls[c].v, heads_of(out, g, first, heads),
                                lse_of(lse, first, heads), heads_of(dout, g, first, heads), mask, dq_calls[c].q,
                                dkv_calls[c].k, dkv_calls[c].v);
  }
}

}  // namespace paradyse
