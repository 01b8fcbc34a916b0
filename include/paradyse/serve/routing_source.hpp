// paradyse/serve/routing_source.hpp: where the router's choices come from when the engine runs a model shape without
// weights (serve/shape_step.hpp): per step and MoE layer, the (token, expert) pairs per expert of the step's n tokens
// under top-k (every token picks k distinct experts, so the counts sum to n k and none exceeds n).
//   ZipfRouting: expert j of a seeded per-layer permutation drawn with weight 1 / (j + 1)^s (s = 0: uniform).
//   WeightedRouting: per layer, published load statistics as the experts' weights (DeepSeek's EPLB example,
//     ../shared/data/moe/eplb_example.json's "weight" matrix; its expert count resampled to the model's by quantiles
//     of the sorted loads, so the skew (max / mean) is kept while the expert identities are not).
//   RecordedRouting: a record of per-step, per-layer expert counts from a real run (RoutingRecorder, through the
//     clock's observer), replayed step after step (cyclically) and layer after layer, each step's counts scaled
//     from its recorded tokens to the simulated step's (largest remainders, at most n per expert).
// Every draw is seeded by (seed, step, layer): the same run draws the same routing. describe() names the source in
// the output.
#pragma once

#include "paradyse/core/atomic_file.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/core/json.hpp"
#include "paradyse/core/printable.hpp"
#include "paradyse/core/rng.hpp"
#include "paradyse/serve/step_trace.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

namespace paradyse::serve {

class RoutingSource {
public:
  virtual ~RoutingSource() = default;
  virtual std::string describe() const = 0;
  // [experts]: pairs per expert of `tokens` tokens at MoE layer `moe_layer` (0, 1, ... over the MoE layers) of step
  // `step`.
  virtual std::vector<std::int64_t> counts(std::int64_t step, std::int64_t moe_layer, std::int64_t tokens,
                                           std::int64_t experts, std::int64_t top_k) = 0;
};

namespace routing_detail {

inline Rng draw_rng(std::uint64_t seed, std::int64_t step, std::int64_t layer) {
  Rng mix(seed * 0x9e3779b97f4a7c15ull + std::uint64_t(step) * 7919u + std::uint64_t(layer) * 104729u + 1);
  return Rng(mix.next_u64());
}

// Each token picks top_k distinct experts, one after another in proportion to the weights of those left.
inline std::vector<std::int64_t> sample_pairs(const std::vector<double>& weight, std::int64_t tokens, std::int64_t top_k,
                                              Rng& rng) {
  const std::size_t E = weight.size();
  check(top_k >= 1 && std::size_t(top_k) <= E, "routing: top-k {} for {} experts", top_k, E);
  std::vector<std::int64_t> count(E, 0);
  std::vector<double> w(E);
  for (std::int64_t t = 0; t < tokens; ++t) {
    w = weight;
    double total = std::accumulate(w.begin(), w.end(), 0.0);
    for (std::int64_t k = 0; k < top_k; ++k) {
      double u = rng.uniform() * total;
      std::size_t e = 0;
      while (e + 1 < E && (w[e] <= 0 || u >= w[e])) u -= w[e++];
      if (w[e] <= 0)  // rounding left nothing: the last expert still free
        for (e = E; e-- > 0 && w[e] <= 0;) {}
      ++count[e];
      total -= w[e];
      w[e] = 0;
    }
  }
  return count;
}

}  // namespace routing_detail

class ZipfRouting final : public RoutingSource {
public:
  ZipfRouting(double exponent, std::uint64_t seed) : s_(exponent), seed_(seed) {
    check(exponent >= 0 && std::isfinite(exponent), "ZipfRouting: exponent {} must be finite and >= 0", exponent);
  }
  std::string describe() const override { return fmt::format("Zipf skew s = {:g} (seed {})", s_, seed_); }
  std::vector<std::int64_t> counts(std::int64_t step, std::int64_t moe_layer, std::int64_t tokens, std::int64_t experts,
                                   std::int64_t top_k) override {
    // The layer's permutation: which expert is the j-th most popular (fixed over the steps).
    Rng order_rng = routing_detail::draw_rng(seed_, -1, moe_layer);
    std::vector<std::int64_t> order(static_cast<std::size_t>(experts));
    std::iota(order.begin(), order.end(), 0);
    for (std::size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[order_rng.below(i)]);
    std::vector<double> w(static_cast<std::size_t>(experts));
    for (std::int64_t j = 0; j < experts; ++j) w[std::size_t(order[std::size_t(j)])] = 1.0 / std::pow(double(j + 1), s_);
    Rng rng = routing_detail::draw_rng(seed_, step, moe_layer);
    return routing_detail::sample_pairs(w, tokens, top_k, rng);
  }

private:
  double s_;
  std::uint64_t seed_;
};

class WeightedRouting final : public RoutingSource {
public:
  // weight[l]: the loads of MoE layer l mod weight.size() (any expert count: resampled to the model's).
  WeightedRouting(std::vector<std::vector<double>> weight, std::string name, std::uint64_t seed)
      : weight_(std::move(weight)), name_(std::move(name)), seed_(seed) {
    check(!weight_.empty(), "WeightedRouting {}: no layers", name_);
    for (const auto& w : weight_) {
      check(!w.empty(), "WeightedRouting {}: a layer without experts", name_);
      for (const double x : w) check(x >= 0 && std::isfinite(x), "WeightedRouting {}: load {} is not >= 0", name_, x);
    }
  }
  std::string describe() const override { return fmt::format("published loads {} (seed {})", name_, seed_); }
  std::vector<std::int64_t> counts(std::int64_t step, std::int64_t moe_layer, std::int64_t tokens, std::int64_t experts,
                                   std::int64_t top_k) override {
    std::vector<double> w = weight_[std::size_t(moe_layer) % weight_.size()];
    if (std::int64_t(w.size()) != experts) {  // quantiles of the sorted loads, in the source's expert order of ranks
      std::vector<double> sorted = w;
      std::sort(sorted.begin(), sorted.end());
      std::vector<double> r(static_cast<std::size_t>(experts));
      for (std::int64_t e = 0; e < experts; ++e) {
        const double at = experts == 1 ? 0.0 : double(e) * double(sorted.size() - 1) / double(experts - 1);
        const std::size_t lo = std::size_t(at), hi = std::min(lo + 1, sorted.size() - 1);
        r[std::size_t(e)] = sorted[lo] + (at - double(lo)) * (sorted[hi] - sorted[lo]);
      }
      Rng order_rng = routing_detail::draw_rng(seed_, -1, moe_layer);
      for (std::size_t i = r.size(); i > 1; --i) std::swap(r[i - 1], r[order_rng.below(i)]);
      w = r;
    }
    if (std::accumulate(w.begin(), w.end(), 0.0) <= 0) std::fill(w.begin(), w.end(), 1.0);
    for (double& x : w) x = std::max(x, 1e-9);  // every expert can be picked (top-k needs k of them)
    Rng rng = routing_detail::draw_rng(seed_, step, moe_layer);
    return routing_detail::sample_pairs(w, tokens, top_k, rng);
  }

private:
  std::vector<std::vector<double>> weight_;
  std::string name_;
  std::uint64_t seed_;
};

// The "weight" matrix (layers x experts) of an EPLB statistics file like DeepSeek's example.
inline WeightedRouting published_routing(const std::string& path, std::uint64_t seed) {
  const json::Value doc = json::load_file(path);
  check(doc.is_object() && doc.contains("weight") && doc.at("weight").is_array(),
        "published routing {}: expected a JSON object with a \"weight\" matrix (layers x experts)", path);
  std::vector<std::vector<double>> w;
  std::size_t row = 0;
  for (const json::Value& layer : doc.at("weight")) {
    check(layer.is_array() && !layer.empty(), "published routing {}: weight[{}] is not a non-empty array", path, row);
    w.emplace_back();
    for (const json::Value& x : layer) {
      check(x.is_number(), "published routing {}: weight[{}] holds a {}, expected numbers", path, row, x.type_name());
      w.back().push_back(x.get<double>());
    }
    ++row;
  }
  const std::string name = path.substr(path.find_last_of('/') == std::string::npos ? 0 : path.find_last_of('/') + 1);
  return WeightedRouting(std::move(w), name, seed);
}

// ---- records ----------------------------------------------------------------------------------------------------

// Per step and MoE layer: the step's tokens and the pairs per expert.
struct RoutingRecord {
  std::int64_t experts = 0;
  struct Row {
    std::int64_t step = 0, layer = 0, tokens = 0;
    std::vector<std::int64_t> counts;
  };
  std::vector<Row> rows;
};

// Collects a record from the engine's step traces (EngineClock::observer); save() writes the CSV
// "step,layer,tokens,e0,e1,...": one row per step and MoE layer (layer: the model's layer index).
class RoutingRecorder {
public:
  void add(const StepTrace& t) {
    for (std::size_t l = 0; l < t.routed.size(); ++l) {
      if (t.routed[l].empty()) continue;
      if (record_.experts == 0) record_.experts = std::int64_t(t.routed[l].size());
      record_.rows.push_back({step_, std::int64_t(l), t.tokens(), t.routed[l]});
    }
    ++step_;
  }
  const RoutingRecord& record() const noexcept { return record_; }
  // Written atomically (core/atomic_file.hpp): a full disk is an Error naming `what` (the flag: "--record-routing"),
  // the file and the system's reason, never a truncated record reported as written (the stream was checked before
  // its buffered data was flushed).
  void save(const std::string& path, const std::string& what = "routing record") const {
    std::ostringstream f;
    f << "step,layer,tokens";
    for (std::int64_t e = 0; e < record_.experts; ++e) f << ",e" << e;
    f << '\n';
    for (const RoutingRecord::Row& r : record_.rows) {
      f << r.step << ',' << r.layer << ',' << r.tokens;
      for (const std::int64_t c : r.counts) f << ',' << c;
      f << '\n';
    }
    write_file_atomically(path, f.str(), what);
  }

private:
  RoutingRecord record_;
  std::int64_t step_ = 0;
};

// The largest count a record's cell may hold (2^40: far beyond any step; sums of them stay inside 64 bits).
inline constexpr std::int64_t kMaxRecordCount = std::int64_t(1) << 40;

// Reads a record; errors name the file, line and column.
inline RoutingRecord load_routing_record(const std::string& path) {
  std::ifstream f(path);
  check(bool(f), "routing record {}: cannot open it", path);
  std::string line;
  check(bool(std::getline(f, line)) && line.rfind("step,layer,tokens,", 0) == 0,
        "routing record {}:1:1: expected the header \"step,layer,tokens,e0,...\"", path);
  RoutingRecord rec;
  rec.experts = std::int64_t(std::count(line.begin(), line.end(), ',')) - 2;
  std::int64_t number = 1;
  std::vector<std::int64_t> lines;  // the line of each row
  while (std::getline(f, line)) {
    ++number;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty()) continue;
    std::vector<std::int64_t> v;
    std::size_t at = 0;
    for (int column = 1;; ++column) {
      const std::size_t comma = line.find(',', at);
      const std::string cell = line.substr(at, comma == std::string::npos ? std::string::npos : comma - at);
      std::size_t used = 0;
      long long x = -1;
      try {
        x = std::stoll(cell, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      check(used == cell.size() && !cell.empty() && x >= 0 && x <= kMaxRecordCount,
            "routing record {}:{}:{}: \"{}\" is not a count in [0, {}]", path, number, at + 1, printable(cell),
            kMaxRecordCount);
      v.push_back(x);
      if (comma == std::string::npos) break;
      at = comma + 1;
    }
    check(std::int64_t(v.size()) == rec.experts + 3, "routing record {}:{}: {} fields, the header has {}", path, number,
          v.size(), rec.experts + 3);
    RoutingRecord::Row r{v[0], v[1], v[2], std::vector<std::int64_t>(v.begin() + 3, v.end())};
    rec.rows.push_back(std::move(r));
    lines.push_back(number);
  }
  check(!rec.rows.empty(), "routing record {}: no rows", path);
  // Then the rows' meaning (after every cell has parsed): under top-k a token picks an expert at most once, so a
  // count above its step's tokens is a damaged record (it was clamped when replayed), refused naming the cell.
  for (std::size_t i = 0; i < rec.rows.size(); ++i) {
    const RoutingRecord::Row& r = rec.rows[i];
    for (std::size_t e = 0; e < r.counts.size(); ++e)
      check(r.counts[e] <= r.tokens,
            "routing record {}:{}: step {} layer {}: expert {} (column {}) has {} token-expert pairs, above the step's "
            "{} tokens (a token picks an expert at most once)",
            path, lines[i], r.step, r.layer, e, e + 4, r.counts[e], r.tokens);
  }
  return rec;
}

class RecordedRouting final : public RoutingSource {
public:
  RecordedRouting(RoutingRecord record, std::string name) : name_(std::move(name)) {
    check(!record.rows.empty(), "RecordedRouting {}: an empty record", name_);
    experts_ = record.experts;
    for (RoutingRecord::Row& r : record.rows) {  // grouped by step, layers in order
      if (steps_.empty() || r.step != last_step_) steps_.emplace_back(), last_step_ = r.step;
      steps_.back().push_back(std::move(r));
    }
  }
  std::string describe() const override {
    return fmt::format("recorded routing {} ({} steps, {} experts)", name_, steps_.size(), experts_);
  }
  std::vector<std::int64_t> counts(std::int64_t step, std::int64_t moe_layer, std::int64_t tokens, std::int64_t experts,
                                   std::int64_t top_k) override {
    check(experts == experts_, "RecordedRouting {}: recorded with {} experts, the model has {}", name_, experts_,
          experts);
    const auto& layers = steps_[std::size_t(step) % steps_.size()];
    const RoutingRecord::Row& r = layers[std::size_t(moe_layer) % layers.size()];
    // Scale to tokens * top_k pairs: floors, then the largest remainders, at most `tokens` per expert.
    const double total = double(std::accumulate(r.counts.begin(), r.counts.end(), std::int64_t(0)));
    const std::int64_t want = tokens * top_k;
    std::vector<std::int64_t> out(r.counts.size(), 0);
    if (total <= 0) return out;
    std::vector<std::pair<double, std::size_t>> rest;
    std::int64_t given = 0;
    for (std::size_t e = 0; e < out.size(); ++e) {
      const double x = double(r.counts[e]) * double(want) / total;
      out[e] = std::min<std::int64_t>(tokens, std::int64_t(std::floor(x)));
      given += out[e];
      rest.push_back({x - std::floor(x), e});
    }
    std::stable_sort(rest.begin(), rest.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    for (std::size_t i = 0; given < want; i = (i + 1) % rest.size()) {
      std::size_t e = rest[i].second;
      if (out[e] < tokens) ++out[e], ++given;
      else if (std::all_of(out.begin(), out.end(), [&](std::int64_t c) { return c >= tokens; })) break;
    }
    return out;
  }

private:
  std::string name_;
  std::int64_t experts_ = 0, last_step_ = -1;
  std::vector<std::vector<RoutingRecord::Row>> steps_;
};

}  // namespace paradyse::serve
