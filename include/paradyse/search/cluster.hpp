// paradyse/search/cluster.hpp: a cluster as the parallelism search sees it: one device model (the hardware
// profile's GEMM, attention, elementwise rates and memory) and a hierarchy of link levels (inside a node, inside a
// supernode, across the network), each with an alpha-beta cost plus a launch cost per operation; and the time of a
// collective over a mesh group from the levels its members span.
//
// One operation over a group of g members on level l, `bytes` its nccl-tests size (cost/profile.hpp):
//   launch_l + alpha_l * steps(op, g) + bus_factor(op, g) * bytes / bandwidth
// with steps and bus_factor those of cost/profile.hpp (an all-reduce 2 (g - 1) steps and 2 (g - 1) / g of its
// buffer, a gather or scatter g - 1 and (g - 1) / g, a send 1 and all of it), the bandwidth that of a ring (below)
// for collectives and the level's point-to-point bandwidth for a send. launch is what every call pays once (a kernel
// launch, a thread communicator's post and wait; train_gpt --emulate holds each operation back by its link's
// launch_s x slowdown, comm/threads_member.hpp paced_seconds); alpha is per ring step.
//
// A group is described by its size n and its span (the number of consecutive ranks its members lie in: a group
// over mesh axes that are contiguous in the mesh has span = n * stride). It runs on the lowest level whose domain
// holds its span (and divides evenly by it, so that every such group lies inside one domain). Bandwidth: a ring
// over a group that leaves a domain of level l-1 crosses level l on every member it holds inside one domain of
// level l-1 (one rail per device, rail-optimised), so its bus bandwidth is min(bw_0, min over crossed levels l of
// members_in_domain(l-1) * bw_l); an all-to-all instead sends each part of its buffer over the level it crosses,
// one device's own link. Members per domain assume the group spreads evenly over its span (exact for strided
// groups). A send/recv step over a group (pipeline neighbours, a cp ring) runs on the group's level: its slowest hop
// straddles the largest domain boundary the group crosses.
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/printable.hpp"
#include "paradyse/cost/builtin_profiles.hpp"
#include "paradyse/core/json.hpp"
#include "paradyse/cost/profile.hpp"
#include "paradyse/cost/profile_json.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace paradyse::search {

using cost::Collective;

struct LinkLevel {
  std::string name;
  std::int64_t domain_devices = 0;  // devices in one domain of this level (0: the whole cluster, the last level)
  double alpha_s = 0;               // latency per ring step (or per all-to-all peer)
  double bytes_per_s = 1;           // achieved bandwidth of one device's link(s) at this level, one direction
  double launch_s = 0;              // fixed cost of every operation on this level (collective call or send/recv)
  double p2p_bytes_per_s = 0;       // one send/recv pair's bandwidth, all members shifting at once; 0: bytes_per_s

  double send_bytes_per_s() const { return p2p_bytes_per_s > 0 ? p2p_bytes_per_s : bytes_per_s; }
};

// A mesh group: `size` members spread evenly over `span` consecutive ranks.
struct GroupSpan {
  int size = 1;
  std::int64_t span = 1;
};

struct ClusterProfile {
  std::string name;
  std::string source;                 // datasheets the figures come from
  cost::HardwareProfile device;       // compute rates and memory of one device (its own links are unused here)
  double peak_flops_per_s = 0;        // datasheet dense bf16 peak, for MFU
  std::vector<LinkLevel> levels;      // lowest (fastest) first; the last has domain_devices = 0
  // Cores that one node's devices share, when they compute on shared cores (thread ranks on a CPU); 0: every device
  // computes on its own (GPUs, NPUs). A calibrated CPU profile holds each rank's own time (thread CPU time), so the
  // devices of a node that outnumber its cores run in turn: see serialisation().
  std::int64_t cores_per_node = 0;
  // Communication is a wait (train_gpt --emulate paces thread ranks' transfers at a device's link: the thread sleeps
  // until the paced end), not work on the shared cores: serialisation() then stretches compute and the optimizer
  // only, and other stages' work fills a pipeline's waits; a collective's holds its lockstep ranks (perf_model.hpp).
  bool paced_links = false;

  // How much longer a device's own work takes when `devices` devices run (1 when every device has its own core):
  // the devices in one node (the first level's domain, or all of them) over its cores. A node of 8 thread ranks on
  // 2 cores runs 4 ranks' work in the time of one.
  double serialisation(std::int64_t devices) const {
    if (cores_per_node <= 0 || levels.empty()) return 1;
    const std::int64_t node = levels[0].domain_devices > 0 ? std::min(levels[0].domain_devices, devices) : devices;
    return std::max(1.0, double(node) / double(cores_per_node));
  }

  // The level a group runs on: the lowest whose domain holds the span evenly.
  int level_of(const GroupSpan& g) const {
    for (std::size_t l = 0; l + 1 < levels.size(); ++l) {
      const std::int64_t d = levels[l].domain_devices;
      if (g.span <= d && d % g.span == 0) return int(l);
    }
    return int(levels.size()) - 1;
  }
  // Members of the group inside one domain of level l (at least 1, at most the group).
  static double members_in(const GroupSpan& g, std::int64_t domain_devices) {
    if (domain_devices <= 0 || domain_devices >= g.span) return g.size;
    return std::max(1.0, double(g.size) * double(domain_devices) / double(g.span));
  }
  // Bus bandwidth of a ring over the group.
  double ring_bandwidth(const GroupSpan& g) const {
    const int top = level_of(g);
    double bw = levels[0].bytes_per_s;
    for (int l = 1; l <= top; ++l)
      bw = std::min(bw, members_in(g, levels[std::size_t(l - 1)].domain_devices) * levels[std::size_t(l)].bytes_per_s);
    return bw;
  }

  // Seconds of one collective of `bytes` (nccl-tests sizes, see cost/profile.hpp) over the group.
  double collective_time(Collective op, const GroupSpan& g, double bytes) const {
    if (g.size <= 1 || bytes <= 0) return 0;
    const int top = level_of(g);
    const LinkLevel& level = levels[std::size_t(top)];
    const double alpha = level.alpha_s;
    if (op == Collective::all_to_all) {
      // Each peer's part crosses the lowest level that holds both ends, on one device link.
      double t = level.launch_s + alpha * (g.size - 1), inside = 1;
      for (int l = 0; l <= top; ++l) {
        const double members = l == top ? g.size : members_in(g, levels[std::size_t(l)].domain_devices);
        t += bytes * (members - inside) / g.size / levels[std::size_t(l)].bytes_per_s;
        inside = members;
      }
      return t;
    }
    if (op == Collective::send_recv) {
      // One step of a chain or ring of neighbours `span / size` ranks apart (pipeline stages, the cp ring): every
      // member sends at once, and the step lasts as long as its slowest hop. A chain over more than one domain of a
      // level has a hop that straddles two domains (ranks s apart with s < domain still straddle a boundary when
      // the group leaves the domain), so the step runs on the group's own level, over one device's link there, at
      // its point-to-point bandwidth.
      return level.launch_s + alpha + bytes / level.send_bytes_per_s();
    }
    return level.launch_s + alpha * cost::latency_steps(op, g.size) +
           cost::bus_factor(op, g.size) * bytes / ring_bandwidth(g);
  }
};

inline void validate(const ClusterProfile& c) {
  check(!c.levels.empty(), "cluster {}: no link levels", c.name);
  check(c.peak_flops_per_s > 0, "cluster {}: peak_flops_per_s = {} must be positive", c.name, c.peak_flops_per_s);
  check(c.cores_per_node >= 0, "cluster {}: cores_per_node = {} must be positive (or 0: one core per device)",
        c.name, c.cores_per_node);
  check(c.device.memory_bytes > c.device.reserved_bytes,
        "cluster {}: memory_bytes = {} must exceed reserved_bytes = {}", c.name, c.device.memory_bytes,
        c.device.reserved_bytes);
  for (std::size_t l = 0; l < c.levels.size(); ++l) {
    const LinkLevel& level = c.levels[l];
    check(level.bytes_per_s > 0 && level.alpha_s >= 0, "cluster {}: level {} needs bytes_per_s > 0 (got {}) and "
          "alpha_s >= 0 (got {})", c.name, level.name, level.bytes_per_s, level.alpha_s);
    check(level.launch_s >= 0 && level.p2p_bytes_per_s >= 0, "cluster {}: level {} needs launch_s >= 0 (got {}) and "
          "p2p_bytes_per_s >= 0 (got {}; 0: bytes_per_s)", c.name, level.name, level.launch_s, level.p2p_bytes_per_s);
    const bool last = l + 1 == c.levels.size();
    check(last ? level.domain_devices == 0 : level.domain_devices >= 1,
          "cluster {}: level {} has domain_devices = {}; expected {}", c.name, level.name, level.domain_devices,
          last ? "0 (the last level spans the cluster)" : "at least 1");
    if (l > 0 && !last)
      check(level.domain_devices > c.levels[l - 1].domain_devices && level.domain_devices % c.levels[l - 1].domain_devices == 0,
            "cluster {}: level {} domain {} must be a multiple of the level below ({})", c.name, level.name,
            level.domain_devices, c.levels[l - 1].domain_devices);
  }
}

// The cluster with every level's links replaced by `link` (a device's link stretched as train_gpt --emulate paces
// thread ranks: cost/emulation.hpp's Emulation::profile.intra_node): its launch latency per operation, step
// latency, bus bandwidth and point-to-point bandwidth for sends, as comm/threads_member.hpp's paced_seconds charges
// them. The transfers become waits, not copies on the shared cores (paced_links).
inline ClusterProfile with_paced_links(ClusterProfile c, const cost::LinkModel& link) {
  for (LinkLevel& level : c.levels) {
    level.launch_s = link.launch_s;
    level.alpha_s = link.step_latency_s;
    level.bytes_per_s = link.bus_bytes_per_s;
    level.p2p_bytes_per_s = link.p2p_bytes_per_s;
  }
  c.paced_links = true;
  return c;
}

// ---- presets ------------------------------------------------------------------------------------------------------
// Their levels' alpha_s is the published per-step latency and their launch_s 0: at the sizes these runs move (MBs
// per call) a few microseconds per call are below the published rows' agreement, and the rows are kept as published.

// DGX A100 SuperPOD: 8x A100-SXM4-80GB per node. Device rates: cost/builtin_profiles.hpp's a100_sxm4_80gb_x8 (A100
// datasheet: 312 TFLOPS dense bf16, 2,039 GB/s HBM2e, 80 GB). NVLink 3 through NVSwitch: 300 GB/s per direction per
// GPU (A100 datasheet); nccl-tests reach ~230 GB/s bus bandwidth on a DGX A100. Network: 8x HDR 200 Gb/s
// InfiniBand, one per GPU (DGX A100 datasheet), 25 GB/s, of which ~90% is achieved.
inline ClusterProfile dgx_a100() {
  ClusterProfile c;
  c.name = "dgx-a100";
  c.device = cost::a100_sxm4_80gb_x8();
  c.source = "NVIDIA A100 datasheet (312 TFLOPS bf16 dense, 80 GB, NVLink 600 GB/s bidirectional); DGX A100 "
             "datasheet (8x HDR 200 Gb/s InfiniBand)";
  c.peak_flops_per_s = 312e12;
  c.levels = {{"nvlink", 8, 6e-6, 230e9}, {"infiniband", 0, 10e-6, 0.9 * 25e9}};
  return c;
}

// DGX H100 SuperPOD: 8x H100-SXM5-80GB per node. Device rates: cost/builtin_profiles.hpp's h100_sxm_80gb_x8 (H100
// datasheet: 989 TFLOPS dense bf16, 3.35 TB/s HBM3, 80 GB). NVLink 4: 450 GB/s per direction per GPU, ~360 GB/s
// nccl-tests bus bandwidth. Network: 8x NDR 400 Gb/s ConnectX-7, one per GPU (DGX H100 datasheet), 50 GB/s.
inline ClusterProfile dgx_h100() {
  ClusterProfile c;
  c.name = "dgx-h100";
  c.device = cost::h100_sxm_80gb_x8();
  c.source = "NVIDIA H100 datasheet (989 TFLOPS bf16 dense, 80 GB, NVLink 900 GB/s bidirectional); DGX H100 "
             "datasheet (8x NDR 400 Gb/s)";
  c.peak_flops_per_s = 989e12;
  c.levels = {{"nvlink", 8, 6e-6, 360e9}, {"infiniband", 0, 10e-6, 0.9 * 50e9}};
  return c;
}

// Ascend supernode (Huawei CloudMatrix384; Zuo et al., "Serving Large Language Models on Huawei CloudMatrix384",
// arXiv 2506.12708, 2025): 48 nodes of 8 Ascend 910C in one Unified Bus domain of 384 NPUs. Per 910C package: 752
// TFLOPS bf16 dense, 128 GB HBM at 3.2 TB/s; UB: 392 GB/s per direction per NPU, non-blocking across the supernode
// with under 1 us added latency across nodes; RDMA plane between supernodes: 400 Gb/s per NPU. Achieved fractions
// as on NVIDIA devices (GEMM 70%, HBM 80%, links 80% on UB and 90% on RDMA): no published Ascend measurements are
// at hand, so these are assumptions, stated here.
inline ClusterProfile ascend_supernode() {
  ClusterProfile c;
  c.name = "ascend-supernode";
  c.source = "CloudMatrix384 (arXiv 2506.12708): Ascend 910C 752 TFLOPS bf16, 128 GB HBM 3.2 TB/s, UB 392 GB/s "
             "per NPU over 384 NPUs, RDMA 400 Gb/s per NPU";
  cost::HardwareProfile& d = c.device;
  d.name = "Ascend-910C";
  d.devices_per_node = 8;
  d.memory_bytes = 128 * cost::detail::kGiB;
  d.reserved_bytes = 4 * cost::detail::kGiB;  // runtime, HCCL buffers, allocator slack (assumed, twice CUDA's)
  d.gemm = {.overhead_s = 8e-6, .flops_per_s = 0.70 * 752e12, .bytes_per_s = 0.8 * 3.2e12};
  d.attention = {.overhead_s = 10e-6, .forward_flops_per_s = 0.50 * 752e12, .backward_flops_per_s = 0.42 * 752e12};
  d.elementwise_bytes_per_s = 0.8 * 3.2e12;
  c.peak_flops_per_s = 752e12;
  c.levels = {{"node-ub", 8, 3e-6, 0.8 * 392e9},
              {"supernode-ub", 384, 4e-6, 0.8 * 392e9},
              {"rdma", 0, 10e-6, 0.9 * 50e9}};
  return c;
}

inline constexpr std::array<std::string_view, 3> kClusterPresets{"dgx-a100", "dgx-h100", "ascend-supernode"};

inline ClusterProfile cluster_preset(std::string_view name) {
  if (name == "dgx-a100") return dgx_a100();
  if (name == "dgx-h100") return dgx_h100();
  if (name == "ascend-supernode") return ascend_supernode();
  throw Error(fmt::format("unknown cluster \"{}\"; expected one of {}, {}, {} or a .json file", printable(name),
                          kClusterPresets[0], kClusterPresets[1], kClusterPresets[2]));
}

// A cluster from JSON: {"name", "peak_flops_per_s", "device": <a hardware profile, cost/profile.hpp>,
// "levels": [{"name", "domain_devices", "alpha_s", "bytes_per_s", ["launch_s"], ["p2p_bytes_per_s"]}, ...],
// ["cores_per_node": N], ["paced_links": B]}; a level's launch_s (seconds, default 0) and p2p_bytes_per_s (default:
// its bytes_per_s) are optional.
// Unknown and repeated keys are refused by name; rates and times in the ranges of cost/profile_json.hpp.
inline ClusterProfile cluster_from_json(const json::Value& v) {
  using namespace cost::detail;
  const json::Field doc(v, "cluster");
  doc.expect(doc.is_object(), "a JSON object");
  only_keys(doc, {"name", "source", "peak_flops_per_s", "device", "levels", "cores_per_node", "paced_links"});
  ClusterProfile c;
  c.name = text(doc, "name");
  // The name labels messages and output: control bytes (a NUL would cut every message) escaped.
  if (std::any_of(c.name.begin(), c.name.end(), [](char ch) { return static_cast<unsigned char>(ch) < 0x20 || ch == 0x7f; }))
    c.name = printable(c.name);
  if (doc.has("source")) c.source = text(doc, "source");
  c.peak_flops_per_s = rate(doc, "peak_flops_per_s");
  if (doc.has("cores_per_node")) c.cores_per_node = integer(doc, "cores_per_node", 1, 1 << 20);
  if (const auto f = doc.find("paced_links")) c.paced_links = f->boolean();
  c.device = cost::profile_from_json(doc["device"]);
  for (const json::Field& entry : doc["levels"].elements()) {
    only_keys(entry, {"name", "domain_devices", "alpha_s", "bytes_per_s", "launch_s", "p2p_bytes_per_s"});
    LinkLevel level{text(entry, "name"), integer(entry, "domain_devices", 0, 1 << 30), seconds(entry, "alpha_s"),
                    rate(entry, "bytes_per_s")};
    if (entry.has("launch_s")) level.launch_s = seconds(entry, "launch_s");
    if (entry.has("p2p_bytes_per_s")) level.p2p_bytes_per_s = rate(entry, "p2p_bytes_per_s");
    c.levels.push_back(std::move(level));
  }
  validate(c);
  return c;
}

inline json::Value cluster_to_json(const ClusterProfile& c) {
  json::Value v = {{"name", c.name}, {"source", c.source}, {"peak_flops_per_s", c.peak_flops_per_s}};
  v["device"] = cost::to_json(c.device);
  json::Value levels = json::Value::array();
  for (const LinkLevel& l : c.levels) {
    json::Value level = {{"name", l.name}, {"domain_devices", l.domain_devices}, {"alpha_s", l.alpha_s},
                         {"bytes_per_s", l.bytes_per_s}};
    if (l.launch_s > 0) level["launch_s"] = l.launch_s;
    if (l.p2p_bytes_per_s > 0) level["p2p_bytes_per_s"] = l.p2p_bytes_per_s;
    levels.push_back(std::move(level));
  }
  v["levels"] = std::move(levels);
  if (c.cores_per_node > 0) v["cores_per_node"] = c.cores_per_node;
  if (c.paced_links) v["paced_links"] = true;
  return v;
}

}  // namespace paradyse::search
