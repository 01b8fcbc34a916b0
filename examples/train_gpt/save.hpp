// examples/train_gpt/save.hpp: --save at the end of the dense run: the global weights as safetensors
// (model/checkpoint.hpp), never weights that are not finite (a last optimizer step that diverged), within the cap.
#pragma once

#include "training_options.hpp"

#include "paradyse/comm/communicator.hpp"
#include "paradyse/core/tensor.hpp"
#include "paradyse/model/checkpoint.hpp"
#include "paradyse/model/layer.hpp"
#if PARADYSE_WITH_MPI
#include "paradyse/comm/mpi.hpp"
#endif

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <exception>
#include <span>
#include <string>

namespace paradyse::examples {

// Whether every weight this rank holds (its shards and the replicated pack) is finite.
template <class ModelT>
bool finite_weights(ModelT& model) {
  const auto finite = [](const Tensor<float>& t) {
    return std::all_of(t.span().begin(), t.span().end(), [](float x) { return std::isfinite(x); });
  };
  for (const LayerWeights& w : model.stack().weights())
    if (!finite(w.attention.packed) || !finite(w.mlp.packed) || !finite(w.norms.packed)) return false;
  return finite(model.replicated());
}


// Saves every rank's model of `ranks` to o.save after `steps_run` steps; returns the exit status (1: not saved).
template <class RanksT>
int save_weights(const TrainingOptions& o, RanksT& ranks, std::size_t steps_run, bool mpi) {
  static_cast<void>(mpi);  // used with MPI only
  // No checkpoint of weights that are not finite (a last optimizer step that diverged).
  std::atomic<int> bad_rank{-1};
  ranks.run([&](auto& comm, int r) {
    // Every process learns the highest rank whose weights are not finite (-1: none).
    const int mine = finite_weights(*ranks.models[std::size_t(r)]) ? -1 : r;
    int worst = -1;
    comm.all_reduce(std::span<const int>(&mine, 1), std::span<int>(&worst, 1), ReduceOp::max);
    if (r == ranks.first_local()) bad_rank = worst;
  });
  if (bad_rank >= 0) {
    fmt::print(stderr, "train_gpt: rank {} holds weights that are not finite (nan or inf) after training: the "
                       "checkpoint is not saved\n", int(bad_rank));
    return 1;
  }
  // Within the cap: the pools give back their buffers first (the cap was budgeted for the model + the save).
  try {
    ranks.run([&](auto& comm, int r) {
      ranks.pools[std::size_t(r)]->trim();
      save_checkpoint(comm, *ranks.models[std::size_t(r)], o.save);
    });
  } catch (const std::exception& e) {
    const std::string message = fmt::format("saving the checkpoint to {} failed after {} steps of training (any "
                                            "earlier file there is unchanged): {}", o.save, steps_run, e.what());
#if PARADYSE_WITH_MPI
    if (mpi) abort_mpi_job(message);  // the other processes wait in the save's collectives
#endif
    fmt::print(stderr, "train_gpt: {}\n", message);
    return 1;
  }
  fmt::print("  checkpoint                 {} (safetensors, global tensors)\n", o.save);
  return 0;
}

}  // namespace paradyse::examples
