// paradyse/serve/step_probe.hpp: how fast this machine runs now against when its profile was calibrated, timed on
// the served model's own decode step.
//
//   const DecodeStepProbe probe;                                    // 4 decode tokens at 40 cached, static TP
//   const std::string key = probe.name(model.config, ranks);
//   profile.reference_s[key] = probe.seconds(comm, model);         // when calibrating (every rank calls it)
//   ...
//   const double slowdown = probe.seconds(comm, model) / profile.reference_s.at(key);  // later: 1 as calibrated
//
// Why a step and not GEMMs: the GEMM probe (serve/speed_probe.hpp: the decode GEMMs cycling through 128 MB of weight
// copies, measured / priced) reads its weights from memory, while a small model's decode step reads them from the
// last-level cache and spends half its time outside GEMMs (attention over the paged cache, norms, the all-reduces'
// hand-offs). On the 2-core machine of docs/serving_simulation.md the two moved apart: in one run the GEMM probe read
// 0.69 (31% faster than calibrated) while the steps ran at 0.49 of their price. The probe runs the real step
// (decoder_step on ops::Cpu, every rank, rank 0's shard of the served weights) and times it in thread CPU time as
// the CPU clock does (the slowest rank's per step, serve/clock.hpp), the median over the repeats.
//
// Why against itself and not against its price: the ratio of the same workload's seconds now and at calibration is
// the machine's speed alone; measured / priced would also carry the time model's error at that step, and the
// simulation multiplied by it would be fitted to the steps it is validated against.
#pragma once

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/core/statistics.hpp"
#include "paradyse/core/timer.hpp"
#include "paradyse/serve/decoder_step.hpp"
#include "paradyse/serve/decoder_weights.hpp"
#include "paradyse/serve/paged_kv_cache.hpp"
#include "paradyse/serve/rank_shard.hpp"
#include "paradyse/strategy/buffer_pool.hpp"

#include <fmt/format.h>

#include <cstdint>
#include <string>
#include <vector>

namespace paradyse::serve {

struct DecodeStepProbe {
  std::int64_t tokens = 4;    // decode tokens in the step, one per request (their tokens differ: routed apart)
  std::int64_t cached = 40;   // positions each request holds before the first timed step
  std::int64_t repeats = 16;  // timed steps (after one untimed); the cache grows by one position a step

  // The workload's name in HardwareProfile::reference_s: the model's shape, the ranks and the batch.
  std::string name(const DecoderConfig& c, int ranks) const {
    return fmt::format("decode step: {} layers, h {}, {} heads ({} kv), {} experts top-{} ffn {}, vocab {}; {} ranks, "
                       "static TP, {} tokens at {} cached, {} repeats",
                       c.layers, c.hidden, c.heads, c.kv_heads, c.moe.experts, c.moe.top_k, c.moe.expert_ffn, c.vocab,
                       ranks, tokens, cached, repeats);
  }

  // Every rank calls it (SPMD) and gets the same value: the median over the repeats of the slowest rank's thread
  // CPU seconds in one decode step of `model`.
  template <Communicator C>
  double seconds(C& comm, const LoadedDecoder& model) const {
    check(tokens >= 1 && cached >= 1 && repeats >= 1,
          "DecodeStepProbe: tokens = {}, cached = {}, repeats = {}: expected each at least 1", tokens, cached, repeats);
    const DecoderConfig& c = model.config;
    const RankShard shard = make_rank_shard(c, model.weights, comm.size(), comm.rank(), MoeMode::tp);
    constexpr std::int64_t block = 16;
    const std::int64_t per_request = (cached + repeats + 1 + block - 1) / block;
    PagedKvCache cache(kv_cache_shape(c, shard, tokens * per_request, block));
    BufferPool pool;
    std::vector<SequenceChunk> batch;
    for (std::int64_t i = 0; i < tokens; ++i) {
      const auto token = std::int32_t((11 + 37 * i) % c.vocab);
      cache.reserve(i, cached);  // the request's prompt first
      const SequenceChunk prompt{i, std::vector<std::int32_t>(std::size_t(cached), token)};
      decoder_step(comm, c, shard, cache, std::span(&prompt, 1), pool);
      batch.push_back({i, {token}});
    }
    std::vector<double> slowest;
    for (std::int64_t rep = 0; rep <= repeats; ++rep) {
      for (const SequenceChunk& ch : batch) cache.reserve(ch.request, 1);
      comm.barrier();
      const double start = thread_cpu_seconds();
      decoder_step(comm, c, shard, cache, batch, pool);
      const double mine = thread_cpu_seconds() - start;
      const double step = max_over_ranks(comm, mine);
      if (rep > 0) slowest.push_back(step);  // the first warms the pool
    }
    return percentile(slowest, 0.5);
  }
};

}  // namespace paradyse::serve
