// paradyse/model/resume.hpp: training checkpoints (train_gpt's --checkpoint-every, --keep, --stop-after, --resume):
// their files, and when a run resumes, saves and stops (TrainingCheckpoints), for any training loop over a
// comm/ranks.hpp group of models that model/checkpoint.hpp saves.
//
// A training checkpoint is DIR/step_<next step, 6 digits>.safetensors (model/checkpoint.hpp, with the AdamW moments)
// whose metadata holds train.args (the options the run was started with, one per line), train.next_step (where the
// data continues) and train.data (a description of the data schedule, which the seed and options fix). All of it is
// under the checkpoint's metadata checksum and parsed strictly (training_checkpoint_info). A resumed run is refused
// when the checkpoint is at or past its end, or when its data schedule is another one (train.data compared).
// A checkpoint that fails to be written is reported and the training goes on (failed() says so); pruning (--keep)
// removes only checkpoints this invocation wrote.
#pragma once

#include "paradyse/core/error.hpp"
#include "paradyse/model/checkpoint.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <limits>
#include <string>
#include <string_view>
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

// The largest step a training checkpoint can continue at (train_gpt's --steps limit).
inline constexpr std::int64_t kMaxTrainingSteps = 10'000'000;

// What a training checkpoint holds beyond the model: its metadata train.args, train.next_step and train.data.
struct TrainingCheckpointInfo {
  std::vector<std::string> args;  // the options its run was started with, one per line of train.args
  int next_step = 0;              // where the data continues, in [1, kMaxTrainingSteps]
  std::string data;               // the data schedule in words
};

// The training metadata of the checkpoint at `path` from its metadata entries, parsed strictly: every field present
// once, train.next_step a decimal integer in [1, kMaxTrainingSteps], train.data not empty. Throws an Error naming the
// file, the field, its value and what was expected. (A pure function of the entries: fuzz tests may call it.)
inline TrainingCheckpointInfo training_checkpoint_info(const std::vector<std::pair<std::string, std::string>>& metadata,
                                                       const std::string& path) {
  const auto field = [&](std::string_view key) -> const std::string& {
    const std::string* found = nullptr;
    for (const auto& [k, v] : metadata) {
      if (k != key) continue;
      check(found == nullptr, "checkpoint {}: the metadata holds '{}' twice", path, key);
      found = &v;
    }
    check(found != nullptr, "checkpoint {}: the metadata has no '{}' (not a training checkpoint of train_gpt: --save "
          "writes the weights only; start from those with --load)", path, key);
    return *found;
  };
  TrainingCheckpointInfo info;
  info.next_step = int(checkpoint_detail::to_integer(field("train.next_step"), "train.next_step", path, 1,
                                                     kMaxTrainingSteps));
  const std::string& args = field("train.args");
  for (std::size_t from = 0; from < args.size();) {
    const std::size_t end = std::min(args.find('\n', from), args.size());
    info.args.push_back(args.substr(from, end - from));
    from = end + 1;
  }
  for (const std::string& a : info.args)
    check(a.find('\0') == std::string::npos, "checkpoint {}: metadata 'train.args' holds a NUL byte", path);
  info.data = field("train.data");
  check(!info.data.empty(), "checkpoint {}: metadata 'train.data' is empty; expected the data schedule in words", path);
  return info;
}

// The training metadata of the checkpoint at `path` (reads the header only; the metadata verified by its checksum).
inline TrainingCheckpointInfo read_training_checkpoint(const std::string& path) {
  return training_checkpoint_info(read_checkpoint_metadata(path), path);
}

// Throws unless `dir` can hold training checkpoints: it is not empty, is (or can be made) a folder, and a file can be
// created in it. Called before any training.
inline void check_checkpoint_dir(const std::string& dir) {
  check(!dir.empty(), "--checkpoint-dir is empty; expected a folder (it is made if missing)");
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  check(!error, "--checkpoint-dir {}: cannot make the folder: {}", dir, error.message());
  try {
    check_writable_target(training_checkpoint_path(dir, 0).string());
  } catch (const Error& e) {
    throw Error(fmt::format("--checkpoint-dir {}: {}", dir, error_reason(e)));
  }
}

// A run's training checkpoints: where it starts (0, or where the checkpoint it resumes from continues), where this
// invocation ends (--stop-after), and the checkpoints it writes on the way: everything a restart needs (the global
// weights and AdamW moments, gathered; the options as given; the next step), atomically, the newest --keep kept.
class TrainingCheckpoints {
public:
  // For the run of `o` over `n_steps` steps whose data `data_description` describes (saved as train.data): with
  // --resume the checkpoint is checked (its step, its data schedule, finite values) and first_step() is where it
  // continues; the folder of the checkpoints to write is made and checked now (by the reporting process `reports`),
  // not after the training. Loading the model is the caller's (a training mesh loads inside its collective call:
  // model/mesh_checkpoint.hpp).
  TrainingCheckpoints(const ResumeOptions& o, int n_steps, std::string data_description, bool reports)
      : o_(o), n_steps_(n_steps), data_(std::move(data_description)), args_(saved_args(o.args)), dir_(o.checkpoint_dir) {
    if (!o.resume.empty()) {
      const TrainingCheckpointInfo info = read_training_checkpoint(o.resume);
      check(info.next_step < n_steps,
            "--resume {}: the checkpoint continues at step {}, but this run has {} steps: nothing is left to train "
            "(the run it was saved in had finished, or --steps is smaller than the checkpoint's step)",
            o.resume, info.next_step, n_steps);
      check(info.data == data_,
            "--resume {}: the checkpoint's data schedule is \"{}\", this run's is \"{}\": resuming would train on "
            "another schedule (give the options the checkpoint's run had: --seed, --steps, --min-len, --max-len, "
            "--order, --corpus and the packing)", o.resume, info.data, data_);
      if (const auto bad = first_nonfinite_tensor(o.resume))
        throw Error(fmt::format("--resume {}: tensor {}: weights or moments that are not finite cannot train", o.resume,
                                *bad));
      first_step_ = info.next_step;
    }
    end_step_ = o.stop_after > 0 ? std::min(n_steps, first_step_ + o.stop_after) : n_steps;
    if ((o.checkpoint_every > 0 || o.stop_after > 0) && reports) check_checkpoint_dir(o.checkpoint_dir);
  }
  // The same for a group of single-group models (comm/ranks.hpp): with --resume every rank of `ranks` loads its
  // weights and AdamW moments from the checkpoint.
  template <class RanksT>
  TrainingCheckpoints(const ResumeOptions& o, int n_steps, std::string data_description, RanksT& ranks)
      : TrainingCheckpoints(o, n_steps, std::move(data_description), ranks.reports()) {
    if (!o.resume.empty())
      ranks.run([&](auto&, int r) { load_checkpoint(*ranks.models[std::size_t(r)], o.resume, {.optimizer_state = true}); });
  }

  // This invocation runs the steps [first_step, end_step).
  int first_step() const noexcept { return first_step_; }
  int end_step() const noexcept { return end_step_; }
  // Whether a training checkpoint of this invocation failed to be written (reported; the training went on).
  bool failed() const noexcept { return failed_; }

  // Whether a checkpoint is due before step `step`: every --checkpoint-every steps (none before this invocation's
  // first step).
  bool due_before(int step) const noexcept {
    return o_.checkpoint_every > 0 && step > first_step_ && step % o_.checkpoint_every == 0;
  }
  // Whether a checkpoint is due after the last step: when the end falls on --checkpoint-every, or where --stop-after
  // stopped early. It continues at end_step().
  bool due_at_end() const noexcept {
    return end_step_ > first_step_ && ((o_.checkpoint_every > 0 && end_step_ % o_.checkpoint_every == 0) ||
                                       (o_.stop_after > 0 && end_step_ < n_steps_));
  }
  // The file and the save options (weights, moments, the run's metadata) of the checkpoint that continues at
  // `next_step`.
  std::string path_of(int next_step) const { return training_checkpoint_path(dir_, next_step).string(); }
  CheckpointSaveOptions save_options(int next_step) const {
    return {.optimizer_state = true,
            .extra = {{"train.args", args_}, {"train.next_step", std::to_string(next_step)}, {"train.data", data_}}};
  }

  // Before step `step`: a checkpoint every --checkpoint-every steps (none before this invocation's first step).
  template <class RanksT>
  void before_step(RanksT& ranks, int step) {
    if (due_before(step)) save(ranks, step);
  }
  // After the last step: a checkpoint when the end falls on --checkpoint-every, or where --stop-after stopped early.
  template <class RanksT>
  void at_end(RanksT& ranks) {
    if (due_at_end()) save(ranks, end_step_);
  }
  // The checkpoint that continues at `next_step`: collective over `ranks` (each pool trimmed first, within the cap).
  // A checkpoint that cannot be written (a full disk, a folder gone) is a side output: reported on stderr with the
  // system's reason, failed() set, and the training goes on (record).
  template <class RanksT>
  void save(RanksT& ranks, int next_step) {
    const std::string path = path_of(next_step);
    const CheckpointSaveOptions options = save_options(next_step);
    try {
      ranks.run([&](auto& comm, int r) {
        ranks.pools[std::size_t(r)]->trim();
        save_checkpoint(comm, *ranks.models[std::size_t(r)], path, options);
      });
    } catch (const OutOfMemory&) {
      throw;
    } catch (const CommError&) {  // a rank lost: not a side output
      throw;
    } catch (const Error& e) {
      record(next_step, ranks.reports(), e.what());
      return;
    }
    record(next_step, ranks.reports());
  }
  // After the collective save of the checkpoint that continues at `next_step` (once per process): `failure` empty,
  // it was written: the oldest checkpoints this invocation wrote beyond --keep are removed (by the reporting process
  // `reports`): only its own (a user's step_best.safetensors, or a longer earlier run's step_000100, stay), so the one
  // just announced is never the one removed. Else it is reported on stderr and failed() set.
  void record(int next_step, bool reports, const std::string& failure = {}) {
    const std::string path = path_of(next_step);
    if (!failure.empty()) {
      failed_ = true;
      if (reports)
        std::fprintf(stderr, "train_gpt: warning: the training checkpoint %s (step %d) was not written: %s; the "
                     "training goes on\n", path.c_str(), next_step, failure.c_str());
      return;
    }
    std::erase(written_, path);  // written again: listed once
    written_.push_back(path);
    if (reports) {
      while (written_.size() > std::size_t(o_.keep)) {
        std::error_code error;
        std::filesystem::remove(written_.front(), error);
        if (error)
          std::fprintf(stderr, "train_gpt: warning: the old training checkpoint %s could not be removed: %s\n",
                       written_.front().c_str(), error.message().c_str());
        written_.erase(written_.begin());
      }
    }
    fmt::print("      checkpoint {} (continues at step {})\n", path, next_step);
  }

private:
  ResumeOptions o_;
  int n_steps_;
  std::string data_, args_;
  std::filesystem::path dir_;
  int first_step_ = 0, end_step_ = 0;
  std::vector<std::string> written_;  // the checkpoints this invocation wrote, oldest first (what it may prune)
  bool failed_ = false;
};

}  // namespace paradyse
