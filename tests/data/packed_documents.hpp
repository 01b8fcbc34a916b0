// tests/data/packed_documents.hpp: what the packing tests share. Random documents, one run's results, and
// what a padded or packed step must give: the token-weighted mean of its documents trained alone.
#pragma once

#include "paradyse/data/corpus.hpp"
#include "paradyse/data/packing.hpp"

#include "paradyse/core/rng.hpp"

#include <fmt/format.h>

#include <cstdint>
#include <string>
#include <vector>

namespace paradyse::testing {

// Documents of `sizes` random lowercase bytes, named d0, d1, ...
inline std::vector<data::Document> documents_of(const std::vector<std::int64_t>& sizes, std::uint64_t seed) {
  Rng rng(seed);
  std::vector<data::Document> docs;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    std::string bytes;
    for (std::int64_t j = 0; j < sizes[i]; ++j) bytes += char('a' + rng.below(26));
    docs.push_back({fmt::format("d{}", i), bytes});
  }
  return docs;
}

// One run's loss, counted tokens and rank 0's replicated gradient (the same on every rank), and on one rank the
// layer gradients (the one-rank shards are the global weights).
struct RunResult {
  double loss = 0;
  std::int64_t counted = 0;
  std::vector<float> replicated_grad, layer_grad;
};

// What a padded or packed step must give: the token-weighted mean of its documents' results alone (`alone`: one
// per window, indexed by the window's document), for the gradient `member`.
struct DocumentsMean {
  double loss = 0;
  std::int64_t counted = 0;
  std::vector<double> grad;
};
inline DocumentsMean documents_mean(const std::vector<RunResult>& alone, const data::Step& step,
                                    std::vector<float> RunResult::*member = &RunResult::replicated_grad) {
  DocumentsMean mean;
  mean.grad.assign((alone.at(step.rows.at(0).document).*member).size(), 0.0);
  for (const data::Window& w : step.rows) {
    const RunResult& a = alone.at(w.document);
    mean.loss += a.loss * double(a.counted);
    mean.counted += a.counted;
    for (std::size_t i = 0; i < mean.grad.size(); ++i) mean.grad[i] += double((a.*member)[i]) * double(a.counted);
  }
  mean.loss /= double(mean.counted);
  for (double& g : mean.grad) g /= double(mean.counted);
  return mean;
}

}  // namespace paradyse::testing
