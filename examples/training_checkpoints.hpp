// examples/training_checkpoints.hpp: the files of train_gpt's training checkpoints (--checkpoint-every, --keep,
// --stop-after, --resume), shared by the dense loop (train_gpt.cpp) and the MoE one (train_moe.hpp).
//
// A training checkpoint is DIR/step_<next step, 6 digits>.safetensors (model/checkpoint.hpp, with the AdamW moments)
// whose metadata holds train.args (the options the run was started with, one per line), train.next_step (where the
// data continues) and train.data (a description of the data schedule, which the seed and options fix).
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/model/checkpoint.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

namespace paradyse::examples {

// The file of the training checkpoint that continues at `next_step`.
inline std::filesystem::path training_checkpoint_path(const std::filesystem::path& dir, int next_step) {
  return dir / fmt::format("step_{:06}.safetensors", next_step);
}

// The next step a training checkpoint continues with.
inline int checkpoint_next_step(const std::string& path) {
  for (const auto& [key, value] : read_checkpoint_metadata(path))
    if (key == "train.next_step") return std::stoi(value);
  throw Error(fmt::format("checkpoint {}: no train.next_step (not a training checkpoint of train_gpt)", path));
}

// Removes all but the newest `keep` training checkpoints (step_<n>.safetensors) of `dir`.
inline void prune_checkpoints(const std::filesystem::path& dir, int keep) {
  std::vector<std::pair<long, std::filesystem::path>> found;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("step_", 0) == 0 && entry.path().extension() == ".safetensors")
      found.emplace_back(std::atol(name.c_str() + 5), entry.path());
  }
  std::sort(found.begin(), found.end());
  for (std::size_t i = 0; i + std::size_t(keep) < found.size(); ++i) std::filesystem::remove(found[i].second);
}

}  // namespace paradyse::examples
