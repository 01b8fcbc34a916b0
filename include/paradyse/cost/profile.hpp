// paradyse/cost/profile.hpp: a hardware profile, the plain value the time and memory models read.
//
// A profile says, per device: its memory, how fast it runs GEMMs (with their dependence on size), attention and
// elementwise kernels, and per collective and group size an alpha-beta cost for each link level (inside a node,
// across nodes). Built-in profiles are in cost/builtin_profiles.hpp; `calibrate` (cost/calibrate.hpp) measures the
// machine at hand and fits one. Profiles load from and save to JSON.
//
// Collective sizes follow nccl-tests: `bytes` is the size of the whole array, i.e. the output of all_gather, the
// input of reduce_scatter, the buffer of all_reduce / broadcast / reduce, one rank's input of all_to_all and one
// message of send_recv (a ring shift: every rank sends one message and receives one).
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/json.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace paradyse::cost {

enum class Collective : std::uint8_t { all_gather, reduce_scatter, all_reduce, all_to_all, broadcast, reduce, send_recv };
inline constexpr std::array<Collective, 7> kAllCollectives{Collective::all_gather, Collective::reduce_scatter,
                                                           Collective::all_reduce, Collective::all_to_all,
                                                           Collective::broadcast,  Collective::reduce,
                                                           Collective::send_recv};

constexpr std::string_view name_of(Collective c) {
  switch (c) {
    case Collective::all_gather: return "all_gather";
    case Collective::reduce_scatter: return "reduce_scatter";
    case Collective::all_reduce: return "all_reduce";
    case Collective::all_to_all: return "all_to_all";
    case Collective::broadcast: return "broadcast";
    case Collective::reduce: return "reduce";
    case Collective::send_recv: return "send_recv";
  }
  return "?";
}

enum class LinkLevel : std::uint8_t { intra_node, inter_node };
constexpr std::string_view name_of(LinkLevel l) { return l == LinkLevel::intra_node ? "intra_node" : "inter_node"; }

// nccl-tests' bus-bandwidth factor: bytes each rank's busiest link carries per byte of `bytes` (a ring algorithm).
constexpr double bus_factor(Collective c, int p) {
  if (p <= 1) return 0;
  switch (c) {
    case Collective::all_gather:
    case Collective::reduce_scatter:
    case Collective::all_to_all: return double(p - 1) / p;
    case Collective::all_reduce: return 2.0 * (p - 1) / p;
    case Collective::broadcast:
    case Collective::reduce:
    case Collective::send_recv: return 1;
  }
  return 1;
}

// Latency-bound steps of the same ring algorithm.
constexpr int latency_steps(Collective c, int p) {
  if (p <= 1) return 0;
  switch (c) {
    case Collective::all_reduce: return 2 * (p - 1);
    case Collective::send_recv: return 1;
    default: return p - 1;
  }
}

// t = alpha + beta * bytes.
struct AlphaBeta {
  double alpha_s = 0;
  double beta_s_per_byte = 0;
  double time(double bytes) const { return alpha_s + beta_s_per_byte * bytes; }
};

// A measured (or datasheet-derived) cost of one collective on one group size and link level, for sizes from
// `min_bytes` up (several entries of one collective split its sizes into ranges: a calibrated CPU backend is faster
// while messages stay in cache).
struct CollectiveCost {
  Collective op = Collective::all_gather;
  LinkLevel level = LinkLevel::intra_node;
  int group_size = 2;
  AlphaBeta cost;
  std::int64_t min_bytes = 0;
};

// The default for a collective that has no entry: a ring over links of this latency and bus bandwidth.
struct LinkModel {
  double launch_s = 0;          // fixed cost of one collective call
  double step_latency_s = 0;    // per ring step
  double bus_bytes_per_s = 1;   // achieved bus bandwidth of ring collectives (nccl-tests busbw)
  double p2p_bytes_per_s = 1;   // achieved bandwidth of one send/recv pair, all ranks shifting at once
};

// GEMM time: t = overhead + flops / rate + operand bytes / bandwidth. The two roofline terms are added rather than
// maxed so that the form is linear in its coefficients (least squares fits it) and the achieved rate rises
// smoothly with size, as it does on real devices: small and skinny GEMMs are bound by their operands, big ones by
// the rate. `flops = 2 m n k`, `bytes = (m k + k n + m n) * dtype bytes`.
struct GemmModel {
  double overhead_s = 0;
  double flops_per_s = 1;
  double bytes_per_s = 0;  // 0: no operand term
  double time(double m, double n, double k, int dtype_bytes) const {
    if (m <= 0 || n <= 0 || k <= 0) return 0;
    const double bytes = (m * k + k * n + m * n) * dtype_bytes;
    return overhead_s + 2 * m * n * k / flops_per_s + (bytes_per_s > 0 ? bytes / bytes_per_s : 0);
  }
  double achieved_flops_per_s(double m, double n, double k, int dtype_bytes) const {
    return 2 * m * n * k / time(m, n, k, dtype_bytes);
  }
};

// Flash-style attention: t = overhead + flops / rate, separately forward and backward. Forward flops are
// 4 * d * (query-key pairs) * heads; backward does 2.5 times the forward flops (it recomputes the scores).
struct AttentionModel {
  double overhead_s = 0;
  double forward_flops_per_s = 1;
  double backward_flops_per_s = 1;
  double forward_time(double flops) const { return flops > 0 ? overhead_s + flops / forward_flops_per_s : 0; }
  double backward_time(double forward_flops) const {
    return forward_flops > 0 ? overhead_s + 2.5 * forward_flops / backward_flops_per_s : 0;
  }
};

// A CPU's GEMM engine for one size class ("small", "medium", "large" by flops; ops/cpu/gemm_choice.hpp), as measured
// when the profile was calibrated: the engine chosen and both engines' rates (0: not built in).
struct GemmEngineChoice {
  std::string size_class;
  std::string engine;  // "cblas" or "fallback"
  double cblas_flops_per_s = 0;
  double fallback_flops_per_s = 0;
  friend bool operator==(const GemmEngineChoice&, const GemmEngineChoice&) = default;
};

struct HardwareProfile {
  std::string name;
  std::string description;
  std::string source;                 // where the figures come from (datasheets, or "calibrated on ...")
  int devices_per_node = 8;
  std::int64_t memory_bytes = 0;      // per device
  std::int64_t reserved_bytes = 0;    // taken by the runtime (context, communicator buffers, allocator slack)
  GemmModel gemm;
  AttentionModel attention;
  double elementwise_bytes_per_s = 1; // bytes read + written per second by elementwise kernels
  // Output elements per second of activation kernels (GELU, SwiGLU, softmax exponentials), which are compute-bound
  // on CPUs; 0: memory-bound like the other elementwise kernels (GPUs).
  double activation_elements_per_s = 0;
  // Fraction of a ring step's shorter side (compute or transfer) that hides under the longer one: 1 on GPUs
  // (copy engines and streams), lower where compute and communication share the same cores.
  double overlap = 1;
  LinkModel intra_node, inter_node;
  std::vector<CollectiveCost> collectives;
  // Calibrated CPU profiles: gemm()'s engine per size class (empty for devices and built-in profiles).
  std::vector<GemmEngineChoice> gemm_engines;

  // The device's GEMM rate, what model-FLOPs utilisation is measured against: the chosen engine's measured rate on
  // large GEMMs where the profile has one, else the fitted asymptotic rate.
  double gemm_peak_flops_per_s() const {
    for (const GemmEngineChoice& c : gemm_engines)
      if (c.size_class == "large") return c.engine == "cblas" ? c.cblas_flops_per_s : c.fallback_flops_per_s;
    return gemm.flops_per_s;
  }

  std::int64_t usable_memory_bytes() const { return memory_bytes - reserved_bytes; }

  LinkLevel level_of(int group_size) const {
    return group_size <= devices_per_node ? LinkLevel::intra_node : LinkLevel::inter_node;
  }
  const LinkModel& link(LinkLevel level) const { return level == LinkLevel::intra_node ? intra_node : inter_node; }

  // Seconds for one collective of `bytes` (nccl-tests size) over a group of `group_size` ranks. An exact entry
  // wins; otherwise the nearest group size of the same collective and level is carried over by the ring formula
  // (alpha scales with the ring steps, beta with the bus factor); otherwise the level's link model.
  double collective_time(Collective op, int group_size, double bytes) const {
    if (group_size <= 1 || bytes <= 0) return 0;
    const LinkLevel level = level_of(group_size);
    // The entry of the nearest group size (an exact one first) whose size range holds `bytes`.
    const CollectiveCost* nearest = nullptr;
    for (const CollectiveCost& entry : collectives) {
      if (entry.op != op || entry.level != level || double(entry.min_bytes) > bytes) continue;
      if (!nearest) {
        nearest = &entry;
        continue;
      }
      const int distance = std::abs(entry.group_size - group_size);
      const int best = std::abs(nearest->group_size - group_size);
      if (distance < best || (distance == best && entry.group_size == nearest->group_size &&
                              entry.min_bytes > nearest->min_bytes))
        nearest = &entry;
    }
    if (nearest && nearest->group_size == group_size) return nearest->cost.time(bytes);
    if (nearest && nearest->group_size > 1) {
      const double alpha_per_step = nearest->cost.alpha_s / latency_steps(op, nearest->group_size);
      const double beta_bus = nearest->cost.beta_s_per_byte / bus_factor(op, nearest->group_size);
      return alpha_per_step * latency_steps(op, group_size) + beta_bus * bus_factor(op, group_size) * bytes;
    }
    const LinkModel& l = link(level);
    const double bandwidth = op == Collective::send_recv ? l.p2p_bytes_per_s : l.bus_bytes_per_s;
    return l.launch_s + l.step_latency_s * latency_steps(op, group_size) + bus_factor(op, group_size) * bytes / bandwidth;
  }

  double elementwise_time(double bytes) const { return bytes > 0 ? bytes / elementwise_bytes_per_s : 0; }
  // An activation producing `elements` outputs from `bytes` of reads and writes.
  double activation_time(double elements, double bytes) const {
    if (elements <= 0) return 0;
    return activation_elements_per_s > 0 ? elements / activation_elements_per_s : elementwise_time(bytes);
  }

  // Sets (or replaces) the entry for one collective, group size, level and size range.
  void set_collective(Collective op, LinkLevel level, int group_size, AlphaBeta cost, std::int64_t min_bytes = 0) {
    for (CollectiveCost& entry : collectives)
      if (entry.op == op && entry.level == level && entry.group_size == group_size && entry.min_bytes == min_bytes) {
        entry.cost = cost;
        return;
      }
    collectives.push_back({op, level, group_size, cost, min_bytes});
  }
};

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

// Reading fields: every message names the field by its full path (gemm.flops_per_s, collectives[2].alpha_s), and
// every number must be finite (a JSON 1e999 does not even parse; this also guards values built in code).
inline std::string field_name(std::string_view where, std::string_view key) {
  return where.empty() ? std::string(key) : fmt::format("{}.{}", where, key);
}
inline const json::Value& member(const json::Value& object, std::string_view where, std::string_view key) {
  check(object.is_object(), "profile: {} is {}, expected an object", where.empty() ? "the profile" : where,
        object.type_name());
  const json::Value* v = object.find(key);
  check(v != nullptr, "profile: missing key \"{}\"{}", key, where.empty() ? "" : fmt::format(" in {}", where));
  return *v;
}
inline double number(const json::Value& object, std::string_view where, std::string_view key) {
  const json::Value& v = member(object, where, key);
  check(v.is_number(), "profile: {} is {}, expected a number", field_name(where, key), v.type_name());
  const double x = v.as_number();
  check(std::isfinite(x), "profile: \"{}\" = {} must be a finite number ({})", key, x, field_name(where, key));
  return x;
}
inline double positive(const json::Value& object, std::string_view where, std::string_view key) {
  const double x = number(object, where, key);
  check(x > 0, "profile: \"{}\" = {} must be positive ({})", key, x, field_name(where, key));
  return x;
}
inline double non_negative(const json::Value& object, std::string_view where, std::string_view key) {
  const double x = number(object, where, key);
  check(x >= 0, "profile: \"{}\" = {} must not be negative ({})", key, x, field_name(where, key));
  return x;
}
inline std::int64_t integer(const json::Value& object, std::string_view where, std::string_view key,
                            std::int64_t min, std::int64_t max) {
  const double x = number(object, where, key);
  check(std::floor(x) == x && x >= double(min) && x <= double(max), "profile: \"{}\" = {} must be an integer in [{}, {}] ({})",
        key, x, min, max, field_name(where, key));
  return std::int64_t(x);
}
inline const std::string& text(const json::Value& object, std::string_view where, std::string_view key) {
  const json::Value& v = member(object, where, key);
  check(v.is_string(), "profile: {} is {}, expected a string", field_name(where, key), v.type_name());
  return v.as_string();
}

inline json::Value link_to_json(const LinkModel& l) {
  json::Value v;
  v.set("launch_s", l.launch_s);
  v.set("step_latency_s", l.step_latency_s);
  v.set("bus_bytes_per_s", l.bus_bytes_per_s);
  v.set("p2p_bytes_per_s", l.p2p_bytes_per_s);
  return v;
}
inline LinkModel link_from_json(const json::Value& v, std::string_view where) {
  return {non_negative(v, where, "launch_s"), non_negative(v, where, "step_latency_s"),
          positive(v, where, "bus_bytes_per_s"), positive(v, where, "p2p_bytes_per_s")};
}

}  // namespace detail

inline json::Value to_json(const HardwareProfile& p) {
  json::Value v;
  v.set("format", "paradyse.hardware_profile/1");
  v.set("name", p.name);
  v.set("description", p.description);
  v.set("source", p.source);
  v.set("devices_per_node", p.devices_per_node);
  v.set("memory_bytes", p.memory_bytes);
  v.set("reserved_bytes", p.reserved_bytes);
  json::Value gemm;
  gemm.set("overhead_s", p.gemm.overhead_s);
  gemm.set("flops_per_s", p.gemm.flops_per_s);
  gemm.set("bytes_per_s", p.gemm.bytes_per_s);
  v.set("gemm", gemm);
  json::Value attention;
  attention.set("overhead_s", p.attention.overhead_s);
  attention.set("forward_flops_per_s", p.attention.forward_flops_per_s);
  attention.set("backward_flops_per_s", p.attention.backward_flops_per_s);
  v.set("attention", attention);
  v.set("elementwise_bytes_per_s", p.elementwise_bytes_per_s);
  v.set("activation_elements_per_s", p.activation_elements_per_s);
  v.set("overlap", p.overlap);
  v.set("intra_node", detail::link_to_json(p.intra_node));
  v.set("inter_node", detail::link_to_json(p.inter_node));
  json::Array table;
  for (const CollectiveCost& c : p.collectives) {
    json::Value entry;
    entry.set("op", std::string(name_of(c.op)));
    entry.set("level", std::string(name_of(c.level)));
    entry.set("group_size", c.group_size);
    entry.set("alpha_s", c.cost.alpha_s);
    entry.set("beta_s_per_byte", c.cost.beta_s_per_byte);
    if (c.min_bytes > 0) entry.set("min_bytes", c.min_bytes);
    table.push_back(entry);
  }
  v.set("collectives", json::Value(std::move(table)));
  if (!p.gemm_engines.empty()) {
    json::Array engines;
    for (const GemmEngineChoice& c : p.gemm_engines) {
      json::Value entry;
      entry.set("size_class", c.size_class);
      entry.set("engine", c.engine);
      entry.set("cblas_flops_per_s", c.cblas_flops_per_s);
      entry.set("fallback_flops_per_s", c.fallback_flops_per_s);
      engines.push_back(entry);
    }
    v.set("gemm_engines", json::Value(std::move(engines)));
  }
  return v;
}

// Throws Error naming the field for a missing or mistyped one, a non-finite number, a negative time or a rate that
// is not positive.
inline HardwareProfile profile_from_json(const json::Value& v) {
  using namespace detail;
  check(v.is_object(), "profile: expected a JSON object, found {}", v.type_name());
  if (const json::Value* format = v.find("format"))
    check(format->is_string() && format->as_string() == "paradyse.hardware_profile/1",
          "profile: format \"{}\" is not \"paradyse.hardware_profile/1\"",
          format->is_string() ? printable(format->as_string()) : std::string(format->type_name()));
  HardwareProfile p;
  p.name = text(v, "", "name");
  if (v.find("description")) p.description = text(v, "", "description");
  if (v.find("source")) p.source = text(v, "", "source");
  p.devices_per_node = int(integer(v, "", "devices_per_node", 1, 1 << 20));
  constexpr std::int64_t kMaxBytes = std::int64_t(1) << 53;  // exact in a double
  p.memory_bytes = integer(v, "", "memory_bytes", 1, kMaxBytes);
  p.reserved_bytes = integer(v, "", "reserved_bytes", 0, kMaxBytes);
  check(p.reserved_bytes < p.memory_bytes,
        "profile: memory_bytes = {} must be positive and above reserved_bytes = {}", p.memory_bytes, p.reserved_bytes);
  const json::Value& gemm = member(v, "", "gemm");
  p.gemm = {non_negative(gemm, "gemm", "overhead_s"), positive(gemm, "gemm", "flops_per_s"),
            non_negative(gemm, "gemm", "bytes_per_s")};
  const json::Value& attention = member(v, "", "attention");
  p.attention = {non_negative(attention, "attention", "overhead_s"),
                 positive(attention, "attention", "forward_flops_per_s"),
                 positive(attention, "attention", "backward_flops_per_s")};
  p.elementwise_bytes_per_s = positive(v, "", "elementwise_bytes_per_s");
  if (v.find("activation_elements_per_s")) p.activation_elements_per_s = non_negative(v, "", "activation_elements_per_s");
  p.overlap = number(v, "", "overlap");
  check(p.overlap >= 0 && p.overlap <= 1, "profile: overlap = {} must be in [0, 1]", p.overlap);
  p.intra_node = link_from_json(member(v, "", "intra_node"), "intra_node");
  p.inter_node = link_from_json(member(v, "", "inter_node"), "inter_node");
  const json::Value& table = member(v, "", "collectives");
  check(table.is_array(), "profile: collectives is {}, expected an array", table.type_name());
  for (const json::Value& entry : table.as_array()) {
    const std::string where = fmt::format("collectives[{}]", p.collectives.size());
    CollectiveCost c;
    c.op = enum_from_name(text(entry, where, "op"), kAllCollectives, "collective");
    c.level = enum_from_name(text(entry, where, "level"), std::array{LinkLevel::intra_node, LinkLevel::inter_node},
                             "link level");
    c.group_size = int(integer(entry, where, "group_size", 2, 1 << 20));
    c.cost = {non_negative(entry, where, "alpha_s"), non_negative(entry, where, "beta_s_per_byte")};
    if (entry.find("min_bytes")) c.min_bytes = integer(entry, where, "min_bytes", 0, kMaxBytes);
    p.collectives.push_back(c);
  }
  if (const json::Value* engines = v.find("gemm_engines")) {
    check(engines->is_array(), "profile: gemm_engines is {}, expected an array", engines->type_name());
    for (const json::Value& entry : engines->as_array()) {
      const std::string where = fmt::format("gemm_engines[{}]", p.gemm_engines.size());
      GemmEngineChoice c;
      c.size_class = text(entry, where, "size_class");
      check(c.size_class == "small" || c.size_class == "medium" || c.size_class == "large",
            "profile: {}.size_class = \"{}\", expected small, medium or large", where, printable(c.size_class));
      c.engine = text(entry, where, "engine");
      check(c.engine == "cblas" || c.engine == "fallback", "profile: {}.engine = \"{}\", expected cblas or fallback",
            where, printable(c.engine));
      c.cblas_flops_per_s = non_negative(entry, where, "cblas_flops_per_s");
      c.fallback_flops_per_s = non_negative(entry, where, "fallback_flops_per_s");
      check((c.engine == "cblas" ? c.cblas_flops_per_s : c.fallback_flops_per_s) > 0,
            "profile: {} chose {} but gives it no rate", where, c.engine);
      p.gemm_engines.push_back(c);
    }
  }
  return p;
}

inline void save_profile(const HardwareProfile& p, const std::string& path) { json::save_file(to_json(p), path); }
inline HardwareProfile load_profile(const std::string& path) { return profile_from_json(json::load_file(path)); }

}  // namespace paradyse::cost
