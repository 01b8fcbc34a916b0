// paradyse/serve/request_trace.hpp: a synthetic request trace for the engine (serve/engine.hpp), and the engine
// options that serve it.
//
// Arrivals are Poisson at `rate` requests/s, or bursty (`burst` requests every `period` seconds, 1 ms apart); prompt
// and output lengths are uniform in their ranges and token ids uniform over the vocabulary, all from `seed`
// (make_trace is poisson_trace or bursty_trace below, then to_serve_requests: the simulation's generator).
//
//   const TraceShape shape{.requests = 32, .rate = 8};
//   const std::vector<ServeRequest> trace = make_trace(shape, config.vocab);
//   const EngineOptions options = serving_options(trace, 64);   // wall clock, 64 tokens per step
//
// Traces as data, for replay and simulation (TraceRequest: arrival time in seconds, prompt tokens and output tokens
// per request): Poisson arrivals at a rate, bursts (b requests every period seconds, 1 ms apart), or a
// production trace as CSV in the Azure LLM inference trace 2023 format (a header naming TIMESTAMP, ContextTokens and
// GeneratedTokens in any order; TIMESTAMP "YYYY-MM-DD HH:MM:SS[.fraction]" or seconds; arrivals become seconds since
// the trace's first row). A bad row is an Error naming the file, line and column. Synthetic lengths are uniform in
// the given ranges (seeded). to_serve_requests gives each request seeded random token ids of its prompt length
// (prompt contents are not part of such traces; a replay forces the given output lengths).
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/printable.hpp"
#include "paradyse/core/rng.hpp"
#include "paradyse/serve/engine.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <string_view>
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

// The most prompt or output tokens one request of a trace file may have (2^21: beyond any context window served
// today); a corrupt 9223372036854775807 would otherwise be materialised as a prompt (to_serve_requests).
inline constexpr std::int64_t kMaxTraceTokens = std::int64_t(1) << 21;

struct TraceRequest {
  double arrival_s = 0;
  std::int64_t prompt_tokens = 1, output_tokens = 1;
  friend bool operator==(const TraceRequest&, const TraceRequest&) = default;
};

struct LengthRanges {
  std::int64_t prompt_min = 8, prompt_max = 64, output_min = 8, output_max = 32;
  void validate() const {
    check(prompt_min >= 1 && prompt_min <= prompt_max && output_min >= 1 && output_min <= output_max,
          "request lengths: prompt [{}, {}] and output [{}, {}] must be ranges of positive lengths", prompt_min,
          prompt_max, output_min, output_max);
  }
};

namespace trace_detail {
inline void draw_lengths(TraceRequest& r, const LengthRanges& l, Rng& rng) {
  r.prompt_tokens = l.prompt_min + std::int64_t(rng.below(std::uint64_t(l.prompt_max - l.prompt_min + 1)));
  r.output_tokens = l.output_min + std::int64_t(rng.below(std::uint64_t(l.output_max - l.output_min + 1)));
}
}  // namespace trace_detail

inline std::vector<TraceRequest> poisson_trace(double rate, std::int64_t requests, const LengthRanges& lengths,
                                               std::uint64_t seed) {
  check(rate > 0 && std::isfinite(rate) && requests >= 1, "poisson_trace: rate {} must be positive, requests {} >= 1",
        rate, requests);
  lengths.validate();
  Rng rng(seed * 7919 + 13);
  std::vector<TraceRequest> out;
  double t = 0;
  for (std::int64_t i = 0; i < requests; ++i) {
    TraceRequest r;
    r.arrival_s = (t += -std::log(1.0 - rng.uniform()) / rate);
    trace_detail::draw_lengths(r, lengths, rng);
    out.push_back(r);
  }
  return out;
}

inline std::vector<TraceRequest> bursty_trace(std::int64_t burst, double period_s, std::int64_t requests,
                                              const LengthRanges& lengths, std::uint64_t seed) {
  check(burst >= 1 && period_s > 0 && requests >= 1, "bursty_trace: burst {} >= 1, period {} s > 0, requests {} >= 1",
        burst, period_s, requests);
  lengths.validate();
  Rng rng(seed * 7919 + 13);
  std::vector<TraceRequest> out;
  for (std::int64_t i = 0; i < requests; ++i) {
    TraceRequest r;
    r.arrival_s = double(i / burst) * period_s + 0.001 * double(i % burst);
    trace_detail::draw_lengths(r, lengths, rng);
    out.push_back(r);
  }
  return out;
}

// Requests for the engine: ids 0.., arrival in seconds, prompts of seeded random token ids below `vocab`.
inline std::vector<ServeRequest> to_serve_requests(const std::vector<TraceRequest>& trace, std::int64_t vocab,
                                                   std::uint64_t seed) {
  Rng rng(seed * 104729 + 7);
  std::vector<ServeRequest> out;
  for (std::size_t i = 0; i < trace.size(); ++i) {
    ServeRequest r;
    r.id = std::int64_t(i);
    r.arrival = trace[i].arrival_s;
    r.max_new_tokens = trace[i].output_tokens;
    r.prompt.resize(std::size_t(trace[i].prompt_tokens));
    for (std::int32_t& t : r.prompt) t = std::int32_t(rng.below(std::uint64_t(vocab)));
    out.push_back(std::move(r));
  }
  return out;
}

// The longest trace served, in seconds of arrivals (an hour): a rate such as 1e-300 requests/s would otherwise make
// the engine wait for arrivals for ever (moe_infer), or simulate an idle day and report 0 tokens/s (moe_simulate).
inline constexpr double kMaxTraceSeconds = 3600;

// The one rule for synthetic traces (moe_infer, moe_simulate, bench/moe_policies): every arrival within
// kMaxTraceSeconds, else an Error naming `flags`, the flags that made the trace as the user gave them ("--rate
// 1e-300", "--bursty --burst 4 --period 1e+06"), the request that arrives too late, the trace (`shape`: "Poisson at
// 1e-300 requests/s") and `remedy`, what to change.
inline void check_trace_span(const std::vector<TraceRequest>& trace, std::string_view flags, std::string_view shape,
                             std::string_view remedy) {
  for (std::size_t i = 0; i < trace.size(); ++i)
    check(trace[i].arrival_s <= kMaxTraceSeconds,  // NaN fails too
          "{}: request {} of {} would arrive at {:.4g} s ({}); at most {} s of arrivals are served: {}", flags, i + 1,
          trace.size(), trace[i].arrival_s, shape, kMaxTraceSeconds, remedy);
}
inline std::string poisson_shape(double rate) { return fmt::format("Poisson at {:g} requests/s", rate); }
inline std::string bursty_shape(std::int64_t burst, double period) {
  return fmt::format("bursts of {} every {:g} s", burst, period);
}

// The flags of a trace shape as moe_infer names them (--rate, or --bursty with --burst and --period), and what to
// change when its arrivals run past kMaxTraceSeconds.
inline std::string trace_flags(const TraceShape& shape) {
  return shape.bursty ? fmt::format("--bursty --burst {} --period {:g}", shape.burst, shape.period)
                      : fmt::format("--rate {:g}", shape.rate);
}
inline std::string_view trace_remedy(bool bursty) {
  return bursty ? "lower --period, raise --burst or lower --requests" : "raise --rate or lower --requests";
}

inline std::vector<ServeRequest> make_trace(const TraceShape& shape, std::int64_t vocab) {
  check(shape.prompt_min >= 1 && shape.prompt_min <= shape.prompt_max && shape.output_min >= 1 &&
            shape.output_min <= shape.output_max && vocab >= 1,
        "make_trace: prompt [{}, {}] and output [{}, {}] lengths need 1 <= min <= max, vocabulary {} >= 1",
        shape.prompt_min, shape.prompt_max, shape.output_min, shape.output_max, vocab);
  // The trace as data (poisson_trace / bursty_trace), then its requests (to_serve_requests): one generator for
  // moe_infer and moe_simulate.
  const LengthRanges lengths{shape.prompt_min, shape.prompt_max, shape.output_min, shape.output_max};
  const std::vector<TraceRequest> t = shape.bursty
                                          ? bursty_trace(shape.burst, shape.period, shape.requests, lengths, shape.seed)
                                          : poisson_trace(shape.rate, shape.requests, lengths, shape.seed);
  check_trace_span(t, trace_flags(shape), shape.bursty ? bursty_shape(shape.burst, shape.period) : poisson_shape(shape.rate),
                   trace_remedy(shape.bursty));
  return to_serve_requests(t, vocab, shape.seed);
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


namespace trace_detail {

// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's days_from_civil).
constexpr std::int64_t days_from_civil(std::int64_t y, unsigned m, unsigned d) {
  y -= m <= 2;
  const std::int64_t era = (y >= 0 ? y : y - 399) / 400;
  const unsigned yoe = unsigned(y - era * 400);
  const unsigned doy = (153 * (m + (m > 2 ? -3 : 9)) + 2) / 5 + d - 1;
  const unsigned doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
  return era * 146097 + std::int64_t(doe) - 719468;
}

// Seconds of "YYYY-MM-DD HH:MM:SS[.fraction]" or of a plain number; false if neither.
inline bool parse_timestamp(const std::string& s, double& seconds) {
  int y = 0, mo = 0, d = 0, h = 0, mi = 0, consumed = 0;
  double sec = 0;
  if (std::sscanf(s.c_str(), "%4d-%2d-%2d %2d:%2d:%lf%n", &y, &mo, &d, &h, &mi, &sec, &consumed) == 6 &&
      std::size_t(consumed) == s.size() && mo >= 1 && mo <= 12 && d >= 1 && d <= 31 && h < 24 && mi < 60 &&
      sec >= 0 && sec < 61) {
    seconds = double(days_from_civil(y, unsigned(mo), unsigned(d))) * 86400.0 + h * 3600.0 + mi * 60.0 + sec;
    return true;
  }
  std::size_t used = 0;
  try {
    seconds = std::stod(s, &used);
  } catch (const std::exception&) {
    return false;
  }
  return used == s.size() && std::isfinite(seconds);
}

}  // namespace trace_detail

// An Azure-format trace; max_requests > 0 keeps the first rows only.
inline std::vector<TraceRequest> read_azure_trace(const std::string& path, std::int64_t max_requests = 0) {
  std::ifstream f(path);
  check(bool(f), "request trace {}: cannot open it", path);
  std::string line;
  check(bool(std::getline(f, line)), "request trace {}: empty (expected a header TIMESTAMP,ContextTokens,"
        "GeneratedTokens)", path);
  if (!line.empty() && line.back() == '\r') line.pop_back();
  auto split = [](const std::string& l) {
    std::vector<std::pair<std::string, std::size_t>> cells;  // text, 1-based column
    std::size_t at = 0;
    while (true) {
      const std::size_t comma = l.find(',', at);
      std::string cell = l.substr(at, comma == std::string::npos ? std::string::npos : comma - at);
      const std::size_t b = cell.find_first_not_of(" \t\""), e = cell.find_last_not_of(" \t\"");
      cells.push_back({b == std::string::npos ? std::string() : cell.substr(b, e - b + 1), at + 1});
      if (comma == std::string::npos) break;
      at = comma + 1;
    }
    return cells;
  };
  const auto header = split(line);
  int ts = -1, ctx = -1, gen = -1;
  for (std::size_t i = 0; i < header.size(); ++i) {
    if (header[i].first == "TIMESTAMP") ts = int(i);
    if (header[i].first == "ContextTokens") ctx = int(i);
    if (header[i].first == "GeneratedTokens") gen = int(i);
  }
  check(ts >= 0 && ctx >= 0 && gen >= 0, "request trace {}:1: the header \"{}\" lacks {}{}{}(the Azure LLM inference "
        "trace format: TIMESTAMP,ContextTokens,GeneratedTokens)", path, printable(line), ts < 0 ? "TIMESTAMP " : "",
        ctx < 0 ? "ContextTokens " : "", gen < 0 ? "GeneratedTokens " : "");
  std::vector<TraceRequest> out;
  double first = 0;
  std::int64_t number = 1;
  while (std::getline(f, line) && (max_requests <= 0 || std::int64_t(out.size()) < max_requests)) {
    ++number;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty()) continue;
    const auto cells = split(line);
    check(cells.size() == header.size(), "request trace {}:{}: {} fields, the header has {}", path, number,
          cells.size(), header.size());
    TraceRequest r;
    double t = 0;
    check(trace_detail::parse_timestamp(cells[std::size_t(ts)].first, t),
          "request trace {}:{}:{}: TIMESTAMP \"{}\" is neither YYYY-MM-DD HH:MM:SS[.fraction] nor seconds", path,
          number, cells[std::size_t(ts)].second, printable(cells[std::size_t(ts)].first));
    auto tokens = [&](int i, const char* name) {
      const auto& [text, column] = cells[std::size_t(i)];
      std::size_t used = 0;
      long long v = 0;
      try {
        v = std::stoll(text, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      check(!text.empty() && used == text.size() && v >= 1 && v <= kMaxTraceTokens,
            "request trace {}:{}:{}: {} \"{}\" is not an integer in [1, {}]", path, number, column, name,
            printable(text), kMaxTraceTokens);
      return std::int64_t(v);
    };
    r.prompt_tokens = tokens(ctx, "ContextTokens");
    r.output_tokens = tokens(gen, "GeneratedTokens");
    if (out.empty()) first = t;
    // Rows in arrival order (as the Azure traces are): an earlier one would arrive before the trace began.
    check(out.empty() || t - first >= out.back().arrival_s,
          "request trace {}:{}:{}: TIMESTAMP \"{}\" is earlier than the previous request's; expected the rows in "
          "arrival order", path, number, cells[std::size_t(ts)].second, printable(cells[std::size_t(ts)].first));
    r.arrival_s = t - first;
    out.push_back(r);
  }
  check(!out.empty(), "request trace {}: no requests after the header", path);
  return out;
}

}  // namespace paradyse::serve
