// paradyse/search/parallel_config.hpp: one point of the N-D parallel training space, and the spaces searched.
//
// Mesh dimensions (outermost first, so that the innermost sit on the fastest links): pp, dp, cp, tp_x, tp_y, with
// dp * pp * cp * tp_x * tp_y = devices. Attention and dense layers run on this mesh: tp = tp_x * tp_y is 2D tensor
// parallelism (tp_x = 1 is Megatron's 1D tensor + sequence parallelism over tp_y), cp splits the sequence.
// Dimension fusion for MoE layers: the same devices re-factor as expert data x ep x etp, with ep folded over the
// devices of dp x cp (ep consecutive positions of the flattened dp x cp axis) and etp over tp (the innermost etp
// positions); the expert-data-parallel group is what remains, edp = dp * cp * tp / (ep * etp).
// Schedule knobs: ZeRO stage over the data-parallel group, micro-batch size, virtual pipeline stages (interleaved
// 1F1B), activation recomputation. Variants: 1D tensor parallelism without sequence parallelism (the 2021
// Megatron: all-reduces, norms and dropout replicated over tp), and context parallelism as a ring (K and V passed
// around, overlapped with attention) or as Llama 3's all-gather of K and V before attention.
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/core/printable.hpp"

#include <fmt/format.h>

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace paradyse::search {

enum class Recompute : std::uint8_t { none, selective, full };
inline constexpr std::array<Recompute, 3> kAllRecompute{Recompute::none, Recompute::selective, Recompute::full};
constexpr std::string_view name_of(Recompute r) {
  return r == Recompute::none ? "none" : r == Recompute::selective ? "selective" : "full";
}

enum class CpScheme : std::uint8_t { ring, all_gather };
inline constexpr std::array<CpScheme, 2> kAllCpSchemes{CpScheme::ring, CpScheme::all_gather};
constexpr std::string_view name_of(CpScheme s) { return s == CpScheme::ring ? "ring" : "all-gather"; }

struct ParallelConfig {
  int dp = 1, pp = 1, cp = 1, tp_x = 1, tp_y = 1;  // the mesh
  int ep = 1, etp = 1;                             // MoE layers, fused onto dp x cp and tp
  int zero = 0;                                    // ZeRO stage 0-3 over the data-parallel group
  int micro_batch = 1;                             // sequences per micro-batch
  int virtual_stages = 1;                          // model chunks per pipeline stage (interleaved 1F1B when > 1)
  Recompute recompute = Recompute::none;
  bool sequence_parallel = true;                   // 1D tp (tp_x = 1) only: false = all-reduce, norms replicated
  CpScheme cp_scheme = CpScheme::ring;             // cp > 1 only

  int tp() const { return tp_x * tp_y; }
  std::int64_t devices() const { return std::int64_t(dp) * pp * cp * tp_x * tp_y; }
  int expert_dp() const { return dp * cp * tp() / (ep * etp); }

  friend bool operator==(const ParallelConfig&, const ParallelConfig&) = default;
};

// The variants are named only when they are not the default, so that tables of the default space read as before.
inline std::string to_string(const ParallelConfig& c) {
  std::string s = fmt::format("dp={} pp={} cp={} tp={}x{} ep={} etp={} zero={} mb={} v={} rc={}", c.dp, c.pp, c.cp,
                              c.tp_x, c.tp_y, c.ep, c.etp, c.zero, c.micro_batch, c.virtual_stages,
                              name_of(c.recompute));
  if (!c.sequence_parallel) s += " sp=off";
  if (c.cp_scheme != CpScheme::ring) s += fmt::format(" cp-scheme={}", name_of(c.cp_scheme));
  return s;
}

// Which dimensions a search may use: "3d" = dp x tp x pp (Megatron-LM's space: 1D tp, no cp/ep), "4d" adds cp
// (and ep folded over dp for MoE models, as Megatron-Core does), "7d" = every dimension (2D tp, ep and etp).
// Every space sweeps ZeRO stage, micro-batch, virtual stages and recomputation.
struct SearchSpace {
  std::string name = "7d";
  bool context_parallel = true;
  bool tensor_2d = true;          // tp_x > 1 allowed
  bool expert_parallel = true;    // ep > 1 allowed (MoE models)
  bool expert_tensor = true;      // etp != tp allowed (otherwise etp = tp, experts sharded like dense layers)
  int max_virtual_stages = 8;
  int max_micro_batch = 16;
  std::vector<CpScheme> cp_schemes{CpScheme::ring};  // the schemes tried when cp > 1 (search_parallel --cp-scheme)
};

inline SearchSpace space_3d() {
  return {.name = "3d", .context_parallel = false, .tensor_2d = false, .expert_parallel = false,
          .expert_tensor = false};
}
inline SearchSpace space_4d() {
  return {.name = "4d", .context_parallel = true, .tensor_2d = false, .expert_parallel = true, .expert_tensor = false};
}
inline SearchSpace space_7d() { return {}; }

inline SearchSpace space_by_name(std::string_view name) {
  if (name == "3d") return space_3d();
  if (name == "4d") return space_4d();
  if (name == "7d") return space_7d();
  throw Error(fmt::format("unknown search space \"{}\"; expected 3d, 4d or 7d", printable(name)));
}

}  // namespace paradyse::search
