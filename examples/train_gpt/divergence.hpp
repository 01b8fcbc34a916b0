// examples/train_gpt/divergence.hpp: when train_gpt stops because training diverged, and how a run that finished
// says that a side output failed.
//
// Diverged: a training loss that is not finite, or one that exploded: above kExplodingFactor x ln(vocab), i.e. four
// times the loss of a uniform guess over the vocabulary (ln 256 = 5.55 nats for the byte model, so above 22.2).
// A freshly initialised model starts near ln(vocab) and training only lowers it, so a loss that far above is a run
// gone wrong (the learning rate, most likely), never a hard batch. Every loop (dense, --experts, --mesh) stops there
// with the step and the likely cause, without saving, and exits 1.
//
// Weights that are not finite when loaded (--load, --resume) are refused before the first step, naming the tensor
// (first_nonfinite_tensor, model/checkpoint.hpp), so that a NaN in a file is never blamed on the learning rate.
//
// Side outputs: --csv and the training checkpoints. One that fails is reported on stderr (the file and the system's
// reason) and the run goes on to its end and its --save; the exit status is then kSideOutputFailed (3), distinct from
// 1 (the run failed) and 2 (the command line was refused), so that scripts notice the lost table or checkpoint while
// the final weights are there.
#pragma once

#include <fmt/format.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>

namespace paradyse::examples {

inline constexpr double kExplodingFactor = 4.0;
inline constexpr int kSideOutputFailed = 3;

// The message when the loss `loss` of step `step` (at learning rate `lr`, the flag's peak `peak_lr`) says training
// diverged, for a model over `vocab` tokens; nothing otherwise.
inline std::optional<std::string> divergence(double loss, int step, std::int64_t vocab, double lr, double peak_lr) {
  const double limit = kExplodingFactor * std::log(double(vocab));
  if (std::isfinite(loss) && loss <= limit) return std::nullopt;
  if (!std::isfinite(loss))  // said as such ("step 3: the training loss is nan"), with what a NaN can come from
    return fmt::format("step {}: the training loss is {} (not a finite number: a NaN or an infinity reached the loss): "
                       "training diverged, most likely from the learning rate ({:g} at this step, --lr {:g}: try a "
                       "smaller one), or from a non-finite value in the input or the weights; stopping without saving "
                       "a checkpoint",
                       step, loss, lr, peak_lr);
  return fmt::format("step {}: the training loss is {:.6g} (above {:g} x ln({}) = {:.2f}; a uniform guess over the {} "
                     "tokens scores ln {} = {:.2f}): training diverged, most likely from the learning rate ({:g} at "
                     "this step, --lr {:g}: try a smaller one); stopping without saving a checkpoint",
                     step, loss, kExplodingFactor, vocab, limit, vocab, vocab, std::log(double(vocab)), lr, peak_lr);
}

// The exit status of a run whose training and --save succeeded: 0, or kSideOutputFailed (said on stderr) when a side
// output failed on the way.
inline int finished(bool side_output_failed) {
  if (!side_output_failed) return 0;
  std::fprintf(stderr, "train_gpt: the training and its --save finished, but a side output (--csv or a training "
                       "checkpoint) failed, as reported above: exit status %d\n", kSideOutputFailed);
  return kSideOutputFailed;
}

}  // namespace paradyse::examples
