// paradyse/serve/sampling.hpp: choosing the next token from logits: greedy, or seeded sampling with a temperature
// and nucleus (top-p) truncation.
//
// temperature 0: argmax (the lowest index wins a tie). Otherwise p_i = softmax(logits / temperature); with top_p < 1
// only the smallest set of most likely tokens whose probabilities sum to at least top_p is kept (always the most
// likely one), renormalised; one uniform draw from the request's own Rng picks the token. A request's Rng is seeded
// from (seed, request id), so its tokens do not depend on which other requests share its batches.
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/rng.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <span>
#include <vector>

namespace paradyse::serve {

struct SamplingParams {
  double temperature = 0;  // 0: greedy
  double top_p = 1.0;      // (0, 1]
  std::uint64_t seed = 0;

  void validate() const {
    check(std::isfinite(temperature) && temperature >= 0, "SamplingParams: temperature = {} must be >= 0", temperature);
    check(top_p > 0 && top_p <= 1, "SamplingParams: top_p = {} must be in (0, 1]", top_p);
  }
};

// The Rng of one request.
inline Rng request_rng(const SamplingParams& s, std::int64_t request) {
  return Rng(s.seed * 0x9e3779b97f4a7c15ull + std::uint64_t(request) * 0xd1b54a32d192ed03ull + 1);
}

inline std::int32_t greedy_token(std::span<const float> logits) {
  check(!logits.empty(), "greedy_token: no logits");
  return std::int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

// The kept tokens and their renormalised probabilities (descending), for temperature > 0.
inline std::vector<std::pair<std::int32_t, double>> nucleus(std::span<const float> logits, const SamplingParams& s) {
  const float top = *std::max_element(logits.begin(), logits.end());
  std::vector<std::pair<std::int32_t, double>> p(logits.size());
  double total = 0;
  for (std::size_t i = 0; i < logits.size(); ++i) {
    p[i] = {std::int32_t(i), std::exp((double(logits[i]) - double(top)) / s.temperature)};
    total += p[i].second;
  }
  std::stable_sort(p.begin(), p.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
  double kept = 0;
  std::size_t n = 0;
  while (n < p.size() && (n == 0 || kept < s.top_p * total)) kept += p[n++].second;
  p.resize(n);
  for (auto& [token, prob] : p) prob /= kept;
  return p;
}

inline std::int32_t sample_token(std::span<const float> logits, const SamplingParams& s, Rng& rng) {
  s.validate();
  if (s.temperature == 0) return greedy_token(logits);
  const std::vector<std::pair<std::int32_t, double>> kept = nucleus(logits, s);
  const double u = rng.uniform();
  double acc = 0;
  for (const auto& [token, prob] : kept) {
    acc += prob;
    if (u < acc) return token;
  }
  return kept.back().first;
}

}  // namespace paradyse::serve
