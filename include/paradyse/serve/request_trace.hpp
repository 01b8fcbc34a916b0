// paradyse/serve/request_trace.hpp: a synthetic request trace for the engine (serve/engine.hpp), and the engine
// options that serve it.
//
// Arrivals are Poisson at `rate` requests/s, or bursty (`burst` requests every `period` seconds, 1 ms apart); prompt
// and output lengths are uniform in their ranges and token ids uniform over the vocabulary, all from `seed`.
//
//   const TraceShape shape{.requests = 32, .rate = 8};
//   const std::vector<ServeRequest> trace = make_trace(shape, config.vocab);
//   const EngineOptions options = serving_options(trace, 64);   // wall clock, 64 tokens per step
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/rng.hpp"
#include "paradyse/serve/engine.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace paradyse::serve {

struct TraceShape {
  std::int64_t requests = 32;
  double rate = 8;       // Poisson arrivals, requests/s
  bool bursty = false;   // instead: `burst` requests every `period` seconds
  std::int64_t burst = 12;
  double period = 1.5;
  std::int64_t prompt_min = 8, prompt_max = 64, output_min = 8, output_max = 32;
  std::uint64_t seed = 1;
};

// The longest trace served, in seconds of arrivals (an hour): a rate such as 1e-300 requests/s would otherwise make
// the engine wait for arrivals for ever.
inline constexpr double kMaxTraceSeconds = 3600;

inline std::vector<ServeRequest> make_trace(const TraceShape& shape, std::int64_t vocab) {
  check(shape.prompt_min >= 1 && shape.prompt_min <= shape.prompt_max && shape.output_min >= 1 &&
            shape.output_min <= shape.output_max && vocab >= 1,
        "make_trace: prompt [{}, {}] and output [{}, {}] lengths need 1 <= min <= max, vocabulary {} >= 1",
        shape.prompt_min, shape.prompt_max, shape.output_min, shape.output_max, vocab);
  Rng rng(shape.seed * 7919 + 13);
  std::vector<ServeRequest> trace;
  double t = 0;
  for (std::int64_t i = 0; i < shape.requests; ++i) {
    ServeRequest r;
    r.id = i;
    if (shape.bursty)
      r.arrival = double(i / shape.burst) * shape.period + 0.001 * double(i % shape.burst);
    else
      r.arrival = (t += -std::log(1.0 - rng.uniform()) / shape.rate);
    const std::int64_t len =
        shape.prompt_min + std::int64_t(rng.below(std::uint64_t(shape.prompt_max - shape.prompt_min + 1)));
    for (std::int64_t k = 0; k < len; ++k) r.prompt.push_back(std::int32_t(rng.below(std::uint64_t(vocab))));
    r.max_new_tokens =
        shape.output_min + std::int64_t(rng.below(std::uint64_t(shape.output_max - shape.output_min + 1)));
    check(r.arrival <= kMaxTraceSeconds,
          "make_trace: request {} of {} would arrive at {:.4g} s ({}); at most {} s of arrivals are served: raise the "
          "rate (--rate) or lower --requests", i + 1, shape.requests, r.arrival,
          shape.bursty ? fmt::format("bursts of {} every {} s", shape.burst, shape.period)
                       : fmt::format("Poisson at {} requests/s", shape.rate),
          kMaxTraceSeconds);
    trace.push_back(std::move(r));
  }
  return trace;
}

// "Poisson 8 req/s", "Poisson 1000 req/s (saturated)" or "bursts of 12 every 1.5 s".
inline std::string trace_name(const TraceShape& shape) {
  if (shape.bursty) return fmt::format("bursts of {} every {} s", shape.burst, shape.period);
  return shape.rate >= 1000 ? fmt::format("Poisson {} req/s (saturated)", shape.rate)
                            : fmt::format("Poisson {} req/s", shape.rate);
}

// The same requests, all arriving at time 0 (a warm-up pass, or a reference run whose tokens do not depend on when
// a request arrives).
inline std::vector<ServeRequest> all_at_once(std::vector<ServeRequest> trace) {
  for (ServeRequest& r : trace) r.arrival = 0;
  return trace;
}

// Engine options for serving `trace` on the wall clock, `step_tokens` per step: up to 64 running requests, 16-token
// KV blocks, enough blocks for 64 of the trace's longest requests.
inline EngineOptions serving_options(const std::vector<ServeRequest>& trace, std::int64_t step_tokens) {
  std::int64_t max_len = 0;
  for (const ServeRequest& r : trace) max_len = std::max(max_len, std::int64_t(r.prompt.size()) + r.max_new_tokens);
  EngineOptions opt;
  opt.wall_clock = true;
  opt.step_tokens = step_tokens;
  opt.max_running = 64;
  opt.block_size = 16;
  opt.kv_blocks = 64 * ((max_len + 15) / 16);
  return opt;
}

}  // namespace paradyse::serve
