// paradyse/search/config_file.hpp: one parallel configuration and the run it is for, as JSON: the schema that
// search_parallel --emit writes (the configuration the search chose) and --score reads (any fixed configuration),
// and that train_gpt --mesh-file is to read. The mesh axes are named as train_gpt's --mesh names them.
//
//   {"format": "paradyse.parallel_config/1",
//    "model": "gpt-175b" | "FILE.json" | {config.json keys, "_name_or_path": name},      (optional: the flags')
//    "cluster": "dgx-a100" | "FILE.json" | {cluster keys, search/cluster.hpp},            (optional)
//    "devices": 64,                                    (optional; must equal the mesh's product)
//    "seq": 2048, "global_batch": 1536,                (optional)
//    "flops": "causal" | "full",                       (optional: the FLOP convention of MFU)
//    "flash_attention": true, "overlap_grad_reduce": true,   (optional: the software's features)
//    "cp_gathers_weights": false,                      (optional: tp inside cp as MegatronRing, training_setup.hpp)
//    "zero3_prefetch": true,                           (optional: train_gpt's ZeRO-3 gathers a layer ahead, ditto)
//    "trainer": "megatron" | "train_gpt",              (optional: what the step posts besides the model, training_setup.hpp)
//    "dp": 2, "pp": 8, "cp": 1, "tp": 4 (or "tp_x": 2, "tp_y": 2), "ep": 1, "etp": 1,
//    "zero": 0, "virtual_stages": 1, "micro_batch": 1, "recompute": "none" | "selective" | "full",
//    "sequence_parallel": true, "cp_scheme": "ring" | "all-gather",
//    "published": {"tflops_per_gpu": 148, "counting": "megatron" | "model", "source": "..."}}   (optional)
//
// Every axis and knob may be left out (1, 0, "none", true, "ring"); unknown and repeated keys are refused by name.
// The same keys as "key=value,key=value" text are search_parallel --config.
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/json.hpp"
#include "paradyse/core/printable.hpp"
#include "paradyse/cost/profile_json.hpp"
#include "paradyse/search/cluster.hpp"
#include "paradyse/search/parallel_config.hpp"
#include "paradyse/search/training_model.hpp"
#include "paradyse/search/training_setup.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <cstdint>
#include <filesystem>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

namespace paradyse::search {

inline constexpr std::string_view kConfigFormat = "paradyse.parallel_config/1";

// How a published throughput counts FLOPs: Megatron-LM's eq. 3 (recomputation's extra forward counted: 4 passes of
// the layers, 3 of the logits) or the model FLOPs of MFU (3 passes).
enum class FlopCounting : std::uint8_t { megatron, model };
constexpr std::string_view name_of(FlopCounting c) { return c == FlopCounting::megatron ? "megatron" : "model"; }

struct PublishedThroughput {
  double tflops_per_gpu = 0;
  FlopCounting counting = FlopCounting::model;
  std::string source;
};

// A configuration file, read: what it fixes (the rest comes from the command line).
struct ConfigFile {
  std::optional<TrainingModel> model;
  std::string model_spec;  // as written: a preset name, a file name, or empty (inline)
  std::optional<ClusterProfile> cluster;
  std::string cluster_spec;
  std::optional<std::int64_t> devices, seq, global_batch;
  std::optional<FlopConvention> flops;
  std::optional<bool> flash_attention, overlap_grad_reduce, cp_gathers_weights, zero3_prefetch;
  std::optional<Trainer> trainer;
  ParallelConfig config;
  std::optional<PublishedThroughput> published;
};

// ---- models and clusters by name, file or value ----------------------------------------------------------------

inline bool is_json_file(std::string_view name) { return name.size() > 5 && name.substr(name.size() - 5) == ".json"; }

// A preset name or a config.json file (relative names from `base`).
inline TrainingModel load_training_model(const std::string& name, const std::filesystem::path& base = {}) {
  if (!is_json_file(name)) return model_preset(name);
  const std::filesystem::path path = base.empty() ? std::filesystem::path(name) : base / name;
  return model_from_json(json::load_file(path.string()), path.stem().string());
}
inline ClusterProfile load_cluster(const std::string& name, const std::filesystem::path& base = {}) {
  if (!is_json_file(name)) return cluster_preset(name);
  const std::filesystem::path path = base.empty() ? std::filesystem::path(name) : base / name;
  return cluster_from_json(json::load_file(path.string()));
}

// ---- the configuration's keys -----------------------------------------------------------------------------------

inline constexpr std::array<std::string_view, 14> kConfigKeys{
    "dp", "pp", "cp", "tp", "tp_x", "tp_y", "ep", "etp", "zero", "virtual_stages", "micro_batch", "recompute",
    "sequence_parallel", "cp_scheme"};

// The configuration's keys of an object (others are the caller's to check). Degrees in [1, 2^24].
inline ParallelConfig config_from_json(const json::Field& doc) {
  ParallelConfig c;
  auto degree = [&](std::string_view key, int& out) {
    if (const auto f = doc.find(key)) out = int(f->integer(1, std::int64_t(1) << 24));
  };
  degree("dp", c.dp);
  degree("pp", c.pp);
  degree("cp", c.cp);
  if (doc.has("tp")) {
    if (doc.has("tp_x") || doc.has("tp_y")) doc.fail("give either \"tp\" (1D) or \"tp_x\" and \"tp_y\" (2D), not both");
    degree("tp", c.tp_y);
  } else {
    degree("tp_x", c.tp_x);
    degree("tp_y", c.tp_y);
  }
  degree("ep", c.ep);
  degree("etp", c.etp);
  degree("virtual_stages", c.virtual_stages);
  degree("micro_batch", c.micro_batch);
  if (const auto f = doc.find("zero")) c.zero = int(f->integer(0, 3));
  if (const auto f = doc.find("recompute")) {
    const std::string& r = f->string();
    bool known = false;
    for (Recompute x : kAllRecompute)
      if (name_of(x) == r) c.recompute = x, known = true;
    if (!known) doc.fail(fmt::format("recompute = \"{}\"; expected none, selective or full", printable(r)));
  }
  if (const auto f = doc.find("sequence_parallel")) c.sequence_parallel = f->boolean();
  if (const auto f = doc.find("cp_scheme")) {
    const std::string& r = f->string();
    bool known = false;
    for (CpScheme x : kAllCpSchemes)
      if (name_of(x) == r) c.cp_scheme = x, known = true;
    if (!known) doc.fail(fmt::format("cp_scheme = \"{}\"; expected ring or all-gather", printable(r)));
  }
  // The degrees multiply to the device count: each may be 2^24, their product must be too (ParallelConfig::devices()
  // would overflow 64 bits beyond that).
  const double devices = double(c.dp) * double(c.pp) * double(c.cp) * double(c.tp_x) * double(c.tp_y);
  if (devices > double(std::int64_t(1) << 24))
    doc.fail(fmt::format("dp*pp*cp*tp_x*tp_y = {}*{}*{}*{}*{} = {:.6g} devices; expected at most 2^24 = 16777216", c.dp,
                         c.pp, c.cp, c.tp_x, c.tp_y, devices));
  return c;
}

inline void add_config(json::Value& v, const ParallelConfig& c) {
  v["dp"] = c.dp;
  v["pp"] = c.pp;
  v["cp"] = c.cp;
  if (c.tp_x == 1) v["tp"] = c.tp_y;
  else v["tp_x"] = c.tp_x, v["tp_y"] = c.tp_y;
  v["ep"] = c.ep;
  v["etp"] = c.etp;
  v["zero"] = c.zero;
  v["virtual_stages"] = c.virtual_stages;
  v["micro_batch"] = c.micro_batch;
  v["recompute"] = std::string(name_of(c.recompute));
  v["sequence_parallel"] = c.sequence_parallel;
  v["cp_scheme"] = std::string(name_of(c.cp_scheme));
}

// "dp=2,pp=8,tp=4,recompute=full" (search_parallel --config) as the JSON object of the same keys.
inline json::Value config_text_to_json(std::string_view text) {
  json::Value v = json::Value::object();
  std::size_t start = 0;
  check(!text.empty(), "--config: empty; expected key=value pairs separated by commas, keys {}",
        "dp, pp, cp, tp (or tp_x, tp_y), ep, etp, zero, virtual_stages, micro_batch, recompute, sequence_parallel, "
        "cp_scheme");
  while (start <= text.size()) {
    const std::size_t end = std::min(text.find(',', start), text.size());
    const std::string_view item = text.substr(start, end - start);
    const std::size_t eq = item.find('=');
    check(eq != std::string_view::npos && eq > 0 && eq + 1 < item.size(),
          "--config: \"{}\" is not key=value", printable(item));
    const std::string key(item.substr(0, eq));
    const std::string_view value = item.substr(eq + 1);
    check(!v.contains(key), "--config: key \"{}\" given twice", printable(key));
    std::int64_t number = 0;
    const auto [ptr, ec] = std::from_chars(value.data(), value.data() + value.size(), number);
    if (ec == std::errc() && ptr == value.data() + value.size()) v[key] = number;
    else if (value == "true" || value == "on") v[key] = true;
    else if (value == "false" || value == "off") v[key] = false;
    else v[key] = std::string(value);
    start = end + 1;
  }
  return v;
}

// The configuration alone, from --config text: its keys only.
inline ParallelConfig config_from_text(std::string_view text) {
  const json::Value v = config_text_to_json(text);
  const json::Field doc(v, "--config");
  cost::detail::only_keys(doc, kConfigKeys);
  return config_from_json(doc);
}

// ---- whole files ------------------------------------------------------------------------------------------------

inline ConfigFile config_file_from_json(const json::Value& value, std::string context = "config",
                                        const std::filesystem::path& base = {}) {
  const json::Field doc(value, std::move(context));
  doc.expect(doc.is_object(), "a JSON object");
  std::vector<std::string_view> known{"format", "model", "cluster", "devices", "seq", "global_batch", "flops",
                                      "flash_attention", "overlap_grad_reduce", "cp_gathers_weights", "trainer",
                                      "zero3_prefetch", "published"};
  known.insert(known.end(), kConfigKeys.begin(), kConfigKeys.end());
  cost::detail::only_keys(doc, known);
  if (const auto f = doc.find("format"))
    check(f->value().is_string() && f->string() == kConfigFormat, "{}: format is not \"{}\"", doc.context(),
          kConfigFormat);
  ConfigFile out;
  if (const auto f = doc.find("model")) {
    if (f->value().is_string()) {
      out.model_spec = f->string();
      out.model = load_training_model(out.model_spec, base);
    } else {
      f->expect(f->is_object(), "a preset name, a .json file name or a config.json object");
      std::string name = "model";
      if (const auto n = f->find("_name_or_path")) name = n->string();
      out.model = model_from_json(f->value(), name);
    }
  }
  if (const auto f = doc.find("cluster")) {
    if (f->value().is_string()) {
      out.cluster_spec = f->string();
      out.cluster = load_cluster(out.cluster_spec, base);
    } else {
      out.cluster = cluster_from_json(f->value());
    }
  }
  if (const auto f = doc.find("devices")) out.devices = f->integer(1, std::int64_t(1) << 24);
  if (const auto f = doc.find("seq")) out.seq = f->integer(1, std::int64_t(1) << 24);
  if (const auto f = doc.find("global_batch")) out.global_batch = f->integer(1, std::int64_t(1) << 24);
  if (const auto f = doc.find("flops")) {
    const std::string& x = f->string();
    check(x == "causal" || x == "full", "{}: flops = \"{}\"; expected causal or full", doc.context(), printable(x));
    out.flops = x == "causal" ? FlopConvention::causal : FlopConvention::full;
  }
  if (const auto f = doc.find("flash_attention")) out.flash_attention = f->boolean();
  if (const auto f = doc.find("overlap_grad_reduce")) out.overlap_grad_reduce = f->boolean();
  if (const auto f = doc.find("cp_gathers_weights")) out.cp_gathers_weights = f->boolean();
  if (const auto f = doc.find("zero3_prefetch")) out.zero3_prefetch = f->boolean();
  if (const auto f = doc.find("trainer")) {
    const std::string& x = f->string();
    check(x == "megatron" || x == "train_gpt", "{}: trainer = \"{}\"; expected megatron or train_gpt", doc.context(),
          printable(x));
    out.trainer = x == "megatron" ? Trainer::megatron : Trainer::train_gpt;
  }
  out.config = config_from_json(doc);
  if (out.devices)
    check(*out.devices == out.config.devices(), "{}: devices = {} but dp*pp*cp*tp_x*tp_y = {}", doc.context(),
          *out.devices, out.config.devices());
  if (const auto f = doc.find("published")) {
    cost::detail::only_keys(*f, {"tflops_per_gpu", "counting", "source"});
    PublishedThroughput p;
    p.tflops_per_gpu = (*f)["tflops_per_gpu"].number();
    check(p.tflops_per_gpu > 0 && p.tflops_per_gpu < 1e6, "{}: published.tflops_per_gpu = {} must be in (0, 1e6)",
          doc.context(), p.tflops_per_gpu);
    if (const auto c = f->find("counting")) {
      const std::string& x = c->string();
      check(x == "megatron" || x == "model", "{}: published.counting = \"{}\"; expected megatron or model",
            doc.context(), printable(x));
      p.counting = x == "megatron" ? FlopCounting::megatron : FlopCounting::model;
    }
    if (const auto s = f->find("source")) p.source = s->string();
    out.published = p;
  }
  return out;
}

inline ConfigFile load_config_file(const std::string& path) {
  return config_file_from_json(json::load_file(path), fmt::format("config {}", path),
                               std::filesystem::path(path).parent_path());
}

// The file of a configuration of `model` on `cluster` (each written by name when `*_spec` names a preset or a
// file, else inline) with the setup it runs under.
inline json::Value config_file_to_json(const ParallelConfig& c, const TrainingModel& model,
                                       const std::string& model_spec, const ClusterProfile& cluster,
                                       const std::string& cluster_spec, const TrainingSetup& setup,
                                       const std::optional<PublishedThroughput>& published = std::nullopt) {
  json::Value v = {{"format", std::string(kConfigFormat)}};
  if (!model_spec.empty()) v["model"] = model_spec;
  else v["model"] = model_to_json(model);
  if (!cluster_spec.empty()) v["cluster"] = cluster_spec;
  else v["cluster"] = cluster_to_json(cluster);
  v["devices"] = c.devices();
  v["seq"] = setup.seq;
  v["global_batch"] = setup.global_batch;
  v["flops"] = std::string(name_of(setup.flops));
  v["flash_attention"] = setup.flash_attention;
  v["overlap_grad_reduce"] = setup.overlap_grad_reduce;
  v["cp_gathers_weights"] = setup.cp_gathers_weights;
  v["zero3_prefetch"] = setup.zero3_prefetch;
  v["trainer"] = std::string(name_of(setup.trainer));
  add_config(v, c);
  if (published) {
    json::Value p = {{"tflops_per_gpu", published->tflops_per_gpu},
                     {"counting", std::string(name_of(published->counting))}};
    if (!published->source.empty()) p["source"] = published->source;
    v["published"] = std::move(p);
  }
  return v;
}

// The setup a file runs under: `base` (the command line's) with what the file fixes.
inline TrainingSetup setup_of(const ConfigFile& f, TrainingSetup base) {
  if (f.seq) base.seq = *f.seq;
  if (f.global_batch) base.global_batch = *f.global_batch;
  if (f.flops) base.flops = *f.flops;
  if (f.flash_attention) base.flash_attention = *f.flash_attention;
  if (f.overlap_grad_reduce) base.overlap_grad_reduce = *f.overlap_grad_reduce;
  if (f.cp_gathers_weights) base.cp_gathers_weights = *f.cp_gathers_weights;
  if (f.zero3_prefetch) base.zero3_prefetch = *f.zero3_prefetch;
  if (f.trainer) base.trainer = *f.trainer;
  return base;
}

}  // namespace paradyse::search
