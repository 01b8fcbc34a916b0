// examples/train_gpt/mesh_checkpoints.hpp: checkpoints of train_gpt --mesh (examples/train_gpt/train_mesh.hpp) in the
// dense run's file format (model/mesh_checkpoint.hpp): --load (weights of any checkpoint: a mesh's of any shape, or
// the dense run's), --resume (weights, AdamW moments, step and data position: bit-exact on the same mesh, on another
// mesh shape or in a plain --ranks run the same steps within float rounding), --checkpoint-every / --keep /
// --stop-after (model/resume.hpp's TrainingCheckpoints decides when and prunes) and --save (the weights at the end).
//
// The mesh trains in one collective call over the world, so everything here but the constructor runs inside it, on
// every rank: the saves are collective (world rank 0 writes), the loads per rank. The bookkeeping of the training
// checkpoints (announcing, pruning, failed()) is done once per process, by its first rank.
#pragma once

#include "training_data.hpp"
#include "training_options.hpp"

#include "paradyse/core/error.hpp"
#include "paradyse/mesh/device_mesh.hpp"
#include "paradyse/model/checkpoint.hpp"
#include "paradyse/model/expert_groups.hpp"
#include "paradyse/model/mesh_checkpoint.hpp"
#include "paradyse/model/mesh_optimizer.hpp"
#include "paradyse/model/mesh_stage.hpp"
#include "paradyse/model/resume.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace paradyse::examples {

// train.data of a mesh run (training_data.hpp's data_description): with --pack-documents over dp > 1 a mesh step
// holds one packed sequence per replica, which the text says (the steps then depend on dp).
inline std::string mesh_data_description(const TrainingOptions& o, int n_steps, int dp) {
  return data_description(o, n_steps, o.pack_tokens) +
         (o.pack_documents > 0 && dp > 1 ? fmt::format(", {} per step (one per dp replica)", dp) : std::string());
}

class MeshCheckpoints {
public:
  // For the mesh run of `o` on `mesh` over `n_steps` mesh steps whose data `data` describes (train.data). Checked
  // before any training: --load's file holds finite weights; --resume's checkpoint continues inside this run, on
  // the same data schedule (with --pack-documents the steps hold one sequence per dp replica, so another dp is
  // another schedule: refused, naming the mesh it was saved on), with finite weights and moments.
  // With --experts `folding` is the mesh's ep and etp (model/expert_groups.hpp), and the saves take each rank's
  // expert groups.
  MeshCheckpoints(const TrainingOptions& o, const GptConfig& config, const DeviceMesh& mesh, int n_steps,
                  const std::string& data, bool reports, ExpertFolding folding = {})
      : o_(o), mesh_(mesh), folding_(folding) {
    // The file of --load or --resume validated for this model now (configuration, tensors, checksum), not by every
    // rank inside the training's collective call.
    struct Input {
      std::string_view flag;
      const std::string& path;
      bool moments;  // the AdamW moments too (--resume)
    };
    for (const Input& input : {Input{"--load", o.load, false}, Input{"--resume", o.resume, true}}) {
      if (input.path.empty()) continue;
      try {
        (void)open_checkpoint(input.path, config, {.allow_missing_checksum = false, .optimizer_state = input.moments});
      } catch (const Error& e) {
        throw Error(fmt::format("{} {}: {}", input.flag, input.path, e.what()));
      }
    }
    if (!o.load.empty())
      if (const auto bad = first_nonfinite_tensor(o.load))
        throw Error(fmt::format("--load {}: tensor {}: weights that are not finite cannot train", o.load, *bad));
    if (!o.resume.empty() && o.pack_documents > 0) {
      const TrainingCheckpointInfo info = read_training_checkpoint(o.resume);
      std::string saved_on = "a single group (--ranks)";
      for (const auto& [key, value] : read_checkpoint_metadata(o.resume))
        if (key == "saved_on_mesh") saved_on = "the mesh " + value;
      check(info.data == data, "--resume {}: the checkpoint's data schedule is \"{}\", this run's on --mesh {} is "
            "\"{}\": with --pack-documents every dp replica trains a packed sequence of its own in each step, so the "
            "steps depend on dp (the checkpoint was saved on {}); resume with its dp, or start from its weights with "
            "--load", o.resume, info.data, o.mesh, data, saved_on);
    }
    checkpoints_.emplace(resume_options(o), n_steps, data, reports);
  }

  int first_step() const noexcept { return checkpoints_->first_step(); }
  int end_step() const noexcept { return checkpoints_->end_step(); }
  bool failed() const noexcept { return checkpoints_->failed(); }

  // On every rank, before its first step: --load (the weights) or --resume (the weights and moments; the step the
  // checkpoint states must be where its data continues, as this mesh's AdamW counts steps). Per rank.
  template <class Chunks>
  void load(int rank, Chunks& chunks, std::span<MeshOptimizer> optimizers) {
    if (!o_.load.empty()) load_mesh_checkpoint(mesh_, rank, std::span(chunks), optimizers, o_.load, {}, folding_);
    if (o_.resume.empty()) return;
    const std::int64_t step = load_mesh_checkpoint(mesh_, rank, std::span(chunks), optimizers, o_.resume,
                                                   {.allow_missing_checksum = false, .optimizer_state = true},
                                                   folding_);
    check(step == first_step(), "--resume {}: the checkpoint's optimizer has taken {} steps but its data continues "
          "at step {}; the mesh counts one optimizer step per step (a run that skipped steps cannot resume on a mesh)",
          o_.resume, step, first_step());
  }

  // On every rank (collective over `world`): the training checkpoint due before step `step`, or after the last step
  // (step = end_step()). A checkpoint that cannot be written is reported and the training goes on.
  // `first_local`: this rank is its process's first (it does the bookkeeping); `reports`: its process reports.
  // `experts`: this rank's expert groups (with --experts).
  template <class C, class Chunks>
  void before_step(C& world, C& dp, C& cp, Chunks& chunks, std::span<MeshOptimizer> optimizers, int step,
                   bool first_local, bool reports, ExpertGroups<C>* experts = nullptr) {
    if (checkpoints_->due_before(step)) save(world, dp, cp, chunks, optimizers, step, first_local, reports, experts);
  }
  template <class C, class Chunks>
  void at_end(C& world, C& dp, C& cp, Chunks& chunks, std::span<MeshOptimizer> optimizers, bool first_local,
              bool reports, ExpertGroups<C>* experts = nullptr) {
    if (checkpoints_->due_at_end())
      save(world, dp, cp, chunks, optimizers, end_step(), first_local, reports, experts);
  }

  // On every rank (collective over `world`), after the training: --save (the weights), unless a weight is not
  // finite (a last optimizer step that diverged; every rank learns it). Returns the exit status (1: not saved; the
  // reason printed when `reports`: this rank is the reporting process's first), 0 without --save.
  template <class C, class Chunks>
  int save_final(C& world, C& dp, C& cp, Chunks& chunks, std::span<MeshOptimizer> optimizers, bool reports,
                 ExpertGroups<C>* experts = nullptr) {
    if (o_.save.empty()) return 0;
    int mine = 0, any = 0;
    const auto finite = [](std::span<const float> values) {
      return std::all_of(values.begin(), values.end(), [](float x) { return std::isfinite(x); });
    };
    for (auto& chunk : chunks) {
      if (chunk.sharded()) {
        for (Zero3Tensor& t : chunk.zero3_shards()) mine = mine || !finite(t.value().span());
        for (Zero3Tensor& t : chunk.expert_zero3_shards()) mine = mine || !finite(t.value().span());  // over edp
        for (const auto& p : chunk.parameters())  // the MoE tensors, whole under ZeRO-3 without edp (empty with)
          if (!p.over_dp) mine = mine || !finite(p.value->span());
      } else {
        for (const auto& p : chunk.parameters()) mine = mine || !finite(p.value->span());
      }
    }
    world.all_reduce(std::span<const int>(&mine, 1), std::span<int>(&any, 1), ReduceOp::max);
    if (any != 0) {
      if (reports)
        fmt::print(stderr, "train_gpt: the mesh holds weights that are not finite (nan or inf) after training: the "
                           "checkpoint {} is not saved\n", o_.save);
      return 1;
    }
    try {
      save_mesh_checkpoint(mesh_, world, dp, cp, std::span(chunks), optimizers, end_step(), o_.save, {}, experts);
    } catch (const CommError&) {
      throw;
    } catch (const Error& e) {  // every rank throws the writer's error (model/checkpoint_io.hpp)
      if (reports)
        fmt::print(stderr, "train_gpt: saving the checkpoint to {} failed (any earlier file there is unchanged): {}\n",
                   o_.save, e.what());
      return 1;
    }
    if (reports) fmt::print("  checkpoint                 {} (safetensors, global tensors)\n", o_.save);
    return 0;
  }

private:
  template <class C, class Chunks>
  void save(C& world, C& dp, C& cp, Chunks& chunks, std::span<MeshOptimizer> optimizers, int next_step,
            bool first_local, bool reports, ExpertGroups<C>* experts) {
    std::string failure;
    try {
      save_mesh_checkpoint(mesh_, world, dp, cp, std::span(chunks), optimizers, next_step, checkpoints_->path_of(next_step),
                           checkpoints_->save_options(next_step), experts);
    } catch (const CommError&) {  // a rank lost: not a side output
      throw;
    } catch (const Error& e) {  // every rank throws the writer's error
      failure = e.what();
    }
    if (first_local) checkpoints_->record(next_step, reports, failure);
  }
  TrainingOptions o_;
  DeviceMesh mesh_;
  ExpertFolding folding_;
  std::optional<TrainingCheckpoints> checkpoints_;
};

}  // namespace paradyse::examples
