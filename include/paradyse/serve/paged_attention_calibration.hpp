// paradyse/serve/paged_attention_calibration.hpp: the profile's models of serving's two attention loops over a
// paged cache measured on this machine: serve/paged_attention.hpp's kernel over several head dims (cost/profile.hpp's
// PagedAttentionModel, fit_paged_attention), and MLA's latent attention (serve/mla_attention.hpp) over several latent
// widths and head counts (LatentAttentionModel, fit_latent_attention), each timed on prompt chunks from an empty cache
// and decode tokens against long ones. moe_simulate --measure calls both when it calibrates the thread ranks
// (scripts/validate_serving.sh).
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/cost/calibrate.hpp"
#include "paradyse/cost/calibration_passes.hpp"
#include "paradyse/serve/mla_attention.hpp"
#include "paradyse/serve/paged_attention.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

namespace paradyse::serve {

struct PagedAttentionCalibrationOptions {
  cost::TimeSource clock = cost::TimeSource::thread_cpu;
  int repetitions = 5;
  int passes = 1;  // each measurement the median of this many passes' (cost/calibration_passes.hpp)
  std::vector<std::int64_t> head_dims = {32, 64, 128};
  // Chunks (new tokens, cached positions): prompt chunks and decode tokens against caches of several lengths.
  std::vector<std::pair<std::int64_t, std::int64_t>> chunks = {{64, 0}, {128, 0}, {32, 256}, {1, 512}, {1, 2048}};
  std::int64_t query_heads = 4, kv_heads = 2;
  std::int64_t requests = 16;  // requests the cache holds (its block tables), one of which is read
};

// MLA's latent attention: every (r_kv, heads) pair at d_r = `rope`, over the same kind of chunks.
struct LatentAttentionCalibrationOptions {
  cost::TimeSource clock = cost::TimeSource::thread_cpu;
  int repetitions = 5;
  int passes = 1;
  std::vector<std::int64_t> ranks = {128, 512};  // kv_lora_rank (DeepSeek-V2 and V3: 512)
  std::vector<std::int64_t> heads = {4, 16};     // query heads on the rank
  std::int64_t rope = 64;                        // qk_rope_head_dim
  std::vector<std::pair<std::int64_t, std::int64_t>> chunks = {{64, 0}, {32, 256}, {1, 512}, {1, 2048}};
};

struct PagedAttentionCalibration {
  cost::PagedAttentionModel model;
  std::vector<cost::PagedAttentionSample> samples;
  cost::Fit fit;
};

// Its samples each as the trace event of its chunk describes it (mla_detail::latent_attention_event).
struct LatentAttentionCalibration {
  cost::LatentAttentionModel model;
  std::vector<cost::LatentAttentionSample> samples;
  cost::Fit fit;
};

namespace detail {

// One pass of calibrate_paged_attention: every head dim and chunk timed once (the fastest of the repetitions).
template <Communicator C>
std::vector<cost::PagedAttentionSample> time_paged_attention(C& comm, const PagedAttentionCalibrationOptions& options,
                                                             std::int64_t longest) {
  const std::int64_t hq = options.query_heads, hk = options.kv_heads, block = 16;
  std::vector<cost::PagedAttentionSample> samples;
  for (const std::int64_t d : options.head_dims) {
    const std::int64_t per_request = (longest + block - 1) / block;
    PagedKvCache cache({1, per_request * options.requests, block, hk, d});
    Tensor<float> kv(Shape{longest, hk, d});
    for (std::int64_t i = 0; i < kv.numel(); ++i) kv.data()[i] = float(std::sin(0.37 * double(i)));
    for (std::int64_t r = 0; r < options.requests; ++r) {
      cache.reserve(r, longest);
      cache.append(r, 0, kv.view(), kv.view());
    }
    const std::int64_t request = options.requests / 2;
    std::vector<float> scores;
    for (const auto& [tokens, cached] : options.chunks) {
      Tensor<float> q(Shape{tokens, hq * d}), o(Shape{tokens, hq * d});
      for (std::int64_t i = 0; i < q.numel(); ++i) q.data()[i] = float(std::cos(0.11 * double(i)));
      const double seconds = cost::calibrate_detail::measure(comm, options.clock, options.repetitions, [&] {
        paged_attention(cache, request, 0, cached, q.view(), o.view(), {0, hq}, {0, hk}, hq / hk, d, scores);
      });
      samples.push_back({chunk_pairs(tokens, cached) * double(hq), double(d), seconds});
    }
  }
  return samples;
}

// One pass of calibrate_latent_attention: every latent width, head count and chunk timed once.
template <Communicator C>
std::vector<cost::LatentAttentionSample> time_latent_attention(C& comm,
                                                               const LatentAttentionCalibrationOptions& options,
                                                               std::int64_t longest) {
  const std::int64_t dr = options.rope, block = 16, request = 0;
  std::vector<cost::LatentAttentionSample> samples;
  mla_detail::LatentScratch scratch;
  for (const std::int64_t rkv : options.ranks) {
    const std::int64_t latent = rkv + dr;
    PagedKvCache cache({1, (longest + block - 1) / block, block, 1, latent, /*keys_only=*/true});
    Tensor<float> rows(Shape{longest, 1, latent});
    for (std::int64_t i = 0; i < rows.numel(); ++i) rows.data()[i] = float(std::sin(0.37 * double(i)));
    cache.reserve(request, longest);
    cache.append(request, 0, rows.view(), {});
    for (const std::int64_t hq : options.heads)
      for (const auto& [tokens, cached] : options.chunks) {
        Tensor<float> q_lat(Shape{tokens, hq, rkv}), q_pe(Shape{tokens, hq, dr}), o_lat(Shape{tokens, hq, rkv});
        for (std::int64_t i = 0; i < q_lat.numel(); ++i) q_lat.data()[i] = float(std::cos(0.11 * double(i)));
        for (std::int64_t i = 0; i < q_pe.numel(); ++i) q_pe.data()[i] = float(std::cos(0.13 * double(i)));
        const AttentionChunk chunk{request, 0, tokens};
        const double scale = 1 / std::sqrt(double(latent));
        const double seconds = cost::calibrate_detail::measure(comm, options.clock, options.repetitions, [&] {
          mla_detail::latent_attention(cache, 0, chunk, cached, scale, q_lat.view(), q_pe.view(), o_lat.view(),
                                       scratch);
        });
        const TraceEvent e = mla_detail::latent_attention_event(chunk_pairs(tokens, cached), hq, rkv, dr);
        samples.push_back({e.m, e.n, e.k, seconds});
      }
  }
  return samples;
}

// The model `fit` gives for `passes` passes of time_pass(longest) (each sample the median of its passes', cost/
// calibration_passes.hpp), `longest` the positions the longest of `chunks` (new tokens after cached ones) needs.
template <class Calibration, class TimePass, class FitFn>
Calibration fit_over_passes(int passes, std::span<const std::pair<std::int64_t, std::int64_t>> chunks,
                            TimePass&& time_pass, FitFn&& fit) {
  std::int64_t longest = 0;
  for (const auto& [tokens, cached] : chunks) longest = std::max(longest, tokens + cached);
  Calibration out;
  out.samples = cost::median_of_passes(passes, [&] { return time_pass(longest); });
  out.fit = fit(out.samples, out.model);
  return out;
}

}  // namespace detail

// Times paged_attention on every rank at once (the slowest rank of each run, the fastest of the repetitions, with
// options.passes the median of that over the passes; every rank calls it) for each head dim and chunk of `options`,
// over a cache of `options.requests` requests of one layer, and fits the model.
template <Communicator C>
PagedAttentionCalibration calibrate_paged_attention(C& comm, const PagedAttentionCalibrationOptions& options = {}) {
  const std::int64_t hq = options.query_heads, hk = options.kv_heads;
  check(hq >= 1 && hk >= 1 && hq % hk == 0 && options.requests >= 1,
        "calibrate_paged_attention: {} query heads over {} kv heads (a multiple), {} requests", hq, hk,
        options.requests);
  return detail::fit_over_passes<PagedAttentionCalibration>(
      options.passes, options.chunks,
      [&](std::int64_t longest) { return detail::time_paged_attention(comm, options, longest); },
      cost::fit_paged_attention);
}

// Times mla_detail::latent_attention on every rank at once (as calibrate_paged_attention) for each latent width,
// head count and chunk of `options`, over one request's latents, and fits the model.
template <Communicator C>
LatentAttentionCalibration calibrate_latent_attention(C& comm, const LatentAttentionCalibrationOptions& options = {}) {
  const auto sizes = [](const std::vector<std::int64_t>& v) {
    return !v.empty() && std::all_of(v.begin(), v.end(), [](std::int64_t x) { return x >= 1; });
  };
  check(sizes(options.ranks) && sizes(options.heads) && options.rope >= 0 && !options.chunks.empty(),
        "calibrate_latent_attention: {} latent ranks and {} head counts (each at least one, all positive), rope "
        "width {} (non-negative), {} chunks (at least one)", options.ranks.size(), options.heads.size(), options.rope,
        options.chunks.size());
  return detail::fit_over_passes<LatentAttentionCalibration>(
      options.passes, options.chunks,
      [&](std::int64_t longest) { return detail::time_latent_attention(comm, options, longest); },
      cost::fit_latent_attention);
}

}  // namespace paradyse::serve
