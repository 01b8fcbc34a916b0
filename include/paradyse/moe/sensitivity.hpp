// paradyse/moe/sensitivity.hpp: Alloc-L's profiler, the table Delta_l(k) of each MoE layer's sensitivity to running
// k experts (issue 12), and its JSON form.
//
// Delta_l(k) is the quality lost when ONLY layer l runs k experts per token and every other layer keeps its own
// top-k, measured on calibration tokens, for k = 1 .. K_max_l (K_max_l >= the layer's top-k when asked to look above
// it; Delta_l(top-k) = 0 by definition). Two metrics:
//   - loss_increase (the default): mean next-token cross-entropy on the calibration tokens minus that of the full
//     model. The model is the caller's: `profile_loss_sensitivity` calls loss(K) with one k per MoE layer. It costs
//     sum_l (K_max_l - 1) calibration forwards.
//   - output_distortion: ||Y_k - Y||_F^2 / ||Y||_F^2 of one MoE block on its own calibration inputs (the hidden
//     states that reach layer l in the full model), Y the block's output at its top-k. No model needed beyond the
//     block; cheap, but blind to how the error propagates to the loss.
// Either table feeds allocate_layers (moe/alloc_layers.hpp). Saved and loaded through the library's JSON reader and
// writer (core/json.hpp); numbers keep 17 digits, so a table survives a round trip bit for bit.
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/json.hpp"
#include "paradyse/core/printable.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/moe/moe_layer.hpp"
#include "paradyse/strategy/buffer_pool.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace paradyse {

enum class SensitivityMetric { loss_increase, output_distortion };

inline std::string_view metric_name(SensitivityMetric m) {
  return m == SensitivityMetric::loss_increase ? "loss_increase" : "output_distortion";
}
inline SensitivityMetric parse_metric(std::string_view name) {
  if (name == "loss_increase") return SensitivityMetric::loss_increase;
  if (name == "output_distortion") return SensitivityMetric::output_distortion;
  throw Error(fmt::format("sensitivity: metric \"{}\"; expected loss_increase or output_distortion", printable(name)));
}

struct SensitivityTable {
  SensitivityMetric metric = SensitivityMetric::loss_increase;
  std::vector<std::int64_t> top_k;          // [L]: each MoE layer's own top-k
  std::vector<std::vector<double>> delta;   // [L][K_max_l]: delta[l][k-1] = Delta_l(k)
  double base = 0;                          // loss_increase: the full model's calibration loss; distortion: 0
  std::int64_t calibration_tokens = 0;      // tokens the table was measured on
  std::string model;                        // the measured model's identity (serve::model_identity); empty: unknown

  std::int64_t layers() const { return std::int64_t(top_k.size()); }
  std::vector<std::int64_t> k_max() const {
    std::vector<std::int64_t> m;
    for (const auto& row : delta) m.push_back(std::int64_t(row.size()));
    return m;
  }
  void validate() const {
    check(!top_k.empty(), "sensitivity: the table has no MoE layer");
    check(delta.size() == top_k.size(), "sensitivity: {} rows of Delta for {} MoE layers", delta.size(), top_k.size());
    for (std::size_t l = 0; l < top_k.size(); ++l) {
      check(top_k[l] >= 1 && std::int64_t(delta[l].size()) >= top_k[l],
            "sensitivity: layer {} has top-k = {} and {} entries; expected top-k >= 1 and Delta for k = 1 .. K_max >= "
            "top-k",
            l, top_k[l], delta[l].size());
      for (std::size_t j = 0; j < delta[l].size(); ++j)
        check(std::isfinite(delta[l][j]), "sensitivity: Delta_{}({}) = {} is not finite", l, j + 1, delta[l][j]);
    }
    check(calibration_tokens >= 0, "sensitivity: calibration_tokens = {} is negative", calibration_tokens);
  }
};

// ---- JSON ----
//   {"format": "paradyse.alloc_moe.sensitivity", "version": 1, "metric": "loss_increase", "base": 3.21,
//    "calibration_tokens": 4096, "layers": [{"top_k": 2, "delta": [0.41, 0, -0.002, ...]}, ...],
//    "model": "mixtral layers 2 (2 MoE) hidden 32 experts 4 top-k 2 config 0123456789abcdef"}
// "model" (optional: tables written before it have none) names the model the table was measured on, so that a
// table is not applied to another model (check_sensitivity_model).

inline constexpr std::string_view kSensitivityFormat = "paradyse.alloc_moe.sensitivity";

inline json::Value sensitivity_to_json(const SensitivityTable& t) {
  t.validate();
  json::Value layers = json::Value::array();
  for (std::size_t l = 0; l < t.top_k.size(); ++l) layers.push_back({{"top_k", t.top_k[l]}, {"delta", t.delta[l]}});
  json::Value doc = {{"format", kSensitivityFormat},      {"version", 1},
                     {"metric", metric_name(t.metric)},   {"base", t.base},
                     {"calibration_tokens", t.calibration_tokens}, {"layers", std::move(layers)}};
  if (!t.model.empty()) doc["model"] = t.model;
  return doc;
}

inline SensitivityTable sensitivity_from_json(const json::Value& value) {
  const json::Field v(value, "sensitivity");
  v.expect(v.is_object(), "an object");
  const auto format = v.find("format");
  check(format && format->value().is_string() && format->string() == kSensitivityFormat,
        "sensitivity: \"format\" must be \"{}\" (not a sensitivity table?)", kSensitivityFormat);
  const std::int64_t version = v["version"].integer();
  check(version == 1, "sensitivity: version {}; this reader knows version 1", version);
  SensitivityTable t;
  t.metric = parse_metric(v["metric"].string());
  t.base = v["base"].number();
  t.calibration_tokens = v["calibration_tokens"].integer();
  for (const json::Field& layer : v["layers"].elements()) {
    t.top_k.push_back(layer["top_k"].integer());
    std::vector<double> row;
    for (const json::Field& d : layer["delta"].elements()) row.push_back(d.number());
    t.delta.push_back(std::move(row));
  }
  if (const auto model = v.find("model")) t.model = model->string();
  t.validate();
  return t;
}

// Throws unless the table was measured on the model `identity` names (a table without an identity is taken as is;
// its layer count is still checked where it is used). `source` names the table in the message.
inline void check_sensitivity_model(const SensitivityTable& t, const std::string& identity, const std::string& source) {
  check(t.model.empty() || t.model == identity,
        "sensitivity table {} was measured on another model: it names \"{}\", this model is \"{}\"", source, t.model,
        identity);
}

// Atomically (core/atomic_file.hpp); `what` names the file in errors (the flag that gave it).
inline void save_sensitivity(const SensitivityTable& t, const std::string& path,
                             const std::string& what = "sensitivity table") {
  json::save_file(sensitivity_to_json(t), path, what);
}
// Errors name the file: "sensitivity table t.json: sensitivity: layer 0 has top-k = 3 and 2 entries ...".
inline SensitivityTable load_sensitivity(const std::string& path) {
  const json::Value doc = json::load_file(path);  // its errors name the file already
  try {
    return sensitivity_from_json(doc);
  } catch (const Error& e) {
    throw Error(fmt::format("sensitivity table {}: {}", path, error_reason(e)));
  }
}

// ---- the profilers ----

// loss(K) -> the mean calibration loss with layer l running K[l] experts per token. k_max[l] >= top_k[l].
template <class Loss>
SensitivityTable profile_loss_sensitivity(std::span<const std::int64_t> top_k, std::span<const std::int64_t> k_max,
                                          std::int64_t calibration_tokens, Loss&& loss) {
  check(k_max.size() == top_k.size(), "profile_loss_sensitivity: {} K_max for {} layers", k_max.size(), top_k.size());
  SensitivityTable t;
  t.metric = SensitivityMetric::loss_increase;
  t.top_k.assign(top_k.begin(), top_k.end());
  t.calibration_tokens = calibration_tokens;
  std::vector<std::int64_t> k(top_k.begin(), top_k.end());
  t.base = double(loss(std::span<const std::int64_t>(k)));
  check(std::isfinite(t.base), "profile_loss_sensitivity: the full model's calibration loss is {}", t.base);
  for (std::size_t l = 0; l < top_k.size(); ++l) {
    check(k_max[l] >= top_k[l], "profile_loss_sensitivity: layer {} has K_max = {} below its top-k = {}", l, k_max[l],
          top_k[l]);
    std::vector<double> row(std::size_t(k_max[l]), 0.0);
    for (std::int64_t j = 1; j <= k_max[l]; ++j) {
      if (j == top_k[l]) continue;  // Delta_l(top-k) = 0
      k[l] = j;
      row[std::size_t(j - 1)] = double(loss(std::span<const std::int64_t>(k))) - t.base;
    }
    k[l] = top_k[l];
    t.delta.push_back(std::move(row));
  }
  t.validate();
  return t;
}

// ||Y_k - Y_top||_F^2 / ||Y_top||_F^2 of one MoE block on x [n, h] (single rank; w holds every expert).
template <class Backend = ops::Cpu>
double moe_output_distortion(const MoeConfig& c, const MoeShard& w, TensorView<const float> x, std::int64_t k,
                             BufferPool& pool) {
  Tensor<float> base(x.shape()), cut(x.shape());
  moe_forward<Backend>(MoeContext(c, pool), w, x, base.view());
  moe_forward<Backend>(MoeContext(c, pool, TopK{k}), w, x, cut.view());
  double num = 0, den = 0;
  for (std::int64_t i = 0; i < x.numel(); ++i) {
    const double b = base.span()[std::size_t(i)], d = double(cut.span()[std::size_t(i)]) - b;
    num += d * d;
    den += b * b;
  }
  check(den > 0, "moe_output_distortion: the block's output is zero on the calibration inputs");
  return num / den;
}

// layers[l], shards[l]: MoE layer l; inputs[l]: [n_l, h] the hidden states reaching its block on calibration text.
template <class Backend = ops::Cpu>
SensitivityTable profile_distortion_sensitivity(std::span<const MoeConfig> layers, std::span<const MoeShard* const> shards,
                                                std::span<const TensorView<const float>> inputs,
                                                std::span<const std::int64_t> k_max, BufferPool& pool) {
  check(shards.size() == layers.size() && inputs.size() == layers.size() && k_max.size() == layers.size(),
        "profile_distortion_sensitivity: {} layers, {} shards, {} inputs, {} K_max; expected one of each per layer",
        layers.size(), shards.size(), inputs.size(), k_max.size());
  SensitivityTable t;
  t.metric = SensitivityMetric::output_distortion;
  for (std::size_t l = 0; l < layers.size(); ++l) {
    const MoeConfig& c = layers[l];
    check(k_max[l] >= c.top_k && k_max[l] <= c.experts,
          "profile_distortion_sensitivity: layer {} has K_max = {}; expected top-k = {} to E = {}", l, k_max[l],
          c.top_k, c.experts);
    t.top_k.push_back(c.top_k);
    t.calibration_tokens = std::max(t.calibration_tokens, inputs[l].numel() / c.hidden);
    std::vector<double> row(std::size_t(k_max[l]), 0.0);
    for (std::int64_t j = 1; j <= k_max[l]; ++j)
      if (j != c.top_k) row[std::size_t(j - 1)] = moe_output_distortion<Backend>(c, *shards[l], inputs[l], j, pool);
    t.delta.push_back(std::move(row));
  }
  t.validate();
  return t;
}

}  // namespace paradyse
