// paradyse/strategy/rope_heads.hpp: rotary position embedding on the q and k parts of a packed q|k|v buffer
// [b, len, R] (attention_heads.hpp's packing), in place, with every token's global position.
//
// A buffer holds either the full sequence in natural order (positions 0..s-1) or a rank's own tokens in the order
// of the unified layout (one segment, or two under zigzag, each a run of consecutive positions). Backward rotates
// the gradients of q and k back (the inverse rotation); v and its gradient are untouched. No-op without RoPE.
#pragma once

#include "paradyse/core/tensor.hpp"
#include "paradyse/ops/backend.hpp"
#include "paradyse/strategy/attention_heads.hpp"
#include "paradyse/strategy/mlp_activation.hpp"
#include "paradyse/strategy/policy.hpp"

#include <cstdint>
#include <span>

namespace paradyse {

enum class RopeDirection : bool { forward, backward };

namespace rope_detail {

// Rotates tokens [local, local + length) of `buffer` as positions [position, position + length).
template <class Backend>
void rotate_run(const ShardGeometry& g, const ops::RopeConfig& config, TensorView<float> buffer,
                TensorView<const float> source, std::int64_t local, std::int64_t length, std::int64_t position,
                RopeDirection direction, std::span<const std::int64_t> document_starts) {
  const std::int64_t b = buffer.extent(0), len = buffer.extent(1);
  const auto targets = head_calls(g, buffer.data(), b, len);
  const auto sources = head_calls(g, source.data(), b, len);
  for (std::size_t c = 0; c < targets.size(); ++c)
    for (int part = 0; part < 2; ++part) {  // q, then k
      const TensorView<float> to = (part == 0 ? targets[c].q : targets[c].k).slice(1, local, length);
      const TensorView<const float> from = (part == 0 ? sources[c].q : sources[c].k).slice(1, local, length);
      if (direction == RopeDirection::forward) Backend::rope_forward(from, to, position, config, document_starts);
      else Backend::rope_backward(from, to, position, config, document_starts);
    }
}

// The q and k parts of `buffer` set to zero (before the backward rotation accumulates into them).
template <class Backend>
void zero_qk(const ShardGeometry& g, TensorView<float> buffer) {
  const auto calls = head_calls(g, buffer.data(), buffer.extent(0), buffer.extent(1));
  for (const auto& call : calls)
    for (const TensorView<float>& part : {call.q, call.k}) Backend::fill(part, 0.0f);
}

template <class Backend, class Runs>
void rotate(const SublayerContext& ctx, TensorView<float> buffer, RopeDirection direction, Runs&& runs) {
  const LayerConfig& c = ctx.layer();
  if (!c.rope) return;
  const ShardGeometry& g = ctx.geometry;
  check(buffer.rank() == 3 && buffer.extent(2) == g.qkv_rows && buffer.is_contiguous(),
        "rope: the packed buffer {} must be contiguous [b, len, {}]", buffer.shape(), g.qkv_rows);
  const ops::RopeConfig config{.theta = c.rope_base};
  if (direction == RopeDirection::forward) {
    runs([&](std::int64_t local, std::int64_t length, std::int64_t position) {
      rotate_run<Backend>(g, config, buffer, buffer, local, length, position, direction, ctx.document_starts);
    });
    return;
  }
  // rope_backward accumulates and must not alias: rotate from a copy into the zeroed q and k parts.
  BufferPool& pool = *ctx.pool;
  PooledBuffer<float> copy = pool.acquire<float>(buffer.shape());
  Backend::copy(TensorView<const float>(buffer), copy.view());
  zero_qk<Backend>(g, buffer);
  runs([&](std::int64_t local, std::int64_t length, std::int64_t position) {
    rotate_run<Backend>(g, config, buffer, copy.view(), local, length, position, direction, ctx.document_starts);
  });
}

}  // namespace rope_detail

// buffer: [b, s, R], the full sequence in natural order (token i at position i).
template <class Backend>
void rope_natural(const SublayerContext& ctx, TensorView<float> buffer, RopeDirection direction) {
  rope_detail::rotate<Backend>(ctx, buffer, direction, [&](auto&& run) { run(0, buffer.extent(1), 0); });
}

// buffer: [b, n_r, R], rank `rank`'s own tokens in the unified layout's order.
template <class Backend>
void rope_local(const SublayerContext& ctx, int rank, TensorView<float> buffer, RopeDirection direction) {
  rope_detail::rotate<Backend>(ctx, buffer, direction, [&](auto&& run) {
    for (int i = 0; i < ctx.sequence.segment_count(); ++i) {
      const TokenSegment segment = ctx.sequence.segment(rank, i);
      if (segment.length) run(segment.local, segment.length, segment.begin);
    }
  });
}

}  // namespace paradyse
