// paradyse/cost/profile_json.hpp: hardware profiles (cost/profile.hpp) to and from JSON (core/json.hpp):
// to_json, profile_from_json, save_profile, load_profile.
//
//   {"format": "paradyse.hardware_profile/1", "name", "description", "source", "devices_per_node", "memory_bytes",
//    "reserved_bytes", "gemm": {...}, "attention": {...}, "elementwise_bytes_per_s", "activation_elements_per_s",
//    "overlap", "intra_node": {...}, "inter_node": {...}, "collectives": [...], ["gemm_engines": [...]]}
//
// Reading names every bad field by its full path (gemm.flops_per_s, collectives[2].alpha_s) and refuses missing or
// mistyped fields, non-finite numbers, negative times and rates that are not positive.
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/json.hpp"
#include "paradyse/core/printable.hpp"
#include "paradyse/cost/profile.hpp"

#include <fmt/format.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>

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
inline std::int64_t integer(const json::Field& object, std::string_view key, std::int64_t min, std::int64_t max) {
  const double x = number(object, key);
  check(std::floor(x) == x && x >= double(min) && x <= double(max),
        "profile: \"{}\" = {} must be an integer in [{}, {}] ({})", key, x, min, max, object[key].path());
  return std::int64_t(x);
}
inline const std::string& text(const json::Field& object, std::string_view key) { return object[key].string(); }

inline json::Value link_to_json(const LinkModel& l) {
  return {{"launch_s", l.launch_s},
          {"step_latency_s", l.step_latency_s},
          {"bus_bytes_per_s", l.bus_bytes_per_s},
          {"p2p_bytes_per_s", l.p2p_bytes_per_s}};
}
inline LinkModel link_from_json(const json::Field& v) {
  return {non_negative(v, "launch_s"), non_negative(v, "step_latency_s"), positive(v, "bus_bytes_per_s"),
          positive(v, "p2p_bytes_per_s")};
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
  v["attention"] = {{"overhead_s", p.attention.overhead_s},
                    {"forward_flops_per_s", p.attention.forward_flops_per_s},
                    {"backward_flops_per_s", p.attention.backward_flops_per_s}};
  v["elementwise_bytes_per_s"] = p.elementwise_bytes_per_s;
  v["activation_elements_per_s"] = p.activation_elements_per_s;
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
  return v;
}

// Throws Error naming the field for a missing or mistyped one, a non-finite number, a negative time or a rate that
// is not positive.
inline HardwareProfile profile_from_json(const json::Field& v) {
  using namespace detail;
  v.expect(v.is_object(), "a JSON object");
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
  p.gemm = {non_negative(gemm, "overhead_s"), positive(gemm, "flops_per_s"), non_negative(gemm, "bytes_per_s")};
  const json::Field attention = v["attention"];
  p.attention = {non_negative(attention, "overhead_s"), positive(attention, "forward_flops_per_s"),
                 positive(attention, "backward_flops_per_s")};
  p.elementwise_bytes_per_s = positive(v, "elementwise_bytes_per_s");
  if (v.has("activation_elements_per_s")) p.activation_elements_per_s = non_negative(v, "activation_elements_per_s");
  p.overlap = number(v, "overlap");
  check(p.overlap >= 0 && p.overlap <= 1, "profile: overlap = {} must be in [0, 1]", p.overlap);
  p.intra_node = link_from_json(v["intra_node"]);
  p.inter_node = link_from_json(v["inter_node"]);
  for (const json::Field& entry : v["collectives"].elements()) {
    CollectiveCost c;
    c.op = enum_from_name(text(entry, "op"), kAllCollectives, "collective");
    c.level = enum_from_name(text(entry, "level"), std::array{LinkLevel::intra_node, LinkLevel::inter_node},
                             "link level");
    c.group_size = int(integer(entry, "group_size", 2, 1 << 20));
    c.cost = {non_negative(entry, "alpha_s"), non_negative(entry, "beta_s_per_byte")};
    if (entry.has("min_bytes")) c.min_bytes = integer(entry, "min_bytes", 0, kMaxBytes);
    p.collectives.push_back(c);
  }
  if (const auto engines = v.find("gemm_engines")) {
    for (const json::Field& entry : engines->elements()) {
      const std::string& where = entry.path();
      GemmEngineChoice c;
      c.size_class = text(entry, "size_class");
      check(c.size_class == "small" || c.size_class == "medium" || c.size_class == "large",
            "profile: {}.size_class = \"{}\", expected small, medium or large", where, printable(c.size_class));
      c.engine = text(entry, "engine");
      check(c.engine == "cblas" || c.engine == "fallback", "profile: {}.engine = \"{}\", expected cblas or fallback",
            where, printable(c.engine));
      c.cblas_flops_per_s = non_negative(entry, "cblas_flops_per_s");
      c.fallback_flops_per_s = non_negative(entry, "fallback_flops_per_s");
      check((c.engine == "cblas" ? c.cblas_flops_per_s : c.fallback_flops_per_s) > 0,
            "profile: {} chose {} but gives it no rate", where, c.engine);
      p.gemm_engines.push_back(c);
    }
  }
  return p;
}
inline HardwareProfile profile_from_json(const json::Value& value) { return profile_from_json(json::Field(value, "profile")); }

inline void save_profile(const HardwareProfile& p, const std::string& path) { json::save_file(to_json(p), path); }
inline HardwareProfile load_profile(const std::string& path) { return profile_from_json(json::load_file(path)); }

}  // namespace paradyse::cost
