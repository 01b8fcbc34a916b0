// paradyse/cost/builtin_profiles.hpp: hardware profiles of well-known 8-GPU NVLink nodes, from their datasheets.
//
// Datasheet figures are peaks; a profile holds achieved rates. The efficiencies used to go from one to the other are
// stated beside each number; they are typical published measurements, not measurements of ours. Run `calibrate`
// (cost/calibrate.hpp) on the machine itself for a profile that is right there.
//
// Two terms a calibrated CPU profile prices are left at 0 (unpriced) here, by assumption: fresh memory
// (FreshMemoryModel: PyTorch's and our device allocators cache their blocks, so a training step touches no new
// pages, and the zeroing of a fresh tensor is a fill at HBM bandwidth, under 1% of a step) and scalar math
// (ScalarMathModel: a GPU's special-function units evaluate exp, sin and cos inside memory-bound kernels).
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/cost/profile.hpp"

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

namespace paradyse::cost {

namespace detail {

inline constexpr std::int64_t kGiB = std::int64_t(1) << 30;
inline constexpr std::int64_t kMiB = std::int64_t(1) << 20;

// The parts every NVLink/NVSwitch node shares: the CUDA context, NCCL's buffers and allocator slack take ~2 GiB.
inline HardwareProfile nvlink_node_base() {
  HardwareProfile p;
  p.devices_per_node = 8;
  p.reserved_bytes = 2 * kGiB;
  p.overlap = 1;  // copy engines / NCCL kernels on their own stream run beside compute
  p.gemm.overhead_s = 6e-6;       // launch + tail effect of one cuBLAS call
  // A grouped GEMM (an MoE layer's experts in one cuBLAS call) launches once: its other items cost their flops and
  // bytes alone. The per-item scheduling inside the kernel is not measured (no lent GPU has timed one yet): 0.
  p.gemm.grouped_item_s = 0.0;
  p.attention.overhead_s = 10e-6;
  return p;
}

// Across nodes, rail-optimised: one NIC per GPU. Ring collectives stripe over the eight rails, so their bus bandwidth
// is the node's NIC bandwidth (8 NICs), but one send/recv pair and the cross-node part of an all-to-all go through a
// single NIC.
inline void set_rail_network(HardwareProfile& p, double nic_bytes_per_s) {
  const double achieved = 0.9 * nic_bytes_per_s;
  p.inter_node = {.launch_s = 10e-6, .step_latency_s = 5e-6, .bus_bytes_per_s = 8 * achieved,
                  .p2p_bytes_per_s = achieved};
  // all_to_all over 2 nodes: each GPU sends half of its buffer through its own NIC.
  p.set_collective(Collective::all_to_all, LinkLevel::inter_node, 16,
                   {.alpha_s = 10e-6 + 15 * 5e-6, .beta_s_per_byte = 0.5 / achieved});
}

}  // namespace detail

// DGX A100 / HGX A100 8-GPU with A100-SXM4-80GB: the ParaDySe paper's machine.
// NVIDIA A100 Tensor Core GPU datasheet (2021): BF16/FP16 Tensor Core 312 TFLOPS dense, 80 GB HBM2e at 2,039 GB/s,
// NVLink 3 at 600 GB/s per GPU (both directions, 300 GB/s each way) through NVSwitch. DGX A100 datasheet: eight
// 200 Gb/s HDR InfiniBand ConnectX-6 for the compute fabric (25 GB/s per GPU).
inline HardwareProfile a100_sxm4_80gb_x8() {
  HardwareProfile p = detail::nvlink_node_base();
  p.name = "A100-SXM4-80GB-x8";
  p.description = "8x A100-SXM4-80GB, NVLink 3 + NVSwitch, 8x HDR 200 Gb/s InfiniBand";
  p.source = "NVIDIA A100 datasheet (312 TFLOPS bf16, 2039 GB/s HBM2e, 600 GB/s NVLink); DGX A100 datasheet (8x "
             "HDR 200 Gb/s); achieved fractions: GEMM 75%, FlashAttention-2 64%/54% fwd/bwd, HBM 80%, NCCL busbw 230 "
             "GB/s";
  p.memory_bytes = 80 * detail::kGiB;  // 81920 MiB as nvidia-smi reports it
  p.gemm.flops_per_s = 0.75 * 312e12;  // large cuBLAS bf16 GEMMs
  p.gemm.bytes_per_s = 0.8 * 2039e9;
  p.attention.forward_flops_per_s = 200e12;   // FlashAttention-2 paper, A100, head dim 128, long sequences
  p.attention.backward_flops_per_s = 170e12;
  p.elementwise_bytes_per_s = 0.8 * 2039e9;
  // NCCL on NVLink 3: ~230 GB/s busbw for large messages (nccl-tests on DGX A100), ~20 us for small all-reduces.
  p.intra_node = {.launch_s = 6e-6, .step_latency_s = 1e-6, .bus_bytes_per_s = 230e9, .p2p_bytes_per_s = 230e9};
  detail::set_rail_network(p, 25e9);
  return p;
}

// DGX H100 / HGX H100 8-GPU with H100-SXM5-80GB.
// NVIDIA H100 Tensor Core GPU datasheet: BF16 Tensor Core 1,979 TFLOPS with sparsity (989 dense), 80 GB HBM3 at
// 3.35 TB/s, NVLink 4 at 900 GB/s per GPU (450 GB/s each way). DGX H100: eight 400 Gb/s ConnectX-7 (50 GB/s per GPU).
inline HardwareProfile h100_sxm_80gb_x8() {
  HardwareProfile p = detail::nvlink_node_base();
  p.name = "H100-SXM-80GB-x8";
  p.description = "8x H100-SXM5-80GB, NVLink 4 + NVSwitch, 8x NDR 400 Gb/s InfiniBand";
  p.source = "NVIDIA H100 datasheet (989 TFLOPS bf16 dense, 3.35 TB/s HBM3, 900 GB/s NVLink); DGX H100 (8x 400 "
             "Gb/s); achieved fractions: GEMM 70%, FlashAttention-3 56%/45% fwd/bwd, HBM 80%, NCCL busbw 360 GB/s";
  p.memory_bytes = 81559 * detail::kMiB;
  p.gemm.flops_per_s = 0.70 * 989e12;
  p.gemm.bytes_per_s = 0.8 * 3.35e12;
  p.attention.forward_flops_per_s = 550e12;   // FlashAttention-3 paper, H100, bf16, head dim 128
  p.attention.backward_flops_per_s = 450e12;
  p.elementwise_bytes_per_s = 0.8 * 3.35e12;
  p.intra_node = {.launch_s = 6e-6, .step_latency_s = 1e-6, .bus_bytes_per_s = 360e9, .p2p_bytes_per_s = 370e9};
  detail::set_rail_network(p, 50e9);
  return p;
}

// HGX H200 8-GPU with H200-SXM-141GB: H100's compute with more and faster memory.
// NVIDIA H200 Tensor Core GPU datasheet: BF16 Tensor Core 1,979 TFLOPS with sparsity (989 dense), 141 GB HBM3e at
// 4.8 TB/s, NVLink 900 GB/s per GPU. Networking as DGX H100 (400 Gb/s per GPU).
inline HardwareProfile h200_sxm_141gb_x8() {
  HardwareProfile p = h100_sxm_80gb_x8();
  p.name = "H200-SXM-141GB-x8";
  p.description = "8x H200-SXM-141GB, NVLink 4 + NVSwitch, 8x NDR 400 Gb/s InfiniBand";
  p.source = "NVIDIA H200 datasheet (989 TFLOPS bf16 dense, 141 GB HBM3e at 4.8 TB/s, 900 GB/s NVLink); achieved "
             "fractions as H100-SXM-80GB-x8";
  p.memory_bytes = 143771 * detail::kMiB;  // "141 GB": nvidia-smi reports 143771 MiB
  p.gemm.bytes_per_s = 0.8 * 4.8e12;
  p.elementwise_bytes_per_s = 0.8 * 4.8e12;
  return p;
}

inline constexpr std::array<std::string_view, 3> kBuiltinProfileNames{"A100-SXM4-80GB-x8", "H100-SXM-80GB-x8",
                                                                      "H200-SXM-141GB-x8"};

// A built-in profile by name (also accepts "a100", "h100", "h200").
inline HardwareProfile builtin_profile(std::string_view name) {
  if (name == kBuiltinProfileNames[0] || name == "a100") return a100_sxm4_80gb_x8();
  if (name == kBuiltinProfileNames[1] || name == "h100") return h100_sxm_80gb_x8();
  if (name == kBuiltinProfileNames[2] || name == "h200") return h200_sxm_141gb_x8();
  throw Error(fmt::format("no built-in profile \"{}\"; known: {}, {}, {} (or a100, h100, h200)", name,
                          kBuiltinProfileNames[0], kBuiltinProfileNames[1], kBuiltinProfileNames[2]));
}

}  // namespace paradyse::cost
