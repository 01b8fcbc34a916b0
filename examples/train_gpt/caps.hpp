// examples/train_gpt/caps.hpp: the dense run's memory cap per rank: --cap-mib, or the library's default
// (plan/memory_cap.hpp: between what all-METP and all-MegatronTS need at --max-len), checked against the model's own
// states (weights, gradients, AdamW moments) and what a save adds, before anything is allocated and again after; and
// (machine_fit_refusal, from the options alone) whether the model can fit this machine at all.
#pragma once

#include "hardware.hpp"
#include "training_options.hpp"

#include "paradyse/model/byte_gpt.hpp"
#include "paradyse/model/checkpoint.hpp"
#include "paradyse/model/gpt.hpp"
#include "paradyse/plan/cost_table.hpp"
#include "paradyse/plan/memory_cap.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

namespace paradyse::examples {

constexpr double kMiB = 1024.0 * 1024.0;

// Whether the model of `o` can fit this machine at all, checked from the options alone (before calibrating or
// allocating anything): every parameter is held at least once over the ranks, with its gradient and two AdamW
// moments, 16 bytes in float32, however a plan shares them. Empty when it may fit (or the machine's memory is
// unknown); otherwise the refusal, naming the flags, the estimated bytes and the machine's memory. Host runs only
// (--device cuda is checked against the device by dense_cap below).
inline std::string machine_fit_refusal(const TrainingOptions& o) {
  if (o.device != "cpu") return {};
  const double machine = physical_memory_bytes();
  const GptConfig config = o.experts > 0 ? paradyse::moe_gpt_config(byte_gpt_shape(o)) : byte_gpt_config(byte_gpt_shape(o));
  const double parameters = double(config.parameter_count());
  const double need = 16.0 * parameters;
  if (machine <= 0 || need <= 0.9 * machine) return {};
  return fmt::format(
      "the model does not fit this machine: {} ({} layers, --hidden {}{}) has {:.4g} M parameters, which need at "
      "least {:.4g} GiB (weights, gradients and two AdamW moments, 16 bytes per parameter in float32, however the "
      "ranks share them); this machine has {:.4g} GiB of memory (90% usable): lower {}",
      o.experts > 0 ? fmt::format("--experts {}", o.experts) : std::string("the GPT"), o.layers, o.hidden,
      o.experts > 0 ? fmt::format(", expert width {}", config.moe->moe.expert_ffn) : std::string(), parameters / 1e6,
      need / (kMiB * 1024), machine / (kMiB * 1024),
      o.experts > 0 ? "--experts, --layers or --hidden" : "--layers or --hidden");
}

// The cap and what it was derived from.
struct DenseCap {
  std::int64_t cap = 0;         // bytes per rank
  std::int64_t metp_peak = 0;   // all-METP's predicted peak at --max-len
  std::int64_t ts_peak = 0;     // all-MegatronTS's
  std::int64_t save_bytes = 0;  // what saving or resuming adds (one global layer gathered); 0 without
  bool raised_for_save = false; // the default raised to fit the model's states and its save
};

// The cap for `config` planned by `costs` (plan/gpt_costs.hpp's GptCosts of `Model`); std::nullopt, after printing
// why, when the model cannot fit the cap given or this machine (the exit status is 2 then).
template <class Model, class Costs>
std::optional<DenseCap> dense_cap(const TrainingOptions& o, const GptConfig& config, const Costs& costs,
                                  bool on_device) {
  // The cap: METP must fit the longest input, MegatronTS must not (unless --cap-mib says otherwise).
  const plan::DefaultCap default_cap = plan::default_memory_cap(costs, o.max_len);
  DenseCap c{o.cap_mib > 0 ? std::int64_t(o.cap_mib * kMiB) : default_cap.cap, default_cap.metp_peak,
             default_cap.ts_peak};
  const std::int64_t metp_peak = c.metp_peak, ts_peak = c.ts_peak;
  // The model's size before anything is allocated: its states (weights, gradients, AdamW moments) per rank, and
  // what a save adds (one layer gathered). Refused with the numbers when it cannot fit the cap or this machine.
  const plan::CostTable longest = costs.table(o.max_len);
  const std::int64_t state_bytes = longest.model_state_bytes + Model::replicated_state_bytes(config);
  // Saving (--save, training checkpoints) and resuming gather or read one global layer at a time.
  const bool saves = !o.save.empty() || o.checkpoint_every > 0 || !o.resume.empty();
  const std::int64_t save_bytes = c.save_bytes = saves ? save_checkpoint_bytes(config, o.ranks) : 0;
  const std::int64_t least_peak = std::max(std::min(metp_peak, ts_peak), state_bytes + save_bytes);
  if (const double machine = on_device ? device_memory_bytes() : physical_memory_bytes();
        machine > 0 && double(least_peak) * o.ranks > 0.9 * machine) {
    fmt::print(stderr,
               "train_gpt: the model does not fit this machine: {} layers of h={} ({:.3g} M parameters) need at "
               "least {:.1f} MiB per rank (states {:.1f} MiB{}; the least-memory plan at --max-len {} peaks at "
               "{:.1f} MiB), {:.2f} GiB for {} ranks; this machine has {:.2f} GiB\n",
               o.layers, o.hidden, double(config.parameter_count()) / 1e6, double(least_peak) / kMiB,
               double(state_bytes) / kMiB,
               save_bytes ? fmt::format(", + {:.1f} MiB to save", double(save_bytes) / kMiB) : std::string(),
               o.max_len, double(std::min(metp_peak, ts_peak)) / kMiB, double(least_peak) * o.ranks / (kMiB * 1024),
               o.ranks, machine / (kMiB * 1024));
    return std::nullopt;
  }
  if (state_bytes + save_bytes > c.cap) {
    if (o.cap_mib > 0) {
      fmt::print(stderr,
                 "train_gpt: the model needs {:.1f} MiB per rank for its weights, gradients and AdamW moments{}, "
                 "above the cap of {:.1f} MiB (--cap-mib): raise the cap to at least {:.1f} MiB{}\n",
                 double(state_bytes) / kMiB,
                 save_bytes ? fmt::format(" and {:.1f} MiB more to save the checkpoint", double(save_bytes) / kMiB)
                            : std::string(),
                 double(c.cap) / kMiB, double(state_bytes + save_bytes) / kMiB,
                 save_bytes ? " or drop --save" : "");
      return std::nullopt;
    }
    c.cap = (state_bytes + save_bytes + std::int64_t(kMiB) - 1) / std::int64_t(kMiB) * std::int64_t(kMiB);
    c.raised_for_save = true;
  }
  return c;
}

// After the models are allocated (the estimate above rounds no tensor): the save must still fit beside the states as
// allocated. Raises the default cap (and every tracker's) when it must; false, after printing why, when --cap-mib
// leaves no room (the exit status is 2 then).
template <class RanksT>
bool fit_save(const TrainingOptions& o, RanksT& ranks, DenseCap& c) {
  if (c.save_bytes == 0) return true;
  std::size_t held = 0;
  std::vector<double> in_use(std::size_t(o.ranks), 0.0);
  for (int r = 0; r < o.ranks; ++r)
    if (ranks.is_local(r)) in_use[std::size_t(r)] = double(ranks.tracker(r).in_use());
  ranks.share(in_use);
  held = std::size_t(*std::max_element(in_use.begin(), in_use.end()));
  const std::int64_t need = std::int64_t(held) + c.save_bytes;
  if (need <= c.cap) return true;
  if (o.cap_mib > 0) {
    fmt::print(stderr, "train_gpt: the model holds {:.1f} MiB per rank and saving it needs {:.1f} MiB more, above "
                       "the cap of {:.1f} MiB (--cap-mib): raise the cap or drop --save\n",
               double(held) / kMiB, double(c.save_bytes) / kMiB, double(c.cap) / kMiB);
    return false;
  }
  c.cap = (need + std::int64_t(kMiB) - 1) / std::int64_t(kMiB) * std::int64_t(kMiB);
  for (int r = 0; r < o.ranks; ++r) ranks.tracker(r).set_cap(std::size_t(c.cap));
  fmt::print("memory cap raised to {:.0f} MiB per rank to fit the model and its save\n", double(c.cap) / kMiB);
  return true;
}

}  // namespace paradyse::examples
