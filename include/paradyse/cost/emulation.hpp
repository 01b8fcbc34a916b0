// paradyse/cost/emulation.hpp: a device node's interconnect emulated on this machine's thread ranks.
//
// On a CPU, communication is a memcpy, so every strategy costs about the same and the planner's gain hides in the
// noise. Emulation reproduces a device node's balance of compute and communication instead: the thread
// communicator paces every transfer (LinkPacing, comm/threads_detail.hpp) at the device's link latency and
// bandwidth, stretched by how much slower this machine computes than the device,
//   slowdown = device GEMM rate / this machine's calibrated GEMM rate,
// so a transfer takes as long relative to this machine's compute as it would relative to the device's.
//
//   const HardwareProfile cpu = ...;                         // calibrated here (cost/calibrate.hpp)
//   const Emulation e = emulate(a100_sxm4_80gb_x8(), cpu);
//   RunOptions options;  options.pacing = e.pacing;          // or comm.set_link_pacing(e.pacing) on every rank
//   run_ranks(p, fn, options);                               // plan with e.profile: this machine's compute, the
//                                                            // device's links slowed down alike
// The pacing only delays completion, so compute between a post and its wait overlaps the transfer (profile
// overlap 1). The emulation holds while the real copies are faster than the paced times (they are by orders of
// magnitude for NVLink-class links scaled by thousands).
#pragma once

#include "paradyse/comm/threads.hpp"
#include "paradyse/core/error.hpp"
#include "paradyse/cost/profile.hpp"

#include <fmt/format.h>

namespace paradyse::cost {

struct Emulation {
  double slowdown = 1;      // device GEMM rate / this machine's
  LinkPacing pacing;        // for the thread communicator
  HardwareProfile profile;  // for the cost model: this machine's compute, the device's links x slowdown
};

inline Emulation emulate(const HardwareProfile& device, const HardwareProfile& machine) {
  const double machine_rate = machine.gemm_peak_flops_per_s();
  check(machine_rate > 0 && device.gemm.flops_per_s > 0,
        "emulate: GEMM rates must be positive (device {} = {}, machine {} = {})", device.name, device.gemm.flops_per_s,
        machine.name, machine_rate);
  Emulation e;
  e.slowdown = device.gemm.flops_per_s / machine_rate;
  const LinkModel& link = device.intra_node;
  e.pacing = {.launch_s = link.launch_s * e.slowdown,
              .alpha_s = link.step_latency_s * e.slowdown,
              .collective_s_per_byte = e.slowdown / link.bus_bytes_per_s,
              .p2p_s_per_byte = e.slowdown / link.p2p_bytes_per_s};
  e.profile = machine;
  e.profile.name = fmt::format("{} with {} links x {:.0f}", machine.name, device.name, e.slowdown);
  e.profile.description = fmt::format("{}'s compute; {}'s intra-node links slowed {:.0f}x (emulated)", machine.name,
                                      device.name, e.slowdown);
  e.profile.intra_node = {link.launch_s * e.slowdown, link.step_latency_s * e.slowdown,
                          link.bus_bytes_per_s / e.slowdown, link.p2p_bytes_per_s / e.slowdown};
  e.profile.inter_node = e.profile.intra_node;
  e.profile.collectives.clear();  // every collective from the link model, as the pacing computes it
  e.profile.overlap = 1;
  return e;
}

}  // namespace paradyse::cost
