// paradyse/cost/model_flops.hpp: the model FLOPs of a GPT training step and the model FLOPs utilisation (MFU) they give.
//
// Model FLOPs count the multiply-adds the model needs, whatever the strategy does on top (recomputation, padding,
// communication): per real token of a row of l tokens, forward
//   2 x (every layer's projection and MLP weights: q, k, v, proj, MLP in/up/out) + 2 x vocab x h (the LM head)
// plus attention: QK^T and PV take 4 x q_width x l^2 per layer for the row, half of it under a causal mask; the
// embedding lookup, norms and activations are not counted. Backward is twice the forward: a training step is 3x.
// MFU = model FLOPs / (step seconds x ranks x the per-rank GEMM rate of the hardware profile).
#pragma once

#include "paradyse/contract/layer_config.hpp"
#include "paradyse/cost/profile.hpp"
#include "paradyse/model/gpt.hpp"

#include <cstdint>
#include <span>

namespace paradyse::cost {

// Forward + backward FLOPs of one training step whose rows hold `lengths` real tokens each (padding excluded).
inline double training_flops(const GptConfig& c, std::span<const std::int64_t> lengths) {
  const LayerConfig& l = c.layer;
  const double h = double(l.hidden);
  const double projections = (2.0 * double(l.q_width()) + 2.0 * double(l.kv_width())) * h;
  const double mlp = (l.activation == Activation::swiglu ? 3.0 : 2.0) * double(l.ffn) * h;
  const double per_token = 2.0 * (double(c.layers) * (projections + mlp) + double(c.vocab) * h);
  const double attention_factor = (l.causal ? 2.0 : 4.0) * double(l.q_width()) * double(c.layers);
  double forward = 0;
  for (const std::int64_t n : lengths) forward += per_token * double(n) + attention_factor * double(n) * double(n);
  return 3.0 * forward;
}

// The per-rank GEMM rate MFU is measured against: the profile's calibrated large-GEMM rate where it has one
// (HardwareProfile::gemm_peak_flops_per_s), else its fitted GEMM rate.
template <class Profile = HardwareProfile>
double gemm_rate_per_rank(const Profile& profile) {
  if constexpr (requires { profile.gemm_peak_flops_per_s(); })
    return profile.gemm_peak_flops_per_s();
  else
    return profile.gemm.flops_per_s;
}

// Model FLOPs utilisation of `flops` done in `seconds` on `ranks` ranks (0 when nothing was timed).
inline double model_flops_utilisation(double flops, double seconds, int ranks, const HardwareProfile& profile) {
  const double available = seconds * double(ranks) * gemm_rate_per_rank(profile);
  return available > 0 ? flops / available : 0.0;
}

}  // namespace paradyse::cost
