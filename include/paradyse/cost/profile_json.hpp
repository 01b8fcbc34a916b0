// paradyse/cost/profile_json.hpp: hardware profiles (cost/profile.hpp) to and from JSON (core/json.hpp):
// to_json, profile_from_json, save_profile, load_profile.
//
//   {"format": "paradyse.hardware_profile/1", "name", "description", "source", "devices_per_node", "memory_bytes",
//    "reserved_bytes", "gemm": {..., ["by_rows": [...]], ["thin": {"max_side", "overhead_s", "flops_per_s",
//    "bytes_per_s", ["timed": {as measured}]}],
//    ["measured": {"dtype_bytes", "shapes": [{"n", "k", "rows", "seconds"}, ...], ["cycle_bytes"],
//    ["call_overhead_s"]}], ["reuse": [{as measured, with cycle_bytes}, ...]], ["grouped_item_s"]},
//    "attention": {"overhead_s", "forward_flops_per_s", "backward_flops_per_s", ["backward_overhead_s"]},
//    ["attention_whole_tiles"], "elementwise_bytes_per_s", "activation_elements_per_s",
//    ["swiglu_forward_elements_per_s"], "overlap", "intra_node": {...},
//    "inter_node": {...}, "collectives": [...],
//    ["gemm_engines": [...]], ["fresh_memory": {"zero_bytes_per_s", "fresh_bytes_per_s", "fresh_min_bytes"}],
//    ["scalar_math": {"exp_per_s", "sincos_per_s", ["softmax_scores_per_s"]}],
//    ["elementwise_classes": [{"max_bytes", "bytes_per_s"}, ...]],
//    ["elementwise_families": [{"family", "overhead_s", "bytes_per_s"}, ...]],
//    ["memory_copy_bytes_per_s"],
//    ["pool_miss_bytes_per_s"], ["paged_attention": {"visits_per_s", "flops_per_s"}],
//    ["latent_attention": {"visits_per_s", "flops_per_s", "shared_per_s"}],
//    ["call_overhead": {"kernel_call_s"}], ["planning_events_per_s"], ["serving_host": {"step_s", "chunk_s"}],
//    ["step_jitter": [ascending positive factors]], ["rank_jitter": relative spread in [0, 1)],
//    ["probe_baseline" (or its older name "serving_probe_baseline"): a positive factor]}
//
// The bracketed keys are optional: a profile written before they existed loads with their terms as then (no GEMM size
// classes: the single fit; fresh memory and scalar math unpriced, rates 0: cost/profile.hpp's FreshMemoryModel and
// ScalarMathModel; no elementwise classes: elementwise_bytes_per_s for every size (and for copies from memory); the
// pool's misses and the fixed cost per kernel call and the serving engine's host work unpriced; attention priced on its
// visible pairs, not its whole tiles, its backward calls at the forward's overhead), and they are written only when
// set.
//
// Reading names every bad field by its full path (gemm.flops_per_s, collectives[2].alpha_s) and refuses missing or
// mistyped fields, unknown and repeated keys, non-finite numbers, times outside [0, 1] s and rates outside [1, 1e30]
// per second (with the key, the value and the range).
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/json.hpp"
#include "paradyse/core/printable.hpp"
#include "paradyse/cost/builtin_profiles.hpp"
#include "paradyse/cost/profile.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace paradyse::cost {

// ---- JSON ---------------------------------------------------------------------------------------------------------

namespace detail {

template <class Enum, std::size_t N>
Enum enum_from_name(std::string_view name, const std::array<Enum, N>& all, std::string_view what) {
  for (Enum e : all)
    if (name_of(e) == name) return e;
  std::string known;
  for (Enum e : all) known += fmt::format("{}{}", known.empty() ? "" : ", ", name_of(e));
  throw Error(fmt::format("profile: unknown {} \"{}\", expected one of {}", what, printable(name), known));
}

// Reading fields (json::Field): every message names the field by its full path (gemm.flops_per_s,
// collectives[2].alpha_s), and every number must be finite (a JSON 1e999 does not even parse; this also guards
// values built in code).
inline double number(const json::Field& object, std::string_view key) {
  const json::Field v = object[key];
  v.expect(v.value().is_number(), "a number");
  const double x = v.value().get<double>();
  check(std::isfinite(x), "profile: \"{}\" = {} must be a finite number ({})", key, x, v.path());
  return x;
}
inline double positive(const json::Field& object, std::string_view key) {
  const double x = number(object, key);
  check(x > 0, "profile: \"{}\" = {} must be positive ({})", key, x, object[key].path());
  return x;
}
inline double non_negative(const json::Field& object, std::string_view key) {
  const double x = number(object, key);
  check(x >= 0, "profile: \"{}\" = {} must not be negative ({})", key, x, object[key].path());
  return x;
}
// Rates (FLOP/s, bytes/s, elements/s) in [1, 1e30] per second and times (overheads, latencies) in [0, 1] s: a rate
// of 1e-300 or a time of 1e300 makes every prediction infinite (MFU inf%), a rate of 1e300 makes it 0 (0 / 0 =
// nan); no device or link is near these bounds (1e30 is calibration's stand-in for a term it could not measure,
// cost/calibrate.hpp).
inline constexpr double kMinRate = 1, kMaxRate = 1e30, kMaxSeconds = 1;
inline double in_range(const json::Field& object, std::string_view key, double x, double min, double max,
                       std::string_view unit) {
  check(x >= min && x <= max, "profile: \"{}\" = {} is outside the accepted range [{}, {}] {} ({})", key, x, min, max,
        unit, object[key].path());
  return x;
}
// A rate: positive and in [kMinRate, kMaxRate]; with `zero_allowed`, 0 also (the term is unused).
inline double rate(const json::Field& object, std::string_view key, bool zero_allowed = false) {
  const double x = zero_allowed ? non_negative(object, key) : positive(object, key);
  return zero_allowed && x == 0 ? 0 : in_range(object, key, x, kMinRate, kMaxRate, "per second");
}
// A time in [0, kMaxSeconds].
inline double seconds(const json::Field& object, std::string_view key) {
  return in_range(object, key, non_negative(object, key), 0, kMaxSeconds, "seconds");
}
inline std::int64_t integer(const json::Field& object, std::string_view key, std::int64_t min, std::int64_t max) {
  const double x = number(object, key);
  check(std::floor(x) == x && x >= double(min) && x <= double(max),
        "profile: \"{}\" = {} must be an integer in [{}, {}] ({})", key, x, min, max, object[key].path());
  return std::int64_t(x);
}
inline const std::string& text(const json::Field& object, std::string_view key) { return object[key].string(); }

// Refuses a key of `object` that is not in `known`, or that appears twice (the parser keeps a repeated key and
// every reader sees only its first value), naming the key, where it is and the keys expected.
inline void only_keys(const json::Field& object, std::span<const std::string_view> known) {
  object.expect(object.is_object(), "a JSON object");
  std::vector<std::string_view> seen;
  for (const auto& [key, member] : object.value().items()) {
    const std::string_view k = key;
    const std::string where = object.path().empty() ? std::string(k) : fmt::format("{}.{}", object.path(), k);
    if (std::find(seen.begin(), seen.end(), k) != seen.end())
      object.fail(fmt::format("duplicate key \"{}\" ({}): each key may appear once", printable(k), printable(where)));
    seen.push_back(k);
    if (std::find(known.begin(), known.end(), k) == known.end()) {
      std::string expected;
      for (std::string_view x : known) expected += fmt::format("{}{}", expected.empty() ? "" : ", ", x);
      object.fail(fmt::format("unknown key \"{}\" ({}); expected {}", printable(k), printable(where), expected));
    }
  }
}
inline void only_keys(const json::Field& object, std::initializer_list<std::string_view> known) {
  only_keys(object, std::span<const std::string_view>(known.begin(), known.size()));
}

inline json::Value link_to_json(const LinkModel& l) {
  return {{"launch_s", l.launch_s},
          {"step_latency_s", l.step_latency_s},
          {"bus_bytes_per_s", l.bus_bytes_per_s},
          {"p2p_bytes_per_s", l.p2p_bytes_per_s}};
}
inline LinkModel link_from_json(const json::Field& v) {
  only_keys(v, {"launch_s", "step_latency_s", "bus_bytes_per_s", "p2p_bytes_per_s"});
  return {seconds(v, "launch_s"), seconds(v, "step_latency_s"), rate(v, "bus_bytes_per_s"),
          rate(v, "p2p_bytes_per_s")};
}

// gemm.by_rows (GemmModel's size classes): [{"max_rows", "overhead_s", "flops_per_s", "bytes_per_s", "outputs_per_s"},
// ...], max_rows whole and strictly ascending. Absent in profiles written before the classes: the single fit alone, as then.
inline json::Value gemm_classes_to_json(const std::vector<GemmRowClass>& classes) {
  json::Value list = json::Value::array();
  for (const GemmRowClass& c : classes)
    list.push_back({{"max_rows", c.max_rows},
                    {"overhead_s", c.overhead_s},
                    {"flops_per_s", c.flops_per_s},
                    {"bytes_per_s", c.bytes_per_s},
                    {"outputs_per_s", c.outputs_per_s}});
  return list;
}
inline std::vector<GemmRowClass> gemm_classes_from_json(const json::Field& list) {
  std::vector<GemmRowClass> classes;
  for (const json::Field& entry : list.elements()) {
    only_keys(entry, {"max_rows", "overhead_s", "flops_per_s", "bytes_per_s", "outputs_per_s"});
    GemmRowClass c;
    c.max_rows = double(integer(entry, "max_rows", 1, std::int64_t(1) << 40));
    check(classes.empty() || c.max_rows > classes.back().max_rows,
          "profile: {}.max_rows = {} must be above the previous class's {} (classes ascending)", entry.path(),
          c.max_rows, classes.empty() ? 0.0 : classes.back().max_rows);
    c.overhead_s = seconds(entry, "overhead_s");
    c.flops_per_s = rate(entry, "flops_per_s");
    c.bytes_per_s = rate(entry, "bytes_per_s", true);
    c.outputs_per_s = rate(entry, "outputs_per_s", true);
    classes.push_back(c);
  }
  return classes;
}

// gemm.measured (GemmModel::measured, a workload's shapes as measured): {"dtype_bytes", "shapes": [{"n", "k", "rows",
// "seconds"}, ...], ["cycle_bytes"], ["call_overhead_s"]}, rows whole and strictly ascending, as many times as rows,
// each (n, k) once; cycle_bytes absent: not recorded; call_overhead_s absent: 0. Absent: none. gemm.reuse
// (GemmModel::reuse): a list of such tables, each with its cycle_bytes, strictly ascending in them.
inline json::Value gemm_measured_to_json(const GemmMeasured& measured) {
  json::Value shapes = json::Value::array();
  for (const GemmMeasuredShape& s : measured.shapes)
    shapes.push_back({{"n", s.n}, {"k", s.k}, {"rows", s.rows}, {"seconds", s.seconds}});
  json::Value out = {{"dtype_bytes", measured.dtype_bytes}, {"shapes", std::move(shapes)}};
  if (measured.cycle_bytes > 0) out["cycle_bytes"] = measured.cycle_bytes;
  if (measured.call_overhead_s > 0) out["call_overhead_s"] = measured.call_overhead_s;
  return out;
}
inline GemmMeasured gemm_measured_from_json(const json::Field& v) {
  only_keys(v, {"dtype_bytes", "shapes", "cycle_bytes", "call_overhead_s"});
  GemmMeasured out{int(integer(v, "dtype_bytes", 1, 8)), {}};
  if (v.find("cycle_bytes")) out.cycle_bytes = double(integer(v, "cycle_bytes", 1, std::int64_t(1) << 53));
  if (v.find("call_overhead_s")) out.call_overhead_s = seconds(v, "call_overhead_s");
  for (const json::Field& entry : v["shapes"].elements()) {
    only_keys(entry, {"n", "k", "rows", "seconds"});
    GemmMeasuredShape s{double(integer(entry, "n", 1, std::int64_t(1) << 40)),
                        double(integer(entry, "k", 1, std::int64_t(1) << 40)), {}, {}};
    for (const GemmMeasuredShape& before : out.shapes)
      check(before.n != s.n || before.k != s.k, "profile: {} repeats the shape n = {}, k = {} (each shape once)",
            entry.path(), s.n, s.k);
    for (const json::Field& row : entry["rows"].elements()) {
      const double m = row.number();
      check(m >= 1 && std::floor(m) == m && (s.rows.empty() || m > s.rows.back()),
            "profile: {} = {} must be a whole row count from 1, above the row before (ascending)", row.path(), m);
      s.rows.push_back(m);
    }
    for (const json::Field& t : entry["seconds"].elements()) {
      const double x = t.number();
      check(x > 0 && x <= kMaxSeconds, "profile: {} = {} must be a time in (0, {}] seconds", t.path(), x, kMaxSeconds);
      s.seconds.push_back(x);
    }
    check(!s.rows.empty() && s.seconds.size() == s.rows.size(),
          "profile: {} has {} rows and {} seconds; expected at least one row and a time for each", entry.path(),
          s.rows.size(), s.seconds.size());
    out.shapes.push_back(std::move(s));
  }
  return out;
}
inline std::vector<GemmMeasured> gemm_reuse_from_json(const json::Field& v) {
  std::vector<GemmMeasured> out;
  for (const json::Field& table : v.elements()) {
    out.push_back(gemm_measured_from_json(table));
    check(out.back().cycle_bytes > 0 && (out.size() == 1 || out.back().cycle_bytes > out[out.size() - 2].cycle_bytes),
          "profile: {} needs a cycle_bytes, positive and above the table's before it (ascending); got {}", table.path(),
          out.back().cycle_bytes);
  }
  return out;
}

// fresh_memory and scalar_math (cost/profile.hpp's FreshMemoryModel, ScalarMathModel): absent, unpriced.
inline json::Value fresh_memory_to_json(const FreshMemoryModel& f) {
  return {{"zero_bytes_per_s", f.zero_bytes_per_s},
          {"fresh_bytes_per_s", f.fresh_bytes_per_s},
          {"fresh_min_bytes", f.fresh_min_bytes}};
}
inline FreshMemoryModel fresh_memory_from_json(const json::Field& v) {
  only_keys(v, {"zero_bytes_per_s", "fresh_bytes_per_s", "fresh_min_bytes"});
  return {rate(v, "zero_bytes_per_s", true), rate(v, "fresh_bytes_per_s", true),
          integer(v, "fresh_min_bytes", 0, std::int64_t(1) << 53)};
}
// scalar_math's softmax_scores_per_s: absent, 0 (profiles written before it).
inline json::Value scalar_math_to_json(const ScalarMathModel& m) {
  json::Value v = {{"exp_per_s", m.exp_per_s}, {"sincos_per_s", m.sincos_per_s}};
  if (m.softmax_scores_per_s > 0) v["softmax_scores_per_s"] = m.softmax_scores_per_s;
  return v;
}
inline ScalarMathModel scalar_math_from_json(const json::Field& v) {
  only_keys(v, {"exp_per_s", "sincos_per_s", "softmax_scores_per_s"});
  return {rate(v, "exp_per_s", true), rate(v, "sincos_per_s", true),
          v.has("softmax_scores_per_s") ? rate(v, "softmax_scores_per_s", true) : 0.0};
}

// elementwise_classes (cost/profile.hpp's ElementwiseClass): [{"max_bytes", "bytes_per_s"}, ...], max_bytes whole and
// strictly ascending.
inline json::Value elementwise_classes_to_json(const std::vector<ElementwiseClass>& classes) {
  json::Value list = json::Value::array();
  for (const ElementwiseClass& c : classes) list.push_back({{"max_bytes", c.max_bytes}, {"bytes_per_s", c.bytes_per_s}});
  return list;
}
inline std::vector<ElementwiseClass> elementwise_classes_from_json(const json::Field& list) {
  std::vector<ElementwiseClass> classes;
  for (const json::Field& entry : list.elements()) {
    only_keys(entry, {"max_bytes", "bytes_per_s"});
    ElementwiseClass c;
    c.max_bytes = double(integer(entry, "max_bytes", 1, std::int64_t(1) << 53));
    check(classes.empty() || c.max_bytes > classes.back().max_bytes,
          "profile: {}.max_bytes = {} must be above the previous class's {} (classes ascending)", entry.path(),
          c.max_bytes, classes.empty() ? 0.0 : classes.back().max_bytes);
    c.bytes_per_s = rate(entry, "bytes_per_s");
    classes.push_back(c);
  }
  return classes;
}

// paged_attention (cost/profile.hpp's PagedAttentionModel): absent, not calibrated (priced as flash attention).
inline json::Value paged_attention_to_json(const PagedAttentionModel& m) {
  return {{"visits_per_s", m.visits_per_s}, {"flops_per_s", m.flops_per_s}};
}
inline PagedAttentionModel paged_attention_from_json(const json::Field& v) {
  only_keys(v, {"visits_per_s", "flops_per_s"});
  return {rate(v, "visits_per_s", true), rate(v, "flops_per_s", true)};
}
// latent_attention (LatentAttentionModel): absent, not calibrated (priced as the paged kernel).
inline json::Value latent_attention_to_json(const LatentAttentionModel& m) {
  return {{"visits_per_s", m.visits_per_s}, {"flops_per_s", m.flops_per_s}, {"shared_per_s", m.shared_per_s}};
}
inline LatentAttentionModel latent_attention_from_json(const json::Field& v) {
  only_keys(v, {"visits_per_s", "flops_per_s", "shared_per_s"});
  return {rate(v, "visits_per_s", true), rate(v, "flops_per_s", true), rate(v, "shared_per_s", true)};
}
// elementwise_families (cost/profile.hpp's ElementwiseFamilyRate): [{"family", "overhead_s", "bytes_per_s"}, ...], the
// calibrated families only, each once, by name (core/trace.hpp's ElementwiseFamily; "other" is the classes').
inline constexpr std::array<ElementwiseFamily, kElementwiseFamilies - 1> kRatedFamilies = {
    ElementwiseFamily::copy, ElementwiseFamily::fill,       ElementwiseFamily::add,       ElementwiseFamily::norm,
    ElementwiseFamily::rope, ElementwiseFamily::softmax,    ElementwiseFamily::activation, ElementwiseFamily::optimizer,
    ElementwiseFamily::rows};
inline json::Value elementwise_families_to_json(const std::array<ElementwiseFamilyRate, kElementwiseFamilies>& rates) {
  json::Value list = json::Value::array();
  for (const ElementwiseFamily f : kRatedFamilies) {
    const ElementwiseFamilyRate& r = rates[std::size_t(f)];
    if (r.calibrated())
      list.push_back({{"family", std::string(name_of(f))}, {"overhead_s", r.overhead_s}, {"bytes_per_s", r.bytes_per_s}});
  }
  return list;
}
inline std::array<ElementwiseFamilyRate, kElementwiseFamilies> elementwise_families_from_json(const json::Field& list) {
  std::array<ElementwiseFamilyRate, kElementwiseFamilies> rates{};
  for (const json::Field& entry : list.elements()) {
    only_keys(entry, {"family", "overhead_s", "bytes_per_s"});
    const ElementwiseFamily f = enum_from_name(text(entry, "family"), kRatedFamilies, "elementwise family");
    ElementwiseFamilyRate& r = rates[std::size_t(f)];
    check(!r.calibrated(), "profile: {}.family \"{}\" appears twice", entry.path(), name_of(f));
    r.overhead_s = seconds(entry, "overhead_s");
    r.bytes_per_s = rate(entry, "bytes_per_s");
  }
  return rates;
}

inline json::Value call_overhead_to_json(const CallOverheadModel& m) {
  return {{"kernel_call_s", m.kernel_call_s}};
}
inline CallOverheadModel call_overhead_from_json(const json::Field& v) {
  only_keys(v, {"kernel_call_s"});
  return {seconds(v, "kernel_call_s")};
}
inline json::Value serving_host_to_json(const ServingHostModel& m) { return {{"step_s", m.step_s}, {"chunk_s", m.chunk_s}}; }
inline ServingHostModel serving_host_from_json(const json::Field& v) {
  only_keys(v, {"step_s", "chunk_s"});
  return {seconds(v, "step_s"), seconds(v, "chunk_s")};
}

}  // namespace detail

inline json::Value to_json(const HardwareProfile& p) {
  json::Value v = {{"format", "paradyse.hardware_profile/1"},
                   {"name", p.name},
                   {"description", p.description},
                   {"source", p.source},
                   {"devices_per_node", p.devices_per_node},
                   {"memory_bytes", p.memory_bytes},
                   {"reserved_bytes", p.reserved_bytes}};
  v["gemm"] = {{"overhead_s", p.gemm.overhead_s},
               {"flops_per_s", p.gemm.flops_per_s},
               {"bytes_per_s", p.gemm.bytes_per_s}};
  if (!p.gemm.by_rows.empty()) v["gemm"]["by_rows"] = detail::gemm_classes_to_json(p.gemm.by_rows);
  if (!p.gemm.measured.shapes.empty()) v["gemm"]["measured"] = detail::gemm_measured_to_json(p.gemm.measured);
  if (!p.gemm.reuse.empty()) {
    v["gemm"]["reuse"] = json::Value::array();
    for (const GemmMeasured& table : p.gemm.reuse) v["gemm"]["reuse"].push_back(detail::gemm_measured_to_json(table));
  }
  if (p.gemm.thin.max_side > 0)
    v["gemm"]["thin"] = {{"max_side", p.gemm.thin.max_side},
                         {"overhead_s", p.gemm.thin.overhead_s},
                         {"flops_per_s", p.gemm.thin.flops_per_s},
                         {"bytes_per_s", p.gemm.thin.bytes_per_s}};
  if (!p.gemm.thin.timed.shapes.empty()) v["gemm"]["thin"]["timed"] = detail::gemm_measured_to_json(p.gemm.thin.timed);
  if (p.gemm.grouped_item_s) v["gemm"]["grouped_item_s"] = *p.gemm.grouped_item_s;
  v["attention"] = {{"overhead_s", p.attention.overhead_s},
                    {"forward_flops_per_s", p.attention.forward_flops_per_s},
                    {"backward_flops_per_s", p.attention.backward_flops_per_s}};
  if (p.attention.backward_overhead_s) v["attention"]["backward_overhead_s"] = *p.attention.backward_overhead_s;
  if (p.attention.whole_tiles) v["attention_whole_tiles"] = true;
  v["elementwise_bytes_per_s"] = p.elementwise_bytes_per_s;
  v["activation_elements_per_s"] = p.activation_elements_per_s;
  if (p.swiglu_forward_elements_per_s > 0) v["swiglu_forward_elements_per_s"] = p.swiglu_forward_elements_per_s;  // absent: GELU's rate
  v["overlap"] = p.overlap;
  v["intra_node"] = detail::link_to_json(p.intra_node);
  v["inter_node"] = detail::link_to_json(p.inter_node);
  json::Value table = json::Value::array();
  for (const CollectiveCost& c : p.collectives) {
    json::Value entry = {{"op", name_of(c.op)},
                         {"level", name_of(c.level)},
                         {"group_size", c.group_size},
                         {"alpha_s", c.cost.alpha_s},
                         {"beta_s_per_byte", c.cost.beta_s_per_byte}};
    if (c.min_bytes > 0) entry["min_bytes"] = c.min_bytes;
    table.push_back(std::move(entry));
  }
  v["collectives"] = std::move(table);
  if (!p.gemm_engines.empty()) {
    json::Value engines = json::Value::array();
    for (const GemmEngineChoice& c : p.gemm_engines)
      engines.push_back({{"size_class", c.size_class},
                         {"engine", c.engine},
                         {"cblas_flops_per_s", c.cblas_flops_per_s},
                         {"fallback_flops_per_s", c.fallback_flops_per_s}});
    v["gemm_engines"] = std::move(engines);
  }
  if (p.fresh_memory != FreshMemoryModel{}) v["fresh_memory"] = detail::fresh_memory_to_json(p.fresh_memory);
  if (p.scalar_math != ScalarMathModel{}) v["scalar_math"] = detail::scalar_math_to_json(p.scalar_math);
  if (!p.elementwise_classes.empty())
    v["elementwise_classes"] = detail::elementwise_classes_to_json(p.elementwise_classes);
  if (p.elementwise_families != decltype(p.elementwise_families){})
    v["elementwise_families"] = detail::elementwise_families_to_json(p.elementwise_families);
  if (p.memory_copy_bytes_per_s > 0) v["memory_copy_bytes_per_s"] = p.memory_copy_bytes_per_s;
  if (p.pool_miss_bytes_per_s > 0) v["pool_miss_bytes_per_s"] = p.pool_miss_bytes_per_s;
  if (p.paged_attention.calibrated()) v["paged_attention"] = detail::paged_attention_to_json(p.paged_attention);
  if (p.latent_attention.calibrated()) v["latent_attention"] = detail::latent_attention_to_json(p.latent_attention);
  if (p.call_overhead != CallOverheadModel{}) v["call_overhead"] = detail::call_overhead_to_json(p.call_overhead);
  if (p.planning_events_per_s > 0) v["planning_events_per_s"] = p.planning_events_per_s;
  if (p.serving_host != ServingHostModel{}) v["serving_host"] = detail::serving_host_to_json(p.serving_host);
  if (!p.step_jitter.empty()) {
    json::Value jitter = json::Value::array();
    for (const double q : p.step_jitter) jitter.push_back(q);
    v["step_jitter"] = std::move(jitter);
  }
  if (p.rank_jitter > 0) v["rank_jitter"] = p.rank_jitter;
  if (p.probe_baseline > 0) v["probe_baseline"] = p.probe_baseline;
  return v;
}

// Throws Error naming the field for a missing, mistyped, unknown or repeated one, a non-finite number, a time
// outside [0, 1] s or a rate outside [1, 1e30] per second.
inline HardwareProfile profile_from_json(const json::Field& v) {
  using namespace detail;
  v.expect(v.is_object(), "a JSON object");
  only_keys(v, {"format", "name", "description", "source", "devices_per_node", "memory_bytes", "reserved_bytes", "gemm",
                "attention", "attention_whole_tiles", "elementwise_bytes_per_s", "activation_elements_per_s",
                "swiglu_forward_elements_per_s", "overlap", "intra_node", "inter_node", "collectives", "gemm_engines",
                "fresh_memory", "scalar_math", "elementwise_classes", "elementwise_families", "memory_copy_bytes_per_s",
                "pool_miss_bytes_per_s", "paged_attention", "latent_attention", "call_overhead",
                "planning_events_per_s", "serving_host", "step_jitter", "rank_jitter", "probe_baseline",
                "serving_probe_baseline"});
  if (const auto format = v.find("format"))
    check(format->value().is_string() && format->string() == "paradyse.hardware_profile/1",
          "profile: format \"{}\" is not \"paradyse.hardware_profile/1\"",
          format->value().is_string() ? printable(format->string()) : std::string(json::type_name(format->value())));
  HardwareProfile p;
  p.name = text(v, "name");
  if (v.has("description")) p.description = text(v, "description");
  if (v.has("source")) p.source = text(v, "source");
  p.devices_per_node = int(integer(v, "devices_per_node", 1, 1 << 20));
  constexpr std::int64_t kMaxBytes = std::int64_t(1) << 53;  // exact in a double
  p.memory_bytes = integer(v, "memory_bytes", 1, kMaxBytes);
  p.reserved_bytes = integer(v, "reserved_bytes", 0, kMaxBytes);
  check(p.reserved_bytes < p.memory_bytes,
        "profile: memory_bytes = {} must be positive and above reserved_bytes = {}", p.memory_bytes, p.reserved_bytes);
  const json::Field gemm = v["gemm"];
  only_keys(gemm,
            {"overhead_s", "flops_per_s", "bytes_per_s", "by_rows", "thin", "measured", "reuse", "grouped_item_s"});
  p.gemm = {seconds(gemm, "overhead_s"), rate(gemm, "flops_per_s"), rate(gemm, "bytes_per_s", true)};
  if (const auto classes = gemm.find("by_rows")) p.gemm.by_rows = gemm_classes_from_json(*classes);
  if (const auto measured = gemm.find("measured")) p.gemm.measured = gemm_measured_from_json(*measured);
  if (const auto reuse = gemm.find("reuse")) p.gemm.reuse = gemm_reuse_from_json(*reuse);
  if (const auto thin = gemm.find("thin")) {  // absent: no head-width class, as before it existed
    only_keys(*thin, {"max_side", "overhead_s", "flops_per_s", "bytes_per_s", "timed"});
    p.gemm.thin = {double(integer(*thin, "max_side", 1, std::int64_t(1) << 20)), seconds(*thin, "overhead_s"),
                   rate(*thin, "flops_per_s"), rate(*thin, "bytes_per_s", true)};
    if (const auto timed = thin->find("timed")) p.gemm.thin.timed = gemm_measured_from_json(*timed);
  }
  if (gemm.has("grouped_item_s")) p.gemm.grouped_item_s = seconds(gemm, "grouped_item_s");
  const json::Field attention = v["attention"];
  only_keys(attention, {"overhead_s", "forward_flops_per_s", "backward_flops_per_s", "backward_overhead_s"});
  p.attention = {seconds(attention, "overhead_s"), rate(attention, "forward_flops_per_s"),
                 rate(attention, "backward_flops_per_s")};
  if (attention.has("backward_overhead_s")) p.attention.backward_overhead_s = seconds(attention, "backward_overhead_s");
  if (v.has("attention_whole_tiles")) p.attention.whole_tiles = v["attention_whole_tiles"].boolean();
  p.elementwise_bytes_per_s = rate(v, "elementwise_bytes_per_s");
  if (v.has("activation_elements_per_s")) p.activation_elements_per_s = rate(v, "activation_elements_per_s", true);
  if (v.has("swiglu_forward_elements_per_s")) p.swiglu_forward_elements_per_s = rate(v, "swiglu_forward_elements_per_s", true);
  p.overlap = number(v, "overlap");
  check(p.overlap >= 0 && p.overlap <= 1, "profile: overlap = {} must be in [0, 1]", p.overlap);
  p.intra_node = link_from_json(v["intra_node"]);
  p.inter_node = link_from_json(v["inter_node"]);
  for (const json::Field& entry : v["collectives"].elements()) {
    only_keys(entry, {"op", "level", "group_size", "alpha_s", "beta_s_per_byte", "min_bytes"});
    CollectiveCost c;
    c.op = enum_from_name(text(entry, "op"), kAllCollectives, "collective");
    c.level = enum_from_name(text(entry, "level"), std::array{LinkLevel::intra_node, LinkLevel::inter_node},
                             "link level");
    c.group_size = int(integer(entry, "group_size", 2, 1 << 20));
    c.cost = {seconds(entry, "alpha_s"),
              in_range(entry, "beta_s_per_byte", non_negative(entry, "beta_s_per_byte"), 0, 1 / kMinRate,
                       "seconds per byte")};
    if (entry.has("min_bytes")) c.min_bytes = integer(entry, "min_bytes", 0, kMaxBytes);
    p.collectives.push_back(c);
  }
  if (const auto engines = v.find("gemm_engines")) {
    for (const json::Field& entry : engines->elements()) {
      const std::string& where = entry.path();
      only_keys(entry, {"size_class", "engine", "cblas_flops_per_s", "fallback_flops_per_s"});
      GemmEngineChoice c;
      c.size_class = text(entry, "size_class");
      check(c.size_class == "small" || c.size_class == "medium" || c.size_class == "large",
            "profile: {}.size_class = \"{}\", expected small, medium or large", where, printable(c.size_class));
      c.engine = text(entry, "engine");
      check(c.engine == "cblas" || c.engine == "fallback", "profile: {}.engine = \"{}\", expected cblas or fallback",
            where, printable(c.engine));
      c.cblas_flops_per_s = rate(entry, "cblas_flops_per_s", true);
      c.fallback_flops_per_s = rate(entry, "fallback_flops_per_s", true);
      check((c.engine == "cblas" ? c.cblas_flops_per_s : c.fallback_flops_per_s) > 0,
            "profile: {} chose {} but gives it no rate", where, c.engine);
      p.gemm_engines.push_back(c);
    }
  }
  if (const auto fresh = v.find("fresh_memory")) p.fresh_memory = fresh_memory_from_json(*fresh);
  if (const auto math = v.find("scalar_math")) p.scalar_math = scalar_math_from_json(*math);
  if (const auto classes = v.find("elementwise_classes")) p.elementwise_classes = elementwise_classes_from_json(*classes);
  if (const auto families = v.find("elementwise_families"))
    p.elementwise_families = elementwise_families_from_json(*families);
  if (v.has("memory_copy_bytes_per_s")) p.memory_copy_bytes_per_s = rate(v, "memory_copy_bytes_per_s", true);
  if (v.has("pool_miss_bytes_per_s")) p.pool_miss_bytes_per_s = rate(v, "pool_miss_bytes_per_s", true);
  if (const auto paged = v.find("paged_attention")) p.paged_attention = paged_attention_from_json(*paged);
  if (const auto latent = v.find("latent_attention")) p.latent_attention = latent_attention_from_json(*latent);
  if (const auto calls = v.find("call_overhead")) p.call_overhead = call_overhead_from_json(*calls);
  if (v.has("planning_events_per_s")) p.planning_events_per_s = rate(v, "planning_events_per_s", true);
  if (const auto host = v.find("serving_host")) p.serving_host = serving_host_from_json(*host);
  if (const auto jitter = v.find("step_jitter"))
    for (const json::Field& f : jitter->elements()) {
      const double q = f.number();
      check(q > 0 && q <= 100 && (p.step_jitter.empty() || q >= p.step_jitter.back()),
            "profile: {} = {} must be a factor in (0, 100], not below the one before (ascending)", f.path(), q);
      p.step_jitter.push_back(q);
    }
  if (v.has("rank_jitter")) {
    p.rank_jitter = number(v, "rank_jitter");
    check(p.rank_jitter >= 0 && p.rank_jitter < 1, "profile: \"rank_jitter\" = {} must be a relative spread in [0, 1) ({})",
          p.rank_jitter, v["rank_jitter"].path());
  }
  // "serving_probe_baseline": the key's name in profiles written before the trainer's probe took a baseline too.
  check(!(v.has("probe_baseline") && v.has("serving_probe_baseline")),
        "profile: \"probe_baseline\" and \"serving_probe_baseline\" (its older name) are both given ({}); keep one",
        v.path());
  for (const char* key : {"probe_baseline", "serving_probe_baseline"})
    if (v.has(key)) {
      p.probe_baseline = number(v, key);
      check(p.probe_baseline > 0 && p.probe_baseline <= 100, "profile: \"{}\" = {} must be a factor in (0, 100] ({})",
            key, p.probe_baseline, v[key].path());
    }
  return p;
}
inline HardwareProfile profile_from_json(const json::Value& value) { return profile_from_json(json::Field(value, "profile")); }

inline void save_profile(const HardwareProfile& p, const std::string& path) { json::save_file(to_json(p), path); }
// Errors name the file (and the field).
inline HardwareProfile load_profile(const std::string& path) {
  return profile_from_json(json::Field(json::load_file(path), fmt::format("profile \"{}\"", printable(path))));
}

// A profile a program is given by name: a .json file (load_profile), else a built-in one (builtin_profile: a100,
// h100, h200 or their full names), which says what it knows when the name is neither.
inline HardwareProfile named_profile(const std::string& name) {
  return name.find(".json") != std::string::npos ? load_profile(name) : builtin_profile(name);
}

}  // namespace paradyse::cost
