// paradyse/serve/paged_attention.hpp: the attention of one chunk's queries over its request's paged KV cache (the
// CPU kernel decoder_step runs), what a step records for it, and its calibration on this machine.
//
// Query i of a chunk (position start + i) attends, per query head, to positions [0, start + i] of its request: a
// score per position (a d-long dot product with the key), a softmax over them (an exp per score), the weighted sum
// of the values. The code is scalar and reads each position's key and value through the cache's block table
// (PagedKvCache::key / value: a request lookup and a block lookup per read), so its time goes with the visits, one
// per (query-key pair, query head), not with flash attention's FLOP rate. Measured here (bench/serve_step_pieces.cpp,
// docs/serving_validation.md) it ran 3-5x slower than the flash-attention rate the dry run had priced it at.
//
// decoder_step records the kernel as one TraceKind::paged_attention event per step (m: the batch's visible
// query-key pairs, n: the rank's query heads, k: the head dim), priced by the profile's PagedAttentionModel
// (cost/profile.hpp; a profile without one prices it as flash attention, as before the model existed), plus the
// stream that reads every position's keys and values. serve/paged_attention_calibration.hpp times this kernel and
// fits the model.
#pragma once

#include "paradyse/core/trace.hpp"
#include "paradyse/serve/paged_kv_cache.hpp"
#include "paradyse/serve/rank_shard.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace paradyse::serve {

// Query-key pairs a chunk of `tokens` new positions after `cached` ones sees under the causal mask.
inline double chunk_pairs(std::int64_t tokens, std::int64_t cached) {
  return double(tokens) * double(cached) + double(tokens) * double(tokens + 1) / 2;
}

// The trace event of the paged kernel over a batch: `pairs` visible query-key pairs, `heads` query heads of width d.
inline TraceEvent paged_attention_event(double pairs, std::int64_t heads, std::int64_t d) {
  return {.kind = TraceKind::paged_attention, .m = pairs, .n = double(heads), .k = double(d)};
}

// out [len, hq d] = causal attention of q [len, hq d] (this rank's query heads q_heads, positions start ..
// start + len - 1 of `request`) over the cached keys and values of layer `layer` (the chunk's own appended already).
// Query head j reads key/value head (q_heads.start + j) / group - kv_heads.start of the cache. `scores`: a buffer
// the caller reuses across calls.
template <class Cache>
void paged_attention(const Cache& cache, std::int64_t request, std::int64_t layer, std::int64_t start,
                     TensorView<const float> q, TensorView<float> out, ChunkRange q_heads, ChunkRange kv_heads,
                     std::int64_t group, std::int64_t d, std::vector<float>& scores) {
  const std::int64_t len = q.extent(0), hq = q_heads.length;
  const float scale = 1.0f / std::sqrt(float(d));
  for (std::int64_t i = 0; i < len; ++i) {
    const std::int64_t visible = start + i + 1;
    scores.resize(std::size_t(visible));
    for (std::int64_t head = 0; head < hq; ++head) {
      const std::int64_t kv = (q_heads.start + head) / group - kv_heads.start;
      const float* qi = &q(i, head * d);
      float top = -INFINITY;
      for (std::int64_t t = 0; t < visible; ++t) {
        const float* kt = cache.key(request, layer, t, kv);
        float dot = 0;
        for (std::int64_t e = 0; e < d; ++e) dot += qi[e] * kt[e];
        scores[std::size_t(t)] = dot * scale;
        top = std::max(top, scores[std::size_t(t)]);
      }
      float total = 0;
      for (std::int64_t t = 0; t < visible; ++t) total += (scores[std::size_t(t)] = std::exp(scores[std::size_t(t)] - top));
      float* o = &out(i, head * d);
      for (std::int64_t e = 0; e < d; ++e) o[e] = 0;
      for (std::int64_t t = 0; t < visible; ++t) {
        const float* vt = cache.value(request, layer, t, kv);
        const float p = scores[std::size_t(t)] / total;
        for (std::int64_t e = 0; e < d; ++e) o[e] += p * vt[e];
      }
    }
  }
}

}  // namespace paradyse::serve
