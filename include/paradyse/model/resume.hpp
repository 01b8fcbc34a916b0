// paradyse/model/resume.hpp: training checkpoints (train_gpt's --checkpoint-every, --keep, --stop-after, --resume):
// their files, and when a run resumes, saves and stops (TrainingCheckpoints), for any training loop over a
// comm/ranks.hpp group of models that model/checkpoint.hpp saves.
//
// A training checkpoint is DIR/step_<next step, 6 digits>.safetensors (model/checkpoint.hpp, with the AdamW moments)
// whose metadata holds train.args (the options the run was started with, one per line), train.next_step (where the
// data continues) and train.data (a description of the data schedule, which the seed and options fix).
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/model/checkpoint.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace paradyse {

// When a run writes training checkpoints and where it resumes from.
struct ResumeOptions {
  int checkpoint_every = 0;                   // every this many steps a training checkpoint; 0: none
  int keep = 2;                               // training checkpoints kept (the newest)
  std::string checkpoint_dir = "checkpoints";
  std::string resume;                         // a training checkpoint to continue from
  int stop_after = 0;                         // > 0: stop after this many steps of this invocation, with a checkpoint
  std::vector<std::string> args;              // the run's options as given, saved as train.args (one per line)
};

// The file of the training checkpoint that continues at `next_step`.
inline std::filesystem::path training_checkpoint_path(const std::filesystem::path& dir, int next_step) {
  return dir / fmt::format("step_{:06}.safetensors", next_step);
}

// The options a run was started with (ResumeOptions::args) as a checkpoint's train.args: one per line.
inline std::string saved_args(const std::vector<std::string>& args) {
  std::string joined;
  for (const std::string& a : args) {
    check(a.find('\n') == std::string::npos, "an option holds a line break: \"{}\"", a);
    joined += (joined.empty() ? "" : "\n") + a;
  }
  return joined;
}

// The next step a training checkpoint continues with.
inline int checkpoint_next_step(const std::string& path) {
  for (const auto& [key, value] : read_checkpoint_metadata(path))
    if (key == "train.next_step")  // strictly: "-6" crashed a resumed run, "x6" leaked std::stoi's exception
      return int(checkpoint_detail::to_integer(value, key, path, 0, std::numeric_limits<int>::max()));
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

// A run's training checkpoints: where it starts (0, or where the checkpoint it resumes from continues), where this
// invocation ends (--stop-after), and the checkpoints it writes on the way: everything a restart needs (the global
// weights and AdamW moments, gathered; the options as given; the next step), atomically, the newest --keep kept.
class TrainingCheckpoints {
public:
  // For the run of `o` over `n_steps` steps whose data `data_description` describes (saved as train.data). With
  // --resume every rank of `ranks` loads its weights and AdamW moments from the checkpoint; the folder of the
  // checkpoints to write is made and checked now, not after the training.
  template <class RanksT>
  TrainingCheckpoints(const ResumeOptions& o, int n_steps, std::string data_description, RanksT& ranks)
      : o_(o), n_steps_(n_steps), data_(std::move(data_description)), args_(saved_args(o.args)), dir_(o.checkpoint_dir) {
    if (!o.resume.empty()) {
      ranks.run([&](auto&, int r) { load_checkpoint(*ranks.models[std::size_t(r)], o.resume, {.optimizer_state = true}); });
      first_step_ = checkpoint_next_step(o.resume);
    }
    end_step_ = o.stop_after > 0 ? std::min(n_steps, first_step_ + o.stop_after) : n_steps;
    if ((o.checkpoint_every > 0 || o.stop_after > 0) && ranks.reports()) {
      std::filesystem::create_directories(dir_);
      check_writable_target(training_checkpoint_path(dir_, 0).string());
    }
  }

  // This invocation runs the steps [first_step, end_step).
  int first_step() const noexcept { return first_step_; }
  int end_step() const noexcept { return end_step_; }

  // Before step `step`: a checkpoint every --checkpoint-every steps (none before this invocation's first step).
  template <class RanksT>
  void before_step(RanksT& ranks, int step) const {
    if (o_.checkpoint_every > 0 && step > first_step_ && step % o_.checkpoint_every == 0) save(ranks, step);
  }
  // After the last step: a checkpoint when the end falls on --checkpoint-every, or where --stop-after stopped early.
  template <class RanksT>
  void at_end(RanksT& ranks) const {
    if (end_step_ > first_step_ && ((o_.checkpoint_every > 0 && end_step_ % o_.checkpoint_every == 0) ||
                                    (o_.stop_after > 0 && end_step_ < n_steps_)))
      save(ranks, end_step_);
  }
  // The checkpoint that continues at `next_step`: collective over `ranks` (each pool trimmed first, within the cap).
  template <class RanksT>
  void save(RanksT& ranks, int next_step) const {
    const std::string path = training_checkpoint_path(dir_, next_step).string();
    const CheckpointSaveOptions options{
        .optimizer_state = true,
        .extra = {{"train.args", args_}, {"train.next_step", std::to_string(next_step)}, {"train.data", data_}}};
    ranks.run([&](auto& comm, int r) {
      ranks.pools[std::size_t(r)]->trim();
      save_checkpoint(comm, *ranks.models[std::size_t(r)], path, options);
    });
    if (ranks.reports()) prune_checkpoints(dir_, o_.keep);
    fmt::print("      checkpoint {} (continues at step {})\n", path, next_step);
  }

private:
  ResumeOptions o_;
  int n_steps_;
  std::string data_, args_;
  std::filesystem::path dir_;
  int first_step_ = 0, end_step_ = 0;
};

}  // namespace paradyse
